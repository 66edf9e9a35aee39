#!/usr/bin/env bash
# The benchmark run on a lent H200 (device tool): builds the routed modules, re-checks what the last
# device check flagged, then times decode, prefill and fused decode against fla in one run. Every
# stage is bounded; results (JSON + logs) go to $OUT (or ./device_out).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
stage build 90 python3 -m flashkda_ext build --parallel 16 --jobs 1 'decode_split8_*' 'decode_row_*' \
  decode_pair_f32_o32 'prefill_vt*' 'fused_*_o32'
tail -1 "$OUT/build.log"
stage racecheck_pair 40 compute-sanitizer --tool racecheck --error-exitcode 7 python3 scripts/sanitize_routes.py --only decode_pair_f32_o32
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|failed$" "$OUT/racecheck_pair.log"
stage jax_prefill 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_jax_gpu.py -k prefill
tail -1 "$OUT/jax_prefill.log"
stage bench_decode 110 python3 benchmarks/bench_decode.py --quick --states f32,bf16 --out "$OUT/bench_decode.json"
tail -22 "$OUT/bench_decode.log"
stage bench_fused 70 python3 benchmarks/bench_fused_decode.py --rows 1,16,64,1024 --heads 16,64 --state f32 --no-plot --no-progress --out "$OUT/bench_fused.json"
tail -14 "$OUT/bench_fused.log"
stage bench_overhead 40 python3 benchmarks/bench_overhead.py --quick --no-plot --no-progress --out "$OUT/bench_overhead.json"
tail -8 "$OUT/bench_overhead.log"
stage bench_prefill 190 python3 benchmarks/bench_prefill.py --heads 16 --gates softplus,bounded --out "$OUT/bench_prefill.json"
tail -60 "$OUT/bench_prefill.log"
