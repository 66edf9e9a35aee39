"""XLA FFI targets: the families' ABI tables, one target per (platform, module, family, argument
layout) registered once per process with the adapter that puts XLA's operands, results and
attributes back in the ABI order, and the ffi_call that runs a plan."""
from __future__ import annotations

import functools
import hashlib
import threading
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import jax_tvm_ffi
import numpy as np
import tvm_ffi

from .. import jit, switches

# The ABI order of each family's TVM-FFI function (docs/architecture.md): tensors, then attributes.
_ABI = {
    "kda_decode": ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "state_indices", "out"),
    "kda_prefill": ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state",
                    "final_state", "state_indices", "checkpoints", "out", "workspace"),
    "fused_kda_decode": ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias",
                         "state_indices", "state", "output_gate", "norm_weight", "out"),
    "kda_verify": ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "state_indices", "cu_seqlens",
                   "num_accepted_tokens", "initial_state", "initial_state_indices", "parent_tokens", "out"),
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
    return switches.env_switch("FLASHKDA_EXT_JAX_COMMAND_BUFFER", True, off="never captured")


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

