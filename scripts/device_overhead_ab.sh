#!/usr/bin/env bash
# Host overhead of the public ops, a baseline tree against this one, in one device run
# (benchmarks/bench_overhead.py: op minus the direct module call). The baseline is a whole tree
# (Python package too: the overhead lives there), exported with
#   mkdir -p .ab_base/base && git archive <rev> flashkda_ext csrc jit trace_templates benchmarks \
#     | tar x -C .ab_base/base                                    (carry .ab_base)
# Usage: BASE=.ab_base/base bash scripts/device_overhead_ab.sh
# ROUNDS (default 2) alternates base / change runs; results: $OUT/overhead_<i>_{base,change}.json
# and the op-minus-direct lines of each in $OUT/overhead.txt.
set -uo pipefail
: "${BASE:?BASE must name a folder holding the baseline tree}"
BASE=$(cd "$BASE" && pwd) || exit 2
source "$(dirname "$0")/device_env.sh"
ROUNDS=${ROUNDS:-2}
BENCH_ARGS=${BENCH_ARGS:-"--no-plot --no-progress"}
# the baseline's modules, built in parallel before timing (its own cache: identities differ)
(cd "$BASE" && export FLASHKDA_EXT_CACHE_DIR=/tmp/fkda_cache_ab_base PYTHONPATH=$BASE:/tmp/site &&
  stage base_build 240 python3 -m flashkda_ext build --backend cuda --all --parallel 16 --jobs 1)
tail -1 "$OUT/base_build.log"
: > "$OUT/overhead.txt"
for i in $(seq 1 "$ROUNDS"); do
  for arm in base change; do
    if [ "$arm" = base ]; then dir=$BASE cache=/tmp/fkda_cache_ab_base; else dir=$PWD cache=$FLASHKDA_EXT_CACHE_DIR; fi
    (cd "$dir" && export FLASHKDA_EXT_CACHE_DIR=$cache PYTHONPATH=$dir:/tmp/site &&
      stage "overhead_${i}_$arm" 300 python3 benchmarks/bench_overhead.py $BENCH_ARGS --out "$OUT/overhead_${i}_$arm.json")
    { echo "-- round $i $arm"; grep -E "validate_dispatch_us|: .* us" "$OUT/overhead_${i}_$arm.log" | grep -v "^==" ; } >> "$OUT/overhead.txt"
  done
done
cat "$OUT/overhead.txt"
