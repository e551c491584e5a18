# Shared by the benchmarks/*_sitting.sh drivers (source it after setting OUT):
#   part NAME GPUS command...   one part on CUDA_VISIBLE_DEVICES=GPUS, its output in OUT/NAME.log, a start and an
#                               end line (with the exit code) in OUT/timeline.txt; a failed part stops nothing
#   slice_models DIR            the random-weight Qwen3-8B model and its 8-layer slice (parallel_acceptance.py's),
#                               made once into DIR/models
part() {
  local name=$1 gpus=$2; shift 2
  echo "$(date -u +%T) start $name on GPUs $gpus" >> "$OUT/timeline.txt"
  CUDA_VISIBLE_DEVICES=$gpus "$@" > "$OUT/$name.log" 2>&1
  echo "$(date -u +%T) end $name (exit $?)" >> "$OUT/timeline.txt"
}

slice_models() {
  python3 - "$1" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import parallel_acceptance as pa
pa.make_models(pa.model_dirs(Path(sys.argv[1]), pa.MODEL, 8), pa.MODEL, 8, {"full", "slice"}, "bfloat16")
PY
}
