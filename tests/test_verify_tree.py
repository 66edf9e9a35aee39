"""kda_verify's draft trees (parent_tokens [N, T_max]: token t >= 1 continues from the state stored after its
token parent_tokens[n, t]) on the CPU backend: the reference's own meaning (each token its root path run as
a chain), the op against it, parents t - 1 bitwise the chain, every refused value named before anything is
written (through the op and through the CPU module itself), the torch custom op, and the trace's refusal.
The CUDA kernels: tests/gpu/test_verify_tree_gpu.py."""
from __future__ import annotations

import math
import warnings

import pytest
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


def test_trace_leaves_a_tree_untraced_with_a_warning(tmp_path, monkeypatch):
    from flashkda_ext import trace
    from flashkda_ext.trace import emission
    monkeypatch.setattr(emission, "_warned", set())
    a = case([4, 2], 4, seed=9)
    with trace.tracing(str(tmp_path)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            op(a)
    assert any("parent_tokens" in str(x.message) for x in w)
    assert not any(tmp_path.rglob("*.json*"))
