#!/usr/bin/env bash
# A/B of a change on a lent GPU (device tool): the same benchmark from a baseline tree and from this
# tree, in interleaved rounds (A B, then B A, ...), then benchmarks/compare_runs.py with each case's
# lowest median over the rounds (one disturbed round does not decide a row). Optionally the GPU tests
# and compute-sanitizer on this tree first, so one device call verifies and measures a change.
#
#   mkdir -p .ab_base/base && git archive <rev> csrc jit | tar x -C .ab_base/base   (carry .ab_base)
#   BASE=.ab_base/base bash scripts/device_ab.sh
#
# BASE     folder holding the baseline's csrc/ and jit/ (required)
# MODULES  module globs to build in both trees (default 'prefill_vt*_f32'); empty: no build step
# BENCH    the benchmark command, without --out (default: prefill, no peer, H16 + H64, both gates)
# ROUNDS   rounds per arm (default 2)
# CHECK    1: before the A/B, build CHECK_BUILD, run CHECK_TESTS and the sanitizers over
#          SANITIZE_ONLY in this tree (defaults: 'prefill_*', tests/gpu/test_prefill_gpu.py, 'prefill_*')
# Results: $OUT/ab_<i>_{base,change}.json, $OUT/ab.txt (the comparison).
set -uo pipefail
if [ $# -gt 0 ]; then echo "device_ab.sh takes no arguments; use the environment (see the header)" >&2; exit 2; fi
: "${BASE:?BASE must name a folder holding the baseline csrc/ and jit/}"
BASE=$(cd "$BASE" && pwd) || exit 2
source "$(dirname "$0")/device_env.sh"
MODULES=${MODULES-'prefill_vt*_f32'}
BENCH=${BENCH:-"python3 benchmarks/bench_prefill.py --no-fla --heads 16,64 --gates bounded,softplus --reps 8 --modes eager --no-plot --no-progress"}
ROUNDS=${ROUNDS:-2}
BASE_CACHE=${BASE_CACHE:-/tmp/fkda_cache_ab_base}
set -f  # module globs and the benchmark's arguments reach the commands as written
if [ "${CHECK:-0}" = 1 ]; then
  stage check_build 120 python3 -m flashkda_ext build --parallel 16 --jobs 1 ${CHECK_BUILD:-prefill_*}
  tail -1 "$OUT/check_build.log"
  stage check_tests 200 python3 -m pytest -q -rfE -p no:cacheprovider ${CHECK_TESTS:-tests/gpu/test_prefill_gpu.py}
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/check_tests.log" | tail -8
  for t in memcheck racecheck synccheck; do
    stage "$t" 120 compute-sanitizer --tool "$t" --error-exitcode 7 python3 scripts/sanitize_routes.py \
      --only "${SANITIZE_ONLY:-prefill_*}"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ failed$" "$OUT/$t.log" | head -3
  done
fi
arm_env() {  # the environment of one arm: its data root and its own JIT cache
  if [ "$1" = base ]; then export FLASHKDA_EXT_DATA_ROOT=$BASE FLASHKDA_EXT_CACHE_DIR=$BASE_CACHE
  else export FLASHKDA_EXT_DATA_ROOT=$PWD; fi
}
if [ -n "$MODULES" ]; then
  for arm in base change; do
    # shellcheck disable=SC2086
    ( arm_env $arm; stage build_$arm 120 python3 -m flashkda_ext build --parallel 16 --jobs 1 $MODULES )
    tail -1 "$OUT/build_$arm.log"
  done
fi
before=() after=()
for ((i = 1; i <= ROUNDS; i++)); do
  order="base change"; (( i % 2 == 0 )) && order="change base"
  for arm in $order; do
    # shellcheck disable=SC2086
    ( arm_env $arm; stage ab_${i}_$arm ${AB_LIMIT:-150} $BENCH --out "$OUT/ab_${i}_$arm.json" )
    if [ $arm = base ]; then before+=("$OUT/ab_${i}_$arm.json"); else after+=("$OUT/ab_${i}_$arm.json"); fi
  done
done
join() { local IFS=,; echo "$*"; }
python3 benchmarks/compare_runs.py "$(join "${before[@]}")" "$(join "${after[@]}")" > "$OUT/ab.txt" 2>&1
grep -E "geomean|  ours on|  [a-z]+ on " "$OUT/ab.txt"
