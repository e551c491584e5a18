"""benchmarks/host_noise_probe.py: fresh processes, each timing host-bound work; their spread in OUT.json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_noise_probe.py"


def test_bad_cpus_are_refused_before_any_process_starts(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "out.json"), "--cpus", "0-x"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "--cpus '0-x': expected a list like 0-7" in done.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.gpu
def test_every_process_is_timed_and_the_spread_is_over_them(tmp_path):
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--processes", "2", "--cpus", "0"], check=True,
                   timeout=300)
    report = json.loads(out.read_text())
    assert len(report["processes"]) == 2 and report["cpus"] == "0"
    for process in report["processes"]:
        assert process["launch_us"] > 0 and process["round_trip_us"] > process["launch_us"] / 2
        assert process["python_us_per_1000"] > 0 and process["sm_clock_mhz"] > 0
    assert set(report["spread"]) == {"launch_us", "round_trip_us", "python_us_per_1000", "sm_clock_mhz"}
    assert all(v >= 0 for v in report["spread"].values())
