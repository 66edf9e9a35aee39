"""Per-token input transforms of KDA: the three gate modes, l2norm, and the shared input preparation.

Everything here computes in the dtype of its (already upcast) input; half-precision inputs given
directly are promoted to float32 first, since the reference never does arithmetic in bf16/fp16.
"""
from __future__ import annotations

import torch

from . import checks

GATE_MODES = ("softplus", "bounded", "log")
SOFTPLUS_THRESHOLD = 20.0


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), and x itself above 20 (the threshold every KDA implementation uses)."""
    # exp may overflow in the branch that is not taken; where() discards it without NaN.
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))


def gate_log_decay(g_raw, gate, A_log=None, dt_bias=None, lower_bound=None):
    """Per-token log decay g (<= 0) of shape [..., HV, K] from the raw gate projection.

    softplus: g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h, :])
    bounded:  g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h, :])), A_log/dt_bias may be None (= 0)
    log:      g = g_raw
    A_log is [HV]; dt_bias is [HV*K] or [HV, K].
    """
    if not isinstance(gate, str) or gate not in GATE_MODES:
        raise ValueError(f"gate: expected one of {GATE_MODES}, got {gate!r}")
    g_raw = checks.tensor("g", g_raw)
    if g_raw.dim() < 2:
        raise ValueError(f"g: expected [..., HV, K], got shape {tuple(g_raw.shape)}")
    # A_log / dt_bias with 'log' are refused, as the op refuses them: they were ignored in silence. (An unused
    # lower_bound stays accepted: callers pass one bound for every gate mode.)
    if gate == "log" and (A_log is not None or dt_bias is not None):
        extra = "A_log" if A_log is not None else "dt_bias"
        raise ValueError(f"{extra}: gate='log' takes g as the final log decay; expected None, got a tensor")
    work = _work_dtype(g_raw.dtype)
    g_raw = g_raw.to(work)
    if gate == "log":
        return g_raw
    HV, K = g_raw.shape[-2], g_raw.shape[-1]
    if gate == "softplus" and (A_log is None or dt_bias is None):
        raise ValueError("gate='softplus' needs both A_log [HV] and dt_bias [HV*K]; got "
                         f"A_log={'None' if A_log is None else 'tensor'}, "
                         f"dt_bias={'None' if dt_bias is None else 'tensor'}")
    if gate == "bounded":
        if lower_bound is None:
            raise ValueError("lower_bound: gate='bounded' needs lower_bound < 0, got None")
        # a finite real: the str "-5" passed float(), -inf gave NaN decays
        lower_bound = checks.real("lower_bound", lower_bound, "< 0")
    # absent A_log means A_log = 0, so exp(A_log) = 1
    a = torch.ones(HV, 1, dtype=work, device=g_raw.device)
    if A_log is not None:
        if checks.tensor("A_log", A_log).numel() != HV:
            raise ValueError(f"A_log: expected {HV} elements [HV], got shape {tuple(A_log.shape)}")
        a = torch.exp(A_log.to(work).to(g_raw.device).reshape(HV, 1))
    b = torch.zeros(HV, K, dtype=work, device=g_raw.device)
    if dt_bias is not None:
        # [HV*K] or [HV, K] (leading 1s aside): a [K, HV] one has the count too and was read transposed
        shape = tuple(checks.tensor("dt_bias", dt_bias).shape)
        while len(shape) > 1 and shape[0] == 1:
            shape = shape[1:]
        if shape not in ((HV * K,), (HV, K)):
            raise ValueError(f"dt_bias: expected shape [HV*K] = [{HV * K}] or [HV, K] = [{HV}, {K}], "
                             f"got {tuple(dt_bias.shape)}")
        b = dt_bias.to(work).to(g_raw.device).reshape(HV, K)
    if gate == "softplus":
        return -a * softplus(g_raw + b)
    return float(lower_bound) * torch.sigmoid(a * (g_raw + b))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis."""
    eps = checks.real("eps", eps, ">= 0")   # a negative eps gave NaN for small x
    x = x.to(_work_dtype(x.dtype))
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_token_inputs(q, k, v, g, beta, *, gate, A_log, dt_bias, lower_bound, scale,
                         beta_is_logit, dtype):
    """Turn raw per-token inputs into what the delta rule consumes, all in `dtype`.

    q, k [..., H, K]; v [..., HV, V]; g [..., HV, K]; beta [..., HV]. Returns q (scaled, normalised)
    and k (normalised) repeated to HV heads (value head hv reads q/k head hv // (HV // H)),
    v, the log decay g, and beta in (0, 1) (after sigmoid when it is a logit).
    """
    for name, x, least in (("q", q, 2), ("k", k, 2), ("v", v, 2), ("g", g, 2), ("beta", beta, 1)):
        if checks.tensor(name, x).dim() < least:
            raise ValueError(f"{name}: expected at least {least} dims, got shape {tuple(x.shape)}")
    checks.compute_dtype(dtype)
    checks.flag("beta_is_logit", beta_is_logit)   # "no" was a truthy logit flag
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    if H < 1:   # HV % H raised ZeroDivisionError
        raise ValueError(f"q: expected at least one head, got shape {tuple(q.shape)}")
    lead = q.shape[:-2]
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)} (same as q), got {tuple(k.shape)}")
    if v.shape[:-2] != lead:
        raise ValueError(f"v: expected leading dims {tuple(lead)}, got shape {tuple(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H}")
    if g.shape != (*lead, HV, K):
        raise ValueError(f"g: expected shape {(*lead, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (*lead, HV):
        raise ValueError(f"beta: expected shape {(*lead, HV)}, got {tuple(beta.shape)}")
    # a finite float > 0, as the op takes it: NaN gave NaN outputs, a str failed in arithmetic
    scale = K ** -0.5 if scale is None else checks.real("scale", scale, "> 0")
    group = HV // H
    qn = (l2norm(q.to(dtype)) * scale).repeat_interleave(group, dim=-2)
    kn = l2norm(k.to(dtype)).repeat_interleave(group, dim=-2)
    log_decay = gate_log_decay(g.to(dtype), gate, A_log=A_log, dt_bias=dt_bias,
                               lower_bound=lower_bound).to(dtype)
    b = beta.to(dtype)
    if beta_is_logit:
        b = torch.sigmoid(b)
    return qn, kn, v.to(dtype), log_decay, b
