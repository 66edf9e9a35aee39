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
stage fb_bench 420 python3 - /tmp/fb_dataset "$OUT" <<'EOF'
import json, os, sys, time
import torch
import flashkda_ext
from flashkda_ext import trace, trace_consumer as tc
from flashinfer_bench.bench import Benchmark
from flashinfer_bench.bench.config import BenchmarkConfig
from flashinfer_bench.data import TraceSet

root, out_dir = sys.argv[1], sys.argv[2]
dev, bf, H, D = "cuda", torch.bfloat16, int(os.environ.get("FB_HEADS", 16)), 128
r = lambda *s, dt=bf: torch.randn(*s, device=dev).to(dt)  # noqa: E731
gate = lambda: dict(A_log=torch.randn(H, device=dev) * 0.5, dt_bias=torch.randn(H * D, device=dev))  # noqa: E731
t0 = time.time()
with trace.tracing(root):
    for rows in (1, 64):                      # decode: padded slots in a pool of 512
        idx = torch.randperm(512, device=dev)[:rows].to(torch.int32)
        if rows > 1:
            idx[::4] = -1
        flashkda_ext.kda_decode(r(rows, H, D), r(rows, H, D), r(rows, H, D), r(rows, H, D), r(rows, H),
                                state=torch.randn(512, H, D, D, device=dev) * 0.1, state_indices=idx,
                                slot_mode="padded", **gate())
        C = 3 * H * D
        flashkda_ext.fused_kda_decode(
            r(rows, C), r(C, 4) * 0.5, r(512, C, 3), r(rows, H, D), r(rows, H), *gate().values(),
            torch.randperm(512, device=dev)[:rows].to(torch.int32), torch.randn(512, H, D, D, device=dev) * 0.1,
            r(rows, H, D), torch.rand(D, device=dev) + 0.5)
    for lens in ((1024,), (256, 1536, 256)):  # prefill: packed sequences with initial states
        T, N = sum(lens), len(lens)
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(N)], dtype=torch.int32, device=dev)
        flashkda_ext.kda_prefill(r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H),
                                 cu_seqlens=cu, initial_state=torch.randn(N, H, D, D, device=dev) * 0.1, **gate())
torch.cuda.synchronize()
print(f"traced in {time.time() - t0:.1f} s")
ts = TraceSet.from_path(root)
for name, d in ts.definitions.items():       # one flashkda_ext Solution per definition
    path = os.path.join(root, "solutions", d.op_type, f"{name}__flashkda_ext.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(tc.solution(d, target="cuda").model_dump_json(indent=2))
ts = TraceSet.from_path(root)
tol = lambda k: float(os.environ.get(k, "2e-2"))  # noqa: E731
cfg = BenchmarkConfig(warmup_runs=3, iterations=int(os.environ.get("FB_ITERS", 20)), num_trials=1,
                      atol=tol("FB_ATOL"), rtol=tol("FB_RTOL"), timeout_seconds=240)
bench = Benchmark(ts, cfg)
try:
    result = bench.run_all(dump_traces=True)
finally:
    bench.close()
rows = []
for name, traces in sorted(result.traces.items()):
    for t in traces:
        ev, axes = t.evaluation, ",".join(f"{k}={v}" for k, v in t.workload.axes.items())
        c, p = ev.correctness, ev.performance
        rows.append([name, axes, ev.status.value, f"{c.max_absolute_error:.2e}" if c else "-",
                     f"{p.latency_ms:.4f}" if p else "-", f"{p.reference_latency_ms:.3f}" if p else "-",
                     f"{p.speedup_factor:.1f}x" if p else "-"])
        if ev.status.value != "PASSED":
            print(f"--- {name} {axes}: {ev.status.value}\n{(ev.log or '')[-1500:]}")
head = ["definition", "var axes", "status", "max abs err", "flashkda ms", "reference ms", "speedup"]
w = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
for line in [head, ["-" * n for n in w]] + rows:
    print("  ".join(str(x).ljust(n) for x, n in zip(line, w)))
print(f"{sum(r[2] == 'PASSED' for r in rows)}/{len(rows)} PASSED; tolerances atol={cfg.atol} rtol={cfg.rtol}")
with open(os.path.join(out_dir, "fb_report.json"), "w") as f:
    json.dump([dict(zip(head, r)) for r in rows], f, indent=1)
EOF
tail -25 "$OUT/fb_bench.log"
tar czf "$OUT/fb_dataset.tgz" -C /tmp fb_dataset 2>/dev/null || true
