"""GPU tests of the CUDA fused_kda_verify modules (csrc/verify/fused_kda_verify*) against the reference.

Every record of jit/modules/fused_verify_cuda.json x T_max in {1, 2, 4, 8} with mixed T_n, num_accepted_tokens
and a padding request. Fresh random inputs (never zeros); outputs NaN-poisoned first; the conv lines equal the
reference's exactly (they only move inputs); slots and conv lines nobody names stay bitwise unchanged; padding
gives exact zeros; every token equals the fused decode kernel of the same layout (fused_row) chained on the
state and window the previous token left, bitwise; CUDA-graph replay of the op == eager.

Run: python3 -m pytest -q tests/gpu/test_fused_verify_gpu.py
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import flashkda_ext  # noqa: E402
from flashkda_ext import reference as REF  # noqa: E402
from flashkda_ext.devtools.testing import fused_chain_start  # noqa: E402
from gpu_common import GATES, bits, load, paged_like, prebuild_selected, records_by_name, rel_l2, sdtype, verify_tables  # noqa: E402,E501

RECORDS = records_by_name("fused_verify_cuda.json")
NAMES = list(RECORDS)
D = 128
LENS = {1: [1, 1, 1], 2: [2, 1, 2], 4: [4, 2, 1, 3], 8: [8, 5, 1, 8]}
# the fused decode module with the verify kernel's CTA (8 warps x 16 V-rows, one CTA per (row, head),
# the same step and RMSNorm order; its state tile arrives by bulk copy, which changes no value)
FUSED_TWIN = {"float32": "fused_rowtma_f32_o32", "bfloat16": "fused_rowtmalate_bf16_o32"}


@pytest.fixture(scope="module", autouse=True)
def _prebuild(request):
    prebuild_selected(request)


def make(gen, lens, cols, H, state_dtype, gate="softplus", pad_request=None, extra_len=0):
    N, T = len(lens), sum(lens)
    slots, C = N * cols + 3, 3 * H * D
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    a = dict(x=r(1, T, C).bfloat16(), conv_weight=(r(C, 4) * 0.5).bfloat16(),
             conv_state=r(slots, C, cols + 2 + extra_len).bfloat16(),
             g=((-torch.nn.functional.softplus(r(1, T, H, D))) if gate == "log" else r(1, T, H, D) - 1.0).bfloat16(),
             beta=r(1, T, H).bfloat16(),
             A_log=None if gate == "log" else (torch.rand(H, generator=gen, device="cuda") * 2.5 - 2.0).float(),
             dt_bias=None if gate == "log" else (r(H * D) * 0.5).float(),
             state=(r(slots, H, D, D) * 0.5).to(state_dtype), output_gate=r(1, T, H, D).bfloat16(),
             norm_weight=(r(D) + 1.0).float())
    idx, nacc, cu = verify_tables(gen, lens, cols, slots)
    if pad_request is not None:
        idx[pad_request, int(nacc[pad_request]) - 1] = -1
    a.update(state_indices=idx.cuda(), num_accepted_tokens=nacc.cuda(), cu_seqlens=cu)
    return a


POS = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state", "output_gate", "norm_weight")


def call_module(name, a, out, gate="softplus", lb=-5.0):
    load(name)["fused_kda_verify"](*(a[n] for n in POS), a["state_indices"], a["cu_seqlens"],
                                   a["num_accepted_tokens"], out, GATES[gate], float(lb), D ** -0.5, 1e-5, False)


def reference(a, gate="softplus", lb=-5.0):
    return REF.fused_kda_verify_step(*(a[n] for n in POS), state_indices=a["state_indices"],
                                     cu_seqlens=a["cu_seqlens"], num_accepted_tokens=a["num_accepted_tokens"],
                                     gate=gate, lower_bound=lb if gate == "bounded" else None)


def live_plan(a):
    plan = REF.verify_plan(a["cu_seqlens"].cpu(), a["state_indices"].cpu(), a["num_accepted_tokens"].cpu(),
                           a["state"].shape[0])
    return plan, [(s, e, rd, ws) for s, e, rd, ws in plan if e > s and rd is not None and ws[0] is not None]


@pytest.mark.parametrize("cols", sorted(LENS))
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name, cols):
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(400 + cols)
    for H, gate in ((8, "softplus"), (16, "bounded"), (8, "log")):
        a = make(gen, LENS[cols], cols, H, sdtype(rec), gate, pad_request=1, extra_len=1)
        conv0, pool0 = a["conv_state"].clone(), a["state"].clone()
        ref_out, ref_conv, ref_pool = reference(a, gate)
        out = torch.full((1, sum(LENS[cols]), H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        call_module(name, a, out, gate)
        torch.cuda.synchronize()
        what = f"{name} T_max={cols} {gate}"
        assert not torch.isnan(out.float()).any(), what
        assert rel_l2(out.float(), ref_out) < 2e-2, what
        assert torch.equal(bits(a["conv_state"]), bits(ref_conv)), what
        plan, live = live_plan(a)
        written = {w for *_, ws in live for w in ws if w is not None}
        tol = 4e-3 if a["state"].dtype == torch.float32 else 1e-2
        for s in written:
            assert rel_l2(a["state"][s].float(), ref_pool[s].double()) < tol, (what, s)
        for s in range(pool0.shape[0]):
            if s not in written:
                assert torch.equal(bits(a["state"][s]), bits(pool0[s])), (what, s)
        s, e = plan[1][:2]
        assert torch.equal(out[0, s:e], torch.zeros_like(out[0, s:e])), what


@pytest.mark.parametrize("name", NAMES)
def test_empty_requests_touch_neither_cache(name):
    """Empty requests (T_n = 0) with live slots among live requests, and trailing ones with padding rows and
    count 1 (T < N, as an engine pads to a CUDA-graph size): the live requests match the reference; every
    state slot and conv line no live request stores, the empty requests' included, stays bitwise unchanged."""
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(410)
    lens = [3, 0, 2, 0, 4] + [0] * 8
    a = make(gen, lens, 4, 8, sdtype(rec))
    a["state_indices"][5:] = -1
    a["num_accepted_tokens"][5:] = 1
    assert sum(lens) < len(lens)
    conv0, pool0 = a["conv_state"].clone(), a["state"].clone()
    ref_out, ref_conv, ref_pool = reference(a)
    out = torch.full((1, sum(lens), 8, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, a, out)
    torch.cuda.synchronize()
    assert not torch.isnan(out.float()).any(), name
    assert rel_l2(out.float(), ref_out) < 2e-2, name
    assert torch.equal(bits(a["conv_state"]), bits(ref_conv)), name
    _, live = live_plan(a)
    written = {w for *_, ws in live for w in ws if w is not None}
    lines = {ws[0] for *_, ws in live}
    assert len(lines) == 3
    for s in range(pool0.shape[0]):
        if s not in written:
            assert torch.equal(bits(a["state"][s]), bits(pool0[s])), (name, "slot", s)
        if s not in lines:
            assert torch.equal(bits(a["conv_state"][s]), bits(conv0[s])), (name, "conv line", s)


@pytest.mark.parametrize("cols", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_strided_pool_equals_the_dense_pool_bitwise(name, cols):
    """A state pool whose slots sit a page apart (vLLM's paged cache; docs/semantics.md "Strided pools"):
    bitwise the dense pool's outputs, conv lines and slots; the filler between slots and the slots no token
    stores stay bitwise unchanged."""
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(3000 + cols)
    a = make(gen, LENS[cols], cols, 8, sdtype(rec), pad_request=1, extra_len=1)
    dense, conv0 = a["state"], a["conv_state"].clone()
    pages, pool, filler = paged_like(dense, seed=cols)
    pages0, dense0 = pages.clone(), dense.clone()
    outs, convs = [], []
    for p in (pool, dense):
        out = torch.full((1, sum(LENS[cols]), 8, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        conv = conv0.clone()
        call_module(name, dict(a, state=p, conv_state=conv), out)
        outs.append(out)
        convs.append(conv)
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0].float()).any()
    assert torch.equal(bits(outs[0]), bits(outs[1])), f"{name}: output differs from the dense pool's"
    assert torch.equal(bits(convs[0]), bits(convs[1])), f"{name}: conv lines differ"
    assert torch.equal(bits(pool), bits(dense)), f"{name}: slots differ from the dense pool's"
    assert torch.equal(bits(filler(pages)), bits(filler(pages0))), f"{name}: filler between slots changed"
    plan, _ = live_plan(dict(a, state=dense0))
    written = {w for _, _, rd, ws in plan if rd is not None for w in ws if w is not None and w >= 0}
    rest = [s for s in range(dense.shape[0]) if s not in written]
    assert written and torch.equal(bits(pool[rest]), bits(dense0[rest])), f"{name}: an unstored slot changed"


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("o32")])
def test_tokens_equal_chained_fused_decode_kernel_bitwise(name):
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(17)
    H = 8
    a = make(gen, [4, 1, 3], 4, H, sdtype(rec))
    conv0, pool0 = a["conv_state"].clone(), a["state"].clone()
    out = torch.full((1, 8, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, a, out)
    torch.cuda.synchronize()
    dec = load(FUSED_TWIN[rec["state_dtype"]])["fused_kda_decode"]
    _, live = live_plan(a)
    for n, (s, e, read, writes) in enumerate(live):
        conv, pool = fused_chain_start(conv0, pool0, int(a["num_accepted_tokens"][n]), read, writes)
        for t in range(s, e):
            want = torch.empty(1, H, D, dtype=torch.bfloat16, device="cuda")
            sl = slice(t, t + 1)
            dec(a["x"][0, sl], a["conv_weight"], conv, a["g"][0, sl], a["beta"][0, sl], a["A_log"], a["dt_bias"],
                torch.zeros(1, dtype=torch.int32, device="cuda"), pool, a["output_gate"][0, sl], a["norm_weight"],
                want, 0, 0.0, D ** -0.5, 1e-5, False)
            torch.cuda.synchronize()
            assert torch.equal(bits(out[0, t]), bits(want[0])), (n, t)
            acc = t - s + 1
            assert torch.equal(bits(a["conv_state"][writes[0], :, acc - 1:acc + 2]), bits(conv[0])), (n, t)
            assert torch.equal(bits(a["state"][writes[t - s]]), bits(pool[0])), (n, t)


def test_op_graph_replay_equals_eager():
    gen = torch.Generator(device="cuda").manual_seed(23)
    for state_dtype in (torch.float32, torch.bfloat16):
        a = make(gen, [4, 2, 1, 3], 4, 16, state_dtype)
        conv0, pool0 = a["conv_state"].clone(), a["state"].clone()
        kw = dict(state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"],
                  num_accepted_tokens=a["num_accepted_tokens"])
        eager = flashkda_ext.fused_kda_verify(*(a[n] for n in POS), **kw)
        torch.cuda.synchronize()
        want = (eager.clone(), a["conv_state"].clone(), a["state"].clone())
        out = torch.full_like(eager, float("nan"))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            flashkda_ext.fused_kda_verify(*(a[n] for n in POS), out=out, **kw)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            flashkda_ext.fused_kda_verify(*(a[n] for n in POS), out=out, **kw)
        a["conv_state"].copy_(conv0)
        a["state"].copy_(pool0)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(want[0]))
        assert torch.equal(bits(a["conv_state"]), bits(want[1])) and torch.equal(bits(a["state"]), bits(want[2]))
