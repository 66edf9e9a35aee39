"""GPU tests of the guarded piece split (jit/modules/prefill_c16g_cuda.json, csrc/prefill/kda_prefill_c16g.cu; routes
c16g_* for bounded gates; issue 46): the fused 16-token-chunk kernel in pieces, guarded by the chunk-64 kernels of the module it
names (prefill_c16g_<X>_<state> falls back to prefill_<X>_<state>).

Which path served a call is read off the bits: decaying keys (every piece's warm-up short) give the piece split's
output and final state bitwise (prefill_c16p_*, the same kernel unguarded); one slowly decaying key a head (every
warm-up walks back to chunk 0) hands the call to the chunk-64 kernels, bitwise the fallback module; a pool updated in
place gives the same bits on either path (the pieces store to a copy the last kernel moves into the pool); a call
whose pieces would not shorten the slowest CTA slot (HV x N over a wave, short sequences) runs the fused kernel
unsplit (prefill_c16_*).
Each path is also held to the float64 recurrence, outputs NaN-poisoned first.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
tvm_ffi = pytest.importorskip("tvm_ffi")
from gpu_common import bits, records_by_name, seed  # noqa: E402
from test_prefill_gpu import DEV, K, TOL, V, call, load, make, recurrence, rel, sdtype  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from warmup_lengths import c16_split  # noqa: E402

RECS = records_by_name("prefill_c16g_cuda.json")
NAMES = list(RECS)
F32 = [n for n in NAMES if n.endswith("_f32")]


def fallback_of(name):
    return name.replace("prefill_c16g_", "prefill_")


def split_of(name):
    return "prefill_c16p_" + name.rsplit("_", 1)[1]


def unsplit_of(name):
    return "prefill_c16_" + name.rsplit("_", 1)[1]


def fast_decays(d):
    """dt_bias + 8: every token's slowest key decays by more than ~1 nat (bounded at -5 or softplus with make's
    A_log), so every warm-up is one 16-token chunk, far below the guard's limit (2 chunks at 4-chunk pieces: 33 pieces
    at 2 x 4 heads on an H200's two-CTA kernel, 16 on the role split; tests/test_prefill_c16_pieces_schedule.py checks
    this premise on the CPU)."""
    d["dt_bias"] = d["dt_bias"] + 8.0
    return d


def slow_key(d, H):
    """One key channel a head barely decays (dt_bias -20: a model's long-memory channel)."""
    d["dt_bias"].view(H, K)[:, 0] = -20.0
    return d


def run_both(name, other, d, gate, N, H, init=None, pool=None, idx=None, st=None):
    """(out, final state) of module `name` and module `other` on the same inputs, NaN-poisoned outputs; with `pool` the
    call updates a copy of it in place. st: the state dtype (default: this file's record of `name`)."""
    st = sdtype(RECS[name]) if st is None else st
    res = []
    for m in (name, other):
        if pool is not None:
            p = pool.clone()
            o = call(load(m), d, gate, init=p, fin=p, idx=idx)
            res.append((o, p))
        else:
            fin = torch.full((N, H, V, K), float("nan"), device=DEV).to(st)
            res.append((call(load(m), d, gate, init=init, fin=fin), fin))
    torch.cuda.synchronize()
    return res


def same(a, b):
    return torch.equal(bits(a[0]), bits(b[0])) and torch.equal(bits(a[1]), bits(b[1]))


def served_against_recurrence(name, d, N, H, st):
    """One bounded call of module `name` from a random initial state, output and final state NaN-poisoned: both
    finite and within TOL of the float64 recurrence. Returns (initial state, out, final state)."""
    init = (torch.randn(N, H, V, K, device=DEV) * 0.5).to(st)
    fin = torch.full((N, H, V, K), float("nan"), device=DEV).to(st)
    o = call(load(name), d, "bounded", init=init, fin=fin)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any() and not torch.isnan(fin.float()).any()
    ro, rf, _ = recurrence(d, "bounded", -5.0, init)
    assert rel(o[0], ro) < TOL and rel(fin, rf) < TOL, (rel(o[0], ro), rel(fin, rf))
    return init, o, fin


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("name", NAMES)
def test_decaying_keys_are_served_by_the_piece_split(name, gate):
    seed("split", name, gate)
    lens, H = [3000, 1700], 4
    d = fast_decays(make(lens, H, H, gate))
    init = (torch.randn(len(lens), H, V, K, device=DEV) * 0.5).to(sdtype(RECS[name]))
    (o, fin), other = run_both(name, split_of(name), d, gate, len(lens), H, init=init)
    assert not torch.isnan(o).any() and not torch.isnan(fin.float()).any()
    assert same((o, fin), other), f"{name}: not the piece split's bits (the guard tripped on decaying keys?)"
    ro, rf, _ = recurrence(d, gate, -5.0, init)
    assert rel(o[0], ro) < TOL and rel(fin, rf) < TOL, (rel(o[0], ro), rel(fin, rf))


@pytest.mark.parametrize("name", NAMES)
def test_a_slowly_decaying_key_hands_the_call_to_the_chunk64_kernels(name):
    seed("slow", name)
    lens, H = [4096, 2500], 4
    d = slow_key(make(lens, H, H, "bounded"), H)
    init = (torch.randn(len(lens), H, V, K, device=DEV) * 0.5).to(sdtype(RECS[name]))
    (o, fin), other = run_both(name, fallback_of(name), d, "bounded", len(lens), H, init=init)
    assert not torch.isnan(o).any() and not torch.isnan(fin.float()).any()
    assert same((o, fin), other), f"{name}: not the chunk-64 kernels' bits"
    ro, rf, _ = recurrence(d, "bounded", -5.0, init)
    assert rel(o[0], ro) < TOL and rel(fin, rf) < TOL, (rel(o[0], ro), rel(fin, rf))
    # deterministic: the same path again
    fin2 = torch.full_like(fin, float("nan"))
    o2 = call(load(name), d, "bounded", init=init, fin=fin2)
    torch.cuda.synchronize()
    assert same((o2, fin2), (o, fin))


def in_place_case(name, key):
    """Three sequences on a pool of 6 slots updated in place (slots 3, 1 and a padding row -1), decaying keys or one
    slow key a head: (inputs, pool before, indices)."""
    seed("inplace", name, key)
    H = 2
    d = make([3000, 40, 500], H, H, "bounded")
    d = fast_decays(d) if key == "fast" else slow_key(d, H)
    pool = (torch.randn(6, H, V, K, device=DEV) * 0.5).to(sdtype(RECS[name]))
    return d, pool, torch.tensor([3, 1, -1], dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("name", NAMES)
def test_a_pool_in_place_with_decaying_keys_is_the_piece_split(name):
    """The pieces store the final states to the workspace's copy and a last kernel moves them into the pool: the bits
    of the piece split called out of place (prefill_c16p_*: initial states read from one pool, final ones stored to
    another), and every slot the call does not own bitwise unchanged."""
    d, pool, idx = in_place_case(name, "fast")
    p = pool.clone()
    o = call(load(name), d, "bounded", init=p, fin=p, idx=idx)
    fin = torch.full_like(pool.float(), float("nan")).to(pool.dtype)
    o2 = call(load(split_of(name)), d, "bounded", init=pool, fin=fin, idx=idx)
    torch.cuda.synchronize()
    assert torch.equal(bits(o), bits(o2)), f"{name}: not the piece split's output bits"
    assert torch.equal(bits(p[[3, 1]]), bits(fin[[3, 1]])), f"{name}: not the piece split's final states"
    assert torch.equal(bits(p[[0, 2, 4, 5]]), bits(pool[[0, 2, 4, 5]]))  # untouched slots (5: the padding row's)
    ro, rf, _ = recurrence(d, "bounded", -5.0, pool, idx=idx.tolist())
    assert rel(o[0], ro) < TOL and rel(p[[3, 1]], rf[:2]) < TOL, (rel(o[0], ro), rel(p[[3, 1]], rf[:2]))


@pytest.mark.parametrize("name", NAMES)
def test_a_pool_in_place_with_a_slow_key_is_the_chunk64_kernels(name):
    """The guard hands the call over before anything reaches the pool: the chunk-64 module's bits in place."""
    d, pool, idx = in_place_case(name, "slow")
    a, b = run_both(name, fallback_of(name), d, "bounded", 3, 2, pool=pool, idx=idx)
    assert same(a, b)
    assert torch.equal(bits(a[1][[0, 2, 4, 5]]), bits(pool[[0, 2, 4, 5]]))  # untouched slots


@pytest.mark.parametrize("name", F32)
def test_a_full_wave_runs_the_fused_kernel_unsplit(name):
    seed("unsplit", name)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    N = 2 * sms // 16 + 1   # N x 16 heads > one wave of 2 CTAs an SM, 4-8 chunks a sequence: pieces would not shorten
    # the slowest CTA slot (scripts/warmup_lengths.pieces_for_waves: 2 waves of 6 chunk steps unsplit, 3 of 5 at 2)
    lens, H = [64 + 16 * (i % 5) for i in range(N)], 16
    d = slow_key(make(lens, H, H, "bounded"), H)   # would trip the guard if it split
    a, b = run_both(name, unsplit_of(name), d, "bounded", N, H)
    assert same(a, b)


@pytest.mark.parametrize("name", [n for n in NAMES if RECS[n]["params"].get("c16_fallback")])
def test_the_unsplit_fallback_module_splits_past_one_wave(name):
    """prefill_c16g_c16_* (params.c16_fallback): 192 items (4 x 2048 H48), which one wave of 2 CTAs an SM holds unsplit,
    split over several waves on decaying keys (the role split, params.c16_ws: 2 pieces in 3 waves of one CTA an SM at 132
    SMs; scripts/warmup_lengths.c16_split) and right against the float64 recurrence; one slow key a head hands the call
    to the two-CTA fused kernel unsplit, launched after the split: prefill_c16_<state>'s bits, the pool in place as out
    of place."""
    seed("waves", name)
    lens, H = [2048] * 4, 48
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    prm = RECS[name]["params"]   # the splitting kernel's CTA slots (the binding's c16_slots): one an SM for the role split
    slots = sms if prm.get("c16_ws") else prm.get("c16_min_blocks", 2) * sms
    P = c16_split(RECS[name]["params"]["c16_pieces"], slots, H * len(lens), 2048 // 16, past_one_wave=True)
    assert P > 1 and c16_split(64, 2 * sms, H * len(lens), 2048 // 16) == 1, P
    st = sdtype(RECS[name])
    init = served_against_recurrence(name, fast_decays(make(lens, H, H, "bounded")), len(lens), H, st)[0]
    slow = slow_key(make(lens, H, H, "bounded"), H)
    a, b = run_both(name, fallback_of(name), slow, "bounded", len(lens), H, init=init)
    assert same(a, b), "the slow key's call is not the unsplit kernel's"
    pool = (torch.randn(2 * len(lens), H, V, K, device=DEV) * 0.5).to(st)
    idx = torch.tensor([5, 0, 6, 3], dtype=torch.int32, device=DEV)
    a, b = run_both(name, fallback_of(name), slow, "bounded", len(lens), H, pool=pool, idx=idx)
    assert same(a, b) and torch.equal(bits(a[1][[1, 2, 4, 7]]), bits(pool[[1, 2, 4, 7]]))


@pytest.mark.parametrize("name", F32)
def test_workspace_too_small_is_refused_before_anything_runs(name):
    seed("ws", name)
    mod = load(name)
    d = make([500, 300], 2, 2, "bounded")
    need = mod["kda_prefill_workspace_bytes"](800, 2, 2)
    assert need > 16
    fin = torch.full((2, 2, V, K), float("nan"), device=DEV)
    out = torch.full_like(d["v"], float("nan"))
    ws = torch.zeros(need - 1, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="workspace"):
        call(mod, d, "bounded", fin=fin, ws=ws, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(fin).all()


@pytest.mark.parametrize("name", F32)
def test_captured_in_a_cuda_graph_replays_both_paths(name):
    """The guard word is zeroed inside the captured work, so a replay decides again: decaying keys, then a slow key
    copied into the same input buffers."""
    seed("graph", name)
    lens, H = [3000, 1700], 4
    fast = fast_decays(make(lens, H, H, "bounded"))
    slow = slow_key({k: (v.clone() if torch.is_tensor(v) else v) for k, v in fast.items()}, H)
    mod = load(name)
    ws = torch.empty(mod["kda_prefill_workspace_bytes"](sum(lens), 2, H), dtype=torch.uint8, device=DEV)
    d = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in fast.items()}
    fin = torch.empty(2, H, V, K, device=DEV)
    out = torch.empty_like(d["v"])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(mod, d, "bounded", fin=fin, ws=ws, out=out)   # warm-up (module loaded, attributes set)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(mod, d, "bounded", fin=fin, ws=ws, out=out)
    for src, other in ((fast, split_of(name)), (slow, fallback_of(name)), (fast, split_of(name))):
        d["dt_bias"].copy_(src["dt_bias"])
        out.fill_(float("nan"))
        fin.fill_(float("nan"))
        graph.replay()
        want = run_both(name, other, src, "bounded", 2, H)[1]
        assert same((out, fin), want), other


# The route through the public op, in a child process (a process routes a call once; FLASHKDA_EXT_OPT_IN is read then).
_OP_CHILD = r"""
import sys, torch, flashkda_ext as fk
from flashkda_ext import dispatch, validation
a = torch.load(sys.argv[1])
kw = dict(A_log=a["A_log"], dt_bias=a["dt_bias"], gate=a["gate"], lower_bound=a["lb"], cu_seqlens=a["cu"],
          initial_state=a["init"], output_final_state=True, max_seqlen=a["longest"])
meta = validation.check_kda_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw).route_meta()
module = dispatch.module_name("kda_prefill", meta)
out, fin = fk.kda_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)
torch.cuda.synchronize()
torch.save({"module": module, "out": out, "fin": fin}, sys.argv[2])
"""


@pytest.mark.parametrize("lens,H,opt_in,want,gate", [c if len(c) == 5 else (*c, "bounded") for c in [
                                                ([8192], 8, "", "prefill_c16g2_pc8_vt64_f32"),       # c16g_few
                                                ([8192], 8, "chunk64", "prefill_pc8_vt64_f32"),
                                                ([8192], 8, "exact_chain", "prefill_vt16_f32"),
                                                ([8192], 12, "", "prefill_c16g_vt16_f32"),           # c16g_groups
                                                ([8192], 24, "", "prefill_c16g_vt32_f32"),           # c16g_groups_24
                                                ([2048, 2048], 32, "", "prefill_c16g_vt64_f32"),
                                                ([2048, 2048], 32, "chunk64", "prefill_vt64_f32"),
                                                ([1024] * 16, 8, "", "prefill_c16g_vt64_f32"),      # c16g_mid
                                                ([1024] * 16, 16, "", "prefill_c16ws_f32"),         # fused_chunk16_wave
                                                ([1024] * 16, 16, "chunk64", "prefill_vt64s_f32"),
                                                ([4096] * 4, 96, "", "prefill_c16ws_f32"),          # fused_chunk16_long
                                                ([4096] * 4, 96, "chunk64", "prefill_vt64s_f32"),
                                                ([2048] * 4, 48, "", "prefill_c16g_c16_f32"),       # c16g_full
                                                ([1024, 64] * 8, 8, "", "prefill_c16gm_vt64_f32"),  # c16g_mixed
                                                ([1024, 64] * 8, 8, "chunk64", "prefill_vt64_f32"),
                                                ([1024, 64] * 8, 16, "", "prefill_c16ws_f32"),  # wave at 136, not mixed
                                                # the softplus gate's twins of the fused bands (routes *_decay)
                                                ([1024] * 16, 16, "", "prefill_c16ws_f32", "softplus"),  # wave twin
                                                ([1024, 64] * 8, 16, "", "prefill_c16ws_f32", "softplus"),
                                                ([4096] * 4, 96, "", "prefill_c16ws_f32", "softplus"),
                                                ([4096] * 4, 96, "chunk64", "prefill_vt64s_f32", "softplus"),
                                                ([2048] * 4, 48, "", "prefill_c16ws_f32", "softplus"),
                                                ([2048] * 4, 48, "chunk64", "prefill_vt64_f32", "softplus"),
                                                ([512] * 24, 16, "", "prefill_c16ws_f32", "softplus"),
                                                ([1024] * 16, 8, "", "prefill_c16g_vt64_f32", "softplus"),  # mid twin
                                                ([1024] * 16, 8, "chunk64", "prefill_vt64_f32", "softplus")]])
def test_long_prompts_route_to_the_fused_kernels_through_the_op(lens, H, opt_in, want, gate, tmp_path):
    """fk.kda_prefill with the bounded gate at lower_bound -5 takes the guarded split by default at >= 8192 tokens a
    sequence at <= 16 items, >= 2048 from 17 (routes c16g_*) and at 16 x 1024 H8 (c16g_mid), the fused kernel unsplit
    (split by role: prefill_c16ws) at 16 x 1024 H16 (fused_chunk16_wave; both with the longest sequence given, max_seqlen) and 4 x 4096 H96
    (fused_chunk16_long, past 2048 tokens a sequence), the split over several waves at 4 x 2048 H48 (c16g_full), each
    sequence's pieces from its own length at 8 x (1024 + 64) H8 (c16g_mixed: the longest 1.9x the mean), and
    FLASHKDA_EXT_OPT_IN=chunk64 keeps the chunk-64 module; the wave band takes 8 x (1024 + 64) H16 (token-heads 136
    times the longest) ahead of c16g_mixed_many; the softplus gate takes the role split unsplit in the long, full,
    wave and fused_chunk16 bands (fused_chunk16_long_decay, c16g_full_decay, fused_chunk16_wave_decay,
    fused_chunk16_decay) and c16g_mid's split at 16 x 1024 H8 (c16g_mid_decay); the op's result is that module's own
    call bitwise, and right against the float64 recurrence (random gates: the split serves, nothing hands over)."""
    seed("op", want, H, gate)
    lb = -5.0 if gate == "bounded" else None
    d = make(lens, H, H, gate)
    init = torch.randn(len(lens), H, V, K, device=DEV) * 0.5
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(dict(q=d["q"], k=d["k"], v=d["v"], g=d["g"], beta=d["beta"], A_log=d["A_log"], dt_bias=d["dt_bias"],
                    cu=d["cut"], init=init, longest=max(lens), gate=gate, lb=lb), src)
    env = dict(os.environ, FLASHKDA_EXT_OPT_IN=opt_in)
    subprocess.run([sys.executable, "-c", _OP_CHILD, str(src), str(dst)], env=env, check=True, timeout=900)
    res = torch.load(dst)
    assert res["module"] == want
    fin = torch.full((len(lens), H, V, K), float("nan"), device=DEV)
    o = call(load(want), d, gate, init=init, fin=fin)
    torch.cuda.synchronize()
    assert torch.equal(bits(res["out"]), bits(o)) and torch.equal(bits(res["fin"]), bits(fin))
    ro, rf, _ = recurrence(d, gate, lb, init)
    assert rel(o[0], ro) < TOL and rel(fin, rf) < TOL
