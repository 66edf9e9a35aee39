# Fused KDA decode: conv cache, SiLU, the step, gated RMSNorm. Fragment appended after kda_common.py.


def fused_kda_decode_reference(x, conv_weight, conv_state, g, beta, state_indices, state, output_gate,
                               norm_weight, A_log=None, dt_bias=None, lower_bound=None, scale=None,
                               norm_eps=1e-5):
    """Returns (out [rows, H, D] in x's dtype, the updated conv cache, the updated state pool)."""
    rows, H, D = g.shape
    HD = H * D
    if scale is None:
        scale = D ** -0.5
    conv_pool = conv_state.clone()
    pool = state.clone()
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(rows, H, D, dtype=work, device=x.device)
    _indices("state_indices", state_indices, (rows,))          # one per row: a short one left rows zero
    _check_slots(state_indices, state.shape[0])
    for r, idx in enumerate(state_indices.tolist()):
        if _is_padding(idx):
            continue
        window = torch.cat([conv_pool[idx].to(work), x[r].to(work)[:, None]], dim=-1)  # [3HD, 4]
        y = (window * conv_weight.to(work)).sum(dim=-1)
        conv_pool[idx] = window[:, 1:].to(conv_pool.dtype)     # shift left, x stored last
        y = y * torch.sigmoid(y)                               # SiLU
        q, k, v = (y[i * HD:(i + 1) * HD].reshape(1, H, D) for i in range(3))
        qn, kn, vv, gl, bb = _prepare(q, k, v, g[r:r + 1], beta[r:r + 1], A_log, dt_bias,
                                      lower_bound, scale)
        o, S = _step(_work(pool[idx]), qn[0], kn[0], vv[0], gl[0], bb[0])
        pool[idx] = S.to(pool.dtype)
        o = o / torch.sqrt((o * o).mean(dim=-1, keepdim=True) + _real("norm_eps", norm_eps))
        out[r] = o * norm_weight.to(work) * torch.sigmoid(output_gate[r].to(work))
    return out.to(x.dtype), conv_pool, pool
