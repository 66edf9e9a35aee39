"""Tensors as the kernels read them, with the fewest copy kernels (each one a launch on the serving path).

SGLang hands q, k, v over as column blocks of one packed projection (mixed_qkv split, unflattened): views
whose rows are `2*H*K + HV*V` elements apart, and a, b as column slices of its fused projection.
kda_decode and kda_verify read such row-strided views as they are (as_rows, qkv_rows: no copy);
kda_prefill reads dense tensors, and a `.contiguous()` per tensor is three copy kernels: where the three
blocks sit side by side in one row-major buffer, one strided copy into a [3, rows, w] tensor gives all
three (two when v's width differs from q's).
"""
from __future__ import annotations

import functools
import math

import torch

from ... import validation
from ...custom_ops import tracing
from .. import rows
from ..common_checks import decode_gate_dtype
from ..rows import rows_view


def reshaped(name: str, x, shape) -> torch.Tensor:
    """x as `shape` (SGLang hands a tensor over in a layout of its own: a flat gate, beta [1, T, HV], ...);
    a TypeError / ValueError naming the argument where it is no tensor or has another number of elements."""
    if not torch.is_tensor(x):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if -1 not in shape and x.numel() != math.prod(shape):
        raise ValueError(f"{name}: expected {math.prod(shape)} elements (shape {list(shape)}), got shape "
                         f"{list(x.shape)}")
    return x.reshape(shape)


def _castable(name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    """A complex tensor is not cast to a real dtype: torch's cast drops the imaginary part (with a warning only),
    so the call would be served on other values than the caller's; SGLang's Triton kernels take no complex tensor
    either. A TypeError naming the argument, before anything runs."""
    if x.dtype.is_complex and not dtype.is_complex:
        raise TypeError(f"{name}: expected a real floating-point tensor (read as {dtype}), got {x.dtype} (a cast "
                        f"would drop the imaginary part)")
    if dtype.is_floating_point and not x.dtype.is_floating_point:
        # only a float is converted (docs/integrations.md): an integer or bool tensor is refused by the ops and
        # by the fla / vLLM adapters; a cast would serve a bool beta logit as 0 / 1
        raise TypeError(f"{name}: expected a floating-point tensor (read as {dtype}), got {x.dtype} (only a "
                        f"floating-point tensor is converted)")


def _unsigned_view(name: str, x: torch.Tensor) -> None:
    """A lazy negated / conjugated view handed to the op as it is (no cast: a cast materializes the sign) is refused
    by the op under the op's name for it (g for SGLang's `a`); named here by SGLang's. SGLang's Triton kernels read
    the memory without the sign, so they cannot serve it either."""
    if x.is_neg() or x.is_conj():
        validation._tensor(name, x)


def as_dense(name: str, x: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """x (the caller's argument `name`) reshaped, in dtype and contiguous: at most one copy."""
    x = reshaped(name, x, shape)
    if x.dtype != dtype:
        _castable(name, x, dtype)
        return x.to(dtype, memory_format=torch.contiguous_format)
    _unsigned_view(name, x)
    return x.contiguous()


def as_rows(name: str, x: torch.Tensor, dtype: torch.dtype, shape, row_dim: int, vector: bool = True) -> torch.Tensor:
    """x (the caller's argument `name`) reshaped and in dtype as kda_decode (row_dim 0) / kda_verify (row_dim 1)
    read it: SGLang's row-strided view as it is where the op takes it (vector: g; beta is read element by
    element), else dense (at most one copy)."""
    x = reshaped(name, x, shape)
    if x.dtype != dtype:
        _castable(name, x, dtype)
        return x.to(dtype, memory_format=torch.contiguous_format)
    _unsigned_view(name, x)
    return rows_view(x, row_dim, vector=vector)


def token_layout(name: str, x, T: int, inner: tuple) -> None:
    """SGLang's gate / beta as [1, T, *inner] or [T, *inner], or with each token's values flat ([1, T, n], [T, n], or
    all flat [T*n]): reshaped() reads them by their element count, so another layout of that count (the tokens last,
    a token's [K, HV] transposed) would be served on scrambled values. A ValueError naming it (no tensor: reshaped
    names it)."""
    if not torch.is_tensor(x):
        return
    n = math.prod(inner)
    if tuple(x.shape) not in {(1, T, *inner), (T, *inner), (1, T, n), (T, n), (T * n,)}:
        raise ValueError(f"{name}: expected shape [1, T, {', '.join(map(str, inner))}] with T = {T} (q's tokens; or "
                         f"[T, ...], or each token's values flat), got {list(x.shape)}")


def gate_rows(name: str, x, q: torch.Tensor, shape, row_dim: int, vector: bool = True) -> torch.Tensor:
    """SGLang's raw gate a / beta logit b (`name`) as kda_decode (row_dim 0) / kda_verify (row_dim 1) read them
    (as_rows), in common_checks.decode_gate_dtype's dtype (fp32 or q's as it is, another float widened to fp32:
    SGLang's kernel reads fp16 unrounded). No tensor is a
    TypeError, a tensor on another device than q a ValueError, each naming SGLang's argument (the op would name
    its own g / beta)."""
    if torch.is_tensor(x):
        validation._same_device(name, x, q.device)
    token_layout(name, x, shape[row_dim], tuple(shape[row_dim + 1:]))
    dtype = decode_gate_dtype(x.dtype, q.dtype) if torch.is_tensor(x) else q.dtype
    return as_rows(name, x, dtype, shape, row_dim, vector=vector)


def dense_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q [..., H, K], k [..., H, K], v [..., HV, V] contiguous, in q's dtype, values unchanged; as they are
    where already dense."""
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == q.dtype:
        return q, k, v
    # a compiler traces the plain copies (it cannot trace storage addresses) and may fuse them
    blocks = None if tracing(q) else _side_by_side(q, k, v)
    if blocks is None:
        return q.contiguous(), as_dense("k", k, q.dtype, k.shape), as_dense("v", v, q.dtype, v.shape)
    q2, W, wv = blocks
    rows, w = q2.shape
    if wv == w:
        dense = q2.as_strided((3, rows, w), (w, W, 1)).contiguous()
        return dense[0].view(q.shape), dense[1].view(k.shape), dense[2].view(v.shape)
    qk = q2.as_strided((2, rows, w), (w, W, 1)).contiguous()
    return qk[0].view(q.shape), qk[1].view(k.shape), v.contiguous()


def _side_by_side(q, k, v):
    """(q as [rows, w], the row stride, v's width) where q, k and v are the consecutive column blocks
    q | k | v of one row-major buffer in one dtype (each row of each one dense block); else None."""
    lead = q.shape[:-2]
    if k.shape != q.shape or v.shape[:-2] != lead or not (q.dtype == k.dtype == v.dtype):
        return None
    rows = math.prod(lead)
    views = [_rows(x, rows) for x in (q, k, v)]
    if rows == 0 or any(x is None for x in views):
        return None
    q2, k2, v2 = views
    w, wv = q2.shape[1], v2.shape[1]
    W = q2.stride(0)
    if rows > 1 and not (k2.stride(0) == v2.stride(0) == W and W >= 2 * w + wv):
        return None
    if any(x.shape[1] > 1 and x.stride(1) != 1 for x in views):
        return None
    base = q.untyped_storage().data_ptr()
    if k.untyped_storage().data_ptr() != base or v.untyped_storage().data_ptr() != base:
        return None
    if k2.storage_offset() != q2.storage_offset() + w or v2.storage_offset() != k2.storage_offset() + w:
        return None
    return q2, W, wv


def _rows(x, rows):
    """x [..., h, d] as a [rows, h*d] view, or None where its rows are not each one dense block."""
    try:
        return x.view(rows, x.shape[-2] * x.shape[-1])
    except RuntimeError:
        return None


#: q, k, v for kda_decode (row_dim 0) / kda_verify (row_dim 1): SGLang's views into mixed_qkv as they are where
#: the op reads them so (no copy), else dense_qkv
qkv_rows = functools.partial(rows.qkv_rows, dense=dense_qkv)
