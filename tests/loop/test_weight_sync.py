"""The RL step feeds the engine planned buckets and, with --offload-rollout, follows the colocated memory
sequence: release after the rollout, resume weights → update → resume KV cache around the sync."""

import time

import pytest
import torch
from rich.console import Console

from redline.configfile import apply_overrides
from redline.loop import rollout_setup
from redline.loop.builtin import materialize
from redline.loop.step import rl_step
from redline.loop.train import build
from redline.sync.plan import plan_for

from .test_train import small_config

BUCKET_BYTES = 128 * 1024  # the tiny model's layers are ~0.4 MB in fp32: several buckets, some holding one group


class RecordingEngine:
    """Delegates to a real engine and records the calls the loop makes, in order."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    async def generate(self, requests):
        if not self.calls or self.calls[-1] != ("generate",):
            self.calls.append(("generate",))
        return await self.inner.generate(requests)

    async def update_weights(self, buckets, version):
        buckets = [list(b) for b in buckets]
        self.calls.append(("update_weights", [[name for name, _ in b] for b in buckets],
                           [sorted({str(t.dtype) for _, t in b}) for b in buckets], version))
        await self.inner.update_weights(buckets, version)

    async def release_memory(self, tags):
        self.calls.append(("release_memory", frozenset(tags)))
        await self.inner.release_memory(tags)

    async def resume_memory(self, tags):
        self.calls.append(("resume_memory", frozenset(tags)))
        await self.inner.resume_memory(tags)

    def __getattr__(self, name):  # flush_cache, pause, resume, health, shutdown
        return getattr(self.inner, name)


def recorded_run(tmp_path, monkeypatch, *, steps: int, walls: list | None = None, **overrides):
    """Build the run with a recording engine and take ``steps`` RL steps; returns (state, engine, metrics).
    ``walls`` (optional) receives each ``rl_step`` call's wall time in seconds, measured around the call."""
    build_engine = rollout_setup.build_engine
    monkeypatch.setattr(rollout_setup, "build_engine", lambda *a, **k: RecordingEngine(build_engine(*a, **k)))
    config = small_config(tmp_path, sft_steps="0", update_weight_buffer_size=str(BUCKET_BYTES), **overrides)
    config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
    state, _ = build(config, Console(quiet=True))
    try:
        metrics = []
        for rollout_id in range(steps):
            began = time.perf_counter()
            metrics.append(rl_step(state, rollout_id))
            if walls is not None:
                walls.append(time.perf_counter() - began)
    finally:
        state.loop.run_until_complete(state.engine.shutdown())
    return state, state.engine, metrics


def test_the_engine_receives_the_plans_buckets(tmp_path, monkeypatch):
    state, engine, _ = recorded_run(tmp_path, monkeypatch, steps=1)
    [(_, names, dtypes, version)] = [c for c in engine.calls if c[0] == "update_weights"]
    expected = plan_for(state.worker.model.export_hf(), BUCKET_BYTES).buckets
    assert len(expected) > 2
    assert names == [b.names for b in expected]
    assert all(len(d) == 1 for d in dtypes)  # dtype-homogeneous
    assert sorted(n for bucket in names for n in bucket) == sorted(n for n, _ in state.worker.model.export_hf())
    assert version == "1"
    assert not any(c[0] in ("release_memory", "resume_memory") for c in engine.calls)  # offload is off


def test_offload_releases_after_rollout_and_resumes_around_the_sync(tmp_path, monkeypatch):
    _, engine, metrics = recorded_run(tmp_path, monkeypatch, steps=2, offload_rollout="true")
    one_step = [("generate",), ("release_memory", frozenset({"weights", "kv_cache"})),
                ("resume_memory", frozenset({"weights"})), "update_weights",
                ("resume_memory", frozenset({"kv_cache"}))]
    calls = [c[0] if c[0] == "update_weights" else c for c in engine.calls]
    assert calls == one_step * 2
    # the released weights came back whole: the second rollout's log-probs are the trainer's
    assert metrics[1]["train/rollout_logprob_abs_diff"] < 1e-4
    assert metrics[1]["perf/offload_rollout_time"] > 0


@pytest.mark.parametrize("level, released", [("kv_cache", {"kv_cache"}), ("weight", {"weights"})])
def test_offload_rollout_level_releases_and_resumes_only_what_it_names(tmp_path, monkeypatch, level, released):
    _, engine, metrics = recorded_run(tmp_path, monkeypatch, steps=2, offload_rollout="true",
                                      offload_rollout_level=level)
    one_step = [("generate",), ("release_memory", frozenset(released))]
    if "weights" in released:
        one_step.append(("resume_memory", frozenset({"weights"})))
    one_step.append("update_weights")
    if "kv_cache" in released:
        one_step.append(("resume_memory", frozenset({"kv_cache"})))
    calls = [c[0] if c[0] == "update_weights" else c for c in engine.calls]
    assert calls == one_step * 2
    # kept or released, the weights the second rollout sampled with are the trainer's
    assert metrics[1]["train/rollout_logprob_abs_diff"] < 1e-4
    assert ("perf/resume_weights_time" in metrics[1]) == ("weights" in released)
    assert ("perf/resume_kv_time" in metrics[1]) == ("kv_cache" in released)


def test_phase_times_and_idle_add_up_to_the_step(tmp_path, monkeypatch):
    walls = []
    _, _, [m] = recorded_run(tmp_path, monkeypatch, steps=1, walls=walls, offload_rollout="true")
    measured = ["perf/rollout_time", "perf/offload_rollout_time", "perf/logprob_time", "perf/train_time",
                "perf/update_weights_time"]
    assert all(m[k] > 0 for k in measured)  # every phase ran and was timed
    assert m["perf/idle_time"] >= 0  # the phases do not overlap or overcount
    # the step's own clock agrees with a clock around the call (it may miss only the call's entry and exit)
    assert walls[0] - 0.05 <= m["perf/step_time"] <= walls[0]
    assert sum(m[k] for k in measured) + m["perf/idle_time"] == pytest.approx(m["perf/step_time"], rel=1e-9)


@pytest.mark.slow  # spawns the engine process (a few seconds)
def test_embedded_engine_in_its_own_process_gets_the_weights(tmp_path):
    from redline.loop.train import run

    from .test_train import records

    config = small_config(tmp_path, embedded_engine_process="true", num_rollout="2", sft_steps="0",
                          eval_interval="100", update_weight_buffer_size=str(BUCKET_BYTES))
    assert run(config) == 0
    rows = records(tmp_path)
    # step 2 samples with the weights step 1 trained (lr 2e-3 moves them well past this tolerance)
    assert all(r["train/rollout_logprob_abs_diff"] < 1e-4 for r in rows)
    assert torch.isfinite(torch.tensor([r["train/pg_loss"] for r in rows])).all()
