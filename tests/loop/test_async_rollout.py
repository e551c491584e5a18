"""--async-rollout: start-up checks, the staleness bound under interrupting weight updates, the overlap
metrics, and checkpoints that keep every generated-and-untrained sample (issue 19)."""

import asyncio
import itertools
import json
import random

import pytest
from redline.configfile import ConfigError, apply_overrides
from redline.loop.async_schedule import check_async, off_policy_correction
from redline.loop.step import rl_step
from redline.loop.train import shutdown
from redline.loop.validate import loss_config
from redline.rollout.manager import RolloutManager
from redline.rollout.rewards import Reward
from redline.rollout.sample_buffer import (
    SampleBuffer,
    oldest_version,
    restart,
    staleness,
)
from redline.rollout.stream import BusyClock, RolloutStream
from redline.rollout.types import (
    FinishReason,
    GenerateResult,
    Sample,
    SamplingParams,
    Status,
)
from rich.console import Console

from .test_disaggregated import DISAGGREGATED, built
from .test_train import small_config


def config_with(tmp_path, **overrides):
    return small_config(tmp_path, **{**DISAGGREGATED, **overrides})


# ----- start-up checks ------------------------------------------------------------------------------------

def test_async_rollout_is_refused_colocated_naming_both_flags(tmp_path):
    for mode in ("one-step", "full"):
        with pytest.raises(ConfigError, match=f"--async-rollout {mode} needs --no-colocate"):
            check_async(small_config(tmp_path, async_rollout=mode))
        with pytest.raises(ConfigError, match=f"--async-rollout {mode} with --rollout-engine sglang needs "
                                              f"--no-colocate .*--sglang-server-urls"):
            check_async(small_config(tmp_path, async_rollout=mode, rollout_engine="sglang"))
    check_async(small_config(tmp_path, async_rollout="full", rollout_engine="sglang", colocate="false",
                             sglang_server_urls="http://127.0.0.1:30000"))


def test_on_one_gpu_the_engine_may_be_a_second_process_that_keeps_its_memory(tmp_path):
    beside = small_config(tmp_path, async_rollout="one-step", embedded_engine_process="true")
    check_async(beside)
    with pytest.raises(ConfigError, match="--offload-rollout"):
        check_async(apply_overrides(beside, {"offload_rollout": "true"}))
    with pytest.raises(ConfigError, match="--offload-train"):
        check_async(apply_overrides(beside, {"offload_train": "true"}))


@pytest.mark.parametrize("overrides, message", [
    ({"async_rollout": "one-step", "max_staleness": "0"}, "--max-staleness 0 would drop every batch"),
    ({"async_rollout": "one-step", "update_weights_interval": "2", "max_staleness": "1"}, "raise it to >= 2"),
    ({"async_rollout": "full", "max_inflight": "19"}, "--max-inflight \\(19\\) must hold one rollout batch"),
    ({"async_rollout": "full", "update_weights_interval": "3", "max_staleness": "1"}, "raise --max-staleness"),
    ({"async_rollout": "one-step", "max_inflight": "40"}, "--max-inflight applies to --async-rollout full"),
    ({"async_rollout": "full", "max_staleness": "-1"}, "--max-staleness must be >= 0"),
    ({"update_weights_interval": "2"}, "--update-weights-interval applies to --async-rollout"),
    ({"max_staleness": "1"}, "--max-staleness applies to --async-rollout"),
    ({"async_rollout": "full", "update_weights_interval": "0"}, "--update-weights-interval must be >= 1"),
    ({"async_rollout": "full", "tis": "none", "use_tis": "true"}, "--tis none"),
    ({"async_rollout": "full", "over_sampling_batch_size": "10"}, "--over-sampling-batch-size has no meaning"),
])
def test_bad_async_settings_are_refused_naming_the_flags(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_async(config_with(tmp_path, **overrides))


def test_good_async_settings_pass(tmp_path):
    check_async(config_with(tmp_path, async_rollout="one-step", update_weights_interval="2", max_staleness="2"))
    check_async(config_with(tmp_path, async_rollout="full", max_staleness="0", max_inflight="40"))


def test_tis_is_on_by_default_in_async_modes_and_tis_none_turns_it_off(tmp_path):
    sync = config_with(tmp_path)
    assert off_policy_correction(sync) is None and loss_config(sync).tis is None
    assert off_policy_correction(apply_overrides(sync, {"use_tis": "true", "tis_mode": "icepop"})) == "icepop"
    for mode in ("one-step", "full"):
        config = apply_overrides(sync, {"async_rollout": mode})
        assert off_policy_correction(config) == "truncate" and loss_config(config).tis == "truncate"
        assert off_policy_correction(apply_overrides(config, {"tis": "none"})) is None
        assert off_policy_correction(apply_overrides(config, {"tis": "icepop"})) == "icepop"


# ----- versions, buffer, clock ------------------------------------------------------------------------------

def generated(version_runs, group_index=0) -> Sample:
    """A sample whose response came from ``version_runs``: ``[(version, tokens), ...]`` in order."""
    sample = Sample(prompt="p", tokens=[5, 6], group_index=group_index, index=group_index)
    for version, count in version_runs:
        sample.add_generation(GenerateResult([7] * count, [-0.5] * count, FinishReason.ABORT, str(version)))
    sample.status = Status.COMPLETED
    return sample


def test_each_token_keeps_its_version_and_staleness_counts_from_the_oldest():
    sample = generated([(3, 2), (4, 3)])
    assert sample.response_versions == ["3", "3", "4", "4", "4"] and sample.weight_versions == ["3", "4"]
    assert oldest_version(sample) == 3 and staleness(sample, trained_by=5) == 2
    sample.append_response([9], None, trainable=False)  # a tool's tokens have no version
    assert sample.response_versions[-1] is None and oldest_version(sample) == 3
    restart([sample])
    assert (sample.tokens, sample.response_versions, sample.status) == ([5, 6], [], Status.PENDING)
    assert oldest_version(sample) is None and staleness(sample, trained_by=5) == 0


def test_buffer_takes_the_oldest_groups_within_the_bound_and_gives_back_the_stale_ones():
    buffer = SampleBuffer()
    for index, version in enumerate([1, 3, 2, 3, 3]):
        buffer.put([generated([(version, 1)], index)])
    taken, stale = buffer.take(2, trained_by=4, max_staleness=1)
    assert [g[0].group_index for g in taken] == [1, 3] and [g[0].group_index for g in stale] == [0, 2]
    assert [g[0].group_index for g in buffer.groups] == [4]
    taken, stale = buffer.take(5, trained_by=9, max_staleness=None)  # no bound: nothing is stale
    assert [g[0].group_index for g in taken] == [4] and stale == []


def test_busy_clock_counts_overlapping_work_once_within_the_window():
    clock = BusyClock(iter([1.0, 2.0, 4.0]).__next__)
    clock.enter()  # busy from 1.0
    clock.enter()  # nested: the same interval
    clock.exit()
    clock.exit()  # idle from 2.0
    assert clock.intervals == [(1.0, 2.0)]
    clock.enter()  # busy from 4.0, still running
    assert clock.busy(0.0, 3.0) == pytest.approx(1.0)
    assert clock.busy(1.5, 5.0) == pytest.approx(0.5 + 1.0)  # (1.5, 2) and (4, 5) of the running one


# ----- the stream under interrupting weight updates ----------------------------------------------------------

class SlowEngine:
    """An engine that makes one token per ``tick`` seconds with the weights it holds; ``pause`` ends every
    running request (ABORT, with its tokens so far), as the real engines do."""

    def __init__(self, tick=0.001):
        self.tick, self.weight_version, self.paused = tick, "0", False
        self.running: set[asyncio.Event] = set()

    async def generate(self, requests):
        [request] = requests
        if self.paused:
            return [GenerateResult([], [], FinishReason.ABORT, self.weight_version)]
        stop, out = asyncio.Event(), []
        self.running.add(stop)
        try:
            for _ in range(request.params.max_new_tokens):
                if stop.is_set():
                    return [GenerateResult(out, [-1.0] * len(out), FinishReason.ABORT, self.weight_version)]
                await asyncio.sleep(self.tick * random.uniform(0.5, 2))
                out.append(1)
            return [GenerateResult(out, [-1.0] * len(out), FinishReason.LENGTH, self.weight_version)]
        finally:
            self.running.discard(stop)

    async def pause(self):
        self.paused = True
        for stop in self.running:
            stop.set()
        await asyncio.sleep(self.tick * 3)  # every running request has returned

    async def resume(self):
        self.paused = False


class Prompts:
    """The data source's interface: fresh groups of ``n`` copies of one prompt, numbered in draw order."""

    def __init__(self):
        self.counter = itertools.count()

    def get_groups(self, num_groups, n):
        groups = []
        for _ in range(num_groups):
            g = next(self.counter)
            groups.append([Sample(prompt="p", tokens=[1, 2], group_index=g, index=g * n + i) for i in range(n)])
        return groups


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


async def score(group):
    return [1.0] * len(group)


def run_stream(steps, *, max_staleness, max_inflight, batch_groups=4, n=2, tokens=12, train_s=0.006):
    """Train ``steps`` batches from a stream over ``SlowEngine``, pushing after each; returns per step the
    staleness of every trained sample, the stream's metrics, and the samples."""
    random.seed(0)

    async def main():
        engine = SlowEngine()
        manager = RolloutManager(engine, Tokenizer(), Prompts(), Reward(score),
                                 params=SamplingParams(max_new_tokens=tokens), rollout_batch_size=batch_groups,
                                 n_samples_per_prompt=n)
        stream = RolloutStream(manager, max_inflight=max_inflight, max_staleness=max_staleness)
        stream.start()
        steps_out = []
        for k in range(steps):
            groups, metrics = await stream.next_batch(k)
            samples = [s for g in groups for s in g]
            assert len(groups) == batch_groups and all(len(g) == n for g in groups)
            assert all(s.response_length == tokens for s in samples)
            steps_out.append(([staleness(s, k) for s in samples], metrics, samples))
            await asyncio.sleep(train_s)  # the trainer trains while the engine generates

            async def push(version=str(k + 1)):
                engine.weight_version = version
            await stream.update_weights(k + 1, push)
        stream.stop()
        for task in list(stream.generating):
            task.cancel()
        return steps_out
    return asyncio.run(main())


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_no_trained_sample_exceeds_the_staleness_bound(max_staleness):
    steps = run_stream(12, max_staleness=max_staleness, max_inflight=16)
    assert all(max(values) <= max_staleness for values, _, _ in steps)
    if max_staleness == 0:  # the bound was binding: samples that waited across an update were generated again
        assert sum(m["rollout/stale_dropped"] for _, m, _ in steps) > 0


def test_weight_updates_interrupt_requests_that_continue_with_the_new_weights():
    steps = run_stream(10, max_staleness=None, max_inflight=16)
    samples = [s for _, _, batch in steps for s in batch]
    spanning = [s for s in samples if len(set(s.response_versions)) > 1]
    assert spanning, "no request was interrupted by an update and continued"
    for s in spanning:
        versions = list(map(int, s.response_versions))
        assert versions == sorted(versions)  # older tokens first, every token with its version
        assert [str(v) for v, _ in itertools.groupby(versions)] == s.weight_versions
    assert max(v for values, _, _ in steps for v in values) >= 1


def test_the_stream_keeps_at_most_max_inflight_trajectories():
    async def main():
        engine = SlowEngine()
        manager = RolloutManager(engine, Tokenizer(), Prompts(), Reward(score),
                                 params=SamplingParams(max_new_tokens=4), rollout_batch_size=2,
                                 n_samples_per_prompt=2)
        stream = RolloutStream(manager, max_inflight=6, max_staleness=None)
        stream.start()
        peak = 0
        for _ in range(40):
            peak = max(peak, stream.in_flight)
            await asyncio.sleep(0.001)
        groups, _ = await stream.next_batch(0)
        stream.stop()
        for task in list(stream.generating):
            task.cancel()
        return peak, groups
    peak, groups = asyncio.run(main())
    assert peak == 6 and len(groups) == 2  # three groups of two: one batch of two groups and one more
    with pytest.raises(ValueError, match="must hold one rollout batch"):
        RolloutStream(RolloutManager(SlowEngine(), Tokenizer(), Prompts(), Reward(score), params=SamplingParams(),
                                     rollout_batch_size=4, n_samples_per_prompt=2),
                      max_inflight=7, max_staleness=None)


# ----- the loop with an engine process on the CPU ----------------------------------------------------------

@pytest.mark.slow  # spawns the engine process (a few seconds)
def test_one_step_trains_each_rollout_one_version_late_while_the_next_generates(tmp_path):
    state = built(tmp_path, async_rollout="one-step", num_rollout="4")
    try:
        metrics = [rl_step(state, k) for k in range(3)]
        assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0]
        assert [m["rollout/staleness_mean"] for m in metrics] == [0.0, 1.0, 1.0]
        for m in metrics:
            assert m["rollout/samples"] == 20.0
            assert 0.0 <= m["perf/overlap_ratio"] <= 1.0 and m["perf/train_wait_time"] >= 0.0
            assert m["perf/rollout_time"] + m["perf/rollout_wait_time"] == pytest.approx(m["perf/step_time"])
            assert "train/tis_mean" in m  # TIS on by default
        assert metrics[1]["perf/overlap_ratio"] > 0  # rollout 2 generated while step 1 trained
        assert "train/rollout_logprob_abs_diff/staleness_1" in metrics[1]
        # the engine generated rollout 3 with the weights of step 1's push: each push lands between rollouts
        samples, _ = state.loop.run_until_complete(state.rollout.generate(3))
        assert {s.weight_versions[0] for s in samples} == {"2"}
    finally:
        shutdown(state)


@pytest.mark.slow
def test_one_step_beside_the_trainer_pushes_into_the_engine_process(tmp_path):
    from redline.loop.builtin import materialize
    from redline.loop.train import build

    config = small_config(tmp_path, async_rollout="one-step", embedded_engine_process="true", sft_steps="0",
                          num_rollout="3")
    state = build(apply_overrides(config, materialize(config, tmp_path / "builtin")), Console(quiet=True))[0]
    try:
        assert state.weight_sync.mode in ("pipelined", "zero-copy")  # the colocated sync into the process
        metrics = [rl_step(state, k) for k in range(2)]
        assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 1.0]
        assert metrics[1]["perf/overlap_ratio"] > 0
    finally:
        shutdown(state)


@pytest.mark.slow
def test_fully_async_keeps_the_bound_and_every_batch_complete(tmp_path):
    state = built(tmp_path, async_rollout="full", max_staleness="1", num_rollout="4")
    try:
        metrics = [rl_step(state, k) for k in range(4)]
        assert all(m["rollout/staleness_max"] <= 1 for m in metrics)
        assert all(m["rollout/samples"] == 20.0 for m in metrics)
        assert all("rollout/stale_dropped" in m and "perf/overlap_ratio" in m for m in metrics)
    finally:
        shutdown(state)


def saved_and_resumed(tmp_path, mode, steps, **overrides):
    """Run ``steps`` steps, save the rollout's state the way a checkpoint does (through JSON), then build a fresh
    run from it; returns (the saved state, the fresh run)."""
    state = built(tmp_path / "a", async_rollout=mode, num_rollout="6", **overrides)
    try:
        for k in range(steps):
            rl_step(state, k)
        saved = json.loads(json.dumps(state.rollout.state_dict()))
    finally:
        shutdown(state)
    resumed = built(tmp_path / "b", async_rollout=mode, num_rollout="6", **overrides)
    resumed.rollout.load_state_dict(saved)
    resumed.loop.run_until_complete(resumed.weight_sync.push(str(steps)))  # as train.restore does
    return saved, resumed


@pytest.mark.slow
def test_one_step_resume_trains_the_rollout_generated_before_the_checkpoint(tmp_path):
    saved, state = saved_and_resumed(tmp_path, "one-step", steps=2)
    try:
        untrained = saved["data_source"]["buffer"]
        assert len(untrained) == 5 and all(len(g) == 4 for g in untrained)  # rollout 2, whole
        samples, metrics = state.loop.run_until_complete(state.rollout.generate(2))
        assert len(samples) == 20 and metrics["rollout/samples"] == 20.0
        # the same samples, not regenerated: same tokens, same versions (one step stale)
        assert [s.tokens for s in samples] == [s["tokens"] for g in untrained for s in g]
        assert metrics["rollout/staleness_max"] == 1.0
    finally:
        shutdown(state)


@pytest.mark.slow
def test_fully_async_resume_loses_no_generated_sample(tmp_path):
    saved, state = saved_and_resumed(tmp_path, "full", steps=2, max_staleness="1")
    try:
        untrained = saved["data_source"]["buffer"]
        assert len(untrained) == 5  # --max-inflight: one batch generated (or generating) and not yet trained
        samples, metrics = state.loop.run_until_complete(state.rollout.generate(2))
        assert len(samples) == 20 and metrics["rollout/samples"] == 20.0
        assert sorted({s.group_index for s in samples}) == sorted(g[0]["group_index"] for g in untrained)
        for sample in samples:  # what was generated before the checkpoint is kept, the rest continued
            before = next(s for g in untrained for s in g if s["index"] == sample.index)
            assert sample.tokens[:len(before["tokens"])] == before["tokens"]
        assert metrics["rollout/staleness_max"] <= 1
    finally:
        shutdown(state)


def test_an_async_steps_phases_add_up_to_its_step_time():
    from redline.loop.metrics import phase_segments

    record = {"perf/rollout_time": 3.0, "perf/train_wait_time": 0.5, "perf/offload_rollout_time": 0.0,
              "perf/logprob_time": 1.0, "perf/train_time": 2.0, "perf/update_weights_time": 0.25,
              "perf/idle_time": 0.25, "perf/step_time": 4.0}
    segments = phase_segments(record)
    assert segments[0] == ("train_wait", 0.5)  # the rollout's place: what the trainer waited, not the overlap
    assert sum(seconds for _, seconds in segments) == pytest.approx(record["perf/step_time"])


def test_the_log_prob_gap_is_reported_per_staleness():
    import torch
    from redline.loop.async_schedule import mismatch_by_staleness

    fresh, stale, mixed = generated([(3, 2)], 0), generated([(2, 2)], 1), generated([(2, 1), (3, 1)], 2)
    mixed.loss_mask[1] = 0  # a masked token's gap does not count
    old = [torch.tensor([0.0, 0.0]), torch.tensor([1.0, 3.0]), torch.tensor([2.0, 100.0])]
    rollout = [torch.zeros(2)] * 3
    metrics = mismatch_by_staleness([fresh, stale, mixed], 3, old, rollout, overall=9.0)
    assert metrics == {"train/rollout_logprob_abs_diff/staleness_0": 0.0,
                       "train/rollout_logprob_abs_diff/staleness_1": pytest.approx((1 + 3 + 2) / 3)}
    # one staleness in the batch: the loss's own gap stands for it
    assert mismatch_by_staleness([stale], 3, None, rollout, overall=9.0) == {
        "train/rollout_logprob_abs_diff/staleness_1": 9.0}


@pytest.mark.slow
def test_a_step_that_fails_while_training_still_shuts_down(tmp_path, monkeypatch):
    state = built(tmp_path, async_rollout="full", num_rollout="3")

    def broken(*args, **kwargs):
        raise FloatingPointError("injected")
    monkeypatch.setattr(state.worker, "step", broken)
    try:
        with pytest.raises(FloatingPointError, match="injected"):
            rl_step(state, 0)  # the loop was running in the helper thread when the training failed
    finally:
        shutdown(state)  # closes the sync, the engine and the loop: the helper thread gave the loop back
    assert state.loop.is_closed()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one-step", "full"])
def test_a_checkpoint_keeps_the_untrained_groups_and_the_resumed_run_trains_complete_batches(tmp_path, mode):
    from redline.loop import checkpoint
    from redline.loop.train import run

    from .test_train import records

    flags = {"async_rollout": mode, "max_staleness": "1", "eval_interval": "2", "save_interval": "2"}
    assert run(config_with(tmp_path / "first", num_rollout="4", **flags)) == 0
    saved = tmp_path / "first" / "checkpoints" / "rollout_1"  # after step 2 of 4: the next batch is generated
    _, mine = checkpoint.load_state(saved)
    untrained = mine["rollout"]["data_source"]["buffer"]
    assert len(untrained) == 5 and all(len(group) == 4 for group in untrained)  # the next batch, whole
    assert run(config_with(tmp_path / "second", num_rollout="4", load=str(saved), **flags)) == 0
    rows = [r for r in records(tmp_path / "second") if "rollout/samples" in r]
    assert [r["step"] for r in rows] == [3, 4]
    assert all(r["rollout/samples"] == 20 and r["rollout/staleness_max"] <= 1 for r in rows)
    if mode == "one-step":  # step 3 trained rollout 2, generated before the checkpoint with version 1
        assert rows[0]["rollout/staleness_max"] == 1
