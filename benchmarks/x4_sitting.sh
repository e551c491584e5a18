#!/usr/bin/env bash
# One 4x H200 sitting for what is left of the GPU acceptance of issues 17, 16 and 18, the four GPUs kept busy:
#
#   bash benchmarks/x4_sitting.sh OUT            # from the repository root (NCCL multicast off, set below)
#
# 0. the random-weight Qwen3-8B model and its 8-layer slice, made once (OUT/p17/models, linked where needed);
# 1. all four GPUs, embedded engine, the current defaults (no async TP, the LM-head-balanced stage split): issue
#    17's TP=4 + SP and PP=2 x TP=2 on the 8B shape, 10 steps, and the slice at TP=4 + SP; then the slice's
#    scaling at 64 prompts x 8, one optimizer step per rollout, each run's last step traced: GPUs 2,3 TP=1 then
#    PP=2 (6 + 2), GPUs 0,1 TP=2 + SP, then TP=2 + SP with async TP (--tp-comm-overlap) for comparison;
# 2. once SGLang and Ray are installed (the file OUT/sglang-ready): GPU 3 issue 18's Ray overhead (3 alternating
#    repeats, embedded engine and SGLang); GPUs 0,1 issue 18's disaggregated placement under Ray. (Issue 16's 4B
#    runs need one GPU to themselves: benchmarks/one_gpu_sitting.sh.)
# Each part writes OUT/<dir>/ and OUT/<part>.log, and a line per start and end in OUT/timeline.txt; a part that
# fails does not stop the others. The sitting of 2026-11-28 ran an earlier form of this script
# (benchmarks/results/loop/parallel-h200x4/README.md).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/x4_sitting.sh OUT}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1 PYTHONUNBUFFERED=1
PA=(python3 benchmarks/parallel_acceptance.py)
SCALING="--rollout-batch-size 64 --global-batch-size 512 --num-steps-per-rollout 1"
source benchmarks/sitting_parts.sh

scaling() {  # scaling NAME GPUS DIR RUN [flags]: one slice run of part 1 into OUT/DIR
  local name=$1 gpus=$2 dir=$3 run=$4; shift 4
  part "$name" "$gpus" "${PA[@]}" "$OUT/$dir" --engine embedded --steps 6 --profile --extra="$SCALING $*" --only "$run"
}

part 0-models 0,1,2,3 slice_models "$OUT/p17"
for dir in p17scaling p17scaling-async-tp; do
  mkdir -p "$OUT/$dir"; ln -sfn "$OUT/p17/models" "$OUT/$dir/models"
done

part 1-four-gpus 0,1,2,3 "${PA[@]}" "$OUT/p17" --engine embedded --steps 10 \
  --only tp4-sp-embedded1,pp2-tp2-sp-embedded1
scaling 1-tp4 0,1,2,3 p17scaling slice-tp4-sp
( scaling 1-tp1 2,3 p17scaling slice-tp1
  scaling 1-pp2 2,3 p17scaling slice-pp2 ) &
( scaling 1-tp2 0,1 p17scaling slice-tp2-sp
  scaling 1-tp2-async-tp 0,1 p17scaling-async-tp slice-tp2-sp --tp-comm-overlap ) &
wait
cp "$OUT/p17scaling/slice-tp1.result.json" "$OUT/p17scaling-async-tp/"
for dir in p17scaling p17scaling-async-tp; do
  CUDA_VISIBLE_DEVICES=0,1,2,3 "${PA[@]}" "$OUT/$dir" --report-only --engine embedded > "$OUT/1-report-$dir.log" 2>&1
done

while [ ! -e "$OUT/sglang-ready" ]; do sleep 5; done
part 2-18-ray 3 python3 benchmarks/ray_acceptance.py "$OUT/p18" --engines embedded,sglang --repeats 3 \
  --num-rollout 30 &
part 2-18-ray-disaggregated 0,1 python3 benchmarks/ray_acceptance.py "$OUT/p18-disaggregated" \
  --engines disaggregated --repeats 3 --num-rollout 30 &
wait
echo "$(date -u +%T) done" >> "$OUT/timeline.txt"
