"""`redline bench report`: pytest-benchmark JSON → markdown table with ratios + PNG."""

import json

import pytest

from redline.bench_report import write_report


def bench(name, group, provider, median, baseline=False, flops=None):
    info = {"provider": provider, "baseline": baseline, "M": 64}
    if flops:
        info["flops"] = flops
    return {"name": name, "group": group, "stats": {"median": median}, "extra_info": info}


def test_table_has_ratios_tflops_and_the_machine(tmp_path):
    data = {"datetime": "2026-11-22T00:00:00", "machine_info": {"redline_env": {
        "software": {"torch": "2.11", "triton": "missing"},
        "gpus": {"driver": "580", "devices": [{"name": "NVIDIA H100"}]}}},
            "benchmarks": [bench("a", "gemm", "cuBLAS", 0.002, baseline=True, flops=2e12),
                           bench("b", "gemm", "mine", 0.001, flops=2e12)]}
    (tmp_path / "run.json").write_text(json.dumps(data))
    md, png = write_report([tmp_path])
    text = md.read_text()
    assert "NVIDIA H100 ×1, driver 580; torch 2.11" in text and "triton" not in text
    assert "| gemm | mine | 1.000 | 2000.0 | — | 0.50 | M=64 |" in text
    assert "| gemm | cuBLAS (baseline) | 2.000 | 1000.0 | — | 1.00 | M=64 |" in text
    assert png.stat().st_size > 0


def test_empty_and_foreign_json_are_skipped_but_broken_json_is_named(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"software": {}}))
    (tmp_path / "deselected.json").write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(ValueError, match="no pytest-benchmark JSON"):
        write_report([tmp_path])
    (tmp_path / "broken.json").write_text("")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        write_report([tmp_path])
