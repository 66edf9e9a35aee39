#!/usr/bin/env bash
# One device call over the tree as it lands: build every CUDA module, the whole tests/gpu but the
# integration tests (decode, fused, prefill, verify, the fast path, context parallelism's one-GPU
# simulation), the context-parallel benchmark (--quick), then flashinfer-bench's Benchmark over traced
# workloads (scripts/fb_benchmark.py). Every log goes into $OUT/logs.tgz (the device returns 8 files).
#   bash scripts/device_final_checks.sh          (carry .whl)
# Optional stages: INTEGRATIONS=1 tests/gpu/test_integrations_gpu.py (fla's wheel carried); FLA=1 fla's own
# test_kda.py with the backend registered and its served / refused counts (carry .fla_tests, see
# device_integrations.sh; FLA_K narrows it); SELFTEST=1 the GPU selftest (every reached route, verify
# included); TRACE=1 the trace tests on CUDA calls; SANITIZE=1 compute-sanitizer memcheck over every route
# (scripts/sanitize_routes.py); RACE="glob" racecheck and synccheck over those modules; VERIFY_BENCH="stem,stem" bench_verify.py --quick with those candidate
# modules beside the routed one and fla; FB=0 skips flashinfer-bench; BENCH_CP=0 skips the
# context-parallel benchmark. VERIFY_GRID=1 bench_verify.py over issue 30's whole grid (graph mode, fla beside the
# routed module; VERIFY_GRID_MODULES=stem,stem adds candidate arms).
# CONCURRENT=1 runs the correctness stages (tests, selftest, trace, memcheck, fla's tests) side by side
# after the build: none of them times anything, and one device command has 10 minutes. The timed stages
# (benchmarks) always run alone, after them.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH=$PWD/scripts:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage build 170 python3 -m flashkda_ext build --backend cuda --all --parallel 16 --jobs 1
tail -1 "$OUT/build.log"
check() {  # a correctness stage: in the background under CONCURRENT=1
  if [ "${CONCURRENT:-0}" = 1 ]; then stage "$@" & else stage "$@"; fi
}
check gpu_tests ${GPU_LIMIT:-130} python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu -k "not integrations"
if [ "${INTEGRATIONS:-0}" = 1 ]; then   # the adoption layer's GPU tests (fla's wheel carried in .whl/)
  check gpu_integrations 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_integrations_gpu.py
fi
if [ "${FLA:-0}" = 1 ]; then
  fla_cmd -rfE
  check fla_kda ${FLA_LIMIT:-200} "${FLA_CMD[@]}"
fi
if [ "${SELFTEST:-0}" = 1 ]; then
  check selftest 120 python3 -m flashkda_ext selftest
fi
if [ "${TRACE:-0}" = 1 ]; then
  check trace_cuda 90 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_trace.py \
    tests/test_trace_flashinfer_bench.py -k "verify or cuda"
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  check memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 7 python3 scripts/sanitize_routes.py
fi
if [ -n "${RACE:-}" ]; then   # racecheck and synccheck over the modules the glob names (shared memory, barriers)
  for t in racecheck synccheck; do
    check "$t" ${RACE_LIMIT:-150} compute-sanitizer --tool "$t" --error-exitcode 7 python3 scripts/sanitize_routes.py --only "$RACE"
  done
fi
wait
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -8
for name in gpu_integrations trace_cuda; do
  [ -f "$OUT/$name.log" ] && { echo "-- $name"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$name.log" | tail -6; }
done
[ -f "$OUT/fla_kda.log" ] && { echo "-- fla_kda"; fla_summary fla_kda; }
[ -f "$OUT/selftest.log" ] && { echo "-- selftest"; tail -4 "$OUT/selftest.log"; }
for t in memcheck racecheck synccheck; do
  [ -f "$OUT/$t.log" ] && { echo "-- $t"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ failed$" "$OUT/$t.log" | tail -3; }
done
if [ -n "${VERIFY_BENCH:-}" ]; then
  stage bench_verify ${VERIFY_LIMIT:-150} python3 benchmarks/bench_verify.py --quick --no-progress --no-plot \
    --modes graph --modules "$VERIFY_BENCH" --out "$OUT/verify.json"
  grep -E "geomean|summary|%copy|T=" "$OUT/bench_verify.log" | tail -34
fi
if [ "${VERIFY_GRID:-0}" = 1 ]; then   # issue 30's whole grid, routed against fla (VERIFY_GRID_MODULES: arms beside it)
  stage verify_grid ${VERIFY_GRID_LIMIT:-200} python3 benchmarks/bench_verify.py --modes graph --no-progress \
    --modules "${VERIFY_GRID_MODULES:-}" --out "$OUT/verify_grid.json"
  grep -E "geomean|^summary" "$OUT/verify_grid.log" | tail -3
fi
if [ "${BENCH_CP:-1}" = 1 ]; then
  stage bench_cp 75 python3 benchmarks/bench_cp.py --quick --no-progress --no-plot --out "$OUT/bench_cp.json"
  tail -14 "$OUT/bench_cp.log"
fi
if [ "${FB:-1}" = 1 ]; then
  export FIB_CACHE_PATH=/tmp/fib_cache
  rm -rf /tmp/fb_dataset
  FB_ITERS=${FB_ITERS:-10} stage fb_bench 175 python3 scripts/fb_benchmark.py /tmp/fb_dataset "$OUT"
  tail -22 "$OUT/fb_bench.log"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.txt *.json 2>/dev/null)
