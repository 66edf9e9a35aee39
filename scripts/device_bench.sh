#!/usr/bin/env bash
# The benchmark run on a lent H200 (device tool): builds the routed modules, then times the JAX front
# end, decode, fused decode and prefill against their peers in one run. Every stage is bounded;
# results (JSON + logs) go to $OUT (or ./device_out). STAGES="jax fused prefill" runs a subset
# (names: jax decode fused overhead prefill, and the measurements behind design choices:
# pdl_ab decode_schedules fused_bands, and ab with AB_BASE=<baseline tree>, AB_PARTS="decode fused prefill",
# AB_GATES=softplus,bounded, AB_HEADS=16,64, AB_MODES=eager,graph (prefill), AB_FUSED_ROWS=1024 (more fused rows);
# default all but ab). Stages are picked by STAGES only: an argument is refused (`device_bench.sh ab`
# once ran every stage into the device call's time limit). For one change, scripts/device_ab.sh runs
# interleaved rounds (and optionally the GPU tests and sanitizers) in one call.
set -uo pipefail
if [ $# -gt 0 ]; then
  echo "device_bench.sh takes no arguments; pick stages with STAGES=\"...\" (got: $*)" >&2
  exit 2
fi
source "$(dirname "$0")/device_env.sh"
want() { [[ ( " ${STAGES:-all} " == *" all "* && $1 != ab ) || " ${STAGES:-all} " == *" $1 "* ]]; }
stage build 90 python3 -m flashkda_ext build --parallel 16 --jobs 1 'decode_split8_*' 'decode_row_*' \
  decode_pair_f32_o32 'prefill_vt*' 'fused_*_o32'
tail -1 "$OUT/build.log"
if want jax; then
  stage jax_overhead 60 python3 benchmarks/bench_jax_overhead.py --device cuda --json "$OUT/jax_overhead.json"
  tail -9 "$OUT/jax_overhead.log"
  # the same with our targets registered as not capturable, then with XLA's command buffers off
  FLASHKDA_EXT_JAX_COMMAND_BUFFER=0 stage jax_overhead_nocapture 60 python3 benchmarks/bench_jax_overhead.py \
    --device cuda --json "$OUT/jax_overhead_nocapture.json"
  tail -3 "$OUT/jax_overhead_nocapture.log"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" stage jax_overhead_nocmdbuf 60 python3 \
    benchmarks/bench_jax_overhead.py --device cuda --json "$OUT/jax_overhead_nocmdbuf.json"
  tail -3 "$OUT/jax_overhead_nocmdbuf.log"
fi
if want decode; then
  stage bench_decode 110 python3 benchmarks/bench_decode.py --quick --states f32,bf16 --out "$OUT/bench_decode.json"
  tail -22 "$OUT/bench_decode.log"
fi
if want fused; then
  stage bench_fused 170 python3 benchmarks/bench_fused_decode.py --rows 1,16,64,1024 --heads 16,64 --state f32 --no-plot --no-progress --out "$OUT/bench_fused.json"
  tail -14 "$OUT/bench_fused.log"
fi
# A/B of a change: the same decode, fused decode and prefill points from a baseline tree (a folder
# holding csrc/ and jit/, read through FLASHKDA_EXT_DATA_ROOT with its own JIT cache) and from this
# tree; no peers; compare_runs.py prints after/before per case. Arms are named by $2 (before) / $3.
ab_compare() {
  # AB_PARTS picks the benchmarks (default "decode fused", plus prefill when AB_PREFILL is set)
  local base=$1 before=$2 after=$3 arm root cache parts=" ${AB_PARTS:-decode fused${AB_PREFILL:+ prefill}} "
  for arm in "$before" "$after"; do
    if [ "$arm" = "$before" ]; then root=$base; cache=/tmp/fkda_cache_$before; else root=$PWD; cache=$FLASHKDA_EXT_CACHE_DIR; fi
    FLASHKDA_EXT_DATA_ROOT=$root FLASHKDA_EXT_CACHE_DIR=$cache stage build_$arm 90 python3 -m flashkda_ext build \
      --parallel 16 --jobs 1 'decode_split8_*' 'decode_quartma*' 'decode_rowtma_bf16_*' 'decode_halftma_f32_*' decode_row_f32_o32 'fused_*_f32_o32' \
      $([[ $parts == *" prefill "* ]] && echo 'prefill_vt*_f32')
    if [[ $parts == *" decode "* ]]; then
      FLASHKDA_EXT_DATA_ROOT=$root FLASHKDA_EXT_CACHE_DIR=$cache stage decode_$arm 90 python3 benchmarks/bench_decode.py \
        --no-fla --modes graph --states f32,bf16 --heads 8,64 --rows 1,4,16,64,256 --no-plot --no-progress --quiet \
        --out "$OUT/decode_$arm.json"
    fi
    if [[ $parts == *" fused "* ]]; then
      FLASHKDA_EXT_DATA_ROOT=$root FLASHKDA_EXT_CACHE_DIR=$cache stage fused_$arm 60 python3 benchmarks/bench_fused_decode.py \
        --no-unfused --modes graph --rows 1,16,64${AB_FUSED_ROWS:+,$AB_FUSED_ROWS} --heads 16,64 --state f32 --no-plot \
        --no-progress --out "$OUT/fused_$arm.json"
    fi
    if [[ $parts == *" prefill "* ]]; then
      FLASHKDA_EXT_DATA_ROOT=$root FLASHKDA_EXT_CACHE_DIR=$cache stage prefill_$arm 90 python3 benchmarks/bench_prefill.py \
        --no-fla --heads ${AB_HEADS:-16} --gates ${AB_GATES:-bounded} --reps 8 --modes ${AB_MODES:-eager} --no-plot --no-progress \
        --out "$OUT/prefill_$arm.json"
    fi
  done
  local f files=()
  for f in decode fused prefill; do
    [[ $parts == *" $f "* ]] && files+=("$OUT/${f}_$before.json" "$OUT/${f}_$after.json")
  done
  python3 benchmarks/compare_runs.py "${files[@]}" 2>&1 | tee "$OUT/${after}_ab.txt"
}
if want pdl_ab; then
  # programmatic dependent launch off (a copy of csrc/ + jit/ with params.pdl = 0) against on
  nopdl=/tmp/fkda_nopdl; rm -rf "$nopdl"; mkdir -p "$nopdl"; cp -r csrc jit "$nopdl/"
  python3 - "$nopdl/jit/modules" <<'PY'
import json, pathlib, sys
for f in pathlib.Path(sys.argv[1]).glob("*.json"):
    d = json.loads(f.read_text())
    for m in d["modules"]:
        if "pdl" in m["params"]:
            m["params"]["pdl"] = 0
    f.write_text(json.dumps(d, indent=1) + "\n")
PY
  AB_PREFILL=1 ab_compare "$nopdl" nopdl pdl
fi
if want ab; then
  # AB_BASE: the baseline tree, e.g. `git archive <rev> csrc jit | tar x -C .ab_base` (carried)
  ab_compare "${AB_BASE:?AB_BASE must name a folder holding the baseline csrc/ and jit/}" base change
fi
if want decode_schedules; then
  # every tile/persistent schedule at bandwidth-band points, bf16 and fp32 state, no peer
  stage decode_schedules 150 python3 benchmarks/bench_decode.py --no-fla --modes graph --states bf16,f32 \
    --heads 8,16,64 --rows 16,64,256,1024,4096 --modules split8,split4w2,split4,row,persist,stream \
    --no-plot --no-progress --quiet --out "$OUT/decode_schedules.json"
  tail -40 "$OUT/decode_schedules.log"
fi
if want fused_bands; then
  stage fused_bands 120 python3 benchmarks/bench_fused_decode.py --no-unfused --modes graph \
    --rows 1,4,16,64,256,1024 --heads 16,64 --state f32 --modules quad,oct,pair,row --no-plot --no-progress \
    --out "$OUT/fused_bands.json"
  tail -16 "$OUT/fused_bands.log"
fi
if want overhead; then
  stage bench_overhead 40 python3 benchmarks/bench_overhead.py --quick --no-plot --no-progress --out "$OUT/bench_overhead.json"
  tail -8 "$OUT/bench_overhead.log"
fi
if want prefill; then
  stage bench_prefill ${PREFILL_LIMIT:-300} python3 benchmarks/bench_prefill.py --heads 16 --gates softplus,bounded --reps 8 --modes eager --out "$OUT/bench_prefill.json"
  tail -60 "$OUT/bench_prefill.log"
fi
# the Triton kernels fla compiled in this run, for a later session to carry (see device_env.sh);
# it comes back only under the device tool's 16 MiB per-file limit
tc=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -d "$tc" ]; then tar czf "$OUT/triton_cache.tgz" -C "$tc" . && du -h "$OUT/triton_cache.tgz"; fi
