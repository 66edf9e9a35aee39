"""A reference for the verify benchmark: a verify call's state traffic with no arithmetic.

`verify_copy_fn(pool, idx, nacc, cu, T_max, part)` reads, for every (request, head), the state tile
of the request's read slot (`idx[n, nacc[n] - 1]`) once and writes it unchanged to each of its
token slots `idx[n, t]`, t < T_n: the same slots and state bytes as one kda_verify call (one read,
T writes), none of its compute and none of its inputs or outputs. Its time is what a plain copy
kernel pays for that traffic at that size on this GPU, so `ours / copy` says how far a verify
kernel is from its own state traffic, and the copy's own share of the floor says how much of the
floor any kernel of that size reached in the same run. A reference, not a bound.

Written in Triton (on the device image), as benchmarks/slot_copy.py is for decode: independent of
the kernels it is compared with. `part` is the share of a tile one program moves (1, 2 or 4); the
benchmark times several and quotes the best. Dense pools only ([slots, HV, V, K]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _verify_copy_kernel(pool, idx, nacc, cu, heads, idx_cols, tile_elems, BLOCK: tl.constexpr,
                        T_MAX: tl.constexpr):
    item = tl.program_id(0)          # one (request, head) pair
    part = tl.program_id(1)          # which BLOCK of its tile
    n = item // heads
    head = item % heads
    length = tl.load(cu + n + 1) - tl.load(cu + n)
    src = tl.load(idx + n * idx_cols + tl.load(nacc + n) - 1).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    if src >= 0:
        x = tl.load(pool + (src * heads + head) * tile_elems + offs, eviction_policy="evict_first")
        for t in tl.static_range(T_MAX):
            if t < length:
                dst = tl.load(idx + n * idx_cols + t).to(tl.int64)
                if dst >= 0:
                    tl.store(pool + (dst * heads + head) * tile_elems + offs, x, cache_modifier=".cs")


def verify_copy_fn(pool: torch.Tensor, idx: torch.Tensor, nacc: torch.Tensor, cu: torch.Tensor, T_max: int,
                   part: int = 1, num_warps: int = 8):
    """A callable that copies pool[idx[n, nacc[n] - 1], h] to pool[idx[n, t], h] for every request
    n, head h and token t < T_n (negative entries skipped)."""
    slots, heads, V, K = pool.shape
    N, cols = idx.shape
    tile = V * K
    if tile % part:
        raise ValueError(f"part: expected a divisor of the tile ({tile} elements), got {part}")
    if not pool.is_contiguous():
        raise ValueError("pool: expected a dense (contiguous) [slots, HV, V, K] pool")
    block = tile // part
    grid = (N * heads, part)

    def run():
        _verify_copy_kernel[grid](pool, idx, nacc, cu, heads, cols, tile, BLOCK=block, T_MAX=T_max,
                                  num_warps=num_warps)
    return run
