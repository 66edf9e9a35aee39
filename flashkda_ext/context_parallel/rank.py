"""One rank's share of a context-parallel prefill, in the steps the driver runs between exchanges.

    phase1()          prefill what starts from a known state (sequences that start on this rank), and
                      summarise a segment that spans the whole range: what the rank hands on
    phase2(incoming)  prefill the first segment from the state the fold gave it
    final_packet()    the final states this rank computed, packed to the plan's fixed size

Every local computation is a call of the public op kda_prefill on this rank's own tokens (dense
states in the working dtype, float32, or float64 for a float64 state on the CPU): the caller's state
dtype is applied only where one-device prefill applies it, when a state is read and when it is
stored, so a bf16 pool is not rounded at a cut.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .plan import Plan, Segment
from .summary import Summary, segment_summary


class StateSource:
    """Where sequences start from and where their final states go: none (zeros), dense
    initial_state [N, HV, V, K], or a pool [slots, HV, V, K] with host slot indices (the same on every
    rank: each holds a replica)."""

    def __init__(self, *, initial_state=None, pool=None, indices: Optional[List[int]] = None, null_slot0=False,
                 shape=None, device=None):
        self.initial_state, self.pool, self.indices, self.null_slot0 = initial_state, pool, indices, null_slot0
        self.shape, self.device = shape, device   # (HV, V, K)
        given = pool if pool is not None else initial_state
        self.state_dtype = given.dtype if given is not None else torch.float32
        self.work_dtype = torch.float64 if self.state_dtype == torch.float64 else torch.float32

    @property
    def mode(self) -> str:
        return "pool" if self.pool is not None else ("dense" if self.initial_state is not None else "none")

    def live(self, seq: int) -> bool:
        """Pool mode: whether sequence seq reads and writes a slot (not a padding index)."""
        i = self.indices[seq]
        return i >= 0 and not (self.null_slot0 and i == 0)

    def initial(self, seqs: Sequence[int]) -> torch.Tensor:
        """Start states [len(seqs), HV, V, K] in the working dtype (a new tensor)."""
        n = len(seqs)
        if self.mode == "none":
            return torch.zeros(n, *self.shape, dtype=self.work_dtype, device=self.device)
        if self.mode == "dense":
            rows = torch.tensor(list(seqs), dtype=torch.int64, device=self.device)
            return self.initial_state.index_select(0, rows).to(self.work_dtype)
        rows = [self.indices[s] if self.live(s) else 0 for s in seqs]
        x = self.pool.index_select(0, torch.tensor(rows, dtype=torch.int64, device=self.device))
        x = x.to(self.work_dtype)
        padding = [i for i, s in enumerate(seqs) if not self.live(s)]
        if padding:  # a padding sequence starts from zeros, as in one-device prefill
            x[padding] = 0
        return x


def _tokens(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Tokens [a, b) of a [1, T, ...] tensor: a view (contiguous, B = 1), copied only when a CUDA view
    would start off the 16-byte boundary the kernels need."""
    piece = x[:, a:b]
    if piece.is_cuda and piece.numel() and piece.data_ptr() % 16:
        piece = piece.clone()
    return piece


class RankWork:
    """Rank `rank`'s tokens (q .. beta: [1, T_r, .] of its range) and its results: out [1, T_r, HV, V]
    (NaN until written), final states of the sequences it ends, checkpoints [N, C, HV, V, K]
    (the entries whose token lies in its range; NaN elsewhere)."""

    def __init__(self, plan: Plan, rank: int, tensors, source: StateSource, gate_kwargs: dict,
                 checkpoint_every: int, checkpoint_slots: int):
        self.plan, self.rank, self.source = plan, rank, source
        self.q, self.k, self.v, self.g, self.beta = tensors
        self.gate_kwargs, self.every = gate_kwargs, checkpoint_every
        self.start = plan.token_range(rank)[0]
        self.out = torch.full(self.v.shape, float("nan"), dtype=self.v.dtype, device=self.v.device)
        self.checkpoints = None
        if checkpoint_every > 0:
            self.checkpoints = torch.full((plan.num_seqs, checkpoint_slots, *source.shape), float("nan"),
                                          dtype=source.state_dtype, device=self.v.device)
        self.finals: Dict[int, torch.Tensor] = {}
        self.summary: Optional[Summary] = None

    def _local(self, x, seg_from: Segment, seg_to: Segment):
        return _tokens(x, seg_from.start - self.start, seg_to.end - self.start)

    def _run(self, segs: Sequence[Segment], init: torch.Tensor) -> torch.Tensor:
        """Prefill consecutive segments from init [len(segs), HV, V, K] (one kda_prefill call); writes
        their output and checkpoints, returns their end states [len(segs), HV, V, K]."""
        from ..ops import kda_prefill
        offsets = [0]
        for s in segs:
            offsets.append(offsets[-1] + s.length)
        cu = torch.tensor(offsets, dtype=torch.int32, device=self.q.device)
        toks = [self._local(x, segs[0], segs[-1]) for x in (self.q, self.k, self.v, self.g, self.beta)]
        res = kda_prefill(*toks, cu_seqlens=cu, initial_state=init, output_final_state=True,
                          checkpoint_every=self.every, max_seqlen=max(s.length for s in segs), **self.gate_kwargs)
        a = segs[0].start - self.start
        self.out[:, a:a + offsets[-1]].copy_(res[0])
        if self.every > 0:
            for i, s in enumerate(segs):
                count, base = s.length // self.every, s.offset_in_seq // self.every
                if count:
                    self.checkpoints[s.seq, base:base + count].copy_(res[2][i, :count])
        return res[1]

    def phase1(self) -> Optional[Summary]:
        """Everything with a known start state; returns what this rank hands on (plan.sends)."""
        segs, head = self.plan.segments[self.rank], self.plan.head(self.rank)
        if head is not None and head.continues_later:   # one segment spans the range: its affine map
            toks = [self._local(x, head, head) for x in (self.q, self.k, self.v, self.g, self.beta)]
            self.summary = segment_summary(*toks, state_dtype=self.source.work_dtype, **self.gate_kwargs)
        known = segs[1:] if head is not None else segs
        if known:
            ends = self._run(known, self.source.initial([s.seq for s in known]))
            for i, s in enumerate(known):
                if not s.continues_later:
                    self.finals[s.seq] = ends[i]
            if known[-1].continues_later:   # a sequence starting here goes on: hand its end state on
                self.summary = Summary(None, ends[-1])
        return self.summary

    def phase2(self, incoming: Optional[torch.Tensor]) -> None:
        """The first segment, continuing a sequence, from its incoming state [HV, V, K]."""
        head = self.plan.head(self.rank)
        if head is None:
            return
        ends = self._run([head], incoming[None])
        if not head.continues_later:
            self.finals[head.seq] = ends[0]

    def final_packet(self, slots: int) -> torch.Tensor:
        """The end states of plan.owned_finals(rank), in order, in a [slots, HV, V, K] buffer (zeros past
        them): every rank's packet has the same size."""
        packet = torch.zeros(slots, *self.source.shape, dtype=self.source.work_dtype, device=self.q.device)
        for j, seq in enumerate(self.plan.owned_finals(self.rank)):
            packet[j] = self.finals[seq]
        return packet


def pack_summary(summary: Optional[Summary], shape, dtype, device) -> torch.Tensor:
    """A summary as one flat buffer of fixed size HV*K*K + HV*V*K (A first; zeros where absent)."""
    HV, V, K = shape
    buf = torch.zeros(HV * K * K + HV * V * K, dtype=dtype, device=device)
    if summary is not None:
        if summary.A is not None:
            buf[:HV * K * K] = summary.A.reshape(-1)
        buf[HV * K * K:] = summary.B.reshape(-1)
    return buf


def unpack_summaries(buffers: Sequence[torch.Tensor], plan: Plan, shape) -> List[Optional[Summary]]:
    """The inverse of pack_summary for every rank, reading each buffer as plan.sends(rank) says."""
    HV, V, K = shape
    out: List[Optional[Summary]] = []
    for r, buf in enumerate(buffers):
        kind = plan.sends(r)
        if kind is None:
            out.append(None)
            continue
        A = buf[:HV * K * K].view(HV, K, K) if kind == "summary" else None
        out.append(Summary(A, buf[HV * K * K:].view(HV, V, K)))
    return out
