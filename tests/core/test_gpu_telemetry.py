"""GPU telemetry: per-step summaries of NVML readings, the sampling thread, and when it is off."""

import threading
import time

import pytest
import redline.extras
import torch
from redline.gpu_telemetry import (
    GpuReading,
    GpuTelemetry,
    NvmlSource,
    open_gpu_telemetry,
    summarize,
    summarize_phases,
)
from redline.loop.metrics import MetricsLog


class FakeSource:
    """Readings from a list, one GPU each (the last one repeated); counts reads and closes."""

    def __init__(self, readings):
        self.readings = list(readings)
        self.reads = 0
        self.closed = 0
        self.read_threads = set()

    def read(self):
        self.read_threads.add(threading.current_thread().name)
        reading = self.readings[min(self.reads, len(self.readings) - 1)]
        self.reads += 1
        return [reading]

    def close(self):
        self.closed += 1


def test_summary_of_one_gpu_is_mean_util_power_clock_and_peak_memory():
    samples = [[GpuReading(100.0, 30e9, 500.0, 1980.0)], [GpuReading(0.0, 50e9, 100.0, 1000.0)],
               [GpuReading(50.0, 40e9, 300.0, 1490.0)]]
    assert summarize(samples) == {"perf/gpu_util": 50.0, "perf/gpu_mem_gb": 50.0, "perf/gpu_power_w": 300.0,
                                  "perf/gpu_sm_clock_mhz": 1490.0}


def test_summary_of_two_gpus_adds_each_gpus_own_values():
    samples = [[GpuReading(100.0, 10e9, 400.0, 1900.0), GpuReading(0.0, 70e9, 100.0, 1100.0)],
               [GpuReading(80.0, 20e9, 600.0, 1700.0), GpuReading(20.0, 60e9, 100.0, 1300.0)]]
    out = summarize(samples)
    assert out["perf/gpu_util"] == pytest.approx(50.0)
    assert out["perf/gpu_mem_gb"] == pytest.approx(70.0)  # the fullest GPU
    assert out["perf/gpu_power_w"] == pytest.approx(300.0)
    assert out["perf/gpu0_util"] == pytest.approx(90.0) and out["perf/gpu1_util"] == pytest.approx(10.0)
    assert out["perf/gpu0_mem_gb"] == pytest.approx(20.0) and out["perf/gpu1_mem_gb"] == pytest.approx(70.0)
    assert out["perf/gpu0_power_w"] == pytest.approx(500.0) and out["perf/gpu1_sm_clock_mhz"] == pytest.approx(1200.0)


def test_summary_of_no_samples_is_empty():
    assert summarize([]) == {}


def test_phase_utilisation_is_the_mean_of_the_readings_taken_in_each_phase():
    busy, idle = GpuReading(90.0, 1e9, 500.0, 1980.0), GpuReading(10.0, 1e9, 100.0, 900.0)
    samples = [(None, [busy]), ("rollout", [busy]), ("rollout", [idle]), ("train", [busy, idle]), ("train", [busy])]
    assert summarize_phases(samples) == {"perf/gpu_util/rollout": 50.0,
                                         "perf/gpu_util/train": pytest.approx(190.0 / 3)}


def wait_for(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_thread_samples_in_the_background_and_stops_cleanly():
    source = FakeSource([GpuReading(10.0, 1e9, 50.0, 900.0)])
    telemetry = GpuTelemetry(source, interval_s=0.005).start()
    thread = telemetry._thread
    wait_for(lambda: source.reads >= 3)
    assert source.read_threads == {"redline-gpu-telemetry"}  # never the caller's thread
    telemetry.stop()
    assert not thread.is_alive() and source.closed == 1
    telemetry.stop()  # idempotent
    assert source.closed == 1


def test_a_window_holds_only_the_readings_taken_after_begin():
    source = FakeSource([GpuReading(0.0, 1e9, 50.0, 900.0)] * 3 + [GpuReading(100.0, 2e9, 700.0, 1980.0)])
    with GpuTelemetry(source, interval_s=0.005) as telemetry:
        wait_for(lambda: source.reads >= 4)
        telemetry.begin()
        wait_for(lambda: source.reads >= 8)
        summary = telemetry.summary()
    assert summary["perf/gpu_util"] == 100.0 and summary["perf/gpu_mem_gb"] == 2.0
    assert summary["perf/gpu_power_w"] == 700.0


def test_readings_belong_to_the_phase_marked_before_them_and_begin_clears_it():
    source = FakeSource([GpuReading(20.0, 1e9, 50.0, 900.0)] * 4 + [GpuReading(80.0, 1e9, 50.0, 900.0)])
    with GpuTelemetry(source, interval_s=0.005) as telemetry:
        telemetry.begin()
        telemetry.phase("rollout")
        wait_for(lambda: source.reads >= 4)
        telemetry.phase("train")
        seen = source.reads
        wait_for(lambda: source.reads >= seen + 3)
        summary = telemetry.summary()
        telemetry.begin()
        wait_for(lambda: source.reads >= seen + 6)
        unmarked = telemetry.summary()
    assert 20.0 <= summary["perf/gpu_util/rollout"] < 50.0  # the 5th read (80) may fall on either side of the mark
    assert summary["perf/gpu_util/train"] == 80.0
    assert not any(key.startswith("perf/gpu_util/") for key in unmarked)


def test_every_phase_entered_has_a_reading_however_short():
    # readings every 60 s: only the ones phase() takes itself fall in the window (all ranks then share the keys)
    source = FakeSource([GpuReading(10.0, 1e9, 50.0, 900.0), GpuReading(30.0, 1e9, 50.0, 900.0),
                         GpuReading(60.0, 1e9, 50.0, 900.0), GpuReading(90.0, 1e9, 50.0, 900.0)])
    with GpuTelemetry(source, interval_s=60.0) as telemetry:
        wait_for(lambda: source.reads >= 1)  # the thread's first reading, then it sleeps
        telemetry.begin()
        for name in ("rollout", "offload_rollout", "update_weights"):
            telemetry.phase(name)
        summary = telemetry.summary()
    assert {k: v for k, v in summary.items() if k.startswith("perf/gpu_util/")} == {
        "perf/gpu_util/rollout": 30.0, "perf/gpu_util/offload_rollout": 60.0, "perf/gpu_util/update_weights": 90.0}
    assert summary["perf/gpu_util"] == 60.0


def test_a_window_shorter_than_the_interval_reads_once_at_its_end():
    source = FakeSource([GpuReading(10.0, 1e9, 50.0, 900.0), GpuReading(70.0, 3e9, 200.0, 1500.0)])
    with GpuTelemetry(source, interval_s=60.0) as telemetry:
        wait_for(lambda: source.reads >= 1)
        telemetry.begin()
        summary = telemetry.summary()
    assert summary["perf/gpu_util"] == 70.0 and source.reads == 2


def test_off_telemetry_starts_no_thread_and_reports_nothing():
    telemetry = GpuTelemetry(None).start()
    telemetry.begin()
    assert not telemetry.enabled and telemetry._thread is None and telemetry.summary() == {}
    telemetry.stop()


def test_cpu_devices_turn_it_off_without_a_note():
    notes = []
    telemetry = open_gpu_telemetry([torch.device("cpu")], notes.append)
    assert not telemetry.enabled and notes == []


def test_missing_pynvml_turns_it_off_with_one_line(monkeypatch):
    monkeypatch.setattr(redline.extras, "available", lambda module: module != "pynvml")
    notes = []
    telemetry = open_gpu_telemetry([torch.device("cuda", 0)], notes.append)
    assert not telemetry.enabled
    assert notes == ["GPU telemetry off: nvidia-ml-py is missing (pip install 'redline[gpu]')"]


def test_report_plots_gpu_telemetry_when_present(tmp_path):
    log = MetricsLog(tmp_path)
    for step in (1, 2):
        log.log(step, {"perf/step_time": 1.0, "perf/gpu_util": 40.0 + step, "perf/gpu_mem_gb": 20.0,
                       "perf/gpu_power_w": 300.0, "perf/gpu_sm_clock_mhz": 1900.0})
    report = log.report("run", []).read_text()
    log.close()
    for name in ("gpu_util", "gpu_memory", "gpu_power", "gpu_sm_clock"):
        assert (tmp_path / f"{name}.png").is_file() and f"![{name}]({name}.png)" in report
    assert "| perf/gpu_util | 41 | 42 | 41 | 42 |" in report


def test_report_draws_no_gpu_plots_without_telemetry(tmp_path):
    log = MetricsLog(tmp_path)
    log.log(1, {"perf/step_time": 1.0})
    report = log.report("run", []).read_text()
    log.close()
    assert "gpu_util" not in report and not (tmp_path / "gpu_util.png").exists()


@pytest.mark.gpu
def test_nvml_reads_the_gpu_torch_uses(cuda):
    import pynvml

    held = torch.empty(2**30, dtype=torch.uint8, device=cuda)  # 1 GB: visible in NVML's memory used
    source = NvmlSource(pynvml, [torch.cuda.current_device()])
    try:
        [reading] = source.read()
    finally:
        source.close()
    assert 0.0 <= reading.util_pct <= 100.0
    assert reading.mem_bytes >= held.numel()
    assert reading.power_w > 0 and reading.sm_clock_mhz > 0


@pytest.mark.gpu
def test_busy_gpu_reads_as_utilised(cuda):
    a = torch.randn(8192, 8192, device=cuda, dtype=torch.bfloat16)
    with open_gpu_telemetry([cuda], print, interval_s=0.05) as telemetry:
        telemetry.begin()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
        busy = telemetry.summary()
    assert busy["perf/gpu_util"] > 80.0, busy
