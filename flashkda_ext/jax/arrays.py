"""jax arrays -> what the shared validation and the routes read: shape-only torch meta tensors, the
platform a call runs on, host offsets and host index tensors (values the torch op inspects too)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _as_array(name: str, x, *, optional: bool = False):
    """None (when optional), a jax.Array or tracer as is, a numpy array as a jax array."""
    if x is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a jax.Array, got None")
    if isinstance(x, jax.Array):
        if not _is_tracer(x) and x.is_deleted():
            # XLA's own error names no argument ("Buffer has been deleted or donated"), and the CPU slot
            # check would read it first: named here, before anything runs
            raise ValueError(f"{name}: a deleted array (donated to an earlier call: an eager call with "
                             f"donate=True consumes its pools; pass the new state that call returned)")
        return x
    if isinstance(x, np.ndarray):
        try:
            arr = jnp.asarray(x)
        except TypeError:  # object, str, datetime, void, longdouble: JAX's message names no argument
            raise ValueError(f"{name}: a numpy array of dtype {x.dtype}, which JAX cannot hold; expected a numeric "
                             f"array") from None
        if arr.dtype != x.dtype:  # x64 off: jnp.asarray would narrow int64 / float64 without a range check
            raise ValueError(f"{name}: got a numpy {x.dtype} array, which JAX (jax_enable_x64 off) would narrow "
                             f"to {arr.dtype} unchecked; convert it yourself (.astype(np.{arr.dtype.name}))")
        return arr
    raise TypeError(f"{name}: expected a jax.Array (or numpy array), got {type(x).__name__}")


_TORCH_DTYPES = {np.dtype(name): getattr(torch, name) for name in
                 ("float32", "bfloat16", "float16", "float64", "int32", "int64", "uint8")
                 if name != "bfloat16"}
_TORCH_DTYPES[np.dtype(jnp.bfloat16)] = torch.bfloat16


def _torch_dtype(name: str, dtype) -> torch.dtype:
    tdtype = _TORCH_DTYPES.get(dtype)
    if tdtype is None:
        dname = jnp.dtype(dtype).name
        tdtype = getattr(torch, dname, None)
        if not isinstance(tdtype, torch.dtype):
            raise ValueError(f"{name}: dtype {dname} has no counterpart among the supported dtypes")
    return tdtype


def _meta(name: str, x):
    """A torch meta tensor with x's shape and dtype (no memory), or None."""
    if x is None:
        return None
    return torch.empty(tuple(x.shape), dtype=_torch_dtype(name, x.dtype), device="meta")


_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def _platform(platform: Optional[str], named_arrays) -> str:
    """'cpu' or 'cuda': given, else the device of the first concrete array, else JAX's default
    device (jax.default_device / jax_default_device), else its default backend (inside jax.jit
    the arrays are tracers and carry no device)."""
    if platform is not None:
        if platform not in ("cpu", "cuda", "gpu"):
            raise ValueError(f"platform: expected 'cpu', 'cuda' or None, got {platform!r}")
        return _PLATFORMS[platform]
    for name, x in named_arrays:
        if x is not None and not _is_tracer(x):
            plat = next(iter(x.devices())).platform
            if plat not in _PLATFORMS:
                raise ValueError(f"{name}: expected an array on a CPU or CUDA device, got platform {plat}")
            return _PLATFORMS[plat]
    default = jax.config.jax_default_device       # jax.default_device(...) or the config option
    if default is not None:
        plat = default if isinstance(default, str) else default.platform
    else:
        plat = jax.default_backend()
    if plat not in _PLATFORMS:
        raise ValueError(f"platform: JAX's default backend {plat!r} is neither CPU nor CUDA; pass platform=")
    return _PLATFORMS[plat]


def _check_platform(plat: str, named_arrays) -> None:
    """The first concrete array on `plat` (the platform the call runs on, given or inferred from that array): with
    platform= naming the other one, the other platform's module would be built and the call fail in XLA's Execute
    ("No FFI handler registered ... on a platform Host"), naming no argument. One array, not each: JAX runs the
    call where its arguments are and refuses committed arrays on different devices itself, naming them; a check
    of every array would cost ~0.4 us an array on every call (x.devices() builds a set). Tracers carry no
    device."""
    for name, x in named_arrays:
        if x is None or _is_tracer(x):
            continue
        got = next(iter(x.devices())).platform
        if _PLATFORMS.get(got, got) != plat:
            raise ValueError(f"{name}: an array on {_PLATFORMS.get(got, got)}, but the call runs on {plat} "
                             f"(platform=); expected the arrays on {plat}")
        return


def _host_offsets(cu_seqlens):
    """The offsets as a list when cu_seqlens is a concrete 1-D integer array on the CPU (values the
    torch op inspects too), else None: device offsets are never copied to the host."""
    if cu_seqlens is None or _is_tracer(cu_seqlens) or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        return None
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        return None
    if next(iter(cu_seqlens.devices())).platform != "cpu":
        return None
    return [int(c) for c in np.asarray(cu_seqlens)]


def _offsets_valid(cs, T) -> bool:
    return cs[0] == 0 and cs[-1] == T and all(b >= a for a, b in zip(cs, cs[1:]))


def _check_host_offsets(cs, T: int, max_seqlen) -> None:
    """The value checks the torch op makes on host offsets (same messages)."""
    if not _offsets_valid(cs, T):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {T}, got {cs}")
    longest = max(b - a for a, b in zip(cs, cs[1:]))
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen: expected >= the longest sequence in cu_seqlens ({longest}), "
                         f"got {max_seqlen}")

def _any_tracer(arrays) -> bool:
    tracer = jax.core.Tracer
    return any(isinstance(x, tracer) for x in arrays)


def _dtype_str(x) -> str:
    return x.dtype.name


def _check_host_slots(x, slots: int, null_slot0: bool, unique: bool) -> None:
    """The CPU kernels' checks of a state_indices array concrete on the CPU (same wording), made before the
    call: refused by the kernel, an eager call would already have donated (deleted) the caller's pools.
    unique: prefill's rule that a live slot serves one sequence only. Device or traced values are not read."""
    host = _host_int32(x)
    if host is None:
        return
    idx = host.numpy().reshape(-1)
    if idx.size and idx.max() >= slots:
        n = int(np.argmax(idx >= slots))
        raise ValueError(f"state_indices: index state_indices[{n}] = {int(idx[n])} is out of range for a pool of "
                         f"{slots} slots (expected < {slots}; negative = padding)")
    if unique:
        live = idx[(idx > 0) | ((idx == 0) & (not null_slot0))]
        values, counts = np.unique(live, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"state_indices: slot {int(values[np.argmax(counts > 1)])} serves more than one "
                             f"sequence; expected each live slot once in prefill")


def _host_int32(x):
    """A torch CPU tensor of a concrete CPU array (values the torch op inspects too), else None."""
    if x is None or _is_tracer(x) or next(iter(x.devices())).platform != "cpu":
        return None
    return torch.from_numpy(np.array(x))

