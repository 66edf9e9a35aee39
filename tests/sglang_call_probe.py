"""SGLang call shapes for the bad-input tests: q, k, v as the views of one packed mixed_qkv SGLang hands over, and
target_verify's two requests (2 and 3 draft tokens) with their pool, NaN-filled intermediate buffer and indices."""
from __future__ import annotations

import torch


def packed_qkv(mixed: torch.Tensor, H: int, K: int, V: int):
    """q, k [1, T, H, K] and v [1, T, H, V]: column views of mixed [T, 2 H K + H V], as SGLang slices them."""
    return tuple(x.unflatten(-1, (H, d))[None] for x, d in zip(mixed.split([H * K, H * K, H * V], -1), (K, K, V)))


def verify_setup(rand, H: int, K: int, V: int, slots: int):
    """(q, k, v, pool, buf, kw) of a target_verify over T = 5 tokens in two requests; kw holds the pool, buffer and
    index arguments (the caller adds or replaces its own)."""
    q, k, v = packed_qkv(rand(5, 2 * H * K + H * V), H, K, V)
    pool = rand(slots, H, V, K)
    buf = torch.full((4, 3, H, V, K), float("nan"))
    kw = dict(ssm_states=pool, cache_indices=torch.tensor([1, 4], dtype=torch.int32),
              query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32), intermediate_states_buffer=buf,
              intermediate_state_indices=torch.tensor([0, 2], dtype=torch.int32))
    return q, k, v, pool, buf, kw
