"""Issue 23's acceptance script (benchmarks/stall_check.py): its reading of step records and its verdicts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from stall_check import compiled_in_steps, markdown, phase_check, read_steps, run_summary, summarize  # noqa: E402


def steps(train, logprob, startup=None):
    records = [{"step": i + 1, "perf/train_time": t, "perf/logprob_time": lp, "perf/step_time": 2.0,
                "perf/compile_time": 0.0} for i, (t, lp) in enumerate(zip(train, logprob))]
    if startup is not None:
        records[0]["perf/startup_compile_time"] = startup
    return records


def test_read_steps_keeps_step_records_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"step": 2, "a": 1}, {"step": 0, "sft/loss": 1},
                                                              {"step": 1, "a": 0})))
    assert [r["step"] for r in read_steps(path)] == [1, 2]


def test_a_first_step_above_one_and_a_half_medians_is_a_stall():
    check = phase_check(steps([9.0, 0.6, 0.7, 0.5, 0.6, 0.65], [0.2] * 6), "perf/train_time", 1.5)
    assert check["median_2_6"] == pytest.approx(0.6) and check["worst_step"] == 1
    assert check["worst_ratio"] == pytest.approx(15.0) and not check["ok"]


def test_steps_within_the_ratio_pass_and_a_late_stall_is_caught():
    assert phase_check(steps([0.8, 0.6, 0.7, 0.5, 0.6, 0.65], [0.2] * 6), "perf/train_time", 1.5)["ok"]
    late = phase_check(steps([0.8, 0.6, 0.7, 0.5, 0.6, 5.6], [0.2] * 6), "perf/train_time", 1.5)
    assert late["worst_step"] == 6 and not late["ok"]


def test_a_missing_phase_fails_with_the_reason():
    check = phase_check([{"step": 1, "perf/train_time": 1.0}], "perf/logprob_time", 1.5)
    assert not check["ok"] and "perf/logprob_time" in check["why"]


def test_verdicts_need_no_stall_and_a_shorter_second_start():
    first = run_summary(steps([0.7] * 6, [0.2] * 6, startup=60.0), wall_s=200.0, ratio=1.5)
    second = run_summary(steps([0.7] * 6, [0.2] * 6, startup=12.0), wall_s=150.0, ratio=1.5)
    assert first["wall_outside_steps_s"] == 188.0 and first["startup_compile_time_s"] == 60.0
    good = summarize([first, second], 1.5)
    assert good["ok"] and good["second_warmup_shorter"] and good["second_start_shorter"]
    assert not summarize([second, first], 1.5)["ok"]
    stalled = run_summary(steps([9.0] + [0.7] * 5, [0.2] * 6, startup=12.0), wall_s=150.0, ratio=1.5)
    assert not summarize([first, stalled], 1.5)["ok"]
    assert "| 1 | 9.000 s |" in markdown(summarize([first, stalled], 1.5), ["redline", "train"])


def test_kernels_a_step_still_compiled_are_read_from_the_log_and_listed():
    log = ("[1/6] reward 0.000 · rollout 3.26s train 1.01s\n"
           "WARNING step 1 compiled 1 Triton kernel(s) the warm-up did not reach: _decode_kernel in rollout (0.41 s)\n"
           "WARNING steps 1-3: every gradient is zero\n")
    found = compiled_in_steps(log)
    assert found == ["step 1 compiled 1 Triton kernel(s) the warm-up did not reach: _decode_kernel in rollout (0.41 s)"]
    runs = [run_summary(steps([0.7] * 6, [0.2] * 6, startup=s), wall_s=150.0, ratio=1.5) for s in (60.0, 12.0)]
    runs[0]["compiled_in_steps"] = found
    assert f"- {found[0]}" in markdown(summarize(runs, 1.5), ["redline", "train"])
