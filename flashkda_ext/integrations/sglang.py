"""A KDA kernel backend in the call shapes of SGLang's linear-attention kernels (LinearAttnKernelBase), with
no sglang import: SGLang can select it by naming the class, or subclass it under its own base.

    from flashkda_ext.integrations.sglang import FlashKDAExtKernel
    kernel = FlashKDAExtKernel()
    o = kernel.decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
                      cache_indices=idx, query_start_loc=qsl)                         # [1, T, HV, V]
    o = kernel.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=idx, query_start_loc=qsl,
                      A_log=A_log, dt_bias=dt_bias, extend_seq_lens_cpu=lens)          # [1, T, HV, V]
    o = kernel.target_verify(A_log, dt_bias, q, k, v, a, b, ssm_states=pool, cache_indices=idx,
                             query_start_loc=qsl, intermediate_states_buffer=buf,
                             intermediate_state_indices=rows, cache_steps=D)            # [1, T, HV, V]

Shapes as SGLang passes them: q, k [1, T, H, K], v [1, T, HV, V] (often views into the packed projection);
decode: raw gate a ([T, HV*K], [1, T, HV*K] or [1, T, HV, K]) and beta logit b ([T, HV] or [1, T, HV]);
extend: raw gate g [1, T, HV, K] and beta [1, T, HV], activated unless beta_is_raw=True; A_log as models
store it ([1, 1, HV, 1] or [HV]); dt_bias [HV*K]; ssm_states the pool [slots, HV, V, K]; cache_indices
int32 [N] (-1: padding, nothing read or written; its output rows are zeros); query_start_loc int32 [N+1].

Conversions, each one pass over the tensor and only when needed (docs/integrations.md): views that are
not contiguous are copied; decode passes a fp32 a / b as it is (kda_decode reads fp32 g and beta natively);
extend and target_verify cast g / a and beta / b in a dtype other than q's (fp32 gate or beta beside bf16
q) to q's dtype (their kernels read them in q's dtype); A_log and dt_bias become flat fp32.

target_verify follows SGLang's Triton KDA verify (read in sgl-project/sglang:
python/sglang/srt/layers/attention/linear/kernels/kernel_backend.py @ 03a4a692 (the base signature),
kernels/kda_triton.py @ 007d1d93 (TritonKDAKernel.target_verify), and the kernel it calls,
python/sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py @ 00e1106f): q, k [1, T, H, K],
v [1, T, HV, V], raw gate a and beta logit b as decode's, D = cache_steps draft tokens per request packed by
query_start_loc; request n starts from ssm_states[cache_indices[n]] (negative: zero state), the state after
its token t is stored to intermediate_states_buffer[intermediate_state_indices[n], t] (the buffer
[R, S, HV, V, K], S its allocated steps), ssm_states is never written (disable_state_update=True), and
retrieve_parent_token (None for chains, [N, D] for topk > 1 trees) names each token's parent step. The
accepted step is committed later, outside the kernel, by the backend's update_mamba_state_after_mtp_verify.
Here: chains only, on kda_verify over the buffer seen as a pool of R * S slots (docs/integrations.md).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import fla_chunk_states
from .. import validation

def _as(x: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """x reshaped, in dtype and contiguous: at most one copy."""
    x = x.reshape(shape)
    if x.dtype != dtype:
        return x.to(dtype, memory_format=torch.contiguous_format)
    return x.contiguous()


def _gb_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """kda_decode's g / beta dtype for x: float32 stays (read natively, no cast kernel), else q's dtype."""
    return torch.float32 if x.dtype == torch.float32 else dtype


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
                       _as(a, _gb_dtype(a, dtype), (T, HV, K)), _as(b, _gb_dtype(b, dtype), (T, HV)), state=ssm_states,
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
    def target_verify(self, A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, ssm_states: torch.Tensor,
                      cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
                      intermediate_states_buffer: Optional[torch.Tensor] = None,
                      intermediate_state_indices: Optional[torch.Tensor] = None, cache_steps: Optional[int] = None,
                      retrieve_parent_token: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None,
                      out: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        """Speculative-decoding verify of a chain of draft tokens, in SGLang's call shape. Returns [1, T, HV, V].

        Request n (tokens query_start_loc[n] .. query_start_loc[n+1]) starts from the committed state
        ssm_states[cache_indices[n]]; the state after its token t goes to
        intermediate_states_buffer[intermediate_state_indices[n], t] (buffer [R, S, HV, V, K], S >= T_n, the
        pool's dtype); ssm_states is never written (SGLang commits the accepted step afterwards). a is the raw
        gate, b the beta logit, as decode's. cache_steps (the draft token count) bounds T_n on the host.
        A negative cache_indices or intermediate_state_indices entry makes the request padding: zero outputs,
        nothing written. Draft trees (retrieve_parent_token) are refused: kda_verify runs chains.
        """
        from ..ops import kda_verify
        _no_unknown("target_verify", kwargs)
        if retrieve_parent_token is not None:
            raise ValueError("retrieve_parent_token: draft trees (speculative topk > 1) are not served; "
                             "flashkda_ext's kda_verify runs each request's drafts as one chain (pass None)")
        if q.dim() != 4 or q.shape[0] != 1:
            raise ValueError(f"q: expected shape [1, T, H, K], got {list(q.shape)}")
        _, T, H, K = q.shape
        HV, V = v.shape[-2], v.shape[-1]
        if cache_indices.dim() != 1:
            raise ValueError(f"cache_indices: expected [N], got {list(cache_indices.shape)}")
        N = cache_indices.shape[0]
        if query_start_loc.shape != (N + 1,):
            raise ValueError(f"query_start_loc: expected [N+1] = [{N + 1}] offsets (one per cache index + 1), "
                             f"got {list(query_start_loc.shape)}")
        buf = _verify_buffer(intermediate_states_buffer, ssm_states, HV, V, K)
        R, S = buf.shape[0], buf.shape[1]
        rows = _verify_rows(intermediate_state_indices, N, R, cache_indices, ssm_states.shape[0])
        if cache_steps is not None and (isinstance(cache_steps, bool) or not isinstance(cache_steps, int)
                                        or not 1 <= cache_steps <= S):
            raise ValueError(f"cache_steps: expected an int in [1, S = {S}] (the draft token count, at most the "
                             f"buffer's steps), got {cache_steps!r}")
        bound = S if cache_steps is None else cache_steps
        if query_start_loc.device.type == "cpu":
            offsets = query_start_loc.tolist()
            longest = max((e - s for s, e in zip(offsets, offsets[1:])), default=0)
            if longest > bound:
                raise ValueError(f"query_start_loc: a request has {longest} draft tokens, more than "
                                 f"{'cache_steps' if cache_steps is not None else 'the buffer steps S'} = {bound}")
        dtype = q.dtype
        A, dt = _params(A_log, dt_bias)
        gate, lb = _gate(lower_bound)
        # The buffer seen as a pool of R * S slots: slot r * S + t holds step t of row r. kda_verify reads
        # and writes one pool, SGLang reads ssm_states and writes the buffer, so the start state is first
        # copied into step 0 of the request's row; kda_verify reads it there before token 0 overwrites it.
        flat = buf.view(R * S, HV, V, K)
        cidx = _as(cache_indices, torch.int32, (N,))
        qsl = _as(query_start_loc, torch.int32, (N + 1,))
        # an empty request (T_n = 0, graph padding) is no live row either: its start state is not copied
        nonempty = (qsl[1:] > qsl[:-1]).to(cidx.device)
        live = (cidx >= 0) & (cidx < ssm_states.shape[0]) & (rows >= 0) & (rows < R) & nonempty
        steps = torch.arange(S, dtype=torch.int32, device=rows.device)
        table = torch.where(live.view(N, 1), rows.view(N, 1) * S + steps, torch.full((), -1, dtype=torch.int32,
                                                                                    device=rows.device))
        args = (_as(q, dtype, q.shape), _as(k, dtype, k.shape), _as(v, dtype, v.shape), _as(a, dtype, (1, T, HV, K)),
                _as(b, dtype, (1, T, HV)))
        kw = dict(state=flat, state_indices=table, cu_seqlens=qsl,
                  max_seqlen=bound, A_log=A, dt_bias=dt, lower_bound=lb,
                  gate=gate, beta_is_logit=True, out=None if out is None else out.view(1, T, HV, V))
        # every check kda_verify makes runs before the start states are copied: a refused call writes nothing
        call = validation.check_kda_verify(*args, **kw)
        validation.check_verify_values(call, kw["cu_seqlens"], table, None, kw["max_seqlen"])
        validation.check_apart((("out", kw["out"]), ("intermediate_states_buffer", flat)),
                               tuple(zip(("q", "k", "v", "a", "b"), args)) + (("ssm_states", ssm_states),))
        _copy_start_states(flat, ssm_states, cidx, rows, live, S, R)
        o = kda_verify(*args, **kw)
        return o if out is None else out

def _no_unknown(where: str, kwargs: dict) -> None:
    if kwargs:
        raise TypeError(f"{where}: unexpected keyword arguments {sorted(kwargs)} for flashkda_ext's SGLang kernel")


def _gather_states(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """pool[idx] with padding indices (< 0) read as zero states."""
    valid = idx >= 0
    states = pool.index_select(0, idx.clamp(min=0).long())
    return torch.where(valid.view(-1, 1, 1, 1), states, torch.zeros((), dtype=pool.dtype, device=pool.device))


def _verify_buffer(buf, pool, HV, V, K) -> torch.Tensor:
    """SGLang's per-layer intermediate state cache [R, S, HV, V, K], checked: written in place as a pool of
    R * S slots, so it must be one contiguous block in the pool's dtype (no copy can stand in for it)."""
    if not torch.is_tensor(buf):
        raise TypeError(f"intermediate_states_buffer: expected a tensor [R, S, HV, V, K], got {type(buf).__name__}")
    if not torch.is_tensor(pool) or pool.dim() != 4 or tuple(pool.shape[1:]) != (HV, V, K):
        got = list(pool.shape) if torch.is_tensor(pool) else type(pool).__name__
        raise ValueError(f"ssm_states: expected the pool [slots, HV, V, K] = [slots, {HV}, {V}, {K}], got {got}")
    if buf.device != pool.device:
        raise ValueError(f"intermediate_states_buffer: expected the device of ssm_states ({pool.device}), "
                         f"got {buf.device}")
    if buf.dim() != 5 or tuple(buf.shape[2:]) != (HV, V, K):
        raise ValueError(f"intermediate_states_buffer: expected [R, S, HV, V, K] = [R, S, {HV}, {V}, {K}], "
                         f"got {list(buf.shape)}")
    if buf.dtype != pool.dtype:
        # SGLang's kernel reads the start state from the pool unrounded: a copy into another dtype would round it
        raise ValueError(f"intermediate_states_buffer: expected the dtype of ssm_states "
                         f"({pool.dtype}), got {buf.dtype}")
    if not buf.is_contiguous():
        raise ValueError("intermediate_states_buffer: expected a contiguous tensor (it is written in place)")
    if buf.shape[0] * buf.shape[1] > validation.INT32_MAX:
        raise ValueError(f"intermediate_states_buffer: R * S = {buf.shape[0] * buf.shape[1]} steps do not fit "
                         f"the int32 slot indices")
    return buf


def _verify_rows(rows, N, R, cache_indices, slots) -> torch.Tensor:
    """intermediate_state_indices as int32 [N]; where index values live in host memory (the CPU backend),
    the rows of live requests must be distinct and < R (on a GPU nothing reads them: out-of-range rows
    make the request padding, repeated rows leave the buffer undefined, as repeated pool slots do)."""
    if not torch.is_tensor(rows) or rows.shape != (N,) or rows.dtype not in (torch.int32, torch.int64):
        got = list(rows.shape) if torch.is_tensor(rows) else type(rows).__name__
        raise ValueError(f"intermediate_state_indices: expected int32 [N] = [{N}] buffer rows, got {got}")
    rows = _as(rows, torch.int32, (N,))
    if rows.device.type == "cpu" and cache_indices.device.type == "cpu":
        seen = {}
        for n, (r, c) in enumerate(zip(rows.tolist(), cache_indices.tolist())):
            if r < 0 or c < 0:
                continue
            if c >= slots:
                raise ValueError(f"cache_indices: entry {n} = {c} is out of range for a pool of {slots} slots")
            if r >= R:
                raise ValueError(f"intermediate_state_indices: entry {n} = {r} is out of range for a buffer of "
                                 f"{R} rows")
            if r in seen:
                raise ValueError(f"intermediate_state_indices: row {r} is used by requests {seen[r]} and {n}; "
                                 f"every request needs a row of its own")
            seen[r] = n
    return rows


def _copy_start_states(flat, pool, cidx, rows, live, S, R) -> None:
    """flat[rows[n] * S] = pool[cidx[n]] for every live request, without a host sync (CUDA-graph safe).
    A padding request with a row copies that row's step 0 onto itself (bitwise unchanged); one without a
    row (negative or >= R) repeats the first request with a row, write for write, so no index_copy_
    target ever gets two different values. Costs N state reads from the pool, N from the buffer and N
    writes, beside kda_verify's N reads and sum(T_n) writes."""
    has_row = (rows >= 0) & (rows < R)
    # the first request with a row (0 if none has one), as a 1-element index: indexing with a 0-d tensor syncs
    first = torch.argmax(has_row.to(torch.int32)).view(1)
    dst = rows.clamp(0, R - 1).long() * S
    start = pool.index_select(0, cidx.clamp(0, pool.shape[0] - 1).long())
    src = torch.where(live.view(-1, 1, 1, 1), start, flat.index_select(0, dst))
    dst = torch.where(has_row, dst, dst.index_select(0, first))
    src = torch.where(has_row.view(-1, 1, 1, 1), src, src.index_select(0, first))
    flat.index_copy_(0, dst, src)
