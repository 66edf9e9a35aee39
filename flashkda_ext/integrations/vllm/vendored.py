"""Adapters for vLLM's vendored copy of fla's KDA ops (vllm/third_party/flash_linear_attention/ops/kda.py), which
vLLM 0.34.0 still calls from one model, bailing_moe_v3 (imported by name at module level): fused_recurrent_kda_fwd
(speculative decoding), chunk_kda (prefill from a precomputed log decay; routed by its longest sequence where
vLLM's step metadata gives it, the step's one-token decodes apart from its prompts: host_lengths.py) and
fused_recurrent_kda (decode). Its
chunk_kda_with_fused_gate has no caller in vLLM 0.34.0 and is left alone.

The argument mapping is fla.py's (these ops are fla's with vLLM's fixed choices: state_v_first, no gate or beta
activation in the recurrent kernel, slot 0 the null block). vLLM's wrappers swallow **kwargs: bailing_moe_v3
passes safe_gate= and lower_bound=, which those wrappers ignore (g is already the log decay, computed by
fused_kda_gate with the bound), so the adapters accept exactly these two as the no-ops they are there, with the
values bailing_moe_v3 passes (a bool; None or a number); any other extra argument or value falls back.
"""
from __future__ import annotations

import torch

from .. import _indices
from ..common_checks import number_or_none
from .. import fla as _fla
from ..rows import rows_view
from . import host_lengths
from ._common import Refused, count_route, gate_dtypes, run_op, tensors, unknown
from .split_calls import prefill_in_parts

#: extra keyword arguments vLLM's vendored chunk_kda / fused_recurrent_kda accept and ignore (bailing_moe_v3)
IGNORED_BY_VLLM = ("safe_gate", "lower_bound")


def _contiguous(x):
    """vLLM's wrappers call .contiguous() on their inputs."""
    return x if x is None or x.is_contiguous() else x.contiguous()


def _no_unknown(kwargs: dict) -> None:
    unknown({k: v for k, v in kwargs.items() if k not in IGNORED_BY_VLLM})
    # no-ops only as bailing_moe_v3 passes them: safe_gate a bool, lower_bound None or a number (not a bool)
    safe_gate, lower_bound = kwargs.get("safe_gate", False), kwargs.get("lower_bound")
    if not isinstance(safe_gate, bool):
        raise Refused(f"safe_gate={safe_gate!r} ({type(safe_gate).__name__}): expected a bool")
    if not number_or_none(lower_bound):
        raise Refused(f"lower_bound={lower_bound!r} ({type(lower_bound).__name__}): expected a number or None")


def _recurrent_form(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                    num_accepted_tokens, use_qk_l2norm_in_kernel, contiguous):
    """fla's fused_recurrent_kda_fwd arguments for a vLLM fused_recurrent_kda(_fwd) call, and the number of
    leading tokens served when vLLM padded the decode batch (else None)."""
    if ssm_state_indices is None or inplace_final_state is not True:
        # without indices vLLM's kernel keeps the state after every token ([T, HV, V, K]), not a final state
        raise Refused("flashkda_ext serves vLLM's fused_recurrent_kda on the state pool only "
                      "(ssm_state_indices given, inplace_final_state=True)")
    if beta is None or not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
        raise Refused("flashkda_ext needs beta and initial_state (the state pool [slots, HV, V, K])")
    tensors(q=q, k=k, v=v, g=g, beta=beta)
    # kda_decode / kda_verify read g and beta in q's dtype or fp32 as they are (vLLM's kernel reads fp32)
    gate_dtypes(q, (q.dtype, torch.float32), g=g, beta=beta)
    if contiguous:
        # vLLM's wrapper makes them dense; the ops this form reaches (kda_decode, kda_verify) read the tokens
        # (dim 1) of row-strided views as they are, so only what they cannot read is copied
        q, k, v, g = (x if x is None else rows_view(x, 1) for x in (q, k, v, g))
        beta = rows_view(beta, 1, vector=False)
    served = None
    B, T = q.shape[0], q.shape[1]
    ssm_state_indices = _indices.int_tensor("ssm_state_indices", ssm_state_indices)
    if num_accepted_tokens is not None:
        num_accepted_tokens = _indices.int_tensor("num_accepted_tokens", num_accepted_tokens)
    t_max = ssm_state_indices.shape[1] if ssm_state_indices.dim() == 2 else None
    if cu_seqlens is not None:
        cu_seqlens = _indices.offsets("cu_seqlens", cu_seqlens, T, longest=t_max)
    if ssm_state_indices.dim() == 2 and cu_seqlens is not None:
        # the table and counts padded to the CUDA-graph batch (checked below only for the N real requests);
        # cu_seqlens holds the real requests
        N = cu_seqlens.shape[0] - 1
        ssm_state_indices = ssm_state_indices[:N]
        num_accepted_tokens = None if num_accepted_tokens is None else num_accepted_tokens[:N]
    if num_accepted_tokens is not None:
        num_accepted_tokens = _indices.accepted_counts("num_accepted_tokens", num_accepted_tokens, t_max)
    ssm_state_indices = _indices.slot_indices("ssm_state_indices", ssm_state_indices, initial_state.shape[0])
    if ssm_state_indices.dim() == 1 and cu_seqlens is not None and B == 1:
        N = cu_seqlens.shape[0] - 1
        if ssm_state_indices.shape[0] < N:
            # one slot a request: a shorter tensor would be broadcast over the requests (vLLM's kernel reads past it)
            raise Refused(f"ssm_state_indices of {ssm_state_indices.shape[0]} entries for N = {N} requests "
                          f"(one slot a request)")
        # A decode batch under a CUDA graph: cu_seqlens holds the N real requests while q holds the graph's
        # padded token count; vLLM's kernel runs the N.
        if T > N:
            q, k, v, g, beta = (x[:, :N] for x in (q, k, v, g, beta))
            served = N
        # one slot a request: fla's mapping puts request n's token (row cu_seqlens[n]) on slot n, an empty request
        # moving the rows after it (host offsets: _indices.one_token_rows; device ones: read by kda_verify). Host
        # offsets of a longer request raise here, naming cu_seqlens: vLLM's kernel would store its later tokens'
        # states in the next requests' slots, so no fallback can run them
        _indices.one_token_offsets(cu_seqlens, q.shape[1])
        ssm_state_indices = ssm_state_indices[:N]
    form = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state, inplace_final_state=True,
                cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=True, use_gate_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, null_slot0=True)
    return form, served


def _serve_recurrent(**call):
    form, served = _recurrent_form(**call)
    ok, reason = _fla._verdict("vllm.vendored.fused_recurrent", _fla._check_fused_recurrent, (), form)
    if not ok:
        raise Refused(reason)
    if served is None:
        return run_op(_fla.serve_fused_recurrent_kda_fwd, **form)
    q, v = call["q"], call["v"]
    # rows past the N requests are left unwritten, as vLLM's kernel leaves them (the layer drops them)
    o = torch.empty((1, q.shape[1], v.shape[2], v.shape[3]), dtype=v.dtype, device=q.device)
    form["out"] = o[:, :served]
    run_op(_fla.serve_fused_recurrent_kda_fwd, **form)
    return o, call["initial_state"]


def serve_fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, inplace_final_state=True, cu_seqlens=None,
                                  ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False):
    return _serve_recurrent(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                            inplace_final_state=inplace_final_state, cu_seqlens=cu_seqlens,
                            ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, contiguous=False)


def serve_fused_recurrent_kda(q, k, v, g, beta=None, scale=None, initial_state=None, inplace_final_state=True,
                              use_qk_l2norm_in_kernel=True, cu_seqlens=None, ssm_state_indices=None, **kwargs):
    _no_unknown(kwargs)
    tensors(q=q)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise Refused("cu_seqlens with a batch of several rows (vLLM raises)")
    return _serve_recurrent(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                            inplace_final_state=inplace_final_state, cu_seqlens=cu_seqlens,
                            ssm_state_indices=ssm_state_indices, num_accepted_tokens=None,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, contiguous=True)


def serve_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """g is the log decay (fla's use_gate_in_kernel=False), beta activated; the state [N, HV, V, K]."""
    _no_unknown(kwargs)
    tensors(q=q, k=k, v=v, g=g, beta=beta)
    if initial_state is not None:     # read below (.is_contiguous()): another object falls back, named
        tensors(initial_state=initial_state)
    # kda_prefill reads g and beta in q's dtype: bailing_moe_v3's fp32 gate (fused_kda_gate) and beta would be
    # rounded, where vLLM's kernel reads them in fp32
    gate_dtypes(q, (q.dtype,), g=g, beta=beta)
    # the parts (the step's decodes apart from its prompts) and their longest sequences, routing only, from vLLM's
    # step metadata (found by the caller's own cu_seqlens object)
    parts, how = host_lengths.step_parts(cu_seqlens, q.shape[1])
    if cu_seqlens is not None:
        cu_seqlens = _indices.offsets("cu_seqlens", cu_seqlens, q.shape[1])
    q, k, v, g, beta, initial_state = (_contiguous(x) for x in (q, k, v, g, beta, initial_state))
    form = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, state_v_first=True, use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False)
    ok, reason = _fla._verdict("vllm.vendored.chunk_kda", _fla._check_chunk_kda, (), form)
    if not ok:
        raise Refused(reason)
    if len(parts) == 1:
        res = run_op(_fla.serve_chunk_kda_known_longest, parts[0][4], **form)
    else:   # fla's form mapped once (no intermediate states here), then one kda_prefill call a part
        from ...ops import kda_prefill
        args, kw, _ = _fla._plan_chunk_kda(_fla._Plan(meta=False), **form)
        cu, init, keep = kw.pop("cu_seqlens"), kw.pop("initial_state"), kw.pop("output_final_state")
        kw.pop("max_seqlen")
        res = prefill_in_parts(kda_prefill, parts, *args, cu, initial_state=init, output_final_state=keep, out=None,
                               **kw)
    if cu_seqlens is not None:
        count_route("vendored.chunk_kda", parts[-1][4], how, len(parts))
    return res


#: vLLM's name -> adapter body (with vLLM 0.34.0's signature of that name)
SERVE = {
    "fused_recurrent_kda_fwd": serve_fused_recurrent_kda_fwd,
    "fused_recurrent_kda": serve_fused_recurrent_kda,
    "chunk_kda": serve_chunk_kda,
}
