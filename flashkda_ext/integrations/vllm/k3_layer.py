"""The adapter of Kimi K3's own prefill in vLLM 0.34.0 (vllm/models/kimi_k3/nvidia/kda.py: `_flashkda_prefill`),
opt-in: FLASHKDA_EXT_VLLM_K3_PREFILL=1 (with FLASHKDA_EXT_VLLM=1 or install()).

Why: on sm_90 / sm_10x / sm_12x with a bounded gate, K3's layer resolves its "auto" prefill backend to FlashKDA
(vLLM's `_flashkda_C` extension, shipped in the wheel), so the K3 ops patch point (k3.py) never sees a K3 prefill
on an H200. The layer calls `_flashkda_prefill` by its module-global name inside `_forward`, so rebinding that
module attribute reaches every call; install() does so right after vLLM imports the module (_post_import.py).

What it computes: the layer passes `_flashkda_prefill` the same arguments it gives `chunk_kda_with_fused_gate` on
its Triton backend (raw gate, beta logits, A_log, dt_bias, lower_bound, the gathered initial state, the request
offsets), so the computation is that op's (served by k3.py the same way); the results go into the buffers the
layer hands over: `out` [1, T, H, D] and `final_state` [N, H, D, D] in the pool's dtype (fp32 or bf16), which the
layer then scatters into the pool. `workspace` is FlashKDA's scratch (sized by its get_workspace_size): it holds
nothing the call reads or returns, and kda_prefill takes its own. Prefix-cache checkpoints (`checkpoint_state`,
`checkpoint_offsets`: one state a request at a block-aligned offset) are not mapped: such a call runs FlashKDA,
counted. Routed by the longest request from vLLM's step metadata where found (host_lengths.py).

Opt-in until benchmarks/bench_vllm.py (arm vllm_flashkda) has timed it against FlashKDA on the H200.
"""
from __future__ import annotations

import torch

from .. import _indices
from . import host_lengths
from ._common import Refused, count_route, dense_qkv, run_op
from .k3 import _dense_out, _gate, _gate_beta

ENV_VAR = "FLASHKDA_EXT_VLLM_K3_PREFILL"
SITE = "k3_layer._flashkda_prefill"


def serve_flashkda_prefill(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, out,
                           final_state, workspace, checkpoint_state=None, checkpoint_offsets=None):
    from ...ops import kda_prefill
    if checkpoint_state is not None or checkpoint_offsets is not None:
        raise Refused("prefix-cache checkpoints (checkpoint_state / checkpoint_offsets: one state a request at its "
                      "own offset) are not mapped")
    if lower_bound is None:
        raise Refused("lower_bound=None: K3 calls FlashKDA with a bounded gate only")
    tensors = (q, k, v, g, beta, initial_state, cu_seqlens, final_state)
    if not all(isinstance(x, torch.Tensor) for x in tensors) or q.dim() != 4 or v.dim() != 4 or q.shape[0] != 1:
        raise Refused("q / v / states outside the layer's contract (packed [1, T, H, D] tensors)")
    q, k, v = dense_qkv(q, k, v)
    g, beta = _gate_beta(g, beta, q)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    cu = _indices.offsets("cu_seqlens", cu_seqlens, q.shape[1])
    state_shape = (cu.shape[0] - 1, HV, V, K)
    if initial_state.dtype not in (torch.float32, torch.bfloat16) or tuple(initial_state.shape) != state_shape:
        raise Refused(f"initial_state must be a float32 or bfloat16 {list(state_shape)} (the gathered states), got "
                      f"{initial_state.dtype} {list(initial_state.shape)}")
    if final_state.dtype != initial_state.dtype or tuple(final_state.shape) != state_shape \
            or not final_state.is_contiguous():
        raise Refused(f"final_state must be a contiguous {initial_state.dtype} {list(state_shape)} (the layer's "
                      f"buffer in the pool's dtype), got {final_state.dtype} {list(final_state.shape)} strides "
                      f"{list(final_state.stride())}")
    longest, how = host_lengths.longest(cu_seqlens, q.shape[1])
    res = run_op(kda_prefill, q, k, v, g, beta, **_gate(A_log, dt_bias, lower_bound, HV, K, q.device),
                 scale=None, beta_is_logit=True, cu_seqlens=cu, initial_state=initial_state.contiguous(),
                 output_final_state=True, final_state=final_state, out=_dense_out(out, tuple(v.shape)),
                 max_seqlen=longest)
    count_route(SITE, longest, how)
    return res[0], res[1]


#: vLLM's name -> adapter body (with vLLM 0.34.0's signature of that name)
SERVE = {"_flashkda_prefill": serve_flashkda_prefill}
