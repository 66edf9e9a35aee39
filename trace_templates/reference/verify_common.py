# The request plan of the verify references (kda_verify.py, fused_kda_verify.py). Fragment appended
# after kda_common.py.


def _verify_plan(state_indices, cu_seqlens, num_accepted_tokens, num_slots, total_tokens):
    """[(start, end, read slot or None, [stored slot or None per token], offset)] per request, with
    a ValueError naming the input for values that are no verify call (random integers, say)."""
    N, cols = _indices("state_indices", state_indices, (None, None)).shape
    offsets = [int(x) for x in _indices("cu_seqlens", cu_seqlens, (None,)).tolist()]
    if len(offsets) != N + 1 or offsets[0] != 0 or offsets[-1] != total_tokens or any(
            not 0 <= b - a <= cols for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to total_tokens = "
                         f"{total_tokens}, each request 0 .. max_draft = {cols} tokens")
    accepted = [1] * N if num_accepted_tokens is None else [
        int(a) for a in _indices("num_accepted_tokens", num_accepted_tokens, (N,)).tolist()]
    if any(not 1 <= a <= cols for a in accepted):
        raise ValueError(f"num_accepted_tokens: expected values in [1, max_draft = {cols}]")
    _check_slots(state_indices, num_slots)
    live = lambda x: None if _is_padding(x) else x  # noqa: E731
    plan = []
    for n, row in enumerate(state_indices.tolist()):
        s, e = offsets[n], offsets[n + 1]
        plan.append((s, e, live(row[accepted[n] - 1]), [live(row[t]) for t in range(e - s)], accepted[n] - 1))
    return plan
