"""fused_kda_verify's check and its call (FusedVerifyCall): the fused rules of fused_decode.py and
the index rules of verify.py."""
from __future__ import annotations

from dataclasses import dataclass

from .common import (GATE_MODE, _bool, _companion, _contiguous, _ndim, _offset_bits, _pool, _resolve_scale,
                     _same_device, _same_dtype, _shape, _tensor, dtype_name)
from .memo import _memoized
from .fused_decode import _FusedHeads, _conv_weight, _fused_step_tail, _fused_x_g, _norm_args
from .verify import _verify_index_table, _verify_lengths, _verify_route_meta


@dataclass(frozen=True)
class FusedVerifyCall(_FusedHeads):
    backend: str
    num_seqs: int
    total_tokens: int
    index_cols: int                 # T_max
    max_seqlen: int
    num_heads: int
    head_dim: int
    slots: int
    conv_len: int                   # L: inputs a conv cache line keeps (>= T_max + 2)
    input_dtype: str
    state_dtype: str
    gate: str
    gate_mode: int
    lower_bound: float
    scale: float
    norm_eps: float
    null_slot0: bool
    offset_bits: int

    def route_meta(self) -> dict:
        return _verify_route_meta(self)


@_memoized
def check_fused_kda_verify(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight, *,
                           state_indices, cu_seqlens, num_accepted_tokens=None, max_seqlen=None, lower_bound=None,
                           gate="softplus", norm_eps=1e-5, scale=None, null_slot0=False, out=None,
                           backend=None) -> FusedVerifyCall:
    """The metadata of a fused verify call (values: check_verify_values, on every call)."""
    x, g, device, backend = _fused_x_g(x, g, backend, 3, "[1, T, 3*H*D]", "[1, T, H, D]")
    _, T, H, D = g.shape
    if x.shape[0] != 1 or g.shape[0] != 1:
        raise ValueError(f"x: expected the packed layout [1, T, 3*H*D] (requests packed by cu_seqlens), got "
                         f"{list(x.shape)}")
    C = 3 * H * D
    _shape("x", x, (1, T, C), "[1, T, 3*H*D] (q|k|v before the conv)")
    for name, t in (("x", x), ("g", g)):
        _contiguous(name, t)
    _same_dtype("g", g, x, "x")
    beta = _companion("beta", beta, x, "x", (1, T, H), "[1, T, H]")
    conv_weight = _conv_weight(conv_weight, x, C, device)
    slots = _pool("state", state, H, D, D, device, backend)
    state_indices, N, cols = _verify_index_table(state_indices, device)
    conv_state = _tensor("conv_state", conv_state)
    _same_device("conv_state", conv_state, device)
    _ndim("conv_state", conv_state, 3, "[slots, 3*H*D, L]")
    if conv_state.shape[0] != slots or conv_state.shape[1] != C or conv_state.shape[2] < cols + 2:
        raise ValueError(f"conv_state: expected shape [slots, 3*H*D, L] = [{slots}, {C}, >= T_max + 2 = {cols + 2}] "
                         f"(a line keeps the inputs of every draft position), got {list(conv_state.shape)}")
    _contiguous("conv_state", conv_state)
    _same_dtype("conv_state", conv_state, x, "x")
    max_seqlen = _verify_lengths("x", T, N, cols, cu_seqlens, num_accepted_tokens, max_seqlen, device)
    output_gate = _companion("output_gate", output_gate, x, "x", (1, T, H, D), "[1, T, H, D]")
    norm_weight = _norm_args(norm_weight, norm_eps, D, device)
    _bool("null_slot0", null_slot0)
    lb = _fused_step_tail("fused_kda_verify", "padded", H, D, x, conv_weight, conv_state, g, beta, A_log, dt_bias,
                          state, output_gate, norm_weight, lower_bound, gate, out, (1, T, H, D), "[1, T, H, D]",
                          (("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                           ("num_accepted_tokens", num_accepted_tokens)), device, backend)
    return FusedVerifyCall(backend, N, T, cols, max_seqlen, H, D, slots, conv_state.shape[2], dtype_name(x.dtype),
                           dtype_name(state.dtype), gate, GATE_MODE[gate], lb, _resolve_scale(scale, D),
                           float(norm_eps), null_slot0, _offset_bits(state, conv_state))
