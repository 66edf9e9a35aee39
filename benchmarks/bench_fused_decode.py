#!/usr/bin/env python
"""Fused decode benchmark: flashkda_ext.fused_kda_decode against what a serving engine runs today.

Arms, all on identical inputs and the same pools, interleaved A B B A, cold L2 (harness.py):

  fused     flashkda_ext.fused_kda_decode: conv cache update + SiLU + gate + l2norm + step +
            gated RMSNorm, one launch.
  unfused   the engine's sequence: causal conv update with its cache (torch: gather, window,
            weighted sum, SiLU, scatter), the gate (fla's fused_kda_gate, or torch without fla),
            the recurrent step (fla's fused_recurrent_kda_fwd on the pool in place, beta sigmoid and
            q/k l2norm inside fla's kernel - the strongest fla configuration), gated RMSNorm in torch.
            Without fla (CPU dry runs) a vectorized torch step stands in, and the arm is named
            "unfused_torch" so no number is mistaken for fla's.
  step      flashkda_ext.kda_decode at the same shape (q, k, v already computed): the fused op should
            cost at most ~1.15x this plain step.

Speedups are quoted against the unfused arm; "% of copy" uses the fused op's essential traffic
(state and conv cache read + written, x/g/beta/output_gate read, out written).

    python benchmarks/bench_fused_decode.py [--quick] [--rows 1,64,1024] [--heads 16,32]
                                            [--state f32,bf16] [--gate softplus|bounded]
    python benchmarks/bench_fused_decode.py --dry-run      # CPU, tiny shapes: checks the logic
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

STATE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
ROWS_FULL = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
ROWS_QUICK = [1, 16, 256, 2048]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(p)
    p.add_argument("--rows", default=None, help="comma list of row counts")
    p.add_argument("--heads", default=None, help="comma list of head counts (default 8,16,32,64)")
    p.add_argument("--state", default=None, help="comma list of f32,bf16")
    p.add_argument("--gate", default="softplus", choices=["softplus", "bounded"])
    p.add_argument("--lower-bound", type=float, default=-5.0, help="for --gate bounded")
    p.add_argument("--slots", type=int, default=4096, help="pool slots (at least rows)")
    p.add_argument("--head-dim", type=int, default=None, help="D (128 on GPU)")
    p.add_argument("--name", default="fused_decode", help="results file stem")
    p.add_argument("--modules", default="", help="comma list of module stems (e.g. quad,rowtma): "
                   "each module called directly as its own arm (route band measurements)")
    p.add_argument("--no-unfused", action="store_true", help="leave the unfused sequence out")
    return p.parse_args(argv)


def grid(args, cfg):
    dry = args.dry_run or not cfg.is_cuda
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    rows = ints(args.rows) if args.rows else ([1, 3] if dry else ROWS_QUICK if cfg.quick else ROWS_FULL)
    heads = ints(args.heads) if args.heads else ([2] if dry else [16] if cfg.quick else [8, 16, 32, 64])
    states = args.state.split(",") if args.state else (["f32"] if (dry or cfg.quick) else ["f32", "bf16"])
    D = args.head_dim or (16 if dry else 128)
    return [(r, h, s, D) for s in states for h in heads for r in rows]


def fla_gate_fn():
    try:
        from fla.ops.kda.gate import fused_kda_gate
        return fused_kda_gate
    except Exception:  # noqa: BLE001
        return None


def module_arm(stem, state_name, slots_numel, args, D, call_args):
    """Arm calling the module fused_{stem}_{state}_{offset} directly, past the router."""
    from flashkda_ext.jit import load_module
    from flashkda_ext.validation import GATE_MODE

    offset = "o64" if slots_numel > 2 ** 31 - 1 else "o32"
    fn = load_module(f"fused_{stem}_{state_name}_{offset}")["fused_kda_decode"]
    lb = args.lower_bound if args.gate == "bounded" else 0.0
    return lambda: fn(*call_args, GATE_MODE[args.gate], lb, D ** -0.5, 1e-5, False)


def make_case(rows, H, state_name, D, args, cfg, gen, use_fla):
    import flashkda_ext as fk

    dev = torch.device(cfg.device)
    bf = dict(dtype=torch.bfloat16, device=dev)
    HD, C = H * D, 3 * H * D
    sdt = STATE_DTYPES[state_name]
    slots = max(args.slots, rows)
    if cfg.is_cuda:  # keep the pool within ~1/4 of free memory
        per_slot = H * D * D * sdt.itemsize + C * 3 * 2
        slots = max(rows, min(slots, int(torch.cuda.mem_get_info(dev)[0] // 4 // per_slot)))
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s)  # noqa: E731
    # the pools (GBs at 64 heads) are drawn on the device: on the host that took minutes
    dgen = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    drnd = lambda *shape, s=1.0: torch.randn(*shape, generator=dgen, device=dev).mul_(s)  # noqa: E731

    x = rnd(rows, C).to(**bf)
    conv_weight = rnd(C, 4, s=0.5).to(**bf)
    conv_state = drnd(slots, C, 3).to(**bf)
    g = rnd(rows, H, D).to(**bf)
    beta = rnd(rows, H).to(**bf)
    A_log = rnd(H, s=0.5).to(dev)
    dt_bias = rnd(HD, s=0.5).to(dev)
    state = drnd(slots, H, D, D, s=0.1).to(dtype=sdt)
    output_gate = rnd(rows, H, D).to(**bf)
    norm_weight = (1 + rnd(D, s=0.1)).to(dev)
    idx = harness.random_unique_slots(rows, slots, dev, generator=gen)
    gate_kw = dict(gate=args.gate, lower_bound=args.lower_bound if args.gate == "bounded" else None)
    out_fused = torch.empty(rows, H, D, **bf)

    def fused():
        return fk.fused_kda_decode(x, conv_weight, conv_state, g, beta, A_log, dt_bias, idx, state,
                                   output_gate, norm_weight, out=out_fused, **gate_kw)

    # -- the unfused sequence -----------------------------------------------------------------
    fla_gate = fla_gate_fn() if use_fla else None
    out_unfused = torch.empty(rows, H, D, **bf)
    idx_long = idx.long()
    q_buf, k_buf, v_buf = (torch.empty(rows, H, D, **bf) for _ in range(3))
    o_buf = torch.empty(rows, H, D, **bf)
    eps = 1e-5

    def conv_and_split():
        window = torch.cat([conv_state.index_select(0, idx_long), x.unsqueeze(-1)], dim=-1)  # [rows, C, 4]
        y = torch.nn.functional.silu((window.float() * conv_weight.float()).sum(-1))
        conv_state.index_copy_(0, idx_long, window[..., 1:])
        y = y.to(torch.bfloat16)
        q_buf.copy_(y[:, :HD].view(rows, H, D))
        k_buf.copy_(y[:, HD:2 * HD].view(rows, H, D))
        v_buf.copy_(y[:, 2 * HD:].view(rows, H, D))

    def gated_rmsnorm(o):
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
        out_unfused.copy_(of * torch.sigmoid(output_gate.float()))
        return out_unfused

    if use_fla:
        g_log = torch.empty(rows, H, D, dtype=torch.float32, device=dev)
        step = harness.fla_decode_fn(q_buf, k_buf, v_buf, g_log, beta, state=state, state_indices=idx,
                                     gate="log", out=o_buf)

        def unfused():
            conv_and_split()
            if fla_gate is not None:
                g_log.copy_(fla_gate(g, A_log, dt_bias, lower_bound=gate_kw["lower_bound"]))
            else:
                g_log.copy_(harness.torch_gate(g, A_log=A_log, dt_bias=dt_bias, **gate_kw))
            step()
            return gated_rmsnorm(o_buf)
        unfused_name = "unfused"
    else:
        def unfused():
            conv_and_split()
            gl = harness.torch_gate(g, A_log=A_log, dt_bias=dt_bias, **gate_kw)
            harness.torch_decode_step(q_buf, k_buf, v_buf, gl, torch.sigmoid(beta.float()), state=state,
                                      state_indices=idx, out=o_buf)
            return gated_rmsnorm(o_buf)
        unfused_name = "unfused_torch"

    # -- the plain step at the same shape -----------------------------------------------------
    sq, sk, sv = (rnd(rows, H, D).to(**bf) for _ in range(3))
    out_step = torch.empty(rows, H, D, **bf)

    def step_plain():
        return fk.kda_decode(sq, sk, sv, g, beta, state=state, state_indices=idx, A_log=A_log,
                             dt_bias=dt_bias, out=out_step, **gate_kw)

    es = sdt.itemsize
    state_rw = 2 * rows * H * D * D * es
    fused_bytes = state_rw + 2 * rows * C * 3 * 2 + rows * (C + 2 * HD + H) * 2 + rows * HD * 2
    step_bytes = state_rw + rows * (4 * HD + H) * 2 + rows * HD * 2

    notes = {}
    # agreement of fused and unfused on one step from the same pools (catches a layout slip)
    pool_bytes = state.numel() * es + conv_state.numel() * 2
    if pool_bytes < (2 << 30) and not args.no_unfused:
        saved = (state.clone(), conv_state.clone())
        try:
            a = fused().clone()
            state.copy_(saved[0]); conv_state.copy_(saved[1])  # noqa: E702
            b = unfused().clone()
            notes["rel_l2_fused_vs_unfused"] = harness.rel_l2(a, b)
        except Exception as e:  # noqa: BLE001  the timing below records the failing arm too
            notes["agreement_check_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        state.copy_(saved[0]); conv_state.copy_(saved[1])  # noqa: E702
        del saved

    arms = [harness.Arm("fused", fused, bytes=fused_bytes)]
    call_args = (x, conv_weight, conv_state, g, beta, A_log, dt_bias, idx, state, output_gate,
                 norm_weight, out_fused)
    for stem in [s for s in args.modules.split(",") if s]:
        arms.append(harness.Arm(f"fused_{stem}", module_arm(stem, state_name, state.numel(), args, D,
                                                            call_args), bytes=fused_bytes))
    if not args.no_unfused:
        arms.append(harness.Arm(unfused_name, unfused, bytes=fused_bytes))
    arms.append(harness.Arm("step", step_plain, bytes=step_bytes))
    name = f"r{rows}_h{H}_{state_name}"
    params = dict(rows=rows, heads=H, head_dim=D, state=state_name, gate=args.gate, slots=slots)
    return harness.Case(name, params, arms, bytes=fused_bytes, notes=notes), unfused_name


def main(argv=None) -> int:
    args = parse(argv)
    cfg = harness.config_from_args(args)
    want_fla = cfg.is_cuda and not (args.no_fla or args.no_unfused)
    use_fla = want_fla and harness.fla_version() is not None
    if want_fla and not use_fla:
        print("fla is not importable: the unfused arm uses a torch step (unfused_torch)", file=sys.stderr)
    cases = grid(args, cfg)
    gen = torch.Generator().manual_seed(0)
    baseline = None if args.no_unfused else "unfused" if use_fla else "unfused_torch"
    run = harness.Run(args.name, cfg, baseline=baseline,
                      primary_mode="graph" if cfg.is_cuda else "wall",
                      extra_meta={"fla_used": use_fla, "gate": args.gate})
    run.start(len(cases))
    for rows, H, s, D in cases:
        try:
            case, _ = make_case(rows, H, s, D, args, cfg, gen, use_fla)
        except Exception as e:  # noqa: BLE001  e.g. out of memory for a huge pool: go on
            print(f"skipped r{rows}_h{H}_{s}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            run.skipped.append({"case": f"r{rows}_h{H}_{s}", "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        rec = run.add(case)
        # the fused op against the plain step (target <= 1.15x)
        f, st = rec["arms"]["fused"]["time_us"], rec["arms"]["step"]["time_us"]
        rec["fused_over_step"] = {m: f[m]["median"] / st[m]["median"] for m in f
                                  if f[m].get("median") and st.get(m, {}).get("median")}
        del case
        if cfg.is_cuda:
            torch.cuda.empty_cache()
    run.finish()
    ratios = [r["fused_over_step"].get(run.primary_mode) for r in run.results]
    ratios = [x for x in ratios if x]
    if ratios:
        print(f"fused / plain step ({run.primary_mode}): geomean {harness.geomean(ratios):.2f}x, "
              f"max {max(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
