#!/usr/bin/env bash
# Issue 18's Ray overhead on one GPU, every run pinned to the same CPUs, in one sitting:
#
#   bash benchmarks/ray_overhead_sitting.sh OUT      # from the repository root, Ray installed
#
# The 50M quickstart's step is bound by the host, and unpinned runs of the same code differed by up to 45 %
# (results/loop/ray-h200/one-gpu-5a4425c/). Here the runs get every hardware thread of the first half of the
# physical cores (RAY_CPUS overrides, taskset syntax); OUT/spare-cpus names the rest, where the sitting's own work
# (copying SGLang's parts, installing it) goes meanwhile: taskset -c "$(cat OUT/spare-cpus)" ...
# 1. OUT/machine.txt: which CPUs share a core (lscpu), the GPU (nvidia-smi);
# 2. the in-process embedded engine, 4 alternating repeats of 30 steps with and without Ray (OUT/embedded/);
#    a line "embedded done" in OUT/timeline.txt when they end;
# 3. SGLang, 3 repeats (OUT/sglang/): with SGLANG_INSTALL=path/to/install.sh (stage.py's, its parts already in
#    /tmp/stage/sglang/) the script installs SGLang itself once the embedded runs end; without it, it waits for
#    OUT/sglang-ready, which whoever installs SGLang makes. Never install while runs start: SGLang's install
#    replaced tokenizers under a starting run's imports (results/loop/ray-h200/direct-sglang-53aec28/).
# --rollout-manager under Ray: RAY_MANAGER for the embedded runs (default rank; the actor, which relays every
# engine call through the rank, was measured in results/loop/ray-h200/pinned-b0e127b/), RAY_MANAGER_SGLANG for the
# SGLang runs (default actor: since 4e8ed67 it is the servers' HTTP client itself, with no relay; unmeasured).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/ray_overhead_sitting.sh OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/sitting_parts.sh

read -r RUN_CPUS SPARE_CPUS < <(python3 - <<'PY'
import os
import subprocess

cores = {}
for line in subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True).stdout.splitlines():
    if line and not line.startswith("#"):
        cpu, core, socket = (int(v or 0) for v in line.split(","))
        if cpu in os.sched_getaffinity(0):
            cores.setdefault((socket, core), []).append(cpu)
keys = sorted(cores)
run = sorted(c for k in keys[: len(keys) // 2] for c in cores[k])
spare = sorted(c for k in keys[len(keys) // 2:] for c in cores[k])
print(",".join(map(str, run)), ",".join(map(str, spare)))
PY
)
RUN_CPUS=${RAY_CPUS:-$RUN_CPUS}
echo "$SPARE_CPUS" > "$OUT/spare-cpus"
{ echo "runs pinned to CPUs $RUN_CPUS; spare CPUs $SPARE_CPUS"; lscpu -e; lscpu; nvidia-smi; } > "$OUT/machine.txt" 2>&1

MANAGER=${RAY_MANAGER:-rank}
part 1-embedded 0 python3 benchmarks/ray_acceptance.py "$OUT/embedded" --engines embedded --repeats 4 \
  --num-rollout 30 --cpus "$RUN_CPUS" --rollout-manager "$MANAGER"
echo "$(date -u +%T) embedded done" >> "$OUT/timeline.txt"
if [ -n "${SGLANG_INSTALL:-}" ]; then
  part 2-sglang-install 0 bash "$SGLANG_INSTALL"  # a failed install shows in its log and in the runs' own
  touch "$OUT/sglang-ready"
fi
while [ ! -e "$OUT/sglang-ready" ]; do sleep 2; done
part 3-sglang 0 python3 benchmarks/ray_acceptance.py "$OUT/sglang" --engines sglang --repeats 3 --num-rollout 30 \
  --cpus "$RUN_CPUS" --rollout-manager "${RAY_MANAGER_SGLANG:-actor}"
echo "$(date -u +%T) done" >> "$OUT/timeline.txt"
