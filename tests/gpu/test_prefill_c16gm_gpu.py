"""GPU tests of the guarded piece split with each sequence's pieces from its own length (jit/modules/
prefill_c16gm_cuda.json: csrc/prefill/kda_prefill_c16g.cu with params.c16_seq_pieces; opt-in route c16g_mixed; issue
46): a batch of long and short sequences, where a long sequence takes ceil(its chunks / L) pieces (at most the grid's
z) and a short one a piece or none beyond its first.

On decaying keys every warm-up is short and the pieces serve: held to the float64 recurrence (outputs NaN-poisoned),
deterministic, an empty and a one-token sequence among them, the longest sequence past z pieces of L, the grid's
layers rotated where one fills the wave (336 items); a pool updated in
place gives the out-of-place bits and leaves the other slots bitwise unchanged. One slowly decaying key a head hands
the call to the chunk-64 kernels, bitwise prefill_vt64_*. The schedule itself (every token stored once, one final-state
writer per sequence, warm-ups below the bound) is checked on the CPU (tests/test_prefill_c16_pieces_schedule.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
tvm_ffi = pytest.importorskip("tvm_ffi")
from gpu_common import bits, records_by_name, seed  # noqa: E402
from test_prefill_c16g_gpu import fast_decays, run_both, same, served_against_recurrence, slow_key  # noqa: E402
from test_prefill_gpu import DEV, K, TOL, V, call, load, make, recurrence, rel, sdtype  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from warmup_lengths import c16_seq_split, own_pieces  # noqa: E402

RECS = records_by_name("prefill_c16gm_cuda.json")
NAMES = list(RECS)


def fallback_of(name):
    return "prefill_vt64_" + name.rsplit("_", 1)[1]


# (lens, heads): long and short sequences with an empty and a one-token one; one sequence past the grid's z pieces
# 48 heads: 336 items, one grid layer fills the wave, so the binding rotates the layers (Args::z_rotate)
MIXED = [([3000, 64, 0, 1, 1200, 17, 700], 4), ([8192, 16, 16, 16], 1), ([3000, 64, 0, 1, 1200, 17, 700], 48)]


@pytest.mark.parametrize("lens,H", MIXED)
@pytest.mark.parametrize("name", NAMES)
def test_mixed_lengths_on_decaying_keys_against_the_recurrence(name, lens, H):
    seed("mixed", name, H)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    z, L = c16_seq_split(RECS[name]["params"]["c16_pieces"], 2 * sms, H, len(lens), sum(lens))
    owns = [own_pieces(-(-n // 16), z, L) for n in lens]
    assert z > 1 and max(owns) > min(owns), (z, L, owns)   # the premise: the sequences' pieces differ
    if H == 1:
        assert -(-lens[0] // 16) > z * L, (z, L)   # the longest is capped at z pieces, each longer than L
    d = fast_decays(make(lens, H, H, "bounded"))
    init, o, fin = served_against_recurrence(name, d, len(lens), H, sdtype(RECS[name]))
    fin2 = torch.full_like(fin, float("nan"))
    o2 = call(load(name), d, "bounded", init=init, fin=fin2)
    torch.cuda.synchronize()
    assert same((o2, fin2), (o, fin)), "not deterministic"


@pytest.mark.parametrize("lens,H", [([4096, 64, 2500, 16], 4), ([2048, 64, 1500, 16, 900, 40], 48)])   # 288 items: rotated
@pytest.mark.parametrize("name", NAMES)
def test_a_slowly_decaying_key_hands_the_call_to_the_chunk64_kernels(name, lens, H):
    seed("slow", name, H)
    d = slow_key(make(lens, H, H, "bounded"), H)
    st = sdtype(RECS[name])
    init = (torch.randn(len(lens), H, V, K, device=DEV) * 0.5).to(st)
    (o, fin), other = run_both(name, fallback_of(name), d, "bounded", len(lens), H, init=init, st=st)
    assert not torch.isnan(o).any() and same((o, fin), other), f"{name}: not the chunk-64 kernels' bits"
    ro, rf, _ = recurrence(d, "bounded", -5.0, init)
    assert rel(o[0], ro) < TOL and rel(fin, rf) < TOL, (rel(o[0], ro), rel(fin, rf))


@pytest.mark.parametrize("name", NAMES)
def test_a_pool_in_place_is_the_out_of_place_call(name):
    """Three sequences on a pool of 6 slots (slots 3, 1 and a padding row -1), decaying keys: the pieces store the
    final states to the workspace's copy and the last kernel moves them in; the bits of the call out of place."""
    seed("inplace", name)
    H = 2
    d = fast_decays(make([3000, 40, 500], H, H, "bounded"))
    pool = (torch.randn(6, H, V, K, device=DEV) * 0.5).to(sdtype(RECS[name]))
    idx = torch.tensor([3, 1, -1], dtype=torch.int32, device=DEV)
    p = pool.clone()
    o = call(load(name), d, "bounded", init=p, fin=p, idx=idx)
    fin = torch.full_like(pool.float(), float("nan")).to(pool.dtype)
    o2 = call(load(name), d, "bounded", init=pool, fin=fin, idx=idx)
    torch.cuda.synchronize()
    assert torch.equal(bits(o), bits(o2)) and torch.equal(bits(p[[3, 1]]), bits(fin[[3, 1]]))
    assert torch.equal(bits(p[[0, 2, 4, 5]]), bits(pool[[0, 2, 4, 5]]))   # untouched slots (5: the padding row's)
    ro, rf, _ = recurrence(d, "bounded", -5.0, pool, idx=idx.tolist())
    assert rel(o[0], ro) < TOL and rel(p[[3, 1]], rf[:2]) < TOL
