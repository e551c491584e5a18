"""benchmarks/offload_train_acceptance.py end to end at the tiny model's size: both runs, the summary's rows."""

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_the_acceptance_script_runs_both_modes_and_summarises_them(tmp_path):
    out = tmp_path / "acceptance"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload_train_acceptance.py"), str(out),
                           "--shapes", "tiny", "--steps", "2", "--config", str(ROOT / "examples" / "quickstart.toml")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "summary.json").read_text())
    plain, offload = results["tiny-no-offload-train"], results["tiny-offload-train"]
    assert plain["ok"] and plain["medians"]["steps"] == 2 and plain["medians"]["perf/sync_time"] > 0
    assert plain["transition_s"] >= plain["medians"]["perf/sync_time"]
    if torch.cuda.is_available():
        assert offload["ok"] and offload["medians"]["perf/pause_train_time"] > 0
    else:  # refused at start-up, naming the flag and what is missing
        assert not offload["ok"] and "--offload-train" in offload["error"] and "CUDA GPU" in offload["error"]
    summary = (out / "summary.md").read_text()
    assert "| tiny-no-offload-train `--no-offload-train` | yes |" in summary
