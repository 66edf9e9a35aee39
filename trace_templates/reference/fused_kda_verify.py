# Fused KDA speculative-decoding verify: per request, the conv over its cache line and its draft
# tokens, SiLU, the step with the state stored per token, gated RMSNorm. Fragment appended after
# kda_common.py and verify_common.py.


def fused_kda_verify_reference(x, conv_weight, conv_state, g, beta, state, output_gate, norm_weight, state_indices,
                               cu_seqlens, num_accepted_tokens=None, A_log=None, dt_bias=None, lower_bound=None,
                               norm_eps=1e-5, scale=None):
    """Returns (out [1, T, H, D] in x's dtype, the updated conv cache, the updated state pool); the
    inputs are not modified."""
    _, T, H, D = g.shape
    HD = H * D
    if scale is None:
        scale = D ** -0.5
    if conv_state.shape[-1] < state_indices.shape[1] + 2:
        raise ValueError(f"conv_state: expected lines of >= max_draft + 2 = {state_indices.shape[1] + 2} inputs")
    plan = _verify_plan(state_indices, cu_seqlens, num_accepted_tokens, state.shape[0], T)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    conv_pool, pool = conv_state.clone(), state.clone()
    out = torch.zeros(T, H, D, dtype=work, device=x.device)
    w = conv_weight.to(work)
    for s, e, read, stores, o in plan:
        if e == s:
            continue                            # an empty request touches nothing
        line_slot = stores[0]                   # column 0 names the request's conv line
        if read is None or line_slot is None:
            continue
        line = conv_state[line_slot].to(work)
        tokens = x[0, s:e].to(work).T           # [3HD, T_n]
        hist = torch.cat([line[:, o:o + 3], tokens], dim=1)
        S = _work(state[read])
        for t in range(s, e):
            y = (hist[:, t - s:t - s + 4] * w).sum(dim=-1)
            y = y * torch.sigmoid(y)            # SiLU
            q, k, v = (y[i * HD:(i + 1) * HD].reshape(1, H, D) for i in range(3))
            qn, kn, vv, gl, bb = _prepare(q, k, v, g[0, t:t + 1], beta[0, t:t + 1], A_log, dt_bias,
                                          lower_bound, scale)
            o_t, S = _step(S, qn[0], kn[0], vv[0], gl[0], bb[0])
            stored = S.to(pool.dtype)
            S = _work(stored)                   # the next token continues from the stored value
            if stores[t - s] is not None:
                pool[stores[t - s]] = stored
            o_t = o_t / torch.sqrt((o_t * o_t).mean(dim=-1, keepdim=True) + _real("norm_eps", norm_eps))
            out[t] = o_t * norm_weight.to(work) * torch.sigmoid(output_gate[0, t].to(work))
        new_line = line.clone()
        new_line[:, 0:2] = line[:, o + 1:o + 3]           # the two inputs before the first draft
        new_line[:, 2:2 + (e - s)] = tokens               # then every draft's input; the rest unchanged
        conv_pool[line_slot] = new_line.to(conv_pool.dtype)
    return out[None].to(x.dtype), conv_pool, pool
