"""Kernel time of the prefill prep kernel alone (and of the state pass, and the call's event time),
module against module on identical inputs, cold L2: issue 32's stage 1 (prep efficiency).

    python3 scripts/prep_timing.py --modules prefill_lp_nostore_vt16_f32,prefill_lp_tf32_vt16_f32 \
        --out prep_timing.json
    python3 scripts/prep_timing.py --dry-run      # CPU: cases, arms, records and the table, no timing

Every case also times the module its route picks (the baseline arm, "routed"). Each round is one
torch.profiler session per (case, gate): for every arm, in interleaved order (A B C, then C B A),
--reps calls, each after an L2 flush (a 256 MiB+ write outside the call). The profiler's device
spans give each call's prep kernel (kda_prep_lite_kernel) and state pass (kda_state_kernel) by
launch order; CUDA events around the call give its event time. Medians over rounds x reps.
SM-cycles a chunk-head = prep us x clock (1.98 GHz, the H200's boost; --ghz) x SMs (132) / the
chunk-heads of the case (sum of ceil(len / 64) x heads: real chunks, gap slots left out; the ncu
figure of docs/perf-notes.md, 14.8 k, divided by the 8208 CTAs of the grid at 1.79 GHz).
Probe modules (params.prep_probe) compute wrong results by design; their state pass runs on
whatever the workspace holds, so only their prep figure means anything.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
K = V = 128
GATES = {"softplus": 0, "bounded": 1}
CASES = {"1x32768 H16": ([32768], 16), "1x8192 H16": ([8192], 16), "4x4096 H16": ([4096] * 4, 16)}


def chunk_heads(lens, H):
    return sum((L + 63) // 64 for L in lens) * H


def sm_cycles(prep_us, lens, H, ghz, sms):
    return prep_us * 1e-6 * ghz * 1e9 * sms / chunk_heads(lens, H)


def routed(lens, H, gate):
    from flashkda_ext import dispatch
    meta = dict(device="cuda", num_seqs=len(lens), value_heads=H, total_tokens=sum(lens), max_seqlen=None,
                work_items=len(lens) * H, state="f32", offset="o64", gate=gate, checkpoints=False)
    return dispatch.module_name("kda_prefill", meta)


def make(lens, H, dev, seed):
    import torch
    g = torch.Generator(device=dev).manual_seed(seed)
    T = sum(lens)

    def r(*shape):
        return torch.randn(*shape, device=dev, generator=g)
    d = dict(q=r(1, T, H, K).bfloat16(), k=r(1, T, H, K).bfloat16(), v=r(1, T, H, V).bfloat16(),
             g=r(1, T, H, K).bfloat16(), beta=r(1, T, H).bfloat16(),
             A_log=torch.rand(H, device=dev, generator=g) * 0.5 - 1.0, dt_bias=r(H * K) * 0.5)
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    d["cu"] = torch.tensor(cu, dtype=torch.int32, device=dev)
    d["init"] = r(len(lens), H, V, K)
    return d


def time_case(lens, H, gate, arms, reps, rounds, flush):
    """{arm: {"prep": [us], "state": [us], "event": [us]}} for one case and gate."""
    import torch
    import tvm_ffi
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from flashkda_ext import jit
    dev = torch.device("cuda")
    d = make(lens, H, dev, seed=1234)
    N, T = len(lens), sum(lens)
    mods = {a: jit.load_module(a) for a in arms}
    ws = torch.empty(int(mods[arms[0]]["kda_prefill_workspace_bytes"](T, N, H)), dtype=torch.uint8, device=dev)
    fin, out = torch.empty_like(d["init"]), torch.empty_like(d["v"])

    def call(a):
        with tvm_ffi.use_torch_stream():
            mods[a]["kda_prefill"](d["q"], d["k"], d["v"], d["g"], d["beta"], d["A_log"], d["dt_bias"], d["cu"],
                                   d["init"], fin, None, None, out, ws, GATES[gate], -5.0, K ** -0.5, True, False, 0)
    for a in arms:  # warm-up: module load, allocator
        call(a)
        call(a)
    torch.cuda.synchronize()
    res = {a: {"prep": [], "state": [], "event": []} for a in arms}
    val = 0.0
    for rnd in range(rounds):
        order = list(arms) if rnd % 2 == 0 else list(reversed(arms))
        seq, evs = [], []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for a in order:
                for _ in range(reps):
                    val = 1.0 - val
                    flush.fill_(val)
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    call(a)
                    e.record()
                    seq.append(a)
                    evs.append((s, e))
            torch.cuda.synchronize()
        kern = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                      if ev.device_type == DeviceType.CUDA)
        preps = [t1 - t0 for t0, t1, n in kern if "kda_prep" in n]
        states = [t1 - t0 for t0, t1, n in kern if "kda_state" in n]
        if len(preps) != len(seq) or len(states) != len(seq):
            raise RuntimeError(f"profiler saw {len(preps)} prep and {len(states)} state kernels for {len(seq)} calls")
        for a, p, st, (s, e) in zip(seq, preps, states, evs):
            res[a]["prep"].append(p)
            res[a]["state"].append(st)
            res[a]["event"].append(s.elapsed_time(e) * 1e3)
    return res


def table(rows, ghz, sms):
    head = f"{'case':12s} {'gate':8s} {'module':30s} {'prep us':>8s} {'/routed':>7s} {'k cyc/ch-h':>10s} " \
           f"{'state us':>8s} {'event us':>8s}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['case']:12s} {r['gate']:8s} {r['module'][:30]:30s} {r['prep_us']:8.1f} {r['prep_ratio']:7.3f} "
                     f"{r['kcycles']:10.2f} {r['state_us']:8.1f} {r['event_us']:8.1f}")
    lines.append(f"k cyc/ch-h: prep kernel us x {ghz} GHz x {sms} SMs / chunk-heads, in thousands "
                 f"(issue 32's stage-1 target: <= 7.4)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", default="prefill_lp_nostore_vt16_f32,prefill_lp_memonly_vt16_f32,"
                    "prefill_lp_tf32_vt16_f32,prefill_lp_wub_vt16_f32,prefill_lp_both_vt16_f32",
                    help="arms beside each case's routed module")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--gates", default="bounded,softplus")
    ap.add_argument("--reps", type=int, default=6, help="calls per arm per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ghz", type=float, default=1.98)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--out", default="")
    ap.add_argument("--dry-run", action="store_true", help="CPU: check cases, records and the table")
    a = ap.parse_args(argv)
    from flashkda_ext import jit
    extra = [m for m in a.modules.split(",") if m]
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; known: {', '.join(CASES)}")
    gates = a.gates.split(",")
    plan = []
    for c in cases:
        lens, H = CASES[c]
        for gate in gates:
            base = routed(lens, H, gate)
            arms = [base] + [m for m in extra if m != base]
            for m in arms:
                rec = jit.get_record(m)
                if rec["family"] != "kda_prefill" or rec["backend"] != "cuda":
                    ap.error(f"{m} is not a CUDA kda_prefill module")
            plan.append((c, lens, H, gate, arms))
    rows = []
    if a.dry_run:
        import random
        rnd = random.Random(0)
        results = [{m: {k: [rnd.uniform(100, 1000) for _ in range(3)] for k in ("prep", "state", "event")}
                    for m in arms} for *_, arms in plan]
    else:
        import torch
        if not torch.cuda.is_available():
            ap.error("no GPU: use --dry-run")
        l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 0)
        flush = torch.empty(max(2 * l2, 256 << 20) // 4, dtype=torch.float32, device="cuda")
        results = []
        for c, lens, H, gate, arms in plan:
            results.append(time_case(lens, H, gate, arms, a.reps, a.rounds, flush))
            print(f"timed {c} {gate}: {len(arms)} arms", flush=True)
    for (c, lens, H, gate, arms), res in zip(plan, results):
        base_prep = statistics.median(res[arms[0]]["prep"])
        for m in arms:
            p = statistics.median(res[m]["prep"])
            rows.append(dict(case=c, gate=gate, module=m, routed=m == arms[0], prep_us=p, prep_ratio=p / base_prep,
                             kcycles=sm_cycles(p, lens, H, a.ghz, a.sms) / 1e3,
                             state_us=statistics.median(res[m]["state"]),
                             event_us=statistics.median(res[m]["event"]),
                             prep_min_us=min(res[m]["prep"]), samples=len(res[m]["prep"]),
                             chunk_heads=chunk_heads(lens, H)))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(rows=rows, ghz=a.ghz, sms=a.sms, reps=a.reps, rounds=a.rounds,
                                               dry_run=a.dry_run), indent=1))
    if a.dry_run:
        print("DRY RUN: random figures, nothing timed")
    print(table(rows, a.ghz, a.sms))
    assert all(math.isfinite(r["kcycles"]) for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
