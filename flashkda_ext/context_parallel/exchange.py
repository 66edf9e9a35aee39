"""The collectives of context-parallel prefill: an agreement round, then fixed-size all_gathers.

Every rank makes the same collectives with tensors of the same size whatever its segments are (sizes
come from the plan, which every rank holds), so no rank can wait on a collective another skips.
GroupExchange runs them over a torch.distributed process group (gloo: CPU tensors; NCCL: CUDA
tensors); the one-process simulation hands the per-rank tensors over directly instead.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional

import torch


def call_signature(*parts) -> int:
    """A 63-bit digest of the call's host facts (plan, shapes, dtypes, scalar arguments): every rank
    must pass the same, or the ranks would run different collectives."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class GroupExchange:
    """all_gather over `group` (None = the default group) on the device its backend needs."""

    def __init__(self, group=None):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group first (or use simulate() in one process)")
        # A list of ranks, a rank number or a DeviceMesh failed inside torch unnamed ("unhashable type: 'list'",
        # "Group 0 is not registered"); new_group's marker for a non-member (an int) is let through to the
        # membership check below.
        non_member = type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER
        if group is not None and not non_member and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected a torch.distributed ProcessGroup (from "
                            f"torch.distributed.new_group) or None (the default group), got "
                            f"{type(group).__name__} {group!r}")
        self.dist, self.group = dist, group
        try:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        except ValueError as e:   # a group destroyed, or one of an earlier default group
            raise ValueError(f"group: not a process group of the current torch.distributed world (destroyed, "
                             f"or made before init_process_group was called again): {e}") from None
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given process group")
        backend = str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")

    def check_device(self, name: str, device: torch.device) -> None:
        """A CUDA input on another GPU than the one the NCCL exchange uses (the current CUDA device): every
        collective would run on that other GPU, one rank's communicator on a device it was not set up for (a
        hang or NCCL's error, naming nothing), so the call is refused naming the input. CPU inputs and gloo
        exchange on the CPU, whatever the current device."""
        if device.type == "cuda" and self.device.type == "cuda" and device != self.device:
            raise ValueError(f"{name}: on {device}, but this rank's NCCL exchange runs on the current CUDA device "
                             f"{self.device}; call torch.cuda.set_device({device}) before cp_prefill")

    def gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on every rank), in rank order, on tensor's device."""
        send = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(send) for _ in range(self.world_size)]
        self.dist.all_gather(parts, send, group=self.group)
        return [p.to(tensor.device) for p in parts]

    def agree(self, signature: int, error: Optional[BaseException]) -> None:
        """Raise on every rank if any rank refused its arguments or the ranks' calls differ, so that a
        refusal on one rank never leaves the others waiting in a later collective."""
        mine = torch.tensor([0 if error is None else 1, signature if error is None else 0], dtype=torch.int64)
        rows = torch.stack(self.gather(mine)).tolist()
        if error is not None:
            raise error
        failed = [r for r, (bad, _) in enumerate(rows) if bad]
        if failed:
            raise ValueError(f"cp_prefill: rank(s) {failed} refused their arguments (see the error on those "
                             f"ranks); nothing was run or written")
        if len({sig for _, sig in rows}) != 1:
            raise ValueError("cp_prefill: the ranks were called with different plans or arguments (plan, "
                             "shapes, dtypes, gate and state arguments must be the same on every rank, "
                             "apart from each rank's own token range); nothing was run or written")
