"""Bad-input campaign 30 (CPU only): context-parallel prefill driven as an operator drives it: flashkda_ext.cp_plan,
flashkda_ext.cp_prefill over a one-process gloo group and over two spawned gloo processes (every collective under a
gloo timeout, the spawn under a deadline, so a deadlock fails instead of hanging), simulate(), and segment_summary
directly. A refusal must name the argument and come before anything is written or sent: the caller's pool is poisoned
with NaN in its unaddressed slots and compared bit for bit, and a spy counts kda_prefill calls (none) and exchange
rounds (the agreement round only). A served call must equal one-device kda_prefill on the whole unsplit prompt within
the CPU float32 tolerance tests/test_context_parallel.py uses (rtol 2e-6, atol 1e-6), and cp_prefill must be bitwise
what simulate() gives its rank. Each case failed before its fix, except those marked "guard".

- segment_summary(one_call=True) doubled g, beta, A_log and dt_bias to 2 HV value heads before kda_prefill checked
  anything, so kda_prefill saw only the doubled arguments: HV % H != 0 (H = 2, HV = 3 or 1: 2 HV % H == 0) was served
  as a meaningless map where the two-call form refuses it; a dt_bias [K, HV] (or [1, HV, K]) was reshaped to [HV, K]
  by element count and served scrambled; a non-contiguous g or v was served; a dt_bias of another element count
  failed as a bare RuntimeError ("shape '[2, 4]' is invalid"), a 2-D beta as IndexError, a list as AttributeError;
  a wrong A_log or g was named with doubled sizes ("A_log: expected shape [HV] = [4], got [6]" for a [3] A_log
  beside HV = 2). Now the caller's arguments get the two-call form's check first (after its own V == K rule): every
  bad input is refused as the two-call form refuses it.
- cp_prefill: a q alone of another length than the plan's range was refused naming k ("k: expected shape ... (same
  as q) = [1, 11, ...], got [1, 12, ...]"), the argument that was right: q is now checked against the plan first.
- guard: cp_plan's refusals (offsets not rising / not from 0 / float / on meta, world sizes 0 / negative / bool /
  float, cuts out of order / out of range / not covering T / of another count, misaligned checkpoints), int64 offsets
  past int32 kept exactly, world sizes above the token count (empty ranges) served; cp_prefill's refusals (plan of
  another world size, states of the wrong shape / dtype / device, pool indices, gate arguments, beta_is_logit, mixed
  devices, layouts read by element count) write and send nothing; served gates x beta_is_logit x state modes, dt_bias
  [HV, K], scale and checkpoints equal one-device prefill.
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import flashkda_ext as fk
from flashkda_ext import context_parallel as cp
from flashkda_ext import ops
from flashkda_ext.reference import kda_recurrent
from gloo_ranks import one_rank_fixture, outcome as _outcome, ranks_fixture

H, HV, K, V = 1, 2, 8, 4            # grouped value heads, K != V (a transpose cannot pass)
CU = [0, 5, 5, 12, 20]              # an empty sequence; T = 20
T = CU[-1]
TOL = dict(rtol=2e-6, atol=1e-6)    # tests/test_context_parallel.py's CPU float32 bound
SLOTS = 6
IDX = [4, -1, 0, 2]                 # a padding index; slot 0 is padding too with null_slot0 (sequence 2)
LIVE = (4, 2)                       # the slots a pool call writes with null_slot0 (1, 3, 5 unaddressed)
GLOO_TIMEOUT = datetime.timedelta(seconds=5)
SPAWN_DEADLINE_S = 60


def inputs(cu=CU, seed=3000, gate="softplus", beta_is_logit=True, h=H, hv=HV, kd=K, vd=V):
    gen = torch.Generator().manual_seed(seed)
    t = cu[-1]

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    d = dict(q=randn(1, t, h, kd), k=randn(1, t, h, kd), v=randn(1, t, hv, vd),
             beta=randn(1, t, hv) if beta_is_logit else torch.rand(1, t, hv, generator=gen))
    if gate == "log":
        d["g"] = -torch.rand(1, t, hv, kd, generator=gen) * 0.6 - 0.01
        gk = dict(gate="log")
    else:
        d["g"] = randn(1, t, hv, kd)
        gk = dict(gate=gate, A_log=torch.rand(hv, generator=gen) - 1.0, dt_bias=randn(hv * kd) * 0.5)
        if gate == "bounded":
            gk["lower_bound"] = -3.0
    if not beta_is_logit:
        gk["beta_is_logit"] = False
    return d, gk


def whole(d):
    return [d[n] for n in ("q", "k", "v", "g", "beta")]


def mine(d, p, rank):
    a, b = p.token_range(rank)
    return [d[n][:, a:b].clone() for n in ("q", "k", "v", "g", "beta")]


def poisoned_pool(seed=7):
    """A pool whose unaddressed slots hold NaN (a refused or served call must keep their bits)."""
    pool = torch.randn(SLOTS, HV, V, K, generator=torch.Generator().manual_seed(seed))
    for s in range(SLOTS):
        if s not in LIVE:
            pool[s] = float("nan")
    return pool


def pool_kwargs(pool=None):
    return dict(state=poisoned_pool() if pool is None else pool, state_indices=torch.tensor(IDX, dtype=torch.int32),
                null_slot0=True)


def raw(x):
    return x.detach().reshape(-1).contiguous().view(torch.uint8)


def bitwise_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def raises_twice(exc, match, fn):
    """The same named error on the first call and on a repeated one."""
    for _ in range(2):
        with pytest.raises(exc, match=match):
            fn()


@pytest.fixture
def spy(monkeypatch):
    """Counts of kda_prefill calls and exchange rounds (all_gathers) made while the test runs."""
    seen = {"prefill": 0, "gather": 0}
    real_prefill, real_gather = ops.kda_prefill, cp.exchange.GroupExchange.gather

    def prefill(*a, **kw):
        seen["prefill"] += 1
        return real_prefill(*a, **kw)

    def gather(self, tensor):
        seen["gather"] += 1
        return real_gather(self, tensor)
    monkeypatch.setattr(ops, "kda_prefill", prefill)
    monkeypatch.setattr(cp.exchange.GroupExchange, "gather", gather)
    return seen


world1 = one_rank_fixture(GLOO_TIMEOUT.total_seconds())


# ---------------------------------------------------------------------------------------------
# cp_plan (guard)


def meta(x):
    return torch.tensor(x).to("meta")


PLAN_REFUSALS = {  # name: (args, kwargs, exception, message)
    "cu_not_rising": (([0, 10, 5, 20], 2), {}, ValueError,
        r"^cu_seqlens: expected non-decreasing offsets starting at 0"),
    "cu_not_from_0": (([2, 10, 20], 2), {}, ValueError, r"^cu_seqlens: expected non-decreasing offsets starting at 0"),
    "cu_negative": (([0, -3], 1), {}, ValueError, r"^cu_seqlens: expected non-decreasing"),
    "cu_float_list": (([0, 10.0, 20], 2), {}, TypeError, r"^cu_seqlens: expected ints, got float 10.0"),
    "cu_bool_in_list": (([0, True], 1), {}, TypeError, r"^cu_seqlens: expected ints, got bool"),
    "cu_float_tensor": ((torch.tensor([0.0, 10.0, 20.0]), 2), {}, ValueError,
                        r"^cu_seqlens: expected an integer tensor, got torch.float32"),
    "cu_bool_tensor": ((torch.tensor([False, True]), 1), {}, ValueError, r"^cu_seqlens: expected an integer tensor"),
    "cu_meta": ((meta(CU), 2), {}, ValueError, r"^cu_seqlens: expected host offsets .* got a tensor on meta"),
    "cu_2d": ((torch.tensor([CU]), 2), {}, ValueError, r"^cu_seqlens: expected a 1-D tensor"),
    "cu_one_offset": (([0], 1), {}, ValueError, r"^cu_seqlens: expected N\+1 >= 2 offsets"),
    "cu_range": ((range(0, 20, 5), 2), {}, TypeError, r"^cu_seqlens: expected a list or tuple of ints or a CPU tensor"),
    "world_0": ((CU, 0), {}, ValueError, r"^world_size: expected an int >= 1, got 0"),
    "world_negative": ((CU, -2), {}, ValueError, r"^world_size: expected an int >= 1, got -2"),
    "world_bool": ((CU, True), {}, TypeError, r"^world_size: expected an int >= 1, got bool True"),
    "world_float": ((CU, 2.0), {}, TypeError, r"^world_size: expected an int >= 1, got float"),
    "world_tensor": ((CU, torch.tensor(2)), {}, TypeError, r"^world_size: expected an int >= 1, got Tensor"),
    "world_none": ((CU, None), {}, TypeError, r"^world_size: expected an int >= 1, got NoneType"),
    "cuts_out_of_order": ((CU, 3, [0, 12, 8, 20]), {}, ValueError, r"^cuts: expected non-decreasing offsets"),
    "cuts_negative": ((CU, 3, [0, -1, 8, 20]), {}, ValueError, r"^cuts: expected non-decreasing offsets"),
    "cuts_past_T_inside": ((CU, 3, [0, 8, 25, 20]), {}, ValueError, r"^cuts: expected non-decreasing offsets"),
    "cuts_short_of_T": ((CU, 2, [0, 8, 19]), {}, ValueError, r"^cuts: expected offsets from 0 to T = 20"),
    "cuts_past_T": ((CU, 2, [0, 8, 21]), {}, ValueError, r"^cuts: expected offsets from 0 to T = 20"),
    "cuts_not_from_0": ((CU, 2, [1, 8, 20]), {}, ValueError, r"^cuts: expected offsets from 0 to T = 20"),
    "cuts_too_few": ((CU, 3, [0, 8, 20]), {}, ValueError, r"^cuts: expected world_size \+ 1 = 4 offsets, got 3"),
    "cuts_too_many": ((CU, 1, [0, 8, 20]), {}, ValueError, r"^cuts: expected world_size \+ 1 = 2 offsets, got 3"),
    "cuts_float": ((CU, 2, [0, 8.0, 20]), {}, TypeError, r"^cuts: expected ints, got float"),
    "cuts_float_tensor": ((CU, 2, torch.tensor([0.0, 8.0, 20.0])), {}, ValueError,
        r"^cuts: expected an integer tensor"),
    "cuts_meta": ((CU, 2, meta([0, 8, 20])), {}, ValueError, r"^cuts: expected host offsets .* on meta"),
    "cuts_str": ((CU, 2, "0,8,20"), {}, TypeError, r"^cuts: expected a list or tuple"),
    # cut 8 lies 3 tokens into sequence 2 (which starts at 5): not a multiple of 2
    "ckpt_misaligned_cut": ((CU, 2, [0, 8, 20]), dict(checkpoint_every=2), ValueError,
                            r"^plan: cut 1 at token 8 lies 3 tokens into sequence 2 \(which starts at 5\)"
                            r".*multiple of 2"),
    "ckpt_negative": ((CU, 2), dict(checkpoint_every=-4), ValueError, r"^checkpoint_every: expected an int >= 0"),
    "ckpt_bool": ((CU, 2), dict(checkpoint_every=True), TypeError,
        r"^checkpoint_every: expected an int >= 0, got bool"),
    "ckpt_float": ((CU, 2), dict(checkpoint_every=4.0), TypeError,
        r"^checkpoint_every: expected an int >= 0, got float"),
}


@pytest.mark.parametrize("name", list(PLAN_REFUSALS))
def test_cp_plan_refuses_bad_arguments_naming_them_guard(name):
    args, kwargs, exc, match = PLAN_REFUSALS[name]
    raises_twice(exc, match, lambda: fk.cp_plan(*args, **kwargs))


def test_cp_plan_keeps_int64_offsets_past_int32_exactly_guard():
    """Host integers: offsets past int32 (an int64 tensor, or a list) are kept exactly, never wrapped."""
    big = [0, 2**31 + 4, 2**33 + 6]
    for given in (big, tuple(big), torch.tensor(big, dtype=torch.int64)):
        p = fk.cp_plan(given, 2)
        assert p.cu_seqlens == tuple(big) and p.total_tokens == 2**33 + 6
        assert p.cuts == (0, (2**33 + 6) // 2, 2**33 + 6) and p.spanning_seqs() == (1,)
    # a uint8 / int16 / int32 host tensor gives the same plan as the list
    for dt in (torch.uint8, torch.int16, torch.int32):
        assert fk.cp_plan(torch.tensor(CU, dtype=dt), 3) == fk.cp_plan(CU, 3)


def test_cp_plan_default_cuts_snap_onto_checkpoints_guard():
    p = fk.cp_plan(CU, 2, checkpoint_every=4)   # the equal cut 10 lies 5 into sequence 2: moved back to 9
    assert p.cuts == (0, 9, 20)
    p.check_checkpoints(4)
    p.check_checkpoints(2)
    with pytest.raises(ValueError, match=r"^plan: cut 1 at token 9 lies 4 tokens into sequence 2.*multiple of 8"):
        p.check_checkpoints(8)


# ---------------------------------------------------------------------------------------------
# cp_prefill over a one-process gloo group: refusals write and send nothing


def _with(name, value):
    return lambda d: {**d, name: value}


GOOD = inputs()
D0, GATE0 = GOOD
P1 = cp.plan(CU, 1)


def _strided(x):
    """x's values in a non-contiguous layout (the dims after T stored in reverse order)."""
    return x.permute(0, 1, *range(x.dim() - 1, 1, -1)).contiguous().permute(0, 1, *range(x.dim() - 1, 1, -1))


CP_REFUSALS = {  # name: (tensor change, keyword change, pool mode, exception, message)
    # tokens: q alone (the fix), each other input alone, all of them
    "q_alone_short": (_with("q", D0["q"][:, :-1]), {}, True, ValueError,
                      r"^q: expected rank 0's 20 tokens \[0, 20\) of the plan, shape \[1, 20, H, K\], "
                      r"got \[1, 19, 1, 8\]"),
    "q_alone_long": (_with("q", torch.cat([D0["q"], D0["q"][:, :1]], 1)), {}, True, ValueError,
                     r"^q: expected rank 0's 20 tokens"),
    "k_short": (_with("k", D0["k"][:, :-1]), {}, True, ValueError, r"^k: expected shape \[B, T, H, K\] \(same as q\)"),
    "v_short": (_with("v", D0["v"][:, :-1]), {}, True, ValueError, r"^v: expected leading dims \[B, T\] = \[1, 20\]"),
    "g_short": (_with("g", D0["g"][:, :-1]), {}, True, ValueError,
        r"^g: expected shape \[B, T, HV, K\] = \[1, 20, 2, 8\]"),
    "beta_short": (_with("beta", D0["beta"][:, :-1]), {}, True, ValueError, r"^beta: expected shape \[B, T, HV\]"),
    "all_short": (lambda d: {n: x[:, :-1] for n, x in d.items()}, {}, True, ValueError, r"^q: expected rank 0's 20"),
    # the plan
    "plan_world_2": (None, dict(plan=cp.plan(CU, 2)), True, ValueError,
                     r"^plan: made for world_size = 2, but the group has 1 ranks"),
    "plan_world_5_over_20": (None, dict(plan=cp.plan(CU, 5)), True, ValueError, r"^plan: made for world_size = 5"),
    "plan_list": (None, dict(plan=CU), True, TypeError, r"^plan: expected a flashkda_ext.context_parallel.Plan"),
    "plan_other_prompt": (None, dict(plan=cp.plan([0, 12], 1)), True, ValueError, r"^q: expected rank 0's 12 tokens"),
    # dense initial_state
    "h0_wrong_N": (None, dict(initial_state=torch.zeros(3, HV, V, K)), False, ValueError,
                   r"^initial_state: expected shape \[N, HV, V, K\] with N = 4"),
    "h0_V_K_swapped": (None, dict(initial_state=torch.zeros(4, HV, K, V)), False, ValueError,
        r"^initial_state: expected shape"),
    "h0_float16": (None, dict(initial_state=torch.zeros(4, HV, V, K, dtype=torch.float16)), False, ValueError,
                   r"^initial_state: expected dtype in .* got float16"),
    "h0_int32": (None, dict(initial_state=torch.zeros(4, HV, V, K, dtype=torch.int32)), False, ValueError,
                 r"^initial_state: expected dtype"),
    "h0_meta": (None, dict(initial_state=torch.zeros(4, HV, V, K, device="meta")), False, ValueError,
                r"^initial_state: expected a tensor on cpu \(the device of q\), got meta"),
    "h0_transposed": (None, dict(initial_state=torch.zeros(4, HV, K, V).transpose(2, 3)), False, ValueError,
                      r"^initial_state: expected a contiguous tensor"),
    "h0_list": (None, dict(initial_state=[[0.0]]), False, TypeError, r"^initial_state: expected a torch.Tensor"),
    "h0_requires_grad": (None, dict(initial_state=torch.zeros(4, HV, V, K, requires_grad=True)), False, ValueError,
                         r"^initial_state: requires grad"),
    "h0_beside_pool": (None, dict(initial_state=torch.zeros(4, HV, V, K)), True, ValueError,
                       r"^initial_state: pool mode \(state \+ state_indices\)"),
    # the pool and its indices
    "idx_int64": (None, dict(state_indices=torch.tensor(IDX)), True, ValueError,
        r"^state_indices: expected dtype int32"),
    "idx_at_slots": (None, dict(state_indices=torch.tensor([4, -1, 0, SLOTS], dtype=torch.int32)), True, ValueError,
                     r"^state_indices: entries must be < slots = 6"),
    "idx_duplicate": (None, dict(state_indices=torch.tensor([4, -1, 2, 2], dtype=torch.int32)), True, ValueError,
                      r"^state_indices: a slot may serve only one sequence"),
    "idx_short": (None, dict(state_indices=torch.tensor([4, -1, 2], dtype=torch.int32)), True, ValueError,
                  r"^state_indices: expected shape \[N\] \(one slot per sequence\) = \[4\]"),
    "idx_meta": (None, dict(state_indices=torch.tensor(IDX, dtype=torch.int32, device="meta")), True, ValueError,
                 r"^state_indices: expected a tensor on cpu"),
    "idx_missing": (None, dict(state_indices=None), True, ValueError, r"^state_indices: pool mode needs both"),
    "pool_float16": (None, dict(state=torch.zeros(SLOTS, HV, V, K, dtype=torch.float16)), True, ValueError,
                     r"^state: expected dtype in .* got float16"),
    "pool_meta": (None, dict(state=torch.zeros(SLOTS, HV, V, K, device="meta")), True, ValueError,
                  r"^state: expected a tensor on cpu"),
    "null_slot0_int": (None, dict(null_slot0=1), True, TypeError, r"^null_slot0: expected a bool, got int"),
    "null_slot0_dense": (None, dict(null_slot0=True), False, ValueError, r"^null_slot0: only meaningful in pool mode"),
    # gates and beta
    "bounded_lb_0": (None, dict(gate="bounded", lower_bound=0.0), True, ValueError,
        r"^lower_bound: expected a finite value < 0"),
    "bounded_lb_1": (None, dict(gate="bounded", lower_bound=1.0), True, ValueError,
        r"^lower_bound: expected a finite value < 0"),
    "bounded_lb_nan": (None, dict(gate="bounded", lower_bound=float("nan")), True, ValueError,
        r"^lower_bound: expected a finite"),
    "bounded_lb_-inf": (None, dict(gate="bounded", lower_bound=float("-inf")), True, ValueError,
        r"^lower_bound: expected a finite"),
    "bounded_lb_bool": (None, dict(gate="bounded", lower_bound=True), True, TypeError,
        r"^lower_bound: expected a float < 0"),
    "bounded_lb_missing": (None, dict(gate="bounded"), True, ValueError, r"^lower_bound: required by gate='bounded'"),
    "softplus_lb_given": (None, dict(lower_bound=-3.0), True, ValueError, r"^lower_bound: only used by gate='bounded'"),
    "log_with_A_log": (None, dict(gate="log"), True, ValueError, r"^A_log: gate='log' takes g as the final log decay"),
    "softplus_no_A_log": (None, dict(A_log=None), True, ValueError, r"^A_log: required by gate='softplus'"),
    "gate_capitalised": (None, dict(gate="Softplus"), True, ValueError,
        r"^gate: expected one of \['softplus', 'bounded', 'log'\]"),
    "beta_is_logit_str": (None, dict(beta_is_logit="false"), True, TypeError,
        r"^beta_is_logit: expected a bool, got str"),
    "beta_is_logit_0": (None, dict(beta_is_logit=0), True, TypeError, r"^beta_is_logit: expected a bool, got int"),
    "output_final_state_1": (None, dict(output_final_state=1), True, TypeError,
        r"^output_final_state: expected a bool"),
    "scale_nan": (None, dict(scale=float("nan")), True, ValueError, r"^scale: expected a finite value > 0"),
    "checkpoint_every_bool": (None, dict(checkpoint_every=True), True, TypeError,
        r"^checkpoint_every: expected an int"),
    "max_seqlen_below_longest": (None, dict(max_seqlen=7), True, ValueError,
                                 r"^max_seqlen: expected an int >= the longest sequence of the plan \(8\)"),
    # mixed devices
    "k_meta": (_with("k", D0["k"].to("meta")), {}, True, ValueError,
        r"^k: expected a tensor on cpu \(the device of q\)"),
    "beta_meta": (_with("beta", D0["beta"].to("meta")), {}, True, ValueError, r"^beta: expected a tensor on cpu"),
    "A_log_meta": (None, dict(A_log=GATE0["A_log"].to("meta")), True, ValueError, r"^A_log: expected a tensor on cpu"),
    "dt_bias_meta": (None, dict(dt_bias=GATE0["dt_bias"].to("meta")), True, ValueError,
        r"^dt_bias: expected a tensor on cpu"),
    "q_double": (_with("q", D0["q"].double()), {}, True, ValueError, r"^k: expected the dtype of q \(float64\)"),
    # layouts read by element count
    "g_transposed_view": (_with("g", _strided(D0["g"])), {}, True, ValueError, r"^g: expected a contiguous tensor"),
    "g_K_by_HV": (_with("g", D0["g"].transpose(2, 3).contiguous()), {}, True, ValueError,
                  r"^g: expected shape \[B, T, HV, K\] = \[1, 20, 2, 8\], got \[1, 20, 8, 2\]"),
    "g_flat_per_token": (_with("g", D0["g"].reshape(1, T, HV * K)), {}, True, ValueError, r"^g: expected shape"),
    "beta_heads_first": (_with("beta", D0["beta"].transpose(1, 2).contiguous()), {}, True, ValueError,
                         r"^beta: expected shape \[B, T, HV\] = \[1, 20, 2\], got \[1, 2, 20\]"),
    "beta_heads_first_view": (_with("beta", D0["beta"].transpose(1, 2).contiguous().transpose(1, 2)), {}, True,
                              ValueError, r"^beta: expected a contiguous tensor"),
    "beta_flat": (_with("beta", D0["beta"].reshape(1, T * HV)), {}, True, ValueError, r"^beta: expected shape"),
    "v_transposed_view": (_with("v", _strided(D0["v"])), {}, True, ValueError, r"^v: expected a contiguous tensor"),
    "dt_bias_K_by_HV": (None, dict(dt_bias=GATE0["dt_bias"].view(K, HV)), True, ValueError,
                        r"^dt_bias: expected shape \[HV\*K\] = \[16\] or \[HV, K\] = \[2, 8\], got \[8, 2\]"),
    "A_log_column": (None, dict(A_log=GATE0["A_log"].view(HV, 1)), True, ValueError,
        r"^A_log: expected shape \[HV\] = \[2\]"),
}


def _refusal_args(name):
    change, kw, pooled, exc, match = CP_REFUSALS[name]
    d = dict(D0) if change is None else change(dict(D0))
    kwargs = dict(GATE0, plan=P1)
    h0 = torch.randn(4, HV, V, K, generator=torch.Generator().manual_seed(5))
    kwargs.update(pool_kwargs() if pooled else dict(initial_state=h0))
    kwargs.update(kw)
    return d, kwargs, exc, match


@pytest.mark.parametrize("name", list(CP_REFUSALS))
def test_cp_prefill_refuses_naming_the_argument_before_writing_or_sending(world1, spy, name):
    """guard except q_alone_* (named k before the fix) and plan_other_prompt (named state_indices: the plan's N
    against the pool's): the named error on the first call and a repeated one; every caller tensor keeps its bits
    (the pool's unaddressed slots are NaN); no prefill ran and only the agreement round was exchanged."""
    d, kwargs, exc, match = _refusal_args(name)
    keep = {n: x.clone() for n, x in {**d, **kwargs}.items() if torch.is_tensor(x) and not x.is_meta}
    raises_twice(exc, match, lambda: cp.cp_prefill(*whole(d), **kwargs))
    for n, before in keep.items():
        now = d.get(n, kwargs.get(n))
        assert bitwise_equal(now, before), f"a refused call changed {n}"
    assert spy["prefill"] == 0, "a refused call ran a prefill"
    assert spy["gather"] == 2, f"{spy['gather']} exchange rounds for 2 refused calls (the agreement round only)"


def test_cp_prefill_pool_overlapping_q_is_refused_guard(world1, spy):
    """A pool sharing q's storage (the op would write into its own input)."""
    n = D0["q"].numel()
    buf = torch.randn(n + SLOTS * HV * V * K)
    q = buf[:n].view_as(D0["q"])
    q.copy_(D0["q"])
    pool = buf[n - 8:n - 8 + SLOTS * HV * V * K].view(SLOTS, HV, V, K)
    before = buf.clone()
    d = dict(D0, q=q)
    raises_twice(ValueError, r"^state: overlaps the memory of q", lambda: cp.cp_prefill(
        *whole(d), plan=P1, **GATE0, **pool_kwargs(pool)))
    assert bitwise_equal(buf, before) and spy["prefill"] == 0


# ---------------------------------------------------------------------------------------------
# simulate with four ranks: the multi-rank refusals (checkpoints against the cuts), nothing written


CUTS4 = [0, 3, 9, 9, 20]   # cut 9 lies 4 tokens into sequence 2 (starts at 5), cut 3 inside sequence 0
SPAN3 = [0, 7, 9, 10, 20]  # sequence 2 (tokens 5..12) on all four ranks: ranks 1 and 2 hand on summaries (A, B)


@pytest.mark.parametrize("every, cuts, match", [
    (3, CUTS4, r"^plan: cut 3 at token 9 lies 4 tokens into sequence 2 .*checkpoint_every=3"),   # cut 1 is 3 in: fine
    (2, CUTS4, r"^plan: cut 1 at token 3 lies 3 tokens into sequence 0 .*multiple of 2"),
    (8, None, r"^plan: cut 2 at token 9 lies 4 tokens into sequence 2 .*multiple of 8"),   # snapped for 4, run at 8
    (True, CUTS4, r"^checkpoint_every: expected an int >= 0, got bool"),
    (-1, CUTS4, r"^checkpoint_every: expected an int >= 0"),
])
def test_simulate_refuses_checkpoints_off_the_cuts_guard(spy, every, cuts, match):
    d, gk = inputs()
    pool = poisoned_pool()
    before = pool.clone()
    p = cp.plan(CU, 4, cuts, checkpoint_every=0 if cuts else 4)
    assert p.cuts == (0, 3, 9, 9, 20) if cuts else p.cuts == (0, 5, 9, 12, 20)
    with pytest.raises((ValueError, TypeError), match=match):
        cp.simulate(*whole(d), plan=p, checkpoint_every=every, **gk, **pool_kwargs(pool))
    assert bitwise_equal(pool, before) and spy["prefill"] == 0


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_simulate_refuses_a_prompt_of_another_length_naming_it_guard(spy, name):
    d, gk = inputs()
    d[name] = torch.cat([d[name], d[name][:, :1]], 1)
    pool = poisoned_pool()
    before = pool.clone()
    raises_twice(ValueError, rf"^{name}: expected the whole prompt \[1, T = 20, \.\.\.\] of the plan, got \[1, 21",
                 lambda: cp.simulate(*whole(d), plan=cp.plan(CU, 4, CUTS4), **gk, **pool_kwargs(pool)))
    assert bitwise_equal(pool, before) and spy["prefill"] == 0


# ---------------------------------------------------------------------------------------------
# served calls: one-device kda_prefill on the whole prompt


def _state(mode, seed=11):
    if mode == "none":
        return {}
    if mode == "dense":
        return dict(initial_state=torch.randn(4, HV, V, K, generator=torch.Generator().manual_seed(seed)))
    return pool_kwargs()


def _copy(kw):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kw.items()}


def _one_device(d, gk, skw, **extra):
    return fk.kda_prefill(*whole(d), cu_seqlens=torch.tensor(CU, dtype=torch.int32), **gk, **skw, **extra)


def _check_served(sim, one, skw_sim, p):
    out = torch.cat([r[0] for r in sim], 1)
    assert out.shape == one[0].shape and not torch.isnan(out).any()
    torch.testing.assert_close(out, one[0], **TOL)
    final = sim[0][1]
    torch.testing.assert_close(final, one[1], **TOL, equal_nan=True)
    if "state" in skw_sim:   # the pool in place: unaddressed (NaN) and padding slots keep their bits
        assert final is skw_sim["state"]
        for s in range(SLOTS):
            if s not in LIVE:
                assert bitwise_equal(final[s], one[1][s]), f"slot {s}"
    for r in range(p.world_size):
        a, b = p.token_range(r)
        assert sim[r][0].shape == (1, b - a, HV, V)


@pytest.mark.parametrize("mode", ["none", "dense", "pool"])
@pytest.mark.parametrize("beta_is_logit", [True, False])
@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
def test_simulate_serves_each_gate_beta_and_state_as_one_device_guard(gate, beta_is_logit, mode):
    d, gk = inputs(seed=3100, gate=gate, beta_is_logit=beta_is_logit)
    skw = _state(mode)
    one = _one_device(d, gk, _copy(skw))
    for p in (cp.plan(CU, 4, CUTS4), cp.plan(CU, 3), cp.plan(CU, 4, SPAN3)):
        sim_kw = _copy(skw)
        _check_served(cp.simulate(*whole(d), plan=p, **gk, **sim_kw), one, sim_kw, p)


def test_simulate_serves_dt_bias_HV_by_K_scale_and_float64_state_guard():
    d, gk = inputs(seed=3200, gate="bounded")
    gk = dict(gk, dt_bias=gk["dt_bias"].view(HV, K), scale=0.3)
    skw = dict(initial_state=torch.randn(4, HV, V, K, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    one = _one_device(d, gk, _copy(skw))
    sim = cp.simulate(*whole(d), plan=cp.plan(CU, 4, CUTS4), **gk, **_copy(skw))
    assert sim[0][1].dtype == torch.float64
    _check_served(sim, one, {}, cp.plan(CU, 4, CUTS4))


@pytest.mark.parametrize("world", [21, 40])
def test_world_size_above_the_token_count_serves_guard(world):
    """More ranks than tokens: most ranges are empty, each rank returns [1, 0 or 1, HV, V]."""
    d, gk = inputs(seed=3300)
    skw = _state("pool")
    one = _one_device(d, gk, _copy(skw))
    p = fk.cp_plan(CU, world)
    assert sum(1 for r in range(world) if p.token_range(r)[0] == p.token_range(r)[1]) == world - T
    sim_kw = _copy(skw)
    _check_served(cp.simulate(*whole(d), plan=p, **gk, **sim_kw), one, sim_kw, p)


@pytest.mark.parametrize("every", [2, 4])
def test_checkpoints_on_snapped_cuts_match_one_device_guard(every):
    d, gk = inputs(seed=3400, gate="log")
    p = fk.cp_plan(CU, 4, checkpoint_every=4)   # default cuts moved back onto multiples of 4 (so of 2 too)
    assert p.cuts == (0, 5, 9, 12, 20)           # cut 9: 4 tokens into sequence 2
    one = _one_device(d, gk, {}, checkpoint_every=every)
    sim = cp.simulate(*whole(d), plan=p, checkpoint_every=every, **gk)
    _check_served(sim, one, {}, p)
    merged = torch.full_like(one[2], float("nan"))
    for r in sim:
        have = ~torch.isnan(r[2])
        assert not (have & ~torch.isnan(merged)).any(), "a checkpoint written by two ranks"
        merged[have] = r[2][have]
    torch.testing.assert_close(merged, one[2], **TOL, equal_nan=True)


@pytest.mark.parametrize("mode", ["dense", "pool"])
def test_cp_prefill_on_a_one_rank_group_is_simulate_bitwise_guard(world1, mode):
    d, gk = inputs(seed=3500, gate="bounded", beta_is_logit=False)
    skw = _state(mode)
    sim_kw, mine_kw = _copy(skw), _copy(skw)
    sim = cp.simulate(*whole(d), plan=P1, **gk, **sim_kw)[0]
    got = cp.cp_prefill(*mine(d, P1, 0), plan=P1, **gk, **mine_kw)
    assert bitwise_equal(got[0], sim[0]) and bitwise_equal(got[1], sim[1])
    _check_served([got], _one_device(d, gk, _copy(skw)), mine_kw, P1)


# ---------------------------------------------------------------------------------------------
# segment_summary directly


L = 6   # segment_summary's segment: tokens


def segment(h=1, hv=2, kd=4, vd=4, seed=3600, dtype=torch.float64, gate="softplus"):
    d, gk = inputs([0, L], seed=seed, gate=gate, h=h, hv=hv, kd=kd, vd=vd)
    return [d[n].to(dtype) for n in ("q", "k", "v", "g", "beta")], gk


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared by the caller
        return type(e), str(e)
    return None


@pytest.mark.parametrize("h, hv", [(2, 3), (2, 1), (4, 2)])
def test_one_call_summary_refuses_value_heads_not_a_multiple_of_the_q_heads(spy, h, hv):
    """Was served (2 HV % H == 0): B and A of a head took different q/k heads. Refused as the two-call form is."""
    args, gk = segment(h=h, hv=hv)
    want = rf"^v: value heads HV = {hv} must be a multiple of the q/k heads H = {h}"
    raises_twice(ValueError, want, lambda: cp.segment_summary(*args, **gk))
    spy["prefill"] = 0   # the two-call form's own prefill refused it; the one-call form must not reach the op
    raises_twice(ValueError, want, lambda: cp.segment_summary(*args, one_call=True, **gk))
    assert spy["prefill"] == 0


@pytest.mark.parametrize("shape", [(4, 2), (1, 2, 4), (8, 1)])
def test_one_call_summary_refuses_a_dt_bias_read_by_element_count(spy, shape):
    """A dt_bias [K, HV] (or any shape of HV*K elements but [HV*K] / [HV, K]) was reshaped to [HV, K] and served."""
    args, gk = segment()
    bias = gk["dt_bias"].reshape(shape)
    want = r"^dt_bias: expected shape \[HV\*K\] = \[8\] or \[HV, K\] = \[2, 4\], got " + \
        str(list(shape)).replace("[", r"\[").replace("]", r"\]")
    for one_call in (False, True):
        spy["prefill"] = 0
        raises_twice(ValueError, want, lambda: cp.segment_summary(*args, one_call=one_call, **dict(gk, dt_bias=bias)))
    assert spy["prefill"] == 0, "the one-call form reached the op"


def _bad_segment_cases(args, gk):
    q, k, v, g, beta = args
    return {
        "dt_bias_9": ([q, k, v, g, beta], dict(gk, dt_bias=torch.zeros(9))),
        "dt_bias_list": ([q, k, v, g, beta], dict(gk, dt_bias=[0.0] * 8)),
        "A_log_list": ([q, k, v, g, beta], dict(gk, A_log=[0.0, 0.0])),
        "A_log_3": ([q, k, v, g, beta], dict(gk, A_log=torch.zeros(3))),
        "A_log_column": ([q, k, v, g, beta], dict(gk, A_log=torch.zeros(2, 1))),
        "beta_2d": ([q, k, v, g, beta[..., 0]], gk),
        "beta_list": ([q, k, v, g, beta.tolist()], gk),
        "beta_heads_first": ([q, k, v, g, beta.transpose(1, 2).contiguous()], gk),
        "g_list": ([q, k, v, g.tolist(), beta], gk),
        "g_3_heads": ([q, k, v, torch.cat([g, g[:, :, :1]], 2), beta], gk),
        "g_K_by_HV": ([q, k, v, g.transpose(2, 3).contiguous(), beta], gk),
        "g_strided": ([q, k, v, _strided(g), beta], gk),
        "v_strided": ([q, k, _strided(v), g, beta], gk),
        # guards: the op named these correctly on the doubled call too
        "g_float32": ([q, k, v, g.float(), beta], gk),
        "beta_meta": ([q, k, v, g, beta.to("meta")], gk),
        "k_wider": ([q, torch.cat([k, k[..., :1]], 3), v, g, beta], gk),
        "lower_bound_0": ([q, k, v, g, beta], dict(gk, gate="bounded", lower_bound=0.0)),
        "log_with_A_log": ([q, k, v, g, beta], dict(gk, gate="log")),
        "beta_is_logit_str": ([q, k, v, g, beta], dict(gk, beta_is_logit="no")),
        "A_log_requires_grad": ([q, k, v, g, beta], dict(gk, A_log=torch.zeros(2, requires_grad=True))),
    }


CASES = list(_bad_segment_cases(*segment()))
GUARDS = ("g_float32", "beta_meta", "k_wider", "lower_bound_0", "log_with_A_log", "beta_is_logit_str",
          "A_log_requires_grad")


@pytest.mark.parametrize("case", CASES)
def test_one_call_summary_refuses_as_the_two_call_form_does(spy, case):
    """The one-call form refuses every bad argument with the two-call form's error (type and message), before
    anything reaches the op: before the fix some were served (g_strided, v_strided), others failed unnamed
    (dt_bias_9: RuntimeError, *_list: AttributeError, beta_2d: IndexError) or were named with doubled sizes
    (A_log_3, A_log_column, g_3_heads, g_K_by_HV, beta_heads_first). GUARDS: the op named them on the doubled call."""
    args, gk = _bad_segment_cases(*segment())[case]
    two = _error(lambda: cp.segment_summary(*args, **gk))
    assert two is not None and two[0] in (TypeError, ValueError), f"two-call form: {two}"
    spy["prefill"] = 0
    for _ in range(2):
        assert _error(lambda: cp.segment_summary(*args, one_call=True, **gk)) == two
    if case not in GUARDS:
        assert spy["prefill"] == 0, "the one-call form reached the op"


def test_one_call_summary_v_not_k_refused_and_b_alone_served(spy):
    args, gk = segment(vd=3)
    raises_twice(ValueError, r"^v: one-call summaries need V == K, got V = 3, K = 4",
                 lambda: cp.segment_summary(*args, one_call=True, **gk))
    assert spy["prefill"] == 0
    # guard: transition=False is B alone, one prefill either way: bitwise the two-call B
    b1 = cp.segment_summary(*args, one_call=True, transition=False, state_dtype=torch.float64, **gk)
    b2 = cp.segment_summary(*args, transition=False, state_dtype=torch.float64, **gk)
    assert b1.A is None and b2.A is None and bitwise_equal(b1.B, b2.B) and b1.B.shape == (2, 3, 4)


@pytest.mark.parametrize("flag", ["one_call", "transition"])
@pytest.mark.parametrize("bad", [1, 0, "no", None, torch.tensor(True)])
def test_segment_summary_flags_must_be_bools_guard(spy, flag, bad):
    args, gk = segment()
    raises_twice(TypeError, rf"^{flag}: expected a bool", lambda: cp.segment_summary(*args, **{flag: bad}, **gk))
    assert spy["prefill"] == 0


@pytest.mark.parametrize("which, bad, match", [
    ("q", lambda x: x[0], r"^q: expected a 4-D tensor of the segment's tokens"),
    ("v", lambda x: x[0], r"^v: expected a 4-D tensor of the segment's tokens"),
    ("q", lambda x: torch.cat([x, x]), r"^q: expected one sequence \[1, L, H, K\], got shape \[2, 6, 1, 4\]"),
    ("q", lambda x: None, r"^q: expected a torch.Tensor, got None"),
    ("k", lambda x: torch.cat([x, x]), r"^k: expected shape \[B, T, H, K\] \(same as q\)"),
    ("v", lambda x: x[:, :-1], r"^v: expected leading dims \[B, T\] = \[1, 6\]"),
])
@pytest.mark.parametrize("one_call", [False, True])
def test_segment_summary_bad_shapes_named_guard(which, bad, match, one_call):
    args, gk = segment()
    i = "qkvgb".index(which[0])
    args[i] = bad(args[i])
    raises_twice((TypeError, ValueError), match, lambda: cp.segment_summary(*args, one_call=one_call, **gk))


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
def test_one_call_summary_with_several_q_heads_guard(gate):
    """H = 2, HV = 4 (two value heads per q head): one-call equals two-call and the reference."""
    args, gk = segment(h=2, hv=4, gate=gate)
    if gate == "bounded":
        gk["lower_bound"] = -3.0
    one = cp.segment_summary(*args, one_call=True, state_dtype=torch.float64, **gk)
    two = cp.segment_summary(*args, state_dtype=torch.float64, **gk)
    torch.testing.assert_close(one.A, two.A, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(one.B, two.B, rtol=1e-12, atol=1e-12)
    S0 = torch.randn(1, 4, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    _, ref, _ = kda_recurrent(*args, initial_state=S0, **gk)
    torch.testing.assert_close(cp.apply_summary(S0[0], one), ref[0], rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# two spawned gloo processes


def _scenarios(rank, world):
    res = {}
    d, gk = inputs(seed=3700, gate="bounded")
    p = cp.plan(CU, world, [0, 9, 20])            # cut 9, 4 tokens into sequence 2
    x = mine(d, p, rank)
    rounds = []
    real_gather = cp.exchange.GroupExchange.gather

    def counting(self, tensor):
        rounds.append(1)
        return real_gather(self, tensor)
    cp.exchange.GroupExchange.gather = counting

    def refused(fn):
        pool = poisoned_pool()
        before = pool.clone()
        del rounds[:]
        out = _outcome(lambda: fn(pool))
        return out + (bitwise_equal(pool, before), len(rounds))

    # guard: a served pool call, bitwise simulate() and within tolerance of one-device prefill
    def served():
        pool_mine, pool_sim, pool_one = poisoned_pool(), poisoned_pool(), poisoned_pool()
        got = cp.cp_prefill(*x, plan=p, **gk, **pool_kwargs(pool_mine))
        sim = cp.simulate(*whole(d), plan=p, **gk, **pool_kwargs(pool_sim))[rank]
        one = _one_device(d, gk, pool_kwargs(pool_one))
        a, b = p.token_range(rank)
        torch.testing.assert_close(got[0], one[0][:, a:b], **TOL)
        torch.testing.assert_close(pool_mine, pool_one, **TOL, equal_nan=True)
        return bitwise_equal(got[0], sim[0]) and bitwise_equal(pool_mine, pool_sim) and got[1] is pool_mine
    res["served"] = _outcome(served)
    # q alone one token short on rank 1 (the fix): rank 1 names q, rank 0 names rank 1
    res["q_short_rank1"] = refused(lambda pool: cp.cp_prefill(
        *([x[0][:, :-1]] + x[1:] if rank == 1 else x), plan=p, **gk, **pool_kwargs(pool)))
    # guard: the ranks' plans differ (same world size, other cuts): every rank refuses
    other = cp.plan(CU, world, [0, 10, 20])
    res["plans_differ"] = refused(lambda pool: cp.cp_prefill(
        *(mine(d, other, rank) if rank == 1 else x), plan=other if rank == 1 else p, **gk, **pool_kwargs(pool)))
    # guard: a plan for one rank on a group of two
    res["plan_world_1"] = refused(lambda pool: cp.cp_prefill(*whole(d), plan=cp.plan(CU, 1), **gk,
                                                             **pool_kwargs(pool)))
    # guard: rank 0's initial_state on another device
    h0 = torch.zeros(4, HV, V, K, device="meta" if rank == 0 else "cpu")
    res["h0_meta_rank0"] = refused(lambda pool: cp.cp_prefill(*x, plan=p, initial_state=h0, **gk))
    cp.exchange.GroupExchange.gather = real_gather
    return res


# each rank's results from one spawn of two gloo processes (tests/gloo_ranks.py: killed, and the test failed, past
# its deadline)
gloo2 = ranks_fixture(_scenarios, world=2, gloo_timeout_s=GLOO_TIMEOUT.total_seconds(), deadline_s=SPAWN_DEADLINE_S)


def test_gloo_served_pool_call_guard(gloo2):
    for rank, res in enumerate(gloo2):
        assert res["served"] == ("ok", True), f"rank {rank}: {res['served']}"


@pytest.mark.parametrize("scenario, per_rank", [
    ("q_short_rank1", [r"^cp_prefill: rank\(s\) \[1\] refused their arguments",
                       r"^q: expected rank 1's 11 tokens \[9, 20\) of the plan, shape \[1, 11, H, K\], "
                       r"got \[1, 10, 1, 8\]"]),
    ("plans_differ", [r"^cp_prefill: the ranks were called with different plans or arguments"] * 2),
    ("plan_world_1", [r"^plan: made for world_size = 1, but the group has 2 ranks"] * 2),
    ("h0_meta_rank0", [r"^initial_state: expected a tensor on cpu \(the device of q\), got meta",
                       r"^cp_prefill: rank\(s\) \[0\] refused their arguments"]),
])
def test_gloo_refusals_name_the_argument_on_every_rank(gloo2, scenario, per_rank):
    """q_short_rank1 failed before its fix (rank 1 named k); the others are guards. Every rank raises, its pool
    keeps its bits and only the agreement round was exchanged."""
    import re
    for rank, (res, want) in enumerate(zip(gloo2, per_rank)):
        kind, msg, pool_kept, rounds = res[scenario]
        assert kind == "ValueError" and re.search(want, msg), f"rank {rank}: {kind}: {msg}"
        assert pool_kept, f"rank {rank}: a refused call wrote its pool"
        assert rounds == 1, f"rank {rank}: {rounds} exchange rounds after a refusal (the agreement round only)"
