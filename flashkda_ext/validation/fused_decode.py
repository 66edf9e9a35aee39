"""fused_kda_decode's check and its call (FusedDecodeCall), with the rules fused_kda_verify shares:
x / g, conv_weight, the gated-RMSNorm arguments, the checks both end with, one head count."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .common import (GATE_MODE, SLOT_MODES, _aligned, _bool, _check_backend, _choice, _companion, _contiguous,
                     _dtype_in, _floating, _gate_args, _indices, _inference_only, _ndim, _offset_bits,
                     _out, _pool, _real, _resolve_scale, _row_strided, _same_device, _same_dtype, _shape,
                     _state_tag, _supported_dims, _tensor, dtype_name)
from .memo import _memoized


def _fused_x_g(x, g, backend, x_rank: int, x_layout: str, g_layout: str):
    """x [.., 3*H*D] (a floating tensor of rank x_rank) and g [.., H, D] (one rank more, on x's device)
    of a fused op; returns them with the device and the backend."""
    x = _tensor("x", x)
    device = x.device
    backend = _check_backend(backend, device)
    _ndim("x", x, x_rank, x_layout)
    _floating("x", x)
    g = _tensor("g", g)
    _same_device("g", g, device)
    _ndim("g", g, x_rank + 1, g_layout)
    H, D = g.shape[-2:]
    if H == 0 or D == 0:
        raise ValueError(f"g: head count and head dim must be > 0, got {list(g.shape)}")
    return x, g, device, backend


def _conv_weight(conv_weight, x, C: int, device, width_major: bool = False):
    """A fused op's conv_weight [3*H*D, 4] (C = 3*H*D), contiguous, of x's dtype or float32. width_major
    (fused_kda_decode): [3, 4, H*D] (per q | k | v part, tap-major: vLLM's decode copy) is taken too."""
    conv_weight = _tensor("conv_weight", conv_weight)
    _same_device("conv_weight", conv_weight, device)
    if width_major and conv_weight.dim() == 3:
        _shape("conv_weight", conv_weight, (3, 4, C // 3), "[3, 4, H*D] (width-major)")
    else:
        _shape("conv_weight", conv_weight, (C, 4), "[3*H*D, 4] or [3, 4, H*D]" if width_major else "[3*H*D, 4]")
    _contiguous("conv_weight", conv_weight)
    if conv_weight.dtype not in (x.dtype, torch.float32):
        want = "float32" if x.dtype == torch.float32 else f"{dtype_name(x.dtype)} (as x) or float32"
        raise ValueError(f"conv_weight: expected dtype {want}, got {dtype_name(conv_weight.dtype)}")
    return conv_weight


def _conv_cache(conv_state, x, C: int, device) -> torch.Tensor:
    """fused_kda_decode's conv_state [slots, 3*H*D, 3] of x's dtype: each slot channel-major (strides [., 3, 1]) or
    width-major ([., 1, 3*H*D]: vLLM's default cache layout seen through its transpose), the slots any stride >=
    one slot apart (a paged cache). csrc/common/fused_layout.h is this rule in the bindings."""
    conv_state = _tensor("conv_state", conv_state)
    _same_device("conv_state", conv_state, device)
    _ndim("conv_state", conv_state, 3, "[slots, 3*H*D, 3]")
    if tuple(conv_state.shape[1:]) != (C, 3):
        raise ValueError(f"conv_state: expected shape [slots, 3*H*D, 3] = [slots, {C}, 3], got {list(conv_state.shape)}")
    slot, ch, w = conv_state.stride()
    if ((ch, w) not in ((3, 1), (1, C))) or (conv_state.shape[0] > 1 and slot < 3 * C):
        raise ValueError(f"conv_state: expected each slot channel-major (strides [., 3, 1]) or width-major (strides "
                         f"[., 1, {C}]), the slots at least {3 * C} elements apart, got strides {list(conv_state.stride())}")
    _same_dtype("conv_state", conv_state, x, "x")
    return conv_state


def _norm_args(norm_weight, norm_eps, D: int, device):
    """A fused op's gated-RMSNorm weight [D] (float32, contiguous) and norm_eps (a finite float > 0)."""
    norm_weight = _tensor("norm_weight", norm_weight)
    _same_device("norm_weight", norm_weight, device)
    _shape("norm_weight", norm_weight, (D,), "[D]")
    _dtype_in("norm_weight", norm_weight, ("float32",))
    _contiguous("norm_weight", norm_weight)
    _real("norm_eps", norm_eps)
    if not math.isfinite(norm_eps) or norm_eps <= 0:
        raise ValueError(f"norm_eps: expected a finite float > 0, got {norm_eps!r}")
    return norm_weight


def _fused_step_tail(op, slot_mode, H, D, x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate,
                     norm_weight, lower_bound, gate, out, out_shape, out_layout, index_args, device,
                     backend) -> float:
    """The checks fused_kda_decode and fused_kda_verify end with, in this order (the first failure is
    the one reported), as _pool_step_tail for the unfused ops; index_args are read between dt_bias and
    output_gate. Returns the lower bound resolved."""
    lb = _gate_args(gate, A_log, dt_bias, lower_bound, H, D, device, backend)
    _supported_dims(op, backend, D, D, H, H, dtype_name(x.dtype), dtype_name(state.dtype), gate, slot_mode)
    for name, t in (("x", x), ("conv_state", conv_state), ("g", g), ("output_gate", output_gate)):
        _aligned(name, t, backend)
    _out(out, out_shape, out_layout, x.dtype, device, backend)
    _inference_only((("x", x), ("conv_weight", conv_weight), ("g", g), ("beta", beta), ("A_log", A_log),
                     ("dt_bias", dt_bias)) + index_args
                    + (("output_gate", output_gate), ("norm_weight", norm_weight)),
                    (("conv_state", conv_state), ("state", state), ("out", out)))
    return lb


class _FusedHeads:
    """The fused calls' one head count: value heads = key heads. A plain base (no fields), so the
    dataclasses' field order and positional construction stay as declared."""

    @property
    def value_heads(self) -> int:
        return self.num_heads


@dataclass(frozen=True)
class FusedDecodeCall(_FusedHeads):
    backend: str
    rows: int
    num_heads: int
    head_dim: int
    slots: int
    conv_slots: int
    input_dtype: str
    state_dtype: str
    conv_dtype: str
    gate: str
    gate_mode: int
    lower_bound: float
    scale: float
    norm_eps: float
    slot_mode: str
    null_slot0: bool
    offset_bits: int

    def route_meta(self) -> dict:
        return {"device": self.backend, "rows": self.rows, "value_heads": self.num_heads,
                "work_items": self.rows * self.num_heads, "state": _state_tag(self.state_dtype),
                "offset": f"o{self.offset_bits}", "slot_mode": self.slot_mode, "gate": self.gate}


@_memoized
def check_fused_kda_decode(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state,
                           output_gate, norm_weight, *, lower_bound=None, gate="softplus", norm_eps=1e-5,
                           scale=None, slot_mode="unique", null_slot0=False, out=None,
                           backend=None) -> FusedDecodeCall:
    x, g, device, backend = _fused_x_g(x, g, backend, 2, "[rows, 3*H*D]", "[rows, H, D]")
    rows, H, D = g.shape
    _shape("x", x, (rows, 3 * H * D), "[rows, 3*H*D] (q|k|v before the conv)")
    C = 3 * H * D
    # the rows as an engine holds them (views of its packed projection), each row dense
    _row_strided("x", x, 0, "[rows, 3*H*D]")
    _row_strided("g", g, 0, "[rows, H, D]")
    _same_dtype("g", g, x, "x")
    beta = _companion("beta", beta, x, "x", (rows, H), "[rows, H]", row_dim=0)
    conv_weight = _conv_weight(conv_weight, x, C, device, width_major=True)
    conv_state = _conv_cache(conv_state, x, C, device)
    slots = _pool("state", state, H, D, D, device, backend)
    if conv_state.shape[0] != slots:
        raise ValueError(f"conv_state: expected {slots} slots (as state), got {conv_state.shape[0]}")
    _indices("state_indices", state_indices, rows, device, "[rows]")
    output_gate = _companion("output_gate", output_gate, x, "x", (rows, H, D), "[rows, H, D]", row_dim=0)
    norm_weight = _norm_args(norm_weight, norm_eps, D, device)
    _choice("slot_mode", slot_mode, SLOT_MODES)
    _bool("null_slot0", null_slot0)
    lb = _fused_step_tail("fused_kda_decode", slot_mode, H, D, x, conv_weight, conv_state, g, beta, A_log, dt_bias,
                          state, output_gate, norm_weight, lower_bound, gate, out, (rows, H, D), "[rows, H, D]",
                          (("state_indices", state_indices),), device, backend)
    return FusedDecodeCall(backend, rows, H, D, slots, conv_state.shape[0], dtype_name(x.dtype),
                           dtype_name(state.dtype), dtype_name(conv_state.dtype), gate, GATE_MODE[gate], lb,
                           _resolve_scale(scale, D), float(norm_eps), slot_mode, null_slot0,
                           _offset_bits(state, conv_state))
