"""The GPU acceptance script of issue 19 (benchmarks/async_acceptance.py) on the CPU: its launches (parsed by the
real ``redline train`` CLI and the async start-up checks), its summary of metrics.jsonl and its target."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import async_acceptance as acceptance


@pytest.mark.parametrize("placement", ["one-gpu", "two-gpus", "cpu", "sglang-two-gpus"])
def test_every_launch_parses_and_passes_the_start_up_checks(placement):
    for shape in acceptance.SHAPES:
        for mode in acceptance.MODES:
            argv = acceptance.command(shape, mode, out=Path("/tmp/out"), steps=7, placement=placement,
                                      python="python3", model_dirs={"1p7b": Path("/models/1p7b")}, extra=[])
            config = acceptance.checked(argv)
            assert config.rollout.num_rollout == 7
            assert config.rollout.async_rollout == {"sync": "off"}.get(mode, mode)
            assert config.parallel.colocate == (placement == "one-gpu")
            assert not config.sync.offload_rollout  # the engine keeps its memory in every mode: same placement
            if placement == "one-gpu":
                assert config.rollout.embedded_engine_process
            if shape == "1p7b":
                assert config.model.hf_checkpoint == "/models/1p7b" and config.model.backend == "bf16"


def record(step, step_time, rollout, train, sync, **extra):
    return {"step": step, "perf/step_time": step_time, "perf/rollout_time": rollout, "perf/logprob_time": 0.0,
            "perf/train_time": train, "perf/update_weights_time": sync, **extra}


def test_summary_takes_medians_after_the_warm_up_steps():
    records = [{"step": 0, "eval/reward_mean": 0.2}, record(1, 9.0, 5.0, 4.0, 1.0), record(2, 9.0, 5.0, 4.0, 1.0),
               record(3, 3.0, 2.0, 1.5, 0.2, **{"perf/overlap_ratio": 0.5, "rollout/staleness_max": 1.0}),
               record(4, 5.0, 2.0, 2.5, 0.4, **{"perf/overlap_ratio": 0.7, "rollout/staleness_max": 1.0}),
               record(5, 4.0, 2.0, 2.0, 0.3, **{"perf/overlap_ratio": 0.6, "rollout/staleness_max": 0.0}),
               {"step": 5, "eval/reward_mean": 0.9}]
    summary = acceptance.summarize(records)
    assert summary["steps"] == 5
    assert (summary["step_time"], summary["train_time"], summary["sync_time"]) == (4.0, 2.0, 0.3)
    assert summary["overlap_ratio"] == 0.6 and summary["staleness_max"] == 1.0
    assert (summary["eval_reward"], summary["eval_step"]) == (0.9, 5)


def test_the_target_is_one_step_within_a_tenth_of_the_longer_phase_plus_sync():
    sync = {"step_time": 10.0, "rollout_time": 5.0, "train_time": 4.0, "sync_time": 1.0}
    results = {"50m-sync": {"summary": sync},
               "50m-one-step": {"summary": {"step_time": 6.4, "rollout_time": 5.0, "train_time": 4.0,
                                            "sync_time": 1.0}},
               "1p7b-sync": {"summary": sync},
               "1p7b-one-step": {"summary": {"step_time": 6.6, "rollout_time": 5.5, "train_time": 4.0,
                                             "sync_time": 1.0}}}
    targets = acceptance.targets(results)
    assert targets["50m"]["bound_from_sync_phases"] == pytest.approx(1.1 * 5.0 + 1.0)
    assert targets["50m"]["met"] and not targets["1p7b"]["met"]
    assert targets["1p7b"]["bound_from_own_phases"] == pytest.approx(1.1 * 5.5 + 1.0)
    assert targets["50m"]["speedup"] == pytest.approx(10.0 / 6.4)
    report = {"device": "cpu", "placement": "cpu", "commit": "abc", "steps": 5, "targets": targets,
              "runs": {name: {"status": "ok", **run} for name, run in results.items()}}
    text = acceptance.markdown(report)
    assert "| 50m | 10.000 | 6.400 | 6.500 |" in text and "| no |" in text
