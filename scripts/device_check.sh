#!/usr/bin/env bash
# One full GPU check on a lent H200 (device tool): builds every CUDA module, runs the GPU tests, the
# selftest and compute-sanitizer over the routes. Logs go to $OUT (or ./device_out). Usage:
#   bash scripts/device_check.sh [pytest paths...]     (default: tests/gpu)
# SANITIZE=0 leaves the compute-sanitizer stages out (a quick re-check); MEMCHECK_ONLY / REPRESENTATIVE
# (module globs) narrow memcheck / racecheck + synccheck to the modules a change touched.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
# one module of each decode schedule and every prefill module: racecheck and synccheck are slow,
# memcheck covers every module
REPRESENTATIVE=${REPRESENTATIVE:-"decode_split8_f32_o32,decode_row_bf16_o64,decode_halftma_f32_o32,decode_rowtma_bf16_o64,decode_seq_f32_o32,decode_pair_f32_o32,decode_persist_f32_o32,decode_stream_f32_o32,prefill_*,fused_*_f32_o32"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage build 200 python3 -m flashkda_ext build --backend cuda --all --parallel 16 --jobs 1
tail -2 "$OUT/build.log"
stage gpu_tests 240 python3 -m pytest -q -rfE -p no:cacheprovider "${@:-tests/gpu}"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -25
stage selftest 60 python3 -m flashkda_ext selftest
tail -14 "$OUT/selftest.log"
if [ "${SANITIZE:-1}" = 1 ]; then
stage memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 7 python3 scripts/sanitize_routes.py ${MEMCHECK_ONLY:+--only "$MEMCHECK_ONLY"}
stage racecheck 150 compute-sanitizer --tool racecheck --error-exitcode 7 python3 scripts/sanitize_routes.py --only "$REPRESENTATIVE"
stage synccheck 120 compute-sanitizer --tool synccheck --error-exitcode 7 python3 scripts/sanitize_routes.py --only "$REPRESENTATIVE"
for t in memcheck racecheck synccheck; do echo "-- $t"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ failed$|FAIL" "$OUT/$t.log" | head -4; done
fi
