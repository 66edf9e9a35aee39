"""GPU tests of the CUDA fused_kda_decode modules (csrc/fused_decode) against the PyTorch reference.

Every module record of jit/modules/fused_decode_cuda.json (so every route's module) x fp32/bf16
state x slot modes x conv weight dtypes. Fresh random inputs each case (never zeros); outputs
NaN-poisoned first and checked fully written; both caches: every slot not addressed stays bitwise
unchanged, the conv cache of an addressed slot equals the reference bitwise (it is a shift of bf16
values), padding rows give exact zeros and touch neither cache; repeated slots apply in row order
(sequential modules); bitwise determinism; CUDA-graph replay == eager bitwise; non-default streams;
64-bit slot offsets on a pool of more than 2^31 elements; the public op's routes end to end.

FKDA_FUSED_TEST_DEVICE=cpu runs the same harness against cpu_fused_kda_decode (a dry run of the
harness itself on a machine without a GPU; the CUDA-only tests skip).

Timings live in benchmarks/bench_fused_decode.py (fused vs the plain step and the unfused engine
sequence, every tile module with --modules).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
DEVICE = os.environ.get("FKDA_FUSED_TEST_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from flashkda_ext import reference as REF  # noqa: E402
from gpu_common import bits, module_records, paged_like, prebuild_selected, rel_l2, slot_list  # noqa: E402

RECORDS = module_records("fused_decode_cuda.json")
GATES = {"softplus": 0, "bounded": 1, "log": 2}
D = 128
CUDA_ONLY = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA-only check")

if DEVICE == "cuda":
    # (module, state dtype, abi)
    CASES = [(r["name"], r["state_dtype"], r["abi"]) for r in RECORDS]
else:  # dry run of the harness on the CPU backend (sequential semantics, any state dtype)
    CASES = [("cpu_fused_kda_decode", "float32", "sequential"),
             ("cpu_fused_kda_decode", "bfloat16", "sequential")]
IDS = [f"{n}-{s}" for n, s, _ in CASES]
SDT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_MODS = {}


@pytest.fixture(scope="module", autouse=True)
def _prebuild(request):
    if DEVICE == "cuda":
        prebuild_selected(request)


def load(name):
    if name not in _MODS:
        from flashkda_ext.jit import load_module
        _MODS[name] = load_module(name)
    return _MODS[name]


def make_inputs(rows, H, gate, gen, w_f32=False):
    r = lambda *s: torch.randn(*s, generator=gen, device=DEVICE)
    bf = torch.bfloat16
    HD = H * D
    inp = dict(
        x=r(rows, 3 * HD).to(bf),
        conv_weight=(r(3 * HD, 4) * 0.5).to(torch.float32 if w_f32 else bf),
        g=((-torch.nn.functional.softplus(r(rows, H, D))) if gate == "log" else (r(rows, H, D) - 1.0)).to(bf),
        beta=r(rows, H).to(bf),
        A_log=(torch.rand(H, generator=gen, device=DEVICE) * 2.5 - 2.0).float(),
        dt_bias=(r(H * D) * 0.5).float(),
        output_gate=r(rows, H, D).to(bf),
        norm_weight=(1.0 + 0.2 * r(D)).float(),
    )
    if gate == "log":
        inp["A_log"] = inp["dt_bias"] = None
    return inp


def make_pools(slots, H, sdt, gen):
    state = (torch.randn(slots, H, D, D, generator=gen, device=DEVICE) * 0.5).to(sdt)
    conv = torch.randn(slots, 3 * H * D, 3, generator=gen, device=DEVICE).to(torch.bfloat16)
    return conv, state


def is_pad(i, null_slot0):
    return i < 0 or (null_slot0 and i == 0)


def call(name, inp, conv, state, idx, out, gate, lb=-5.0, scale=None, eps=1e-5, null_slot0=False):
    scale = D ** -0.5 if scale is None else scale
    load(name)["fused_kda_decode"](
        inp["x"], inp["conv_weight"], conv, inp["g"], inp["beta"], inp["A_log"], inp["dt_bias"], idx,
        state, inp["output_gate"], inp["norm_weight"], out, GATES[gate], float(lb), float(scale),
        float(eps), bool(null_slot0))


def reference(inp, conv, state, il, gate, lb=-5.0, eps=1e-5, null_slot0=False):
    """(out fp64 [rows,H,D], {slot: new conv rows}, {slot: new state}) on the used slots only
    (so a huge pool is never cloned); rows run in order, so repeats are sequential."""
    used = sorted({i for i in il if not is_pad(i, null_slot0)})
    remap = {s: j for j, s in enumerate(used)}
    sidx = torch.tensor([-1 if is_pad(i, null_slot0) else remap[i] for i in il], dtype=torch.int32)
    out, new_conv, new_state = REF.fused_kda_decode_step(
        inp["x"], inp["conv_weight"], conv[used].clone(), inp["g"], inp["beta"], inp["A_log"],
        inp["dt_bias"], sidx, state[used].clone(), inp["output_gate"], inp["norm_weight"], gate=gate,
        lower_bound=lb if gate == "bounded" else None, norm_eps=eps, scale=None, null_slot0=False,
        dtype=torch.float64)
    return out, {s: new_conv[remap[s]] for s in used}, {s: new_state[remap[s]] for s in used}


def check_against_reference(name, sdt_name, rows, H, gate, slot_mode, seed, slots=48, null_slot0=False,
                            w_f32=False, eps=1e-5):
    sdt = SDT[sdt_name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    inp = make_inputs(rows, H, gate, gen, w_f32=w_f32)
    conv, state = make_pools(slots, H, sdt, gen)
    il = slot_list(rows, slots, slot_mode, seed, null_slot0)
    idx = torch.tensor(il, dtype=torch.int32, device=DEVICE)
    conv0, state0 = conv.clone(), state.clone()
    ref_out, ref_conv, ref_state = reference(inp, conv, state, il, gate, eps=eps, null_slot0=null_slot0)
    assert torch.equal(bits(state), bits(state0)) and torch.equal(bits(conv), bits(conv0))
    out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    call(name, inp, conv, state, idx, out, gate, eps=eps, null_slot0=null_slot0)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all(), f"{name}: output not fully written"
    pad = [r for r in range(rows) if is_pad(il[r], null_slot0)]
    valid = [r for r in range(rows) if r not in pad]
    if pad:
        assert (out[pad].float() == 0).all(), f"{name}: padding rows must be exact zeros"
    e = rel_l2(out.float(), ref_out)
    assert e < 1.2e-2, f"{name} {gate} {slot_mode}: output rel L2 {e:.3e}"
    for r in valid:  # no single row hides behind the aggregate
        er = rel_l2(out[r].float(), ref_out[r])
        assert er < 2.5e-2, f"{name} {gate} {slot_mode}: row {r} output rel L2 {er:.3e}"
    tol = 2e-5 if sdt == torch.float32 else 4e-3
    for s in ref_state:
        es = rel_l2(state[s].float(), ref_state[s])
        assert es < tol, f"{name} slot {s}: state rel L2 {es:.3e}"
        assert torch.equal(bits(conv[s]), bits(ref_conv[s])), f"{name} slot {s}: conv cache differs"
    untouched = [s for s in range(slots) if s not in ref_state]
    assert untouched, "test needs untouched slots"
    assert torch.equal(bits(state[untouched]), bits(state0[untouched])), f"{name}: untouched state slot modified"
    assert torch.equal(bits(conv[untouched]), bits(conv0[untouched])), f"{name}: untouched conv slot modified"
    return e


@pytest.mark.parametrize("name,sdt,abi", CASES, ids=IDS)
@pytest.mark.parametrize("case", [
    dict(rows=1, H=8, gate="softplus", slot_mode="unique"),
    dict(rows=13, H=16, gate="bounded", slot_mode="padded"),
    dict(rows=33, H=12, gate="log", slot_mode="unique", w_f32=True),
    dict(rows=9, H=24, gate="softplus", slot_mode="padded", null_slot0=True, w_f32=True),
    dict(rows=3, H=96, gate="bounded", slot_mode="unique", eps=1e-3),
    dict(rows=5, H=64, gate="softplus", slot_mode="padded"),
    dict(rows=100, H=8, gate="bounded", slot_mode="padded", slots=128, w_f32=True),
], ids=lambda c: f"r{c['rows']}h{c['H']}-{c['gate']}-{c['slot_mode']}")
def test_matches_reference(name, sdt, abi, case):
    case = dict(case)
    check_against_reference(name, sdt, case.pop("rows"), case.pop("H"), case.pop("gate"),
                            case.pop("slot_mode"), seed=hash((name, sdt, str(case))) % 10000, **case)


@pytest.mark.parametrize("name,sdt,abi", [c for c in CASES if c[2] == "sequential"],
                         ids=[i for i, c in zip(IDS, CASES) if c[2] == "sequential"])
@pytest.mark.parametrize("rows,H,gate", [(2, 8, "softplus"), (17, 16, "bounded"), (40, 32, "log")])
def test_repeated_slots_sequential(name, sdt, abi, rows, H, gate):
    check_against_reference(name, sdt, rows, H, gate, "repeated", seed=rows * 31 + H)


def engine_layout(inp, conv0, state0, sdt, gen, conv_major):
    """The inputs as vLLM's K3 layer holds them (csrc/common/fused_layout.h): x, output_gate, beta, g column blocks of
    one projection row; the conv cache (width- or channel-major) and the state pool interleaved in one paged cache
    (per page: conv cache, state, 64 spare bytes); the width-major conv weight [3, 4, H*D]. Same values as inp."""
    rows, C = inp["x"].shape
    H = inp["g"].shape[1]
    HD = H * D
    proj = torch.randn(rows, C + HD + H + HD + 24, generator=gen, device=DEVICE).to(torch.bfloat16)
    views = dict(x=proj[:, :C], output_gate=proj[:, C:C + HD].view(rows, H, D), beta=proj[:, C + HD:C + HD + H],
                 g=proj[:, C + HD + H:C + HD + H + HD].view(rows, H, D))
    for k, v in views.items():
        v.copy_(inp[k])
    slots = conv0.shape[0]
    conv_bytes, state_bytes = C * 3 * 2, HD * D * sdt.itemsize
    page = conv_bytes + state_bytes + 64
    store = torch.randint(0, 255, (slots * page,), dtype=torch.uint8, generator=gen, device=DEVICE)
    cstr = (page // 2, 1, C) if conv_major == "width" else (page // 2, 3, 1)
    conv = torch.as_strided(store.view(torch.bfloat16), (slots, C, 3), cstr)
    state = torch.as_strided(store.view(sdt), (slots, H, D, D), (page // sdt.itemsize, D * D, D, 1),
                             conv_bytes // sdt.itemsize)
    conv.copy_(conv0)
    state.copy_(state0)
    w = inp["conv_weight"].view(3, HD, 4).transpose(1, 2).contiguous()
    return dict(inp, conv_weight=w, **views), conv, state, store


@CUDA_ONLY
@pytest.mark.parametrize("name,sdt,abi", CASES, ids=IDS)
@pytest.mark.parametrize("conv_major", ["width", "channel"])
@pytest.mark.parametrize("rows,H,gate", [(9, 12, "bounded"), (40, 24, "softplus")])
def test_engine_layouts_equal_the_dense_call_bitwise(name, sdt, abi, conv_major, rows, H, gate):
    """Row-strided x / g / beta / output_gate, the conv cache and the pool interleaved in one paged cache, the
    width-major conv weight: every module gives bitwise the dense call's output, caches and slots; the spare bytes
    of each page and the slots no row names stay bitwise unchanged."""
    gen = torch.Generator(device=DEVICE).manual_seed(rows * 7 + H)
    inp = make_inputs(rows, H, gate, gen, w_f32=True)
    slots = 48
    conv0, state0 = make_pools(slots, H, SDT[sdt], gen)
    eng, conv, state, store = engine_layout(inp, conv0, state0, SDT[sdt], gen, conv_major)
    il = slot_list(rows, slots, "padded", rows, True)
    idx = torch.tensor(il, dtype=torch.int32, device=DEVICE)
    store0 = store.clone()
    out_e = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    call(name, eng, conv, state, idx, out_e, gate, null_slot0=True)
    conv_d, state_d = conv0.clone(), state0.clone()
    out_d = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    call(name, inp, conv_d, state_d, idx, out_d, gate, null_slot0=True)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.isfinite(out_e.float()).all()
    assert torch.equal(bits(out_e), bits(out_d))
    assert torch.equal(bits(conv), bits(conv_d)) and torch.equal(bits(state), bits(state_d))
    # bytes outside every named slot's conv cache and state: unchanged
    used = sorted({i for i in il if not is_pad(i, True)})
    page = store.numel() // slots
    written = torch.zeros_like(store, dtype=torch.bool).view(slots, page)
    written[used, :page - 64] = True
    assert torch.equal(store[~written.view(-1)], store0[~written.view(-1)])


@CUDA_ONLY
@pytest.mark.parametrize("name,sdt,abi", CASES, ids=IDS)
@pytest.mark.parametrize("rows,H", [(9, 8), (40, 16)])
def test_strided_pool_equals_the_dense_pool_bitwise(name, sdt, abi, rows, H):
    """A state pool whose slots sit a page apart (vLLM's paged cache; docs/semantics.md "Strided pools"):
    every module (rowtma* bulk-copy a tile from each slot's base) gives bitwise the dense pool's outputs, conv
    cache and slots; the filler between slots and the unnamed slots stay bitwise unchanged."""
    gen = torch.Generator(device=DEVICE).manual_seed(rows + H)
    inp = make_inputs(rows, H, "softplus", gen)
    slots = 48
    conv0, dense = make_pools(slots, H, SDT[sdt], gen)
    pages, pool, filler = paged_like(dense, seed=rows)
    pages0, dense0 = pages.clone(), dense.clone()
    il = slot_list(rows, slots, "padded", rows)
    idx = torch.tensor(il, dtype=torch.int32, device=DEVICE)
    outs, convs = [], []
    for p in (pool, dense):
        out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        conv = conv0.clone()
        call(name, inp, conv, p, idx, out, "softplus")
        outs.append(out)
        convs.append(conv)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(bits(outs[0]), bits(outs[1])), f"{name}: output differs from the dense pool's"
    assert torch.equal(bits(convs[0]), bits(convs[1])), f"{name}: conv cache differs"
    assert torch.equal(bits(pool), bits(dense)), f"{name}: slots differ from the dense pool's"
    assert torch.equal(bits(filler(pages)), bits(filler(pages0))), f"{name}: filler between slots changed"
    named = {i for i in il if i >= 0}
    rest = [s for s in range(slots) if s not in named]
    assert torch.equal(bits(pool[rest]), bits(dense0[rest])), f"{name}: an unnamed slot changed"


@pytest.mark.parametrize("name,sdt,abi", CASES, ids=IDS)
def test_all_rows_padding(name, sdt, abi):
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    rows, H, slots = 6, 8, 8
    inp = make_inputs(rows, H, "softplus", gen)
    conv, state = make_pools(slots, H, SDT[sdt], gen)
    conv0, state0 = conv.clone(), state.clone()
    idx = torch.tensor([-1, -2, -1, -7, -1, -3], dtype=torch.int32, device=DEVICE)
    out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    call(name, inp, conv, state, idx, out, "softplus")
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert (out.float() == 0).all()
    assert torch.equal(bits(state), bits(state0)) and torch.equal(bits(conv), bits(conv0))


@CUDA_ONLY
@pytest.mark.parametrize("name,sdt,abi", CASES, ids=IDS)
def test_deterministic_graph_and_stream(name, sdt, abi):
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows, H, slots = 37, 16, 96
    inp = make_inputs(rows, H, "softplus", gen)
    conv0, state0 = make_pools(slots, H, SDT[sdt], gen)
    idx = torch.randperm(slots, device="cuda")[:rows].to(torch.int32)
    idx[5] = -1
    results = []
    for _ in range(2):  # eager twice: bitwise identical
        conv, state = conv0.clone(), state0.clone()
        out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        call(name, inp, conv, state, idx, out, "softplus")
        results.append((out, conv, state))
    torch.cuda.synchronize()
    for a, b in zip(results[0], results[1]):
        assert torch.equal(bits(a), bits(b)), f"{name}: not deterministic"
    # graph capture on a side stream (a launch on another stream would break the capture), replay
    conv, state = conv0.clone(), state0.clone()
    out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            call(name, inp, conv, state, idx, out, "softplus")
    torch.cuda.synchronize()
    conv.copy_(conv0)
    state.copy_(state0)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b, what in zip((out, conv, state), results[0], ("out", "conv_state", "state")):
        assert torch.equal(bits(a), bits(b)), f"{name}: graph replay != eager ({what})"
    # non-default stream: x arrives on that stream behind a long sleep; a launch on any other
    # stream would read the stale (NaN) x
    xs = torch.full_like(inp["x"], float("nan"))
    conv, state = conv0.clone(), state0.clone()
    out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)
        xs.copy_(inp["x"])
        call(name, dict(inp, x=xs), conv, state, idx, out, "softplus")
    s.synchronize()
    for a, b, what in zip((out, conv, state), results[0], ("out", "conv_state", "state")):
        assert torch.equal(bits(a), bits(b)), f"{name}: wrong stream ({what})"


@pytest.mark.parametrize("name,sdt,abi", CASES, ids=IDS)
def test_back_to_back_calls_on_the_same_slots(name, sdt, abi):
    """Each call sees the state and conv cache its predecessor wrote, with calls issued back to
    back (programmatic dependent launch may start one while the previous finishes): six calls on
    the same slots, eager and as one CUDA graph, equal bitwise the same calls synced one by one."""
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    rows, H, slots, steps = 6, 8, 16, 6
    inputs = [make_inputs(rows, H, "softplus", gen) for _ in range(steps)]
    conv0, state0 = make_pools(slots, H, SDT[sdt], gen)
    idx = torch.tensor([3, 11, 0, 7, 14, 5], dtype=torch.int32, device=DEVICE)
    outs = [torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(steps)]

    def run(conv, state, sync):
        for inp, out in zip(inputs, outs):
            call(name, inp, conv, state, idx, out, "softplus")
            if sync and DEVICE == "cuda":
                torch.cuda.synchronize()

    ref = (conv0.clone(), state0.clone())
    run(*ref, True)
    ref_outs = [o.clone() for o in outs]
    conv, state = conv0.clone(), state0.clone()
    run(conv, state, False)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for a, b, what in ((conv, ref[0], "conv_state"), (state, ref[1], "state")):
        assert torch.equal(bits(a), bits(b)), f"{name}: back-to-back eager calls differ ({what})"
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    if DEVICE != "cuda":
        return
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            run(conv, state, False)
    torch.cuda.synchronize()
    conv.copy_(conv0)
    state.copy_(state0)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b, what in ((conv, ref[0], "conv_state"), (state, ref[1], "state")):
        assert torch.equal(bits(a), bits(b)), f"{name}: graph replay of back-to-back calls differs ({what})"
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))


@CUDA_ONLY
def test_o32_rejects_large_pool_and_o64_handles_it():
    """A bf16 state pool of more than 2^31 elements: o32 twins refuse it, o64 twins update slots
    past the 2^31-element boundary correctly and leave their neighbours alone."""
    H = 8
    per_slot = H * D * D
    slots = (2 ** 31) // per_slot + 16
    try:
        state = torch.empty(slots, H, D, D, dtype=torch.bfloat16, device="cuda")
        conv = torch.empty(slots, 3 * H * D, 3, dtype=torch.bfloat16, device="cuda")
    except RuntimeError:
        pytest.skip("not enough GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(11)
    hi = [slots - 1, slots - 5, slots - 9, 3, (2 ** 31) // per_slot + 1]
    probe = sorted(set(hi + [slots - 2, slots - 3, 2, 4]))
    c0, s0 = make_pools(len(probe), H, torch.bfloat16, gen)
    state[probe], conv[probe] = s0, c0
    rows = len(hi)
    inp = make_inputs(rows, H, "bounded", gen)
    idx = torch.tensor(hi, dtype=torch.int32, device="cuda")
    ref_out, ref_conv, ref_state = reference(inp, conv, state, hi, "bounded")
    for rec in RECORDS:
        if rec["state_dtype"] != "bfloat16":
            continue
        out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        if rec["slot_offset_bits"] == 32:
            with pytest.raises(Exception, match="64-bit|o64"):
                call(rec["name"], inp, conv, state, idx, out, "bounded")
            continue
        state[probe], conv[probe] = s0, c0
        call(rec["name"], inp, conv, state, idx, out, "bounded")
        torch.cuda.synchronize()
        assert rel_l2(out.float(), ref_out) < 1.2e-2, rec["name"]
        for s in ref_state:
            assert rel_l2(state[s].float(), ref_state[s]) < 4e-3, (rec["name"], s)
            assert torch.equal(bits(conv[s]), bits(ref_conv[s])), (rec["name"], s)
        for j, s in enumerate(probe):
            if s not in ref_state:
                assert torch.equal(bits(state[s]), bits(s0[j])), (rec["name"], s)
                assert torch.equal(bits(conv[s]), bits(c0[j])), (rec["name"], s)
    del state, conv
    torch.cuda.empty_cache()


@pytest.mark.parametrize("slot_mode", ["unique", "padded", "repeated"])
@pytest.mark.parametrize("rows,H", [(1, 8), (8, 8), (20, 16), (40, 32), (100, 16)])
def test_public_op_routes(slot_mode, rows, H):
    """flashkda_ext.fused_kda_decode end to end: validation, route selection, module, result."""
    import flashkda_ext
    gen = torch.Generator(device=DEVICE).manual_seed(rows * 7 + H)
    slots = 2 * rows + 8
    inp = make_inputs(rows, H, "softplus", gen)
    conv, state = make_pools(slots, H, torch.float32, gen)
    il = slot_list(rows, slots, slot_mode, seed=rows + H)
    if slot_mode == "padded" and all(i >= 0 for i in il):
        il[0] = -1
    idx = torch.tensor(il, dtype=torch.int32, device=DEVICE)
    conv0, state0 = conv.clone(), state.clone()
    ref_out, ref_conv, ref_state = reference(inp, conv, state, il, "softplus")
    out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    flashkda_ext.fused_kda_decode(inp["x"], inp["conv_weight"], conv, inp["g"], inp["beta"], inp["A_log"],
                                  inp["dt_bias"], idx, state, inp["output_gate"], inp["norm_weight"],
                                  gate="softplus", slot_mode=slot_mode, out=out)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    assert rel_l2(out.float(), ref_out) < 1.2e-2
    for s in ref_state:
        assert rel_l2(state[s].float(), ref_state[s]) < 2e-5
        assert torch.equal(bits(conv[s]), bits(ref_conv[s]))
    untouched = [s for s in range(slots) if s not in ref_state]
    assert torch.equal(bits(state[untouched]), bits(state0[untouched]))
    assert torch.equal(bits(conv[untouched]), bits(conv0[untouched]))


@CUDA_ONLY
def test_contract_matches_supported():
    sup = json.loads((ROOT / "jit/supported.json").read_text())["families"]["fused_kda_decode"]["cuda"]
    for rec in RECORDS:
        c = json.loads(load(rec["name"])["fkda_contract"]())
        assert c["FKDA_SUPPORTED_VALUE_HEADS"] == sup["value_heads"]
        assert c["FKDA_HEAD_DIM_K"] == sup["head_dims_k"][0] == D
        assert c["FKDA_THREADS"] == rec["threads"] and c["FKDA_SLOT_OFFSET_BITS"] == rec["slot_offset_bits"]
        assert c["FKDA_CLUSTER_X"] == rec["cluster"][0]
        assert c["FKDA_STATE_BF16"] == (1 if rec["state_dtype"] == "bfloat16" else 0)


@CUDA_ONLY
def test_binding_rejects_unsupported_heads():
    rec = RECORDS[0]
    gen = torch.Generator(device="cuda").manual_seed(3)
    H = 4  # not in the supported set
    inp = make_inputs(2, H, "softplus", gen)
    conv, state = make_pools(4, H, SDT[rec["state_dtype"]], gen)
    idx = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    out = torch.empty(2, H, D, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="heads"):
        call(rec["name"], inp, conv, state, idx, out, "softplus")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"] + sys.argv[1:]))
