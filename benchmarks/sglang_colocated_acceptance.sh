#!/usr/bin/env bash
# Issue 16's colocated-SGLang acceptance on one H100, from the loop's own metrics (offload_train_acceptance.py):
#
#   bash benchmarks/sglang_colocated_acceptance.sh OUTDIR [part]     # part: 1.7b | 4b-no-offload | 4b |
#                                                                    #       4b-keep-weights | all
#
# 1.7b          Qwen3-1.7B shape, SGLang colocated (examples/qwen3_1p7b_breakdown.toml, 16 prompts x 8 x 128 tokens),
#               the default --offload-train plan, 8 steps: perf/update_weights_time against SGLang's own handling
#               inside it (target <= 1.2x);
# 4b-no-offload Qwen3-4B shape (random weights, fp32 master weights + Adam with --optimizer-cpu-offload: its 72 GB
#               of state do not fit beside an engine on 80 GB), 64 prompts x 8 samples x 1024-token responses,
#               --no-offload-train, 2 steps: the KV cache SGLang gets when the trainer stays resident (its static
#               share 0.45: what fits beside the resident trainer);
# 4b            the same with --offload-train (the default plan; SGLang at its default share beside a paused
#               trainer, 0.7), 10 steps: per-phase times, the KV cache, the transition against the sync
#               alone (target <= 2x);
# 4b-keep-weights the same with --offload-rollout-level kv_cache: SGLang keeps its weights on the GPU while the
#               trainer works, so the push skips their release and resume.
# Each part adds its runs to OUTDIR/summary.md and summary.json. Needs SGLang 0.5.17 and redline's native library
# (the script builds it). The 4B run takes ~20 min on an H100: run it detached where a command is time-limited.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:?usage: bash benchmarks/sglang_colocated_acceptance.sh OUTDIR [1.7b|4b-no-offload|4b|all]}
PART=${2:-all}
case $PART in 1.7b|4b-no-offload|4b|4b-keep-weights|all) ;;
  *) echo "sglang_colocated_acceptance.sh: part '$PART' is not one of 1.7b, 4b-no-offload, 4b, 4b-keep-weights," \
       "all" >&2; exit 2 ;;
esac
ACCEPT=(python3 "$ROOT/benchmarks/offload_train_acceptance.py" "$OUT" --config "$ROOT/examples/qwen3_1p7b_breakdown.toml"
        --models "$OUT/models" --run-timeout 1800)
WORKLOAD_4B="--rollout-engine sglang --rollout-batch-size 64 --n-samples-per-prompt 8 --rollout-max-response-len 1024
             --rollout-ignore-eos --global-batch-size 512 --num-steps-per-rollout 1"
case $PART in 1.7b|all)
  "${ACCEPT[@]}" --shapes qwen3-1.7b --steps 8 --modes offload-train-auto --extra "--rollout-engine sglang" --tag=-sglang ;;
esac
case $PART in 4b-no-offload|all)
  "${ACCEPT[@]}" --shapes qwen3-4b --steps 2 --modes no-offload-train --tag=-sglang-e2e \
    --extra "$WORKLOAD_4B --sglang-mem-fraction-static 0.45" ;;
esac
case $PART in 4b|all)
  "${ACCEPT[@]}" --shapes qwen3-4b --steps 10 --modes offload-train-auto --tag=-sglang-e2e --extra "$WORKLOAD_4B" ;;
esac
case $PART in 4b-keep-weights|all)
  "${ACCEPT[@]}" --shapes qwen3-4b --steps 10 --modes offload-train-auto --tag=-sglang-e2e-keep-weights \
    --extra "$WORKLOAD_4B --offload-rollout-level kv_cache" ;;
esac
