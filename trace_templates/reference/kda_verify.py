# KDA speculative-decoding verify on a state pool or step rows, optionally from a second, read-only
# start pool, optionally over a draft tree. Fragment appended after kda_common.py and verify_common.py.


def _row_table(rows, num_rows, cols):
    """Step rows: state_indices [N] (a row of state [R, T_max, ...] per request) as the [N, T_max]
    slot table of the R * T_max slots it stands for (all padding for a padding row)."""
    values = [int(r) for r in _indices("state_indices", rows, (None,)).tolist()]
    if any(r >= num_rows for r in values):
        raise ValueError(f"state_indices: expected rows < num_rows = {num_rows} or negative (padding), "
                         f"got {max(values)}")
    table = [[-1] * cols if _is_padding(r) else [r * cols + t for t in range(cols)] for r in values]
    return torch.tensor(table, dtype=torch.int32).reshape(len(values), cols)


def _start_slots(initial_state_indices, num_initial_slots, pad_rows):
    """initial_state's slot per request, None for padding (its own entry, or a padding row)."""
    values = [int(x) for x in _indices("initial_state_indices", initial_state_indices, (len(pad_rows),)).tolist()]
    if any(x >= num_initial_slots for x in values):
        raise ValueError(f"initial_state_indices: expected slots < num_initial_slots = {num_initial_slots} "
                         f"or negative (padding), got {max(values)}")
    return [None if p or _is_padding(x) else x for x, p in zip(values, pad_rows)]


def _parents(parent_tokens, plan, reads, cols):
    """The token each token of a request continues from (None for token 0, which reads), t - 1 without a
    tree. A tree's entry [n, t], 1 <= t < T_n, is in [0, t) and, unless the request is padding, names a
    token whose state is stored."""
    if parent_tokens is not None:
        # int() below would truncate a float parent (1.5 -> 1) or take a bool, and slicing would cut a table of
        # another shape to fit: refuse both, naming the input
        if tuple(_integer("parent_tokens", parent_tokens).shape) != (len(plan), cols):
            raise ValueError(f"parent_tokens: expected [N, T_max] = [{len(plan)}, {cols}] (as state_indices), "
                             f"got {list(parent_tokens.shape)}")
    out = []
    for n, ((s, e, _, stores, _), read) in enumerate(zip(plan, reads)):
        parents = [None] + list(range(e - s - 1))
        if parent_tokens is not None:
            parents[1:] = [int(p) for p in parent_tokens[n, 1:e - s].tolist()]
            for t, p in enumerate(parents[1:], 1):
                if not 0 <= p < t:
                    raise ValueError(f"parent_tokens: entry [{n}, {t}] = {p}; expected a token of request {n} "
                                     f"before it, in [0, {t})")
                if read is not None and stores[p] is None:
                    raise ValueError(f"parent_tokens: entry [{n}, {t}] = {p} names a token whose state is not "
                                     f"stored (its state_indices entry is padding)")
        out.append(parents)
    return out


def kda_verify_reference(q, k, v, g, beta, state, state_indices, cu_seqlens, num_accepted_tokens=None,
                         A_log=None, dt_bias=None, lower_bound=None, scale=None, initial_state=None,
                         initial_state_indices=None, parent_tokens=None):
    """Returns (out [1, T, HV, V] in v's dtype, the updated state in state's shape); the inputs are not
    modified. state [R, T_max, HV, V, K] (step rows) takes state_indices [N], one row per request;
    parent_tokens [N, T_max] (a draft tree): token t >= 1 continues from the state stored after its parent."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    T = q.shape[1]
    flat = state.reshape(-1, *state.shape[-3:])    # step rows: slot (n, t) is state[row n, t], of R * T_max
    pad_rows = [False] * state_indices.shape[0]
    if state.dim() == 5:
        table = _row_table(state_indices, state.shape[0], state.shape[1])     # checks state_indices first
        pad_rows = [_is_padding(int(r)) for r in state_indices.tolist()]
        state_indices = table
    plan = _verify_plan(state_indices, cu_seqlens, num_accepted_tokens, flat.shape[0], T)
    pool = flat.clone()
    source, reads = flat, [read for _, _, read, _, _ in plan]     # the pool as it was before the call
    if initial_state is not None:
        source, reads = initial_state, _start_slots(initial_state_indices, initial_state.shape[0], pad_rows)
    parents = _parents(parent_tokens, plan, reads, state_indices.shape[1])
    qn, kn, vv, gl, bb = _prepare(q[0], k[0], v[0], g[0], beta[0], A_log, dt_bias, lower_bound, scale)
    out = torch.zeros(vv.shape, dtype=vv.dtype, device=v.device)
    for (s, e, _, stores, _), read, parent in zip(plan, reads, parents):
        if read is None:
            continue
        S, kept = _work(source[read]), []
        for t in range(s, e):
            if parent[t - s] is not None:       # from the stored (rounded) state of its parent: t - 1 in a chain
                S = _work(kept[parent[t - s]])
            out[t], S = _step(S, qn[t], kn[t], vv[t], gl[t], bb[t])
            stored = S.to(pool.dtype)
            kept.append(stored)
            if stores[t - s] is not None:
                pool[stores[t - s]] = stored
    return out[None].to(v.dtype), pool.reshape(state.shape)
