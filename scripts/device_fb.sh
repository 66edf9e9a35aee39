#!/usr/bin/env bash
# flashinfer-bench's own benchmark runner over traced workloads of all three ops, on a lent H200
# (device tool). Traces CUDA calls of kda_decode, fused_kda_decode and kda_prefill through the public
# ops into flashinfer-bench's dataset layout, adds a flashkda_ext Solution per definition
# (flashkda_ext.trace_consumer.solution), runs flashinfer_bench.bench.Benchmark (its persistent
# runner: the definition's reference as the baseline, correctness, then timing) and prints its report
# as a table. The traces it wrote (solutions/, traces/) come back as $OUT/fb_dataset.tgz.
#
# Needs in .whl/ (cp312 manylinux; scripts/device_env.sh installs them), besides the usual tvm-ffi and
# jsonschema wheels:
#   flashinfer_bench-0.1.2-py3-none-any.whl        (installed --no-deps: no flashinfer-python, no CUDA DSL)
#   safetensors-0.7.0-cp38-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
#   pydantic-2.13.4-py3-none-any.whl
#   pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
#   annotated_types-0.7.0-py3-none-any.whl
#   typing_inspection-0.4.5-py3-none-any.whl
#   typing_extensions-4.16.0-py3-none-any.whl
#   docstring_parser-0.17.0-py3-none-any.whl
# Knobs: FB_ATOL / FB_RTOL (default 2e-2: bf16 outputs), FB_ITERS (default 20), FB_HEADS (default 16).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
python3 -c "import flashinfer_bench, safetensors, pydantic, docstring_parser" || {
  echo "flashinfer-bench or its import deps are missing: carry the wheels listed in scripts/device_fb.sh" >&2; exit 1; }
stage build 120 python3 -m flashkda_ext build --parallel 16 --jobs 1 'decode_split8_*' 'decode_row_*' \
  decode_pair_f32_o32 'prefill_vt*' 'fused_*_o32'
tail -1 "$OUT/build.log"
export FIB_CACHE_PATH=/tmp/fib_cache
rm -rf /tmp/fb_dataset
stage fb_bench 420 python3 scripts/fb_benchmark.py /tmp/fb_dataset "$OUT"
tail -25 "$OUT/fb_bench.log"
tar czf "$OUT/fb_dataset.tgz" -C /tmp fb_dataset 2>/dev/null || true
