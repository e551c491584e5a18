"""``EngineFanOut``: every broadcast call of the engine protocol reaches each engine of a group, with its arguments."""

import asyncio

import pytest

from redline.loop.rollout_setup import EngineGroup


class RecordingEngine:
    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        async def record(*args):
            self.calls.append((method, args))
        return record


@pytest.mark.parametrize("method, args", [("release_memory", (("kv_cache",),)), ("resume_memory", (("weights",),)),
                                          ("flush_cache", ()), ("pause", ()), ("resume", ()), ("shutdown", ())])
def test_each_broadcast_call_reaches_every_engine(method, args):
    engines = [RecordingEngine() for _ in range(3)]
    asyncio.run(getattr(EngineGroup(engines), method)(*args))
    assert [engine.calls for engine in engines] == [[(method, args)]] * 3


def test_every_engine_reads_every_weight_bucket():
    """The buckets may be a one-shot iterator: each engine gets its own list of them."""
    engines = [RecordingEngine() for _ in range(2)]
    asyncio.run(EngineGroup(engines).update_weights(iter([[1, 2], [3]]), "v7"))
    assert [engine.calls for engine in engines] == [[("update_weights", ([[1, 2], [3]], "v7"))]] * 2
