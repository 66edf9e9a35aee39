"""Benchmark of the CUDA kda_verify modules (speculative-decoding verify) against fla's
fused_recurrent_kda_fwd with a 2-D ssm_state_indices and num_accepted_tokens, one run.

Grid (issue 30): T in {2, 4, 8} draft tokens per request, requests {1, 8, 64, 256, 1024}, heads
H = HV in {16, 32, 64}, fp32 and bf16 state, softplus gate; every request has T tokens, its T
states go to T distinct random slots and it starts from one of them (num_accepted_tokens random in
[1, T]). For each point: CUDA-graph replay time per call (device events) of the routed module and of
fla, and the memory floor: one state read + T state writes per (request, head) + the inputs and the
output, at the device-to-device copy bandwidth measured in the same run ("% copy" is the floor's
share of the measured time). Cold L2 by rotation: M calls on M different slot tables, M sized so one
timed run moves well over the 60 MB L2.

    python3 benchmarks/bench_verify.py --quick          # T {2, 8}, rows {1, 64, 1024}, H {16, 64}
    python3 benchmarks/bench_verify.py --out results/   # the whole grid
    python3 benchmarks/bench_verify.py --dry-run        # CPU backend, tiny shapes: checks the logic
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import in_sequence as sequence  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = V = 128
DEVICE = "cuda"


def load(name):
    from flashkda_ext.jit import load_module  # built or loaded once per process
    return load_module(name)


def routed(meta):
    from flashkda_ext import dispatch
    return dispatch.module_name("kda_verify", meta)


def fla_fn():
    try:
        import inspect

        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001
        print(f"fla not importable: {e!r}", file=sys.stderr)
        return None
    params = inspect.signature(fused_recurrent_kda_fwd).parameters
    missing = [n for n in ("num_accepted_tokens", "ssm_state_indices", "state_v_first") if n not in params]
    if missing:  # an fla without the speculative-decoding path: no peer rather than a wrong one
        print(f"fla's fused_recurrent_kda_fwd lacks {missing}: fla left out", file=sys.stderr)
        return None
    return fused_recurrent_kda_fwd


def make_case(N, T, HV, gen):
    r = lambda *s: torch.randn(*s, generator=gen, device=DEVICE)  # noqa: E731
    tokens = N * T
    q, k = r(1, tokens, HV, K).bfloat16(), r(1, tokens, HV, K).bfloat16()
    v = r(1, tokens, HV, V).bfloat16()
    g = (r(1, tokens, HV, K) - 1.0).bfloat16()
    beta = r(1, tokens, HV).bfloat16()
    A_log = (torch.rand(HV, generator=gen, device=DEVICE) * 2.5 - 2.0).float()
    dt_bias = (r(HV * K) * 0.5).float()
    cu = torch.arange(0, tokens + 1, T, dtype=torch.int32, device=DEVICE)
    return q, k, v, g, beta, A_log, dt_bias, cu


def slot_table(N, T, slots, gen):
    idx = torch.randperm(slots, device=DEVICE, generator=gen)[:N * T].reshape(N, T).to(torch.int32)
    nacc = torch.randint(1, T + 1, (N,), device=DEVICE, generator=gen, dtype=torch.int32)
    return idx, nacc


def ours_call(name, case, pool, idx, nacc, out):
    q, k, v, g, beta, A_log, dt_bias, cu = case
    fn = load(name)["kda_verify"]
    return lambda: fn(q, k, v, g, beta, A_log, dt_bias, pool, idx, cu, nacc, None, None, None, out, 0, 0.0, K ** -0.5,
                      True, False)


def cast_call(name, case, pool, idx, nacc, out):
    """case's fp32 g and beta cast to bf16 (one pass each), then module `name`: what a caller holding an
    fp32 gate paid before kda_verify read it natively (arm "gb32_cast")."""
    q, k, v, g, beta, A_log, dt_bias, cu = case
    fn = load(name)["kda_verify"]
    return lambda: fn(q, k, v, g.to(torch.bfloat16), beta.to(torch.bfloat16), A_log, dt_bias, pool, idx, cu, nacc,
                      None, None, out, 0, 0.0, K ** -0.5, True, False)


def op_call(case, pool, idx, nacc, out, T):
    import flashkda_ext as fk
    q, k, v, g, beta, A_log, dt_bias, cu = case
    return lambda: fk.kda_verify(q, k, v, g, beta, state=pool, state_indices=idx, cu_seqlens=cu,
                                 num_accepted_tokens=nacc, max_seqlen=T, A_log=A_log, dt_bias=dt_bias, out=out)


def fla_call(fla, case, pool, idx, nacc, out):
    q, k, v, g, beta, A_log, dt_bias, cu = case
    return harness.fla_verify_fn(q, k, v, g, beta, state=pool, state_indices=idx, cu_seqlens=cu,
                                 num_accepted_tokens=nacc, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, out=out,
                                 fn=fla)


# state-copy references (benchmarks/verify_copy.py): (label, share of a tile a program moves, warps)
COPY_CONFIGS = (("copy_p1", 1, 8), ("copy_p2", 2, 8), ("copy_p4", 4, 4))


def state_bytes(N, T, HV, esz):
    """The state part of the floor: one read and T writes per (request, head)."""
    return N * HV * V * K * esz * (1 + T)


def floor_bytes(N, T, HV, esz):
    """One state read + T state writes per (request, head), plus q, k, v, g, beta in and out."""
    state = state_bytes(N, T, HV, esz)
    tokens = N * T
    io = tokens * HV * (K * 2 * 3 + V * 2 * 2 + 2)  # q, k, g, v, out (bf16), beta
    return state + io


def accuracy(fla, name_of):
    """Output / state rel. L2 error against the float64 reference at one point: ours vs fla."""
    from flashkda_ext import reference as REF
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    N, T, HV = (16, 4, 16) if DEVICE == "cuda" else (3, 2, 2)
    slots = N * T + 8
    res = {}
    for sname, sdt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        case = make_case(N, T, HV, gen)
        pool0 = (torch.randn(slots, HV, V, K, generator=gen, device=DEVICE) * 0.5).to(sdt)
        idx, nacc = slot_table(N, T, slots, gen)
        q, k, v, g, beta, A_log, dt_bias, cu = case
        ro, rp = REF.kda_verify_step(*(t.cpu() for t in (q, k, v, g, beta)), state=pool0.cpu(),
                                     state_indices=idx.cpu(), cu_seqlens=cu.cpu(), num_accepted_tokens=nacc.cpu(),
                                     A_log=A_log.cpu(), dt_bias=dt_bias.cpu())
        err = lambda a, b: ((a.double().cpu() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
        written = idx.flatten().long().cpu()
        entry = {"module": name_of(sname)}
        for who in ("ours", "fla"):
            if who == "fla" and fla is None:
                continue
            pool = pool0.clone()
            out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=DEVICE)
            (ours_call(entry["module"], case, pool, idx, nacc, out) if who == "ours"
             else fla_call(fla, case, pool, idx, nacc, out))()
            entry[who] = dict(out_rel_l2=err(out, ro), state_rel_l2=err(pool.cpu()[written], rp[written]))
        res[sname] = entry
    return res


def main(argv=None):
    global K, V, DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap)
    ap.add_argument("--tokens", default="", help="comma list of T (draft tokens per request)")
    ap.add_argument("--rows", default="", help="comma list of request counts")
    ap.add_argument("--heads", default="", help="comma list of H = HV")
    ap.add_argument("--states", default="f32,bf16")
    ap.add_argument("--op-arm", action="store_true", help="also time the public op flashkda_ext.kda_verify")
    ap.add_argument("--modules", default="", help="comma list of module stems timed beside the routed one "
                    "(arm 'ours'), e.g. bulk4j4,stage2j8: arms named by stem (jit/modules/verify_cuda.json)")
    ap.add_argument("--slot-copy", nargs="?", const="copy_p1,copy_p2,copy_p4", default="",
                    help="also time benchmarks/verify_copy.py (Triton): each request's read tile copied unchanged "
                         "to its token slots, no arithmetic, no inputs or outputs: the state traffic's own cost "
                         "(arms copy_p1/p2/p4, %% of their own state bytes; a comma list, or all when given alone)")
    ap.add_argument("--gb32", action="store_true",
                    help="also time fp32 g and beta: arm 'gb32' calls the routed module's _gb32 twin (reads them "
                         "as fp32), arm 'gb32_cast' casts them to bf16 (one pass each) and calls the routed module")
    ap.add_argument("--max-calls", type=int, default=64, help="calls per timed graph (cap; 1: one call a graph, "
                    "as the engines' benchmarks time it)")
    ap.add_argument("--name", default="verify", help="results file stem (when --out is a folder)")
    args = ap.parse_args(argv)
    cfg = harness.config_from_args(args)
    DEVICE = cfg.device
    dry = args.dry_run or not cfg.is_cuda
    if dry:
        K = V = 16
    fla = None if (args.no_fla or not cfg.is_cuda) else fla_fn()
    ints = lambda s, d: [int(x) for x in s.split(",")] if s else d  # noqa: E731
    Ts = ints(args.tokens, [2] if dry else [2, 8] if args.quick else [2, 4, 8])
    rows_list = ints(args.rows, [1, 3] if dry else [1, 64, 1024] if args.quick else [1, 8, 64, 256, 1024])
    heads = ints(args.heads, [2] if dry else [16, 64] if args.quick else [16, 32, 64])
    states = ["f32"] if dry and args.states == "f32,bf16" else args.states.split(",")
    copies = harness.pick_copy_arms(args.slot_copy, COPY_CONFIGS, cfg.is_cuda)
    from flashkda_ext.jit import all_records
    records = {r["name"] for r in all_records()}
    run = harness.Run(args.name, cfg, baseline="fla" if fla is not None else None,
                      primary_mode="graph" if cfg.is_cuda else "wall",
                      extra_meta={"gate": "softplus", "fla_used": fla is not None})
    copy_tbps = run.ceiling["GBps"] / 1e3
    print(f"copy {copy_tbps:.3f} TB/s", flush=True)
    run.start(len(states) * len(heads) * len(rows_list) * len(Ts))
    for sname in states:
        sdt = torch.float32 if sname == "f32" else torch.bfloat16
        esz = 4 if sname == "f32" else 2
        for HV in heads:
            slots = max(2048, max(rows_list) * (max(Ts) + 1)) if not dry else 32
            gen = torch.Generator(device=DEVICE).manual_seed(HV)
            pool = torch.empty(slots, HV, V, K, dtype=sdt, device=DEVICE)
            pool.normal_(generator=gen).mul_(0.5)
            for T in Ts:
                for N in rows_list:
                    case = make_case(N, T, HV, gen)
                    out = torch.empty(1, N * T, HV, V, dtype=torch.bfloat16, device=DEVICE)
                    nbytes = floor_bytes(N, T, HV, esz)
                    M = harness.calls_per_graph(args.max_calls, nbytes) if cfg.is_cuda else 2
                    tables = [slot_table(N, T, slots, gen) for _ in range(M)]
                    offset = "o64" if pool.numel() > 2 ** 31 - 1 else "o32"
                    meta = dict(device=DEVICE, num_seqs=N, value_heads=HV, total_tokens=N * T, max_seqlen=T,
                                work_items=N * HV, state=sname, offset=offset, gate="softplus")
                    name = routed(meta)
                    arms = [harness.Arm("ours", sequence([ours_call(name, case, pool, i, a, out) for i, a in tables]),
                                        calls=M, bytes=nbytes)]
                    for stem in [x for x in args.modules.split(",") if x]:
                        other = f"verify_{stem}_{sname}_{offset}"
                        if other != name and other in records:
                            arms.append(harness.Arm(stem, sequence([ours_call(other, case, pool, i, a, out)
                                                                    for i, a in tables]), calls=M, bytes=nbytes))
                    if args.gb32 and cfg.is_cuda:
                        case32 = case[:3] + (case[3].float(), case[4].float()) + case[5:]
                        twin = routed(dict(meta, gb="f32"))
                        arms.append(harness.Arm("gb32", sequence([ours_call(twin, case32, pool, i, a, out)
                                                                  for i, a in tables]), calls=M, bytes=nbytes))
                        arms.append(harness.Arm("gb32_cast", sequence([cast_call(name, case32, pool, i, a, out)
                                                                       for i, a in tables]), calls=M, bytes=nbytes))
                    if args.op_arm:
                        arms.append(harness.Arm("op", sequence([op_call(case, pool, i, a, out, T) for i, a in tables]),
                                                calls=M, bytes=nbytes))
                    if copies:
                        from verify_copy import verify_copy_fn
                        cu = case[-1]
                        for label, part, warps in copies:  # bytes: the state traffic only (module docstring)
                            arms.append(harness.Arm(label, sequence([verify_copy_fn(pool, i, a, cu, T, part, warps)
                                                                     for i, a in tables]),
                                                    calls=M, bytes=state_bytes(N, T, HV, esz)))
                    if fla is not None:
                        arms.append(harness.Arm("fla", sequence([fla_call(fla, case, pool, i, a, out)
                                                                 for i, a in tables]), calls=M, bytes=nbytes))
                    params = dict(state=sname, T=T, rows=N, heads=HV, work_items=N * HV, floor_bytes=nbytes,
                                  calls_per_graph=M, module=name)
                    rec = run.add(harness.Case(f"{sname}_T{T}_h{HV}_r{N}", params, arms, bytes=nbytes, flush=False))
                    parts = []
                    for n, a in rec["arms"].items():
                        t = (a["time_us"].get(run.primary_mode) or {}).get("median")
                        pct = (a.get("bandwidth", {}).get(run.primary_mode) or {}).get("pct_copy")
                        parts.append(f"{n}={'-' if t is None else f'{t:.1f}'}us"
                                     f"({'-' if pct is None else f'{pct:.0f}'}% of floor)")
                    print(f"{sname} T={T} HV={HV} rows={N}: {' '.join(parts)}", flush=True)
            del pool
            if cfg.is_cuda:
                torch.cuda.empty_cache()
    acc = accuracy(fla, lambda s: routed(dict(device=DEVICE, num_seqs=16, value_heads=16, total_tokens=64,
                                              max_seqlen=4, work_items=256, state=s, offset="o32",
                                              gate="softplus")))
    run.extra.update(copy_tbps=copy_tbps, accuracy=acc, summary_by_state=summarize(run.results, run.primary_mode))
    run.finish()
    print("accuracy", json.dumps(acc))
    print("summary", json.dumps(run.extra["summary_by_state"]))
    return 0


def summarize(results, mode):
    """Per state dtype: geomean and min speedup over fla, and the floor share from 2048 work items,
    of the routed module (arm 'ours'), and the same per timed arm under 'arms' (--modules candidates
    included, over the points where they ran)."""
    med = lambda a: (a["time_us"].get(mode) or {}).get("median")  # noqa: E731

    def stats(pts, arm):
        ratios = [med(p["arms"]["fla"]) / med(p["arms"][arm]) for p in pts
                  if arm in p["arms"] and "fla" in p["arms"] and med(p["arms"]["fla"]) and med(p["arms"][arm])]
        big = [(p["arms"][arm].get("bandwidth", {}).get(mode) or {}).get("pct_copy") for p in pts
               if arm in p["arms"] and p["params"]["work_items"] >= 2048]
        big = [x for x in big if x]
        return dict(geomean_speedup=harness.geomean(ratios) if ratios else None,
                    min_speedup=min(ratios) if ratios else None,
                    min_pct_floor_from_2048=min(big) if big else None)

    out = {}
    for sname in sorted({p["params"]["state"] for p in results}):
        pts = [p for p in results if p["params"]["state"] == sname]
        arms = sorted({a for p in pts for a in p["arms"] if a != "fla"})  # copies: % of their own bytes
        out[sname] = dict(points=len(pts), **stats(pts, "ours"), arms={a: stats(pts, a) for a in arms})
    return out


if __name__ == "__main__":
    sys.exit(main())
