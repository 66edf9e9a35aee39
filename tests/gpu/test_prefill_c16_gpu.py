"""GPU tests of the fused 16-token-chunk prefill modules (jit/modules/prefill_c16_cuda.json: prefill_c16_f32 / _bf16,
opt-in route c16, and their piece-split twins prefill_c16p_*, opt-in c16p; csrc/prefill/kda_prefill_c16.cuh; issue 46).

Against the float64 token recurrence (tests/gpu/test_prefill_gpu.py's helpers) on fresh random inputs, every output
NaN-poisoned first: ragged lengths (0, 1, 15, 16, 17, 100, 1000), 64x512 H16 subsets, grouped heads, int32 / int64
cu_seqlens, dense and pool states (padding, null slot 0, an index past the pool, in place, a strided pool), final state
checked, bitwise determinism; beside it the routed chunk-64 module on the same inputs (today's accuracy), which the
module must not fall behind by more than 25%. Every gate: softplus and log gates, and decays that leave the factored
operands' range (extreme softplus, a log gate of -300 a token, the bounded gate at lower_bound -8), in every chunk or
in some (test_gates: the kernel's elementwise fallback, chunk by chunk). The module refuses checkpoints (nothing
written). The piece-split twins run every case (most of them split, few sequences x heads) and test_pieces holds them
to the unsplit module: piece 0's rows bitwise, the rest within 1.1x its error.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
tvm_ffi = pytest.importorskip("tvm_ffi")
from gpu_common import bits, paged_like, records_by_name, seed  # noqa: E402
from test_prefill_gpu import DEV, GATES, K, TOL, V, call, load, make, recurrence, rel, sdtype  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from warmup_lengths import c16_split  # noqa: E402

RECS = records_by_name("prefill_c16_cuda.json")
NAMES = list(RECS)
BASE = {"float32": "prefill_vt64_f32", "bfloat16": "prefill_vt64_bf16"}  # a routed chunk-64 module of each state dtype


def pieces_of(rec, N, HV, tokens):
    """The pieces the binding picks (kda_prefill_c16_launch.h, c16_split, mirrored by scripts/warmup_lengths.c16_split:
    2 CTAs an SM, the mean sequence's chunks), at most params.pieces."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    return c16_split(rec["params"].get("pieces", 1), rec["min_blocks"] * sms, HV * N, -(-(tokens // N) // 16))


def module_and_state_dtype(name):
    """The loaded module `name` and the torch dtype of its state."""
    return load(name), sdtype(RECS[name])


CASES = [
    dict(id="ragged_h4", lens=[1, 15, 16, 17, 100, 1000], H=4, HV=4, init=True),
    dict(id="empty_and_short_h2", lens=[0, 33, 0, 16, 5, 1, 0], H=2, HV=2, init=True),
    dict(id="one_token_h1", lens=[1], H=1, HV=1),
    dict(id="b4_t512_h16", lens=[512] * 4, H=16, HV=16, init=True, cu64=True),
    dict(id="b2_t512_h16_no_init", lens=[512] * 2, H=16, HV=16),
    dict(id="gva_h2_hv8", lens=[100, 300, 7], H=2, HV=8, init=True),
    dict(id="t2048_h2", lens=[2048], H=2, HV=2, init=True),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_against_recurrence(name, case):
    seed(name, case["id"])
    mod, st = module_and_state_dtype(name)
    d = make(case["lens"], case["H"], case["HV"], "bounded", cu64=case.get("cu64", False))
    N, HV = len(case["lens"]), case["HV"]
    init = (torch.randn(N, HV, V, K, device=DEV) * 0.5).to(st) if case.get("init") else None
    ro, rf, _ = recurrence(d, "bounded", -5.0, init)
    fin = torch.full((N, HV, V, K), float("nan"), device=DEV).to(st)
    o = call(mod, d, "bounded", init=init, fin=fin)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any() and not torch.isnan(fin.float()).any()
    eo, ef = rel(o[0], ro), rel(fin, rf)
    assert eo < TOL and ef < TOL, f"out {eo:.3e} state {ef:.3e}"
    for n, L in enumerate(case["lens"]):  # an empty sequence's final state is its initial state, bitwise
        if L == 0:
            want = init[n] if init is not None else torch.zeros_like(fin[n])
            assert torch.equal(bits(fin[n]), bits(want)), n
    # deterministic, bitwise
    fin2 = torch.full_like(fin, float("nan"))
    o2 = call(mod, d, "bounded", init=init, fin=fin2)
    torch.cuda.synchronize()
    assert torch.equal(bits(o2), bits(o)) and torch.equal(bits(fin2), bits(fin))


def wide_decays(d, gate, rows):
    """Decays that leave the factored range (more than 116 log2 units, 80 nats, over a 16-token chunk) on `rows` of the
    tokens: softplus ~22-36 nats a token (A_log in [-1, -0.5]), a log gate of up to -300 a token."""
    g = d["g"].float()
    if gate == "softplus":
        g[:, rows] = torch.randn_like(g[:, rows]) * 2 + 60.0
    else:
        g[:, rows] = -300.0 * torch.rand_like(g[:, rows])
    d["g"] = g.bfloat16()
    return d


GATE_CASES = [
    dict(id="softplus_ragged", gate="softplus", lens=[1, 15, 16, 17, 100, 1000], H=4),
    dict(id="softplus_extreme", gate="softplus", lens=[300, 37, 16], H=2, extreme=True),   # every chunk falls back
    dict(id="softplus_some_chunks_wide", gate="softplus", lens=[40, 16, 300], H=4, wide=[(16, 32), (100, 106)]),
    # one token a burst (~30-50 log2 units): its quarter is below a quarter of the range, the chunk's G_C within it
    # (the role split's producers check the chunk and find nothing beyond)
    dict(id="softplus_one_token_bursts", gate="softplus", lens=[40, 300], H=4, wide=[(20, 21), (100, 101), (237, 238)]),
    dict(id="softplus_some_keys_wide", gate="softplus", lens=[1, 40, 16, 300], H=4, wide_keys=5),   # every chunk
    dict(id="softplus_keys_shifted", gate="softplus", lens=[1, 40, 16, 300], H=4, wide_keys=9, shifted=True),
    dict(id="log", gate="log", lens=[1, 15, 16, 17, 100, 700], H=4),
    dict(id="log_some_keys_wide", gate="log", lens=[200, 33], H=2, wide_keys=7),
    dict(id="log_keys_shifted", gate="log", lens=[200, 33], H=2, wide_keys=6, shifted=True),
    dict(id="log_some_chunks_wide", gate="log", lens=[200, 33], H=2, wide=[(0, 5), (64, 80)]),
    dict(id="softplus_gva", gate="softplus", lens=[100, 300, 7], H=2, HV=8),
    dict(id="bounded_lb8_near_bound", gate="bounded", lb=-8.0, lens=[40, 16, 300], H=4, near_bound=True),
]


def gate_inputs(case, st):
    """(inputs, gate, lower_bound, initial state) of a GATE_CASES case, the state in dtype st."""
    gate, lb = case["gate"], case.get("lb", -5.0)
    H, HV, lens = case["H"], case.get("HV", case["H"]), case["lens"]
    d = make(lens, H, HV, gate, extreme=case.get("extreme", False))
    for a, b in case.get("wide", []):
        wide_decays(d, gate, slice(a, b))
    if case.get("wide_keys"):  # a few keys a head decay by > 5 nats a token in every chunk, the rest as random;
        nk = case["wide_keys"]  # shifted: 5-10 nats (G_C within twice the factored range), else far more
        if gate == "softplus":
            d["dt_bias"].view(HV, K)[:, :nk] = 14.0 if case.get("shifted") else 40.0
        else:
            g = d["g"].float()
            g[..., :nk] = (-2.0 * torch.rand_like(g[..., :nk]) - 5.5 if case.get("shifted")
                           else -30.0 * torch.rand_like(g[..., :nk]) - 6.0)
            d["g"] = g.bfloat16()
    if case.get("near_bound"):
        d["g"] = (torch.randn_like(d["g"].float()) + 6.0).bfloat16()  # sigmoid ~1: every step near the bound
    init = (torch.randn(len(lens), HV, V, K, device=DEV) * 0.5).to(st)
    return d, gate, lb, init


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", GATE_CASES, ids=[c["id"] for c in GATE_CASES])
def test_gates(name, case):
    """Every gate against the float64 recurrence, finite, deterministic; where a chunk's keys leave the factored range
    (extreme, wide, wide_keys, near_bound at lower_bound -8) the kernel adds those keys' terms of L and Aqk elementwise."""
    seed("gates", name, case["id"])
    mod, st = module_and_state_dtype(name)
    d, gate, lb, init = gate_inputs(case, st)
    ro, rf, _ = recurrence(d, gate, lb, init)
    fin = torch.full_like(init, float("nan"))
    o = call(mod, d, gate, lb=lb, init=init, fin=fin)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(fin.float()).all()
    eo, ef = rel(o[0], ro), rel(fin, rf)
    assert eo < TOL and ef < TOL, f"out {eo:.3e} state {ef:.3e}"
    fin2 = torch.full_like(fin, float("nan"))
    o2 = call(mod, d, gate, lb=lb, init=init, fin=fin2)
    torch.cuda.synchronize()
    assert torch.equal(bits(o2), bits(o)) and torch.equal(bits(fin2), bits(fin))


ACC_CASES = [
    dict(id="b8_t512_h16", lens=[512] * 8, H=16),
    dict(id="ragged_h8", lens=[1, 15, 16, 17, 100, 1000, 3000], H=8),
    dict(id="b8_t512_h16_softplus", lens=[512] * 8, H=16, gate="softplus"),
    dict(id="ragged_h8_log", lens=[1, 15, 16, 17, 100, 1000, 3000], H=8, gate="log"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", ACC_CASES, ids=[c["id"] for c in ACC_CASES])
def test_accuracy_no_worse_than_chunk64(name, case):
    """Today's accuracy (rel. L2 ~4e-3 out and state against float64): the chunk-64 module on the same inputs."""
    seed("acc", name, case["id"])
    rec = RECS[name]
    st = sdtype(rec)
    H, N, gate = case["H"], len(case["lens"]), case.get("gate", "bounded")
    d = make(case["lens"], H, H, gate)
    init = (torch.randn(N, H, V, K, device=DEV) * 0.5).to(st)
    ro, rf, _ = recurrence(d, gate, -5.0, init)
    res = {}
    for m in (name, BASE[rec["state_dtype"]]):
        fin = torch.full((N, H, V, K), float("nan"), device=DEV).to(st)
        o = call(load(m), d, gate, init=init, fin=fin)
        torch.cuda.synchronize()
        res[m] = (rel(o[0], ro), rel(fin, rf))
    (eo, ef), (bo, bf) = res[name], res[BASE[rec["state_dtype"]]]
    msg = f"{name}: out {eo:.3e} state {ef:.3e}; {BASE[rec['state_dtype']]}: out {bo:.3e} state {bf:.3e}"
    print(msg)
    assert eo < TOL and ef < TOL, msg
    assert eo <= 1.25 * bo + 1e-4 and ef <= 1.25 * bf + 1e-4, msg


@pytest.mark.parametrize("name", NAMES)
def test_lower_bound_edge_and_probability_beta(name):
    """lower_bound -5 exactly with gates near the bound (|G| of a chunk near 16 x 5 nats: the factored operands'
    range), A_log / dt_bias absent, and beta given as a probability (beta_is_logit false)."""
    seed("edge", name)
    rec = RECS[name]
    st = sdtype(rec)
    d = make([40, 16, 300], 4, 4, "bounded")
    d["g"] = (torch.randn_like(d["g"].float()) + 6.0).bfloat16()  # sigmoid ~1: every step near the bound
    d["A_log"] = d["dt_bias"] = None
    d["beta"] = torch.sigmoid(d["beta"].float()).bfloat16()
    init = (torch.randn(3, 4, V, K, device=DEV) * 0.5).to(st)
    dd = dict(d, beta=torch.logit(d["beta"].double()).float())  # the reference takes a logit
    ro, rf, _ = recurrence(dd, "bounded", -5.0, init)
    fin = torch.full_like(init, float("nan"))
    out = torch.full_like(d["v"], float("nan"))
    with tvm_ffi.use_torch_stream():
        load(name)["kda_prefill"](d["q"], d["k"], d["v"], d["g"], d["beta"], None, None, d["cut"], init, fin, None,
                                  None, out, None, GATES["bounded"], -5.0, K ** -0.5, False, False, 0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(fin.float()).all()
    assert rel(out[0], ro) < TOL and rel(fin, rf) < TOL, (rel(out[0], ro), rel(fin, rf))


@pytest.mark.parametrize("name", NAMES)
def test_pool_in_place(name):
    seed("pool", name)
    mod, st = module_and_state_dtype(name)
    d = make([200, 64, 90, 33, 5], 4, 4, "bounded")
    slots = 9
    mem = (torch.randn(slots + 1, 4, V, K, device=DEV) * 0.5).to(st)  # the last slot is a guard
    pool, guard = mem[:slots], mem[slots].clone()
    pool0 = pool.clone()
    idx = torch.tensor([5, -1, 0, 2, slots], dtype=torch.int32, device=DEV)  # padding, null slot 0, past the pool
    ro, rf, _ = recurrence(d, "bounded", -5.0, pool0, idx=[5, -1, 0, 2, -1], null0=True)
    o = call(mod, d, "bounded", init=pool, fin=pool, idx=idx, null0=True)
    torch.cuda.synchronize()
    assert rel(o[0], ro) < TOL
    assert rel(pool[5], rf[0]) < TOL and rel(pool[2], rf[3]) < TOL
    for s in (0, 1, 3, 4, 6, 7, 8):
        assert torch.equal(bits(pool[s]), bits(pool0[s])), s
    assert torch.equal(bits(mem[slots]), bits(guard))


@pytest.mark.parametrize("name", NAMES)
def test_strided_pool_equals_the_dense_pool_bitwise(name):
    seed("strided", name)
    mod, st = module_and_state_dtype(name)
    d = make([200, 1, 64, 0, 90, 33], 4, 4, "bounded")
    dense = (torch.randn(11, 4, V, K, device=DEV) * 0.5).to(st)
    pages, pool, filler = paged_like(dense, seed=5)
    pages0 = pages.clone()
    idx = torch.tensor([5, 9, -1, 7, 0, 2], dtype=torch.int32, device=DEV)
    outs = [call(mod, d, "bounded", init=p, fin=p, idx=idx, null0=True) for p in (pool, dense)]
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    assert torch.equal(bits(pool), bits(dense))
    assert torch.equal(bits(filler(pages)), bits(filler(pages0)))


@pytest.mark.parametrize("name", NAMES)
def test_refuses_what_the_route_never_sends(name):
    mod, st = module_and_state_dtype(name)
    d = make([40, 20], 2, 2, "bounded")
    fin = torch.full((2, 2, V, K), float("nan"), device=DEV).to(st)
    out = torch.full_like(d["v"], float("nan"))
    with pytest.raises(ValueError, match="lower_bound"):  # the common check: finite and < 0
        call(mod, d, "bounded", lb=0.5, fin=fin, out=out)
    ckpt = torch.full((2, 1, 2, V, K), float("nan"), device=DEV).to(st)
    with pytest.raises(ValueError, match="checkpoints"):
        call(mod, d, "bounded", fin=fin, out=out, ckpt=ckpt, every=16)
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(fin.float()).all() and torch.isnan(ckpt.float()).all()
    assert mod["kda_prefill_workspace_bytes"](1000, 3, 2) == 0


PIECE_NAMES = [n for n in NAMES if RECS[n]["params"].get("pieces", 1) > 1]
PIECE_CASES = [
    dict(id="b1_t4096_h2", lens=[4096], H=2),
    dict(id="b2_t3000_h8", lens=[3000, 1700], H=8),
    dict(id="ragged_h4", lens=[0, 1, 2000, 17, 900, 16], H=4),
    dict(id="b1_t4096_h2_softplus", lens=[4096], H=2, gate="softplus"),
    dict(id="b4_t2048_h24_waves", lens=[2048] * 4, H=24),   # 96 items: 8 pieces in 3 waves (c16_split)
]


@pytest.mark.parametrize("name", PIECE_NAMES)
@pytest.mark.parametrize("case", PIECE_CASES, ids=[c["id"] for c in PIECE_CASES])
def test_pieces(name, case):
    """Against the unsplit module (the same record without pieces): piece 0's chunks are the same operations, bitwise;
    the other pieces start from zero after a warm-up that drops < 2^-24 of the state, so they are held to the float64
    recurrence like the unsplit module (1.1x its error + 1e-4). The final state comes from the last piece."""
    seed("pieces", name, case["id"])
    rec = RECS[name]
    base = name.replace("prefill_c16p_", "prefill_c16_")
    st = sdtype(rec)
    H, N, lens = case["H"], len(case["lens"]), case["lens"]
    P = pieces_of(rec, N, H, sum(lens))
    assert P > 1, P
    gate = case.get("gate", "bounded")
    d = make(lens, H, H, gate)
    init = (torch.randn(N, H, V, K, device=DEV) * 0.5).to(st)
    ro, rf, _ = recurrence(d, gate, -5.0, init)
    res = {}
    for m in (name, base):
        fin = torch.full((N, H, V, K), float("nan"), device=DEV).to(st)
        res[m] = (call(load(m), d, gate, init=init, fin=fin), fin)
    torch.cuda.synchronize()
    (o, fin), (ob, finb) = res[name], res[base]
    assert not torch.isnan(o).any() and not torch.isnan(fin.float()).any()
    eo, ef, bo, bf = rel(o[0], ro), rel(fin, rf), rel(ob[0], ro), rel(finb, rf)
    msg = f"{name} (P={P}) out {eo:.3e} state {ef:.3e}; {base} out {bo:.3e} state {bf:.3e}"
    print(msg)
    assert eo < TOL and ef < TOL, msg
    assert eo <= 1.1 * bo + 1e-4 and ef <= 1.1 * bf + 1e-4, msg
    rows, start = [], 0
    for L in lens:  # piece 0's tokens of each sequence
        per = -(-(-(-L // 16)) // P)
        rows.extend(range(start, start + min(L, per * 16)))
        start += L
    rows = torch.tensor(rows, dtype=torch.long, device=DEV)
    assert torch.equal(bits(o[0, rows]), bits(ob[0, rows])), "piece 0 is not bitwise the unsplit module: " + msg
    o2 = call(load(name), d, gate, init=init, fin=torch.full_like(fin, float("nan")))
    torch.cuda.synchronize()
    assert torch.equal(bits(o2), bits(o))


@pytest.mark.parametrize("name", PIECE_NAMES)
def test_pieces_in_place_pool_runs_unsplit(name):
    """initial_state is final_state (a pool updated in place): the binding runs the call unsplit, so it is bitwise the
    unsplit module (a piece reading the initial state could otherwise race the last piece's store)."""
    seed("inplace", name)
    rec = RECS[name]
    st = sdtype(rec)
    d = make([3000, 40], 2, 2, "bounded")
    pool = (torch.randn(4, 2, V, K, device=DEV) * 0.5).to(st)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    pools, outs = [], []
    for m in (name, name.replace("prefill_c16p_", "prefill_c16_")):
        p = pool.clone()
        outs.append(call(load(m), d, "bounded", init=p, fin=p, idx=idx))
        pools.append(p)
    torch.cuda.synchronize()
    assert torch.equal(bits(outs[0]), bits(outs[1])) and torch.equal(bits(pools[0]), bits(pools[1]))


@pytest.mark.parametrize("gate", ["bounded", "softplus", "log"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_public_op_routes_the_band_to_c16(state_dtype, gate):
    """flashkda_ext.kda_prefill at >= 384 sequences x heads of short sequences (routes fused_chunk16, bounded at
    lower_bound -5, and fused_chunk16_decay, softplus and log) takes prefill_c16ws, the fused kernel split by role: its
    output and final state are bitwise prefill_c16's called directly; with FLASHKDA_EXT_OPT_IN=chunk64, or the bounded
    gate at lower_bound -5.5, the same shape stays on the chunk-64 modules. (The route table's every band edge:
    tests/test_routes.py, on the CPU.)"""
    import flashkda_ext
    from flashkda_ext import dispatch
    seed("public_op", str(state_dtype), gate)
    lens = [int(x) for x in torch.randint(1, 300, (48,))]
    d = make(lens, 8, 8, gate)
    N, HV = len(lens), 8
    init = (torch.randn(N, HV, V, K, device=DEV) * 0.5).to(state_dtype)
    kw = dict(lower_bound=-5.0) if gate == "bounded" else {}
    o, fin = flashkda_ext.kda_prefill(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=d["A_log"], dt_bias=d["dt_bias"],
                                      gate=gate, cu_seqlens=d["cut"], initial_state=init, **kw)
    tag = "f32" if state_dtype == torch.float32 else "bf16"
    fin_m = torch.full_like(init, float("nan"))
    o_m = call(load(f"prefill_c16_{tag}"), d, gate, init=init, fin=fin_m)
    torch.cuda.synchronize()
    assert torch.equal(bits(o), bits(o_m)) and torch.equal(bits(fin), bits(fin_m))
    meta = dict(backend="cuda", num_seqs=N, value_heads=HV, total_tokens=sum(lens), max_seqlen=None, state=tag,
                offset="o32", gate=gate, checkpoints=False)
    from flashkda_ext.validation import prefill_route_meta
    m = prefill_route_meta(**meta, lower_bound=kw.get("lower_bound"))
    assert dispatch.module_name("kda_prefill", m, ()) == f"prefill_c16ws_{tag}"
    assert dispatch.module_name("kda_prefill", m, {"chunk64"}) == f"prefill_vt64s_{tag}"
    if gate == "bounded":
        m = prefill_route_meta(**meta, lower_bound=-5.5)
        assert not dispatch.module_name("kda_prefill", m, ()).startswith("prefill_c16")
    ref_o, ref_f, _ = recurrence(d, gate, -5.0, init)
    assert rel(o[0], ref_o) < TOL and rel(fin, ref_f) < TOL
