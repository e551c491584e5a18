#!/usr/bin/env bash
# One 4x H200 sitting for the GPU acceptance of issues 17, 16 and 18, the four GPUs kept busy in parallel lanes:
#
#   bash benchmarks/x4_sitting.sh OUT            # from the repository root (NCCL multicast off, set below)
#
# 0. the random-weight Qwen3-8B model and its 8-layer slice, made once (OUT/p17/models, linked where needed);
# 1. train-phase scaling on the slice (64 prompts x 8, one optimizer step per rollout, each run's last step
#    traced): GPUs 2,3 TP=1 then PP=2 (the default stage split); GPUs 0,1 TP=2 + SP with async TP
#    (--tp-comm-overlap) then without it (the default);
# 2. once SGLang is installed (the file OUT/sglang-ready) and part 1 is done: GPUs 0,1 issue 17's TP=2 + SP trainer
#    with a TP=2 SGLang engine on the 8B shape, 10 steps (with async TP where part 1 measured it faster);
#    GPU 2 issue 16's 4B colocated SGLang transition with --offload-train; GPU 3 issue 18's Ray overhead.
# Each part writes OUT/<dir>/ and OUT/<part>.log, and a line per start and end in OUT/timeline.txt; a part that
# fails does not stop the others.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/x4_sitting.sh OUT}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1 PYTHONUNBUFFERED=1
PA=(python3 benchmarks/parallel_acceptance.py)
SCALING="--rollout-batch-size 64 --global-batch-size 512 --num-steps-per-rollout 1"

part() {  # part NAME CUDA_VISIBLE_DEVICES command...: one part, timed, logged
  local name=$1 gpus=$2; shift 2
  echo "$(date -u +%T) start $name on GPUs $gpus" >> "$OUT/timeline.txt"
  CUDA_VISIBLE_DEVICES=$gpus "$@" > "$OUT/$name.log" 2>&1
  echo "$(date -u +%T) end $name (exit $?)" >> "$OUT/timeline.txt"
}

scaling() {  # scaling NAME GPUS DIR RUN [flags]: one slice run of part 1 into OUT/DIR
  local name=$1 gpus=$2 dir=$3 run=$4; shift 4
  part "$name" "$gpus" "${PA[@]}" "$OUT/$dir" --engine embedded --steps 6 --profile --extra="$SCALING $*" --only "$run"
}

median_train() {  # the median train seconds of a part-1 run, or 1e9 when it has none
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['summary']['phases']['perf/train_time']['median_s'])" \
    "$1" 2>/dev/null || echo 1e9
}

part 0-models 0,1,2,3 python3 - "$OUT/p17" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import parallel_acceptance as pa
pa.make_models(pa.model_dirs(Path(sys.argv[1]), pa.MODEL, 8), pa.MODEL, 8, {"full", "slice"}, "bfloat16")
EOF
for dir in p17scaling p17scaling-async-tp; do
  mkdir -p "$OUT/$dir"; ln -sfn "$OUT/p17/models" "$OUT/$dir/models"
done

( scaling 1-tp1 2,3 p17scaling slice-tp1
  scaling 1-pp2 2,3 p17scaling slice-pp2 ) &
( scaling 1-tp2-async-tp 0,1 p17scaling-async-tp slice-tp2-sp --tp-comm-overlap
  scaling 1-tp2 0,1 p17scaling slice-tp2-sp ) &
wait
cp "$OUT/p17scaling/slice-tp1.result.json" "$OUT/p17scaling-async-tp/"
for dir in p17scaling p17scaling-async-tp; do
  CUDA_VISIBLE_DEVICES=0,1,2,3 "${PA[@]}" "$OUT/$dir" --report-only --engine embedded > "$OUT/1-report-$dir.log" 2>&1
done

while [ ! -e "$OUT/sglang-ready" ]; do sleep 5; done
OVERLAP=""
on=$(median_train "$OUT/p17scaling-async-tp/slice-tp2-sp.result.json")
off=$(median_train "$OUT/p17scaling/slice-tp2-sp.result.json")
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) else 1)" "$on" "$off" \
  && OVERLAP="--tp-comm-overlap"
echo "$(date -u +%T) train TP=2 slice: async TP $on s, without $off s -> '$OVERLAP'" >> "$OUT/timeline.txt"
part 2-tp2-sglang 0,1 "${PA[@]}" "$OUT/p17" --engine sglang --steps 10 --only tp2-sp-sglang2 --extra="$OVERLAP" &
part 2-16-4b 2 bash benchmarks/sglang_colocated_acceptance.sh "$OUT/p16" 4b &
part 2-18-ray 3 python3 benchmarks/ray_acceptance.py "$OUT/p18" --engines embedded,sglang --repeats 2 \
  --num-rollout 30 &
wait
echo "$(date -u +%T) done" >> "$OUT/timeline.txt"
