"""Finding the compilers, their versions (cached per process) and the flags every compile uses.

Flags here are free of machine paths; include/library directories are added by the builder only,
so that a module's identity does not depend on where things are installed.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from .errors import ToolchainError

CXX_FLAGS = ["-O3", "-std=c++17", "-fPIC"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-lineinfo",
              "-Xptxas", "-v"]
CXX_LINK_FLAGS = ["-shared"]
NVCC_LINK_FLAGS = ["-shared", "-cudart", "static"]
# Flags a record may not set: the spec fields own them.
FORBIDDEN_FLAG_PREFIXES = ("-gencode", "--generate-code", "-arch", "--gpu-architecture", "-code",
                           "-o", "--output-file", "-shared", "-DFKDA_", "-UFKDA_", "-include")


def find_cxx() -> str:
    env = os.environ.get("CXX")
    if env:
        found = shutil.which(env)
        if found:
            return found
        raise ToolchainError(f"CXX={env!r} is not an executable; unset CXX or point it at g++/clang++")
    for cand in ("g++", "c++", "clang++"):
        found = shutil.which(cand)
        if found:
            return found
    raise ToolchainError("no host C++ compiler found (looked for $CXX, g++, c++, clang++); "
                         "install g++ (e.g. apt-get install g++) or set CXX")


def find_nvcc() -> str:
    env = os.environ.get("NVCC")
    if env:
        found = shutil.which(env)
        if found:
            return found
        raise ToolchainError(f"NVCC={env!r} is not an executable; unset NVCC or point it at nvcc")
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(str(Path(os.environ[var]) / "bin" / "nvcc"))
    which = shutil.which("nvcc")
    if which:
        cands.append(which)
    cands.append("/usr/local/cuda/bin/nvcc")
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise ToolchainError("no CUDA compiler found (looked at $CUDA_HOME/bin/nvcc, nvcc on PATH, "
                         "/usr/local/cuda/bin/nvcc); install the CUDA toolkit (12.8 or newer for "
                         "sm_90a), put nvcc on PATH or set CUDA_HOME, or use prebuilt modules "
                         "via FLASHKDA_EXT_AOT_DIR")


def find_cuobjdump() -> str:
    """cuobjdump, for reading machine code (SASS) without a GPU: $CUOBJDUMP, beside nvcc, on PATH,
    or the PyPI wheel nvidia-cuda-cuobjdump (nvidia/cu*/bin/cuobjdump in site-packages). Its -sass
    runs nvdisasm, so one is returned only where nvdisasm_dir finds that too."""
    cands = [os.environ.get("CUOBJDUMP", "")]
    try:
        cands.append(str(Path(find_nvcc()).parent / "cuobjdump"))
    except ToolchainError:
        pass
    cands.append(shutil.which("cuobjdump") or "")
    try:
        import nvidia  # namespace package of NVIDIA's PyPI wheels
        for base in nvidia.__path__:
            cands += sorted(str(p) for p in Path(base).glob("cu*/bin/cuobjdump"))
    except ImportError:
        pass
    found = [c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)]
    for c in found:
        if nvdisasm_dir(c):
            return c
    raise ToolchainError(("cuobjdump found (" + found[0] + ") but no nvdisasm beside it, on PATH or in "
                          "NVDISASM_PATH; `pip install nvidia-cuda-nvdisasm` provides one") if found else
                         "no cuobjdump found (CUOBJDUMP, beside nvcc, on PATH, or the nvidia-cuda-cuobjdump "
                         "wheel); `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` provides both")


def nvdisasm_dir(cuobjdump: str) -> Optional[str]:
    """The folder of the nvdisasm that `cuobjdump -sass` will run: NVDISASM_PATH, beside cuobjdump
    (the toolkit, or both wheels in one site-packages), or on PATH; None when there is none."""
    for d in (os.environ.get("NVDISASM_PATH", ""), str(Path(cuobjdump).parent)):
        if d and os.path.isfile(os.path.join(d, "nvdisasm")):
            return d
    w = shutil.which("nvdisasm")
    return str(Path(w).parent) if w else None


def _found(find) -> bool:
    try:
        find()
        return True
    except ToolchainError:
        return False


def have_nvcc() -> bool:
    """Whether find_nvcc finds one (tests and tools that only run where nvcc is installed)."""
    return _found(find_nvcc)


def have_cuobjdump() -> bool:
    """Whether find_cuobjdump finds one with its nvdisasm (tests that read machine code)."""
    return _found(find_cuobjdump)


def cuda_include_dir(nvcc: str) -> Optional[str]:
    cands = [Path(nvcc).resolve().parent.parent / "include"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    cands.append(Path("/usr/local/cuda/include"))
    for c in cands:
        if (c / "cuda_runtime.h").is_file():
            return str(c)
    return None


@functools.lru_cache(maxsize=None)
def tool_version(tool: str) -> str:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise ToolchainError(f"cannot run {tool} --version: {e}") from e
    return out.stdout.strip() or out.stderr.strip()


def versions(backend: str) -> Dict[str, str]:
    """Compiler version strings that go into a module's identity."""
    v = {"cxx": tool_version(find_cxx())}
    if backend == "cuda":
        v["nvcc"] = tool_version(find_nvcc())
    return v


def normalize_arch(arch: str) -> str:
    """'9.0a', '90a', 'sm_90a' -> 'sm_90a'; 'cpu'/'host' -> 'host'."""
    a = str(arch).strip().lower()
    if a in ("host", "cpu"):
        return "host"
    m = re.fullmatch(r"(?:sm_?|compute_)?(\d+)\.?(\d)?([af]?)", a)
    if not m:
        raise ValueError(f"unknown arch {arch!r}; use e.g. 9.0a, sm_90a or host")
    major, minor, suffix = m.groups()
    digits = major + minor if minor is not None else major
    return f"sm_{digits}{suffix}"


def gencode(arch: str) -> str:
    num = arch[len("sm_"):]
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def compile_flags(record: dict, arch: str) -> Dict[str, List[str]]:
    """Path-free flags: 'cxx' for .cc/.cpp, 'nvcc' for .cu, 'link' for the final link.

    A record's own flags go to the compiler of its backend (nvcc for CUDA modules, whose .cc helpers
    get the plain host flags)."""
    extra = list(record.get("flags", []))
    if record["backend"] == "cpu":
        return {"cxx": CXX_FLAGS + extra, "nvcc": [], "link": list(CXX_LINK_FLAGS)}
    return {"cxx": list(CXX_FLAGS),
            "nvcc": NVCC_FLAGS + [gencode(arch)] + extra,
            "link": list(NVCC_LINK_FLAGS)}
