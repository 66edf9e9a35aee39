"""The ops' fast path on the GPU (flashkda_ext/fast_path.py; csrc/common/binding.h, "Call signatures").

After one call of a kind is validated in full, later calls skip Python validation (replaced here by
a tripwire) and launch through the routed module's signature-checked function. Their results must
be bitwise those of the routed module's plain function on the same inputs (which the other GPU test
files check against the reference): every decode route band and state dtype, the fused op, and
packed prefill shapes with dense and pool states; CUDA-graph replay equals eager (decode, prefill);
a call whose metadata changed still reaches the full check, with nothing written.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import flashkda_ext  # noqa: E402
from flashkda_ext import dispatch, ops, validation  # noqa: E402
from gpu_common import bits  # noqa: E402

K = V = 128


@pytest.fixture(autouse=True)
def fresh_paths():
    ops.clear_call_caches()
    yield
    ops.clear_call_caches()


def tripwire(*args, **kwargs):
    raise AssertionError("the full validation ran: the fast path was not taken")


def capture(fn):
    """A CUDA graph of one fn() call, captured on a side stream (fn is not run eagerly)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph


def decode_inputs(rows, HV, gen):
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return dict(q=r(rows, HV, K).bfloat16(), k=r(rows, HV, K).bfloat16(), v=r(rows, HV, V).bfloat16(),
                g=(r(rows, HV, K) - 1.0).bfloat16(), beta=r(rows, HV).bfloat16(),
                A_log=torch.rand(HV, generator=gen, device="cuda") * 2.5 - 2.0, dt_bias=r(HV * K) * 0.5)


def op_decode(a, pool, idx, out):
    return flashkda_ext.kda_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], state=pool, state_indices=idx,
                                   A_log=a["A_log"], dt_bias=a["dt_bias"], out=out)


def plain_decode(a, pool, idx, out):
    call = validation.check_kda_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], state=pool, state_indices=idx,
                                       A_log=a["A_log"], dt_bias=a["dt_bias"], out=out)
    dispatch.function("kda_decode", call.route_meta())(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], pool, idx, out, call.gate_mode,
        call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0)


# points across the unique-slot bands of jit/routes/kda_decode.json (8 .. 8192 work items)
@pytest.mark.parametrize("rows,HV", [(1, 8), (4, 16), (16, 32), (64, 64), (512, 16)])
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16])
def test_decode_fast_path_bitwise_equals_the_plain_function(rows, HV, sdt, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(rows * 131 + HV)
    slots = 2 * rows + 8
    pool = (torch.randn(slots, HV, V, K, generator=gen, device="cuda") * 0.5).to(sdt)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:rows].to(torch.int32)
    op_decode(decode_inputs(rows, HV, gen), pool, idx, None)  # validated in full: the fast entry
    want_pool = pool.clone()
    steps = [decode_inputs(rows, HV, gen) for _ in range(3)]
    wants = []
    for a in steps:
        wants.append(torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda"))
        plain_decode(a, want_pool, idx, wants[-1])
    monkeypatch.setattr(ops.validation, "check_kda_decode", tripwire)
    for a, want in zip(steps, wants):
        got = op_decode(a, pool, idx, None)
        assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(pool), bits(want_pool))


def test_decode_fast_path_in_graph_replay_equals_eager(monkeypatch):
    rows, HV, slots = 8, 16, 40
    gen = torch.Generator(device="cuda").manual_seed(7)
    pool = torch.randn(slots, HV, V, K, generator=gen, device="cuda") * 0.5
    idx = torch.randperm(slots, generator=gen, device="cuda")[:rows].to(torch.int32)
    a = decode_inputs(rows, HV, gen)
    out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    pool0 = pool.clone()
    op_decode(a, pool, idx, out)
    eager_out, eager_pool = out.clone(), pool.clone()
    pool.copy_(pool0)
    out.fill_(float("nan"))
    monkeypatch.setattr(ops.validation, "check_kda_decode", tripwire)
    graph = capture(lambda: op_decode(a, pool, idx, out))
    pool.copy_(pool0)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(eager_out))
    assert torch.equal(bits(pool), bits(eager_pool))


def test_decode_misaligned_input_after_a_fast_entry_reaches_the_full_check():
    rows, HV, slots = 4, 8, 16
    gen = torch.Generator(device="cuda").manual_seed(3)
    pool = torch.randn(slots, HV, V, K, generator=gen, device="cuda")
    idx = torch.arange(rows, dtype=torch.int32, device="cuda")
    op_decode(decode_inputs(rows, HV, gen), pool, idx, None)
    a = decode_inputs(rows, HV, gen)
    flat = torch.randn(rows * HV * K + 1, generator=gen, device="cuda").bfloat16()
    a["q"] = flat[1:].view(rows, HV, K)  # same shape, strides and dtype; 2 bytes off 16-byte alignment
    pool0 = pool.clone()
    out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="q"):
        op_decode(a, pool, idx, out)
    torch.cuda.synchronize()
    assert out.isnan().all()
    assert torch.equal(bits(pool), bits(pool0))


def test_fused_fast_path_bitwise_equals_the_plain_function(monkeypatch):
    rows, H, D, slots = 16, 16, 128, 40
    C = 3 * H * D
    gen = torch.Generator(device="cuda").manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731

    def inputs():
        return dict(x=r(rows, C).bfloat16(), g=(r(rows, H, D) - 1.0).bfloat16(), beta=r(rows, H).bfloat16(),
                    output_gate=r(rows, H, D).bfloat16())
    w, nw = (r(C, 4) * 0.5).bfloat16(), r(D).abs() + 0.5
    A_log, dt_bias = torch.rand(H, generator=gen, device="cuda") * 2.5 - 2.0, r(H * D) * 0.5
    conv, state = r(slots, C, 3).bfloat16(), r(slots, H, D, D) * 0.5
    idx = torch.randperm(slots, generator=gen, device="cuda")[:rows].to(torch.int32)

    def op(a, conv, state, out=None):
        return flashkda_ext.fused_kda_decode(a["x"], w, conv, a["g"], a["beta"], A_log, dt_bias, idx, state,
                                             a["output_gate"], nw, out=out)
    op(inputs(), conv, state)
    steps = [inputs() for _ in range(3)]
    want_conv, want_state, wants = conv.clone(), state.clone(), []
    for a in steps:
        call = validation.check_fused_kda_decode(a["x"], w, want_conv, a["g"], a["beta"], A_log, dt_bias, idx,
                                                 want_state, a["output_gate"], nw)
        wants.append(torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device="cuda"))
        dispatch.function("fused_kda_decode", call.route_meta())(
            a["x"], w, want_conv, a["g"], a["beta"], A_log, dt_bias, idx, want_state, a["output_gate"], nw,
            wants[-1], call.gate_mode, call.lower_bound, call.scale, call.norm_eps, call.null_slot0)
    monkeypatch.setattr(ops.validation, "check_fused_kda_decode", tripwire)
    for a, want in zip(steps, wants):
        assert torch.equal(bits(op(a, conv, state)), bits(want))
    assert torch.equal(bits(conv), bits(want_conv)) and torch.equal(bits(state), bits(want_state))


def prefill_inputs(T, HV, gen):
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return dict(q=r(1, T, HV, K).bfloat16(), k=r(1, T, HV, K).bfloat16(), v=r(1, T, HV, V).bfloat16(),
                g=(r(1, T, HV, K) - 1.0).bfloat16(), beta=r(1, T, HV).bfloat16(),
                A_log=torch.rand(HV, generator=gen, device="cuda") * 2.5 - 2.0, dt_bias=r(HV * K) * 0.5)


def plain_prefill(a, cu, **kw):
    """The routed module's function on the same inputs, its outputs allocated here."""
    call = validation.check_kda_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], A_log=a["A_log"],
                                        dt_bias=a["dt_bias"], cu_seqlens=cu, **kw)
    _, module, _ = ops._prefill_route(call)
    T, HV, N = call.total_tokens, call.value_heads, call.num_seqs
    out = torch.full((1, T, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    pool = "state" in kw
    final = kw["state"] if pool else torch.full((N, HV, V, K), float("nan"), device="cuda")
    ws = torch.empty(int(module["kda_prefill_workspace_bytes"](T, N, HV)), dtype=torch.uint8, device="cuda")
    module["kda_prefill"](a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], cu,
                          kw["state"] if pool else kw["initial_state"], final, kw.get("state_indices"), None, out, ws,
                          call.gate_mode, call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0, 0)
    return out, final


# packed lengths that route to different prefill modules (V tiles 16 / 32 / 64, one-chunk finish)
@pytest.mark.parametrize("lengths", [(64,) * 4, (1000, 24), (3000,), (64,) * 20])
@pytest.mark.parametrize("pool", [False, True])
def test_prefill_fast_path_bitwise_equals_the_plain_function(lengths, pool, monkeypatch):
    HV, N = 16, len(lengths)
    T = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(T + N)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(N)], dtype=torch.int32, device="cuda")
    if pool:
        slots = 2 * N + 3
        st = torch.randn(slots, HV, V, K, generator=gen, device="cuda") * 0.5
        kw = dict(state=st, state_indices=torch.randperm(slots, generator=gen, device="cuda")[:N].to(torch.int32))
    else:
        kw = dict(initial_state=torch.randn(N, HV, V, K, generator=gen, device="cuda") * 0.5)
    flashkda_ext.kda_prefill(**prefill_inputs(T, HV, gen), cu_seqlens=cu, **kw)  # the fast entry
    steps = [prefill_inputs(T, HV, gen) for _ in range(2)]
    want_kw = dict(kw, state=kw["state"].clone()) if pool else kw
    wants = [plain_prefill(a, cu, **want_kw) for a in steps]
    monkeypatch.setattr(ops.validation, "check_kda_prefill", tripwire)
    for a, (want_out, want_final) in zip(steps, wants):
        out, final = flashkda_ext.kda_prefill(**a, cu_seqlens=cu, **kw)
        assert torch.equal(bits(out), bits(want_out))
        if not pool:
            assert torch.equal(bits(final), bits(want_final))
    if pool:
        assert torch.equal(bits(kw["state"]), bits(want_kw["state"]))


def test_prefill_fast_path_in_graph_replay_equals_eager(monkeypatch):
    lengths, HV = (300, 64, 700), 16
    N, T = len(lengths), sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(5)
    cu = torch.tensor([0, 300, 364, 1064], dtype=torch.int32, device="cuda")
    a = prefill_inputs(T, HV, gen)
    init = torch.randn(N, HV, V, K, generator=gen, device="cuda") * 0.5
    ws = torch.empty(flashkda_ext.prefill_workspace_bytes(a["q"], a["v"], cu_seqlens=cu), dtype=torch.uint8,
                     device="cuda")
    out = torch.full((1, T, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    final = torch.full((N, HV, V, K), float("nan"), device="cuda")
    run = lambda: flashkda_ext.kda_prefill(**a, cu_seqlens=cu, initial_state=init, final_state=final,  # noqa: E731
                                           workspace=ws, out=out)
    run()
    eager_out, eager_final = out.clone(), final.clone()
    out.fill_(float("nan"))
    final.fill_(float("nan"))
    monkeypatch.setattr(ops.validation, "check_kda_prefill", tripwire)
    graph = capture(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(eager_out))
    assert torch.equal(bits(final), bits(eager_final))
