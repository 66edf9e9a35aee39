#!/usr/bin/env bash
# One device call for the fast-path rework ([R]) and what merged with it: build every CUDA module,
# the GPU tests, the cold / warm differential and the edge tests over the CUDA routes, the selftest.
# Logs: $OUT/logs.tgz; a short table last.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage build 220 python3 -m flashkda_ext build --backend cuda --all --parallel 16 --jobs 1
tail -2 "$OUT/build.log"
stage gpu_tests 230 python3 -m pytest -q -x -rfE -p no:cacheprovider tests/gpu -k "not integrations"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
stage differential 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fast_path_differential.py \
  tests/test_bad_input_edges.py
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/differential.log" | tail -12
stage selftest 60 python3 -m flashkda_ext selftest
tail -6 "$OUT/selftest.log"
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.txt 2>/dev/null)
