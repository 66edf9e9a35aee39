"""How SGLang 0.5.23 selects flashkda_ext: its own plugin framework and its own backend flags.

SGLang loads every `sglang.srt.plugins` entry point early in each of its processes (sglang/srt/plugins:
load_plugins; SGLANG_PLUGINS restricts which) and offers `add_linear_attn_kernel_backend_choices` for
out-of-tree kernel names. flashkda_ext's entry point (pyproject.toml) is `plugin()`:

1. adds the name "flashkda_ext" to --linear-attn-{,decode-,prefill-,verify-}backend's choices;
2. hooks (HookRegistry, AROUND) resolve_linear_attn_backends: when a runner's choice resolves to
   LinearAttnKernelBackend.CUSTOM (the closed enum's answer to any out-of-tree name), it hooks
   KDAKernelDispatcher.__init__ (once; imported only then), which
3. builds the dispatcher with "triton" in each phase named "flashkda_ext" (SGLang's own kernel is the
   fallback and every other branch stays SGLang's), then puts a FlashKDAExtKernel in those phases.

A phase named anything else is left to SGLang (a CUSTOM name that is not ours still raises there). The
safe gate goes through the dispatcher's own checks: verify by supports_safe_gate_verify, extend by
supports_safe_gate, decode by forward_decode's packed route (supports_packed_decode_safe_gate); the
unpacked KDAKernelDispatcher.decode refuses lower_bound for any kernel but Triton and is not reached.

install() / uninstall() do steps 1-3 in this process without the plugin machinery (tests, notebooks).
"""
from __future__ import annotations

import functools

BACKEND_NAME = "flashkda_ext"
_KDA = "sglang.srt.layers.attention.linear.kda_backend"
_UTILS = "sglang.srt.layers.attention.linear.utils"
_PHASES = ("decode", "prefill", "verify")
_KERNEL_ATTR = {"decode": "decode_kernel", "prefill": "extend_kernel", "verify": "verify_kernel"}
_installed = {}


def _configured_names() -> dict:
    """The backend name each phase was configured with, read where resolve_linear_attn_backends reads it."""
    from sglang.srt.runtime_context import get_exec
    m = get_exec().mamba
    return {"decode": m.linear_attn_decode_backend or m.linear_attn_backend,
            "prefill": m.linear_attn_prefill_backend or m.linear_attn_backend,
            "verify": m.linear_attn_verify_backend}


def _dispatcher_init(original, self, decode_backend, prefill_backend, verify_backend):
    from .kernel import FlashKDAExtKernel
    given = dict(zip(_PHASES, (decode_backend, prefill_backend, verify_backend)))
    ours = set()
    if any(b.is_custom() for b in given.values()):
        names = _configured_names()
        ours = {p for p, b in given.items() if b.is_custom() and names[p] == BACKEND_NAME}
    if not ours:
        return original(self, decode_backend, prefill_backend, verify_backend)
    triton = type(decode_backend)("triton")
    original(self, *(triton if p in ours else given[p] for p in _PHASES))
    kernel = FlashKDAExtKernel(fallback=self.triton_kernel)
    for p in ours:
        setattr(self, _KERNEL_ATTR[p], kernel)
    # as the dispatcher records them (its own rules then see CUSTOM, not triton)
    self.prefill_backend, self.verify_backend = prefill_backend, verify_backend
    self.supports_packed_decode = getattr(self.decode_kernel, "supports_packed_decode", False)
    self.supports_packed_decode_safe_gate = getattr(self.decode_kernel, "supports_packed_decode_safe_gate", False)


def _resolve_around(original, *args, **kwargs):
    backends = original(*args, **kwargs)
    if any(b.is_custom() for b in (backends.decode, backends.prefill, backends.verify)):
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        target = _KDA + ".KDAKernelDispatcher.__init__"
        if target not in HookRegistry._patched:
            HookRegistry.register(target, _dispatcher_init, HookType.AROUND)
            HookRegistry.apply_hooks()
    return backends


def _add_choice() -> bool:
    """Add the name to SGLang's choices; True when this call added it."""
    from sglang.srt.arg_groups.choices import LINEAR_ATTN_KERNEL_BACKEND_CHOICES, add_linear_attn_kernel_backend_choices
    if BACKEND_NAME in LINEAR_ATTN_KERNEL_BACKEND_CHOICES:
        return False
    add_linear_attn_kernel_backend_choices([BACKEND_NAME])
    return True


def plugin() -> None:
    """The `sglang.srt.plugins` entry point: SGLang calls it in each process, then applies the hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    _add_choice()
    HookRegistry.register(_UTILS + ".resolve_linear_attn_backends", _resolve_around, HookType.AROUND)


def install() -> None:
    """Steps 1-3 in this process, without SGLang's plugin loader; undone by uninstall()."""
    import importlib
    if _installed:
        return
    added = _add_choice()
    cls = importlib.import_module(_KDA).KDAKernelDispatcher
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, decode_backend, prefill_backend, verify_backend):
        _dispatcher_init(original, self, decode_backend, prefill_backend, verify_backend)

    cls.__init__ = __init__
    _installed.update(cls=cls, init=original, added=added)


def uninstall() -> None:
    """Undo install(): the dispatcher's own __init__ and the choice list as they were."""
    if not _installed:
        return
    from sglang.srt.arg_groups.choices import LINEAR_ATTN_KERNEL_BACKEND_CHOICES
    _installed["cls"].__init__ = _installed["init"]
    if _installed["added"]:
        LINEAR_ATTN_KERNEL_BACKEND_CHOICES.remove(BACKEND_NAME)
    _installed.clear()
