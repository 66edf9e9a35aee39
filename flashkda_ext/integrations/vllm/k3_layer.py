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
nothing the call reads or returns, and kda_prefill takes its own. Routed by the longest request from vLLM's step
metadata where found (host_lengths.py).

Prefix-cache checkpoints (mamba_cache_mode "align", on whenever prefix caching is): `checkpoint_offsets[r]` > 0 asks
for request r's state after that many tokens of its query in `checkpoint_state[r]` (entries of offset 0 are not
read). kda_prefill's own checkpoints fall every `checkpoint_every` tokens from a sequence's start, not at one offset
a request, so the call is cut instead: each request with a checkpoint ends one kda_prefill call after its first
`offset` tokens and starts the next from that state (its row of `final_state` holds it between the two calls, then
it is copied into `checkpoint_state`). Each call is a contiguous slice of the tokens, so nothing is gathered; k
checkpoints make k + 1 calls (vLLM's usual prefill step has one prompt, so two). The cuts need vLLM's host copies of
the offsets and query lengths (m.checkpoint.offsets / query_lens of the step's metadata, host_lengths.py, each length
checked against the step's conv block counts); without them, or where they disagree, the call runs FlashKDA, counted.

Opt-in: timed against FlashKDA on the H200 (benchmarks/bench_vllm.py, arms vllm_flashkda / ours_k3_layer;
benchmarks/results/h200-2026-12-05-1b1a007) it is ahead at 1 x 1024 (1.78x H8), 4 x 1024 H8, 64 x 1024 H8 and a
mixed step beside an 8192-token prompt (1.83x), behind at 16 x 1024 (0.73x H8, 0.76x H12) and 4 x 1024 H12 (0.93x).
"""
from __future__ import annotations

import itertools

import torch

from ... import validation
from .. import _indices
from . import host_lengths
from ._common import Refused, count_route, dense_qkv, run_op
from .split_calls import prefill_in_parts
from .k3 import _dense_out, _gate, _gate_beta

ENV_VAR = "FLASHKDA_EXT_VLLM_K3_PREFILL"
SITE = "k3_layer._flashkda_prefill"


def serve_flashkda_prefill(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, out,
                           final_state, workspace, checkpoint_state=None, checkpoint_offsets=None):
    from ...ops import kda_prefill
    if (checkpoint_state is None) != (checkpoint_offsets is None):
        raise Refused("checkpoint_state and checkpoint_offsets come together (one without the other is outside "
                      "the layer's contract)")
    if lower_bound is None:
        raise Refused("lower_bound=None: K3 calls FlashKDA with a bounded gate only")
    if dt_bias is None:     # never guessed as a zero bias: `_flashkda_prefill` calls dt_bias.view(...)
        raise Refused("dt_bias=None (K3's _flashkda_prefill requires it and reports it)")
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
    gate = _gate(A_log, dt_bias, lower_bound, HV, K, q.device)
    out = _dense_out(out, tuple(v.shape))
    if checkpoint_offsets is not None:
        return _serve_with_checkpoints(kda_prefill, q, k, v, g, beta, gate, initial_state, cu_seqlens, out,
                                       final_state, checkpoint_state, checkpoint_offsets, state_shape)
    parts, how = host_lengths.step_parts(cu_seqlens, q.shape[1])
    res = prefill_in_parts(kda_prefill, parts, q, k, v, g, beta, cu, **gate, scale=None, beta_is_logit=True,
                           initial_state=initial_state.contiguous(), output_final_state=True,
                           final_state=final_state, out=out)
    count_route(SITE, parts[-1][4], how, len(parts))
    return res


def cut_at_checkpoints(offsets, lengths, breaks=()):
    """The kda_prefill calls of a prefill whose requests (query `lengths`) want their states after `offsets`
    tokens (0: none; else 0 < offset < length): (first token, end token, first request row, last request row,
    the lengths of the call's sequences, whether its first sequence goes on from a cut) a call, in order. A
    request with a checkpoint is the last sequence of one call (its first `offset` tokens) and the first of the
    next (the rest). `breaks`: requests that also start a call (the step's first prompt after its decodes)."""
    calls, t, t0, r0, pieces, carried = [], 0, 0, 0, [], False
    for r, (o, n) in enumerate(zip(offsets, lengths)):
        if r in breaks and r > r0:
            calls.append((t0, t, r0, r - 1, pieces, carried))
            t0, r0, pieces, carried = t, r, [], False
        if o:
            calls.append((t0, t + o, r0, r, pieces + [o], carried))
            t0, r0, pieces, carried = t + o, r, [n - o], True
        else:
            pieces.append(n)
        t += n
    calls.append((t0, t, r0, len(lengths) - 1, pieces, carried))
    return calls


def _serve_with_checkpoints(kda_prefill, q, k, v, g, beta, gate, initial_state, cu_seqlens, out, final_state,
                            checkpoint_state, checkpoint_offsets, state_shape):
    if not isinstance(checkpoint_state, torch.Tensor) or checkpoint_state.dtype != initial_state.dtype \
            or tuple(checkpoint_state.shape) != state_shape or not checkpoint_state.is_contiguous():
        raise Refused(f"checkpoint_state must be a contiguous {initial_state.dtype} {list(state_shape)}, got "
                      f"{getattr(checkpoint_state, 'dtype', type(checkpoint_state).__name__)} "
                      f"{list(getattr(checkpoint_state, 'shape', []))}")
    # written by copy_ between the calls (not through the op, which would refuse it before writing): torch refuses
    # that update to an inference tensor outside inference mode, or to one requiring grad under grad mode, after the
    # first call has written out and final_state; the ops' inference-only rule, checked before anything runs
    conflict = validation.inference_conflict((), (("checkpoint_state", checkpoint_state),))
    if conflict is not None and conflict[1] == "inference":
        raise Refused("checkpoint_state is an inference tensor, written in place outside torch.inference_mode()")
    if conflict is not None:
        raise Refused("checkpoint_state requires grad under grad mode (written in place between the cut calls)")
    if not isinstance(checkpoint_offsets, torch.Tensor) or checkpoint_offsets.dim() != 1 \
            or checkpoint_offsets.shape[0] != state_shape[0] or checkpoint_offsets.device != q.device:
        raise Refused(f"checkpoint_offsets must be one offset a request ({state_shape[0]}) on {q.device}")
    if out is None:
        raise Refused("prefix-cache checkpoints without an out buffer (the layer always passes one)")
    host, why = host_lengths.checkpoint_lengths(cu_seqlens, checkpoint_offsets, q.shape[1])
    if host is None:
        raise Refused(f"prefix-cache checkpoints need vLLM's host offsets to cut the call at: {why}")
    parts, _ = host_lengths.step_parts(cu_seqlens, q.shape[1])
    calls = cut_at_checkpoints(*host, breaks={parts[-1][2]} if len(parts) > 1 else ())
    init = initial_state.contiguous()
    # The calls share their tensors and dtypes, so a call the op refuses is the first (before any write); were a
    # later one refused, FlashKDA's fallback rewrites out, final_state and every checkpoint row this wrote.
    for j, (t0, t1, r0, r1, pieces, carried) in enumerate(calls):
        if not carried:
            starts = init[r0:r1 + 1]
        else:   # the cut request goes on from the state the last call left in checkpoint_state
            starts = checkpoint_state[r0:r0 + 1] if r1 == r0 else \
                torch.cat([checkpoint_state[r0:r0 + 1], init[r0 + 1:r1 + 1]])
        cu = torch.tensor([0] + list(itertools.accumulate(pieces)), dtype=torch.int32,
                          pin_memory=q.is_cuda).to(q.device, non_blocking=True)
        run_op(kda_prefill, q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1], **gate,
               scale=None, beta_is_logit=True, cu_seqlens=cu, initial_state=starts, output_final_state=True,
               final_state=final_state[r0:r1 + 1], out=out[:, t0:t1], max_seqlen=max(pieces))
        if j + 1 < len(calls) and calls[j + 1][5]:
            checkpoint_state[r1].copy_(final_state[r1])
    count_route(SITE, max(max(c[4]) for c in calls), "vllm metadata", 1 + (len(parts) > 1))
    return out, final_state


#: vLLM's name -> adapter body (with vLLM 0.34.0's signature of that name)
SERVE = {"_flashkda_prefill": serve_flashkda_prefill}
