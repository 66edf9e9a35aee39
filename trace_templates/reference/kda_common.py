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
    # the layouts the op takes (A_log [HV]; dt_bias [HV, K] or flat [HV*K]): a reshape by element count served
    # a [K, HV] dt_bias on scrambled values
    if A_log is not None:
        _float("A_log", A_log, (HV,))
        rate = torch.exp(A_log.to(g.dtype).reshape(HV, 1))
    bias = torch.zeros(HV, K, dtype=g.dtype, device=g.device)
    if dt_bias is not None:
        if tuple(_float("dt_bias", dt_bias).shape) != (HV * K,):
            _float("dt_bias", dt_bias, (HV, K))
        bias = dt_bias.to(g.dtype).reshape(HV, K)
    if GATE == "softplus":
        return -rate * _softplus(g + bias)
    return _real("lower_bound", lower_bound) * torch.sigmoid(rate * (g + bias))


def _l2norm(x):
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _real(name, x):
    """A float scalar input (scale, lower_bound, norm_eps): a number; float() read '0.3' and True (as 1.0)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__} {x!r}")
    return float(x)


def _float(name, x, shape=None):
    """A floating-point tensor input, of `shape` where given (an int / bool one was read as numbers)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
    return x


def _integer(name, x):
    """An index input as an integer tensor (int() truncated a float one, a bool one was read as 0 / 1)."""
    if not isinstance(x, torch.Tensor) or x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(f"{name}: expected an integer tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    return x


def _indices(name, x, shape):
    """An index input: an integer tensor (_integer) of `shape` (None: any size; a shorter or longer one was cut to
    fit or failed unnamed)."""
    if _integer(name, x).dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, x.shape)):
        raise ValueError(f"{name}: expected shape {['*' if s is None else s for s in shape]}, got {list(x.shape)}")
    return x


def _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale):
    """q (normalised, scaled), k (normalised) repeated to HV heads; v, log decay, beta in (0, 1)."""
    # q [..., H, K], v [..., HV, V]; k as q, g [..., HV, K], beta [..., HV]: a beta [HV, 1] for [1, HV] was broadcast
    if _float("q", q).dim() < 3:
        raise ValueError(f"q: expected [..., tokens, heads, head_dim], got {list(q.shape)}")
    lead, (H, K), HV = tuple(q.shape[:-2]), tuple(q.shape[-2:]), v.shape[-2]
    for name, x, shape in (("q", q, q.shape), ("k", k, q.shape), ("v", v, lead + tuple(v.shape[-2:])),
                           ("g", g, lead + (HV, K)), ("beta", beta, lead + (HV,))):
        _float(name, x, shape)
    if HV % H:
        raise ValueError(f"v: expected value heads HV = {HV}, a multiple of q's heads H = {H}")
    group = HV // H
    qn = (_l2norm(_work(q)) * _real("scale", scale)).repeat_interleave(group, dim=-2)
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
    _integer("state_indices", state_indices)
    if state_indices.numel() and int(state_indices.max()) >= num_slots:
        raise ValueError(f"state_indices: expected slots < num_slots = {num_slots} or negative "
                         f"(padding), got {int(state_indices.max())}")
