"""kda_prefill on jax arrays: dense or pool state, checkpoints, and the CUDA prefill's workspace as
an XLA result."""
from __future__ import annotations

import functools

import jax.numpy as jnp

from .. import dispatch, jit, validation
from .arrays import (_any_tracer, _as_array, _check_host_offsets, _check_host_slots, _check_platform, _dtype_str,
                     _host_offsets, _meta,
                     _offsets_valid, _platform)
from .plan import _Prepared, _donate_positions, _prepared, _remember, _route, _run, _signature
from .targets import _GRAPH_SAFE, _Plan, _attrs, _command_buffers_allowed, _ffi


@functools.lru_cache(maxsize=None)
def _prefill_module_info(module_name: str):
    """(chunk size, the loaded module) of a prefill module."""
    params = jit.get_record(module_name).get("params", {})
    chunk = int(params.get("CHUNK", params.get("chunk", 1)))
    return chunk, jit.load_module(module_name)


def _prefill_impl(plan, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, state_indices,
                  state, checkpoints):
    B, T = q.shape[0], q.shape[1]
    packed = lambda x: x.reshape((1, B * T) + tuple(x.shape[2:]))  # noqa: E731  B rows -> one packed row
    if cu_seqlens is None:  # B rows of T tokens each (T may be 0: B empty sequences)
        cu_seqlens = (jnp.arange(0, (B + 1) * T, T, dtype=jnp.int32) if T > 0
                      else jnp.zeros((B + 1,), dtype=jnp.int32))
    results = {n: (shape, dtype) for n, shape, dtype, _a in plan.results}
    if "checkpoints" in results and checkpoints is None:
        # Slots past a sequence's own count stay NaN, as with the torch op.
        shape, dtype = results["checkpoints"]
        checkpoints = jnp.full(shape, jnp.nan, dtype=jnp.dtype(dtype))
    arrays = dict(q=packed(q), k=packed(k), v=packed(v), g=packed(g), beta=packed(beta), A_log=A_log,
                  dt_bias=None if dt_bias is None else dt_bias.reshape(-1), cu_seqlens=cu_seqlens,
                  initial_state=state if state is not None else initial_state,
                  state_indices=state_indices, checkpoints=checkpoints)
    got = dict(zip((r[0] for r in plan.results), _ffi(plan, arrays)))
    out = got["out"].reshape(q.shape[:2] + got["out"].shape[2:])
    final = got.get("final_state")
    if "checkpoints" in got:
        return out, final, got["checkpoints"]
    return out, final


def kda_prefill(q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, gate="softplus",
                scale=None, beta_is_logit=True, cu_seqlens=None, initial_state=None, state=None,
                state_indices=None, output_final_state=True, checkpoint_every=0, checkpoints=None,
                max_seqlen=None, null_slot0=False, donate=True, platform=None):
    """Chunked KDA over (packed, variable-length) input. Returns (out, final_state), or
    (out, final_state, checkpoints) when checkpoint_every > 0.

    Shapes, dtypes and options as flashkda_ext.kda_prefill. Dense mode: initial_state [N, HV, V, K]
    (or None for zeros) and a fresh final_state (None when output_final_state=False). Pool mode:
    state [slots, HV, V, K] + state_indices [N]: final_state is the pool, written in place of
    `state`; with output_final_state=False the pool is only read (nothing committed, final_state
    None: a speculative extend). Given checkpoints are written in place too. Eagerly the pool and given checkpoints are
    donated unless donate=False; under jax.jit, donate them on your jit. The CUDA prefill's scratch
    workspace is allocated by XLA as an extra result (so the call stays capturable).
    """
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state",
             "state_indices", "state", "checkpoints")
    vals = (q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, state_indices, state, checkpoints)
    required = {"q", "k", "v", "g", "beta"}
    args = tuple(_as_array(n, x, optional=n not in required) for n, x in zip(names, vals))
    plat = _platform(platform, zip(names, args))
    # Host offsets give the longest sequence (sizes the checkpoints, feeds the route), as in torch.
    cs = _host_offsets(args[7])
    key = _signature("kda_prefill", plat, args,
                     (lower_bound, gate, scale, beta_is_logit, output_final_state, checkpoint_every,
                      max_seqlen, null_slot0, donate), extra=None if cs is None else tuple(cs))
    prep = _prepared(key)
    if prep is None:
        prep = _prepare_prefill(names, args, plat, key, cs, lower_bound=lower_bound, gate=gate,
                                scale=scale, beta_is_logit=beta_is_logit,
                                output_final_state=output_final_state,
                                checkpoint_every=checkpoint_every, max_seqlen=max_seqlen,
                                null_slot0=null_slot0, donate=donate)   # checks the platform before building
    else:
        _check_platform(plat, zip(names, args))
    if prep.plan.platform == "cpu" and args[10] is not None:  # pool mode: every call, before the donation
        _check_host_slots(args[9], args[10].shape[0], null_slot0, unique=True)
    return _run(_prefill_impl, prep, args, eager=not _any_tracer(args), names=names)


def _prepare_prefill(names, args, plat, key, cs, *, lower_bound, gate, scale, beta_is_logit,
                     output_final_state, checkpoint_every, max_seqlen, null_slot0,
                     donate) -> _Prepared:
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, state_indices, state, checkpoints = args
    route_max = max_seqlen
    if cs is not None and max_seqlen is None and q.ndim == 4 and _offsets_valid(cs, q.shape[1]):
        route_max = max(b - a for a, b in zip(cs, cs[1:]))
    call = validation.check_kda_prefill(
        _meta("q", q), _meta("k", k), _meta("v", v), _meta("g", g), _meta("beta", beta),
        A_log=_meta("A_log", A_log), dt_bias=_meta("dt_bias", dt_bias), lower_bound=lower_bound,
        gate=gate, scale=scale, beta_is_logit=beta_is_logit, cu_seqlens=_meta("cu_seqlens", cu_seqlens),
        initial_state=_meta("initial_state", initial_state), state=_meta("state", state),
        state_indices=_meta("state_indices", state_indices), output_final_state=output_final_state,
        checkpoint_every=checkpoint_every, checkpoints=_meta("checkpoints", checkpoints),
        max_seqlen=route_max, null_slot0=null_slot0, backend=plat)
    if cs is not None:
        _check_host_offsets(cs, call.seqlen, max_seqlen)
    _check_platform(plat, zip(names, args))       # before the route's module is built
    module_name = _route("kda_prefill", call)
    chunk, module = _prefill_module_info(module_name)
    if call.checkpoint_every % chunk != 0:
        raise ValueError(f"checkpoint_every: expected a multiple of the chunk size {chunk} of route "
                         f"{module_name}, got {call.checkpoint_every}")

    B, T, HV, V, K = call.batch, call.seqlen, call.value_heads, call.head_dim_v, call.head_dim_k
    sdtype = call.state_dtype or "float32"
    # Operands in ABI order; in pool mode the pool travels in the initial_state slot.
    operands = [n for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias") if
                dict(zip(names, args))[n] is not None]
    operands.append("cu_seqlens")
    if call.state_mode == "pool" or initial_state is not None:
        operands.append("initial_state")
    if state_indices is not None:
        operands.append("state_indices")
    results = [("out", (1, B * T, HV, V), _dtype_str(v), None)]
    if call.state_mode == "pool":
        if call.output_final_state:  # else: read the pool, commit nothing (final_state None)
            results.append(("final_state", tuple(state.shape), _dtype_str(state), "initial_state"))
    elif call.output_final_state:
        results.append(("final_state", (call.num_seqs, HV, V, K), sdtype, None))
    if call.checkpoint_every > 0:
        operands.append("checkpoints")   # the given buffer, or NaNs made inside the trace
        results.append(("checkpoints", (call.num_seqs, call.checkpoint_slots, HV, V, K), sdtype,
                        "checkpoints"))
    graph_safe = _GRAPH_SAFE["kda_prefill"]
    need = dispatch.prefill_workspace_need(module, call.total_tokens, call.num_seqs, HV)
    if need is not None:
        results.append(("workspace", (max(need, 1),), "uint8", None))
        graph_safe = True  # scratch comes from XLA, not from an allocation inside the call
    plan = _Plan(
        family="kda_prefill", platform=plat, module=module_name, operands=tuple(operands),
        results=tuple(results),
        attrs=_attrs("kda_prefill", call), cuda_graph=graph_safe and _command_buffers_allowed())
    donated = (10, 11) if call.output_final_state else (11,)  # a pool that is not committed is only read
    return _remember(key, plan, _donate_positions(args, donated, donate))

