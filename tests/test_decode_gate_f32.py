"""kda_decode with fp32 g and beta beside bf16 q/k/v (issue 29): read in their own dtype on the CPU
backend and through the public op, against the reference on fresh random inputs with poisoned outputs;
an fp32 gate that bf16 holds exactly gives the bf16 call's result bit for bit; the fast path keeps
one entry per dtype combination; the conversion a module without fp32 reads needs (forced here) runs
and leaves no fast entry; traces name the gate dtype."""
import json
import random

import pytest
import torch

import flashkda_ext
from flashkda_ext import dispatch, fast_path, ops, trace
from flashkda_ext.reference import kda_decode_step

ROWS, H, HV, K, V, SLOTS = 5, 2, 4, 16, 8, 7
bf16, f32 = torch.bfloat16, torch.float32
COMBOS = [(f32, f32), (f32, bf16), (bf16, f32)]


@pytest.fixture(autouse=True)
def fresh_paths():
    ops.clear_call_caches()
    yield
    ops.clear_call_caches()


def gen():
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def inputs(g, g_dtype, beta_dtype, state_dtype=f32, gate="softplus"):
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, dtype=torch.float64) * scale  # noqa: E731
    graw = -r(ROWS, HV, K).abs() * 0.3 if gate == "log" else r(ROWS, HV, K)
    # beta as a probability when not a logit: (0, 1)
    b = r(ROWS, HV)
    return dict(q=r(ROWS, H, K).to(bf16), k=r(ROWS, H, K).to(bf16), v=r(ROWS, HV, V).to(bf16),
                g=graw.to(g_dtype), beta=b.to(beta_dtype),
                state=(r(SLOTS, HV, V, K) * 0.5).to(state_dtype),
                state_indices=torch.tensor([4, -1, 2, 6, 0], dtype=torch.int32),
                A_log=None if gate == "log" else r(HV, scale=0.3).float(),
                dt_bias=None if gate == "log" else r(HV * K, scale=0.5).float())


def run(a, gate="softplus", out=None, **kw):
    lb = -4.0 if gate == "bounded" else None
    return flashkda_ext.kda_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"],
                                   state_indices=a["state_indices"], A_log=a["A_log"], dt_bias=a["dt_bias"],
                                   gate=gate, lower_bound=lb, out=out, **kw)


def reference(a, state0, gate="softplus"):
    lb = -4.0 if gate == "bounded" else None
    return kda_decode_step(a["q"], a["k"], a["v"], a["g"], a["beta"], state=state0,
                           state_indices=a["state_indices"], gate=gate, A_log=a["A_log"], dt_bias=a["dt_bias"],
                           lower_bound=lb)


def poisoned():
    return torch.full((ROWS, HV, V), float("nan"), dtype=bf16)


@pytest.mark.parametrize("g_dtype,beta_dtype", COMBOS)
@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
@pytest.mark.parametrize("state_dtype", [f32, bf16])
def test_cpu_decode_reads_fp32_gate_and_beta_as_they_are(g_dtype, beta_dtype, gate, state_dtype):
    g, seed = gen()
    for call in range(2):  # the first call is checked in full, the second takes the fast path
        a = inputs(g, g_dtype, beta_dtype, state_dtype, gate)
        state0 = a["state"].clone()
        out = poisoned()
        assert run(a, gate, out=out) is out
        want_out, want_state = reference(a, state0, gate)
        tol = dict(rtol=6e-3, atol=1e-4, msg=lambda m: f"seed {seed}, call {call}: {m}")
        torch.testing.assert_close(out.double(), want_out, **tol)
        torch.testing.assert_close(a["state"].double(), want_state.double(), **tol)
        assert torch.equal(a["state"][[1, 3, 5]], state0[[1, 3, 5]])  # slots no row addresses
        assert torch.all(out[1] == 0)                                  # the padding row


def test_fp32_values_are_used_as_fp32():
    """The CPU module and the reference read an fp32 gate as it is: a cast to bf16 first would give
    another result, and the module agrees with the fp32 reference much more closely than with it."""
    g, seed = gen()
    a = inputs(g, f32, f32)
    state0 = a["state"].clone()
    run(a)
    want_out, want_state = reference(a, state0)
    cast = dict(a, g=a["g"].to(bf16), beta=a["beta"].to(bf16))
    cast_out, cast_state = reference(cast, state0)
    live = [0, 2, 3, 4]
    err = (a["state"].double() - want_state.double())[a["state_indices"][live].long()].abs().max()
    err_cast = (a["state"].double() - cast_state.double())[a["state_indices"][live].long()].abs().max()
    assert err < 1e-5 < err_cast, f"seed {seed}: {err} vs cast {err_cast}"


@pytest.mark.parametrize("g_dtype,beta_dtype", COMBOS)
def test_bf16_exact_fp32_gate_equals_the_bf16_call_bitwise(g_dtype, beta_dtype):
    g, seed = gen()
    a = inputs(g, bf16, bf16)
    b = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    b["g"], b["beta"] = a["g"].to(g_dtype), a["beta"].to(beta_dtype)  # the same values, exactly
    out_a, out_b = run(a, out=poisoned()), run(b, out=poisoned())
    assert torch.equal(out_a, out_b), f"seed {seed}"
    assert torch.equal(a["state"], b["state"]), f"seed {seed}"


def test_fast_path_keeps_one_entry_per_gate_dtype(monkeypatch):
    g, seed = gen()
    for g_dtype, beta_dtype in [(bf16, bf16)] + COMBOS:
        run(inputs(g, g_dtype, beta_dtype))
    assert fast_path.size() == 4

    def tripwire(*args, **kwargs):
        raise AssertionError("the full validation ran: the fast path was not taken")

    monkeypatch.setattr(ops.validation, "check_kda_decode", tripwire)
    for g_dtype, beta_dtype in COMBOS + [(bf16, bf16)]:
        a = inputs(g, g_dtype, beta_dtype)
        state0 = a["state"].clone()
        out = run(a, out=poisoned())
        want_out, _ = reference(a, state0)
        torch.testing.assert_close(out.double(), want_out, rtol=6e-3, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("g_dtype,beta_dtype", COMBOS)
def test_a_module_reading_fp32_gets_the_other_one_converted(g_dtype, beta_dtype, monkeypatch):
    """As on a GPU, where the routed _gb32 module reads both g and beta as fp32 (forced here on the CPU
    module, which would read either): the bf16 one of a mixed pair is converted up, exactly, so the
    result is the mixed call's; the call leaves no fast entry (the converted copy is not the caller's)."""
    monkeypatch.setattr(dispatch, "gb_read_dtype", lambda module, input_dtype: "float32")
    g, seed = gen()
    a = inputs(g, g_dtype, beta_dtype)
    b = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    monkeypatch.setattr(fast_path, "put", lambda *args, **kw: pytest.fail("a converted call left a fast entry")
                        if g_dtype != beta_dtype else None)
    out_a = run(a, out=poisoned())
    monkeypatch.undo()
    ops.clear_call_caches()
    out_b = run(b, out=poisoned())  # the CPU module reading each in its own dtype
    assert torch.equal(out_a, out_b) and torch.equal(a["state"], b["state"]), f"seed {seed}"


def test_binding_checks_gate_dtypes():
    """The CPU module itself (below the Python checks) takes g and beta in q's dtype or fp32, and names
    the argument otherwise."""
    g, _ = gen()
    a = inputs(g, torch.float16, bf16)
    mod = dispatch.function("kda_decode", {"device": "cpu"})
    out = poisoned()
    with pytest.raises(Exception, match="'g' must have dtype one of"):
        mod(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"], a["state_indices"],
            out, 0, 0.0, K ** -0.5, True, False)
    assert out.isnan().all()


def test_trace_names_and_types_the_fp32_gate(tmp_path):
    g, _ = gen()
    with trace.tracing(tmp_path):
        run(inputs(g, f32, bf16))
    defs = [p for p in tmp_path.rglob("*.json")]
    assert len(defs) == 1
    d = json.loads(defs[0].read_text())
    assert "_gf32" in d["name"] and "betaf32" not in d["name"]
    inputs_ = {x["name"]: x for x in d["inputs"]} if isinstance(d["inputs"], list) else d["inputs"]
    assert inputs_["g"]["dtype"] == "float32" and inputs_["beta"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("g_dtype,beta_dtype", COMBOS)
def test_jax_decode_reads_fp32_gate_and_beta(g_dtype, beta_dtype, monkeypatch):
    """The JAX front end: the same module call as the torch op, bitwise, for fp32 / mixed g and beta; and
    with a module that reads both as fp32 (forced, as on a GPU's _gb32 route) the bf16 one is converted
    inside the jitted call, exactly."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    import jax.numpy as jnp
    from flashkda_ext import jax as kj

    def to_jax(t):
        return jnp.array(jax.dlpack.from_dlpack(t.detach().contiguous().clone()), copy=True)

    g, seed = gen()
    a = inputs(g, g_dtype, beta_dtype)
    b = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    t_out = run(a)
    names = ("q", "k", "v", "g", "beta")
    for forced in (False, True):
        monkeypatch.setattr(kj.plan, "_PREPARED", {})  # this call's plan alone (forced: planned again)
        if forced:
            monkeypatch.setattr(dispatch, "gb_read_dtype", lambda module, input_dtype: "float32")
        j = {n: to_jax(x) for n, x in b.items() if isinstance(x, torch.Tensor)}
        out, state = kj.kda_decode(*(j[n] for n in names), state=j["state"], state_indices=j["state_indices"],
                                   A_log=j["A_log"], dt_bias=j["dt_bias"], donate=False)
        prep = next(iter(kj.plan._PREPARED.values()))
        want = tuple((n, "float32") for n, d in (("g", g_dtype), ("beta", beta_dtype)) if d != f32) if forced else ()
        assert prep.plan.casts == want
        assert torch.equal(torch.from_dlpack(out).clone(), t_out), f"seed {seed}, forced {forced}"
        assert torch.equal(torch.from_dlpack(state).clone(), a["state"]), f"seed {seed}, forced {forced}"
