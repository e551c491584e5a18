#!/usr/bin/env bash
# One 2-GPU sitting (2x H200) for what two GPUs can measure of issues 17 and 18:
#
#   bash benchmarks/two_gpu_sitting.sh OUT       # from the repository root (NCCL multicast off, set below)
#
# 0. the random-weight Qwen3-8B model and its 8-layer slice, made once (OUT/p17/models);
# 1. issue 17's train-phase scaling on the slice with the current defaults (no async TP, the LM-head-balanced
#    stage split, the sequence-parallel backward's reduce-scatter under the dW GEMM): 64 prompts x 8, one
#    optimizer step per rollout, each run's last step traced; TP=1 on one GPU, then TP=2 + SP and PP=2 on both;
# 2. once Ray is installed (the operator's install call ends with `touch OUT/ray-ready`): issue 18's disaggregated placement under Ray (the trainer on
#    GPU 0, an embedded engine process on GPU 1 in a bundle of its own), 3 alternating repeats with and without Ray.
# Each part writes OUT/<dir>/ and OUT/<part>.log, and a line per start and end in OUT/timeline.txt; a part that
# fails does not stop the others.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/two_gpu_sitting.sh OUT}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1 PYTHONUNBUFFERED=1
source benchmarks/sitting_parts.sh
SCALING="--rollout-batch-size 64 --global-batch-size 512 --num-steps-per-rollout 1"

part 0-models 0,1 slice_models "$OUT/p17"
for run in slice-tp1 slice-tp2-sp slice-pp2; do  # the script plans with both GPUs visible; slice-tp1 uses one
  part "1-$run" 0,1 python3 benchmarks/parallel_acceptance.py "$OUT/p17" --engine embedded --steps 6 --profile \
    --extra="$SCALING" --only "$run"
done
CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/parallel_acceptance.py "$OUT/p17" --report-only --engine embedded \
  > "$OUT/1-report.log" 2>&1

while [ ! -e "$OUT/ray-ready" ]; do sleep 5; done
part 2-18-ray-disaggregated 0,1 python3 benchmarks/ray_acceptance.py "$OUT/p18-disaggregated" \
  --engines disaggregated --repeats 3 --num-rollout 30
echo "$(date -u +%T) done" >> "$OUT/timeline.txt"
