"""Colocated SGLang updates: the engine packs bucket k+1 while the server loads bucket k, with one update request
in flight at a time, in plan order; a failure while packing leaves no request behind."""

import asyncio
import threading
import time

import pytest
import torch

pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")

from redline.rollout.engine import SerializedBucket
from redline.rollout.sglang import engine as sglang_engine
from redline.rollout.sglang.engine import SGLangEngine

LOAD_S, PACK_S = 0.15, 0.1


class SlowServer:
    """Stands in for one server's client: each update takes LOAD_S, and the events are logged."""

    def __init__(self, events):
        self.events = events

    async def weight_loaders(self):  # without redline's checked loader: flattened buckets
        return []

    async def begin_weight_update(self):
        self.events.append(("begin",))

    async def end_weight_update(self):
        self.events.append(("end",))

    async def update_weights_from_tensor(self, per_rank, load_format, version):
        self.events.append(("load", per_rank[0]))
        await asyncio.sleep(LOAD_S)
        self.events.append(("loaded", per_rank[0]))

    async def close(self):
        pass


def engine_with(events, monkeypatch, fail_at=None):
    lock = threading.Lock()

    def slow_serialize(named_tensors, tp_size=1):
        name = named_tensors[0][0]
        if name == fail_at:
            raise RuntimeError(f"cannot pack {name}")
        with lock:
            events.append(("pack", name))
        time.sleep(PACK_S)
        return SerializedBucket(per_rank=(name,) * tp_size)

    monkeypatch.setattr(sglang_engine, "serialize_bucket", slow_serialize)
    engine = SGLangEngine(["http://127.0.0.1:1"])
    engine.workers = [SlowServer(events)]
    return engine


def buckets(n):
    return [[(f"b{i}", torch.zeros(2))] for i in range(n)]


def test_bucket_k_plus_1_is_packed_while_bucket_k_loads(monkeypatch):
    events = []
    engine = engine_with(events, monkeypatch)
    began = time.perf_counter()
    asyncio.run(engine.update_weights(buckets(4), "3"))
    elapsed = time.perf_counter() - began
    assert events[0] == ("begin",) and events[-1] == ("end",)
    loads = [e[1] for e in events if e[0] == "load"]
    assert loads == ["b0", "b1", "b2", "b3"]  # plan order
    for k in range(3):  # pack k+1 starts before load k ends; load k+1 only after load k ended
        assert events.index(("pack", f"b{k + 1}")) < events.index(("loaded", f"b{k}"))
        assert events.index(("loaded", f"b{k}")) < events.index(("load", f"b{k + 1}"))
    sequential = 4 * (LOAD_S + PACK_S)
    assert elapsed < sequential - 2 * PACK_S  # the overlap is real time saved
    assert engine.weight_version == "3"


def test_a_failure_while_packing_leaves_no_update_in_flight(monkeypatch):
    events = []
    engine = engine_with(events, monkeypatch, fail_at="b2")

    async def update_then_settle():
        with pytest.raises(RuntimeError, match="cannot pack b2"):
            await engine.update_weights(buckets(4), "3")
        await asyncio.sleep(2 * LOAD_S)  # a request left running would log its end meanwhile

    asyncio.run(update_then_settle())
    assert ("loaded", "b0") in events and ("load", "b2") not in events
    assert ("loaded", "b1") not in events  # cancelled, not left to run on its own
    assert engine.weight_version == "0"
