"""kda_verify's draft trees (parent_tokens [N, T_max]: token t >= 1 continues from the state stored after its
token parent_tokens[n, t]) on the CPU backend: the reference's own meaning (each token its root path run as
a chain), the op against it, parents t - 1 bitwise the chain, every refused value named before anything is
written (through the op and through the CPU module itself), the torch custom op, and their trace (the
definition, its reference, the consumer's drawn trees).
The CUDA kernels: tests/gpu/test_verify_tree_gpu.py."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import safetensors.torch
import torch

import flashkda_ext as F
from flashkda_ext import jit
from flashkda_ext import reference as R

H, HV, K, V = 2, 4, 16, 8
SLOTS = 40


def case(lens, cols, seed=0, state_dtype=torch.float32, parents=None):
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    idx = torch.randperm(SLOTS, generator=gen)[:N * cols].reshape(N, cols).to(torch.int32)
    if parents is None:
        parents = torch.randint(-5, 50, (N, cols), generator=gen, dtype=torch.int32)  # junk where never read
        for n, L in enumerate(lens):
            for t in range(1, L):
                parents[n, t] = int(torch.randint(0, t, (1,), generator=gen))
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
                A_log=r(HV) * 0.3, dt_bias=r(HV * K), state=(r(SLOTS, HV, V, K) * 0.5).to(state_dtype),
                state_indices=idx, cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(),
                                                           dtype=torch.int32),
                num_accepted_tokens=torch.randint(1, cols + 1, (N,), generator=gen, dtype=torch.int32),
                parent_tokens=torch.as_tensor(parents, dtype=torch.int32))


def op(a, **kw):
    args = {k: a[k] for k in ("q", "k", "v", "g", "beta")}
    rest = {k: v for k, v in a.items() if k not in args}
    return F.kda_verify(*args.values(), **dict(rest, **kw))


def ref(a):
    rest = {k: v for k, v in a.items() if k not in ("q", "k", "v", "g", "beta")}
    return R.kda_verify_step(a["q"], a["k"], a["v"], a["g"], a["beta"], **rest)


def test_reference_runs_each_token_as_its_root_path():
    """The reference's tree: token t's output is the last output of the chain root .. t (its parents) run from
    the request's start slot."""
    lens, cols = [5, 3], 5
    a = case(lens, cols, seed=1)
    out, _ = ref(a)
    starts = [0, 5]
    for n, L in enumerate(lens):
        read = int(a["state_indices"][n, int(a["num_accepted_tokens"][n]) - 1])
        for t in range(L):
            path = [t]
            while path[-1] > 0:
                path.append(int(a["parent_tokens"][n, path[-1]]))
            rows = [starts[n] + j for j in reversed(path)]
            P = len(rows)
            b = {k: a[k][:, rows] for k in ("q", "k", "v", "g", "beta")}
            b.update(A_log=a["A_log"], dt_bias=a["dt_bias"], state=a["state"],
                     state_indices=torch.tensor([list(range(P))], dtype=torch.int32) + SLOTS - P,
                     cu_seqlens=torch.tensor([0, P], dtype=torch.int32))
            b["state"] = a["state"].clone()
            b["state"][SLOTS - P] = a["state"][read]   # the chain starts from the tree's start state
            o, _ = ref(b)
            torch.testing.assert_close(o[0, P - 1], out[0, starts[n] + t], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,cols", [([4, 2, 4, 1], 4), ([8, 5, 1, 8], 8), ([3, 0, 3], 3)])
def test_op_matches_reference(lens, cols, state_dtype):
    a = case(lens, cols, seed=len(lens) * 10 + cols, state_dtype=state_dtype)
    want_out, want_pool = ref(a)
    pool0 = a["state"].clone()
    out = torch.full((1, sum(lens), HV, V), math.nan)
    op(a, out=out)
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(a["state"].double(), want_pool.double(), **tol)
    written = {int(a["state_indices"][n, t]) for n, L in enumerate(lens) for t in range(L)}
    for s in range(SLOTS):
        if s not in written:
            assert torch.equal(a["state"][s], pool0[s]), s


def test_parents_t_minus_1_equal_the_chain_bitwise():
    lens, cols = [4, 3, 4], 4
    a = case(lens, cols, seed=3, parents=(torch.arange(4) - 1).repeat(3, 1))
    b = dict(a, state=a["state"].clone())
    b.pop("parent_tokens")
    assert torch.equal(op(a), op(b)) and torch.equal(a["state"], b["state"])
    c = case(lens, cols, seed=3)   # a real tree differs
    assert not torch.equal(op(c), op(dict(b, state=c["state"].clone())))


def test_step_rows_take_a_tree():
    """The step-row pool (state [R, T_max, ...], one row a request, as SGLang's buffer): bitwise the slot table
    it stands for."""
    lens, cols = [4, 3], 4
    a = case(lens, cols, seed=4)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    buf = torch.randn(4, cols, HV, V, K)
    table = (rows.view(-1, 1) * cols + torch.arange(cols)).to(torch.int32)
    flat = buf.clone().view(4 * cols, HV, V, K)
    b = dict(a, state=flat, state_indices=table, num_accepted_tokens=None)
    s = dict(a, state=buf, state_indices=rows, num_accepted_tokens=None)
    assert torch.equal(op(b), op(s)) and torch.equal(flat, buf.view(4 * cols, HV, V, K))


BAD = [
    (lambda a: a["parent_tokens"].__setitem__((0, 2), 2), r"^parent_tokens: entry \[0, 2\] = 2; expected"),
    (lambda a: a["parent_tokens"].__setitem__((1, 1), -1), r"^parent_tokens: entry \[1, 1\] = -1; expected"),
    (lambda a: (a["parent_tokens"].__setitem__((0, 3), 1), a["state_indices"].__setitem__((0, 1), -1)),
     r"^parent_tokens: entry \[0, [23]\] = 1 names a token whose state is not stored"),
    (lambda a: a.__setitem__("parent_tokens", a["parent_tokens"].long()), r"^parent_tokens: expected dtype int32"),
    (lambda a: a.__setitem__("parent_tokens", a["parent_tokens"][:, :3].contiguous()), r"^parent_tokens: expected \[N, T_max\]"),
    (lambda a: a.__setitem__("parent_tokens", a["parent_tokens"].t().contiguous().t()), r"^parent_tokens: .*contiguous"),
]


def bad_case(mutate, seed):
    """Two requests of 4 tokens from their column 0, mutated; the pool before and a NaN-poisoned out."""
    a = case([4, 4], 4, seed=seed)
    a["num_accepted_tokens"].fill_(1)
    mutate(a)
    return a, a["state"].clone(), torch.full((1, 8, HV, V), math.nan)


@pytest.mark.parametrize("mutate,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_op_refuses_bad_parents_naming_them_and_writes_nothing(mutate, match):
    a, pool0, out = bad_case(mutate, seed=5)
    for _ in range(2):   # the first call and every later one
        with pytest.raises(ValueError, match=match):
            op(a, out=out)
        assert torch.equal(a["state"], pool0) and out.isnan().all()


def test_a_padding_request_skips_the_stored_state_rule():
    """A request whose read entry is padding reads and writes nothing: its parents need not name stored
    states (their range is still checked)."""
    a = case([3, 3], 3, seed=6, parents=[[0, 0, 1], [0, 0, 1]])
    a["num_accepted_tokens"].fill_(1)
    a["state_indices"][1] = torch.tensor([-1, -1, 7], dtype=torch.int32)
    out = op(a)
    assert torch.equal(out[0, 3:], torch.zeros(3, HV, V))


@pytest.mark.parametrize("mutate,match", BAD[:3], ids=["after", "negative", "not_stored"])
def test_cpu_module_refuses_bad_parents_itself(mutate, match):
    """The last line of defence: the CPU module's own checks, naming the argument, nothing written."""
    a, pool0, out = bad_case(mutate, seed=7)
    fn = jit.load_module("cpu_kda_verify")["kda_verify"]
    with pytest.raises(ValueError, match=r"'parent_tokens'"):
        fn(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"], a["state_indices"],
           a["cu_seqlens"], a["num_accepted_tokens"], None, None, a["parent_tokens"], out, 0, 0.0, K ** -0.5, True,
           False)
    assert torch.equal(a["state"], pool0) and out.isnan().all()


def test_custom_op_and_fake_take_parent_tokens():
    """torch.ops.flashkda_ext.kda_verify (what torch.compile records) serves a tree as the op does."""
    a = case([4, 2], 4, seed=8)
    b = dict(a, state=a["state"].clone())
    want = op(b)
    out = torch.full_like(want, math.nan)
    torch.ops.flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["state_indices"],
                                      a["cu_seqlens"], a["num_accepted_tokens"], None, a["A_log"], a["dt_bias"],
                                      None, "softplus", None, True, False, out, None, None, a["parent_tokens"])
    assert torch.equal(out, want) and torch.equal(a["state"], b["state"])
    from torch._subclasses.fake_tensor import FakeTensorMode
    narrow = a["parent_tokens"][:, :3].contiguous()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fa = {k: mode.from_tensor(v) if torch.is_tensor(v) else v for k, v in a.items()}
        fa["parent_tokens"] = mode.from_tensor(narrow)
        with pytest.raises(ValueError, match=r"^parent_tokens: expected \[N, T_max\]"):
            torch.ops.flashkda_ext.kda_verify(
                fa["q"], fa["k"], fa["v"], fa["g"], fa["beta"], fa["state"], fa["state_indices"], fa["cu_seqlens"],
                fa["num_accepted_tokens"], None, fa["A_log"], fa["dt_bias"], None, "softplus", None, True, False,
                torch.empty(1, 6, HV, V), None, None, fa["parent_tokens"])


# ---------------------------------------------------------------------------------------------
# the trace: tree calls are traced, their reference is the op, the consumer draws valid trees

TREE_TAG = "domain:parent_tokens=tree_parents(max_draft)"


def trace_call(a, trace_dir):
    """The op on case a, traced without a warning: (out, the definition, its one workload line)."""
    from flashkda_ext import trace
    with trace.tracing(str(trace_dir)), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = op(a)
    (path,) = (trace_dir / "definitions").rglob("*.json")
    d = json.loads(path.read_text())
    (line,) = [json.loads(x) for x in (trace_dir / trace.workloads_relpath(d)).read_text().splitlines()]
    trace.validate_definition(d)
    trace.validate_workload_line(line, d)
    return out, d, line


def saved_index(line, name, trace_dir):
    src = line["workload"]["inputs"][name]
    assert src["type"] == "safetensors", name
    return safetensors.torch.load_file(str(trace_dir / src["path"]))[src["tensor_key"]]


def run_reference(d, line, data, trace_dir, **index):
    """The definition's rendered reference on the workload's saved index tensors (`index` overrides some)
    and the call's own data tensors `data`."""
    namespace = {}
    exec(compile(d["reference"], "<emitted reference>", "exec"), namespace)
    kw = {}
    for name, src in line["workload"]["inputs"].items():
        if src["type"] == "safetensors":
            kw[name] = saved_index(line, name, trace_dir)
        else:
            kw[name] = src["value"] if src["type"] == "scalar" else data[name]
    return namespace["run"](**dict(kw, **index))


def branches(parents, cu_seqlens):
    """Entries a request reads that are not the chain's t - 1."""
    cu = cu_seqlens.tolist()
    return sum(int(parents[n, t]) != t - 1 for n in range(len(cu) - 1) for t in range(1, cu[n + 1] - cu[n]))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_trace_writes_a_tree_definition_whose_reference_is_the_op(state_dtype, tmp_path, monkeypatch):
    from flashkda_ext import trace
    monkeypatch.setattr(trace.emission, "_warned", set())
    a = case([4, 2, 3], 4, seed=9, state_dtype=state_dtype)
    assert branches(a["parent_tokens"], a["cu_seqlens"])          # a real tree
    data = {k: v.clone() for k, v in a.items()}                   # as before the op writes the pool
    out, d, line = trace_call(a, tmp_path)
    assert "_tree" in d["name"] and TREE_TAG in d["tags"]
    spec = d["inputs"]["parent_tokens"]
    assert spec["shape"] == ["num_seqs", "max_draft"] and spec["dtype"] == "int32"
    saved = saved_index(line, "parent_tokens", tmp_path)
    assert saved.dtype == torch.int32 and torch.equal(saved, data["parent_tokens"])
    ref_out, ref_state = run_reference(d, line, data, tmp_path)
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ref_out, out, **tol)
    torch.testing.assert_close(ref_state.float(), a["state"].float(), **tol)
    # the parents matter: the same reference over the chain computes something else
    chain = (torch.arange(4) - 1).repeat(3, 1).to(torch.int32)
    assert not torch.allclose(run_reference(d, line, data, tmp_path, parent_tokens=chain)[0], out, atol=1e-2)


def test_traced_padding_request_needs_no_stored_parent(tmp_path):
    """The reference keeps the op's exception: a padding request's parents need only be in range."""
    a = case([3, 3], 3, seed=6, parents=[[0, 0, 1], [0, 0, 1]])
    a["num_accepted_tokens"].fill_(1)
    a["state_indices"][1] = torch.tensor([-1, -1, 7], dtype=torch.int32)
    data = {k: v.clone() for k, v in a.items()}
    out, d, line = trace_call(a, tmp_path)
    ref_out, ref_state = run_reference(d, line, data, tmp_path)
    torch.testing.assert_close(ref_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_state, a["state"], rtol=1e-5, atol=1e-5)


def test_a_chain_call_keeps_its_definition():
    """A tree adds one name part, one input and one tag; a chain call's definition is the tree call's built
    with tree False, as it was before trees were traced."""
    from flashkda_ext import trace, validation

    def facts(args):
        return trace.facts("kda_verify", validation.check_kda_verify(**args), args)

    a = case([4, 2, 3], 4, seed=9)
    tree = facts(a)
    chain = facts({k: v for k, v in a.items() if k != "parent_tokens"})
    assert tree["tree"] and not chain["tree"]
    d_chain, d_tree = trace.build_definition("kda_verify", chain), trace.build_definition("kda_verify", tree)
    assert d_chain == trace.definitions._build_definition("kda_verify", dict(tree, tree=False))
    assert d_chain["name"] == "kda_verify_h2_hv4_dk16_dv8_f32state_f32in_cpu"
    assert list(d_chain["inputs"]) == ["q", "k", "v", "g", "beta", "state", "state_indices", "cu_seqlens",
                                       "num_accepted_tokens", "A_log", "dt_bias", "scale"]
    assert d_tree["name"] == "kda_verify_h2_hv4_dk16_dv8_f32state_f32in_tree_cpu"
    assert list(d_tree["inputs"]) == list(d_chain["inputs"]) + ["parent_tokens"]
    assert [t for t in d_tree["tags"] if t != TREE_TAG] == d_chain["tags"] and TREE_TAG in d_tree["tags"]


@pytest.mark.parametrize("mutate,match", BAD[:3], ids=["after", "negative", "not_stored"])
def test_trace_reference_refuses_bad_parents_naming_them(mutate, match, tmp_path):
    a, _, _ = bad_case(lambda a: None, seed=10)
    data = {k: v.clone() for k, v in a.items()}
    _, d, line = trace_call(a, tmp_path)
    mutate(data)
    with pytest.raises(ValueError, match=match):
        run_reference(d, line, data, tmp_path, parent_tokens=data["parent_tokens"],
                      state_indices=data["state_indices"])


def tree_call(layout, seed=11):
    """A tree call of 4 requests (T_max = 4) with a slot table and num_accepted_tokens, a start pool, or step rows
    (one a padding row)."""
    a = case([4, 2, 3, 4], 4, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    if layout == "init":
        a.update(initial_state=torch.randn(6, HV, V, K, generator=gen), num_accepted_tokens=None,
                 initial_state_indices=torch.tensor([5, -1, 0, 2], dtype=torch.int32))
    if layout == "rows":
        a.update(state=torch.randn(6, 4, HV, V, K, generator=gen),
                 state_indices=torch.tensor([5, 0, -1, 3], dtype=torch.int32))
    return a


@pytest.mark.parametrize("layout", ["table", "init", "rows"])
def test_consumer_draws_trees_the_op_accepts(layout):
    """index_tensors' parent_tokens (drawn with the definition's other index tensors) pass the op's value checks,
    branch, and meet the requests whose token 0 stores nowhere (which the draw makes padding)."""
    from flashkda_ext import trace, trace_consumer, validation
    a = tree_call(layout)
    f = trace.facts("kda_verify", validation.check_kda_verify(**a), a)
    d = trace.build_definition("kda_verify", f)
    axes = trace.build_workload("kda_verify", f, d, a)["workload"]["axes"]
    branched = unstored_roots = 0
    for seed in range(8):
        idx = trace_consumer.index_tensors(d, axes, seed=seed)
        assert set(idx) == set(trace.index_inputs("kda_verify", d)) and "parent_tokens" in idx
        b = dict(a, state=a["state"].clone(), **idx)
        op(b)                    # the CPU op checks every value: a bad parent is a ValueError naming it
        branched += branches(idx["parent_tokens"], idx["cu_seqlens"])
        if layout != "rows":
            lengths = torch.diff(idx["cu_seqlens"])
            unstored_roots += int(((idx["state_indices"][:, 0] < 0) & (lengths >= 2)).sum())
    assert branched > 0
    assert layout == "rows" or unstored_roots > 0


def test_a_tree_whose_parents_cannot_be_read_is_not_traced(tmp_path, monkeypatch):
    """parent_tokens is an index input the workload stores: without its values (meta, or CUDA graph capture)
    the call is not traced, with the one warning of that path."""
    from flashkda_ext import trace, validation
    monkeypatch.setattr(trace.emission, "_warned", set())
    a = case([4, 2], 4, seed=12)
    call = validation.check_kda_verify(**a)
    with trace.tracing(str(tmp_path)), pytest.warns(RuntimeWarning, match="index tensors cannot be read"):
        assert trace.emit("kda_verify", call, dict(a, parent_tokens=a["parent_tokens"].to("meta"))) is None
    assert not any(tmp_path.rglob("*.json*"))
