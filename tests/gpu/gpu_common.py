"""Helpers the GPU test files share (imported by name: pytest puts this folder on sys.path)."""
from __future__ import annotations

import torch


def rel_l2(a, b):
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bits(t):
    """The raw bits of an fp32 or bf16 tensor, for bitwise comparisons (NaN == NaN)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def slot_list(rows, slots, slot_mode, seed, null_slot0=False):
    """Slot indices per row: "unique" (a random permutation), "padded" (every third row padding,
    negative indices of several values, slot 0 on row 2 with null_slot0) or "repeated" (a few slots
    reused in interleaved order, plus padding)."""
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed)).tolist()
    if slot_mode == "unique":
        return perm[:rows]
    if slot_mode == "padded":
        il = [perm[r] if r % 3 != 1 else -1 - (r % 5) for r in range(rows)]
        if null_slot0 and rows > 2:
            il[2] = 0
        return il
    return [perm[(r * 7) % max(1, rows // 3 + 1)] if r % 5 != 4 else -1 for r in range(rows)]
