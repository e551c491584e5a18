#!/usr/bin/env bash
# Issue 20's acceptance in one sitting on one GPU (an H200): redline-sglang, trl-vllm, trl and redline-embedded,
# each 10 measured steps after 2 warm-up, one after the other (bench_e2e.py, one invocation per trainer so each
# has its own timeout) into one folder. The whole sitting takes ~40 min, past the GPU machine's 10-minute command
# limit, so the trainers run detached and the same command is repeated until it prints "sitting done":
#
#   bash benchmarks/e2e_sitting.sh /tmp/e2e-sitting [DEST]
#
# Each call starts the sitting if it is neither running nor done, follows its log for up to WAIT_S seconds
# (default 540), then packs what is there into DEST (default $OUT when set): e2e.md, sitting.log and
# e2e-sitting.tgz (every result, config, log and metrics file under 16 MiB). Order: the issue's headline ratios
# first (redline-sglang against both TRL paths), the embedded engine last.
#
# Before the first call: redline installed (python3 -m pip install --no-deps --no-build-isolation -e .), the
# sglang and trl bundles installed, the vllm bundle for trl-vllm (benchmarks/stage_peers.py; benchmarks/README.md). A
# trainer that cannot run is recorded as skipped with its reason. Keep the working tree as it is while it runs:
# every trainer process imports redline and the benchmark from it.
#
# Settings (environment): TRAINERS, SHAPES (qwen3-1.7b), STEPS (10), WARMUP (2), TIMEOUT_REDLINE_SGLANG (900 s),
# TIMEOUT_TRL_VLLM (1200), TIMEOUT_TRL (1500), TIMEOUT_REDLINE_EMBEDDED (900), TRL_VLLM_PYTHON
# (/tmp/venv-vllm/bin/python3, stage_peers.py's venv), BENCH_ARGS (more bench_e2e.py flags), WAIT_S.
# Timeouts: the 2026-11-24 H200 sitting's step times (redline-sglang 33 s, embedded 42 s, TRL 69 s) times 12,
# plus start-up and a margin; a trainer stopped by its timeout keeps the steps it finished.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:?usage: bash benchmarks/e2e_sitting.sh DIR [DEST]}
DEST=${2:-${OUT:-}}
TRAINERS=${TRAINERS:-redline-sglang trl-vllm trl redline-embedded}
SHAPES=${SHAPES:-qwen3-1.7b}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
TRL_VLLM_PYTHON=${TRL_VLLM_PYTHON:-/tmp/venv-vllm/bin/python3}
WAIT_S=${WAIT_S:-540}

timeout_of() {  # seconds one trainer may run: TIMEOUT_<TRAINER, upper case, - as _>
  local var="TIMEOUT_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  local -A default=([redline-sglang]=900 [trl-vllm]=1200 [trl]=1500 [redline-embedded]=900)
  echo "${!var:-${default[$1]:-900}}"
}

run_sitting() {  # the detached part: every trainer, one after the other
  cd "$ROOT" || exit 1
  export PYTHONUNBUFFERED=1
  mkdir -p "$DIR/e2e"
  nvidia-smi > "$DIR/e2e/gpu.txt" 2>&1
  python3 -m pip list > "$DIR/e2e/pip.txt" 2>&1
  [ -x "$TRL_VLLM_PYTHON" ] && "$TRL_VLLM_PYTHON" -m pip list > "$DIR/e2e/pip-trl-vllm.txt" 2>&1
  for trainer in $TRAINERS; do
    limit=$(timeout_of "$trainer")
    echo "== $(date -u +%T) $trainer: $STEPS steps after $WARMUP warm-up, timeout ${limit} s"
    # the outer timeout only guards bench_e2e.py itself (model build, report); the trainer has --trainer-timeout
    timeout --kill-after=60 $((limit + 600)) python3 benchmarks/bench_e2e.py "$DIR/e2e" --shapes "$SHAPES" \
      --trainers "$trainer" --steps "$STEPS" --warmup "$WARMUP" --trainer-timeout "$limit" \
      --trl-vllm-python "$TRL_VLLM_PYTHON" ${BENCH_ARGS:-}
    status=$?
    echo "== $(date -u +%T) $trainer: exit $status; processes still on the GPU:"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
  done
  echo "== $(date -u +%T) sitting done"
  touch "$DIR/done"
}

pack() {  # what comes back: the table, the log, and every small result file in one archive
  [ -n "$DEST" ] || return 0
  mkdir -p "$DEST"
  cp "$DIR/sitting.log" "$DEST/" 2>/dev/null
  cp "$DIR/e2e/e2e.md" "$DEST/" 2>/dev/null
  (cd "$DIR" && find e2e -type f -size -16M \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' \
    -o -name '*.txt' -o -name '*.toml' -o -name '*.log' -o -name '*.gz' \) -print0 |
    tar czf "$DEST/e2e-sitting.tgz" --null -T -)
}

if [ "$DIR" = "__run" ]; then  # re-entry of the detached runner: bash e2e_sitting.sh __run DIR
  DIR=$2
  run_sitting
  exit 0
fi

mkdir -p "$DIR"
if [ ! -e "$DIR/done" ] && ! { [ -f "$DIR/sitting.pid" ] && kill -0 "$(cat "$DIR/sitting.pid")" 2>/dev/null; }; then
  # a new process session outlives the command that started it (the GPU machine ends a command's processes)
  setsid nohup env TRAINERS="$TRAINERS" SHAPES="$SHAPES" STEPS="$STEPS" WARMUP="$WARMUP" \
    TRL_VLLM_PYTHON="$TRL_VLLM_PYTHON" bash "${BASH_SOURCE[0]}" __run "$DIR" >> "$DIR/sitting.log" 2>&1 < /dev/null &
  echo $! > "$DIR/sitting.pid"
  echo "started the sitting in $DIR (pid $(cat "$DIR/sitting.pid")): $TRAINERS"
fi
deadline=$((SECONDS + WAIT_S))
shown=0
while :; do
  lines=$(wc -l < "$DIR/sitting.log" 2>/dev/null || echo 0)
  [ "$lines" -gt "$shown" ] && sed -n "$((shown + 1)),${lines}p" "$DIR/sitting.log" && shown=$lines
  [ -e "$DIR/done" ] && break
  [ $SECONDS -ge $deadline ] && { echo "still running; run the same command again"; break; }
  sleep 10
done
pack
