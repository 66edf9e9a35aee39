"""GPU tests of the CUDA kda_decode modules (csrc/decode) against the PyTorch reference.

Every module record of jit/modules/decode_cuda.json (so every route's module, and the _gb32 twins that
read g and beta as fp32: fed fp32 values bf16 cannot hold) x fp32/bf16 state x slot modes; each _gb32
twin given bf16-exact fp32 g / beta equals its bf16 module bitwise; the public op with fp32 / mixed
g and beta. Fresh random inputs each case; outputs NaN-poisoned first; every pool slot not
addressed stays bitwise unchanged; padding rows are exact zeros; repeated slots apply in row order;
bitwise determinism; CUDA-graph replay == eager bitwise; non-default streams; 64-bit slot offsets on
a pool of more than 2^31 elements.

Modules load through flashkda_ext.jit.load_module (an AOT directory in $FLASHKDA_EXT_AOT_DIR first);
the ones the selected tests call and no AOT directory holds are JIT-built in parallel up front.
"""
from __future__ import annotations

import json
import sys
import types
import zlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
GATES = {"softplus": 0, "bounded": 1, "log": 2}
K = V = 128


def _reference():
    try:
        from flashkda_ext import reference
        return reference
    except Exception:  # package init not importable on its own (bring-up): load the subpackage alone
        if "flashkda_ext" not in sys.modules or not hasattr(sys.modules["flashkda_ext"], "__path__"):
            stub = types.ModuleType("flashkda_ext")
            stub.__path__ = [str(ROOT / "flashkda_ext")]
            sys.modules["flashkda_ext"] = stub
        import importlib
        return importlib.import_module("flashkda_ext.reference")


REF = _reference()
from gpu_common import bits, module_records, packed_rows, paged_like, prebuild_selected, rel_l2, sdtype, slot_list  # noqa: E402,E501

RECORDS = module_records("decode_cuda.json")


@pytest.fixture(scope="module", autouse=True)
def _prebuild(request):
    prebuild_selected(request)


def load(name):
    from flashkda_ext.jit import load_module  # built or loaded once per process
    return load_module(name)


def gb_f32(rec):
    """True for the _gb32 twins, which read g and beta as fp32."""
    return bool(rec["params"].get("gb_f32"))


def gb_dtype(rec):
    return torch.float32 if gb_f32(rec) else torch.bfloat16


def make_inputs(rows, H, HV, gate, gen, device="cuda", gb=torch.bfloat16):
    """q, k, v bf16; g and beta in gb (fp32: values bf16 cannot hold, read as they are)."""
    r = lambda *s: torch.randn(*s, generator=gen, device=device)
    q = r(rows, H, K).to(torch.bfloat16)
    k = r(rows, H, K).to(torch.bfloat16)
    v = r(rows, HV, V).to(torch.bfloat16)
    if gate == "log":
        g = (-torch.nn.functional.softplus(r(rows, HV, K))).to(gb)
    else:
        g = (r(rows, HV, K) - 1.0).to(gb)
    beta = r(rows, HV).to(gb)
    A_log = (torch.rand(HV, generator=gen, device=device) * 2.5 - 2.0).float()
    dt_bias = (r(HV * K) * 0.5).float()
    return q, k, v, g, beta, A_log, dt_bias


def make_pool(slots, HV, dtype, gen):
    return (torch.randn(slots, HV, V, K, generator=gen, device="cuda") * 0.5).to(dtype)


def call(name, q, k, v, g, beta, A_log, dt_bias, pool, idx, out, gate, lb=-5.0, scale=None,
         beta_is_logit=True, null_slot0=False):
    scale = K ** -0.5 if scale is None else scale
    load(name)["kda_decode"](q, k, v, g, beta, A_log, dt_bias, pool, idx, out, GATES[gate],
                             float(lb), float(scale), bool(beta_is_logit), bool(null_slot0))


def reference(q, k, v, g, beta, A_log, dt_bias, pool, idx, gate, lb=-5.0, scale=None,
              beta_is_logit=True, null_slot0=False, sequential=False):
    """(out fp64 [rows,HV,V], dict slot -> new state in pool dtype) without cloning the pool."""
    kw = dict(gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lb if gate == "bounded" else None,
              scale=scale, beta_is_logit=beta_is_logit)
    rows = q.shape[0]
    il = idx.tolist()
    is_pad = lambda i: i < 0 or (null_slot0 and i == 0)
    if sequential:  # the package reference, on just the slots used (the pool may be huge)
        used = sorted({i for i in il if not is_pad(i)})
        remap = {s: j for j, s in enumerate(used)}
        small = pool[used].clone()
        sidx = torch.tensor([-1 if is_pad(i) else remap[i] for i in il], dtype=torch.int32)
        out, new = REF.kda_decode_step(q, k, v, g, beta, state=small, state_indices=sidx,
                                       null_slot0=False, dtype=torch.float64, **kw)
        return out, {s: new[remap[s]] for s in used}
    valid = [r for r in range(rows) if not is_pad(il[r])]
    HV = v.shape[1]
    out = torch.zeros(rows, HV, V, dtype=torch.float64, device=q.device)
    states = {}
    if valid:
        vi = torch.tensor(valid, device=q.device)
        qn, kn, vv, gl, bb = REF.gates.prepare_token_inputs(
            q[vi], k[vi], v[vi], g[vi], beta[vi], dtype=torch.float64, **kw)
        S = pool[[il[r] for r in valid]].to(torch.float64)
        n = len(valid)
        o, S = REF.step.delta_step(S.reshape(n * HV, V, K), qn.reshape(n * HV, K), kn.reshape(n * HV, K),
                                   vv.reshape(n * HV, V), gl.reshape(n * HV, K), bb.reshape(n * HV))
        out[vi] = o.reshape(n, HV, V)
        S = S.reshape(n, HV, V, K).to(pool.dtype)
        for j, r in enumerate(valid):
            states[il[r]] = S[j]
    return out, states


def check_against_reference(name, rows, H, HV, gate, slot_mode, seed, slots=64, null_slot0=False,
                            beta_is_logit=True, gate_params=True):
    rec = next(r for r in RECORDS if r["name"] == name)
    sdt = torch.float32 if rec["state_dtype"] == "float32" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, H, HV, gate, gen, gb=gb_dtype(rec))
    if gate == "log" or not gate_params:  # log takes neither; bounded may omit both (= 0)
        A_log = dt_bias = None
    if not beta_is_logit:
        beta = torch.sigmoid(beta.float()).to(gb_dtype(rec))
    pool = make_pool(slots, HV, sdt, gen)
    il = slot_list(rows, slots, slot_mode, seed, null_slot0)
    idx = torch.tensor(il, dtype=torch.int32, device="cuda")
    before = pool.clone()
    out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref_out, ref_states = reference(q, k, v, g, beta, A_log, dt_bias, pool, idx.cpu(), gate,
                                    beta_is_logit=beta_is_logit, null_slot0=null_slot0,
                                    sequential=(slot_mode == "repeated"))
    call(name, q, k, v, g, beta, A_log, dt_bias, pool, idx, out, gate,
         beta_is_logit=beta_is_logit, null_slot0=null_slot0)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all(), "output not fully written"
    pad = [r for r in range(rows) if il[r] < 0 or (null_slot0 and il[r] == 0)]
    if pad:
        assert (out[pad].float() == 0).all(), "padding rows must be exact zeros"
    e = rel_l2(out.float(), ref_out)
    assert e < 1.2e-2, f"{name} {gate} {slot_mode}: output rel L2 {e:.3e}"
    touched = set(ref_states)
    for s, st in ref_states.items():
        es = rel_l2(pool[s].float(), st.double())
        tol = 2e-5 if sdt == torch.float32 else 4e-3
        assert es < tol, f"{name} slot {s}: state rel L2 {es:.3e}"
    untouched = [s for s in range(slots) if s not in touched]
    if untouched:
        assert torch.equal(bits(pool[untouched]), bits(before[untouched])), "untouched slot modified"
    return e


NAMES = [r["name"] for r in RECORDS]
FAST = [r["name"] for r in RECORDS if r["abi"] != "sequential"]
SEQ = [r["name"] for r in RECORDS if r["abi"] == "sequential"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", [
    dict(rows=1, H=8, HV=8, gate="softplus", slot_mode="unique"),
    dict(rows=13, H=4, HV=16, gate="bounded", slot_mode="padded"),
    dict(rows=40, H=16, HV=16, gate="log", slot_mode="unique", beta_is_logit=False),
    dict(rows=9, H=2, HV=8, gate="softplus", slot_mode="padded", null_slot0=True),
    dict(rows=5, H=1, HV=32, gate="bounded", slot_mode="unique", gate_params=False),
])
def test_matches_reference(name, case):
    case = dict(case)
    check_against_reference(name, case.pop("rows"), case.pop("H"), case.pop("HV"), case.pop("gate"),
                            case.pop("slot_mode"), seed=zlib.crc32(f"{name}{case}".encode()) % 10000, **case)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows,H,HV", [(13, 4, 16), (40, 16, 16)])
def test_strided_pool_equals_the_dense_pool_bitwise(name, rows, H, HV):
    """A pool whose slots sit a page apart (vLLM's paged cache; docs/semantics.md "Strided pools"): every
    module (the bulk-copy ones read a tile from each slot's base) gives bitwise the dense pool's outputs and
    slots, and leaves the filler between slots and the unnamed slots bitwise unchanged."""
    rec = next(r for r in RECORDS if r["name"] == name)
    sdt = torch.float32 if rec["state_dtype"] == "float32" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + HV)
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, H, HV, "softplus", gen, gb=gb_dtype(rec))
    slots = 64
    dense = make_pool(slots, HV, sdt, gen)
    pages, pool, filler = paged_like(dense, seed=rows)
    pages0, dense0 = pages.clone(), dense.clone()
    il = slot_list(rows, slots, "padded", rows, null_slot0=True)
    idx = torch.tensor(il, dtype=torch.int32, device="cuda")
    outs = []
    for p in (pool, dense):
        out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call(name, q, k, v, g, beta, A_log, dt_bias, p, idx, out, "softplus", null_slot0=True)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(bits(outs[0]), bits(outs[1])), f"{name}: output differs from the dense pool's"
    assert torch.equal(bits(pool), bits(dense)), f"{name}: slots differ from the dense pool's"
    assert torch.equal(bits(filler(pages)), bits(filler(pages0))), f"{name}: filler between slots changed"
    named = {i for i in il if i > 0}
    rest = [s for s in range(slots) if s not in named]
    assert torch.equal(bits(pool[rest]), bits(dense0[rest])), f"{name}: an unnamed slot changed"
    assert not torch.equal(bits(pool[sorted(named)]), bits(dense0[sorted(named)]))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows,H,HV", [(13, 4, 16), (40, 8, 8)])
def test_row_strided_inputs_equal_the_dense_inputs_bitwise(name, rows, H, HV):
    """q | k | v as column blocks of one packed buffer and g | beta of one projection (the layouts vLLM and SGLang
    hand over; docs/api.md "Layouts"): every module reads the views as they are, bitwise the dense call (outputs
    and slots). Rows off a 16-byte multiple are refused naming the argument, nothing written."""
    rec = next(r for r in RECORDS if r["name"] == name)
    sdt = torch.float32 if rec["state_dtype"] == "float32" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(rows * 11 + HV)
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, H, HV, "bounded", gen, gb=gb_dtype(rec))
    views = (*packed_rows([q, k, v], 0), *packed_rows([g, beta], 0))
    slots = 64
    pool0 = make_pool(slots, HV, sdt, gen)
    il = slot_list(rows, slots, "padded", rows, null_slot0=True)
    idx = torch.tensor(il, dtype=torch.int32, device="cuda")
    results = []
    for inputs in ((q, k, v, g, beta), views):
        pool = pool0.clone()
        out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call(name, *inputs, A_log, dt_bias, pool, idx, out, "bounded", null_slot0=True)
        results.append((out, pool))
    torch.cuda.synchronize()
    (o0, p0), (o1, p1) = results
    assert torch.isfinite(o1.float()).all()
    assert torch.equal(bits(o1), bits(o0)), f"{name}: output differs from the dense inputs'"
    assert torch.equal(bits(p1), bits(p0)), f"{name}: slots differ from the dense inputs'"
    assert not torch.equal(bits(p1), bits(pool0))
    for i, what in ((0, "q"), (3, "g")):
        bad = list(views)
        bad[i] = packed_rows([(q, k, v, g)[i]], 0, extra=2)[0]      # rows 2 elements off 16 bytes
        pool = pool0.clone()
        out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=f"'{what}'.*16-byte"):
            call(name, *bad, A_log, dt_bias, pool, idx, out, "bounded", null_slot0=True)
        torch.cuda.synchronize()
        assert out.isnan().all() and torch.equal(bits(pool), bits(pool0))


@pytest.mark.parametrize("name", SEQ)
@pytest.mark.parametrize("rows,gate", [(2, "softplus"), (17, "bounded"), (33, "log")])
def test_repeated_slots_sequential(name, rows, gate):
    check_against_reference(name, rows, 8, 8, gate, "repeated", seed=rows)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_graph_and_stream(name):
    rec = next(r for r in RECORDS if r["name"] == name)
    sdt = torch.float32 if rec["state_dtype"] == "float32" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows, H, HV, slots = 37, 8, 16, 96
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, H, HV, "softplus", gen, gb=gb_dtype(rec))
    pool0 = make_pool(slots, HV, sdt, gen)
    idx = torch.randperm(slots, device="cuda")[:rows].to(torch.int32)
    idx[5] = -1
    results = []
    for _ in range(2):  # eager twice: bitwise identical
        pool = pool0.clone()
        out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call(name, q, k, v, g, beta, A_log, dt_bias, pool, idx, out, "softplus")
        results.append((out, pool))
    torch.cuda.synchronize()
    assert torch.equal(bits(results[0][0]), bits(results[1][0]))
    assert torch.equal(bits(results[0][1]), bits(results[1][1]))
    # graph capture (fails if the kernel went to another stream than the capturing one) and replay
    pool = pool0.clone()
    out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            call(name, q, k, v, g, beta, A_log, dt_bias, pool, idx, out, "softplus")
    torch.cuda.synchronize()
    pool.copy_(pool0)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(results[0][0])), "graph replay != eager (out)"
    assert torch.equal(bits(pool), bits(results[0][1])), "graph replay != eager (state)"
    # non-default stream: the inputs arrive on that stream behind a long sleep; a launch on any
    # other stream would read the stale (NaN) inputs
    qs = torch.full_like(q, float("nan"))
    pool = pool0.clone()
    out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)
        qs.copy_(q)
        call(name, qs, k, v, g, beta, A_log, dt_bias, pool, idx, out, "softplus")
    s.synchronize()
    assert torch.equal(bits(out), bits(results[0][0])), "wrong stream"
    assert torch.equal(bits(pool), bits(results[0][1])), "wrong stream (state)"


def test_o32_rejects_large_pool_and_o64_handles_it():
    """A bf16 pool of more than 2^31 elements: the o32 twin refuses it, the o64 twin updates slots
    past the 2^31-element boundary correctly."""
    HV, H = 8, 8
    per_slot = HV * V * K
    slots = (2 ** 31) // per_slot + 16
    assert slots * per_slot > 2 ** 31
    try:
        pool = torch.empty(slots, HV, V, K, dtype=torch.bfloat16, device="cuda")
    except RuntimeError:
        pytest.skip("not enough GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(11)
    hi = [slots - 1, slots - 5, slots - 9, 3, (2 ** 31) // per_slot + 1]
    probe = sorted(set(hi + [slots - 2, slots - 3, 2, 4]))
    pool[probe] = make_pool(len(probe), HV, torch.bfloat16, gen)
    rows = len(hi)
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, H, HV, "bounded", gen)
    idx = torch.tensor(hi, dtype=torch.int32, device="cuda")
    before = pool[probe].clone()
    ref_out, ref_states = reference(q, k, v, g, beta, A_log, dt_bias, pool, idx.cpu(), "bounded")
    for rec in RECORDS:
        if rec["state_dtype"] != "bfloat16":
            continue
        out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        gg, bb = g.to(gb_dtype(rec)), beta.to(gb_dtype(rec))  # the same values (bf16 ones, exact in fp32)
        if rec["slot_offset_bits"] == 32:
            with pytest.raises(Exception, match="int32|o64"):
                call(rec["name"], q, k, v, gg, bb, A_log, dt_bias, pool, idx, out, "bounded")
            continue
        pool[probe] = before
        call(rec["name"], q, k, v, gg, bb, A_log, dt_bias, pool, idx, out, "bounded")
        torch.cuda.synchronize()
        assert rel_l2(out.float(), ref_out) < 1.2e-2, rec["name"]
        for s, st in ref_states.items():
            assert rel_l2(pool[s].float(), st.double()) < 4e-3, (rec["name"], s)
        for j, s in enumerate(probe):
            if s not in ref_states:
                assert torch.equal(bits(pool[s]), bits(before[j])), (rec["name"], s)
    del pool
    torch.cuda.empty_cache()


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16])
def test_o32_largest_pool(sdt):
    """The largest pool o32 modules take (just under 2^31 elements): byte offsets pass 2^32 in fp32
    and 2^31 in bf16, element offsets do not. Last slots updated right, neighbours untouched."""
    HV, H = 8, 4
    per_slot = HV * V * K
    slots = (2 ** 31 - 1) // per_slot
    try:
        pool = torch.empty(slots, HV, V, K, dtype=sdt, device="cuda")
    except RuntimeError:
        pytest.skip("not enough GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(13)
    hi = [slots - 1, slots - 3, slots // 2 + 1, 1]
    probe = sorted(set(hi + [slots - 2, slots // 2, slots // 2 + 2, 0, 2]))
    pool[probe] = make_pool(len(probe), HV, sdt, gen)
    before = pool[probe].clone()
    rows = len(hi)
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, H, HV, "softplus", gen)
    idx = torch.tensor(hi, dtype=torch.int32, device="cuda")
    ref_out, ref_states = reference(q, k, v, g, beta, A_log, dt_bias, pool, idx.cpu(), "softplus")
    dname = "float32" if sdt == torch.float32 else "bfloat16"
    for rec in RECORDS:
        if rec["state_dtype"] != dname or rec["slot_offset_bits"] != 32:
            continue
        pool[probe] = before
        out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call(rec["name"], q, k, v, g.to(gb_dtype(rec)), beta.to(gb_dtype(rec)), A_log, dt_bias, pool, idx, out,
             "softplus")
        torch.cuda.synchronize()
        assert rel_l2(out.float(), ref_out) < 1.2e-2, rec["name"]
        for s, st in ref_states.items():
            tol = 2e-5 if sdt == torch.float32 else 4e-3
            assert rel_l2(pool[s].float(), st.double()) < tol, (rec["name"], s)
        for j, s in enumerate(probe):
            if s not in ref_states:
                assert torch.equal(bits(pool[s]), bits(before[j])), (rec["name"], s)
    del pool
    torch.cuda.empty_cache()


def test_contract_matches_supported():
    sup = json.loads((ROOT / "jit/supported.json").read_text())["families"]["kda_decode"]["cuda"]
    for rec in RECORDS:
        c = json.loads(load(rec["name"])["fkda_contract"]())
        assert c["FKDA_SUPPORTED_VALUE_HEADS"] == sup["value_heads"]
        assert c["FKDA_HEAD_DIM_K"] == sup["head_dims_k"][0] and c["FKDA_HEAD_DIM_V"] == sup["head_dims_v"][0]
        assert c["FKDA_THREADS"] == rec["threads"] and c["FKDA_SLOT_OFFSET_BITS"] == rec["slot_offset_bits"]
        assert c["FKDA_STATE_BF16"] == (1 if rec["state_dtype"] == "bfloat16" else 0)


@pytest.mark.parametrize("name", NAMES)
def test_back_to_back_calls_on_the_same_slots(name):
    """Programmatic dependent launch lets a call start while the previous one finishes: each call
    must still see the state its predecessor wrote. Eight calls on the same slots, issued back to
    back (eager, then as one CUDA graph), equal bitwise the same calls with a sync after each."""
    rec = next(r for r in RECORDS if r["name"] == name)
    sdt = torch.float32 if rec["state_dtype"] == "float32" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    rows, HV, steps = 12, 8, 8
    inputs = [make_inputs(rows, HV, HV, "softplus", gen, gb=gb_dtype(rec)) for _ in range(steps)]
    pool0 = make_pool(24, HV, sdt, gen)
    idx = torch.randperm(24, generator=torch.Generator().manual_seed(5))[:rows].to(torch.int32).cuda()
    outs = [torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(steps)]

    def run(pool, sync):
        for inp, out in zip(inputs, outs):
            call(name, *inp, pool, idx, out, "softplus")
            if sync:
                torch.cuda.synchronize()

    ref_pool = pool0.clone()
    run(ref_pool, True)
    ref_outs = [o.clone() for o in outs]
    for o in outs:
        o.fill_(float("nan"))
    pool = pool0.clone()
    run(pool, False)
    torch.cuda.synchronize()
    assert torch.equal(bits(pool), bits(ref_pool)), "back-to-back eager calls differ from synced calls"
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    pool.copy_(pool0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        run(pool, False)  # warm-up (loads the module) before capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        run(pool, False)
    pool.copy_(pool0)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(pool), bits(ref_pool)), "graph replay of back-to-back calls differs"
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))


GB32 = [r["name"] for r in RECORDS if gb_f32(r)]


def test_every_routed_module_has_a_gb32_twin():
    """The routes' _gb32 rules name these twins: one per routed module, the same record but gb_f32."""
    assert GB32, "no _gb32 records"
    for name in GB32:
        assert name[:-len("_gb32")] in NAMES, name


@pytest.mark.parametrize("name", GB32)
@pytest.mark.parametrize("case", [
    dict(rows=1, H=8, HV=8, gate="softplus", slot_mode="unique"),
    dict(rows=29, H=4, HV=16, gate="bounded", slot_mode="padded"),
    dict(rows=70, H=8, HV=8, gate="log", slot_mode="repeated"),
])
def test_gb32_with_bf16_exact_values_equals_the_bf16_module_bitwise(name, case):
    """fp32 g and beta holding bf16 values exactly: the _gb32 twin reads the same numbers its bf16 module
    reads after its own conversion, so output and pool agree bit for bit (the load path is the only
    difference between them)."""
    rec = next(r for r in RECORDS if r["name"] == name)
    base = name[:-len("_gb32")]
    if rec["abi"] != "sequential" and case["slot_mode"] == "repeated":
        case = dict(case, slot_mode="padded")
    seed = zlib.crc32(f"{name}{case}".encode()) % 10000
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows, H, HV, gate = case["rows"], case["H"], case["HV"], case["gate"]
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, H, HV, gate, gen)   # bf16 g, beta
    if gate == "log":
        A_log = dt_bias = None
    slots = 3 * rows + 8
    pool0 = make_pool(slots, HV, sdtype(rec), gen)
    idx = torch.tensor(slot_list(rows, slots, case["slot_mode"], seed), dtype=torch.int32, device="cuda")
    res = []
    for mod, gg, bb in ((base, g, beta), (name, g.float(), beta.float())):
        pool = pool0.clone()
        out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call(mod, q, k, v, gg, bb, A_log, dt_bias, pool, idx, out, gate)
        res.append((out, pool))
    torch.cuda.synchronize()
    assert torch.equal(bits(res[0][0]), bits(res[1][0])), f"{name}: output differs from {base}"
    assert torch.equal(bits(res[0][1]), bits(res[1][1])), f"{name}: pool differs from {base}"


@pytest.mark.parametrize("name", GB32[:1] + [n for n in NAMES if n.startswith("decode_split8_bf16_o32")])
def test_binding_refuses_the_other_gate_dtype(name):
    """A _gb32 module takes fp32 g and beta only, the others bf16 only: the binding names the argument
    and launches nothing."""
    rec = next(r for r in RECORDS if r["name"] == name)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, g, beta, A_log, dt_bias = make_inputs(4, 8, 8, "softplus", gen, gb=gb_dtype(rec))
    other = torch.bfloat16 if gb_f32(rec) else torch.float32
    pool = make_pool(8, 8, sdtype(rec), gen)
    before = pool.clone()
    idx = torch.arange(4, dtype=torch.int32, device="cuda")
    out = torch.full((4, 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    for gg, bb, arg in ((g.to(other), beta, "'g'"), (g, beta.to(other), "'beta'")):
        with pytest.raises(Exception, match=arg):
            call(name, q, k, v, gg, bb, A_log, dt_bias, pool, idx, out, "softplus")
    torch.cuda.synchronize()
    assert out.isnan().all() and torch.equal(bits(pool), bits(before))


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,HV", [(1, 8), (4, 16), (16, 8), (32, 16), (64, 8), (1024, 8), (1024, 16)])
@pytest.mark.parametrize("gdt,bdt", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.float32)])
def test_public_op_reads_fp32_gate_and_beta(sdt, rows, HV, gdt, bdt):
    """The public op with fp32 (or mixed) g / beta beside bf16 q: routed to the _gb32 twin of the band's
    module, against the reference reading the fp32 values as they are; a mixed pair equals the same
    call with the bf16 one given in fp32, bitwise; a second call (the fast path) the same again."""
    import flashkda_ext as fk
    from flashkda_ext import dispatch, validation
    seed = zlib.crc32(f"{sdt}{rows}{HV}{gdt}{bdt}".encode()) % 10000
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, HV, HV, "softplus", gen, gb=torch.float32)
    g, beta = g.to(gdt), beta.to(bdt)
    slots = 2 * rows + 4
    pool0 = make_pool(slots, HV, sdt, gen)
    idx = torch.tensor(slot_list(rows, slots, "padded", seed), dtype=torch.int32, device="cuda")
    meta = validation.check_kda_decode(q, k, v, g, beta, state=pool0, state_indices=idx, A_log=A_log,
                                       dt_bias=dt_bias, slot_mode="padded").route_meta()
    assert meta["gb"] == "f32" and dispatch.module_name("kda_decode", meta).endswith("_gb32")
    ref_out, ref_states = reference(q, k, v, g, beta, A_log, dt_bias, pool0, idx.cpu(), "softplus")
    results = []
    for gg, bb in ((g, beta), (g, beta), (g.float(), beta.float())):
        pool = pool0.clone()
        out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        fk.kda_decode(q, k, v, gg, bb, state=pool, state_indices=idx, A_log=A_log, dt_bias=dt_bias,
                      slot_mode="padded", out=out)
        results.append((out, pool))
    torch.cuda.synchronize()
    out, pool = results[0]
    assert rel_l2(out.float(), ref_out) < 1.2e-2
    tol = 2e-5 if sdt == torch.float32 else 4e-3
    for s, st in ref_states.items():
        assert rel_l2(pool[s].float(), st.double()) < tol, s
    for o, p in results[1:]:
        assert torch.equal(bits(o), bits(out)) and torch.equal(bits(p), bits(pool))


# The opt-in route (docs/jit.md, "Opt-in routes"): run in a child process, since a process picks a
# call's route once (the environment is read at the first routing).
_OPT_IN_CHILD = r"""
import sys, torch, flashkda_ext as fk
from flashkda_ext import dispatch, validation
a = torch.load(sys.argv[1])
meta = validation.check_kda_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["pool"],
                                   state_indices=a["idx"], A_log=a["A_log"], dt_bias=a["dt_bias"],
                                   slot_mode="padded").route_meta()
module = dispatch.module_name("kda_decode", meta)
outs = []
for _ in range(2):  # the second call takes the fast path
    pool = a["pool"].clone()
    out = fk.kda_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], state=pool, state_indices=a["idx"],
                        A_log=a["A_log"], dt_bias=a["dt_bias"], slot_mode="padded")
    outs.append((out, pool))
torch.cuda.synchronize()
torch.save({"module": module, "outs": outs}, sys.argv[2])
"""


@pytest.mark.parametrize("sdt,gb", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_opt_in_persistent_route_through_the_op(sdt, gb, tmp_path):
    """FLASHKDA_EXT_OPT_IN=persistent: the public op sends a padded call to the persistent stream module
    (fp32 g / beta: its _gb32 twin) and matches the reference; 2048 rows x 16 heads are 65536 tiles of
    64 V-rows, so each CTA of the persistent grid walks about 250 of them through its cp.async ring."""
    import os
    import subprocess
    rows, HV = 2048, 16
    seed = zlib.crc32(f"opt_in{sdt}{gb}".encode()) % 10000
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, g, beta, A_log, dt_bias = make_inputs(rows, HV, HV, "softplus", gen, gb=gb)
    slots = rows + 64
    pool0 = make_pool(slots, HV, sdt, gen)
    idx = torch.tensor(slot_list(rows, slots, "padded", seed), dtype=torch.int32, device="cuda")
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, pool=pool0, idx=idx), src)
    env = dict(os.environ, FLASHKDA_EXT_OPT_IN="persistent")
    subprocess.run([sys.executable, "-c", _OPT_IN_CHILD, str(src), str(dst)], env=env, check=True, timeout=900)
    res = torch.load(dst)
    tag = "f32" if sdt == torch.float32 else "bf16"
    assert res["module"] == f"decode_stream_{tag}_o32" + ("_gb32" if gb == torch.float32 else "")
    ref_out, ref_states = reference(q, k, v, g, beta, A_log, dt_bias, pool0, idx.cpu(), "softplus")
    out, pool = res["outs"][0]
    assert rel_l2(out.float(), ref_out) < 1.2e-2
    tol = 2e-5 if sdt == torch.float32 else 4e-3
    for s, st in ref_states.items():
        assert rel_l2(pool[s].float(), st.double()) < tol, s
    untouched = [s for s in range(slots) if s not in ref_states]
    assert torch.equal(bits(pool[untouched]), bits(pool0[untouched]))
    out2, pool2 = res["outs"][1]
    assert torch.equal(bits(out2), bits(out)) and torch.equal(bits(pool2), bits(pool))
