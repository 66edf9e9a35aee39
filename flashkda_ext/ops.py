"""The public ops: validate, trace, route, call the TVM-FFI function (destination-passing).

Each op is the same four steps (docs/architecture.md): validation.check_* raises before anything is
launched; trace.emit writes the call's definition and workload first when tracing is on (before the
launch: a launch that crashes the process leaves its trace); dispatch picks the module from host-known
metadata; the module's function fills the outputs given to it. A call the module refuses after its
emit (a ValueError or TypeError: the CPU modules' index value checks) has the emit undone by
trace.retract: a refused call writes nothing.
A call whose metadata matches an earlier validated one takes the fast path (fast_path.py) instead.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import custom_ops, dispatch, fast_path, jit, trace, validation
from .custom_ops import _is_compiling
from .fast_path import Tensor as _Tensor

# Outputs shaped like an input are allocated with empty_like (~1 us cheaper per call than torch.empty
# with shape, dtype and device keywords, measured on CPython 3.11 / torch 2.13); dense, whatever the
# input's strides.
_DENSE = torch.contiguous_format


class _MaybeOverlap(Exception):
    """Raised inside a fast branch to take the full path (caught there, never seen by a caller)."""


def _launch(traced: bool, fn, *args) -> None:
    """fn(*args), the module's launch. A call the module refuses (its argument checks raise ValueError or
    TypeError) takes back the trace its emit wrote (trace.retract): a refused call writes nothing. Any other
    error (a launch failure the runtime reports) keeps it, as a crash does."""
    try:
        fn(*args)
    except (ValueError, TypeError):
        if traced:
            trace.retract()
        raise


def _route_fn(family: str, call):
    """The call's TVM-FFI function, kept on the (memoized) call object so a steady serving loop
    pays for route selection once."""
    fn = call.__dict__.get("_fn")
    if fn is None:
        fn = dispatch.function(family, call.route_meta())
        object.__setattr__(call, "_fn", fn)
    return fn


def _gb_casts(call, family: str = "kda_decode", meta=None) -> tuple:
    """kda_decode / kda_verify: the g / beta dtype conversions the module `family` routes the call to
    (route metadata `meta`, default the call's) needs (validation.decode._GbDtypes.gb_casts; none when g and
    beta match what it reads), kept on the (memoized) call object. g and beta in q's dtype (gb
    "input") are what every module a route gives such a call reads."""
    if call.gb != "f32":
        return ()
    casts = call.__dict__.get("_gb_casts")
    if casts is None:
        module = dispatch.module_name(family, call.route_meta() if meta is None else meta)
        casts = call.gb_casts(dispatch.gb_read_dtype(module, call.input_dtype))
        object.__setattr__(call, "_gb_casts", casts)
    return casts


def _cast_gb(casts, g, beta):
    """g and beta converted as casts says (one of them fp32 and the other not: one exact pass)."""
    conv = {name: getattr(torch, dtype) for name, dtype in casts}
    return (g.to(conv["g"]) if "g" in conv else g), (beta.to(conv["beta"]) if "beta" in conv else beta)


def clear_call_caches() -> None:
    """Forget every fast-path entry, memoized validation verdict and cached prefill route (tests that
    patch the launch path; the next call of each kind is validated and routed in full again)."""
    fast_path.clear()
    validation.memo.clear_memos()
    _prefill_route_for.cache_clear()


def kda_decode(q, k, v, g, beta, *, state, state_indices, A_log=None, dt_bias=None, lower_bound=None,
               gate="softplus", scale=None, beta_is_logit=True, slot_mode="unique", null_slot0=False,
               out=None):
    """One recurrent KDA step per row on a state pool, updated in place.

    q, k [rows, H, K]; v [rows, HV, V]; g [rows, HV, K] (raw gate); beta [rows, HV] (each may be a
    row-strided view, its rows dense: docs/api.md "Layouts");
    state [slots, HV, V, K] fp32 or bf16 (updated in place); state_indices int32 [rows]
    (negative = padding row: zero output, no state touched). Returns out [rows, HV, V] (v's dtype).
    slot_mode declares what state_indices may hold: "unique", "padded" (negatives) or "repeated"
    (rows sharing a slot are applied in row order). See docs/api.md.
    """
    key = dest = None
    if (fast_path.ENABLED and not _is_compiling() and not trace.enabled() and type(q) is _Tensor
            and g is not None and beta is not None
            and fast_path.plain_ok((q, k, v, g, beta, A_log, dt_bias, state_indices), (state, out))):
        # g's and beta's dtypes: fp32 and bf16 gates of one shape are two entries (the signature alone
        # would keep them correct, but a loop alternating them would replace one entry by the other)
        key = ("kda_decode", q.shape[0], g.dtype, beta.dtype, gate, slot_mode, type(lower_bound), lower_bound,
               type(scale), scale, type(beta_is_logit), beta_is_logit, type(null_slot0), null_slot0)
        entry = fast_path.get(key)
        if entry is not None:
            fn, sig, tail = entry
            try:  # see fast_path's docstring: a raise here (v not a tensor, too) has launched nothing
                dest = torch.empty_like(v, memory_format=_DENSE) if out is None else out  # a valid call's out
                if fn(sig, q, k, v, g, beta, A_log, dt_bias, state, state_indices, dest, *tail) == sig:
                    return dest
            except Exception:  # noqa: BLE001 - the full path raises the full check's error
                pass
    if custom_ops.tracing(q):  # Dynamo / export / FakeTensor: one flashkda_ext::kda_decode node
        return custom_ops.traced_kda_decode(
            q, k, v, g, beta, state=state, state_indices=state_indices, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, gate=gate, scale=scale, beta_is_logit=beta_is_logit, slot_mode=slot_mode,
            null_slot0=null_slot0, out=out)
    call = validation.check_kda_decode(
        q, k, v, g, beta, state=state, state_indices=state_indices, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, gate=gate, scale=scale, beta_is_logit=beta_is_logit,
        slot_mode=slot_mode, null_slot0=null_slot0, out=out)
    validation.check_apart((("out", out), ("state", state)),
                           (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                            ("dt_bias", dt_bias), ("state_indices", state_indices)))
    if out is None:
        out = dest if dest is not None else torch.empty(
            (call.rows, call.value_heads, call.head_dim_v), dtype=v.dtype, device=v.device)
    traced = False
    if trace.enabled():  # before the launch: a crashing call leaves its trace
        traced = trace.emit("kda_decode", call, dict(
            q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=state_indices, A_log=A_log,
            dt_bias=dt_bias, lower_bound=lower_bound, scale=call.scale, out=out)) is not None
    fn = _route_fn("kda_decode", call)
    casts = _gb_casts(call)
    if casts:  # one fp32 and one bf16 of g / beta: one pass brings the other to what the module reads
        g, beta = _cast_gb(casts, g, beta)
    sig_args = (q, k, v, g, beta, A_log, dt_bias, state, state_indices, out)  # the caller's own tensors
    tail = (call.gate_mode, call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0)
    _launch(traced, fn, *sig_args, *tail)
    if key is not None and not casts:  # a converted copy's signature would never match the caller's tensor
        fast_path.put(key, "kda_decode", call, sig_args, tail)
    return out


def _prefill_route(call):
    """(rule, module, chunk) for a prefill call, kept on the (memoized) call object and per route
    metadata: route selection and spec lookups cost ~0.1 ms each, too much to repeat on every call
    of a serving loop (a call whose host offsets are checked by value gets a new call object)."""
    cached = call.__dict__.get("_route")
    if cached is None:
        cached = _prefill_route_for(tuple(sorted(call.route_meta().items())))
        object.__setattr__(call, "_route", cached)
    return cached


@functools.lru_cache(maxsize=512)
def _prefill_route_for(meta_items: tuple):
    rule = dispatch.select_rule("kda_prefill", dict(meta_items))
    chunk = int(jit.get_record(rule["module"]).get("params", {}).get("chunk", 1))
    return rule, jit.load_module(rule["module"]), chunk


def prefill_workspace_bytes(q, v, *, cu_seqlens=None, max_seqlen=None, gate="softplus", lower_bound=None,
                            state_dtype=torch.float32, checkpoint_every=0) -> int:
    """Bytes of scratch the CUDA prefill needs for these shapes (0 on CPU): preallocate it once
    and pass it as `workspace=` to capture kda_prefill in a CUDA graph. The keywords are the call's own
    (each can change the route): its max_seqlen, gate and lower_bound, the dtype of its state and its
    checkpoint_every."""
    meta = _workspace_route_meta(q, v, cu_seqlens, max_seqlen, gate, lower_bound, state_dtype, checkpoint_every)
    if q.device.type != "cuda":
        return 0
    module = jit.load_module(dispatch.module_name("kda_prefill", meta))
    need = dispatch.prefill_workspace_need(module, meta["total_tokens"], meta["num_seqs"], meta["value_heads"])
    return 0 if need is None else need


def _workspace_route_meta(q, v, cu_seqlens, max_seqlen, gate, lower_bound, state_dtype, checkpoint_every) -> dict:
    """The CUDA route metadata of the kda_prefill call prefill_workspace_bytes is asked about (checked as the
    op checks these arguments)."""
    q, v = validation._tensor("q", q), validation._tensor("v", v)
    validation._ndim("q", q, 4, "[B, T, H, K]")
    validation._ndim("v", v, 4, "[B, T, HV, V]")
    B, T = q.shape[0], q.shape[1]
    N = B if cu_seqlens is None else validation._tensor("cu_seqlens", cu_seqlens).shape[0] - 1
    validation.check_max_seqlen(max_seqlen, T, cu_seqlens is not None)
    validation._choice("gate", gate, validation.GATES)
    lb = validation._gate_bound(gate, lower_bound)
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype: expected torch.float32 or torch.bfloat16, got {state_dtype!r}")
    validation.check_checkpoint_every(checkpoint_every)
    state = "f32" if state_dtype == torch.float32 else "bf16"
    return validation.prefill_route_meta("cuda", N, v.shape[2], B * T, max_seqlen, state, "o32", gate,
                                         checkpoint_every > 0, lb)


def kda_prefill(q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, gate="softplus",
                scale=None, beta_is_logit=True, cu_seqlens=None, initial_state=None, state=None,
                state_indices=None, output_final_state=True, final_state=None, checkpoint_every=0,
                checkpoints=None, max_seqlen=None, null_slot0=False, workspace=None, out=None):
    """Chunked KDA over (packed, variable-length) input.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (raw gate); beta [B, T, HV].
    Packed input: B = 1 and cu_seqlens [N+1]. Initial state dense [N, HV, V, K] (initial_state) or
    pool mode (state pool + state_indices [N]: read and written in place). Returns (out, final_state),
    or (out, final_state, checkpoints) when checkpoint_every > 0. See docs/api.md.
    """
    key = None
    if (fast_path.ENABLED and not _is_compiling() and not trace.enabled() and type(q) is _Tensor
            and fast_path.plain_ok((q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, state_indices),
                                   (state, final_state, checkpoints, workspace, out))
            and (cu_seqlens is None or cu_seqlens.is_cuda)):
        # (host offsets, cu_seqlens on the CPU, are checked by value on every call: full path)
        key = ("kda_prefill", q.shape[0], q.shape[1], gate, type(lower_bound), lower_bound, type(scale), scale,
               type(beta_is_logit), beta_is_logit, type(output_final_state), output_final_state,
               type(checkpoint_every), checkpoint_every, type(max_seqlen), max_seqlen, type(null_slot0), null_slot0,
               cu_seqlens is None, initial_state is None, state is None, final_state is None, checkpoints is None,
               workspace is None, out is None)
        entry = fast_path.get(key)
        if entry is not None:
            fn, sig, tail, call, ws_bytes, pool_read = entry
            try:  # see fast_path's docstring: a raise here (v not a tensor, too) has launched nothing
                if pool_read is not None:  # a pool only read: the signature cannot see it meet an input
                    lo = state.data_ptr()
                    hi = lo + pool_read[0]
                    for x, n in zip((q, k, v, g, beta, A_log, dt_bias, cu_seqlens, state_indices), pool_read[1]):
                        if n and lo - n < x.data_ptr() < hi:  # [p, p + n) meets [lo, hi) (n = 0: None or empty)
                            raise _MaybeOverlap  # the full check decides (and names the pair)
                args, result = _prefill_bind(call, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state,
                                             state, state_indices, final_state, checkpoints, out)
                ws = workspace if ws_bytes is None or workspace is not None else torch.empty(
                    ws_bytes, dtype=torch.uint8, device=q.device)
                if fn(sig, *args, ws, *tail) == sig:
                    return result
            except Exception:  # noqa: BLE001 - the full path raises the full check's error
                pass
    if custom_ops.tracing(q):  # Dynamo / export / FakeTensor: one flashkda_ext::kda_prefill node
        return custom_ops.traced_kda_prefill(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale,
            beta_is_logit=beta_is_logit, cu_seqlens=cu_seqlens, initial_state=initial_state, state=state,
            state_indices=state_indices, output_final_state=output_final_state, final_state=final_state,
            checkpoint_every=checkpoint_every, checkpoints=checkpoints, max_seqlen=max_seqlen,
            null_slot0=null_slot0, workspace=workspace, out=out)
    call = validation.check_kda_prefill(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale,
        beta_is_logit=beta_is_logit, cu_seqlens=cu_seqlens, initial_state=initial_state, state=state,
        state_indices=state_indices, output_final_state=output_final_state, final_state=final_state,
        checkpoint_every=checkpoint_every, checkpoints=checkpoints, max_seqlen=max_seqlen,
        null_slot0=null_slot0, out=out)
    rule, module, chunk = _prefill_route(call)
    if call.checkpoint_every % chunk != 0:
        raise ValueError(f"checkpoint_every: expected a multiple of the chunk size {chunk} of route "
                         f"{rule['module']}, got {call.checkpoint_every}")
    need = dispatch.prefill_workspace_need(module, call.total_tokens, call.num_seqs, call.value_heads)
    workspace = validation.check_workspace(workspace, need, q.device, call.backend)
    validation.check_apart(
        (("out", out), ("state", state), ("final_state", final_state), ("checkpoints", checkpoints),
         ("workspace", workspace)),
        (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log), ("dt_bias", dt_bias),
         ("cu_seqlens", cu_seqlens), ("initial_state", initial_state), ("state_indices", state_indices)),
        same_view_ok=("initial_state", "final_state"))
    args, result = _prefill_bind(call, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, state,
                                 state_indices, final_state, checkpoints, out)
    traced = False
    if trace.enabled():  # before the launch: a crashing call leaves its trace
        cu, init, final, _, ckpt = args[7:12]
        traced = trace.emit("kda_prefill", call, dict(
            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            scale=call.scale, cu_seqlens=cu, initial_state=init, state_indices=state_indices,
            final_state=final, checkpoints=ckpt, out=result[0])) is not None
    ws = workspace if need is None or workspace is not None else torch.empty(max(need, 1), dtype=torch.uint8,
                                                                           device=q.device)
    tail = (call.gate_mode, call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0,
            call.checkpoint_every)
    _launch(traced, module["kda_prefill"], *args, ws, *tail)
    if key is not None:
        ws_bytes = None if need is None else max(1, need)
        # A pool read and not committed (output_final_state=False) travels in the module's initial_state slot,
        # which the binding does not write, so its signature marks no overlap of the pool with an input; the
        # full check refuses one (the pool is an output, docs/api.md). The warm call compares addresses with
        # the byte extents of this validated call (a call whose tensors differ in metadata fails the signature).
        pool_read = None
        if call.state_mode == "pool" and not call.output_final_state:
            pool_read = (validation._span_bytes(state), tuple(
                validation._span_bytes(x) for x in (q, k, v, g, beta, A_log, dt_bias, cu_seqlens, state_indices)))
        fast_path.put(key, "kda_prefill", call, args + (ws,), tail, extra=(call, ws_bytes, pool_read))
    return result


def _prefill_bind(call, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, state, state_indices,
                  final_state, checkpoints, out):
    """The module function's arguments up to the workspace, for a validated call, with the outputs the
    caller left out allocated; and the op's result."""
    device = q.device
    B, T, HV, V, K = call.batch, call.seqlen, call.value_heads, call.head_dim_v, call.head_dim_k
    if out is None:  # v's shape, dtype and device in a validated call
        out = torch.empty_like(v, memory_format=_DENSE)
    if cu_seqlens is None:  # B rows of T tokens each (T may be 0: B empty sequences)
        cu_seqlens = (torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device) if T > 0
                      else torch.zeros(B + 1, dtype=torch.int32, device=device))
    sdtype = getattr(torch, call.state_dtype) if call.state_dtype else torch.float32
    if call.state_mode == "pool":  # output_final_state=False: read the pool, commit nothing
        init, final = state, (state if call.output_final_state else None)
    else:
        init = initial_state
        if call.output_final_state and final_state is None:
            final_state = torch.empty((call.num_seqs, HV, V, K), dtype=sdtype, device=device)
        final = final_state if call.output_final_state else None
    if call.checkpoint_every > 0 and checkpoints is None:
        # Slots past a sequence's own count stay NaN: never read as a state by mistake.
        checkpoints = torch.full((call.num_seqs, call.checkpoint_slots, HV, V, K), float("nan"),
                                 dtype=sdtype, device=device)
    # The caller's own tensors (B > 1 contiguous rows are the packed row the module reads): never a
    # reshape, which could copy a tensor and leave the caller's untouched (and out of the signature).
    args = (q, k, v, g, beta, A_log, dt_bias, cu_seqlens, init, final, state_indices, checkpoints, out)
    result_state = final
    result = (out, result_state, checkpoints) if call.checkpoint_every > 0 else (out, result_state)
    return args, result


def fused_kda_decode(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
                     norm_weight, *, lower_bound=None, gate="softplus", norm_eps=1e-5, scale=None,
                     slot_mode="unique", null_slot0=False, out=None):
    """Conv update + SiLU + gate + l2norm + recurrent step + gated RMSNorm in one launch.

    x [rows, 3*H*D] (q|k|v before the conv); conv_weight [3*H*D, 4]; conv_state [slots, 3*H*D, 3]
    (in place); g [rows, H, D]; beta [rows, H]; state [slots, H, D, D] (in place); output_gate
    [rows, H, D]; norm_weight [D]. Returns out [rows, H, D] = rmsnorm(o) * norm_weight * sigmoid(gate).
    """
    key = dest = None
    if (fast_path.ENABLED and not _is_compiling() and not trace.enabled() and type(x) is _Tensor
            and fast_path.plain_ok((x, conv_weight, g, beta, A_log, dt_bias, state_indices, output_gate, norm_weight),
                                   (conv_state, state, out))):
        key = ("fused_kda_decode", x.shape[0], gate, slot_mode, type(lower_bound), lower_bound,
               type(norm_eps), norm_eps, type(scale), scale, type(null_slot0), null_slot0)
        entry = fast_path.get(key)
        if entry is not None:
            fn, sig, tail = entry
            try:  # see fast_path's docstring: a raise here (output_gate not a tensor, too) has launched nothing
                # a valid call's out is output_gate's shape ([rows, H, D]) with x's dtype and device
                dest = torch.empty_like(output_gate, dtype=x.dtype, memory_format=_DENSE) if out is None else out
                if fn(sig, x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
                      norm_weight, dest, *tail) == sig:
                    return dest
            except Exception:  # noqa: BLE001 - the full path raises the full check's error
                pass
    if custom_ops.tracing(x):  # Dynamo / export / FakeTensor: one flashkda_ext::fused_kda_decode node
        return custom_ops.traced_fused_kda_decode(
            x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate, norm_weight,
            lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale, slot_mode=slot_mode,
            null_slot0=null_slot0, out=out)
    call = validation.check_fused_kda_decode(
        x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
        norm_weight, lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale,
        slot_mode=slot_mode, null_slot0=null_slot0, out=out)
    validation.check_apart((("out", out), ("conv_state", conv_state), ("state", state)),
                           (("x", x), ("conv_weight", conv_weight), ("g", g), ("beta", beta), ("A_log", A_log),
                            ("dt_bias", dt_bias), ("state_indices", state_indices), ("output_gate", output_gate),
                            ("norm_weight", norm_weight)))
    if out is None:
        out = dest if dest is not None else torch.empty(
            (call.rows, call.num_heads, call.head_dim), dtype=x.dtype, device=x.device)
    traced = False
    if trace.enabled():  # before the launch: a crashing call leaves its trace
        traced = trace.emit("fused_kda_decode", call, dict(
            x=x, conv_weight=conv_weight, conv_state=conv_state, g=g, beta=beta, A_log=A_log,
            dt_bias=dt_bias, state_indices=state_indices, state=state, output_gate=output_gate,
            norm_weight=norm_weight, lower_bound=lower_bound, scale=call.scale, norm_eps=norm_eps,
            out=out)) is not None
    fn = _route_fn("fused_kda_decode", call)
    sig_args = (x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
                norm_weight, out)
    tail = (call.gate_mode, call.lower_bound, call.scale, call.norm_eps, call.null_slot0)
    _launch(traced, fn, *sig_args, *tail)
    if key is not None:
        fast_path.put(key, "fused_kda_decode", call, sig_args, tail)
    return out


def kda_verify(q, k, v, g, beta, *, state, state_indices, cu_seqlens, num_accepted_tokens=None, max_seqlen=None,
               A_log=None, dt_bias=None, lower_bound=None, gate="softplus", scale=None, beta_is_logit=True,
               null_slot0=False, out=None, initial_state=None, initial_state_indices=None, parent_tokens=None):
    """Speculative-decoding verify: T_n draft tokens per request on a state pool, the state after
    every token stored in a slot of its own.

    q, k [1, T, H, K]; v [1, T, HV, V]; g [1, T, HV, K] (raw gate); beta [1, T, HV], the N requests
    packed by cu_seqlens (int32 [N+1], T_n >= 0: an empty request, such as an engine's CUDA-graph
    padding, reads and writes nothing); state [slots, HV, V, K] fp32 or bf16
    (updated in place); state_indices int32 [N, T_max]: the state after token t of request n goes
    to state[state_indices[n, t]]; request n starts from state[state_indices[n, num_accepted_tokens[n]
    - 1]] (num_accepted_tokens int32 [N]; None = column 0). Negative entries are padding (docs/
    semantics.md, "Verify"). max_seqlen: a host bound on T_n for routing (default T_max). Returns out
    [1, T, HV, V] (v's dtype). T_max = 1 is kda_decode on state_indices[:, 0], and is served by it
    (then T = N: one token per request).

    initial_state [slots2, HV, V, K] (state's dtype, read only; state itself or memory apart from it)
    with initial_state_indices int32 [N]: request n starts from initial_state[initial_state_indices[n]]
    instead (num_accepted_tokens must be None); a padding entry (negative, 0 with null_slot0, on a GPU
    also >= slots2) makes the request padding. Nothing else changes.

    Step rows: state [R, T_max, HV, V, K] with state_indices int32 [N] (request n's row) stands for the
    table state_indices[n] * T_max + t over the R * T_max slots (the state after token t goes to
    state[row, t]); a padding row (negative, 0 with null_slot0, on a GPU also >= R) makes the request
    padding. docs/semantics.md, "Verify".

    parent_tokens int32 [N, T_max] (a draft tree, e.g. SGLang's retrieve_parent_token): token t >= 1 of
    request n continues from the state stored after its token parent_tokens[n, t] (in [0, t), an entry
    whose state is stored) instead of token t - 1; column 0 is not read. On a GPU a request with an
    entry outside those rules is padding (zeros, nothing written); on the CPU it is a ValueError.
    """
    key = dest = None
    if (fast_path.ENABLED and not _is_compiling() and not trace.enabled() and type(q) is _Tensor
            and type(state_indices) is _Tensor
            and fast_path.plain_ok((q, k, v, g, beta, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens,
                                    initial_state, initial_state_indices, parent_tokens), (state, out))):
        key = ("kda_verify", q.shape, state_indices.shape, gate, type(lower_bound), lower_bound, type(scale), scale,
               type(beta_is_logit), beta_is_logit, type(null_slot0), null_slot0, type(max_seqlen), max_seqlen,
               num_accepted_tokens is None, initial_state is None, initial_state_indices is None,
               parent_tokens is None)
        entry = fast_path.get(key)
        if entry is not None:
            fn, sig, tail, seen = entry
            # Host index values (CPU backend) are checked on every call; any doubt, or a raise before
            # the launch (fast_path's docstring), takes the full path, which raises the full check's error.
            try:
                dest = torch.empty_like(v, memory_format=_DENSE) if out is None else out  # a valid call's out
                validation.check_verify_values(seen, cu_seqlens, state_indices, num_accepted_tokens, max_seqlen,
                                               initial_state_indices, _initial_is_state(seen, initial_state, state),
                                               parent_tokens)
                if fn(sig, q, k, v, g, beta, A_log, dt_bias, state, state_indices, cu_seqlens, num_accepted_tokens,
                      initial_state, initial_state_indices, parent_tokens, dest, *tail) == sig:
                    return dest
            except Exception:  # noqa: BLE001
                pass
    if custom_ops.tracing(q):  # Dynamo / export / FakeTensor: one flashkda_ext::kda_verify node
        return custom_ops.traced_kda_verify(
            q, k, v, g, beta, state=state, state_indices=state_indices, cu_seqlens=cu_seqlens,
            num_accepted_tokens=num_accepted_tokens, max_seqlen=max_seqlen, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, gate=gate, scale=scale, beta_is_logit=beta_is_logit, null_slot0=null_slot0,
            out=out, initial_state=initial_state, initial_state_indices=initial_state_indices,
            parent_tokens=parent_tokens)
    call = validation.check_kda_verify(
        q, k, v, g, beta, state=state, state_indices=state_indices, cu_seqlens=cu_seqlens,
        num_accepted_tokens=num_accepted_tokens, max_seqlen=max_seqlen, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, gate=gate, scale=scale, beta_is_logit=beta_is_logit, null_slot0=null_slot0,
        out=out, initial_state=initial_state, initial_state_indices=initial_state_indices,
        parent_tokens=parent_tokens)
    validation.check_verify_values(call, cu_seqlens, state_indices, num_accepted_tokens, max_seqlen,
                                   initial_state_indices, _initial_is_state(call, initial_state, state), parent_tokens)
    validation.check_apart((("out", out), ("state", state)),
                           (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                            ("dt_bias", dt_bias), ("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                            ("num_accepted_tokens", num_accepted_tokens), ("initial_state", initial_state),
                            ("initial_state_indices", initial_state_indices), ("parent_tokens", parent_tokens)),
                           same_view_ok=("state", "initial_state"))
    if out is None:
        out = dest if dest is not None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    traced = False
    if trace.enabled():  # before the launch (either module): a crashing call leaves its trace
        traced = trace.emit("kda_verify", call, dict(
            q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=state_indices, cu_seqlens=cu_seqlens,
            num_accepted_tokens=num_accepted_tokens, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            scale=call.scale, out=out, initial_state=initial_state, initial_state_indices=initial_state_indices,
            parent_tokens=parent_tokens)) is not None
    if call.as_decode:
        # One token per request, read from and written to column 0: kda_decode's own module on views
        # of the caller's tensors (bitwise kda_decode). Always the full path: the decode signature
        # would not cover cu_seqlens and num_accepted_tokens.
        meta = call.decode_route_meta()
        fn = dispatch.function("kda_decode", meta)
        g, beta = _cast_gb(_gb_casts(call, "kda_decode", meta), g, beta)
        _launch(traced, fn, q[0], k[0], v[0], g[0], beta[0], A_log, dt_bias, state, state_indices[:, 0], out[0],
                call.gate_mode, call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0)
        return out
    fn = _route_fn("kda_verify", call)
    casts = _gb_casts(call, "kda_verify")
    if casts:  # one fp32 and one bf16 of g / beta: one pass brings the other to what the module reads
        g, beta = _cast_gb(casts, g, beta)
    sig_args = (q, k, v, g, beta, A_log, dt_bias, state, state_indices, cu_seqlens, num_accepted_tokens,
                initial_state, initial_state_indices, parent_tokens, out)
    tail = (call.gate_mode, call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0)
    _launch(traced, fn, *sig_args, *tail)
    if key is not None and not casts:  # a converted copy's signature would never match the caller's tensor
        fast_path.put(key, "kda_verify", call, sig_args, tail, extra=(call,))
    return out


def _initial_is_state(call, initial_state, state) -> bool:
    """Whether kda_verify's initial_state is state itself (same view): then its reads meet the call's writes
    (a rule on host values only, so only the CPU backend asks)."""
    return call.has_initial and call.backend == "cpu" and validation.same_view(initial_state, state)


def fused_kda_verify(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight, *,
                     state_indices, cu_seqlens, num_accepted_tokens=None, max_seqlen=None, lower_bound=None,
                     gate="softplus", norm_eps=1e-5, scale=None, null_slot0=False, out=None):
    """fused_kda_decode over each request's draft tokens with the state kept per token (kda_verify).

    x [1, T, 3*H*D]; conv_weight [3*H*D, 4]; conv_state [slots, 3*H*D, L] with L >= T_max + 2 (in
    place; request n's line is conv_state[state_indices[n, 0]], read at offset
    num_accepted_tokens[n] - 1); g [1, T, H, D]; beta [1, T, H]; state [slots, H, D, D] (in place);
    output_gate [1, T, H, D]; norm_weight [D]; state_indices, cu_seqlens, num_accepted_tokens,
    max_seqlen as kda_verify. Returns out [1, T, H, D] = rmsnorm(o) * norm_weight * sigmoid(gate).
    See docs/semantics.md, "Fused verify".
    """
    key = dest = None
    if (fast_path.ENABLED and not _is_compiling() and not trace.enabled() and type(x) is _Tensor
            and type(state_indices) is _Tensor
            and fast_path.plain_ok((x, conv_weight, g, beta, A_log, dt_bias, output_gate, norm_weight, state_indices,
                                    cu_seqlens, num_accepted_tokens), (conv_state, state, out))):
        key = ("fused_kda_verify", x.shape, state_indices.shape, gate, type(lower_bound), lower_bound,
               type(norm_eps), norm_eps, type(scale), scale, type(null_slot0), null_slot0, type(max_seqlen),
               max_seqlen, num_accepted_tokens is None)
        entry = fast_path.get(key)
        if entry is not None:
            fn, sig, tail, seen = entry
            # As in kda_verify: any doubt about the index values, or a raise before the launch, takes the
            # full path.
            try:
                dest = torch.empty_like(output_gate, dtype=x.dtype, memory_format=_DENSE) if out is None else out
                validation.check_verify_values(seen, cu_seqlens, state_indices, num_accepted_tokens, max_seqlen)
                if fn(sig, x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight,
                      state_indices, cu_seqlens, num_accepted_tokens, dest, *tail) == sig:
                    return dest
            except Exception:  # noqa: BLE001
                pass
    if custom_ops.tracing(x):  # Dynamo / export / FakeTensor: one flashkda_ext::fused_kda_verify node
        return custom_ops.traced_fused_kda_verify(
            x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight,
            state_indices=state_indices, cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
            max_seqlen=max_seqlen, lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale,
            null_slot0=null_slot0, out=out)
    call = validation.check_fused_kda_verify(
        x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight,
        state_indices=state_indices, cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
        max_seqlen=max_seqlen, lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale,
        null_slot0=null_slot0, out=out)
    validation.check_verify_values(call, cu_seqlens, state_indices, num_accepted_tokens, max_seqlen)
    validation.check_apart((("out", out), ("conv_state", conv_state), ("state", state)),
                           (("x", x), ("conv_weight", conv_weight), ("g", g), ("beta", beta), ("A_log", A_log),
                            ("dt_bias", dt_bias), ("output_gate", output_gate), ("norm_weight", norm_weight),
                            ("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                            ("num_accepted_tokens", num_accepted_tokens)))
    if out is None:
        out = dest if dest is not None else torch.empty(output_gate.shape, dtype=x.dtype, device=x.device)
    traced = False
    if trace.enabled():  # before the launch: a crashing call leaves its trace
        traced = trace.emit("fused_kda_verify", call, dict(
            x=x, conv_weight=conv_weight, conv_state=conv_state, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
            state=state, output_gate=output_gate, norm_weight=norm_weight, state_indices=state_indices,
            cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens, lower_bound=lower_bound,
            scale=call.scale, norm_eps=norm_eps, out=out)) is not None
    fn = _route_fn("fused_kda_verify", call)
    sig_args = (x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight,
                state_indices, cu_seqlens, num_accepted_tokens, out)
    tail = (call.gate_mode, call.lower_bound, call.scale, call.norm_eps, call.null_slot0)
    _launch(traced, fn, *sig_args, *tail)
    if key is not None:
        fast_path.put(key, "fused_kda_verify", call, sig_args, tail, extra=(call,))
    return out
