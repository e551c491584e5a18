"""Benchmark harness on pytest-benchmark.

Every run records the environment (``redline env``: device, driver, versions) in the JSON's machine_info, and
every benchmark records NVML clocks/power before and after itself, its shapes, provider and peak extra memory
(beyond what was allocated before its warm-up, over one call after the warm-up).
Providers of one comparison share a ``benchmark.group``; one of them is the baseline, and the terminal summary
prints each provider's time as a ratio of the baseline's.

Use the ``gpu_bench`` fixture::

    def test_mm(gpu_bench):
        gpu_bench(lambda: a @ b, group="gemm 8192^3", provider="torch.mm", baseline=True, flops=2 * n**3, n=n)
"""

import gc
import sys
from pathlib import Path

import pytest
import torch

from redline.env_report import collect, device_snapshot
from redline.gpu_memory import make_cublas_workspaces

sys.path.insert(0, str(Path(__file__).parent))  # benchmark helper modules next to this file

RATIO_ROWS = []


@pytest.fixture(scope="session", autouse=True)
def _cublas_workspaces():
    """cuBLAS's one-time per-thread workspaces, made before any benchmark measures memory."""
    if torch.cuda.is_available():
        make_cublas_workspaces()


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["redline_env"] = collect()


def nvml_now() -> list[dict]:
    """Clocks, power and memory of every GPU right now (empty without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML library / no driver: nothing to record
        return []
    try:
        return [device_snapshot(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.fixture
def gpu_bench(benchmark):
    """Time ``fn`` (synchronised, after warm-up) and record the context; returns fn's last result."""

    def run(fn, *, group, provider, baseline=False, flops=None, rounds=5, warmup=3, **shape):
        benchmark.group = group
        info = benchmark.extra_info
        info.update(provider=provider, baseline=baseline, **shape)
        if flops:
            info["flops"] = flops
        info["nvml_before"] = nvml_now()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
        for _ in range(warmup):
            fn()
        _synchronize()
        if torch.cuda.is_available():  # one call's peak after the warm-up: no compilation or autotuning in it
            torch.cuda.reset_peak_memory_stats()
            fn()
            _synchronize()
            info["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base_mem) / 2**20

        def timed():
            out = fn()
            _synchronize()
            return out

        result = benchmark.pedantic(timed, rounds=rounds, iterations=1)
        info["nvml_after"] = nvml_now()
        RATIO_ROWS.append((group, provider, baseline, benchmark))
        return result

    return run


def pytest_terminal_summary(terminalreporter):
    groups = {}
    for group, provider, baseline, bench in RATIO_ROWS:
        if bench.stats is None:
            continue
        groups.setdefault(group, []).append((provider, baseline, bench.stats.stats.median))
    if not groups:
        return
    terminalreporter.section("ratios vs baseline (median; > 1 = slower than the baseline)")
    for group, rows in groups.items():
        base = next((m for _, b, m in rows if b), None)
        terminalreporter.write_line(group)
        for provider, baseline, median in sorted(rows, key=lambda r: r[2]):
            ratio = f"{median / base:6.2f}x" if base else "   n/a"
            terminalreporter.write_line(f"  {provider:<40} {median * 1e3:10.3f} ms  {ratio}"
                                        + ("  (baseline)" if baseline else ""))
