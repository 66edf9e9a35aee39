"""A flashkda_ext backend for fla's backend registry (fla >= 0.6), so fla's KDA entry points run our kernels.

    import flashkda_ext.integrations.fla as fkda_fla
    fkda_fla.register()          # once, after importing fla; FLA_FLASHKDA_EXT=0 turns it off again

fla dispatches `chunk_kda` (its function registry) and `fused_recurrent_kda_fwd` (the 'kda' operation
registry, the call vLLM's KDA decode makes) to the first enabled backend whose verifier accepts the call.
Our verifiers accept only what the kernels claim and say why otherwise, so fla falls back to Triton for
the rest (training, K-first state, context parallel, per-chunk intermediate states, ...).

The mapping itself (serve_chunk_kda, serve_fused_recurrent_kda_fwd and their verifiers) imports nothing
from fla; only register() does. Conversions done here, each one pass, documented in docs/integrations.md:
g and beta in fp32 beside bf16 q (as engines produce them) go to kda_decode and kda_verify as they are
(both read fp32 g and beta natively); for kda_prefill, and in any other dtype than q's or fp32, they are
cast to q's dtype (kda_prefill reads them in q's dtype only); A_log / dt_bias are flattened to [HV] /
[HV*K] float32; int64 slot indices, offsets and counts become int32 through common_checks.narrow_int32
(range-checked, never wrapped); a non-fp32 dense initial state of fused_recurrent is
read through an fp32 copy (fla's final state is fp32).
"""
from __future__ import annotations

import collections
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from .. import switches, validation
from . import _indices, common_checks, fla_chunk_states
from ..custom_ops import _check_on_meta

BACKEND_TYPE = "flashkda_ext"
ENV_VAR = "FLA_FLASHKDA_EXT"      # fla's own switch convention: "0" disables the registered backend
PRIORITY = 2                      # fla: lower runs first; FlashKDA's backend is 3, fla's Triton the fallback

#: calls served / refused per entry point, e.g. STATS["chunk_kda", "served"] (the acceptance run counts them)
STATS: collections.Counter = collections.Counter()
#: refusals per (entry point, reason)
REASONS: collections.Counter = collections.Counter()


class Refused(Exception):
    """A call outside what flashkda_ext serves; the message is the reason fla logs."""


class _Plan:
    """Builds the op call either on meta stand-ins (verifier: shapes and dtypes only, nothing allocated
    on the device) or on the real tensors (implementation)."""

    def __init__(self, meta: bool):
        self.meta = meta

    def cast(self, x, dtype):
        if x is None or x.dtype == dtype:
            return x if not self.meta or x is None else _meta_like(x)
        if dtype.is_floating_point and not x.dtype.is_floating_point:
            # only a float is converted to a float (docs/integrations.md, "Conversions"): an integer, bool or complex
            # tensor is what the op itself refuses, and a cast would serve it (a complex one without its imaginary part)
            raise Refused(f"flashkda_ext converts floating-point tensors only, got a {x.dtype} tensor of shape "
                          f"{list(x.shape)} where the op reads {dtype}")
        if self.meta:
            return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device="meta")
        return x.to(dtype)

    def gate_beta(self, g, beta, q):
        """g and beta as kda_decode / kda_verify read them (common_checks.decode_gate_dtype: no cast kernel for the
        engines' fp32 gate / beta; an fp16 one widened, not rounded)."""
        return tuple(self.cast(x, common_checks.decode_gate_dtype(x.dtype, q.dtype)) for x in (g, beta))

    def reshape(self, x, shape):
        if x is None:
            return None
        return (_meta_like(x) if self.meta else x).reshape(shape)

    def keep(self, x):
        return _meta_like(x) if self.meta and x is not None else x

    def index(self, name: str, x, low: int = common_checks.INT32_MIN, high: int = common_checks.INT32_MAX,
              pad=None, what: str = ""):
        """An integer argument as the int32 the op reads (common_checks.narrow_int32: host values checked,
        device values out of range made `pad`); on meta stand-ins only the dtype changes."""
        if x is None or x.dtype.is_floating_point or x.dtype.is_complex:
            return self.keep(x)     # the op's own check names a non-integer dtype
        if x.dtype == torch.bool:   # a mask, not indices: int32 would make it slots / counts 0 and 1
            raise Refused(f"flashkda_ext requires {name} as an integer tensor, got torch.bool")
        if self.meta:
            return self.cast(x, torch.int32)
        return common_checks.narrow_int32(name, x, low, high, pad, what)

    def arange(self, n: int, device):
        return torch.arange(n, dtype=torch.int32, device="meta" if self.meta else device)


def _meta_like(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def _common(q, k, v, beta, tensors: dict, *, use_qk_l2norm_in_kernel, allow_neg_eigval, state_v_first,
            written: tuple = ()) -> None:
    """Refusals shared by both entry points. `written`: the names in `tensors` the op writes in place."""
    # What the verifier's meta stand-ins drop, read on the real tensors: a lazy negated / conjugated view (the
    # kernels would read its memory without the sign) and an inference tensor written outside inference mode (torch
    # refuses that update); accepted here, the op itself would raise instead of fla falling back.
    for name, t in (("q", q), *tensors.items()):
        if t is not None and (t.is_neg() or t.is_conj()):
            raise Refused(f"flashkda_ext does not serve a lazy {'negated' if t.is_neg() else 'conjugated'} view "
                          f"({name}); the op would need it resolved")
    # Grad mode alone is no refusal: with no input requiring grad autograd records nothing, so the call is
    # inference whatever the mode (fla's own forward tests and many engines run so); the public ops take the
    # same rule (validation.inference_conflict).
    conflict = validation.inference_conflict((("q", q), *((n, t) for n, t in tensors.items() if n not in written)),
                                             tuple((n, tensors.get(n)) for n in written))
    if conflict is not None and conflict[1] == "inference":
        raise Refused(f"flashkda_ext would write {conflict[0]} in place, an inference tensor, outside "
                      f"torch.inference_mode() (torch refuses that update)")
    if conflict is not None:
        raise Refused("flashkda_ext serves inference only (autograd is recording: an input requires grad)")
    if q.device.type not in ("cuda", "cpu"):
        raise Refused(f"flashkda_ext runs on CUDA (and its CPU backend), got a tensor on {q.device}")
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise Refused(f"flashkda_ext requires {name} on {q.device} (the device of q), got {t.device}")
    if q.is_cuda and q.dtype != torch.bfloat16:
        raise Refused(f"flashkda_ext requires bfloat16 q/k/v on CUDA, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise Refused(f"flashkda_ext requires q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 4:
        raise Refused(f"flashkda_ext requires q of shape [B, T, H, K], got {list(q.shape)}")
    if beta.dim() != 3:
        raise Refused(f"flashkda_ext requires a scalar beta per head [B, T, HV], got {list(beta.shape)}")
    if not use_qk_l2norm_in_kernel:
        raise Refused("flashkda_ext requires use_qk_l2norm_in_kernel=True (its kernels always l2-normalize q and k)")
    if allow_neg_eigval:
        raise Refused("flashkda_ext requires allow_neg_eigval=False")
    if not state_v_first:
        raise Refused("flashkda_ext requires state_v_first=True (its state is [.., V, K]; fla's default is K-first)")


def _flags(**flags) -> None:
    """fla's flag arguments: True / False exactly (fla reads any truthy value; an int or a string is not what
    its signature says, so the call goes back to fla rather than being read one way or the other)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise Refused(f"flashkda_ext requires {name} as a bool, got {type(value).__name__} {value!r}")


def _lower_bound(lower_bound) -> None:
    # True would read as lower_bound 1.0 (or be dropped with the log gate)
    if not common_checks.number_or_none(lower_bound):
        raise Refused(f"flashkda_ext requires lower_bound as a number or None, got {type(lower_bound).__name__} "
                      f"{lower_bound!r}")


def _gate(plan: _Plan, use_gate_in_kernel, A_log, dt_bias, lower_bound, HV: int):
    """(gate, A_log [HV] fp32, dt_bias [HV*K] fp32, lower_bound) in flashkda_ext's terms. fla's rule:
    use_gate_in_kernel with lower_bound is the bounded gate (A_log optional), without it the softplus gate."""
    if not use_gate_in_kernel:
        return "log", None, None, None
    if lower_bound is None:
        if A_log is None or dt_bias is None:
            raise Refused("flashkda_ext's softplus gate requires A_log and dt_bias tensors")
        gate = "softplus"
    else:
        gate = "bounded"
    if A_log is not None:
        A_log = plan.cast(plan.reshape(A_log, (-1,)), torch.float32)
    if dt_bias is not None:
        dt_bias = plan.cast(plan.reshape(dt_bias, (-1,)), torch.float32)
    return gate, A_log, dt_bias, lower_bound


def _validated(family: str, device, args: tuple, kwargs: dict) -> None:
    check = {"kda_decode": validation.check_kda_decode, "kda_prefill": validation.check_kda_prefill,
             "kda_verify": validation.check_kda_verify}[family]
    try:
        _check_on_meta(check, device, args, kwargs)
    except (TypeError, ValueError) as e:
        raise Refused(f"flashkda_ext does not serve this call: {e}") from e


# ---------------------------------------------------------------------------------------------
# chunk_kda -> kda_prefill


def _plan_chunk_kda(plan, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                    allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                    return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                    cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, **kwargs):
    _flags(output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
           use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
           allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, disable_recompute=disable_recompute,
           return_intermediate_states=return_intermediate_states, state_v_first=state_v_first, use_graph=use_graph)
    _lower_bound(lower_bound)
    _common(q, k, v, beta, dict(k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log,
                                dt_bias=dt_bias, cu_seqlens=cu_seqlens),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first)
    if cp_context is not None:
        raise Refused("flashkda_ext does not support context parallel (cp_context)")
    chunk = kwargs.pop("chunk_size", 64)
    # fla's hints, each honoured or refused (fla 0.6.0's chunk_kda): chunk_size is 32 or 64 (fla raises
    # otherwise; the kernels pick their own chunk, so it only shapes h); safe_gate picks fla's tensor-core path
    # for gates >= lower_bound (the same recurrence), and with the gate in the kernel fla requires lower_bound
    # in [-5, 0); disable_recompute keeps activations for a backward pass (none here), which fla refuses with
    # return_intermediate_states; max_num_seqs is use_graph's bound (use_graph is refused below)
    if type(chunk) is not int or chunk not in (32, 64):
        # an int exactly: 64.0 or a tensor compares equal to 64, but is what fla reads, not a count (fla runs it)
        raise Refused(f"flashkda_ext serves fla's chunk_size 32 or 64 (an int), got {chunk!r}")
    if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
        raise Refused(f"safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0) (fla raises), "
                      f"got {lower_bound}")
    if disable_recompute and return_intermediate_states:
        raise Refused("disable_recompute=True with return_intermediate_states=True (fla asserts against it)")
    if max_num_seqs is not None:
        raise Refused(f"flashkda_ext does not map max_num_seqs (use_graph's sequence bound), got {max_num_seqs!r}")
    if cu_seqlens_cpu is not None:
        # the verifier checks the host copy on its own (its values are in the verdict's key) and refuses naming
        # it; the copy is compared with host cu_seqlens only when served (the key holds no cu_seqlens values)
        try:
            _check_host_offsets(cu_seqlens_cpu, cu_seqlens, q.shape[1], compare=not plan.meta)
        except ValueError as e:
            if plan.meta:
                raise Refused(f"flashkda_ext does not serve this call: {e}") from e
            raise
    lengths = None
    if return_intermediate_states:
        # fla's h: the state entering each chunk, built from our checkpoints with host lengths
        if chunk != 64:
            raise Refused(f"flashkda_ext serves return_intermediate_states with chunk_size=64, got {chunk}")
        if cu_seqlens is None:
            lengths = [q.shape[1]] * q.shape[0]
        elif cu_seqlens_cpu is not None:
            offsets = cu_seqlens_cpu.tolist()
            lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        else:
            raise Refused("flashkda_ext serves return_intermediate_states with packed input only when "
                          "cu_seqlens_cpu is given (the per-chunk layout needs host lengths)")
    if use_graph:
        raise Refused("flashkda_ext does not map use_graph (fla's fixed-shape chunk list); pass workspace= "
                      "to kda_prefill directly for CUDA graphs")
    unknown = sorted(kwargs)
    if unknown:
        raise Refused(f"flashkda_ext does not know the arguments {unknown}")
    gate, A_log, dt_bias, lower_bound = _gate(plan, use_gate_in_kernel, A_log, dt_bias, lower_bound, v.shape[2])
    max_seqlen = None
    if lengths is not None:
        max_seqlen = max(lengths, default=0)
    elif cu_seqlens_cpu is not None:      # checked above: cu_seqlens is given
        max_seqlen = int((cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).max()) if cu_seqlens_cpu.numel() > 1 else 0
    args = (plan.keep(q), plan.keep(k), plan.keep(v), plan.cast(g, q.dtype), plan.cast(beta, q.dtype))
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale,
              beta_is_logit=bool(use_beta_sigmoid_in_kernel), cu_seqlens=plan.keep(cu_seqlens),
              initial_state=plan.cast(initial_state, torch.float32), output_final_state=bool(output_final_state),
              max_seqlen=max_seqlen)
    if lengths is not None:
        kw["checkpoint_every"] = chunk
    return args, kw, lengths


def _check_host_offsets(cu_seqlens_cpu, cu_seqlens, T: int, compare: bool = True) -> None:
    """fla's cu_seqlens_cpu is the host copy of cu_seqlens; the per-chunk layout and max_seqlen are read
    from it. Where cu_seqlens is in host memory too the two are compared (no synchronisation). Device
    offsets are not read (that would cost a device-to-host copy every call): there the host copy is
    trusted, as fla trusts it (docs/integrations.md)."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu: given without cu_seqlens (it is the host copy of cu_seqlens)")
    if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu" \
            or cu_seqlens_cpu.dtype not in (torch.int32, torch.int64) or cu_seqlens_cpu.dim() != 1:
        raise ValueError(f"cu_seqlens_cpu: expected a 1-D int32 or int64 tensor in host memory (the host copy of "
                         f"cu_seqlens), got {_describe(cu_seqlens_cpu)}")
    host = cu_seqlens_cpu.tolist()
    if len(host) != cu_seqlens.shape[0] or not host:
        raise ValueError(f"cu_seqlens_cpu: expected the {cu_seqlens.shape[0]} offsets of cu_seqlens, got {host}")
    validation.check_offsets_span("cu_seqlens_cpu", host, T)
    if compare and common_checks.host_values(cu_seqlens) and cu_seqlens.tolist() != host:
        raise ValueError(f"cu_seqlens_cpu: expected the host copy of cu_seqlens {cu_seqlens.tolist()}, got {host}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {list(x.shape)} on {x.device}"
    return type(x).__name__


# Verdicts by call signature: a serving loop repeats the same call every step, and the checks on meta
# stand-ins cost ~80 us a call. The key holds everything a verdict depends on (the hand-written part:
# validation's own memo keys tensors without strides or requires_grad, and sees mapped arguments).
_VERDICTS: dict = {}
_VERDICT_LIMIT = 512
_SCALARS = (type(None), bool, int, float, str)


def _verdict_key(entry: str, args: tuple, kwargs: dict):
    """A hashable summary of the call, or None when some argument cannot be summarized (no memo)."""
    key = [entry, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(kwargs)]
    for name, x in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor:
                return None   # subclasses (fake, functional) are checked every time
            if name == "cu_seqlens_cpu":
                if x.device.type != "cpu":
                    return None     # no values to key by (the check refuses it, naming it)
                # host lengths shape the per-chunk layout (flattened with its shape: a 0-d or 2-D one is refused by
                # the check, not by this key)
                key.append((tuple(x.shape), tuple(x.reshape(-1).tolist())))
            else:
                key.append((x.shape, x.dtype, x.device, x.stride(), x.requires_grad, x.is_neg(), x.is_conj(),
                            x.is_inference(), x.data_ptr() & 15 if x.is_cuda else 0))
        elif type(x) in _SCALARS:
            key.append((type(x), x))
        else:
            return None
    return tuple(key)


def _verdict(entry: str, check, args: tuple, kwargs: dict):
    """(True, None) when check(*args, **kwargs) passes, else (False, reason); memoized by call signature.
    The vLLM adapter shares it (flashkda_ext/integrations/vllm.py), under entry names of its own."""
    key = _verdict_key(entry, args, kwargs)
    verdict = _VERDICTS.get(key) if key is not None else None
    if verdict is None:
        try:
            check(*args, **kwargs)
            verdict = (True, None)
        except Exception as e:  # noqa: BLE001  (a call the mapping cannot read is refused, never raised)
            verdict = (False, str(e) if isinstance(e, Refused) else
                       f"flashkda_ext could not map the call: {type(e).__name__}: {e}")
        if key is not None:
            if len(_VERDICTS) >= _VERDICT_LIMIT:
                _VERDICTS.clear()
            _VERDICTS[key] = verdict
    return verdict


def _verify(entry: str, check, args: tuple, kwargs: dict):
    verdict = _verdict(entry, check, args, kwargs)
    STATS[entry, "served" if verdict[0] else "refused"] += 1
    if not verdict[0]:
        REASONS[entry, verdict[1]] += 1
    return verdict


def _check_chunk_kda(*args, **kwargs):
    q = args[0] if args else kwargs["q"]
    a, kw, _ = _plan_chunk_kda(_Plan(meta=True), *args, **kwargs)
    _validated("kda_prefill", q.device, a, kw)


def _fla_chunk_asserts(*args, **kwargs) -> None:
    """What fla 0.6.0's chunk_kda itself refuses beyond the mapping's checks (its body runs only when no backend
    serves the call, so a call served here would pass where fla raises): an initial_state that is not fp32
    ("initial_state must be in float32."; the mapping would read it through an fp32 copy), and
    return_intermediate_states outside torch.inference_mode() ("only allowed in inference mode"). fla's entry only:
    vLLM's vendored chunk_kda shares the mapping, not fla's asserts. The arguments are read by the mapping's own
    signature (the call already bound to it in _check_chunk_kda)."""
    call = _CHUNK_SIGNATURE.bind(None, *args, **kwargs).arguments
    initial_state = call.get("initial_state")
    if isinstance(initial_state, torch.Tensor) and initial_state.dtype != torch.float32:
        raise Refused(f"flashkda_ext serves chunk_kda's initial_state in float32 only, as fla asserts; got "
                      f"{initial_state.dtype}")
    if call.get("return_intermediate_states") is True and not torch.is_inference_mode_enabled():
        raise Refused("return_intermediate_states=True outside torch.inference_mode() (fla asserts against it)")


_CHUNK_SIGNATURE = inspect.signature(_plan_chunk_kda)


def _check_fla_chunk_kda(*args, **kwargs):
    _check_chunk_kda(*args, **kwargs)
    _fla_chunk_asserts(*args, **kwargs)


def chunk_kda_verifier(*args, **kwargs):
    """fla's verifier protocol: (True, None) when flashkda_ext serves this chunk_kda call, else (False, reason)."""
    return _verify("chunk_kda", _check_fla_chunk_kda, args, kwargs)


def serve_chunk_kda(*args, **kwargs):
    """chunk_kda through kda_prefill: returns (o [B, T, HV, V], final_state [N, HV, V, K] fp32 or None), and
    with return_intermediate_states h [B, NT, HV, V, K] in q's dtype (B = 1 for packed input, NT chunks
    over all sequences), h[:, c] the state entering chunk c (fla's layout with state_v_first=True)."""
    return serve_chunk_kda_known_longest(None, *args, **kwargs)


def serve_chunk_kda_known_longest(longest, *args, **kwargs):
    """serve_chunk_kda, routed by `longest` (a caller's host bound on the longest sequence: vLLM's vendored
    chunk_kda, integrations/vllm/host_lengths.py) where fla's own arguments (cu_seqlens_cpu) do not give it."""
    from ..ops import kda_prefill
    a, kw, lengths = _plan_chunk_kda(_Plan(meta=False), *args, **kwargs)
    if kw["max_seqlen"] is None and kw["cu_seqlens"] is not None:
        kw["max_seqlen"] = longest
    res = kda_prefill(*a, **kw)
    if lengths is None:
        return res[0], res[1]
    q, v = a[0], a[2]
    init = kw["initial_state"]
    if init is None:
        init = torch.zeros((len(lengths), v.shape[2], v.shape[3], q.shape[3]), dtype=torch.float32, device=q.device)
    h = fla_chunk_states(init, res[2], lengths, kw["checkpoint_every"]).to(q.dtype)
    if kw["cu_seqlens"] is None:  # equal lengths: one row of chunks per batch entry
        h = h.view(q.shape[0], -1, *h.shape[2:])
    return res[0], res[1], h


# ---------------------------------------------------------------------------------------------
# fused_recurrent_kda_fwd -> kda_decode (one token per slot-indexed sequence) or kda_prefill


def _plan_fused_recurrent(plan, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                          output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                          ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                          use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                          lower_bound=None, out=None, *, null_slot0=False, **kwargs):
    """(family, args, kwargs, result) where result(op output) builds fla's (o, final_state).
    null_slot0 is no fla argument: vLLM's vendored kernel skips slot 0 (its null block), fla's does not."""
    _flags(output_final_state=output_final_state, inplace_final_state=inplace_final_state,
           state_v_first=state_v_first, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
           use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
           allow_neg_eigval=allow_neg_eigval, null_slot0=null_slot0)
    _lower_bound(lower_bound)
    _common(q, k, v, beta, dict(k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log,
                                dt_bias=dt_bias, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                                out=out),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first, written=("initial_state", "out") if inplace_final_state is True else ("out",))
    if out is not None and tuple(out.shape) != tuple(v.shape):
        # fla asserts out.shape == v.shape; a decode batch would write a reshaped view of it and hand it back in
        # the caller's shape, not fla's [B, T, HV, V]
        raise Refused(f"flashkda_ext requires out of the shape of v {list(v.shape)} (fla asserts it), got "
                      f"{list(out.shape)}")
    if num_accepted_tokens is not None and (ssm_state_indices is None or ssm_state_indices.dim() != 2):
        raise Refused("flashkda_ext serves num_accepted_tokens only with per-token ssm_state_indices [N, T_max]")
    if kwargs:
        raise Refused(f"flashkda_ext does not know the arguments {sorted(kwargs)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gate, A_log, dt_bias, lower_bound = _gate(plan, use_gate_in_kernel, A_log, dt_bias, lower_bound, HV)
    slots = initial_state.shape[0] if initial_state is not None and initial_state.dim() > 0 else 0

    def slot_index(x):   # out of the pool: refused on the host, padding on a device (never written)
        return plan.index("ssm_state_indices", x, high=slots - 1, pad=-1,
                          what=f" (a pool of {slots} slots; negative = padding)")
    # g and beta are cast where they are used: kda_decode / kda_verify keep fp32 ones, kda_prefill takes q's dtype
    gate_kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate, scale=scale,
                   beta_is_logit=bool(use_beta_sigmoid_in_kernel))

    if ssm_state_indices is not None:
        # continuous batching: initial_state is the pool, written in place, one state index per sequence
        if initial_state is None or not inplace_final_state:
            raise Refused("flashkda_ext serves ssm_state_indices only with the pool updated in place "
                          "(initial_state given, inplace_final_state=True)")
        if ssm_state_indices.dim() == 2:
            # speculative decoding (kda_verify): the state after token t of sequence n goes to slot
            # [n, t], the initial state is read from slot [n, num_accepted_tokens[n] - 1]
            if cu_seqlens is None or B != 1:
                raise Refused("flashkda_ext serves per-token ssm_state_indices [N, T_max] on packed input "
                              "(B = 1 with cu_seqlens)")
            _refuse_unchecked_offsets(cu_seqlens)
            t_max = int(ssm_state_indices.shape[1])
            kw = dict(state=plan.keep(initial_state), state_indices=slot_index(ssm_state_indices),
                      cu_seqlens=plan.index("cu_seqlens", cu_seqlens, 0, T, what=f" (T = {T} tokens)"),
                      num_accepted_tokens=plan.index("num_accepted_tokens", num_accepted_tokens, 1, t_max, pad=0,
                                                     what=f" (T_max = {t_max})"),
                      max_seqlen=t_max, null_slot0=null_slot0, out=plan.keep(out), **gate_kw)
            cu = kw["cu_seqlens"]
            if not plan.meta and common_checks.host_values(cu) and cu.dim() == 1 and cu.shape[0] > 1 \
                    and int(cu.diff().max()) > t_max:
                # named as fla's caller passed it (the op would name the max_seqlen this adapter adds)
                raise ValueError(f"cu_seqlens: a request of {int(cu.diff().max())} tokens, more than the {t_max} "
                                 f"columns of ssm_state_indices (nothing was written)")
            args = (plan.keep(q), plan.keep(k), plan.keep(v), *plan.gate_beta(g, beta, q))
            return "kda_verify", args, kw, lambda o: (o, initial_state)
        if ssm_state_indices.dim() != 1:
            raise Refused(f"flashkda_ext serves ssm_state_indices of 1 or 2 dims, got {ssm_state_indices.dim()}")
        # the decode batch reshapes k, g and beta into rows: fla's layouts exactly, as the other mappings' op checks
        # require (read by element count, g [B, T, K, HV] or beta [HV, T, B] was served on scrambled values)
        for name, x, want, dims in (("k", k, (B, T, H, K), "H, K"), ("g", g, (B, T, HV, K), "HV, K"),
                                    ("beta", beta, (B, T, HV), "HV")):
            if x is not None and tuple(x.shape) != want:
                raise Refused(f"flashkda_ext requires {name} of shape {list(want)} (fla's [B, T, {dims}]), "
                              f"got {list(x.shape)}")
        idx = slot_index(ssm_state_indices)
        if cu_seqlens is None:
            if T != 1:
                raise Refused(f"flashkda_ext serves ssm_state_indices for one token per sequence, got T = {T}")
            rows = B
        else:
            # 1-D indices: one slot a request, so a request has at most one token (fla would store token
            # t of request n in slot [n + t], another request's). T == N: a decode batch, where an empty
            # request (CUDA-graph padding) shifts the rows of the requests after it.
            N = cu_seqlens.shape[0] - 1
            if B != 1 or T != N:
                raise Refused(f"flashkda_ext serves varlen ssm_state_indices only as a decode batch "
                              f"(B = 1, one token per sequence: T == N), got B = {B}, T = {T}, N = {N}")
            if tuple(ssm_state_indices.shape) != (N,):
                raise Refused(f"flashkda_ext serves 1-D ssm_state_indices of one slot a request [N = {N}], "
                              f"got {list(ssm_state_indices.shape)}")
            if not common_checks.host_values(cu_seqlens):
                # the offsets are on the device: kda_verify reads them there (empty requests touch nothing)
                return _decode_as_verify(plan, q, k, v, g, beta, initial_state, idx, cu_seqlens, null_slot0,
                                         out, gate_kw)
            if not plan.meta:
                idx = _indices.one_token_rows(cu_seqlens, idx, T)
            rows = N
        g, beta = plan.gate_beta(g, beta, q)
        o_rows = plan.reshape(out, (rows, HV, V)) if out is not None else None
        args = (plan.reshape(q, (rows, H, K)), plan.reshape(k, (rows, H, K)), plan.reshape(v, (rows, HV, V)),
                plan.reshape(g, (rows, HV, K)), plan.reshape(beta, (rows, HV)))
        kw = dict(state=plan.keep(initial_state), state_indices=idx, slot_mode="padded", null_slot0=null_slot0,
                  out=o_rows, **gate_kw)
        return "kda_decode", args, kw, lambda o: (o.reshape(B, T, HV, V) if out is None else out, initial_state)

    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    args = (plan.keep(q), plan.keep(k), plan.keep(v), plan.cast(g, q.dtype), plan.cast(beta, q.dtype))
    kw = dict(cu_seqlens=plan.keep(cu_seqlens), out=plan.keep(out), **gate_kw)
    if inplace_final_state:
        if initial_state is None:
            raise Refused("flashkda_ext: inplace_final_state=True needs initial_state")
        if initial_state.dim() > 0 and initial_state.shape[0] < N:
            # slots past the pool would be padding (a GPU starts them from zero and stores nothing)
            raise Refused(f"flashkda_ext: inplace_final_state=True updates initial_state[n] for each of the "
                          f"N = {N} sequences, got initial_state of shape {list(initial_state.shape)}")
        # the dense states updated in place: pool mode over slots 0..N-1
        kw.update(state=plan.keep(initial_state), state_indices=plan.arange(N, q.device))
        return "kda_prefill", args, kw, lambda r: (r[0], initial_state)
    kw.update(initial_state=plan.cast(initial_state, torch.float32), output_final_state=bool(output_final_state))
    return "kda_prefill", args, kw, lambda r: (r[0], r[1])


def _refuse_unchecked_offsets(cu_seqlens) -> None:
    if common_checks.unchecked_on_device(cu_seqlens):
        raise Refused(f"flashkda_ext serves device cu_seqlens of int32 here ({cu_seqlens.dtype} offsets on "
                      f"{cu_seqlens.device} cannot be range-checked for the int32 kernels without a sync)")


def _decode_as_verify(plan, q, k, v, g, beta, initial_state, idx, cu_seqlens, null_slot0, out, gate_kw):
    """A decode batch whose offsets are only on the device, as kda_verify with state_indices [N, 2] =
    (idx[n], -1): a one-token request reads and writes slot idx[n] exactly as decode; an empty request
    touches nothing; a request of more tokens (outside the contract, undecidable without a sync) has
    every output computed, its first token's state stored in its own slot, the rest stored nowhere."""
    _refuse_unchecked_offsets(cu_seqlens)
    N = cu_seqlens.shape[0] - 1
    if plan.meta:
        table = torch.empty((N, 2), dtype=torch.int32, device="meta")
    else:
        table = F.pad(idx.reshape(N, 1), (0, 1), value=-1)
        if out is None:
            out = torch.zeros_like(v)                  # rows no request owns: zeros, as fla's output
    kw = dict(state=plan.keep(initial_state), state_indices=table, cu_seqlens=plan.index("cu_seqlens", cu_seqlens),
              num_accepted_tokens=None, max_seqlen=None, null_slot0=null_slot0, out=plan.keep(out), **gate_kw)
    args = (plan.keep(q), plan.keep(k), plan.keep(v), *plan.gate_beta(g, beta, q))
    return "kda_verify", args, kw, lambda o: (o, initial_state)


def _check_fused_recurrent(*args, **kwargs):
    q = args[0] if args else kwargs["q"]
    family, a, kw, _ = _plan_fused_recurrent(_Plan(meta=True), *args, **kwargs)
    _validated(family, q.device, a, kw)


def fused_recurrent_kda_fwd_verifier(*args, **kwargs):
    """fla's verifier protocol for fused_recurrent_kda_fwd (the vLLM decode call)."""
    return _verify("fused_recurrent_kda_fwd", _check_fused_recurrent, args, kwargs)


def serve_fused_recurrent_kda_fwd(*args, **kwargs):
    """fused_recurrent_kda_fwd through kda_decode / kda_prefill: returns (o [B, T, HV, V], final_state)."""
    from ..ops import kda_decode, kda_prefill, kda_verify
    family, a, kw, result = _plan_fused_recurrent(_Plan(meta=False), *args, **kwargs)
    fn = {"kda_decode": kda_decode, "kda_prefill": kda_prefill, "kda_verify": kda_verify}[family]
    return result(fn(*a, **kw))


# ---------------------------------------------------------------------------------------------
# registration (the only part that imports fla)

_REGISTERED: Optional[type] = None


def register(priority: int = PRIORITY) -> type:
    """Register the flashkda_ext backend with fla's registries for chunk_kda and the 'kda' operations
    (fused_recurrent_kda_fwd). Idempotent; returns the backend class. Raises ImportError without fla >= 0.6."""
    global _REGISTERED
    if _REGISTERED is not None and _REGISTERED.priority == priority:
        return _REGISTERED
    try:
        from fla.backends import BaseBackend
        from fla.backends import register as fla_register
        from fla.ops.kda import chunk_kda
    except ImportError as e:
        raise ImportError(f"flashkda_ext.integrations.fla.register: needs fla >= 0.6 (flash-linear-attention) "
                          f"with its backend registry (fla.backends): {e}") from e

    class FlashKDAExtBackend(BaseBackend):
        """flashkda_ext's Hopper kernels for fla's KDA forward (inference only); FLA_FLASHKDA_EXT=0 disables."""
        backend_type = BACKEND_TYPE
        package_name = "flashkda_ext"
        env_var = ENV_VAR
        default_enable = True

        def chunk_kda_verifier(self, *args, **kwargs):
            return chunk_kda_verifier(*args, **kwargs)

        def chunk_kda(self, *args, **kwargs):
            return serve_chunk_kda(*args, **kwargs)

        def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs):
            return fused_recurrent_kda_fwd_verifier(*args, **kwargs)

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            return serve_fused_recurrent_kda_fwd(*args, **kwargs)

    FlashKDAExtBackend.priority = priority
    fla_register(chunk_kda)(FlashKDAExtBackend)
    fla_register("kda")(FlashKDAExtBackend)
    _REGISTERED = FlashKDAExtBackend
    return FlashKDAExtBackend


def register_from_env() -> Optional[type]:
    """register() when FLASHKDA_EXT_FLA=1 (for a launcher or sitecustomize that cannot edit the engine); read as
    every on/off variable is (flashkda_ext.switches: a value that is no switch is a ValueError naming it)."""
    if switches.env_switch("FLASHKDA_EXT_FLA", False, on="register the fla backend", off="do not"):
        return register()
    return None
