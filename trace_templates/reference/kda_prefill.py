# KDA prefill, token by token. Fragment appended after kda_common.py; the emitted reference also
# defines STATE_MODE ("none", "dense", "pool"), STATE_DTYPE and OUTPUT_FINAL_STATE.


def kda_prefill_reference(q, k, v, g, beta, A_log=None, dt_bias=None, cu_seqlens=None,
                          initial_state=None, state=None, state_indices=None, final_state=None,
                          lower_bound=None, scale=None, checkpoint_every=0, checkpoints=None):
    """Returns the outputs in the definition's order: out, then final_state_out (dense) or
    state_out (pool) when OUTPUT_FINAL_STATE, then checkpoints_out when checkpoint_every > 0.
    final_state and checkpoints are the op's destination buffers: final_state is never read,
    checkpoints' entries past a sequence's count are returned unchanged (the kernels skip them)."""
    B, T, HV, V = v.shape
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    qn, kn, vv, gl, bb = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale)
    work = vv.dtype
    if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                         or checkpoint_every < 0):
        raise TypeError(f"checkpoint_every: expected an int >= 0, got {type(checkpoint_every).__name__} "
                        f"{checkpoint_every!r}")
    if cu_seqlens is None:
        segments = [(b, 0, T) for b in range(B)]
    else:
        offsets = [int(x) for x in _indices("cu_seqlens", cu_seqlens, (None,)).tolist()]
        segments = [(0, s, e) for s, e in zip(offsets[:-1], offsets[1:])]
    N = len(segments)
    if STATE_MODE == "pool":
        _indices("state_indices", state_indices, (N,))         # one per sequence
    indices = state_indices.tolist() if STATE_MODE == "pool" else None
    if STATE_MODE == "pool":
        _check_slots(state_indices, state.shape[0])
    if cu_seqlens is not None and (offsets[0] != 0 or offsets[-1] != T
                                   or any(a > b for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to seq_len = {T}")

    out = torch.zeros(B, T, HV, V, dtype=work, device=v.device)
    finals, per_seq_ckpts = [], []
    for n, (b, s, e) in enumerate(segments):
        if STATE_MODE == "pool" and not _is_padding(indices[n]):
            S = _work(state[indices[n]]).clone()
        elif STATE_MODE == "dense" and initial_state is not None:
            S = _work(initial_state[n]).clone()
        else:
            S = torch.zeros(HV, V, K, dtype=work, device=v.device)
        ckpts = []
        for t in range(s, e):
            out[b, t], S = _step(S, qn[b, t], kn[b, t], vv[b, t], gl[b, t], bb[b, t])
            if checkpoint_every and (t - s + 1) % checkpoint_every == 0:
                ckpts.append(S.clone())
        finals.append(S)
        per_seq_ckpts.append(ckpts)

    results = [out.to(v.dtype)]
    if OUTPUT_FINAL_STATE and STATE_MODE == "pool":
        pool = state.clone()
        for n, S in enumerate(finals):
            if not _is_padding(indices[n]):
                pool[indices[n]] = S.to(pool.dtype)
        results.append(pool)
    elif OUTPUT_FINAL_STATE and STATE_MODE == "dense":
        final = torch.zeros(N, HV, V, K, dtype=getattr(torch, STATE_DTYPE), device=v.device)
        for n, S in enumerate(finals):
            final[n] = S
        results.append(final)
    if checkpoint_every:
        ckpt = checkpoints.clone()
        for n, states in enumerate(per_seq_ckpts):
            if len(states) > ckpt.shape[1]:
                raise ValueError(f"checkpoints: sequence {n} reaches {len(states)} checkpoints, "
                                 f"the buffer holds {ckpt.shape[1]}")
            for c, S in enumerate(states):
                ckpt[n, c] = S
        results.append(ckpt)
    return results[0] if len(results) == 1 else tuple(results)
