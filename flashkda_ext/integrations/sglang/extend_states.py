"""The states an SGLang extend hands back beside its output: host lengths checked against the offsets, the
start states read from the pool, and the radix cache's fp32 track snapshot (track_state)."""
from __future__ import annotations

import torch

from ... import validation


def host_lengths(query_start_loc: torch.Tensor, extend_seq_lens_cpu, T: int, *, exact: bool):
    """Per-request token counts on the host (None when not given and not `exact`), checked against
    query_start_loc.

    Offsets in host memory are always compared value by value. Device offsets are copied to the host (one
    sync) only when `exact` (the lengths then size and order the checkpoints and h); otherwise the host
    lengths only have to agree with the batch (count N, sum T) since nothing is computed from them."""
    N = query_start_loc.shape[0] - 1
    given = None
    if extend_seq_lens_cpu is not None:
        raw = extend_seq_lens_cpu.tolist() if torch.is_tensor(extend_seq_lens_cpu) else list(extend_seq_lens_cpu)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in raw):
            raise ValueError(f"extend_seq_lens_cpu: expected N non-negative ints, got {raw}")
        if len(raw) != N or sum(raw) != T:
            raise ValueError(f"extend_seq_lens_cpu: expected N = {N} lengths summing to T = {T} tokens, got {raw}")
        given = raw
    if not exact and (given is None or query_start_loc.device.type != "cpu"):
        return given
    offsets = query_start_loc.tolist()
    validation.check_offsets_span("query_start_loc", offsets, T)
    device_lengths = [e - s for s, e in zip(offsets, offsets[1:])]
    if given is not None and given != device_lengths:
        raise ValueError(f"extend_seq_lens_cpu: {given} disagrees with the lengths in query_start_loc "
                         f"{device_lengths}")
    return device_lengths


def gather_states(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """pool[idx] with padding (< 0) and out-of-range indices read as zero states (as the kernels start them)."""
    valid = (idx >= 0) & (idx < pool.shape[0])
    states = pool.index_select(0, torch.where(valid, idx, 0).long())
    return torch.where(valid.view(-1, 1, 1, 1), states, torch.zeros((), dtype=pool.dtype, device=pool.device))


def check_track(track_state, track_chunk_idx, pool: torch.Tensor, N: int) -> None:
    """SGLang's snapshot buffer: fp32 [>= N, HV, V, K] on the pool's device, with track_chunk_idx [>= N]."""
    if not torch.is_tensor(track_state) or track_state.dtype != torch.float32 or track_state.dim() != 4 \
            or tuple(track_state.shape[1:]) != tuple(pool.shape[1:]) or track_state.shape[0] < N \
            or track_state.device != pool.device:
        got = (f"{track_state.dtype} {list(track_state.shape)} on {track_state.device}"
               if torch.is_tensor(track_state) else type(track_state).__name__)
        raise ValueError(f"track_state: expected float32 [>= {N}, {', '.join(map(str, pool.shape[1:]))}] on "
                         f"{pool.device} (the fp32 snapshot buffer), got {got}")
    if not torch.is_tensor(track_chunk_idx) or track_chunk_idx.dim() != 1 or track_chunk_idx.shape[0] < N \
            or track_chunk_idx.dtype not in (torch.int32, torch.int64) or track_chunk_idx.device != pool.device:
        got = (f"{track_chunk_idx.dtype} {list(track_chunk_idx.shape)}" if torch.is_tensor(track_chunk_idx)
               else type(track_chunk_idx).__name__)
        raise ValueError(f"track_chunk_idx: expected an int tensor [>= {N}] on {pool.device} beside track_state, "
                         f"got {got}")
    # written after the pool is committed, so a buffer torch cannot write is refused now: rows apart (an
    # expanded view would write one row twice), and the ops' inference-only rule
    validation._slot_stride("track_state", track_state)
    validation._inference_only((), (("track_state", track_state),))


def write_track(track_state, track_chunk_idx, initial, checkpoints, query_start_loc, chunk: int) -> None:
    """track_state[n] = the state entering chunk c = track_chunk_idx[n] of request n, in fp32: its start
    state for c = 0, else checkpoint c - 1 (the state after c * chunk tokens). As SGLang's chunk_kda, a row
    whose c is negative or not a chunk of its request is left alone. No host sync (CUDA-graph safe)."""
    N, C = checkpoints.shape[0], checkpoints.shape[1]
    n = torch.arange(N, device=initial.device)
    c = track_chunk_idx[:N].to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    chunks = (qsl[1:] - qsl[:-1] + chunk - 1) // chunk
    # c - 1 < C always holds for c < chunks (C >= the longest request // chunk): kept as a guard
    valid = (c >= 0) & (c < chunks) & (c - 1 < C)
    flat = torch.cat([initial.to(checkpoints.dtype), checkpoints.reshape(N * C, *checkpoints.shape[2:])])
    src = torch.where(c == 0, n, N + n * C + (c - 1).clamp(0, max(C - 1, 0)))
    src = torch.where(valid, src, n)
    rows = track_state[:N]
    rows.copy_(torch.where(valid.view(-1, 1, 1, 1), flat.index_select(0, src).to(torch.float32), rows))
