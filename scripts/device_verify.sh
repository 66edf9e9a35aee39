#!/usr/bin/env bash
# GPU check and first measurement of kda_verify and fused_kda_verify (issue 30) on a lent H200 (device tool): builds the
# verify modules (and the decode twins the tests compare with), runs tests/gpu/test_verify_gpu.py and test_fused_verify_gpu.py,
# compute-sanitizer over the verify routes, then benchmarks/bench_verify.py (fla side by side when it
# is importable: carry its wheel in .whl/, see device_env.sh). Logs and results go to $OUT.
#
#   bash scripts/device_verify.sh            BENCH_ARGS="--quick" by default; BENCH_ARGS="" for the grid
#   BENCH_MODULES=tile,stage,stage16w4 ...   the candidate stems timed beside the routed module (default tile,split16,split8)
#   SANITIZE_ONLY=verify_pipe*,...            the modules compute-sanitizer launches (default every verify module)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage build 200 python3 -m flashkda_ext build --backend cuda --parallel 16 --jobs 1 'verify_*' 'fused_verify_*' \
  fused_row_f32_o32 fused_row_bf16_o32 \
  decode_split8_f32_o32 decode_split4w2_bf16_o32 decode_quartma_f32_o32 decode_split8_bf16_o32 \
  decode_quartmabulk_bf16_o32 decode_rowtma_bf16_o32
tail -2 "$OUT/build.log"
stage gpu_tests 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_verify_gpu.py tests/gpu/test_fused_verify_gpu.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -25
if [ "${SANITIZE:-1}" = 1 ]; then
  for t in memcheck racecheck synccheck; do
    stage "$t" 120 compute-sanitizer --tool "$t" --error-exitcode 7 python3 scripts/sanitize_routes.py --only "${SANITIZE_ONLY:-verify_*,fused_verify_*}"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ failed$|FAIL" "$OUT/$t.log" | head -4
  done
fi
stage bench 420 python3 benchmarks/bench_verify.py ${BENCH_ARGS---quick} --modules ${BENCH_MODULES:-tile,split16,split8} \
  --no-progress --out "$OUT"
grep -E "^(copy|summary|accuracy)|T=" "$OUT/bench.log" | tail -60
