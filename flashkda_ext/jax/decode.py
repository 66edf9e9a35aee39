"""kda_decode and fused_kda_decode on jax arrays: one step per row on a state pool (and, fused, its
conv cache), both written in place."""
from __future__ import annotations

from .. import dispatch, validation
from .arrays import _any_tracer, _as_array, _check_host_slots, _check_platform, _dtype_str, _meta, _platform
from .plan import _Prepared, _donate_positions, _prepared, _remember, _route, _run, _signature
from .targets import _GRAPH_SAFE, _Plan, _attrs, _command_buffers_allowed, _ffi


# ---------------------------------------------------------------------------------------------
# kda_decode


def _decode_impl(plan, q, k, v, g, beta, A_log, dt_bias, state_indices, state):
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log,
                  dt_bias=None if dt_bias is None else dt_bias.reshape(-1),
                  state_indices=state_indices, state=state)
    out, new_state = _ffi(plan, arrays)
    return out, new_state


def kda_decode(q, k, v, g, beta, *, state, state_indices, A_log=None, dt_bias=None, lower_bound=None,
               gate="softplus", scale=None, beta_is_logit=True, slot_mode="unique", null_slot0=False,
               donate=True, platform=None):
    """One recurrent KDA step per row on a state pool. Returns (out, new_state).

    Shapes, dtypes and options as flashkda_ext.kda_decode: q, k [rows, H, K]; v [rows, HV, V];
    g [rows, HV, K]; beta [rows, HV]; state [slots, HV, V, K]; state_indices int32 [rows].
    new_state is the pool after the step, written in place of `state` (eagerly, `state` is donated
    unless donate=False; under jax.jit, donate it on your jit). platform: "cpu"/"cuda" to override
    the device inferred from the arrays (needed only inside jax.jit off the default backend).
    """
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_indices", "state")
    vals = (q, k, v, g, beta, A_log, dt_bias, state_indices, state)
    optional = {"A_log", "dt_bias"}
    args = tuple(_as_array(n, x, optional=n in optional) for n, x in zip(names, vals))
    plat = _platform(platform, zip(names, args))
    key = _signature("kda_decode", plat, args, (lower_bound, gate, scale, beta_is_logit, slot_mode,
                                                null_slot0, donate))
    prep = _prepared(key)
    if prep is None:
        prep = _prepare_decode(names, args, plat, key, lower_bound=lower_bound, gate=gate, scale=scale,
                               beta_is_logit=beta_is_logit, slot_mode=slot_mode, null_slot0=null_slot0,
                               donate=donate)
    _check_platform(plat, zip(names, args))  # after the checks of the arguments, before anything is built
    if prep.plan.platform == "cpu":  # values, not signature: every call, before the pool is donated
        _check_host_slots(args[7], args[8].shape[0], null_slot0, unique=False)
    return _run(_decode_impl, prep, args, eager=not _any_tracer(args), names=names)


def _prepare_decode(names, args, plat, key, *, lower_bound, gate, scale, beta_is_logit, slot_mode,
                    null_slot0, donate) -> _Prepared:
    q, k, v, g, beta, A_log, dt_bias, state_indices, state = args
    call = validation.check_kda_decode(
        _meta("q", q), _meta("k", k), _meta("v", v), _meta("g", g), _meta("beta", beta),
        state=_meta("state", state), state_indices=_meta("state_indices", state_indices),
        A_log=_meta("A_log", A_log), dt_bias=_meta("dt_bias", dt_bias), lower_bound=lower_bound,
        gate=gate, scale=scale, beta_is_logit=beta_is_logit, slot_mode=slot_mode,
        null_slot0=null_slot0, backend=plat)
    module = _route("kda_decode", call)
    operands = tuple(n for n, x in zip(names, args) if x is not None)
    plan = _Plan(
        family="kda_decode", platform=plat, module=module, operands=operands,
        results=(("out", (call.rows, call.value_heads, call.head_dim_v), _dtype_str(v), None),
                 ("state", tuple(state.shape), _dtype_str(state), "state")),
        attrs=_attrs("kda_decode", call), cuda_graph=_GRAPH_SAFE["kda_decode"] and _command_buffers_allowed(),
        casts=call.gb_casts(dispatch.gb_read_dtype(module, call.input_dtype)))
    return _remember(key, plan, _donate_positions(args, (8,), donate))


# ---------------------------------------------------------------------------------------------
# fused_kda_decode


def _fused_impl(plan, x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state,
                output_gate, norm_weight):
    arrays = dict(x=x, conv_weight=conv_weight, conv_state=conv_state, g=g, beta=beta, A_log=A_log,
                  dt_bias=None if dt_bias is None else dt_bias.reshape(-1), state_indices=state_indices,
                  state=state, output_gate=output_gate, norm_weight=norm_weight)
    out, new_conv_state, new_state = _ffi(plan, arrays)
    return out, new_conv_state, new_state


def fused_kda_decode(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
                     norm_weight, *, lower_bound=None, gate="softplus", norm_eps=1e-5, scale=None,
                     slot_mode="unique", null_slot0=False, donate=True, platform=None):
    """Conv update + SiLU + gate + l2norm + recurrent step + gated RMSNorm in one launch.
    Returns (out, new_conv_state, new_state).

    Shapes, dtypes and options as flashkda_ext.fused_kda_decode. new_conv_state and new_state are
    written in place of conv_state and state (eagerly both are donated unless donate=False; under
    jax.jit, donate them on your jit).
    """
    names = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices", "state",
             "output_gate", "norm_weight")
    vals = (x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
            norm_weight)
    optional = {"A_log", "dt_bias"}
    args = tuple(_as_array(n, a, optional=n in optional) for n, a in zip(names, vals))
    plat = _platform(platform, zip(names, args))
    key = _signature("fused_kda_decode", plat, args, (lower_bound, gate, norm_eps, scale, slot_mode,
                                                      null_slot0, donate))
    prep = _prepared(key)
    if prep is None:
        prep = _prepare_fused(names, args, plat, key, lower_bound=lower_bound, gate=gate,
                              norm_eps=norm_eps, scale=scale, slot_mode=slot_mode,
                              null_slot0=null_slot0, donate=donate)
    _check_platform(plat, zip(names, args))
    if prep.plan.platform == "cpu":  # values, not signature: every call, before the pools are donated
        _check_host_slots(args[7], args[8].shape[0], null_slot0, unique=False)
    return _run(_fused_impl, prep, args, eager=not _any_tracer(args), names=names)


def _prepare_fused(names, args, plat, key, *, lower_bound, gate, norm_eps, scale, slot_mode,
                   null_slot0, donate) -> _Prepared:
    x, conv_state, state = args[0], args[2], args[8]
    call = validation.check_fused_kda_decode(
        *(_meta(n, a) for n, a in zip(names, args)), lower_bound=lower_bound, gate=gate,
        norm_eps=norm_eps, scale=scale, slot_mode=slot_mode, null_slot0=null_slot0, backend=plat)
    module = _route("fused_kda_decode", call)
    plan = _Plan(
        family="fused_kda_decode", platform=plat, module=module,
        operands=tuple(n for n, a in zip(names, args) if a is not None),
        results=(("out", (call.rows, call.num_heads, call.head_dim), _dtype_str(x), None),
                 ("conv_state", tuple(conv_state.shape), _dtype_str(conv_state), "conv_state"),
                 ("state", tuple(state.shape), _dtype_str(state), "state")),
        attrs=_attrs("fused_kda_decode", call), cuda_graph=_GRAPH_SAFE["fused_kda_decode"] and _command_buffers_allowed())
    return _remember(key, plan, _donate_positions(args, (2, 8), donate))

