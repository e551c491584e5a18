#!/usr/bin/env bash
# One single-GPU sitting (H100 or H200) for what one GPU can still measure of issues 16, 17 and 18:
#
#   bash benchmarks/one_gpu_sitting.sh OUT       # from the repository root, SGLang and Ray installed
#
# 0. redline's native library (the VMM allocator behind PausableMemory), built into build/native;
# 1. the GPU tests of what changed since the last sitting, beside the start-up of the next part (the model's
#    creation, SGLang's launch): issue 17's packed forward and backward without a device-to-host wait
#    (tests/trainer/test_seq_bounds.py), issue 16's pausable trainer state and colocated syncs;
# 2. issue 16's colocated-SGLang acceptance (benchmarks/sglang_colocated_acceptance.sh): the 1.7B update phase
#    against SGLang's handling (8 steps), then the 4B transition against the sync alone (10 steps), both with the
#    default --offload-train plan;
# 3. issue 18's Ray overhead on the 50M quickstart (benchmarks/ray_acceptance.py, RAY_ENGINES, default the
#    in-process embedded engine; 3 alternating repeats of 30 steps).
# Each part writes OUT/<dir>/ and OUT/<part>.log, and a line per start and end in OUT/timeline.txt; a part that
# fails does not stop the others.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/one_gpu_sitting.sh OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

source benchmarks/sitting_parts.sh

part 0-native 0 bash -c 'cmake -S . -B build/native -DCMAKE_BUILD_TYPE=Release && cmake --build build/native -j 8'
export REDLINE_NATIVE_LIBRARY=$PWD/build/native/libredline_native.so  # the pausable memory of the GPU tests
part 1-gpu-tests 0 python3 -m pytest -q -m gpu tests/trainer/test_seq_bounds.py tests/loop/test_train_offload.py \
  tests/loop/test_colocated_sync.py &
part 2-16-1.7b 0 bash benchmarks/sglang_colocated_acceptance.sh "$OUT/p16" 1.7b
wait
part 2-16-4b 0 bash benchmarks/sglang_colocated_acceptance.sh "$OUT/p16" 4b
part 3-18-ray 0 python3 benchmarks/ray_acceptance.py "$OUT/p18" --engines "${RAY_ENGINES:-embedded}" --repeats 3 \
  --num-rollout 30
echo "$(date -u +%T) done" >> "$OUT/timeline.txt"
