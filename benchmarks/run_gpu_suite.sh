#!/usr/bin/env bash
# The GPU suite: every test marked gpu/multigpu/te/sglang/ray, then every benchmark; results into OUT_DIR.
#   bash benchmarks/run_gpu_suite.sh OUT_DIR [extra pytest args for the benchmarks, e.g. -k lm_head]
# Writes OUT_DIR/env.json (redline env --json), OUT_DIR/gpu-tests.xml + .log, OUT_DIR/<bench>.json, and a
# markdown table + PNG per benchmark file (redline bench report). Exits non-zero if any test or benchmark failed.
set -uo pipefail
out=${1:?usage: run_gpu_suite.sh OUT_DIR [pytest args]}
shift
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
status=0
redline env --json > "$out/env.json" || status=1
python3 -m pytest tests -m "gpu or multigpu or te or sglang or ray" -q --junitxml="$out/gpu-tests.xml" \
    2>&1 | tee "$out/gpu-tests.log" || status=1
for bench in benchmarks/bench_*.py; do
    name=$(basename "$bench" .py)
    python3 -m pytest "$bench" -q --benchmark-json="$out/$name.json" "$@" 2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 5 ]; then   # every benchmark in the file deselected: pytest-benchmark leaves an empty file
        rm -f "$out/$name.json"
    elif [ "$rc" -ne 0 ]; then
        status=1
    fi
done
if ls "$out"/bench_*.json >/dev/null 2>&1; then
    redline bench report "$out" || status=1
fi
exit $status
