"""Context-parallel prefill on the CPU backend (flashkda_ext.context_parallel, docs/context-parallel.md).

The affine segment summary against the float64 reference for random start states; the plan (cuts in a
sequence, on boundaries, a sequence across three or more ranks, empty ranges, bad cuts refused);
simulate() against one-device kda_prefill (dense, pool with padding and null slot 0, no initial state,
a bf16 pool, float64 against the reference, final states, checkpoints), run-to-run bitwise; refused
calls write nothing; and cp_prefill over gloo with 2, 3 and 4 processes, bitwise equal to simulate()
(one spawn per world size, several cases inside). Fresh random inputs; K != V to catch transposes.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext import context_parallel as cp
from flashkda_ext.reference import kda_recurrent

H, HV, K, V = 1, 2, 16, 12       # grouped value heads (HV / H = 2), K != V
LENS = [10, 0, 25, 7, 20]        # one empty sequence; T = 62
CU = [0, 10, 10, 35, 42, 62]
LAYOUTS = {  # world size, cuts
    "mid_and_across_four": (4, [0, 12, 15, 20, 62]),   # sequence 2 (tokens 10..35) on all four ranks
    "empty_ranges": (4, [0, 0, 13, 13, 62]),
    "boundaries": (3, [0, 10, 35, 62]),
    "default_split": (2, None),
}
EVERY = 4
CKPT_CUTS = [0, 14, 22, 50, 62]  # 4 and 12 tokens into sequence 2, 8 into sequence 4
SLOTS = 9
POOL_IDX = [5, -1, 2, 0, 7]      # a padding index; slot 0 is padding too with null_slot0 (sequence 3)
# the CPU backend's tolerances (tests/test_cpu_backend.py); CP against one-device float32 measured
# at most 0.04 of this bound over 480 random cases (the fold's extra roundings are that small)
TOL = {torch.float32: dict(rtol=2e-6, atol=1e-6), torch.bfloat16: dict(rtol=6e-3, atol=1e-4),
       torch.float64: dict(rtol=1e-10, atol=1e-10)}


def fresh_seed():
    return random.SystemRandom().randrange(2**31)


def make_inputs(seed, dtype=torch.float32, gate="softplus", lens=LENS):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    d = dict(q=randn(1, T, H, K), k=randn(1, T, H, K), v=randn(1, T, HV, V), beta=randn(1, T, HV))
    if gate == "log":
        d["g"] = (-torch.rand(1, T, HV, K, generator=gen, dtype=torch.float64) * 0.6 - 0.01).to(dtype)
        gk = dict(gate="log")
    else:
        d["g"] = randn(1, T, HV, K)
        gk = dict(gate=gate, A_log=torch.rand(HV, generator=gen) * 0.5 - 1.0, dt_bias=randn(HV * K, scale=0.5).float())
        if gate == "bounded":
            gk.update(lower_bound=-4.0)
    return d, gk, gen


def state_kwargs(mode, gen, N=len(LENS)):
    """(kwargs for kda_prefill / simulate, the state dtype); a fresh copy of the state every call."""
    if mode == "none":
        return {}, torch.float32
    if mode in ("dense", "dense_f64"):
        dt = torch.float64 if mode == "dense_f64" else torch.float32
        return dict(initial_state=torch.randn(N, HV, V, K, generator=gen, dtype=torch.float64).to(dt)), dt
    dt = torch.bfloat16 if mode == "pool_bf16" else torch.float32
    pool = torch.randn(SLOTS, HV, V, K, generator=gen, dtype=torch.float64).to(dt)
    return dict(state=pool, state_indices=torch.tensor(POOL_IDX, dtype=torch.int32), null_slot0=True), dt


def copy_state(kw):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kw.items()}


def merge_checkpoints(results):
    """The one-device checkpoints from every rank's share: each entry from exactly one rank."""
    ckpts = [r[2] for r in results]
    have = torch.stack([~torch.isnan(c.float()).flatten(2).all(-1) for c in ckpts])   # [R, N, C]
    assert int(have.sum(0).max()) <= 1, "a checkpoint entry written by two ranks"
    merged = torch.full_like(ckpts[0], float("nan"))
    for c, h in zip(ckpts, have):
        merged[h] = c[h]
    return merged, have.any(0)


def bitwise_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(torch.uint8) == b.view(torch.uint8)).all())


# ---------------------------------------------------------------------------------------------
# the affine summary


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
def test_segment_summary_is_the_affine_map_of_the_reference(gate):
    """S_end = S_start @ A + B for random S_start, against the float64 token recurrence (K != V)."""
    seed = fresh_seed()
    d, gk, gen = make_inputs(seed, torch.float64, gate, lens=[13])
    summary = cp.segment_summary(d["q"], d["k"], d["v"], d["g"], d["beta"], state_dtype=torch.float64, **gk)
    assert summary.A.shape == (HV, K, K) and summary.B.shape == (HV, V, K)
    for _ in range(2):
        S0 = torch.randn(1, HV, V, K, generator=gen, dtype=torch.float64)
        _, ref_final, _ = kda_recurrent(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=S0, **gk)
        got = cp.apply_summary(S0[0], summary)
        torch.testing.assert_close(got, ref_final[0], rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")
    # B alone is the end state from zero; A is not the identity (the tokens did something)
    _, ref_zero, _ = kda_recurrent(d["q"], d["k"], d["v"], d["g"], d["beta"], **gk)
    torch.testing.assert_close(summary.B, ref_zero[0], rtol=1e-10, atol=1e-10)
    assert (summary.A - torch.eye(K, dtype=torch.float64)).abs().max() > 1e-3


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
@pytest.mark.parametrize("dt_bias_shape", ["flat", "2d"])
def test_one_call_summary_equals_the_two_call_maps(gate, dt_bias_shape):
    """V == K, grouped value heads (H = 1, HV = 2): A and B from one prefill over 2 HV value heads
    equal the two-call maps, and the pair maps a random start state as the reference does."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    Hq, HVv, D, L = 1, 2, 8, 11
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    d = dict(q=rnd(1, L, Hq, D), k=rnd(1, L, Hq, D), v=rnd(1, L, HVv, D), beta=rnd(1, L, HVv))
    if gate == "log":
        d["g"] = -torch.rand(1, L, HVv, D, generator=gen, dtype=torch.float64) * 0.6 - 0.01
        gk = dict(gate="log")
    else:
        d["g"] = rnd(1, L, HVv, D)
        bias = rnd(HVv * D).float() * 0.5
        gk = dict(gate=gate, A_log=torch.rand(HVv, generator=gen) * 0.5 - 1.0,
                  dt_bias=bias if dt_bias_shape == "flat" else bias.view(HVv, D))
        if gate == "bounded":
            gk.update(lower_bound=-4.0)
    args = [d[n] for n in ("q", "k", "v", "g", "beta")]
    one = cp.segment_summary(*args, state_dtype=torch.float64, one_call=True, **gk)
    two = cp.segment_summary(*args, state_dtype=torch.float64, one_call=False, **gk)
    assert one.A.shape == two.A.shape == (HVv, D, D) and one.B.shape == two.B.shape == (HVv, D, D)
    tight = dict(rtol=1e-12, atol=1e-12, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(one.A, two.A, **tight)
    torch.testing.assert_close(one.B, two.B, **tight)
    S0 = rnd(1, HVv, D, D)
    _, ref_final, _ = kda_recurrent(*args, initial_state=S0, **gk)
    torch.testing.assert_close(cp.apply_summary(S0[0], one), ref_final[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="one-call summaries need V == K"):
        cp.segment_summary(*args[:2], d["v"][..., :5], *args[3:], one_call=True, **gk)


# ---------------------------------------------------------------------------------------------
# the plan


def segs(p, r):
    return [(s.seq, s.start, s.end, s.continues_from_earlier, s.continues_later) for s in p.segments[r]]


def test_plan_cut_inside_a_sequence_and_on_a_boundary():
    p = cp.plan([0, 10, 30], 2, [0, 15, 30])
    assert segs(p, 0) == [(0, 0, 10, False, False), (1, 10, 15, False, True)]
    assert segs(p, 1) == [(1, 15, 30, True, False)]
    assert p.sends(0) == "state" and p.sends(1) is None and p.head(1).seq == 1 and p.head(0) is None
    assert p.spanning_seqs() == (1,) and p.final_owner(1) == 1 and p.owned_finals(0) == (0,)
    q = cp.plan([0, 10, 30], 2, [0, 10, 30])
    assert segs(q, 0) == [(0, 0, 10, False, False)] and segs(q, 1) == [(1, 10, 30, False, False)]
    assert q.spanning_seqs() == () and q.sends(0) is None


def test_plan_sequence_across_three_ranks_and_empty_ranges():
    p = cp.plan([0, 40], 3, [0, 10, 20, 40])
    assert segs(p, 1) == [(0, 10, 20, True, True)] and p.sends(1) == "summary"
    assert p.pieces(0) == (0, 1, 2) and p.final_owner(0) == 2
    e = cp.plan([0, 5, 5, 20, 40], 4, [0, 0, 20, 20, 40])
    assert segs(e, 0) == [] and segs(e, 2) == [] and e.token_range(2) == (20, 20)
    assert e.final_owner(1) is None and e.pieces(1) == ()       # the empty sequence lives on no rank
    assert segs(e, 1) == [(0, 0, 5, False, False), (2, 5, 20, False, False)]


def test_plan_default_split_and_checkpoint_alignment():
    assert cp.plan([0, 62], 4).cuts == (0, 15, 31, 46, 62)
    aligned = cp.plan([0, 10, 35, 62], 4, checkpoint_every=4)   # equal cuts 15, 31, 46 moved back
    assert aligned.cuts == (0, 14, 30, 43, 62)
    aligned.check_checkpoints(4)
    cp.plan([0, 10, 35, 62], 3, [0, 10, 35, 62], checkpoint_every=7)   # boundaries are always aligned
    with pytest.raises(ValueError, match=r"cut 1 at token 15 lies 5 tokens into sequence 1.*multiple of 4"):
        cp.plan([0, 10, 35, 62], 2, [0, 15, 62], checkpoint_every=4)


@pytest.mark.parametrize("args, err, match", [
    (([0, 10], 2, [0, 5]), ValueError, r"cuts: expected world_size \+ 1 = 3"),
    (([0, 10], 2, [0, 6, 5]), ValueError, "cuts: expected offsets from 0 to T = 10"),
    (([0, 10], 3, [0, 6, 5, 10]), ValueError, "cuts: expected non-decreasing"),
    (([0, 10], 2, [1, 5, 10]), ValueError, "cuts: expected offsets from 0"),
    (([0, 10], 2, [0, 5.0, 10]), TypeError, "cuts: expected ints"),
    (([0, 10], 0), ValueError, "world_size: expected an int >= 1"),
    (([0, 10], True), TypeError, "world_size"),
    (([0, 10, 5], 2), ValueError, "cu_seqlens: expected non-decreasing"),
    (([3, 10], 2), ValueError, "cu_seqlens"),
    (("0,10", 2), TypeError, "cu_seqlens"),
    ((torch.tensor([0.0, 10.0]), 2), ValueError, "cu_seqlens: expected an integer tensor"),
])
def test_plan_refuses_bad_arguments(args, err, match):
    with pytest.raises(err, match=match):
        cp.plan(*args)


def test_plan_takes_a_host_tensor():
    assert cp.plan(torch.tensor(CU, dtype=torch.int32), 2).cu_seqlens == tuple(CU)


# ---------------------------------------------------------------------------------------------
# simulate() against one-device kda_prefill


def run_both(mode, layout, gate="softplus", every=0):
    seed = fresh_seed()
    dtype = torch.float64 if mode == "dense_f64" else torch.float32
    d, gk, gen = make_inputs(seed, dtype, gate)
    skw, sdt = state_kwargs(mode, gen)
    R, cuts = LAYOUTS[layout] if every == 0 else (4, CKPT_CUTS)
    p = cp.plan(CU, R, cuts, checkpoint_every=every)
    extra = dict(checkpoint_every=every) if every else {}
    one_kw, sim_kw = copy_state(skw), copy_state(skw)
    one = fk.kda_prefill(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=torch.tensor(CU, dtype=torch.int32),
                         **gk, **one_kw, **extra)
    sim = cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=p, **gk, **sim_kw, **extra)
    return seed, p, d, gk, skw, sdt, one, sim, sim_kw


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", ["none", "dense", "pool", "pool_bf16"])
def test_simulate_matches_one_device_prefill(mode, layout):
    seed, p, d, gk, skw, sdt, one, sim, sim_kw = run_both(mode, layout)
    msg = f"seed {seed}, {mode}, {layout}"
    assert len(sim) == p.world_size
    for r, res in enumerate(sim):
        a, b = p.token_range(r)
        assert res[0].shape == (1, b - a, HV, V) and not torch.isnan(res[0]).any(), msg
        assert res[1] is sim[0][1], "every rank returns the one final state"
    out = torch.cat([res[0] for res in sim], dim=1)
    torch.testing.assert_close(out, one[0], **TOL[torch.float32], msg=lambda m: f"{msg}: {m}")
    final = sim[0][1]
    assert final.dtype == sdt and final.shape == one[1].shape
    torch.testing.assert_close(final.double(), one[1].double(), **TOL[sdt], msg=lambda m: f"{msg}: {m}")
    if mode.startswith("pool"):   # the pool is written in place; padding slots and unaddressed ones untouched
        pool0, pool = skw["state"], sim_kw["state"]
        assert final is pool
        for slot in range(SLOTS):
            if slot not in (5, 2, 7):
                assert bitwise_equal(pool[slot], pool0[slot]), f"{msg}: slot {slot} changed"
    elif mode == "dense":
        assert bitwise_equal(final[1], skw["initial_state"][1]), "the empty sequence keeps its initial state"


def test_simulate_float64_against_the_reference():
    """float64 inputs and state on the CPU: the whole CP path agrees with the token recurrence to 1e-10."""
    seed, p, d, gk, skw, _, _, sim, _ = run_both("dense_f64", "mid_and_across_four", gate="bounded")
    ref_out, ref_final, _ = kda_recurrent(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=CU,
                                          initial_state=skw["initial_state"], **gk)
    out = torch.cat([res[0] for res in sim], dim=1)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(sim[0][1], ref_final, rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("mode", ["dense", "pool_bf16"])
def test_simulate_checkpoints_match_one_device(mode):
    seed, p, d, gk, skw, sdt, one, sim, _ = run_both(mode, None, gate="log", every=EVERY)
    merged, have = merge_checkpoints(sim)
    ref = one[2]
    assert merged.shape == ref.shape and merged.dtype == ref.dtype
    assert torch.equal(have, ~torch.isnan(ref.float()).flatten(2).all(-1)), "checkpoint entries differ in place"
    torch.testing.assert_close(merged.double(), ref.double(), **TOL[sdt], equal_nan=True,
                               msg=lambda m: f"seed {seed}, {mode}: {m}")
    # a rank's entries are the ones whose token lies in its range
    for r, res in enumerate(sim):
        a, b = p.token_range(r)
        for n, (s, e) in enumerate(zip(CU, CU[1:])):
            for c in range((e - s) // EVERY):
                token = s + (c + 1) * EVERY
                assert bool(~torch.isnan(res[2][n, c].float()).all()) == (a < token <= b)


def test_checkpoint_slots_follow_max_seqlen_as_one_device():
    seed = fresh_seed()
    d, gk, gen = make_inputs(seed, gate="log")
    p = cp.plan(CU, 4, CKPT_CUTS, checkpoint_every=EVERY)
    longest = max(e - s for s, e in zip(CU, CU[1:]))
    for max_seqlen in (None, longest, longest + 3 * EVERY):
        one = fk.kda_prefill(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=torch.tensor(CU, dtype=torch.int32),
                             checkpoint_every=EVERY, max_seqlen=max_seqlen, **gk)
        sim = cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=p, checkpoint_every=EVERY,
                          max_seqlen=max_seqlen, **gk)
        assert all(res[2].shape == one[2].shape for res in sim), (max_seqlen, one[2].shape, sim[0][2].shape)
    with pytest.raises(ValueError, match="max_seqlen: expected an int >= the longest sequence"):
        cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=p, checkpoint_every=EVERY,
                    max_seqlen=longest - 1, **gk)


def test_simulate_is_bitwise_deterministic():
    seed = fresh_seed()
    d, gk, gen = make_inputs(seed, gate="bounded")
    skw, _ = state_kwargs("pool", gen)
    p = cp.plan(CU, 4, CKPT_CUTS, checkpoint_every=EVERY)
    runs = []
    for _ in range(2):
        kw = copy_state(skw)
        runs.append((cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=p, checkpoint_every=EVERY,
                                 **gk, **kw), kw["state"]))
    (first, pool1), (second, pool2) = runs
    assert bitwise_equal(pool1, pool2)
    for x, y in zip(first, second):
        assert bitwise_equal(x[0], y[0]) and bitwise_equal(x[2], y[2])


def test_output_final_state_false_commits_nothing():
    seed = fresh_seed()
    d, gk, gen = make_inputs(seed)
    skw, _ = state_kwargs("pool", gen)
    kw = copy_state(skw)
    sim = cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=cp.plan(CU, 3), output_final_state=False,
                      **gk, **kw)
    assert all(res[1] is None for res in sim)
    assert bitwise_equal(kw["state"], skw["state"])


# ---------------------------------------------------------------------------------------------
# refused calls


@pytest.mark.parametrize("bad, match", [
    (dict(plan=[0, 62]), "plan: expected a flashkda_ext.context_parallel.Plan"),
    (dict(state_indices=torch.tensor([5, -1, 9, 0, 7], dtype=torch.int32)), "state_indices: entries must be < slots"),
    (dict(state_indices=torch.tensor([5, -1, 2, 2, 7], dtype=torch.int32)), "a slot may serve only one sequence"),
    (dict(checkpoint_every=3), r"multiple of 3 tokens"),
    (dict(initial_state=torch.zeros(5, HV, V, K)), "initial_state: pool mode"),
    (dict(gate="bounded"), "lower_bound"),
])
def test_refused_calls_write_nothing(bad, match):
    d, gk, gen = make_inputs(fresh_seed())
    skw, _ = state_kwargs("pool", gen)
    kw = copy_state(skw)
    args = dict(plan=cp.plan(CU, 4, CKPT_CUTS), **gk, **kw)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], **args)
    assert bitwise_equal(kw["state"], skw["state"])


def test_simulate_refuses_a_prompt_of_another_length():
    d, gk, _ = make_inputs(fresh_seed())
    with pytest.raises(ValueError, match=r"q: expected the whole prompt \[1, T = 40"):
        cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=cp.plan([0, 40], 2), **gk)


def test_cp_prefill_needs_a_process_group():
    d, gk, _ = make_inputs(fresh_seed())
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        cp.cp_prefill(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=cp.plan(CU, 1), **gk)


# ---------------------------------------------------------------------------------------------
# gloo: R processes against simulate()


GLOO_CASES = [  # (name, layout or None for the checkpoint cuts, state mode, gate, checkpoint_every)
    ("mid_dense", "mid_and_across_four", "dense", "softplus", 0),
    ("empty_ranges_pool", "empty_ranges", "pool", "bounded", 0),
    ("boundaries_none", "boundaries", "none", "log", 0),
    ("ckpt_pool_bf16", None, "pool_bf16", "softplus", EVERY),
]


def _cuts_for(world_size, layout):
    """The case's cuts for this world size: the layout's when it has that many ranks, else an equal split
    (checkpoint cases: aligned to the checkpoints)."""
    if layout is None:
        return CKPT_CUTS if world_size == 4 else None
    R, cuts = LAYOUTS[layout]
    return cuts if R == world_size else None


def _gloo_cases(rank, world_size, group, seed):
    """Every GLOO_CASES case on `group` (this process is its rank `rank` of world_size), bitwise against
    simulate() here; then a refusal on one rank and a disagreement between ranks, both raised everywhere."""
    for name, layout, mode, gate, every in GLOO_CASES:
        d, gk, gen = make_inputs(seed, gate=gate)
        skw, _ = state_kwargs(mode, gen)
        p = cp.plan(CU, world_size, _cuts_for(world_size, layout), checkpoint_every=every)
        extra = dict(checkpoint_every=every) if every else {}
        sim_kw, mine_kw = copy_state(skw), copy_state(skw)
        sim = cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=p, **gk, **sim_kw, **extra)
        a, b = p.token_range(rank)
        local = [d[n][:, a:b].clone() for n in ("q", "k", "v", "g", "beta")]   # a rank holds only its tokens
        mine = cp.cp_prefill(*local, plan=p, group=group, **gk, **mine_kw, **extra)
        what = f"seed {seed}, world {world_size}, rank {rank}, case {name}"
        assert bitwise_equal(mine[0], sim[rank][0]), f"{what}: out differs from simulate()"
        assert bitwise_equal(mine[1], sim[rank][1]), f"{what}: final state differs from simulate()"
        if every:
            assert bitwise_equal(mine[2], sim[rank][2]), f"{what}: checkpoints differ from simulate()"
        again = cp.cp_prefill(*local, plan=p, group=group, **gk, **copy_state(skw), **extra)
        assert bitwise_equal(again[0], mine[0]) and bitwise_equal(again[1], mine[1]), \
            f"{what}: not deterministic run to run"
    d, gk, _ = make_inputs(seed)
    p = cp.plan(CU, world_size)
    a, b = p.token_range(rank)
    local = [d[n][:, a:b] for n in ("q", "k", "v", "g", "beta")]
    last = world_size - 1
    with pytest.raises(ValueError) as refused:   # the last rank passes one token short of its range
        cp.cp_prefill(*(x[:, :-1] if rank == last else x for x in local), plan=p, group=group, **gk)
    want = "q: expected rank" if rank == last else f"rank(s) [{last}] refused"
    assert want in str(refused.value), f"rank {rank}: {refused.value}"
    with pytest.raises(ValueError, match="different plans or arguments"):
        cp.cp_prefill(*local, plan=p, group=group, **gk, output_final_state=rank != 0)


GLOO_GROUPS = {2: [1, 3], 3: [0, 1, 2], 4: [0, 1, 2, 3]}   # world size -> global ranks (2: group rank != rank)


def _gloo_worker(rank, init_file, seed):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        for world_size, members in GLOO_GROUPS.items():
            group = dist.new_group(members) if world_size < 4 else None   # every process takes part
            if rank in members:
                _gloo_cases(members.index(rank), world_size, group, seed)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gloo_ranks_match_simulate_bitwise(tmp_path):
    """cp_prefill on 2, 3 and 4 gloo ranks (one spawn of 4 processes; process groups of 2 and 3 of them)
    gives each rank bitwise what simulate() gives that rank."""
    import torch.multiprocessing as mp
    mp.spawn(_gloo_worker, args=(str(tmp_path / "init"), fresh_seed()), nprocs=4, join=True)
