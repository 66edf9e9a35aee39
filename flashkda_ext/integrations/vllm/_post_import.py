"""Run a callback right after a named module is first imported.

Why: vLLM runs install() from its general-plugin hook, early in every process, but imports a model's layer module
(K3's vllm/models/kimi_k3/nvidia/kda.py) only when it builds that model. Importing the layer module from the hook
would pull vLLM's model stack in at plugin time, so install() waits for vLLM's own import instead: a finder at the
front of sys.meta_path lets the other finders locate the module, then wraps that one spec's exec_module so the
callback runs on the module once its body has executed (the module's loader, spec and source stay the real ones).
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable, Dict


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: Dict[str, Callable] = {}
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        callback = self.callbacks.get(fullname)
        if callback is None or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.active = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            if self.callbacks.pop(fullname, None) is callback:
                callback(module)
        loader.exec_module = exec_module      # this spec's loader instance only
        return spec


_FINDER = _Finder()


def when_imported(name: str, callback: Callable) -> None:
    """callback(module) right after `name`'s first import; ValueError where it is imported already (the caller
    then has the module)."""
    if sys.modules.get(name) is not None:
        raise ValueError(f"{name} is imported already")
    _FINDER.callbacks[name] = callback
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def cancel(name: str) -> None:
    """Forget a callback that has not run; the finder leaves sys.meta_path when none is left."""
    _FINDER.callbacks.pop(name, None)
    if not _FINDER.callbacks and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def pending() -> list:
    return sorted(_FINDER.callbacks)
