"""The rules every op's check is built from: kinds, shapes, dtypes, devices, layouts and ranges of
single arguments, the gate and its parameters, the supported set, the q/k/v/g/beta group, out, state
pools and index tensors, inference-only and no-overlap; plus the call metadata several ops share
(state tag, offset width). Each rule raises TypeError or ValueError naming the argument."""
from __future__ import annotations

import functools
import math
from itertools import chain
from typing import Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake as _is_fake

from .. import supported as _supported

GATES = ("softplus", "bounded", "log")
GATE_MODE = {"softplus": 0, "bounded": 1, "log": 2}
SLOT_MODES = ("unique", "padded", "repeated")
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

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


def _rows_apart(x: torch.Tensor, row_dim: int) -> bool:
    """x's dims after row_dim row-major dense (a dim of size <= 1 may carry any stride, as for
    is_contiguous) and its rows (dim row_dim) any stride >= one row's elements apart."""
    shape, stride = x.shape, x.stride()
    want = 1
    for i in range(len(shape) - 1, row_dim, -1):     # indexing, not slices of torch.Size: the adapters' hot path
        n = shape[i]
        if n > 1 and stride[i] != want:
            return False
        want *= n
    return shape[row_dim] <= 1 or stride[row_dim] >= want


def _row_strided(name: str, x: torch.Tensor, row_dim: int, layout: str) -> None:
    """x [1.., rows, *inner] as kda_decode / kda_verify read it: each row's inner block dense, the rows any
    stride >= one row's elements apart (views of an engine's packed projection). The dims before row_dim
    must have size 1, else x must be contiguous (the op's own shape check then names the dim). The CUDA
    rule on the row stride is _row_aligned's; csrc/common/row_stride.h is this rule in the bindings."""
    if any(n != 1 for n in x.shape[:row_dim]):
        _contiguous(name, x)
    elif not _rows_apart(x, row_dim):
        raise ValueError(f"{name}: expected {layout} with its inner dims contiguous (row-major; the rows may sit "
                         f"any stride >= {math.prod(x.shape[row_dim + 1:])} elements apart), got shape "
                         f"{list(x.shape)} with strides {list(x.stride())}; call .contiguous() first")


def _row_misaligned(x: torch.Tensor, row_dim: int) -> bool:
    # CUDA reads each row of q, k, v, g by 16-byte vectors: every row must start 16-byte aligned
    return x.shape[row_dim] > 1 and x.stride(row_dim) * x.element_size() % 16 != 0


def _row_aligned(name: str, x: torch.Tensor, row_dim: int, backend: str) -> None:
    if backend == "cuda" and _row_misaligned(x, row_dim):
        raise ValueError(f"{name}: expected a row stride that is a multiple of 16 bytes "
                         f"({16 // x.element_size()} elements of {dtype_name(x.dtype)}) on CUDA, got "
                         f"{x.stride(row_dim)} elements (strides {list(x.stride())}); call .contiguous() first")


def rows_as_read(x: torch.Tensor, row_dim: int, *, vector: bool = True) -> bool:
    """True when kda_decode (row_dim 0) / kda_verify (row_dim 1) take x as it is (_row_strided and, off
    the CPU, _row_aligned and _aligned; meta tensors stand in for a device, without an address). vector:
    q, k, v, g (beta is read element by element: no rule on its row stride). For the adapters, which pass
    an engine's views through where the ops take them and copy where not."""
    shape = x.shape
    for i in range(row_dim):
        if shape[i] != 1:
            return x.is_contiguous()
    if not _rows_apart(x, row_dim):
        return False
    if x.is_cpu:
        return True
    if vector and _row_misaligned(x, row_dim):
        return False
    return x.is_meta or x.numel() == 0 or x.data_ptr() % 16 == 0


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


def _companion(name: str, x, ref: torch.Tensor, ref_name: str, shape: tuple, what: str,
               row_dim: Optional[int] = None) -> torch.Tensor:
    """A tensor that must sit beside `ref`: same device and dtype, the given shape, contiguous (or, with row_dim,
    row-strided: _row_strided)."""
    x = _tensor(name, x)
    _same_device(name, x, ref.device)
    _shape(name, x, shape, what)
    if row_dim is None:
        _contiguous(name, x)
    else:
        _row_strided(name, x, row_dim, what)
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
    # A Python int float() would refuse (OverflowError: it rounds past the largest double): named here. Compared,
    # not caught: under torch.compile Dynamo folds float() and raises its own internal error.
    if isinstance(value, int) and abs(value) >= _FLOAT_OVERFLOW:
        raise ValueError(f"{name}: expected a finite float {what}, got an int of {value.bit_length()} bits "
                         f"(too large for a float)")
    return float(value)


_FLOAT_OVERFLOW = 2 ** 1024 - 2 ** 970  # the least int that float() rounds to 2**1024 (overflows)

#: each real argument's rule, as its messages state it (eager checks and the traced wrappers alike)
_REAL_RULES = {"scale": "or None", "lower_bound": "< 0", "norm_eps": "> 0"}


def _real(name: str, value) -> float:
    """scale, lower_bound or norm_eps as a float (_float with the argument's own rule)."""
    return _float(name, value, _REAL_RULES[name])


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
    scale = _real("scale", scale)
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
    return _gate_bound(gate, lower_bound)


def _gate_bound(gate: str, lower_bound) -> float:
    """lower_bound checked against its (already checked) gate; returned as a float, 0.0 when unused."""
    if gate == "bounded":
        if lower_bound is None:
            raise ValueError("lower_bound: required by gate='bounded' (a float < 0), got None")
        lower_bound = _real("lower_bound", lower_bound)
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


_INNER = {"q": "H, K", "k": "H, K", "v": "HV, V", "g": "HV, K", "beta": "HV"}


def _qkv_common(q, k, v, g, beta, *, lead: tuple, lead_names: str, gb_f32: bool = False,
                row_dim: Optional[int] = None):
    """Shapes of q, k [*lead, H, K], v [*lead, HV, V], g [*lead, HV, K], beta [*lead, HV]; all of q's
    dtype, except that with gb_f32 g and beta may each be float32 instead (kda_decode and kda_verify
    read them so). Contiguous, or with row_dim (kda_decode 0, kda_verify 1) row-strided (_row_strided)."""
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
        if row_dim is None:
            _contiguous(name, x)
        else:
            _row_strided(name, x, row_dim, f"[{lead_names}, {_INNER[name]}]")
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


def _int32_tensor(name: str, idx, device) -> torch.Tensor:
    """An index argument: a tensor on device, of dtype int32 (its shape: the caller's)."""
    idx = _tensor(name, idx)
    _same_device(name, idx, device)
    if idx.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype int32, got {dtype_name(idx.dtype)}")
    return idx


def _indices(name: str, idx, length: int, device, what: str) -> None:
    idx = _int32_tensor(name, idx, device)
    _shape(name, idx, (length,), what)
    _contiguous(name, idx)


def check_offsets_span(name: str, offsets: list, T: int, detail: str = "", at_most: bool = False) -> None:
    """Host offsets (a non-empty list) that rise from 0 to T (at_most: to T or below it, the rows past the last
    offset owned by no sequence) and never fall, else a ValueError naming the argument the caller knows them by
    (cu_seqlens, SGLang's query_start_loc, fla's cu_seqlens_cpu); `detail` follows T."""
    end_ok = offsets[-1] <= T if at_most else offsets[-1] == T
    if offsets[0] != 0 or not end_ok or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets from 0 {'up to at most' if at_most else 'to'} "
                         f"T = {T}{detail}, got {offsets}")


def inference_conflict(read: tuple, written: tuple) -> Optional[Tuple[str, str]]:
    """The ops' inference-only rule, as data: (name, "inference") for an inference tensor among `written` outside
    inference mode (torch refuses that in-place update), (name, "grad") for a tensor requiring grad while grad mode
    records, else None. (name, tensor) pairs; what is no tensor is skipped. The ops raise on it
    (_inference_only); the integrations fall back with reasons of their own words."""
    if torch.is_inference_mode_enabled():
        return None
    for name, x in written:
        if isinstance(x, torch.Tensor) and x.is_inference():
            return name, "inference"
    if torch.is_grad_enabled():
        for name, x in chain(read, written):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                return name, "grad"
    return None


def _inference_only(read: tuple, written: tuple) -> None:
    """The ops are inference-only: with grad enabled, no argument may require grad (the result would
    have no grad_fn and a leaf would be changed in place); outside inference mode, nothing written
    may be an inference tensor (torch itself refuses that in-place update). (name, tensor) pairs;
    None tensors are skipped."""
    conflict = inference_conflict(read, written)
    if conflict is None:
        return
    name, kind = conflict
    if kind == "inference":
        raise ValueError(f"{name}: an inference tensor (made under torch.inference_mode()) cannot be "
                         f"written in place outside inference mode; call under torch.inference_mode() "
                         f"or pass a clone made outside it")
    raise ValueError(f"{name}: requires grad, but the ops are inference-only (no autograd); "
                     f"pass x.detach() or call under torch.no_grad() / torch.inference_mode()")


def _address(x: torch.Tensor) -> tuple:
    """(address space, first byte) of x: its device and data pointer; for a fake tensor (tracing: no data
    pointer) its storage and the byte its view starts at, so that views of one storage are compared as eager
    compares them and tensors of different storages never meet."""
    if type(x) is not torch.Tensor and _is_fake(x):
        return (x.device, x.untyped_storage()._cdata), x.storage_offset() * x.element_size()
    return x.device, x.data_ptr()


def _extent(x: torch.Tensor) -> tuple:
    """(address space, first byte, one past the last byte) that x can touch; empty for numel 0."""
    space, lo = _address(x)
    if x.numel() == 0:
        return space, 0, 0
    return space, lo, lo + _span_bytes(x)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (_address(a) == _address(b) and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


def _slots_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b, whose extents overlap, are two pools of one paged cache that never share a byte: the same
    slot stride in bytes (dim 0), and no slot of one meeting a slot of the other, each slot taken as the bytes from
    its first element to its last (vLLM keeps a layer's conv cache and state pool in one page a slot). Exact for
    those slot ranges: slot i of a and slot j of b meet when d - fa < (i - j) P < d + fb (d: b's start less a's,
    fa / fb: a slot's bytes, P: the stride). csrc/common/binding.h, slots_apart, is the same rule."""
    if a.dim() < 2 or b.dim() < 2 or a.device != b.device:
        return False
    P = a.stride(0) * a.element_size()
    if P <= 0 or P != b.stride(0) * b.element_size():
        return False
    fa = (1 + sum((n - 1) * st for n, st in zip(a.shape[1:], a.stride()[1:]))) * a.element_size()
    fb = (1 + sum((n - 1) * st for n, st in zip(b.shape[1:], b.stride()[1:]))) * b.element_size()
    d = _address(b)[1] - _address(a)[1]
    k_lo = max((d - fa) // P + 1, -(b.shape[0] - 1))
    k_hi = min(-((-(d + fb)) // P) - 1, a.shape[0] - 1)
    return k_lo > k_hi


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
            if _slots_apart(x_i, x_j):
                continue
            raise ValueError(f"{name_i}: overlaps the memory of {name_j}; the op writes {name_i}, so it must not "
                             f"share storage with any other argument (pass a separate tensor)")


def _check_backend(backend: Optional[str], device: torch.device) -> str:
    if backend is None:
        return backend_of(device)
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend: expected 'cpu', 'cuda' or None, got {backend!r}")
    return backend


def _state_tag(state_dtype: Optional[str]) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float64": "f64", None: "none"}[state_dtype]


def _span(t: torch.Tensor) -> int:
    """Elements from t's first to one past its last (numel for a contiguous tensor; more for a pool
    whose slots sit apart): what the kernels' element offsets into it reach."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _span_bytes(t: Optional[torch.Tensor]) -> int:
    """Bytes from t's first element to one past its last (0 for None or an empty tensor)."""
    return 0 if t is None else _span(t) * t.element_size()


def _offset_bits(*tensors) -> int:
    # Element offsets into any state-shaped tensor (a strided pool: its whole span) must fit the
    # kernel's offset type.
    return 64 if any(t is not None and _span(t) > INT32_MAX for t in tensors) else 32
