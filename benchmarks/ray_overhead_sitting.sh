#!/usr/bin/env bash
# Issue 18's Ray overhead on one GPU, every run pinned to the same CPUs, in one sitting:
#
#   SGLANG_INSTALL=/tmp/stage/sglang-install.sh bash benchmarks/ray_overhead_sitting.sh OUT   # repository root,
#                                                                                             # Ray installed
#
# Whole runs of the same code differed by up to 45 % on the H200 guest (each process draws its own host speed), so
# three pairs of them cannot resolve 2 %. The sitting measures the step first with bench_ray_rollout.py --measure
# step, whose placements live in processes that stay up and take turns one RL step each (the differences paired per
# round), then the whole-run pairs of ray_acceptance.py as before. Every run gets every hardware thread of the first
# half of the physical cores (RAY_CPUS overrides, taskset syntax); OUT/spare-cpus names the rest, for the sitting's
# own work.
# 1. OUT/machine.txt: which CPUs share a core (lscpu), the GPU (nvidia-smi);
# 2. with SGLANG_INSTALL=path/to/install.sh (stage.py's, its parts already in /tmp/stage/sglang/), SGLang's install,
#    before any run: an install replaced tokenizers under a starting run's imports once
#    (results/loop/ray-h200/direct-sglang-53aec28/); without it, the SGLang parts wait for OUT/sglang-ready, which
#    whoever installs SGLang makes;
# 3. the step (OUT/step-embedded/, then OUT/step-sglang/: every placement pushing its weights to the one server in
#    its turn), then SGLang's rollout alone (OUT/rollout-sglang/): in-process, ray-rank and ray-actor, TURN_REPEATS
#    (default 4) repeats of TURN_ROUNDS (default 30) rounds;
# 4. whole-run pairs: the in-process embedded engine, EMBEDDED_REPEATS (default 4) alternating repeats of 30 steps
#    with and without Ray (OUT/embedded/, --rollout-manager RAY_MANAGER, default rank), then SGLang, SGLANG_REPEATS
#    (default 3) (OUT/sglang/, RAY_MANAGER_SGLANG, default actor: the servers' HTTP client itself).
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

if [ -n "${SGLANG_INSTALL:-}" ]; then
  part 0-sglang-install 0 bash "$SGLANG_INSTALL"  # a failed install shows in its log and in the runs' own
  touch "$OUT/sglang-ready"
fi
TURNS=(--rounds "${TURN_ROUNDS:-30}" --repeats "${TURN_REPEATS:-4}")
bench() { taskset -c "$RUN_CPUS" python3 benchmarks/bench_ray_rollout.py "$@" "${TURNS[@]}"; }
part 1-step-embedded 0 bench "$OUT/step-embedded" --measure step --engine embedded
while [ ! -e "$OUT/sglang-ready" ]; do sleep 2; done
part 2-step-sglang 0 bench "$OUT/step-sglang" --measure step --engine sglang
part 3-rollout-sglang 0 bench "$OUT/rollout-sglang" --measure rollout --engine sglang
echo "$(date -u +%T) paired benchmarks done" >> "$OUT/timeline.txt"
part 4-embedded 0 python3 benchmarks/ray_acceptance.py "$OUT/embedded" --engines embedded \
  --repeats "${EMBEDDED_REPEATS:-4}" --num-rollout 30 --cpus "$RUN_CPUS" --rollout-manager "${RAY_MANAGER:-rank}"
part 5-sglang 0 python3 benchmarks/ray_acceptance.py "$OUT/sglang" --engines sglang --repeats "${SGLANG_REPEATS:-3}" \
  --num-rollout 30 --cpus "$RUN_CPUS" --rollout-manager "${RAY_MANAGER_SGLANG:-actor}"
echo "$(date -u +%T) done" >> "$OUT/timeline.txt"
