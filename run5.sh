#!/usr/bin/env bash
# session 13 run 5: the fp32 grid with fla and the public op (fast path on / off)
set -uo pipefail
source scripts/device_env.sh
stage decode_f32 545 python3 benchmarks/bench_decode.py --op-arm --states f32 --out "$OUT/full_f32_op.json" --no-progress --quiet
tail -12 "$OUT/decode_f32.log"
cd "$OUT" && tar czf /tmp/run5.tgz . && rm -rf ./* && mv /tmp/run5.tgz .
