"""The fast path's per-call tensor test, compiled against torch (csrc/torch_ext/plain_ok.cpp).

fast_path.plain_ok reads, on every fast call, what DLPack does not carry into the TVM-FFI modules:
each tensor's exact type, neg bit, requires_grad and inference flag. In Python that costs ~0.3-0.45 us
a tensor on an H200 host (about 4 us for a decode call's ten); the compiled test reads the same flags
through torch's C++ API in tens of nanoseconds. It is a torch extension, built with
torch.utils.cpp_extension (torch's headers, linked to torch_python), the one piece of the package that
is: the kernels stay torch-free, for JAX.

Where: <cache dir>/torch_ext/plain_ok-<key>/, key = a hash of the source and of the torch and Python
versions (an extension binary is tied to all three).
When: a built one is loaded at import (a file test and a dlopen); otherwise the first call that arms
the fast path builds it (~15 s, once per cache), unless FLASHKDA_EXT_DISABLE_JIT=1 forbids builds or
FLASHKDA_EXT_NATIVE_FLAGS=0 asks for the Python test. `python -m flashkda_ext build` builds it ahead.
A build that fails (no compiler, no torch headers) warns once; the Python test then stays, which
gives the same answers (tests/test_flag_reader.py holds the two to one table).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from . import paths

NAME = "flashkda_ext_plain_ok"
_lock = threading.Lock()
_tried_build = False
_native: Optional[Callable] = None


def wanted() -> bool:
    return os.environ.get("FLASHKDA_EXT_NATIVE_FLAGS", "1") != "0"


def source() -> Path:
    return paths.csrc_dir() / "torch_ext" / "plain_ok.cpp"


def build_dir() -> Path:
    key = hashlib.sha256(source().read_bytes() + f"|{torch.__version__}|{sys.version_info[:2]}".encode())
    return paths.cache_dir() / "torch_ext" / f"plain_ok-{key.hexdigest()[:16]}"


def _built_file() -> Optional[Path]:
    found = sorted(build_dir().glob(NAME + "*.so"))
    return found[0] if found else None


def _import(path: Path) -> Callable:
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.plain_ok


def load() -> Optional[Callable]:
    """The compiled plain_ok when it is built (never builds), else None."""
    global _native
    if _native is None and wanted():
        path = _built_file()
        if path is not None:
            with _lock:
                if _native is None:
                    _native = _import(path)
    return _native


def build() -> Callable:
    """Build (if needed) and load the compiled plain_ok; raises what the build raised."""
    global _native, _tried_build
    with _lock:
        _tried_build = True
        if _native is None:
            from torch.utils import cpp_extension  # slow to import: only when building

            from .jit.builder import _ninja

            out = build_dir()
            out.mkdir(parents=True, exist_ok=True)
            # cpp_extension runs `ninja` from PATH; the pip wheel's binary may live off it
            saved = os.environ.get("PATH", "")
            os.environ["PATH"] = os.pathsep.join([os.path.dirname(_ninja()[0]), saved])
            try:
                module = cpp_extension.load(NAME, [str(source())], extra_cflags=["-O2"],
                                            build_directory=str(out), verbose=False)
            finally:
                os.environ["PATH"] = saved
            _native = module.plain_ok
    return _native


def ensure() -> Optional[Callable]:
    """load(), else one build attempt per process when builds are allowed; None when neither works."""
    fn = load()
    if fn is not None or _tried_build or not wanted():
        return fn
    from .jit.loader import jit_disabled

    if jit_disabled():
        return None
    try:
        return build()
    except Exception as e:  # noqa: BLE001 - any build failure leaves the Python test in place
        warnings.warn(f"flashkda_ext: the compiled fast-path flag test did not build ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); the Python test serves instead "
                      f"(same checks, ~0.3 us more a tensor)", RuntimeWarning, stacklevel=2)
        return None
