"""The CPU bindings' contracts, called straight through TVM-FFI (no Python validation in front):
each wrong call raises a ValueError naming the argument, the expected and the received value, and
writes nothing; the compiled contract (fkda_contract) agrees with the module record and
jit/supported.json; every dtype the supported set lists is accepted. Also times a small call.
The modules are every CPU module of the JIT registry: a family without cases here fails a test."""
import json
import math
import random
import time

import pytest
import torch

from flashkda_ext import jit, supported
from flashkda_ext.jit import macros, specs

# Every CPU module of the registry (jit/modules/*.json), helpers (no kernel) aside: a new family or
# module is tested here or fails test_every_registry_cpu_family_is_covered.
MODULES = tuple((r["name"], r["family"]) for r in jit.all_records()
                if r["backend"] == "cpu" and r["family"] not in specs.HELPER_FAMILIES)
FAMILIES = tuple(dict.fromkeys(fam for _, fam in MODULES))
DT = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
      "float16": torch.float16}


@pytest.fixture(scope="module")
def mods():
    return {name: jit.load_module(name) for name, _ in MODULES}


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


# The verify calls: 4 requests of T_max = 3 (lens 2, 0, 3, 1: an empty one), each reading the slot
# at its accepted column; request 3 reads a padding entry (zero outputs, nothing stored).
LENS, COLS = (2, 0, 3, 1), 3
TABLE = [[1, 2, -1], [3, 4, 5], [7, 8, 9], [-1, 6, 0]]
ACCEPTED = [1, 2, 2, 1]


def _cu(lens):
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)


def verify_args(in_dtype=torch.float32, state_dtype=torch.float32, H=2, HV=4, K=6, V=5, slots=10):
    gen = _gen()
    T = sum(LENS)
    r = lambda *s, dt=in_dtype: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
                A_log=r(HV, dt=torch.float32), dt_bias=r(HV * K, dt=torch.float32),
                state=r(slots, HV, V, K, dt=state_dtype), state_indices=torch.tensor(TABLE, dtype=torch.int32),
                cu_seqlens=_cu(LENS), num_accepted_tokens=torch.tensor(ACCEPTED, dtype=torch.int32),
                initial_state=None, initial_state_indices=None, parent_tokens=None,
                out=torch.full((1, T, HV, V), math.nan, dtype=in_dtype), gate_mode=0, lower_bound=-5.0,
                scale=K ** -0.5, beta_is_logit=True, null_slot0=False)


def fused_verify_args(in_dtype=torch.float32, state_dtype=torch.float32, H=2, D=4, slots=10):
    gen = _gen()
    T, C = sum(LENS), 3 * H * D
    r = lambda *s, dt=in_dtype: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    return dict(x=r(1, T, C), conv_weight=r(C, 4), conv_state=r(slots, C, COLS + 2), g=r(1, T, H, D),
                beta=r(1, T, H), A_log=r(H, dt=torch.float32), dt_bias=r(H * D, dt=torch.float32),
                state=r(slots, H, D, D, dt=state_dtype), output_gate=r(1, T, H, D),
                norm_weight=r(D, dt=torch.float32), state_indices=torch.tensor(TABLE, dtype=torch.int32),
                cu_seqlens=_cu(LENS), num_accepted_tokens=torch.tensor(ACCEPTED, dtype=torch.int32),
                out=torch.full((1, T, H, D), math.nan, dtype=in_dtype), gate_mode=0, lower_bound=-5.0,
                scale=D ** -0.5, norm_eps=1e-5, null_slot0=False)


MAKE = {"kda_decode": decode_args, "kda_prefill": prefill_args, "fused_kda_decode": fused_args,
        "kda_verify": verify_args, "fused_kda_verify": fused_verify_args}
# What a call may write: poisoned outputs stay NaN and in-place state stays as it was on an error.
WRITTEN = {"kda_decode": ("state", "out"), "kda_prefill": ("initial_state", "final_state", "checkpoints", "out"),
           "fused_kda_decode": ("conv_state", "state", "out"), "kda_verify": ("state", "out"),
           "fused_kda_verify": ("conv_state", "state", "out")}


def make(fam, **kw):
    assert fam in MAKE, f"no argument builder for the registry's CPU family {fam!r}: add one to MAKE"
    return MAKE[fam](**kw)


def call(mods, name, fam, args):
    mods[name][fam](*args.values())


# ---------------------------------------------------------------------------------------------
# wrong calls: (family, what to change, substrings the message must hold)


def _set(**kw):
    return lambda a: a.update(kw)


def _dtype(name, dt):
    return lambda a: a.update({name: a[name].to(dt)})


def _noncontig(name):
    return lambda a: a.update({name: a[name].transpose(-1, -2).contiguous().transpose(-1, -2)})


def _then(*changes):
    return lambda a: [c(a) for c in changes]


def _overlap_rows(name):
    # kda_verify's [1, T, n, d] inputs with their tokens closer than one token apart (each still dense)
    def change(a):
        x = a[name]
        a[name] = x.as_strided(x.shape, (x.stride(0), math.prod(x.shape[2:]) - 1, *x.stride()[2:]))
    return change


def _apart(x, dim, pad):
    # x with its entries along dim `pad` elements more than one entry apart (a view of a wider buffer:
    # an engine's packed projection for tokens, a paged pool for slots)
    inner = math.prod(x.shape[dim + 1:])
    wide = torch.randn(*x.shape[:dim + 1], inner + pad).to(x.dtype)
    wide[..., :inner] = x.flatten(dim + 1)
    return wide[..., :inner].unflatten(-1, x.shape[dim + 1:])


def _rows_apart(name):
    return lambda a: a.update({name: _apart(a[name], 1, 7)})


def _with_init(a):
    # kda_verify's second start pool (read only): request n starts from initial_state[initial_state_indices[n]]
    a.update(num_accepted_tokens=None, initial_state=torch.randn(3, *a["state"].shape[-3:]).to(a["state"].dtype),
             initial_state_indices=torch.tensor([0, 2, 1, -1], dtype=torch.int32))


def _init_is_state(a):
    # initial_state the pool itself (the same view): each request reads a slot only it writes
    a.update(num_accepted_tokens=None, initial_state=a["state"],
             initial_state_indices=torch.tensor([1, 3, 8, -1], dtype=torch.int32))


def _init_over_out(a):
    # a second start pool whose first slots are out's memory: out is written while they are read
    _with_init(a)
    buf = a["initial_state"].flatten().clone()
    a.update(initial_state=buf.view(a["initial_state"].shape), out=buf[:a["out"].numel()].view(a["out"].shape))


def _step_rows(a, R=5):
    # kda_verify's step rows: state [R, T_max, HV, V, K], one row a request (-1: padding)
    a.update(state=torch.randn(R, COLS, *a["state"].shape[-3:]).to(a["state"].dtype),
             state_indices=torch.tensor([1, 3, 0, -1], dtype=torch.int32))


def _table(n, row):
    # TABLE with row n replaced
    return torch.tensor([row if i == n else r for i, r in enumerate(TABLE)], dtype=torch.int32)


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
    ("kda_decode", lambda a: a.update(v=torch.randn(3, 3, 5), g=torch.randn(3, 3, 6)), ["'v' has HV = 3", "H = 2 of 'q'"]),
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
    # kda_verify: dtypes, shapes, index dtypes
    ("kda_verify", _dtype("v", torch.float64), ["'v'", "'q'", "float32", "float64"]),
    ("kda_verify", _dtype("q", torch.int32), ["'q'", "int32"]),
    ("kda_verify", _dtype("g", torch.float16), ["'g' must have dtype float32, got float16"]),
    ("kda_verify", _dtype("state", torch.float16), ["'state'", "float16"]),
    ("kda_verify", _dtype("out", torch.bfloat16), ["'out'", "float32", "bfloat16"]),
    ("kda_verify", lambda a: a.update(k=a["k"][..., :5].contiguous()), ["'k'", "K=6", "[1, 6, 2, 5]"]),
    ("kda_verify", lambda a: a.update(state=a["state"][:, :, :4].contiguous()), ["'state'", "V=5", "[10, 4, 4, 6]"]),
    ("kda_verify", lambda a: a.update(out=a["out"][:, :5].contiguous()), ["'out'", "T=6", "[1, 5, 4, 5]"]),
    ("kda_verify", _set(v=torch.randn(1, 6, 3, 5)), ["'v' has HV = 3", "H = 2 of 'q'"]),
    ("kda_verify", _dtype("state_indices", torch.int64), ["'state_indices'", "int32", "int64"]),
    ("kda_verify", _dtype("cu_seqlens", torch.int64), ["'cu_seqlens'", "int32", "int64"]),
    ("kda_verify", _dtype("num_accepted_tokens", torch.int64), ["'num_accepted_tokens'", "int32", "int64"]),
    # the row-stride rule (csrc/common/row_stride.h): tokens apart are read, overlapping tokens refused
    ("kda_verify", _overlap_rows("beta"), ["'beta'", "inner dims contiguous", ">= 4", "[24, 3, 1]"]),
    ("kda_verify", _overlap_rows("q"), ["'q'", "inner dims contiguous", ">= 12", "[72, 11, 6, 1]"]),
    ("kda_verify", _then(_rows_apart("v"), _overlap_rows("v")), ["'v'", ">= 20", "[162, 19, 5, 1]"]),
    ("kda_verify", _noncontig("k"), ["'k'", "inner dims contiguous", "[72, 12, 1, 2]"]),
    ("kda_verify", _noncontig("out"), ["'out'", "contiguous", "[120, 20, 1, 4]"]),
    # gate arguments, scale
    ("kda_verify", _set(gate_mode=3), ["'gate_mode'", "got 3"]),
    ("kda_verify", _set(gate_mode=1, lower_bound=0.0), ["'lower_bound'", "< 0", "got 0"]),
    ("kda_verify", _set(A_log=None), ["'A_log'", "softplus", "got None"]),
    ("kda_verify", _set(gate_mode=2), ["'A_log'", "log gate", "got a tensor"]),
    ("kda_verify", lambda a: a.update(dt_bias=a["dt_bias"][:-1].contiguous()), ["'dt_bias'", "HV*K=24", "[23]"]),
    ("kda_verify", _set(scale=-1.0), ["'scale'", "> 0", "got -1"]),
    ("kda_verify", _set(scale=math.nan), ["'scale'", "nan"]),
    # initial_state / initial_state_indices
    ("kda_verify", _then(_with_init, _set(initial_state_indices=None)),
     ["'initial_state_indices' is missing", "together"]),
    ("kda_verify", _then(_with_init, _set(initial_state=None)), ["'initial_state' is missing", "together"]),
    ("kda_verify", _then(_with_init, _set(num_accepted_tokens=torch.ones(4, dtype=torch.int32))),
     ["'num_accepted_tokens'", "absent with initial_state"]),
    ("kda_verify", _then(_with_init, _set(initial_state_indices=torch.tensor([0, 3, 1, -1], dtype=torch.int32))),
     ["'initial_state_indices'", "entry 1 = 3", "3 slots"]),
    ("kda_verify", _then(_with_init, _set(initial_state_indices=torch.tensor([0, 2, 1], dtype=torch.int32))),
     ["'initial_state_indices'", "N=4", "[3]"]),
    ("kda_verify", _then(_with_init, _dtype("initial_state_indices", torch.int64)),
     ["'initial_state_indices'", "int32", "int64"]),
    ("kda_verify", _then(_with_init, _dtype("initial_state", torch.float64)),
     ["'initial_state'", "'state'", "float32", "float64"]),
    ("kda_verify", _then(_with_init, lambda a: a.update(initial_state=a["initial_state"][..., :5].contiguous())),
     ["'initial_state'", "K=6", "[3, 4, 5, 5]"]),
    ("kda_verify", _then(_with_init, lambda a: a.update(initial_state=a["state"][1:])),
     ["'initial_state' overlaps 'state'", "same view"]),
    ("kda_verify", _init_over_out, ["'initial_state' overlaps 'out'"]),
    ("kda_verify", _then(_init_is_state, _set(initial_state_indices=torch.tensor([1, 3, 2, -1], dtype=torch.int32))),
     ["'initial_state_indices'", "request 2 reads slot 2", "request 0 writes"]),
    # cu_seqlens, num_accepted_tokens, the slot table
    ("kda_verify", _set(cu_seqlens=_cu((2, 0, 4))), ["'cu_seqlens'", "N+1=5", "[4]"]),
    ("kda_verify", _set(cu_seqlens=_cu((2, 0, 3, 0))), ["'cu_seqlens'", "T = 6", "= 5"]),
    ("kda_verify", _set(cu_seqlens=_cu((4, 0, 1, 1))), ["'cu_seqlens'", "request 0 has 4 tokens", "T_max = 3"]),
    ("kda_verify", _set(state_indices=torch.empty(0, 3, dtype=torch.int32)),
     ["'state_indices'", "N, T_max >= 1", "got [0, 3]"]),
    ("kda_verify", _set(cu_seqlens=torch.tensor([0, 3, 2, 5, 6], dtype=torch.int32)),
     ["'cu_seqlens'", "non-decreasing", "3 > "]),
    ("kda_verify", _set(num_accepted_tokens=torch.tensor([1, 2, 4, 1], dtype=torch.int32)),
     ["'num_accepted_tokens'", "entry 2 = 4", "T_max = 3"]),
    ("kda_verify", _set(num_accepted_tokens=torch.tensor([1, 2, 2], dtype=torch.int32)),
     ["'num_accepted_tokens'", "N=4", "[3]"]),
    ("kda_verify", _set(state_indices=_table(2, [7, 8, 10])), ["'state_indices'", "= 10", "10 slots"]),
    ("kda_verify", _set(state_indices=_table(2, [7, 1, 9])), ["'state_indices'", "slot 1 is written twice"]),
    ("kda_verify", _set(state_indices=_table(0, [1, 2, 8]), num_accepted_tokens=torch.tensor([3, 2, 2, 1],
                                                                                          dtype=torch.int32)),
     ["'state_indices'", "request 0 reads slot 8", "request 2 writes"]),
    # pools whose slots sit apart: dims 1-3 dense and a slot stride that is a multiple of 16 bytes
    ("kda_verify", lambda a: a.update(state=_apart(a["state"], 0, 1)),
     ["'state'", "multiple of 16 bytes", "[121, 30, 6, 1]"]),
    ("kda_verify", _then(_with_init, lambda a: a.update(initial_state=_apart(a["initial_state"], 0, 1))),
     ["'initial_state'", "multiple of 16 bytes", "[121, 30, 6, 1]"]),
    # step rows
    ("kda_verify", _then(_step_rows, _set(state_indices=torch.tensor(TABLE, dtype=torch.int32))),
     ["'state_indices'", "1 dims", "[4, 3]"]),
    ("kda_verify", _then(_step_rows, _set(state_indices=torch.tensor([1, 5, 0, -1], dtype=torch.int32))),
     ["'state_indices'", "entry 1 = 5", "5 rows"]),
    ("kda_verify", _then(_step_rows, lambda a: a.update(state=torch.randn(5, 4, 4, 5, 6)[:, :3])),
     ["'state'", "T_max steps apart", "[480, 120, 30, 6, 1]"]),
    # fused_kda_verify: dtypes, shapes, contiguity, index dtypes
    ("fused_kda_verify", _dtype("x", torch.int32), ["'x'", "int32"]),
    ("fused_kda_verify", _dtype("g", torch.float64), ["'g'", "'x'", "float32", "float64"]),
    ("fused_kda_verify", _dtype("output_gate", torch.bfloat16), ["'output_gate'", "float32", "bfloat16"]),
    ("fused_kda_verify", _dtype("conv_state", torch.float16), ["'conv_state'", "float32", "float16"]),
    ("fused_kda_verify", _dtype("conv_weight", torch.float64), ["'conv_weight'", "float32", "float64"]),
    ("fused_kda_verify", _dtype("norm_weight", torch.bfloat16), ["'norm_weight'", "float32", "bfloat16"]),
    ("fused_kda_verify", _dtype("state", torch.float16), ["'state'", "float16"]),
    ("fused_kda_verify", lambda a: a.update(x=a["x"][..., :-3].contiguous()), ["'x'", "3*H*D=24", "[1, 6, 21]"]),
    ("fused_kda_verify", lambda a: a.update(conv_state=a["conv_state"][..., :4].contiguous()),
     ["'conv_state'", "L >= T_max + 2 = 5", "L = 4"]),
    ("fused_kda_verify", lambda a: a.update(conv_state=a["conv_state"][:9].contiguous()),
     ["'conv_state'", "slots=10", "[9, 24, 5]"]),
    ("fused_kda_verify", lambda a: a.update(conv_weight=a["conv_weight"][:, :3].contiguous()),
     ["'conv_weight'", "width=4", "[24, 3]"]),
    ("fused_kda_verify", _set(state=torch.randn(10, 4, 4, 4)), ["'state'", "H=2", "[10, 4, 4, 4]"]),  # group size 1
    ("fused_kda_verify", lambda a: a.update(output_gate=a["output_gate"][..., :3].contiguous()),
     ["'output_gate'", "D=4", "[1, 6, 2, 3]"]),
    ("fused_kda_verify", _noncontig("output_gate"), ["'output_gate'", "contiguous", "[48, 8, 1, 2]"]),
    ("fused_kda_verify", _rows_apart("x"), ["'x'", "contiguous", "[186, 31, 1]"]),  # no row strides here
    ("fused_kda_verify", lambda a: a.update(state=_apart(a["state"], 0, 1)),
     ["'state'", "multiple of 16 bytes", "[33, 16, 4, 1]"]),
    ("fused_kda_verify", _dtype("state_indices", torch.int64), ["'state_indices'", "int32", "int64"]),
    ("fused_kda_verify", _dtype("cu_seqlens", torch.int64), ["'cu_seqlens'", "int32", "int64"]),
    ("fused_kda_verify", _dtype("num_accepted_tokens", torch.int64), ["'num_accepted_tokens'", "int32", "int64"]),
    # gate arguments, scale, norm_eps
    ("fused_kda_verify", _set(gate_mode=-1), ["'gate_mode'", "got -1"]),
    ("fused_kda_verify", _set(gate_mode=1, lower_bound=math.nan), ["'lower_bound'", "nan"]),
    ("fused_kda_verify", _set(gate_mode=2, A_log=None), ["'dt_bias'", "log gate", "got a tensor"]),
    ("fused_kda_verify", _dtype("A_log", torch.float64), ["'A_log'", "float32", "float64"]),
    ("fused_kda_verify", _set(scale=math.inf), ["'scale'", "inf"]),
    ("fused_kda_verify", _set(norm_eps=0.0), ["'norm_eps'", "> 0", "got 0"]),
    # cu_seqlens, num_accepted_tokens, the slot table
    ("fused_kda_verify", _set(cu_seqlens=_cu((2, 0, 4))), ["'cu_seqlens'", "N+1=5", "[4]"]),
    ("fused_kda_verify", _set(cu_seqlens=_cu((4, 0, 1, 1))), ["'cu_seqlens'", "request 0 has 4 tokens", "T_max = 3"]),
    ("fused_kda_verify", _set(num_accepted_tokens=torch.tensor([0, 2, 2, 1], dtype=torch.int32)),
     ["'num_accepted_tokens'", "entry 0 = 0", "[1, T_max = 3]"]),
    ("fused_kda_verify", _set(state_indices=torch.tensor([1, 3, 7, -1], dtype=torch.int32)),
     ["'state_indices'", "2 dims", "[N, T_max]", "[4]"]),
    ("fused_kda_verify", _set(state_indices=_table(0, [1, 11, -1])), ["'state_indices'", "= 11", "10 slots"]),
    ("fused_kda_verify", _set(state_indices=_table(2, [2, 8, 9])), ["'state_indices'", "slot 2 is written twice"]),
]

# Calls the wrong ones above start from (besides MAKE's): each must be served.
VALID = [
    ("kda_verify", _step_rows),
    ("kda_verify", _with_init),
    ("kda_verify", _init_is_state),
    ("kda_verify", _then(_step_rows, _with_init)),
    ("kda_verify", _then(*(_rows_apart(n) for n in ("q", "k", "v", "g", "beta")))),
    ("kda_verify", lambda a: a.update(state=_apart(a["state"], 0, 4))),
    ("kda_verify", _then(_with_init, lambda a: a.update(initial_state=_apart(a["initial_state"], 0, 8)))),
    ("kda_verify", lambda a: a.update({n: a[n].bfloat16() for n in ("q", "k", "v", "out")})),  # g, beta float32
    ("fused_kda_verify", _set(num_accepted_tokens=None)),
    ("fused_kda_verify", lambda a: a.update(state=_apart(a["state"], 0, 4))),
]


CASES = [pytest.param(name, fam, change, expect, id=f"{name}-{'|'.join(expect)}")
         for fam, change, expect in WRONG for name, f2 in MODULES if f2 == fam]


def test_every_registry_cpu_family_is_covered():
    # A CPU family the registry gains must get an argument builder, its written outputs and wrong calls here.
    assert MODULES, "no CPU module in the registry"
    with_wrong = {f for f, _, _ in WRONG}
    missing = {fam: [what for what, have in (("an argument builder (MAKE)", fam in MAKE),
                                             ("its written outputs (WRITTEN)", fam in WRITTEN),
                                             ("wrong calls (WRONG)", fam in with_wrong)) if not have]
               for fam in FAMILIES}
    missing = {fam: m for fam, m in missing.items() if m}
    assert not missing, f"registry CPU families this file does not test: {missing}"
    stale = (set(MAKE) | set(WRITTEN) | with_wrong | {f for f, _ in VALID}) - set(FAMILIES)
    assert not stale, f"cases for families the registry has no CPU module of: {sorted(stale)}"
    for fam in FAMILIES:
        args = make(fam)
        assert set(WRITTEN[fam]) <= set(args), (fam, set(WRITTEN[fam]) - set(args))


@pytest.mark.parametrize("name,fam,change,expect", CASES)
def test_wrong_call_is_stopped_by_the_binding(mods, name, fam, change, expect):
    args = make(fam)
    change(args)
    before = {n: args[n].clone() for n in WRITTEN[fam] if args[n] is not None}
    with pytest.raises(ValueError) as info:
        call(mods, name, fam, args)
    msg = str(info.value)
    assert f"{name}::{fam}" in msg, msg
    for part in expect:
        assert part in msg, f"expected {part!r} in the message: {msg}"
    for n, t in before.items():  # nothing written before the checks passed
        assert torch.equal(torch.isnan(args[n]), torch.isnan(t)), f"{n} written by a rejected call"
        assert torch.equal(torch.nan_to_num(args[n]), torch.nan_to_num(t)), f"{n} written by a rejected call"


VALID_CASES = [pytest.param(name, fam, change, id=f"{name}-{tag}")
               for fam, change, tag in [(f, None, "base") for f in FAMILIES] +
               [(f, c, str(i)) for i, (f, c) in enumerate(VALID)]
               for name, f2 in MODULES if f2 == fam]


@pytest.mark.parametrize("name,fam,change", VALID_CASES)
def test_valid_calls_pass(mods, name, fam, change):
    # The wrong calls above differ from these by one change each; these must succeed.
    args = make(fam)
    if change is not None:
        change(args)
    # kda_verify's second pool (apart from state) is read only
    second = fam == "kda_verify" and args["initial_state"] is not None and args["initial_state"] is not args["state"]
    init0 = args["initial_state"].clone() if second else None
    call(mods, name, fam, args)
    assert not torch.isnan(args["out"]).any(), fam
    if second:
        assert torch.equal(args["initial_state"], init0)


# ---------------------------------------------------------------------------------------------
# the compiled contract vs the record and jit/supported.json


@pytest.mark.parametrize("name,fam", MODULES)
def test_contract_matches_record_and_supported_set(mods, name, fam):
    got = json.loads(mods[name]["fkda_contract"]())
    assert got == macros.contract_values(jit.get_record(name))
    sup = supported.supported(fam, "cpu")
    assert got["FKDA_MODULE_NAME"] == name and got["FKDA_FAMILY"] == fam
    assert got["FKDA_HEAD_DIM_K"] == (0 if sup["head_dims_k"] is None else sup["head_dims_k"][0])
    assert got["FKDA_SUPPORTED_VALUE_HEADS"] == (sup["value_heads"] or [])
    assert got["FKDA_SUPPORTED_GROUP_SIZES"] == (sup["group_sizes"] or [])
    assert got["FKDA_STATE_BF16"] == -1  # any of supported state_dtypes, checked below


@pytest.mark.parametrize("name,fam", MODULES)
def test_every_supported_dtype_is_accepted(mods, name, fam):
    sup = supported.supported(fam, "cpu")
    for in_name in sup["input_dtypes"]:
        for st_name in sup["state_dtypes"]:
            args = make(fam, in_dtype=DT[in_name], state_dtype=DT[st_name])
            call(mods, name, fam, args)
            assert not torch.isnan(args["out"]).any(), (fam, in_name, st_name)


def test_group_size_rule_of_fused_decode(mods):
    # fused_kda_decode/cpu supports group size 1 only: its g defines H and the state must match it
    args = fused_args()
    args["state"] = torch.randn(4, 4, 4, 4)
    with pytest.raises(ValueError, match="'state'.*H=2"):
        call(mods, "cpu_fused_kda_decode", "fused_kda_decode", args)


# ---------------------------------------------------------------------------------------------
# timing


def test_small_decode_call_time(mods, capsys):
    """Per-call time of a small decode (1 row, 1 head, K = V = 16, fp32) through TVM-FFI."""
    args = decode_args(rows=1, H=1, HV=1, K=16, V=16, slots=2)
    args["state_indices"] = torch.tensor([1], dtype=torch.int32)
    fn, vals = mods["cpu_kda_decode"]["kda_decode"], list(args.values())
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
