"""A reference for the decode benchmark: the pool's state traffic with no arithmetic.

`slot_copy(pool, idx, part)` reads every (row, head) state tile that a decode call addresses and
writes it back in place, unchanged: the same slots, the same bytes read and written as one decode
step, none of its compute. Its time is what a plain copy kernel pays for that address pattern on
this GPU, so `ours / slot_copy` says how far a decode kernel is from its own traffic. It is a
reference, not a bound: a decode kernel can beat it (2026-11-30, f5ae208: fp32 at small rows).

Written in Triton (on the device image): independent of the kernels it is compared with. `part` is
the share of a tile one program moves (1, 2 or 4); the benchmark times several and quotes the best.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slot_copy_kernel(pool, idx, heads, tile_elems, scale, BLOCK: tl.constexpr):
    item = tl.program_id(0)          # one (row, head) pair
    part = tl.program_id(1)          # which BLOCK of its tile
    row = item // heads
    head = item % heads
    slot = tl.load(idx + row).to(tl.int64)
    base = (slot * heads + head) * tile_elems + part * BLOCK
    offs = tl.arange(0, BLOCK)
    x = tl.load(pool + base + offs, eviction_policy="evict_first")
    tl.store(pool + base + offs, (x.to(tl.float32) * scale).to(x.dtype), cache_modifier=".cs")


def slot_copy_fn(pool: torch.Tensor, idx: torch.Tensor, part: int = 1, num_warps: int = 8,
                 scale: float = 1.0):
    """A callable that writes pool[idx[r], h] * scale onto itself for every row r and head h
    (scale 1.0: an unchanged copy, the benchmark's case; the tests use another to see the slots)."""
    slots, heads, V, K = pool.shape
    rows = idx.shape[0]
    tile = V * K
    if tile % part:
        raise ValueError(f"part: expected a divisor of the tile ({tile} elements), got {part}")
    block = tile // part
    grid = (rows * heads, part)

    def run():
        _slot_copy_kernel[grid](pool, idx, heads, tile, scale, BLOCK=block, num_warps=num_warps)
    return run
