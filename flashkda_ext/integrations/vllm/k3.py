"""Adapters for the Kimi K3 / Kimi-Linear KDA ops of vLLM 0.34.0
(vllm/models/kimi_k3/nvidia/ops/third_party/kda), with vLLM's signatures and return conventions.

Both KDA layers that reach them (model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py for Kimi-Linear,
models/kimi_k3/nvidia/kda.py for K3's full-rank gate with its Triton backends) import the three names
from the package at call time, so rebinding the package attributes reaches every call.

- fused_recurrent_kda_packed_decode -> kda_decode: one token per row from the packed post-conv
  [B, 2*H*K + H*V] buffer (q | k | v: its row-strided views, no copy), raw gate, beta logit, softplus or
  bounded gate, pool in place.
- chunk_kda_with_fused_gate -> kda_prefill (dense mode): raw gate and beta logit, softplus or bounded
  gate (lower_bound), the fp32 final state vLLM returns; routed by its longest sequence where vLLM's step
  metadata gives it (host_lengths.py), else by the mean.
- fused_recurrent_kda -> kda_verify (speculative decoding: ssm_state_indices [N, T_max] with
  num_accepted_tokens), or kda_decode for one-token requests.

Conventions carried over from vLLM's kernels: slot indices <= 0 are padding (vLLM's null block is slot 0,
CUDA-graph padding repeats it: null_slot0=True, slot_mode="padded"); the pool may be bf16 or fp32 and a
strided view of vLLM's paged cache; vLLM passes only the real requests' offsets, so tokens past the
last offset (CUDA-graph padding) belong to no request and are not written.
"""
from __future__ import annotations

import torch

from ... import ops   # ops.<op> at call time (a module attribute: tests may wrap it)
from .. import _indices
from ..common_checks import number_or_none
from ..rows import as_read, rows_view
from . import host_lengths
from .split_calls import prefill_in_parts
from ._common import Refused, count_route, dense_qkv, gate_dtypes, qkv_rows, run_op, tensors, unknown


#: A_log / dt_bias (g_bias) dtypes served, read as fp32: vLLM's kernels load each element in its stored dtype and
#: convert it to fp32 before any arithmetic (tl.load(A_log + i_h).to(tl.float32), the same for the bias, at all
#: three call sites), so one .float() gives exactly the values vLLM computes with (an fp64 value rounds to
#: nearest in both). Another dtype (integer, bool, complex: .float() would drop an imaginary part) falls back.
_PARAM_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _param(name: str, x, n: int, what: str = "") -> torch.Tensor:
    if type(x) is torch.Tensor and x.dtype == torch.float32 and x.dim() == 1 and x.shape[0] == n:
        return x    # what vLLM passes: reshape(-1).float() below would return this very tensor
    if not isinstance(x, torch.Tensor) or x.numel() != n:
        raise Refused(f"{name} must be a tensor of {n} elements{what}")
    if x.dtype not in _PARAM_DTYPES:
        raise Refused(f"{name} of dtype {x.dtype}: flashkda_ext reads a floating-point {name} as fp32, as vLLM's "
                      f"kernels do")
    if not x.is_contiguous():
        # vLLM's decode / verify kernels read the parameter's memory (A_log + i_h, dt_bias + i_h * K + k; their
        # wrappers refuse or assert a strided one, fuse_gate=False reads it as it lies): reshape(-1) of a strided
        # view (a transposed [K, H] dt_bias) would serve other values than those, so the call falls back (the
        # layers pass their contiguous parameters; only the chunk wrapper reshapes first, and falls back too)
        raise Refused(f"{name} of strides {list(x.stride())} for shape {list(x.shape)}: vLLM's kernels read "
                      f"{name} in memory order (a contiguous tensor)")
    return x.reshape(-1).float()


def _flag(name: str, value) -> bool:
    """A bool argument: True / False exactly (1 == True in Python, but an int is not what vLLM's signature says)."""
    if not isinstance(value, bool):
        raise Refused(f"{name}={value!r} ({type(value).__name__}): vLLM's signature takes a bool")
    return value


def _gate(A_log, dt_bias, lower_bound, HV: int, K: int, device, bias: str = "dt_bias") -> dict:
    """vLLM's gate in flashkda_ext's terms: lower_bound set -> lower_bound * sigmoid(exp(A_log) * (g + dt_bias)),
    else -exp(A_log) * softplus(g + dt_bias) (threshold 20 in both). `bias`: vLLM's name of dt_bias there."""
    if not number_or_none(lower_bound):     # True would be served as lower_bound 1.0
        raise Refused(f"lower_bound must be a number or None, got {type(lower_bound).__name__} {lower_bound!r}")
    A_log = _param("A_log", A_log, HV, " (one per head)")
    if dt_bias is None:
        # vLLM adds no bias; the bounded gate takes an absent dt_bias as 0 (no zero-filled tensor to launch)
        if lower_bound is None:
            dt_bias = torch.zeros(HV * K, dtype=torch.float32, device=device)
    else:
        dt_bias = _param(bias, dt_bias, HV * K)
    # lower_bound as given: the op's validation makes it a float with its range checked (float() here would
    # raise OverflowError for an int past the float range)
    return dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                gate="softplus" if lower_bound is None else "bounded")


def _gate_beta(g: torch.Tensor, beta: torch.Tensor, q: torch.Tensor, row_dim=None):
    """g and beta in a dtype the op reads as it is (q's, or fp32 for decode / verify, row_dim given): never
    cast, since vLLM reads them in their own dtype. Dense for prefill; for decode (row_dim 0) / verify
    (row_dim 1) vLLM's views (beta: a column slice of its projection) as they are where the op reads them."""
    gate_dtypes(q, (q.dtype,) if row_dim is None else (q.dtype, torch.float32), raw_g=g, raw_beta=beta)
    if row_dim is None:
        return g.contiguous(), beta.contiguous()
    return rows_view(g, row_dim), rows_view(beta, row_dim, vector=False)


def _first(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:n], or x itself where it holds n entries (dim 0)."""
    return x if x.shape[0] == n else x[:n]


def _dense_out(out, shape: tuple):
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):    # no AttributeError from .shape: vLLM's wrapper reports it
        raise Refused(f"out is {type(out).__name__}: vLLM passes a tensor or None here")
    if tuple(out.shape) != shape or not out.is_contiguous():
        raise Refused(f"out must be a contiguous {list(shape)}, got shape {list(out.shape)} "
                      f"strides {list(out.stride())}")
    return out


# ---------------------------------------------------------------------------------------------


def serve_packed_decode(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, state_indices,
                        scale=None, out=None):
    for name, x, dims in (("mixed_qkv", mixed_qkv, 2), ("raw_g", raw_g, 4), ("raw_beta", raw_beta, 3),
                          ("initial_state", initial_state, 4), ("state_indices", state_indices, 1)):
        if not isinstance(x, torch.Tensor) or x.dim() != dims:
            raise Refused(f"{name} outside vLLM's contract (a {dims}-D tensor); vLLM's wrapper reports it")
    if dt_bias is None:
        raise Refused("dt_bias=None (vLLM's packed decode requires it and reports it)")
    _, H, V, K = initial_state.shape
    B = mixed_qkv.shape[0]
    hk = H * K
    if (mixed_qkv.shape[1] != 2 * hk + H * V or mixed_qkv.stride(1) != 1 or tuple(raw_g.shape) != (1, B, H, K)
            or tuple(raw_beta.shape) != (1, B, H) or state_indices.shape[0] != B):
        raise Refused("shapes outside vLLM's packed decode contract; vLLM's wrapper reports them")
    # q | k | v of each token are consecutive channel ranges of one row: row-strided views kda_decode reads
    # as they are (one permuting copy where it cannot). With V == K (Kimi's 128) one view and an unbind make
    # the three: 2.2 us on the host against 5.5 for three slices and views (this runs every decode step)
    if V == K:
        q, k, v = mixed_qkv.view(B, 3, H, K).unbind(1)
        # the three share shape, strides and dtype and start hk elements apart: where that is a whole number of
        # 16-byte vectors (always at Kimi's K = 128) the op reads k and v as they are exactly when it reads q so
        # (validation.rows_as_read), and one check stands for three (2-3 us of host time at 4 rows)
        if (hk * mixed_qkv.element_size()) % 16 != 0 or not as_read(q, 0):
            q, k, v = qkv_rows(q, k, v, 0)
    else:
        q, k, v = mixed_qkv[:, :hk].view(B, H, K), mixed_qkv[:, hk:2 * hk].view(B, H, K), \
            mixed_qkv[:, 2 * hk:].view(B, H, V)
        q, k, v = qkv_rows(q, k, v, 0)
    g, beta = _gate_beta(raw_g[0], raw_beta[0], q, row_dim=0)
    o = _dense_out(out, (1, B, H, V))
    res = run_op(ops.kda_decode, q, k, v, g, beta, state=initial_state,
                 state_indices=_indices.slot_indices("state_indices", state_indices, initial_state.shape[0]),
                 **_gate(A_log, dt_bias, lower_bound, H, K, q.device), scale=scale, beta_is_logit=True,
                 slot_mode="padded", null_slot0=True, out=None if o is None else o.view(B, H, V))
    return (o if o is not None else res.view(1, B, H, V)), initial_state


def serve_chunk_with_fused_gate(q, k, v, raw_g, raw_beta, A_log, g_bias, scale=None, initial_state=None,
                                output_final_state=False, lower_bound=None, use_qk_l2norm_in_kernel=False,
                                cu_seqlens=None, out=None, **kwargs):
    from ...ops import kda_prefill
    unknown(kwargs)     # vLLM's wrapper swallows **kwargs; an adapter must not guess what they mean
    if not _flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel):
        raise Refused("use_qk_l2norm_in_kernel=False (flashkda_ext always l2-normalizes q and k)")
    tensors(q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta)
    if q.dim() != 4 or v.dim() != 4:
        raise Refused("q / v outside vLLM's contract ([B, T, H, D])")
    q, k, v = dense_qkv(q, k, v)
    g, beta = _gate_beta(raw_g, raw_beta, q)
    HV, K = v.shape[2], q.shape[3]
    cu = None if cu_seqlens is None else _indices.offsets("cu_seqlens", cu_seqlens, q.shape[1])
    # the parts (the step's decodes apart from its prompts) and their longest sequences, for routing only (never
    # read from the device): from vLLM's step metadata, found by the caller's own cu_seqlens object
    parts, how = host_lengths.step_parts(cu_seqlens, q.shape[1])
    # vLLM reads h0 (the pool's dtype, gathered) into fp32 and returns an fp32 final state: one dense fp32 copy
    # at most (to() alone keeps an fp32 tensor's strides)
    init = initial_state
    if init is not None and (not isinstance(init, torch.Tensor) or init.dtype not in _PARAM_DTYPES):
        # to(fp32) would drop a complex state's imaginary part (and read an integer / bool one as numbers)
        raise Refused(f"initial_state of {getattr(init, 'dtype', type(init).__name__)}: vLLM reads a "
                      f"floating-point initial_state into fp32")
    if init is not None:
        init = init.contiguous() if init.dtype == torch.float32 else \
            init.to(torch.float32, memory_format=torch.contiguous_format)
    res = prefill_in_parts(kda_prefill, parts, q, k, v, g, beta, cu,
                           **_gate(A_log, g_bias, lower_bound, HV, K, q.device, "g_bias"), scale=scale,
                           beta_is_logit=True, initial_state=init,
                           output_final_state=_flag("output_final_state", output_final_state),
                           out=_dense_out(out, tuple(v.shape)))
    if cu is not None:
        count_route("k3.chunk_kda_with_fused_gate", parts[-1][4], how, len(parts))
    return res


def serve_fused_recurrent(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                          ssm_state_indices, num_accepted_tokens=None, out=None, fuse_gate=None):
    # fuse_gate picks where vLLM computes the same gate (in the recurrent kernel or before it): no effect here.
    # The objects None / True / False only (`in` would let 1 or 0.0 through as True / False)
    if not (fuse_gate is None or isinstance(fuse_gate, bool)):
        raise Refused(f"fuse_gate={fuse_gate!r} ({type(fuse_gate).__name__}): vLLM takes None, True or False")
    tensors(q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta)
    if q.dim() != 4 or q.shape[0] != 1 or not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
            or cu_seqlens.shape[0] < 1 or ssm_state_indices is None or not isinstance(initial_state, torch.Tensor) \
            or initial_state.dim() != 4:
        raise Refused("outside vLLM's contract (packed q [1, T, H, K], cu_seqlens [N+1], ssm_state_indices and the "
                      "pool initial_state [slots, H, V, K] given)")
    ssm_state_indices = _indices.int_tensor("ssm_state_indices", ssm_state_indices)
    # kda_verify reads the tokens (dim 1) of vLLM's views as they are; so does kda_decode their rows (q[0])
    q, k, v = qkv_rows(q, k, v, 1)
    g, beta = _gate_beta(raw_g, raw_beta, q, row_dim=1)
    T, K = q.shape[1], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    gate = _gate(A_log, dt_bias, lower_bound, HV, K, q.device)
    o = _dense_out(out, (1, T, HV, V))
    N = cu_seqlens.shape[0] - 1
    slots = initial_state.shape[0]
    common = dict(state=initial_state, **gate, scale=K ** -0.5, beta_is_logit=True, null_slot0=True)

    if ssm_state_indices.dim() == 2 and ssm_state_indices.shape[1] >= 2:
        t_max = ssm_state_indices.shape[1]
        cu = _indices.offsets("cu_seqlens", cu_seqlens, T, longest=t_max)
        # vLLM pads the index table and counts to the CUDA-graph batch but passes the real requests' offsets
        # (a slice only where there is padding to drop: a view costs ~1 us of host time every step)
        idx = _indices.slot_indices("ssm_state_indices", _first(ssm_state_indices, N), slots).contiguous()
        nat = None if num_accepted_tokens is None else _indices.accepted_counts(
            "num_accepted_tokens", _first(_indices.int_tensor("num_accepted_tokens", num_accepted_tokens), N),
            t_max).contiguous()
        if cu.device.type == "cpu":
            # tokens past the last offset belong to no request: on the host that is visible, and the op takes
            # exactly the requests' tokens (a GPU kernel leaves those rows unwritten, as vLLM's does)
            used = int(cu[-1])      # in [0, T]: offsets() checked it
        else:
            # no host read: a request holds at most T_max tokens, so tokens past N * T_max (vLLM's CUDA-graph
            # padding of the token count) belong to none and are not passed (views: nothing launched)
            used = min(T, N * ssm_state_indices.shape[1])
            if o is None and ssm_state_indices.shape[0] > N:
                # a graph-padded batch: tokens past the last real offset stay zero in an output made here
                o = torch.zeros((1, T, HV, V), dtype=v.dtype, device=v.device)
        if used == T:
            res = run_op(ops.kda_verify, q, k, v, g, beta, state_indices=idx, cu_seqlens=cu, num_accepted_tokens=nat,
                         out=o, **common)
            return (o if o is not None else res), initial_state
        if o is None:
            o = torch.zeros((1, T, HV, V), dtype=v.dtype, device=v.device)
        if used:
            run_op(ops.kda_verify, *(x[:, :used] for x in (q, k, v, g, beta)), state_indices=idx, cu_seqlens=cu,
                   num_accepted_tokens=nat, out=o[:, :used], **common)
        return o, initial_state

    # one token per request (1-D indices, or a one-column table): kda_decode over the token rows, request n's
    # token (row cu_seqlens[n]) with slot n (an empty request moves the rows after it, not their slots)
    if ssm_state_indices.dim() not in (1, 2) or T != N or ssm_state_indices.shape[0] < N \
            or (ssm_state_indices.dim() == 2 and ssm_state_indices.shape[1] < 1):
        raise Refused(f"one-token ssm_state_indices need T == N (vLLM asserts it), N rows and a column, got T = {T}, "
                      f"N = {N}, indices {list(ssm_state_indices.shape)}")
    if num_accepted_tokens is not None and (not isinstance(num_accepted_tokens, torch.Tensor)
                                            or num_accepted_tokens.dim() != 1 or num_accepted_tokens.shape[0] < N):
        # a count per request: a shorter tensor would broadcast its first count over every request
        raise Refused(f"num_accepted_tokens must hold one count per request ([>= N = {N}]), got "
                      f"{list(getattr(num_accepted_tokens, 'shape', []))}")
    first = ssm_state_indices if ssm_state_indices.dim() == 1 else ssm_state_indices[:, 0]
    if ssm_state_indices.dim() == 1 and num_accepted_tokens is not None:
        raise Refused("num_accepted_tokens with 1-D ssm_state_indices (vLLM asserts it is None)")
    cu = _indices.offsets("cu_seqlens", cu_seqlens, T)
    first = _indices.slot_indices("ssm_state_indices", first, slots)[:N]
    if num_accepted_tokens is not None:      # a one-column table: only count 1 names a column
        nat = _indices.accepted_counts("num_accepted_tokens", num_accepted_tokens[:N], 1)
        first = torch.where(nat == 1, first, -1).to(torch.int32)
    rows = _indices.one_token_rows(cu, first, T)
    res = run_op(ops.kda_decode, q[0], k[0], v[0], g[0], beta[0], state_indices=rows, slot_mode="padded",
                 out=None if o is None else o[0], **common)
    return (o if o is not None else res.unsqueeze(0)), initial_state


#: vLLM's name -> the adapter body (vLLM 0.34.0's signature of that name), rebound in the K3 ops package
SERVE = {
    "fused_recurrent_kda_packed_decode": serve_packed_decode,
    "chunk_kda_with_fused_gate": serve_chunk_with_fused_gate,
    "fused_recurrent_kda": serve_fused_recurrent,
}
