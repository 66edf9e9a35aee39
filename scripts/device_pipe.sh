#!/usr/bin/env bash
# issue 30: the persistent verify candidates (verify_pipe*, kda_verify_pipe_kernel) on a lent H200
# (device tool): builds every verify module and the decode twins the tests compare with, runs
# tests/gpu/test_verify_gpu.py (its persistent test walks ~10 tiles a CTA), compute-sanitizer over
# the pipe modules (sanitize_routes.py gives them 1440+ tiles), then times the candidates beside
# the routed modules over the large bands (graph replay, no peer: % of the memory floor is the
# measure; BENCH_FLA=1 keeps fla). Everything lands in $OUT; logs.tgz holds the logs.
#   BENCH_ROWS=64,256,1024 BENCH_BF16=stage2,pipe2,pipe4,bulk4 BENCH_F32=bulk4,pipe4 SANITIZE=1
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage build 200 python3 -m flashkda_ext build --backend cuda --parallel 16 --jobs 1 'verify_*' \
  decode_split8_f32_o32 decode_split4w2_bf16_o32
tail -1 "$OUT/build.log"
stage gpu_tests 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_verify_gpu.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
if [ "${SANITIZE:-1}" = 1 ]; then
  for t in memcheck racecheck synccheck; do
    stage "$t" 120 compute-sanitizer --tool "$t" --error-exitcode 7 python3 scripts/sanitize_routes.py --only 'verify_pipe*'
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ failed$|FAIL" "$OUT/$t.log" | head -3
  done
fi
fla=--no-fla; [ "${BENCH_FLA:-0}" = 1 ] && fla=""
common=(--modes graph --tokens 2,4,8 --rows "${BENCH_ROWS:-64,256,1024}" --heads 16,32,64 $fla --no-progress --out "$OUT")
stage bench_bf16 200 python3 benchmarks/bench_verify.py "${common[@]}" --states bf16 \
  --modules "${BENCH_BF16:-stage2,pipe2,pipe4,bulk4}" --name pipe_bf16
stage bench_f32 150 python3 benchmarks/bench_verify.py "${common[@]}" --states f32 \
  --modules "${BENCH_F32:-bulk4,pipe4}" --name pipe_f32
for b in bench_bf16 bench_f32; do grep -E "^(summary)" "$OUT/$b.log" | cut -c1-600; done
(cd "$OUT" && tar czf logs.tgz *.log gpu.txt)
