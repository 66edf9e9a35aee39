"""GPU tests of the CUDA kda_verify modules (csrc/verify) against the PyTorch reference.

Every record of jit/modules/verify_cuda.json x T_max in {1, 2, 3, 4, 8} with mixed T_n in one batch,
num_accepted_tokens, padding requests and padding tokens. Fresh random inputs each case (never
zeros); outputs NaN-poisoned first; every slot no stored token names stays bitwise unchanged;
padding requests give exact zeros; the verify kernel at one token equals the decode kernel of the
same tile shape bitwise, and T tokens equal T chained decode calls bitwise; T_max = 1 through the
op equals kda_decode bitwise; the values the kernel cannot serve (slot >= slots, a count outside
[1, T_max]) are padding; bitwise determinism; CUDA-graph replay == eager.

Run: python3 -m pytest -q tests/gpu/test_verify_gpu.py
"""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import flashkda_ext  # noqa: E402
from flashkda_ext import reference as REF  # noqa: E402
from gpu_common import GATES, bits, load, packed_rows, paged_like, prebuild_selected, records_by_name, rel_l2, sdtype, verify_tables  # noqa: E402,E501

RECORDS = records_by_name("verify_cuda.json")
NAMES = list(RECORDS)
K = V = 128
LENS = {1: [1, 1, 1, 1], 2: [2, 1, 2, 2, 1], 3: [3, 1, 2, 3], 4: [4, 2, 1, 3, 4], 8: [8, 5, 1, 8, 3, 7],
        12: [12, 9, 1, 12, 5]}  # 12: past the staged modules' 8-token block (a second, partial block)
# a decode module on state registers (the same per-V-row step, prep and packing as every verify
# module: a V-row's values do not depend on the CTA's shape)
DECODE_TWIN = {"float32": "decode_split8_f32_o32", "bfloat16": "decode_split8_bf16_o32"}


@pytest.fixture(scope="module", autouse=True)
def _prebuild(request):
    prebuild_selected(request)


def make(gen, lens, cols, H, HV, state_dtype, gate="softplus", pad_request=None, pad_token=None, spare=5):
    N, T = len(lens), sum(lens)
    slots = N * cols + spare
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    a = dict(q=r(1, T, H, K).bfloat16(), k=r(1, T, H, K).bfloat16(), v=r(1, T, HV, V).bfloat16(),
             g=((-torch.nn.functional.softplus(r(1, T, HV, K))) if gate == "log" else r(1, T, HV, K) - 1.0).bfloat16(),
             beta=r(1, T, HV).bfloat16(),
             A_log=None if gate == "log" else (torch.rand(HV, generator=gen, device="cuda") * 2.5 - 2.0).float(),
             dt_bias=None if gate == "log" else (r(HV * K) * 0.5).float(),
             state=(r(slots, HV, V, K) * 0.5).to(state_dtype))
    idx, nacc, cu = verify_tables(gen, lens, cols, slots)
    if pad_request is not None:
        idx[pad_request, int(nacc[pad_request]) - 1] = -3
    if pad_token is not None and int(nacc[pad_token[0]]) - 1 != pad_token[1]:
        idx[pad_token] = -1
    a.update(state_indices=idx.cuda(), num_accepted_tokens=nacc.cuda(), cu_seqlens=cu)
    return a


def call_module(name, a, out, gate="softplus", lb=-5.0, scale=None, beta_is_logit=True, null_slot0=False):
    """The module's own function on a's tensors; a _gb32 module (params.gb_f32) gets g and beta as fp32,
    converted exactly from a's bf16 values, so every test holds it to its bf16 twin's results. a's
    initial_state / initial_state_indices (the second start pool) are passed when present."""
    g, beta = a["g"], a["beta"]
    if RECORDS[name]["params"].get("gb_f32") and g.dtype != torch.float32:
        g, beta = g.float(), beta.float()
    load(name)["kda_verify"](a["q"], a["k"], a["v"], g, beta, a["A_log"], a["dt_bias"], a["state"],
                             a["state_indices"], a["cu_seqlens"], a["num_accepted_tokens"], a.get("initial_state"),
                             a.get("initial_state_indices"), a.get("parent_tokens"), out, GATES[gate], float(lb),
                             float(K ** -0.5 if scale is None else scale), bool(beta_is_logit), bool(null_slot0))


def reference(a, gate="softplus", lb=-5.0, **kw):
    """(out float64 [1, T, HV, V], new pool) on the GPU, from the (unchanged) inputs."""
    return REF.kda_verify_step(
        a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"], state_indices=a["state_indices"],
        cu_seqlens=a["cu_seqlens"], num_accepted_tokens=a["num_accepted_tokens"], gate=gate, A_log=a["A_log"],
        dt_bias=a["dt_bias"], lower_bound=lb if gate == "bounded" else None, **kw)


def stored_slots(a, null_slot0=False):
    plan = REF.verify_plan(a["cu_seqlens"].cpu(), a["state_indices"].cpu(), a["num_accepted_tokens"].cpu(),
                           a["state"].shape[0], null_slot0)
    return plan, {w for _, _, read, ws in plan if read is not None for w in ws if w is not None}


def check(a, pool0, out, ref_out, ref_pool, what, null_slot0=False):
    plan, written = stored_slots(a, null_slot0)
    torch.cuda.synchronize()
    assert not torch.isnan(out.float()).any(), f"{what}: an output element was never written"
    assert rel_l2(out.float(), ref_out) < 1.2e-2, what
    tol = 4e-3 if a["state"].dtype == torch.float32 else 1e-2
    for s in written:
        assert rel_l2(a["state"][s].float(), ref_pool[s].double()) < tol, (what, s)
    for s in range(pool0.shape[0]):
        if s not in written:
            assert torch.equal(bits(a["state"][s]), bits(pool0[s])), f"{what}: slot {s} changed"
    for s, e, read, _ in plan:
        if read is None:
            assert torch.equal(out[0, s:e], torch.zeros_like(out[0, s:e])), f"{what}: padding output not zero"


@pytest.mark.parametrize("cols", sorted(LENS))
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name, cols):
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(1000 + cols)
    lens = LENS[cols]
    for H, HV, gate in ((4, 4, "softplus"), (2, 8, "bounded"), (4, 4, "log")):
        a = make(gen, lens, cols, H, HV, sdtype(rec), gate, pad_request=1, pad_token=(0, cols - 1) if cols > 1 else None)
        pool0 = a["state"].clone()
        ref_out, ref_pool = reference(a, gate)
        out = torch.full((1, sum(lens), HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call_module(name, a, out, gate)
        check(a, pool0, out, ref_out, ref_pool, f"{name} T_max={cols} {gate} HV={HV}")


@pytest.mark.parametrize("cols", [2, 4, 8])
@pytest.mark.parametrize("name", NAMES)
def test_strided_pool_equals_the_dense_pool_bitwise(name, cols):
    """A pool whose slots sit a page apart (vLLM's paged cache; docs/semantics.md "Strided pools"): every
    module (bulk4's bulk copies move a tile from each slot's base) gives bitwise the dense pool's outputs and
    slots; the filler between slots and the slots no token stores stay bitwise unchanged."""
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(2000 + cols)
    a = make(gen, LENS[cols], cols, 2, 8, sdtype(rec), pad_request=1)
    dense = a["state"]
    pages, pool, filler = paged_like(dense, seed=cols)
    pages0, dense0 = pages.clone(), dense.clone()
    outs = []
    for p in (pool, dense):
        out = torch.full((1, sum(LENS[cols]), 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call_module(name, dict(a, state=p), out)
        outs.append(out)
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0].float()).any()
    assert torch.equal(bits(outs[0]), bits(outs[1])), f"{name}: output differs from the dense pool's"
    assert torch.equal(bits(pool), bits(dense)), f"{name}: slots differ from the dense pool's"
    assert torch.equal(bits(filler(pages)), bits(filler(pages0))), f"{name}: filler between slots changed"
    _, written = stored_slots(dict(a, state=dense0))
    rest = [s for s in range(dense.shape[0]) if s not in written]
    assert written and torch.equal(bits(pool[rest]), bits(dense0[rest])), f"{name}: an unstored slot changed"


@pytest.mark.parametrize("cols", [1, 4, 12])
@pytest.mark.parametrize("name", NAMES)
def test_row_strided_inputs_equal_the_dense_inputs_bitwise(name, cols):
    """q | k | v as column blocks of one packed buffer and g | beta of one projection, token-major (the layouts
    vLLM and SGLang hand over; docs/api.md "Layouts"): every module reads the views as they are (the staged
    cp.async loads, a token stride apart), bitwise the dense call; tokens off a 16-byte multiple are refused
    naming the argument, nothing written."""
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(4000 + cols)
    a = make(gen, LENS[cols], cols, 2, 8, sdtype(rec), pad_request=1)
    if rec["params"].get("gb_f32"):      # the module's own g / beta dtype, so the views reach it as they are
        a["g"], a["beta"] = a["g"].float(), a["beta"].float()
    views = dict(zip(("q", "k", "v"), packed_rows([a["q"], a["k"], a["v"]], 1)))
    views.update(zip(("g", "beta"), packed_rows([a["g"], a["beta"]], 1)))
    pool0 = a["state"].clone()
    T = sum(LENS[cols])
    results = []
    for inputs in ({}, views):
        a["state"] = pool0.clone()
        out = torch.full((1, T, 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call_module(name, dict(a, **inputs), out)
        results.append((out, a["state"]))
    torch.cuda.synchronize()
    (o0, p0), (o1, p1) = results
    assert not torch.isnan(o1.float()).any()
    assert torch.equal(bits(o1), bits(o0)), f"{name}: output differs from the dense inputs'"
    assert torch.equal(bits(p1), bits(p0)), f"{name}: slots differ from the dense inputs'"
    for what in ("k", "g"):
        bad = dict(views, **{what: packed_rows([a[what]], 1, extra=2)[0]})   # tokens 2 elements off 16 bytes
        a["state"] = pool0.clone()
        out = torch.full((1, T, 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=f"'{what}'.*16-byte"):
            call_module(name, dict(a, **bad), out)
        torch.cuda.synchronize()
        assert out.isnan().all() and torch.equal(bits(a["state"]), bits(pool0))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 4])
def test_op_reads_row_strided_views_bitwise(state_dtype, cols):
    """Through the public op (its checks on real addresses, its routes, the fast path on the second strided
    call; T_max = 1 served by the decode module): views of packed buffers give bitwise the dense call."""
    gen = torch.Generator(device="cuda").manual_seed(77 + cols)
    a = make(gen, LENS[cols], cols, 4, 8, state_dtype, pad_request=1)
    views = dict(zip(("q", "k", "v"), packed_rows([a["q"], a["k"], a["v"]], 1)))
    views.update(zip(("g", "beta"), packed_rows([a["g"], a["beta"]], 1)))
    pool0 = a["state"].clone()
    kw = dict(state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"],
              num_accepted_tokens=a["num_accepted_tokens"], A_log=a["A_log"], dt_bias=a["dt_bias"])
    results = []
    for inputs in (a, views, views):
        pool = pool0.clone()
        out = torch.full((1, sum(LENS[cols]), 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        flashkda_ext.kda_verify(*(inputs[n] for n in ("q", "k", "v", "g", "beta")), state=pool, out=out, **kw)
        results.append((out, pool))
    torch.cuda.synchronize()
    (o0, p0), *rest = results
    assert not torch.isnan(o0.float()).any() and not torch.equal(bits(p0), bits(pool0))
    for o, p in rest:
        assert torch.equal(bits(o), bits(o0)) and torch.equal(bits(p), bits(p0))


@pytest.mark.parametrize("name", NAMES)
def test_options_scale_beta_null_slot0(name):
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(7)
    a = make(gen, [3, 2, 4], 4, 4, 8, sdtype(rec))
    a["beta"] = torch.rand(a["beta"].shape, generator=gen, device="cuda").bfloat16()
    a["state_indices"][2, int(a["num_accepted_tokens"][2]) - 1] = 0  # request 2 starts from the null block
    pool0 = a["state"].clone()
    ref_out, ref_pool = reference(a, scale=0.05, beta_is_logit=False, null_slot0=True)
    out = torch.full((1, 9, 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, a, out, scale=0.05, beta_is_logit=False, null_slot0=True)
    check(a, pool0, out, ref_out, ref_pool, name, null_slot0=True)
    assert torch.equal(bits(a["state"][0]), bits(pool0[0]))
    assert torch.equal(out[0, 5:], torch.zeros_like(out[0, 5:]))  # request 2 (tokens 5..8) is padding


# (lens, T_max): the second reaches past the staged modules' 8-token block (16 = two full blocks,
# 9 and 11 a full one and a partial one)
CHAINED = [([4, 1, 3, 2], 4), ([11, 8, 9, 1, 16], 16)]


@pytest.mark.parametrize("lens,cols", CHAINED)
@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("o32")])
def test_tokens_equal_chained_decode_kernel_bitwise(name, lens, cols):
    """The state stays packed in the pool's dtype between tokens: token t equals the decode kernel of
    the same tile shape on the state stored after token t - 1, bitwise (T = 1 included)."""
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(3 + cols)
    H, HV = 4, 8
    a = make(gen, lens, cols, H, HV, sdtype(rec))
    pool0 = a["state"].clone()
    out = torch.full((1, sum(lens), HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, a, out)
    plan, _ = stored_slots(a)
    dec = load(DECODE_TWIN[rec["state_dtype"]])["kda_decode"]
    work = torch.cat([pool0, pool0[:1]])
    scratch = pool0.shape[0]
    want = torch.empty_like(out)
    for s, e, read, writes in plan:
        work[scratch] = pool0[read]
        for t in range(s, e):
            o = torch.empty(1, HV, V, dtype=torch.bfloat16, device="cuda")
            dec(a["q"][0, t:t + 1], a["k"][0, t:t + 1], a["v"][0, t:t + 1], a["g"][0, t:t + 1], a["beta"][0, t:t + 1],
                a["A_log"], a["dt_bias"], work, torch.tensor([scratch], dtype=torch.int32, device="cuda"), o, 0, 0.0,
                K ** -0.5, True, False)
            want[0, t] = o[0]
            if writes[t - s] is not None:
                work[writes[t - s]] = work[scratch]
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(want))
    assert torch.equal(bits(a["state"]), bits(work[:scratch]))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_op_t1_equals_kda_decode_bitwise(state_dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    for N, HV in ((3, 8), (64, 16), (300, 32)):
        a = make(gen, [1] * N, 1, HV, HV, state_dtype, spare=4)
        a["state_indices"][1, 0] = -1
        pool = a["state"].clone()
        want = flashkda_ext.kda_decode(a["q"][0], a["k"][0], a["v"][0], a["g"][0], a["beta"][0], state=pool,
                                       state_indices=a["state_indices"][:, 0].contiguous(), A_log=a["A_log"],
                                       dt_bias=a["dt_bias"], slot_mode="padded")
        got = flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"],
                                      state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"],
                                      num_accepted_tokens=a["num_accepted_tokens"], A_log=a["A_log"],
                                      dt_bias=a["dt_bias"])
        assert torch.equal(bits(got[0]), bits(want))
        assert torch.equal(bits(a["state"]), bits(pool))


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("o32")])
def test_values_the_kernel_cannot_serve_are_padding(name):
    """A count outside [1, T_max] or a read slot >= slots: a padding request; a token slot >= slots:
    not stored. Nothing outside the pool is touched."""
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(9)
    a = make(gen, [2, 3, 2, 1], 3, 4, 4, sdtype(rec))
    slots = a["state"].shape[0]
    nacc = a["num_accepted_tokens"]
    nacc[0] = 0
    nacc[3] = 4
    a["state_indices"][2, int(nacc[2]) - 1] = slots + 7
    read1 = int(nacc[1]) - 1
    j = (read1 + 1) % 3  # a token of request 1 other than its read column
    a["state_indices"][1, j] = slots
    pool0 = a["state"].clone()
    out = torch.full((1, 8, 4, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, a, out)
    torch.cuda.synchronize()
    for s0, e0 in ((0, 2), (5, 7), (7, 8)):
        assert torch.equal(out[0, s0:e0], torch.zeros_like(out[0, s0:e0])), (s0, e0)
    assert not torch.isnan(out.float()).any()
    live = {int(a["state_indices"][1, t]) for t in range(3) if t != j}
    assert any(not torch.equal(bits(a["state"][s]), bits(pool0[s])) for s in live)
    for s in range(slots):
        if s not in live:
            assert torch.equal(bits(a["state"][s]), bits(pool0[s])), s


def test_op_routes_deterministic_and_graph_replay_equals_eager():
    gen = torch.Generator(device="cuda").manual_seed(21)
    for state_dtype in (torch.float32, torch.bfloat16):
        a = make(gen, [4, 2, 1, 3, 4, 4], 4, 8, 16, state_dtype)
        pool0 = a["state"].clone()
        kw = dict(state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"],
                  num_accepted_tokens=a["num_accepted_tokens"], A_log=a["A_log"], dt_bias=a["dt_bias"])
        results = []
        for _ in range(2):
            a["state"].copy_(pool0)
            out = flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"], **kw)
            torch.cuda.synchronize()
            results.append((out.clone(), a["state"].clone()))
        assert torch.equal(bits(results[0][0]), bits(results[1][0])), "not deterministic"
        assert torch.equal(bits(results[0][1]), bits(results[1][1])), "not deterministic (state)"
        ref_out, ref_pool = reference(dict(a, state=pool0))
        _, written = stored_slots(a)
        assert rel_l2(results[0][0].float(), ref_out) < 1.2e-2
        assert_graph_replay_equals(a, kw, pool0, *results[0])
        assert written


def assert_graph_replay_equals(a, kw, pool0, want_out, want_pool):
    """The op on a (from pool0) captured in a CUDA graph and replayed: out and pool bitwise want_*."""
    out = torch.full_like(want_out, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on the capture stream (fast-path entry, module load)
        flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"], out=out, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"], out=out, **kw)
    a["state"].copy_(pool0)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(want_out)), "graph replay != eager (out)"
    assert torch.equal(bits(a["state"]), bits(want_pool)), "graph replay != eager (state)"


def _graph_padded(a, live):
    """a's requests past the first `live` made empty the way vLLM pads a speculative batch to a
    CUDA-graph size: the last offset repeated, the null block (slot 0, null_slot0) in their rows,
    count 1; the tokens past the live requests dropped."""
    T = int(a["cu_seqlens"][live])
    a["cu_seqlens"][live + 1:] = T
    a["state_indices"][live:] = 0
    a["num_accepted_tokens"][live:] = 1
    for n in ("q", "k", "v", "g", "beta"):
        a[n] = a[n][:, :T].contiguous()
    return a


@pytest.mark.parametrize("name", NAMES)
def test_empty_requests_read_and_write_nothing(name):
    """Empty requests (T_n = 0) among live ones and trailing as vLLM's graph padding (T < N): the live
    requests match the reference, every slot no live token stores (the empty requests' included) stays
    bitwise unchanged, every output row is written."""
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(95)
    a = _graph_padded(make(gen, [3, 0, 2, 0, 1, 4] + [2] * 10, 4, 2, 8, sdtype(rec), pad_token=(2, 1)), 6)
    assert a["q"].shape[1] < a["state_indices"].shape[0]
    pool0 = a["state"].clone()
    ref_out, ref_pool = reference(a, null_slot0=True)
    out = torch.full((1, a["q"].shape[1], 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, a, out, null_slot0=True)
    check(a, pool0, out, ref_out, ref_pool, f"{name} empty requests", null_slot0=True)


def test_op_serves_a_graph_padded_batch_and_replays_it():
    """The public op on vLLM's CUDA-graph-padded speculative batch (trailing empty requests, T < N), fp32
    and bf16 pools: it matches the reference, and a captured graph replays it bitwise."""
    gen = torch.Generator(device="cuda").manual_seed(96)
    for state_dtype in (torch.float32, torch.bfloat16):
        a = _graph_padded(make(gen, [4, 2, 3, 4] + [4] * 12, 4, 8, 16, state_dtype), 4)
        pool0 = a["state"].clone()
        kw = dict(state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"], null_slot0=True,
                  num_accepted_tokens=a["num_accepted_tokens"], A_log=a["A_log"], dt_bias=a["dt_bias"])
        eager = flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"], **kw)
        torch.cuda.synchronize()
        eager_pool = a["state"].clone()
        ref_out, ref_pool = reference(dict(a, state=pool0), null_slot0=True)
        check(dict(a, state=eager_pool), pool0, eager, ref_out, ref_pool, f"op {state_dtype}", null_slot0=True)
        assert_graph_replay_equals(a, kw, pool0, eager, eager_pool)


GB32 = sorted(n for n in NAMES if RECORDS[n]["params"].get("gb_f32"))


@pytest.mark.parametrize("name", GB32)
def test_gb32_module_reads_fp32_gate_and_beta_as_they_are(name):
    """fp32 g and beta whose values bf16 cannot hold: the _gb32 module matches the reference on those values
    and differs from its bf16 twin on the rounded values (it reads the fp32 values, not a rounding of them)."""
    rec = RECORDS[name]
    base = name[:-len("_gb32")]
    gen = torch.Generator(device="cuda").manual_seed(97)
    a = make(gen, LENS[4], 4, 2, 8, sdtype(rec), pad_request=1)
    g32 = torch.randn(a["g"].shape, generator=gen, device="cuda") - 1.0
    b32 = torch.randn(a["beta"].shape, generator=gen, device="cuda")
    assert not torch.equal(g32, g32.bfloat16().float())
    pool0 = a["state"].clone()
    exact = dict(a, g=g32, beta=b32)
    ref_out, ref_pool = reference(exact)
    out = torch.full((1, sum(LENS[4]), 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, exact, out)
    check(exact, pool0, out, ref_out, ref_pool, name)
    a["state"].copy_(pool0)
    rounded = dict(a, g=g32.bfloat16(), beta=b32.bfloat16())
    out16 = torch.full_like(out, float("nan"))
    call_module(base, rounded, out16)
    torch.cuda.synchronize()
    assert not torch.isnan(out16.float()).any() and not torch.equal(bits(out), bits(out16)), name


def test_op_takes_fp32_gate_and_beta_to_the_gb32_twin():
    """The public op with fp32 g and beta (and with fp32 g beside bf16 beta: one exact pass) beside bf16 q: bitwise
    the routed _gb32 module's result, for each band a call of this size routes to."""
    from flashkda_ext import dispatch
    gen = torch.Generator(device="cuda").manual_seed(98)
    for lens, HV, state_dtype in (([2], 8, torch.bfloat16), ([3, 1, 4, 2], 8, torch.float32),
                                  ([4, 2, 3, 1] * 4, 8, torch.bfloat16)):
        a = make(gen, lens, 4, 4, HV, state_dtype)
        g32 = torch.randn(a["g"].shape, generator=gen, device="cuda") - 1.0
        b16 = a["beta"]
        pool0 = a["state"].clone()
        kw = dict(state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"],
                  num_accepted_tokens=a["num_accepted_tokens"], A_log=a["A_log"], dt_bias=a["dt_bias"])
        results = []
        for beta in (b16.float(), b16):
            a["state"].copy_(pool0)
            out = flashkda_ext.kda_verify(a["q"], a["k"], a["v"], g32, beta, state=a["state"], **kw)
            torch.cuda.synchronize()
            results.append((out, a["state"].clone()))
        meta = dict(device="cuda", num_seqs=len(lens), value_heads=HV, total_tokens=sum(lens), max_seqlen=4,
                    work_items=len(lens) * HV, state="f32" if state_dtype == torch.float32 else "bf16",
                    offset="o32", gate="softplus", gb="f32")
        name = dispatch.module_name("kda_verify", meta)
        assert name.endswith("_gb32"), name
        a["state"].copy_(pool0)
        out = torch.full_like(results[0][0], float("nan"))
        call_module(name, dict(a, g=g32, beta=b16.float()), out)
        torch.cuda.synchronize()
        for got, pool in results:
            assert torch.equal(bits(got), bits(out)) and torch.equal(bits(pool), bits(a["state"])), name


def assert_twins_bitwise(name, twin, a, HV, gate="softplus"):
    """The call of a (from its pool as it is) through module name and through twin: every output
    written, outputs and the whole pool bitwise equal, something stored."""
    pool0 = a["state"].clone()
    T = a["q"].shape[1]
    results = []
    for mod in (name, twin):
        a["state"].copy_(pool0)
        out = torch.full((1, T, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call_module(mod, a, out, gate)
        torch.cuda.synchronize()
        results.append((out, a["state"].clone()))
    (out, pool), (want_out, want_pool) = results
    assert not torch.isnan(out.float()).any(), "an output element was never written"
    assert torch.equal(bits(out), bits(want_out)), f"{name} != {twin} (out, {gate})"
    assert torch.equal(bits(pool), bits(want_pool)), f"{name} != {twin} (state, {gate})"
    assert not torch.equal(bits(pool), bits(pool0)), "nothing was stored"


# The step and prep variants (joint_passes: the row sums of several passes in one butterfly;
# wide_gate: the decays computed by the whole CTA; gb_f32: g and beta read as fp32, here given the
# bf16 values exactly) and the module they vary: the record with the same params but those. split_prep
# (w1v16j4s) has no such base record: the chained-decode tests hold it bitwise to decode's prepare().
VARIANT_KEYS = ("joint_passes", "wide_gate", "gb_f32")


def _base_of(name):
    """The live record that differs from name only by dropping some of its variant keys (the fewest),
    or None (its base was a candidate that lost: the variant is held to the reference above)."""
    rec = RECORDS[name]
    keys = [k for k in VARIANT_KEYS if k in rec["params"]]
    for drop in range(1, len(keys) + 1):
        for gone in itertools.combinations(keys, drop):
            want = {k: v for k, v in rec["params"].items() if k not in gone}
            same = [n for n in NAMES if n != name and RECORDS[n]["params"] == want
                    and all(RECORDS[n][f] == rec[f] for f in ("state_dtype", "slot_offset_bits", "threads",
                                                                "smem_bytes"))]
            assert len(same) <= 1, (name, same)
            if same:
                return same[0]
    return None


VARIANT_BASE = {n: b for n in NAMES if any(k in RECORDS[n]["params"] for k in VARIANT_KEYS)
                for b in [_base_of(n)] if b is not None}


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
@pytest.mark.parametrize("name", sorted(VARIANT_BASE))
def test_step_and_prep_variants_bitwise_equal_their_base_module(name, gate):
    """The same calls (every gate; requests of 1-12 tokens, so a second 8-token block runs; a padding
    request, dead token slots, more heads than the CTA's prep threads see at once) through the
    variant and the module it varies give bitwise equal outputs and pools; the base module is checked
    against the reference and chained decode above."""
    base = VARIANT_BASE[name]
    rec = RECORDS[name]
    gen = torch.Generator(device="cuda").manual_seed(91)
    lens, cols, H, HV = [12, 1, 2, 7, 8, 3, 5, 9], 12, 2, 8
    a = make(gen, lens, cols, H, HV, sdtype(rec), gate, pad_request=2, pad_token=(0, 5))
    assert_twins_bitwise(name, base, a, HV, gate)
