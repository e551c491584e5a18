#!/usr/bin/env bash
# Issue 16's colocated-sync acceptance from the loop's own metrics, in one command:
#   benchmarks/loop_sync_check.sh OUTDIR
# Qwen3-1.7B shape (examples/qwen3_1p7b_breakdown.toml, random weights, --backend bf16), --offload-rollout, a few
# RL steps each: the embedded engine in its own process reading the bf16 trainer's flat compute buffer in place
# (shared, the default there), the same with --check-weights (every row checked), copying zero-copy out of that
# buffer (REDLINE_SYNC_SHARE=0) and over the pipelined protocol (REDLINE_SYNC_ZERO_COPY=0); the in-process engine
# beside them (shared, the default, and staged pack + load). Also one contiguous device-to-device copy of the
# model's sync bytes, measured in the same run. Writes OUTDIR/<run>/
# (metrics.jsonl, report.md, phase_times.png), OUTDIR/copy.json and OUTDIR/summary.md: perf/update_weights_time
# and its phases per step, the sync phase over the copy, and the targets (sync phase <= 2x the copy, whole
# perf/update_weights_time <= 15 ms). Exit status 1 when a run misses a target.
# Overrides (e.g. for a CPU smoke run): CONFIG, MODEL_NAME (built-in model), STEPS, EXTRA (more flags).
set -euo pipefail
OUT=${1:?usage: benchmarks/loop_sync_check.sh OUTDIR}
CONFIG=${CONFIG:-examples/qwen3_1p7b_breakdown.toml}
MODEL_NAME=${MODEL_NAME:-qwen3-1.7b}
STEPS=${STEPS:-6}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
[ -f "$OUT/model/config.json" ] || $PY "$HERE/loop_sync_check.py" model "$OUT/model" "$MODEL_NAME"
$PY "$HERE/loop_sync_check.py" copy "$OUT/model" "$OUT/copy.json"

train() {  # name, env assignments..., -- flags...
  local name=$1; shift
  env COLUMNS=200 "$@" $PY -m redline.cli train "$CONFIG" --hf-checkpoint "$OUT/model" --num-rollout "$STEPS" \
    --backend bf16 --offload-rollout --output-dir "$OUT/$name" ${EXTRA:-} ${FLAGS[@]+"${FLAGS[@]}"} \
    > "$OUT/$name.log" 2>&1 || { echo "run $name failed; see $OUT/$name.log" >&2; tail -20 "$OUT/$name.log" >&2; exit 2; }
  grep -m1 "weight sync:" "$OUT/$name.log" || true
}
FLAGS=(--embedded-engine-process); train process
FLAGS=(--embedded-engine-process --check-weights); train process-check-weights
FLAGS=(--embedded-engine-process); train process-zero-copy REDLINE_SYNC_SHARE=0
FLAGS=(--embedded-engine-process); train process-pipelined REDLINE_SYNC_ZERO_COPY=0
FLAGS=(); train in-process
FLAGS=(); train in-process-staged REDLINE_SYNC_SHARE=0 REDLINE_IN_PROCESS_SYNC=staged
$PY "$HERE/loop_sync_check.py" summary "$OUT"
