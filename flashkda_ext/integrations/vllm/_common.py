"""What every vLLM adapter shares: the served / fallback counters and the rule that runs a call site."""
from __future__ import annotations

import collections
import functools
import threading

import torch

from .._indices import NotNarrowable
from .. import rows

#: calls per call site: STATS[site, "served"] ran flashkda_ext, STATS[site, "fell_back"] ran vLLM's original
STATS: collections.Counter = collections.Counter()
#: fallbacks per (call site, reason)
REASONS: collections.Counter = collections.Counter()
#: served prefill calls per (call site, how the route knew the longest sequence): "longest from vLLM's metadata"
#: (" , decodes apart" when the step's decodes ran as a call of their own: host_lengths.step_parts), or "by the
#: mean: <why the longest was not known>" (host_lengths.py)
ROUTED: collections.Counter = collections.Counter()


def count_route(site: str, longest, why: str, parts: int = 1) -> None:
    """One served prefill call in ROUTED: routed by the longest request host_lengths gave (in `parts` calls), or
    by the mean (longest None) for the reason it gave."""
    how = f"by the mean: {why}" if longest is None else \
        "longest from vLLM's metadata" + (", decodes apart" if parts > 1 else "")
    ROUTED[site, how] += 1


class Refused(Exception):
    """A call the kernels cannot serve exactly; the message is the counted reason."""


class OpRefused(Exception):
    """The flashkda_ext op refused the mapped call (validation runs before any launch or write)."""


def run_op(op, *args, **kwargs):
    try:
        return op(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise OpRefused() from e


def fall_back(site: str, reason: str) -> None:
    STATS[site, "fell_back"] += 1
    REASONS[site, reason] += 1


_FALLING_BACK = threading.local()


def _original(original, call: dict):
    """vLLM's own function; an adapted name it calls inside (the vendored fused_recurrent_kda calls
    fused_recurrent_kda_fwd) passes straight through to its original, uncounted."""
    _FALLING_BACK.active = True
    try:
        return original(**call)
    finally:
        _FALLING_BACK.active = False


def serve_or_fall_back(site: str, serve, original, call: dict):
    """serve(**call) counted as served, or original(**call) with the reason counted when serve raises Refused /
    NotNarrowable, or when the op refuses the mapped call (its TypeError / ValueError is raised before anything
    is written)."""
    # The rule: a call outside what the adapter maps falls back (vLLM's kernel takes it, or its wrapper reports
    # it); only host values no kernel can run (a slot index past the pool or int32, a count outside [1, T_max],
    # offsets outside [0, T]: _indices) raise a ValueError naming the argument, since vLLM's kernels would read
    # or write out of bounds with them.
    if getattr(_FALLING_BACK, "active", False):
        return original(**call)
    try:
        result = serve(**call)
    except (Refused, NotNarrowable) as e:
        fall_back(site, str(e))
        return _original(original, call)
    except OpRefused as e:
        fall_back(site, f"flashkda_ext does not serve this call: {e.__cause__}")
        return _original(original, call)
    STATS[site, "served"] += 1
    return result


def unknown(kwargs: dict) -> None:
    """An argument the adapter does not know is never ignored: the call falls back."""
    if kwargs:
        raise Refused(f"unknown arguments {sorted(kwargs)} (the adapter serves only arguments it knows)")


def tensors(**named) -> None:
    """The tensor arguments of vLLM's signature are tensors (None or another object falls back, named: vLLM's
    wrapper reports it)."""
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise Refused(f"{name} is {type(x).__name__}: vLLM passes a tensor here (its wrapper reports the rest)")


def gate_dtypes(q: torch.Tensor, ok: tuple, **named) -> None:
    """The gate / beta arguments in a dtype of `ok`, what the op reads as it is: any other would be cast, which
    rounds or widens what vLLM's kernel reads in its own dtype, so the call falls back."""
    for name, x in named.items():
        if x.dtype not in ok:
            raise Refused(f"{name} of dtype {x.dtype} beside q of {q.dtype}: the op reads {name} in "
                          f"{' or '.join(map(str, dict.fromkeys(ok)))} (a cast would change what vLLM's kernel computes)")


def dense_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v as the ops take them (contiguous). vLLM's are row-strided views of one packed [T, 2*H*K + H*V]
    buffer (q | k | v per token): when they are, one permuting copy makes all three dense (as vLLM's own
    rearrange_mixed_qkv does); a dense tensor is taken as it is."""
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        return q, k, v
    esize = q.element_size()
    if (q.shape == k.shape == v.shape and q.stride() == k.stride() == v.stride() and q.dtype == k.dtype == v.dtype
            and q.stride()[-2:] == (q.shape[-1], 1)):
        hk = q.shape[-2] * q.shape[-1]
        same = q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        if same and k.data_ptr() == q.data_ptr() + hk * esize and v.data_ptr() == q.data_ptr() + 2 * hk * esize:
            packed = q.as_strided((3, *q.shape), (hk, *q.stride())).contiguous()
            return packed.unbind(0)
    return q.contiguous(), k.contiguous(), v.contiguous()


#: q, k, v for kda_decode (row_dim 0) / kda_verify (row_dim 1): vLLM's row-strided views of its post-conv buffer
#: as they are where the op reads them, else dense_qkv's one permuting copy
qkv_rows = functools.partial(rows.qkv_rows, dense=dense_qkv)
