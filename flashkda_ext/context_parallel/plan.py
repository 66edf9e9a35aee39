"""The context-parallel plan: which tokens of one packed prompt each rank prefills (host integers only).

A prompt of N packed sequences (cu_seqlens, T tokens) is cut into world_size contiguous token ranges,
rank r owning tokens [cuts[r], cuts[r+1]). A range may be empty, and a sequence may span several ranks.
Per rank the plan lists its segments: the parts of sequences inside its range, in token order, each
saying whether it continues a sequence begun on an earlier rank and whether the sequence goes on past
this rank. Every rank builds the same plan from the same host integers, so every decision taken from
it (what to exchange, how to fold) is the same on every rank without any communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..validation import _int


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) (global offsets) of sequence `seq`, all on one rank."""
    seq: int
    start: int
    end: int
    seq_start: int                 # where sequence `seq` starts (global offset)
    continues_from_earlier: bool   # the sequence began on an earlier rank: the start state comes from there
    continues_later: bool          # the sequence goes on on a later rank: this rank hands its end state on

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def offset_in_seq(self) -> int:
        return self.start - self.seq_start


@dataclass(frozen=True)
class Plan:
    """Each rank's token range and segments. Build it with plan(); it holds host integers only."""
    cu_seqlens: Tuple[int, ...]
    world_size: int
    cuts: Tuple[int, ...]
    checkpoint_every: int
    segments: Tuple[Tuple[Segment, ...], ...]   # per rank, in token order
    seq_ranks: Tuple[Tuple[int, ...], ...]      # per sequence, the ranks holding its tokens (see pieces)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def longest(self) -> int:
        """Tokens of the longest sequence (0 for a prompt of empty sequences)."""
        return max((e - s for s, e in zip(self.cu_seqlens, self.cu_seqlens[1:])), default=0)

    def _rank(self, rank) -> int:
        return _index("rank", rank, self.world_size)

    def _seq(self, seq) -> int:
        return _index("seq", seq, self.num_seqs)

    def token_range(self, rank: int) -> Tuple[int, int]:
        rank = self._rank(rank)
        return self.cuts[rank], self.cuts[rank + 1]

    def head(self, rank: int) -> Optional[Segment]:
        """The rank's first segment when it continues a sequence from an earlier rank (its start state
        is known only after the exchange), else None."""
        segs = self.segments[self._rank(rank)]
        return segs[0] if segs and segs[0].continues_from_earlier else None

    def sends(self, rank: int) -> Optional[str]:
        """What the rank contributes to the state exchange: "summary" (its only segment spans it, so it
        sends the affine map (A, B) of that segment), "state" (its last segment starts a sequence here or
        on this rank, so it sends that segment's end state) or None."""
        segs = self.segments[self._rank(rank)]
        if not segs or not segs[-1].continues_later:
            return None
        return "summary" if segs[-1].continues_from_earlier else "state"

    def pieces(self, seq: int) -> Tuple[int, ...]:
        """The ranks holding tokens of sequence `seq`, in rank order (empty for an empty sequence)."""
        return self.seq_ranks[self._seq(seq)]

    def spanning_seqs(self) -> Tuple[int, ...]:
        """Sequences with tokens on more than one rank, in order."""
        return tuple(n for n, ranks in enumerate(self.seq_ranks) if len(ranks) > 1)

    def final_owner(self, seq: int) -> Optional[int]:
        """The rank that computes sequence `seq`'s final state (the one holding its last token), or None
        for an empty sequence (its final state is its initial state)."""
        ranks = self.pieces(seq)
        return ranks[-1] if ranks else None

    def owned_finals(self, rank: int) -> Tuple[int, ...]:
        """The sequences whose final state `rank` computes, in order."""
        return tuple(s.seq for s in self.segments[self._rank(rank)] if not s.continues_later)

    def check_checkpoints(self, checkpoint_every: int) -> None:
        """Checkpoints every e tokens stay where one-device prefill puts them only if every cut inside a
        sequence sits a multiple of e after that sequence's start: ValueError otherwise."""
        # checked: a bool, a float (2.5 passes every % test it divides) or a negative count skipped the check
        if _int("checkpoint_every", checkpoint_every, ">= 0") < 0:
            raise ValueError(f"checkpoint_every: expected an int >= 0, got {checkpoint_every}")
        if checkpoint_every == 0:
            return
        for r in range(1, self.world_size):
            for seg in self.segments[r]:
                if seg.continues_from_earlier and seg.offset_in_seq % checkpoint_every:
                    raise ValueError(
                        f"plan: cut {r} at token {seg.start} lies {seg.offset_in_seq} tokens into sequence "
                        f"{seg.seq} (which starts at {seg.seq_start}); with checkpoint_every={checkpoint_every} "
                        f"a cut inside a sequence must be a multiple of {checkpoint_every} tokens from its "
                        f"start (build the plan with checkpoint_every={checkpoint_every} for aligned default cuts)")


def _index(name: str, value, count: int) -> int:
    """A rank or sequence number in [0, count): a negative one would index from the end (token_range(-1) gave
    (T, 0)), a bool would pass as 0 or 1, and one past the end raised a bare IndexError."""
    if not 0 <= _int(name, value, f"in [0, {count})") < count:
        raise ValueError(f"{name}: expected an int in [0, {count}) (the plan's), got {value}")
    return value


def _host_ints(name: str, values) -> list:
    """A 1-D list of host ints from a list/tuple of ints or a 1-D CPU integer tensor."""
    if torch.is_tensor(values):
        if values.device.type != "cpu":
            raise ValueError(f"{name}: expected host offsets (a list or a CPU tensor), got a tensor on "
                             f"{values.device}; copy it once with .tolist() (the plan is host integers)")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {list(values.shape)}")
        return [int(x) for x in values.tolist()]
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}: expected a list or tuple of ints or a CPU tensor, got {type(values).__name__}")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}: expected ints, got {type(x).__name__} {x!r}")
    return list(values)


def _snap_to_checkpoints(cut: int, cu: Sequence[int], every: int) -> int:
    """The latest position <= cut that is a sequence boundary or a multiple of `every` tokens into the
    sequence holding `cut` (monotone in cut, so snapped cuts stay ordered)."""
    for s, e in zip(cu, cu[1:]):
        if s < cut < e:
            return s + (cut - s) // every * every
    return cut


def plan(cu_seqlens, world_size: int, cuts=None, *, checkpoint_every: int = 0) -> Plan:
    """The plan for `world_size` ranks over the packed prompt `cu_seqlens` (host offsets, N+1 ints).

    cuts: world_size + 1 non-decreasing token offsets from 0 to T (rank r owns [cuts[r], cuts[r+1])),
    or None for an equal token split (cuts[r] = r * T // world_size; with checkpoint_every > 0 each cut
    inside a sequence is moved back to the nearest multiple of checkpoint_every from that sequence's
    start). With checkpoint_every > 0 given cuts must be aligned that way (ValueError otherwise).
    """
    cu = _host_ints("cu_seqlens", cu_seqlens)
    if len(cu) < 2:
        raise ValueError(f"cu_seqlens: expected N+1 >= 2 offsets, got {cu}")
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets starting at 0, got {cu}")
    if _int("world_size", world_size, ">= 1") < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size}")
    if _int("checkpoint_every", checkpoint_every, ">= 0") < 0:
        raise ValueError(f"checkpoint_every: expected an int >= 0, got {checkpoint_every}")
    T = cu[-1]
    if cuts is None:
        cuts = [r * T // world_size for r in range(world_size + 1)]
        if checkpoint_every > 0:
            cuts = [_snap_to_checkpoints(c, cu, checkpoint_every) for c in cuts]
    else:
        cuts = _host_ints("cuts", cuts)
        if len(cuts) != world_size + 1:
            raise ValueError(f"cuts: expected world_size + 1 = {world_size + 1} offsets, got {len(cuts)}: {cuts}")
        if cuts[0] != 0 or cuts[-1] != T:
            raise ValueError(f"cuts: expected offsets from 0 to T = {T}, got {cuts}")
        if any(b < a for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"cuts: expected non-decreasing offsets, got {cuts}")
    segments, seq_ranks = [], [[] for _ in range(len(cu) - 1)]
    for r in range(world_size):
        a, b = cuts[r], cuts[r + 1]
        segs = []
        for n, (s, e) in enumerate(zip(cu, cu[1:])):
            lo, hi = max(s, a), min(e, b)
            if lo < hi:
                segs.append(Segment(n, lo, hi, s, s < a, e > b))
                seq_ranks[n].append(r)
        segments.append(tuple(segs))
    result = Plan(tuple(cu), world_size, tuple(cuts), checkpoint_every, tuple(segments),
                  tuple(tuple(r) for r in seq_ranks))
    result.check_checkpoints(checkpoint_every)
    return result
