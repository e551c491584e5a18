"""``--no-colocate``: the trainer broadcasts each step's weights (gloo on the CPU, NCCL on GPUs) into embedded
engine processes of their own; after every sync the engines hold the trainer's weights bit for bit."""

import pytest
import torch
from rich.console import Console

from redline.configfile import ConfigError, apply_overrides
from redline.loop.builtin import materialize
from redline.loop.step import rl_step
from redline.loop.train import build, shutdown
from redline.loop.validate import check_placement

from .test_train import small_config
from .test_weight_sync import BUCKET_BYTES

DISAGGREGATED = dict(colocate="false", sft_steps="0", update_weight_buffer_size=str(BUCKET_BYTES),
                     distributed_timeout_minutes="0.5")


def built(tmp_path, **overrides):
    engines = int(overrides.get("rollout_num_gpus", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() < 1 + engines:
        pytest.skip(f"--no-colocate with {engines} engine GPU(s) needs {1 + engines} GPUs on a CUDA machine")
    config = small_config(tmp_path, **{**DISAGGREGATED, **overrides})
    config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
    check_placement(config)
    return build(config, Console(quiet=True))[0]


def assert_engine_holds_trainer_weights(state, engine):
    trainer = {name: t.detach().cpu() for name, t in state.worker.model.export_hf()}
    received = dict(state.loop.run_until_complete(engine.export_weights()))
    assert sorted(received) == sorted(trainer)
    for name, tensor in trainer.items():
        assert torch.equal(received[name], tensor), name


@pytest.mark.slow  # spawns the engine process (a few seconds)
def test_two_steps_push_the_trainers_weights_into_the_engine_process(tmp_path):
    state = built(tmp_path)
    try:
        engine = state.engine
        assert state.weight_sync.backend == ("nccl" if torch.cuda.is_available() else "gloo")
        assert len(state.weight_sync.plan.buckets) > 2
        initial = dict(state.loop.run_until_complete(engine.export_weights()))
        for rollout_id in range(2):
            metrics = rl_step(state, rollout_id)
            assert_engine_holds_trainer_weights(state, engine)
            for key in ["rollout/reward_mean", "train/pg_loss", "train/grad_norm", "perf/update_weights_time"]:
                assert torch.isfinite(torch.tensor(metrics[key])), key
            # the second rollout sampled with the weights the first step trained
            assert metrics["train/rollout_logprob_abs_diff"] < 1e-4
        moved = dict(state.worker.model.export_hf())
        assert any(not torch.equal(initial[n], moved[n].cpu()) for n in initial)  # the sync carried new values
    finally:
        shutdown(state)


@pytest.mark.slow
def test_two_engine_processes_each_get_every_sync(tmp_path):
    state = built(tmp_path, rollout_num_gpus="2")
    try:
        assert len(state.engine.engines) == 2
        rl_step(state, 0)
        for engine in state.engine.engines:
            assert_engine_holds_trainer_weights(state, engine)
    finally:
        shutdown(state)


def test_placement_checks_name_the_flag(tmp_path, monkeypatch):
    config = small_config(tmp_path, **DISAGGREGATED)
    with pytest.raises(ConfigError, match="--offload-rollout"):
        check_placement(apply_overrides(config, {"offload_rollout": "true"}))
    with pytest.raises(ConfigError, match="--rollout-num-gpus"):
        check_placement(apply_overrides(config, {"rollout_num_gpus": "0"}))
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes"):
        check_placement(apply_overrides(config, {"distributed_timeout_minutes": "0"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_placement(config)  # GPU 0 trains, GPU 1 serves
    with pytest.raises(ConfigError, match="3 in all, but 2 are visible"):
        check_placement(apply_overrides(config, {"rollout_num_gpus": "2"}))
    sglang = apply_overrides(config, {"rollout_engine": "sglang", "rollout_num_gpus": "2"})
    with pytest.raises(ConfigError, match="3 in all, but 2 are visible"):  # launched: one server per engine GPU
        check_placement(sglang)
    check_placement(apply_overrides(sglang, {"sglang_server_urls": "http://127.0.0.1:30000"}))  # attached


@pytest.mark.slow
def test_a_dead_engine_fails_the_push_instead_of_hanging(tmp_path):
    import time

    if torch.cuda.is_available():
        pytest.skip("gloo only: NCCL's watchdog answers a dead peer by aborting this process")
    state = built(tmp_path, distributed_timeout_minutes="0.1")
    try:
        state.engine._process.kill()
        began = time.perf_counter()
        # gloo's error (DistBackendError is a RuntimeError) or the bounded wait's TimeoutError
        with pytest.raises((RuntimeError, TimeoutError)) as failure:
            state.loop.run_until_complete(state.weight_sync.push("1"))
        assert time.perf_counter() - began < 45, failure.value
    finally:
        import torch.distributed as dist

        dist.destroy_process_group(state.weight_sync.group)  # the dead engine cannot leave it
        state.weight_sync.group = None
        state.engine._closed = True
