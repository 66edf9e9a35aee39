"""GPU tests of the two-stage guarded split (candidate, branch pf-guard2: jit/modules/prefill_c16g2_cuda.json): the
fused 16-token-chunk kernel in pieces, guarded by the chunk-64 piece split of prefill_pc8_vt64_f32, itself guarded by
the unsplit chain at V tile 16 (kda_chain_decide_kernel picks the one before either runs).

Which path served is read off the bits, as in test_prefill_c16g_gpu.py: decaying keys give prefill_c16p_f32's bits (the
fused split); one key a head whose warm-up is a few hundred tokens (past the fused pieces' limit, within a chunk-64
piece) gives prefill_pc8_vt64_f32's; a key that barely decays gives prefill_vt16_f32's (the chain). Each is also held
to the float64 recurrence, outputs NaN-poisoned first, out of place and on a pool updated in place.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
tvm_ffi = pytest.importorskip("tvm_ffi")
from gpu_common import seed  # noqa: E402
from test_prefill_c16g_gpu import fast_decays, same, slow_key  # noqa: E402
from test_prefill_gpu import DEV, K, TOL, V, call, gate_ref, load, make, recurrence, rel  # noqa: E402

NAME = "prefill_c16g2_pc8_vt64_f32"
LENS, H = [8192], 2


def warmups(d, per_tokens):
    """Warm-up (tokens) each piece of per_tokens tokens walks back before its start, as the kernels bound it: the sum
    over tokens of the largest log2 decay over the keys, back to <= -24 (float64; the kernels sum per chunk in fp32)."""
    gl = gate_ref(d["g"][0], "bounded", d["A_log"], d["dt_bias"], -5.0, H) / math.log(2.0)   # [T, H, K]
    worst = gl.max(dim=-1).values                                                           # [T, H]
    T, out = worst.shape[0], []
    for h in range(H):
        for c0 in range(per_tokens, T, per_tokens):
            acc, t = 0.0, c0
            while t > 0 and acc > -24.0:
                t -= 1
                acc += float(worst[t, h])
            out.append(c0 - t)
    return out


def moderate_key(d):
    """One key channel a head decays by ~0.05 bits a token (A_log ln 0.5 and dt_bias -10 through the bounded gate at
    lower bound -5): warm-ups of ~460 tokens (CPU draws of this shape: 461-468 at every seed tried), past the fused
    pieces' limit (8 chunks of 16 at 64 pieces of 128 tokens) and within a chunk-64 piece (1024 tokens)."""
    d["A_log"].fill_(math.log(0.5))
    d["dt_bias"].view(H, K)[:, 0] = -10.0
    return d


def run(name, d, init):
    """(out, final state) of module `name` (fp32 state) on d, outputs NaN-poisoned first."""
    fin = torch.full((len(LENS), H, V, K), float("nan"), device=DEV)
    o = call(load(name), d, "bounded", init=init, fin=fin)
    torch.cuda.synchronize()
    return o, fin


def check(d, other, init):
    (o, fin), ref = run(NAME, d, init), run(other, d, init)
    assert not torch.isnan(o).any() and not torch.isnan(fin.float()).any()
    assert same((o, fin), ref), f"not {other}'s bits"
    ro, rf, _ = recurrence(d, "bounded", -5.0, init)
    assert rel(o[0], ro) < TOL and rel(fin, rf) < TOL, (rel(o[0], ro), rel(fin, rf))


def test_decaying_keys_are_the_fused_split():
    seed("c16g2", "fast")
    d = fast_decays(make(LENS, H, H, "bounded"))
    check(d, "prefill_c16p_f32", torch.randn(1, H, V, K, device=DEV) * 0.5)


def test_a_moderately_decaying_key_is_the_chunk64_piece_split():
    seed("c16g2", "moderate")
    d = moderate_key(make(LENS, H, H, "bounded"))
    w64 = warmups(d, 1024)   # 8 chunk-64 pieces of 1024 tokens (one wave holds 2 tiles x 2 heads x 8)
    assert 16 * 16 < max(w64) <= 960, w64   # past the fused pieces' limit (<= 16 chunks of 16), within a piece
    check(d, "prefill_pc8_vt64_f32", torch.randn(1, H, V, K, device=DEV) * 0.5)


def test_a_slowly_decaying_key_is_the_unsplit_chain():
    seed("c16g2", "slow")
    d = slow_key(make(LENS, H, H, "bounded"), H)
    assert max(warmups(d, 1024)) > 1024
    check(d, "prefill_vt16_f32", torch.randn(1, H, V, K, device=DEV) * 0.5)


@pytest.mark.parametrize("key", ["fast", "moderate", "slow"])
def test_a_pool_updated_in_place_is_the_call_out_of_place(key):
    """Each path on a pool of 3 slots, the call's at slot 2: the same bits as out of place, the other slots unchanged."""
    seed("c16g2", "inplace", key)
    d = make(LENS, H, H, "bounded")
    d = {"fast": fast_decays, "moderate": moderate_key, "slow": lambda x: slow_key(x, H)}[key](d)
    pool = torch.randn(3, H, V, K, device=DEV) * 0.5
    mod = load(NAME)
    fin = torch.full((1, H, V, K), float("nan"), device=DEV)
    o_ref = call(mod, d, "bounded", init=pool[2:3].clone(), fin=fin)
    p = pool.clone()
    o = call(mod, d, "bounded", init=p, fin=p, idx=torch.tensor([2], dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
    assert same((o, p[2:3]), (o_ref, fin)), f"{key}: in place differs from out of place"
    assert torch.equal(p[:2], pool[:2]), "a slot the call does not own changed"
