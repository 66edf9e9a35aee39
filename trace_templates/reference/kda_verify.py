# KDA speculative-decoding verify on a state pool. Fragment appended after kda_common.py and
# verify_common.py.


def kda_verify_reference(q, k, v, g, beta, state, state_indices, cu_seqlens, num_accepted_tokens=None,
                         A_log=None, dt_bias=None, lower_bound=None, scale=None):
    """Returns (out [1, T, HV, V] in v's dtype, the updated pool); the input pool is not modified."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    T = q.shape[1]
    plan = _verify_plan(state_indices, cu_seqlens, num_accepted_tokens, state.shape[0], T)
    qn, kn, vv, gl, bb = _prepare(q[0], k[0], v[0], g[0], beta[0], A_log, dt_bias, lower_bound, scale)
    pool = state.clone()
    out = torch.zeros(vv.shape, dtype=vv.dtype, device=v.device)
    for s, e, read, stores, _ in plan:
        if read is None:
            continue
        S = _work(state[read])                  # the pool as it was before the call
        for t in range(s, e):
            out[t], S = _step(S, qn[t], kn[t], vv[t], gl[t], bb[t])
            stored = S.to(pool.dtype)
            S = _work(stored)                   # the next token continues from the stored value
            if stores[t - s] is not None:
                pool[stores[t - s]] = stored
    return out[None].to(v.dtype), pool
