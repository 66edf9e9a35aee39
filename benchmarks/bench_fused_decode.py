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
import fused_common as fc  # noqa: E402
import harness  # noqa: E402

ROWS_FULL = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
ROWS_QUICK = [1, 16, 256, 2048]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(p)
    fc.add_args(p, "fused_decode", "default 8,16,32,64")
    p.add_argument("--slots", type=int, default=4096, help="pool slots (at least rows)")
    p.add_argument("--modules", default="", help="comma list of module stems (e.g. quad,rowtma): "
                   "each module called directly as its own arm (route band measurements)")
    return p.parse_args(argv)


def grid(args, cfg):
    rows, heads, states, D = fc.grid_lists(args, cfg, ([1, 3], ROWS_QUICK, ROWS_FULL), ([2], [16], [8, 16, 32, 64]),
                                           (["f32"], ["f32"], ["f32", "bf16"]))
    return [(r, h, s, D) for s in states for h in heads for r in rows]


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
    sdt = fc.STATE_DTYPES[state_name]
    slots = fc.fit_slots(args.slots, rows, H * D * D * sdt.itemsize + C * 3 * 2, cfg)
    rnd, drnd = fc.randn_makers(gen, dev)

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
    gate_kw = fc.gate_kwargs(args)
    out_fused = torch.empty(rows, H, D, **bf)

    def fused():
        return fk.fused_kda_decode(x, conv_weight, conv_state, g, beta, A_log, dt_bias, idx, state,
                                   output_gate, norm_weight, out=out_fused, **gate_kw)

    # -- the unfused sequence -----------------------------------------------------------------
    q_buf, k_buf, v_buf, o_buf = (torch.empty(rows, H, D, **bf) for _ in range(4))
    conv = fc.conv_split_fn(x, conv_weight, conv_state, idx, (q_buf, k_buf, v_buf))
    norm = fc.gated_rmsnorm_fn(output_gate, norm_weight, torch.empty(rows, H, D, **bf))
    g_log = torch.empty(rows, H, D, dtype=torch.float32, device=dev)
    gate = fc.gate_fn(g, A_log, dt_bias, gate_kw, g_log, fc.fla_gate_fn() if use_fla else None)
    if use_fla:
        step = harness.fla_decode_fn(q_buf, k_buf, v_buf, g_log, beta, state=state, state_indices=idx,
                                     gate="log", out=o_buf)
    else:
        def step():
            harness.torch_decode_step(q_buf, k_buf, v_buf, g_log, torch.sigmoid(beta.float()), state=state,
                                      state_indices=idx, out=o_buf)

    def unfused():
        conv()
        gate()
        step()
        return norm(o_buf)

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
    if not args.no_unfused:   # fused and unfused agree on one step from the same pools (a layout slip)
        fc.agreement(fused, unfused, ((state, idx), (conv_state, idx)), notes)

    arms = [harness.Arm("fused", fused, bytes=fused_bytes)]
    call_args = (x, conv_weight, conv_state, g, beta, A_log, dt_bias, idx, state, output_gate,
                 norm_weight, out_fused)
    for stem in [s for s in args.modules.split(",") if s]:
        arms.append(harness.Arm(f"fused_{stem}", module_arm(stem, state_name, state.numel(), args, D,
                                                            call_args), bytes=fused_bytes))
    if not args.no_unfused:
        arms.append(harness.Arm(fc.unfused_name(use_fla), unfused, bytes=fused_bytes))
    arms.append(harness.Arm("step", step_plain, bytes=step_bytes))
    name = f"r{rows}_h{H}_{state_name}"
    params = dict(rows=rows, heads=H, head_dim=D, state=state_name, gate=args.gate, slots=slots)
    return harness.Case(name, params, arms, bytes=fused_bytes, notes=notes)


def main(argv=None) -> int:
    return fc.main(parse(argv), grid, make_case, lambda rows, H, state_name, D: f"r{rows}_h{H}_{state_name}")


if __name__ == "__main__":
    sys.exit(main())
