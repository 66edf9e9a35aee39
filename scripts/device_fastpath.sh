#!/usr/bin/env bash
# One device call for the fast path's host cost ([R]) on the final tree: build every CUDA module, the
# whole tests/gpu (while the baseline tree's modules build beside it), the cold / warm differential
# and edge tests over the CUDA routes, then the overhead A/B (benchmarks/bench_overhead.py of THIS
# tree run against both packages, so both have the same arms: op_inference and custom_op too) and
# scripts/fast_path_pieces.py (each step of the decode fast path alone), and the A/B table of the
# host-mode differences (benchmarks/overhead_ab.py). Logs: $OUT, every one also in $OUT/logs.tgz.
#   BASE=.ab_base/base bash scripts/device_fastpath.sh          (carry .ab_base and .whl)
# GPU_TESTS=0 leaves tests/gpu out (a later call over the final tree runs it); SANITIZE=1 adds
# compute-sanitizer memcheck over every route (scripts/sanitize_routes.py).
set -uo pipefail
: "${BASE:?BASE must name a folder holding the baseline tree}"
BASE=$(cd "$BASE" && pwd) || exit 2
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format=%H > "$OUT/tree.txt" 2>/dev/null || true
stage build 200 python3 -m flashkda_ext build --backend cuda --all --parallel 16 --jobs 1
grep -E "flag test|^build:" "$OUT/build.log"
(cd "$BASE" && export FLASHKDA_EXT_CACHE_DIR=/tmp/fkda_cache_ab_base PYTHONPATH=$BASE:/tmp/site &&
  stage base_build 240 python3 -m flashkda_ext build --backend cuda --all --parallel 12 --jobs 1) &
base_pid=$!
if [ "${GPU_TESTS:-1}" = 1 ]; then
  stage gpu_tests 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -8
fi
stage differential 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fast_path_differential.py \
  tests/test_bad_input_edges.py tests/test_fast_path.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/differential.log" | tail -8
if [ "${SANITIZE:-0}" = 1 ]; then  # compute-sanitizer memcheck over every route
  stage memcheck 170 compute-sanitizer --tool memcheck --error-exitcode 7 python3 scripts/sanitize_routes.py
  grep -E "ERROR SUMMARY|[0-9]+ failed$|passed" "$OUT/memcheck.log" | tail -3
fi
wait "$base_pid"; tail -1 "$OUT/base_build.log"
BENCH=$PWD/benchmarks/bench_overhead.py
: > "$OUT/overhead.txt"
i=0
for arm in base change base change; do
  i=$((i + 1))
  if [ "$arm" = base ]; then dir=$BASE cache=/tmp/fkda_cache_ab_base; else dir=$PWD cache=$FLASHKDA_EXT_CACHE_DIR; fi
  (cd "$dir" && export FLASHKDA_EXT_CACHE_DIR=$cache PYTHONPATH=$dir:/tmp/site &&
    stage "overhead_${i}_$arm" 150 python3 "$BENCH" --no-plot --no-progress --out "$OUT/overhead_${i}_$arm.json")
  { echo "-- run $i $arm"; grep -E "validate_dispatch" "$OUT/overhead_${i}_$arm.log"; } >> "$OUT/overhead.txt"
done
stage pieces 90 python3 scripts/fast_path_pieces.py
cat "$OUT/pieces.log"
python3 benchmarks/overhead_ab.py "$OUT"/overhead_{1_base,2_change,3_base,4_change}.json | tee "$OUT/overhead_ab.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.txt *.json 2>/dev/null)
