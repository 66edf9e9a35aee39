"""GPU tests of the fused 16-token-chunk kernel split by role (jit/modules/prefill_c16ws_cuda.json: prefill_c16ws_f32 /
_bf16, routes fused_chunk16, fused_chunk16_long, fused_chunk16_wave for the bounded gate at lower_bound >= -5, and the
guarded modules' split for every gate; csrc/prefill/kda_prefill_c16ws.cuh; issue 46).

The kernel does prefill_c16's operations in the same order, so every case holds it to prefill_c16 of the same state
dtype bitwise (output and final state), and to the float64 token recurrence (tests/gpu/test_prefill_gpu.py's helpers)
on fresh random inputs, outputs and states NaN-poisoned first: ragged lengths with empty and one-token sequences,
1..9 chunks (every stage and producer parity), 64x512-like batches, grouped heads, int64 cu_seqlens, no initial
state; a pool updated in place (padding, null slot 0, an index past the pool: those slots bitwise unchanged); a second
stream and CUDA-graph replay; every other gate (softplus, log, the bounded gate below -5) on prefill_c16's gate cases,
whose chunks leave the factored range (its fallback, in the producers here); checkpoints refused before anything is
written."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
tvm_ffi = pytest.importorskip("tvm_ffi")
from gpu_common import bits, records_by_name, seed  # noqa: E402
from test_prefill_c16_gpu import CASES as C16_CASES  # noqa: E402
from test_prefill_c16_gpu import GATE_CASES, gate_inputs  # noqa: E402
from test_prefill_gpu import DEV, K, TOL, V, call, load, make, recurrence, rel, sdtype  # noqa: E402

RECS = records_by_name("prefill_c16ws_cuda.json")
NAMES = list(RECS)


def twin(name):
    """prefill_c16 of the same state dtype: the kernel this one must equal bitwise."""
    return name.replace("prefill_c16ws_", "prefill_c16_")


# prefill_c16's cases, and sequences of 1..9 chunks (every stage and both producers' parities)
CASES = C16_CASES + [dict(id="chunks_1_to_9", lens=[2, 17, 33, 49, 65, 80, 97, 113, 144], H=4, HV=4, init=True)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bitwise_prefill_c16_and_the_recurrence(name, case):
    seed(name, case["id"])
    st = sdtype(RECS[name])
    d = make(case["lens"], case["H"], case["HV"], "bounded", cu64=case.get("cu64", False))
    N, HV = len(case["lens"]), case["HV"]
    init = (torch.randn(N, HV, V, K, device=DEV) * 0.5).to(st) if case.get("init") else None
    fin = torch.full((N, HV, V, K), float("nan"), device=DEV).to(st)
    o = call(load(name), d, "bounded", init=init, fin=fin)
    fin_b = torch.full_like(fin, float("nan"))
    o_b = call(load(twin(name)), d, "bounded", init=init, fin=fin_b)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any() and not torch.isnan(fin.float()).any()
    assert torch.equal(bits(o), bits(o_b)), "output differs from prefill_c16"
    assert torch.equal(bits(fin), bits(fin_b)), "final state differs from prefill_c16"
    ro, rf, _ = recurrence(d, "bounded", -5.0, init)
    eo, ef = rel(o[0], ro), rel(fin, rf)
    assert eo < TOL and ef < TOL, f"out {eo:.3e} state {ef:.3e}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", GATE_CASES, ids=[c["id"] for c in GATE_CASES])
def test_every_gate_bitwise_prefill_c16_and_the_recurrence(name, case):
    """The checked gates: the producers take a chunk beyond the factored range elementwise (or shifted) as prefill_c16
    does, so the same bits; finite, and within TOL of the recurrence."""
    seed("gates", name, case["id"])
    d, gate, lb, init = gate_inputs(case, sdtype(RECS[name]))
    fin, fin_b = torch.full_like(init, float("nan")), torch.full_like(init, float("nan"))
    o = call(load(name), d, gate, lb=lb, init=init, fin=fin)
    o_b = call(load(twin(name)), d, gate, lb=lb, init=init, fin=fin_b)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(fin.float()).all()
    assert torch.equal(bits(o), bits(o_b)), "output differs from prefill_c16"
    assert torch.equal(bits(fin), bits(fin_b)), "final state differs from prefill_c16"
    ro, rf, _ = recurrence(d, gate, lb, init)
    eo, ef = rel(o[0], ro), rel(fin, rf)
    assert eo < TOL and ef < TOL, f"out {eo:.3e} state {ef:.3e}"


@pytest.mark.parametrize("name", NAMES)
def test_pool_in_place(name):
    seed(name, "pool")
    st = sdtype(RECS[name])
    d = make([300, 0, 17, 64, 1], 4, 4, "bounded")
    pool = (torch.randn(9, 4, V, K, device=DEV) * 0.5).to(st)
    idx = torch.tensor([3, 0, 5, -1, 9], dtype=torch.int32, device=DEV)  # null slot 0, padding, past the pool
    p1, p2 = pool.clone(), pool.clone()
    o1 = call(load(name), d, "bounded", init=p1, fin=p1, idx=idx, null0=True)
    o2 = call(load(twin(name)), d, "bounded", init=p2, fin=p2, idx=idx, null0=True)
    torch.cuda.synchronize()
    assert torch.equal(bits(o1), bits(o2)) and torch.equal(bits(p1), bits(p2))
    assert not torch.equal(bits(p1[3]), bits(pool[3])) and not torch.equal(bits(p1[5]), bits(pool[5]))
    for s in (0, 1, 2, 4, 6, 7, 8):
        assert torch.equal(bits(p1[s]), bits(pool[s])), s


@pytest.mark.parametrize("name", NAMES)
def test_second_stream_and_graph_replay(name):
    seed(name, "graph")
    st = sdtype(RECS[name])
    mod = load(name)
    d = make([300, 77, 1000], 16, 16, "bounded")
    init = torch.randn(3, 16, V, K, device=DEV).to(st)
    fin_e, out_e = torch.empty_like(init), torch.empty_like(d["v"])
    call(mod, d, "bounded", init=init, fin=fin_e, out=out_e)
    fin_s, out_s = torch.full_like(init, float("nan")), torch.full_like(d["v"], float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(mod, d, "bounded", init=init, fin=fin_s, out=out_s)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(bits(out_s), bits(out_e)) and torch.equal(bits(fin_s), bits(fin_e))
    fin_g, out_g = torch.full_like(init, float("nan")), torch.full_like(d["v"], float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(mod, d, "bounded", init=init, fin=fin_g, out=out_g)
    fin_g.fill_(float("nan"))
    out_g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out_g), bits(out_e)) and torch.equal(bits(fin_g), bits(fin_e))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("gate,lb,ckpt,arg", [("bounded", -5.0, True, "checkpoints"), ("softplus", -5.0, True, "checkpoints")])
def test_refused_before_anything_is_written(name, gate, lb, ckpt, arg):
    st = sdtype(RECS[name])
    d = make([40, 7], 2, 2, gate)
    out = torch.full_like(d["v"], float("nan"))
    init = torch.randn(2, 2, V, K, device=DEV).to(st)
    fin = torch.full_like(init, float("nan"))
    ck = torch.full((3, 2, V, K), float("nan"), device=DEV).to(st) if ckpt else None
    with pytest.raises(Exception, match=arg):
        call(load(name), d, gate, lb=lb, init=init, fin=fin, ckpt=ck, every=16 if ckpt else 0, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(fin.float()).all()
