"""The colocated transition's overlaps: the trainer's pause while the engine resumes its weights, its resume while
the engine releases, only where the GPU has room for both, timed so the phase's parts still add up."""

import asyncio
import threading
import time

import pytest
import torch

from redline.loop import rollout_setup, weight_sync
from redline.loop import side_by_side as side_by_side_module
from redline.loop.side_by_side import OVERLAP_ENV, has_room, side_by_side
from redline.loop.train_offload import TrainOffload
from redline.loop.validate import ConfigError, check_sync_switches

GIB = 2**30
CPU = torch.device("cpu")


def test_the_engines_call_and_the_trainers_work_run_at_once_and_are_timed_apart():
    """Engine 0.3 s, trainer 0.1 s under it: all of the trainer's seconds are hidden, none exposed."""
    ran_on = []

    async def engine_call():
        await asyncio.sleep(0.3)

    def trainer_work():
        ran_on.append(threading.current_thread() is not threading.main_thread())
        time.sleep(0.1)

    began = time.perf_counter()
    times = asyncio.run(side_by_side(engine_call(), trainer_work, CPU))
    wall = time.perf_counter() - began
    assert ran_on == [True]
    assert times.engine == pytest.approx(0.3, abs=0.05) and times.exposed == 0.0
    assert times.hidden == pytest.approx(0.1, abs=0.05)
    assert wall < 0.38  # together, not 0.4 one after the other
    assert times.engine + times.exposed == pytest.approx(wall, abs=0.05)


def test_trainer_work_longer_than_the_engines_call_is_exposed_for_the_rest():
    async def engine_call():
        await asyncio.sleep(0.1)

    times = asyncio.run(side_by_side(engine_call(), lambda: time.sleep(0.3), CPU))
    assert times.hidden == pytest.approx(0.1, abs=0.05)
    assert times.exposed == pytest.approx(0.2, abs=0.05)


def test_an_error_on_one_side_is_raised_once_both_have_ended():
    finished = []

    async def engine_call():
        raise RuntimeError("server said no")

    def trainer_work():
        time.sleep(0.1)
        finished.append(True)

    with pytest.raises(RuntimeError, match="server said no"):
        asyncio.run(side_by_side(engine_call(), trainer_work, CPU))
    assert finished == [True]  # not left running behind the raise


@pytest.mark.parametrize("need,free,expected", [(4 * GIB, 6 * GIB, True), (4 * GIB, 5 * GIB - 1, False),
                                                (0, 80 * GIB, False)])
def test_room_is_the_need_measured_before_plus_headroom(monkeypatch, need, free, expected):
    """0 bytes needed means never measured alone: the first transition runs one part after the other."""
    monkeypatch.setattr(side_by_side_module, "device_memory", lambda device: (free, 80 * GIB))
    assert has_room(torch.device("cuda"), need, GIB) is expected


def test_off_cuda_nothing_is_free_so_nothing_overlaps():
    assert not has_room(CPU, 1, 0)


def test_the_switch_is_checked_at_start_up_naming_it(monkeypatch):
    monkeypatch.setenv(OVERLAP_ENV, "yes")
    with pytest.raises(ConfigError, match=f"{OVERLAP_ENV} must be 0 or 1, got 'yes'"):
        check_sync_switches()


# ----- in the loop ------------------------------------------------------------------------------------------

class Driver:
    """The GPU's free memory as the driver would report it: what the engine (in another process) holds comes off
    ``total``; the trainer's pausable memory is left out (its host imitation)."""

    def __init__(self, total: int, weights: int, kv_cache: int):
        self.total, self.sizes = total, {"weights": weights, "kv_cache": kv_cache}
        self.held = set(self.sizes)

    def free(self, device) -> tuple[int, int]:
        return max(self.total - sum(self.sizes[t] for t in self.held), 0), self.total


class TimedEngine:
    """Delegates to the real engine; its memory calls take 50 ms, move the driver's bytes and are recorded as
    ``(name, start, end)``."""

    def __init__(self, inner, driver: Driver, spans: list):
        self.inner, self.driver, self.spans = inner, driver, spans

    async def release_memory(self, tags):
        await self._span("release", tags, lambda: self.driver.held.difference_update(tags))
        await self.inner.release_memory(tags)

    async def resume_memory(self, tags):
        await self._span(f"resume {'+'.join(sorted(tags))}", tags, lambda: self.driver.held.update(tags))
        await self.inner.resume_memory(tags)

    async def _span(self, name, tags, change):
        start = time.perf_counter()
        await asyncio.sleep(0.05)
        change()
        self.spans.append((name, start, time.perf_counter()))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def timed_run(tmp_path, monkeypatch, total: int, steps: int = 3):
    """The small bf16 run with --offload-rollout and --offload-train (``process_memory``) beside a ``TimedEngine``;
    the trainer's pause and resume recorded too. Returns (spans, metrics)."""
    from redline.loop import train_offload

    from .test_train_offload import loop_run

    train_offload._train_offload.cache_clear()  # a TrainOffload of its own, not an earlier run's (paused)
    spans = []
    driver = Driver(total, weights=2 * GIB, kv_cache=6 * GIB)
    for module in (weight_sync, side_by_side_module):
        monkeypatch.setattr(module, "device_memory", driver.free)
    for method in ("pause_state", "resume"):
        original = getattr(TrainOffload, method)

        def recorded(self, *args, _original=original, _name=f"train {method}", **kwargs):
            start = time.perf_counter()
            _original(self, *args, **kwargs)
            spans.append((_name, start, time.perf_counter()))

        monkeypatch.setattr(TrainOffload, method, recorded)
    build_engine = rollout_setup.build_engine
    monkeypatch.setattr(rollout_setup, "build_engine",
                        lambda *a, **k: TimedEngine(build_engine(*a, **k), driver, spans))
    _, _, metrics = loop_run(tmp_path, monkeypatch, True, steps=steps)
    return spans, metrics


def overlapped(spans, first: str, second: str) -> list[bool]:
    """Per occurrence of ``first``: whether a ``second`` span ran during it."""
    return [any(s < end and e > start for name, s, e in spans if name == second)
            for name_, start, end in spans if name_ == first]


def test_with_room_the_second_transition_on_overlaps_and_training_is_unchanged(tmp_path, monkeypatch,
                                                                                process_memory):
    spans, metrics = timed_run(tmp_path / "overlap", monkeypatch, total=80 * GIB)
    # the first release and weights resume ran alone (measured); from step 2 on each runs beside the trainer
    assert overlapped(spans, "resume weights", "train pause_state") == [False, True, True]
    assert overlapped(spans, "release", "train resume") == [False, True, True]
    assert all(m["perf/pause_train_hidden_time"] > 0.0 for m in metrics[1:])
    assert metrics[0]["perf/pause_train_hidden_time"] == 0.0
    assert all(m["perf/resume_train_hidden_time"] > 0.0 for m in metrics[1:])
    for m in metrics:  # the parts still add up to no more than the phases' walls
        update = sum(m.get(k, 0.0) for k in ("perf/pause_train_time", "perf/resume_weights_time",
                                              "perf/sync_time", "perf/check_weights_time", "perf/resume_kv_time"))
        assert update <= m["perf/update_weights_time"] + 1e-3
        offload = m.get("perf/release_time", 0.0) + m.get("perf/resume_train_time", 0.0)
        assert offload <= m["perf/offload_rollout_time"] + 1e-3
    monkeypatch.setenv(OVERLAP_ENV, "0")
    serial_spans, serial = timed_run(tmp_path / "serial", monkeypatch, total=80 * GIB)
    assert not any(overlapped(serial_spans, "resume weights", "train pause_state"))
    assert not any(overlapped(serial_spans, "release", "train resume"))
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert [m[key] for m in metrics] == [m[key] for m in serial], key


def test_without_room_for_the_engines_weights_beside_the_trainer_they_stay_apart(tmp_path, monkeypatch,
                                                                                 process_memory):
    """2.5 GiB free with the engine released: short of its weights' 2 GiB + 1 GiB headroom beside the unpaused
    trainer; nothing free while the engine holds its memory, so the trainer's resume waits for the release."""
    spans, metrics = timed_run(tmp_path, monkeypatch, total=5 * GIB // 2)
    assert not any(overlapped(spans, "resume weights", "train pause_state"))
    assert not any(overlapped(spans, "release", "train resume"))
    assert all(m["perf/pause_train_hidden_time"] == 0.0 for m in metrics)
