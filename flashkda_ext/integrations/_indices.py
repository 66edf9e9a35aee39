"""Integer metadata vLLM hands its adapters, narrowed to the int32 the ops take without ever wrapping
(through common_checks.narrow_int32, the narrowing every adapter shares).

An int64 value outside int32 would wrap to another slot (2**32 + 1 -> 1) and write it. Host tensors
(the CPU backend) are range-checked and refused with an error naming the argument; device tensors are
never read back (no sync, CUDA-graph safe): an out-of-range entry becomes the value the kernels already
treat as "touch nothing" (a slot index: -1, padding; an accepted-token count: 0, outside [1, T_max],
which makes the request padding). Offsets have no such value, so int64 offsets on a device are refused
(the caller falls back to the engine's own kernel).
"""
from __future__ import annotations

import torch

from .common_checks import narrow_int32, unchecked_on_device


class NotNarrowable(Exception):
    """The tensor cannot be narrowed to int32 without reading it on the host (an adapter falls back)."""


def _int32(name: str, x: torch.Tensor, invalid: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32 or int64 tensor, got {x.dtype}")
    return narrow_int32(name, x, pad=invalid)


def slot_indices(name: str, x: torch.Tensor) -> torch.Tensor:
    """Slot indices as int32; on a device an entry outside int32 becomes -1 (padding: touches nothing)."""
    return _int32(name, x, -1)


def accepted_counts(name: str, x: torch.Tensor) -> torch.Tensor:
    """num_accepted_tokens as int32; on a device an entry outside int32 becomes 0 (the request is padding)."""
    return _int32(name, x, 0)


def offsets(name: str, x: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as int32: int64 is range-checked on the host; on a device it raises NotNarrowable."""
    if isinstance(x, torch.Tensor) and unchecked_on_device(x):
        raise NotNarrowable(f"{name}: int64 offsets on {x.device} cannot be narrowed to int32 without a host read")
    return _int32(name, x, 0)


def one_token_rows(cu_seqlens: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """A decode batch's slot per row (int32 [N]) that is padding wherever request r is not exactly token r
    (cu_seqlens[r] == r and cu_seqlens[r+1] == r+1): an empty request, or a row whose token belongs to a
    longer request, is then never served as a row. Read on the device, no host sync."""
    N = cu_seqlens.shape[0] - 1
    r = torch.arange(N + 1, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    at = cu_seqlens == r
    return torch.where(at[:-1] & at[1:], indices[:N], -1).to(torch.int32)
