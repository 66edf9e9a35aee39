"""The adapter of Kimi K3's native fused decode in vLLM 0.34.0 (`vllm._custom_ops.fused_kda_decode`), opt-in:
FLASHKDA_EXT_VLLM_K3_NATIVE_DECODE=1 (with FLASHKDA_EXT_VLLM=1 or install()).

Why: K3's layer (vllm/models/kimi_k3/nvidia/kda.py) resolves its "auto" decode backend to "native" on sm_90 for
12, 24, 48 or 96 heads a GPU (TP8 and below), D = 128, conv width 4, bf16 activations and conv cache, fp32 state, no
speculation: a pure-decode step then calls `ops.fused_kda_decode` (conv update, gate, KDA step, gated RMSNorm in
one launch of vLLM's `_C` extension) and never reaches the K3 ops the k3 patch point serves. `ops` is the module
vllm._custom_ops, looked up at call time, so rebinding its attribute reaches every call.

What it computes: flashkda_ext.fused_kda_decode, the same four stages, on vLLM's tensors as the layer holds them
(no copy): x the packed q|k|v projection rows (a column slice of the layer's projection), the conv cache
[slots, 3*H*D, 3] in either of vLLM's layouts (a transposed view of its default [slots, 3, 3*H*D]) and the fp32
state pool, interleaved in one paged cache, vLLM's width-major decode copy of the conv weight [3, 4, H*D],
raw_g [1, T, H, D], raw_beta [1, T, H] and output_gate [T, H, D] as views. The gate: lower_bound set ->
lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), else the softplus gate, as vLLM's Triton path of the same
layer. Slot indices <= 0 are padding (vLLM's null block 0 and CUDA-graph padding, as for the packed decode the
layer runs otherwise), their rows written as zeros. Falls back, counted, on a conv bias, dt_bias None, a call without
the output norm (output_gate / norm_weight None: the op always applies it), a conv weight other than the width-major
copy (flashkda_ext also reads the canonical [3*H*D, 4], but what vLLM's `_C` kernel does with one is not in the
wheel's source) and anything outside these layouts.

Opt-in for the host side (benchmarks/bench_vllm_native.py; H100, 2026-12-05, results h100-2026-12-05-42d3bf9): on
the GPU the kernel is ahead of vLLM's at every measured point (rows 1-1024, H 12-96, graph replay 1.01-1.47x), but
vLLM 0.34 runs K3 with breakable CUDA graphs, where the layer's `_forward` runs as Python every step, and back to
back at 1-4 rows this adapter's host path is slower than vLLM's thin wrapper.
"""
from __future__ import annotations

import torch

from ... import ops   # ops.<op> at call time (a module attribute: tests may wrap it)
from .. import _indices
from ._common import Refused, run_op
from .k3 import _gate

ENV_VAR = "FLASHKDA_EXT_VLLM_K3_NATIVE_DECODE"
SITE = "k3_native.fused_kda_decode"
Tensor = torch.Tensor


def serve_fused_kda_decode(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state,
                           out=None, lower_bound=None, output_gate=None, norm_weight=None, norm_eps=1e-5):
    if bias is not None:
        raise Refused("a conv bias (flashkda_ext's fused decode has none; K3's conv1d is built without one)")
    if dt_bias is None:     # never guessed as a zero bias: vLLM's signature and `_C` op take a tensor
        raise Refused("dt_bias=None (vLLM's fused_kda_decode requires it and reports it)")
    if output_gate is None or norm_weight is None:
        raise Refused("output_gate / norm_weight None: the call without the gated RMSNorm (flashkda_ext's fused "
                      "decode always applies it)")
    if not (isinstance(weight, Tensor) and weight.dim() == 3):
        # the layer always passes its width-major decode copy [3, W, H*D] (kda.py's decode_conv1d_weight); what vLLM's
        # compiled kernel does with another layout is not in the wheel's source, so it is not guessed
        raise Refused("a conv weight other than the layer's width-major decode copy [3, W, H*D] (what vLLM's kernel "
                      "does with another layout is not known here)")
    if not (isinstance(x, Tensor) and x.dim() == 2 and isinstance(raw_g, Tensor) and raw_g.dim() == 4
            and isinstance(raw_beta, Tensor) and raw_beta.dim() == 3 and isinstance(state, Tensor) and state.dim() == 4
            and isinstance(state_indices, Tensor) and state_indices.dim() == 1 and isinstance(output_gate, Tensor)
            and output_gate.dim() == 3):     # one expression: this runs on every decode step of the layer
        raise Refused("x / raw_g / raw_beta / state / state_indices / output_gate outside vLLM's contract (2-, 4-, "
                      "3-, 4-, 1- and 3-D tensors); vLLM's kernel reports it")
    one, T, H, D = raw_g.shape
    if one != 1 or raw_beta.shape != (1, T, H) or x.shape[0] != T:    # torch.Size == tuple: no tuple() per step
        raise Refused("raw_g / raw_beta / x outside vLLM's contract ([1, T, H, D], [1, T, H], [T, 3*H*D])")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != (1, T, H, D)
                            or not out.is_contiguous()):
        raise Refused(f"out must be a contiguous [1, {T}, {H}, {D}] (the layer's buffer)")
    if out is None:     # vLLM's wrapper allocates the same
        out = torch.empty(1, T, H, D, dtype=x.dtype, device=x.device)
    run_op(ops.fused_kda_decode, x, weight, conv_state, raw_g[0], raw_beta[0],
           state_indices=_indices.slot_indices("state_indices", state_indices, state.shape[0]), state=state,
           output_gate=output_gate, norm_weight=norm_weight, norm_eps=norm_eps,
           **_gate(A_log, dt_bias, lower_bound, H, D, x.device), slot_mode="padded", null_slot0=True, out=out[0])
    return out


#: vLLM's name -> adapter body (with vLLM 0.34.0's signature of that name)
SERVE = {"fused_kda_decode": serve_fused_kda_decode}
