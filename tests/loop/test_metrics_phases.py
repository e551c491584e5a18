"""report.md and phase_times.png show the colocated transition's phases in place of the phases holding them."""

import pytest
from redline.loop.metrics import MetricsLog, phase_segments

STEP = {"perf/rollout_time": 2.0, "perf/offload_rollout_time": 0.3, "perf/logprob_time": 0.5,
        "perf/train_time": 1.0, "perf/update_weights_time": 0.4, "perf/idle_time": 0.1, "perf/step_time": 4.3,
        "perf/release_time": 0.25, "perf/resume_weights_time": 0.05, "perf/sync_time": 0.2,
        "perf/resume_kv_time": 0.1}


def test_segments_replace_a_phase_by_its_parts_and_stack_to_the_step():
    segments = phase_segments(STEP)
    names = [n for n, _ in segments]
    assert names == ["rollout", "release", "offload_rollout: other", "logprob", "train", "resume_weights", "sync",
                     "resume_kv", "update_weights: other", "idle"]
    seconds = dict(segments)
    assert seconds["update_weights: other"] == pytest.approx(0.4 - 0.35)
    assert sum(seconds.values()) == pytest.approx(STEP["perf/step_time"])


def test_a_record_without_parts_stacks_its_phases():
    plain = {k: v for k, v in STEP.items() if k in ("perf/rollout_time", "perf/update_weights_time")}
    assert phase_segments(plain) == [("rollout", 2.0), ("offload_rollout", 0.0), ("logprob", 0.0),
                                     ("train", 0.0), ("update_weights", 0.4), ("idle", 0.0)]


def test_report_lists_the_transition_and_draws_the_stacked_plot(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(3):
        log.log(step, STEP)
    report = log.report("run", []).read_text()
    log.close()
    for row in ["| update_weights: sync | 0.2000 | 4.7% |", "| offload_rollout: release | 0.2500 | 5.8% |",
                "| update_weights: resume_weights | 0.0500 |", "| update_weights: resume_kv | 0.1000 |"]:
        assert row in report
    assert "check_weights" not in report  # a part no step recorded is not listed
    assert (tmp_path / "phase_times.png").stat().st_size > 0 and "![phase_times](phase_times.png)" in report
