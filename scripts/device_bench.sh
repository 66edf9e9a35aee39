#!/usr/bin/env bash
# The benchmark run on a lent H200 (device tool): builds the routed modules, then times the JAX front
# end, decode, fused decode and prefill against their peers in one run. Every stage is bounded;
# results (JSON + logs) go to $OUT (or ./device_out). STAGES="jax fused prefill" runs a subset
# (names: jax decode fused overhead prefill; default all).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
want() { [[ " ${STAGES:-all} " == *" all "* || " ${STAGES:-all} " == *" $1 "* ]]; }
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
