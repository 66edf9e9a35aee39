#!/usr/bin/env bash
# One full GPU check on a lent H200 (device tool): builds every CUDA module, runs the GPU tests, the
# selftest and compute-sanitizer over every route. Logs go to $OUT (or ./device_out). Usage:
#   bash scripts/device_check.sh [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} || exit 1
fi
export PYTHONUNBUFFERED=1 FLASHKDA_EXT_CACHE_DIR=${FLASHKDA_EXT_CACHE_DIR:-/tmp/fkda_cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
python3 -m flashkda_ext build --backend cuda --all --parallel 16 --jobs 1 > "$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/build.log"
t0=$(date +%s)
python3 -m pytest -q -rfE tests/gpu ${1:+-k "$1"} > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -25
t0=$(date +%s)
python3 -m flashkda_ext selftest > "$OUT/selftest.log" 2>&1
echo "selftest rc=$? in $(( $(date +%s) - t0 )) s"; tail -12 "$OUT/selftest.log"
for tool in memcheck racecheck synccheck; do
  t0=$(date +%s)
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 7 python3 scripts/sanitize_routes.py > "$OUT/sanitize_$tool.log" 2>&1
  echo "sanitizer $tool rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "ERROR SUMMARY|failed$|FAIL" "$OUT/sanitize_$tool.log" | head -5
done
