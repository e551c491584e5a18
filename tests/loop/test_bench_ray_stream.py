"""benchmarks/bench_ray_stream.py on the CPU: both stream settings and every reader time, each answer delivered."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ray_stream.py"


@pytest.mark.ray
@pytest.mark.slow
def test_both_settings_stream_every_answer_and_the_table_reports_them(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'redline[ray]')")
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--answers", "40", "--spread-ms", "20",
                    "--score-ms", "0,0.2", "--repeats", "2"], check=True, timeout=600)
    report = json.loads((tmp_path / "ray-stream.json").read_text())
    rows = report["results"]
    assert [(r["backlog"], r["score_ms"]) for r in rows] == [(-1, 0.0), (1, 0.0), (-1, 0.2), (1, 0.2)]
    for row in rows:
        assert len(row["after_last_answer_ms"]) == 2 and row["median_after_last_answer_ms"] > -20
        assert 1 <= row["chunks_per_rollout"] <= 40  # every answer in some chunk, never more chunks than answers
    assert (tmp_path / "environment.json").exists() and "| 0.2 |" in (tmp_path / "ray-stream.md").read_text()
