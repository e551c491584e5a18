"""redline.long_lived: the start-up's objects out of the cyclic garbage collector's scans, for a block or for good."""

import gc
import weakref

import pytest

from redline.long_lived import freeze_long_lived, long_lived_frozen


class Node:
    def __init__(self):
        self.other = self


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_block_freezes_what_lives_and_unfreezes_after(unfrozen):
    kept = [Node() for _ in range(10)]

    def tracked() -> set[int]:  # what the collector's generations hold (frozen objects are in none)
        return {id(obj) for generation in range(3) for obj in gc.get_objects(generation)}

    assert {id(node) for node in kept} <= tracked()
    with long_lived_frozen():
        assert gc.get_freeze_count() >= len(kept)
        assert not {id(node) for node in kept} & tracked()
    assert gc.get_freeze_count() == 0
    assert {id(node) for node in kept} <= tracked()


def test_garbage_is_collected_before_the_freeze_not_frozen_with_it(unfrozen):
    garbage = Node()
    dead = weakref.ref(garbage)
    del garbage  # a cycle: only the collector frees it
    freeze_long_lived()
    assert dead() is None
    assert gc.get_freeze_count() > 0


def test_redline_gc_freeze_0_leaves_the_collector_alone(unfrozen, monkeypatch):
    monkeypatch.setenv("REDLINE_GC_FREEZE", "0")
    with long_lived_frozen():
        assert gc.get_freeze_count() == 0
    freeze_long_lived()
    assert gc.get_freeze_count() == 0


def test_a_switch_other_than_0_or_1_is_refused_naming_it(unfrozen, monkeypatch):
    monkeypatch.setenv("REDLINE_GC_FREEZE", "false")
    with pytest.raises(ValueError, match="REDLINE_GC_FREEZE must be 0 or 1, got 'false'"):
        freeze_long_lived()
    assert gc.get_freeze_count() == 0
