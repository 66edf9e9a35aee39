"""SGLang's real KDA code from the pinned wheel (sglang 0.5.23), importable on a CPU without SGLang's deps.

`real_sglang()` finds the wheel (FLASHKDA_EXT_ENGINE_WHEELS, else the ignored cache .cache/engines/, else a
pinned `pip download --no-deps` into that cache), extracts only the files below, and imports them by path
under their real module names. Under CI=true a wheel that cannot be had fails the test; elsewhere it skips.

Real (from the wheel, unmodified):
  sglang/srt/layers/attention/linear/kda_backend.py   KDAKernelDispatcher, KDAAttnBackend (forward_decode,
                                                      forward_extend, _forward_target_verify)
  sglang/srt/layers/attention/linear/utils.py         LinearAttnKernelBackend, resolve_linear_attn_backends,
                                                      the verify row tables
  sglang/srt/layers/attention/linear/kernels/kernel_backend.py, kernels/kda_triton.py (TritonKDAKernel)
  sglang/srt/layers/attention/linear/kda_prefill_graph.py   KDAPrefillGraphMetadata (allocate, fill),
                                                      kda_extend_in_graph: the breakable prefill CUDA graph's extend
  sglang/srt/layers/attention/linear/kda_flashinfer_prefill_graph.py   FlashInferKDAPrefillGraph, which drives a
                                                      kernel's prefill_graph_wrapper_cls
  sglang/srt/plugins/__init__.py, plugins/hook_registry.py   the plugin loader and HookRegistry
  sglang/srt/arg_groups/choices.py                    the backend choice lists and their adders
  MambaAttnBackendBase._track_mamba_state_extend / _track_mamba_state_decode / _translate_mamba_indices, taken from
  sglang/srt/layers/attention/hybrid_linear_attn_backend.py (the rest of that module is not loaded).

Stubbed (heavy or GPU-only imports of those files; the code paths exercised read none of them but these):
  msgspec.Struct (LinearAttnBackends' base), sglang.srt.environ.envs (defaults), sglang.srt.runtime_context
  (get_exec & co: a mutable CONFIG namespace), sglang.srt.utils / utils.common (platform probes False,
  rank0_log silent), sglang.kernels.ops.mamba.causal_conv1d_triton (the conv: identity, so q|k|v is the
  layer's input split; the conv is SGLang's own kernel and not under test), kda_fused_decode (covered() is
  False: SGLang's K3 fused decode does not engage), the Triton KDA ops TritonKDAKernel calls (recording
  stubs: TRITON_CALLS gets (name, kwargs), they return ("triton", name)), kda_flashinfer, radix_linear_attention,
  cuda_graph_config, forward_batch_info, model_runner (names only); for kda_prefill_graph: triton (only its cdiv,
  where triton is not installed: (a + b - 1) // b), kda_prefill_track and prefill_track_metadata (the prefix-cache
  track path of a captured extend: names only, not exercised), the conv's CAUSAL_CONV1D_FWD_BLOCK_M (8, the wheel's
  value). On a CPU, torch.Tensor.pin_memory raises (no accelerator): tests that run KDAPrefillGraphMetadata.fill
  make it the identity (page-locking changes no value).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import sys
import types
import zipfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import engine_wheels  # noqa: E402

VERSION = "0.5.23"
ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = engine_wheels.CACHE
PIP_DOWNLOAD = engine_wheels.pip_download("sglang", VERSION)
LINEAR = "sglang/srt/layers/attention/linear/"
FILES = (LINEAR + "kda_backend.py", LINEAR + "utils.py", LINEAR + "kernels/kernel_backend.py",
         LINEAR + "kernels/kda_triton.py", LINEAR + "kda_prefill_graph.py", LINEAR + "kda_flashinfer_prefill_graph.py",
         "sglang/srt/plugins/__init__.py", "sglang/srt/plugins/hook_registry.py",
         "sglang/srt/arg_groups/choices.py", "sglang/srt/layers/attention/hybrid_linear_attn_backend.py")
REAL_MODULES = ("sglang.srt.arg_groups.choices", "sglang.srt.plugins.hook_registry", "sglang.srt.plugins",
                "sglang.srt.layers.attention.linear.utils", "sglang.srt.layers.attention.linear.kernels.kernel_backend",
                "sglang.srt.layers.attention.linear.kernels.kda_triton",
                "sglang.srt.layers.attention.linear.kda_flashinfer_prefill_graph",
                "sglang.srt.layers.attention.linear.kda_prefill_graph",
                "sglang.srt.layers.attention.linear.kda_backend")

TRITON_CALLS: list = []
STUBBED: set = set()   # top-level modules stubbed here beside sglang's own (removed again by unload)
CONFIG = types.SimpleNamespace()


def find_wheel() -> pathlib.Path:
    """The pinned wheel, downloaded into the cache when missing; fails under CI=true, else skips, if absent."""
    try:
        return engine_wheels.find_wheel("sglang", VERSION, cache=CACHE, pip=PIP_DOWNLOAD)
    except RuntimeError as e:
        msg = f"sglang=={VERSION} wheel not available ({e}); set FLASHKDA_EXT_ENGINE_WHEELS or allow pip download"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def extract(wheel: pathlib.Path) -> pathlib.Path:
    dest = CACHE / f"sglang-{VERSION}"
    with engine_wheels.folder_lock(CACHE), zipfile.ZipFile(wheel) as z:   # a file another worker is writing is not read
        for name in FILES:
            target = dest / name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    return dest


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def _package(name: str) -> None:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            _module(sub, __path__=[])


def _load(root: pathlib.Path, name: str) -> types.ModuleType:
    rel = name.replace(".", "/")
    path = root / (rel + "/__init__.py") if (root / rel).is_dir() else root / (rel + ".py")
    _package(name.rpartition(".")[0])
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=None)
    mod = importlib.util.module_from_spec(spec)
    if path.name == "__init__.py":
        mod.__path__ = [str(path.parent)]
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class _Env:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class _Envs:
    DEFAULTS = {"SGLANG_KDA_PREFILL_GRAPH_MAX_SEQS": 32, "SGLANG_PLUGINS": "", "SGLANG_PLATFORM": "",
                "SGLANG_MAMBA_SSM_DTYPE": None}

    def __getattr__(self, name):
        return _Env(self.DEFAULTS.get(name, False))


def _recording(name):
    def op(*args, **kwargs):
        TRITON_CALLS.append((name, kwargs))
        return ("triton", name)
    return op


def _track_methods(root: pathlib.Path) -> dict:
    """MambaAttnBackendBase's track methods, compiled from the wheel's source (the class itself needs the
    whole mamba stack)."""
    src = (root / "sglang/srt/layers/attention/hybrid_linear_attn_backend.py").read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "MambaAttnBackendBase")
    wanted = [f for f in cls.body if isinstance(f, ast.FunctionDef)
              and f.name in ("_track_mamba_state_extend", "_track_mamba_state_decode", "_translate_mamba_indices")]
    module = ast.fix_missing_locations(ast.Module(body=wanted, type_ignores=[]))
    ns = {"Optional": __import__("typing").Optional, "torch": __import__("torch"), "ForwardBatch": object,
          "ForwardMetadata": object}
    exec(compile(module, "hybrid_linear_attn_backend.py", "exec"), ns)
    return {f.name: ns[f.name] for f in wanted}


def _stub(root: pathlib.Path) -> None:
    class Struct:
        def __init_subclass__(cls, **kwargs):
            pass

        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    _module("msgspec", Struct=Struct)
    for pkg in ("sglang.srt.environ", "sglang.srt.utils", "sglang.kernels.ops.attention.fla",
                "sglang.kernels.ops.attention.linear", "sglang.kernels.ops.mamba"):
        _package(pkg)
    _module("sglang.srt.environ", envs=_Envs())
    CONFIG.__dict__.clear()
    CONFIG.mamba = types.SimpleNamespace(linear_attn_backend="triton", linear_attn_decode_backend=None,
                                         linear_attn_prefill_backend=None, linear_attn_verify_backend=None,
                                         enable_linear_replayssm_spec=False, enable_mamba_extra_buffer=False,
                                         mamba_ssm_dtype=None)
    CONFIG.spec = types.SimpleNamespace(speculative_eagle_topk=None, speculative_algorithm=None)
    _module("sglang.srt.runtime_context", get_exec=lambda: CONFIG, get_spec=lambda: CONFIG.spec,
            get_memory=lambda: CONFIG, get_disagg=lambda: CONFIG, get_platform=lambda: CONFIG,
            mamba_cache_chunk_size=lambda: 64)
    no = lambda *a, **k: False  # noqa: E731
    utils = sys.modules["sglang.srt.utils"]
    utils.__dict__.update(is_cpu=no, is_cuda=no, is_hip=no, is_npu=no, is_xpu=no)
    _module("sglang.srt.utils.common", rank0_log=lambda *a, **k: None, is_gfx95_supported=no,
            get_eager_max_batch_size=lambda n: n)
    identity = lambda x, *a, **k: x  # noqa: E731
    _module("sglang.kernels.ops.mamba.causal_conv1d_triton", causal_conv1d_fn=identity,
            causal_conv1d_update=identity, PAD_SLOT_ID=-1, CAUSAL_CONV1D_FWD_BLOCK_M=8)
    _module("sglang.kernels.ops.mamba.kda_prefill_track", TRACK_FINAL_STATE=1, TRACK_CHUNK_STATE=2,
            kda_track_conv_window=None, kda_track_ssm_state=None)
    _package("sglang.srt.layers.attention.mamba")
    _module("sglang.srt.layers.attention.mamba.prefill_track_metadata", build_prefill_track_plan=None)
    if "triton" not in sys.modules and importlib.util.find_spec("triton") is None:
        _module("triton", cdiv=lambda a, b: (a + b - 1) // b)
        STUBBED.add("triton")
    _module("sglang.kernels.ops.attention.kda_fused_decode", covered=no, kda_fused_decode=None)
    fused = sys.modules["sglang.kernels.ops.attention.kda_fused_decode"]
    _module("sglang.kernels.ops.attention", kda_fused_decode=fused, __path__=[])
    sys.modules["sglang.kernels.ops.attention.fla"].__path__ = []
    _module("sglang.kernels.ops.attention.fla.fused_recurrent",
            fused_recurrent_kda_packed_decode=_recording("fused_recurrent_kda_packed_decode"))
    _module("sglang.kernels.ops.attention.fla.kda", chunk_kda=_recording("chunk_kda"))
    _module("sglang.kernels.ops.attention.linear.fused_recurrent_linear_replayssm",
            fused_recurrent_linear_replayssm_decode=_recording("fused_recurrent_linear_replayssm_decode"))
    _module("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",
            fused_sigmoid_gating_delta_rule_update=_recording("fused_sigmoid_gating_delta_rule_update"))
    base = type("MambaAttnBackendBase", (), dict(_track_methods(root), accept_lens_pool=None))
    _module("sglang.srt.layers.attention.hybrid_linear_attn_backend", MambaAttnBackendBase=base)
    _package("sglang.srt.layers.attention.linear.kernels")
    _module("sglang.srt.layers.attention.linear.kernels.kda_flashinfer", build_fused_accept_indices=None)
    _module("sglang.srt.layers.radix_linear_attention", RadixLinearAttention=object)
    _module("sglang.srt.model_executor.cuda_graph_config", Backend=types.SimpleNamespace(FULL="full"))
    _module("sglang.srt.model_executor.forward_batch_info", ForwardBatch=object)
    _module("sglang.srt.model_executor.model_runner", ModelRunner=object)


def real_sglang() -> types.SimpleNamespace:
    """Stubs installed and the real modules loaded (fresh each call); returns them by short name."""
    root = extract(find_wheel())
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.") or n == "msgspec"]:
        del sys.modules[name]
    TRITON_CALLS.clear()
    _stub(root)
    mods = {name.rpartition(".")[2]: _load(root, name) for name in REAL_MODULES}
    return types.SimpleNamespace(root=root, config=CONFIG, triton_calls=TRITON_CALLS, **mods)


def unload() -> None:
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.") or n == "msgspec"]:
        del sys.modules[name]
    for name in STUBBED:
        sys.modules.pop(name, None)
    STUBBED.clear()
