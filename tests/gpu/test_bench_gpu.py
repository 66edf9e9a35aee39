"""The benchmarks' copy references on the GPU (Triton): decode's slot copy (benchmarks/slot_copy.py) must
move exactly the tiles a decode call addresses and leave them bitwise unchanged at scale 1; verify's state
copy (benchmarks/verify_copy.py) must put each request's read tile in exactly its token slots."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part,warps", [(1, 8), (4, 4)])
def test_verify_copy_moves_the_read_tile_to_the_token_slots(dtype, part, warps):
    """benchmarks/verify_copy.py: each request's read slot (column nacc - 1) lands bitwise in its
    token slots (ragged lengths, a padding entry skipped), the read slots and every other slot unchanged."""
    from verify_copy import verify_copy_fn
    gen = torch.Generator(device="cuda").manual_seed(4)
    pool = torch.randn(40, 3, 128, 128, generator=gen, device="cuda").to(dtype)
    ref = pool.clone()
    idx = torch.tensor([[5, 9, 30], [12, 2, -1], [7, 33, 20]], dtype=torch.int32, device="cuda")
    nacc = torch.tensor([2, 1, 3], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32, device="cuda")  # lengths 3, 2, 3
    verify_copy_fn(pool, idx, nacc, cu, 3, part, warps)()
    torch.cuda.synchronize()
    want = ref.clone()
    for n, (row, a, length) in enumerate(zip(idx.tolist(), nacc.tolist(), (3, 2, 3))):
        src = ref[row[a - 1]]
        for t in range(length):
            if row[t] >= 0:
                want[row[t]] = src
    assert not torch.equal(bits(want), bits(ref))      # the case moves something
    assert torch.equal(bits(pool), bits(want))
