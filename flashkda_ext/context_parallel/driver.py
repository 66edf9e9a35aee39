"""cp_prefill (one rank of a process group) and simulate (every rank in one process): one algorithm.

    1. validate (every rank; then an agreement round so a refusal anywhere stops every rank)
    2. phase 1 on each rank: prefill what starts from a known state, summarise a range-spanning segment
    3. exchange the summaries (all_gather, fixed size) and fold them in rank order -> incoming states
    4. phase 2 on each rank: prefill its first segment from its incoming state
    5. exchange the final states (all_gather, fixed size); every rank assembles the same [N, HV, V, K]
       and returns it (dense) or writes it into its pool replica (pool mode)

simulate() runs steps 2-5 for all ranks in turn with the same calls in the same order, handing the
buffers over instead of gathering them, so its per-rank results are bitwise those of the distributed run.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from .. import validation
from .exchange import GroupExchange, call_signature
from .plan import Plan
from .rank import RankWork, StateSource, _tokens, pack_summary, unpack_summaries
from .summary import fold


def _chunk(call) -> int:
    """The chunk of the route the local calls take (dense float32 working state): checkpoints must
    fall on its chunk boundaries."""
    from .. import dispatch, jit
    meta = dict(call.route_meta(), state="f32")
    rule = dispatch.select_rule("kda_prefill", meta)
    return int(jit.get_record(rule["module"]).get("params", {}).get("chunk", 1))


def _prepare(plan, rank: int, q, k, v, g, beta, *, gate_kwargs: dict, initial_state, state, state_indices,
             output_final_state, checkpoint_every, null_slot0, max_seqlen):
    """Every check of one rank's call before anything runs; returns (RankWork, StateSource, signature).
    q .. beta hold the rank's own tokens [1, T_r, .]."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a flashkda_ext.context_parallel.Plan (from plan()), got "
                        f"{type(plan).__name__}")
    q = validation._tensor("q", q)
    validation._ndim("q", q, 4, "[1, T_r, H, K] (this rank's tokens)")
    # q's tokens against the plan before the one-device checks, which take q's T as given: a q alone of another
    # length was refused naming k ("same as q"), the argument that was right
    a, b = plan.token_range(rank)
    if q.shape[1] != b - a:
        raise ValueError(f"q: expected rank {rank}'s {b - a} tokens [{a}, {b}) of the plan, shape "
                         f"[1, {b - a}, H, K], got {list(q.shape)}")
    N = plan.num_seqs
    # The same checks as a one-device call over this rank's tokens (offsets with the N sequences of the
    # plan, all tokens in the first: the shapes of every state argument follow from N).
    stand_in = torch.tensor([0] + [q.shape[1]] * N, dtype=torch.int64, device=q.device)
    call = validation.check_kda_prefill(
        q, k, v, g, beta, cu_seqlens=stand_in, initial_state=initial_state, state=state,
        state_indices=state_indices, output_final_state=output_final_state, checkpoint_every=checkpoint_every,
        null_slot0=null_slot0, **gate_kwargs)
    plan.check_checkpoints(checkpoint_every)
    longest = plan.longest
    if max_seqlen is not None:
        validation._int("max_seqlen", max_seqlen, f">= the longest sequence ({longest})")
        if max_seqlen < longest:
            raise ValueError(f"max_seqlen: expected an int >= the longest sequence of the plan ({longest}), "
                             f"got {max_seqlen}")
        # bounded as one-device kda_prefill bounds it (<= T): a larger one sized the NaN checkpoint tensor
        # from it (2**40 died in the allocator, unnamed) and passed unread without checkpoints
        if max_seqlen > plan.total_tokens:
            raise ValueError(f"max_seqlen: expected an int <= the plan's T = {plan.total_tokens} tokens, "
                             f"got {max_seqlen}")
    # The checkpoints' slot count as one-device kda_prefill has it with host offsets (the plan's are):
    # (max_seqlen, else the longest sequence) // checkpoint_every.
    ckpt_slots = (max_seqlen if max_seqlen is not None else longest) // checkpoint_every if checkpoint_every else 0
    chunk = _chunk(call) if checkpoint_every > 0 and call.backend == "cuda" else 1
    if checkpoint_every % chunk:
        raise ValueError(f"checkpoint_every: expected a multiple of the chunk size {chunk} of the CUDA "
                         f"prefill, got {checkpoint_every}")
    validation.check_apart((("state", state),),
                           (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", gate_kwargs["A_log"]),
                            ("dt_bias", gate_kwargs["dt_bias"]), ("state_indices", state_indices)))
    shape = (call.value_heads, call.head_dim_v, call.head_dim_k)
    indices = None
    if state is not None:
        indices = [int(i) for i in state_indices.tolist()]   # N host ints, read once (a copy on CUDA)
        live = [i for i in indices if i >= 0 and not (null_slot0 and i == 0)]
        if any(i >= call.slots for i in live):
            raise ValueError(f"state_indices: entries must be < slots = {call.slots}, got {indices}")
        if len(set(live)) != len(live):
            raise ValueError(f"state_indices: a slot may serve only one sequence of a prefill, got {indices}")
    source = StateSource(initial_state=initial_state, pool=state, indices=indices, null_slot0=null_slot0,
                         shape=shape, device=q.device)
    work = RankWork(plan, rank, (q, k, v, g, beta), source, gate_kwargs, checkpoint_every, ckpt_slots)
    given = state if state is not None else initial_state
    signature = call_signature(
        plan.cu_seqlens, plan.cuts, call.num_heads, shape, call.input_dtype, str(v.dtype), source.mode,
        None if given is None else (str(given.dtype), tuple(given.shape)), indices, null_slot0, output_final_state,
        checkpoint_every, ckpt_slots, call.gate, call.lower_bound, call.scale, call.beta_is_logit,
        gate_kwargs["A_log"] is None, gate_kwargs["dt_bias"] is None, q.device.type)
    return work, source, signature


def _assemble_finals(packets: Sequence[torch.Tensor], plan: Plan, source: StateSource, slots: int) -> torch.Tensor:
    """[N, HV, V, K] (working dtype) from every rank's final packet; an empty sequence keeps its start."""
    final = torch.empty(plan.num_seqs, *source.shape, dtype=source.work_dtype, device=source.device)
    row_of = {n: r * slots + j for r in range(plan.world_size) for j, n in enumerate(plan.owned_finals(r))}
    ended = sorted(row_of)
    rows = [row_of[n] for n in ended]
    empty = [n for n in range(plan.num_seqs) if n not in row_of]   # no rank holds a token of it
    if ended:
        every = torch.cat(list(packets))
        final.index_copy_(0, torch.tensor(ended, device=source.device),
                          every.index_select(0, torch.tensor(rows, device=source.device)))
    if empty:
        final.index_copy_(0, torch.tensor(empty, device=source.device), source.initial(empty))
    return final


def _commit(final: torch.Tensor, source: StateSource):
    """The final state as the op returns it: dense [N, HV, V, K] in the state dtype, or the pool with
    every live sequence's slot written (in place)."""
    if source.mode != "pool":
        return final.to(source.state_dtype)
    live = [n for n in range(final.shape[0]) if source.live(n)]
    if live:
        dev = source.device
        source.pool.index_copy_(0, torch.tensor([source.indices[n] for n in live], device=dev),
                                final.index_select(0, torch.tensor(live, device=dev)).to(source.pool.dtype))
    return source.pool


def _execute(works: List[RankWork], plan: Plan, source: StateSource,
             gather: Callable[[List[torch.Tensor]], List[torch.Tensor]], output_final_state: bool):
    """Steps 2-5 for the ranks run in this process (`works`, in rank order); gather turns their buffers
    into all ranks' buffers in rank order. Returns each local rank's (out, final_state, checkpoints)."""
    summaries = [w.phase1() for w in works]
    incoming: List[Optional[torch.Tensor]] = [None] * plan.world_size
    if plan.spanning_seqs():
        buffers = gather([pack_summary(s, source.shape, source.work_dtype, source.device) for s in summaries])
        incoming = fold(unpack_summaries(buffers, plan, source.shape), plan)
    for w in works:
        w.phase2(incoming[w.rank])
    final = None
    if output_final_state:
        slots = max(len(plan.owned_finals(r)) for r in range(plan.world_size))
        packets = gather([w.final_packet(slots) for w in works]) if slots else []
        final = _commit(_assemble_finals(packets, plan, source, slots), source)
    return [(w.out, final, w.checkpoints) for w in works]


def _result(out, final, checkpoints, checkpoint_every):
    return (out, final, checkpoints) if checkpoint_every > 0 else (out, final)


def cp_prefill(q, k, v, g, beta, *, plan: Plan, group=None, A_log=None, dt_bias=None, lower_bound=None,
               gate="softplus", scale=None, beta_is_logit=True, initial_state=None, state=None, state_indices=None,
               output_final_state=True, checkpoint_every=0, null_slot0=False, max_seqlen=None):
    """Context-parallel prefill, this rank's share (docs/context-parallel.md).

    Every rank of `group` (None: the default group) calls it with the same plan and arguments, and its
    own tokens: q, k [1, T_r, H, K]; v [1, T_r, HV, V]; g [1, T_r, HV, K]; beta [1, T_r, HV], where
    [a, b) = plan.token_range(rank) and T_r = b - a. initial_state [N, HV, V, K] (dense) or state
    [slots, HV, V, K] + state_indices [N] int32 (pool mode; every rank holds an identical replica) are
    given whole on every rank. Returns (out [1, T_r, HV, V], final_state) or, with checkpoint_every > 0,
    (out, final_state, checkpoints): final_state is the whole [N, HV, V, K] on every rank (pool mode:
    the pool, written in place on every rank; None without output_final_state); checkpoints
    [N, C, HV, V, K] holds the entries whose token lies in this rank's range, NaN elsewhere, with C as
    one-device kda_prefill has it for host offsets: max_seqlen // checkpoint_every (max_seqlen: a host
    bound >= the longest sequence, <= T; None: the longest sequence).
    """
    exchange = GroupExchange(group)
    gate_kwargs = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale,
                       beta_is_logit=beta_is_logit)
    error, signature, prepared = None, 0, None
    try:
        if isinstance(q, torch.Tensor):
            exchange.check_device("q", q.device)
        if isinstance(plan, Plan) and plan.world_size != exchange.world_size:
            raise ValueError(f"plan: made for world_size = {plan.world_size}, but the group has "
                             f"{exchange.world_size} ranks")
        prepared = _prepare(plan, exchange.rank, q, k, v, g, beta, gate_kwargs=gate_kwargs,
                            initial_state=initial_state, state=state, state_indices=state_indices,
                            output_final_state=output_final_state, checkpoint_every=checkpoint_every,
                            null_slot0=null_slot0, max_seqlen=max_seqlen)
        signature = prepared[2]
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank has heard of it
        error = e
    exchange.agree(signature, error)
    work, source, _ = prepared
    with torch.no_grad():
        (out, final, ckpt), = _execute([work], plan, source, lambda bufs: exchange.gather(bufs[0]),
                                       output_final_state)
    return _result(out, final, ckpt, checkpoint_every)


def simulate(q, k, v, g, beta, *, plan: Plan, A_log=None, dt_bias=None, lower_bound=None, gate="softplus",
             scale=None, beta_is_logit=True, initial_state=None, state=None, state_indices=None,
             output_final_state=True, checkpoint_every=0, null_slot0=False, max_seqlen=None) -> list:
    """Every rank of `plan` in this process, in turn, with the calls cp_prefill makes: the whole prompt
    q, k [1, T, H, K] etc. (T = plan.total_tokens) is cut by the plan. Returns one result per rank,
    as cp_prefill returns it on that rank (the final state is one tensor shared by all; pool mode:
    the one pool, written in place once)."""
    gate_kwargs = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale,
                       beta_is_logit=beta_is_logit)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a flashkda_ext.context_parallel.Plan (from plan()), got "
                        f"{type(plan).__name__}")
    tensors = [validation._tensor(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))]
    for name, x in zip(("q", "k", "v", "g", "beta"), tensors):
        if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != plan.total_tokens:
            raise ValueError(f"{name}: expected the whole prompt [1, T = {plan.total_tokens}, ...] of the plan, "
                             f"got {list(x.shape)}")
    works, source = [], None
    for r in range(plan.world_size):
        a, b = plan.token_range(r)
        work, source_r, _ = _prepare(plan, r, *(_tokens(x, a, b) for x in tensors), gate_kwargs=gate_kwargs,
                                     initial_state=initial_state, state=state, state_indices=state_indices,
                                     output_final_state=output_final_state, checkpoint_every=checkpoint_every,
                                     null_slot0=null_slot0, max_seqlen=max_seqlen)
        source = source or source_r
        work.source = source   # one state source for all ranks: the pool is written once
        works.append(work)
    with torch.no_grad():
        results = _execute(works, plan, source, lambda bufs: bufs, output_final_state)
    return [_result(*res, checkpoint_every) for res in results]
