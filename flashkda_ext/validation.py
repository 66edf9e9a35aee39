"""Argument validation shared by every public op.

Every rule raises before anything is launched: TypeError for a wrong kind of value, ValueError for a
wrong shape, dtype, device, layout or range, each naming the argument, what was expected and what was
received. What a backend supports (head dims, head counts, dtypes, gates, slot modes) is read from
jit/supported.json through flashkda_ext.supported, the same file the binding macros and the trace
constraints are rendered from.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Optional

import torch

from . import supported as _supported

GATES = ("softplus", "bounded", "log")
GATE_MODE = {"softplus": 0, "bounded": 1, "log": 2}
SLOT_MODES = ("unique", "padded", "repeated")
INT32_MAX = 2**31 - 1

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


# ---------------------------------------------------------------------------------------------
# small rules


def _tensor(name: str, x, *, optional: bool = False) -> Optional[torch.Tensor]:
    if x is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a torch.Tensor, got None")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    # A lazy negated / conjugated view: the kernels would read its raw memory without the sign.
    if x.is_neg():
        raise ValueError(f"{name}: expected a tensor without the negative bit (a lazy negated view, e.g. "
                         f"from torch._neg_view); call .resolve_neg() first")
    if x.is_conj():
        raise ValueError(f"{name}: expected a tensor without the conjugate bit (a lazy .conj() view); "
                         f"call .resolve_conj() first")
    return x


def _shape(name: str, x: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {what} = {list(expected)}, got {list(x.shape)}")


def _ndim(name: str, x: torch.Tensor, ndim: int, what: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {what}, got shape {list(x.shape)}")


def _contiguous(name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (row-major strides), got shape "
                         f"{list(x.shape)} with strides {list(x.stride())}; call .contiguous() first")


def _same_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got {x.device}")


def _dtype_in(name: str, x: torch.Tensor, allowed, what: str = "") -> None:
    if allowed is not None and dtype_name(x.dtype) not in allowed:
        raise ValueError(f"{name}: expected dtype in {list(allowed)}{what}, got {dtype_name(x.dtype)}")


def _floating(name: str, x: torch.Tensor) -> None:
    """The reference tensor of the inputs' dtype: checked before the others are compared with it, so
    an integer q (or x) is blamed on q, not on the first tensor that differs from it."""
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point dtype (bfloat16, float16, float32 or float64), "
                         f"got {dtype_name(x.dtype)}")


def _same_dtype(name: str, x: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if x.dtype != ref.dtype:
        raise ValueError(f"{name}: expected the dtype of {ref_name} ({dtype_name(ref.dtype)}), got {dtype_name(x.dtype)}")


def _companion(name: str, x, ref: torch.Tensor, ref_name: str, shape: tuple, what: str) -> torch.Tensor:
    """A tensor that must sit beside `ref`: same device and dtype, the given shape, contiguous."""
    x = _tensor(name, x)
    _same_device(name, x, ref.device)
    _shape(name, x, shape, what)
    _contiguous(name, x)
    _same_dtype(name, x, ref, ref_name)
    return x


def _aligned(name: str, x: torch.Tensor, backend: str) -> None:
    # CUDA kernels use 16-byte vector accesses; a sliced view can start off that boundary.
    # Meta tensors (shape-only checks, e.g. from the JAX wrappers) have no address to check.
    if backend == "cuda" and x.device.type != "meta" and x.numel() > 0 and x.data_ptr() % 16 != 0:
        raise ValueError(f"{name}: expected a data pointer aligned to 16 bytes, got address "
                         f"{x.data_ptr():#x} (offset view?); pass a fresh contiguous tensor")


def _in_set(name: str, value, allowed, what: str) -> None:
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}: {what} {value} is not supported here; expected one of {list(allowed)}")


def _choice(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def _int(name: str, value, what: str) -> int:
    """An int scalar (not a bool): TypeError for another kind of value."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int {what}, got {type(value).__name__} {value!r}")
    return value


def _float(name: str, value, what: str) -> float:
    """A real number (int or float, not a bool): TypeError for another kind of value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float {what}, got {type(value).__name__} {value!r}")
    return float(value)


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def backend_of(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "cuda"
    raise ValueError(f"q: expected a tensor on a CPU or CUDA device, got {device}")


def _resolve_scale(scale, head_dim_k: int) -> float:
    if scale is None:
        return head_dim_k ** -0.5
    scale = _float("scale", scale, "or None")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite value > 0, got {scale}")
    return float(scale)


def _gate_args(gate, A_log, dt_bias, lower_bound, value_heads: int, head_dim_k: int,
               device: torch.device, backend: str) -> float:
    """Checks the gate mode and its parameters; returns lower_bound as a float (0.0 when unused)."""
    _choice("gate", gate, GATES)
    A_log = _tensor("A_log", A_log, optional=True)
    dt_bias = _tensor("dt_bias", dt_bias, optional=True)
    if gate == "softplus" and (A_log is None or dt_bias is None):
        missing = "A_log" if A_log is None else "dt_bias"
        raise ValueError(f"{missing}: required by gate='softplus' (g = -exp(A_log) * softplus(g + dt_bias)), got None")
    if gate == "log" and (A_log is not None or dt_bias is not None):
        extra = "A_log" if A_log is not None else "dt_bias"
        raise ValueError(f"{extra}: gate='log' takes g as the final log decay; expected None, got a tensor")
    if A_log is not None:
        _same_device("A_log", A_log, device)
        _dtype_in("A_log", A_log, ("float32",))
        _shape("A_log", A_log, (value_heads,), "[HV]")
        _contiguous("A_log", A_log)
    if dt_bias is not None:
        _same_device("dt_bias", dt_bias, device)
        _dtype_in("dt_bias", dt_bias, ("float32",))
        if tuple(dt_bias.shape) not in ((value_heads * head_dim_k,), (value_heads, head_dim_k)):
            raise ValueError(f"dt_bias: expected shape [HV*K] = [{value_heads * head_dim_k}] or "
                             f"[HV, K] = [{value_heads}, {head_dim_k}], got {list(dt_bias.shape)}")
        _contiguous("dt_bias", dt_bias)
    if gate == "bounded":
        if lower_bound is None:
            raise ValueError("lower_bound: required by gate='bounded' (a float < 0), got None")
        lower_bound = _float("lower_bound", lower_bound, "< 0")
        if not math.isfinite(lower_bound) or lower_bound >= 0:
            raise ValueError(f"lower_bound: expected a finite value < 0, got {lower_bound}")
        return float(lower_bound)
    if lower_bound is not None:
        raise ValueError(f"lower_bound: only used by gate='bounded'; expected None with gate={gate!r}, "
                         f"got {lower_bound}")
    return 0.0


@functools.lru_cache(maxsize=64)
def _supported_set(family: str, backend: str) -> dict:
    # Read once per process: the file is data shipped with the package, not a runtime setting.
    sup = _supported.supported(family, backend)
    if sup is None:
        raise ValueError(f"{family}: the {backend} backend is not supported (no entry in jit/supported.json)")
    return sup


def _supported_dims(family: str, backend: str, head_dim_k: int, head_dim_v: int,
                    num_heads: int, value_heads: int, input_dtype: str,
                    state_dtype: Optional[str], gate: str, slot_mode: Optional[str],
                    state_name: str = "state") -> None:
    sup = _supported_set(family, backend)
    where = f" by the {backend} backend of {family}"
    _in_set("q", head_dim_k, sup["head_dims_k"], "head dim K =")
    _in_set("v", head_dim_v, sup["head_dims_v"], "head dim V =")
    _in_set("v", value_heads, sup["value_heads"], "value head count HV =")
    _in_set("v", value_heads // num_heads, sup["group_sizes"], "group size HV/H =")
    if sup["input_dtypes"] is not None and input_dtype not in sup["input_dtypes"]:
        raise ValueError(f"q: expected dtype in {sup['input_dtypes']}{where}, got {input_dtype}")
    if state_dtype is not None and sup["state_dtypes"] is not None and state_dtype not in sup["state_dtypes"]:
        raise ValueError(f"{state_name}: expected dtype in {sup['state_dtypes']}{where}, got {state_dtype}")
    _in_set("gate", gate, sup["gates"], "gate")
    if slot_mode is not None:
        _in_set("slot_mode", slot_mode, sup["slot_modes"], "slot mode")


def _qkv_common(q, k, v, g, beta, *, lead: tuple, lead_names: str, gb_f32: bool = False):
    """Shapes of q, k [*lead, H, K], v [*lead, HV, V], g [*lead, HV, K], beta [*lead, HV]; all of q's
    dtype, except that with gb_f32 g and beta may each be float32 instead (kda_decode and kda_verify
    read them so)."""
    q = _tensor("q", q)
    k = _tensor("k", k)
    v = _tensor("v", v)
    g = _tensor("g", g)
    beta = _tensor("beta", beta)
    nl = len(lead)
    _ndim("q", q, nl + 2, f"[{lead_names}, H, K]")
    _floating("q", q)  # before the others are compared with q's dtype
    device = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _same_device(name, x, device)
    num_heads, head_dim_k = q.shape[nl], q.shape[nl + 1]
    _shape("k", k, tuple(q.shape), f"[{lead_names}, H, K] (same as q)")
    _ndim("v", v, nl + 2, f"[{lead_names}, HV, V]")
    if tuple(v.shape[:nl]) != tuple(q.shape[:nl]):
        raise ValueError(f"v: expected leading dims [{lead_names}] = {list(q.shape[:nl])} (as q), got {list(v.shape)}")
    value_heads, head_dim_v = v.shape[nl], v.shape[nl + 1]
    if num_heads == 0 or value_heads == 0 or head_dim_k == 0 or head_dim_v == 0:
        raise ValueError(f"q/v: head counts and head dims must be > 0, got q {list(q.shape)}, v {list(v.shape)}")
    if value_heads % num_heads != 0:
        raise ValueError(f"v: value heads HV = {value_heads} must be a multiple of the q/k heads H = {num_heads}")
    _shape("g", g, tuple(q.shape[:nl]) + (value_heads, head_dim_k), f"[{lead_names}, HV, K]")
    _shape("beta", beta, tuple(q.shape[:nl]) + (value_heads,), f"[{lead_names}, HV]")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _contiguous(name, x)
        if gb_f32 and name in ("g", "beta"):
            if x.dtype not in (q.dtype, torch.float32):
                also = "" if q.dtype == torch.float32 else " or float32"
                raise ValueError(f"{name}: expected the dtype of q ({dtype_name(q.dtype)}){also}, "
                                 f"got {dtype_name(x.dtype)}")
        else:
            _same_dtype(name, x, q, "q")
    return device, num_heads, head_dim_k, value_heads, head_dim_v


def _out(out, expected_shape: tuple, what: str, dtype: torch.dtype, device, backend: str):
    if out is None:
        return None
    out = _tensor("out", out)
    _same_device("out", out, device)
    _shape("out", out, expected_shape, what)
    if out.dtype != dtype:
        raise ValueError(f"out: expected dtype {dtype_name(dtype)} (the dtype of v), got {dtype_name(out.dtype)}")
    _contiguous("out", out)
    _aligned("out", out, backend)
    return out


def _slot_stride(name: str, state: torch.Tensor) -> int:
    """The slot stride (elements) of a pool [slots, HV, V, K] whose slots may sit apart, as serving
    engines page them (vLLM keeps a request's conv and recurrent state in one page): dims 1-3 dense
    (a dim of size 1 may carry any stride, as for is_contiguous), and a slot stride of HV*V*K or more,
    then a multiple of 16 bytes (the bulk copies read 16-byte-aligned tiles from each slot's base).
    Slots never overlap. docs/semantics.md, "Strided pools"; csrc/common/pool_args.h, the same rule."""
    slots, a, b, d = state.shape
    st = state.stride()
    elems = a * b * d
    inner = (d <= 1 or st[3] == 1) and (b <= 1 or st[2] == d) and (a <= 1 or st[1] == b * d)
    stride = elems if slots <= 1 else st[0]
    size = state.element_size()
    if not inner or stride < elems or (stride != elems and stride * size % 16 != 0):
        raise ValueError(f"{name}: expected a pool [slots, HV, V, K] with dims 1-3 contiguous (strides "
                         f"[{b * d}, {d}, 1]) and a slot stride of {elems} elements, or more as a multiple of "
                         f"16 bytes ({16 // size} elements of {dtype_name(state.dtype)}); got shape "
                         f"{list(state.shape)} with strides {list(st)}")
    return stride


def _pool(name: str, state, value_heads: int, head_dim_v: int, head_dim_k: int, device, backend: str,
          *, slots_apart: bool = True) -> int:
    """A state pool [slots, HV, V, K]: its slot count. slots_apart: the slots may sit apart
    (_slot_stride); else (a dense state) it must be contiguous."""
    state = _tensor(name, state)
    _same_device(name, state, device)
    _ndim(name, state, 4, "[slots, HV, V, K]")
    if tuple(state.shape[1:]) != (value_heads, head_dim_v, head_dim_k):
        raise ValueError(f"{name}: expected shape [slots, HV, V, K] = [slots, {value_heads}, {head_dim_v}, "
                         f"{head_dim_k}], got {list(state.shape)}")
    if slots_apart:
        _slot_stride(name, state)
    else:
        _contiguous(name, state)
    _aligned(name, state, backend)
    return state.shape[0]


def _indices(name: str, idx, length: int, device, what: str) -> None:
    idx = _tensor(name, idx)
    _same_device(name, idx, device)
    if idx.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype int32, got {dtype_name(idx.dtype)}")
    _shape(name, idx, (length,), what)
    _contiguous(name, idx)


def _inference_only(read: tuple, written: tuple) -> None:
    """The ops are inference-only: with grad enabled, no argument may require grad (the result would
    have no grad_fn and a leaf would be changed in place); outside inference mode, nothing written
    may be an inference tensor (torch itself refuses that in-place update). (name, tensor) pairs;
    None tensors are skipped."""
    if torch.is_inference_mode_enabled():
        return
    for name, x in written:
        if x is not None and x.is_inference():
            raise ValueError(f"{name}: an inference tensor (made under torch.inference_mode()) cannot be "
                             f"written in place outside inference mode; call under torch.inference_mode() "
                             f"or pass a clone made outside it")
    if torch.is_grad_enabled():
        for name, x in chain(read, written):
            if x is not None and x.requires_grad:
                raise ValueError(f"{name}: requires grad, but the ops are inference-only (no autograd); "
                                 f"pass x.detach() or call under torch.no_grad() / torch.inference_mode()")


def _extent(x: torch.Tensor) -> tuple:
    """(device, first byte, one past the last byte) that x can touch; empty for numel 0."""
    if x.numel() == 0:
        return x.device, 0, 0
    last = sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    lo = x.data_ptr()
    return x.device, lo, lo + (last + 1) * x.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


def check_apart(written: tuple, read: tuple, same_view_ok: tuple = ()) -> None:
    """No tensor the op writes may overlap any other tensor argument (the kernels read and write in
    an order of their own; an overlap silently corrupts the state pool or the inputs). (name, tensor)
    pairs, None skipped; same_view_ok names the one pair that may be the identical view (a dense state
    read and written in place). Reads addresses, so it runs on every full check (never memoized); the
    fast path's signature carries the same rule (csrc/common/binding.h, CallTensors)."""
    items = [(n, x, True) for n, x in written if x is not None] + [(n, x, False) for n, x in read if x is not None]
    spans = [_extent(x) for _, x, _ in items]
    for i, (name_i, x_i, w_i) in enumerate(items):
        if not w_i:
            continue
        dev_i, lo_i, hi_i = spans[i]
        for j, (name_j, x_j, _) in enumerate(items):
            dev_j, lo_j, hi_j = spans[j]
            if j == i or dev_i != dev_j or not (lo_i < hi_i and lo_j < hi_j and lo_i < hi_j and lo_j < hi_i):
                continue
            if {name_i, name_j} == set(same_view_ok) and _same_view(x_i, x_j):
                continue
            raise ValueError(f"{name_i}: overlaps the memory of {name_j}; the op writes {name_i}, so it must not "
                             f"share storage with any other argument (pass a separate tensor)")


def check_workspace(workspace, need: Optional[int], device: torch.device, backend: str):
    """The caller's prefill scratch buffer: uint8, on q's device, contiguous, >= need bytes."""
    if workspace is None or need is None:
        return workspace
    workspace = _tensor("workspace", workspace)
    if workspace.dtype != torch.uint8 or workspace.device != device or workspace.numel() < need:
        raise ValueError(f"workspace: expected a uint8 tensor on {device} with at least {need} bytes, "
                         f"got {dtype_name(workspace.dtype)} {list(workspace.shape)} on {workspace.device}")
    _contiguous("workspace", workspace)
    _aligned("workspace", workspace, backend)
    _inference_only((), (("workspace", workspace),))
    return workspace


def _check_backend(backend: Optional[str], device: torch.device) -> str:
    if backend is None:
        return backend_of(device)
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend: expected 'cpu', 'cuda' or None, got {backend!r}")
    return backend


# ---------------------------------------------------------------------------------------------
# memo: a serving loop calls with the same shapes every step, so the verdict of a full check is
# reused for the next call whose tensors have the same shape, dtype, device, contiguity (strides when
# not contiguous: a pool's slot stride decides its verdict and offset width) and 16-byte alignment
# and whose other arguments are equal (same type too: True is not 1). Anything the key
# cannot capture (values inside a host tensor, unhashable arguments, tensor subclasses) takes the
# full check every time.

_MEMO_LIMIT = 512


_SCALAR_TYPES = (type(None), bool, int, float, str)
_Tensor = torch.Tensor


def _memo_key(args, kwargs):
    """A hashable summary of the call, or None when some argument cannot be summarized. Called on
    every call of a serving loop, so it avoids what costs there: x.device.type (a new string each
    time, ~0.25 us a tensor; x.is_cuda says the same) and per-call generator tuples."""
    # the inference-only rule reads the grad and inference modes and each tensor's flags
    key = [tuple(kwargs), torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    add = key.append
    for name, x in chain(zip(repeat(None), args), kwargs.items()):
        tx = type(x)
        if tx is _Tensor:
            flags = (x.requires_grad, x.is_inference(), x.is_neg(), x.is_conj())
            if x.is_cuda:
                add((x.shape, x.dtype, x.device, x.is_contiguous() or x.stride(), x.data_ptr() & 15, flags))
            elif name == "cu_seqlens":
                return None  # host offsets are checked by value
            else:
                add((x.shape, x.dtype, x.device, x.is_contiguous() or x.stride(), flags))
        elif tx in _SCALAR_TYPES:
            add((tx, x))
        else:
            return None
    return tuple(key)


def _memoized(check):
    cache: dict = {}

    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        key = _memo_key(args, kwargs)
        if key is None:
            return check(*args, **kwargs)
        hit = cache.get(key)
        if hit is not None:
            return hit
        call = check(*args, **kwargs)
        if len(cache) >= _MEMO_LIMIT:
            cache.clear()
        cache[key] = call
        return call

    wrapper.cache_clear = cache.clear
    return wrapper


# ---------------------------------------------------------------------------------------------
# the calls


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


def _state_tag(state_dtype: Optional[str]) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float64": "f64", None: "none"}[state_dtype]


def _span(t: torch.Tensor) -> int:
    """Elements from t's first to one past its last (numel for a contiguous tensor; more for a pool
    whose slots sit apart): what the kernels' element offsets into it reach."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _offset_bits(*tensors) -> int:
    # Element offsets into any state-shaped tensor (a strided pool: its whole span) must fit the
    # kernel's offset type.
    return 64 if any(t is not None and _span(t) > INT32_MAX for t in tensors) else 32


def _pool_step_tail(op, slot_mode, dims, q, k, v, g, beta, state, A_log, dt_bias, lower_bound, gate, out,
                    out_shape, out_layout, index_args, device, backend) -> float:
    """The checks kda_decode and kda_verify end with, in this order (the first failure is the one
    reported): the gate arguments, the supported set, alignment of q..beta, out, inference-only
    (index_args: the op's index tensors, read after dt_bias). dims = (H, K, HV, V); returns the
    lower bound resolved."""
    H, K, HV, V = dims
    lb = _gate_args(gate, A_log, dt_bias, lower_bound, HV, K, device, backend)
    _supported_dims(op, backend, K, V, H, HV, dtype_name(q.dtype), dtype_name(state.dtype), gate, slot_mode)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _aligned(name, x, backend)
    _out(out, out_shape, out_layout, v.dtype, device, backend)
    _inference_only((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                     ("dt_bias", dt_bias)) + index_args, (("state", state), ("out", out)))
    return lb


@_memoized
def check_kda_decode(q, k, v, g, beta, *, state, state_indices, A_log=None, dt_bias=None,
                     lower_bound=None, gate="softplus", scale=None, beta_is_logit=True,
                     slot_mode="unique", null_slot0=False, out=None, backend=None) -> DecodeCall:
    device, H, K, HV, V = _qkv_common(q, k, v, g, beta, lead=("rows",), lead_names="rows", gb_f32=True)
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
        return {"device": self.backend, "num_seqs": self.num_seqs, "value_heads": self.value_heads,
                "total_tokens": self.total_tokens, "max_seqlen": self.max_seqlen,
                "work_items": self.num_seqs * self.value_heads, "state": _state_tag(self.state_dtype or "float32"),
                "offset": f"o{self.offset_bits}", "gate": self.gate,
                "checkpoints": self.checkpoint_every > 0}


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

    if max_seqlen is not None:
        _int("max_seqlen", max_seqlen, "or None")
        if cu_seqlens is None and max_seqlen != T:
            # unpacked input: each of the B rows is one sequence of exactly T tokens
            raise ValueError(f"max_seqlen: expected T = {T} (every one of the B rows is a sequence of T tokens) "
                             f"or None, got {max_seqlen}")
        if max_seqlen < 0 or max_seqlen > T:
            raise ValueError(f"max_seqlen: expected an int in [0, T = {T}] or None, got {max_seqlen!r}")
    cu_dtype = None
    if cu_seqlens is not None:
        cu_seqlens = _tensor("cu_seqlens", cu_seqlens)
        _same_device("cu_seqlens", cu_seqlens, device)
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: expected dtype int32 or int64, got {dtype_name(cu_seqlens.dtype)}")
        _ndim("cu_seqlens", cu_seqlens, 1, "[N+1]")
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens: expected at least 2 offsets [N+1] with N >= 1, got {list(cu_seqlens.shape)}")
        _contiguous("cu_seqlens", cu_seqlens)
        if B != 1:
            raise ValueError(f"q: packed variable-length input (cu_seqlens given) needs batch B = 1, got B = {B}")
        if cu_seqlens.device.type == "cpu":
            # Only host-side offsets are inspected; device offsets are checked by the binding.
            cs = cu_seqlens.tolist()
            if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
                raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {T}, got {cs}")
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

    _int("checkpoint_every", checkpoint_every, ">= 0")
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every: expected an int >= 0, got {checkpoint_every!r}")
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


def _conv_weight(conv_weight, x, C: int, device):
    """A fused op's conv_weight [3*H*D, 4] (C = 3*H*D), contiguous, of x's dtype or float32."""
    conv_weight = _tensor("conv_weight", conv_weight)
    _same_device("conv_weight", conv_weight, device)
    _shape("conv_weight", conv_weight, (C, 4), "[3*H*D, 4]")
    _contiguous("conv_weight", conv_weight)
    if conv_weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"conv_weight: expected dtype {dtype_name(x.dtype)} (as x) or float32, "
                         f"got {dtype_name(conv_weight.dtype)}")
    return conv_weight


def _norm_args(norm_weight, norm_eps, D: int, device):
    """A fused op's gated-RMSNorm weight [D] (float32, contiguous) and norm_eps (a finite float > 0)."""
    norm_weight = _tensor("norm_weight", norm_weight)
    _same_device("norm_weight", norm_weight, device)
    _shape("norm_weight", norm_weight, (D,), "[D]")
    _dtype_in("norm_weight", norm_weight, ("float32",))
    _contiguous("norm_weight", norm_weight)
    _float("norm_eps", norm_eps, "> 0")
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
    for name, t in (("x", x), ("g", g)):
        _contiguous(name, t)
    _same_dtype("g", g, x, "x")
    beta = _companion("beta", beta, x, "x", (rows, H), "[rows, H]")
    conv_weight = _conv_weight(conv_weight, x, C, device)
    conv_state = _tensor("conv_state", conv_state)
    _same_device("conv_state", conv_state, device)
    _ndim("conv_state", conv_state, 3, "[slots, 3*H*D, 3]")
    if tuple(conv_state.shape[1:]) != (C, 3):
        raise ValueError(f"conv_state: expected shape [slots, 3*H*D, 3] = [slots, {C}, 3], got {list(conv_state.shape)}")
    _contiguous("conv_state", conv_state)
    _same_dtype("conv_state", conv_state, x, "x")
    slots = _pool("state", state, H, D, D, device, backend)
    if conv_state.shape[0] != slots:
        raise ValueError(f"conv_state: expected {slots} slots (as state), got {conv_state.shape[0]}")
    _indices("state_indices", state_indices, rows, device, "[rows]")
    output_gate = _companion("output_gate", output_gate, x, "x", (rows, H, D), "[rows, H, D]")
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


def _verify_index_table(state_indices, device):
    """A verify call's state_indices [N, T_max] (int32, one slot per request and token): the
    tensor, N and T_max."""
    state_indices = _tensor("state_indices", state_indices)
    _same_device("state_indices", state_indices, device)
    if state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices: expected dtype int32, got {dtype_name(state_indices.dtype)}")
    _ndim("state_indices", state_indices, 2, "[N, T_max] (one slot per request and token)")
    _contiguous("state_indices", state_indices)
    N, cols = state_indices.shape
    if N < 1 or cols < 1:
        raise ValueError(f"state_indices: expected [N, T_max] with N >= 1 and T_max >= 1, got "
                         f"{list(state_indices.shape)}")
    return state_indices, N, cols


def _verify_lengths(first, T, N, cols, cu_seqlens, num_accepted_tokens, max_seqlen, device,
                    one_token_is_decode=False) -> int:
    """cu_seqlens, num_accepted_tokens and max_seqlen of a verify call with N requests of
    0 .. T_max = cols tokens, T >= 1 in all (errors about T name the token input `first`); returns
    max_seqlen resolved (None: T_max). one_token_is_decode: T_max = 1 is served as kda_decode, one
    token per request, so it needs T = N."""
    _indices("cu_seqlens", cu_seqlens, N + 1, device, "[N+1] (N = state_indices.shape[0])")
    if not 1 <= T <= N * cols:
        # every request has 0 .. T_max tokens (an empty request: an engine's graph padding)
        raise ValueError(f"{first}: expected T between 1 and N * T_max = {N * cols} tokens (each request "
                         f"0 .. T_max = {cols} tokens), got T = {T}")
    if one_token_is_decode and cols == 1 and T != N:
        raise ValueError(f"{first}: with T_max = 1 (state_indices [N, 1]) the call is kda_decode, one token per "
                         f"request: expected T = N = {N}, got T = {T} (empty requests need T_max >= 2)")
    if num_accepted_tokens is not None:
        _indices("num_accepted_tokens", num_accepted_tokens, N, device, "[N] (one count per request)")
    if max_seqlen is None:
        return cols
    _int("max_seqlen", max_seqlen, "or None")
    if not 1 <= max_seqlen <= cols:
        raise ValueError(f"max_seqlen: expected an int in [1, T_max = {cols}] (the columns of "
                         f"state_indices) or None, got {max_seqlen}")
    return max_seqlen


def _verify_route_meta(call) -> dict:
    """The route metadata of a verify call (VerifyCall, FusedVerifyCall)."""
    return {"device": call.backend, "num_seqs": call.num_seqs, "value_heads": call.value_heads,
            "total_tokens": call.total_tokens, "max_seqlen": call.max_seqlen,
            "work_items": call.num_seqs * call.value_heads, "state": _state_tag(call.state_dtype),
            "offset": f"o{call.offset_bits}", "gate": call.gate}


@dataclass(frozen=True)
class VerifyCall(_GbDtypes):
    backend: str
    num_seqs: int
    total_tokens: int
    index_cols: int                 # T_max: columns of state_indices
    max_seqlen: int                 # host bound on T_n used for routing (<= index_cols)
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
    null_slot0: bool
    has_accepted: bool
    offset_bits: int
    g_dtype: str
    beta_dtype: str

    @property
    def as_decode(self) -> bool:
        """T_max = 1: every request is one token read from and written to column 0, which is
        kda_decode on state_indices[:, 0]; the op serves it with the decode module (bitwise
        kda_decode by construction)."""
        return self.index_cols == 1

    def route_meta(self) -> dict:
        return dict(_verify_route_meta(self), gb=self.gb)

    def decode_route_meta(self) -> dict:
        """kda_decode's route metadata for the as_decode case (negatives allowed: 'padded')."""
        return {"device": self.backend, "rows": self.num_seqs, "value_heads": self.value_heads,
                "work_items": self.num_seqs * self.value_heads, "state": _state_tag(self.state_dtype),
                "offset": f"o{self.offset_bits}", "slot_mode": "padded", "gate": self.gate, "gb": self.gb}


@_memoized
def check_kda_verify(q, k, v, g, beta, *, state, state_indices, cu_seqlens, num_accepted_tokens=None,
                     max_seqlen=None, A_log=None, dt_bias=None, lower_bound=None, gate="softplus",
                     scale=None, beta_is_logit=True, null_slot0=False, out=None, backend=None) -> VerifyCall:
    """Everything about a verify call that its metadata shows; the values of host index tensors
    are checked by check_verify_values on every call."""
    device, H, K, HV, V = _qkv_common(q, k, v, g, beta, lead=("1", "T"), lead_names="1, T", gb_f32=True)
    backend = _check_backend(backend, device)
    if q.shape[0] != 1:
        raise ValueError(f"q: expected the packed layout [1, T, H, K] (requests packed by cu_seqlens), "
                         f"got batch {q.shape[0]} in {list(q.shape)}")
    T = q.shape[1]
    _bool("beta_is_logit", beta_is_logit)
    _bool("null_slot0", null_slot0)
    slots = _pool("state", state, HV, V, K, device, backend)
    state_indices, N, cols = _verify_index_table(state_indices, device)
    max_seqlen = _verify_lengths("q", T, N, cols, cu_seqlens, num_accepted_tokens, max_seqlen, device,
                                 one_token_is_decode=True)
    lb = _pool_step_tail("kda_verify", "padded", (H, K, HV, V), q, k, v, g, beta, state, A_log, dt_bias,
                         lower_bound, gate, out, (1, T, HV, V), "[1, T, HV, V]",
                         (("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                          ("num_accepted_tokens", num_accepted_tokens)), device, backend)
    return VerifyCall(backend, N, T, cols, max_seqlen, H, HV, K, V, slots, dtype_name(q.dtype),
                      dtype_name(state.dtype), gate, GATE_MODE[gate], lb, _resolve_scale(scale, K),
                      beta_is_logit, null_slot0, num_accepted_tokens is not None, _offset_bits(state),
                      dtype_name(g.dtype), dtype_name(beta.dtype))


def check_verify_values(call: VerifyCall, cu_seqlens, state_indices, num_accepted_tokens,
                        max_seqlen=None) -> None:
    """The values of the index tensors, where they live in host memory (the CPU backend); on a GPU
    they are never read here (no synchronisation), and the kernels treat what they cannot serve as
    padding (docs/semantics.md, "Verify"). Runs on every call: values are not metadata."""
    if call.backend != "cpu" or cu_seqlens.device.type != "cpu":
        return
    cs = cu_seqlens.tolist()
    T, cols = call.total_tokens, call.index_cols
    if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {T} (a request has "
                         f">= 0 tokens), got {cs}")
    lengths = [b - a for a, b in zip(cs, cs[1:])]
    longest = max(lengths)
    if longest > call.max_seqlen:
        what = "max_seqlen" if max_seqlen is not None else "state_indices"
        raise ValueError(f"{what}: a request has {longest} tokens, more than T_max = {call.max_seqlen} "
                         f"(cu_seqlens {cs})")
    idx = state_indices.tolist()
    accepted = [1] * call.num_seqs if num_accepted_tokens is None else num_accepted_tokens.tolist()
    for n, a in enumerate(accepted):
        if not 1 <= a <= cols:
            raise ValueError(f"num_accepted_tokens: expected values in [1, T_max = {cols}], got "
                             f"num_accepted_tokens[{n}] = {a}")
    for n, row in enumerate(idx):
        for t, s in enumerate(row):
            if s >= call.slots:
                raise ValueError(f"state_indices: entry [{n}, {t}] = {s} is out of range for a pool of "
                                 f"{call.slots} slots (expected < {call.slots}; negative = padding)")
    pad = (lambda s: s < 0 or (call.null_slot0 and s == 0))
    writer = {}  # slot -> request that writes it
    for n, row in enumerate(idx):
        if pad(row[accepted[n] - 1]):
            continue  # a padding request touches nothing
        for t in range(lengths[n]):
            s = row[t]
            if pad(s):
                continue
            if s in writer:
                raise ValueError(f"state_indices: slot {s} is written twice (request {writer[s]} and request "
                                 f"{n}, token {t}); every written slot must be distinct")
            writer[s] = n
    for n, row in enumerate(idx):
        s = row[accepted[n] - 1]
        if lengths[n] and not pad(s) and writer.get(s, n) != n:  # an empty request reads nothing
            raise ValueError(f"state_indices: request {n} starts from slot {s}, which request {writer[s]} "
                             f"writes; a request may read only a slot no other request writes")


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
