"""GPU tests of the two-stage guarded split (route c16g_few; jit/modules/prefill_c16g2_cuda.json): the fused
16-token-chunk kernel in pieces, guarded by the chunk-64 piece split of prefill_pc8_vt64_<state>, itself guarded by the
unsplit chain at V tile 16 (kda_chain_decide_kernel picks the one before either runs). fp32 and bf16 state twins.

Which path served is read off the bits, as in test_prefill_c16g_gpu.py: decaying keys give prefill_c16p_<state>'s bits
(the fused split); one key a head whose warm-up is a few hundred tokens (past the fused pieces' limit, within a chunk-64
piece) gives prefill_pc8_vt64_<state>'s; a key that barely decays gives prefill_vt16_<state>'s (the chain). Each is also
held to the float64 recurrence, outputs NaN-poisoned first, out of place, on a pool updated in place and replayed from
one CUDA graph (both guard words are zeroed inside the captured work, so every replay decides again).
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

NAMES = {"f32": "prefill_c16g2_pc8_vt64_f32", "bf16": "prefill_c16g2_pc8_vt64_bf16"}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
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
    """(out, final state) of module `name` on d (the state in init's dtype), outputs NaN-poisoned first."""
    fin = torch.full((len(LENS), H, V, K), float("nan"), device=DEV).to(init.dtype)
    o = call(load(name), d, "bounded", init=init, fin=fin)
    torch.cuda.synchronize()
    return o, fin


def check(state, d, other, init):
    (o, fin), ref = run(NAMES[state], d, init), run(f"{other}_{state}", d, init)
    assert not torch.isnan(o).any() and not torch.isnan(fin.float()).any()
    assert same((o, fin), ref), f"not {other}_{state}'s bits"
    ro, rf, _ = recurrence(d, "bounded", -5.0, init)
    assert rel(o[0], ro) < TOL and rel(fin, rf) < TOL, (rel(o[0], ro), rel(fin, rf))


def initial(state):
    return (torch.randn(1, H, V, K, device=DEV) * 0.5).to(DTYPES[state])


PATHS = {"fast": (fast_decays, "prefill_c16p"), "moderate": (moderate_key, "prefill_pc8_vt64"),
         "slow": (lambda x: slow_key(x, H), "prefill_vt16")}


@pytest.mark.parametrize("state", list(NAMES))
def test_decaying_keys_are_the_fused_split(state):
    seed("c16g2", "fast", state)
    d = fast_decays(make(LENS, H, H, "bounded"))
    check(state, d, "prefill_c16p", initial(state))


@pytest.mark.parametrize("state", list(NAMES))
def test_a_moderately_decaying_key_is_the_chunk64_piece_split(state):
    seed("c16g2", "moderate", state)
    d = moderate_key(make(LENS, H, H, "bounded"))
    w64 = warmups(d, 1024)   # 8 chunk-64 pieces of 1024 tokens (one wave holds 2 tiles x 2 heads x 8)
    assert 16 * 16 < max(w64) <= 960, w64   # past the fused pieces' limit (<= 16 chunks of 16), within a piece
    check(state, d, "prefill_pc8_vt64", initial(state))


@pytest.mark.parametrize("state", list(NAMES))
def test_a_slowly_decaying_key_is_the_unsplit_chain(state):
    seed("c16g2", "slow", state)
    d = slow_key(make(LENS, H, H, "bounded"), H)
    assert max(warmups(d, 1024)) > 1024
    check(state, d, "prefill_vt16", initial(state))


@pytest.mark.parametrize("state", list(NAMES))
@pytest.mark.parametrize("key", list(PATHS))
def test_a_pool_updated_in_place_is_the_call_out_of_place(key, state):
    """Each path on a pool of 3 slots, the call's at slot 2: the same bits as out of place, the other slots unchanged."""
    seed("c16g2", "inplace", key, state)
    d = PATHS[key][0](make(LENS, H, H, "bounded"))
    pool = (torch.randn(3, H, V, K, device=DEV) * 0.5).to(DTYPES[state])
    mod = load(NAMES[state])
    fin = torch.full((1, H, V, K), float("nan"), device=DEV).to(pool.dtype)
    o_ref = call(mod, d, "bounded", init=pool[2:3].clone(), fin=fin)
    p = pool.clone()
    o = call(mod, d, "bounded", init=p, fin=p, idx=torch.tensor([2], dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
    assert same((o, p[2:3]), (o_ref, fin)), f"{key}: in place differs from out of place"
    assert torch.equal(p[:2], pool[:2]), "a slot the call does not own changed"


def test_one_captured_graph_replays_every_path():
    """Captured once on decaying keys, replayed with each path's gate parameters copied into the same buffers (fast,
    moderate, slow, fast): every replay takes its path's bits, so neither guard word carries over from a replay."""
    seed("c16g2", "graph")
    base = make(LENS, H, H, "bounded")
    draws = {key: fn({k: (v.clone() if torch.is_tensor(v) else v) for k, v in base.items()})
             for key, (fn, _) in PATHS.items()}
    mod = load(NAMES["f32"])
    d = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in draws["fast"].items()}
    init = initial("f32")
    ws = torch.empty(mod["kda_prefill_workspace_bytes"](sum(LENS), 1, H), dtype=torch.uint8, device=DEV)
    fin = torch.empty(1, H, V, K, device=DEV)
    out = torch.empty_like(d["v"])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(mod, d, "bounded", init=init, fin=fin, ws=ws, out=out)   # warm-up (module loaded, attributes set)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(mod, d, "bounded", init=init, fin=fin, ws=ws, out=out)
    for key in ("fast", "moderate", "slow", "fast"):
        d["A_log"].copy_(draws[key]["A_log"])
        d["dt_bias"].copy_(draws[key]["dt_bias"])
        out.fill_(float("nan"))
        fin.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = run(f"{PATHS[key][1]}_f32", draws[key], init)
        assert same((out, fin), want), key
