"""Context-parallel prefill (issue 33): one long packed prompt split into contiguous token ranges, one
per rank; the state entering a rank comes from the ranks before it through affine summaries
(S_end = S_start @ A + B) exchanged with torch.distributed and folded in rank order.

    plan(cu_seqlens, world_size, cuts=None, checkpoint_every=0) -> Plan     host integers only
    cp_prefill(q, k, v, g, beta, *, plan, group=None, ...)                  one rank of a process group
    simulate(q, k, v, g, beta, *, plan, ...)                                every rank in one process
    segment_summary(...), fold(...)                                         the pieces they are made of

See docs/context-parallel.md.
"""
from .driver import cp_prefill, simulate
from .plan import Plan, Segment, plan
from .summary import Summary, apply_summary, fold, segment_summary

__all__ = ["Plan", "Segment", "Summary", "apply_summary", "cp_prefill", "fold", "plan", "segment_summary",
           "simulate"]
