"""The CPU bindings' contracts, called straight through TVM-FFI (no Python validation in front):
each wrong call raises a ValueError naming the argument, the expected and the received value, and
writes nothing; the compiled contract (fkda_contract) agrees with the module record and
jit/supported.json; every dtype the supported set lists is accepted. Also times a small call."""
import json
import math
import random
import time

import pytest
import torch

from flashkda_ext import jit, supported
from flashkda_ext.jit import macros

FAMILIES = ("kda_decode", "kda_prefill", "fused_kda_decode")
DT = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
      "float16": torch.float16}


@pytest.fixture(scope="module")
def mods():
    return {fam: jit.load_module(f"cpu_{fam}") for fam in FAMILIES}


def _gen():
    return torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))


def decode_args(in_dtype=torch.float32, state_dtype=torch.float32, rows=3, H=2, HV=4, K=6, V=5, slots=4):
    gen = _gen()
    r = lambda *s, dt=in_dtype: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    return dict(q=r(rows, H, K), k=r(rows, H, K), v=r(rows, HV, V), g=r(rows, HV, K), beta=r(rows, HV),
                A_log=r(HV, dt=torch.float32), dt_bias=r(HV * K, dt=torch.float32),
                state=r(slots, HV, V, K, dt=state_dtype), state_indices=torch.tensor([1, -1, 3][:rows], dtype=torch.int32),
                out=torch.full((rows, HV, V), math.nan, dtype=in_dtype), gate_mode=0, lower_bound=-5.0,
                scale=K ** -0.5, beta_is_logit=True, null_slot0=False)


def prefill_args(in_dtype=torch.float32, state_dtype=torch.float32, lens=(3, 0, 5), H=1, HV=2, K=4, V=3,
                 every=2, C=2):
    gen = _gen()
    T, N = sum(lens), len(lens)
    r = lambda *s, dt=in_dtype: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(N)], dtype=torch.int32)
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
                A_log=r(HV, dt=torch.float32), dt_bias=r(HV * K, dt=torch.float32), cu_seqlens=cu,
                initial_state=r(N, HV, V, K, dt=state_dtype),
                final_state=torch.full((N, HV, V, K), math.nan, dtype=state_dtype), state_indices=None,
                checkpoints=torch.full((N, C, HV, V, K), math.nan, dtype=state_dtype),
                out=torch.full((1, T, HV, V), math.nan, dtype=in_dtype), workspace=None, gate_mode=0,
                lower_bound=-5.0, scale=K ** -0.5, beta_is_logit=True, null_slot0=False,
                checkpoint_every=every)


def fused_args(in_dtype=torch.float32, state_dtype=torch.float32, rows=3, H=2, D=4, slots=4):
    gen = _gen()
    r = lambda *s, dt=in_dtype: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    C = 3 * H * D
    return dict(x=r(rows, C), conv_weight=r(C, 4), conv_state=r(slots, C, 3), g=r(rows, H, D), beta=r(rows, H),
                A_log=r(H, dt=torch.float32), dt_bias=r(H * D, dt=torch.float32),
                state_indices=torch.tensor([2, 0, -1][:rows], dtype=torch.int32),
                state=r(slots, H, D, D, dt=state_dtype), output_gate=r(rows, H, D),
                norm_weight=r(D, dt=torch.float32), out=torch.full((rows, H, D), math.nan, dtype=in_dtype),
                gate_mode=0, lower_bound=-5.0, scale=D ** -0.5, norm_eps=1e-5, null_slot0=False)


MAKE = {"kda_decode": decode_args, "kda_prefill": prefill_args, "fused_kda_decode": fused_args}
# What a call may write: poisoned outputs stay NaN and in-place state stays as it was on an error.
WRITTEN = {"kda_decode": ("state", "out"), "kda_prefill": ("initial_state", "final_state", "checkpoints", "out"),
           "fused_kda_decode": ("conv_state", "state", "out")}


def call(mods, fam, args):
    mods[fam][fam](*args.values())


# ---------------------------------------------------------------------------------------------
# wrong calls: (family, what to change, substrings the message must hold)


def _set(**kw):
    return lambda a: a.update(kw)


def _dtype(name, dt):
    return lambda a: a.update({name: a[name].to(dt)})


def _noncontig(name):
    return lambda a: a.update({name: a[name].transpose(-1, -2).contiguous().transpose(-1, -2)})


WRONG = [
    ("kda_decode", _dtype("v", torch.float64), ["'v'", "float32", "float64"]),
    ("kda_decode", _dtype("q", torch.int32), ["'q'", "int32"]),
    ("kda_decode", lambda a: a.update(k=a["k"][..., :5].contiguous()), ["'k'", "K=6", "[3, 2, 5]"]),
    ("kda_decode", lambda a: a.update(state=a["state"][:, :, :4].contiguous()), ["'state'", "V=5"]),
    ("kda_decode", _set(state_indices=torch.tensor([1, -1, 4], dtype=torch.int32)),
     ["'state_indices'", "= 4", "4 slots"]),
    ("kda_decode", _dtype("state_indices", torch.int64), ["'state_indices'", "int32", "int64"]),
    ("kda_decode", _dtype("state", torch.float16), ["'state'", "float16"]),
    ("kda_decode", _dtype("out", torch.bfloat16), ["'out'", "bfloat16"]),
    ("kda_decode", _noncontig("q"), ["'q'", "contiguous", "strides"]),
    ("kda_decode", _set(gate_mode=1, lower_bound=0.5), ["'lower_bound'", "< 0", "0.5"]),
    ("kda_decode", _set(gate_mode=1, lower_bound=math.nan), ["'lower_bound'", "nan"]),
    ("kda_decode", _set(gate_mode=3), ["'gate_mode'", "got 3"]),
    ("kda_decode", _set(scale=0.0), ["'scale'", "> 0", "got 0"]),
    ("kda_decode", _set(scale=math.inf), ["'scale'", "inf"]),
    ("kda_decode", _set(A_log=None), ["'A_log'", "softplus"]),
    ("kda_decode", _set(gate_mode=2), ["'A_log'", "log gate"]),
    ("kda_decode", _dtype("A_log", torch.float64), ["'A_log'", "float32", "float64"]),
    ("kda_decode", lambda a: a.update(dt_bias=a["dt_bias"][:-1].contiguous()), ["'dt_bias'", "HV*K=24", "[23]"]),
    ("kda_decode", lambda a: a.update(v=torch.randn(3, 3, 5), g=torch.randn(3, 3, 6)), ["HV", "H=2", "HV=3"]),
    ("kda_prefill", _set(checkpoints=torch.full((3, 1, 2, 3, 4), math.nan)),
     ["'checkpoints'", "C=1", "sequence 2", "needs 2"]),
    ("kda_prefill", _set(checkpoint_every=0), ["'checkpoints'", "checkpoint_every=0"]),
    ("kda_prefill", _set(checkpoints=None), ["'checkpoints'", "None"]),
    ("kda_prefill", _set(checkpoint_every=-2), ["'checkpoint_every'", ">= 0", "-2"]),
    ("kda_prefill", _set(cu_seqlens=torch.tensor([0, 3, 3, 7], dtype=torch.int32)),
     ["'cu_seqlens'", "T = 8", "= 7"]),
    ("kda_prefill", _set(cu_seqlens=torch.tensor([0, 4, 3, 8], dtype=torch.int32)),
     ["'cu_seqlens'", "non-decreasing", "4 > "]),
    ("kda_prefill", _dtype("cu_seqlens", torch.float32), ["'cu_seqlens'", "int32", "int64", "float32"]),
    ("kda_prefill", _set(final_state=torch.full((2, 2, 3, 4), math.nan)), ["'final_state'", "N=3", "[2, 2, 3, 4]"]),
    ("kda_prefill", _dtype("final_state", torch.float64), ["'final_state'", "float64", "initial_state"]),
    ("kda_prefill", _set(state_indices=torch.tensor([1, 0, 1], dtype=torch.int32)),
     ["'state_indices'", "slot 1", "more than one"]),
    ("kda_prefill", _set(state_indices=torch.tensor([1, 0, 3], dtype=torch.int32)),
     ["'state_indices'", "= 3", "3 slots"]),
    ("kda_prefill", _set(null_slot0=True), ["'null_slot0'"]),
    # B > 1 rows are read as the packed row of B * T tokens: the offsets must then cover all of them
    ("kda_prefill", lambda a: a.update({n: torch.cat([a[n], a[n]]) for n in ("q", "k", "v", "g", "beta", "out")}),
     ["'cu_seqlens'", "T = 16", "= 8"]),
    ("kda_prefill", lambda a: a.update({n: torch.cat([a[n], a[n]]) for n in ("q", "v", "g", "beta", "out")},
                                       k=torch.cat([a["k"], a["k"]]).reshape(4, 4, *a["k"].shape[2:])),
     ["'k'", "B=2", "[4, 4, 1, 4]"]),
    ("kda_prefill", _set(gate_mode=1, lower_bound=0.0), ["'lower_bound'", "got 0"]),
    ("fused_kda_decode", _set(norm_eps=0.0), ["'norm_eps'", "> 0"]),
    ("fused_kda_decode", lambda a: a.update(conv_state=a["conv_state"][:3].contiguous()),
     ["'conv_state'", "slots=4", "width-1=3", "[3, 24, 3]"]),
    ("fused_kda_decode", _dtype("norm_weight", torch.bfloat16), ["'norm_weight'", "float32", "bfloat16"]),
    ("fused_kda_decode", _dtype("conv_weight", torch.float64), ["'conv_weight'", "float32", "float64"]),
    ("fused_kda_decode", lambda a: a.update(x=a["x"][:, :-3].contiguous()), ["'x'", "3*H*D=24", "[3, 21]"]),
    ("fused_kda_decode", _set(state_indices=torch.tensor([2, 0, 9], dtype=torch.int32)),
     ["'state_indices'", "= 9"]),
    ("fused_kda_decode", _set(gate_mode=-1), ["'gate_mode'", "-1"]),
]


@pytest.mark.parametrize("fam,change,expect", WRONG, ids=[f"{f}-{'|'.join(e)}" for f, _, e in WRONG])
def test_wrong_call_is_stopped_by_the_binding(mods, fam, change, expect):
    args = MAKE[fam]()
    change(args)
    before = {n: args[n].clone() for n in WRITTEN[fam] if args[n] is not None}
    with pytest.raises(ValueError) as info:
        call(mods, fam, args)
    msg = str(info.value)
    assert f"cpu_{fam}::{fam}" in msg, msg
    for part in expect:
        assert part in msg, f"expected {part!r} in the message: {msg}"
    for n, t in before.items():  # nothing written before the checks passed
        assert torch.equal(torch.isnan(args[n]), torch.isnan(t)), f"{n} written by a rejected call"
        assert torch.equal(torch.nan_to_num(args[n]), torch.nan_to_num(t)), f"{n} written by a rejected call"


def test_valid_base_calls_pass(mods):
    # The wrong calls above differ from these by one change each; these must succeed.
    for fam in FAMILIES:
        args = MAKE[fam]()
        call(mods, fam, args)
        assert not torch.isnan(args["out"]).any(), fam


# ---------------------------------------------------------------------------------------------
# the compiled contract vs the record and jit/supported.json


@pytest.mark.parametrize("fam", FAMILIES)
def test_contract_matches_record_and_supported_set(mods, fam):
    name = f"cpu_{fam}"
    got = json.loads(mods[fam]["fkda_contract"]())
    assert got == macros.contract_values(jit.get_record(name))
    sup = supported.supported(fam, "cpu")
    assert got["FKDA_MODULE_NAME"] == name and got["FKDA_FAMILY"] == fam
    assert got["FKDA_HEAD_DIM_K"] == (0 if sup["head_dims_k"] is None else sup["head_dims_k"][0])
    assert got["FKDA_SUPPORTED_VALUE_HEADS"] == (sup["value_heads"] or [])
    assert got["FKDA_SUPPORTED_GROUP_SIZES"] == (sup["group_sizes"] or [])
    assert got["FKDA_STATE_BF16"] == -1  # any of supported state_dtypes, checked below


@pytest.mark.parametrize("fam", FAMILIES)
def test_every_supported_dtype_is_accepted(mods, fam):
    sup = supported.supported(fam, "cpu")
    for in_name in sup["input_dtypes"]:
        for st_name in sup["state_dtypes"]:
            args = MAKE[fam](in_dtype=DT[in_name], state_dtype=DT[st_name])
            call(mods, fam, args)
            assert not torch.isnan(args["out"]).any(), (fam, in_name, st_name)


def test_group_size_rule_of_fused_decode(mods):
    # fused_kda_decode/cpu supports group size 1 only: its g defines H and the state must match it
    args = fused_args()
    args["state"] = torch.randn(4, 4, 4, 4)
    with pytest.raises(ValueError, match="'state'.*H=2"):
        call(mods, "fused_kda_decode", args)


# ---------------------------------------------------------------------------------------------
# timing


def test_small_decode_call_time(mods, capsys):
    """Per-call time of a small decode (1 row, 1 head, K = V = 16, fp32) through TVM-FFI."""
    args = decode_args(rows=1, H=1, HV=1, K=16, V=16, slots=2)
    args["state_indices"] = torch.tensor([1], dtype=torch.int32)
    fn, vals = mods["kda_decode"]["kda_decode"], list(args.values())
    for _ in range(200):
        fn(*vals)
    samples = []
    for _ in range(5):
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*vals)
        samples.append((time.perf_counter() - t0) / n)
    per_call_us = sorted(samples)[len(samples) // 2] * 1e6
    with capsys.disabled():
        print(f"\n[cpu backend] small kda_decode call through TVM-FFI: {per_call_us:.2f} us (median of 5 x 2000)")
    assert per_call_us < 1000.0
