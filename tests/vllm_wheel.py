"""The real vLLM 0.34.0 code for the conformance tests (tests/test_integrations_vllm.py), without installing
vLLM or its dependencies.

fetch() finds the pinned wheel (a local copy named by FLASHKDA_EXT_ENGINE_WHEELS, else
`pip download --no-deps vllm==0.34.0` into the ignored cache .cache/engines/) and extracts only the files
under EXTRACT. load() then imports the real modules by path under their own names: the parent packages
are bare package modules pointing into the extracted tree (so `vllm/__init__.py` and the model packages'
heavy __init__s never run) and only these imports are stubbed:

- `vllm.platforms.current_platform`: a CPU-only platform (is_cuda / is_rocm / ... False, no device
  capability; the ops modules ask at import and at launch) and `vllm_version_matches_substr` (False);
- `vllm.logger.init_logger`: the standard logging module;
- `vllm.model_executor.custom_op.CustomOp` (only for the vendored module's FusedRMSNormGated class
  definition, a norm these tests never run): an nn.Module whose register() returns the class unchanged;
- the package __init__s on the way (`vllm`, `vllm.models.kimi_k3`, fla's `ops`, ...): bare packages, so
  only the modules below them that the ops import run.

Everything else the KDA ops modules import is vLLM's own code (vllm.triton_utils falls back to its own
Triton placeholders where Triton is not installed, as here: the Triton kernels are defined, never launched).

Without the wheel: under CI=true the caller fails (require()); elsewhere it skips with the reason.
"""
from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

VERSION = "0.34.0"
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "engines"
#: the files the tests import or read (prefixes inside the wheel)
EXTRACT = (
    "vllm/models/kimi_k3/nvidia/ops/third_party/kda/",
    "vllm/third_party/flash_linear_attention/",
    "vllm/triton_utils/",
    "vllm/utils/math_utils.py",
    "vllm/utils/torch_version.py",
    "vllm/utils/platform_utils.py",
    "vllm/utils/torch_utils.py",
    "vllm/utils/gpu_sync_debug.py",
    "vllm/envs.py",
    "vllm/model_executor/warmup/",
    "vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py",
    "vllm/model_executor/layers/mamba/mamba_utils.py",
    "vllm/models/kimi_k3/nvidia/kda.py",
    "vllm/models/kimi_k3/amd/kda.py",
    "vllm/model_executor/models/bailing_moe_v3.py",
)
K3_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
VENDORED_OPS = "vllm.third_party.flash_linear_attention.ops.kda"


def _wheel() -> Path | None:
    pattern = f"vllm-{VERSION}-*.whl"
    for folder in filter(None, (os.environ.get("FLASHKDA_EXT_ENGINE_WHEELS"), str(CACHE))):
        found = sorted(Path(folder).glob(pattern))
        if found:
            return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                          "--dest", str(CACHE), f"vllm=={VERSION}"], capture_output=True, text=True)
    found = sorted(CACHE.glob(pattern))
    if not found:
        raise RuntimeError(f"pip download vllm=={VERSION} failed: {res.stderr.strip()[-400:]}")
    return found[0]


def fetch() -> Path:
    """The extracted tree (its root holds vllm/); extraction is done once per wheel."""
    wheel = _wheel()
    tree = CACHE / f"vllm-{VERSION}-tree"
    stamp = tree / ".complete"
    if not stamp.exists():
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(EXTRACT) and name.endswith(".py"):
                    z.extract(name, tree)
        stamp.write_text(wheel.name)
    return tree


def require() -> Path:
    """fetch(), or fail under CI=true / skip elsewhere with the reason."""
    try:
        return fetch()
    except Exception as e:  # noqa: BLE001  (no network, no pip: the reason is reported either way)
        msg = f"the vLLM {VERSION} wheel is not available: {e}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def source(tree: Path, module: str) -> str:
    return (tree / (module.replace(".", "/") + ".py")).read_text()


class _Platform:
    """vllm.platforms.current_platform as a CPU-only host answers it (no CUDA, no ROCm, no PDL): the ops
    modules ask at import (device selection, ROCm tuning tables) and at launch (never reached on CPU)."""

    def _no(self, *args, **kwargs) -> bool:
        return False

    is_cuda = is_cuda_alike = is_rocm = is_xpu = is_arch_support_pdl = _no
    is_pin_memory_available = is_confidential_compute = _no
    has_device_capability = is_device_capability = is_device_capability_family = _no

    def get_device_capability(self, *args, **kwargs):
        return None

    def get_device_name(self, *args, **kwargs) -> str:
        return "cpu"


_LOADED: dict = {}      # the vllm modules of the first load(): vLLM registers torch types at import, once


def load(tree: Path, monkeypatch) -> types.SimpleNamespace:
    """The real K3 ops package and vLLM's vendored fla kda module from `tree`, imported once per process and
    put into sys.modules for one test (monkeypatch takes every vllm module out again afterwards).
    Returns SimpleNamespace(k3=..., vendored=...)."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    if not _LOADED:
        _import(tree)
        _LOADED.update((n, m) for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm."))
        for name in _LOADED:
            del sys.modules[name]
    for name, module in _LOADED.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(k3=_LOADED[K3_OPS], vendored=_LOADED[VENDORED_OPS])


def _import(tree: Path) -> None:
    def package(name: str):
        mod = types.ModuleType(name)
        mod.__path__ = [str(tree / name.replace(".", "/"))]
        sys.modules[name] = mod

    for name in ("vllm", "vllm.utils", "vllm.model_executor", "vllm.models", "vllm.models.kimi_k3",
                 "vllm.models.kimi_k3.nvidia", "vllm.models.kimi_k3.nvidia.ops",
                 "vllm.models.kimi_k3.nvidia.ops.third_party", "vllm.third_party",
                 "vllm.third_party.flash_linear_attention", "vllm.third_party.flash_linear_attention.ops"):
        package(name)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _Platform()
    platforms.vllm_version_matches_substr = lambda substr: False
    sys.modules["vllm.platforms"] = platforms
    logger = types.ModuleType("vllm.logger")
    logger.init_logger = logging.getLogger
    sys.modules["vllm.logger"] = logger
    custom_op = types.ModuleType("vllm.model_executor.custom_op")

    class CustomOp(torch.nn.Module):
        @classmethod
        def register(cls, name):
            return lambda op_cls: op_cls

    custom_op.CustomOp = CustomOp
    sys.modules["vllm.model_executor.custom_op"] = custom_op
    importlib.import_module(K3_OPS)
    importlib.import_module(VENDORED_OPS)
