"""Bad-input campaign 22 (CPU backend): kda_verify's draft trees (`parent_tokens` [N, T_max] int32: token t >= 1 of
request n continues from the state stored after its token parent_tokens[n, t]) through the JAX front end, the torch
custom op and its fake, the trace facility and the reference. Each case failed before its fix, except those marked
"guard" (behaviour that was already right, pinned beside the fixes).

- torch custom op fake: the fake ran the eager checks on meta stand-ins, which all sit on the meta device, so a
  FakeTensorMode call with parent_tokens (or state_indices, or any tensor) on another device than q (a fake CUDA
  or meta tensor) returned outputs where eager refuses "parent_tokens: expected a tensor on cpu (the device of
  q), got ...". Under torch.compile(fullgraph=True) such a call traced, and was refused only when run, by the
  op's meta-among-real rule with another message. The fakes of every op now apply the eager device rule (first
  call and a repeated one alike; kda_decode's state_indices on meta was served by its fake too).
- reference (kda_verify_step, the spec): parent_tokens was read with int() row by row: a float table was truncated
  (0.5 -> 0) and a bool one taken as 0 / 1, both served; a table of another shape ([N, T_max + 1], [N + 1, T_max])
  was cut to fit and served; a 1-D table failed with "'int' object is not subscriptable" and a list with an
  AttributeError, naming nothing. Now host ints [N, T_max] as state_indices, refused naming parent_tokens (the op
  refuses each of these calls too).
- guard: the fast path after a valid tree call refuses a bad parent (the token itself, -1, int32's largest
  value) as the cold call does, bit for bit nothing written.
- guard: the JAX front end refuses bad parent values eagerly before the pool is donated (cold and warm, the torch
  op's message), a numpy int64 table past int32 without wrapping it, and under jax.jit still names a float or
  mis-shaped parent_tokens at trace time; served trees equal the torch op bitwise.
- guard: a fake tree call infers the real op's out (shape, dtype, device); torch.compile(fullgraph=True) serves the
  tree bitwise as eager, which matches the reference (not zeros).
- guard: a refused tree call leaves no trace; a served one writes a `_tree` definition storing its parent table.
"""
from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashkda_ext as fk
from flashkda_ext import fast_path, reference
from flashkda_ext.devtools.testing import call_outcome
from bad_input_cases import HV, V, decode_args, i32, verify_args

POS = ("q", "k", "v", "g", "beta")
T, N, T_MAX = 5, 2, 3


def tree_args():
    """verify_args' two requests of 2 and 3 tokens (slots [[1, 4, -1], [2, 5, 3]]), request 1 a tree: its token 2
    branches off token 0. Fresh random values (never zeros)."""
    return dict(verify_args(), parent_tokens=i32(0, 0, 0, 0, 0, 0).reshape(N, T_MAX))


def verify(a):
    a = dict(a)
    return fk.kda_verify(*[a.pop(n) for n in POS], **a)


def ref(a):
    a = dict(a)
    return reference.kda_verify_step(*[a.pop(n) for n in POS], **a)


def fakes(a, mode):
    return {n: (mode.from_tensor(x) if isinstance(x, torch.Tensor) else x) for n, x in a.items()}


# ---------------------------------------------------------------------------------------------
# torch custom op: the fake applies the eager device rule


@pytest.mark.parametrize("device", ["meta", "cuda"])
@pytest.mark.parametrize("name", ["parent_tokens", "state_indices"])
def test_fake_refuses_an_index_on_another_device_as_eager(name, device):
    words = f"{name}: expected a tensor on cpu (the device of q), got {device}"
    if device == "meta":      # eager (a CUDA tensor needs a GPU; the fake's stands in for it)
        with pytest.raises(ValueError, match="^" + re.escape(words)):
            verify(dict(tree_args(), **{name: tree_args()[name].to("meta")}))
    a = tree_args()
    with FakeTensorMode() as mode:
        f = fakes(a, mode)
        f[name] = torch.empty(a[name].shape, dtype=torch.int32, device=device)
        for _ in range(2):    # the first call and a repeated one
            with pytest.raises(ValueError, match="^" + re.escape(words)):
                verify(f)


def test_fake_device_rule_holds_for_the_other_ops_too():
    """The rule is the fakes' own (every op): kda_decode's state_indices on meta beside CPU fakes, as eager."""
    a = decode_args()
    words = "state_indices: expected a tensor on cpu (the device of q), got meta"
    with pytest.raises(ValueError, match="^" + re.escape(words)):
        fk.kda_decode(*[a[n] for n in POS], **dict({n: x for n, x in a.items() if n not in POS},
                                                   state_indices=a["state_indices"].to("meta")))
    with FakeTensorMode() as mode:
        f = fakes(a, mode)
        f["state_indices"] = torch.empty(a["state_indices"].shape, dtype=torch.int32, device="meta")
        with pytest.raises(ValueError, match="^" + re.escape(words)):
            fk.kda_decode(*[f.pop(n) for n in POS], **f)


def test_compiled_tree_call_with_a_meta_parent_table_is_refused_while_tracing():
    import torch._dynamo
    a = dict(tree_args(), parent_tokens=tree_args()["parent_tokens"].to("meta"))
    before = {n: x.clone() for n, x in a.items() if isinstance(x, torch.Tensor) and not x.is_meta}
    words = "parent_tokens: expected a tensor on cpu (the device of q), got meta"
    with pytest.raises(ValueError, match="^" + re.escape(words)):
        verify(a)                                                    # eager
    torch._dynamo.reset()
    fn = torch.compile(verify, fullgraph=True, backend="eager")
    for _ in range(2):
        with pytest.raises(Exception) as info:
            fn(a)
        assert words in str(info.value), str(info.value)[:2000]     # Dynamo wraps the eager error, keeping its text
    assert all(torch.equal(a[n], x) for n, x in before.items())


# ---------------------------------------------------------------------------------------------
# the reference: parent_tokens as host ints [N, T_max]

REF_BAD = [("float", lambda p: p.float() + 0.5, r"^parent_tokens: expected an integer tensor, got torch.float32"),
           ("bool", lambda p: p.bool(), r"^parent_tokens: expected an integer tensor, got torch.bool"),
           ("wide", lambda p: torch.cat([p, p[:, :1]], 1), r"^parent_tokens: expected \[N, T_max\] = \[2, 3\]"),
           ("tall", lambda p: torch.cat([p, p[:1]], 0), r"^parent_tokens: expected \[N, T_max\] = \[2, 3\]"),
           ("1-D", lambda p: p[:, 1].contiguous(), r"^parent_tokens: expected a 2-D tensor"),
           ("list", lambda p: p.tolist(), r"^parent_tokens: expected a 2-D integer tensor")]


@pytest.mark.parametrize("bad,match", [(b, m) for _, b, m in REF_BAD], ids=[i for i, _, _ in REF_BAD])
def test_reference_names_a_parent_table_it_cannot_read(bad, match):
    a = tree_args()
    a["parent_tokens"] = bad(a["parent_tokens"])
    with pytest.raises((TypeError, ValueError), match=r"^parent_tokens: "):
        verify(dict(a, state=a["state"].clone()))                  # the op refuses each of these calls too
    with pytest.raises((TypeError, ValueError), match=match):
        ref(a)


# ---------------------------------------------------------------------------------------------
# guards


@pytest.mark.parametrize("t,p", [(2, 2), (2, -1), (1, 2 ** 31 - 1)], ids=["self", "minus1", "int32_max"])
def test_warm_fast_path_refuses_a_bad_parent_as_the_cold_call(t, p):
    """guard"""
    def bad():
        a = tree_args()
        a["parent_tokens"][1, t] = p
        return a
    fast_path.clear()
    cold = call_outcome(verify, bad())
    verify(tree_args())                                  # a valid tree call arms the fast path
    assert fast_path.size() == 1
    warm = call_outcome(verify, bad())
    assert cold[0] == "raise" and cold == warm
    assert re.match(rf"parent_tokens: entry \[1, {t}\] = {p}; expected a token of request 1", cold[2])


def test_jax_tree_values_and_static_checks():
    """guard"""
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    import jax.numpy as jnp
    import numpy as np
    kj = pytest.importorskip("flashkda_ext.jax")

    def to_jax(a):
        return {n: (jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor) else x) for n, x in a.items()}

    def jverify(a, **kw):
        a = dict(a, **kw)
        return kj.kda_verify(*[a.pop(n) for n in POS], **a)

    a = tree_args()
    want = dict(a, state=a["state"].clone())
    out = verify(want)
    jout, jstate = jverify(to_jax(a), donate=False)
    assert torch.equal(torch.from_numpy(np.array(jout)), out) and out.abs().max() > 0
    assert torch.equal(torch.from_numpy(np.array(jstate)), want["state"])
    bad = tree_args()
    bad["parent_tokens"][1, 2] = 3
    with pytest.raises(ValueError) as eager:
        verify(bad)
    for _ in range(2):                                   # cold (after the valid call: warm plan) and again
        ja = to_jax(bad)
        with pytest.raises(ValueError, match="^" + re.escape(str(eager.value))):
            jverify(ja)                                  # donate=True: refused before the pool is donated
        assert not ja["state"].is_deleted()
    wide = np.full((N, T_MAX), 2 ** 32, np.int64)        # x64 off: jnp.asarray would wrap it to 0
    with pytest.raises(ValueError, match=r"^parent_tokens: got a numpy int64 array"):
        jverify(to_jax(tree_args()), parent_tokens=wide, donate=False)
    arrays = to_jax(tree_args())
    names = [n for n, x in arrays.items() if x is not None]
    for table, match in ((jnp.zeros((N, T_MAX), jnp.float32), r"^parent_tokens: expected dtype int32, got float32"),
                         (jnp.zeros((N, T_MAX + 1), jnp.int32), r"^parent_tokens: expected \[N, T_max\] = \[2, 3\]")):
        def traced(*xs, table=table):
            return jverify(dict(zip(names, xs), parent_tokens=table))
        with pytest.raises(ValueError, match=match):
            jax.jit(traced)(*[arrays[n] for n in names])


def test_fake_infers_the_tree_output_and_compile_serves_it():
    """guard"""
    import torch._dynamo
    a = tree_args()
    eager = dict(a, state=a["state"].clone())
    out = verify(eager)
    with FakeTensorMode() as mode:
        fo = verify(fakes(a, mode))
    assert (fo.shape, fo.dtype, fo.device) == (out.shape, out.dtype, out.device) == ((1, T, HV, V), a["v"].dtype,
                                                                                       a["v"].device)
    torch._dynamo.reset()
    compiled = dict(a, state=a["state"].clone())
    got = torch.compile(verify, fullgraph=True, backend="eager")(compiled)
    assert torch.equal(got, out) and torch.equal(compiled["state"], eager["state"])
    want, pool = ref(a)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager["state"].double(), pool.double(), rtol=1e-5, atol=1e-5)
    assert out.abs().max() > 0.01
    chain = verify(dict(a, state=a["state"].clone(), parent_tokens=None))
    assert not torch.equal(out[0, 4], chain[0, 4])       # the branch matters


def test_trace_of_refused_and_served_tree_calls(tmp_path, monkeypatch):
    """guard"""
    import safetensors.torch
    from flashkda_ext import trace
    monkeypatch.setattr(trace.emission, "_warned", set())
    bad = tree_args()
    bad["parent_tokens"][1, 1] = 1
    with trace.tracing(str(tmp_path)), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"^parent_tokens: entry \[1, 1\] = 1"):
            verify(bad)
        assert not any(tmp_path.rglob("*"))
        a = tree_args()
        verify(a)
    (path,) = (tmp_path / "definitions").rglob("*.json")
    assert path.stem.endswith("_tree_cpu")
    (line,) = (tmp_path / "workloads").rglob("*.jsonl")
    src = json.loads(line.read_text())["workload"]["inputs"]["parent_tokens"]
    saved = safetensors.torch.load_file(str(tmp_path / src["path"]))[src["tensor_key"]]
    assert saved.dtype == torch.int32 and torch.equal(saved, a["parent_tokens"])
