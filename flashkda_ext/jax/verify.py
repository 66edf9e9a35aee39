"""kda_verify and fused_kda_verify on jax arrays: speculative-decoding verify on a state pool, with
the host value checks of index arrays concrete on the CPU on every call."""
from __future__ import annotations

from .. import dispatch, validation
from .arrays import _any_tracer, _as_array, _check_platform, _dtype_str, _host_int32, _meta, _platform
from .plan import _Prepared, _donate_positions, _module_for, _prepared, _remember, _route, _run, _signature
from .targets import _GRAPH_SAFE, _Plan, _attrs, _command_buffers_allowed, _ffi


# ---------------------------------------------------------------------------------------------
# kda_verify


def _verify_impl(plan, q, k, v, g, beta, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state,
                 initial_state=None, initial_state_indices=None, parent_tokens=None):
    dt = None if dt_bias is None else dt_bias.reshape(-1)
    if plan.family == "kda_decode":  # T_max = 1: kda_decode on column 0 (as the torch op)
        arrays = dict(q=q[0], k=k[0], v=v[0], g=g[0], beta=beta[0], A_log=A_log, dt_bias=dt,
                      state_indices=state_indices[:, 0], state=state)
        out, new_state = _ffi(plan, arrays)
        return out[None], new_state
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt, state_indices=state_indices,
                  cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens, state=state,
                  initial_state=initial_state, initial_state_indices=initial_state_indices, parent_tokens=parent_tokens)
    out, new_state = _ffi(plan, arrays)
    return out, new_state


def kda_verify(q, k, v, g, beta, *, state, state_indices, cu_seqlens, num_accepted_tokens=None, max_seqlen=None,
               A_log=None, dt_bias=None, lower_bound=None, gate="softplus", scale=None, beta_is_logit=True,
               null_slot0=False, initial_state=None, initial_state_indices=None, parent_tokens=None, donate=True,
               platform=None):
    """Speculative-decoding verify on a state pool. Returns (out, new_state).

    Shapes, dtypes and options as flashkda_ext.kda_verify: q, k [1, T, H, K]; v [1, T, HV, V];
    g [1, T, HV, K]; beta [1, T, HV]; state [slots, HV, V, K]; state_indices int32 [N, T_max];
    cu_seqlens int32 [N+1]; num_accepted_tokens int32 [N] or None; initial_state [slots2, HV, V, K] with
    initial_state_indices int32 [N] (or both None): the requests' start states, read only, instead of
    state's (num_accepted_tokens then None); state may be step rows [R, T_max, HV, V, K] with
    state_indices [N] (one row per request); parent_tokens int32 [N, T_max] or None: a draft tree (token
    t >= 1 continues from the state stored after its token parent_tokens[n, t]). new_state is the pool after the
    step, written in place of `state` (eagerly donated unless donate=False; under jax.jit, donate it
    on your jit). Index arrays that are concrete on the CPU have their values checked as the torch op
    does; T_max = 1 runs kda_decode's module on column 0.
    """
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_indices", "cu_seqlens", "num_accepted_tokens",
             "state", "initial_state", "initial_state_indices", "parent_tokens")
    vals = (q, k, v, g, beta, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state, initial_state,
            initial_state_indices, parent_tokens)
    args, plat = _verify_arrays(names, vals, platform)
    key = _signature("kda_verify", plat, args, (max_seqlen, lower_bound, gate, scale, beta_is_logit, null_slot0,
                                                donate))
    prep = _prepared(key)
    if prep is None:
        prep = _prepare_verify(names, args, plat, key, max_seqlen=max_seqlen, lower_bound=lower_bound, gate=gate,
                               scale=scale, beta_is_logit=beta_is_logit, null_slot0=null_slot0, donate=donate)
    _check_platform(plat, zip(names, args))
    _check_verify_values(key, prep, args, (8, 7, 9, 12, 13), max_seqlen)
    return _run(_verify_impl, prep, args, eager=not _any_tracer(args), names=names)


def _verify_arrays(names, vals, platform):
    """A verify op's inputs as arrays (A_log, dt_bias, num_accepted_tokens may be None) and the
    platform they run on."""
    optional = {"A_log", "dt_bias", "num_accepted_tokens", "initial_state", "initial_state_indices", "parent_tokens"}
    args = tuple(_as_array(n, a, optional=n in optional) for n, a in zip(names, vals))
    return args, _platform(platform, zip(names, args))


def _check_verify_values(key, prep, args, positions, max_seqlen) -> None:
    """On the CPU, the values of the index arrays that are concrete there (not part of the
    signature: checked on every call); positions: where cu_seqlens, state_indices, num_accepted_tokens and
    (kda_verify) initial_state_indices and parent_tokens stand in args. The second pool is never the buffer
    XLA writes."""
    if prep.plan.platform != "cpu":
        return
    host = [_host_int32(args[i]) for i in positions]
    if all(h is not None or args[i] is None for h, i in zip(host, positions)) and args[positions[0]] is not None:
        tree = dict(initial_state_indices=host[3], parent_tokens=host[4]) if len(host) > 3 else {}
        validation.check_verify_values(_VERIFY_CALLS[key], *host[:3], max_seqlen, **tree)


def _prepare_verify(names, args, plat, key, *, max_seqlen, lower_bound, gate, scale, beta_is_logit, null_slot0,
                    donate) -> _Prepared:
    (q, k, v, g, beta, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state, init, init_idx,
     parents) = args
    call = validation.check_kda_verify(
        _meta("q", q), _meta("k", k), _meta("v", v), _meta("g", g), _meta("beta", beta), state=_meta("state", state),
        state_indices=_meta("state_indices", state_indices), cu_seqlens=_meta("cu_seqlens", cu_seqlens),
        num_accepted_tokens=_meta("num_accepted_tokens", num_accepted_tokens), max_seqlen=max_seqlen,
        A_log=_meta("A_log", A_log), dt_bias=_meta("dt_bias", dt_bias), lower_bound=lower_bound, gate=gate,
        scale=scale, beta_is_logit=beta_is_logit, null_slot0=null_slot0,
        initial_state=_meta("initial_state", init), initial_state_indices=_meta("initial_state_indices", init_idx),
        parent_tokens=_meta("parent_tokens", parents), backend=plat)
    present = {n for n, x in zip(names, args) if x is not None}
    if call.as_decode:
        module = _module_for("kda_decode", tuple(sorted(call.decode_route_meta().items())))
        family = "kda_decode"
        operands = tuple(n for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_indices", "state")
                         if n in present)
        out_shape = (call.num_seqs, call.value_heads, call.head_dim_v)
    else:
        module, family = _route("kda_verify", call), "kda_verify"
        operands = tuple(n for n in names if n in present)
        out_shape = (1, call.total_tokens, call.value_heads, call.head_dim_v)
    plan = _Plan(
        family=family, platform=plat, module=module, operands=operands,
        results=(("out", out_shape, _dtype_str(v), None), ("state", tuple(state.shape), _dtype_str(state), "state")),
        attrs=_attrs(family, call), cuda_graph=_GRAPH_SAFE[family] and _command_buffers_allowed(),
        casts=call.gb_casts(dispatch.gb_read_dtype(module, call.input_dtype)))
    _VERIFY_CALLS[key] = call  # the host value checks need it on every call (no slot for it on _Prepared)
    return _remember(key, plan, _donate_positions(args, (10,), donate))


#: the call's signature (shapes, dtypes and every attribute, max_seqlen among them) -> its validated VerifyCall. Not
#: the plan: two calls that differ only in max_seqlen share a plan, and the values are checked against the call's own
_VERIFY_CALLS: dict = {}


# ---------------------------------------------------------------------------------------------
# fused_kda_verify


def _fused_verify_impl(plan, x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight,
                       state_indices, cu_seqlens, num_accepted_tokens):
    arrays = dict(x=x, conv_weight=conv_weight, conv_state=conv_state, g=g, beta=beta, A_log=A_log,
                  dt_bias=None if dt_bias is None else dt_bias.reshape(-1), state=state, output_gate=output_gate,
                  norm_weight=norm_weight, state_indices=state_indices, cu_seqlens=cu_seqlens,
                  num_accepted_tokens=num_accepted_tokens)
    out, new_conv_state, new_state = _ffi(plan, arrays)
    return out, new_conv_state, new_state


def fused_kda_verify(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight, *,
                     state_indices, cu_seqlens, num_accepted_tokens=None, max_seqlen=None, lower_bound=None,
                     gate="softplus", norm_eps=1e-5, scale=None, null_slot0=False, donate=True, platform=None):
    """The fused verify (flashkda_ext.fused_kda_verify). Returns (out, new_conv_state, new_state),
    written in place of conv_state and state (eagerly both donated unless donate=False). Index arrays
    concrete on the CPU have their values checked as the torch op does.
    """
    names = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state", "output_gate",
             "norm_weight", "state_indices", "cu_seqlens", "num_accepted_tokens")
    vals = (x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight, state_indices,
            cu_seqlens, num_accepted_tokens)
    args, plat = _verify_arrays(names, vals, platform)
    key = _signature("fused_kda_verify", plat, args, (max_seqlen, lower_bound, gate, norm_eps, scale, null_slot0,
                                                      donate))
    prep = _prepared(key)
    if prep is None:
        x_, cw, cs, g_, b_, al, dt, st, og, nw, si, cu, na = args
        call = validation.check_fused_kda_verify(
            *(_meta(n, a) for n, a in zip(names[:10], args[:10])), state_indices=_meta("state_indices", si),
            cu_seqlens=_meta("cu_seqlens", cu), num_accepted_tokens=_meta("num_accepted_tokens", na),
            max_seqlen=max_seqlen, lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale,
            null_slot0=null_slot0, backend=plat)
        plan = _Plan(
            family="fused_kda_verify", platform=plat, module=_route("fused_kda_verify", call),
            operands=tuple(n for n, a in zip(names, args) if a is not None),
            results=(("out", (1, call.total_tokens, call.num_heads, call.head_dim), _dtype_str(x_), None),
                     ("conv_state", tuple(cs.shape), _dtype_str(cs), "conv_state"),
                     ("state", tuple(st.shape), _dtype_str(st), "state")),
            attrs=_attrs("fused_kda_verify", call),
            cuda_graph=_GRAPH_SAFE["fused_kda_verify"] and _command_buffers_allowed())
        _VERIFY_CALLS[key] = call
        prep = _remember(key, plan, _donate_positions(args, (2, 7), donate))
    _check_platform(plat, zip(names, args))
    _check_verify_values(key, prep, args, (11, 10, 12), max_seqlen)
    return _run(_fused_verify_impl, prep, args, eager=not _any_tracer(args), names=names)

