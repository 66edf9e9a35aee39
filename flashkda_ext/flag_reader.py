"""The fast path's per-call tensor test, compiled against torch (csrc/torch_ext/plain_ok.cpp).

fast_path.plain_ok reads, on every fast call, what DLPack does not carry into the TVM-FFI modules:
each tensor's exact type, neg bit, requires_grad and inference flag. In Python that costs ~0.3-0.45 us
a tensor on an H200 host (about 4 us for a decode call's ten); the compiled test reads the same flags
through torch's C++ API in tens of nanoseconds. It is a CPython extension linked to torch (torch's
headers, c10, torch_python), the one piece of the package that is: the kernels stay torch-free, for JAX.

Built by the package's own builder (jit/builder.py: the cache's fcntl lock, which a dead holder
frees at once; a temp folder renamed into place, a dead build's reclaimed; ninja dies with its
caller; one stderr line before and after), as <cache>/flag_reader-<identity[:16]>/, identity = a
hash of the source, the compile and link flags, and the torch, Python ABI and scheme versions.

When: a built one is loaded at import (a file test, a hash and a dlopen). Otherwise the first call
that arms the fast path starts its build and returns at once: a child interpreter in a session of its
own, at low priority (~10 s of one core, parsing torch's headers), watched by a daemon thread. The
Python test serves until the build is done, then the compiled one replaces it (fast_path.plain_ok),
so no call waits for it; a script that exits sooner leaves the child to finish the build for the
next process (not killed with it, so short runs do not each start and lose it). FLASHKDA_EXT_DISABLE_JIT=1 forbids the
build, FLASHKDA_EXT_NATIVE_FLAGS=0 keeps the Python test; `python -m flashkda_ext build` builds it
ahead. A failed build warns once and the Python test stays, which gives the same answers
(tests/test_flag_reader.py holds the two to one table); a build of the same identity that failed
before is not retried by the ops (`build` retries it). A process killed mid-build leaves nothing
that blocks the next one (tests/test_jit_lifecycle.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from typing import Callable, List, Optional

import torch

from . import paths, switches

NAME = "flashkda_ext_plain_ok"   # the CPython module name (PyInit_ in the source)
ARTIFACT = "flag_reader"          # the cache folder's name: flag_reader-<identity[:16]>
SCHEME = 1                        # bump when the build below changes how the .so is produced
_lock = threading.Lock()
_native: Optional[Callable] = None
_tried = False                    # ensure() started (or declined) this process's one build
_worker: Optional[threading.Thread] = None


def wanted() -> bool:
    """$FLASHKDA_EXT_NATIVE_FLAGS (default 1): an on/off word, else a ValueError naming the variable."""
    return switches.env_switch("FLASHKDA_EXT_NATIVE_FLAGS", True)


def source() -> Path:
    return paths.csrc_dir() / "torch_ext" / "plain_ok.cpp"


def _torch_dir() -> Path:
    return Path(torch.__file__).resolve().parent


def _compile_flags() -> List[str]:
    # torch's own extension flags (C++20, its libstdc++ ABI); -w: torch's headers warn by the page
    return ["-O2", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def _libs() -> List[str]:
    lib = str(_torch_dir() / "lib")
    return ["-L", lib, "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]


def identity() -> str:
    """What the .so depends on. Not the compiler's version (finding it runs the compiler, and this
    runs at import): a CPython extension's ABI is Python's and torch's, both in here."""
    inputs = {"scheme": SCHEME, "source": hashlib.sha256(source().read_bytes()).hexdigest(),
              "flags": _compile_flags(), "libs": _libs()[2:-1], "torch": torch.__version__,
              "python": sysconfig.get_config_var("SOABI") or sys.version}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def build_dir() -> Path:
    from .jit.builder import artifact_name

    return paths.cache_dir() / artifact_name(ARTIFACT, identity())


def _built_file() -> Optional[Path]:
    from .jit.builder import read_valid_meta

    meta = read_valid_meta(build_dir(), identity())
    return build_dir() / meta["file"] if meta else None


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


def _write(tmp: Path) -> str:
    """build.ninja of the extension in the builder's temp folder; the .so's name."""
    from .jit import builder, toolchain
    from .jit.commands import Compile

    incs = ["-I", str(_torch_dir() / "include"), "-I", sysconfig.get_paths()["include"]]
    cxx = toolchain.find_cxx()
    step = Compile(source(), "cxx", [cxx] + _compile_flags() + incs)
    so_name = NAME + ".so"
    builder.write_ninja(tmp, so_name, [step], [cxx, "-shared"], _libs())
    return so_name


def build(jobs: Optional[int] = None) -> Callable:
    """Build (if needed) and load the compiled plain_ok; raises what the build raised."""
    global _native
    from .jit import builder

    ident = identity()
    folder, meta, _ = builder.ensure_artifact(
        paths.cache_dir(), ARTIFACT, ident, "the fast path's flag reader (torch extension)",
        "the ops keep the Python flag test; `python -m flashkda_ext build` retries",
        _write, {"name": ARTIFACT, "identity": ident, "torch": torch.__version__}, jobs=jobs)
    fn = _import(folder / meta["file"])
    with _lock:
        if _native is None:
            _native = fn
    return _native


def failed_before() -> Optional[Path]:
    """The kept folder of a failed build of this very identity (the builder's .failed/), if any."""
    from .jit.builder import artifact_name

    failed = paths.cache_dir() / ".failed" / artifact_name(ARTIFACT, identity())
    return failed if failed.is_dir() else None


def start_child():
    """Start build() in a child interpreter of its own session, at low priority, and return its
    Popen (wait_child reads the outcome). Started in the caller's thread (a few ms) so that a script
    that exits at once has started it: the child is not tied to this process, and finishes the
    build for the next one. Its stderr is this process's (the builder's two lines)."""
    import subprocess

    # the child imports this very package, whatever its working folder holds
    code = (f"import sys; sys.path.insert(0, {str(paths.PACKAGE_DIR.parent)!r}); "
            f"from {__name__} import _child_main; _child_main()")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_child(proc) -> Optional[str]:
    """None when the child built the test, else the reason it did not."""
    reason, _ = proc.communicate()
    if proc.returncode == 0:
        return None
    return reason.strip() or f"the build process exited with status {proc.returncode}"


def _child_main() -> None:
    """The child of start_child: build, or print the reason on one line and exit 3."""
    try:
        os.nice(10)  # the caller's own work (its modules' builds) goes first
    except OSError:
        pass
    try:
        build(jobs=1)
    except Exception as e:  # noqa: BLE001 - reported by the parent, once
        try:
            print(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        except OSError:  # the parent is gone: nobody to tell
            pass
        sys.exit(3)


def _background(proc, on_ready: Callable[[Callable], None]) -> None:
    try:
        reason = wait_child(proc)
        fn = load() if reason is None else None
    except Exception as e:  # noqa: BLE001 - e.g. the built .so does not load
        reason, fn = f"{type(e).__name__}: {e}", None
    if fn is None:
        warnings.warn(f"flashkda_ext: the fast path's compiled flag test did not build "
                      f"({reason or 'its artifact does not verify'}); the Python test serves instead "
                      f"(same checks, ~0.3 us more a tensor)", RuntimeWarning, stacklevel=2)
        return
    on_ready(fn)


def ensure(on_ready: Callable[[Callable], None]) -> Optional[Callable]:
    """load(); else, once per process and when builds are allowed, start the build (start_child)
    with a daemon thread that calls on_ready(fn) when it is done, and return None (the caller keeps
    the Python test meanwhile). A build of this identity that failed before is not retried here."""
    global _tried, _worker
    fn = load()
    if fn is not None or _tried or not wanted():
        return fn
    from .jit.loader import jit_disabled

    if jit_disabled():
        return None
    with _lock:
        if _tried:
            return None
        _tried = True
        failed = failed_before()
        if failed is not None:
            warnings.warn(f"flashkda_ext: the fast path's compiled flag test failed to build before "
                          f"(see {failed}); the Python test serves instead. `python -m flashkda_ext "
                          f"build` retries it", RuntimeWarning, stacklevel=3)
            return None
        try:
            proc = start_child()
        except OSError as e:
            warnings.warn(f"flashkda_ext: the fast path's compiled flag test did not build (the build "
                          f"process did not start: {e}); the Python test serves instead",
                          RuntimeWarning, stacklevel=3)
            return None
        _worker = threading.Thread(target=_background, args=(proc, on_ready), daemon=True,
                                   name="flashkda_ext flag reader build")
        _worker.start()
    return None


def wait(timeout: Optional[float] = None) -> Optional[Callable]:
    """The compiled test once a background build started by ensure() is done (None if it failed
    or none ran); for tests and scripts."""
    if _worker is not None:
        _worker.join(timeout)
    return _native
