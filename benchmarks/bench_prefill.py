"""Benchmark of the CUDA kda_prefill modules against fla's chunk_kda (Triton) on identical inputs.

Cases (issue 8): layer {8192, 16384, 2x8192, 3000+13384, 4x4096, 2x(8128+64), 8x(1024+64), 32768
tokens}, wrapper {4x64, 16x64, 64x64, 16x128, 16x256, 16 random lengths in 17..255}, heads 12 and
16 (--heads), softplus and bounded (lower_bound -5) gates, fp32 initial and final state; plus the
small sequences x heads rows B=1, T in {2048, 4096, 16384}, H in {1, 2, 4, 8}.

Timing: CUDA events around one call, a 256 MB buffer rewritten before each call (cold L2), median
of --reps. The module is the one jit/routes/kda_prefill.json picks for the case (or --module), with a
preallocated workspace (as a CUDA-graph capture would have). fla gets the same tensors: its state
in the same [N, HV, V, K] layout (state_v_first=True), gates and l2norm in its kernels.

    python benchmarks/bench_prefill.py --out bench_prefill.json [--heads 16] [--quick] [--no-fla]
    FKDA_PREFILL_PREBUILT=<dir> loads <dir>/<name>.so instead of building through flashkda_ext.jit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
K = V = 128
GATES = {"softplus": 0, "bounded": 1}


def load(name):
    pre = os.environ.get("FKDA_PREFILL_PREBUILT")
    if pre:
        import tvm_ffi
        return tvm_ffi.load_module(str(Path(pre) / f"{name}.so"))
    from flashkda_ext import jit
    return jit.load_module(name)


def route_module(num_seqs, heads, total_tokens, gate):
    from flashkda_ext import dispatch
    meta = dict(device="cuda", num_seqs=num_seqs, value_heads=heads, total_tokens=total_tokens, max_seqlen=None,
                work_items=num_seqs * heads, state="f32", offset="o64", gate=gate, checkpoints=False)
    return dispatch.module_name("kda_prefill", meta)


def cases(heads, quick):
    g = torch.Generator().manual_seed(7)
    rnd = torch.randint(17, 256, (16,), generator=g).tolist()
    layer = {"8192": [8192], "16384": [16384], "2x8192": [8192] * 2, "3000+13384": [3000, 13384],
             "4x4096": [4096] * 4, "2x(8128+64)": [8128, 64] * 2, "8x(1024+64)": [1024, 64] * 8, "32768": [32768]}
    wrap = {"4x64": [64] * 4, "16x64": [64] * 16, "64x64": [64] * 64, "16x128": [128] * 16, "16x256": [256] * 16,
            "16xrand17-255": rnd}
    out = []
    for H in heads:
        for k, v in {**layer, **wrap}.items():
            out.append((f"H{H} {k}", v, H))
    for T in (2048, 4096, 16384):
        for H in (1, 2, 4, 8):
            out.append((f"B1 T{T} H{H}", [T], H))
    return out[:6] if quick else out


def make(lens, H, gate, dev):
    T = sum(lens)
    d = dict(q=torch.randn(1, T, H, K, device=dev).bfloat16(), k=torch.randn(1, T, H, K, device=dev).bfloat16(),
             v=torch.randn(1, T, H, V, device=dev).bfloat16(), g=torch.randn(1, T, H, K, device=dev).bfloat16(),
             beta=torch.randn(1, T, H, device=dev).bfloat16(), A_log=torch.rand(H, device=dev) * 0.5 - 1.0,
             dt_bias=torch.randn(H * K, device=dev) * 0.5)
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    d["cu"] = torch.tensor(cu, dtype=torch.int32, device=dev)
    d["init"] = torch.randn(len(lens), H, V, K, device=dev)
    return d


def timeit(fn, reps, flush):
    ts = []
    for i in range(reps + 2):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_prefill.json")
    ap.add_argument("--heads", default="16,12")
    ap.add_argument("--gates", default="softplus,bounded")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--module", default=None, help="force one module instead of the route's")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    args = ap.parse_args()
    import tvm_ffi
    dev = torch.device("cuda")
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    chunk_kda = None
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda
        except Exception as e:  # noqa: BLE001
            print("fla not importable:", repr(e)[:200])
    rows = []
    for gate in args.gates.split(","):
        for name, lens, H in cases([int(h) for h in args.heads.split(",")], args.quick):
            d = make(lens, H, gate, dev)
            N, T = len(lens), sum(lens)
            mname = args.module or route_module(N, H, T, gate)
            mod = load(mname)
            ws = torch.empty(mod["kda_prefill_workspace_bytes"](T, N, H), dtype=torch.uint8, device=dev)
            fin, out = torch.empty_like(d["init"]), torch.empty_like(d["v"])

            def ours():
                with tvm_ffi.use_torch_stream():
                    mod["kda_prefill"](d["q"], d["k"], d["v"], d["g"], d["beta"], d["A_log"], d["dt_bias"], d["cu"],
                                       d["init"], fin, None, None, out, ws, GATES[gate], -5.0, K ** -0.5, True, False, 0)

            r = dict(case=name, gate=gate, T=T, N=N, H=H, module=mname, ours_ms=timeit(ours, args.reps, flush))
            if chunk_kda is not None:
                kw = dict(scale=K ** -0.5, initial_state=d["init"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=d["A_log"],
                          dt_bias=d["dt_bias"], state_v_first=True, cu_seqlens=d["cu"].long())
                if gate == "bounded":
                    kw.update(safe_gate=True, lower_bound=-5.0)
                r["fla_ms"] = timeit(lambda: chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], **kw), args.reps, flush)
                r["speedup"] = r["fla_ms"] / r["ours_ms"]
            rows.append(r)
            print(json.dumps(r), flush=True)
            del ws
    sp = [r["speedup"] for r in rows if "speedup" in r]
    summary = dict(device=torch.cuda.get_device_name(), rows=rows,
                   geomean_speedup=(float(torch.tensor(sp).log().mean().exp()) if sp else None),
                   min_speedup=(min(sp) if sp else None), time=time.strftime("%Y-%m-%d %H:%M:%S"))
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print("\n%-22s %-9s %-18s %9s %9s %6s" % ("case", "gate", "module", "ours ms", "fla ms", "x"))
    for r in rows:
        print("%-22s %-9s %-18s %9.4f %9s %6s" % (r["case"], r["gate"], r["module"], r["ours_ms"],
                                                   "%.4f" % r["fla_ms"] if "fla_ms" in r else "-",
                                                   "%.2f" % r["speedup"] if "speedup" in r else "-"))
    if sp:
        print("geomean speedup over fla: %.2fx, min %.2fx" % (summary["geomean_speedup"], summary["min_speedup"]))


if __name__ == "__main__":
    main()
