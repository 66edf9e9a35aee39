#!/usr/bin/env python
"""Fused verify benchmark: flashkda_ext.fused_kda_verify against what a serving engine runs today for
speculative-decoding verify.

Arms, all on identical inputs and the same pools, interleaved A B B A, cold L2 (harness.py):

  fused     flashkda_ext.fused_kda_verify: conv cache update over the draft tokens + SiLU + gate + l2norm +
            verify recurrence (the state after every token in a slot of its own) + gated RMSNorm, one launch.
  unfused   the engine's sequence: the causal conv over the draft tokens with its cache (torch: gather the
            line, window from the accepted position, weighted sum, SiLU, write the line back: vLLM's
            causal_conv1d_update with num_accepted_tokens), the gate (fla's fused_kda_gate, or torch without
            fla), the verify recurrence (fla's fused_recurrent_kda_fwd with a 2-D ssm_state_indices and
            num_accepted_tokens on the pool in place, beta sigmoid and q/k l2norm inside fla's kernel),
            gated RMSNorm in torch. Without fla (CPU dry runs) a vectorized torch recurrence stands in, and
            the arm is named "unfused_torch" so no number is mistaken for fla's.
  step      flashkda_ext.kda_verify at the same shape (q, k, v already computed).

Every request has T draft tokens (T 4 unless --tokens says otherwise; issue 30's verify grid is 2 / 4 / 8),
written to T distinct random slots, and starts from one of them (num_accepted_tokens random in [1, T]); its
conv line is the one of its first slot, T + 2 inputs long (vLLM's layout). Speedups are quoted against the
unfused arm; "% of copy" uses the fused op's essential traffic: per (request, head) one state read and T
state writes, per request the conv window read (3 inputs) and its line written (T + 2), x / g / beta /
output_gate read and out written per token.

    python benchmarks/bench_fused_verify.py [--quick] [--tokens 2,4,8] [--rows 1,64,1024] [--heads 16,64]
                                            [--state f32,bf16] [--gate softplus|bounded]
    python benchmarks/bench_fused_verify.py --dry-run      # CPU, tiny shapes: checks the logic
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fused_common as fc  # noqa: E402
import harness  # noqa: E402

ROWS_FULL = [1, 8, 64, 256, 1024]      # bench_verify.py's requests
ROWS_QUICK = [1, 64, 1024]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(p)
    fc.add_args(p, "fused_verify", "default 16,32,64")
    p.add_argument("--tokens", default="4", help="comma list of T, draft tokens per request (default 4)")
    p.add_argument("--slots", type=int, default=4096, help="pool slots (at least requests x T)")
    return p.parse_args(argv)


def grid(args, cfg):
    rows, heads, states, D = fc.grid_lists(args, cfg, ([1, 3], ROWS_QUICK, ROWS_FULL), ([2], [16, 64], [16, 32, 64]),
                                           (["f32"], ["f32"], ["f32", "bf16"]))
    return [(n, t, h, s, D) for s in states for h in heads for t in fc.int_list(args.tokens) for n in rows]


def traffic(N, T, H, D, state_bytes):
    """(fused op's, plain step's) essential bytes of one call (module docstring)."""
    HD, C, tokens = H * D, 3 * H * D, N * T
    state = N * H * D * D * state_bytes * (1 + T)
    fused = state + N * C * (3 + T + 2) * 2 + tokens * (C + 2 * HD + H) * 2 + tokens * HD * 2
    step = state + tokens * (4 * HD + H) * 2 + tokens * HD * 2
    return fused, step


def make_case(N, T, H, state_name, D, args, cfg, gen, use_fla):
    import flashkda_ext as fk

    dev = torch.device(cfg.device)
    bf = dict(dtype=torch.bfloat16, device=dev)
    HD, C, tokens, L = H * D, 3 * H * D, N * T, T + 2
    sdt = fc.STATE_DTYPES[state_name]
    slots = fc.fit_slots(args.slots, tokens, H * D * D * sdt.itemsize + C * L * 2, cfg)
    rnd, drnd = fc.randn_makers(gen, dev)

    x = rnd(1, tokens, C).to(**bf)
    conv_weight = rnd(C, 4, s=0.5).to(**bf)
    conv_state = drnd(slots, C, L).to(**bf)
    g = rnd(1, tokens, H, D).to(**bf)
    beta = rnd(1, tokens, H).to(**bf)
    A_log = rnd(H, s=0.5).to(dev)
    dt_bias = rnd(HD, s=0.5).to(dev)
    state = drnd(slots, H, D, D, s=0.1).to(dtype=sdt)
    output_gate = rnd(1, tokens, H, D).to(**bf)
    norm_weight = (1 + rnd(D, s=0.1)).to(dev)
    idx = harness.random_unique_slots(tokens, slots, dev, generator=gen).view(N, T)
    nacc = torch.randint(1, T + 1, (N,), generator=gen, dtype=torch.int32).to(dev)
    cu = torch.arange(0, tokens + 1, T, dtype=torch.int32, device=dev)
    gate_kw = fc.gate_kwargs(args)
    verify_kw = dict(state_indices=idx, cu_seqlens=cu, num_accepted_tokens=nacc, max_seqlen=T)
    out_fused = torch.empty(1, tokens, H, D, **bf)

    def fused():
        return fk.fused_kda_verify(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate,
                                   norm_weight, out=out_fused, **verify_kw, **gate_kw)

    # -- the unfused sequence -----------------------------------------------------------------
    q_buf, k_buf, v_buf, o_buf = (torch.empty(1, tokens, H, D, **bf) for _ in range(4))
    conv = fc.conv_split_fn(x, conv_weight, conv_state, idx[:, 0], (q_buf, k_buf, v_buf), offsets=nacc - 1)
    norm = fc.gated_rmsnorm_fn(output_gate, norm_weight, torch.empty(1, tokens, H, D, **bf))
    g_log = torch.empty(1, tokens, H, D, dtype=torch.float32, device=dev)
    gate = fc.gate_fn(g, A_log, dt_bias, gate_kw, g_log, fc.fla_gate_fn() if use_fla else None)
    if use_fla:
        step = harness.fla_verify_fn(q_buf, k_buf, v_buf, g_log, beta, state=state, state_indices=idx,
                                     cu_seqlens=cu, num_accepted_tokens=nacc, gate="log", out=o_buf)
    else:
        def step():
            harness.torch_verify_step(q_buf[0], k_buf[0], v_buf[0], g_log[0], torch.sigmoid(beta[0].float()),
                                      state=state, state_indices=idx, num_accepted_tokens=nacc, out=o_buf[0])

    def unfused():
        conv()
        gate()
        step()
        return norm(o_buf)

    # -- the plain verify step at the same shape ------------------------------------------------
    sq, sk, sv = (rnd(1, tokens, H, D).to(**bf) for _ in range(3))
    out_step = torch.empty(1, tokens, H, D, **bf)

    def step_plain():
        return fk.kda_verify(sq, sk, sv, g, beta, state=state, A_log=A_log, dt_bias=dt_bias, out=out_step,
                             **verify_kw, **gate_kw)

    fused_bytes, step_bytes = traffic(N, T, H, D, sdt.itemsize)
    notes = {}
    if not args.no_unfused:   # fused and unfused agree on one call from the same pools (a layout slip)
        fc.agreement(fused, unfused, ((state, idx), (conv_state, idx[:, 0])), notes)
    arms = [harness.Arm("fused", fused, bytes=fused_bytes)]
    if not args.no_unfused:
        arms.append(harness.Arm(fc.unfused_name(use_fla), unfused, bytes=fused_bytes))
    arms.append(harness.Arm("step", step_plain, bytes=step_bytes))
    params = dict(rows=N, T=T, heads=H, head_dim=D, state=state_name, gate=args.gate, slots=slots,
                  work_items=N * H)
    return harness.Case(label(N, T, H, state_name), params, arms, bytes=fused_bytes, notes=notes)


def label(N, T, H, state_name, D=None):
    return f"{state_name}_T{T}_h{H}_r{N}"


def main(argv=None) -> int:
    return fc.main(parse(argv), grid, make_case, label)


if __name__ == "__main__":
    sys.exit(main())
