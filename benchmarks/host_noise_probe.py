"""How much a host-bound process's speed varies from one process to the next on this machine, without redline.

    python3 benchmarks/host_noise_probe.py OUT.json [--processes 12] [--cpus 0-7]

The 50M quickstart's RL step is bound by the host, and the same code's step differs by 25-45 % between runs
(results/loop/ray-h200/). This starts ``--processes`` fresh Python processes one after another (pinned to
``--cpus`` when given) and times three host-bound things in each: a pure-Python loop (µs per 1000 iterations),
CUDA kernel launches without a wait (µs each) and launch + ``.item()`` round trips (µs each), the GPU's SM clock
read through NVML beside them. If these differ between processes as the step does, the step's run-to-run spread is
the machine's, not the code's. Writes OUT.json: every process's numbers and each one's spread (max - min) / median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_acceptance import cpu_set, pinned  # noqa: E402  (a script beside this one)

PROBE = """
import json, time, torch
import pynvml
x = torch.zeros(1, device="cuda")
for _ in range(2000):
    x.add_(1)
torch.cuda.synchronize()
began = time.perf_counter()
for _ in range(20000):
    x.add_(1)
torch.cuda.synchronize()
launch = (time.perf_counter() - began) / 20000 * 1e6
began = time.perf_counter()
for _ in range(2000):
    x.add_(1)
    x.item()
round_trip = (time.perf_counter() - began) / 2000 * 1e6
began = time.perf_counter()
total = 0
for i in range(2_000_000):
    total += i * i
python = (time.perf_counter() - began) / 2000 * 1e6
pynvml.nvmlInit()
clock = pynvml.nvmlDeviceGetClockInfo(pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_CLOCK_SM)
print(json.dumps({"launch_us": launch, "round_trip_us": round_trip, "python_us_per_1000": python,
                  "sm_clock_mhz": clock}))
"""
KEYS = ("launch_us", "round_trip_us", "python_us_per_1000", "sm_clock_mhz")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--processes", type=int, default=12)
    parser.add_argument("--cpus", default=None, help="pin every process to these CPUs (taskset list: 0-7)")
    args = parser.parse_args()
    try:
        cpus = cpu_set(args.cpus) if args.cpus else None
    except ValueError as exc:
        parser.error(str(exc))
    runs = []
    for _ in range(args.processes):
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                              preexec_fn=pinned(cpus))
        runs.append(json.loads(done.stdout.splitlines()[-1]))
        print(runs[-1], flush=True)
    spread = {k: (max(r[k] for r in runs) - min(r[k] for r in runs)) / statistics.median(r[k] for r in runs)
              for k in KEYS}
    args.out.write_text(json.dumps({"cpus": args.cpus, "processes": runs, "spread": spread}, indent=1) + "\n")
    print("spread (max - min) / median:", {k: f"{v:.1%}" for k, v in spread.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
