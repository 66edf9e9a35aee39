"""The engines' row-strided views handed to kda_decode / kda_verify as they are.

vLLM and SGLang hand q, k, v over as column blocks of one packed projection (rows `2*H*K + HV*V`
elements apart) and g, beta as column slices of theirs. kda_decode (rows: dim 0) and kda_verify (tokens:
dim 1) read such views directly (validation.rows_as_read: each row's inner block dense, on a GPU the
rows 16-byte aligned), so the adapters pass them through and copy only what the ops cannot read (each
copy is a kernel launch on the serving path, 2-3 us in a CUDA-graph replay on an H200). Traced calls
(FakeTensor, torch.compile) get dense tensors: a view's address cannot be checked there, and a
compiler may fuse the copy.
"""
from __future__ import annotations

import torch

from .. import validation
from ..custom_ops import tracing


def as_read(x: torch.Tensor, row_dim: int, *, vector: bool = True) -> bool:
    """True when the op reads x as it is (dense, or a row-strided view it takes; vector: q, k, v, g)."""
    return x.is_contiguous() or (x.dim() > row_dim and not tracing(x)
                                 and validation.rows_as_read(x, row_dim, vector=vector))


def rows_view(x: torch.Tensor, row_dim: int, *, vector: bool = True) -> torch.Tensor:
    """x itself where the op reads it so, else a dense copy (one kernel)."""
    return x if as_read(x, row_dim, vector=vector) else x.contiguous()


def qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_dim: int, dense):
    """q, k, v for kda_decode (row_dim 0) / kda_verify (row_dim 1): an engine's views into its packed buffer
    as they are where the op reads them so (no copy), else dense(q, k, v), the engine's fewest-copies form."""
    if k.dtype == v.dtype == q.dtype and all(as_read(x, row_dim) for x in (q, k, v)):
        return q, k, v
    return dense(q, k, v)
