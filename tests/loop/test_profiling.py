"""--use-pytorch-profiler: the trace's per-phase summary, the profiler's step window, its start-up checks."""

import json

import pytest

from redline.configfile import ConfigError
from redline.loop.profiling import StepProfiler, summarize_trace, summary_markdown
from redline.loop.train import run
from redline.loop.validate import check_profile
from tests.loop.test_train import records, small_config


def span(cat, name, start, end, device=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": float(start), "dur": float(end - start)}
    if device is not None:
        event["args"] = {"device": device}
    return event


# microseconds: one step [0, 1000) with train [100, 600) and update_weights [600, 900); GPU 0 runs a GEMM, an
# all-reduce overlapping its end, a copy, and a GEMM that starts in train and runs past it; GPU 1 one GEMM
TRACE = {"traceEvents": [
    span("user_annotation", "redline/step", 0, 1000),
    span("user_annotation", "redline/train", 100, 600),
    span("user_annotation", "redline/update_weights", 600, 900),
    span("user_annotation", "other/range", 0, 1000),
    span("cpu_op", "aten::mm", 100, 120),
    span("kernel", "gemm", 100, 300, device=0),
    span("kernel", "ncclDevKernel_AllReduce_Sum_f32", 250, 400, device=0),
    span("gpu_memcpy", "Memcpy DtoD", 450, 500, device=0),
    span("kernel", "gemm", 550, 650, device=0),
    span("kernel", "gemm", 700, 800, device=1),
    {"ph": "M", "name": "process_name", "args": {"name": "x"}},
]}


def test_summary_charges_device_work_to_the_phase_it_starts_in():
    train = summarize_trace(TRACE)["phases"]["train"]
    assert train["wall_s"] == pytest.approx(500e-6)
    gpu = train["gpus"]["0"]
    # busy: [100, 400) ∪ [450, 500) ∪ [550, 600) (the last GEMM clipped to the phase's end)
    assert gpu["busy_s"] == pytest.approx(400e-6)
    assert gpu["idle_share"] == pytest.approx(1 - 400 / 500)
    assert gpu["nccl_s"] == pytest.approx(150e-6)
    assert gpu["exposed_nccl_s"] == pytest.approx(100e-6)  # [300, 400): no other kernel runs
    assert gpu["copy_s"] == pytest.approx(50e-6)
    assert gpu["kernels"] == 3
    assert list(train["gpus"]) == ["0"]  # GPU 1's kernel starts in update_weights
    assert train["top_kernels"][0] == {"name": "gemm", "seconds": pytest.approx(250e-6), "calls": 2}
    assert train["top_kernels"][1]["name"] == "ncclDevKernel_AllReduce_Sum_f32"


def test_summary_of_a_kernel_started_in_an_earlier_phase_is_not_charged_again():
    update = summarize_trace(TRACE)["phases"]["update_weights"]
    assert list(update["gpus"]) == ["1"]
    assert update["gpus"]["1"]["busy_s"] == pytest.approx(100e-6)
    assert update["gpus"]["1"]["idle_share"] == pytest.approx(1 - 100 / 300)


def test_summary_of_the_whole_step_and_only_redline_ranges():
    summary = summarize_trace(TRACE)
    assert set(summary["phases"]) == {"step", "train", "update_weights"}
    step = summary["phases"]["step"]
    assert step["gpus"]["0"]["busy_s"] == pytest.approx(450e-6)  # [100, 400) ∪ [450, 500) ∪ [550, 650)
    assert step["gpus"]["1"]["busy_s"] == pytest.approx(100e-6)


def test_summary_is_per_step_and_shares_do_not_change_with_steps():
    one, two = summarize_trace(TRACE)["phases"]["train"], summarize_trace(TRACE, steps=2)["phases"]["train"]
    assert two["wall_s"] == pytest.approx(one["wall_s"] / 2)
    assert two["gpus"]["0"]["busy_s"] == pytest.approx(one["gpus"]["0"]["busy_s"] / 2)
    assert two["gpus"]["0"]["idle_share"] == pytest.approx(one["gpus"]["0"]["idle_share"])
    assert two["gpus"]["0"]["kernels"] == 1.5


def test_summary_markdown_lists_phases_in_step_order_with_their_kernels():
    text = summary_markdown({**summarize_trace(TRACE), "profiled_steps": [3]})
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and "phase" not in line]
    assert rows[:3] == ["step", "step", "train"]  # the step on both GPUs, then its phases
    assert "| train | 0.0005 | 0 | 0.0004 | 20.0% | 0.0001 | 0.0001 | 0.0001 | 3 |" in text
    assert "## train: heaviest kernels" in text and "| `gemm` | 0.0003 | 2 |" in text


def test_an_inert_profiler_marks_nothing(tmp_path):
    profiler = StepProfiler()
    profiler.begin_step(3)
    profiler.phase("train")
    assert profiler.end_step(3) == {}
    assert profiler.close() is None and profiler.report_lines(tmp_path) == []


def test_a_run_profiles_its_chosen_steps(tmp_path):
    assert run(small_config(tmp_path, use_pytorch_profiler="true", profile_step_start="2",
                            profile_step_end="4")) == 0
    rows = records(tmp_path)
    assert [r["step"] for r in rows if r.get("perf/profiled") == 1] == [2, 3]
    folder = tmp_path / "profile" / "rank0"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["profiled_steps"] == [2, 3] and summary["steps"] == 2
    assert {"step", "rollout", "offload_rollout", "train", "update_weights"} <= set(summary["phases"])
    # the phase ranges lie within the step's: the train range holds the step's timed train phase
    phases = summary["phases"]
    train_time = sum(r["perf/train_time"] for r in rows if r.get("perf/profiled")) / 2
    assert train_time <= phases["train"]["wall_s"] < phases["step"]["wall_s"]
    assert (folder / "trace.json.gz").stat().st_size > 0
    assert "profile of steps [2, 3]: profile/rank0/summary.md" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("overrides, message", [
    ({"profile_step_end": "6"}, "apply to --use-pytorch-profiler, which is off"),
    ({"use_pytorch_profiler": "true", "profile_step_start": "0"}, "--profile-step-start must be >= 1"),
    ({"use_pytorch_profiler": "true", "profile_step_start": "3", "profile_step_end": "3"},
     "--profile-step-end (3) must be after --profile-step-start (3)"),
    ({"use_pytorch_profiler": "true", "profile_step_start": "4", "profile_step_end": "6"},
     "--profile-step-end 6 is past the run's end: its last step is 4 (--num-rollout 4), so at most 5"),
])
def test_profile_settings_are_checked_at_start_up(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_profile(small_config(tmp_path, **overrides))


def test_profile_defaults_pass_the_check(tmp_path):
    assert check_profile(small_config(tmp_path)) is None
    assert check_profile(small_config(tmp_path, use_pytorch_profiler="true")) is None


@pytest.mark.gpu
def test_a_cuda_trace_charges_its_kernels_to_the_phase(tmp_path):
    import torch

    profiler = StepProfiler(range(1, 2), tmp_path)
    profiler.begin_step(1)
    profiler.phase("train")
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        x = x @ x / 64
    torch.cuda.synchronize()
    profiler.phase("update_weights")
    torch.cuda.synchronize()
    assert profiler.end_step(1) == {"perf/profiled": 1.0}
    summary = json.loads((tmp_path / "summary.json").read_text())
    gpu = summary["phases"]["train"]["gpus"][str(torch.cuda.current_device())]
    assert gpu["kernels"] >= 4 and 0 < gpu["busy_s"] <= summary["phases"]["train"]["wall_s"]
    top = summary["phases"]["train"]["top_kernels"][0]  # the matmuls (cuBLAS names its kernels per release)
    assert top["calls"] >= 4 and top["seconds"] <= gpu["busy_s"]
