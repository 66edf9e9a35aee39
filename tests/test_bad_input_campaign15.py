"""Bad-input campaign 15 (CPU backend): the JAX front end, the torch custom ops' fake implementations, the trace
consumer and the fla adapter, driven as an integrator would. Each case failed before its fix, except those marked
"guard" (behaviour that was already right, pinned beside the fix that depends on it).

- JAX: a numpy argument of a dtype JAX cannot hold (object, str, datetime, longdouble) failed in jnp.asarray with
  JAX's "Error interpreting argument to stage", naming no argument; platform="cuda" with arrays on the CPU built
  the CUDA module (prefill: before the call, decode: at the call) and then failed in XLA's Execute ("No FFI
  handler registered ... on a platform Host"), naming no argument. The refusal comes after the arguments' own
  checks (a bad head dim is still named first: guard) and leaves the pools undonated.
- torch custom ops: the fake implementations ran the eager checks on meta stand-ins that drop requires_grad and
  the inference flag, so a FakeTensor call with an input requiring grad (or an inference pool written outside
  inference mode) returned outputs where eager refuses; kda_prefill's fake never looked at `workspace` (a float32
  one was accepted); the traced prefill sized its final state in the dtype of given checkpoints, so bf16
  checkpoints beside no state (eager: "checkpoints: expected the state dtype float32") were served with a bf16
  final state under torch.compile; a gate / slot_mode that is no str or a None flag failed in the schema with a
  RuntimeError instead of the eager ValueError / TypeError naming it.
- trace_consumer: index_tensors drew indices for axes the definition's constraints refuse (num_seqs_p1 = 1 gave 2
  offsets; a missing var axis was a KeyError), for negative axes (torch's error, no axis named; check_call took
  them), and under slot_mode "unique" padded with -1 when rows outnumber the slots (the mode promises distinct,
  non-negative slots); verify offsets for fewer tokens than requests (the constraints allow it) did not end at
  total_tokens; checkpoint_every / seed of the wrong type were read by truth value, truncated by int() or failed in
  torch.manual_seed naming nothing; op_spec took an unknown op: tag (a Solution that fails only when run).
- fla (0.6.0's chunk_kda asserts both): a non-fp32 initial_state and return_intermediate_states outside
  torch.inference_mode() were served (the verdict memo now keys inference mode too); fused_recurrent_kda_fwd's
  `out` of another shape than v (fla asserts out.shape == v.shape) was served through a reshape and returned in
  the caller's shape, not [B, T, HV, V]. The verifiers checked meta stand-ins, which drop a lazy negated view and
  the inference flag: such a call was accepted and the op then raised (no fallback to fla's kernel); both now fall
  back, counted (the verdict memo keys the flags).
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashkda_ext as fk
from flashkda_ext import ops, trace_consumer
from flashkda_ext.integrations import fla as fkda_fla
from bad_input_cases import (FUSED_POS, H, HV, K, R, SLOTS, V, decode_args, fla_chunk_call as fla_chunk,
                             fla_decode_call as fla_decode, fused_args, i32, rand, verify_args)

POS = ("q", "k", "v", "g", "beta")


def prefill_args(T=8):
    return dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, HV, V), g=rand(1, T, HV, K),
                beta=rand(1, T, HV), A_log=rand(HV), dt_bias=rand(HV * K), cu_seqlens=i32(0, 5, T))


MAKE = {"kda_decode": (decode_args, POS), "kda_verify": (verify_args, POS), "kda_prefill": (prefill_args, POS),
        "fused_kda_decode": (fused_args, FUSED_POS)}


def run(op, a):
    a = dict(a)
    return getattr(fk, op)(*[a.pop(n) for n in MAKE[op][1]], **a)


def raises_twice(exc, match, fn):
    """The same named error on the first call and on a repeated one (nothing memoised past a refusal)."""
    for _ in range(2):
        with pytest.raises(exc, match=match):
            fn()


# ---------------------------------------------------------------------------------------------
# JAX

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")
import jax.numpy as jnp  # noqa: E402

kj = pytest.importorskip("flashkda_ext.jax")


def to_jax(a):
    return {n: (jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor) else x) for n, x in a.items()}


UNHELD = [np.array([4, None, 2], dtype=object), np.array(["a", "b", "c"]), np.array([1, 2, 3], dtype="datetime64[s]"),
          np.zeros(3, dtype=np.longdouble)]


@pytest.mark.parametrize("value", UNHELD, ids=lambda v: str(v.dtype))
def test_jax_numpy_array_of_a_dtype_jax_cannot_hold_is_named(value):
    for warm in (False, True):
        if warm:
            run_jax("kda_decode", to_jax(decode_args()), donate=False)
        a = to_jax(decode_args())
        with pytest.raises(ValueError, match=r"^state_indices: a numpy array of dtype .*which JAX cannot hold"):
            run_jax("kda_decode", dict(a, state_indices=value))
        assert not a["state"].is_deleted()


def run_jax(op, a, **kw):
    a = dict(a, **kw)
    return getattr(kj, op)(*[a.pop(n) for n in MAKE[op][1]], **a)


def big_decode():
    """kda_decode inputs the CUDA backend's supported set takes (so only the platform is wrong)."""
    Hb, D, S = 16, 128, 4
    z = lambda *s, dt=jnp.bfloat16: jnp.zeros(s, dt)  # noqa: E731
    return dict(q=z(2, Hb, D), k=z(2, Hb, D), v=z(2, Hb, D), g=z(2, Hb, D), beta=z(2, Hb),
                state=z(S, Hb, D, D, dt=jnp.float32), state_indices=jnp.array([0, 1], jnp.int32),
                A_log=z(Hb, dt=jnp.float32), dt_bias=z(Hb * D, dt=jnp.float32))


def big_prefill():
    Hb, D, T = 16, 128, 4
    z = lambda *s, dt=jnp.bfloat16: jnp.zeros(s, dt)  # noqa: E731
    return dict(q=z(1, T, Hb, D), k=z(1, T, Hb, D), v=z(1, T, Hb, D), g=z(1, T, Hb, D), beta=z(1, T, Hb),
                A_log=z(Hb, dt=jnp.float32), dt_bias=z(Hb * D, dt=jnp.float32), cu_seqlens=jnp.array([0, 4], jnp.int32),
                state=z(3, Hb, D, D, dt=jnp.float32), state_indices=jnp.array([1], jnp.int32))


@pytest.mark.parametrize("op,make", [("kda_decode", big_decode), ("kda_prefill", big_prefill)])
def test_jax_platform_other_than_the_arrays_is_refused_before_anything_is_built(op, make, monkeypatch):
    from flashkda_ext import jit
    built = []
    real = jit.load_module
    monkeypatch.setattr(jit, "load_module", lambda name, *a, **k: built.append(name) or real(name, *a, **k))
    a = make()
    raises_twice(ValueError, r"^q: an array on cpu, but the call runs on cuda",
                 lambda: run_jax(op, a, platform="cuda"))
    assert not a["state"].is_deleted()
    assert not [m for m in built if "cpu" not in m], built      # no CUDA module built for a call that cannot run


def test_jax_platform_cuda_still_applies_the_cuda_rules_first():
    """Guard: the argument the CUDA backend refuses is named before the platform (tests/test_jax.py relies on it)."""
    a = to_jax(decode_args())
    with pytest.raises(ValueError, match="head dim K = 8"):
        run_jax("kda_decode", a, platform="cuda")
    assert not a["state"].is_deleted()
    out, _ = run_jax("kda_decode", a, platform="cpu", donate=False)     # the arrays' own platform: served
    assert out.shape == (R, HV, V)


# ---------------------------------------------------------------------------------------------
# torch custom ops: fake implementations


def fake_outcome(op, a, change=None):
    mode = FakeTensorMode()
    fa = {n: (mode.from_tensor(x) if isinstance(x, torch.Tensor) else x) for n, x in a.items()}
    with mode:
        if change:
            change(fa)
        return run(op, fa)


@pytest.mark.parametrize("op,name", [("kda_decode", "q"), ("kda_decode", "state"), ("kda_prefill", "v"),
                                     ("kda_verify", "beta"), ("fused_kda_decode", "x")])
def test_fake_refuses_an_input_requiring_grad_as_eager(op, name):
    a = MAKE[op][0]()
    a[name].requires_grad_()
    ops.clear_call_caches()
    with pytest.raises(ValueError, match=rf"^{name}: requires grad, but the ops are inference-only"):
        run(op, a)
    a = MAKE[op][0]()
    a[name].requires_grad_()
    with pytest.raises(ValueError, match=rf"^{name}: requires grad, but the ops are inference-only"):
        fake_outcome(op, a)
    with torch.no_grad():                                         # guard: the same call without grad is traced
        out = fake_outcome(op, MAKE[op][0]())
    assert out is not None


def test_fake_refuses_an_inference_pool_written_outside_inference_mode():
    a = decode_args()
    with torch.inference_mode():
        a["state"] = a["state"].clone()
    words = r"^state: an inference tensor .*cannot be written in place outside inference mode"
    with pytest.raises(ValueError, match=words):
        run("kda_decode", a)
    with pytest.raises(ValueError, match=words):
        fake_outcome("kda_decode", a)


def test_fake_prefill_checks_the_workspace_kind():
    a = dict(prefill_args(), workspace=torch.zeros(16))
    with pytest.raises(ValueError, match=r"^workspace: expected a uint8 tensor on cpu"):
        run("kda_prefill", a)
    with pytest.raises(ValueError, match=r"^workspace: expected a uint8 tensor on cpu"):
        fake_outcome("kda_prefill", dict(prefill_args(), workspace=torch.zeros(16)))
    out = fake_outcome("kda_prefill", dict(prefill_args(), workspace=torch.zeros(16, dtype=torch.uint8)))  # guard
    assert out[0].shape == (1, 8, HV, V)


def test_traced_prefill_takes_the_state_dtype_as_eager_not_from_checkpoints():
    bad = dict(checkpoint_every=4, checkpoints=torch.zeros(2, 2, HV, V, K, dtype=torch.bfloat16))
    words = r"^checkpoints: expected the state dtype float32, got bfloat16"
    ops.clear_call_caches()
    with pytest.raises(ValueError, match=words):
        run("kda_prefill", dict(prefill_args(), **bad))
    with pytest.raises(ValueError, match=words):
        fake_outcome("kda_prefill", dict(prefill_args(), **bad))
    torch._dynamo.reset()
    a = dict(prefill_args(), **bad)
    tens = {n: x for n, x in a.items() if isinstance(x, torch.Tensor)}
    fn = torch.compile(lambda t: run("kda_prefill", dict(t, checkpoint_every=4)), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="checkpoints: expected the state dtype float32, got bfloat16"):
        fn(tens)
    # guard: with a bf16 initial_state the bf16 checkpoints are the state dtype, eager and traced alike
    def bf16_state():
        return dict(prefill_args(), initial_state=torch.zeros(2, HV, V, K, dtype=torch.bfloat16), **bad)
    eager = run("kda_prefill", bf16_state())
    fake = fake_outcome("kda_prefill", bf16_state())
    assert [x.dtype for x in eager[1:]] == [x.dtype for x in fake[1:]] == [torch.bfloat16] * 2


SCALARS = [("kda_decode", dict(gate=None), ValueError, r"^gate: expected one of \['softplus'"),
           ("kda_decode", dict(slot_mode=1), ValueError, r"^slot_mode: expected one of \['unique'"),
           ("kda_decode", dict(beta_is_logit=None), TypeError, r"^beta_is_logit: expected a bool, got NoneType"),
           ("kda_decode", dict(scale="0.5"), TypeError, r"^scale: expected a float"),
           ("fused_kda_decode", dict(slot_mode=None), ValueError, r"^slot_mode: expected one of"),
           ("kda_prefill", dict(output_final_state=None), TypeError, r"^output_final_state: expected a bool"),
           ("kda_prefill", dict(checkpoint_every=None), TypeError, r"^checkpoint_every: expected an int >= 0"),
           ("kda_verify", dict(max_seqlen="3"), TypeError, r"^max_seqlen: expected an int or None"),
           ("kda_verify", dict(null_slot0=None), TypeError, r"^null_slot0: expected a bool")]


@pytest.mark.parametrize("op,kw,exc,match", SCALARS, ids=[f"{o}-{next(iter(k))}" for o, k, _, _ in SCALARS])
def test_traced_scalar_the_schema_cannot_take_gets_the_eager_error(op, kw, exc, match):
    ops.clear_call_caches()
    with pytest.raises(exc, match=match):
        run(op, dict(MAKE[op][0](), **kw))
    with pytest.raises(exc, match=match):
        fake_outcome(op, dict(MAKE[op][0](), **kw))


# ---------------------------------------------------------------------------------------------
# trace_consumer


@pytest.fixture(scope="module")
def definitions():
    out = {}
    for op in ("kda_decode", "kda_prefill", "kda_verify"):
        text = subprocess.run([sys.executable, "-m", "flashkda_ext", "trace", "dump", op, "--backend", "cpu"],
                              check=True, capture_output=True, text=True).stdout
        out[op] = json.loads(text)
    return out


PREFILL_AXES = dict(batch=1, seq_len=10, num_seqs=3, num_seqs_p1=4)


def test_index_tensors_refuses_axes_the_constraints_refuse(definitions):
    d = definitions["kda_prefill"]
    assert trace_consumer.index_tensors(d, PREFILL_AXES)["cu_seqlens"].shape == (4,)      # guard
    with pytest.raises(ValueError, match=r"^axes: .* violate .*num_seqs_p1 == num_seqs \+ 1"):
        trace_consumer.index_tensors(d, dict(PREFILL_AXES, num_seqs_p1=1))
    with pytest.raises(ValueError, match=r"no value for var axis 'num_seqs'"):
        trace_consumer.index_tensors(d, {k: v for k, v in PREFILL_AXES.items() if k != "num_seqs"})


@pytest.mark.parametrize("op,axes,axis", [("kda_decode", dict(rows=-1, num_slots=4), "rows"),
                                          ("kda_prefill", dict(PREFILL_AXES, seq_len=-3), "seq_len")])
def test_negative_axis_is_refused_naming_it(definitions, op, axes, axis):
    d = definitions[op]
    for fn in (trace_consumer.check_call, trace_consumer.index_tensors):
        with pytest.raises(ValueError, match=rf"var axis '{axis}': expected an int >= 0"):
            fn(d, axes)


def test_unique_slots_need_as_many_slots_as_rows(definitions):
    d = definitions["kda_decode"]
    assert "slot_mode:unique" in d["tags"]
    idx = trace_consumer.index_tensors(d, dict(rows=4, num_slots=4))["state_indices"]           # guard
    assert sorted(idx.tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"need 10 distinct live slots under slot_mode 'unique'.*num_slots = 4"):
        trace_consumer.index_tensors(d, dict(rows=10, num_slots=4))


def test_verify_offsets_with_fewer_tokens_than_requests_end_at_total(definitions):
    d = definitions["kda_verify"]
    axes = dict(batch=1, total_tokens=1, num_slots=10, num_seqs=2, max_draft=3, num_seqs_p1=3)
    assert trace_consumer.check_call(d, axes) == []
    idx = trace_consumer.index_tensors(d, axes, seed=4)
    cu = idx["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == 1 and len(cu) == 3 and all(b >= a for a, b in zip(cu, cu[1:])), cu
    args = dict(q=rand(1, 1, H, K), k=rand(1, 1, H, K), v=rand(1, 1, HV, V), g=rand(1, 1, HV, K), beta=rand(1, 1, HV),
                state=rand(10, HV, V, K), A_log=rand(HV), dt_bias=rand(HV * K), **idx)
    fk.kda_verify(*[args.pop(n) for n in POS], **args)          # the op takes them


@pytest.mark.parametrize("name,value,exc", [("checkpoint_every", True, TypeError), ("checkpoint_every", 2.5, TypeError),
                                            ("checkpoint_every", "4", TypeError), ("checkpoint_every", -4, ValueError),
                                            ("seed", 1.5, TypeError), ("seed", None, TypeError),
                                            ("seed", True, TypeError)])
def test_index_tensors_options_of_the_wrong_type_are_named(definitions, name, value, exc):
    with pytest.raises(exc, match=rf"^{name}: expected an int"):
        trace_consumer.index_tensors(definitions["kda_prefill"], PREFILL_AXES, **{name: value})


def test_op_spec_refuses_an_unknown_op_tag(definitions):
    d = dict(definitions["kda_prefill"], tags=["op:kda_prefil", "gate:softplus"])
    with pytest.raises(ValueError, match=r"op: tag 'kda_prefil'; expected one of kda_decode"):
        trace_consumer.op_spec(d)
    assert trace_consumer.op_spec(definitions["kda_prefill"])["op"] == "kda_prefill"              # guard


# ---------------------------------------------------------------------------------------------
# fla


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fla_chunk_kda_initial_state_not_fp32_is_refused(dtype):
    with torch.inference_mode():
        init = rand(1, 4, V, K)
        assert fkda_fla.chunk_kda_verifier(**fla_chunk(initial_state=init, output_final_state=True)) == (True, None)
        before = fkda_fla.STATS["chunk_kda", "refused"]
        for _ in range(2):
            ok, why = fkda_fla.chunk_kda_verifier(**fla_chunk(initial_state=init.to(dtype), output_final_state=True))
            assert not ok and "initial_state in float32 only" in why, why
        assert fkda_fla.STATS["chunk_kda", "refused"] == before + 2


def test_fla_return_intermediate_states_needs_inference_mode():
    call = fla_chunk(return_intermediate_states=True)
    with torch.inference_mode():
        assert fkda_fla.chunk_kda_verifier(**call) == (True, None)                                 # guard
    for ctx in (torch.no_grad, torch.enable_grad):     # same signature, memo armed: refused outside inference mode
        with ctx():
            ok, why = fkda_fla.chunk_kda_verifier(**call)
            assert not ok and "outside torch.inference_mode()" in why, why


@pytest.mark.parametrize("shape", [(3, 4, V), (1, 3, 4 * V)])
def test_fla_fused_recurrent_out_of_another_shape_is_refused(shape):
    with torch.inference_mode():
        out = torch.full(shape, 7.0)
        ok, why = fkda_fla.fused_recurrent_kda_fwd_verifier(**fla_decode(out=out))
        assert not ok and "out of the shape of v [1, 3, 4, 16]" in why, why
        assert torch.equal(out, torch.full(shape, 7.0))
        good = torch.zeros(1, 3, 4, V)                                                            # guard
        assert fkda_fla.fused_recurrent_kda_fwd_verifier(**fla_decode(out=good)) == (True, None)
        o, _ = fkda_fla.serve_fused_recurrent_kda_fwd(**fla_decode(out=good))
        assert o is good and o.shape == (1, 3, 4, V)


# ---------------------------------------------------------------------------------------------
# fla: what the verifier's meta stand-ins drop (found by campaign 18's review; the op raised after the verifier
# had accepted the call, instead of fla falling back)


def _inference_copy(x):
    with torch.inference_mode():
        return x.clone()


@pytest.mark.parametrize("entry,name", [("chunk", "q"), ("chunk", "g"), ("decode", "q"), ("decode", "beta")])
def test_fla_a_lazy_negated_view_falls_back(entry, name):
    make, verifier = ((fla_chunk, fkda_fla.chunk_kda_verifier) if entry == "chunk" else
                      (fla_decode, fkda_fla.fused_recurrent_kda_fwd_verifier))
    with torch.inference_mode():
        assert verifier(**make()) == (True, None)                                           # guard: plain
        call = make()
        call[name] = torch._neg_view(call[name])
        ok, why = verifier(**call)
    assert not ok and f"lazy negated view ({name})" in why, why


def test_fla_an_inference_pool_written_outside_inference_mode_falls_back():
    call = fla_decode(initial_state=_inference_copy(rand(SLOTS, 4, V, K)))
    ok, why = fkda_fla.fused_recurrent_kda_fwd_verifier(**call)
    assert not ok and "write initial_state in place, an inference tensor" in why, why
    with torch.inference_mode():                                                            # guard: inside it
        assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
        fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    # an inference tensor only read (q) is no reason to fall back
    call = fla_decode(q=_inference_copy(rand(1, 3, 2, K)))
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
