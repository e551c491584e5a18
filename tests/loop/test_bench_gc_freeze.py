"""benchmarks/bench_gc_freeze.py: a run's numbers count its steps from step 3 and only the full collections its loop
paid, not those of its start-up or of its report."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gc_freeze as bench  # noqa: E402  (a script of benchmarks/, not a package)


def test_a_runs_summary_counts_the_loops_collections_and_its_steps_from_step_3(tmp_path):
    records = [{"step": 0, "eval/reward_mean": 0.2}] + [
        {"step": step, "perf/step_time": seconds, "perf/rollout_time": seconds / 2, "perf/train_time": seconds / 4}
        for step, seconds in [(1, 9.0), (2, 5.0), (3, 0.1), (4, 0.3), (5, 0.2)]]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)))
    pauses = {"loop_began": 10.0, "loop_ended": 20.0,
              "pauses": [[5.0, 0.5], [12.0, 0.25], [15.0, 0.125], [21.0, 0.5]]}  # start-up, two in the loop, report
    summary = bench.summary(tmp_path, pauses)
    assert summary["steps"] == 3
    assert summary["median_step_ms"] == pytest.approx(200.0) and summary["max_step_ms"] == pytest.approx(300.0)
    assert summary["mean_step_ms"] == pytest.approx(200.0) and summary["median_rollout_ms"] == pytest.approx(100.0)
    assert summary["p90_step_ms"] == pytest.approx(280.0)  # 200 + 0.8 * (300 - 200), interpolated
    assert summary["full_collection_ms_in_loop"] == [250.0, 125.0]
    assert "2, 375, 250" in bench.table([{"mode": "frozen", "repeat": 0, "summary": summary}])


def test_a_run_whose_process_ran_no_loop_reports_no_collections(tmp_path):
    record = {"step": 3, "perf/step_time": 0.1, "perf/rollout_time": 0.05, "perf/train_time": 0.04}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record))
    summary = bench.summary(tmp_path, {"loop_began": None, "loop_ended": None, "pauses": [[1.0, 0.2]]})
    assert summary["full_collection_ms_in_loop"] is None
    assert "not this process's" in bench.table([{"mode": "frozen", "repeat": 0, "summary": summary}])
