"""GPU tests of the two-group state-pass modules (params.groups > 1; issue 46).

A groups module runs params.groups 4-warp groups in one state-pass CTA, each its own V tile, sharing one
copy of a chunk's W / Qg / Kd / A / gC. Each group does exactly the operations of one CTA of the module
without groups (same V tile, same order), so its outputs, final states, checkpoints and untouched pool
slots must be bitwise those of that module (its one-group twin: the same record without params.groups).
Piece-split groups modules are checked the same way against their one-group piece-split twin (the same
pieces); test_prefill_gpu.py and test_prefill_pieces_gpu.py run every record against the float64
recurrence as well. Every output is NaN-poisoned before the call (call()).
"""
from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
from gpu_common import bits  # noqa: E402
from test_prefill_gpu import DEV, K, RECORDS, V, call, load, make, sdtype  # noqa: E402

GROUP_RECS = [r for r in RECORDS if r["params"].get("groups", 1) > 1]


def one_group_twin(rec):
    """The record with the same params (pieces included) but one group a CTA; for a piece count no
    one-group module is built with, the one-group module without pieces of that V tile is the twin of
    piece 0 only, so the pieces' count is kept and a missing twin fails here."""
    want = {k: v for k, v in rec["params"].items() if k != "groups"}
    same = [r for r in RECORDS if r["params"].get("groups", 1) == 1 and r["params"] == want
            and r["state_dtype"] == rec["state_dtype"]]
    return same[0] if len(same) == 1 else None


def twin_or_skip(rec):
    t = one_group_twin(rec)
    if t is None:  # e.g. 16 pieces, built only with groups: its pieces are held to the recurrence elsewhere
        pytest.skip(f"{rec['name']}: no one-group module with the same pieces")
    return t


CASES = [
    dict(id="varlen_softplus_ckpt", lens=[130, 1, 63, 65, 0, 64, 200, 700], H=4, gate="softplus", every=64, nck=3),
    dict(id="b1_t8192_h8_bounded", lens=[8192], H=8, gate="bounded"),
    dict(id="b1_t4096_h2_softplus", lens=[4096], H=2, gate="softplus"),
    dict(id="batch_64x256_h4_bounded", lens=[256] * 64, H=4, gate="bounded"),
]


def run(rec, d, gate, init, every=0, nck=0):
    N, HV = len(d["cu"]) - 1, d["v"].shape[2]
    st = sdtype(rec)
    fin = torch.full((N, HV, V, K), float("nan"), device=DEV).to(st)
    ck = None
    if every and rec["params"].get("pieces", 1) == 1:
        ck = torch.full((N, nck, HV, V, K), float("nan"), device=DEV).to(st)
    o = call(load(rec["name"]), d, gate, init=init, fin=fin, ckpt=ck, every=every if ck is not None else 0)
    torch.cuda.synchronize()
    return o, fin, ck


@pytest.mark.parametrize("rec", GROUP_RECS, ids=[r["name"] for r in GROUP_RECS])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bitwise_the_one_group_module(rec, case):
    twin = twin_or_skip(rec)
    torch.manual_seed(zlib.crc32(f"{rec['name']}{case['id']}".encode()))
    d = make(case["lens"], case["H"], case["H"], case["gate"])
    N = len(case["lens"])
    init = (torch.randn(N, case["H"], V, K, device=DEV) * 0.5).to(sdtype(rec))
    o, fin, ck = run(rec, d, case["gate"], init, case.get("every", 0), case.get("nck", 0))
    ot, fint, ckt = run(twin, d, case["gate"], init, case.get("every", 0), case.get("nck", 0))
    assert not torch.isnan(o).any() and not torch.isnan(fin).any(), rec["name"]
    assert torch.equal(bits(o), bits(ot)), f"{rec['name']} output differs from {twin['name']}"
    assert torch.equal(bits(fin), bits(fint)), f"{rec['name']} final state differs from {twin['name']}"
    if ck is not None:
        assert torch.equal(bits(ck), bits(ckt)), f"{rec['name']} checkpoints differ from {twin['name']}"


@pytest.mark.parametrize("rec", GROUP_RECS, ids=[r["name"] for r in GROUP_RECS])
def test_pool_in_place_untouched_slots(rec):
    """A pool updated in place through state_indices (with a padding index): the served slots bitwise the
    one-group module's, every other slot bitwise unchanged."""
    twin = twin_or_skip(rec)
    torch.manual_seed(zlib.crc32(f"{rec['name']}pool".encode()))
    lens, H = [300, 5000, 64, 1], 4
    d = make(lens, H, H, "softplus")
    st = sdtype(rec)
    pool0 = (torch.randn(9, H, V, K, device=DEV) * 0.5).to(st)
    idx = torch.tensor([7, -1, 2, 4], dtype=torch.int32, device=DEV)
    outs = []
    for r in (rec, twin):
        pool = pool0.clone()
        o = call(load(r["name"]), d, "softplus", init=pool, fin=pool, idx=idx)
        torch.cuda.synchronize()
        outs.append((o, pool))
    (o, pool), (ot, poolt) = outs
    assert torch.equal(bits(o), bits(ot)) and torch.equal(bits(pool), bits(poolt)), rec["name"]
    untouched = [s for s in range(9) if s not in (7, 2, 4)]
    assert torch.equal(bits(pool[untouched]), bits(pool0[untouched])), rec["name"]
    assert not torch.equal(bits(pool[7]), bits(pool0[7])), rec["name"]  # the call did update a served slot
