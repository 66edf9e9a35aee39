#!/usr/bin/env bash
# One device call over the tree as it lands: build every CUDA module, the whole tests/gpu but the
# integration tests (decode, fused, prefill, verify, the fast path, context parallelism's one-GPU
# simulation), the context-parallel benchmark (--quick), then flashinfer-bench's Benchmark over traced
# workloads (scripts/fb_benchmark.py). Every log goes into $OUT/logs.tgz (the device returns 8 files).
#   bash scripts/device_final_checks.sh          (carry .whl)
# Optional stages: INTEGRATIONS=1 tests/gpu/test_integrations_gpu.py (fla's wheel carried); SELFTEST=1 the
# GPU selftest (every reached route, verify included); TRACE=1 the trace tests on CUDA calls; SANITIZE=1
# compute-sanitizer memcheck over every route (scripts/sanitize_routes.py); FB=0 skips flashinfer-bench;
# BENCH_CP=0 skips the context-parallel benchmark.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage build 160 python3 -m flashkda_ext build --backend cuda --all --parallel 16 --jobs 1
tail -1 "$OUT/build.log"
stage gpu_tests 130 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu -k "not integrations"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -8
if [ "${INTEGRATIONS:-0}" = 1 ]; then   # the adoption layer's GPU tests (fla's wheel carried in .whl/)
  stage gpu_integrations 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_integrations_gpu.py
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_integrations.log" | tail -6
fi
if [ "${SELFTEST:-0}" = 1 ]; then
  stage selftest 120 python3 -m flashkda_ext selftest
  tail -4 "$OUT/selftest.log"
fi
if [ "${TRACE:-0}" = 1 ]; then
  stage trace_cuda 90 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_trace.py \
    tests/test_trace_flashinfer_bench.py -k "verify or cuda"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/trace_cuda.log" | tail -6
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  stage memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 7 python3 scripts/sanitize_routes.py
  grep -E "ERROR SUMMARY|[0-9]+ failed$" "$OUT/memcheck.log" | tail -3
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
