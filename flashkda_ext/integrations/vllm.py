"""vLLM's KDA ops rebound to flashkda_ext: vLLM vendors its own copy of fla's KDA ops and its KDA layer
calls that copy, so fla's backend registry (flashkda_ext.integrations.fla) never reaches it. install()
rebinds the vendored names in vLLM's modules to adapters with vLLM's exact signatures and return
conventions; a call the kernels do not claim goes to the original vLLM function, kept by the adapter.

    import flashkda_ext.integrations.vllm as fkda_vllm
    fkda_vllm.install()          # or FLASHKDA_EXT_VLLM=1 in the environment (a vLLM general plugin)
    ...
    fkda_vllm.uninstall()        # the originals again

As read in vLLM 638d6e97 (main, 2026-07-23; the table in docs/integrations.md): the ops live in
vllm/third_party/flash_linear_attention/ops/kda.py (vllm/model_executor/layers/fla/ops/kda.py before
vLLM #48500) and the layer, vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py
(vllm/model_executor/layers/kda.py before #41126), imports fused_recurrent_kda (decode) and
chunk_kda_with_fused_gate (prefill; chunk_kda before #43667) by name. The state pool is
[slots, HV, V, K], a view into vLLM's paged mamba cache whose slots sit a page apart (the conv states
share the page): the kernels take it as it is (docs/semantics.md, "Strided pools"). Slot 0 is vLLM's null
block (NULL_BLOCK_ID): its kernel neither reads nor writes an index <= 0, which null_slot0=True gives here.

The argument mapping is fla.py's (vLLM's vendored arguments are a subset of fla's, with vLLM's fixed
choices: state_v_first, no gate or beta activation in the recurrent kernel). This module adds what is
vLLM's own: its signatures, slot 0, the decode batch padded for CUDA graphs, the fallback, the rebinding.
Nothing here imports vllm until install() runs.
"""
from __future__ import annotations

import collections
import importlib
import inspect
import os
import sys

import torch

from . import fla as _fla
from .fla import Refused

ENV_VAR = "FLASHKDA_EXT_VLLM"       # "1": install() when vLLM loads its general plugins (pyproject entry point)
#: where vLLM keeps its vendored KDA ops, newest first (install() uses the first that imports)
OPS_MODULES = (
    "vllm.third_party.flash_linear_attention.ops.kda",    # since vLLM #48500 (2026-07-16)
    "vllm.model_executor.layers.fla.ops.kda",             # before
)

#: calls per entry point: STATS[name, "served"] ran flashkda_ext, STATS[name, "fell_back"] ran vLLM's original
STATS: collections.Counter = collections.Counter()
#: fallbacks per (entry point, reason)
REASONS: collections.Counter = collections.Counter()

# ---------------------------------------------------------------------------------------------
# vLLM's call -> fla's keyword arguments (fla.py plans and validates those)


def _contiguous(x):
    """vLLM's wrappers call .contiguous() on their inputs. On the verdict's pass too: one copy the first
    time a call signature is seen (fla.py's checks need real devices), none once the verdict is memoized."""
    return x if x is None or x.is_contiguous() else x.contiguous()


def _recurrent_form(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens,
                    ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel, contiguous):
    """fla's fused_recurrent_kda_fwd arguments for a vLLM fused_recurrent_kda(_fwd) call, and the number of
    leading tokens served when vLLM padded the decode batch (else None; then the caller passes out=, a view
    of the padded output, which validates as the op's own output would)."""
    if ssm_state_indices is None or not inplace_final_state:
        # without indices vLLM's kernel keeps the state after every token ([T, HV, V, K]), not a final state
        raise Refused("flashkda_ext serves vLLM's fused_recurrent_kda on the state pool only "
                      "(ssm_state_indices given, inplace_final_state=True)")
    if beta is None or initial_state is None:
        raise Refused("flashkda_ext needs beta and initial_state (the state pool)")
    # vLLM's paged mamba cache keeps a slot's conv and recurrent states in one page, so the pool is a view
    # whose slots sit a page apart: the kernels take it as it is (validation refuses, with its reason, a
    # pool outside docs/semantics.md "Strided pools": inner dims not dense, a padded slot stride not a
    # multiple of 16 bytes).
    if contiguous:
        q, k, v, g, beta = (_contiguous(x) for x in (q, k, v, g, beta))
    served = None
    B, T = q.shape[0], q.shape[1]
    if ssm_state_indices.dim() == 1 and cu_seqlens is not None and B == 1:
        N = cu_seqlens.shape[0] - 1
        # A decode batch under a CUDA graph: the layer passes the N real requests in cu_seqlens while q holds
        # the graph's padded token count and ssm_state_indices its padded batch; vLLM's kernel runs the N.
        if T > N:
            q, k, v, g, beta = (x[:, :N] for x in (q, k, v, g, beta))
            served = N
        if ssm_state_indices.shape[0] > N:
            ssm_state_indices = ssm_state_indices[:N]
    form = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state, inplace_final_state=True,
                cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=True, use_gate_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, null_slot0=True)
    return form, served


def _check_recurrent(**call):
    form, _ = _recurrent_form(**call)
    _fla._check_fused_recurrent(**form)


def _serve_recurrent(**call):
    form, served = _recurrent_form(**call)
    if served is None:
        return _fla.serve_fused_recurrent_kda_fwd(**form)
    q, v = call["q"], call["v"]
    # rows past the N requests are left unwritten, as vLLM's kernel leaves them (the layer drops them)
    o = torch.empty((1, q.shape[1], v.shape[2], v.shape[3]), dtype=v.dtype, device=q.device)
    form["out"] = o[:, :served]
    _fla.serve_fused_recurrent_kda_fwd(**form)
    return o, call["initial_state"]


def _chunk_form(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, A_log=None, g_bias=None, fused_gate=False):
    """fla's chunk_kda arguments for a vLLM chunk_kda / chunk_kda_with_fused_gate call. vLLM's fused gate is
    fla's softplus gate in the kernel (-exp(A_log) * softplus(raw_g + g_bias), threshold 20); its beta is
    activated; its state is [N, HV, V, K]."""
    q, k, v, g, beta, initial_state = (_contiguous(x) for x in (q, k, v, g, beta, initial_state))
    form = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, state_v_first=True, use_beta_sigmoid_in_kernel=False,
                use_gate_in_kernel=fused_gate)
    if fused_gate:
        form.update(A_log=A_log, dt_bias=g_bias)
    return form


def _check_chunk(**call):
    _fla._check_chunk_kda(**_chunk_form(**call))


def _serve_chunk(**call):
    return _fla.serve_chunk_kda(**_chunk_form(**call))


def _count_fallback(entry: str, reason: str) -> None:
    STATS[entry, "fell_back"] += 1
    REASONS[entry, reason] += 1


def _claimed(entry: str, check, call: dict) -> bool:
    ok, reason = _fla._verdict("vllm." + entry, check, (), call)
    if ok:
        STATS[entry, "served"] += 1
    else:
        _count_fallback(entry, reason)
    return ok


# ---------------------------------------------------------------------------------------------
# the adapters: vLLM's signatures (vLLM 638d6e97), flashkda_ext when claimed, else the original.
# Arguments vLLM's wrappers swallow (**kwargs) are ignored here too and passed on to the original.


def _adapt_fused_recurrent_kda_fwd(original):
    def fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, inplace_final_state=True, cu_seqlens=None,
                                ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False):
        call = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                    inplace_final_state=inplace_final_state, cu_seqlens=cu_seqlens,
                    ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if _claimed("fused_recurrent_kda_fwd", _check_recurrent, dict(call, contiguous=False)):
            return _serve_recurrent(**call, contiguous=False)
        return original(**call)
    return fused_recurrent_kda_fwd


def _adapt_fused_recurrent_kda(original):
    def fused_recurrent_kda(q, k, v, g, beta=None, scale=None, initial_state=None, inplace_final_state=True,
                            use_qk_l2norm_in_kernel=True, cu_seqlens=None, ssm_state_indices=None, **kwargs):
        call = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                    inplace_final_state=inplace_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices)
        # vLLM's wrapper raises for a batch of several rows with cu_seqlens: the original says so
        if cu_seqlens is None or q.shape[0] == 1:
            mapped = dict(call, num_accepted_tokens=None, contiguous=True)   # the wrapper never passes one
            if _claimed("fused_recurrent_kda", _check_recurrent, mapped):
                return _serve_recurrent(**mapped)
        else:
            _count_fallback("fused_recurrent_kda", "cu_seqlens with a batch of several rows (vLLM raises)")
        return original(**call, **kwargs)
    return fused_recurrent_kda


def _adapt_chunk_kda(original):
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        call = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    cu_seqlens=cu_seqlens)
        if _claimed("chunk_kda", _check_chunk, call):
            return _serve_chunk(**call)
        return original(**call, **kwargs)
    return chunk_kda


def _adapt_chunk_kda_with_fused_gate(original):
    def chunk_kda_with_fused_gate(q, k, v, raw_g, beta, A_log, g_bias, scale=None, initial_state=None,
                                  output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        call = dict(q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    cu_seqlens=cu_seqlens)
        mapped = dict(call, g=raw_g, A_log=A_log, g_bias=g_bias, fused_gate=True)
        if _claimed("chunk_kda_with_fused_gate", _check_chunk, mapped):
            return _serve_chunk(**mapped)
        return original(raw_g=raw_g, A_log=A_log, g_bias=g_bias, **call, **kwargs)
    return chunk_kda_with_fused_gate


#: vLLM's name -> the adapter factory (fused_kda_gate and the causal conv calls stay vLLM's: docs/integrations.md)
ADAPTERS = {
    "fused_recurrent_kda": _adapt_fused_recurrent_kda,
    "fused_recurrent_kda_fwd": _adapt_fused_recurrent_kda_fwd,
    "chunk_kda": _adapt_chunk_kda,
    "chunk_kda_with_fused_gate": _adapt_chunk_kda_with_fused_gate,
}

# ---------------------------------------------------------------------------------------------
# install / uninstall: rebinding names in vLLM's modules

_ACTIVE: dict = {}      # name -> (original, adapter) while installed


def _params(fn) -> list:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def _vllm_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "vllm" or name.startswith("vllm."))]


def _rebind(old, new) -> list:
    """Set every vLLM module attribute that is `old` (by identity) to `new`; the module names touched."""
    touched = []
    for module in _vllm_modules():
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                touched.append(f"{module.__name__}.{attr}")
    return touched


def _ops_module():
    errors = []
    for name in OPS_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError("flashkda_ext.integrations.vllm.install: vLLM's KDA ops module is not importable (is vllm "
                      "installed?); tried " + "; ".join(errors))


def install() -> dict:
    """Rebind vLLM's KDA ops (ADAPTERS' names) to flashkda_ext adapters in every loaded vllm module that holds
    them (the ops module and the layers that imported them by name; a layer imported later reads the
    rebound name from the ops module). Idempotent. Returns {name: [module.attr rebound]} or, for a name whose
    vLLM signature is not the one adapted, {name: "skipped: ..."}. Raises ImportError when vllm (its KDA ops
    module) does not import."""
    ops = _ops_module()
    report = {}
    for name, make in ADAPTERS.items():
        current = getattr(ops, name, None)
        if current is None:
            continue                        # an older vLLM without this op
        if name in _ACTIVE:
            original, adapter = _ACTIVE[name]
            report[name] = _rebind(original, adapter)   # modules loaded since the first install
            continue
        adapter = make(current)
        if _params(current) != _params(adapter):
            report[name] = (f"skipped: vLLM's signature {inspect.signature(current)} is not the adapted "
                            f"{inspect.signature(adapter)}")
            continue
        adapter.__wrapped__ = current
        adapter.__doc__ = f"flashkda_ext adapter of vLLM's {name}; falls back to the original (__wrapped__)."
        _ACTIVE[name] = (current, adapter)
        report[name] = _rebind(current, adapter)
    return report


def uninstall() -> dict:
    """Put vLLM's originals back wherever an adapter is bound (also in modules imported after install()).
    Returns {name: [module.attr restored]}; a no-op when nothing is installed."""
    report = {name: _rebind(adapter, original) for name, (original, adapter) in _ACTIVE.items()}
    _ACTIVE.clear()
    return report


def installed() -> bool:
    return bool(_ACTIVE)


def install_from_env():
    """install() when FLASHKDA_EXT_VLLM=1, else nothing (None). The pyproject entry point in vLLM's
    'vllm.general_plugins' group calls it, so vLLM runs it in every process (engine core and workers)."""
    if os.environ.get(ENV_VAR, "0") not in ("", "0"):
        return install()
    return None
