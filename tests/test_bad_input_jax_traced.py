"""Bad input through the JAX front end and the torch traced path (CPU backend); each case failed before its fix.

JAX:
- a numpy int64 / float64 argument was narrowed by jnp.asarray (x64 off) without a range check: state_indices
  [4, 2**32 + 1, 2] was served as [4, 1, 2], cu_seqlens [0, 2**32 + 2, 2**32 + 5] as [0, 2, 5];
- an eager call whose host index values the CPU kernel refuses (a slot past the pool, a slot serving two
  prefill sequences) donated the pools first: the call failed with XLA's runtime error and the caller's pool
  was deleted.
torch.compile / torch.export:
- the traced wrappers converted a huge int scale / lower_bound / norm_eps (OverflowError, no name; Dynamo
  folds float() and raised its internal error past validation's except clause) and read v.shape,
  q.shape[-1], cu_seqlens.shape[0], output_gate.shape, x.dtype, q.device before any check (AttributeError,
  IndexError, "not enough values to unpack").
The JAX refusals are checked cold and after a valid call; the traced bad tensors after a valid trace.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")
import jax.numpy as jnp  # noqa: E402

import flashkda_ext as fk  # noqa: E402
from bad_input_cases import (FUSED_POS, FUSED_VERIFY_POS, H, HV, K, R, SLOTS, V, decode_args, fused_args,
                             fused_verify_args, i32, rand, verify_args)  # noqa: E402

kj = pytest.importorskip("flashkda_ext.jax")

POS = ("q", "k", "v", "g", "beta")


def prefill_args():
    return dict(q=rand(1, 8, H, K), k=rand(1, 8, H, K), v=rand(1, 8, HV, V), g=rand(1, 8, HV, K), beta=rand(1, 8, HV),
                A_log=rand(HV), dt_bias=rand(HV * K), cu_seqlens=i32(0, 5, 8))


def pool_prefill_args():
    return dict(prefill_args(), state=rand(SLOTS, HV, V, K), state_indices=i32(1, 4))


MAKE = {"kda_decode": decode_args, "kda_verify": verify_args, "kda_prefill": prefill_args,
        "fused_kda_decode": fused_args, "fused_kda_verify": fused_verify_args}


def call(lib, op, a, kw=None):
    """op of lib (flashkda_ext or flashkda_ext.jax) on the arguments a (by name)."""
    a = dict(a, **(kw or {}))
    pos = {"fused_kda_decode": FUSED_POS, "fused_kda_verify": FUSED_VERIFY_POS}.get(op, POS)
    return getattr(lib, op)(*[a.pop(n) for n in pos], **a)


def to_jax(a):
    return {n: (jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor) else x) for n, x in a.items()}


# --- JAX: numpy arrays jnp.asarray would narrow (x64 off) --------------------------------------------------

NARROWED = [("kda_decode", "state_indices", np.array([4, 2 ** 32 + 1, 2], np.int64)),
            ("kda_verify", "cu_seqlens", np.array([0, 2 ** 32 + 2, 2 ** 32 + 5], np.int64)),
            ("kda_prefill", "cu_seqlens", np.array([0, 2 ** 32 + 5, 2 ** 32 + 8], np.int64)),
            ("kda_decode", "q", np.zeros((R, H, K), np.float64))]


@pytest.mark.parametrize("op,name,value", NARROWED, ids=[f"{o}-{n}" for o, n, _ in NARROWED])
def test_a_numpy_array_jax_would_narrow_is_refused_naming_it(op, name, value):
    with jax.enable_x64(False):
        for warm in (False, True):
            if warm:
                call(kj, op, to_jax(MAKE[op]()), {"donate": False})
            a = to_jax(MAKE[op]())
            with pytest.raises(ValueError, match=rf"^{name}: .*int32|^{name}: .*float32"):
                call(kj, op, dict(a, **{name: value}))
            if "state" in a:
                assert not a["state"].is_deleted()      # refused before anything was donated
    with jax.enable_x64(True):  # numpy int64 stays int64 there: the op's own dtype rule names it
        if value.dtype == np.int64 and op != "kda_prefill":    # (prefill takes int64 offsets)
            with pytest.raises(ValueError, match=rf"^{name}: expected dtype int32, got int64"):
                call(kj, op, dict(to_jax(MAKE[op]()), **{name: value}), {"donate": False})


def test_a_numpy_array_of_a_dtype_jax_keeps_is_still_taken():
    a = to_jax(decode_args())
    out, _ = call(kj, "kda_decode", dict(a, state_indices=np.array([4, 0, 2], np.int32)), {"donate": False})
    assert out.shape == (R, HV, V)


# --- JAX: host index values the CPU kernel refuses, checked before the pools are donated ------------------

BAD_SLOTS = [("kda_decode", decode_args, i32(4, SLOTS, 2), "is out of range for a pool of 6 slots"),
             ("fused_kda_decode", fused_args, i32(1, -1, 99), "is out of range for a pool of 6 slots"),
             ("kda_prefill", pool_prefill_args, i32(1, SLOTS), "is out of range for a pool of 6 slots"),
             ("kda_prefill", pool_prefill_args, i32(3, 3), "slot 3 serves more than one sequence")]


@pytest.mark.parametrize("op,make,indices,words", BAD_SLOTS, ids=["decode", "fused", "prefill-range", "prefill-dup"])
def test_eager_bad_slot_values_are_refused_before_the_pools_are_donated(op, make, indices, words):
    for warm in (False, True):
        if warm:
            call(kj, op, to_jax(make()))
        t = make()
        a = to_jax(dict(t, state_indices=indices))
        with pytest.raises(ValueError, match="^state_indices: ") as info:
            call(kj, op, a)                                       # donate=True: the default
        assert words in str(info.value)
        for pool in ("state", "conv_state"):
            if pool in a:
                assert not a[pool].is_deleted() and np.array_equal(np.asarray(a[pool]), t[pool].numpy())


def test_prefill_padding_slots_may_repeat():
    # -1 (and 0 with null_slot0) is padding, so it is not "a slot serving two sequences"
    a = to_jax(dict(pool_prefill_args(), state_indices=i32(0, 0)))
    out, pool = call(kj, "kda_prefill", a, {"null_slot0": True, "donate": False})
    assert np.array_equal(np.asarray(pool), np.asarray(a["state"]))


# --- torch.compile / torch.export: the traced wrappers name the argument -----------------------------------

HUGE = 10 ** 400


def traced(mode, op, a, kw):
    import torch._dynamo
    torch._dynamo.reset()
    if mode == "compile":
        return torch.compile(lambda x: call(fk, op, x, kw), fullgraph=True, backend="eager")(a)

    class M(torch.nn.Module):
        def forward(self, x):
            return call(fk, op, x, kw)
    return torch.export.export(M(), (a,))


def refused_traced(mode, op, a, kw, message):
    """Refused under tracing with the eager message (Dynamo wraps it; its text is kept), writing nothing."""
    tensors = {n: x.clone() for n, x in a.items() if isinstance(x, torch.Tensor)}
    with pytest.raises(Exception) as info:
        traced(mode, op, a, kw)
    assert message in str(info.value), str(info.value)[:2000]
    assert all(torch.equal(a[n], x) for n, x in tensors.items())


SCALARS = [("kda_decode", dict(scale=HUGE), "scale: expected a finite float or None, got an int of"),
           ("kda_decode", dict(gate="bounded", lower_bound=-HUGE), "lower_bound: expected a finite float < 0, got an"),
           ("kda_prefill", dict(scale=HUGE), "scale: expected a finite float or None, got an int of"),
           ("kda_verify", dict(scale=HUGE), "scale: expected a finite float or None, got an int of"),
           ("fused_kda_decode", dict(gate="bounded", lower_bound=-HUGE), "lower_bound: expected a finite float < 0"),
           ("fused_kda_verify", dict(scale=HUGE), "scale: expected a finite float or None, got an int of"),
           ("fused_kda_decode", dict(norm_eps=HUGE), "norm_eps: expected a finite float > 0, got an int of"),
           ("fused_kda_verify", dict(norm_eps=HUGE), "norm_eps: expected a finite float > 0, got an int of")]


@pytest.mark.parametrize("mode", ["compile", "export"])
@pytest.mark.parametrize("op,kw,message", SCALARS, ids=[f"{o}-{next(iter(k))}" for o, k, _ in SCALARS])
def test_traced_huge_int_scalar_is_named(mode, op, kw, message):
    with pytest.raises(ValueError, match="^" + message.split(",")[0]):     # the eager message
        call(fk, op, MAKE[op](), kw)
    refused_traced(mode, op, MAKE[op](), kw, message)


TENSORS = [("kda_decode", dict(v=None), "v: expected a torch.Tensor, got None"),
           ("kda_decode", dict(q=None), "q: expected a torch.Tensor, got None"),
           ("kda_verify", dict(v=None), "v: expected a torch.Tensor, got None"),
           ("kda_prefill", dict(v=torch.zeros(8, HV, V)),
            "v: expected a 4-D tensor [B, T, HV, V], got shape [8, 4, 16]"),
           ("kda_prefill", dict(q=torch.tensor(1.0)), "q: expected a 4-D tensor [B, T, H, K], got shape []"),
           ("kda_prefill", dict(cu_seqlens=torch.tensor(8, dtype=torch.int32)),
            "cu_seqlens: expected a 1-D tensor [N+1], got shape []"),
           ("fused_kda_decode", dict(output_gate=None), "output_gate: expected a torch.Tensor, got None"),
           ("fused_kda_decode", dict(x=None), "x: expected a torch.Tensor, got None"),
           ("fused_kda_verify", dict(output_gate=None), "output_gate: expected a torch.Tensor, got None")]


@pytest.mark.parametrize("mode", ["compile", "export"])
@pytest.mark.parametrize("op,bad,message", TENSORS, ids=[f"{o}-{next(iter(b))}" for o, b, _ in TENSORS])
def test_traced_wrapper_names_a_bad_tensor_it_would_read(mode, op, bad, message):
    with pytest.raises((TypeError, ValueError), match="^" + re.escape(message)):
        call(fk, op, dict(MAKE[op](), **bad))                    # the eager message
    traced(mode, op, MAKE[op](), {})                            # a valid call traces (and warms the caches)
    refused_traced(mode, op, dict(MAKE[op](), **bad), {}, message)
