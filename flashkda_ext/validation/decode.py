"""kda_decode's check and its call (DecodeCall), with what kda_verify shares with it: the g / beta
dtypes (_GbDtypes) and the checks both end with (_pool_step_tail)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .common import (GATE_MODE, SLOT_MODES, _aligned, _bool, _check_backend, _choice, _gate_args, _indices,
                     _inference_only, _offset_bits, _out, _pool, _qkv_common, _resolve_scale, _row_aligned,
                     _state_tag, _supported_dims, dtype_name)
from .memo import _memoized


class _GbDtypes:
    """g / beta dtype metadata of a decode or verify call (fields input_dtype, g_dtype, beta_dtype)."""

    @property
    def gb(self) -> str:
        """Route metadata 'gb': "f32" when g or beta is float32 beside q of another dtype (the
        routes' _gb32 twins read both as fp32), else "input" (both in q's dtype)."""
        if self.input_dtype != "float32" and "float32" in (self.g_dtype, self.beta_dtype):
            return "f32"
        return "input"

    def gb_casts(self, read: Optional[str]) -> tuple:
        """((name, dtype), ...): g / beta to convert before the module that reads both in dtype `read`
        (None: each in its own, the CPU module). Mixed fp32 / bf16 beside a _gb32 module: the bf16 one
        goes up to fp32, exactly; a module without fp32 reads (none is routed so today) would round."""
        if read is None:
            return ()
        return tuple((n, read) for n, d in (("g", self.g_dtype), ("beta", self.beta_dtype)) if d != read)


@dataclass(frozen=True)
class DecodeCall(_GbDtypes):
    backend: str
    rows: int
    num_heads: int
    value_heads: int
    head_dim_k: int
    head_dim_v: int
    slots: int
    input_dtype: str
    state_dtype: str
    gate: str
    gate_mode: int
    lower_bound: float
    scale: float
    beta_is_logit: bool
    slot_mode: str
    null_slot0: bool
    offset_bits: int
    g_dtype: str
    beta_dtype: str

    def route_meta(self) -> dict:
        return {"device": self.backend, "rows": self.rows, "value_heads": self.value_heads,
                "work_items": self.rows * self.value_heads, "state": _state_tag(self.state_dtype),
                "offset": f"o{self.offset_bits}", "slot_mode": self.slot_mode, "gate": self.gate, "gb": self.gb}


def _pool_step_tail(op, slot_mode, dims, q, k, v, g, beta, state, A_log, dt_bias, lower_bound, gate, out,
                    out_shape, out_layout, index_args, device, backend) -> float:
    """The checks kda_decode and kda_verify end with, in this order (the first failure is the one
    reported): the gate arguments, the supported set, alignment of q..beta, out, inference-only
    (index_args: the op's index tensors, read after dt_bias). dims = (H, K, HV, V); returns the
    lower bound resolved."""
    H, K, HV, V = dims
    lb = _gate_args(gate, A_log, dt_bias, lower_bound, HV, K, device, backend)
    _supported_dims(op, backend, K, V, H, HV, dtype_name(q.dtype), dtype_name(state.dtype), gate, slot_mode)
    row_dim = q.dim() - 3  # the rows (kda_decode) or tokens (kda_verify) may sit apart
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _aligned(name, x, backend)
        if name != "beta":  # beta is read element by element
            _row_aligned(name, x, row_dim, backend)
    _out(out, out_shape, out_layout, v.dtype, device, backend)
    _inference_only((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                     ("dt_bias", dt_bias)) + index_args, (("state", state), ("out", out)))
    return lb


@_memoized
def check_kda_decode(q, k, v, g, beta, *, state, state_indices, A_log=None, dt_bias=None,
                     lower_bound=None, gate="softplus", scale=None, beta_is_logit=True,
                     slot_mode="unique", null_slot0=False, out=None, backend=None) -> DecodeCall:
    device, H, K, HV, V = _qkv_common(q, k, v, g, beta, lead=("rows",), lead_names="rows", gb_f32=True,
                                      row_dim=0)
    backend = _check_backend(backend, device)
    rows = q.shape[0]
    _choice("slot_mode", slot_mode, SLOT_MODES)
    _bool("beta_is_logit", beta_is_logit)
    _bool("null_slot0", null_slot0)
    slots = _pool("state", state, HV, V, K, device, backend)
    _indices("state_indices", state_indices, rows, device, "[rows]")
    lb = _pool_step_tail("kda_decode", slot_mode, (H, K, HV, V), q, k, v, g, beta, state, A_log, dt_bias,
                         lower_bound, gate, out, (rows, HV, V), "[rows, HV, V]",
                         (("state_indices", state_indices),), device, backend)
    return DecodeCall(backend, rows, H, HV, K, V, slots, dtype_name(q.dtype), dtype_name(state.dtype),
                      gate, GATE_MODE[gate], lb, _resolve_scale(scale, K), beta_is_logit, slot_mode,
                      null_slot0, _offset_bits(state), dtype_name(g.dtype), dtype_name(beta.dtype))
