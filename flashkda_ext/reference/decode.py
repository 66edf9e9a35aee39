"""Decode semantics: one token per row on a state pool, and the fused decode
(causal conv with its cache, SiLU, the step, gated RMSNorm)."""
from __future__ import annotations

import torch

from . import checks
from .gates import prepare_token_inputs
from .prefill import is_padding
from .step import delta_step

CONV_WIDTH = 4


def _row_indices(state_indices, rows, slots):
    indices = checks.host_ints("state_indices", state_indices)   # a float tensor was truncated (1.7 -> 1)
    if len(indices) != rows:
        raise ValueError(f"state_indices: expected {rows} entries (one per row), got {len(indices)}")
    if any(i >= slots for i in indices):
        raise ValueError(f"state_indices: entries must be < slots={slots}, got {indices}")
    return indices


def kda_decode_step(q, k, v, g, beta, *, state, state_indices, gate="softplus", A_log=None,
                    dt_bias=None, lower_bound=None, scale=None, beta_is_logit=True,
                    null_slot0=False, dtype=torch.float64):
    """One token per row on a state pool.

    q, k [rows, H, K]; v [rows, HV, V]; g [rows, HV, K] raw gate; beta [rows, HV];
    state: pool [slots, HV, V, K]; state_indices [rows].
    Rows run in order; a padding row (index < 0, or 0 with null_slot0) outputs zeros and touches
    nothing; each updated slot is stored back in the pool's dtype after its row, so rows sharing a
    slot behave exactly as sequential calls. Returns (out [rows, HV, V] in dtype, new pool); the
    input pool is not modified.
    """
    checks.tensor("v", v, 3, "[rows, HV, V]")   # unpacked below: a 4-D v raised a bare ValueError
    checks.tensor("state", state)
    checks.flag("null_slot0", null_slot0)
    rows, HV, V = v.shape
    K = checks.tensor("q", q).shape[-1]
    if state.dim() != 4 or tuple(state.shape[1:]) != (HV, V, K):
        raise ValueError(f"state: expected pool [slots, {HV}, {V}, {K}] (layout [slots, HV, V, K]), "
                         f"got {tuple(state.shape)}")
    indices = _row_indices(state_indices, rows, state.shape[0])
    qn, kn, vv, gl, bb = prepare_token_inputs(
        q, k, v, g, beta, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        scale=scale, beta_is_logit=beta_is_logit, dtype=dtype)
    pool = state.clone()
    out = torch.zeros(rows, HV, V, dtype=dtype, device=v.device)
    for r, idx in enumerate(indices):
        if is_padding(idx, null_slot0):
            continue
        out[r], S = delta_step(pool[idx].to(dtype), qn[r], kn[r], vv[r], gl[r], bb[r])
        pool[idx] = S.to(pool.dtype)
    return out, pool


def causal_conv_update(x, conv_weight, conv_state_rows):
    """One step of the width-4 causal depthwise conv, before any activation.

    x [..., C] the new input; conv_weight [C, 4]; conv_state_rows [..., C, 3] the previous three
    inputs, oldest first. Returns (y [..., C], new rows [..., C, 3]) where
    y[c] = w[c,0]*s[c,0] + w[c,1]*s[c,1] + w[c,2]*s[c,2] + w[c,3]*x[c], and the new rows are
    [s[c,1], s[c,2], x[c]] (shifted left, x appended). Computes in x's dtype.
    """
    window = torch.cat([conv_state_rows.to(x.dtype), x[..., None]], dim=-1)   # [..., C, 4]
    y = (window * conv_weight.to(x.dtype)).sum(dim=-1)
    return y, window[..., 1:]


def rmsnorm(x, eps):
    """x / sqrt(mean(x^2) + eps) over the last axis (no weight)."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def fused_kda_decode_step(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state,
                          output_gate, norm_weight, *, gate, lower_bound=None, norm_eps=1e-5,
                          scale=None, null_slot0=False, dtype=torch.float64):
    """The fused decode: conv (+cache) -> SiLU -> split q|k|v -> KDA step -> gated RMSNorm.

    x [rows, 3*H*D]; conv_weight [3*H*D, 4]; conv_state [slots, 3*H*D, 3]; g [rows, H, D] raw gate;
    beta [rows, H] (a logit); A_log [H] or None; dt_bias [H*D] or None; state_indices [rows];
    state [slots, H, D, D]; output_gate [rows, H, D]; norm_weight [D].
    out = rmsnorm(o) * norm_weight * sigmoid(output_gate). Padding rows output zeros and touch
    neither cache; rows sharing a slot run in row order. Returns (out [rows, H, D] in dtype,
    new conv_state, new state) - copies in the inputs' dtypes; the inputs are not modified.
    """
    checks.compute_dtype(dtype)   # used on x before prepare_token_inputs checks it
    rows, H, D = checks.tensor("g", g, 3, "[rows, H, D]").shape
    HD = H * D
    if tuple(x.shape) != (rows, 3 * HD):
        raise ValueError(f"x: expected [{rows}, {3 * HD}] (rows, 3*H*D), got {tuple(x.shape)}")
    if tuple(conv_weight.shape) != (3 * HD, CONV_WIDTH):
        raise ValueError(f"conv_weight: expected [{3 * HD}, {CONV_WIDTH}], got {tuple(conv_weight.shape)}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (3 * HD, CONV_WIDTH - 1):
        raise ValueError(f"conv_state: expected [slots, {3 * HD}, {CONV_WIDTH - 1}], "
                         f"got {tuple(conv_state.shape)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, D, D):
        raise ValueError(f"state: expected [slots, {H}, {D}, {D}], got {tuple(state.shape)}")
    if conv_state.shape[0] != state.shape[0]:
        raise ValueError(f"conv_state and state must have the same number of slots, got "
                         f"{conv_state.shape[0]} and {state.shape[0]}")
    indices = _row_indices(state_indices, rows, state.shape[0])
    conv_pool = conv_state.clone()
    pool = state.clone()
    out = torch.zeros(rows, H, D, dtype=dtype, device=x.device)
    for r, idx in enumerate(indices):
        if is_padding(idx, null_slot0):
            continue
        y, new_rows = causal_conv_update(x[r].to(dtype), conv_weight, conv_pool[idx])
        conv_pool[idx] = new_rows.to(conv_pool.dtype)
        y = torch.nn.functional.silu(y)
        q, k, v = (y[i * HD:(i + 1) * HD].reshape(1, H, D) for i in range(3))
        qn, kn, vv, gl, bb = prepare_token_inputs(
            q, k, v, g[r:r + 1], beta[r:r + 1], gate=gate, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, scale=scale, beta_is_logit=True, dtype=dtype)
        o, S = delta_step(pool[idx].to(dtype), qn[0], kn[0], vv[0], gl[0], bb[0])
        pool[idx] = S.to(pool.dtype)
        out[r] = (rmsnorm(o, norm_eps) * norm_weight.to(dtype)
                  * torch.sigmoid(output_gate[r].to(dtype)))
    return out, conv_pool, pool
