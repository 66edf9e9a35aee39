#!/usr/bin/env python
"""A whole Kimi-Linear-shaped KDA layer, prefill and decode, with fla's ops and with ours (issue 29's table).

The layer mirrors fla.layers.kda (sizes of the public Kimi-Linear-48B-A3B config: hidden 2304, 32 heads of
128, conv 4): q/k/v projections, causal depthwise conv + SiLU, the low-rank gate projection (raw gate,
activated in the kernel with A_log / dt_bias), beta projection (sigmoid in the kernel), the KDA op, gated
RMSNorm with the low-rank output gate (sigmoid), output projection. State pool [slots, H, V, K] fp32.

Arms (same weights and inputs, interleaved A B B A by harness.py):
  fla           fla's chunk_kda / fused_recurrent_kda_fwd (Triton), flashkda_ext's backend switched off
  fla_backend   the same layer code with flashkda_ext registered in fla's registry (FLA_FLASHKDA_EXT on)
  ours          flashkda_ext called directly: kda_prefill; decode through fused_kda_decode (conv + KDA +
                gated RMSNorm in one launch)
  ours_compiled the `ours` decode step under torch.compile(inductor, fullgraph=True) (graph mode: captured)
Prefill: 4K and 32K tokens (one sequence from a pool slot); decode: 1, 64 and 256 rows.

    python benchmarks/bench_layer.py [--quick] [--dry-run] [--no-fla]

--dry-run runs a tiny layer on the CPU backend (no fla: its Triton kernels need a GPU) to check the logic.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

KIMI = dict(hidden=2304, heads=32, head_dim=128, conv=4)   # Kimi-Linear-48B-A3B's KDA layers
TINY = dict(hidden=64, heads=2, head_dim=16, conv=4)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(p)
    p.add_argument("--name", default="layer")
    p.add_argument("--prefill", default=None, help="comma list of prefill token counts (default 4096,32768)")
    p.add_argument("--rows", default=None, help="comma list of decode rows (default 1,64,256)")
    p.add_argument("--only-casts", action="store_true",
                   help="only the 'adapter casts' cases (fp32 gate / beta read natively vs cast): no prefill or "
                        "layer decode, so no fused or prefill module is built")
    return p.parse_args(argv)


class KDALayer:
    """The weights of one layer and its two steps; `impl` picks the KDA ops ("fla" or "ours")."""

    def __init__(self, sizes: dict, device, dtype, slots: int, gen: torch.Generator):
        self.hidden, self.H, self.D = sizes["hidden"], sizes["heads"], sizes["head_dim"]
        HD, d = self.H * self.D, self.D
        r = lambda *s, scale: (torch.randn(*s, generator=gen) * scale).to(device, dtype)  # noqa: E731
        self.w_qkv = r(3 * HD, self.hidden, scale=self.hidden ** -0.5)
        self.conv_weight = r(3 * HD, sizes["conv"], scale=0.5)
        self.w_f1, self.w_f2 = r(d, self.hidden, scale=self.hidden ** -0.5), r(HD, d, scale=d ** -0.5)
        self.w_g1, self.w_g2 = r(d, self.hidden, scale=self.hidden ** -0.5), r(HD, d, scale=d ** -0.5)
        self.w_b = r(self.H, self.hidden, scale=self.hidden ** -0.5)
        self.w_o = r(self.hidden, HD, scale=HD ** -0.5)
        self.A_log = torch.log(torch.empty(self.H).uniform_(1, 16, generator=gen)).to(device)
        self.dt_bias = (torch.randn(HD, generator=gen) * 0.5).to(device)
        self.norm_weight = torch.ones(d, device=device)
        self.state = (torch.randn(slots, self.H, d, d, generator=gen) * 0.02).to(device)
        self.conv_state = torch.zeros(slots, 3 * HD, sizes["conv"] - 1, device=device, dtype=dtype)
        self.fla_norm = None

    # shared pieces ---------------------------------------------------------------------------
    def gates(self, x):
        g = (x @ self.w_f1.t()) @ self.w_f2.t()
        out_gate = (x @ self.w_g1.t()) @ self.w_g2.t()
        return g, x @ self.w_b.t(), out_gate

    def gated_norm(self, o, out_gate):
        if self.fla_norm is not None:       # fla's layer uses its fused norm: so does its arm
            return self.fla_norm(o, out_gate)
        o32 = o.float()
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + 1e-5) * self.norm_weight
        return (o32 * torch.sigmoid(out_gate.float())).to(o.dtype)

    # prefill ---------------------------------------------------------------------------------
    def prefill(self, x, slot, impl: str):
        """x [T, hidden] of one sequence starting from pool slot `slot` (written back)."""
        T, H, D = x.shape[0], self.H, self.D
        xw = (x @ self.w_qkv.t()).t().unsqueeze(0)
        qkv = F.silu(F.conv1d(F.pad(xw, (self.conv_weight.shape[1] - 1, 0)), self.conv_weight.unsqueeze(1),
                              groups=xw.shape[1]))[0].t()
        q, k, v = (t.reshape(1, T, H, D).contiguous() for t in qkv.split(H * D, dim=-1))
        g, beta, out_gate = self.gates(x)
        g, beta = g.view(1, T, H, D), beta.view(1, T, H)
        if impl == "ours":
            import flashkda_ext
            o, _ = flashkda_ext.kda_prefill(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias,
                                            state=self.state, state_indices=slot, max_seqlen=T)
        else:
            from fla.ops.kda import chunk_kda
            cu = torch.tensor([0, T], device=x.device)
            o, ht = chunk_kda(q, k, v, g, beta, initial_state=self.state[slot.long()], output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                              state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), A_log=self.A_log,
                              dt_bias=self.dt_bias)
            self.state[slot.long()] = ht
        o = self.gated_norm(o[0], out_gate.view(T, H, D))
        return o.reshape(T, H * D) @ self.w_o.t()

    # decode ----------------------------------------------------------------------------------
    def decode(self, x, idx, impl: str):
        """x [rows, hidden], one token per row on pool slots idx (distinct)."""
        rows, H, D = x.shape[0], self.H, self.D
        g, beta, out_gate = self.gates(x)
        g, out_gate = g.view(rows, H, D), out_gate.view(rows, H, D)
        mixed = x @ self.w_qkv.t()
        if impl == "ours":
            import flashkda_ext
            o = flashkda_ext.fused_kda_decode(mixed, self.conv_weight, self.conv_state, g, beta, self.A_log,
                                              self.dt_bias, idx, self.state, out_gate, self.norm_weight)
            return o.reshape(rows, H * D) @ self.w_o.t()
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        li = idx.long()
        window = torch.cat([self.conv_state[li], mixed.unsqueeze(-1)], dim=-1)      # [rows, C, conv]
        self.conv_state[li] = window[..., 1:]
        qkv = F.silu((window.float() * self.conv_weight.float()).sum(-1)).to(x.dtype)
        q, k, v = (t.reshape(1, rows, H, D).contiguous() for t in qkv.split(H * D, dim=-1))
        o, _ = fused_recurrent_kda_fwd(q, k, v, g.view(1, rows, H, D), beta.view(1, rows, H), A_log=self.A_log,
                                       dt_bias=self.dt_bias, initial_state=self.state, inplace_final_state=True,
                                       state_v_first=True, cu_seqlens=self._arange(rows + 1, x.device),
                                       ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True)
        o = self.gated_norm(o[0], out_gate)
        return o.reshape(rows, H * D) @ self.w_o.t()

    _aranges: dict = {}

    def _arange(self, n, device):
        key = (n, str(device))
        if key not in self._aranges:   # a graph-capturable decode keeps its offsets alive
            self._aranges[key] = torch.arange(n, device=device, dtype=torch.int32)
        return self._aranges[key]


def fla_switch(on: bool):
    """Runs fla's registry with flashkda_ext's backend on or off (fla reads the switch on every call)."""
    from flashkda_ext.integrations import fla as fkda_fla
    if on:
        os.environ.pop(fkda_fla.ENV_VAR, None)
    else:
        os.environ[fkda_fla.ENV_VAR] = "0"


def with_switch(on: bool, fn):
    def run():
        fla_switch(on)
        return fn()
    return run


def main(argv=None):
    args = parse(argv)
    cfg = harness.config_from_args(args)
    dry = not cfg.is_cuda
    sizes = TINY if dry else KIMI
    use_fla = not args.no_fla and not args.only_casts and not dry and harness.fla_version() is not None
    if use_fla:
        from flashkda_ext.integrations import fla as fkda_fla
        fkda_fla.register()
    dev, dtype = torch.device(cfg.device), (torch.float32 if dry else torch.bfloat16)
    prefill_T = [int(t) for t in (args.prefill or ("64,160" if dry else ("4096" if cfg.quick else "4096,32768"))).split(",")]
    rows_list = [int(r) for r in (args.rows or ("1,4" if dry else "1,64,256")).split(",")]
    slots = max(rows_list) * 2 + 2
    layer = KDALayer(sizes, dev, dtype, slots, torch.Generator().manual_seed(0))
    if use_fla:
        try:
            from fla.modules import FusedRMSNormGated
            norm = FusedRMSNormGated(sizes["head_dim"], activation="sigmoid", eps=1e-5).to(dev)
            layer.fla_norm = norm
        except ImportError:
            pass
    run = harness.Run(args.name, cfg, baseline="fla" if use_fla else "ours",
                      extra_meta={"layer": sizes, "fla_backend": use_fla})
    if args.only_casts:
        prefill_T = []
    run.start(len(prefill_T) + (1 if args.only_casts else 2) * len(rows_list))
    gen = torch.Generator().manual_seed(1)
    compiled_decode = torch.compile(lambda x, i: layer.decode(x, i, "ours"), fullgraph=True)

    for T in prefill_T:
        x = (torch.randn(T, sizes["hidden"], generator=gen) * 0.5).to(dev, dtype)
        slot = torch.tensor([0], dtype=torch.int32, device=dev)
        arms = [harness.Arm("ours", lambda: layer.prefill(x, slot, "ours"), graph=False)]
        notes = {}
        if use_fla:
            arms = [harness.Arm("fla", with_switch(False, lambda: layer.prefill(x, slot, "fla")), graph=False),
                    harness.Arm("fla_backend", with_switch(True, lambda: layer.prefill(x, slot, "fla")), graph=False)] + arms
            notes["rel_l2_vs_fla"] = _agreement(layer, lambda impl, on: layer.prefill(x, slot, impl), "ours")
        with torch.inference_mode():
            run.add(harness.Case(f"prefill T={T}", {"phase": "prefill", "tokens": T}, arms, notes=notes,
                                 reps=None if T <= 4096 else 10))
    for rows in ([] if args.only_casts else rows_list):
        x = (torch.randn(rows, sizes["hidden"], generator=gen) * 0.5).to(dev, dtype)
        idx = torch.randperm(slots, generator=gen)[:rows].to(dev, torch.int32)
        arms = [harness.Arm("ours", lambda: layer.decode(x, idx, "ours")),
                harness.Arm("ours_compiled", lambda: compiled_decode(x, idx))]
        notes = {}
        if use_fla:
            arms = [harness.Arm("fla", with_switch(False, lambda: layer.decode(x, idx, "fla"))),
                    harness.Arm("fla_backend", with_switch(True, lambda: layer.decode(x, idx, "fla")))] + arms
            notes["rel_l2_vs_fla"] = _agreement(layer, lambda impl, on: layer.decode(x, idx, impl), "ours")
        with torch.inference_mode():
            run.add(harness.Case(f"decode rows={rows}", {"phase": "decode", "rows": rows}, arms, notes=notes))
    for rows in rows_list:   # fp32 gate / beta beside bf16 q: read natively vs the one-pass casts they replaced
        run.add(_cast_case(layer, rows, slots, gen, dev, dtype))
    if use_fla:
        fla_switch(True)
    run.finish()
    return 0


def _cast_case(layer, rows, slots, gen, dev, dtype):
    """The SGLang kernel's decode with the raw gate and beta logit in q's dtype ("ours"), in fp32 read as
    they are by the _gb32 modules ("ours_fp32_gate_beta"), and in fp32 cast to q's dtype first, one pass
    each, as the adapter did before kda_decode read them natively ("ours_fp32_cast"): native vs cast is
    what the fp32 reads save; native vs ours what reading 4-byte gates costs."""
    from flashkda_ext.integrations.sglang import FlashKDAExtKernel
    H, D = layer.H, layer.D
    r = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
    q, k, v = (r(1, rows, H, D).to(dtype) for _ in range(3))
    a32, b32 = r(rows, H * D), r(1, rows, H)
    a16, b16 = a32.to(dtype), b32.to(dtype)
    idx = torch.randperm(slots, generator=gen)[:rows].to(dev, torch.int32)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev)
    kern = FlashKDAExtKernel()

    def decode(a, b):
        return lambda: kern.decode(q, k, v, a, b, A_log=layer.A_log, dt_bias=layer.dt_bias, ssm_states=layer.state,
                                   cache_indices=idx, query_start_loc=qsl)
    def cast_then_decode():
        return kern.decode(q, k, v, a32.to(dtype), b32.to(dtype), A_log=layer.A_log, dt_bias=layer.dt_bias,
                           ssm_states=layer.state, cache_indices=idx, query_start_loc=qsl)
    arms = [harness.Arm("ours", decode(a16, b16)), harness.Arm("ours_fp32_gate_beta", decode(a32, b32)),
            harness.Arm("ours_fp32_cast", cast_then_decode)]
    with torch.inference_mode():
        return harness.Case(f"adapter casts rows={rows}", {"phase": "decode casts", "rows": rows}, arms)


def _agreement(layer, step, ours: str) -> dict:
    """rel_l2 of each arm's layer output against fla's on the same state (the pool is restored between)."""
    saved = layer.state.clone(), layer.conv_state.clone()
    outs = {}
    with torch.inference_mode():
        for name, impl, on in (("fla", "fla", False), ("fla_backend", "fla", True), ("ours", ours, True)):
            fla_switch(on)
            layer.state.copy_(saved[0])
            layer.conv_state.copy_(saved[1])
            outs[name] = step(impl, on)
    layer.state.copy_(saved[0])
    layer.conv_state.copy_(saved[1])
    return {k: harness.rel_l2(v, outs["fla"]) for k, v in outs.items() if k != "fla"}


if __name__ == "__main__":
    sys.exit(main())
