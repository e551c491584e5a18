#!/usr/bin/env bash
# One 4x H200 sitting for the GPU acceptance of issues 17, 16 and 18, the four GPUs kept busy in parallel lanes:
#
#   bash benchmarks/x4_sitting.sh OUT            # from the repository root, NCCL multicast off (set below)
#
# 1. all four GPUs, embedded engine: 17's TP=4 + SP and PP=2 x TP=2 on the Qwen3-8B shape, and the TP=4 + SP
#    train-phase scaling run on the 8-layer slice (parallel_acceptance.py);
# 2. lane GPUs 0,1: the slice at TP=1 (GPU 0) and TP=2 + SP, traced (--profile), 64 prompts x 8 per rollout;
#    then, once SGLang is installed, 17's TP=2 + SP trainer with a TP=2 SGLang engine on the 8B shape, 10 steps;
#    lane GPUs 2,3 at the same time: the slice at PP=2 with the default stage split (the LM head counted) and
#    with the even 4 + 4 split; then, once SGLang is installed, GPU 2: 16's colocated SGLang acceptance (1.7B,
#    then the 4B transition with --offload-train), GPU 3: 18's Ray overhead (3 alternating repeats).
# SGLang-dependent parts wait for the file OUT/sglang-ready (the install step of the staging creates it) and are
# skipped, saying so, when SGLang cannot be imported after it. Each part writes under OUT/<part>/ and its log
# OUT/<part>.log; a part that fails does not stop the others.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/x4_sitting.sh OUT}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1 PYTHONUNBUFFERED=1
PA=(python3 benchmarks/parallel_acceptance.py)
BIG="--rollout-batch-size 64 --global-batch-size 256"

part() {  # part NAME CUDA_VISIBLE_DEVICES command...: one part, timed, logged
  local name=$1 gpus=$2; shift 2
  echo "$(date -u +%T) start $name on GPUs $gpus" >> "$OUT/timeline.txt"
  CUDA_VISIBLE_DEVICES=$gpus "$@" > "$OUT/$name.log" 2>&1
  echo "$(date -u +%T) end $name (exit $?)" >> "$OUT/timeline.txt"
}

wait_for_sglang() {  # true once SGLang is installed and imports
  while [ ! -e "$OUT/sglang-ready" ]; do sleep 5; done
  python3 -c "import sglang" 2>/dev/null || { echo "$(date -u +%T) sglang does not import: skipped" \
    >> "$OUT/timeline.txt"; return 1; }
}

part 17-four-gpus 0,1,2,3 "${PA[@]}" "$OUT/p17" --engine embedded --steps 10 \
  --only tp4-sp-embedded1,pp2-tp2-sp-embedded1
part 17-slice-tp4 0,1,2,3 "${PA[@]}" "$OUT/p17slice" --engine embedded --steps 6 --profile --extra "$BIG" \
  --only slice-tp4-sp

(  # lane GPUs 0,1
  part 17-slice-tp1 0,1 "${PA[@]}" "$OUT/p17slice" --engine embedded --steps 6 --profile --extra "$BIG" \
    --only slice-tp1
  part 17-slice-tp2 0,1 "${PA[@]}" "$OUT/p17slice" --engine embedded --steps 6 --profile --extra "$BIG" \
    --only slice-tp2-sp
  wait_for_sglang && part 17-tp2-sglang 0,1 "${PA[@]}" "$OUT/p17" --engine sglang --steps 10 --only tp2-sp-sglang2
) &
(  # lane GPUs 2,3; the slice model is made by the TP=1 part before its run starts (its log): wait for it
  while [ ! -e "$OUT/p17slice/slice-tp1.log" ]; do sleep 5; done
  mkdir -p "$OUT/p17slice-even-split/models"
  ln -sfn "$OUT/p17slice/models/qwen3-8b-8-layers" "$OUT/p17slice-even-split/models/qwen3-8b-8-layers"
  part 17-slice-pp2 2,3 "${PA[@]}" "$OUT/p17slice" --engine embedded --steps 6 --profile --extra "$BIG" \
    --only slice-pp2
  part 17-slice-pp2-even 2,3 "${PA[@]}" "$OUT/p17slice-even-split" --engine embedded --steps 6 --profile \
    --extra "$BIG --decoder-first-pipeline-num-layers 4" --only slice-pp2
  if wait_for_sglang; then
    ( part 16-sglang-1.7b 2 bash benchmarks/sglang_colocated_acceptance.sh "$OUT/p16" 1.7b
      part 16-sglang-4b 2 bash benchmarks/sglang_colocated_acceptance.sh "$OUT/p16" 4b ) &
    part 18-ray 3 python3 benchmarks/ray_acceptance.py "$OUT/p18" --engines embedded,sglang --repeats 3 \
      --num-rollout 30
    wait
  fi
) &
wait
# the reports over every run with a result (one per engine naming: embedded, then SGLang)
for engine in embedded sglang; do
  "${PA[@]}" "$OUT/p17" --report-only --engine "$engine" > "$OUT/17-report-$engine.log" 2>&1
  cp "$OUT/p17/acceptance.md" "$OUT/p17/acceptance-$engine.md"; cp "$OUT/p17/acceptance.json" "$OUT/p17/acceptance-$engine.json"
done
cp "$OUT/p17slice/slice-tp1.result.json" "$OUT/p17slice-even-split/"
for dir in p17slice p17slice-even-split; do
  "${PA[@]}" "$OUT/$dir" --report-only --engine embedded > "$OUT/17-report-$dir.log" 2>&1
done
echo "$(date -u +%T) done" >> "$OUT/timeline.txt"
