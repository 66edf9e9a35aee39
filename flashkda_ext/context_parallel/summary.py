"""The affine summary of a segment and the fold of summaries in rank order.

One token step in storage layout (state S [V, K] per value head, DESIGN.md section 2) is

    S <- S diag(e) - beta (S diag(e) k) k^T + beta v k^T  =  S M_t + b_t,
    M_t = diag(e) (I - beta k k^T)  [K, K],   b_t = beta v k^T  [V, K],   e = exp(g_t),

so a segment of tokens maps its start state affinely: S_end = S_start A + B with A = M_1 ... M_L and
B the end state from S_start = 0. A is the end state, from S_start = I, of the same tokens with v = 0
(then every b_t vanishes); as a state it has K rows, so it is computed with a K-wide zero value
tensor. Both come from the public op kda_prefill, so every backend that prefills also summarises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .. import validation
from ..validation.common import _same_device
from .plan import Plan

# kda_prefill's gate arguments, the only ones a summary passes on: the rest (cu_seqlens, initial_state,
# checkpoint_every, ...) are the summary's own or make no sense for one segment, and went on to the op unnamed
_GATE_KWARGS = ("gate", "A_log", "dt_bias", "lower_bound", "scale", "beta_is_logit")


@dataclass
class Summary:
    """What a rank hands on for the sequence that continues past it: the map S_end = S_start @ A + B
    ([HV, V, K] @ [HV, K, K] + [HV, V, K]) of a segment whose start state is not known yet, or (A None)
    the known end state B of a segment whose start state was known."""
    A: Optional[torch.Tensor]
    B: torch.Tensor


def _prefill_end_state(q, k, v, g, beta, start, prefill_kwargs):
    """The end state [HV, V', K] of the tokens (one sequence, B = 1) from `start` [HV, V', K]."""
    from ..ops import kda_prefill  # late: the ops import the whole op path
    _, final = kda_prefill(q, k, v, g, beta, initial_state=start[None], output_final_state=True,
                           **prefill_kwargs)
    return final[0]


def segment_summary(q, k, v, g, beta, *, state_dtype=torch.float32, transition: bool = True,
                    one_call: bool = False, **prefill_kwargs) -> Summary:
    """(A, B) of one segment: q, k [1, L, H, K]; v [1, L, HV, V]; g [1, L, HV, K]; beta [1, L, HV] (the
    segment's tokens, one sequence). prefill_kwargs are kda_prefill's gate arguments (gate, A_log,
    dt_bias, lower_bound, scale, beta_is_logit). A [HV, K, K] and B [HV, V, K] are in state_dtype
    (float32, or float64 on the CPU). transition=False leaves A out (B alone: the map's offset).
    one_call: both maps from one kda_prefill over 2 HV value heads (_summary_one_call; needs V == K).
    Off by default: tested on the CPU backend; on the H200 (2026-12-02, 770472b, bench_cp.py --quick) it cost
    2.21-2.33x the prefill per token against 2.09-2.28x for the two calls (docs/context-parallel.md; the run's
    JSON was not kept in benchmarks/results/h200-2026-12-02-770472b). benchmarks/bench_cp.py has both forms side
    by side: its "summary" arm is this default, "summary_one_call" the other."""
    # checked before any shape is read (a 3-D v raised IndexError) or a flag is taken by truth value
    # (transition="no" dropped A, one_call="no" took the one-call form)
    for name, x, ndim in (("q", q, 4), ("v", v, 4)):
        validation._ndim(name, validation._tensor(name, x), ndim, "of the segment's tokens")
    if q.shape[0] != 1:
        raise ValueError(f"q: expected one sequence [1, L, H, K], got shape {list(q.shape)}")
    validation._bool("transition", transition)
    validation._bool("one_call", one_call)
    if state_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"state_dtype: expected torch.float32 or torch.float64, got {state_dtype!r}")
    if state_dtype == torch.float64 and q.device.type != "cpu":
        raise ValueError(f"state_dtype: torch.float64 is for the CPU backend, got tensors on {q.device}")
    unknown = sorted(set(prefill_kwargs) - set(_GATE_KWARGS))
    if unknown:
        raise TypeError(f"{unknown[0]}: segment_summary passes on kda_prefill's gate arguments only "
                        f"({', '.join(_GATE_KWARGS)}), got {unknown}")
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    zero = torch.zeros(HV, V, K, dtype=state_dtype, device=q.device)
    if one_call and transition:   # B alone is one prefill either way
        # the caller's arguments get the check of the B prefill before they are doubled to 2 HV heads: kda_prefill
        # saw only the doubled ones, so HV % H != 0 (2 HV % H == 0) and a [K, HV] dt_bias (reshaped by element
        # count) were served as wrong maps, a non-contiguous g or v was served, and a bad g / beta / A_log /
        # dt_bias failed unnamed (IndexError, RuntimeError, AttributeError) or was named with doubled sizes
        if V != K:   # the form's own rule first, whatever else is wrong with v
            raise ValueError(f"v: one-call summaries need V == K, got V = {V}, K = {K}")
        validation.check_kda_prefill(q, k, v, g, beta, initial_state=zero[None], output_final_state=True,
                                     **prefill_kwargs)
        return _summary_one_call(q, k, v, g, beta, state_dtype, prefill_kwargs)
    B = _prefill_end_state(q, k, v, g, beta, zero, prefill_kwargs)
    A = None
    if transition:
        eye = torch.eye(K, dtype=state_dtype, device=q.device).expand(HV, K, K).contiguous()
        v_zero = torch.zeros(*v.shape[:3], K, dtype=v.dtype, device=v.device)
        A = _prefill_end_state(q, k, v_zero, g, beta, eye, prefill_kwargs)
    return Summary(A, B)


def _twice(x: Optional[torch.Tensor], dim: int) -> Optional[torch.Tensor]:
    return None if x is None else x.repeat_interleave(2, dim=dim)


def _summary_one_call(q, k, v, g, beta, state_dtype, prefill_kwargs) -> Summary:
    """A and B from one prefill over 2 HV value heads: head 2h is head h with its values from 0 (its end
    state is B), head 2h+1 is head h with zero values from I (its end state is A). Grouped value heads
    keep both on head h's q and k (head j of 2 HV uses q/k head j // (2 HV / H) = h // (HV / H)). One
    launch of twice the heads instead of two launches: the hope was that a long sequence's prefill, bound by
    its ordered chunk chain at 16 heads, takes the extra heads on idle SMs (on the H200 it did not:
    segment_summary's docstring). segment_summary checks the arguments (V == K among them) first."""
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    v2 = torch.stack((v, torch.zeros_like(v)), dim=3).reshape(*v.shape[:2], 2 * HV, V)
    kw = dict(prefill_kwargs)
    kw["A_log"] = _twice(kw.get("A_log"), 0)
    dt_bias = kw.get("dt_bias")
    if dt_bias is not None:   # [HV * K] or [HV, K]: each head's K entries twice, in the shape given
        kw["dt_bias"] = dt_bias.reshape(HV, K).repeat_interleave(2, dim=0).reshape(
            (2 * HV * K,) if dt_bias.dim() == 1 else (2 * HV, K))
    start = torch.stack((torch.zeros(HV, V, K, dtype=state_dtype, device=q.device),
                         torch.eye(K, dtype=state_dtype, device=q.device).expand(HV, K, K)), dim=1)
    end = _prefill_end_state(q, k, v2, _twice(g, 2), _twice(beta, 2), start.reshape(2 * HV, V, K), kw)
    end = end.view(HV, 2, V, K)
    return Summary(end[:, 1].contiguous(), end[:, 0].contiguous())


def _float3(name: str, x, what: str) -> torch.Tensor:
    x = validation._tensor(name, x)
    validation._ndim(name, x, 3, what)
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point tensor {what}, got {x.dtype}")
    return x


def _check_summary(name: str, summary, shape=None) -> None:
    """A Summary whose B is [HV, V, K] (`shape` when given) and A, when present, [HV, K, K] on B's device:
    torch broadcasting took a [V, K] or [1, V, K] B, and other shapes failed inside baddbmm unnamed."""
    if not isinstance(summary, Summary):
        raise TypeError(f"{name}: expected a flashkda_ext.context_parallel.Summary, got {type(summary).__name__}")
    B = _float3(f"{name}.B", summary.B, "[HV, V, K]")
    if shape is not None and tuple(B.shape) != tuple(shape):
        raise ValueError(f"{name}.B: expected shape [HV, V, K] = {list(shape)}, got {list(B.shape)}")
    if summary.A is not None:
        A = _float3(f"{name}.A", summary.A, "[HV, K, K]")
        HV, _, K = B.shape
        if tuple(A.shape) != (HV, K, K):
            raise ValueError(f"{name}.A: expected shape [HV, K, K] = {[HV, K, K]} (B is {list(B.shape)}), "
                             f"got {list(A.shape)}")
        _same_device(f"{name}.A", A, B.device)


def apply_summary(state: torch.Tensor, summary: Summary) -> torch.Tensor:
    """state @ A + B in float64 (whatever TF32 settings torch has), for [HV, V, K] state."""
    _check_summary("summary", summary)
    state = _float3("state", state, "[HV, V, K]")   # checked with A None too: never ignored unread
    if tuple(state.shape) != tuple(summary.B.shape):
        raise ValueError(f"state: expected shape [HV, V, K] = {list(summary.B.shape)} (the summary's B), "
                         f"got {list(state.shape)}")
    _same_device("state", state, summary.B.device)
    if summary.A is None:
        return summary.B.double()
    return torch.baddbmm(summary.B.double(), state.double(), summary.A.double())


def fold(summaries: Sequence[Optional[Summary]], plan: Plan) -> List[Optional[torch.Tensor]]:
    """Each rank's incoming state (the start state of its first segment when that continues a sequence
    from an earlier rank, else None), from the ranks' summaries (plan.sends(r) says which rank gave
    which kind; the others' entries are ignored). Fixed order: sequence by sequence, rank by rank, in
    float64, each incoming state cast to the dtype of the summaries."""
    # One entry per rank, each None or a Summary: a short or long list was read as far as the plan went
    # (or not at all), and a bad entry raised AttributeError naming nothing.
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a flashkda_ext.context_parallel.Plan (from plan()), got {type(plan).__name__}")
    if not isinstance(summaries, (list, tuple)) or len(summaries) != plan.world_size:
        got = f"{len(summaries)} entries" if isinstance(summaries, (list, tuple)) else type(summaries).__name__
        raise ValueError(f"summaries: expected a list of world_size = {plan.world_size} entries (one per rank, "
                         f"None where a rank sends nothing), got {got}")
    for r, s in enumerate(summaries):
        if s is not None and not isinstance(s, Summary):
            raise TypeError(f"summaries[{r}]: expected a Summary or None, got {type(s).__name__}")
    incoming: List[Optional[torch.Tensor]] = [None] * plan.world_size
    for seq in plan.spanning_seqs():
        ranks = plan.pieces(seq)
        first = summaries[ranks[0]]
        if plan.sends(ranks[0]) != "state" or first is None:
            raise ValueError(f"fold: rank {ranks[0]} starts sequence {seq} and must send its end state")
        _check_summary(f"summaries[{ranks[0]}]", first)
        if first.A is not None:   # its B was used as the state and A dropped
            raise ValueError(f"summaries[{ranks[0]}]: rank {ranks[0]} starts sequence {seq} and sends its end "
                             f"state (A None), got a map (A, B)")
        shape = tuple(first.B.shape)
        dtype = first.B.dtype
        carry = first.B.double()
        for i, r in enumerate(ranks[1:], start=1):
            incoming[r] = carry.to(dtype)
            if i < len(ranks) - 1:   # the sequence goes on past rank r: r's segment spans its whole range
                s = summaries[r]
                if plan.sends(r) != "summary" or s is None or s.A is None:
                    raise ValueError(f"fold: rank {r} spans sequence {seq} and must send its summary (A, B)")
                _check_summary(f"summaries[{r}]", s, shape)
                carry = apply_summary(carry, s)
    return incoming
