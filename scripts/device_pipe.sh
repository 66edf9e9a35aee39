#!/usr/bin/env bash
# issue 30: verify candidates on a lent H200 (device tool): builds every verify module and the decode
# twins the tests compare with, runs tests/gpu/test_verify_gpu.py (its persistent test walks ~10
# tiles a CTA), compute-sanitizer over SANITIZE_ONLY (sanitize_routes.py gives persistent modules
# 1440+ tiles), times the candidate stems beside the routed modules (graph replay, no peer: % of the
# memory floor is the measure; BENCH_FLA=1 keeps fla), and, with NCU_MODULES, profiles one launch
# of each at T 2, HV 32, 1024 requests (o32 modules: the pool stays under 2^31 elements) with Nsight Compute. $OUT/logs.tgz holds every result.
#   BENCH_ROWS=1,8,64,256,1024 BENCH_BF16=stage2,... BENCH_F32=bulk4,... (empty: no bench of that state)
#   BENCH_LIMIT=200 SANITIZE=1 SANITIZE_ONLY='verify_*' TESTS=1 TESTS_K='pytest -k expression' BUILD='verify_* ...' (module globs)
#   BENCH_HEADS=16,32,64 BENCH_TOKENS=2,4,8 BENCH_ARGS='--gb32' (more bench_verify flags)
#   TEST_FILES='tests/gpu/test_verify_gpu.py ...' TESTS_LIMIT=200 BENCH_COPY=copy_p1,copy_p2 (bench_verify's --slot-copy arms)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage build 200 python3 -m flashkda_ext build --backend cuda --parallel 16 --jobs 1 ${BUILD:-'verify_*' \
  decode_split8_f32_o32 decode_split4w2_bf16_o32}
tail -1 "$OUT/build.log"
[ "${TESTS:-1}" = 1 ] && stage gpu_tests "${TESTS_LIMIT:-200}" python3 -m pytest -q -rfE -p no:cacheprovider ${TEST_FILES:-tests/gpu/test_verify_gpu.py} \
  ${TESTS_K:+-k "$TESTS_K"}
[ "${TESTS:-1}" = 1 ] && grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
if [ "${SANITIZE:-1}" = 1 ]; then
  for t in memcheck racecheck synccheck; do
    stage "$t" 120 compute-sanitizer --tool "$t" --error-exitcode 7 python3 scripts/sanitize_routes.py \
      --only "${SANITIZE_ONLY:-verify_*}"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ failed$|FAIL" "$OUT/$t.log" | head -3
  done
fi
fla=--no-fla; [ "${BENCH_FLA:-0}" = 1 ] && fla=""
common=(--modes graph --rows "${BENCH_ROWS:-64,256,1024}" --heads "${BENCH_HEADS:-16,32,64}" --tokens "${BENCH_TOKENS:-2,4,8}" $fla --no-progress --out "$OUT"
        ${BENCH_COPY:+--slot-copy "$BENCH_COPY"} ${BENCH_ARGS:-})
[ -n "${BENCH_BF16-x}" ] && stage bench_bf16 "${BENCH_LIMIT:-200}" python3 benchmarks/bench_verify.py "${common[@]}" --states bf16 \
  --modules "${BENCH_BF16:-stage2,pipe2}" --name cand_bf16
[ -n "${BENCH_F32-x}" ] && stage bench_f32 "${BENCH_LIMIT:-150}" python3 benchmarks/bench_verify.py "${common[@]}" --states f32 \
  --modules "${BENCH_F32:-bulk4,pipe4}" --name cand_f32
for b in bench_bf16 bench_f32; do [ -f "$OUT/$b.log" ] && grep -E "^(summary)" "$OUT/$b.log" | cut -c1-900; done
if [ -n "${NCU_MODULES:-}" ]; then
  stage ncu 150 ncu --clock-control none --kernel-name regex:kda_verify --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    --metrics "$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard barrier \
      lg_throttle short_scoreboard wait math_pipe_throttle drain membar mio_throttle no_instruction \
      not_selected selected dispatch_stall sleeping branch_resolving)dram__bytes_read.sum,dram__bytes_write.sum" \
    python3 scripts/verify_ncu_case.py --modules "$NCU_MODULES" --tokens 2 --heads 32 --rows 1024
  grep -E "kda_verify_|DRAM Throughput|Achieved Occupancy|Duration|stalled|dram__bytes|Warp Cycles Per Issued" \
    "$OUT/ncu.log" | head -120
fi
# the device returns at most 8 files: every log in logs.tgz, beside the results and plots
(cd "$OUT" && tar czf logs.tgz *.log *.json gpu.txt 2>/dev/null && rm -f *.log gpu.txt)
