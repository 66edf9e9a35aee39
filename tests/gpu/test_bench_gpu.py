"""The decode benchmark's slot-copy reference (benchmarks/slot_copy.py, Triton) on the GPU: it must
move exactly the tiles a decode call addresses, and leave them bitwise unchanged at scale 1."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from slot_copy import slot_copy_fn  # noqa: E402

from gpu_common import bits  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part,warps", [(1, 8), (2, 8), (4, 4)])
def test_slot_copy_moves_exactly_the_addressed_tiles(dtype, part, warps):
    gen = torch.Generator(device="cuda").manual_seed(3)
    pool = torch.randn(40, 3, 128, 128, generator=gen, device="cuda").to(dtype)
    ref = pool.clone()
    idx = torch.tensor([17, 3, 38, 0, 21], dtype=torch.int32, device="cuda")
    slot_copy_fn(pool, idx, part, warps)()
    torch.cuda.synchronize()
    assert torch.equal(bits(pool), bits(ref))            # scale 1: bitwise unchanged
    slot_copy_fn(pool, idx, part, warps, scale=2.0)()
    torch.cuda.synchronize()
    want = ref.clone()
    want[idx.long()] *= 2                                 # exact: a power of two
    assert torch.equal(bits(pool), bits(want))           # the addressed slots, all heads, nothing else
