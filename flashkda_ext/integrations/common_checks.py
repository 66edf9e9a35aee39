"""Checks the engine adapters share (fla, vLLM, SGLang): narrowing an engine's integer tensors to the
int32 the kernels read, never by wrapping; a lower_bound that is a number (not a bool) or None; the dtype a
gate / beta goes to kda_decode / kda_verify in.

Engines hand over slot indices, offsets and counts as int64; `x.to(torch.int32)` would turn 2**32 + 1
into slot 1 and write it. Where the values sit in host memory (the CPU backend, an engine's host copy)
reading them costs no device synchronisation, so they are checked and a bad one is a ValueError naming
the caller's argument. On a device they are never read (no device-to-host copy on the serving path):
a value out of range becomes `pad`, a value the kernels already treat as padding (docs/semantics.md:
on a GPU a slot index past the pool, or a count outside [1, T_max], touches nothing), in the same pass
as the narrowing. Where no such value exists (offsets), `pad=None` and the caller must not narrow
device values: `unchecked_on_device` says when, so an adapter can fall back with that reason.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def decode_gate_dtype(x: torch.dtype, q: torch.dtype) -> torch.dtype:
    """The dtype a gate / beta of dtype x, beside q of dtype q, goes to kda_decode / kda_verify in: x where they read
    it as it is (q's dtype or fp32, validation's gb_f32 rule), another float widened to fp32 (exact for fp16, which
    the engines' kernels read unrounded; rounding it to a bf16 q's dtype would drop 3 mantissa bits)."""
    return x if x in (q, torch.float32) else torch.float32


def number_or_none(x) -> bool:
    """True for None or an int / float that is no bool (a bool is an int to isinstance: True would read as
    1.0): how an engine may pass lower_bound."""
    return x is None or (not isinstance(x, bool) and isinstance(x, (int, float)))


def host_values(x: Optional[torch.Tensor]) -> bool:
    """True when x's values can be read without a device synchronisation (None, or in host memory)."""
    return x is None or x.device.type == "cpu"


def unchecked_on_device(x: Optional[torch.Tensor]) -> bool:
    """True when narrowing x to int32 needs a range check that only a device-to-host copy could do."""
    return x is not None and not host_values(x) and _narrows(x.dtype)


def _narrows(dtype: torch.dtype) -> bool:
    return dtype not in (torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool) and not (
        dtype.is_floating_point or dtype.is_complex)


#: unsigned dtypes past uint8 (torch's barebones uint16 / 32 / 64)
_WRAPPING_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def narrow_int32(name: str, x: Optional[torch.Tensor], low: int = INT32_MIN, high: int = INT32_MAX,
                 pad: Optional[int] = None, what: str = "") -> Optional[torch.Tensor]:
    """x as int32 with every value in [low, high], for the argument the caller called `name`.

    None, int32 and non-integer tensors (bool included) come back as they are (the op's own checks name a
    wrong dtype).
    Host values out of [low, high]: ValueError naming `name`, the first bad entry and `what` (why the
    range). Device values: out of range becomes `pad` (device ops only); with pad=None a device tensor
    that needs narrowing raises ValueError (the adapter should have refused it: unchecked_on_device).
    Values of a narrower integer dtype are widened (no wrap), and checked like the others."""
    if x is None or x.dtype in (torch.int32, torch.bool) or x.dtype.is_floating_point or x.dtype.is_complex:
        return x    # bool: a mask, never made slots 0 / 1 here (the op names its dtype)
    if x.dtype in _WRAPPING_UNSIGNED:
        # the int64 compare below would wrap them (uint64 2**64 - 1 -> -1, padding) before any check
        raise ValueError(f"{name}: expected a signed integer (int32 or int64) tensor, got the unsigned {x.dtype}")
    low, high = max(low, INT32_MIN), min(high, INT32_MAX)
    if host_values(x):
        flat = x.reshape(-1).to(torch.int64)   # compared in int64: a narrow dtype would overflow the bounds
        bad = ((flat < low) | (flat > high)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            pos = list(torch.unravel_index(torch.tensor(i), x.shape)) if x.dim() > 1 else [i]
            where = ", ".join(str(int(p)) for p in pos)
            bounds = f"in [{low}, {high}]" if low > INT32_MIN else f"<= {high}"
            raise ValueError(f"{name}: entry [{where}] = {int(flat[i])} is out of range: expected values "
                             f"{bounds}{what} (the kernels read int32; nothing was written)")
        return x.to(torch.int32)
    if not _narrows(x.dtype):
        return x.to(torch.int32)
    if pad is None:
        raise ValueError(f"{name}: {x.dtype} values on {x.device} cannot be range-checked before the int32 "
                         f"narrowing without a device-to-host copy; pass int32 or host values")
    return torch.where((x >= low) & (x <= high), x, pad).to(torch.int32)


def int32_indices(name: str, x, shape) -> torch.Tensor:
    """Slot indices (an int32 or int64 tensor) reshaped to `shape` as contiguous int32, through
    narrow_int32: host values out of the int32 range raise naming `name`; device values out of it become
    -1 (padding: touches nothing)."""
    if not torch.is_tensor(x) or x.dtype not in (torch.int32, torch.int64):
        got = x.dtype if torch.is_tensor(x) else type(x).__name__
        raise ValueError(f"{name}: expected an int32 or int64 tensor, got {got}")
    if x.numel() != math.prod(shape):   # a reshape error would not name the argument
        raise ValueError(f"{name}: expected {math.prod(shape)} entries (shape {list(shape)}), got shape "
                         f"{list(x.shape)}")
    return narrow_int32(name, x.reshape(shape), pad=-1).contiguous()
