"""One vLLM chunk call served as several kda_prefill calls, one a part of its requests (host_lengths.step_parts:
the step's one-token decodes apart from its prompts), each routed by its own longest sequence.

Why not one call: routes read a call's width (sequences x heads) and its longest sequence; hundreds of one-token
decodes beside one prompt make the call look wide, so the prompt lands on a route made for many sequences.

The parts are contiguous slices of the tokens and of the requests, so nothing is gathered: each call reads its
slice of q / k / v / g / beta and of the initial states, and writes its slice of one output and one final-state
buffer; the parts' offsets are cu_seqlens' own slices, rebased on the device.
"""
from __future__ import annotations

import torch

from ... import validation
from ._common import run_op


def prefill_in_parts(kda_prefill, parts, q, k, v, g, beta, cu, *, initial_state, output_final_state, out,
                     final_state=None, **op_kwargs):
    """(out, final_state) of kda_prefill over the parts [(t0, t1, r0, r1, longest)]; op_kwargs (gate, scale, ...)
    go to every call. One part: one call as it stands."""
    if len(parts) == 1:
        res = run_op(kda_prefill, q, k, v, g, beta, cu_seqlens=cu, initial_state=initial_state,
                     output_final_state=output_final_state, final_state=final_state, out=out,
                     max_seqlen=parts[0][4], **op_kwargs)
        return res[0], res[1]
    N = cu.shape[0] - 1
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    if output_final_state and final_state is None:
        dtype = initial_state.dtype if initial_state is not None else torch.float32
        final_state = torch.empty((N, v.shape[2], v.shape[3], q.shape[3]), dtype=dtype, device=q.device)
    calls = []
    for t0, t1, r0, r1, longest in parts:
        part_cu = cu[r0:r1 + 1] if t0 == 0 else cu[r0:r1 + 1] - t0
        calls.append(((q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1]), dict(
            cu_seqlens=part_cu, initial_state=None if initial_state is None else initial_state[r0:r1],
            output_final_state=output_final_state, final_state=final_state[r0:r1] if output_final_state else None,
            out=out[:, t0:t1], max_seqlen=longest, **op_kwargs)))
    # Every later part is checked before the first is launched: the parts differ in their offsets and lengths (the
    # metadata's cut may not match the call: tokens padded past the last offset, a longest it undercounts), and a
    # call the op refuses falls back to vLLM's kernel with nothing written.
    for args, kwargs in calls[1:]:
        run_op(validation.check_kda_prefill, *args, **kwargs)
    for args, kwargs in calls:
        run_op(kda_prefill, *args, **kwargs)
    return out, (final_state if output_final_state else None)
