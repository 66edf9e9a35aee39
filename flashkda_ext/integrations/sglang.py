"""A KDA kernel backend in the call shapes of SGLang's linear-attention kernels (LinearAttnKernelBase), with
no sglang import: SGLang can select it by naming the class, or subclass it under its own base.

    from flashkda_ext.integrations.sglang import FlashKDAExtKernel
    kernel = FlashKDAExtKernel()
    o = kernel.decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
                      cache_indices=idx, query_start_loc=qsl)                         # [1, T, HV, V]
    o = kernel.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=idx, query_start_loc=qsl,
                      A_log=A_log, dt_bias=dt_bias, extend_seq_lens_cpu=lens)          # [1, T, HV, V]

Shapes as SGLang passes them: q, k [1, T, H, K], v [1, T, HV, V] (often views into the packed projection);
decode: raw gate a ([T, HV*K], [1, T, HV*K] or [1, T, HV, K]) and beta logit b ([T, HV] or [1, T, HV]);
extend: raw gate g [1, T, HV, K] and beta [1, T, HV], activated unless beta_is_raw=True; A_log as models
store it ([1, 1, HV, 1] or [HV]); dt_bias [HV*K]; ssm_states the pool [slots, HV, V, K]; cache_indices
int32 [N] (-1: padding, nothing read or written; its output rows are zeros); query_start_loc int32 [N+1].

Conversions, each one pass over the tensor and only when needed (docs/integrations.md): views that are
not contiguous are copied; g / a and beta / b in a dtype other than q's (fp32 gate or beta beside bf16 q)
are cast to q's dtype (the kernels read them in q's dtype); A_log and dt_bias become flat fp32.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import fla_chunk_states

SPEC_DECODE_ISSUE = "the [SD] speculative-decoding issue (target_verify, num_accepted_tokens)"


def _as(x: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """x reshaped, in dtype and contiguous: at most one copy."""
    x = x.reshape(shape)
    if x.dtype != dtype:
        return x.to(dtype, memory_format=torch.contiguous_format)
    return x.contiguous()


def _params(A_log, dt_bias):
    A = None if A_log is None else _as(A_log, torch.float32, (-1,))
    dt = None if dt_bias is None else _as(dt_bias, torch.float32, (-1,))
    return A, dt


def _gate(lower_bound):
    """SGLang's rule (as its Triton chunk_kda): a lower_bound selects the bounded gate, else softplus."""
    return ("softplus" if lower_bound is None else "bounded"), lower_bound


def _host_lengths(query_start_loc: torch.Tensor, extend_seq_lens_cpu) -> list:
    """Per-sequence lengths on the host: extend_seq_lens_cpu when given (no sync), else one device->host
    copy of query_start_loc."""
    if extend_seq_lens_cpu is not None:
        if torch.is_tensor(extend_seq_lens_cpu):
            return [int(n) for n in extend_seq_lens_cpu.tolist()]
        return [int(n) for n in extend_seq_lens_cpu]
    offsets = query_start_loc.tolist()
    return [b - a for a, b in zip(offsets, offsets[1:])]


class FlashKDAExtKernel:
    """decode / extend / target_verify with the signatures of SGLang's LinearAttnKernelBase."""

    uses_state_checkpoints: bool = True  # extend can return per-chunk states from the kernel's checkpoints
    supports_packed_decode: bool = False

    def __init__(self, chunk_size: int = 64):
        # the radix cache's track buffer reads states at multiples of SGLang's FLA chunk (64)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size: expected an int > 0, got {chunk_size!r}")
        self.chunk_size = chunk_size

    # -----------------------------------------------------------------------------------------
    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
               A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor, cache_indices: torch.Tensor,
               query_start_loc: torch.Tensor, lower_bound: Optional[float] = None, out: Optional[torch.Tensor] = None,
               **kwargs) -> torch.Tensor:
        """One token per request: kda_decode on the pool, updated in place. Returns [1, T, HV, V]."""
        from ..ops import kda_decode
        _no_unknown("decode", kwargs)
        if q.dim() != 4 or q.shape[0] != 1:
            raise ValueError(f"q: expected shape [1, T, H, K], got {list(q.shape)}")
        _, T, H, K = q.shape
        HV, V = v.shape[-2], v.shape[-1]
        N = cache_indices.shape[0]
        if query_start_loc.shape[0] != N + 1 or T != N:
            raise ValueError(f"query_start_loc: decode takes one token per request (T == N); got T = {T}, "
                             f"{N} cache_indices and query_start_loc of shape {list(query_start_loc.shape)}")
        dtype = q.dtype
        A, dt = _params(A_log, dt_bias)
        gate, lb = _gate(lower_bound)
        o = kda_decode(_as(q, dtype, (T, H, K)), _as(k, dtype, (T, H, K)), _as(v, dtype, (T, HV, V)),
                       _as(a, dtype, (T, HV, K)), _as(b, dtype, (T, HV)), state=ssm_states,
                       state_indices=_as(cache_indices, torch.int32, (N,)), A_log=A, dt_bias=dt, lower_bound=lb,
                       gate=gate, beta_is_logit=True, slot_mode="padded",
                       out=None if out is None else out.view(T, HV, V))
        return o.view(1, T, HV, V) if out is None else out

    # -----------------------------------------------------------------------------------------
    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
               ssm_states: torch.Tensor, cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
               A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
               lower_bound: Optional[float] = None, extend_seq_lens_cpu: Optional[Sequence[int]] = None,
               is_spec_decode: bool = False, beta_is_raw: bool = False, return_intermediate_states: bool = False,
               output_intermediate_states: Optional[bool] = None, **kwargs):
        """Chunked prefill of packed requests from their pool slots. Returns o [1, T, HV, V], or (o, h) with
        return_intermediate_states (SGLang also spells it output_intermediate_states): h [1, NT, HV, V, K]
        in the pool's dtype, h[c_n + j] the state of request n after j * chunk_size tokens (j = 0: its
        initial state), NT = sum_n ceil(len_n / chunk_size) (FLA's per-chunk h, for the radix track buffer).
        is_spec_decode: the pool is read, never written (verify / draft forwards stay rollback-able)."""
        from ..ops import kda_prefill
        _no_unknown("extend", kwargs)
        want_h = bool(return_intermediate_states or output_intermediate_states)
        if q.dim() != 4 or q.shape[0] != 1:
            raise ValueError(f"q: expected shape [1, T, H, K], got {list(q.shape)}")
        _, T, H, K = q.shape
        HV, V = v.shape[-2], v.shape[-1]
        N = cache_indices.shape[0]
        if query_start_loc.shape[0] != N + 1:
            raise ValueError(f"query_start_loc: expected [N+1] = [{N + 1}] offsets (one per cache index + 1), "
                             f"got {list(query_start_loc.shape)}")
        dtype = q.dtype
        A, dt = _params(A_log, dt_bias)
        gate, lb = _gate(lower_bound)
        if gate == "softplus" and (A is None or dt is None):
            raise ValueError("A_log: extend without lower_bound applies the softplus gate and needs A_log and dt_bias")
        lengths = _host_lengths(query_start_loc, extend_seq_lens_cpu) if (want_h or extend_seq_lens_cpu
                                                                           is not None) else None
        idx = _as(cache_indices, torch.int32, (N,))
        common = dict(A_log=A, dt_bias=dt, lower_bound=lb, gate=gate, beta_is_logit=bool(beta_is_raw),
                      cu_seqlens=query_start_loc, max_seqlen=max(lengths, default=0) if lengths else None)
        args = (_as(q, dtype, q.shape), _as(k, dtype, k.shape), _as(v, dtype, v.shape), _as(g, dtype, (1, T, HV, K)),
                _as(beta, dtype, (1, T, HV)))
        if want_h:
            initial = _gather_states(ssm_states, idx)  # h starts from each request's state: read it first
            common.update(checkpoint_every=self.chunk_size)
        # is_spec_decode: pool mode with output_final_state=False reads the slots and commits nothing
        res = kda_prefill(*args, state=ssm_states, state_indices=idx, output_final_state=not is_spec_decode,
                          **common)
        o = res[0]
        if not want_h:
            return o
        return o, fla_chunk_states(initial, res[2], lengths, self.chunk_size)

    # -----------------------------------------------------------------------------------------
    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.target_verify: speculative decoding is not served yet; "
                                  f"it comes with {SPEC_DECODE_ISSUE}")


def _no_unknown(where: str, kwargs: dict) -> None:
    if kwargs:
        raise TypeError(f"{where}: unexpected keyword arguments {sorted(kwargs)} for flashkda_ext's SGLang kernel")


def _gather_states(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """pool[idx] with padding indices (< 0) read as zero states."""
    valid = idx >= 0
    states = pool.index_select(0, idx.clamp(min=0).long())
    return torch.where(valid.view(-1, 1, 1, 1), states, torch.zeros((), dtype=pool.dtype, device=pool.device))
