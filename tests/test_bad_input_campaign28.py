"""Bad-input campaign 28 (CPU backend): a traced call is refused as eager refuses it and served as eager serves it.
One table (wrong shapes and element-count-compatible layouts, dtypes, meta beside CPU, bad scalars, optional
combinations, overlapping outputs) runs through every public op eagerly, through its fake (FakeTensorMode), through
torch.compile(fullgraph=True) (a backend that runs nothing: tracing only) and, where the arguments map, through the
JAX front end eagerly and traced (jax.eval_shape). A refusal is eager's exception type and message; a served call
has eager's output shapes / dtypes / devices. Each case failed before its fix, except those marked "guard".

- fake overlap order: the fakes ran the overlap check over the tensors in schema order (state written before out),
  so an out inside the pool (prefill: overlapping final_state) was refused by the fake and torch.compile as
  "state: overlaps the memory of out", where eager says "out: overlaps the memory of state". Now eager's order
  (custom_ops._APART_ORDER, checked against ops.py's check_apart calls below).
- fake prefill checkpoints: with host cu_seqlens and no max_seqlen eager needs C >= longest sequence //
  checkpoint_every (3 for offsets [0, 2, 5], every 1); the fake, with no values, required C >= T // every = 5, so
  checkpoints eager serves were refused under FakeTensorMode / torch.compile / torch.export (and bf16 ones named for
  their shape, not their dtype). Now the T bound only where eager has it (device offsets); the real implementation
  checks host offsets when it runs.
- guard: the rest of the table agrees; the traced ops declare their pools mutated (schema, torch.export); JAX eager
  and traced refuse with torch's message.
Expected differences (a fake or a JAX tracer has no values): slots / offsets / num_accepted_tokens / parent_tokens
out of range, max_seqlen or checkpoints short of the longest sequence: served traced, and the compiled call is
refused when it runs, with eager's message, nothing written. Reverse: traced prefill with checkpoint_every > 0 and
neither checkpoints nor max_seqlen is refused naming max_seqlen (the count sizes an output); JAX traced checks given
checkpoints against T (docs/jax.md: nothing reads the offsets after the trace). Known, not fixed: with two faults,
one a device (meta beside CPU), eager may name the device one (checked first) where the fake, whose meta stand-ins
carry no device, applies the device rule last and names the other (pinned below).
"""
from __future__ import annotations

import ast
import inspect

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode

import flashkda_ext as fk
from flashkda_ext import custom_ops, ops
from bad_input_cases import (FUSED_POS, FUSED_VERIFY_POS, H, HV, K, SLOTS, V, decode_args, fused_args,
                             fused_verify_args, i32, rand, verify_args)

BF, INT, NAN, POS = torch.bfloat16, torch.int32, float("nan"), ("q", "k", "v", "g", "beta")


def prefill_args():
    return dict(q=rand(1, 5, H, K), k=rand(1, 5, H, K), v=rand(1, 5, HV, V), g=rand(1, 5, HV, K), beta=rand(1, 5, HV),
                cu_seqlens=i32(0, 2, 5), initial_state=rand(2, HV, V, K), A_log=rand(HV), dt_bias=rand(HV * K))


OPS = {"d": ("kda_decode", POS, decode_args), "v": ("kda_verify", POS, verify_args),
       "p": ("kda_prefill", POS, prefill_args), "D": ("fused_kda_decode", FUSED_POS, fused_args),
       "V": ("fused_kda_verify", FUSED_VERIFY_POS, fused_verify_args)}


def call(op, a):
    name, pos, _ = OPS[op]
    a = dict(a)
    return getattr(fk, name)(*[a.pop(n) for n in pos], **a)


def shapes(r):
    if isinstance(r, (tuple, list)):
        return tuple(shapes(x) for x in r)
    return None if r is None else (tuple(r.shape), str(r.dtype).replace("torch.", ""),
                                   str(r.device) if torch.is_tensor(r) else "jax")


def outcome(fn):
    try:
        return "ok", shapes(fn())
    except (TypeError, ValueError) as e:
        return "raise", e


def up(**kw):
    return lambda a: dict(a, **{n: (x(a[n]) if callable(x) else x) for n, x in kw.items()})


def bf16(*keep):   # the op's inputs in bf16 (the conv cache with them), the named ones left fp32
    return lambda a: {n: (x.to(BF) if n in ("q", "k", "v", "g", "beta", "x", "output_gate", "conv_state")
                          and n not in keep else x) for n, x in a.items()}


def inside(pool):  # out as a view of the pool's memory
    return lambda a: dict(a, out=a[pool].view(-1)[:a[_o(a)].numel()].view(a[_o(a)].shape))


def _o(a):
    return "output_gate" if "x" in a else "v"


tr, meta, ROW = (lambda x: x.transpose(-1, -2).contiguous()), (lambda x: x.to("meta")), (lambda x: x[None])
to = (lambda dtype: lambda x: x.to(dtype))  # noqa: E731
BOUNDED = dict(gate="bounded", A_log=None, dt_bias=None)
CASES = {   # id: (ops (OPS' keys), change)
    "g_K_HV": ("dvpDV", up(g=tr)), "g_flat": ("dvpDV", up(g=lambda x: x.flatten(-2))),
    "beta_heads_first": ("dvpDV", up(beta=tr)), "state_K_first": ("dvDV", up(state=tr)),
    "init_K_first": ("p", up(initial_state=tr)), "idx_short": ("dD", up(state_indices=lambda x: x[:2])),
    "idx_1d": ("vV", up(state_indices=lambda x: x[:, 0].contiguous())), "cu_short": ("vV", up(cu_seqlens=i32(0, 5))),
    "out_shape": ("dvpDV", lambda a: dict(a, out=torch.empty(1))), "k_rows_strided": ("dv", up(k=lambda x: tr(x).mT)),
    "dt_bias_HV": ("dvpDV", up(dt_bias=lambda x: x[:x.numel() // 8])), "norm_weight_2d": ("DV", up(norm_weight=ROW)),
    "conv_weight_T": ("DV", up(conv_weight=tr)), "conv_state_slots": ("D", up(conv_state=lambda x: x[:4])),
    "q_int": ("dvp", up(q=to(torch.int32))), "x_int": ("DV", up(x=to(torch.int32))), "g_int": ("dvpDV", up(g=to(INT))),
    "beta_bool": ("dvpDV", up(beta=to(torch.bool))), "A_log_int": ("dvpDV", up(A_log=to(torch.int32))),
    "state_fp16": ("dvDV", up(state=to(torch.float16))), "state_int": ("dvDV", up(state=to(torch.int32))),
    "init_fp16": ("p", up(initial_state=to(torch.float16))), "init_int": ("p", up(initial_state=to(torch.int32))),
    "idx_int64": ("dvDV", up(state_indices=to(torch.int64))), "cu_float": ("vpV", up(cu_seqlens=to(torch.float32))),
    "bf16": ("dvpDV", bf16()), "bf16_g32": ("dvpDV", bf16("g")), "bf16_beta32": ("dvp", bf16("beta")),
    "bf16_gb32": ("dvpDV", bf16("g", "beta")), "fp16_g_bf16": ("dvp", lambda a: up(g=to(torch.float16))(bf16()(a))),
    "out_bf16": ("dvpDV", lambda a: dict(a, out=torch.empty(a[_o(a)].shape, dtype=BF))),
    "initial_bf16": ("v", lambda a: dict(a, initial_state=a["state"].to(BF), initial_state_indices=i32(0, 3))),
    "ckpt_bf16": ("p", lambda a: dict(a, checkpoint_every=1, checkpoints=torch.empty(2, 3, HV, V, K, dtype=BF))),
    "final_bf16": ("p", lambda a: dict(a, final_state=torch.empty(2, HV, V, K, dtype=BF))),
    "g_meta": ("dvpDV", up(g=meta)), "A_log_meta": ("dvpDV", up(A_log=meta)), "state_meta": ("dvDV", up(state=meta)),
    "idx_meta": ("dvDV", up(state_indices=meta)), "cu_meta": ("vpV", up(cu_seqlens=meta)),
    "init_meta": ("p", up(initial_state=meta)), "conv_state_meta": ("DV", up(conv_state=meta)),
    "out_meta": ("dvpDV", lambda a: dict(a, out=torch.empty(a[_o(a)].shape, device="meta"))),
    "parent_meta": ("v", lambda a: dict(a, parent_tokens=torch.zeros(2, 3, dtype=torch.int32, device="meta"))),
    "scale_bool": ("dvpDV", up(scale=True)), "scale_nan": ("dvpDV", up(scale=NAN)),
    "scale_neg": ("dvpDV", up(scale=-1.0)), "scale_int": ("dvpDV", up(scale=1)),
    "lb_pos": ("dvpDV", up(lower_bound=0.5, **BOUNDED)), "lb_nan": ("dvpDV", up(lower_bound=NAN, **BOUNDED)),
    "lb_bool": ("dvpDV", up(lower_bound=True, **BOUNDED)), "lb_int": ("dvpDV", up(lower_bound=-1, **BOUNDED)),
    "lb_softplus": ("dvpDV", up(lower_bound=-1.0)),
    "gate_bad": ("dvpDV", up(gate="relu")), "gate_log_A_log": ("dvpDV", up(gate="log")),
    "null_slot0_int": ("dvpDV", up(null_slot0=1)), "beta_is_logit_int": ("dvp", up(beta_is_logit=0)),
    "slot_mode_bad": ("dD", up(slot_mode="any")), "norm_eps_nan": ("DV", up(norm_eps=NAN)),
    "norm_eps_bool": ("DV", up(norm_eps=True)), "norm_eps_zero": ("DV", up(norm_eps=0.0)),
    "max_seqlen_bool": ("vpV", up(max_seqlen=True)), "max_seqlen_float": ("vV", up(max_seqlen=3.0)),
    "max_seqlen_big": ("vV", up(max_seqlen=4)), "ofs_int": ("p", up(output_final_state=1)),
    "ckpt_every_bool": ("p", up(checkpoint_every=True)), "ckpt_every_neg": ("p", up(checkpoint_every=-1)),
    "ckpt_given_every0": ("p", up(checkpoints=torch.empty(2, 3, HV, V, K))),
    "ckpt_maxlen": ("p", up(checkpoint_every=1, max_seqlen=3)),
    "ckpt_longest": ("p", up(checkpoint_every=1, checkpoints=torch.empty(2, 3, HV, V, K))),   # fixed (fake refused)
    "pool_no_idx": ("p", up(initial_state=None, state=torch.randn(SLOTS, HV, V, K))),
    "pool": ("p", up(initial_state=None, state=torch.randn(SLOTS, HV, V, K), state_indices=i32(1, 3))),
    "null_slot0_dense": ("p", up(null_slot0=True)),
    "final_no_ofs": ("p", up(final_state=torch.empty(2, HV, V, K), output_final_state=False)),
    "nat": ("vV", up(num_accepted_tokens=i32(1, 2))), "nat_2d": ("v", up(num_accepted_tokens=i32(1, 2)[None])),
    "nat_1d_idx": ("vV", up(num_accepted_tokens=i32(1, 2), state_indices=lambda x: x[:, 0].contiguous())),
    "nat_initial": ("v", lambda a: dict(a, num_accepted_tokens=i32(1, 1), initial_state=a["state"].clone(),
                                        initial_state_indices=i32(0, 3))),
    "initial_no_idx": ("v", lambda a: dict(a, initial_state=a["state"].clone())),
    "step_rows": ("v", up(state=torch.randn(3, 3, HV, V, K), state_indices=i32(0, 2))),
    "parent": ("v", up(parent_tokens=torch.zeros(2, 3, dtype=torch.int32))),
    "parent_wide": ("v", up(parent_tokens=torch.zeros(2, 4, dtype=torch.int32))),
    "parent_float": ("v", up(parent_tokens=torch.zeros(2, 3))),
    "q_requires_grad": ("dvp", up(q=lambda x: x.requires_grad_())),
    "out_is_v": ("dvp", lambda a: dict(a, out=a["v"])), "out_is_gate": ("DV", lambda a: dict(a, out=a["output_gate"])),
    "out_in_state": ("dvDV", inside("state")), "out_in_init": ("p", inside("initial_state")),  # dvDV: fixed
    "out_in_final": ("p", lambda a: inside("final_state")(dict(a, final_state=torch.empty(2, HV, V, K)))),   # fixed
    "q_in_state": ("dv", lambda a: dict(a, q=a["state"].view(-1)[:a["q"].numel()].view(a["q"].shape))),
    "final_is_init": ("p", lambda a: dict(a, final_state=a["initial_state"])),
    # values only (VALUES below)
    "idx_oob": ("dDv", up(state_indices=lambda x: torch.where(x == x.flatten()[-1], 99, x).int())),
    "pool_oob": ("p", up(initial_state=None, state=torch.randn(SLOTS, HV, V, K), state_indices=i32(1, 99))),
    "cu_values": ("vpV", up(cu_seqlens=i32(0, 3, 4))), "nat_oob": ("vV", up(num_accepted_tokens=i32(1, 9))),
    "max_seqlen_small": ("v", up(max_seqlen=2)),
    "parent_oob": ("v", up(parent_tokens=i32(0, 2, 2, 0, 2, 2).view(2, 3))),
    "ckpt_maxlen_small": ("p", up(checkpoint_every=1, max_seqlen=2)),
    "ckpt_short": ("p", up(checkpoint_every=1, checkpoints=torch.empty(2, 2, HV, V, K))),
}
TABLE = [(op, cid) for cid, (codes, _) in CASES.items() for op in codes]
VALUES = {"idx_oob", "pool_oob", "cu_values", "nat_oob", "max_seqlen_small", "parent_oob", "ckpt_maxlen_small",
          "ckpt_short"}   # eager refuses on values a fake has not: served traced, refused when run
COMPILED = {"g_K_HV", "beta_heads_first", "state_fp16", "cu_float", "bf16_g32", "g_meta", "cu_meta", "scale_bool",
            "lb_nan", "null_slot0_int", "norm_eps_bool", "max_seqlen_bool", "ckpt_longest", "nat_1d_idx",
            "parent_wide", "out_in_state", "out_in_final", "q_in_state", "final_is_init", "pool"}


def table(keep):
    cases = [c for c in TABLE if keep(c[1])]
    return pytest.mark.parametrize("op,cid", cases, ids=[f"{OPS[o][0]}-{c}" for o, c in cases])


def args(op, cid):
    return CASES[cid][1](OPS[op][2]())


def fake_outcome(a, fn):
    with FakeTensorMode() as mode:
        return outcome(lambda: fn({n: (mode.from_tensor(x) if torch.is_tensor(x) else x) for n, x in a.items()}))


def same(e, t):
    return e[0] == t[0] and (e[1] == t[1] if e[0] == "ok" else (type(e[1]), str(e[1])) == (type(t[1]), str(t[1])))


@table(lambda c: c not in VALUES)
def test_fake_refuses_and_serves_as_eager(op, cid):
    eager = outcome(lambda: call(op, args(op, cid)))
    fake = fake_outcome(args(op, cid), lambda a: call(op, a))
    assert same(eager, fake), (eager, fake)


class _Traced(Exception):  # noqa: N818
    """Raised by compile_outcome's graph: tracing went through."""


def compile_outcome(op, a):
    torch._dynamo.reset()

    def backend(gm, example_inputs):           # tracing only: the compiled graph is never run
        assert any("flashkda_ext" in str(n.target) for n in gm.graph.nodes)
        def run(*_):
            raise _Traced
        return run
    try:
        torch.compile(lambda t: call(op, t), fullgraph=True, backend=backend)(a)
    except _Traced:
        return "traced"
    except Exception as e:       # noqa: BLE001 - Dynamo wraps the fake's error, its repr kept in the text
        return e


@table(lambda c: c in COMPILED)
def test_compile_refuses_while_tracing_as_eager(op, cid):
    eager = outcome(lambda: call(op, args(op, cid)))
    got = compile_outcome(op, args(op, cid))
    if eager[0] == "ok":
        assert got == "traced", got
    else:
        assert got != "traced" and repr(eager[1]) in str(got), (eager, str(got)[:3000])


def raw(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


@table(lambda c: c in VALUES)
def test_value_faults_are_refused_when_the_compiled_call_runs(op, cid):
    """Expected difference: a fake has no values; the real implementation refuses at run time, writing nothing."""
    eager = outcome(lambda: call(op, args(op, cid)))
    assert eager[0] == "raise", eager
    fake = fake_outcome(args(op, cid), lambda a: call(op, a))
    assert fake[0] == "ok", fake
    a = args(op, cid)
    before = {n: raw(x) for n, x in a.items() if torch.is_tensor(x)}
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(lambda t: call(op, t), fullgraph=True, backend="eager")(a)
    assert str(eager[1]) in str(info.value)
    assert all(torch.equal(raw(a[n]), x) for n, x in before.items())


def test_traced_checkpoints_without_a_count_need_max_seqlen():
    """Expected difference (reverse): the count sizes an output, which a trace must know."""
    a = dict(prefill_args(), checkpoint_every=1)
    assert outcome(lambda: call("p", a))[0] == "ok"
    fake = fake_outcome(a, lambda t: call("p", t))
    assert fake[0] == "raise" and str(fake[1]).startswith("max_seqlen: required under torch.compile/export")


def test_checkpoints_for_the_longest_sequence_compile_and_run_as_eager():
    """fixed: C = longest // checkpoint_every (host offsets) served compiled, bitwise eager. guard: device offsets
    keep the T bound, as eager's (a fake CUDA call)."""
    a = args("p", "ckpt_longest")
    want = call("p", dict(a, checkpoints=a["checkpoints"].clone()))
    torch._dynamo.reset()
    got = torch.compile(lambda t: call("p", t), fullgraph=True, backend="eager")(a)
    assert all(torch.equal(raw(x), raw(y)) for x, y in zip(got, want)) and got[2] is a["checkpoints"]
    with FakeTensorMode():
        e = (lambda *s, dt=BF: torch.empty(*s, dtype=dt, device="cuda"))  # noqa: E731
        cu = dict(q=e(1, 8, 2, 128), k=e(1, 8, 2, 128), v=e(1, 8, 2, 128), g=e(1, 8, 2, 128), beta=e(1, 8, 2),
                  A_log=e(2, dt=torch.float32), dt_bias=e(256, dt=torch.float32), cu_seqlens=e(3, dt=torch.int32),
                  initial_state=e(2, 2, 128, 128, dt=torch.float32), checkpoint_every=2)
        for c, words in ((2, r"^checkpoints: expected shape \[N, C, HV, V, K\] = \[2, >= 4,"), (4, None)):
            run = lambda: call("p", dict(cu, checkpoints=e(2, c, 2, 128, 128, dt=torch.float32)))  # noqa: E731
            if words:
                with pytest.raises(ValueError, match=words):
                    run()
            else:
                assert run()[2].shape == (2, 4, 2, 128, 128)


def test_fake_overlap_order_is_ops_check_apart_order():
    """The order the fix put in custom_ops is the one ops.py's check_apart calls list (a change there shows here)."""
    tree = ast.parse(inspect.getsource(ops))
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in custom_ops._APART_ORDER):
        (c,) = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "check_apart"]
        names = [p.elts[0].value for t in c.args[:2] for p in t.elts]
        assert tuple(names) == custom_ops._APART_ORDER[fn.name], fn.name


@pytest.mark.parametrize("op", list(OPS))
def test_traced_ops_declare_their_pools_mutated(op):
    """guard: the schema marks the pools and out written; torch.export (functionalized) returns the pools."""
    name, _, make = OPS[op]
    pools = {"d": {"state"}, "v": {"state"}, "p": {"state"}, "D": {"conv_state", "state"}, "V": {"conv_state", "state"}}
    schema = getattr(torch.ops.flashkda_ext, name).default._schema
    written = {x.name for x in schema.arguments if x.alias_info is not None and x.alias_info.is_write}
    assert pools[op] | {"out"} <= written
    a = make() if op != "p" else args("p", "pool")
    names = [n for n, x in a.items() if torch.is_tensor(x)]

    class M(torch.nn.Module):
        def forward(self, *xs):
            return call(op, dict(a, **dict(zip(names, xs))))
    ep = torch.export.export(M(), tuple(a[n] for n in names), strict=False).run_decompositions()
    placeholders = [n.name for n in ep.graph.nodes if n.op == "placeholder"]
    mutated = {names[placeholders.index(x)] for x in ep.graph_signature.user_inputs_to_mutate.values()}
    assert mutated == pools[op]


def test_two_faults_one_a_device_known_difference():
    """Known, not fixed: eager names the device fault it checks first; the fake, whose stand-ins all sit on meta,
    applies the device rule after its other checks and names the later fault. One fault alone agrees (the table)."""
    a = dict(decode_args(), g=decode_args()["g"].to("meta"), state=tr(decode_args()["state"]))
    eager = outcome(lambda: call("d", a))
    fake = fake_outcome(a, lambda t: call("d", t))
    assert str(eager[1]).startswith("g: expected a tensor on cpu (the device of q), got meta")
    assert str(fake[1]).startswith("state: expected shape [slots, HV, V, K]")


# --- JAX: eager and traced (jax.eval_shape) refuse the same static facts with torch's message ----------------------

NOT_JAX = {c for c in CASES if "meta" in c or c.startswith(("out_", "final_"))} | {   # JAX: no strides, devices,
    "k_rows_strided", "idx_int64", "q_requires_grad", "q_in_state"}     # out=, final_state=; int64 narrowed (x64 off)


@table(lambda c: c not in NOT_JAX)
def test_jax_eager_and_traced_agree_with_torch(op, cid):
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    import jax.numpy as jnp
    kj = pytest.importorskip("flashkda_ext.jax")
    name, pos, _ = OPS[op]
    t = args(op, cid)
    a = {n: (jnp.asarray(x.float().numpy()).astype(jnp.bfloat16) if torch.is_tensor(x) and x.dtype == BF else
             jnp.asarray(x.numpy()) if torch.is_tensor(x) else x) for n, x in t.items()}
    arrays = {n: x for n, x in a.items() if isinstance(x, jax.Array)}

    def jcall(d):
        d = dict(a, **d)
        return getattr(kj, name)(*[d.pop(n) for n in pos], **d, donate=False)
    eager = outcome(lambda: call(op, t))
    je = outcome(lambda: jcall({}))
    jt = outcome(lambda: jax.eval_shape(jcall, arrays))
    t_bound = cid in ("ckpt_longest", "ckpt_bf16", "ckpt_short")
    if t_bound:                # expected: traced, given checkpoints are checked against T (docs/jax.md)
        assert jt[0] == "raise" and str(jt[1]).startswith("checkpoints: expected shape [N, C, HV, V, K] = [2, >= 5,")
    if eager[0] == "ok":
        assert je[0] == "ok" and (t_bound or je[1] == jt[1]), (je, jt)
        assert je[1][0][:2] == (eager[1][0] if op == "p" else eager[1])[:2]      # out: shape and dtype
    elif cid in VALUES:        # expected: a tracer has no values; eager JAX reads them (naming the argument)
        assert je[0] == "raise" and str(je[1]).split(":")[0] in str(eager[1]) and (t_bound or jt[0] == "ok")
    else:
        assert same(je, eager) and (t_bound or same(jt, eager)), (eager, je, jt)
