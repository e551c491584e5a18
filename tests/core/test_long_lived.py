"""redline.long_lived: the start-up's objects out of the cyclic garbage collector's scans, for a block or for good."""

import asyncio
import gc
import weakref

import pytest

from redline.long_lived import freeze_engine_servers, freeze_long_lived, long_lived_frozen


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


class Servers:
    """An engine of two server groups, as a disaggregated run holds them; the second has no /freeze_gc route."""

    def __init__(self):
        self.asked = []
        self.engines = [self.Group(self, []), self.Group(self, ["http://b:1"]), object()]  # and one without servers

    class Group:
        def __init__(self, servers, missing):
            self.servers, self.missing = servers, missing

        async def freeze_gc(self):
            self.servers.asked.append(self)
            return self.missing


def test_the_engines_servers_are_asked_to_freeze_and_those_that_cannot_are_named(monkeypatch):
    engine, loop = Servers(), asyncio.new_event_loop()
    try:
        assert freeze_engine_servers(engine, loop) == ["http://b:1"]
        assert engine.asked == engine.engines[:2]
        monkeypatch.setenv("REDLINE_GC_FREEZE", "0")
        assert freeze_engine_servers(engine, loop) == []
        assert len(engine.asked) == 2
    finally:
        loop.close()
