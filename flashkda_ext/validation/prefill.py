"""kda_prefill's check and its call (PrefillCall), and the check of the caller's prefill workspace."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .common import (GATE_MODE, INT32_MAX, INT64_MAX, _aligned, _bool, _check_backend, _contiguous, _gate_args,
                     _indices, _inference_only, _int, _ndim, _out, _pool, _qkv_common, _resolve_scale, _same_device,
                     _span, _state_tag, _supported_dims, _tensor, check_offsets_span, dtype_name)
from .memo import _memoized


def prefill_route_meta(backend: str, num_seqs: int, value_heads: int, total_tokens: int,
                       max_seqlen: Optional[int], state: str, offset: str, gate: str, checkpoints: bool,
                       lower_bound: Optional[float] = None) -> dict:
    """kda_prefill's route metadata (docs/architecture.md), its derived fields (mean_seqlen, work_items,
    work_per_longest, longest_vs_mean_pct) in one place for the op and for callers that route without a call
    (ops.prefill_workspace_bytes).
    lower_bound: the bounded gate's bound, None for the other gates (a band on it then never holds).
    work_per_longest: token-heads of the call per token of its longest sequence, the longest being max_seqlen
    when the caller knows it and the mean otherwise (then it is work_items, or a little more where the mean is
    rounded down): how far the whole work
    outweighs the one ordered chain no kernel can split without pieces.
    longest_vs_mean_pct: the longest sequence in percent of the mean (100 x longest x num_seqs // total_tokens; about
    100 for like lengths or an unknown longest, more for a batch of long and short sequences)."""
    mean = total_tokens // max(1, num_seqs)
    longest = mean if max_seqlen is None else max_seqlen
    return {"device": backend, "num_seqs": num_seqs, "value_heads": value_heads, "total_tokens": total_tokens,
            "max_seqlen": max_seqlen, "mean_seqlen": mean, "work_items": num_seqs * value_heads,
            "work_per_longest": total_tokens * value_heads // max(1, longest),
            "longest_vs_mean_pct": 100 * longest * num_seqs // max(1, total_tokens), "state": state, "offset": offset,
            "gate": gate, "checkpoints": checkpoints, "lower_bound": lower_bound if gate == "bounded" else None}


def check_max_seqlen(max_seqlen, T: int, packed: bool) -> None:
    """kda_prefill's max_seqlen: None, or an int in [0, T] (exactly T for unpacked input)."""
    if max_seqlen is None:
        return
    _int("max_seqlen", max_seqlen, "or None")
    if not packed and max_seqlen != T:
        # unpacked input: each of the B rows is one sequence of exactly T tokens
        raise ValueError(f"max_seqlen: expected T = {T} (every one of the B rows is a sequence of T tokens) "
                         f"or None, got {max_seqlen}")
    if max_seqlen < 0 or max_seqlen > T:
        raise ValueError(f"max_seqlen: expected an int in [0, T = {T}] or None, got {max_seqlen!r}")


def check_offset_count(cu_seqlens: torch.Tensor) -> None:
    """kda_prefill's cu_seqlens [N+1] holds at least one sequence (the traced wrapper sizes outputs from N)."""
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 offsets [N+1] with N >= 1, got {list(cu_seqlens.shape)}")


def check_checkpoint_every(checkpoint_every) -> None:
    """kda_prefill's checkpoint_every: an int in [0, INT64_MAX]."""
    _int("checkpoint_every", checkpoint_every, ">= 0")
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every: expected an int >= 0, got {checkpoint_every!r}")
    if checkpoint_every > INT64_MAX:  # the modules take an int64: name it here, not the FFI conversion
        raise ValueError(f"checkpoint_every: expected an int <= {INT64_MAX} (the kernels' int64), got "
                         f"{checkpoint_every}")


@dataclass(frozen=True)
class PrefillCall:
    backend: str
    batch: int
    seqlen: int
    num_seqs: int
    total_tokens: int
    num_heads: int
    value_heads: int
    head_dim_k: int
    head_dim_v: int
    input_dtype: str
    state_dtype: Optional[str]      # None when no state tensor is read or written
    state_mode: str                 # "none", "dense" or "pool"
    slots: int                      # pool slots (pool mode) else num_seqs
    output_final_state: bool
    checkpoint_every: int
    checkpoint_slots: int
    max_seqlen: Optional[int]
    cu_seqlens_dtype: Optional[str]
    gate: str
    gate_mode: int
    lower_bound: float
    scale: float
    beta_is_logit: bool
    null_slot0: bool
    offset_bits: int

    def route_meta(self) -> dict:
        return prefill_route_meta(self.backend, self.num_seqs, self.value_heads, self.total_tokens,
                                  self.max_seqlen, _state_tag(self.state_dtype or "float32"),
                                  f"o{self.offset_bits}", self.gate, self.checkpoint_every > 0,
                                  float(self.lower_bound))


@_memoized
def check_kda_prefill(q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, gate="softplus",
                      scale=None, beta_is_logit=True, cu_seqlens=None, initial_state=None, state=None,
                      state_indices=None, output_final_state=True, final_state=None, checkpoint_every=0,
                      checkpoints=None, max_seqlen=None, null_slot0=False, out=None, backend=None,
                      chunk_multiple: int = 1) -> PrefillCall:
    device, H, K, HV, V = _qkv_common(q, k, v, g, beta, lead=("B", "T"), lead_names="B, T")
    backend = _check_backend(backend, device)
    B, T = q.shape[0], q.shape[1]
    _bool("beta_is_logit", beta_is_logit)
    _bool("output_final_state", output_final_state)
    _bool("null_slot0", null_slot0)

    check_max_seqlen(max_seqlen, T, cu_seqlens is not None)
    cu_dtype = None
    if cu_seqlens is not None:
        cu_seqlens = _tensor("cu_seqlens", cu_seqlens)
        _same_device("cu_seqlens", cu_seqlens, device)
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: expected dtype int32 or int64, got {dtype_name(cu_seqlens.dtype)}")
        _ndim("cu_seqlens", cu_seqlens, 1, "[N+1]")
        check_offset_count(cu_seqlens)
        _contiguous("cu_seqlens", cu_seqlens)
        if B != 1:
            raise ValueError(f"q: packed variable-length input (cu_seqlens given) needs batch B = 1, got B = {B}")
        if cu_seqlens.device.type == "cpu":
            # Only host-side offsets are inspected; device offsets are checked by the binding.
            cs = cu_seqlens.tolist()
            check_offsets_span("cu_seqlens", cs, T)
            host_longest = max(b - a for a, b in zip(cs, cs[1:]))
            if max_seqlen is not None and max_seqlen < host_longest:
                raise ValueError(f"max_seqlen: expected >= the longest sequence in cu_seqlens ({host_longest}), "
                                 f"got {max_seqlen}")
            max_seqlen = host_longest if max_seqlen is None else max_seqlen
        N = cu_seqlens.shape[0] - 1
        cu_dtype = dtype_name(cu_seqlens.dtype)
    else:
        N = B
    if cu_seqlens is None and max_seqlen is None:
        max_seqlen = T

    state_mode, slots, state_dtype = "none", N, None
    state_name = "state"  # the argument the state dtype was read from, for the supported-set message
    if state is not None or state_indices is not None:
        if state is None or state_indices is None:
            missing = "state" if state is None else "state_indices"
            raise ValueError(f"{missing}: pool mode needs both state (the pool) and state_indices, got None")
        if initial_state is not None or final_state is not None:
            extra = "initial_state" if initial_state is not None else "final_state"
            raise ValueError(f"{extra}: pool mode (state + state_indices) reads and writes the pool in place; "
                             f"expected None, got a tensor")
        slots = _pool("state", state, HV, V, K, device, backend)
        _indices("state_indices", state_indices, N, device, "[N] (one slot per sequence)")
        state_mode, state_dtype = "pool", dtype_name(state.dtype)
    else:
        if null_slot0:
            raise ValueError("null_slot0: only meaningful in pool mode (state + state_indices); expected False")
        if initial_state is not None:
            n0 = _pool("initial_state", initial_state, HV, V, K, device, backend, slots_apart=False)
            if n0 != N:
                raise ValueError(f"initial_state: expected shape [N, HV, V, K] with N = {N} sequences, "
                                 f"got {list(initial_state.shape)}")
            state_mode, state_dtype, state_name = "dense", dtype_name(initial_state.dtype), "initial_state"
        if final_state is not None:
            if not output_final_state:
                raise ValueError("final_state: given but output_final_state=False; expected None")
            n1 = _pool("final_state", final_state, HV, V, K, device, backend, slots_apart=False)
            if n1 != N:
                raise ValueError(f"final_state: expected shape [N, HV, V, K] with N = {N} sequences, "
                                 f"got {list(final_state.shape)}")
            if state_dtype is not None and dtype_name(final_state.dtype) != state_dtype:
                raise ValueError(f"final_state: expected the dtype of initial_state ({state_dtype}), "
                                 f"got {dtype_name(final_state.dtype)}")
            if initial_state is None:
                state_name = "final_state"
            state_mode, state_dtype = "dense", dtype_name(final_state.dtype)
        elif output_final_state:
            state_mode = "dense"
            state_dtype = state_dtype or "float32"

    check_checkpoint_every(checkpoint_every)
    ckpt_slots = 0
    if checkpoint_every > 0:
        if checkpoint_every % chunk_multiple != 0:
            raise ValueError(f"checkpoint_every: expected a multiple of the chunk size {chunk_multiple} on "
                             f"the {backend} backend, got {checkpoint_every}")
        longest = max_seqlen if max_seqlen is not None else T
        need = longest // checkpoint_every
        if checkpoints is not None:
            checkpoints = _tensor("checkpoints", checkpoints)
            _same_device("checkpoints", checkpoints, device)
            _ndim("checkpoints", checkpoints, 5, "[N, C, HV, V, K]")
            if (checkpoints.shape[0], *checkpoints.shape[2:]) != (N, HV, V, K) or checkpoints.shape[1] < need:
                raise ValueError(f"checkpoints: expected shape [N, C, HV, V, K] = [{N}, >= {need}, {HV}, {V}, {K}] "
                                 f"(C >= longest sequence // checkpoint_every), got {list(checkpoints.shape)}")
            _contiguous("checkpoints", checkpoints)
            _aligned("checkpoints", checkpoints, backend)
            if state_dtype is not None and dtype_name(checkpoints.dtype) != state_dtype:
                raise ValueError(f"checkpoints: expected the state dtype {state_dtype}, got {dtype_name(checkpoints.dtype)}")
            if state_dtype is None:
                state_dtype, state_name = dtype_name(checkpoints.dtype), "checkpoints"
            ckpt_slots = checkpoints.shape[1]
        else:
            ckpt_slots = need
            state_dtype = state_dtype or "float32"
    elif checkpoints is not None:
        raise ValueError("checkpoints: given but checkpoint_every = 0; expected None")

    lb = _gate_args(gate, A_log, dt_bias, lower_bound, HV, K, device, backend)
    _supported_dims("kda_prefill", backend, K, V, H, HV, dtype_name(q.dtype), state_dtype, gate,
                    "padded" if state_mode == "pool" else None, state_name)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _aligned(name, x, backend)
    _out(out, (B, T, HV, V), "[B, T, HV, V]", v.dtype, device, backend)
    _inference_only((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                     ("dt_bias", dt_bias), ("cu_seqlens", cu_seqlens), ("initial_state", initial_state),
                     ("state_indices", state_indices)),
                    (("state", state), ("final_state", final_state), ("checkpoints", checkpoints), ("out", out)))
    ckpt_numel = N * ckpt_slots * HV * V * K
    pool_span = _span(state) if state_mode == "pool" else slots * HV * V * K
    offset_bits = 64 if max(pool_span, ckpt_numel, T * HV * max(K, V)) > INT32_MAX else 32
    return PrefillCall(backend, B, T, N, B * T, H, HV, K, V, dtype_name(q.dtype), state_dtype, state_mode,
                       slots, output_final_state, checkpoint_every, ckpt_slots, max_seqlen, cu_dtype, gate,
                       GATE_MODE[gate], lb, _resolve_scale(scale, K), beta_is_logit, null_slot0, offset_bits)


def check_workspace(workspace, need: Optional[int], device: torch.device, backend: str):
    """The caller's prefill scratch buffer: uint8, on q's device, contiguous, >= need bytes. A module that
    needs none (need None: the CPU backend) still refuses a buffer of the wrong kind, as a GPU call would."""
    if workspace is None:
        return workspace
    workspace = _tensor("workspace", workspace)
    if workspace.dtype != torch.uint8 or workspace.device != device or (need is not None and workspace.numel() < need):
        size = "" if need is None else f" with at least {need} bytes"
        raise ValueError(f"workspace: expected a uint8 tensor on {device}{size}, "
                         f"got {dtype_name(workspace.dtype)} {list(workspace.shape)} on {workspace.device}")
    if need is None:
        return workspace
    _contiguous("workspace", workspace)
    _aligned("workspace", workspace, backend)
    _inference_only((), (("workspace", workspace),))
    return workspace

