"""Benchmark of the CUDA kda_decode modules against fla's fused_recurrent_kda (Triton), one run.

Grid: value heads {8,16,32,64} (H = HV) x rows 1..4096 (powers of two), pool of 8192 slots, random
unique slots, fp32 and bf16 state, softplus gate. For each point: CUDA-graph replay time and eager
time per call (device events, and host-inclusive wall time), for the module the routes pick (or every
listed module with --modules), and for fla when importable. State traffic (bytes read + written) is
reported in TB/s and as a share of the device-to-device copy bandwidth measured in the same run.

Timing goes through benchmarks/harness.py (arms interleaved A B B A, medians, JSON + plot).
Cold L2 by rotation: each timed run holds M calls on M different random slot lists, M sized so one run
touches well over the 60 MB L2 (capped at 128), and the pool (8192 slots) is far larger than L2;
times are per call.

    python benchmarks/bench_decode.py --out bench_decode.json [--quick] [--modules a,b]
    python benchmarks/bench_decode.py --dry-run        # CPU backend, tiny shapes: checks the logic
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import in_sequence as sequence  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = V = 128
SLOTS = DEFAULT_SLOTS = 8192   # SLOTS: this run's pool (--slots)
DEVICE = "cuda"
GATES = {"softplus": 0, "bounded": 1, "log": 2}


def load(name):
    from flashkda_ext.jit import load_module  # built or loaded once per process
    return load_module(name)


def route(meta):
    """The module and rule name the op would pick (flashkda_ext.dispatch: opt-in rules only when opted in)."""
    from flashkda_ext import dispatch
    rule = dispatch.select_rule("kda_decode", meta)
    return rule["module"], rule["name"]


def fla_fn():
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        return fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001
        print(f"fla not importable: {e!r}", file=sys.stderr)
        return None


def make_case(rows, HV, gen):
    r = lambda *s: torch.randn(*s, generator=gen, device=DEVICE)  # noqa: E731
    q = r(rows, HV, K).bfloat16()
    k = r(rows, HV, K).bfloat16()
    v = r(rows, HV, V).bfloat16()
    g = (r(rows, HV, K) - 1.0).bfloat16()
    beta = r(rows, HV).bfloat16()
    A_log = (torch.rand(HV, generator=gen, device=DEVICE) * 2.5 - 2.0).float()
    dt_bias = (r(HV * K) * 0.5).float()
    return q, k, v, g, beta, A_log, dt_bias


SLOT_ORDERS = ("random", "sorted", "contiguous", "grouped")
PAGE = 2 << 20   # the GPU's large page (2 MiB): what "grouped" keeps together


def slot_list(rows, order, gen, slot_bytes):
    """rows unique pool slots (int32) of one call, in the address pattern `order` (SLOT_ORDERS).
    grouped: random like "random", but in runs of whole 2 MiB pages (PAGE // slot_bytes consecutive
    slots a run, runs page-aligned): the same bytes over the fewest distinct pages. slot_bytes: one
    pool slot's state (HV x V x K x element size)."""
    if order == "contiguous":
        start = int(torch.randint(0, SLOTS - rows + 1, (1,), generator=gen, device=DEVICE))
        return torch.arange(start, start + rows, dtype=torch.int32, device=DEVICE)
    if order == "grouped":
        per = max(1, PAGE // slot_bytes)
        runs = torch.randperm(SLOTS // per, device=DEVICE, generator=gen)[:math.ceil(rows / per)]
        idx = (runs[:, None] * per + torch.arange(per, device=DEVICE)[None, :]).reshape(-1)[:rows]
        return idx.to(torch.int32)
    idx = torch.randperm(SLOTS, device=DEVICE, generator=gen)[:rows]
    if order == "sorted":
        idx = idx.sort().values
    return idx.to(torch.int32)


def ours_call(name, case, pool, idx, out):
    q, k, v, g, beta, A_log, dt_bias = case
    fn = load(name)["kda_decode"]
    return lambda: fn(q, k, v, g, beta, A_log, dt_bias, pool, idx, out, 0, 0.0, K ** -0.5, True, False)


def cast_call(name, case, pool, idx, out):
    """case's fp32 g and beta cast to bf16 (one pass each), then module `name`: what a caller holding an
    fp32 gate paid before kda_decode read it natively (arm "gb32_cast")."""
    q, k, v, g, beta, A_log, dt_bias = case
    fn = load(name)["kda_decode"]
    return lambda: fn(q, k, v, g.to(torch.bfloat16), beta.to(torch.bfloat16), A_log, dt_bias, pool, idx, out,
                      0, 0.0, K ** -0.5, True, False)


def op_call(case, pool, idx, out, fast=True):
    """The public op (validation, memo, routing, then the same module): what a caller pays. fast=False:
    with its signature fast path off, as FLASHKDA_EXT_FAST_PATH=0 sets it (arm "op_full")."""
    import flashkda_ext as fk
    from flashkda_ext import fast_path
    q, k, v, g, beta, A_log, dt_bias = case

    def run():
        fast_path.ENABLED = fast  # the two arms interleave in one process
        fk.kda_decode(q, k, v, g, beta, state=pool, state_indices=idx, A_log=A_log, dt_bias=dt_bias, out=out)
    return run


# slot-copy references (benchmarks/slot_copy.py): (label, share of a tile a program moves, warps)
SLOT_COPY_CONFIGS = (("copy_p1", 1, 8), ("copy_p2", 2, 8), ("copy_p4", 4, 4))
NOT_OURS = ("fla", "op", "op_full", "gb32", "gb32_cast") + tuple(c[0] for c in SLOT_COPY_CONFIGS)


def fla_call(fla, case, pool, idx, out):
    q, k, v, g, beta, A_log, dt_bias = case
    q4, k4, v4, g4 = (t.unsqueeze(1) for t in (q, k, v, g))
    b3, o4 = beta.unsqueeze(1), out.unsqueeze(1)
    return lambda: fla(q4, k4, v4, g4, b3, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                       scale=K ** -0.5, inplace_final_state=True, state_v_first=True,
                       ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, out=o4)


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
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    rows, HV = (64, 16) if DEVICE == "cuda" else (4, 2)
    slots = 256 if DEVICE == "cuda" else 16
    for sname, sdt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        case = make_case(rows, HV, gen)
        q, k, v, g, beta, A_log, dt_bias = case
        pool0 = (torch.randn(slots, HV, V, K, generator=gen, device=DEVICE) * 0.5).to(sdt)
        idx = torch.randperm(slots, device=DEVICE, generator=gen)[:rows].to(torch.int32)
        qn, kn, vv, gl, bb = REF.gates.prepare_token_inputs(
            q, k, v, g, beta, gate="softplus", A_log=A_log, dt_bias=dt_bias, lower_bound=None,
            scale=None, beta_is_logit=True, dtype=torch.float64)
        S0 = pool0[idx.long()].double().reshape(rows * HV, V, K)
        o_ref, S_ref = REF.step.delta_step(S0, qn.reshape(-1, K), kn.reshape(-1, K), vv.reshape(-1, V),
                                           gl.reshape(-1, K), bb.reshape(-1))
        o_ref, S_ref = o_ref.reshape(rows, HV, V), S_ref.reshape(rows, HV, V, K)
        err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
        meta = dict(device=DEVICE, rows=rows, value_heads=HV, work_items=rows * HV, state=sname,
                    offset="o32", slot_mode="unique", gate="softplus")
        name, _ = route(meta)
        entry = {}
        for who in ("ours", "fla"):
            if who == "fla" and fla is None:
                continue
            pool = pool0.clone()
            out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            (ours_call(name, case, pool, idx, out) if who == "ours" else fla_call(fla, case, pool, idx, out))()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            entry[who] = dict(out_rel_l2=err(out, o_ref), state_rel_l2=err(pool[idx.long()], S_ref))
        entry["module"] = name
        res[sname] = entry
    return res


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap)   # --out (folder or .json), --quick, --no-fla, --dry-run, --reps, ...
    ap.add_argument("--modules", default="", help="comma list of module stems (e.g. split8,row,stream); "
                    "default: the routed module only")
    ap.add_argument("--max-calls", type=int, default=128, help="calls per timed graph (cap; 1: one call a graph, "
                    "as the engines' benchmarks time it)")
    ap.add_argument("--quiet", action="store_true", help="no per-point lines")
    ap.add_argument("--states", default="f32,bf16")
    ap.add_argument("--heads", default="")
    ap.add_argument("--rows", default="")
    ap.add_argument("--name", default="decode", help="results file stem (when --out is a folder)")
    ap.add_argument("--slot-order", default="random", choices=SLOT_ORDERS,
                    help="slots of a call: random (unique, the default and the issue's grid), sorted (the same "
                         "random set in ascending order), contiguous (a run of rows slots at a random start) or "
                         "grouped (random runs of whole 2 MiB pages): how much of the cost is the pool's address "
                         "pattern")
    ap.add_argument("--op-arm", action="store_true",
                    help="also time the public op flashkda_ext.kda_decode (arm 'op': validation and routing "
                         "included; arm 'op_full': the same with its signature fast path off; the default arm "
                         "calls the routed module's function directly)")
    ap.add_argument("--slot-copy", nargs="?", const="copy_p1,copy_p2,copy_p4", default="",
                    help="also time benchmarks/slot_copy.py (Triton): the same slots read and written back "
                         "unchanged, no arithmetic: the address pattern's own cost (arms copy_p1/p2/p4, a "
                         "comma list of them, or all when given alone)")
    ap.add_argument("--gb32", action="store_true",
                    help="also time fp32 g and beta: arm 'gb32' calls the routed module's _gb32 twin (reads them "
                         "as fp32), arm 'gb32_cast' casts them to bf16 (one pass each) and calls the routed module")
    ap.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help="pool slots (the issue's grid: 8192)")
    ap.add_argument("--offset", default="auto", choices=("auto", "o32", "o64"),
                    help="slot-offset width of the modules called: auto (as the dispatcher decides from the pool's "
                         "size) or forced; o64 runs on any pool, o32 only on pools below 2^31 elements")
    return ap.parse_args(argv)


def main(argv=None):
    global K, V, SLOTS, DEVICE
    args = parse(argv)
    cfg = harness.config_from_args(args)
    DEVICE = cfg.device
    SLOTS = args.slots
    if not cfg.is_cuda:           # dry run: the CPU backend through the same module ABI
        K = V = 16
        SLOTS = min(SLOTS, 64)
    fla = None if (args.no_fla or not cfg.is_cuda) else fla_fn()
    if cfg.is_cuda:
        dev = torch.cuda.get_device_properties(0)
        dev_name, sms = dev.name, dev.multi_processor_count
    else:
        dev_name, sms = "cpu", 0
    dry = args.dry_run or not cfg.is_cuda
    heads = [int(x) for x in args.heads.split(",")] if args.heads else (
        [2] if dry else [8, 64] if args.quick else [8, 16, 32, 64])
    rows_list = [int(x) for x in args.rows.split(",")] if args.rows else (
        [1, 3] if dry else [1, 4, 16, 64, 256, 1024, 4096] if args.quick else [2 ** i for i in range(13)])
    if max(rows_list) > SLOTS:
        raise SystemExit(f"--slots {SLOTS}: a call of {max(rows_list)} rows needs at least that many unique slots")
    states = args.states.split(",") if not (dry and args.states == "f32,bf16") else ["f32"]
    stems = [s for s in args.modules.split(",") if s]
    copies = harness.pick_copy_arms(args.slot_copy, SLOT_COPY_CONFIGS, cfg.is_cuda)
    run = harness.Run(args.name, cfg, baseline="fla" if fla is not None else None,
                      primary_mode="graph" if cfg.is_cuda else "wall",
                      extra_meta={"slots": SLOTS, "gate": "softplus", "fla_used": fla is not None,
                                  "slot_order": args.slot_order})
    copy_tbps = run.ceiling["GBps"] / 1e3
    print(f"device {dev_name}, {sms} SMs; copy {copy_tbps:.3f} TB/s", flush=True)
    run.start(len(states) * len(heads) * len(rows_list))
    for sname in states:
        sdt = torch.float32 if sname == "f32" else torch.bfloat16
        esz = 4 if sname == "f32" else 2
        for HV in heads:
            gen = torch.Generator(device=DEVICE).manual_seed(HV)
            pool = torch.empty(SLOTS, HV, V, K, dtype=sdt, device=DEVICE)
            pool.normal_(generator=gen).mul_(0.5)
            for rows in rows_list:
                case = make_case(rows, HV, gen)
                out = torch.empty(rows, HV, V, dtype=torch.bfloat16, device=DEVICE)
                traffic = rows * HV * V * K * esz * 2
                M = harness.calls_per_graph(args.max_calls, traffic) if cfg.is_cuda else 2
                reps = 5 if traffic * M > 1e9 else 8
                idxs = [slot_list(rows, args.slot_order, gen, HV * V * K * esz) for _ in range(M)]
                offset = "o64" if pool.numel() > 2 ** 31 - 1 else "o32"  # as the dispatcher decides
                if args.offset != "auto":
                    if args.offset == "o32" and offset == "o64":
                        raise SystemExit(f"--offset o32: the pool ({pool.numel()} elements) needs 64-bit offsets")
                    offset = args.offset
                meta = dict(device=DEVICE, rows=rows, value_heads=HV, work_items=rows * HV, state=sname,
                            offset=offset, slot_mode="unique", gate="softplus")
                routed, rule = route(meta)
                names = [f"decode_{s}_{sname}_{offset}" for s in stems] if stems else [routed]
                arms = []
                for name in names:
                    label = name.replace("decode_", "").replace(f"_{sname}_{offset}", "") if stems else "ours"
                    arms.append(harness.Arm(label, sequence([ours_call(name, case, pool, i, out) for i in idxs]),
                                            calls=M, bytes=traffic))
                if args.gb32:
                    case32 = case[:3] + (case[3].float(), case[4].float()) + case[5:]
                    twin, _ = route(dict(meta, gb="f32"))
                    arms.append(harness.Arm("gb32", sequence([ours_call(twin, case32, pool, i, out) for i in idxs]),
                                            calls=M, bytes=traffic))
                    arms.append(harness.Arm("gb32_cast", sequence([cast_call(routed, case32, pool, i, out)
                                                                   for i in idxs]), calls=M, bytes=traffic))
                if args.op_arm:
                    arms.append(harness.Arm("op", sequence([op_call(case, pool, i, out) for i in idxs]),
                                            calls=M, bytes=traffic))
                    arms.append(harness.Arm("op_full", sequence([op_call(case, pool, i, out, False) for i in idxs]),
                                            calls=M, bytes=traffic))
                if copies:
                    from slot_copy import slot_copy_fn
                    for label, part, warps in copies:
                        arms.append(harness.Arm(label, sequence([slot_copy_fn(pool, i, part, warps) for i in idxs]),
                                                calls=M, bytes=traffic))
                if fla is not None:
                    arms.append(harness.Arm("fla", sequence([fla_call(fla, case, pool, i, out) for i in idxs]),
                                            calls=M, bytes=traffic))
                params = dict(state=sname, heads=HV, rows=rows, work_items=rows * HV, state_bytes=traffic,
                              calls_per_graph=M, module=routed, rule=rule, modules=names)
                # fewer samples for multi-millisecond points (8, or 5 for big runs, at the default --reps)
                case_reps = max(4, cfg.reps * reps // 10)
                rec = run.add(harness.Case(f"{sname}_h{HV}_r{rows}", params, arms, bytes=traffic, flush=False,
                                           reps=case_reps))
                parts = []
                for n, a in rec["arms"].items():
                    t = a["time_us"]
                    g_us = (t.get("graph") or {}).get("median")
                    w_us = (t.get("wall") or {}).get("median")
                    pct = (a.get("bandwidth", {}).get(run.primary_mode) or {}).get("pct_copy")
                    parts.append(f"{n}={'-' if g_us is None else f'{g_us:.1f}'}/"
                                 f"{'-' if w_us is None else f'{w_us:.0f}'}us"
                                 f"({'-' if pct is None else f'{pct:.0f}'}%)")
                if not args.quiet:
                    print(f"{sname} HV={HV} rows={rows}: {' '.join(parts)}", flush=True)
            del pool
            if cfg.is_cuda:
                torch.cuda.empty_cache()
    acc = accuracy(fla)
    summary = summarize(run.results, states) if fla is not None else {}
    run.extra.update(device=dev_name, sms=sms, copy_tbps=copy_tbps, slots=SLOTS, gate="softplus",
                     accuracy=acc, summary_by_state=summary)
    run.finish()
    print("accuracy", json.dumps(acc))
    print("summary", json.dumps(summary))
    print(markdown(run.results, copy_tbps, run.primary_mode))
    return 0


def summarize(results, states):
    """Per state dtype, against fla: geomean speedup in each timing mode of the best of our module
    arms per point ("ours"; graph, eager = device events, wall = host clock), the same for the
    public op when timed ("op"), and the minimum graph speedup. geomean_speedup_eager keeps its
    old meaning (the wall mode) for the earlier result files."""
    med = lambda t, m: (t.get(m) or {}).get("median")  # noqa: E731
    summary = {}
    for sname in states:
        ratios = {}
        for p in results:
            if p["params"]["state"] != sname or "fla" not in p["arms"]:
                continue
            fl = p["arms"]["fla"]["time_us"]
            ours = [a["time_us"] for n, a in p["arms"].items() if n not in NOT_OURS]
            who = {"ours": ours}
            if "op" in p["arms"]:
                who["op"] = [p["arms"]["op"]["time_us"]]
            for w, ts in who.items():
                for m in ("graph", "eager", "wall"):
                    best = min((med(t, m) for t in ts if med(t, m)), default=None)
                    if best and med(fl, m):
                        ratios.setdefault((w, m), []).append(med(fl, m) / best)
        if not ratios.get(("ours", "graph")):
            continue
        entry = dict(geomean_speedup_graph=harness.geomean(ratios[("ours", "graph")]),
                     min_speedup_graph=min(ratios[("ours", "graph")]),
                     geomean_speedup_eager=harness.geomean(ratios[("ours", "wall")]) if ratios.get(("ours", "wall")) else None,
                     points=len(ratios[("ours", "graph")]))
        for (w, m), r in sorted(ratios.items()):
            entry[f"{w}_{m}_geomean"] = harness.geomean(r)
        summary[sname] = entry
    return summary


def markdown(results, copy_tbps, mode="graph"):
    """A compact table per state dtype: best of ours (graph us, % of copy) and fla, per point.
    "eager" here is the host-inclusive wall time per call (the harness's "wall" mode). With the
    public-op arm: its eager time (device events) and wall time; with the slot copies: the fastest
    of them in graph replay, its % of copy, and ours as a share of it."""
    med = lambda t, m: (t.get(m) or {}).get("median")  # noqa: E731
    copies = [c[0] for c in SLOT_COPY_CONFIGS]
    has_op = any("op" in p["arms"] for p in results)
    has_copy = any(c in p["arms"] for p in results for c in copies)
    fmt = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"copy bandwidth {copy_tbps:.2f} TB/s (read + write)"]
    for sname in sorted({p["params"]["state"] for p in results}):
        head = ["HV", "rows", "ours", "fla", "x graph", "x eager", "% copy"]
        if has_op:
            head += ["op eager / wall us", "x op eager / wall"]
        if has_copy:
            head += ["slot copy us (% copy)", "ours / slot copy"]
        lines += ["", f"state {sname}: {mode} us (eager us) ours [module] | fla | speedup {mode} / eager | "
                      f"ours % of copy", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for p in results:
            if p["params"]["state"] != sname:
                continue
            ours = {n: a for n, a in p["arms"].items() if n not in NOT_OURS and med(a["time_us"], mode)}
            if not ours:
                continue
            n, a = min(ours.items(), key=lambda kv: med(kv[1]["time_us"], mode))
            stem = p["params"]["module"].replace("decode_", "").rsplit("_", 2)[0] if n == "ours" else n
            if p["params"]["module"].endswith("o64"):
                stem += "/o64"
            g, w = med(a["time_us"], mode), med(a["time_us"], "wall")
            f = p["arms"].get("fla")
            ft = f["time_us"] if f else {}
            fg, fw, fe = med(ft, mode), med(ft, "wall"), med(ft, "eager")
            pct = (a.get("bandwidth", {}).get(mode) or {}).get("pct_copy")
            cells = [str(p["params"]["heads"]), str(p["params"]["rows"]), f"{g:.1f} ({fmt(w, 0)}) {stem}",
                     f"{fmt(fg)} ({fmt(fw, 0)})", fmt(fg / g if fg else None, 2),
                     fmt(fw / w if fw and w else None, 2), fmt(pct, 0)]
            if has_op:
                o = (p["arms"].get("op") or {}).get("time_us", {})
                oe, ow = med(o, "eager"), med(o, "wall")
                cells += [f"{fmt(oe)} / {fmt(ow, 0)}",
                          f"{fmt(fe / oe if fe and oe else None, 2)} / {fmt(fw / ow if fw and ow else None, 2)}"]
            if has_copy:
                cs = [(med(p["arms"][c]["time_us"], mode), p["arms"][c]) for c in copies
                      if c in p["arms"] and med(p["arms"][c]["time_us"], mode)]
                if cs:
                    cg, ca = min(cs, key=lambda x: x[0])
                    cp = (ca.get("bandwidth", {}).get(mode) or {}).get("pct_copy")
                    cells += [f"{cg:.1f} ({fmt(cp, 0)})", fmt(g / cg, 2)]
                else:
                    cells += ["-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
