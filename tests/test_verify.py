"""kda_verify (speculative-decoding verify) on the CPU backend: against the reference on fresh random
data, T_max in {1, 2, 3, 4, 8} with mixed T_n, num_accepted_tokens, padding and untouched slots; T = 1
equal to kda_decode bitwise; T tokens equal to T chained kda_decode calls bitwise; errors naming the
argument (in Python and in the binding); cold and warm calls agreeing (docs/semantics.md, "Verify")."""
from __future__ import annotations

import random

import pytest
import torch

import flashkda_ext
from flashkda_ext import fast_path, jit, ops, validation
from flashkda_ext import reference as R
from flashkda_ext.devtools.testing import call_outcome
from verify_cases import clone, reference, run

H, HV, K, V = 2, 4, 8, 16  # K != V: a transposed state cannot pass


def cold():
    ops.clear_call_caches()


@pytest.fixture(autouse=True)
def fresh():
    cold()
    yield
    cold()


def make(gen, lens, cols, *, slots=None, dtype=torch.float32, state_dtype=torch.float32, gate="softplus",
         accepted=True, pad_request=None, pad_token=None):
    """Fresh random arguments (never zeros): requests of lens tokens, state_indices [N, cols] of
    distinct slots (plus a few slots named by nobody), num_accepted_tokens in [1, cols]."""
    N, T = len(lens), sum(lens)
    slots = slots or N * cols + 3
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(dtype)  # noqa: E731
    idx = torch.randperm(slots, generator=gen)[:N * cols].reshape(N, cols).to(torch.int32)
    nacc = torch.randint(1, cols + 1, (N,), generator=gen, dtype=torch.int32)
    if pad_request is not None:
        idx[pad_request, int(nacc[pad_request]) - 1] = -1
    if pad_token is not None:
        n, t = pad_token
        if int(nacc[n]) - 1 != t:
            idx[n, t] = -1 - t
    a = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
             state=(torch.randn(slots, HV, V, K, generator=gen) * 0.5).to(state_dtype), state_indices=idx,
             cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
             num_accepted_tokens=nacc if accepted else None, gate=gate)
    if gate != "log":
        a["A_log"] = torch.randn(HV, generator=gen) * 0.3
        a["dt_bias"] = torch.randn(HV * K, generator=gen) * 0.5
    if gate == "bounded":
        a["lower_bound"] = -4.0
    if gate == "log":
        a["g"] = -torch.rand(1, T, HV, K, generator=gen).to(dtype) - 0.01
    return a


def named_slots(a):
    return {int(s) for s in a["state_indices"].flatten().tolist() if s >= 0}


def gen_():
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed)


LENS = {1: [1, 1, 1], 2: [2, 1, 2, 2], 3: [3, 1, 2], 4: [4, 2, 1, 3], 8: [8, 5, 1, 8, 3]}


@pytest.mark.parametrize("cols", sorted(LENS))
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_with_padding_and_untouched_slots(cols, state_dtype):
    gen = gen_()
    lens = LENS[cols]
    a = make(gen, lens, cols, state_dtype=state_dtype, pad_request=1 if len(lens) > 2 else None,
             pad_token=(0, cols - 1) if cols > 1 else None)
    a["out"] = torch.full((1, sum(lens), HV, V), float("nan"))  # poisoned: every element must be written
    pool0 = a["state"].clone()
    ref_out, ref_pool = reference(a)
    out = run(a)
    assert out is a["out"]
    assert torch.isfinite(out).all()
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(a["state"].double(), ref_pool.double(), **tol)
    # slots no live token names stay bitwise unchanged; a padding request writes nothing
    plan = R.verify_plan(a["cu_seqlens"], a["state_indices"], a["num_accepted_tokens"], pool0.shape[0])
    written = {w for s, e, read, ws in plan if read is not None for w in ws if w is not None}
    for s in range(pool0.shape[0]):
        if s not in written:
            assert torch.equal(a["state"][s], pool0[s]), f"slot {s} is not written but changed"
    for s, e, read, _ in plan:
        if read is None:
            assert torch.equal(out[0, s:e], torch.zeros_like(out[0, s:e])), "a padding request's output is not zero"
    assert written and len(written) < pool0.shape[0]


def _free_slot0(a):
    """Slot 0 out of the live rows (it is the null block below): an unnamed slot takes its place."""
    idx = a["state_indices"]
    spare = min(set(range(1, a["state"].shape[0])) - set(idx.flatten().tolist()))
    idx[idx == 0] = spare


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_empty_requests_read_and_write_nothing(state_dtype):
    """Requests of 0 tokens among live ones and, as vLLM pads a speculative batch to a CUDA-graph size,
    trailing empty requests with null-slot rows and count 1 (T < N): the live requests match the
    reference, every slot no live token stores is bitwise unchanged, cold and warm calls agree."""
    gen = gen_()
    lens = [3, 0, 2, 0, 1] + [0] * 6  # 11 requests, 6 tokens, T_max 4
    a = make(gen, lens, 4, state_dtype=state_dtype, pad_token=(2, 1))
    _free_slot0(a)
    tail = slice(5, 11)
    a["state_indices"][tail] = 0  # the null block (null_slot0), as vLLM fills its padded rows
    a["num_accepted_tokens"][tail] = 1
    a["null_slot0"] = True
    assert sum(lens) < len(lens)
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for attempt in ("cold", "warm"):
        b = clone(a)
        b["out"] = torch.full((1, sum(lens), HV, V), float("nan"))
        ref_out, ref_pool = reference(b)
        out = run(b)
        assert torch.isfinite(out).all(), attempt
        torch.testing.assert_close(out.double(), ref_out, **tol)
        plan = R.verify_plan(b["cu_seqlens"], b["state_indices"], b["num_accepted_tokens"], a["state"].shape[0],
                             null_slot0=True)
        written = {w for s, e, read, ws in plan if read is not None for w in ws if w is not None}
        assert len(written) >= 4
        for s in range(a["state"].shape[0]):
            if s in written:
                torch.testing.assert_close(b["state"][s].double(), ref_pool[s].double(), **tol)
            else:
                assert torch.equal(b["state"][s], a["state"][s]), f"{attempt}: slot {s} changed"


def test_fp32_gate_and_beta_are_read_as_they_are():
    """bf16 q / k / v with fp32 g and beta (as engines make them): the result is the reference's on the fp32
    values; fp32 g beside bf16 beta equals the all-fp32 call on the same values, bitwise."""
    gen = gen_()
    a = make(gen, [3, 2, 4], 4, dtype=torch.bfloat16)
    a["g"] = torch.randn(a["g"].shape, generator=gen) - 1.0
    a["beta"] = torch.randn(a["beta"].shape, generator=gen).bfloat16()
    results = []
    for beta in (a["beta"].float(), a["beta"]):
        b = clone(dict(a, beta=beta))
        results.append((run(b), b["state"]))
    ref_out, ref_pool = reference(dict(a, beta=a["beta"].float()))
    torch.testing.assert_close(results[0][0].double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(results[0][1].double(), ref_pool.double(), atol=1e-5, rtol=1e-5)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    rounded = clone(dict(a, g=a["g"].bfloat16()))
    assert not torch.equal(run(rounded), results[1][0])  # the fp32 gate was not rounded to bf16


def test_one_column_with_empty_requests_is_refused():
    """T_max = 1 is served as kda_decode, one token per request: T < N is refused, naming q."""
    gen = gen_()
    a = make(gen, [1, 1, 1], 1)
    a.update(cu_seqlens=torch.tensor([0, 1, 2, 2], dtype=torch.int32),
             **{n: a[n][:, :2].contiguous() for n in ("q", "k", "v", "g", "beta")})
    c = call_outcome(run, a, ("state",))
    assert c[0] == "raise" and c[1] is ValueError and c[2].startswith("q:") and "T_max = 1" in c[2], c


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
def test_gates_and_options_match_reference(gate):
    gen = gen_()
    a = make(gen, [3, 2, 4], 4, gate=gate, accepted=False)
    a.update(scale=0.7, beta_is_logit=False, beta=torch.rand(1, 9, HV, generator=gen))
    ref_out, ref_pool = reference(a)
    out = run(a)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a["state"].double(), ref_pool.double(), atol=1e-5, rtol=1e-5)


def test_bf16_inputs_and_null_slot0():
    gen = gen_()
    a = make(gen, [2, 3], 3, dtype=torch.bfloat16, state_dtype=torch.bfloat16, slots=12)
    a["state_indices"][1, int(a["num_accepted_tokens"][1]) - 1] = 0  # slot 0 = the null block
    a["null_slot0"] = True
    pool0 = a["state"].clone()
    ref_out, ref_pool = reference(a)
    out = run(a)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(a["state"].double(), ref_pool.double(), atol=3e-2, rtol=3e-2)
    assert torch.equal(out[0, 2:], torch.zeros_like(out[0, 2:]))
    assert torch.equal(a["state"][0], pool0[0])


def _decode(a, rows_idx, token_rows, pool):
    """kda_decode over the given packed tokens with the given slots, on pool."""
    sel = torch.tensor(token_rows)
    return flashkda_ext.kda_decode(
        a["q"][0, sel], a["k"][0, sel], a["v"][0, sel], a["g"][0, sel], a["beta"][0, sel], state=pool,
        state_indices=torch.tensor(rows_idx, dtype=torch.int32), A_log=a.get("A_log"), dt_bias=a.get("dt_bias"),
        lower_bound=a.get("lower_bound"), gate=a["gate"], slot_mode="padded")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 3])
def test_one_token_per_request_equals_kda_decode_bitwise(cols, state_dtype):
    """T_n = 1 with num_accepted_tokens = 1: cols = 1 is served by the decode module, cols = 3 by the
    verify module itself; both must be kda_decode on column 0, bitwise."""
    gen = gen_()
    a = make(gen, [1] * 5, cols, state_dtype=state_dtype, dtype=torch.bfloat16, accepted=False)
    a["state_indices"][3, 0] = -1
    pool = a["state"].clone()
    want = _decode(a, a["state_indices"][:, 0].tolist(), list(range(5)), pool)
    got = run(a)
    assert torch.equal(got[0], want)
    assert torch.equal(a["state"], pool)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_tokens_equal_chained_kda_decode_bitwise(state_dtype):
    """The state continues from its stored value: token t of a request equals kda_decode on a copy of
    the state after token t - 1, bitwise, bf16 state included."""
    gen = gen_()
    lens = [4, 2, 3]
    a = make(gen, lens, 4, state_dtype=state_dtype, dtype=torch.bfloat16)
    pool = a["state"].clone()
    want = torch.empty(1, sum(lens), HV, V, dtype=torch.bfloat16)
    plan = R.verify_plan(a["cu_seqlens"], a["state_indices"], a["num_accepted_tokens"], pool.shape[0])
    scratch = pool.shape[0]  # one extra slot carries the running state
    work = torch.cat([pool, pool[:1]])
    for s, e, read, writes in plan:
        work[scratch] = pool[read]
        for t in range(s, e):
            want[0, t] = _decode(a, [scratch], [t], work)[0]
            if writes[t - s] is not None:
                work[writes[t - s]] = work[scratch]
    got = run(a)
    assert torch.equal(got, want)
    assert torch.equal(a["state"], work[:scratch])


def _bad(name, value):
    def change(a):
        a[name] = value(a) if callable(value) else value
    change.__name__ = f"{name}"
    return change


def _dup_write(a):
    idx = a["state_indices"].clone()
    idx[1, 0] = idx[0, 0]
    return idx


def _read_other(a):
    idx = a["state_indices"].clone()
    nacc = a["num_accepted_tokens"]
    idx[1, int(nacc[1]) - 1] = idx[0, 0]
    return idx


def _batch2(a):
    for n in ("q", "k", "v", "g", "beta"):
        a[n] = torch.cat([a[n], a[n]])


BAD = [  # (change, argument the message must name)
    (_bad("cu_seqlens", lambda a: torch.tensor([0, 3, 2, 9], dtype=torch.int32)), "cu_seqlens"),
    (_bad("cu_seqlens", lambda a: torch.tensor([0, 5, 6, 9], dtype=torch.int32)), "state_indices"),
    (_bad("cu_seqlens", lambda a: torch.tensor([0, 3, 5, 8], dtype=torch.int32)), "cu_seqlens"),
    (_bad("cu_seqlens", lambda a: a["cu_seqlens"].long()), "cu_seqlens"),
    (_bad("cu_seqlens", lambda a: a["cu_seqlens"][:3]), "cu_seqlens"),
    (_bad("num_accepted_tokens", lambda a: torch.tensor([1, 0, 2], dtype=torch.int32)), "num_accepted_tokens"),
    (_bad("num_accepted_tokens", lambda a: torch.tensor([1, 5, 2], dtype=torch.int32)), "num_accepted_tokens"),
    (_bad("num_accepted_tokens", lambda a: a["num_accepted_tokens"].long()), "num_accepted_tokens"),
    (_bad("state_indices", _dup_write), "state_indices"),
    (_bad("state_indices", _read_other), "state_indices"),
    (_bad("state_indices", lambda a: a["state_indices"].clamp(max=100) + 100), "state_indices"),
    (_bad("state_indices", lambda a: a["state_indices"].long()), "state_indices"),
    (_bad("state_indices", lambda a: a["state_indices"].flatten()), "state_indices"),
    (_bad("state_indices", lambda a: a["state_indices"].t().contiguous().t()), "state_indices"),
    (_batch2, "q"),
    (_bad("out", lambda a: torch.empty(1, 9, HV, K)), "out"),
    (_bad("max_seqlen", 5), "max_seqlen"),
    (_bad("max_seqlen", 2), "max_seqlen"),
    (_bad("max_seqlen", 2.0), "max_seqlen"),
    (_bad("state", lambda a: a["state"][:, :, :, :K - 1].contiguous()), "state"),
    (_bad("beta", lambda a: a["beta"].double()), "beta"),
    (_bad("g", lambda a: a["g"].requires_grad_()), "g"),
    (_bad("state", lambda a: a["state"].to(torch.float16)), "state"),
    (_bad("A_log", None), "A_log"),
    (_bad("null_slot0", 1), "null_slot0"),
]


def _base(gen):
    return make(gen, [3, 2, 4], 4)


def _outcome(a):
    return call_outcome(run, a, ("state",))


@pytest.mark.parametrize("change,argname", BAD, ids=[f"{i}-{c.__name__}" for i, (c, _) in enumerate(BAD)])
def test_bad_input_names_the_argument_and_cold_equals_warm(change, argname):
    gen = gen_()
    a = _base(gen)
    change(a)
    cold()
    c = _outcome(clone(a))
    assert c[0] == "raise" and c[1] in (TypeError, ValueError), c
    assert c[2].startswith(f"{argname}:"), c[2]
    cold()
    assert _outcome(_base(gen))[0] == "ok"  # arms the fast path
    assert fast_path.size() == 1
    w = _outcome(clone(a))
    assert (c[0], c[1], c[2]) == (w[0], w[1], w[2])


def test_valid_warm_call_takes_the_fast_path_and_equals_cold(monkeypatch):
    gen = gen_()
    a = _base(gen)
    c = _outcome(clone(a))
    cold()
    assert _outcome(_base(gen))[0] == "ok"
    checks = []
    real = validation.check_kda_verify
    monkeypatch.setattr(validation, "check_kda_verify", lambda *x, **k: checks.append(1) or real(*x, **k))
    w = _outcome(clone(a))
    assert checks == [], "the warm call was checked in full"
    assert torch.equal(c[1], w[1]) and torch.equal(c[2], w[2])


def test_binding_checks_host_values_itself():
    """The last line of defence: the CPU module refuses what validation refuses, naming the argument."""
    gen = gen_()
    a = _base(gen)
    fn = jit.load_module("cpu_kda_verify")["kda_verify"]
    out = torch.empty(1, 9, HV, V)

    def call(idx=None, cu=None, nacc=None):
        fn(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"],
           a["state_indices"] if idx is None else idx, a["cu_seqlens"] if cu is None else cu,
           a["num_accepted_tokens"] if nacc is None else nacc, None, None, None, out, 0, 0.0, K ** -0.5, True, False)

    pool0 = a["state"].clone()
    for kw, name in ((dict(idx=_dup_write(a)), "state_indices"), (dict(idx=_read_other(a)), "state_indices"),
                     (dict(cu=torch.tensor([0, 3, 3, 9], dtype=torch.int32)), "cu_seqlens"),
                     (dict(nacc=torch.tensor([1, 0, 1], dtype=torch.int32)), "num_accepted_tokens")):
        with pytest.raises(ValueError, match=f"'{name}'"):
            call(**kw)
        assert torch.equal(a["state"], pool0)
    call()  # the untouched arguments are valid
    assert not torch.equal(a["state"], pool0)


def test_compiled_verify_matches_eager_bitwise():
    """kda_verify under torch.compile(fullgraph) is one flashkda_ext::kda_verify node (its schema names
    the pool and out as written) and gives eager's results bitwise, pool included."""
    sch = torch.ops.flashkda_ext.kda_verify.default._schema
    assert {a.name for a in sch.arguments if a.alias_info is not None and a.alias_info.is_write} == {"state", "out"}
    gen = gen_()
    a = make(gen, LENS[3], 3)
    b = clone(a)
    want = run(a)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: run(x), backend="aot_eager", fullgraph=True)
    got = fn(b)
    assert torch.equal(got, want) and torch.equal(b["state"], a["state"])


def test_call_outcome_compares_a_refused_calls_tensors_bit_for_bit():
    """The bad-input cases hand the op a torch.empty buffer; when its garbage holds a NaN, the untouched buffer must
    count as unchanged (torch.equal says NaN != NaN: a CI run failed on it), and a write of -0.0 over 0.0 as changed."""
    def refuse(args):
        raise ValueError("refused")

    def write_negative_zero(args):
        args["out"][1] = -0.0
        raise ValueError("refused")

    args = {"out": torch.tensor([float("nan"), 0.0])}
    assert call_outcome(refuse, args)[:2] == ("raise", ValueError)
    with pytest.raises(AssertionError, match="a refused call changed out"):
        call_outcome(write_negative_zero, args)
