"""kda_verify's check and its call (VerifyCall), the value check of every verify call's host index
tensors (check_verify_values), and the index-table and length rules fused_kda_verify shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import (GATE_MODE, INT32_MAX, _bool, _check_backend, _contiguous, _indices, _int, _int32_tensor,
                     _ndim, _offset_bits, _pool, _qkv_common, _resolve_scale, _same_device, _state_tag, _tensor,
                     dtype_name)
from .memo import _memoized
from .decode import _GbDtypes, _pool_step_tail


def _int32_indices(name, idx, device, ndim, what):
    """An int32 index tensor of ndim dims on device, contiguous (what: the layout named in the error)."""
    idx = _int32_tensor(name, idx, device)
    _ndim(name, idx, ndim, what)
    _contiguous(name, idx)
    return idx


def _verify_index_table(state_indices, device):
    """A verify call's state_indices [N, T_max] (int32, one slot per request and token): the
    tensor, N and T_max."""
    state_indices = _int32_indices("state_indices", state_indices, device, 2,
                                   "[N, T_max] (one slot per request and token)")
    N, cols = state_indices.shape
    if N < 1 or cols < 1:
        raise ValueError(f"state_indices: expected [N, T_max] with N >= 1 and T_max >= 1, got "
                         f"{list(state_indices.shape)}")
    return state_indices, N, cols


def _step_rows(state, state_indices, HV, V, K, device, backend):
    """kda_verify's step rows: state [R, T_max, HV, V, K] (a row of T_max slots per request, rows T_max
    slots apart; the R * T_max slots dense or apart as a strided pool's) with state_indices int32 [N], one
    row each. Returns (state_indices, N, T_max, R)."""
    R, cols = state.shape[0], state.shape[1]
    if tuple(state.shape[2:]) != (HV, V, K):
        raise ValueError(f"state: expected step rows [R, T_max, HV, V, K] = [R, T_max, {HV}, {V}, {K}], got "
                         f"{list(state.shape)}")
    if R > 1 and cols > 1 and state.stride(0) != cols * state.stride(1):
        raise ValueError(f"state: the rows of step rows [R, T_max, HV, V, K] must follow each other at T_max "
                         f"steps (stride(0) = T_max * stride(1) = {cols * state.stride(1)}), got strides "
                         f"{list(state.stride())}")
    if R * cols > INT32_MAX:
        raise ValueError(f"state: R * T_max = {R * cols} slots do not fit the int32 slot indices")
    _pool("state", state.view(R * cols, HV, V, K), HV, V, K, device, backend)
    state_indices = _int32_indices("state_indices", state_indices, device, 1,
                                   "[N] (one row of state per request: state is step rows)")
    N = state_indices.shape[0]
    if N < 1 or cols < 1:
        raise ValueError(f"state_indices: expected [N] with N >= 1 and state [R, T_max, ...] with T_max >= 1, got "
                         f"{list(state_indices.shape)} and {list(state.shape)}")
    return state_indices, N, cols, R


def _verify_lengths(first, T, N, cols, cu_seqlens, num_accepted_tokens, max_seqlen, device,
                    one_token_is_decode=False) -> int:
    """cu_seqlens, num_accepted_tokens and max_seqlen of a verify call with N requests of
    0 .. T_max = cols tokens, T >= 1 in all (errors about T name the token input `first`); returns
    max_seqlen resolved (None: T_max). one_token_is_decode: T_max = 1 is served as kda_decode, one
    token per request, so it needs T = N."""
    _indices("cu_seqlens", cu_seqlens, N + 1, device, "[N+1] (N = state_indices.shape[0])")
    if not 1 <= T <= N * cols:
        # every request has 0 .. T_max tokens (an empty request: an engine's graph padding)
        raise ValueError(f"{first}: expected T between 1 and N * T_max = {N * cols} tokens (each request "
                         f"0 .. T_max = {cols} tokens), got T = {T}")
    if one_token_is_decode and cols == 1 and T != N:
        raise ValueError(f"{first}: with T_max = 1 (state_indices [N, 1]) the call is kda_decode, one token per "
                         f"request: expected T = N = {N}, got T = {T} (empty requests need T_max >= 2)")
    if num_accepted_tokens is not None:
        _indices("num_accepted_tokens", num_accepted_tokens, N, device, "[N] (one count per request)")
    if max_seqlen is None:
        return cols
    _int("max_seqlen", max_seqlen, "or None")
    if not 1 <= max_seqlen <= cols:
        raise ValueError(f"max_seqlen: expected an int in [1, T_max = {cols}] (the columns of "
                         f"state_indices) or None, got {max_seqlen}")
    return max_seqlen


def _verify_route_meta(call) -> dict:
    """The route metadata of a verify call (VerifyCall, FusedVerifyCall)."""
    return {"device": call.backend, "num_seqs": call.num_seqs, "value_heads": call.value_heads,
            "total_tokens": call.total_tokens, "max_seqlen": call.max_seqlen,
            "work_items": call.num_seqs * call.value_heads, "state": _state_tag(call.state_dtype),
            "offset": f"o{call.offset_bits}", "gate": call.gate}


@dataclass(frozen=True)
class VerifyCall(_GbDtypes):
    backend: str
    num_seqs: int
    total_tokens: int
    index_cols: int                 # T_max: columns of state_indices
    max_seqlen: int                 # host bound on T_n used for routing (<= index_cols)
    num_heads: int
    value_heads: int
    head_dim_k: int
    head_dim_v: int
    slots: int
    input_dtype: str
    state_dtype: str
    gate: str
    gate_mode: int
    lower_bound: float
    scale: float
    beta_is_logit: bool
    null_slot0: bool
    has_accepted: bool
    offset_bits: int
    g_dtype: str
    beta_dtype: str
    initial_slots: int = -1         # slots of initial_state; -1: no second start pool
    rows: int = 0                   # step rows (state [R, T_max, ...], state_indices [N]): R; 0: a slot table
    tree: bool = False              # parent_tokens given (a draft tree): only register-store modules serve it

    @property
    def has_initial(self) -> bool:
        return self.initial_slots >= 0

    @property
    def as_decode(self) -> bool:
        """T_max = 1 without initial_state: every request is one token read from and written to
        column 0, which is kda_decode on state_indices[:, 0]; the op serves it with the decode module
        (bitwise kda_decode by construction). With initial_state the read is elsewhere: the verify
        module serves it."""
        return self.index_cols == 1 and not self.has_initial and not self.rows

    def route_meta(self) -> dict:
        return dict(_verify_route_meta(self), gb=self.gb, tree=self.tree)

    def decode_route_meta(self) -> dict:
        """kda_decode's route metadata for the as_decode case (negatives allowed: 'padded')."""
        return {"device": self.backend, "rows": self.num_seqs, "value_heads": self.value_heads,
                "work_items": self.num_seqs * self.value_heads, "state": _state_tag(self.state_dtype),
                "offset": f"o{self.offset_bits}", "slot_mode": "padded", "gate": self.gate, "gb": self.gb}


@_memoized
def check_kda_verify(q, k, v, g, beta, *, state, state_indices, cu_seqlens, num_accepted_tokens=None,
                     max_seqlen=None, A_log=None, dt_bias=None, lower_bound=None, gate="softplus",
                     scale=None, beta_is_logit=True, null_slot0=False, out=None, initial_state=None,
                     initial_state_indices=None, parent_tokens=None, backend=None) -> VerifyCall:
    """Everything about a verify call that its metadata shows; the values of host index tensors
    are checked by check_verify_values on every call (and the addresses by check_apart)."""
    device, H, K, HV, V = _qkv_common(q, k, v, g, beta, lead=("1", "T"), lead_names="1, T", gb_f32=True,
                                      row_dim=1)
    backend = _check_backend(backend, device)
    if q.shape[0] != 1:
        raise ValueError(f"q: expected the packed layout [1, T, H, K] (requests packed by cu_seqlens), "
                         f"got batch {q.shape[0]} in {list(q.shape)}")
    T = q.shape[1]
    _bool("beta_is_logit", beta_is_logit)
    _bool("null_slot0", null_slot0)
    if isinstance(state, torch.Tensor) and state.dim() == 5:  # step rows: one row of T_max slots per request
        state = _tensor("state", state)
        _same_device("state", state, device)
        state_indices, N, cols, rows = _step_rows(state, state_indices, HV, V, K, device, backend)
        slots = rows * cols
    else:
        slots, rows = _pool("state", state, HV, V, K, device, backend), 0
        state_indices, N, cols = _verify_index_table(state_indices, device)
    initial_slots = _initial_pool(initial_state, initial_state_indices, num_accepted_tokens, state, (HV, V, K), N,
                                  device, backend)
    max_seqlen = _verify_lengths("q", T, N, cols, cu_seqlens, num_accepted_tokens, max_seqlen, device,
                                 one_token_is_decode=initial_state is None and not rows)
    if parent_tokens is not None:  # a draft tree: token t continues from token parent_tokens[n, t]
        parent_tokens = _int32_indices("parent_tokens", parent_tokens, device, 2,
                                       "[N, T_max] (the token each draft token continues from)")
        if tuple(parent_tokens.shape) != (N, cols):
            raise ValueError(f"parent_tokens: expected [N, T_max] = [{N}, {cols}] (as the slot table "
                             f"state_indices stands for), got {list(parent_tokens.shape)}")
    lb = _pool_step_tail("kda_verify", "padded", (H, K, HV, V), q, k, v, g, beta, state, A_log, dt_bias,
                         lower_bound, gate, out, (1, T, HV, V), "[1, T, HV, V]",
                         (("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                          ("num_accepted_tokens", num_accepted_tokens), ("initial_state", initial_state),
                          ("initial_state_indices", initial_state_indices), ("parent_tokens", parent_tokens)),
                         device, backend)
    return VerifyCall(backend, N, T, cols, max_seqlen, H, HV, K, V, slots, dtype_name(q.dtype),
                      dtype_name(state.dtype), gate, GATE_MODE[gate], lb, _resolve_scale(scale, K),
                      beta_is_logit, null_slot0, num_accepted_tokens is not None,
                      _offset_bits(state, initial_state), dtype_name(g.dtype), dtype_name(beta.dtype), initial_slots,
                      rows, parent_tokens is not None)


def _initial_pool(initial_state, initial_state_indices, num_accepted_tokens, state, dims, N, device, backend) -> int:
    """kda_verify's second start pool: initial_state [slots2, HV, V, K] in state's dtype (read only;
    its slots may sit apart, as state's) with initial_state_indices int32 [N], given together and
    without num_accepted_tokens. Returns its slot count, -1 when absent."""
    if initial_state is None and initial_state_indices is None:
        return -1
    if initial_state is None or initial_state_indices is None:
        missing = "initial_state" if initial_state is None else "initial_state_indices"
        raise ValueError(f"{missing}: initial_state and initial_state_indices are given together (request n "
                         f"starts from initial_state[initial_state_indices[n]]) or not at all")
    if num_accepted_tokens is not None:
        raise ValueError("num_accepted_tokens: expected None with initial_state (request n starts from "
                         "initial_state[initial_state_indices[n]], not from a column of state_indices)")
    slots = _pool("initial_state", initial_state, *dims, device, backend)
    if initial_state.dtype != state.dtype:
        raise ValueError(f"initial_state: expected the dtype of state ({dtype_name(state.dtype)}), got "
                         f"{dtype_name(initial_state.dtype)}")
    _indices("initial_state_indices", initial_state_indices, N, device, "[N] (one start slot per request)")
    return slots


def check_verify_values(call: VerifyCall, cu_seqlens, state_indices, num_accepted_tokens,
                        max_seqlen=None, initial_state_indices=None, initial_is_state=False,
                        parent_tokens=None) -> None:
    """The values of the index tensors, where they live in host memory (the CPU backend); on a GPU
    they are never read here (no synchronisation), and the kernels treat what they cannot serve as
    padding (docs/semantics.md, "Verify"). Runs on every call: values are not metadata.
    initial_is_state: initial_state is the identical view of state (its reads then meet the writes).
    parent_tokens (kda_verify's draft tree): entry [n, t], t >= 1 of a request's tokens, in [0, t) and
    naming a token whose entry is live (its state is stored) unless the request is padding."""
    if call.backend != "cpu" or cu_seqlens.device.type != "cpu":
        return
    cs = cu_seqlens.tolist()
    T, cols = call.total_tokens, call.index_cols
    if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {T} (a request has "
                         f">= 0 tokens), got {cs}")
    lengths = [b - a for a, b in zip(cs, cs[1:])]
    longest = max(lengths)
    if longest > call.max_seqlen:
        what = "max_seqlen" if max_seqlen is not None else "state_indices"
        raise ValueError(f"{what}: a request has {longest} tokens, more than T_max = {call.max_seqlen} "
                         f"(cu_seqlens {cs})")
    idx = state_indices.tolist()
    pad_row = [False] * call.num_seqs
    rows = getattr(call, "rows", 0)  # a VerifyCall's step rows (fused_kda_verify has none)
    if rows:  # step rows: the table they stand for (row * T_max + t; a padding row's entries padding)
        for n, r in enumerate(idx):
            if r >= rows:
                raise ValueError(f"state_indices: entry {n} = {r} is out of range for state's {rows} rows "
                                 f"(expected < {rows}; negative = padding)")
        pad_row = [r < 0 or (call.null_slot0 and r == 0) for r in idx]
        idx = [[-1] * cols if p else [r * cols + t for t in range(cols)] for r, p in zip(idx, pad_row)]
    accepted = [1] * call.num_seqs if num_accepted_tokens is None else num_accepted_tokens.tolist()
    for n, a in enumerate(accepted):
        if not 1 <= a <= cols:
            raise ValueError(f"num_accepted_tokens: expected values in [1, T_max = {cols}], got "
                             f"num_accepted_tokens[{n}] = {a}")
    for n, row in enumerate(idx):
        for t, s in enumerate(row):
            if s >= call.slots:
                raise ValueError(f"state_indices: entry [{n}, {t}] = {s} is out of range for a pool of "
                                 f"{call.slots} slots (expected < {call.slots}; negative = padding)")
    if initial_state_indices is not None:  # kda_verify's second pool (a VerifyCall with initial_slots)
        reads = initial_state_indices.tolist()
        for n, s in enumerate(reads):
            if s >= call.initial_slots:
                raise ValueError(f"initial_state_indices: entry {n} = {s} is out of range for initial_state's "
                                 f"{call.initial_slots} slots (expected < {call.initial_slots}; negative = padding)")
    else:
        reads = [row[accepted[n] - 1] for n, row in enumerate(idx)]
    reads = [-1 if p else s for s, p in zip(reads, pad_row)]  # a padding row: a padding request
    pad = (lambda s: s < 0 or (call.null_slot0 and s == 0))
    if parent_tokens is not None:
        for n, row in enumerate(parent_tokens.tolist()):
            for t in range(1, lengths[n]):
                p = row[t]
                if not 0 <= p < t:
                    raise ValueError(f"parent_tokens: entry [{n}, {t}] = {p}; expected a token of request {n} "
                                     f"before it, in [0, {t})")
                if not pad(reads[n]) and pad(idx[n][p]):
                    raise ValueError(f"parent_tokens: entry [{n}, {t}] = {p} names a token whose state is not "
                                     f"stored (state_indices entry [{n}, {p}] is padding)")
    writer = {}  # slot -> request that writes it
    for n, row in enumerate(idx):
        if pad(reads[n]):
            continue  # a padding request touches nothing
        for t in range(lengths[n]):
            s = row[t]
            if pad(s):
                continue
            if s in writer:
                raise ValueError(f"state_indices: slot {s} is written twice (request {writer[s]} and request "
                                 f"{n}, token {t}); every written slot must be distinct")
            writer[s] = n
    if initial_state_indices is not None and not initial_is_state:
        return  # the start states come from a pool apart from the one written
    what = "state_indices" if initial_state_indices is None else "initial_state_indices"
    for n, s in enumerate(reads):
        if lengths[n] and not pad(s) and writer.get(s, n) != n:  # an empty request reads nothing
            raise ValueError(f"{what}: request {n} starts from slot {s}, which request {writer[s]} "
                             f"writes; a request may read only a slot no other request writes")
