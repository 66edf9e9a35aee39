# Shared pieces of every KDA reference: the gates, l2norm and one delta-rule step.
# Fragment: the emitted reference puts `import torch` and the constants GATE, BETA_IS_LOGIT and
# NULL_SLOT0 above it. Work is in float32 (the kernels accumulate in fp32), float64 stays float64.


def _work(x):
    return x.to(torch.float64) if x.dtype == torch.float64 else x.to(torch.float32)


def _softplus(x):
    # log(1 + exp(x)), and x itself above 20; the clamp keeps the unused branch finite
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def _log_decay(g, A_log, dt_bias, lower_bound):
    """Per-token log decay [..., HV, K] (<= 0) from the raw gate."""
    g = _work(g)
    if GATE == "log":
        return g
    HV, K = g.shape[-2], g.shape[-1]
    rate = torch.ones(HV, 1, dtype=g.dtype, device=g.device)
    if A_log is not None:
        rate = torch.exp(A_log.to(g.dtype).reshape(HV, 1))
    bias = torch.zeros(HV, K, dtype=g.dtype, device=g.device)
    if dt_bias is not None:
        bias = dt_bias.to(g.dtype).reshape(HV, K)
    if GATE == "softplus":
        return -rate * _softplus(g + bias)
    return float(lower_bound) * torch.sigmoid(rate * (g + bias))


def _l2norm(x):
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale):
    """q (normalised, scaled), k (normalised) repeated to HV heads; v, log decay, beta in (0, 1)."""
    group = v.shape[-2] // q.shape[-2]
    qn = (_l2norm(_work(q)) * float(scale)).repeat_interleave(group, dim=-2)
    kn = _l2norm(_work(k)).repeat_interleave(group, dim=-2)
    b = _work(beta)
    if BETA_IS_LOGIT:
        b = torch.sigmoid(b)
    return qn, kn, _work(v), _log_decay(g, A_log, dt_bias, lower_bound), b


def _step(S, q, k, v, g, beta):
    """One token on every value head. S [HV, V, K]; q, k, g [HV, K]; v [HV, V]; beta [HV]."""
    S = S * torch.exp(g)[:, None, :]
    u = beta[:, None] * (v - torch.einsum("hvk,hk->hv", S, k))
    S = S + u[:, :, None] * k[:, None, :]
    return torch.einsum("hvk,hk->hv", S, q), S


def _is_padding(index):
    return index < 0 or (NULL_SLOT0 and index == 0)


def _check_slots(state_indices, num_slots):
    # a clear error instead of an IndexError for indices that are no slots (e.g. random integers)
    if state_indices.numel() and int(state_indices.max()) >= num_slots:
        raise ValueError(f"state_indices: expected slots < num_slots = {num_slots} or negative "
                         f"(padding), got {int(state_indices.max())}")
