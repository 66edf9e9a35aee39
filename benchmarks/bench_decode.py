"""Benchmark of the CUDA kda_decode modules against fla's fused_recurrent_kda (Triton), one run.

Grid: value heads {8,16,32,64} (H = HV) x rows 1..4096 (powers of two), pool of 8192 slots, random
unique slots, fp32 and bf16 state, softplus gate. For each point: CUDA-graph replay time and eager
time per call (host included), for the module the routes pick (or every listed module with
--modules), and for fla when importable. State traffic (bytes read + written) is reported in TB/s
and as a share of the device-to-device copy bandwidth measured in the same run.

Cold-ish L2: each timed graph holds M calls on M different random slot lists, M sized so one replay
touches well over the 60 MB L2 (capped at 128), and the pool (8192 slots) is far larger than L2.

    python benchmarks/bench_decode.py --out bench_decode.json [--quick] [--modules a,b]
    FKDA_DECODE_PREBUILT=<dir> loads <dir>/<name>.so instead of building through flashkda_ext.jit.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
K = V = 128
SLOTS = 8192
GATES = {"softplus": 0, "bounded": 1, "log": 2}
def load(name):
    from flashkda_ext.jit import load_module  # built or loaded once per process
    return load_module(name)


def route(meta):
    """First rule of jit/routes/kda_decode.json whose 'when' holds (docs/architecture.md)."""
    rules = json.loads((ROOT / "jit/routes/kda_decode.json").read_text())["rules"]
    for rule in rules:
        ok = True
        for key, want in rule["when"].items():
            if key.endswith("_min") or key.endswith("_max"):
                val = meta.get(key[:-4])
                if val is None or (val < want if key.endswith("_min") else val > want):
                    ok = False
            elif isinstance(want, list):
                ok = meta.get(key) in want
            else:
                ok = meta.get(key) == want
            if not ok:
                break
        if ok:
            return rule["module"].format(**meta), rule["name"]
    raise RuntimeError("no route")


def fla_fn():
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        return fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001
        print(f"fla not importable: {e!r}", file=sys.stderr)
        return None


def make_case(rows, HV, gen):
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    q = r(rows, HV, K).bfloat16()
    k = r(rows, HV, K).bfloat16()
    v = r(rows, HV, V).bfloat16()
    g = (r(rows, HV, K) - 1.0).bfloat16()
    beta = r(rows, HV).bfloat16()
    A_log = (torch.rand(HV, generator=gen, device="cuda") * 2.5 - 2.0).float()
    dt_bias = (r(HV * K) * 0.5).float()
    return q, k, v, g, beta, A_log, dt_bias


def ours_call(name, case, pool, idx, out):
    q, k, v, g, beta, A_log, dt_bias = case
    fn = load(name)["kda_decode"]
    return lambda: fn(q, k, v, g, beta, A_log, dt_bias, pool, idx, out, 0, 0.0, K ** -0.5, True, False)


def fla_call(fla, case, pool, idx, out):
    q, k, v, g, beta, A_log, dt_bias = case
    q4, k4, v4, g4 = (t.unsqueeze(1) for t in (q, k, v, g))
    b3, o4 = beta.unsqueeze(1), out.unsqueeze(1)
    return lambda: fla(q4, k4, v4, g4, b3, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                       scale=K ** -0.5, inplace_final_state=True, state_v_first=True,
                       ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, out=o4)


def time_graph(calls, reps):
    """Median per-call time (us) of a graph replaying len(calls) launches."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()  # warm-up (Triton compiles outside capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            for c in calls:
                c()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def time_eager(calls, reps):
    """Median per-call wall time (us) of back-to-back eager calls, host included."""
    calls[0]()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for c in calls:
            c()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(times)


def copy_bandwidth():
    n = 1 << 30  # 1 Gi fp16 elements: 2 GiB each way
    x = torch.empty(n, dtype=torch.float16, device="cuda").normal_()
    y = torch.empty_like(x)
    y.copy_(x)
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(ts) / 1e12


def accuracy(fla):
    """Output / state rel. L2 error against the float64 reference: ours (routed) vs fla."""
    sys.path.insert(0, str(ROOT))
    try:
        from flashkda_ext import reference as REF
    except Exception:  # noqa: BLE001
        import importlib
        import types
        stub = types.ModuleType("flashkda_ext")
        stub.__path__ = [str(ROOT / "flashkda_ext")]
        sys.modules["flashkda_ext"] = stub
        REF = importlib.import_module("flashkda_ext.reference")
    res = {}
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, HV = 64, 16
    for sname, sdt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        case = make_case(rows, HV, gen)
        q, k, v, g, beta, A_log, dt_bias = case
        pool0 = (torch.randn(256, HV, V, K, generator=gen, device="cuda") * 0.5).to(sdt)
        idx = torch.randperm(256, device="cuda")[:rows].to(torch.int32)
        qn, kn, vv, gl, bb = REF.gates.prepare_token_inputs(
            q, k, v, g, beta, gate="softplus", A_log=A_log, dt_bias=dt_bias, lower_bound=None,
            scale=None, beta_is_logit=True, dtype=torch.float64)
        S0 = pool0[idx.long()].double().reshape(rows * HV, V, K)
        o_ref, S_ref = REF.step.delta_step(S0, qn.reshape(-1, K), kn.reshape(-1, K), vv.reshape(-1, V),
                                           gl.reshape(-1, K), bb.reshape(-1))
        o_ref, S_ref = o_ref.reshape(rows, HV, V), S_ref.reshape(rows, HV, V, K)
        err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
        meta = dict(device="cuda", rows=rows, value_heads=HV, work_items=rows * HV, state=sname,
                    offset="o32", slot_mode="unique", gate="softplus")
        name, _ = route(meta)
        entry = {}
        for who in ("ours", "fla"):
            if who == "fla" and fla is None:
                continue
            pool = pool0.clone()
            out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
            (ours_call(name, case, pool, idx, out) if who == "ours" else fla_call(fla, case, pool, idx, out))()
            torch.cuda.synchronize()
            entry[who] = dict(out_rel_l2=err(out, o_ref), state_rel_l2=err(pool[idx.long()], S_ref))
        entry["module"] = name
        res[sname] = entry
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--quick", action="store_true", help="rows {1,4,16,64,256,1024,4096} x heads {8,64}")
    ap.add_argument("--modules", default="", help="comma list of module stems (e.g. split4,row); "
                    "default: the routed module only")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--max-calls", type=int, default=128, help="calls per timed graph (cap)")
    ap.add_argument("--quiet", action="store_true", help="no per-point lines")
    ap.add_argument("--states", default="f32,bf16")
    ap.add_argument("--heads", default="")
    ap.add_argument("--rows", default="")
    args = ap.parse_args()

    fla = None if args.no_fla else fla_fn()
    dev = torch.cuda.get_device_properties(0)
    copy_tbps = copy_bandwidth()
    print(f"device {dev.name}, {dev.multi_processor_count} SMs; copy {copy_tbps:.3f} TB/s", flush=True)
    heads = [int(x) for x in args.heads.split(",")] if args.heads else ([8, 64] if args.quick else [8, 16, 32, 64])
    rows_list = [int(x) for x in args.rows.split(",")] if args.rows else (
        [1, 4, 16, 64, 256, 1024, 4096] if args.quick else [2 ** i for i in range(13)])
    stems = [s for s in args.modules.split(",") if s]
    points = []
    for sname in args.states.split(","):
        sdt = torch.float32 if sname == "f32" else torch.bfloat16
        esz = 4 if sname == "f32" else 2
        for HV in heads:
            gen = torch.Generator(device="cuda").manual_seed(HV)
            pool = torch.empty(SLOTS, HV, V, K, dtype=sdt, device="cuda")
            pool.normal_(generator=gen).mul_(0.5)
            for rows in rows_list:
                case = make_case(rows, HV, gen)
                out = torch.empty(rows, HV, V, dtype=torch.bfloat16, device="cuda")
                traffic = rows * HV * V * K * esz * 2
                M = max(2, min(args.max_calls, math.ceil(256e6 / traffic)))
                reps = 5 if traffic * M > 1e9 else 8
                idxs = [torch.randperm(SLOTS, device="cuda", generator=gen)[:rows].to(torch.int32) for _ in range(M)]
                offset = "o64" if pool.numel() > 2 ** 31 - 1 else "o32"  # as the dispatcher decides
                meta = dict(device="cuda", rows=rows, value_heads=HV, work_items=rows * HV, state=sname,
                            offset=offset, slot_mode="unique", gate="softplus")
                names = [f"decode_{s}_{sname}_{offset}" for s in stems] if stems else [route(meta)[0]]
                rec = dict(state=sname, heads=HV, rows=rows, work_items=rows * HV, state_bytes=traffic,
                           calls_per_graph=M, results={})
                for name in names:
                    calls = [ours_call(name, case, pool, i, out) for i in idxs]
                    tg = time_graph(calls, reps)
                    te = time_eager(calls, 3)
                    rec["results"][name] = dict(graph_us=tg, eager_us=te, tbps=traffic / tg / 1e6,
                                                pct_copy=100 * traffic / tg / 1e6 / copy_tbps)
                if fla is not None:
                    calls = [fla_call(fla, case, pool, i, out) for i in idxs]
                    tg = time_graph(calls, reps)
                    te = time_eager(calls, 3)
                    rec["results"]["fla"] = dict(graph_us=tg, eager_us=te, tbps=traffic / tg / 1e6,
                                                 pct_copy=100 * traffic / tg / 1e6 / copy_tbps)
                points.append(rec)
                Path(args.out).write_text(json.dumps(dict(copy_tbps=copy_tbps, points=points, partial=True)))
                line = " ".join(f"{n.replace('decode_', '').replace('_' + sname + '_' + offset, '')}="
                                f"{r['graph_us']:.1f}/{r['eager_us']:.0f}us({r['pct_copy']:.0f}%)"
                                for n, r in rec["results"].items())
                if not args.quiet:
                    print(f"{sname} HV={HV} rows={rows}: {line}", flush=True)
            del pool
            torch.cuda.empty_cache()
    acc = accuracy(fla)
    summary = {}
    if fla is not None:
        for sname in args.states.split(","):
            sg, se = [], []
            for p in points:
                if p["state"] != sname:
                    continue
                best = min((r for n, r in p["results"].items() if n != "fla"), key=lambda r: r["graph_us"])
                sg.append(p["results"]["fla"]["graph_us"] / best["graph_us"])
                se.append(p["results"]["fla"]["eager_us"] / best["eager_us"])
            if sg:
                summary[sname] = dict(geomean_speedup_graph=math.exp(sum(map(math.log, sg)) / len(sg)),
                                      min_speedup_graph=min(sg),
                                      geomean_speedup_eager=math.exp(sum(map(math.log, se)) / len(se)))
    doc = dict(device=dev.name, sms=dev.multi_processor_count, copy_tbps=copy_tbps, slots=SLOTS,
               gate="softplus", points=points, accuracy=acc, summary=summary)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("accuracy", json.dumps(acc))
    print("summary", json.dumps(summary))
    print(markdown(points, copy_tbps))


def markdown(points, copy_tbps):
    """A compact table per state dtype: best of ours (graph us, % of copy) and fla, per point."""
    lines = [f"copy bandwidth {copy_tbps:.2f} TB/s (read + write)"]
    for sname in sorted({p["state"] for p in points}):
        lines += ["", f"state {sname}: graph us (eager us) ours [module] | fla | speedup graph / eager | ours % of copy",
                  "", "| HV | rows | ours | fla | x graph | x eager | % copy |", "|---|---|---|---|---|---|---|"]
        for p in points:
            if p["state"] != sname:
                continue
            ours = {n: r for n, r in p["results"].items() if n != "fla"}
            n, r = min(ours.items(), key=lambda kv: kv[1]["graph_us"])
            f = p["results"].get("fla")
            stem = n.replace("decode_", "").rsplit("_", 2)[0] + ("" if n.endswith("o32") or n == "fla" else "/o64")
            lines.append(f"| {p['heads']} | {p['rows']} | {r['graph_us']:.1f} ({r['eager_us']:.0f}) {stem} | "
                         + (f"{f['graph_us']:.1f} ({f['eager_us']:.0f}) | {f['graph_us'] / r['graph_us']:.2f} | "
                            f"{f['eager_us'] / r['eager_us']:.2f}" if f else "- | - | -")
                         + f" | {r['pct_copy']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
