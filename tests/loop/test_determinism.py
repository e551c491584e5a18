"""Same seed, same machine, same result: two launches of one CPU run write identical records."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_train import QUICKSTART

# the quickstart, smaller: 20 RL steps with evaluations, a few seconds of compute each launch
FLAGS = ["--num-rollout", "20", "--rollout-batch-size", "10", "--n-samples-per-prompt", "8",
         "--global-batch-size", "80", "--sft-steps", "5", "--eval-interval", "10"]


def timing_free(record: dict) -> dict:
    """A record without what the clock measures (perf/*: phase times, throughput, GPU readings)."""
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


def launch(out: Path, hash_seed: str) -> list[dict]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}  # set and dict-of-str orders differ between launches
    done = subprocess.run([sys.executable, "-m", "redline.cli", "train", str(QUICKSTART), "--output-dir", str(out),
                           *FLAGS], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [timing_free(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU promise (loop/determinism.py)")
def test_two_launches_with_one_seed_are_bit_identical(tmp_path):
    first, second = launch(tmp_path / "a", "1"), launch(tmp_path / "b", "2")
    assert [r["step"] for r in first] == list(range(21))
    for a, b in zip(first, second):
        assert a == b, f"step {a['step']}: " + ", ".join(k for k in a if a[k] != b.get(k))
