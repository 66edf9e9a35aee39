"""Speculative-decoding verify: T_n draft tokens per request on a state pool, the state after every
token kept in a slot of its own (docs/semantics.md, "Verify")."""
from __future__ import annotations

import torch

from . import checks
from .gates import prepare_token_inputs
from .prefill import _segments, is_padding
from .step import delta_step


def verify_plan(cu_seqlens, state_indices, num_accepted_tokens, slots, null_slot0=False, initial_state_indices=None,
                initial_slots=None):
    """[(start, end, read slot or None, [write slot or None per token])] for every request, from
    host values: the read slot is state_indices[n, num_accepted_tokens[n] - 1] (column 0 when
    num_accepted_tokens is None), or initial_state_indices[n] (a slot of the second pool, of
    initial_slots slots) when given; None marks padding. Raises ValueError on values the op refuses."""
    # host integers, checked: int() truncated float entries (1.7 -> 1) and took bools
    idx = checks.host_ints("state_indices", state_indices, 2)
    N = len(idx)
    cols = len(idx[0]) if N else 0
    offsets = checks.host_ints("cu_seqlens", cu_seqlens)
    checks.flag("null_slot0", null_slot0)
    segments = _segments(1, offsets[-1] if offsets else 0, offsets)
    if len(segments) != N:
        raise ValueError(f"state_indices: expected {len(segments)} rows (one per request), got {N}")
    accepted = [1] * N if num_accepted_tokens is None else checks.host_ints("num_accepted_tokens", num_accepted_tokens)
    if len(accepted) != N:   # a short one raised IndexError below
        raise ValueError(f"num_accepted_tokens: expected N = {N} entries, got {len(accepted)}")
    if initial_state_indices is not None:
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens: expected None with initial_state_indices")
        reads = checks.host_ints("initial_state_indices", initial_state_indices)
        if len(reads) != N or any(x >= initial_slots for x in reads):
            raise ValueError(f"initial_state_indices: expected N = {N} entries < {initial_slots}, got {reads}")
    else:
        reads = [idx[n][accepted[n] - 1] for n in range(N)]
    plan = []
    for n, (_, s, e) in enumerate(segments):
        if not 0 <= e - s <= cols:
            raise ValueError(f"cu_seqlens: request {n} has {e - s} tokens; expected 0 .. T_max = {cols}")
        if not 1 <= accepted[n] <= cols:
            raise ValueError(f"num_accepted_tokens: entry {n} is {accepted[n]}; expected 1 .. T_max = {cols}")
        if any(x >= slots for x in idx[n]):
            raise ValueError(f"state_indices: row {n} = {idx[n]} has an entry >= slots = {slots}")
        live = lambda x: None if is_padding(x, null_slot0) else x  # noqa: E731
        plan.append((s, e, live(reads[n]), [live(idx[n][t]) for t in range(e - s)]))
    return plan


def tree_parents(plan, parent_tokens, cols):
    """For each request of plan (verify_plan's): the token each of its tokens continues from, None
    for token 0 (the read slot); t - 1 without parent_tokens (the chain). parent_tokens [N, T_max]
    (an integer tensor of host values, T_max = cols; column 0 not read): entry [n, t] in [0, t),
    naming a token whose state is stored when the request is not padding. Raises ValueError
    (TypeError for a non-tensor) naming parent_tokens otherwise."""
    rows = None
    if parent_tokens is not None:
        # host ints, as state_indices: int() truncated a float parent (0.5 -> 0) and took a bool, and a
        # table of another shape was cut to fit (or failed unnamed)
        rows = checks.host_ints("parent_tokens", parent_tokens, 2)
        if tuple(parent_tokens.shape) != (len(plan), cols):
            raise ValueError(f"parent_tokens: expected [N, T_max] = [{len(plan)}, {cols}] (as state_indices), "
                             f"got {list(parent_tokens.shape)}")
    out = []
    for n, (s, e, read, writes) in enumerate(plan):
        parents = [None] + list(range(e - s - 1))
        if rows is not None:
            parents = [None] + rows[n][1:e - s]
            for t in range(1, e - s):
                p = parents[t]
                if not 0 <= p < t:
                    raise ValueError(f"parent_tokens: entry [{n}, {t}] = {p}; expected a token of request {n} "
                                     f"before it, in [0, {t})")
                if read is not None and writes[p] is None:
                    raise ValueError(f"parent_tokens: entry [{n}, {t}] = {p} names a token whose state is not "
                                     f"stored (its state_indices entry is padding)")
        out.append(parents)
    return out


def kda_verify_step(q, k, v, g, beta, *, state, state_indices, cu_seqlens, num_accepted_tokens=None,
                    gate="softplus", A_log=None, dt_bias=None, lower_bound=None, scale=None,
                    beta_is_logit=True, null_slot0=False, initial_state=None, initial_state_indices=None,
                    parent_tokens=None, dtype=torch.float64):
    """The verify step on a state pool.

    q, k [1, T, H, K]; v [1, T, HV, V]; g [1, T, HV, K] raw gate; beta [1, T, HV]; state: pool
    [slots, HV, V, K]; state_indices [N, T_max]; cu_seqlens [N+1] (T_n >= 0); num_accepted_tokens
    [N] or None. Request n starts from the state in slot state_indices[n, num_accepted_tokens[n] - 1]
    (as the pool was before the call) and runs its tokens in order; after token t the state is
    stored in the pool's dtype into slot state_indices[n, t] (unless that entry is padding), and
    token t + 1 continues from that stored (rounded) value, so the outputs after any token are the
    ones a later call resuming from its slot reproduces. A request whose read entry is padding
    outputs zeros and writes nothing; an empty request (T_n = 0) reads and writes nothing.
    With state as step rows [R, T_max, HV, V, K] and state_indices [N] (one row each), entry (n, t) is
    slot row * T_max + t of the R * T_max, and a padding row makes the request padding (also with
    initial_state); the pool returned has state's shape.
    With initial_state (a pool [slots2, HV, V, K] in state's dtype, never written) and
    initial_state_indices [N] (num_accepted_tokens then None), request n starts from
    initial_state[initial_state_indices[n]] instead (negative, or 0 with null_slot0: the request is
    padding); everything else is unchanged.
    With parent_tokens [N, T_max] (a draft tree), token t >= 1 of request n continues from the state
    stored after token parent_tokens[n, t] of the same request (in [0, t), its entry live) instead of
    token t - 1; column 0 is not read (token 0 starts from the read slot), and parent_tokens[n, t] =
    t - 1 for every t is the chain. Returns (out [1, T, HV, V] in dtype, new pool); the input pools
    are not modified.
    """
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q: expected packed [1, T, H, K], got shape {tuple(q.shape)}")
    if state.dim() == 5:  # step rows: the R * T_max slots with the table they stand for
        flat, table, pad_rows = _step_rows_table(state, state_indices, null_slot0)
        if initial_state_indices is not None:
            initial_state_indices = initial_state_indices.masked_fill(pad_rows.to(initial_state_indices.device), -1)
        out, pool = kda_verify_step(
            q, k, v, g, beta, state=flat, state_indices=table, cu_seqlens=cu_seqlens,
            num_accepted_tokens=num_accepted_tokens, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            scale=scale, beta_is_logit=beta_is_logit, null_slot0=null_slot0, initial_state=initial_state,
            initial_state_indices=initial_state_indices, parent_tokens=parent_tokens, dtype=dtype)
        return out, pool.view(state.shape)
    T, HV, V, K = q.shape[1], v.shape[2], v.shape[3], q.shape[3]
    if state.dim() != 4 or tuple(state.shape[1:]) != (HV, V, K):
        raise ValueError(f"state: expected pool [slots, {HV}, {V}, {K}], got {tuple(state.shape)}")
    if (initial_state is None) != (initial_state_indices is None):
        raise ValueError("initial_state: expected together with initial_state_indices, or neither")
    source = state if initial_state is None else initial_state
    if source.dim() != 4 or source.shape[1:] != state.shape[1:] or source.dtype != state.dtype:
        raise ValueError(f"initial_state: expected a pool [slots, {HV}, {V}, {K}] of {state.dtype}, got "
                         f"{tuple(source.shape)} {source.dtype}")
    plan = verify_plan(cu_seqlens, state_indices, num_accepted_tokens, state.shape[0], null_slot0,
                       initial_state_indices, source.shape[0])
    parents = tree_parents(plan, parent_tokens, state_indices.shape[1])
    qn, kn, vv, gl, bb = prepare_token_inputs(
        q[0], k[0], v[0], g[0], beta[0], gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        scale=scale, beta_is_logit=beta_is_logit, dtype=dtype)
    pool = state.clone()
    out = torch.zeros(1, T, HV, V, dtype=dtype, device=v.device)
    for (s, e, read, writes), parent in zip(plan, parents):
        if read is None or e == s:
            continue
        S = source[read].to(dtype)  # as the pool was before the call
        for t in range(s, e):
            p = parent[t - s]
            if p is not None and p != t - s - 1:  # a tree: from the state stored after token p
                S = pool[writes[p]].to(dtype)
            out[0, t], S = delta_step(S, qn[t], kn[t], vv[t], gl[t], bb[t])
            stored = S.to(pool.dtype)
            S = stored.to(dtype)  # the next token continues from the stored value
            if writes[t - s] is not None:
                pool[writes[t - s]] = stored
    return out, pool


def _step_rows_table(state, rows, null_slot0):
    """Step rows (state [R, T_max, HV, V, K], rows [N]) as a pool of R * T_max slots (a copy) and the
    [N, T_max] table they stand for (row * T_max + t, all -1 for a padding row), and which rows pad."""
    R, cols = state.shape[0], state.shape[1]
    if rows.dim() != 1:
        raise ValueError(f"state_indices: expected [N] with step rows, got {tuple(rows.shape)}")
    values = [int(r) for r in rows.tolist()]
    if any(r >= R for r in values):
        raise ValueError(f"state_indices: {values} has a row >= R = {R}")
    pad = torch.tensor([is_padding(r, null_slot0) for r in values])
    table = torch.tensor([[-1] * cols if p else [r * cols + t for t in range(cols)] for r, p in zip(values, pad)],
                         dtype=torch.int32)
    return state.reshape(R * cols, *state.shape[2:]), table, pad


CONV_WIDTH = 4


def fused_kda_verify_step(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight, *,
                          state_indices, cu_seqlens, num_accepted_tokens=None, gate, lower_bound=None,
                          norm_eps=1e-5, scale=None, null_slot0=False, dtype=torch.float64):
    """The fused verify: per request, the conv (+cache) -> SiLU -> split q|k|v -> KDA step -> gated
    RMSNorm of fused_kda_decode over its T_n tokens, the state kept per token as in kda_verify_step.

    x [1, T, 3*H*D]; conv_weight [3*H*D, 4]; conv_state [slots, 3*H*D, L] with L >= T_max + 2;
    g [1, T, H, D]; beta [1, T, H] (a logit); state [slots, H, D, D]; output_gate [1, T, H, D];
    norm_weight [D]. The conv line of request n is conv_state[state_indices[n, 0]] (a padding entry
    there makes the request padding); with o = num_accepted_tokens[n] - 1 its three inputs before the
    first token are line[:, o:o+3], and afterwards line[:, 0:2] = old line[:, o+1:o+3] and
    line[:, 2 + j] = x of token j (entries past T_n + 2 unchanged), so the next call's window at
    offset a - 1 is the three inputs up to its accepted token a - 1. An empty request (T_n = 0) touches
    nothing, its conv line included. Returns (out [1, T, H, D] in dtype, new conv_state, new state); the
    inputs are not modified.
    """
    checks.compute_dtype(dtype)   # used on x before prepare_token_inputs checks it
    T = checks.tensor("x", x, 3, "[1, T, 3*H*D]").shape[1]
    H, D = checks.tensor("g", g, 4, "[1, T, H, D]").shape[2:]
    HD = H * D
    if tuple(x.shape) != (1, T, 3 * HD):
        raise ValueError(f"x: expected [1, {T}, {3 * HD}], got {tuple(x.shape)}")
    cols = state_indices.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1] != 3 * HD or conv_state.shape[2] < cols + 2:
        raise ValueError(f"conv_state: expected [slots, {3 * HD}, >= T_max + 2 = {cols + 2}], "
                         f"got {tuple(conv_state.shape)}")
    plan = verify_plan(cu_seqlens, state_indices, num_accepted_tokens, state.shape[0], null_slot0)
    accepted = [1] * len(plan) if num_accepted_tokens is None else [int(a) for a in num_accepted_tokens.tolist()]
    conv_pool, pool = conv_state.clone(), state.clone()
    out = torch.zeros(1, T, H, D, dtype=dtype, device=x.device)
    w = conv_weight.to(dtype)
    for n, (s, e, read, writes) in enumerate(plan):
        if e == s:
            continue  # an empty request
        line_slot = writes[0]
        if read is None or line_slot is None:
            continue
        o = accepted[n] - 1
        line = conv_state[line_slot].to(dtype)
        hist = torch.cat([line[:, o:o + CONV_WIDTH - 1], x[0, s:e].to(dtype).T], dim=1)  # [C, 3 + T_n]
        S = state[read].to(dtype)
        for t in range(s, e):
            y = (hist[:, t - s:t - s + CONV_WIDTH] * w).sum(dim=1)
            y = torch.nn.functional.silu(y)
            q, k, v = (y[i * HD:(i + 1) * HD].reshape(1, H, D) for i in range(3))
            qn, kn, vv, gl, bb = prepare_token_inputs(
                q, k, v, g[0, t:t + 1], beta[0, t:t + 1], gate=gate, A_log=A_log, dt_bias=dt_bias,
                lower_bound=lower_bound, scale=scale, beta_is_logit=True, dtype=dtype)
            o_t, S = delta_step(S, qn[0], kn[0], vv[0], gl[0], bb[0])
            stored = S.to(pool.dtype)
            S = stored.to(dtype)
            if writes[t - s] is not None:
                pool[writes[t - s]] = stored
            rms = torch.sqrt((o_t * o_t).mean(dim=-1, keepdim=True) + norm_eps)
            out[0, t] = o_t / rms * norm_weight.to(dtype) * torch.sigmoid(output_gate[0, t].to(dtype))
        new_line = line.clone()
        new_line[:, 0:CONV_WIDTH - 2] = line[:, o + 1:o + CONV_WIDTH - 1]
        new_line[:, CONV_WIDTH - 2:CONV_WIDTH - 2 + (e - s)] = x[0, s:e].to(dtype).T
        conv_pool[line_slot] = new_line.to(conv_pool.dtype)
    return out, conv_pool, pool
