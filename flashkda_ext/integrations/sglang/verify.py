"""target_verify in SGLang's call shape, on kda_verify over the intermediate state buffer seen as a pool.

SGLang's Triton KDA verify (0.5.23: kernels/kda_triton.py TritonKDAKernel.target_verify, the kernel in
sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py): q, k [1, T, H, K], v [1, T, HV, V], raw
gate a and beta logit b; requests packed by query_start_loc, at most cache_steps tokens each; request n
starts from ssm_states[cache_indices[n]] (negative: zero state), the state after its token t is stored to
intermediate_states_buffer[intermediate_state_indices[n], t] (buffer [R, S, HV, V, K]); ssm_states is never
written. 0.5.23 passes the backend's whole per-pool row table (build_verify_intermediate_state_indices:
longer than N, padded onto the discard row R - 1); request n uses entry n, as the Triton kernel does.
"""
from __future__ import annotations

import torch

from ... import validation
from ..common_checks import int32_indices, narrow_int32
from .dense import as_dense as _as, gate_rows, qkv_rows


def target_verify(A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc, buf, table,
                  cache_steps, lower_bound, gate_of, out, parents=None):
    from ...ops import kda_verify
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q: expected shape [1, T, H, K], got {list(q.shape)}")
    _, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    if not torch.is_tensor(cache_indices) or cache_indices.dim() != 1:
        raise ValueError(f"cache_indices: expected [N], got {getattr(cache_indices, 'shape', cache_indices)}")
    N = cache_indices.shape[0]
    if not torch.is_tensor(query_start_loc) or query_start_loc.shape != (N + 1,):
        raise ValueError(f"query_start_loc: expected [N+1] = [{N + 1}] offsets (one per cache index + 1), "
                         f"got {getattr(query_start_loc, 'shape', query_start_loc)}")
    if query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_start_loc: expected an int32 or int64 tensor, got {query_start_loc.dtype}")
    validation._same_device("query_start_loc", query_start_loc, q.device)   # SGLang's name (kda_verify: cu_seqlens)
    buf = _verify_buffer(buf, ssm_states, HV, V, K)
    R, S = buf.shape[0], buf.shape[1]
    cidx = int32_indices("cache_indices", cache_indices, (N,))
    rows = _verify_rows(table, N, R, cidx, ssm_states.shape[0])
    if cache_steps is not None and (isinstance(cache_steps, bool) or not isinstance(cache_steps, int)
                                    or not 1 <= cache_steps <= S):
        raise ValueError(f"cache_steps: expected an int in [1, S = {S}] (the draft token count, at most the "
                         f"buffer's steps), got {cache_steps!r}")
    bound = S if cache_steps is None else cache_steps
    # range-checked, never wrapped (int64 host offsets 2**32, 2**32 + 3 would become 0, 3); int64 device
    # offsets raise here (the kernel falls back before, see FlashKDAExtKernel.target_verify)
    qsl = narrow_int32("query_start_loc", query_start_loc).contiguous()
    if query_start_loc.device.type == "cpu":
        offsets = query_start_loc.tolist()
        # under SGLang's name, before kda_verify (which would name its own cu_seqlens)
        validation.check_offsets_span("query_start_loc", offsets, T, f" (the draft tokens of the N = {N} requests)")
        longest = max((e - s for s, e in zip(offsets, offsets[1:])), default=0)
        if longest > bound:
            raise ValueError(f"query_start_loc: a request has {longest} draft tokens, more than "
                             f"{'cache_steps' if cache_steps is not None else 'the buffer steps S'} = {bound}")
    A = None if A_log is None else _as("A_log", A_log, torch.float32, (-1,))
    dt = None if dt_bias is None else _as("dt_bias", dt_bias, torch.float32, (-1,))
    if A is None or dt is None:     # SGLang's verify kernel reads both (no bias-free variant)
        raise ValueError(f"{'A_log' if A is None else 'dt_bias'}: target_verify activates the raw gate a in the "
                         f"kernel and needs A_log and dt_bias, got None")
    gate, lb = gate_of(lower_bound, A)
    # kda_verify with SGLang's two pools as they are, no device op beside the kernel: the buffer is step rows
    # (state [R, S, HV, V, K], state_indices = the request's row: the state after token t goes to
    # buf[rows[n], t]; a row out of range makes the request padding), and the start state of request n is
    # read from ssm_states[cache_indices[n]] (initial_state: read only; an index that is negative or past
    # the pool makes the request padding too).
    # a draft tree's parents [N, S] (SGLang's retrieve_parent_token; column 0 and the columns past a request's
    # tokens are never read): int64 narrowed with the range check, device values out of range becoming -1,
    # which makes the request padding as any parent outside [0, t) does
    par = None if parents is None else int32_indices("retrieve_parent_token", parents, (N, S))
    if par is not None and par.device.type == "cpu" and query_start_loc.device.type == "cpu":
        for n, (s, e) in enumerate(zip(offsets, offsets[1:])):   # kda_verify's rule, under SGLang's name
            for t in range(1, e - s):
                if not 0 <= int(par[n, t]) < t:
                    raise ValueError(f"retrieve_parent_token: entry [{n}, {t}] = {int(par[n, t])}; expected the "
                                     f"parent of draft token {t}, a token before it (in [0, {t}))")
    q, k, v = qkv_rows(q, k, v, 1)      # SGLang's views into mixed_qkv as they are (kda_verify reads them)
    # fp32 a / b stay fp32: kda_verify reads them natively (its routes' _gb32 twins), as SGLang's kernel does;
    # another floating dtype goes to fp32, exact for fp16 (gate_rows)
    args = (q, k, v, gate_rows("a", a, q, (1, T, HV, K), 1), gate_rows("b", b, q, (1, T, HV), 1, vector=False))
    dest = None if out is None else validation._tensor("out", out)   # kda_verify checks its shape (named)
    # SGLang never writes ssm_states: refused even as the identical view kda_verify would accept
    validation.check_apart((("out", dest), ("intermediate_states_buffer", buf)),
                           tuple(zip(("q", "k", "v", "a", "b"), args)) + (("ssm_states", ssm_states),))
    # kda_verify checks everything before it launches: a refused call writes nothing
    o = kda_verify(*args, state=buf, state_indices=rows, cu_seqlens=qsl, max_seqlen=bound, A_log=A, dt_bias=dt,
                   lower_bound=lb, gate=gate, beta_is_logit=True, out=dest, initial_state=ssm_states,
                   initial_state_indices=cidx, parent_tokens=par)
    return o if out is None else out


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


def _verify_rows(table, N, R, cidx, slots) -> torch.Tensor:
    """Entries 0..N-1 of intermediate_state_indices as int32 [N] (range-checked, never wrapped). Where index
    values live in host memory (the CPU backend) the rows of live requests must be distinct and < R. On a GPU
    nothing reads them: out-of-range rows make the request padding, repeated rows leave those rows undefined,
    as in SGLang's kernel (which lets the pad rows of an over-padded warmup batch race onto its discard row
    R - 1)."""
    if not torch.is_tensor(table) or table.dim() != 1 or table.shape[0] < N:
        got = list(table.shape) if torch.is_tensor(table) else type(table).__name__
        raise ValueError(f"intermediate_state_indices: expected a 1-D int tensor of >= N = {N} buffer rows "
                         f"(request n uses entry n), got {got}")
    rows = int32_indices("intermediate_state_indices", table[:N], (N,))
    if rows.device.type == "cpu" and cidx.device.type == "cpu":
        seen = {}
        for n, (r, c) in enumerate(zip(rows.tolist(), cidx.tolist())):
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

