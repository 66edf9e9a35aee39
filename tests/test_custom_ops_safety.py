"""Direct torch.ops.flashkda_ext.* calls with bad input (issue 45, "Adapter safety"): each raises an error
naming the argument, the same on the first call and after a valid call of the op (the fast path armed),
and writes nothing. Before: a meta tensor among CPU tensors returned with `out` unwritten; an int where
a bool is expected became True; prefill with checkpoint_every > 0 and no checkpoints tensor computed the
checkpoints and dropped them (as it dropped a requested final state). CPU backend."""
import pytest
import torch

import flashkda_ext  # noqa: F401  (registers the ops)
from flashkda_ext import ops

R, H, HV, K, V, SLOTS, T = 3, 2, 4, 8, 16, 6, 8
OPS = torch.ops.flashkda_ext


def cold():
    ops.clear_call_caches()


def rand(*s, seed=[0]):
    seed[0] += 1
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed[0]))


def decode_args():
    return dict(q=rand(R, H, K), k=rand(R, H, K), v=rand(R, HV, V), g=rand(R, HV, K), beta=rand(R, HV),
                state=rand(SLOTS, HV, V, K), state_indices=torch.tensor([4, 0, 2], dtype=torch.int32),
                A_log=rand(HV), dt_bias=rand(HV * K), lower_bound=None, gate="softplus", scale=None,
                beta_is_logit=True, slot_mode="unique", null_slot0=False, out=torch.zeros(R, HV, V))


def verify_args():
    return dict(q=rand(1, 5, H, K), k=rand(1, 5, H, K), v=rand(1, 5, HV, V), g=rand(1, 5, HV, K), beta=rand(1, 5, HV),
                state=rand(SLOTS, HV, V, K), state_indices=torch.tensor([[1, 4, -1], [2, 5, 3]], dtype=torch.int32),
                cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), num_accepted_tokens=None, max_seqlen=None,
                A_log=rand(HV), dt_bias=rand(HV * K), lower_bound=None, gate="softplus", scale=None,
                beta_is_logit=True, null_slot0=False, out=torch.zeros(1, 5, HV, V))


def prefill_args():
    return dict(q=rand(2, T, H, K), k=rand(2, T, H, K), v=rand(2, T, HV, V), g=rand(2, T, HV, K), beta=rand(2, T, HV),
                A_log=rand(HV), dt_bias=rand(HV * K), lower_bound=None, gate="softplus", scale=None,
                beta_is_logit=True, cu_seqlens=None, initial_state=None, state=None, state_indices=None,
                output_final_state=True, final_state=torch.zeros(2, HV, V, K), checkpoint_every=0, checkpoints=None,
                max_seqlen=None, null_slot0=False, workspace=None, out=torch.zeros(2, T, HV, V))


MAKE = {"kda_decode": decode_args, "kda_verify": verify_args, "kda_prefill": prefill_args}


def call(op, a):
    getattr(OPS, op).default(*a.values())


def outcome(op, a):
    before = {n: x.clone() for n, x in a.items() if isinstance(x, torch.Tensor) and not x.is_meta}
    with pytest.raises((TypeError, ValueError)) as e:
        call(op, a)
    for n, x in before.items():
        assert torch.equal(a[n], x), f"{op}: the refused call wrote {n}"
    return type(e.value), str(e.value)


def refused_cold_and_warm(op, change, match):
    a = MAKE[op]()
    change(a)
    cold()
    first = outcome(op, a)
    call(op, MAKE[op]())          # a valid call of the op arms the fast path and the verdict memo
    assert first == outcome(op, a), "the bad call fails differently after a valid call"
    assert first[1].startswith(match), first


def _meta(name):
    def change(a):
        a[name] = a[name].to("meta")
    return change


META_CASES = [("kda_decode", "state"), ("kda_decode", "out"), ("kda_decode", "q"), ("kda_decode", "state_indices"),
              ("kda_verify", "state"), ("kda_verify", "cu_seqlens"), ("kda_prefill", "final_state"),
              ("kda_prefill", "out")]


@pytest.mark.parametrize("op,name", META_CASES, ids=[f"{o}-{n}" for o, n in META_CASES])
def test_a_meta_tensor_among_cpu_tensors_is_refused_naming_it(op, name):
    refused_cold_and_warm(op, _meta(name), f"{name}: a meta tensor among tensors on cpu")


def test_all_meta_is_refused_as_before():
    a = {n: (x.to("meta") if isinstance(x, torch.Tensor) else x) for n, x in decode_args().items()}
    with pytest.raises(ValueError, match="^q: expected a tensor on a CPU or CUDA device, got meta"):
        call("kda_decode", a)


FLAGS = [("kda_decode", "null_slot0"), ("kda_decode", "beta_is_logit"), ("kda_verify", "null_slot0"),
         ("kda_prefill", "output_final_state"), ("kda_prefill", "null_slot0"), ("kda_prefill", "beta_is_logit")]


@pytest.mark.parametrize("value", [1, 0, 2])
@pytest.mark.parametrize("op,name", FLAGS, ids=[f"{o}-{n}" for o, n in FLAGS])
def test_an_int_for_a_bool_flag_is_refused_as_the_public_op_refuses_it(op, name, value):
    def change(a):
        a[name] = value
    refused_cold_and_warm(op, change, f"{name}: expected a bool, got int")


COUNTS = [("kda_prefill", "checkpoint_every", "expected an int >= 0, got bool"),
          ("kda_prefill", "max_seqlen", "expected an int or None, got bool"),
          ("kda_verify", "max_seqlen", "expected an int or None, got bool")]


@pytest.mark.parametrize("op,name,message", COUNTS, ids=[f"{o}-{n}" for o, n, _ in COUNTS])
def test_a_bool_for_an_integer_argument_is_refused_as_the_public_op_refuses_it(op, name, message):
    # an `int` schema argument would turn True into 1 before any check (checkpoint_every=True served as 1)
    def change(a):
        a[name] = True
    refused_cold_and_warm(op, change, f"{name}: {message}")


def test_no_integer_argument_is_typed_int_in_a_schema():
    for op in (OPS.kda_decode.default, OPS.kda_verify.default, OPS.kda_prefill.default,
               OPS.fused_kda_decode.default, OPS.fused_kda_verify.default):
        ints = [a.name for a in op._schema.arguments if str(a.type) in ("int", "int?", "SymInt", "SymInt?")]
        assert not ints, f"{op}: the dispatcher would turn True into 1 for {ints}"


def test_the_fused_ops_refuse_an_int_null_slot0_too():
    for op in (OPS.fused_kda_decode.default, OPS.fused_kda_verify.default):
        arg = next(a for a in op._schema.arguments if a.name == "null_slot0")
        assert str(arg.type) != "bool", f"{op}: the dispatcher would turn null_slot0=1 into True"


def test_prefill_outputs_the_op_would_drop_are_refused_naming_them():
    def ckpt(a):
        a["checkpoint_every"] = 4                            # checkpoints None: computed, then nowhere to go
    refused_cold_and_warm("kda_prefill", ckpt, "checkpoints: ")

    def final(a):
        a["final_state"] = None                              # output_final_state=True, dense mode
    refused_cold_and_warm("kda_prefill", final, "final_state: ")


def test_prefill_writes_what_it_is_given():
    a = prefill_args()
    a.update(checkpoint_every=4, checkpoints=torch.full((2, 2, HV, V, K), float("nan")))
    call("kda_prefill", a)
    assert torch.isfinite(a["checkpoints"]).all() and torch.isfinite(a["final_state"]).all()
    b = dict(a, output_final_state=False, final_state=None, checkpoint_every=0, checkpoints=None,
             out=torch.zeros_like(a["out"]))                  # nothing asked, nothing dropped: same out
    call("kda_prefill", b)
    torch.testing.assert_close(b["out"], a["out"], rtol=0, atol=0)


# --- under torch.compile: the wrappers' own reads and the schema's casts give the eager message (campaign 13) ---

def compiled_and_eager_errors(fn, a):
    """The eager error message of fn(**a), and the text of the error under torch.compile(fullgraph=True) (Dynamo
    reports an exception raised in traced code inside its own, as in test_custom_ops.py)."""
    import flashkda_ext as fk
    op = getattr(fk, fn)
    with pytest.raises((TypeError, ValueError)) as eager:
        op(**a)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(lambda kw: op(**kw), backend="aot_eager", fullgraph=True)(a)
    return str(eager.value), str(compiled.value)


def public(a):
    return {n: x for n, x in a.items() if n not in ("workspace",)}


@pytest.mark.parametrize("fn,make,name,value", [
    ("kda_decode", decode_args, "state_indices", [1]), ("kda_decode", decode_args, "dt_bias", 3),
    ("kda_verify", verify_args, "num_accepted_tokens", 3), ("kda_prefill", prefill_args, "initial_state", [1]),
    ("kda_prefill", prefill_args, "checkpoints", [1])])
def test_a_non_tensor_for_a_tensor_argument_is_named_under_compile(fn, make, name, value):
    """Before: torch's "Unable to cast [1] to Tensor" from the schema, naming no argument."""
    a = public(make())
    a[name] = value
    eager, compiled = compiled_and_eager_errors(fn, a)
    assert f"{name}: expected a torch.Tensor, got {type(value).__name__}" in compiled, compiled
    assert eager.startswith(name), eager


@pytest.mark.parametrize("change", [dict(cu_seqlens=torch.zeros(0, dtype=torch.int32)),
                                    dict(max_seqlen=-4), dict(max_seqlen=2 ** 63), dict(max_seqlen=8.0)],
                         ids=["no-offsets", "negative", "huge", "float"])
def test_prefill_sizes_nothing_from_unchecked_values_under_compile(change):
    """Before: the traced wrapper sized the final state from N = -1 or the checkpoints from max_seqlen, failing in
    torch.empty / torch.full with a message naming nothing."""
    a = public(prefill_args())
    a.update(q=a["q"][:1].reshape(1, T, H, K), k=a["k"][:1], v=a["v"][:1], g=a["g"][:1], beta=a["beta"][:1],
             cu_seqlens=torch.tensor([0, 2, T], dtype=torch.int32), final_state=None, out=None, checkpoint_every=2)
    a.update(change)
    eager, compiled = compiled_and_eager_errors("kda_prefill", a)
    assert eager in compiled, (eager, compiled)


@pytest.mark.parametrize("fn,make,reader", [("kda_decode", decode_args, "q"), ("kda_verify", verify_args, "k")])
def test_an_input_overlapping_the_state_is_refused_under_compile_as_eager(fn, make, reader):
    """Campaign 13: functionalization hands the compiled op a copy of the pool, so a q that is a view of the state
    was served there and refused eagerly; the fake now checks the overlap on Dynamo's fake tensors."""
    a = public(make())
    n = a[reader].numel()
    a[reader] = a["state"].view(-1)[:n].view(a[reader].shape)
    before = a["state"].clone()
    eager, compiled = compiled_and_eager_errors(fn, a)
    assert eager.startswith("state: overlaps the memory of") and eager in compiled, (eager, compiled)
    assert torch.equal(a["state"], before)
