"""The memo of the op checks: a serving loop calls with the same shapes every step, so the verdict of
a full check is reused for the next call whose tensors have the same shape, dtype, device, contiguity
(strides when not contiguous: a pool's slot stride decides its verdict and offset width) and 16-byte
alignment and whose other arguments are equal (same type too: True is not 1). Anything the key
cannot capture (values inside a host tensor, unhashable arguments, tensor subclasses) takes the
full check every time."""
from __future__ import annotations

import functools
from itertools import chain, repeat

import torch

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


_CACHES: list = []  # every memoized check's cache, for clear_memos


def clear_memos() -> None:
    """Forget every memoized verdict: the next call of each op is checked in full."""
    for cache in _CACHES:
        cache.clear()


def _memoized(check):
    cache: dict = {}
    _CACHES.append(cache)

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
