"""kda_verify with a second, read-only start-state pool (initial_state, initial_state_indices) and with
step rows (state [R, T_max, HV, V, K], state_indices [N]) on the CPU backend: against the reference on
fresh random data (outputs poisoned first), padding and out-of-range start indices and rows, initial_state
apart from state and identical to it, step rows bitwise the slot table they stand for, refusals naming
the argument (cold and warm, nothing written), and the binding's own checks (docs/semantics.md, "Verify")."""
from __future__ import annotations

import random

import pytest
import torch

from flashkda_ext import fast_path, jit, ops, validation
from flashkda_ext import reference as R
from flashkda_ext.devtools.testing import call_outcome
from verify_cases import clone, reference, run

H, HV, K, V = 2, 4, 8, 16  # K != V: a transposed state cannot pass


def cold():
    ops.clear_call_caches()


@pytest.fixture(autouse=True)
def fresh():
    cold()
    yield
    cold()


def gen_():
    return torch.Generator().manual_seed(random.SystemRandom().randrange(2 ** 31))


def make(gen, lens, cols, *, init_slots=5, state_dtype=torch.float32, dtype=torch.float32, starts=None):
    """Fresh random arguments: requests of lens tokens, state_indices [N, cols] of distinct slots of a pool
    with spare slots, a second pool of init_slots slots and one start index per request (starts, or random)."""
    N, T = len(lens), sum(lens)
    slots = N * cols + 3
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    idx = torch.randperm(slots, generator=gen)[:N * cols].reshape(N, cols).to(torch.int32)
    if starts is None:
        starts = torch.randint(0, init_slots, (N,), generator=gen).tolist()
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
                state=(torch.randn(slots, HV, V, K, generator=gen) * 0.5).to(state_dtype), state_indices=idx,
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
                A_log=torch.randn(HV, generator=gen) * 0.3, dt_bias=torch.randn(HV * K, generator=gen) * 0.5,
                initial_state=(torch.randn(init_slots, HV, V, K, generator=gen) * 0.5).to(state_dtype),
                initial_state_indices=torch.tensor(starts, dtype=torch.int32))


def poisoned_out(a):
    return torch.full((1, a["q"].shape[1], HV, V), float("nan"), dtype=a["v"].dtype)


def check_against_reference(a, tol):
    pool0, init0 = a["state"].clone(), a["initial_state"].clone()
    ref_out, ref_pool = reference(a)
    out = run(a)
    assert out is a["out"] and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(a["state"].double(), ref_pool.double(), **tol)
    assert torch.equal(a["initial_state"], init0) or a["initial_state"] is a["state"], "initial_state was written"
    # slots no live token names stay bitwise unchanged; a padding request outputs zeros, writes nothing
    plan = R.verify_plan(a["cu_seqlens"], a["state_indices"], None, pool0.shape[0], a.get("null_slot0", False),
                         initial_state_indices=a["initial_state_indices"], initial_slots=a["initial_state"].shape[0])
    written = {w for s, e, read, ws in plan if read is not None for w in ws if w is not None}
    for s in range(pool0.shape[0]):
        if s not in written:
            assert torch.equal(a["state"][s], pool0[s]), f"slot {s} is not written but changed"
    for s, e, read, _ in plan:
        if read is None:
            assert torch.equal(out[0, s:e], torch.zeros_like(out[0, s:e]))
    return plan


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens, cols, starts", [
    ([3, 1, 2], 3, None),                    # random start slots (repeats allowed: a read-only pool)
    ([2, 0, 2, 1], 2, [4, 0, -1, 2]),        # an empty request, a padding start (-1) between live ones
    ([1, 1, 1], 1, [3, -7, 3]),              # T_max = 1: the verify module, not kda_decode
    ([4, 2, 0, 3], 4, [-1, -1, -1, -1]),     # every request padding: zeros, nothing written
])
def test_second_pool_matches_reference(state_dtype, lens, cols, starts):
    a = make(gen_(), lens, cols, state_dtype=state_dtype, starts=starts)
    a["out"] = poisoned_out(a)
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    plan = check_against_reference(a, tol)
    for (s, e, read, _), n0 in zip(plan, a["initial_state_indices"].tolist()):
        assert (read is None) == (n0 < 0)


def test_start_state_is_the_second_pool_bitwise():
    """Request n from initial_state[i] equals the same call without initial_state whose read slot holds a
    copy of initial_state[i]: the second pool changes where the start state is read, nothing else."""
    gen = gen_()
    a = make(gen, [3, 2, 3], 3, state_dtype=torch.bfloat16, dtype=torch.bfloat16, starts=[1, 4, 1])
    b = clone(a)
    for n, i in enumerate(a["initial_state_indices"].tolist()):
        b["state"][int(b["state_indices"][n, 0])] = a["initial_state"][i]
    del b["initial_state"], b["initial_state_indices"]
    assert torch.equal(run(a), run(b)) and torch.equal(a["state"], b["state"])


def test_null_slot0_makes_start_index_0_padding():
    a = make(gen_(), [2, 2], 2, starts=[0, 3])
    a["null_slot0"] = True
    a["out"] = poisoned_out(a)
    plan = check_against_reference(a, dict(atol=1e-5, rtol=1e-5))
    assert plan[0][2] is None and plan[1][2] == 3


def test_initial_state_may_be_state_itself():
    """The same pool as both: requests start from slots of state as it was before the call, provided no
    other request writes them (the rule without initial_state); a request may start from a slot it writes."""
    gen = gen_()
    a = make(gen, [3, 2, 1], 3)
    idx = a["state_indices"]
    free = sorted(set(range(a["state"].shape[0])) - set(idx.flatten().tolist()))
    a["initial_state"] = a["state"]
    a["initial_state_indices"] = torch.tensor([int(idx[0, 2]), free[0], free[0]], dtype=torch.int32)
    a["out"] = poisoned_out(a)
    check_against_reference(a, dict(atol=1e-5, rtol=1e-5))
    # reading a slot another request writes is refused, naming initial_state_indices, nothing written
    b = make(gen, [3, 2, 1], 3)
    b["initial_state"] = b["state"]
    spare = sorted(set(range(b["state"].shape[0])) - set(b["state_indices"].flatten().tolist()))[0]
    b["initial_state_indices"] = torch.tensor([int(b["state_indices"][1, 0]), spare, -1], dtype=torch.int32)
    c = call_outcome(run, b, ("state",))
    assert c[0] == "raise" and c[2].startswith("initial_state_indices:") and "request 1 writes" in c[2], c


def _missing_indices(a):
    del a["initial_state_indices"]


def _missing_pool(a):
    del a["initial_state"]


def _with_accepted(a):
    a["num_accepted_tokens"] = torch.ones(3, dtype=torch.int32)


def _other_dtype(a):
    a["initial_state"] = a["initial_state"].to(torch.bfloat16)


def _other_heads(a):
    a["initial_state"] = torch.randn(5, HV, K, V)


def _int64_indices(a):
    a["initial_state_indices"] = a["initial_state_indices"].long()


def _short_indices(a):
    a["initial_state_indices"] = a["initial_state_indices"][:2]


def _out_of_range(a):
    a["initial_state_indices"] = torch.tensor([0, 5, 1], dtype=torch.int32)   # 5 slots


def _overlaps_state(a):
    a["initial_state"] = a["state"][2:]                  # neither apart from state nor state itself


def _overlaps_written_out(a):
    init = torch.randn(5 * HV * V * K)
    a["initial_state"] = init.view(5, HV, V, K)
    a["out"] = init[:8 * HV * V].view(1, 8, HV, V)


BAD = [(_missing_indices, "initial_state_indices"), (_missing_pool, "initial_state"),
       (_with_accepted, "num_accepted_tokens"), (_other_dtype, "initial_state"), (_other_heads, "initial_state"),
       (_int64_indices, "initial_state_indices"), (_short_indices, "initial_state_indices"),
       (_out_of_range, "initial_state_indices"), (_overlaps_state, "state"), (_overlaps_written_out, "out")]


def _base(gen):
    return make(gen, [3, 2, 3], 3)


def assert_refused_cold_and_warm(bad, good, argname, *, fast_entries=None):
    """bad() is refused naming argname with the state unwritten, cold and again after good() armed the fast
    path (with fast_entries entries, where given), the same way both times."""
    c = call_outcome(run, bad(), ("state",))
    assert c[0] == "raise" and c[1] in (TypeError, ValueError), c
    assert c[2].startswith(f"{argname}:"), c[2]
    cold()
    assert call_outcome(run, good(), ("state",))[0] == "ok"  # arms the fast path
    if fast_entries is not None:
        assert fast_path.size() == fast_entries
    w = call_outcome(run, bad(), ("state",))
    assert (c[0], c[1], c[2]) == (w[0], w[1], w[2])


@pytest.mark.parametrize("change,argname", BAD, ids=[c.__name__ for c, _ in BAD])
def test_bad_input_names_the_argument_writes_nothing_cold_and_warm(change, argname):
    seed = random.SystemRandom().randrange(2 ** 31)

    def bad():  # built afresh for each call (a clone would undo the overlaps)
        a = _base(torch.Generator().manual_seed(seed))
        change(a)
        return a
    assert_refused_cold_and_warm(bad, lambda: _base(gen_()), argname, fast_entries=1)


def test_valid_warm_call_takes_the_fast_path_and_equals_cold(monkeypatch):
    gen = gen_()
    a = _base(gen)
    c = call_outcome(run, clone(a), ("state",))
    cold()
    assert call_outcome(run, _base(gen), ("state",))[0] == "ok"
    checks = []
    real = validation.check_kda_verify
    monkeypatch.setattr(validation, "check_kda_verify", lambda *x, **k: checks.append(1) or real(*x, **k))
    w = call_outcome(run, clone(a), ("state",))
    assert checks == [], "the warm call was checked in full"
    assert torch.equal(c[1], w[1]) and torch.equal(c[2], w[2])
    # a warm call whose start index is out of range is refused by the host value check, as cold
    b = clone(a)
    b["initial_state_indices"] = torch.tensor([0, 9, 1], dtype=torch.int32)
    assert call_outcome(run, b, ("state",))[2].startswith("initial_state_indices:")


def test_binding_checks_the_second_pool_itself():
    """The last line of defence: the CPU module refuses what validation refuses, naming the argument."""
    a = _base(gen_())
    fn = jit.load_module("cpu_kda_verify")["kda_verify"]
    out = torch.empty(1, 8, HV, V)

    def call(init=a["initial_state"], idx=a["initial_state_indices"], nacc=None):
        fn(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"], a["state_indices"],
           a["cu_seqlens"], nacc, init, idx, None, out, 0, 0.0, K ** -0.5, True, False)

    pool0 = a["state"].clone()
    for kw, name in ((dict(idx=None), "initial_state_indices"), (dict(init=None), "initial_state"),
                     (dict(nacc=torch.ones(3, dtype=torch.int32)), "num_accepted_tokens"),
                     (dict(idx=torch.tensor([0, 5, 1], dtype=torch.int32)), "initial_state_indices"),
                     (dict(idx=torch.tensor([0, 1], dtype=torch.int32)), "initial_state_indices"),
                     (dict(init=a["initial_state"].double()), "initial_state"),
                     (dict(init=a["state"][1:]), "initial_state")):
        with pytest.raises(ValueError, match=f"'{name}'"):
            call(**kw)
        assert torch.equal(a["state"], pool0)
    call()  # the untouched arguments are valid
    assert not torch.equal(a["state"], pool0)


def test_custom_op_takes_the_second_pool():
    """torch.ops.flashkda_ext.kda_verify (the torch.compile / export node) passes both through."""
    a = _base(gen_())
    b = clone(a)
    out = torch.empty(1, 8, HV, V)
    torch.ops.flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["state_indices"],
                                      a["cu_seqlens"], None, None, a["A_log"], a["dt_bias"], None, "softplus", None,
                                      True, False, out, a["initial_state"], a["initial_state_indices"])
    assert torch.equal(out, run(b)) and torch.equal(a["state"], b["state"])


# ---------------------------------------------------------------------------------------------
# step rows: state [R, T_max, HV, V, K], state_indices [N] (one row of T_max slots per request)


def step_rows(gen, lens, cols, rows, *, R=6, starts=None, state_dtype=torch.float32):
    """make()'s call on step rows: a buffer of R rows of cols slots and one row per request (rows)."""
    a = make(gen, lens, cols, state_dtype=state_dtype, starts=starts)
    a["state"] = (torch.randn(R, cols, HV, V, K, generator=gen) * 0.5).to(state_dtype)
    a["state_indices"] = torch.tensor(rows, dtype=torch.int32)
    return a


def as_table(a):
    """The same call on the R * T_max slots with the [N, T_max] table step rows stand for (a padding row:
    -1 everywhere and, with initial_state, a padding start)."""
    R, cols = a["state"].shape[:2]
    rows = a["state_indices"].tolist()
    pad = [r < 0 or (a.get("null_slot0", False) and r == 0) for r in rows]
    b = dict(a, state=a["state"].clone().view(R * cols, HV, V, K), state_indices=torch.tensor(
        [[-1] * cols if p else [r * cols + t for t in range(cols)] for r, p in zip(rows, pad)], dtype=torch.int32))
    if "initial_state_indices" in a:
        b["initial_state_indices"] = a["initial_state_indices"].masked_fill(torch.tensor(pad), -1)
    return b


@pytest.mark.parametrize("second_pool", [True, False])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens, cols, rows, starts", [
    ([3, 1, 2], 3, [4, 0, 2], [1, 3, 1]),
    ([2, 0, 2, 1], 2, [5, 1, -1, 3], [4, 0, 2, -1]),   # an empty request; a padding row; a padding start
    ([1, 1, 1], 1, [2, -1, 0], [0, 1, 4]),             # T_max = 1: the verify module, not kda_decode
    ([3, 2], 3, [-1, 1], [2, 2]),                       # a padding row with a live start: padding
])
def test_step_rows_are_the_slot_table_bitwise_and_match_reference(second_pool, state_dtype, lens, cols, rows, starts):
    gen = gen_()
    a = step_rows(gen, lens, cols, rows, starts=starts, state_dtype=state_dtype)
    if not second_pool:
        del a["initial_state"], a["initial_state_indices"]
        a["num_accepted_tokens"] = torch.randint(1, cols + 1, (len(lens),), generator=gen, dtype=torch.int32)
    a["out"] = poisoned_out(a)
    b = as_table(dict(a, out=poisoned_out(a)))
    ref_out, ref_pool = reference(a)
    buf0 = a["state"].clone()
    out = run(a)
    assert out is a["out"] and torch.isfinite(out).all()
    assert torch.equal(out, run(b)) and torch.equal(a["state"].view(b["state"].shape), b["state"])
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(a["state"].double(), ref_pool.double(), **tol)
    offsets = a["cu_seqlens"].tolist()
    for n, r in enumerate(rows):
        s, e = offsets[n], offsets[n + 1]
        if r < 0 or (second_pool and starts[n] < 0):  # a padding request: zeros, its row untouched
            assert torch.equal(out[0, s:e], torch.zeros_like(out[0, s:e]))
            if r >= 0:
                assert torch.equal(a["state"][r], buf0[r])
        elif r >= 0:
            assert torch.equal(a["state"][r, e - s:], buf0[r, e - s:]), "steps past T_n changed"
    for r in set(range(a["state"].shape[0])) - set(rows):
        assert torch.equal(a["state"][r], buf0[r]), f"row {r} is named by nobody but changed"


def _rows_table_of_2d(a):
    a["state_indices"] = a["state_indices"].view(-1, 1).expand(-1, 3).contiguous()


def _rows_out_of_range(a):
    a["state_indices"] = torch.tensor([1, 6, 2], dtype=torch.int32)    # R = 6


def _rows_with_a_table_state(a):
    a["state"] = a["state"][:, 0].contiguous()


def _rows_apart(a):
    a["state"] = torch.randn(6, 4, HV, V, K)[:, :3]                     # rows 4 steps apart, 3 steps each


def _rows_initial_state_inside(a):
    a["initial_state"] = a["state"][2]                                 # a row of the buffer itself


ROW_BAD = [(_rows_table_of_2d, "state_indices"), (_rows_out_of_range, "state_indices"),
           (_rows_with_a_table_state, "state_indices"), (_rows_apart, "state"),
           (_rows_initial_state_inside, "state")]


@pytest.mark.parametrize("change,argname", ROW_BAD, ids=[c.__name__ for c, _ in ROW_BAD])
def test_step_rows_bad_input_names_the_argument_writes_nothing_cold_and_warm(change, argname):
    seed = random.SystemRandom().randrange(2 ** 31)

    def base():
        return step_rows(torch.Generator().manual_seed(seed), [3, 2, 3], 3, [4, 0, 2], starts=[0, 2, 1])

    def bad():
        a = base()
        change(a)
        return a
    assert_refused_cold_and_warm(bad, base, argname)


def test_binding_checks_step_rows_itself():
    a = step_rows(gen_(), [3, 2, 3], 3, [4, 0, 2])
    fn = jit.load_module("cpu_kda_verify")["kda_verify"]
    out = torch.empty(1, 8, HV, V)

    def call(state=a["state"], idx=a["state_indices"]):
        fn(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], state, idx, a["cu_seqlens"], None,
           a["initial_state"], a["initial_state_indices"], None, out, 0, 0.0, K ** -0.5, True, False)

    buf0 = a["state"].clone()
    for kw, name in ((dict(idx=torch.tensor([4, 6, 2], dtype=torch.int32)), "state_indices"),
                     (dict(idx=torch.zeros(3, 3, dtype=torch.int32)), "state_indices"),
                     (dict(state=torch.randn(6, 4, HV, V, K)[:, :3]), "state")):
        with pytest.raises(ValueError, match=f"'{name}'"):
            call(**kw)
        assert torch.equal(a["state"], buf0)
    call()
    assert not torch.equal(a["state"], buf0)


def test_second_pool_with_slots_apart_equals_the_dense_one_bitwise():
    """initial_state may be a strided pool (slots a page apart, as vLLM pages them): the same results."""
    a = _base(gen_())
    b = clone(a)
    n = HV * V * K
    pages = torch.randn(a["initial_state"].shape[0], n + 12)      # 48 bytes of filler a slot
    b["initial_state"] = pages[:, 8:8 + n].view(a["initial_state"].shape)
    b["initial_state"].copy_(a["initial_state"])
    filler = pages.clone()
    assert not b["initial_state"].is_contiguous()
    assert torch.equal(run(a), run(b)) and torch.equal(a["state"], b["state"])
    assert torch.equal(pages, filler), "initial_state (or the memory between its slots) was written"
