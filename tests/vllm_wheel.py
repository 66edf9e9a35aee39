"""The real vLLM 0.34.0 KDA code for the conformance tests (tests/test_integrations_vllm.py), without installing
vLLM or its dependencies: scripts/prepare_vllm_engine.py extracts the pinned wheel's files (a local copy named by
FLASHKDA_EXT_ENGINE_WHEELS, else `pip download --no-deps vllm==0.34.0` into the ignored .cache/engines/) with
its few stubs (listed there: vllm.platforms answered from torch, vllm.logger, CustomOp, empty package
__init__s); load() imports the real modules from that folder. Triton is not installed here: vllm.triton_utils
falls back to its own placeholders, so the Triton kernels are defined and never launched.

Without the wheel: under CI=true require() fails the test; elsewhere it skips with the reason.
"""
from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import prepare_vllm_engine as engine  # noqa: E402

K3_OPS, VENDORED_OPS = engine.K3_OPS, engine.VENDORED_OPS


def _wheel() -> Path:
    return engine.find_wheel()


def fetch() -> Path:
    """The prepared folder (its root holds vllm/)."""
    return engine.prepare(_wheel(), engine.CACHE / f"vllm-{engine.VERSION}-tree")


def require() -> Path:
    """fetch(), or fail under CI=true / skip elsewhere with the reason."""
    try:
        return fetch()
    except Exception as e:  # noqa: BLE001  (no network, no pip: the reason is reported either way)
        msg = f"the vLLM {engine.VERSION} wheel is not available: {e}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def source(tree: Path, module: str) -> str:
    return (tree / (module.replace(".", "/") + ".py")).read_text()


_LOADED: dict = {}      # the vllm modules of the first load(): vLLM registers torch types at import, once


def load(tree: Path, monkeypatch) -> types.SimpleNamespace:
    """The real K3 ops package and vLLM's vendored fla kda module from `tree`, imported once per process and
    put into sys.modules for one test (monkeypatch takes every vllm module out again afterwards).
    Returns SimpleNamespace(k3=..., vendored=...)."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    if not _LOADED:
        sys.path.insert(0, str(tree))
        try:
            importlib.import_module(K3_OPS)
            importlib.import_module(VENDORED_OPS)
        finally:
            sys.path.remove(str(tree))
        _LOADED.update((n, m) for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm."))
        for name in _LOADED:
            del sys.modules[name]
    for name, module in _LOADED.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(k3=_LOADED[K3_OPS], vendored=_LOADED[VENDORED_OPS])


def recorder(original, answer):
    """(fn, seen): a stand-in for vLLM's `original` with its signature that records each call's keywords in `seen`
    and returns `answer` (the fallback tests: vLLM's kernel itself cannot run here)."""
    import inspect
    seen = []

    def fn(**kw):
        seen.append(kw)
        return answer
    fn.__signature__ = inspect.signature(original)
    return fn, seen


# the fixtures the vLLM conformance test files share (imported by name into each)
@pytest.fixture(scope="module")
def tree():
    """The prepared folder of the pinned wheel (require())."""
    return require()


@pytest.fixture
def real(tree, monkeypatch):
    """The real K3 ops and vendored modules (load()); the adapters uninstalled after the test."""
    from flashkda_ext.integrations import vllm as fkda_vllm
    ns = load(tree, monkeypatch)
    yield ns
    fkda_vllm.uninstall()


@pytest.fixture
def real_fn(tree):
    """K3's `_flashkda_prefill` compiled from the wheel's kda.py (scripts/vllm_step_metadata.py): the original the
    k3_layer adapter wraps (FlashKDA itself loads only on a CUDA machine)."""
    import vllm_step_metadata
    return vllm_step_metadata.flashkda_prefill(tree)


@pytest.fixture
def seen(monkeypatch):
    """The keyword arguments of every kda_prefill call the adapters make (the op itself still runs)."""
    from flashkda_ext import ops
    calls, real_op = [], ops.kda_prefill

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real_op(*args, **kwargs)
    monkeypatch.setattr(ops, "kda_prefill", recording)
    return calls
