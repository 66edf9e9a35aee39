"""Benchmark of context-parallel prefill on one GPU (flashkda_ext.context_parallel, issue 33).

Cases: one sequence of T in {32768, 131072} tokens (--tokens), H = HV = 16, K = V = 128, bf16 inputs,
softplus gate, fp32 state, split into R in {2, 4, 8} equal pieces (--ranks). Per case:

  piece    the summary (A, B) of one rank's piece (two kda_prefill calls, the A one K-wide; the arm
           summary_one_call: one call over 2 HV value heads) against kda_prefill of the same piece from a
           known state: time per token and the ratio summary / prefill (the extra work a rank in the
           middle of a sequence does before the exchange)
  fold     fold() of the R ranks' summaries (R - 2 affine steps in float64 on the GPU)
  simulate simulate() end to end (all R ranks in turn, no communication) against one-GPU kda_prefill
           of the whole prompt: the total work of context parallelism, serialized

Timing goes through benchmarks/harness.py: CUDA events around one call with L2 flushed before each call
(cold L2), median of --reps ("eager"), and the host-inclusive wall time ("wall"); arms interleaved.

    python benchmarks/bench_cp.py --out bench_cp.json [--quick]
    python benchmarks/bench_cp.py --dry-run       # CPU backend, tiny shapes: checks the logic
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make(T, H, D, dev, dtype):
    d = {n: torch.randn(1, T, H, D, device=dev).to(dtype) for n in ("q", "k", "v", "g")}
    d["beta"] = torch.randn(1, T, H, device=dev).to(dtype)
    gk = dict(gate="softplus", A_log=torch.rand(H, device=dev) * 0.5 - 1.0,
              dt_bias=torch.randn(H * D, device=dev) * 0.5)
    return d, gk


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap)   # --out (folder or .json), --reps, --quick, --dry-run, --modes, ...
    ap.add_argument("--tokens", default="32768,131072")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--name", default="cp", help="results file stem (when --out is a folder)")
    ap.set_defaults(reps=12, modes="eager,wall")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    cfg = harness.config_from_args(args)
    import flashkda_ext as fk
    from flashkda_ext import context_parallel as cp
    dev = torch.device(cfg.device)
    dry = args.dry_run or not cfg.is_cuda
    D, H = (16, 2) if dry else (128, args.heads)
    dtype = torch.float32 if dry else torch.bfloat16
    tokens = [256] if dry else [int(t) for t in args.tokens.split(",")]
    if cfg.quick and not dry:
        tokens = tokens[:1]
    ranks = [2, 4] if dry else [int(r) for r in args.ranks.split(",")]
    torch.manual_seed(0)
    run = harness.Run(args.name, cfg, baseline="prefill", primary_mode="eager" if cfg.is_cuda else "wall",
                      extra_meta={"state": "f32", "heads": H, "head_dim": D})
    run.start(len(tokens) * len(ranks) * 3)
    pm, rows = run.primary_mode, []
    for T in tokens:
        d, gk = make(T, H, D, dev, dtype)
        h0 = torch.randn(1, H, D, D, device=dev) * 0.5
        whole = [d[n] for n in ("q", "k", "v", "g", "beta")]
        for R in ranks:
            p = cp.plan([0, T], R)
            a, b = p.token_range(1)          # rank 1's piece: inside the sequence (spanning when R > 2)
            piece = [x[:, a:b].contiguous() for x in whole]
            L = b - a

            def summary(piece=piece):
                cp.segment_summary(*piece, **gk)

            def summary_one_call(piece=piece):
                cp.segment_summary(*piece, one_call=True, **gk)   # one call over 2 HV value heads (V == K)

            def prefill(piece=piece):
                fk.kda_prefill(*piece, initial_state=h0, output_final_state=True, **gk)

            params = dict(T=T, R=R, H=H, piece_tokens=L)
            rec = run.add(harness.Case(f"T{T} R{R} piece", dict(params, what="piece"),
                                       [harness.Arm("summary", summary, graph=False),
                                        harness.Arm("summary_one_call", summary_one_call, graph=False),
                                        harness.Arm("prefill", prefill, graph=False)]))
            t_sum = rec["arms"]["summary"]["time_us"].get(pm, {}).get("median")
            t_pre = rec["arms"]["prefill"]["time_us"].get(pm, {}).get("median")
            t_one_call = rec["arms"]["summary_one_call"]["time_us"].get(pm, {}).get("median")
            row = dict(T=T, R=R, piece_tokens=L, summary_us=t_sum, prefill_us=t_pre, summary_one_call_us=t_one_call,
                       ratio_one_call_over_prefill=(t_one_call / t_pre) if t_one_call and t_pre else None,
                       summary_ns_per_token=t_sum and 1e3 * t_sum / L, prefill_ns_per_token=t_pre and 1e3 * t_pre / L,
                       ratio_summary_over_prefill=(t_sum / t_pre) if t_sum and t_pre else None)

            # the fold of this plan's summaries (made once, as the ranks would send them)
            summaries = [None] * R
            summaries[0] = cp.Summary(None, torch.randn(H, D, D, device=dev))
            for r in range(1, R - 1):
                lo, hi = p.token_range(r)
                summaries[r] = cp.segment_summary(*(x[:, lo:hi].contiguous() for x in whole), **gk)
            rec = run.add(harness.Case(f"T{T} R{R} fold", dict(params, what="fold"),
                                       [harness.Arm("fold", lambda s=summaries, p=p: cp.fold(s, p), graph=False)]))
            row["fold_us"] = rec["arms"]["fold"]["time_us"].get(pm, {}).get("median")

            def simulate(p=p):
                cp.simulate(*whole, plan=p, initial_state=h0, **gk)

            def one_device():
                fk.kda_prefill(*whole, initial_state=h0, output_final_state=True, **gk)

            rec = run.add(harness.Case(f"T{T} R{R} simulate", dict(params, what="simulate"),
                                       [harness.Arm("simulate", simulate, graph=False),
                                        harness.Arm("prefill", one_device, graph=False)], reps=max(4, cfg.reps // 2)))
            t_sim = rec["arms"]["simulate"]["time_us"].get(pm, {}).get("median")
            t_one = rec["arms"]["prefill"]["time_us"].get(pm, {}).get("median")
            row.update(simulate_us=t_sim, one_device_us=t_one,
                       ratio_simulate_over_one_device=(t_sim / t_one) if t_sim and t_one else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    run.extra.update(device=torch.cuda.get_device_name() if cfg.is_cuda else "cpu", rows=rows,
                     time=time.strftime("%Y-%m-%d %H:%M:%S"))
    run.finish()
    print("\n%-8s %3s %9s %12s %12s %7s %7s %9s %11s %11s %6s" % (
        "T", "R", "piece", "summ ns/tok", "pref ns/tok", "s/p", "1call/p", "fold us", "sim us", "one us", "sim/1"))
    for r in rows:
        def f(x, fmt):
            return "-" if x is None else fmt % x
        print("%-8d %3d %9d %12s %12s %7s %7s %9s %11s %11s %6s" % (
            r["T"], r["R"], r["piece_tokens"], f(r["summary_ns_per_token"], "%.2f"),
            f(r["prefill_ns_per_token"], "%.2f"),
            f(r["ratio_summary_over_prefill"], "%.2f"), f(r["ratio_one_call_over_prefill"], "%.2f"),
            f(r["fold_us"], "%.1f"), f(r["simulate_us"], "%.1f"),
            f(r["one_device_us"], "%.1f"), f(r["ratio_simulate_over_one_device"], "%.2f")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
