"""JAX front end: the same compiled TVM-FFI modules as the torch ops, called through XLA's FFI.

    import flashkda_ext.jax as kda_jax
    out, new_state = kda_jax.kda_decode(q, k, v, g, beta, state=pool, state_indices=idx, ...)

Each op takes and returns jax arrays and works eagerly and under jax.jit. Per call:

1. Arguments are checked in Python by flashkda_ext.validation (shape-only torch "meta" tensors stand
   in for the jax arrays), so a bad call raises the same ValueError/TypeError naming the argument as
   the torch op, before anything reaches XLA.
2. The route is picked from host-known metadata (flashkda_ext.dispatch), and the module's function
   is registered once per process as an XLA FFI target through jax-tvm-ffi: CPU arrays get the CPU
   backend module, CUDA arrays the CUDA module. XLA hands the target its stream.
3. jax.ffi.ffi_call runs it. Pools updated in place (decode state, conv cache, prefill state pool,
   checkpoints) are declared as input/output aliases, so XLA writes them in place when the input
   buffer is donated. Eager calls donate them by default (donate=True: the input arrays are consumed,
   as an in-place update would); under your own jax.jit, donate the pools with donate_argnums.

The module functions take outputs as arguments in a fixed order, with optional tensors passed as
None (docs/architecture.md), while an XLA FFI target receives all operands, then all results, then
attributes. An adapter (one per module and argument layout) puts them back in the ABI order: the
C++ wrapper of the helper module "ffi_reorder" (csrc/jax/ffi_reorder.cc), so after the first trace
a jitted step runs no Python of ours; a Python adapter only when that module cannot be loaded.

Steps 1 and 2 run once per call signature (shapes, dtypes, platform, options): a repeated eager
call reuses the validated plan and its jitted function (the verdict of a passed validation is
remembered; a call that fails it is checked, and raises, every time).

Needs jax and jax-tvm-ffi: pip install "flashkda_ext[jax]".
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

try:
    import jax
    import jax.numpy as jnp
    import jax_tvm_ffi
except ImportError as _err:  # tests/test_jax.py hides jax_tvm_ffi to check this message
    raise ImportError(
        "flashkda_ext.jax needs jax and jax-tvm-ffi; install them with "
        "`pip install \"flashkda_ext[jax]\"` (jax>=0.7.2, jax-tvm-ffi>=0.1.3). "
        f"Import failed with: {_err}") from _err

import numpy as np
import torch
import tvm_ffi

from . import dispatch, jit, validation

__all__ = ["kda_decode", "kda_prefill", "fused_kda_decode", "kda_verify", "fused_kda_verify", "registered_targets"]

# The ABI order of each family's TVM-FFI function (docs/architecture.md): tensors, then attributes.
_ABI = {
    "kda_decode": ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "state_indices", "out"),
    "kda_prefill": ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state",
                    "final_state", "state_indices", "checkpoints", "out", "workspace"),
    "fused_kda_decode": ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias",
                         "state_indices", "state", "output_gate", "norm_weight", "out"),
    "kda_verify": ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "state_indices", "cu_seqlens",
                   "num_accepted_tokens", "out"),
    "fused_kda_verify": ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state", "output_gate",
                         "norm_weight", "state_indices", "cu_seqlens", "num_accepted_tokens", "out"),
}
_ATTRS = {
    "kda_decode": ("gate_mode", "lower_bound", "scale", "beta_is_logit", "null_slot0"),
    "kda_prefill": ("gate_mode", "lower_bound", "scale", "beta_is_logit", "null_slot0",
                    "checkpoint_every"),
    "fused_kda_decode": ("gate_mode", "lower_bound", "scale", "norm_eps", "null_slot0"),
    "kda_verify": ("gate_mode", "lower_bound", "scale", "beta_is_logit", "null_slot0"),
    "fused_kda_verify": ("gate_mode", "lower_bound", "scale", "norm_eps", "null_slot0"),
}
# Families whose kernels may be captured into a CUDA graph (XLA command buffer) as they are:
# decode launches only, no host sync, no allocation. Prefill is capturable only when the module
# takes its scratch as a workspace argument, which this wrapper then allocates as an XLA result.
_GRAPH_SAFE = {"kda_decode": True, "fused_kda_decode": True, "kda_prefill": False, "kda_verify": True,
               "fused_kda_verify": True}


def _command_buffers_allowed() -> bool:
    """FLASHKDA_EXT_JAX_COMMAND_BUFFER=0 registers every target as not capturable, so XLA runs the
    call as a plain thunk even where it is safe to capture (a tuning and diagnosis switch: recent XLA
    wraps every capturable custom call in a command buffer, even alone). Read when a call is planned."""
    value = os.environ.get("FLASHKDA_EXT_JAX_COMMAND_BUFFER", "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"FLASHKDA_EXT_JAX_COMMAND_BUFFER: expected 0 or 1, got {value!r}")


# ---------------------------------------------------------------------------------------------
# arrays -> shape-only torch tensors for the shared validation


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _as_array(name: str, x, *, optional: bool = False):
    """None (when optional), a jax.Array or tracer as is, a numpy array as a jax array."""
    if x is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a jax.Array, got None")
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    raise TypeError(f"{name}: expected a jax.Array (or numpy array), got {type(x).__name__}")


_TORCH_DTYPES = {np.dtype(name): getattr(torch, name) for name in
                 ("float32", "bfloat16", "float16", "float64", "int32", "int64", "uint8")
                 if name != "bfloat16"}
_TORCH_DTYPES[np.dtype(jnp.bfloat16)] = torch.bfloat16


def _torch_dtype(name: str, dtype) -> torch.dtype:
    tdtype = _TORCH_DTYPES.get(dtype)
    if tdtype is None:
        dname = jnp.dtype(dtype).name
        tdtype = getattr(torch, dname, None)
        if not isinstance(tdtype, torch.dtype):
            raise ValueError(f"{name}: dtype {dname} has no counterpart among the supported dtypes")
    return tdtype


def _meta(name: str, x):
    """A torch meta tensor with x's shape and dtype (no memory), or None."""
    if x is None:
        return None
    return torch.empty(tuple(x.shape), dtype=_torch_dtype(name, x.dtype), device="meta")


_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def _platform(platform: Optional[str], named_arrays) -> str:
    """'cpu' or 'cuda': given, else the device of the first concrete array, else JAX's default
    device (jax.default_device / jax_default_device), else its default backend (inside jax.jit
    the arrays are tracers and carry no device)."""
    if platform is not None:
        if platform not in ("cpu", "cuda", "gpu"):
            raise ValueError(f"platform: expected 'cpu', 'cuda' or None, got {platform!r}")
        return _PLATFORMS[platform]
    for name, x in named_arrays:
        if x is not None and not _is_tracer(x):
            plat = next(iter(x.devices())).platform
            if plat not in _PLATFORMS:
                raise ValueError(f"{name}: expected an array on a CPU or CUDA device, got platform {plat}")
            return _PLATFORMS[plat]
    default = jax.config.jax_default_device       # jax.default_device(...) or the config option
    if default is not None:
        plat = default if isinstance(default, str) else default.platform
    else:
        plat = jax.default_backend()
    if plat not in _PLATFORMS:
        raise ValueError(f"platform: JAX's default backend {plat!r} is neither CPU nor CUDA; pass platform=")
    return _PLATFORMS[plat]


def _host_offsets(cu_seqlens):
    """The offsets as a list when cu_seqlens is a concrete 1-D integer array on the CPU (values the
    torch op inspects too), else None: device offsets are never copied to the host."""
    if cu_seqlens is None or _is_tracer(cu_seqlens) or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        return None
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        return None
    if next(iter(cu_seqlens.devices())).platform != "cpu":
        return None
    return [int(c) for c in np.asarray(cu_seqlens)]


def _offsets_valid(cs, T) -> bool:
    return cs[0] == 0 and cs[-1] == T and all(b >= a for a, b in zip(cs, cs[1:]))


def _check_host_offsets(cs, T: int, max_seqlen) -> None:
    """The value checks the torch op makes on host offsets (same messages)."""
    if not _offsets_valid(cs, T):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {T}, got {cs}")
    longest = max(b - a for a, b in zip(cs, cs[1:]))
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen: expected >= the longest sequence in cu_seqlens ({longest}), "
                         f"got {max_seqlen}")


# ---------------------------------------------------------------------------------------------
# FFI targets: one per (platform, module, family, argument layout), registered once per process


@dataclass(frozen=True)
class _Plan:
    """Everything static about one call: hashable, so it is a jit static argument."""
    family: str
    platform: str                 # "cpu" or "cuda"
    module: str                   # module name chosen by the route
    operands: tuple               # names of the operands given to ffi_call, in order
    results: tuple                # (name, shape, dtype name, aliased operand name or None)
    attrs: tuple                  # ((name, value), ...) in the family's attribute order
    cuda_graph: bool              # allow XLA to capture the call into a command buffer
    casts: tuple = ()             # ((operand name, dtype name), ...) converted before the call (kda_decode's and
                                  # kda_verify's g / beta when one is fp32 and the other not: _GbDtypes.gb_casts)


_TARGETS: dict = {}
_LOCK = threading.Lock()


def _abi_order(plan: _Plan) -> tuple:
    """For each ABI tensor slot: the index of the buffer among operands + results, or None.
    An aliased operand is the same buffer as its result: both names point at the result."""
    n_in = len(plan.operands)
    where = {name: i for i, name in enumerate(plan.operands)}
    for j, (name, _shape, _dtype, alias) in enumerate(plan.results):
        where[name] = n_in + j
        if alias is not None:
            where[alias] = n_in + j
    return tuple(where.get(name) for name in _ABI[plan.family])


# The C++ reorder of the helper module "ffi_reorder" (csrc/jax/ffi_reorder.cc), loaded once:
# {"fn": its TVM-FFI function, or None when the module could not be loaded}. Holding the function
# keeps the helper's library loaded for as long as the wrappers it made (its code) may run.
_REORDER: dict = {}


def _cpp_reorder():
    """ffi_reorder(fn, order, n_buffers) -> Function from the helper module, or None (warned once)."""
    if "fn" not in _REORDER:
        try:
            _REORDER["fn"] = jit.load_module("ffi_reorder")["ffi_reorder"]
        except Exception as err:  # noqa: BLE001  no host compiler, no AOT artifact, JIT disabled...
            _REORDER["fn"] = None
            warnings.warn(
                "flashkda_ext.jax: the C++ argument reorder (module 'ffi_reorder') is unavailable, "
                "so every XLA FFI call goes through a Python adapter (slower, takes the GIL): "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Build it with "
                "`python -m flashkda_ext build ffi_reorder` or ship it in your AOT directory.",
                RuntimeWarning, stacklevel=4)
    return _REORDER["fn"]


def _python_adapter(fn, order: tuple, n_buffers: int):
    """The fallback of _make_adapter, used only when the C++ helper module cannot be loaded (no host
    compiler and no AOT artifact for it): the same reordering, in Python, on every call."""
    def adapter(*xs):
        fn(*[None if i is None else xs[i] for i in order], *xs[n_buffers:])
    return tvm_ffi.convert(adapter)


def _make_adapter(fn, order: tuple, n_buffers: int):
    """(adapter, kind): a TVM-FFI function taking (operands..., results..., attributes...) as
    jax-tvm-ffi passes them and calling fn in the ABI's order (None where an optional tensor is
    absent; an aliased operand and its result are one buffer). kind "c++": the ffi_reorder helper
    module's wrapper, so no Python runs per call; "python": the fallback adapter."""
    make = _cpp_reorder()
    if make is not None:
        return make(fn, [-1 if i is None else i for i in order], n_buffers), "c++"
    return _python_adapter(fn, order, n_buffers), "python"


@functools.lru_cache(maxsize=1024)
def _module_for(family: str, meta_items: tuple) -> str:
    """The route's module for host-known metadata (selection is pure: cached per process)."""
    return dispatch.module_name(family, dict(meta_items))


def _route(family: str, call) -> str:
    return _module_for(family, tuple(sorted(call.route_meta().items())))


@functools.lru_cache(maxsize=None)
def _prefill_module_info(module_name: str):
    """(chunk size, the loaded module) of a prefill module."""
    params = jit.get_record(module_name).get("params", {})
    chunk = int(params.get("CHUNK", params.get("chunk", 1)))
    return chunk, jit.load_module(module_name)


@functools.lru_cache(maxsize=1024)
def _target(plan: _Plan) -> str:
    """The registered FFI target serving plan (registered on first use)."""
    order = _abi_order(plan)
    n_buffers = len(plan.operands) + len(plan.results)
    attr_names = tuple(a for a, _ in plan.attrs)
    key = (plan.platform, plan.module, plan.family, order, n_buffers, attr_names, plan.cuda_graph)
    with _LOCK:
        name = _TARGETS.get(key)
        if name is not None:
            return name
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
        name = f"flashkda_ext.{plan.module}.{plan.family}.{digest}"
        fn = jit.load_module(plan.module)[plan.family]
        adapter, kind = _make_adapter(fn, order, n_buffers)
        jax_tvm_ffi.register_ffi_target(
            name, adapter, ["args", "rets"] + [f"attrs.{a}" for a in attr_names],
            platform="gpu" if plan.platform == "cuda" else "cpu", allow_cuda_graph=plan.cuda_graph)
        _TARGETS[key] = name
        _ADAPTERS[name] = (kind, adapter)
        return name


_ADAPTERS: dict = {}   # target name -> (adapter kind "c++" or "python", the registered function)


def registered_targets() -> list:
    """Names of the XLA FFI targets this process has registered (one per module and layout)."""
    with _LOCK:
        return sorted(_TARGETS.values())


def _attrs(family: str, call) -> tuple:
    """The scalar arguments of the family's ABI, in order, from the validated call."""
    return tuple((name, getattr(call, name)) for name in _ATTRS[family])


def _attr(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return np.int64(value)
    return np.float64(value)


def _ffi(plan: _Plan, arrays: dict) -> tuple:
    """The ffi_call itself (traced): returns the results in plan.results order."""
    name = _target(plan)
    shapes = tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for _n, shape, dtype, _a in plan.results)
    aliases = {plan.operands.index(alias): j for j, (_n, _s, _d, alias) in enumerate(plan.results)
               if alias is not None}
    call = jax.ffi.ffi_call(name, shapes, input_output_aliases=aliases)
    if plan.casts:
        arrays = dict(arrays)
        for n, dtype in plan.casts:
            arrays[n] = arrays[n].astype(jnp.dtype(dtype))
    return tuple(call(*[arrays[n] for n in plan.operands], **{a: _attr(v) for a, v in plan.attrs}))


# ---------------------------------------------------------------------------------------------
# per-signature memo: a serving loop calls an op with the same shapes and options every step


class _Prepared:
    """What one call signature resolved to: the plan, the donated argument positions, and (eager
    calls) the jitted function for the plan, made on first use."""
    __slots__ = ("plan", "donated", "eager_fn")

    def __init__(self, plan: _Plan, donated: tuple):
        self.plan, self.donated, self.eager_fn = plan, donated, None


_PREPARED: dict = {}
_PREPARED_LIMIT = 512
_KEY_SCALARS = (type(None), bool, int, float, str)


def _signature(family: str, plat: str, args: tuple, options: tuple, extra=None):
    """A hashable key of everything the validation and the route read from a call (each array's
    shape and dtype or None, the platform, the options with their types: True is not 1, and extra
    host values such as cu_seqlens offsets), or None when an option is not a plain scalar (that
    call takes the full path every time). Only calls that passed validation are remembered, so a
    bad call is always checked, and raises, before anything reaches XLA."""
    key = [family, plat, extra, _command_buffers_allowed()]
    for x in args:
        key.append(None if x is None else (x.shape, x.dtype))
    for v in options:
        t = type(v)
        if t not in _KEY_SCALARS:
            return None
        key.append((t, v))
    return tuple(key)


def _remember(key, plan: _Plan, donated: tuple) -> _Prepared:
    prep = _Prepared(plan, donated)
    if key is not None:
        if len(_PREPARED) >= _PREPARED_LIMIT:
            _PREPARED.clear()
        _PREPARED[key] = prep
    return prep


def _run(impl, prep: _Prepared, args: tuple, eager: bool):
    """Inside a trace, call impl directly (donation is the enclosing jit's business); eagerly,
    through a jit of impl for this plan that donates the in-place pools (positions in args) when
    asked. The plan is bound, not a static argument, so a repeated eager call hashes nothing of ours."""
    if not eager:
        return impl(prep.plan, *args)
    fn = prep.eager_fn
    if fn is None:
        fn = prep.eager_fn = _eager_jit(impl, prep.plan, prep.donated)
    return fn(*args)


@functools.lru_cache(maxsize=None)
def _eager_jit(impl, plan: _Plan, donate: tuple):
    return jax.jit(functools.partial(impl, plan), donate_argnums=donate)


def _donate_positions(args: tuple, positions, donate: bool) -> tuple:
    if not isinstance(donate, bool):
        raise TypeError(f"donate: expected a bool, got {type(donate).__name__}")
    if not donate:
        return ()
    return tuple(i for i in positions if args[i] is not None)


def _any_tracer(arrays) -> bool:
    tracer = jax.core.Tracer
    return any(isinstance(x, tracer) for x in arrays)


def _dtype_str(x) -> str:
    return x.dtype.name


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
    prep = None if key is None else _PREPARED.get(key)
    if prep is None:
        prep = _prepare_decode(names, args, plat, key, lower_bound=lower_bound, gate=gate, scale=scale,
                               beta_is_logit=beta_is_logit, slot_mode=slot_mode, null_slot0=null_slot0,
                               donate=donate)
    return _run(_decode_impl, prep, args, eager=not _any_tracer(args))


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
# kda_prefill


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
    prep = None if key is None else _PREPARED.get(key)
    if prep is None:
        prep = _prepare_prefill(names, args, plat, key, cs, lower_bound=lower_bound, gate=gate,
                                scale=scale, beta_is_logit=beta_is_logit,
                                output_final_state=output_final_state,
                                checkpoint_every=checkpoint_every, max_seqlen=max_seqlen,
                                null_slot0=null_slot0, donate=donate)
    return _run(_prefill_impl, prep, args, eager=not _any_tracer(args))


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
    prep = None if key is None else _PREPARED.get(key)
    if prep is None:
        prep = _prepare_fused(names, args, plat, key, lower_bound=lower_bound, gate=gate,
                              norm_eps=norm_eps, scale=scale, slot_mode=slot_mode,
                              null_slot0=null_slot0, donate=donate)
    return _run(_fused_impl, prep, args, eager=not _any_tracer(args))


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


# ---------------------------------------------------------------------------------------------
# kda_verify


def _verify_impl(plan, q, k, v, g, beta, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state):
    dt = None if dt_bias is None else dt_bias.reshape(-1)
    if plan.family == "kda_decode":  # T_max = 1: kda_decode on column 0 (as the torch op)
        arrays = dict(q=q[0], k=k[0], v=v[0], g=g[0], beta=beta[0], A_log=A_log, dt_bias=dt,
                      state_indices=state_indices[:, 0], state=state)
        out, new_state = _ffi(plan, arrays)
        return out[None], new_state
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt, state_indices=state_indices,
                  cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens, state=state)
    out, new_state = _ffi(plan, arrays)
    return out, new_state


def _host_int32(x):
    """A torch CPU tensor of a concrete CPU array (values the torch op inspects too), else None."""
    if x is None or _is_tracer(x) or next(iter(x.devices())).platform != "cpu":
        return None
    return torch.from_numpy(np.array(x))


def kda_verify(q, k, v, g, beta, *, state, state_indices, cu_seqlens, num_accepted_tokens=None, max_seqlen=None,
               A_log=None, dt_bias=None, lower_bound=None, gate="softplus", scale=None, beta_is_logit=True,
               null_slot0=False, donate=True, platform=None):
    """Speculative-decoding verify on a state pool. Returns (out, new_state).

    Shapes, dtypes and options as flashkda_ext.kda_verify: q, k [1, T, H, K]; v [1, T, HV, V];
    g [1, T, HV, K]; beta [1, T, HV]; state [slots, HV, V, K]; state_indices int32 [N, T_max];
    cu_seqlens int32 [N+1]; num_accepted_tokens int32 [N] or None. new_state is the pool after the
    step, written in place of `state` (eagerly donated unless donate=False; under jax.jit, donate it
    on your jit). Index arrays that are concrete on the CPU have their values checked as the torch op
    does; T_max = 1 runs kda_decode's module on column 0.
    """
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_indices", "cu_seqlens", "num_accepted_tokens",
             "state")
    vals = (q, k, v, g, beta, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state)
    args, plat = _verify_arrays(names, vals, platform)
    key = _signature("kda_verify", plat, args, (max_seqlen, lower_bound, gate, scale, beta_is_logit, null_slot0,
                                                donate))
    prep = None if key is None else _PREPARED.get(key)
    if prep is None:
        prep = _prepare_verify(names, args, plat, key, max_seqlen=max_seqlen, lower_bound=lower_bound, gate=gate,
                               scale=scale, beta_is_logit=beta_is_logit, null_slot0=null_slot0, donate=donate)
    _check_verify_values(prep, args, (8, 7, 9), max_seqlen)
    return _run(_verify_impl, prep, args, eager=not _any_tracer(args))


def _verify_arrays(names, vals, platform):
    """A verify op's inputs as arrays (A_log, dt_bias, num_accepted_tokens may be None) and the
    platform they run on."""
    optional = {"A_log", "dt_bias", "num_accepted_tokens"}
    args = tuple(_as_array(n, a, optional=n in optional) for n, a in zip(names, vals))
    return args, _platform(platform, zip(names, args))


def _check_verify_values(prep, args, positions, max_seqlen) -> None:
    """On the CPU, the values of the index arrays that are concrete there (not part of the
    signature: checked on every call); positions: where cu_seqlens, state_indices and
    num_accepted_tokens stand in args."""
    if prep.plan.platform != "cpu":
        return
    cu, si, na = positions
    host = [_host_int32(args[i]) for i in (cu, si, na)]
    if host[0] is not None and host[1] is not None and (args[na] is None or host[2] is not None):
        validation.check_verify_values(_VERIFY_CALLS[prep.plan], *host, max_seqlen)


def _prepare_verify(names, args, plat, key, *, max_seqlen, lower_bound, gate, scale, beta_is_logit, null_slot0,
                    donate) -> _Prepared:
    q, k, v, g, beta, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state = args
    call = validation.check_kda_verify(
        _meta("q", q), _meta("k", k), _meta("v", v), _meta("g", g), _meta("beta", beta), state=_meta("state", state),
        state_indices=_meta("state_indices", state_indices), cu_seqlens=_meta("cu_seqlens", cu_seqlens),
        num_accepted_tokens=_meta("num_accepted_tokens", num_accepted_tokens), max_seqlen=max_seqlen,
        A_log=_meta("A_log", A_log), dt_bias=_meta("dt_bias", dt_bias), lower_bound=lower_bound, gate=gate,
        scale=scale, beta_is_logit=beta_is_logit, null_slot0=null_slot0, backend=plat)
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
    _VERIFY_CALLS[plan] = call  # the host value checks need it on every call (no slot for it on _Prepared)
    return _remember(key, plan, _donate_positions(args, (10,), donate))


_VERIFY_CALLS: dict = {}  # plan -> its validated VerifyCall


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
    prep = None if key is None else _PREPARED.get(key)
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
        _VERIFY_CALLS[plan] = call
        prep = _remember(key, plan, _donate_positions(args, (2, 7), donate))
    _check_verify_values(prep, args, (11, 10, 12), max_seqlen)
    return _run(_fused_verify_impl, prep, args, eager=not _any_tracer(args))

