#!/usr/bin/env bash
# fp32 g and beta read natively by kda_decode (issue 29, the _gb32 modules) on a lent H200, one device
# command (carry .whl, see device_env.sh). Logs go to $OUT, all of them into $OUT/logs.tgz.
#   bash scripts/device_gf32.sh
# Stages (STAGES, default "build tests bench"):
#   build  every kda_decode module (decode_*: the tests' o32 / o64 checks call each record), 16 at a time
#   tests  tests/gpu/test_decode_gpu.py whole (the _gb32 records in every module test, their bitwise
#          equality with the bf16 modules, the binding's refusals, the public op per band and mixed
#          pairs) and the SGLang adapter's decode tests (one kernel per call with an fp32 gate / beta)
#   bench  benchmarks/bench_layer.py --only-casts (the adapter's decode: bf16 gate / beta, fp32 read
#          natively, fp32 cast first: arms ours / ours_fp32_gate_beta / ours_fp32_cast, graph replay) and
#          benchmarks/bench_decode.py --gb32 on a few points per band (module level: gb32 / gb32_cast
#          beside the routed bf16 module)
# SELFTEST=1 adds the GPU selftest (every route, the _gb32 rules included; builds what it needs).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTHONPATH=$PWD/scripts:${PYTHONPATH:-}
STAGES=${STAGES:-build tests bench}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if has build; then
  stage build 200 python3 -m flashkda_ext build --backend cuda --parallel 16 --jobs 1 'decode_*'
  tail -1 "$OUT/build.log"
fi
if has tests; then
  stage gpu_decode ${GPU_LIMIT:-300} python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_decode_gpu.py
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_decode.log" | tail -12
  stage gpu_sglang 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_integrations_gpu.py -k sglang
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_sglang.log" | tail -8
fi
if [ "${SELFTEST:-0}" = 1 ]; then
  stage selftest 240 python3 -m flashkda_ext selftest
  grep -E "gb32|g/beta|^(FAIL|PASS) .*summary|passed|failed" "$OUT/selftest.log" | tail -30
fi
if has bench; then
  stage bench_layer_casts ${BENCH_LIMIT:-150} python3 benchmarks/bench_layer.py --only-casts --no-progress \
    --no-plot --rows ${BENCH_ROWS:-1,4,64,256} --out "$OUT"
  tail -12 "$OUT/bench_layer_casts.log"
  stage bench_decode_gb32 ${DECODE_LIMIT:-200} python3 benchmarks/bench_decode.py --gb32 --no-fla --no-plot \
    --heads ${DECODE_HEADS:-8,64} --rows ${DECODE_ROWS:-1,4,16,64,1024} --out "$OUT/decode_gb32.json"
  grep -E "HV=|summary" "$OUT/bench_decode_gb32.log" | tail -34
fi
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.txt *.json 2>/dev/null)
