"""GPU tests of the two-group state pass (params.groups > 1; issue 46).

A groups module runs params.groups 4-warp groups in one state-pass CTA, each its own V tile, sharing one
copy of a chunk's W / Qg / Kd / A / gC. Each group does exactly the operations of one CTA of the one-group
module of the same V tile, in the same order, so where a call runs unsplit (a piece-split module picks one
piece once the sequences x heads fill the SMs: kda_prefill.cu, state_pieces) its outputs, final states and
pool slots are bitwise those of that module. The split itself (more than one piece) is checked in
test_prefill_pieces_gpu.py against the float64 recurrence and, for piece 0, bitwise against the same
one-group module; test_prefill_gpu.py runs every record through its cases. Every output is NaN-poisoned
before the call (call()).
"""
from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
from gpu_common import bits  # noqa: E402
from test_prefill_gpu import DEV, K, RECORDS, V, call, load, make, sdtype  # noqa: E402
from test_prefill_pieces_gpu import SMS, launch_pieces, unsplit  # noqa: E402

GROUP_RECS = [r for r in RECORDS if r["params"].get("groups", 1) > 1]


def batch(H, first):
    """Enough sequences that N x H exceeds the SM count (one piece), the first few of assorted lengths."""
    n = SMS // H + 1
    return first + [200 + 37 * (i % 5) for i in range(n - len(first))]


CASES = [
    dict(id="softplus_h4", lens=batch(4, [0, 1, 63, 64, 65, 3000, 130]), H=4, gate="softplus"),
    dict(id="bounded_h2", lens=batch(2, [5000, 700]), H=2, gate="bounded"),
]


@pytest.mark.parametrize("rec", GROUP_RECS, ids=[r["name"] for r in GROUP_RECS])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bitwise_the_one_group_module(rec, case):
    base = unsplit(rec)
    N, H = len(case["lens"]), case["H"]
    assert launch_pieces(rec, N, H) == 1
    torch.manual_seed(zlib.crc32(f"{rec['name']}{case['id']}".encode()))
    d = make(case["lens"], H, H, case["gate"])
    init = (torch.randn(N, H, V, K, device=DEV) * 0.5).to(sdtype(rec))
    res = []
    for r in (rec, base):
        fin = torch.full((N, H, V, K), float("nan"), device=DEV).to(sdtype(rec))
        o = call(load(r["name"]), d, case["gate"], init=init, fin=fin)
        torch.cuda.synchronize()
        res.append((o, fin))
    (o, fin), (ob, finb) = res
    assert not torch.isnan(o).any() and not torch.isnan(fin).any(), rec["name"]
    assert torch.equal(bits(o), bits(ob)), f"{rec['name']}: output differs from {base['name']}"
    assert torch.equal(bits(fin), bits(finb)), f"{rec['name']}: final state differs from {base['name']}"


@pytest.mark.parametrize("rec", GROUP_RECS, ids=[r["name"] for r in GROUP_RECS])
def test_pool_in_place_untouched_slots(rec):
    """A pool updated in place through state_indices (one padding row): the served slots and the outputs
    bitwise the one-group module's, every other slot bitwise unchanged."""
    base = unsplit(rec)
    H = 4
    lens = batch(H, [300, 5000, 64, 1])
    N = len(lens)
    assert launch_pieces(rec, N, H) == 1
    torch.manual_seed(zlib.crc32(f"{rec['name']}pool".encode()))
    d = make(lens, H, H, "softplus")
    slots = N + 5
    pool0 = (torch.randn(slots, H, V, K, device=DEV) * 0.5).to(sdtype(rec))
    perm = torch.randperm(slots, device=DEV)[:N].to(torch.int32)
    perm[1] = -1  # padding: nothing read or written
    outs = []
    for r in (rec, base):
        pool = pool0.clone()
        o = call(load(r["name"]), d, "softplus", init=pool, fin=pool, idx=perm)
        torch.cuda.synchronize()
        outs.append((o, pool))
    (o, pool), (ob, poolb) = outs
    assert torch.equal(bits(o), bits(ob)) and torch.equal(bits(pool), bits(poolb)), rec["name"]
    served = {int(s) for s in perm.tolist() if s >= 0}
    untouched = [s for s in range(slots) if s not in served]
    assert len(untouched) == slots - (N - 1)
    assert torch.equal(bits(pool[untouched]), bits(pool0[untouched])), rec["name"]
    assert not torch.equal(bits(pool[int(perm[0])]), bits(pool0[int(perm[0])])), rec["name"]  # a served slot moved
