"""fused_kda_verify on the CPU backend: against the reference on fresh random data (mixed T_n,
num_accepted_tokens, padding, untouched slots and conv lines), T_max = 1 equal to fused_kda_decode
bitwise, every accepted prefix's conv window and state equal to chained fused_kda_decode calls
bitwise (what the next call resumes from), errors naming the argument, cold / warm agreement."""
from __future__ import annotations

import random

import pytest
import torch

import flashkda_ext
from flashkda_ext import fast_path, ops, validation
from flashkda_ext import reference as R
from flashkda_ext.devtools.testing import call_outcome, fused_chain_start

H, D = 2, 8
C = 3 * H * D


@pytest.fixture(autouse=True)
def fresh():
    ops.clear_call_caches()
    yield
    ops.clear_call_caches()


def gen_():
    return torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))


def make(gen, lens, cols, *, extra_len=0, dtype=torch.float32, state_dtype=torch.float32, gate="softplus",
         pad_request=None, pad_token=None):
    N, T = len(lens), sum(lens)
    slots = N * cols + 3
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(dtype)  # noqa: E731
    idx = torch.randperm(slots, generator=gen)[:N * cols].reshape(N, cols).to(torch.int32)
    nacc = torch.randint(1, cols + 1, (N,), generator=gen, dtype=torch.int32)
    if pad_request is not None:
        idx[pad_request, int(nacc[pad_request]) - 1] = -1
    if pad_token is not None and pad_token[1] not in (0, int(nacc[pad_token[0]]) - 1):
        idx[pad_token] = -2
    a = dict(x=r(1, T, C), conv_weight=r(C, 4, scale=0.5), conv_state=r(slots, C, cols + 2 + extra_len),
             g=r(1, T, H, D), beta=r(1, T, H), A_log=torch.randn(H, generator=gen) * 0.3,
             dt_bias=torch.randn(H * D, generator=gen) * 0.5,
             state=(torch.randn(slots, H, D, D, generator=gen) * 0.5).to(state_dtype), output_gate=r(1, T, H, D),
             norm_weight=torch.randn(D, generator=gen) + 1.0, state_indices=idx,
             cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
             num_accepted_tokens=nacc, gate=gate)
    if gate == "log":
        a.update(A_log=None, dt_bias=None, g=-torch.rand(1, T, H, D, generator=gen).to(dtype) - 0.01)
    if gate == "bounded":
        a["lower_bound"] = -4.0
    return a


POS = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state", "output_gate", "norm_weight")


def run(a):
    return flashkda_ext.fused_kda_verify(*(a[n] for n in POS), **{n: v for n, v in a.items() if n not in POS})


def reference(a):
    kw = {n: v for n, v in a.items() if n not in POS and n not in ("out", "max_seqlen")}
    return R.fused_kda_verify_step(*(a[n] for n in POS), **kw)


@pytest.mark.parametrize("cols,lens", [(1, [1, 1, 1]), (2, [2, 1, 2]), (4, [4, 1, 3, 2]), (8, [8, 2, 5])])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(cols, lens, state_dtype):
    gen = gen_()
    a = make(gen, lens, cols, extra_len=1, state_dtype=state_dtype, pad_request=1,
             pad_token=(0, cols - 1) if cols > 2 else None)
    a["out"] = torch.full((1, sum(lens), H, D), float("nan"))
    conv0, pool0 = a["conv_state"].clone(), a["state"].clone()
    ref_out, ref_conv, ref_pool = reference(a)
    out = run(a)
    assert torch.isfinite(out).all()
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(a["state"].double(), ref_pool.double(), **tol)
    assert torch.equal(a["conv_state"], ref_conv)  # the conv lines only move inputs: exact
    plan = R.verify_plan(a["cu_seqlens"], a["state_indices"], a["num_accepted_tokens"], pool0.shape[0])
    live = [(s, e, read, ws) for s, e, read, ws in plan if read is not None and ws[0] is not None]
    written = {w for *_, ws in live for w in ws if w is not None}
    lines = {ws[0] for *_, ws in live}
    for s in range(pool0.shape[0]):
        if s not in written:
            assert torch.equal(a["state"][s], pool0[s]), f"slot {s} changed"
        if s not in lines:
            assert torch.equal(a["conv_state"][s], conv0[s]), f"conv line {s} changed"
    s, e = plan[1][:2]
    assert torch.equal(out[0, s:e], torch.zeros_like(out[0, s:e]))


def _free_slot0(a):
    """Slot 0 out of the live rows (it is the null block below): an unnamed slot takes its place."""
    idx = a["state_indices"]
    spare = min(set(range(1, a["state"].shape[0])) - set(idx.flatten().tolist()))
    idx[idx == 0] = spare


def test_empty_requests_touch_neither_cache():
    """Requests of 0 tokens (among live ones, and trailing with null-slot rows and count 1, as vLLM pads
    a speculative batch; T < N): the live requests match the reference; the empty requests' state slots
    and conv lines, and every slot and line no live request stores, stay bitwise unchanged."""
    gen = gen_()
    lens = [3, 0, 2] + [0] * 4
    a = make(gen, lens, 4)
    _free_slot0(a)
    a["state_indices"][3:] = 0
    a["num_accepted_tokens"][3:] = 1
    a["null_slot0"] = True
    assert sum(lens) < len(lens)
    conv0, pool0 = a["conv_state"].clone(), a["state"].clone()
    ref_out, ref_conv, ref_pool = reference(a)
    out = run(a)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a["state"].double(), ref_pool.double(), atol=1e-5, rtol=1e-5)
    assert torch.equal(a["conv_state"], ref_conv)
    plan = R.verify_plan(a["cu_seqlens"], a["state_indices"], a["num_accepted_tokens"], pool0.shape[0], True)
    live = [ws for s, e, read, ws in plan if e > s and read is not None and ws[0] is not None]
    written = {w for ws in live for w in ws if w is not None}
    lines = {ws[0] for ws in live}
    assert len(lines) == 2
    empty_row = [int(x) for x in a["state_indices"][1].tolist()]  # request 1: empty, live slots
    for s in range(pool0.shape[0]):
        if s not in written:
            assert torch.equal(a["state"][s], pool0[s]), f"slot {s} changed"
        if s not in lines:
            assert torch.equal(a["conv_state"][s], conv0[s]), f"conv line {s} changed"
    assert not set(empty_row) & (written | lines)


@pytest.mark.parametrize("gate", ["bounded", "log"])
def test_gates_bf16_inputs(gate):
    gen = gen_()
    a = make(gen, [3, 2], 3, dtype=torch.bfloat16, state_dtype=torch.bfloat16, gate=gate)
    ref_out, ref_conv, ref_pool = reference(a)
    out = run(a)
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(a["state"].double(), ref_pool.double(), atol=3e-2, rtol=3e-2)
    assert torch.equal(a["conv_state"], ref_conv)


def _fused_decode(a, t, conv, pool, slot):
    sl = slice(t, t + 1)
    return flashkda_ext.fused_kda_decode(
        a["x"][0, sl], a["conv_weight"], conv, a["g"][0, sl], a["beta"][0, sl], a["A_log"], a["dt_bias"],
        torch.tensor([slot], dtype=torch.int32), pool, a["output_gate"][0, sl], a["norm_weight"], gate=a["gate"],
        lower_bound=a.get("lower_bound"), slot_mode="padded")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_one_token_equals_fused_kda_decode_bitwise(state_dtype):
    gen = gen_()
    a = make(gen, [1, 1, 1, 1], 1, state_dtype=state_dtype, dtype=torch.bfloat16)
    a["state_indices"][2, 0] = -1
    conv, pool = a["conv_state"].clone(), a["state"].clone()
    want = flashkda_ext.fused_kda_decode(
        a["x"][0], a["conv_weight"], conv, a["g"][0], a["beta"][0], a["A_log"], a["dt_bias"],
        a["state_indices"][:, 0].contiguous(), pool, a["output_gate"][0], a["norm_weight"], slot_mode="padded")
    got = run(a)
    assert torch.equal(got[0], want) and torch.equal(a["state"], pool) and torch.equal(a["conv_state"], conv)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_every_accepted_prefix_resumes_as_chained_fused_decode(state_dtype):
    """After the call, for every a in 1..T_n: the conv window at offset a - 1 of the request's line and
    the state in slot state_indices[n, a - 1] are what a - 1 + 1 chained fused_kda_decode calls leave,
    and every token's output equals the chained call's, bitwise."""
    gen = gen_()
    lens, cols = [4, 2, 3], 4
    a = make(gen, lens, cols, state_dtype=state_dtype, dtype=torch.bfloat16)
    conv0, pool0 = a["conv_state"].clone(), a["state"].clone()
    out = run(a)
    plan = R.verify_plan(a["cu_seqlens"], a["state_indices"], a["num_accepted_tokens"], pool0.shape[0])
    for n, (s, e, read, writes) in enumerate(plan):
        conv, pool = fused_chain_start(conv0, pool0, int(a["num_accepted_tokens"][n]), read, writes)
        for t in range(s, e):
            want = _fused_decode(a, t, conv, pool, 0)
            assert torch.equal(out[0, t], want[0]), (n, t)
            acc = t - s + 1
            assert torch.equal(a["conv_state"][writes[0], :, acc - 1:acc + 2], conv[0]), (n, t)
            assert torch.equal(a["state"][writes[t - s]], pool[0]), (n, t)


def _dup(a):
    idx = a["state_indices"].clone()
    idx[1, 0] = idx[0, 0]
    return idx


BAD = [
    ("conv_state", lambda a: a["conv_state"][:, :, :-1].contiguous(), "conv_state"),
    ("state_indices", _dup, "state_indices"),
    ("cu_seqlens", lambda a: torch.tensor([0, 4, 3, 7], dtype=torch.int32), "cu_seqlens"),
    ("num_accepted_tokens", lambda a: torch.tensor([1, 9, 1], dtype=torch.int32), "num_accepted_tokens"),
    ("norm_eps", 0.0, "norm_eps"),
    ("output_gate", lambda a: a["output_gate"][:, :, :, :-1].contiguous(), "output_gate"),
    ("state", lambda a: a["state"].to(torch.float16), "state"),
]


def _outcome(a):
    return call_outcome(run, a, ("state", "conv_state"))


def _clone(a):
    return {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in a.items()}


@pytest.mark.parametrize("name,value,argname", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument_cold_and_warm(name, value, argname):
    gen = gen_()
    base = make(gen, [3, 1, 3], 3)
    a = _clone(base)
    a[name] = value(a) if callable(value) else value
    c = _outcome(_clone(a))
    assert c[0] == "raise" and c[2].startswith(f"{argname}:"), c
    ops.clear_call_caches()
    assert _outcome(_clone(base))[0] == "ok" and fast_path.size() == 1
    w = _outcome(_clone(a))
    assert c == w


def test_valid_warm_call_takes_the_fast_path(monkeypatch):
    gen = gen_()
    a = make(gen, [3, 1, 3], 3)
    c = _outcome(_clone(a))
    assert _outcome(make(gen, [3, 1, 3], 3))[0] == "ok"
    real = validation.check_fused_kda_verify
    checks = []
    monkeypatch.setattr(validation, "check_fused_kda_verify", lambda *x, **k: checks.append(1) or real(*x, **k))
    w = _outcome(_clone(a))
    assert checks == []
    assert all(torch.equal(x, y) for x, y in zip(c[1:], w[1:]))


def test_compiled_fused_verify_matches_eager_bitwise():
    """fused_kda_verify under torch.compile(fullgraph): one flashkda_ext::fused_kda_verify node (the conv
    cache, the pool and out written), eager's results bitwise, both caches included."""
    sch = torch.ops.flashkda_ext.fused_kda_verify.default._schema
    assert {a.name for a in sch.arguments if a.alias_info is not None and a.alias_info.is_write} == \
        {"conv_state", "state", "out"}
    a = make(gen_(), [2, 3, 1], 3)
    b = _clone(a)
    want = run(a)
    torch._dynamo.reset()
    got = torch.compile(lambda x: run(x), backend="aot_eager", fullgraph=True)(b)
    assert torch.equal(got, want)
    assert torch.equal(b["state"], a["state"]) and torch.equal(b["conv_state"], a["conv_state"])
