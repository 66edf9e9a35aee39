"""flashkda_ext.jax on the CPU backend, for real: jax + jax-tvm-ffi call the same compiled CPU modules
as the torch ops. Results equal the reference (float64) within tolerance and the torch op exactly
(same module, same inputs), eagerly and under jax.jit; in-place pools are aliased, not copied; bad
calls raise the torch op's ValueError/TypeError naming the argument, before any FFI call."""
import os
import sys

import pytest
import torch

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")
import jax.numpy as jnp  # noqa: E402

import flashkda_ext as fk  # noqa: E402
from flashkda_ext import reference as ref  # noqa: E402

kj = pytest.importorskip("flashkda_ext.jax")

H, HV, K, V = 2, 4, 16, 8          # K != V catches transposes; HV = 2 H exercises grouped heads


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")          # shown by pytest on failure
    return torch.Generator().manual_seed(seed)


def to_jax(t: torch.Tensor):
    """A jax copy of a CPU torch tensor (any dtype, bf16 included)."""
    return jnp.array(jax.dlpack.from_dlpack(t.detach().contiguous().clone()), copy=True)


def to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a).clone()


def gate_params(gen, gate, heads, dim):
    if gate == "log":
        return dict(A_log=None, dt_bias=None, lower_bound=None)
    return dict(A_log=0.5 * torch.randn(heads, generator=gen), dt_bias=0.5 * torch.randn(heads * dim, generator=gen),
                lower_bound=-5.0 if gate == "bounded" else None)


def raw_gate(gen, shape, gate):
    g = torch.randn(*shape, generator=gen)
    return -torch.rand(*shape, generator=gen) * 0.5 if gate == "log" else g


def decode_inputs(gen, rows, slots, gate, dtype=torch.float32, indices=None):
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    d = dict(q=r(rows, H, K), k=r(rows, H, K), v=r(rows, HV, V), g=raw_gate(gen, (rows, HV, K), gate).to(dtype),
             beta=r(rows, HV), state=torch.randn(slots, HV, V, K, generator=gen),
             state_indices=torch.randperm(slots, generator=gen)[:rows].to(torch.int32) if indices is None
             else torch.tensor(indices, dtype=torch.int32))
    d.update(gate_params(gen, gate, HV, K))
    return d


def jaxify(d):
    return {n: (to_jax(x) if isinstance(x, torch.Tensor) else x) for n, x in d.items()}


def torch_decode(d, **kw):
    a = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in d.items()}
    out = fk.kda_decode(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a, **kw)
    return out, a["state"]


def jax_decode(d, **kw):
    a = dict(d)
    return kj.kda_decode(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a, **kw)


# ---------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_decode_matches_reference_and_torch(gen, gate, mode):
    d = decode_inputs(gen, rows=5, slots=7, gate=gate)
    t_out, t_state = torch_decode(d, gate=gate)
    r_out, r_state = ref.kda_decode_step(
        d["q"], d["k"], d["v"], d["g"], d["beta"], state=d["state"], state_indices=d["state_indices"],
        gate=gate, A_log=d["A_log"], dt_bias=d["dt_bias"], lower_bound=d["lower_bound"])
    jd = jaxify(d)
    lb = jd.pop("lower_bound")                                  # a static argument, not an array
    if mode == "eager":
        out, state = jax_decode(jd, gate=gate, lower_bound=lb)
    else:
        fn = jax.jit(lambda a: jax_decode(a, gate=gate, lower_bound=lb))
        out, state = fn(jd)
    assert out.shape == (5, HV, V) and out.dtype == jnp.float32
    assert torch.equal(to_torch(out), t_out) and torch.equal(to_torch(state), t_state)
    torch.testing.assert_close(to_torch(out).double(), r_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(to_torch(state).double(), r_state.double(), rtol=1e-4, atol=1e-4)


def test_decode_padding_repeats_null_slot0_bf16(gen):
    # padding row (-1), two rows sharing slot 2 (applied in row order), slot 0 as the null block
    d = decode_inputs(gen, rows=5, slots=4, gate="softplus", dtype=torch.bfloat16, indices=[2, -1, 2, 0, 3])
    d["state"] = d["state"].to(torch.bfloat16)                  # a bf16 pool too
    kw = dict(slot_mode="repeated", null_slot0=True)
    t_out, t_state = torch_decode(d, **kw)
    out, state = jax.jit(lambda a: jax_decode(a, **kw))(jaxify(d))
    assert out.dtype == jnp.bfloat16
    assert torch.equal(to_torch(out), t_out) and torch.equal(to_torch(state), t_state)
    assert torch.all(to_torch(out)[[1, 3]] == 0)
    assert torch.equal(to_torch(state)[0], d["state"][0])        # null slot untouched
    r_out, r_state = ref.kda_decode_step(
        d["q"], d["k"], d["v"], d["g"], d["beta"], state=d["state"], state_indices=d["state_indices"],
        A_log=d["A_log"], dt_bias=d["dt_bias"], null_slot0=True)
    torch.testing.assert_close(to_torch(out).double(), r_out, rtol=2e-2, atol=2e-2)
    assert state.dtype == jnp.bfloat16
    torch.testing.assert_close(to_torch(state).double(), r_state.double(), rtol=1e-2, atol=1e-2)


def test_decode_steps_chain_under_jit_with_donation(gen):
    """Two steps through a jitted, donating function equal two torch steps; the pool buffer is
    written in place each time (same address, donated input deleted)."""
    d1 = decode_inputs(gen, rows=3, slots=5, gate="softplus")
    d2 = decode_inputs(gen, rows=3, slots=5, gate="softplus")
    d2["state"] = d1["state"]
    for n in ("A_log", "dt_bias"):
        d2[n] = d1[n]
    _, t_state = torch_decode(d1)
    d2t = dict(d2, state=t_state)
    t_out2, t_state2 = torch_decode(d2t)

    step = jax.jit(lambda s, a: jax_decode(dict(a, state=s)), donate_argnums=0)
    pool = to_jax(d1["state"])
    addr = pool.unsafe_buffer_pointer()
    a1 = {n: x for n, x in jaxify(d1).items() if n != "state"}
    a2 = {n: x for n, x in jaxify(d2).items() if n != "state"}
    _, pool1 = step(pool, a1)
    assert pool.is_deleted() and pool1.unsafe_buffer_pointer() == addr
    out2, pool2 = step(pool1, a2)
    assert pool1.is_deleted() and pool2.unsafe_buffer_pointer() == addr
    assert torch.equal(to_torch(out2), t_out2) and torch.equal(to_torch(pool2), t_state2)


def test_eager_call_donates_pool_unless_asked_not_to(gen):
    d = decode_inputs(gen, rows=2, slots=3, gate="log")
    jd = jaxify(d)
    addr = jd["state"].unsafe_buffer_pointer()
    _, new_state = jax_decode(jd, gate="log")
    assert jd["state"].is_deleted() and new_state.unsafe_buffer_pointer() == addr

    for _ in range(2):      # the consumed pool again: named, before anything runs (was XLA's "Buffer has been
        with pytest.raises(ValueError, match="^state: a deleted array"):       # deleted or donated", no name)
            jax_decode(jd, gate="log")
    jd["state"] = new_state
    jd["g"].delete()
    with pytest.raises(ValueError, match="^g: a deleted array"):
        jax_decode(jd, gate="log")
    assert not new_state.is_deleted()       # a refused call donated nothing

    jd = jaxify(d)
    _, kept = jax_decode(jd, gate="log", donate=False)
    assert not jd["state"].is_deleted()
    assert torch.equal(to_torch(jd["state"]), d["state"])          # the input pool is unchanged
    assert not torch.equal(to_torch(kept), d["state"])


def test_registration_once_per_module_and_layout(gen):
    import jax_tvm_ffi
    for gate in ("softplus", "log"):                             # two argument layouts
        jax_decode(jaxify(decode_inputs(gen, rows=2, slots=3, gate=gate)), gate=gate)
    before = (kj.registered_targets(), jax_tvm_ffi.registered_count())
    for gate in ("softplus", "log"):
        for rows in (1, 3):                                      # new shapes, same targets
            jax_decode(jaxify(decode_inputs(gen, rows=rows, slots=4, gate=gate)), gate=gate)
    assert (kj.registered_targets(), jax_tvm_ffi.registered_count()) == before
    names = [n for n in before[0] if ".kda_decode." in n]
    assert len(names) == 2 and all("cpu_kda_decode" in n for n in names)


def test_command_buffer_switch(gen, monkeypatch):
    """FLASHKDA_EXT_JAX_COMMAND_BUFFER=0 plans every call as not capturable (a separate target),
    with the same results; a value that is not 0/1 is an error naming the variable."""
    d = decode_inputs(gen, rows=2, slots=3, gate="softplus")
    out1, state1 = jax_decode(jaxify(d), gate="softplus")
    monkeypatch.setenv("FLASHKDA_EXT_JAX_COMMAND_BUFFER", "0")
    out0, state0 = jax_decode(jaxify(d), gate="softplus")
    assert torch.equal(to_torch(out0), to_torch(out1)) and torch.equal(to_torch(state0), to_torch(state1))
    plans = [p.plan for p in kj.plan._PREPARED.values() if p.plan.family == "kda_decode"]
    assert any(not p.cuda_graph for p in plans) and any(p.cuda_graph for p in plans)
    monkeypatch.setenv("FLASHKDA_EXT_JAX_COMMAND_BUFFER", "maybe")
    with pytest.raises(ValueError, match="FLASHKDA_EXT_JAX_COMMAND_BUFFER"):
        jax_decode(jaxify(d), gate="softplus")


# ---------------------------------------------------------------------------------------------
# prefill


def prefill_inputs(gen, lens, gate, dtype=torch.float32):
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    d = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=raw_gate(gen, (1, T, HV, K), gate).to(dtype),
             beta=r(1, T, HV), cu_seqlens=torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32))
    d.update(gate_params(gen, gate, HV, K))
    return d


def split(d):
    a = dict(d)
    return (a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta")), a


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_prefill_dense_with_checkpoints(gen, mode):
    lens = [5, 0, 9, 3]
    d = prefill_inputs(gen, lens, "bounded")
    d["initial_state"] = torch.randn(len(lens), HV, V, K, generator=gen)
    kw = dict(gate="bounded", checkpoint_every=2)
    pos, rest = split(d)
    t_out, t_final, t_ck = fk.kda_prefill(*pos, **rest, **kw)
    r_out, r_final, r_ck = ref.kda_recurrent(*pos, **rest, **kw)
    jpos, jrest = split(jaxify(d))
    kw["lower_bound"] = jrest.pop("lower_bound")
    if mode == "eager":
        out, final, ck = kj.kda_prefill(*jpos, **jrest, **kw)
    else:
        # traced offsets have no host values: max_seqlen (static) sizes the checkpoints as torch does
        out, final, ck = jax.jit(lambda p, r: kj.kda_prefill(*p, **r, **kw, max_seqlen=max(lens)))(jpos, jrest)
    assert out.shape == (1, sum(lens), HV, V) and ck.shape == t_ck.shape
    assert torch.equal(to_torch(out), t_out) and torch.equal(to_torch(final), t_final)
    assert torch.equal(to_torch(ck).isnan(), t_ck.isnan())           # untouched slots stay NaN
    assert torch.equal(to_torch(ck).nan_to_num(), t_ck.nan_to_num())
    torch.testing.assert_close(to_torch(out).double(), r_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(to_torch(final).double(), r_final, rtol=1e-4, atol=1e-4)
    # the op sizes C from T (max_seqlen unknown), the reference from the longest sequence
    c = r_ck.shape[1]
    torch.testing.assert_close(to_torch(ck)[:, :c].double(), r_ck, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert to_torch(ck)[:, c:].isnan().all()
    assert not torch.equal(to_torch(jrest["initial_state"]), t_final)   # dense: initial untouched


def test_prefill_pool_mode_in_place_and_batched(gen):
    lens = [4, 6, 2]
    d = prefill_inputs(gen, lens, "softplus")
    pool = torch.randn(6, HV, V, K, generator=gen)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)          # the padding sequence writes nothing
    pos, rest = split(d)
    t_pool = pool.clone()
    t_out, _ = fk.kda_prefill(*pos, **rest, state=t_pool, state_indices=idx)
    r_out, r_pool, _ = ref.kda_recurrent(*pos, **rest, initial_state=pool, state_indices=idx)

    jpos, jrest = split(jaxify(d))
    jpool = to_jax(pool)
    addr = jpool.unsafe_buffer_pointer()
    fn = jax.jit(lambda p, r, s, i: kj.kda_prefill(*p, **r, state=s, state_indices=i), donate_argnums=2)
    out, new_pool = fn(jpos, jrest, jpool, to_jax(idx))
    assert jpool.is_deleted() and new_pool.unsafe_buffer_pointer() == addr
    assert torch.equal(to_torch(out), t_out) and torch.equal(to_torch(new_pool), t_pool)
    torch.testing.assert_close(to_torch(new_pool).double(), r_pool.double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(to_torch(out).double(), r_out, rtol=1e-4, atol=1e-4)
    for s in (0, 2, 3, 5):
        assert torch.equal(to_torch(new_pool)[s], pool[s])

    # B > 1 without cu_seqlens, no final state
    qb = torch.randn(2, 5, H, K, generator=gen)
    kb = torch.randn(2, 5, H, K, generator=gen)
    vb = torch.randn(2, 5, HV, V, generator=gen)
    gb = torch.randn(2, 5, HV, K, generator=gen)
    bb = torch.randn(2, 5, HV, generator=gen)
    gp = dict(A_log=rest["A_log"], dt_bias=rest["dt_bias"])
    t_out, t_final = fk.kda_prefill(qb, kb, vb, gb, bb, **gp, output_final_state=False)
    out, final = kj.kda_prefill(*(to_jax(x) for x in (qb, kb, vb, gb, bb)),
                                **{n: to_jax(x) for n, x in gp.items()}, output_final_state=False)
    assert final is None and t_final is None
    assert out.shape == (2, 5, HV, V) and torch.equal(to_torch(out), t_out)


# ---------------------------------------------------------------------------------------------
# fused decode


def fused_inputs(gen, rows, slots, gate, D=8, Hf=3, indices=None):
    C = 3 * Hf * D
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    d = dict(x=r(rows, C), conv_weight=0.5 * r(C, 4), conv_state=r(slots, C, 3),
             g=raw_gate(gen, (rows, Hf, D), gate), beta=r(rows, Hf),
             state_indices=torch.randperm(slots, generator=gen)[:rows].to(torch.int32) if indices is None
             else torch.tensor(indices, dtype=torch.int32),
             state=r(slots, Hf, D, D), output_gate=r(rows, Hf, D), norm_weight=r(D))
    gp = gate_params(gen, gate, Hf, D)
    d["A_log"], d["dt_bias"] = gp["A_log"], gp["dt_bias"]
    return d, gp["lower_bound"]


FUSED_ORDER = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices", "state",
               "output_gate", "norm_weight")


@pytest.mark.parametrize("gate", ["softplus", "log"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_fused_decode_matches_reference_and_torch(gen, gate, mode):
    d, lb = fused_inputs(gen, rows=4, slots=6, gate=gate, indices=[5, -1, 0, 2])
    tc = {n: (x.clone() if x is not None else None) for n, x in d.items()}
    t_out = fk.fused_kda_decode(*(tc[n] for n in FUSED_ORDER), gate=gate, lower_bound=lb, slot_mode="padded")
    r_out, r_conv, r_state = ref.fused_kda_decode_step(*(d[n] for n in FUSED_ORDER), gate=gate, lower_bound=lb)
    jd = jaxify(d)
    args = [jd[n] for n in FUSED_ORDER]
    conv_addr, state_addr = jd["conv_state"].unsafe_buffer_pointer(), jd["state"].unsafe_buffer_pointer()
    if mode == "eager":
        out, conv, state = kj.fused_kda_decode(*args, gate=gate, lower_bound=lb, slot_mode="padded")
    else:
        fn = jax.jit(lambda *a: kj.fused_kda_decode(*a, gate=gate, lower_bound=lb, slot_mode="padded"),
                     donate_argnums=(2, 8))
        out, conv, state = fn(*args)
    assert conv.unsafe_buffer_pointer() == conv_addr and state.unsafe_buffer_pointer() == state_addr
    assert torch.equal(to_torch(out), t_out)
    assert torch.equal(to_torch(conv), tc["conv_state"]) and torch.equal(to_torch(state), tc["state"])
    torch.testing.assert_close(to_torch(out).double(), r_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(to_torch(conv).double(), r_conv.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(to_torch(state).double(), r_state.double(), rtol=1e-4, atol=1e-4)


def test_fused_decode_takes_the_width_major_conv_weight(gen):
    """conv_weight [3, 4, H*D] (vLLM's decode copy; docs/api.md "fused_kda_decode layouts") gives the [3*H*D, 4]
    call's bits through the same FFI binding."""
    d, lb = fused_inputs(gen, rows=3, slots=5, gate="softplus")
    C = d["conv_weight"].shape[0]
    wide = dict(d, conv_weight=d["conv_weight"].view(3, C // 3, 4).transpose(1, 2).contiguous())
    outs = [kj.fused_kda_decode(*(jaxify(x)[n] for n in FUSED_ORDER), gate="softplus", lower_bound=lb, donate=False)
            for x in (d, wide)]
    for a, b in zip(*outs):
        assert torch.equal(to_torch(a), to_torch(b))


# ---------------------------------------------------------------------------------------------
# errors: raised in Python, before any FFI call, naming the argument


def _bad_decode(gen, mutate, **kw):
    jd = jaxify(decode_inputs(gen, rows=3, slots=4, gate="softplus"))
    del jd["lower_bound"]
    jd.update(mutate)
    return jd, kw


@pytest.mark.parametrize("mutate, kw, exc, words", [
    ({"k": jnp.zeros((3, H, K + 1))}, {}, ValueError, ["k", "shape"]),
    ({"state": jnp.zeros((4, HV, K, V))}, {}, ValueError, ["state", "[slots, HV, V, K]"]),
    ({"state": jnp.zeros((4, HV, V, K), jnp.float16)}, {}, ValueError, ["state", "float16"]),
    ({"state_indices": jnp.zeros((3,), jnp.float32)}, {}, ValueError, ["state_indices", "int32", "float32"]),
    ({"v": jnp.zeros((3, HV, V), jnp.bfloat16)}, {}, ValueError, ["v", "float32", "bfloat16"]),
    ({"A_log": None}, {}, ValueError, ["A_log", "softplus"]),
    ({}, {"gate": "tanh"}, ValueError, ["gate", "tanh"]),
    ({}, {"slot_mode": "any"}, ValueError, ["slot_mode", "any"]),
    ({}, {"lower_bound": -1.0}, ValueError, ["lower_bound", "bounded"]),
    ({}, {"null_slot0": 1}, TypeError, ["null_slot0", "bool"]),
    ({"q": [[1.0]]}, {}, TypeError, ["q", "jax.Array", "list"]),
    ({}, {"platform": "tpu"}, ValueError, ["platform", "tpu"]),
])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_decode_errors_name_the_argument(gen, mutate, kw, exc, words, mode):
    jd, kw = _bad_decode(gen, mutate, **kw)
    arrays = {n: x for n, x in jd.items() if isinstance(x, jax.Array)}     # traced under jit
    others = {n: x for n, x in jd.items() if n not in arrays}              # None, a list: closed over
    before = jax_tvm_ffi_count()
    with pytest.raises(exc) as info:
        if mode == "eager":
            jax_decode(jd, **kw)
        else:
            jax.jit(lambda a: jax_decode({**a, **others}, **kw))(arrays)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert jax_tvm_ffi_count() == before
    assert not jd["state"].is_deleted()               # nothing donated, nothing run


def jax_tvm_ffi_count():
    import jax_tvm_ffi
    return jax_tvm_ffi.registered_count()


def test_prefill_errors_name_the_argument(gen):
    d = jaxify(prefill_inputs(gen, [3, 4], "softplus"))
    pos, rest = split(d)
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing offsets"):
        kj.kda_prefill(*pos, **dict(rest, cu_seqlens=jnp.array([0, 5, 4], jnp.int32)))
    with pytest.raises(ValueError, match=r"max_seqlen: expected >= the longest sequence in cu_seqlens \(4\)"):
        kj.kda_prefill(*pos, **rest, max_seqlen=3)
    with pytest.raises(ValueError, match="initial_state"):
        kj.kda_prefill(*pos, **rest, initial_state=jnp.zeros((3, HV, V, K)))
    with pytest.raises(ValueError, match="state_indices"):
        kj.kda_prefill(*pos, **rest, state=jnp.zeros((3, HV, V, K)))
    with pytest.raises(ValueError, match="checkpoints"):
        kj.kda_prefill(*pos, **rest, checkpoint_every=2, checkpoints=jnp.zeros((2, 1, HV, V, K)))
    with pytest.raises(ValueError, match="checkpoint_every"):
        jax.jit(lambda p, r: kj.kda_prefill(*p, **r, checkpoint_every=-1))(pos, rest)


def test_fused_errors_name_the_argument(gen):
    d, _ = fused_inputs(gen, rows=2, slots=3, gate="softplus")
    jd = jaxify(d)
    bad = dict(jd, conv_state=jnp.zeros((2, jd["x"].shape[1], 3)))
    with pytest.raises(ValueError, match="conv_state: expected 3 slots"):
        kj.fused_kda_decode(*(bad[n] for n in FUSED_ORDER))
    bad = dict(jd, norm_weight=jnp.zeros((5,)))
    with pytest.raises(ValueError, match="norm_weight"):
        jax.jit(lambda *a: kj.fused_kda_decode(*a))(*(bad[n] for n in FUSED_ORDER))
    with pytest.raises(ValueError, match="norm_eps"):
        kj.fused_kda_decode(*(jd[n] for n in FUSED_ORDER), norm_eps=0.0)


def test_import_error_names_what_to_install(monkeypatch):
    import importlib
    monkeypatch.setitem(sys.modules, "jax_tvm_ffi", None)      # makes `import jax_tvm_ffi` fail
    monkeypatch.delitem(sys.modules, "flashkda_ext.jax")
    with pytest.raises(ImportError) as info:
        importlib.import_module("flashkda_ext.jax")
    msg = str(info.value)
    assert "jax-tvm-ffi" in msg and "pip install" in msg and "flashkda_ext[jax]" in msg


def test_platform_selects_the_backend_rules(gen):
    """platform= picks the backend whose supported set validates the call: K = 16 is fine on the
    CPU backend and refused by the CUDA one (head dim 128 only) before anything is built."""
    jd = jaxify(decode_inputs(gen, rows=2, slots=3, gate="softplus"))
    del jd["lower_bound"]
    with pytest.raises(ValueError, match="head dim K = 16"):
        jax_decode(jd, platform="cuda")
    assert not jd["state"].is_deleted()
    with jax.default_device(jax.devices("cpu")[0]):
        out, _ = jax.jit(lambda a: jax_decode(a))({n: x for n, x in jd.items()})
    assert out.shape == (2, HV, V)


def test_compiled_program_copies_the_pool_only_without_donation(gen):
    """The FFI call aliases the pool: with donation XLA compiles no copy of it; without donation
    (the input must survive) exactly one copy of the pool appears."""
    d = decode_inputs(gen, rows=3, slots=6, gate="softplus")
    jd = jaxify(d)
    consts = {n: jd[n] for n in ("state_indices", "A_log", "dt_bias")}

    def f(pool, q, k, v, g, beta):
        return kj.kda_decode(q, k, v, g, beta, state=pool, **consts)

    args = [jd[n] for n in ("state", "q", "k", "v", "g", "beta")]
    pool_type = f"f32[6,{HV},{V},{K}]"
    copies = {}
    for donate in ((0,), ()):
        hlo = jax.jit(f, donate_argnums=donate).lower(*args).compile().as_text()
        assert "custom-call" in hlo
        copies[donate] = sum(1 for line in hlo.splitlines() if f"= {pool_type}" in line and " copy(" in line)
    assert copies == {(0,): 0, (): 1}


def test_prefill_given_checkpoints_written_in_place(gen):
    lens = [4, 7]
    d = prefill_inputs(gen, lens, "log")
    d.pop("lower_bound")
    pos, rest = split(d)
    sentinel = torch.full((2, 5, HV, V, K), 7.0)            # C >= T // 2 = 5
    t_ck = sentinel.clone()
    t_out, t_final, _ = fk.kda_prefill(*pos, **rest, gate="log", checkpoint_every=2, checkpoints=t_ck)
    jpos, jrest = split(jaxify(d))
    jck = to_jax(sentinel)
    addr = jck.unsafe_buffer_pointer()
    out, final, ck = kj.kda_prefill(*jpos, **jrest, gate="log", checkpoint_every=2, checkpoints=jck)
    assert jck.is_deleted() and ck.unsafe_buffer_pointer() == addr
    assert torch.equal(to_torch(ck), t_ck) and torch.equal(to_torch(out), t_out)
    assert torch.equal(to_torch(final), t_final)
    assert torch.all(to_torch(ck)[0, 2:] == 7.0) and torch.all(to_torch(ck)[1, 3:] == 7.0)   # past each count


# ---------------------------------------------------------------------------------------------
# the FFI targets' argument reorder is C++ (helper module ffi_reorder); the eager path memoizes


def _flashkda_frames(fn):
    """Names of the flashkda_ext Python functions entered while fn() runs (any thread that starts
    or runs Python meanwhile; on the CPU backend XLA runs the custom call on the calling thread)."""
    import threading
    seen = []

    def prof(frame, event, arg):
        if event == "call" and "flashkda_ext" in frame.f_code.co_filename:
            seen.append(frame.f_code.co_name)

    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def test_targets_reorder_in_cpp_no_python_per_jitted_call(gen):
    """A layout with absent optional tensors (log gate: A_log, dt_bias -> None) and an aliased pool
    (operand and result are one buffer, named twice in the ABI order) gives the torch op's results,
    through a target whose adapter is the C++ wrapper; a jitted step then runs no flashkda_ext Python."""
    d = decode_inputs(gen, rows=4, slots=6, gate="log", indices=[3, -1, 0, 5])
    t_out, t_state = torch_decode(d, gate="log", slot_mode="padded")
    jd = jaxify(d)
    del jd["lower_bound"]
    pool = jd.pop("state")
    step = jax.jit(lambda s, a: jax_decode(dict(a, state=s), gate="log", slot_mode="padded"), donate_argnums=0)
    out, pool = step(pool, jd)
    assert torch.equal(to_torch(out), t_out) and torch.equal(to_torch(pool), t_state)

    names = [n for n in kj.registered_targets() if ".kda_decode." in n]
    assert names and all(kj.targets._ADAPTERS[n][0] == "c++" for n in kj.registered_targets())

    box = {"pool": pool}

    def run():
        for _ in range(3):
            _, box["pool"] = step(box["pool"], jd)
        jax.block_until_ready(box["pool"])

    assert _flashkda_frames(run) == []


def _reorder_calls(make, order, n_buffers, args):
    import tvm_ffi
    seen = []
    wrapped = make(tvm_ffi.convert(lambda *a: seen.append(a)), order, n_buffers)
    wrapped(*args)
    return seen


def test_cpp_reorder_semantics_and_errors():
    from flashkda_ext import jit
    make = jit.load_module("ffi_reorder")["ffi_reorder"]
    # buffers a b c (c the result aliased to operand 0's slot too), attributes 7, 0.5, True
    args = ("a", "b", "c", 7, 0.5, True)
    assert _reorder_calls(make, [2, -1, 0, 2, 1], 3, args) == [("c", None, "a", "c", "b", 7, 0.5, True)]
    assert _reorder_calls(make, [], 0, (1, 2)) == [(1, 2)]
    # the Python fallback does exactly the same
    fallback = lambda fn, order, n: kj.targets._python_adapter(fn, tuple(None if i < 0 else i for i in order), n)  # noqa: E731
    assert _reorder_calls(fallback, [2, -1, 0, 2, 1], 3, args) == [("c", None, "a", "c", "b", 7, 0.5, True)]
    with pytest.raises(ValueError, match=r"order\[1\] = 3 is not a buffer index"):
        _reorder_calls(make, [0, 3], 3, args)
    with pytest.raises(ValueError, match="expected 3 buffers"):
        _reorder_calls(make, [0, 1, 2], 3, ("a", "b"))
    import json
    assert json.loads(jit.load_module("ffi_reorder")["fkda_contract"]())["FKDA_FAMILY"] == "ffi_reorder"


def test_python_adapter_fallback_warns_when_helper_unavailable(monkeypatch):
    from flashkda_ext import jit
    real = jit.load_module

    def broken(name, *a, **kw):
        if name == "ffi_reorder":
            raise jit.JitDisabledError("no artifact for ffi_reorder (test)")
        return real(name, *a, **kw)

    monkeypatch.setattr(kj.targets, "_REORDER", {})
    monkeypatch.setattr(jit, "load_module", broken)
    with pytest.warns(RuntimeWarning, match="Python adapter"):
        adapter, kind = kj.targets._make_adapter(jax_noop_fn(), (1, None, 0), 2)
    assert kind == "python"
    adapter, kind = kj.targets._make_adapter(jax_noop_fn(), (1, None, 0), 2)      # warned once, then quiet
    assert kind == "python"


def jax_noop_fn():
    import tvm_ffi
    return tvm_ffi.convert(lambda *a: None)


def test_eager_calls_validate_once_per_signature_and_bad_calls_always(gen, monkeypatch):
    calls = []
    real = kj.validation.check_kda_decode

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    d = decode_inputs(gen, rows=3, slots=5, gate="softplus")
    t_out, _ = torch_decode(d)
    monkeypatch.setattr(kj.plan, "_PREPARED", {})
    monkeypatch.setattr(kj.validation, "check_kda_decode", counting)
    for _ in range(3):
        jd = jaxify(d)
        del jd["lower_bound"]
        out, _ = jax_decode(jd)
    assert len(calls) == 1
    assert torch.equal(to_torch(out), t_out)
    jd = jaxify(decode_inputs(gen, rows=2, slots=5, gate="softplus"))     # another shape: checked
    del jd["lower_bound"]
    jax_decode(jd)
    assert len(calls) == 2
    for _ in range(2):                                                    # a bad option: raises each time
        jd = jaxify(d)
        del jd["lower_bound"]
        with pytest.raises(TypeError, match="null_slot0"):
            jax_decode(jd, null_slot0=0)                                   # 0 is not False
        assert not jd["state"].is_deleted()
    assert len(calls) == 4


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_prefill_pool_without_final_state_commits_nothing(gen, mode):
    """Pool mode with output_final_state=False reads the pool and writes nothing (a speculative
    extend): final_state is None, the pool keeps its bits, the output equals the torch op's."""
    lens = [4, 6, 2]
    d = prefill_inputs(gen, lens, "softplus")
    pool = torch.randn(6, HV, V, K, generator=gen)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    pos, rest = split(d)
    t_pool = pool.clone()
    t_out, t_final = fk.kda_prefill(*pos, **rest, state=t_pool, state_indices=idx, output_final_state=False)
    assert t_final is None and torch.equal(t_pool, pool)
    jpos, jrest = split(jaxify(d))
    jpool = to_jax(pool)
    call = lambda p, r, s, i: kj.kda_prefill(*p, **r, state=s, state_indices=i,  # noqa: E731
                                             output_final_state=False)
    out, final = (call if mode == "eager" else jax.jit(call))(jpos, jrest, jpool, to_jax(idx))
    assert final is None and not jpool.is_deleted()         # not donated: only read
    assert torch.equal(to_torch(jpool), pool)
    assert torch.equal(to_torch(out), t_out)
