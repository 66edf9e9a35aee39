#!/usr/bin/env bash
# Context parallelism on one H200: build the prefill modules, tests/gpu/test_context_parallel_gpu.py
# (simulate() against one-GPU kda_prefill; the NCCL test runs only with 2+ GPUs), then the whole
# benchmarks/bench_cp.py grid (T 32768 and 131072, R 2 / 4 / 8). Logs: $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage build 100 python3 -m flashkda_ext build --backend cuda --parallel 16 --jobs 1 'prefill_*'
tail -1 "$OUT/build.log"
stage cp_tests 60 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_context_parallel_gpu.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cp_tests.log" | tail -6
stage bench_cp ${BENCH_LIMIT:-90} python3 benchmarks/bench_cp.py --no-progress --no-plot --out "$OUT/bench_cp.json"
tail -9 "$OUT/bench_cp.log"
