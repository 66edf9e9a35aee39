"""vLLM's KDA ops rebound to flashkda_ext adapters (pinned: vLLM 0.34.0; docs/integrations.md, "vLLM").

    import flashkda_ext.integrations.vllm as fkda_vllm
    fkda_vllm.install()          # or FLASHKDA_EXT_VLLM=1 in the environment (a vLLM general plugin)
    ...
    fkda_vllm.uninstall()        # the originals again

Patch points (PATCH_POINTS), each name rebound wherever a loaded vllm module holds it:
- k3 (k3.py): vllm.models.kimi_k3.nvidia.ops.third_party.kda, read at call time by both Kimi KDA layers
  (Kimi-Linear's shared GDN layer and K3's own): fused_recurrent_kda_packed_decode, chunk_kda_with_fused_gate,
  fused_recurrent_kda. The AMD copy (kimi_k3.amd) is left alone: the kernels are CUDA sm_90a and CPU.
- vendored (vendored.py): vllm.third_party.flash_linear_attention.ops.kda, still called by bailing_moe_v3:
  fused_recurrent_kda_fwd, chunk_kda, fused_recurrent_kda.
Opt-in (OPT_IN_POINTS, each when its environment variable is 1):
- k3_layer (k3_layer.py; FLASHKDA_EXT_VLLM_K3_PREFILL=1): vllm.models.kimi_k3.nvidia.kda's _flashkda_prefill,
  K3's own prefill on an H200 (its "auto" prefill backend resolves to vLLM's FlashKDA there).
- k3_native (k3_native.py; FLASHKDA_EXT_VLLM_K3_NATIVE_DECODE=1): vllm._custom_ops.fused_kda_decode, K3's native
  fused decode (conv, KDA step, gated RMSNorm; its "auto" decode backend at 12 / 24 / 48 / 96 heads on sm_90).

Every adapter has vLLM's signature of its name (install() checks it and skips a name whose signature differs),
serves a call exactly or runs vLLM's original with the reason counted (STATS / REASONS, per call site
"<patch point>.<name>"), and falls back on any argument it does not know. The chunk prefills count in
ROUTED how their route knew the longest sequence (host_lengths.py). Nothing here imports vllm until
install() runs.
"""
from __future__ import annotations

import importlib
import inspect
import sys

from ... import switches
from . import _post_import, k3, k3_layer, k3_native, vendored
from ._common import REASONS, ROUTED, STATS, Refused, serve_or_fall_back

__all__ = ["install", "uninstall", "installed", "install_from_env", "adapter_for", "STATS", "REASONS", "ROUTED",
           "Refused", "PATCH_POINTS"]

ENV_VAR = "FLASHKDA_EXT_VLLM"       # "1": install() when vLLM loads its general plugins (pyproject entry point)
#: (patch point, vLLM module whose names are rebound, {name: adapter body})
PATCH_POINTS = (
    ("k3", "vllm.models.kimi_k3.nvidia.ops.third_party.kda", k3.SERVE),
    ("vendored", "vllm.third_party.flash_linear_attention.ops.kda", vendored.SERVE),
)

#: patch points install() takes only when their environment variable is 1: (point, module, bodies, variable)
OPT_IN_POINTS = (
    ("k3_layer", "vllm.models.kimi_k3.nvidia.kda", k3_layer.SERVE, k3_layer.ENV_VAR),
    ("k3_native", "vllm._custom_ops", k3_native.SERVE, k3_native.ENV_VAR),
)

_ACTIVE: dict = {}      # call site -> (original, adapter) while installed


def _opted_in(variable: str) -> bool:
    # as every on/off variable is read (flashkda_ext.switches): a value that is no switch is a ValueError naming it
    return switches.env_switch(variable, False, on="install this opt-in adapter", off="leave vLLM's call")


def _params(fn) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _adapter(site: str, serve, original):
    """A function with `serve`'s (= vLLM's) signature: flashkda_ext when it serves the call, else original."""
    sig = inspect.signature(serve)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def adapter(*args, **kwargs):
        if args:    # the layers pass keywords; a positional call is bound by the signature
            bound = sig.bind_partial(*args, **kwargs).arguments
            kwargs = {**{k: v for k, v in bound.items() if k != var_kw}, **bound.get(var_kw, {})}
        return serve_or_fall_back(site, serve, original, kwargs)

    adapter.__signature__ = inspect.signature(original)     # the same parameters (install() checked)
    adapter.__name__ = adapter.__qualname__ = original.__name__
    adapter.__module__ = __name__
    adapter.__wrapped__ = original
    adapter.__doc__ = f"flashkda_ext adapter of vLLM's {site}; falls back to the original (__wrapped__)."
    return adapter


def adapter_for(site: str, original):
    """The adapter of a call site ("k3.fused_recurrent_kda_packed_decode", ...) around vLLM's `original` (what
    install() binds in vLLM's modules); ValueError when the site is unknown or the signature is not the adapted one."""
    point, _, name = site.partition(".")
    points = [(p, b) for p, _, b in PATCH_POINTS] + [(p, b) for p, _, b, _ in OPT_IN_POINTS]
    bodies = dict(points).get(point, {})
    if name not in bodies:
        raise ValueError(f"site: expected one of {[f'{p}.{n}' for p, b in points for n in b]}, got {site!r}")
    if _params(original) != _params(bodies[name]):
        raise ValueError(f"original: vLLM's signature {inspect.signature(original)} is not the adapted "
                         f"{inspect.signature(bodies[name])}")
    return _adapter(site, bodies[name], original)


def _vllm_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "vllm" or name.startswith("vllm."))]


def _rebind(old, new) -> list:
    """Set every vLLM module attribute that is `old` (by identity) to `new`; the attributes touched."""
    touched = []
    for module in _vllm_modules():
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                touched.append(f"{module.__name__}.{attr}")
    return touched


def _bind(point: str, module_name: str, ops, bodies: dict, report: dict) -> None:
    """Rebind each name of `bodies` that module `ops` holds to its adapter, wherever a loaded vllm module holds
    it; report[site]: the attributes rebound, or "skipped: why"."""
    for name in bodies:
        site = f"{point}.{name}"
        if site in _ACTIVE:
            original, adapter = _ACTIVE[site]
            report[site] = _rebind(original, adapter)
            continue
        current = getattr(ops, name, None)
        if current is None:
            report[site] = f"skipped: {module_name} has no {name}"
            continue
        try:
            adapter = adapter_for(site, current)
        except ValueError as e:
            report[site] = f"skipped: {e}"
            continue
        _ACTIVE[site] = (current, adapter)
        report[site] = _rebind(current, adapter)


#: what install() did for the opt-in points whose module vLLM imported after it: {site: report}
DEFERRED: dict = {}


def install() -> dict:
    """Rebind the names of PATCH_POINTS to adapters in every loaded vllm module that holds them. Idempotent
    (a second call rebinds modules loaded since). Returns {site: [module.attr rebound]} or {site: "skipped:
    why"} (a signature that is not the adapted one, a module that does not import). Raises ImportError when
    no patch point's module imports (vllm not installed). An opted-in point (OPT_IN_POINTS) whose module is not
    imported yet is not imported here: it is rebound right after vLLM imports it (report: "deferred: ...";
    what was then rebound lands in DEFERRED)."""
    import torch
    if torch.version.hip is not None:
        # vLLM's ROCm layers read the kimi_k3.amd ops; bailing_moe_v3 would reach CUDA-only kernels
        return {point: "skipped: a ROCm build of torch (the kernels are CUDA sm_90a and CPU)"
                for point, _, _ in PATCH_POINTS}
    report, errors = {}, []
    for point, module_name, bodies in PATCH_POINTS:
        try:
            ops = importlib.import_module(module_name)
        except ImportError as e:
            errors.append(f"{module_name}: {e}")
            report[point] = f"skipped: {module_name} does not import ({e})"
            continue
        _bind(point, module_name, ops, bodies, report)
    if len(errors) == len(PATCH_POINTS):
        raise ImportError("flashkda_ext.integrations.vllm.install: no vLLM KDA ops module imports (is vllm "
                          "installed?); " + "; ".join(errors))
    for point, module_name, bodies, variable in OPT_IN_POINTS:
        if not _opted_in(variable):
            continue
        module = sys.modules.get(module_name)
        if module is not None:
            _bind(point, module_name, module, bodies, report)
        else:
            _post_import.when_imported(
                module_name, lambda m, p=point, n=module_name, b=bodies: _bind(p, n, m, b, DEFERRED))
            report[point] = f"deferred: rebound when vLLM imports {module_name}"
    return report


def uninstall() -> dict:
    """Put vLLM's originals back wherever an adapter is bound (also in modules imported after install()), and
    drop the opted-in points still waiting for their module. Returns {site: [module.attr restored]}; a no-op
    when nothing is installed."""
    report = {site: _rebind(adapter, original) for site, (original, adapter) in _ACTIVE.items()}
    _ACTIVE.clear()
    for _, module_name, _, _ in OPT_IN_POINTS:
        _post_import.cancel(module_name)
    return report


def installed() -> bool:
    return bool(_ACTIVE)


def install_from_env():
    """install() when FLASHKDA_EXT_VLLM=1, else nothing (None). The pyproject entry point in vLLM's
    'vllm.general_plugins' group calls it, so vLLM runs it in every process (engine core and workers)."""
    if switches.env_switch(ENV_VAR, False, on="install the adapters", off="leave vLLM as it is"):
        return install()
    return None
