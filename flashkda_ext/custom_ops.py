"""The public ops as torch.library custom ops, so torch.compile (fullgraph) and torch.export can trace them.

Eager callers never come here: flashkda_ext.kda_decode & co. stay the fast entry. Under tracing
(Dynamo, export, FakeTensor) the public functions call `traced_*` below instead, which put one
`flashkda_ext::<op>` node in the graph.

Schema design. The ops are destination-passing, as the TVM-FFI functions are: each custom op takes every
output as an argument it writes (`mutates_args`: the state pool, conv cache, final state, checkpoints,
workspace, out) and returns nothing. An output the caller left out is allocated by `traced_*` just before
the op (a fresh graph tensor, so functionalization re-inplaces it), and the public function returns the
caller's own tensors (the pool in prefill's pool mode) exactly as in eager mode: no custom op ever
returns an alias of an input, and optional outputs are just `Tensor?` arguments.

Registration. The ops are defined with torch.library.Library (define + a CompositeExplicitAutograd kernel +
register_fake) rather than the torch.library.custom_op decorator: the decorator's eager dispatch adds
Python work per call that grows with the argument count (~100 us for kda_decode's 16 arguments on this
CPU, in torch 2.13's ADInplaceOrView wrapper), the plain definition only the dispatcher's own round trip
(3.1-4.3 us for 16-23 arguments on that CPU, what a no-op kernel costs too: scripts/custom_op_floor.py;
backend keys instead of CompositeExplicitAutograd, or an Autograd fallthrough, measured no faster:
the git history of docs/perf-notes.md). What the decorator's extra kernels do (autograd checks, version-counter bumps of the
written tensors) an inference op does not need.

Direct calls. torch.ops.flashkda_ext.<op> is public too, so the op layer refuses what the dispatcher
would otherwise let through: the flags, the integer arguments (checkpoint_every, max_seqlen) and the real
ones (scale, lower_bound, norm_eps) are typed `Scalar` in the schema (a `bool` argument converts 1 to True,
an `int` one True to 1, a `float` one True to 1.0, before any check; a Scalar keeps the caller's Python type,
so validation refuses the int flag or the bool count or scale as the public op does); a meta tensor among
real ones (the dispatcher then runs the fake, which writes nothing) is refused naming it; `out=None` (the
dispatcher passes None for a Tensor) and prefill's outputs the op would compute and drop (checkpoints, a
dense final state) must be given.

Validation. The real implementation calls the public op on real tensors, so the full validation (which
reads jit/supported.json and memoizes) and the fast path run there, outside any traced region. The fake
implementation runs the same checks on meta-tensor stand-ins (shape, dtype, layout; no data pointers, no
values), then the device rule on the tensors themselves (the stand-ins all sit on meta), so a bad call fails at
trace time with the eager error message.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional, Union

import torch
from torch._subclasses.fake_tensor import is_fake as _is_fake

from . import validation
# ops imports this module first, so here ops is still half-built: its functions are looked up at call time
# (a module global, not an import statement per call: `from .ops import f` costs ~0.5 us a call)
from . import ops as _ops

Tensor = torch.Tensor
#: a flag's annotation: schema type Scalar (see "Direct calls" above); validation requires a real bool
Flag = Union[int, float, bool]
#: an integer argument's annotation, Scalar for the same reason: an `int` schema argument would turn True into
#: 1 before any check; validation requires a real int
Count = Union[int, float, bool]
#: a real scalar's annotation (scale, lower_bound, norm_eps), Scalar too: a `float` schema argument turns True
#: into 1.0 before any check (scale=True was served as 1.0); validation refuses a bool as the public op does
Real = Union[int, float, bool]
_is_compiling = torch.compiler.is_compiling
_functional = torch._is_functional_tensor
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_LIB = torch.library.Library("flashkda_ext", "DEF")  # kept alive: dropping it unregisters the ops


def _register(name: str, mutates_args: tuple):
    """Define flashkda_ext::<name> from the Python signature of the decorated real implementation,
    with that function as its kernel for every backend; returns the OpOverload."""
    def decorate(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return getattr(torch.ops.flashkda_ext, name).default
    return decorate


def _fake(name: str, same_view_ok: tuple = ()):
    """Register fn as flashkda_ext::<name>'s fake, with the checks the stand-ins cannot make: a meta tensor among
    real ones, and (tracing) a written tensor overlapping another argument; same_view_ok as the eager op's."""
    def decorate(fn):
        names = list(inspect.signature(fn).parameters)
        written = {a.name for a in getattr(torch.ops.flashkda_ext, name).default._schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write}

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            named = list(zip(names, args)) + list(kwargs.items())
            _refuse_meta_among_real(named)
            result = fn(*args, **kwargs)
            _tensor_flags(named, written)
            _one_device(named)
            _apart_when_traced(named, written, same_view_ok, _APART_ORDER[name])
            return result
        torch.library.register_fake(f"flashkda_ext::{name}", checked, lib=_LIB)
        return fn
    return decorate


def _tensor_flags(named, written: set) -> None:
    """The eager check of what the meta stand-ins drop (torch.empty_strided keeps shape, strides and dtype only):
    the inference-only rule (requires_grad with grad enabled; an inference tensor written outside inference mode).
    Without it a fake call returned outputs for a call eager refuses. (A lazy negated or conjugated view is
    resolved by the dispatcher before any kernel of a custom op, the fake's included.)"""
    tensors = [(n, t) for n, t in named if isinstance(t, Tensor)]
    validation._inference_only(tuple((n, t) for n, t in tensors if n not in written),
                               tuple((n, t) for n, t in tensors if n in written))


def _one_device(named) -> None:
    """The eager device rule, which the meta stand-ins drop (they all sit on the meta device): every tensor on the
    device of the first (q, or the fused ops' x). Without it a FakeTensor call with parent_tokens or state_indices
    on another device (a fake CUDA or meta tensor beside CPU ones) returned outputs where eager refuses it, and
    torch.compile traced it. Run after the stand-ins' checks, so any other problem is still named first."""
    tensors = [(n, t) for n, t in named if isinstance(t, Tensor)]
    for name, t in tensors:
        validation._same_device(name, t, tensors[0][1].device)


#: each op's tensors in the order its eager check_apart lists them (ops.py: the written ones, out first, then the
#: read ones), so the pair found first, and the argument named, is eager's: in the schema's order an out inside the
#: pool was named "state: overlaps the memory of out" where eager says "out: overlaps the memory of state"
_APART_ORDER = {
    "kda_decode": ("out", "state", "q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_indices"),
    "fused_kda_decode": ("out", "conv_state", "state", "x", "conv_weight", "g", "beta", "A_log", "dt_bias",
                         "state_indices", "output_gate", "norm_weight"),
    "kda_prefill": ("out", "state", "final_state", "checkpoints", "workspace", "q", "k", "v", "g", "beta", "A_log",
                    "dt_bias", "cu_seqlens", "initial_state", "state_indices"),
    "kda_verify": ("out", "state", "q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_indices", "cu_seqlens",
                   "num_accepted_tokens", "initial_state", "initial_state_indices", "parent_tokens"),
    "fused_kda_verify": ("out", "conv_state", "state", "x", "conv_weight", "g", "beta", "A_log", "dt_bias",
                         "output_gate", "norm_weight", "state_indices", "cu_seqlens", "num_accepted_tokens"),
}


def _apart_when_traced(named, written: set, same_view_ok: tuple, order: tuple) -> None:
    """The eager op's overlap check on the fake tensors Dynamo traces with: views of one storage keep it there (a
    q that is a view of the state pool), where the stand-ins the other checks run on do not. Functionalization
    later hands the op copies, so a compiled call would otherwise serve what eager refuses. The tensors go in the
    eager op's order (order: _APART_ORDER's)."""
    tensors = sorted(((n, t) for n, t in named if isinstance(t, Tensor)), key=lambda p: order.index(p[0]))
    if not any(_is_fake(t) for _, t in tensors):
        return
    validation.check_apart(tuple((n, t) for n, t in tensors if n in written),
                           tuple((n, t) for n, t in tensors if n not in written), same_view_ok=same_view_ok)


def _refuse_meta_among_real(named) -> None:
    """The dispatcher sends a call with one meta tensor among real ones to the fake implementation, which
    computes and writes nothing: refused, naming the meta argument. (Fake tensors are tracing; all-meta
    calls meet validation's device check.)"""
    tensors = [(n, t) for n, t in named if isinstance(t, Tensor)]
    if any(_is_fake(t) for _, t in tensors):
        return
    meta = [n for n, t in tensors if t.is_meta]
    real = [t.device for _, t in tensors if not t.is_meta]
    if meta and real:
        raise ValueError(f"{meta[0]}: a meta tensor among tensors on {real[0]} (it has no data: the op could "
                         f"neither compute from it nor write it); pass every tensor on one device")


def _refuse_no_out(op: str, out) -> None:
    """The custom ops return nothing: the dispatcher lets None through for the Tensor `out`, and the op would
    then update the pool and drop the output it computed."""
    if out is None:
        raise ValueError(f"out: flashkda_ext::{op} writes its outputs into its arguments; expected a tensor, "
                         f"got None")


def _refuse_dropped_outputs(output_final_state, final_state, state, state_indices, checkpoint_every,
                            checkpoints) -> None:
    """kda_prefill's op returns nothing: an output it is asked to compute needs a tensor to be written to."""
    if isinstance(checkpoint_every, int) and not isinstance(checkpoint_every, bool) and checkpoint_every > 0 \
            and checkpoints is None:
        raise ValueError(f"checkpoints: flashkda_ext::kda_prefill writes its outputs into its arguments; "
                         f"checkpoint_every = {checkpoint_every} needs a checkpoints tensor, got None")
    if output_final_state is True and final_state is None and state is None and state_indices is None:
        raise ValueError("final_state: flashkda_ext::kda_prefill writes its outputs into its arguments; "
                         "output_final_state=True (no pool) needs a final_state tensor, got None")


def tracing(x) -> bool:
    """True when a public op must go through its custom op: Dynamo or export is tracing, or x is a
    FakeTensor (FakeTensorMode, non-strict export, a meta-analysis pass)."""
    if _is_compiling():
        return True
    # A plain torch.Tensor that wraps nothing is never fake: torch's is_fake answers False for it after ~1 us of
    # subclass tests; the adapters ask this of several views every decode step. Any other tensor asks is_fake.
    if type(x) is Tensor and not _functional(x) and not _functorch_wrapped(x):
        return False
    return _is_fake(x)


# ---------------------------------------------------------------------------------------------
# fake-mode validation: the eager checks on meta stand-ins


def _meta(x):
    if not isinstance(x, Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def _check_on_meta(check, device: Optional[torch.device], args: tuple, kwargs: dict):
    # __wrapped__: the check itself, not its memo (symbolic sizes do not hash, and fake calls are rare)
    raw = getattr(check, "__wrapped__", check)
    if device is None:  # the first tensor's (the fakes: q or x may be None, the check then names it)
        device = next((t.device for t in (*args, *kwargs.values()) if isinstance(t, Tensor)), torch.device("cpu"))
    backend = validation.backend_of(device)
    return raw(*(_meta(a) for a in args), backend=backend, **{k: _meta(v) for k, v in kwargs.items()})


# ---------------------------------------------------------------------------------------------
# kda_decode


@_register("kda_decode", mutates_args=("state", "out"))
def kda_decode_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, state_indices: Tensor,
                  A_log: Optional[Tensor], dt_bias: Optional[Tensor], lower_bound: Optional[Real], gate: str,
                  scale: Optional[Real], beta_is_logit: Flag, slot_mode: str, null_slot0: Flag,
                  out: Tensor) -> None:
    _refuse_no_out("kda_decode", out)
    _ops.kda_decode(q, k, v, g, beta, state=state, state_indices=state_indices, A_log=A_log, dt_bias=dt_bias,
                    lower_bound=lower_bound, gate=gate, scale=scale, beta_is_logit=beta_is_logit, slot_mode=slot_mode,
                    null_slot0=null_slot0, out=out)


@_fake("kda_decode")
def _kda_decode_fake(q, k, v, g, beta, state, state_indices, A_log, dt_bias, lower_bound, gate, scale,
                     beta_is_logit, slot_mode, null_slot0, out) -> None:
    _refuse_no_out("kda_decode", out)
    _check_on_meta(validation.check_kda_decode, None, (q, k, v, g, beta), dict(
        state=state, state_indices=state_indices, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        gate=gate, scale=scale, beta_is_logit=beta_is_logit, slot_mode=slot_mode, null_slot0=null_slot0, out=out))


def traced_kda_decode(q, k, v, g, beta, *, state, state_indices, A_log=None, dt_bias=None, lower_bound=None,
                      gate="softplus", scale=None, beta_is_logit=True, slot_mode="unique", null_slot0=False,
                      out=None):
    """kda_decode under tracing: same arguments and result as the public op."""
    if out is None:
        _read_ok("v", v)
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _op_call(kda_decode_op, q, k, v, g, beta, state, state_indices, A_log, dt_bias,
             _opt_float("lower_bound", lower_bound), gate, _opt_float("scale", scale), beta_is_logit, slot_mode,
             null_slot0, out)
    return out


# ---------------------------------------------------------------------------------------------
# fused_kda_decode


@_register("fused_kda_decode", mutates_args=("conv_state", "state", "out"))
def fused_kda_decode_op(x: Tensor, conv_weight: Tensor, conv_state: Tensor, g: Tensor, beta: Tensor,
                        A_log: Optional[Tensor], dt_bias: Optional[Tensor], state_indices: Tensor, state: Tensor,
                        output_gate: Tensor, norm_weight: Tensor, lower_bound: Optional[Real], gate: str,
                        norm_eps: Real, scale: Optional[Real], slot_mode: str, null_slot0: Flag,
                        out: Tensor) -> None:
    _refuse_no_out("fused_kda_decode", out)
    _ops.fused_kda_decode(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
                          norm_weight, lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale,
                          slot_mode=slot_mode, null_slot0=null_slot0, out=out)


@_fake("fused_kda_decode")
def _fused_kda_decode_fake(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
                           norm_weight, lower_bound, gate, norm_eps, scale, slot_mode, null_slot0, out) -> None:
    _refuse_no_out("fused_kda_decode", out)
    _check_on_meta(validation.check_fused_kda_decode, None,
                   (x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
                    norm_weight),
                   dict(lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale, slot_mode=slot_mode,
                        null_slot0=null_slot0, out=out))


def traced_fused_kda_decode(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state, output_gate,
                            norm_weight, *, lower_bound=None, gate="softplus", norm_eps=1e-5, scale=None,
                            slot_mode="unique", null_slot0=False, out=None):
    """fused_kda_decode under tracing: same arguments and result as the public op."""
    if out is None:
        _read_ok("x", x)
        _read_ok("output_gate", output_gate)
        out = torch.empty(output_gate.shape, dtype=x.dtype, device=x.device)
    norm_eps = validation._real("norm_eps", norm_eps)  # TypeError, as the eager check
    _op_call(fused_kda_decode_op, x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state,
             output_gate, norm_weight, _opt_float("lower_bound", lower_bound), gate, norm_eps,
             _opt_float("scale", scale), slot_mode, null_slot0, out)
    return out


# ---------------------------------------------------------------------------------------------
# kda_prefill


@_register("kda_prefill", mutates_args=("state", "final_state", "checkpoints", "workspace", "out"))
def kda_prefill_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                   dt_bias: Optional[Tensor], lower_bound: Optional[Real], gate: str, scale: Optional[Real],
                   beta_is_logit: Flag, cu_seqlens: Optional[Tensor], initial_state: Optional[Tensor],
                   state: Optional[Tensor], state_indices: Optional[Tensor], output_final_state: Flag,
                   final_state: Optional[Tensor], checkpoint_every: Count, checkpoints: Optional[Tensor],
                   max_seqlen: Optional[Count], null_slot0: Flag, workspace: Optional[Tensor], out: Tensor) -> None:
    _refuse_no_out("kda_prefill", out)
    _refuse_dropped_outputs(output_final_state, final_state, state, state_indices, checkpoint_every, checkpoints)
    _ops.kda_prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale,
                     beta_is_logit=beta_is_logit, cu_seqlens=cu_seqlens, initial_state=initial_state, state=state,
                     state_indices=state_indices, output_final_state=output_final_state, final_state=final_state,
                     checkpoint_every=checkpoint_every, checkpoints=checkpoints, max_seqlen=max_seqlen,
                     null_slot0=null_slot0, workspace=workspace, out=out)


@_fake("kda_prefill", same_view_ok=("initial_state", "final_state"))
def _kda_prefill_fake(q, k, v, g, beta, A_log, dt_bias, lower_bound, gate, scale, beta_is_logit, cu_seqlens,
                      initial_state, state, state_indices, output_final_state, final_state, checkpoint_every,
                      checkpoints, max_seqlen, null_slot0, workspace, out) -> None:
    _refuse_no_out("kda_prefill", out)
    _refuse_dropped_outputs(output_final_state, final_state, state, state_indices, checkpoint_every, checkpoints)
    if max_seqlen is None and isinstance(cu_seqlens, Tensor) and cu_seqlens.device.type == "cpu" \
            and isinstance(checkpoints, Tensor) and checkpoints.dim() == 5 and isinstance(q, Tensor) and q.dim() == 4 \
            and type(checkpoint_every) is int and checkpoint_every > 0 \
            and type(q.shape[1]) is int and type(checkpoints.shape[1]) is int:
        # the longest sequence, which sizes the checkpoints eager requires, is a value of host cu_seqlens (eager
        # reads it; a fake has none): given checkpoints are checked against it by the real implementation, here
        # against the most they can hold (it was T, refusing checkpoints of C = longest // every eager serves).
        # Device offsets: eager too checks against T (it reads no values there)
        max_seqlen = min(q.shape[1], checkpoints.shape[1] * checkpoint_every)
    _check_on_meta(validation.check_kda_prefill, None, (q, k, v, g, beta), dict(
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale, beta_is_logit=beta_is_logit,
        cu_seqlens=cu_seqlens, initial_state=initial_state, state=state, state_indices=state_indices,
        output_final_state=output_final_state, final_state=final_state, checkpoint_every=checkpoint_every,
        checkpoints=checkpoints, max_seqlen=max_seqlen, null_slot0=null_slot0, out=out))
    # the kind of the scratch buffer (its size needs the route's module: checked by the real implementation)
    validation.check_workspace(workspace, None, q.device, validation.backend_of(q.device))


def traced_kda_prefill(q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, gate="softplus",
                       scale=None, beta_is_logit=True, cu_seqlens=None, initial_state=None, state=None,
                       state_indices=None, output_final_state=True, final_state=None, checkpoint_every=0,
                       checkpoints=None, max_seqlen=None, null_slot0=False, workspace=None, out=None):
    """kda_prefill under tracing: same arguments and results as the public op. The outputs the caller
    leaves out are allocated here as the eager op allocates them (checkpoints NaN-filled)."""
    _read_ok("q", q, 4, "[B, T, H, K]")
    _read_ok("v", v, 4, "[B, T, HV, V]")
    if cu_seqlens is not None:
        _read_ok("cu_seqlens", cu_seqlens, 1, "[N+1]")
        validation.check_offset_count(cu_seqlens)     # the eager check, before N sizes a final state
    # the eager check, before max_seqlen sizes the checkpoints
    validation.check_max_seqlen(max_seqlen, v.shape[1], cu_seqlens is not None)
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    pool = state is not None or state_indices is not None
    # eager's rule: the state dtype is initial_state's, else final_state's, else float32; never checkpoints' (the
    # check then requires given checkpoints of that dtype: a bf16 one beside no state is refused, not served)
    sdtype = _state_dtype(initial_state, final_state)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if not pool and output_final_state is True and final_state is None:
        final_state = torch.empty((N, HV, V, K), dtype=sdtype, device=q.device)
        sdtype = final_state.dtype
    if isinstance(checkpoint_every, int) and not isinstance(checkpoint_every, bool) and checkpoint_every > 0 \
            and checkpoints is None:
        if cu_seqlens is not None and max_seqlen is None:
            # the eager op reads host offsets for the count; a traced graph cannot (data-dependent shape)
            raise ValueError("max_seqlen: required under torch.compile/export when checkpoint_every > 0 with "
                             "cu_seqlens and no preallocated checkpoints (it fixes the checkpoint count); got None")
        longest = T if max_seqlen is None else max_seqlen
        if pool:
            sdtype = state.dtype if isinstance(state, Tensor) else sdtype
        checkpoints = torch.full((N, longest // checkpoint_every, HV, V, K), float("nan"), dtype=sdtype,
                                 device=q.device)
    _op_call(kda_prefill_op, q, k, v, g, beta, A_log, dt_bias, _opt_float("lower_bound", lower_bound), gate,
             _opt_float("scale", scale), beta_is_logit, cu_seqlens, initial_state, state, state_indices,
             output_final_state, final_state, checkpoint_every, checkpoints, max_seqlen, null_slot0, workspace, out)
    # as eager: pool mode returns the pool itself; output_final_state=False returns None (a pool only read)
    result_state = (state if pool else final_state) if output_final_state else None
    has_ckpt = isinstance(checkpoint_every, int) and checkpoint_every > 0
    return (out, result_state, checkpoints) if has_ckpt else (out, result_state)


# ---------------------------------------------------------------------------------------------
# kda_verify, fused_kda_verify (speculative decoding)


@_register("kda_verify", mutates_args=("state", "out"))
def kda_verify_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, state_indices: Tensor,
                  cu_seqlens: Tensor, num_accepted_tokens: Optional[Tensor], max_seqlen: Optional[Count],
                  A_log: Optional[Tensor], dt_bias: Optional[Tensor], lower_bound: Optional[Real], gate: str,
                  scale: Optional[Real], beta_is_logit: Flag, null_slot0: Flag, out: Tensor,
                  initial_state: Optional[Tensor] = None, initial_state_indices: Optional[Tensor] = None,
                  parent_tokens: Optional[Tensor] = None) -> None:
    _refuse_no_out("kda_verify", out)
    _ops.kda_verify(q, k, v, g, beta, state=state, state_indices=state_indices, cu_seqlens=cu_seqlens,
                    num_accepted_tokens=num_accepted_tokens, max_seqlen=max_seqlen, A_log=A_log, dt_bias=dt_bias,
                    lower_bound=lower_bound, gate=gate, scale=scale, beta_is_logit=beta_is_logit, null_slot0=null_slot0,
                    out=out, initial_state=initial_state, initial_state_indices=initial_state_indices,
                    parent_tokens=parent_tokens)


@_fake("kda_verify", same_view_ok=("state", "initial_state"))
def _kda_verify_fake(q, k, v, g, beta, state, state_indices, cu_seqlens, num_accepted_tokens, max_seqlen, A_log,
                     dt_bias, lower_bound, gate, scale, beta_is_logit, null_slot0, out, initial_state=None,
                     initial_state_indices=None, parent_tokens=None) -> None:
    _refuse_no_out("kda_verify", out)
    # the index values are checked by the real implementation (a graph has none to read)
    _check_on_meta(validation.check_kda_verify, None, (q, k, v, g, beta), dict(
        state=state, state_indices=state_indices, cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
        max_seqlen=max_seqlen, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale,
        beta_is_logit=beta_is_logit, null_slot0=null_slot0, out=out, initial_state=initial_state,
        initial_state_indices=initial_state_indices, parent_tokens=parent_tokens))


def traced_kda_verify(q, k, v, g, beta, *, state, state_indices, cu_seqlens, num_accepted_tokens=None,
                      max_seqlen=None, A_log=None, dt_bias=None, lower_bound=None, gate="softplus", scale=None,
                      beta_is_logit=True, null_slot0=False, out=None, initial_state=None, initial_state_indices=None,
                      parent_tokens=None):
    """kda_verify under tracing: same arguments and result as the public op."""
    if out is None:
        _read_ok("v", v)
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _op_call(kda_verify_op, q, k, v, g, beta, state, state_indices, cu_seqlens, num_accepted_tokens, max_seqlen, A_log,
             dt_bias, _opt_float("lower_bound", lower_bound), gate, _opt_float("scale", scale), beta_is_logit,
             null_slot0, out, initial_state, initial_state_indices, parent_tokens)
    return out


@_register("fused_kda_verify", mutates_args=("conv_state", "state", "out"))
def fused_kda_verify_op(x: Tensor, conv_weight: Tensor, conv_state: Tensor, g: Tensor, beta: Tensor,
                        A_log: Optional[Tensor], dt_bias: Optional[Tensor], state: Tensor, output_gate: Tensor,
                        norm_weight: Tensor, state_indices: Tensor, cu_seqlens: Tensor,
                        num_accepted_tokens: Optional[Tensor], max_seqlen: Optional[Count],
                        lower_bound: Optional[Real], gate: str, norm_eps: Real, scale: Optional[Real],
                        null_slot0: Flag, out: Tensor) -> None:
    _refuse_no_out("fused_kda_verify", out)
    _ops.fused_kda_verify(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight,
                          state_indices=state_indices, cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
                          max_seqlen=max_seqlen, lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale,
                          null_slot0=null_slot0, out=out)


@_fake("fused_kda_verify")
def _fused_kda_verify_fake(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight,
                           state_indices, cu_seqlens, num_accepted_tokens, max_seqlen, lower_bound, gate, norm_eps,
                           scale, null_slot0, out) -> None:
    _refuse_no_out("fused_kda_verify", out)
    _check_on_meta(validation.check_fused_kda_verify, None,
                   (x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight),
                   dict(state_indices=state_indices, cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
                        max_seqlen=max_seqlen, lower_bound=lower_bound, gate=gate, norm_eps=norm_eps, scale=scale,
                        null_slot0=null_slot0, out=out))


def traced_fused_kda_verify(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight, *,
                            state_indices, cu_seqlens, num_accepted_tokens=None, max_seqlen=None, lower_bound=None,
                            gate="softplus", norm_eps=1e-5, scale=None, null_slot0=False, out=None):
    """fused_kda_verify under tracing: same arguments and result as the public op."""
    if out is None:
        _read_ok("x", x)
        _read_ok("output_gate", output_gate)
        out = torch.empty(output_gate.shape, dtype=x.dtype, device=x.device)
    _op_call(fused_kda_verify_op, x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight,
             state_indices, cu_seqlens, num_accepted_tokens, max_seqlen, _opt_float("lower_bound", lower_bound), gate,
             validation._real("norm_eps", norm_eps), _opt_float("scale", scale), null_slot0, out)
    return out


def _state_dtype(*candidates) -> torch.dtype:
    for t in candidates:
        if isinstance(t, Tensor):
            return t.dtype
    return torch.float32


def _opt_float(name: str, x):
    """An int scale or lower_bound (a valid eager argument) as the float the op computes with; anything
    else passes through so the checks name it. An int past the float range gets the eager ValueError
    naming it (the schema's Scalar could not hold it)."""
    if isinstance(x, int) and not isinstance(x, bool):
        return validation._real(name, x)
    return x


def _tensor_positions(op) -> tuple:
    """(position, name, optional) of each Tensor argument in an op's schema."""
    return tuple((i, a.name, str(a.type) == "Optional[Tensor]") for i, a in enumerate(op._schema.arguments)
                 if str(a.type) in ("Tensor", "Optional[Tensor]"))


def _scalar_positions(op) -> tuple:
    """(position, name, schema type) of each str / number argument in an op's schema."""
    return tuple((i, a.name, str(a.type)) for i, a in enumerate(op._schema.arguments)
                 if str(a.type) in ("str", "number", "Optional[number]"))


#: the eager check of each str / number argument of the schemas (what the public op raises for a value the schema
#: cannot take: a non-str gate, a None flag, a str scale, ...), run before the schema raises its RuntimeError
_SCALAR_RULES = {
    "gate": lambda n, v: validation._choice(n, v, validation.GATES),
    "slot_mode": lambda n, v: validation._choice(n, v, validation.SLOT_MODES),
    "beta_is_logit": validation._bool, "null_slot0": validation._bool, "output_final_state": validation._bool,
    "checkpoint_every": lambda n, v: validation.check_checkpoint_every(v),
    "max_seqlen": lambda n, v: validation._int(n, v, "or None"),
    "scale": validation._real, "lower_bound": validation._real, "norm_eps": validation._real,
}
_NUMBER = (bool, int, float)


def _op_call(op, *args) -> None:
    """op(*args) under tracing, each Tensor argument checked first: the schema's cast of a list or a number fails
    with torch's message, which names no argument; this is the eager one. A str or number argument the schema
    cannot take gets the eager check's ValueError / TypeError (the schema's is a RuntimeError). The positions are
    read from the schemas once at import (_TENSOR_ARGS, _SCALAR_ARGS): Dynamo traces this function, not the
    schema objects."""
    for i, name, optional in _TENSOR_ARGS[op]:
        x = args[i]
        if not isinstance(x, Tensor) and not (optional and x is None):
            raise TypeError(f"{name}: expected a torch.Tensor, got {'None' if x is None else type(x).__name__}")
    for i, name, kind in _SCALAR_ARGS[op]:
        x = args[i]
        fits = isinstance(x, str) if kind == "str" else (
            isinstance(x, _NUMBER) or (x is None and kind == "Optional[number]"))
        if not fits:
            _SCALAR_RULES[name](name, x)
    op(*args)


def _read_ok(name: str, x, ndim: Optional[int] = None, layout: str = "") -> None:
    """A traced wrapper reads x's shape, dtype or device before the fake's checks run: refuse what it could not
    read with the eager message (not an AttributeError, IndexError or unpacking error). Not validation._tensor:
    its is_neg() / is_conj() tests break a fullgraph Dynamo trace (a non-Tensor result); the fake makes them."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {'None' if x is None else type(x).__name__}")
    if ndim is not None:
        validation._ndim(name, x, ndim, layout)


_TENSOR_ARGS = {op: _tensor_positions(op) for op in (kda_decode_op, fused_kda_decode_op, kda_prefill_op,
                                                     kda_verify_op, fused_kda_verify_op)}
_SCALAR_ARGS = {op: _scalar_positions(op) for op in _TENSOR_ARGS}
