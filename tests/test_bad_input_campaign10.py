"""Bad-input campaign 10 (CPU backend): each case failed before its fix, or was silently served.

- Python ints too large for a float (scale, lower_bound, norm_eps) raised OverflowError without the
  argument's name; a checkpoint_every past int64 failed in the FFI conversion ("argument #19").
- torch.ops.flashkda_ext.* took out=None (the schema's Tensor lets None through): the step ran, the pool
  was updated and the output dropped; and a bool scale / norm_eps became 1.0 through the `float` schema.
Every refusal is checked cold and after a valid call (the fast path and the verdict memo armed), and
leaves every tensor as it was.
"""
from __future__ import annotations

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext import ops

from bad_input_cases import (FUSED_POS, FUSED_VERIFY_POS, H, HV, K, R, V, decode_args, fused_args,
                             fused_verify_args, rand, verify_args)

OPS = torch.ops.flashkda_ext


def prefill_args():
    return dict(q=rand(2, 4, H, K), k=rand(2, 4, H, K), v=rand(2, 4, HV, V), g=rand(2, 4, HV, K), beta=rand(2, 4, HV),
                A_log=rand(HV), dt_bias=rand(HV * K), initial_state=rand(2, HV, V, K))




def public(op, a, kw):
    a = dict(a, **kw)
    if op == "fused_kda_decode":
        return fk.fused_kda_decode(*[a.pop(n) for n in FUSED_POS], **a)
    if op == "fused_kda_verify":
        return fk.fused_kda_verify(*[a.pop(n) for n in FUSED_VERIFY_POS], **a)
    return getattr(fk, op)(*[a.pop(n) for n in ("q", "k", "v", "g", "beta")], **a)


MAKE = {"kda_decode": decode_args, "kda_verify": verify_args, "kda_prefill": prefill_args,
        "fused_kda_decode": fused_args, "fused_kda_verify": fused_verify_args}


def refused_cold_and_warm(call, valid, exc, match):
    """call() raises exc matching `match` before and after valid() armed the fast path, the same each time,
    and writes nothing (tensors compared bitwise)."""
    ops.clear_call_caches()
    errors = []
    for warm in (False, True):
        if warm:
            valid()
        tensors = call.tensors()
        before = [t.clone() for t in tensors]
        with pytest.raises(exc, match=match) as e:
            call()
        errors.append(str(e.value))
        assert all(torch.equal(t, b) for t, b in zip(tensors, before)), "a refused call wrote"
    assert errors[0] == errors[1]


class Call:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def tensors(self):
        return [x for x in self.args.values() if isinstance(x, torch.Tensor)]

    def __call__(self):
        return self.fn(self.args)


# --- Python ints past the float range, and checkpoint_every past int64 -----------------------------------

HUGE = 10 ** 400

SCALAR_CASES = [("kda_decode", dict(scale=HUGE), "scale"),
                ("kda_decode", dict(gate="bounded", lower_bound=-HUGE), "lower_bound"),
                ("kda_verify", dict(scale=HUGE), "scale"),
                ("kda_prefill", dict(scale=HUGE), "scale"),
                ("fused_kda_decode", dict(norm_eps=HUGE), "norm_eps"),
                ("fused_kda_verify", dict(norm_eps=HUGE), "norm_eps"),
                ("fused_kda_verify", dict(gate="bounded", lower_bound=-HUGE), "lower_bound")]


@pytest.mark.parametrize("op,kw,name", SCALAR_CASES, ids=[f"{o}-{n}" for o, _, n in SCALAR_CASES])
def test_an_int_too_large_for_a_float_is_named(op, kw, name):
    a = MAKE[op]()
    refused_cold_and_warm(Call(lambda x: public(op, x, kw), a), lambda: public(op, MAKE[op](), {}), ValueError,
                          rf"^{name}: expected a finite float .* \(too large for a float\)")


def test_checkpoint_every_past_int64_is_named():
    a = prefill_args()
    kw = dict(checkpoint_every=2 ** 63)
    refused_cold_and_warm(Call(lambda x: public("kda_prefill", x, kw), a),
                          lambda: public("kda_prefill", prefill_args(), dict(checkpoint_every=2)), ValueError,
                          r"^checkpoint_every: expected an int <= 9223372036854775807")
    # the largest int64 is a valid (if checkpoint-free) request
    out, final, ckpt = public("kda_prefill", prefill_args(), dict(checkpoint_every=2 ** 63 - 1))
    assert ckpt.shape[1] == 0


# --- torch.ops.flashkda_ext.*: out=None, and a bool where a real scalar goes ------------------------------

def op_args(op):
    """The custom op's arguments by name, in schema order, with every output given."""
    a = MAKE[op]()
    if op == "kda_decode":
        d = dict(q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"], state=a["state"],
                 state_indices=a["state_indices"], A_log=a["A_log"], dt_bias=a["dt_bias"], lower_bound=None,
                 gate="softplus", scale=None, beta_is_logit=True, slot_mode="unique", null_slot0=False,
                 out=torch.zeros(R, HV, V))
    elif op == "kda_verify":
        d = dict(q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"], state=a["state"],
                 state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"], num_accepted_tokens=None,
                 max_seqlen=None, A_log=a["A_log"], dt_bias=a["dt_bias"], lower_bound=None, gate="softplus",
                 scale=None, beta_is_logit=True, null_slot0=False, out=torch.zeros(1, 5, HV, V))
    elif op == "kda_prefill":
        d = dict(q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"], A_log=a["A_log"], dt_bias=a["dt_bias"],
                 lower_bound=None, gate="softplus", scale=None, beta_is_logit=True, cu_seqlens=None,
                 initial_state=a["initial_state"], state=None, state_indices=None, output_final_state=True,
                 final_state=torch.zeros(2, HV, V, K), checkpoint_every=0, checkpoints=None, max_seqlen=None,
                 null_slot0=False, workspace=None, out=torch.zeros(2, 4, HV, V))
    elif op == "fused_kda_decode":
        d = {n: a[n] for n in FUSED_POS}
        d.update(lower_bound=None, gate="softplus", norm_eps=1e-5, scale=None, slot_mode="unique", null_slot0=False,
                 out=torch.zeros(R, 3, 8))
    else:
        d = {n: a[n] for n in FUSED_VERIFY_POS}
        d.update(state_indices=a["state_indices"], cu_seqlens=a["cu_seqlens"], num_accepted_tokens=None,
                 max_seqlen=None, lower_bound=None, gate="softplus", norm_eps=1e-5, scale=None, null_slot0=False,
                 out=torch.zeros(1, 5, 3, 8))
    return d


def run_op(op, d):
    getattr(OPS, op).default(**d)


ALL_OPS = ("kda_decode", "kda_verify", "kda_prefill", "fused_kda_decode", "fused_kda_verify")


@pytest.mark.parametrize("op", ALL_OPS)
def test_custom_op_without_out_is_refused_and_writes_nothing(op):
    """Before: the op ran, updated the pool (and conv cache) in place and dropped the output it computed."""
    d = op_args(op)
    d["out"] = None
    refused_cold_and_warm(Call(lambda x: run_op(op, x), d), lambda: run_op(op, op_args(op)), ValueError,
                          rf"^out: flashkda_ext::{op} writes its outputs into its arguments")


BOOL_SCALARS = [(op, "scale") for op in ALL_OPS] + [("fused_kda_decode", "norm_eps"),
                                                    ("fused_kda_verify", "norm_eps"),
                                                    ("kda_decode", "lower_bound")]


@pytest.mark.parametrize("op,name", BOOL_SCALARS, ids=[f"{o}-{n}" for o, n in BOOL_SCALARS])
def test_custom_op_refuses_a_bool_real_scalar_as_the_public_op_does(op, name):
    """Before: the `float` schema turned scale=True / norm_eps=True into 1.0 and the call was served."""
    d = op_args(op)
    d[name] = True
    if name == "lower_bound":
        d["gate"] = "bounded"
    refused_cold_and_warm(Call(lambda x: run_op(op, x), d), lambda: run_op(op, op_args(op)), TypeError,
                          rf"^{name}: expected a float")
    with pytest.raises(TypeError, match=rf"^{name}: expected a float"):
        public(op, MAKE[op](), {name: True, **(dict(gate="bounded") if name == "lower_bound" else {})})


@pytest.mark.parametrize("op", ALL_OPS)
def test_custom_op_takes_an_int_or_float_scale_as_before(op):
    d, e = op_args(op), op_args(op)
    d["scale"], e["scale"] = 1, 1.0
    e = dict(e, **{n: x.clone() for n, x in d.items() if isinstance(x, torch.Tensor)})
    run_op(op, d)
    run_op(op, e)
    assert torch.equal(d["out"], e["out"]) and d["out"].abs().sum() > 0


# --- a prefill workspace of the wrong kind, on the CPU backend (which needs none) --------------------------

@pytest.mark.parametrize("workspace", [torch.zeros(64, dtype=torch.float32), torch.zeros(64, dtype=torch.int8)],
                         ids=["float32", "int8"])
def test_prefill_workspace_of_the_wrong_dtype_is_refused_on_cpu_too(workspace):
    """The CPU backend takes no workspace, and used to ignore whatever was passed; a GPU call refuses it."""
    a = prefill_args()
    a["out"] = torch.full_like(a["v"], 7.0)
    ok = dict(prefill_args(), out=torch.empty_like(a["v"]), workspace=torch.zeros(64, dtype=torch.uint8))
    refused_cold_and_warm(Call(lambda x: public("kda_prefill", x, dict(workspace=workspace)), a),
                          lambda: public("kda_prefill", ok, {}), ValueError, "workspace: expected a uint8 tensor")
