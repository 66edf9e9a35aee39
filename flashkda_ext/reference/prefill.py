"""Prefill semantics: packed variable-length sequences, initial/final state (dense or pool),
checkpoints; and the token-by-token recurrence that defines them."""
from __future__ import annotations

import torch

from . import checks
from .gates import prepare_token_inputs
from .step import delta_step


def _segments(B, T, cu_seqlens):
    """[(batch row, start, end)] for every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if B != 1:
        raise ValueError(f"cu_seqlens given: batch must be 1 (packed input), got B={B}")
    offsets = checks.host_ints("cu_seqlens", cu_seqlens)   # int() truncated a float offset (2.7 -> 2)
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens: expected N+1 offsets from 0 to T={T}, got {offsets}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens: offsets must be non-decreasing, got {offsets}")
    return [(0, a, b) for a, b in zip(offsets, offsets[1:])]


def is_padding(index: int, null_slot0: bool) -> bool:
    """A state index that means 'no state': negative, or 0 when slot 0 is the null block."""
    return index < 0 or (null_slot0 and index == 0)


def run_prefill(sequence_fn, q, k, v, g, beta, *, gate, A_log, dt_bias, lower_bound, scale,
                beta_is_logit, cu_seqlens, initial_state, state_indices, null_slot0,
                output_final_state, checkpoint_every, dtype):
    """Shared driver of kda_recurrent and kda_chunked.

    sequence_fn(q, k, v, g, beta, S0, checkpoint_every) runs one sequence ([L, HV, .] inputs,
    S0 [HV, V, K]) and returns (o [L, HV, V], final S, [checkpoint states]).
    """
    checks.tensor("q", q, 4, "[B, T, H, K]")
    checks.tensor("v", v, 4, "[B, T, HV, V]")   # read below before any other check (a 3-D v: IndexError)
    # scalars checked before they are used: a bool or float count, a str flag taken by truth value
    checkpoint_every = checks.count("checkpoint_every", checkpoint_every, 0)
    checks.flag("output_final_state", output_final_state)
    checks.flag("null_slot0", null_slot0)
    if initial_state is not None:
        checks.tensor("initial_state", initial_state, 4, "[N or slots, HV, V, K]")
    B, T = q.shape[0], q.shape[1]
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    qn, kn, vv, gl, bb = prepare_token_inputs(
        q, k, v, g, beta, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        scale=scale, beta_is_logit=beta_is_logit, dtype=dtype)
    segments = _segments(B, T, cu_seqlens)
    N = len(segments)
    device = q.device

    pool_mode = state_indices is not None
    if pool_mode:
        if initial_state is None:
            raise ValueError("state_indices given: initial_state must be the state pool [slots, HV, V, K]")
        indices = checks.host_ints("state_indices", state_indices)   # a float tensor was truncated
        if len(indices) != N:
            raise ValueError(f"state_indices: expected {N} entries (one per sequence), got {len(indices)}")
        live = [i for i in indices if not is_padding(i, null_slot0)]
        if len(set(live)) != len(live):
            raise ValueError(f"state_indices: a slot may serve only one sequence in prefill, got {indices}")
        slots = initial_state.shape[0]
        if any(i >= slots for i in live):
            raise ValueError(f"state_indices: entries must be < slots={slots}, got {indices}")
    expected_state = (initial_state.shape[0] if pool_mode else N, HV, V, K)
    if initial_state is not None and tuple(initial_state.shape) != expected_state:
        raise ValueError(f"initial_state: expected shape {expected_state} (layout [., HV, V, K]), "
                         f"got {tuple(initial_state.shape)}")

    def start_state(n):
        if initial_state is None or (pool_mode and is_padding(indices[n], null_slot0)):
            return torch.zeros(HV, V, K, dtype=dtype, device=device)
        return initial_state[indices[n] if pool_mode else n].to(dtype).clone()

    out = torch.zeros(B, T, HV, V, dtype=dtype, device=device)
    finals, checkpoints_per_seq = [], []
    for n, (b, s, e) in enumerate(segments):
        o, S, ckpts = sequence_fn(qn[b, s:e], kn[b, s:e], vv[b, s:e], gl[b, s:e], bb[b, s:e],
                                  start_state(n), checkpoint_every)
        out[b, s:e] = o
        finals.append(S)
        checkpoints_per_seq.append(ckpts)

    checkpoints = None
    if checkpoint_every > 0:
        C = max([(e - s) // checkpoint_every for _, s, e in segments], default=0)
        # entries past a sequence's own count stay NaN (kernels leave them untouched)
        checkpoints = torch.full((N, C, HV, V, K), float("nan"), dtype=dtype, device=device)
        for n, ckpts in enumerate(checkpoints_per_seq):
            for c, S in enumerate(ckpts):
                checkpoints[n, c] = S

    final_state = None
    if output_final_state:
        final_state = final_states(finals, initial_state, indices if pool_mode else None, null_slot0, (HV, V, K),
                                   dtype, device)
    return out, final_state, checkpoints


def final_states(finals, initial_state, indices, null_slot0, state_shape, dtype, device):
    """The call's final state from each sequence's own (finals[n], [HV, V, K]): with a pool (indices given) a copy of
    initial_state with the sequences' slots written and every other slot (padding's too) as it was; else the states
    stacked [N, HV, V, K] in dtype."""
    if indices is not None:
        final_state = initial_state.clone()
        for n, S in enumerate(finals):
            if not is_padding(indices[n], null_slot0):
                final_state[indices[n]] = S.to(initial_state.dtype)
        return final_state
    return torch.stack(finals) if finals else torch.zeros(0, *state_shape, dtype=dtype, device=device)


def _recurrent_sequence(q, k, v, g, beta, S, checkpoint_every):
    L, HV, V = v.shape
    o = torch.zeros(L, HV, V, dtype=v.dtype, device=v.device)
    ckpts = []
    for t in range(L):
        o[t], S = delta_step(S, q[t], k[t], v[t], g[t], beta[t])
        if checkpoint_every and (t + 1) % checkpoint_every == 0:
            ckpts.append(S.clone())
    return o, S, ckpts


def kda_recurrent(q, k, v, g, beta, *, gate="softplus", A_log=None, dt_bias=None, lower_bound=None,
                  scale=None, beta_is_logit=True, cu_seqlens=None, initial_state=None,
                  state_indices=None, null_slot0=False, output_final_state=True, checkpoint_every=0,
                  dtype=torch.float64):
    """KDA prefill, token by token: the definition every other form must match.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] raw gate; beta [B, T, HV].
    cu_seqlens (B == 1) packs N sequences; otherwise each batch row is one sequence (N = B).
    initial_state: dense [N, HV, V, K], or a pool [slots, HV, V, K] addressed by state_indices [N].
    Returns (out [B, T, HV, V] in dtype,
             final_state: dense [N, HV, V, K] in dtype, or in pool mode a new pool in the pool's
                          dtype with the addressed slots replaced (None if not output_final_state),
             checkpoints [N, C, HV, V, K] in dtype, the state after every checkpoint_every tokens,
                          C = max_n floor(len_n / checkpoint_every), NaN past a sequence's count
                          (None when checkpoint_every == 0)).
    """
    return run_prefill(_recurrent_sequence, q, k, v, g, beta, gate=gate, A_log=A_log,
                       dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                       beta_is_logit=beta_is_logit, cu_seqlens=cu_seqlens,
                       initial_state=initial_state, state_indices=state_indices,
                       null_slot0=null_slot0, output_final_state=output_final_state,
                       checkpoint_every=checkpoint_every, dtype=dtype)
