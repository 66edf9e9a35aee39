"""FlashKDAExtKernel: SGLang 0.5.23's KDA kernel interface (LinearAttnKernelBase) on flashkda_ext.

Every keyword SGLang 0.5.23's call sites pass is named in the signatures below; a call the kernels cannot
serve exactly goes to SGLang's own TritonKDAKernel (`fallback`, handed in by the plugin) with its reason
counted in REASONS; without a fallback it raises NotImplementedError with that reason. Any other keyword is
a TypeError. Which call site passes what: docs/integrations.md, "SGLang".
"""
from __future__ import annotations

import collections
from typing import Optional

import torch

from .. import fla_chunk_states
from ... import validation
from ...validation import common as _common
from ..common_checks import int32_indices, unchecked_on_device
from . import extend_states, verify
from .dense import as_dense as _as, dense_qkv, gate_rows, qkv_rows, token_layout

#: calls per (method, "served" | "fell_back")
STATS: collections.Counter = collections.Counter()
#: fallbacks per (method, reason)
REASONS: collections.Counter = collections.Counter()


def _params(A_log, dt_bias):
    A = None if A_log is None else _as("A_log", A_log, torch.float32, (-1,))
    dt = None if dt_bias is None else _as("dt_bias", dt_bias, torch.float32, (-1,))
    return A, dt


def _gate_name(lower_bound, A_log) -> str:
    """SGLang's rule (its chunk_kda): with A_log the raw gate is activated in the kernel, bounded when
    lower_bound is set, else softplus; without A_log g is already the log decay."""
    return "log" if A_log is None else "softplus" if lower_bound is None else "bounded"


def _gate(lower_bound, A_log):
    """(gate, bound) by _gate_name's rule, the bound checked where it is read."""
    if A_log is None:
        # SGLang's chunk_kda then reads lower_bound only as safe_gate, a promise that the given log decay is
        # >= lower_bound that lets its intra-chunk kernel skip a guard; the log gate is exact for any g, so the
        # promise changes nothing here (read in sglang 0.5.23, kernels/ops/attention/fla/kda.py). The bound is
        # still checked as the bounded gate checks it: True, a string, NaN or a bound >= 0 is no bound SGLang's
        # models give, and is refused here as with A_log rather than dropped
        if lower_bound is not None:
            validation._gate_bound("bounded", lower_bound)
        return "log", None
    return _gate_name(lower_bound, A_log), lower_bound


def _no_unknown(where: str, kwargs: dict) -> None:
    if kwargs:
        raise TypeError(f"{where}: unexpected keyword arguments {sorted(kwargs)} for flashkda_ext's SGLang kernel "
                        f"(SGLang 0.5.23's call sites pass none of them)")


def _not_a_bool(name: str, value) -> str:
    """The fallback reason for a flag that is no Python bool (SGLang's call sites pass bools; its kernel reads
    any value truthily, so "False" would be True there, and the call is left to it rather than read either
    way). The type, not the value, so that REASONS counts one key a flag and type."""
    kind = type(value)      # qualified outside builtins: numpy 2 names its bool type "bool" too
    kind = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name} of type {kind}, not a bool (SGLang's signature takes a bool)"


def _check_offsets(query_start_loc: torch.Tensor, q: torch.Tensor, T: Optional[int] = None) -> None:
    """query_start_loc [N+1] checked under the name SGLang passes it by (kda_prefill would name it cu_seqlens):
    int32 / int64 on q's device; with T (extend), contiguous, at least one request, and where the offsets are
    in host memory non-decreasing from 0 to T."""
    if query_start_loc.dtype not in (torch.int32, torch.int64) or query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc: expected int32 or int64 offsets on {q.device} (the device of q), "
                         f"got {query_start_loc.dtype} on {query_start_loc.device}")
    if T is None:
        return
    if query_start_loc.shape[0] < 2:
        raise ValueError(f"query_start_loc: expected N+1 >= 2 offsets (at least one request), got "
                         f"{list(query_start_loc.shape)}")
    if not query_start_loc.is_contiguous():
        raise ValueError("query_start_loc: expected a contiguous tensor")
    if query_start_loc.device.type == "cpu":
        validation.check_offsets_span("query_start_loc", query_start_loc.tolist(), T)


#: (family, backend, H, K, HV, V, input dtype, pool dtype, gate) -> why the kernels do not take that head layout / dtype
#: on that backend (jit/supported.json), or None: a few calls' worth of keys in a serving process, one lookup a call
_UNSUPPORTED: dict = {}


def _backend(device) -> Optional[str]:
    """The op's backend for a device other than CPU / CUDA (the op's own rule, validation.common.backend_of), or None
    where it has none."""
    try:
        return _common.backend_of(device)
    except ValueError:
        return None


def _capability_reason(family: str, q_dtype, pool, H: int, K: int, HV: int, V: int, gate: str, device_of,
                       read: tuple, written: tuple) -> Optional[str]:
    """Why flashkda_ext's op would refuse a well-formed call that SGLang's Triton kernel serves, or None. Such a call
    falls back (counted) instead of raising from the op: a head layout or dtype outside the supported set of the
    backend (e.g. --mamba-ssm-dtype float16's fp16 pool; on CUDA K or V other than 128, fp16 / fp32 activations), a
    device other than CPU / CUDA, an inference tensor written in place outside torch.inference_mode() (torch refuses
    that update to our ops; SGLang's Triton kernels write through the pointer), an argument requiring grad under grad
    mode (the ops are inference-only; SGLang's kernels compute the forward and record nothing). (name, tensor) pairs;
    what is no tensor is left to the op, which names it."""
    conflict = validation.inference_conflict(read, written)
    if conflict is not None and conflict[1] == "inference":
        return (f"{conflict[0]} is an inference tensor written in place outside torch.inference_mode() (torch "
                f"refuses that update to flashkda_ext's op)")
    if conflict is not None:
        return f"{conflict[0]} requires grad under grad mode (flashkda_ext's ops are inference-only)"
    if not isinstance(pool, torch.Tensor):
        return None     # named by the op
    backend = "cuda" if device_of.is_cuda else "cpu" if device_of.is_cpu else _backend(device_of.device)
    key = (family, backend, H, K, HV, V, q_dtype, pool.dtype, gate)
    try:
        return _UNSUPPORTED[key]
    except KeyError:
        pass
    if backend is None:
        why = f"a tensor on {device_of.device} (flashkda_ext runs on CUDA and CPU)"
    else:
        try:
            _common._supported_dims(family, backend, K, V, H, HV, validation.dtype_name(q_dtype),
                                       validation.dtype_name(pool.dtype), gate, None, "ssm_states")
            why = None
        except ValueError as e:
            why = str(e)
    _UNSUPPORTED[key] = why
    return why


def _qkv_dims(q, v):
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q: expected shape [1, T, H, K], got {list(q.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v: expected shape [1, T, HV, V] with T = {q.shape[1]}, got {list(v.shape)}")
    return q.shape[1], q.shape[2], q.shape[3], v.shape[2], v.shape[3]


class FlashKDAExtKernel:
    """decode / packed_decode / extend / target_verify with SGLang 0.5.23's signatures.

    The capability flags, with the meaning KDAKernelDispatcher / KDAAttnBackend give them in 0.5.23:
    """

    supports_packed_decode = True             # forward_decode hands over the post-conv packed qkv
    supports_packed_decode_safe_gate = True   # ... also for models with a gate lower_bound
    supports_safe_gate = True                 # effective_extend_kernel keeps this kernel under lower_bound
    supports_safe_gate_verify = True          # the dispatcher lets target_verify take lower_bound
    supports_track_state_snapshot = True      # extend writes track_state at track_chunk_idx (radix cache)
    uses_state_checkpoints = False            # no FlashInfer checkpoint plan is needed (track_state serves it)
    supports_fused_chain_verify = False       # SGLang's fused conv+verify Triton kernel is not ours
    supports_strided_target_verify_qkv = False

    @property
    def prefill_graph_wrapper_cls(self):
        """The class SGLang's breakable prefill CUDA graphs capture the extend with (prefill_graph.py), read by
        KDAAttnBackend.supports_prefill_graph_extend and per captured bucket: PrefillGraphWrapper with
        FLASHKDA_EXT_SGLANG_PREFILL_GRAPH=1 and without SGLang's mamba extra buffer, else None (each KDA layer
        then breaks the graph and extend() serves it eagerly)."""
        from . import prefill_graph
        return prefill_graph.wrapper_cls()

    def __init__(self, chunk_size: int = 64, fallback=None):
        # SGLang's track_chunk_idx and h count chunks of its chunk_kda's 64 tokens
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size: expected an int > 0, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.fallback = fallback

    def _fall_back(self, method: str, reason: str, *args, **kwargs):
        STATS[method, "fell_back"] += 1
        REASONS[method, reason] += 1
        if self.fallback is None:
            raise NotImplementedError(f"{method}: {reason}; flashkda_ext does not serve this call and no fallback "
                                      f"kernel was given (the SGLang plugin passes SGLang's TritonKDAKernel)")
        return getattr(self.fallback, method)(*args, **kwargs)

    # -----------------------------------------------------------------------------------------
    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
               A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor, cache_indices: torch.Tensor,
               query_start_loc: torch.Tensor, lower_bound: Optional[float] = None, out: Optional[torch.Tensor] = None,
               **kwargs) -> torch.Tensor:
        """One token per request: kda_decode on the pool, updated in place. Returns [1, T, HV, V]."""
        _no_unknown("decode", kwargs)
        T, H, K, HV, V = _qkv_dims(q, v)
        N = cache_indices.shape[0] if torch.is_tensor(cache_indices) else -1
        if not torch.is_tensor(query_start_loc) or query_start_loc.shape != (N + 1,) or T != N:
            got = list(query_start_loc.shape) if torch.is_tensor(query_start_loc) else type(query_start_loc).__name__
            raise ValueError(f"query_start_loc: decode takes one token per request (T == N); got T = {T}, "
                             f"{N} cache_indices and query_start_loc of shape {got}")
        # kda_decode reads no offsets; SGLang's kernel does, so they are checked as its own call would need them
        _check_offsets(query_start_loc, q)
        if query_start_loc.device.type == "cpu" and query_start_loc.tolist() != list(range(N + 1)):
            raise ValueError(f"query_start_loc: decode expects offsets 0, 1, ..., N (one token per request), "
                             f"got {query_start_loc.tolist()}")
        if out is not None:     # written as the [1, T, HV, V] decode returns
            out = validation._tensor("out", out)
            if tuple(out.shape) != (1, T, HV, V):
                raise ValueError(f"out: expected shape [1, T, HV, V] = {[1, T, HV, V]}, got {list(out.shape)}")
        reason = _capability_reason(
            "kda_decode", q.dtype, ssm_states, H, K, HV, V, "softplus" if lower_bound is None else "bounded", q,
            (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)),
            (("ssm_states", ssm_states),))
        if reason is not None:
            if out is not None:     # ours (SGLang's kernel takes none): it must take the result, checked first
                validation._inference_only((), (("out", out),))
            o = self._fall_back("decode", reason, q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                                cache_indices=cache_indices, query_start_loc=query_start_loc, lower_bound=lower_bound)
            return o if out is None else out.copy_(o)
        o = self._decode(q.reshape(T, H, K), k.reshape(T, H, K), v.reshape(T, HV, V), a, b, A_log, dt_bias,
                         ssm_states, cache_indices, lower_bound, None, out)
        STATS["decode", "served"] += 1
        return o

    def packed_decode(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, A_log: torch.Tensor,
                      dt_bias: torch.Tensor, scale: float, ssm_states: torch.Tensor, cache_indices: torch.Tensor,
                      num_v_heads: int, head_v_dim: int, lower_bound: Optional[float] = None,
                      replayssm_d=None, replayssm_k=None, replayssm_g=None, replayssm_write_pos=None,
                      replayssm_force_flush=None, **kwargs) -> torch.Tensor:
        """forward_decode's packed call: mixed_qkv [B, H*K + H*K + HV*V] after the conv. Returns [1, B, HV, V]."""
        _no_unknown("packed_decode", kwargs)
        ring = (replayssm_d, replayssm_k, replayssm_g, replayssm_write_pos)
        if lower_bound is None and all(x is not None for x in ring):
            # SGLang's Triton packed decode switches to its ReplaySSM ring kernel exactly then
            return self._fall_back(
                "packed_decode", "ReplaySSM ring decode (--enable-linear-replayssm)", mixed_qkv, a, b, A_log=A_log,
                dt_bias=dt_bias, scale=scale, ssm_states=ssm_states, cache_indices=cache_indices,
                num_v_heads=num_v_heads, head_v_dim=head_v_dim, lower_bound=lower_bound, replayssm_d=replayssm_d,
                replayssm_k=replayssm_k, replayssm_g=replayssm_g, replayssm_write_pos=replayssm_write_pos,
                replayssm_force_flush=replayssm_force_flush)
        if mixed_qkv.dim() != 2:
            raise ValueError(f"mixed_qkv: expected [B, 2*H*K + HV*V], got {list(mixed_qkv.shape)}")
        B, dim = mixed_qkv.shape
        for name, n in (("num_v_heads", num_v_heads), ("head_v_dim", head_v_dim)):
            if validation._int(name, n, "> 0") <= 0:
                raise ValueError(f"{name}: expected an int > 0, got {n}")
        HV, V, K = num_v_heads, head_v_dim, validation._tensor("ssm_states", ssm_states).shape[-1]
        qk = dim - HV * V
        if qk <= 0 or qk % (2 * K):
            raise ValueError(f"mixed_qkv: width {dim} is not 2*H*K + HV*V for HV = {HV}, V = {V}, K = {K} "
                             f"(K from ssm_states)")
        H = qk // (2 * K)
        reason = _capability_reason(
            "kda_decode", mixed_qkv.dtype, ssm_states, H, K, HV, V, "softplus" if lower_bound is None else "bounded",
            mixed_qkv, (("mixed_qkv", mixed_qkv), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)),
            (("ssm_states", ssm_states),))
        if reason is not None:
            return self._fall_back(
                "packed_decode", reason, mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias, scale=scale,
                ssm_states=ssm_states, cache_indices=cache_indices, num_v_heads=num_v_heads, head_v_dim=head_v_dim,
                lower_bound=lower_bound, replayssm_d=replayssm_d, replayssm_k=replayssm_k, replayssm_g=replayssm_g,
                replayssm_write_pos=replayssm_write_pos, replayssm_force_flush=replayssm_force_flush)
        q, k, v = mixed_qkv.split([H * K, H * K, HV * V], dim=-1)
        o = self._decode(q.reshape(B, H, K), k.reshape(B, H, K), v.reshape(B, HV, V), a, b, A_log, dt_bias,
                         ssm_states, cache_indices, lower_bound, scale, None)
        STATS["packed_decode", "served"] += 1
        return o

    def _decode(self, q, k, v, a, b, A_log, dt_bias, ssm_states, cache_indices, lower_bound, scale, out):
        from ...ops import kda_decode
        T, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        A, dt = _params(A_log, dt_bias)
        if A is None or dt is None:     # SGLang's decode kernels read both (no bias-free variant)
            raise ValueError(f"{'A_log' if A is None else 'dt_bias'}: decode activates the raw gate a in the kernel "
                             f"and needs A_log and dt_bias, got None")
        gate, lb = _gate(lower_bound, A)
        # a / b in fp32 or q's dtype as they are (kda_decode reads fp32 natively), another float in fp32 (exact for
        # fp16); SGLang's row-strided views
        # (a, b column slices of its projection; q, k, v of mixed_qkv) go as they are where kda_decode reads them
        a = gate_rows("a", a, q, (T, HV, K), 0)
        b = gate_rows("b", b, q, (T, HV), 0, vector=False)
        idx = int32_indices("cache_indices", cache_indices, (T,))
        q, k, v = qkv_rows(q, k, v, 0)
        o = kda_decode(q, k, v, a, b, state=ssm_states, state_indices=idx, A_log=A, dt_bias=dt, lower_bound=lb,
                       gate=gate, scale=scale, beta_is_logit=True, slot_mode="padded",
                       out=None if out is None else out[0])
        return o.view(1, T, HV, V) if out is None else out

    # -----------------------------------------------------------------------------------------
    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
               ssm_states: torch.Tensor, cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
               A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
               lower_bound: Optional[float] = None, beta_is_raw: bool = False,
               extend_seq_lens_cpu=None, extend_prefix_lens: Optional[torch.Tensor] = None,
               layer_id: Optional[int] = None, is_spec_decode: bool = False,
               return_intermediate_states: bool = False, output_intermediate_states: Optional[bool] = None,
               track_ssm_h_src: Optional[torch.Tensor] = None, track_state: Optional[torch.Tensor] = None,
               track_chunk_idx: Optional[torch.Tensor] = None, track_ssm_h_batch_src: Optional[torch.Tensor] = None,
               state_checkpoint_cu_starts: Optional[torch.Tensor] = None, num_state_checkpoints: int = 0,
               state_checkpoint_every_n_tokens: int = 0, state_checkpoint_indices: Optional[torch.Tensor] = None,
               chunk_indices: Optional[torch.Tensor] = None, chunk_offsets: Optional[torch.Tensor] = None,
               **kwargs):
        """Chunked prefill of packed requests from their pool slots, committed in place (as SGLang's chunk_kda).

        Returns o [1, T, HV, V], or (o, h) with return_intermediate_states (also spelled
        output_intermediate_states): h is FLA's per-chunk states [1, NT, HV, V, K] in the pool's dtype, or None
        where SGLang reads none of its rows (track_state given, or track_ssm_h_src empty). track_state
        [>= N, HV, V, K] fp32: row n gets the state entering chunk track_chunk_idx[n] (chunks of chunk_size
        tokens; -1 or past the request: the row is left alone), as SGLang's chunk_kda writes it.
        extend_prefix_lens and layer_id do not change the result (SGLang's chunk kernel reads neither: a new
        request's slot is zeroed by the pool); track_ssm_h_batch_src names the track_state rows SGLang reads.
        """
        _no_unknown("extend", kwargs)
        call = dict(ssm_states=ssm_states, cache_indices=cache_indices, query_start_loc=query_start_loc, A_log=A_log,
                    dt_bias=dt_bias, lower_bound=lower_bound, beta_is_raw=beta_is_raw,
                    extend_seq_lens_cpu=extend_seq_lens_cpu, extend_prefix_lens=extend_prefix_lens, layer_id=layer_id,
                    is_spec_decode=is_spec_decode, return_intermediate_states=return_intermediate_states,
                    track_ssm_h_src=track_ssm_h_src, track_state=track_state, track_chunk_idx=track_chunk_idx,
                    track_ssm_h_batch_src=track_ssm_h_batch_src,
                    state_checkpoint_cu_starts=state_checkpoint_cu_starts, num_state_checkpoints=num_state_checkpoints,
                    state_checkpoint_every_n_tokens=state_checkpoint_every_n_tokens,
                    state_checkpoint_indices=state_checkpoint_indices, chunk_indices=chunk_indices,
                    chunk_offsets=chunk_offsets)
        if output_intermediate_states is not None:
            call["output_intermediate_states"] = output_intermediate_states
        reason = _extend_fallback_reason(call)
        if reason is None and torch.is_tensor(q) and q.dim() == 4 and torch.is_tensor(v) and v.dim() == 4:
            reason = _capability_reason(
                "kda_prefill", q.dtype, ssm_states, q.shape[2], q.shape[3], v.shape[2], v.shape[3],
                _gate_name(lower_bound, A_log), q,
                (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log), ("dt_bias", dt_bias)),
                (("ssm_states", ssm_states), ("track_state", track_state)))
        if reason is not None:
            return self._fall_back("extend", reason, q, k, v, g, beta, **call)
        return self._extend(q, k, v, g, beta, **call)

    def _extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log, dt_bias, lower_bound,
                beta_is_raw, extend_seq_lens_cpu, return_intermediate_states, track_ssm_h_src, track_state,
                track_chunk_idx, output_intermediate_states=None, **_read_by_the_fallback_check):
        from ...ops import kda_prefill
        T, H, K, HV, V = _qkv_dims(q, v)
        if not torch.is_tensor(cache_indices) or cache_indices.dim() != 1:
            raise ValueError(f"cache_indices: expected a 1-D tensor [N], got "
                             f"{list(cache_indices.shape) if torch.is_tensor(cache_indices) else cache_indices!r}")
        N = cache_indices.shape[0]
        if not torch.is_tensor(query_start_loc) or query_start_loc.shape != (N + 1,):
            got = list(query_start_loc.shape) if torch.is_tensor(query_start_loc) else query_start_loc
            raise ValueError(f"query_start_loc: expected [N+1] = [{N + 1}] offsets (one per cache index + 1), "
                             f"got {got}")
        _check_offsets(query_start_loc, q, T)
        # named as SGLang passes them (kda_prefill would name them state / state_indices)
        for name, x in (("ssm_states", ssm_states), ("cache_indices", cache_indices)):
            if torch.is_tensor(x):
                validation._same_device(name, x, q.device)
        if track_chunk_idx is not None and track_state is None:
            # SGLang's chunk_kda asserts they come together: the indices alone would be dropped
            raise ValueError("track_chunk_idx: given without track_state; SGLang's chunk_kda takes them together "
                             "(the chunk each track_state row snapshots)")
        want_h = return_intermediate_states or output_intermediate_states is True   # bools (or None): checked
        # h is materialized only where SGLang may read it: track_state replaces it, an empty
        # track_ssm_h_src says no row of it is read
        need_h = want_h and track_state is None and (track_ssm_h_src is None or track_ssm_h_src.numel() > 0)
        if track_state is not None:
            extend_states.check_track(track_state, track_chunk_idx, ssm_states, N)
            # written after the pool is committed: sharing memory with the pool would overwrite its slots
            validation.check_apart((("track_state", track_state),),
                                   (("ssm_states", ssm_states), ("q", q), ("k", k), ("v", v), ("g", g),
                                    ("beta", beta), ("track_chunk_idx", track_chunk_idx), ("A_log", A_log),
                                    ("dt_bias", dt_bias), ("cache_indices", cache_indices),
                                    ("query_start_loc", query_start_loc)))
        ckpt = need_h or track_state is not None
        lengths = extend_states.host_lengths(query_start_loc, extend_seq_lens_cpu, T, exact=ckpt)
        dtype = q.dtype
        A, dt = _params(A_log, dt_bias)
        gate, lb = _gate(lower_bound, A)
        if gate == "softplus" and dt is None:
            # SGLang's chunk_kda adds no bias then (HAS_BIAS = dt_bias is not None); g + 0.0 is g, so a zero bias
            # is the same gate (the bounded gate reads an absent dt_bias as 0 itself)
            dt = torch.zeros(HV * K, dtype=torch.float32, device=q.device)
        idx = int32_indices("cache_indices", cache_indices, (N,))
        # kda_prefill reads g and beta in q's dtype
        token_layout("g", g, T, (HV, K))
        token_layout("beta", beta, T, (HV,))
        args = (*dense_qkv(q, k, v), _as("g", g, dtype, (1, T, HV, K)), _as("beta", beta, dtype, (1, T, HV)))
        kw = dict(A_log=A, dt_bias=dt, lower_bound=lb, gate=gate, beta_is_logit=beta_is_raw,
                  cu_seqlens=query_start_loc, state=ssm_states, state_indices=idx, output_final_state=True)
        if not ckpt:
            # SGLang's host lengths name the longest request for the route (a long request in a batch of short
            # ones keeps the fused chunk-16 kernel's one-CTA chain off it); nothing is computed from them
            o = kda_prefill(*args, **kw, max_seqlen=None if lengths is None else max(lengths, default=0))[0]
            STATS["extend", "served"] += 1
            return (o, None) if want_h else o
        kw.update(checkpoint_every=self.chunk_size, max_seqlen=max(lengths, default=0))
        # every check kda_prefill makes runs before the start states are read (a bad index is named, not an
        # IndexError of the gather)
        validation.check_kda_prefill(*args, **kw)
        initial = extend_states.gather_states(ssm_states, idx)
        o, _, checkpoints = kda_prefill(*args, **kw)
        STATS["extend", "served"] += 1
        if track_state is not None:
            extend_states.write_track(track_state, track_chunk_idx, initial, checkpoints, query_start_loc,
                                      self.chunk_size)
        if not want_h:
            return o
        return o, (fla_chunk_states(initial, checkpoints, lengths, self.chunk_size) if need_h else None)

    # -----------------------------------------------------------------------------------------
    def target_verify(self, A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, ssm_states: torch.Tensor,
                      cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
                      intermediate_states_buffer: Optional[torch.Tensor] = None,
                      intermediate_state_indices: Optional[torch.Tensor] = None, cache_steps: Optional[int] = None,
                      retrieve_parent_token: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None,
                      cache_ring: bool = False, replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None,
                      replayssm_beta=None, fused_accept_state_indices=None, fused_accept_num_accepted=None,
                      out: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        """Speculative-decoding verify of chains or draft trees (docs/integrations.md, "SGLang"). Returns
        [1, T, HV, V]; ssm_states is never written; the state after token t of request n goes to
        intermediate_states_buffer[intermediate_state_indices[n], t] (the table may be longer than N: SGLang
        passes its per-pool table, request n uses entry n); with retrieve_parent_token [N, S] (a draft tree)
        token t continues from the state stored after token retrieve_parent_token[n, t]."""
        _no_unknown("target_verify", kwargs)
        reason = None
        if not isinstance(cache_ring, bool):
            reason = _not_a_bool("cache_ring", cache_ring)
        elif cache_ring or any(x is not None for x in (replayssm_rawv, replayssm_rawk, replayssm_g, replayssm_beta)):
            reason = "ReplaySSM ring write (--enable-linear-replayssm-spec)"
        elif fused_accept_state_indices is not None or fused_accept_num_accepted is not None:
            reason = "fused-accept verify indices (FlashInfer's recurrent_kda contract)"
        elif torch.is_tensor(query_start_loc) and unchecked_on_device(query_start_loc):
            reason = (f"{query_start_loc.dtype} query_start_loc on {query_start_loc.device} (narrowing to the "
                      f"kernels' int32 needs a range check, reading it a sync)")
        elif retrieve_parent_token is not None:
            reason = _tree_fallback_reason(retrieve_parent_token, cache_indices, intermediate_states_buffer)
        if reason is None and torch.is_tensor(q) and q.dim() == 4 and torch.is_tensor(v) and v.dim() == 4:
            reason = _capability_reason(
                "kda_verify", q.dtype, ssm_states, q.shape[2], q.shape[3], v.shape[2], v.shape[3],
                "softplus" if lower_bound is None else "bounded", q,
                (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias),
                 ("ssm_states", ssm_states)), (("intermediate_states_buffer", intermediate_states_buffer),))
        if reason is not None:
            ring = dict(cache_ring=cache_ring, replayssm_rawv=replayssm_rawv, replayssm_rawk=replayssm_rawk,
                        replayssm_g=replayssm_g, replayssm_beta=replayssm_beta)
            if fused_accept_state_indices is not None or fused_accept_num_accepted is not None:
                ring.update(fused_accept_state_indices=fused_accept_state_indices,
                            fused_accept_num_accepted=fused_accept_num_accepted)
            if out is not None:
                # out is ours (SGLang's kernel takes none: its **kwargs would drop it): checked before SGLang's
                # kernel runs, then given its result
                T, _, _, HV, V = _qkv_dims(q, v)
                out = validation._tensor("out", out)
                if tuple(out.shape) != (1, T, HV, V) or out.dtype != v.dtype or out.device != v.device:
                    raise ValueError(f"out: expected a {v.dtype} tensor [1, T, HV, V] = {[1, T, HV, V]} on "
                                     f"{v.device}, got {out.dtype} {list(out.shape)} on {out.device}")
                validation._inference_only((), (("out", out),))     # out.copy_ below must not be refused
            o = self._fall_back(
                "target_verify", reason, A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b,
                ssm_states=ssm_states, cache_indices=cache_indices, query_start_loc=query_start_loc,
                intermediate_states_buffer=intermediate_states_buffer,
                intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                retrieve_parent_token=retrieve_parent_token, lower_bound=lower_bound, **ring)
            return o if out is None else out.copy_(o)
        o = verify.target_verify(A_log, dt_bias, q, k, v, a, b, ssm_states=ssm_states, cache_indices=cache_indices,
                                 query_start_loc=query_start_loc, buf=intermediate_states_buffer,
                                 table=intermediate_state_indices, cache_steps=cache_steps,
                                 lower_bound=lower_bound, gate_of=_gate, out=out, parents=retrieve_parent_token)
        STATS["target_verify", "served"] += 1
        return o


def _tree_fallback_reason(parents, cache_indices, buf) -> Optional[str]:
    """Why a draft tree's verify goes to SGLang's kernel, or None: kda_verify reads the parents as a table
    [N, S] beside the buffer's S steps (SGLang allocates [bs, draft_token_num] and steps of the same count)."""
    if not (torch.is_tensor(parents) and torch.is_tensor(cache_indices) and torch.is_tensor(buf) and buf.dim() == 5):
        return None  # target_verify names the argument that is not what it must be
    N, S = cache_indices.shape[0], buf.shape[1]
    if parents.dtype not in (torch.int32, torch.int64) or tuple(parents.shape) != (N, S):
        return (f"draft tree with a parent table {parents.dtype} {list(parents.shape)}, not int32 / int64 "
                f"[N, S] = [{N}, {S}] (one column per buffer step)")
    return None


def _extend_fallback_reason(call: dict) -> Optional[str]:
    """Why SGLang's own kernel must run this extend, or None when flashkda_ext serves it exactly."""
    for flag in ("beta_is_raw", "is_spec_decode", "return_intermediate_states", "output_intermediate_states"):
        if flag in call and not isinstance(call[flag], bool):     # output_intermediate_states: only when given
            return _not_a_bool(flag, call[flag])
    if call["is_spec_decode"]:
        # SGLang's chunk_kda commits draft_extend_v2 in place while its comment asks kernels not to:
        # its own kernel stays the reference for that contract
        return "draft extend (is_spec_decode): SGLang's chunk_kda defines its state contract"
    if call["chunk_indices"] is not None or call["chunk_offsets"] is not None:
        return "prefill CUDA-graph chunk tables (chunk_indices / chunk_offsets)"
    if call["num_state_checkpoints"] or call["state_checkpoint_indices"] is not None:
        return "a FlashInfer state-checkpoint plan (num_state_checkpoints > 0)"
    if call["A_log"] is None and call["dt_bias"] is not None:
        # SGLang's chunk_kda then reads g as the activated log decay and never reads dt_bias; a caller that
        # passes a bias may mean a raw gate, so the call is left to SGLang's reading rather than guessed
        return "dt_bias without A_log (SGLang's chunk_kda reads g as activated and ignores dt_bias)"
    return None
