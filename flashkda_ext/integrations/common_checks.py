"""Checks the engine adapters share. Here: engine slot indices (int32 or int64) narrowed to the int32 the
kernels read, with a range check instead of a wrap (2**32 + 1 must not become slot 1)."""
from __future__ import annotations

import torch

from ..validation import INT32_MAX

_INDEX_DTYPES = (torch.int32, torch.int64)


def sglang_int32_indices(name: str, x, shape) -> torch.Tensor:
    """x (int32 or int64) reshaped to `shape`, as contiguous int32, without ever wrapping a value.

    Where the values live in host memory they are checked: an int64 value outside the int32 range raises a
    ValueError naming `name` and the entry. On a device they are not read (that would cost a device-to-host
    copy): the conversion saturates instead, in the same kernel that narrows, so meanings survive: a value
    above the int32 range becomes INT32_MAX (>= any slot count: out of range, which the CUDA kernels serve
    as padding and the CPU backend refuses), one below it becomes -1 (padding, as every negative index is).
    """
    if not torch.is_tensor(x) or x.dtype not in _INDEX_DTYPES:
        got = x.dtype if torch.is_tensor(x) else type(x).__name__
        raise ValueError(f"{name}: expected an int32 or int64 tensor, got {got}")
    x = x.reshape(shape)
    if x.dtype == torch.int32:
        return x.contiguous()
    if x.device.type == "cpu":
        bad = ((x > INT32_MAX) | (x < -INT32_MAX - 1)).flatten().nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"{name}: entry {i} = {int(x.flatten()[i])} is outside the int32 range of the kernels' "
                             f"indices (narrowing it would wrap to another slot)")
        return x.to(torch.int32, memory_format=torch.contiguous_format)
    return x.clamp(-1, INT32_MAX).to(torch.int32, memory_format=torch.contiguous_format)
