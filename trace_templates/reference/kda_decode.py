# KDA decode on a state pool. Fragment appended after kda_common.py.


def kda_decode_reference(q, k, v, g, beta, state, state_indices, A_log=None, dt_bias=None,
                         lower_bound=None, scale=None):
    """Returns (out [rows, HV, V] in v's dtype, the updated pool); the input pool is not modified."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    qn, kn, vv, gl, bb = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale)
    pool = state.clone()
    out = torch.zeros(vv.shape, dtype=vv.dtype, device=v.device)
    _indices("state_indices", state_indices, (q.shape[0],))    # one per row: a short one left rows zero
    _check_slots(state_indices, state.shape[0])
    for r, idx in enumerate(state_indices.tolist()):
        if _is_padding(idx):
            continue
        out[r], S = _step(_work(pool[idx]), qn[r], kn[r], vv[r], gl[r], bb[r])
        # stored back in the pool's dtype after each row: repeated slots behave like sequential steps
        pool[idx] = S.to(pool.dtype)
    return out.to(v.dtype), pool
