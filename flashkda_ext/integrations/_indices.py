"""Integer metadata vLLM hands its adapters, narrowed to the int32 the ops take without ever wrapping
(through common_checks.narrow_int32, the narrowing every adapter shares).

The rule (docs/integrations.md, "vLLM", "Integer metadata"): what the adapter cannot map falls back, counted
(NotNarrowable): an argument that is no int32 / int64 tensor (vLLM's kernels take what they take; its wrapper
reports the rest), an offsets tensor that is not 1-D, int64 offsets on a device (no value there is "touch
nothing", and checking them needs a host read). Values that no kernel can run raise ValueError naming the
argument, before anything is written: where they are in host memory (the CPU backend) a slot index past the
pool or outside int32 (2**32 + 1 would wrap to slot 1), an accepted-token count outside [1, T_max], offsets
that do not rise from 0 within the T tokens or a request longer than T_max: vLLM's kernels do not check them
and would read or write out of bounds, so a fallback would turn a named error into a memory fault. Device
tensors are never read back (no sync, CUDA-graph safe): an out-of-range entry becomes the value the kernels
already treat as "touch nothing" (a slot index: -1, padding; a count: 0, which makes the request padding).
"""
from __future__ import annotations

from typing import Optional

import torch

from .common_checks import INT32_MAX, INT32_MIN, host_values, narrow_int32, unchecked_on_device


class NotNarrowable(Exception):
    """Integer metadata the adapter does not map to the kernels' int32 (no int32 / int64 tensor, offsets that
    are not 1-D, int64 offsets on a device): the adapter falls back, the message counted as the reason."""


def int_tensor(name: str, x) -> torch.Tensor:
    """x when it is an int32 or int64 tensor, else NotNarrowable naming it."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise NotNarrowable(f"{name}: expected an int32 or int64 tensor, got {got}")
    return x


def _int32(name: str, x, invalid: int, low: int = INT32_MIN, high: int = INT32_MAX, what: str = "") -> torch.Tensor:
    x = int_tensor(name, x)
    if x.dtype == torch.int32 and host_values(x) and (low > INT32_MIN or high < INT32_MAX):
        # narrow_int32 takes an int32 tensor as it is: its host values are checked here, read in Python (no
        # torch op: the CPU backend's call stays as lean as a GPU's)
        values = x.tolist() if x.dim() == 1 else x.reshape(-1).tolist()
        for i, value in enumerate(values):
            if not low <= value <= high:
                where = i if x.dim() == 1 else ", ".join(str(int(p)) for p in torch.unravel_index(
                    torch.tensor(i), x.shape))
                bounds = f"in [{low}, {high}]" if low > INT32_MIN else f"<= {high}"
                raise ValueError(f"{name}: entry [{where}] = {value} is out of range: expected values {bounds}{what} "
                                 f"(nothing was written)")
        return x
    return narrow_int32(name, x, low, high, pad=invalid, what=what)


def slot_indices(name: str, x, slots: Optional[int] = None) -> torch.Tensor:
    """Slot indices as int32, each < slots (a pool of `slots`; <= 0 is vLLM's padding); on a device an entry
    out of range becomes -1 (padding: touches nothing)."""
    high = INT32_MAX if slots is None else slots - 1
    return _int32(name, x, -1, high=high, what="" if slots is None else f" (a pool of {slots} slots; <= 0: padding)")


def accepted_counts(name: str, x, t_max: Optional[int] = None) -> torch.Tensor:
    """num_accepted_tokens as int32 in [1, t_max] (a count names a column of the [N, t_max] slot table); on a
    device an entry out of range becomes 0 (the request is padding)."""
    if t_max is None:
        return _int32(name, x, 0)
    return _int32(name, x, 0, 1, t_max, f" (a column of the {t_max}-column ssm_state_indices)")


def offsets(name: str, x, T: Optional[int] = None, longest: Optional[int] = None) -> torch.Tensor:
    """cu_seqlens as int32: host offsets must rise from 0 and stay within the T tokens, each request at most
    `longest` tokens (ValueError); int64 offsets on a device raise NotNarrowable (never read there)."""
    x = int_tensor(name, x)
    if x.dim() != 1 or x.shape[0] < 1:
        raise NotNarrowable(f"{name}: expected 1-D offsets [N+1], got shape {list(x.shape)}")
    if unchecked_on_device(x):
        raise NotNarrowable(f"{name}: int64 offsets on {x.device} cannot be narrowed to int32 without a host read")
    cu = _int32(name, x, 0, 0, INT32_MAX if T is None else T, "" if T is None else f" (T = {T} tokens)")
    if host_values(cu):
        cs = cu.tolist()
        lengths = [b - a for a, b in zip(cs, cs[1:])]
        if cs[0] != 0 or min(lengths, default=0) < 0:
            raise ValueError(f"{name}: expected non-decreasing offsets from 0, got {cs} (nothing was written)")
        if longest is not None and max(lengths, default=0) > longest:
            raise ValueError(f"{name}: a request of {max(lengths)} tokens, more than the {longest} columns of "
                             f"ssm_state_indices (got {cs}; nothing was written)")
    return cu


def one_token_offsets(cu_seqlens: torch.Tensor, rows: int) -> Optional[list]:
    """Host offsets of a batch of one token a request (one state slot each) as a list, checked: offsets that do
    not rise from 0 within the `rows` tokens, or a request of more than one token, raise ValueError naming
    cu_seqlens (the engines' kernels would store its later tokens' states in the next requests' slots). Device
    offsets: None (never read back)."""
    if not host_values(cu_seqlens):
        return None
    cs = cu_seqlens.tolist()
    if cs[0] != 0 or cs[-1] > rows or any(b < a for a, b in zip(cs, cs[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to at most {rows} (the decode rows), "
                         f"got {cs} (nothing was written)")
    for n, (a, b) in enumerate(zip(cs, cs[1:])):
        if b - a > 1:
            raise ValueError(f"cu_seqlens: with 1-D ssm_state_indices (one state slot a request) a request has at "
                             f"most one token; request {n} has {b - a} (cu_seqlens {cs}; nothing was written)")
    return cs


def one_token_rows(cu_seqlens: torch.Tensor, indices: torch.Tensor, rows: int) -> torch.Tensor:
    """A decode batch's slot per token row (int32 [rows]), read as the engines' kernels read a request: its
    token at row cu_seqlens[n], its state at indices[n] (an empty request before it moves its row, not its
    slot). The row of a one-token request gets its slot; a row no request owns gets -1 (padding: zero output,
    nothing written). Host offsets are checked (one_token_offsets); device ones are never read back (no sync,
    CUDA-graph safe): a row gets a slot only from a one-token request that starts inside the rows."""
    N = cu_seqlens.shape[0] - 1
    cs = one_token_offsets(cu_seqlens, rows)
    if cs is not None:
        slots = indices[:N].to(torch.int32)
        if cs == list(range(rows + 1)):
            return slots                               # row n is request n's token
        out = torch.full((rows,), -1, dtype=torch.int32)
        for n, (a, b) in enumerate(zip(cs, cs[1:])):
            if b > a:
                out[a] = slots[n]
        return out
    start = cu_seqlens[:-1].to(torch.int64)
    owned = ((cu_seqlens[1:] - cu_seqlens[:-1]) == 1) & (start >= 0) & (start < rows)
    # every other request is scattered to one spare row past the end, dropped below
    out = torch.full((rows + 1,), -1, dtype=torch.int32, device=cu_seqlens.device)
    out.scatter_(0, torch.where(owned, start, rows), indices[:N].to(torch.int32))
    return out[:rows]
