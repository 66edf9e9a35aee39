"""Bad-input campaign 23 (CPU backend): kda_verify's draft trees (`parent_tokens` [N, T_max] int32, tag
`domain:parent_tokens=tree_parents(max_draft)`) through the trace consumer and the trace templates' reference, driven
as an operator would with hand-edited or corrupted definitions and workloads. Each case failed before its fix, except
those marked "guard" (behaviour that was already right, pinned beside the fixes).

- reference (trace_templates/reference/kda_verify.py, the emitted `run`): parent_tokens was read with int() entry by
  entry: a float table was truncated (1.5 -> 1) and a bool one taken as 0 / 1, both served; a table of another shape
  was cut to fit ([N, T_max + 1], served) or failed unnamed ([N - 1, T_max]: IndexError, 1-D: TypeError). Now an
  integer tensor [N, T_max] (T_max: state_indices' columns, a step row's steps) or a ValueError / TypeError naming
  parent_tokens.
- consumer index_tensors, the tree tag: a malformed domain tag (`tree_parents(-1)`, `tree_parents(2.5)`) did not
  match the tag pattern and was silently dropped, so no parent table was drawn (make_workload then left the input to
  flashinfer-bench's random int32); `tree_parents(0)`, `tree_parents` with no axis, an unknown axis or two axes were
  a bare KeyError; a tag naming another axis than the table's columns (`tree_parents(num_slots)`) or an input whose
  shape is not [num_seqs, T_max] (1-D, [num_seqs, num_slots]) drew a table of another shape than the definition's;
  a float32 / bool parent_tokens was drawn in that dtype (bool: every parent 0 / 1); a tag without its input was a
  KeyError, an input without its tag was not drawn; a tree tag on a kda_decode definition drew a table its op
  ignores. Each is now a ValueError naming the tag or input.
- guard: the drawn tables are valid trees (parents in [0, t) naming a stored token for every live request) for
  every seed and layout (slot table, start pool, step rows, null_slot0) at N, T_max in {1, 2, 3}; the reference
  accepts each and the op on them equals the reference; N = 0 and T_max = 0 are refused by the constraints.
- guard: the reference still refuses a parent >= t and a negative one where it is read, and takes junk in the
  entries it never reads (column 0, past a request's tokens).
"""
from __future__ import annotations

import copy

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext import trace, trace_consumer, validation

H, HV, K, V = 1, 2, 8, 8
TAG = "domain:parent_tokens=tree_parents(max_draft)"


def tree_args(layout="table", N=3, cols=3, lens=(3, 1, 2), seed=0, null_slot0=False):
    """A valid tree call: request 0 branches (token 2 off token 0)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    T = sum(lens)
    a = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
             A_log=r(HV) * 0.3, dt_bias=r(HV * K), state=r(20, HV, V, K) * 0.5,
             state_indices=(torch.arange(N * cols, dtype=torch.int32).reshape(N, cols) + 1),
             cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
             num_accepted_tokens=torch.ones(N, dtype=torch.int32),
             parent_tokens=(torch.arange(cols) - 1).clamp(min=0).repeat(N, 1).to(torch.int32))
    a["parent_tokens"][0, 2] = 0
    if null_slot0:
        a["null_slot0"] = True
    if layout == "init":
        a.update(initial_state=r(6, HV, V, K), num_accepted_tokens=None,
                 initial_state_indices=torch.arange(N, dtype=torch.int32) + 1)
    if layout == "rows":
        a.update(state=r(N + 2, cols, HV, V, K), state_indices=torch.arange(N, dtype=torch.int32) + 1)
    return a


def definition(a):
    f = trace.facts("kda_verify", validation.check_kda_verify(**a), a)
    d = trace.build_definition("kda_verify", f)
    return d, trace.build_workload("kda_verify", f, d, a)["workload"]["axes"]


def op(a):
    a = dict(a)
    return fk.kda_verify(*[a.pop(n) for n in ("q", "k", "v", "g", "beta")], **a)


def reference(d, a, **override):
    """The definition's emitted reference on the call's inputs (by name, in the definition's order)."""
    namespace = {}
    exec(compile(d["reference"], "<emitted reference>", "exec"), namespace)
    kw = dict(a, **override)
    if "scale" not in kw:
        kw["scale"] = K ** -0.5
    return namespace["run"](**{n: kw.get(n) for n in d["inputs"]})


@pytest.fixture(scope="module")
def tree():
    a = tree_args()
    d, axes = definition(a)
    assert TAG in d["tags"]
    return a, d, axes


# ---------------------------------------------------------------------------------------------
# the reference


@pytest.mark.parametrize("bad", ["float", "bool", "wider", "fewer_rows", "narrower", "flat"])
def test_reference_refuses_a_parent_table_it_would_truncate_or_cut(tree, bad):
    a, d, _ = tree
    p = a["parent_tokens"]
    table = {"float": p.float() + 0.5, "bool": p.bool(), "wider": torch.cat([p, p[:, :1]], 1),
             "fewer_rows": p[:-1], "narrower": p[:, :-1], "flat": p.flatten()}[bad]
    with pytest.raises((ValueError, TypeError), match="parent_tokens"):
        reference(d, a, parent_tokens=table)


def test_reference_checks_the_entries_it_reads_and_only_those(tree):   # guard
    a, d, _ = tree
    for t, p in ((2, 2), (2, -1), (1, 5)):
        bad = a["parent_tokens"].clone()
        bad[0, t] = p
        with pytest.raises(ValueError, match=rf"parent_tokens: entry \[0, {t}\]"):
            reference(d, a, parent_tokens=bad)
    junk = a["parent_tokens"].clone()
    junk[:, 0] = -7                 # column 0: never read
    junk[1, 1:] = 99                # request 1 has one token
    want_out, want_state = reference(d, a)
    out, state = reference(d, a, parent_tokens=junk)
    assert torch.equal(out, want_out) and torch.equal(state, want_state)


# ---------------------------------------------------------------------------------------------
# the consumer: the tree tag and its input


def retag(d, tag):
    d = copy.deepcopy(d)
    d["tags"] = [tag if t == TAG else t for t in d["tags"]]
    return d


@pytest.mark.parametrize("tag", ["tree_parents(-1)", "tree_parents(2.5)", "tree_parents(max draft)",
                                 "tree_parents(0)", "tree_parents", "tree_parents(max_drafts)",
                                 "tree_parents(max_draft,num_seqs)", "tree_parents(num_slots)",
                                 "tree_parents(num_seqs)"])
def test_index_tensors_refuses_a_bad_tree_tag_naming_it(tree, tag):
    _, d, axes = tree
    with pytest.raises(ValueError, match=r"domain:parent_tokens="):
        trace_consumer.index_tensors(retag(d, f"domain:parent_tokens={tag}"), axes)


@pytest.mark.parametrize("change", ["no_input", "no_tag", "float32", "bool", "int64", "flat", "num_slots_cols",
                                    "scalar"])
def test_index_tensors_refuses_a_bad_parent_tokens_input_naming_it(tree, change):
    _, d, axes = tree
    d = copy.deepcopy(d)
    spec = d["inputs"]["parent_tokens"]
    if change == "no_input":
        del d["inputs"]["parent_tokens"]
    elif change == "no_tag":
        d["tags"].remove(TAG)
    elif change in ("float32", "bool", "int64"):
        spec["dtype"] = change
    elif change == "flat":
        spec["shape"] = ["num_seqs"]
    elif change == "num_slots_cols":
        spec["shape"] = ["num_seqs", "num_slots"]
    else:
        spec["shape"] = None
    with pytest.raises(ValueError, match="parent_tokens"):
        trace_consumer.index_tensors(d, axes)


def test_index_tensors_refuses_a_tree_tag_on_another_op():
    from bad_input_cases import decode_args
    a = decode_args()
    b = dict(a)
    call = validation.check_kda_decode(*[b.pop(n) for n in ("q", "k", "v", "g", "beta")], **b)
    f = trace.facts("kda_decode", call, a)
    d = copy.deepcopy(trace.build_definition("kda_decode", f))   # the cached definition is shared: a copy
    d["tags"].append("domain:parent_tokens=tree_parents(rows)")
    d["inputs"]["parent_tokens"] = dict(shape=["rows", "rows"], dtype="int32")
    with pytest.raises(ValueError, match=r"tree_parents.*kda_verify"):
        trace_consumer.index_tensors(d, dict(rows=3, num_slots=6))


# ---------------------------------------------------------------------------------------------
# guard: drawn trees at the smallest shapes, every layout, many seeds


def valid_tree(idx, layout, null_slot0):
    pad = lambda s: s < 0 or (null_slot0 and s == 0)  # noqa: E731
    cu, p = idx["cu_seqlens"].tolist(), idx["parent_tokens"]
    si = idx["state_indices"]
    for n in range(len(cu) - 1):
        L = cu[n + 1] - cu[n]
        stored = [not pad(int(si[n])) for _ in range(L)] if layout == "rows" else [not pad(int(x)) for x in si[n, :L]]
        if layout == "init":
            live = not pad(int(idx["initial_state_indices"][n]))
        elif layout == "rows":
            live = stored[0] if L else False
        else:
            live = not pad(int(si[n, int(idx["num_accepted_tokens"][n]) - 1]))
        for t in range(1, L):
            q = int(p[n, t])
            assert 0 <= q < t and (not live or stored[q]), (n, t, q, idx)


@pytest.mark.parametrize("layout", ["table", "init", "rows"])
@pytest.mark.parametrize("null_slot0", [False, True])
def test_drawn_trees_are_valid_at_every_small_shape(layout, null_slot0):
    d, _ = definition(tree_args(layout, null_slot0=null_slot0))
    served = 0
    for N in (1, 2, 3):
        for cols in (1, 2, 3):
            for T in range(N, N * cols + 1):
                axes = dict(total_tokens=T, num_seqs=N, max_draft=cols, num_seqs_p1=N + 1)
                axes.update({"num_rows": N + 2} if layout == "rows" else {"num_slots": N * cols + 2})
                if layout == "init":
                    axes["num_initial_slots"] = N + 1
                axes = {k: v for k, v in axes.items() if k in d["axes"]}
                if trace_consumer.check_call(d, axes):
                    continue
                for seed in range(6):
                    idx = trace_consumer.index_tensors(d, axes, seed=seed)
                    assert idx["parent_tokens"].shape == (N, cols) and idx["parent_tokens"].dtype == torch.int32
                    valid_tree(idx, layout, null_slot0)
                if (N, cols, T) == (2, 3, 5):       # served equals the reference
                    a = tree_args(layout, N=N, cols=cols, lens=(3, 2), null_slot0=null_slot0)
                    a.update(trace_consumer.index_tensors(d, axes, seed=3))
                    want_out, want_state = reference(d, a)
                    b = dict(a, state=a["state"].clone())
                    out = op(b)
                    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(b["state"], want_state, rtol=1e-5, atol=1e-5)
                    served += 1
    assert served == 1
    for zero in (dict(num_seqs=0, num_seqs_p1=1, total_tokens=0), dict(max_draft=0)):
        axes = dict(total_tokens=2, num_seqs=2, max_draft=2, num_seqs_p1=3, num_slots=8, num_rows=4,
                    num_initial_slots=3, **{})
        axes = {k: v for k, v in dict(axes, **zero).items() if k in d["axes"]}
        with pytest.raises(ValueError, match="violate"):
            trace_consumer.index_tensors(d, axes)
