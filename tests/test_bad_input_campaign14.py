"""Bad-input campaign 14 (CPU only): context-parallel pieces, on/off environment variables and the opt-in list,
and the PyTorch reference. Each case failed before its fix, except those marked "guard".

- context_parallel: Plan's accessors took a negative rank or sequence as an index from the end (token_range(-1)
  gave (T, 0)) and raised a bare IndexError past the end; check_checkpoints took a bool, a float or a negative
  count; segment_summary took transition / one_call by truth value, passed any keyword on to kda_prefill and read
  shapes before checking them; apply_summary and fold broadcast or failed inside torch on mismatched shapes,
  read lists of the wrong length as far as the plan went, and dropped A of a rank that should send a state;
  cp_prefill / simulate took a max_seqlen above T (the checkpoint tensor was sized from it).
- FLASHKDA_EXT_FAST_PATH and FLASHKDA_EXT_NATIVE_FLAGS were off only for exactly "0": "false" or "off" meant on.
- dispatch's opted_in="persistent" (a str) opted in to its letters, i.e. to nothing.
- reference: int() truncated float offsets and indices, str flags were taken by truth value, an integer compute
  dtype gave integer outputs, NaN / str scale and lower_bound passed, a [K, HV] dt_bias was read as [HV, K].
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flashkda_ext import context_parallel as cp
from flashkda_ext import dispatch, flag_reader
from flashkda_ext import reference as R

H, HV, K, V = 1, 2, 8, 4
CU = [0, 10, 40, 52]


def rand(*s, seed=[1400]):
    seed[0] += 1
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed[0]))


def raises_twice(exc, match, fn):
    """The same named error on the first call and on a repeated one (nothing memoised past a refusal)."""
    for _ in range(2):
        with pytest.raises(exc, match=match):
            fn()


# ---------------------------------------------------------------------------------------------
# context_parallel: the plan's accessors

PLAN = cp.plan(CU, 4, cuts=[0, 15, 25, 25, 52])


@pytest.mark.parametrize("method", ["token_range", "head", "sends", "owned_finals"])
@pytest.mark.parametrize("rank", [-1, 4, 99])
def test_plan_rank_accessors_refuse_a_rank_outside_the_plan(method, rank):
    raises_twice(ValueError, r"rank: expected an int in \[0, 4\)", lambda: getattr(PLAN, method)(rank))


@pytest.mark.parametrize("method", ["pieces", "final_owner"])
@pytest.mark.parametrize("seq", [-1, 3])
def test_plan_sequence_accessors_refuse_a_sequence_outside_the_plan(method, seq):
    raises_twice(ValueError, r"seq: expected an int in \[0, 3\)", lambda: getattr(PLAN, method)(seq))


@pytest.mark.parametrize("bad", [True, 1.0])
def test_plan_accessors_refuse_a_bool_or_float_rank(bad):
    raises_twice(TypeError, "rank: expected an int", lambda: PLAN.token_range(bad))
    raises_twice(TypeError, "seq: expected an int", lambda: PLAN.pieces(bad))


def test_plan_accessors_in_range_guard():
    assert PLAN.token_range(3) == (25, 52) and PLAN.pieces(1) == (0, 1, 3) and PLAN.final_owner(2) == 3


@pytest.mark.parametrize("bad, exc", [(True, TypeError), (2.5, TypeError), ("4", TypeError), (-1, ValueError)])
def test_check_checkpoints_refuses_what_is_not_a_count(bad, exc):
    raises_twice(exc, "checkpoint_every: expected an int >= 0", lambda: PLAN.check_checkpoints(bad))


# ---------------------------------------------------------------------------------------------
# context_parallel: segment_summary, apply_summary, fold


def segment(L=7):
    return [rand(1, L, H, K), rand(1, L, H, K), rand(1, L, HV, V), rand(1, L, HV, K), rand(1, L, HV)]


GATE = dict(A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K))


@pytest.mark.parametrize("name", ["transition", "one_call"])
@pytest.mark.parametrize("bad", ["no", None, 0, 1])
def test_segment_summary_flags_must_be_bools(name, bad):
    raises_twice(TypeError, f"{name}: expected a bool", lambda: cp.segment_summary(*segment(), **{name: bad}, **GATE))


@pytest.mark.parametrize("extra", [dict(cu_seqlens=torch.tensor([0, 3, 7])), dict(checkpoint_every=2),
                                   dict(initial_state=torch.zeros(1, HV, V, K)), dict(foo=1)])
def test_segment_summary_takes_gate_arguments_only(extra):
    name = next(iter(extra))
    raises_twice(TypeError, f"{name}: segment_summary passes on kda_prefill's gate arguments only",
                 lambda: cp.segment_summary(*segment(), **extra, **GATE))


@pytest.mark.parametrize("bad", [torch.bfloat16, torch.int32, "float32", torch.float16])
def test_segment_summary_state_dtype_is_named(bad):
    raises_twice(ValueError, "state_dtype: expected torch.float32 or torch.float64",
                 lambda: cp.segment_summary(*segment(), state_dtype=bad, **GATE))


def test_segment_summary_checks_shapes_before_reading_them():
    q, k, v, g, beta = segment()
    raises_twice(TypeError, "q: expected a torch.Tensor", lambda: cp.segment_summary(None, k, v, g, beta, **GATE))
    raises_twice(ValueError, "q: expected a 4-D tensor", lambda: cp.segment_summary(q[0], k, v, g, beta, **GATE))
    raises_twice(ValueError, "v: expected a 4-D tensor", lambda: cp.segment_summary(q, k, v[0], g, beta, **GATE))
    two = [torch.cat([x, x]) for x in (q, k, v, g, beta)]
    raises_twice(ValueError, r"q: expected one sequence \[1, L, H, K\]", lambda: cp.segment_summary(*two, **GATE))


def test_segment_summary_default_guard():
    s = cp.segment_summary(*segment(), **GATE)
    assert s.A.shape == (HV, K, K) and s.B.shape == (HV, V, K) and s.A.dtype == torch.float32


def test_apply_summary_refuses_mismatched_shapes_and_types():
    A, B, S = rand(HV, K, K), rand(HV, V, K), rand(HV, V, K)
    good = cp.Summary(A, B)
    raises_twice(TypeError, "summary: expected a flashkda_ext.context_parallel.Summary",
                 lambda: cp.apply_summary(S, (A, B)))
    raises_twice(ValueError, r"state: expected shape \[HV, V, K\]", lambda: cp.apply_summary(S.transpose(1, 2), good))
    raises_twice(ValueError, "state: expected a 3-D tensor", lambda: cp.apply_summary(S[None], good))
    raises_twice(ValueError, "state: expected a floating-point tensor", lambda: cp.apply_summary(S.int(), good))
    # a B of [1, V, K] or [K] broadcast in baddbmm before
    raises_twice(ValueError, "summary.A: expected shape", lambda: cp.apply_summary(S, cp.Summary(A, B[:1])))
    raises_twice(ValueError, "summary.B: expected a 3-D tensor", lambda: cp.apply_summary(S, cp.Summary(A, B[0, 0])))
    raises_twice(ValueError, "summary.A: expected shape",
                 lambda: cp.apply_summary(S, cp.Summary(rand(HV, K, K + 1), B)))
    # the state is checked with A None too (it used to be ignored unread)
    raises_twice(TypeError, "state: expected a torch.Tensor", lambda: cp.apply_summary("S", cp.Summary(None, B)))
    torch.testing.assert_close(cp.apply_summary(S, good), torch.baddbmm(B.double(), S.double(), A.double()))  # guard


def fold_inputs():
    state = cp.Summary(None, rand(HV, V, K))        # rank 0 starts sequence 1
    span = cp.Summary(rand(HV, K, K), rand(HV, V, K))  # rank 1 lies inside it
    return [state, span, None, None]


@pytest.mark.parametrize("summaries", [lambda s: s[:2], lambda s: s[:1], lambda s: s + [None], lambda s: None,
                                       lambda s: "junk"])
def test_fold_needs_one_entry_per_rank(summaries):
    raises_twice(ValueError, "summaries: expected a list of world_size = 4 entries",
                 lambda: cp.fold(summaries(fold_inputs()), PLAN))


def test_fold_refuses_entries_of_the_wrong_kind_or_shape():
    s = fold_inputs()
    raises_twice(TypeError, "plan: expected a flashkda_ext.context_parallel.Plan", lambda: cp.fold(s, "plan"))
    raises_twice(TypeError, r"summaries\[3\]: expected a Summary or None", lambda: cp.fold(s[:3] + ["x"], PLAN))
    raises_twice(TypeError, r"summaries\[0\]: expected a Summary or None",
                 lambda: cp.fold([(None, s[0].B)] + s[1:], PLAN))
    # rank 0 sends its end state: a map (A, B) had its A dropped and B taken as the state
    raises_twice(ValueError, r"summaries\[0\]: rank 0 starts sequence 1 and sends its end state",
                 lambda: cp.fold([s[1], s[1], None, None], PLAN))
    raises_twice(ValueError, r"summaries\[1\].B: expected shape", lambda: cp.fold(
        [cp.Summary(None, rand(1, V, K)), s[1], None, None], PLAN))
    raises_twice(ValueError, r"summaries\[0\].B: expected a floating-point tensor", lambda: cp.fold(
        [cp.Summary(None, torch.ones(HV, V, K, dtype=torch.int64)), s[1], None, None], PLAN))
    incoming = cp.fold(s, PLAN)  # guard
    assert incoming[0] is None and incoming[2] is None and torch.equal(incoming[1], s[0].B)


@pytest.mark.parametrize("every", [0, 5])
def test_simulate_refuses_max_seqlen_above_T_and_writes_nothing(every):
    T = CU[-1]
    q, k, v, g, beta = rand(1, T, H, K), rand(1, T, H, K), rand(1, T, HV, V), rand(1, T, HV, K), rand(1, T, HV)
    pool = rand(5, HV, V, K)
    before = pool.clone()
    for bad in (T + 1, 2**40):
        raises_twice(ValueError, f"max_seqlen: expected an int <= the plan's T = {T}", lambda: cp.simulate(
            q, k, v, g, beta, plan=PLAN, state=pool, state_indices=torch.tensor([1, 3, 2], dtype=torch.int32),
            checkpoint_every=every, max_seqlen=bad, **GATE))
    assert torch.equal(pool, before)
    res = cp.simulate(q, k, v, g, beta, plan=PLAN, checkpoint_every=every, max_seqlen=T, **GATE)  # guard: T is fine
    assert len(res) == 4


# ---------------------------------------------------------------------------------------------
# on/off environment variables; the opt-in list


@pytest.mark.parametrize("raw, want", [("", True), (" 1", True), ("yes", True), ("ON", True), ("0", False),
                                       ("false", False), (" off ", False), ("No", False)])
def test_native_flags_switch_words(monkeypatch, raw, want):
    monkeypatch.setenv("FLASHKDA_EXT_NATIVE_FLAGS", raw)
    assert flag_reader.wanted() is want


@pytest.mark.parametrize("raw", ["2", "-1", "1.5", "enable", "0 0"])
def test_native_flags_refuses_what_is_not_a_switch(monkeypatch, raw):
    monkeypatch.setenv("FLASHKDA_EXT_NATIVE_FLAGS", raw)
    raises_twice(ValueError, "FLASHKDA_EXT_NATIVE_FLAGS=.* is not a switch", flag_reader.wanted)


def _fast_path_enabled(raw):
    env = dict(os.environ, FLASHKDA_EXT_FAST_PATH=raw)
    return subprocess.run([sys.executable, "-c", "from flashkda_ext import fast_path; print(fast_path.ENABLED)"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_fast_path_off_by_a_word():
    r = _fast_path_enabled("false")
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stderr


def test_fast_path_refuses_what_is_not_a_switch_at_import():
    r = _fast_path_enabled("2")
    # switches.SwitchError, a ValueError
    assert r.returncode != 0 and "SwitchError: FLASHKDA_EXT_FAST_PATH='2' is not a switch" in r.stderr, r.stderr


@pytest.mark.parametrize("bad, exc", [("persistent", TypeError), (b"persistent", TypeError), (5, TypeError)])
def test_opted_in_must_be_a_collection_of_names(bad, exc):
    meta = dict(device="cpu")
    raises_twice(exc, "opted_in: expected a collection of opt-in names",
                 lambda: dispatch.select_rule("kda_decode", meta, bad))


def test_opt_in_env_with_blanks_and_duplicates_guard(monkeypatch):
    monkeypatch.setenv(dispatch.OPT_IN_ENV, " persistent,, persistent ,")
    assert dispatch.opt_in() == frozenset({"persistent"})
    monkeypatch.setenv(dispatch.OPT_IN_ENV, "persistent, Persistent")
    raises_twice(ValueError, r"FLASHKDA_EXT_OPT_IN=.* names unknown opt-in route\(s\) \['Persistent'\]",
                 dispatch.opt_in)


# ---------------------------------------------------------------------------------------------
# the reference

T = 6


def prompt():
    return dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, HV, V), g=rand(1, T, HV, K), beta=rand(1, T, HV))


@pytest.mark.parametrize("fn", [R.kda_recurrent, R.kda_chunked])
@pytest.mark.parametrize("cu, exc, match", [
    ([0, 2.7, 6], TypeError, "cu_seqlens: expected ints, got float 2.7"),         # int() gave 2
    (torch.tensor([0.0, 2.5, 6.0]), ValueError, "cu_seqlens: expected an integer tensor"),
    ([False, True, 6], TypeError, "cu_seqlens: expected ints, got bool"),
    (torch.tensor([[0, 3], [3, 6]]), ValueError, "cu_seqlens: expected a 1-D tensor"),
    (6, TypeError, "cu_seqlens: expected a 1-D integer tensor or a list of ints")])
def test_reference_offsets_are_host_ints(fn, cu, exc, match):
    raises_twice(exc, match, lambda: fn(**prompt(), cu_seqlens=cu, **GATE))


@pytest.mark.parametrize("idx, match", [(torch.tensor([1.7]), "state_indices: expected an integer tensor"),
                                        (torch.tensor([True]), "state_indices: expected an integer tensor"),
                                        (torch.tensor([[1]]), "state_indices: expected a 1-D tensor")])
def test_reference_prefill_state_indices_are_ints(idx, match):
    raises_twice(ValueError, match, lambda: R.kda_recurrent(**prompt(), initial_state=rand(4, HV, V, K),
                                                            state_indices=idx, **GATE))


@pytest.mark.parametrize("name, bad, exc", [
    ("scale", float("nan"), ValueError), ("scale", 0.0, ValueError), ("scale", True, TypeError),
    ("scale", "0.5", TypeError), ("beta_is_logit", "no", TypeError), ("beta_is_logit", None, TypeError),
    ("output_final_state", "no", TypeError), ("null_slot0", "x", TypeError),
    ("checkpoint_every", True, TypeError), ("checkpoint_every", 2.0, TypeError), ("checkpoint_every", None, TypeError),
    ("dtype", torch.int32, ValueError), ("dtype", torch.bfloat16, ValueError), ("dtype", "float64", ValueError)])
def test_reference_scalars_are_named(name, bad, exc):
    raises_twice(exc, f"{name}: expected", lambda: R.kda_recurrent(**prompt(), **{name: bad}, **GATE))


@pytest.mark.parametrize("name, bad, exc", [("chunk_size", True, TypeError), ("chunk_size", 2.5, TypeError),
                                            ("chunk_size", None, TypeError), ("checkpoint_every", 2.0, TypeError)])
def test_reference_chunked_counts_are_named(name, bad, exc):
    raises_twice(exc, f"{name}: expected an int", lambda: R.kda_chunked(**prompt(), **{name: bad}, **GATE))


@pytest.mark.parametrize("bad, exc", [("-5", TypeError), (float("-inf"), ValueError), (float("nan"), ValueError),
                                      (True, TypeError), ([-5.0], TypeError), (0.0, ValueError)])
def test_reference_lower_bound_is_a_finite_negative_float(bad, exc):
    raises_twice(exc, "lower_bound: expected a finite float < 0",
                 lambda: R.kda_recurrent(**prompt(), gate="bounded", lower_bound=bad))


def test_reference_gate_parameters_are_checked():
    # a [K, HV] dt_bias has HV*K entries too: it was read as [HV, K]
    raises_twice(ValueError, r"dt_bias: expected shape \[HV\*K\]", lambda: R.kda_recurrent(
        **prompt(), A_log=torch.zeros(HV), dt_bias=torch.zeros(K, HV)))
    raises_twice(TypeError, "A_log: expected a torch.Tensor", lambda: R.kda_recurrent(
        **prompt(), A_log=[0.0, 0.0], dt_bias=torch.zeros(HV * K)))
    raises_twice(ValueError, "A_log: gate='log' takes g as the final log decay", lambda: R.kda_recurrent(
        **prompt(), gate="log", **GATE))
    raises_twice(ValueError, "dt_bias: gate='log' takes g as the final log decay", lambda: R.kda_recurrent(
        **prompt(), gate="log", dt_bias=GATE["dt_bias"]))
    raises_twice(ValueError, r"g: expected \[..., HV, K\]", lambda: R.gate_log_decay(rand(4), "softplus", **GATE))
    raises_twice(ValueError, "eps: expected a finite float >= 0", lambda: R.l2norm(rand(3), eps=-1.0))


def test_reference_gate_guards():
    # an unused lower_bound stays accepted (callers pass one bound for every gate); [1, HV*K] dt_bias reads as [HV*K]
    a = R.kda_recurrent(**(p := prompt()), lower_bound=-4.0, **GATE)[0]
    b = R.kda_recurrent(**p, A_log=GATE["A_log"], dt_bias=GATE["dt_bias"][None])[0]
    assert torch.equal(a, b)


def test_reference_tensors_are_checked_before_their_shapes_are_read():
    p = prompt()
    raises_twice(TypeError, "q: expected a torch.Tensor", lambda: R.kda_recurrent(**dict(p, q=None), **GATE))
    raises_twice(ValueError, "v: expected a 4-D tensor", lambda: R.kda_recurrent(**dict(p, v=p["v"][0]), **GATE))
    raises_twice(ValueError, "q: expected at least one head", lambda: R.kda_recurrent(
        **dict(p, q=rand(1, T, 0, K), k=rand(1, T, 0, K)), **GATE))
    raises_twice(ValueError, "q: expected a real-valued tensor", lambda: R.kda_recurrent(
        **dict(p, q=p["q"].to(torch.complex64)), **GATE))


def test_reference_decode_and_verify_indices_are_named():
    rows = 3
    d = dict(q=rand(rows, H, K), k=rand(rows, H, K), v=rand(rows, HV, V), g=rand(rows, HV, K), beta=rand(rows, HV))
    pool = rand(5, HV, V, K)
    raises_twice(ValueError, "state_indices: expected an integer tensor", lambda: R.kda_decode_step(
        **d, state=pool, state_indices=torch.tensor([0.0, 1.7, 2.0]), **GATE))
    raises_twice(ValueError, "v: expected a 3-D tensor", lambda: R.kda_decode_step(
        **dict(d, v=d["v"][None]), state=pool, state_indices=torch.tensor([0, 1, 2]), **GATE))
    p = dict(q=rand(1, 4, H, K), k=rand(1, 4, H, K), v=rand(1, 4, HV, V), g=rand(1, 4, HV, K), beta=rand(1, 4, HV))
    table, cu = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([0, 2, 4])
    raises_twice(ValueError, "cu_seqlens: expected an integer tensor", lambda: R.kda_verify_step(
        **p, state=pool, state_indices=table, cu_seqlens=cu.float(), **GATE))
    raises_twice(ValueError, "state_indices: expected an integer tensor", lambda: R.kda_verify_step(
        **p, state=pool, state_indices=table.float(), cu_seqlens=cu, **GATE))
    raises_twice(ValueError, "num_accepted_tokens: expected N = 2 entries", lambda: R.kda_verify_step(
        **p, state=pool, state_indices=table, cu_seqlens=cu, num_accepted_tokens=torch.tensor([1]), **GATE))
    raises_twice(ValueError, "num_accepted_tokens: expected an integer tensor", lambda: R.kda_verify_step(
        **p, state=pool, state_indices=table, cu_seqlens=cu, num_accepted_tokens=torch.tensor([1.0, 2.9]), **GATE))
