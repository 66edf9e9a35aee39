"""The pinned engine wheels (vLLM, SGLang) that the conformance tests, the prepare steps and the GPU benchmarks
read: a local copy in a folder of FLASHKDA_EXT_ENGINE_WHEELS (os.pathsep-separated), else one in the ignored
cache .cache/engines/, else `pip download --no-deps` into that cache. Nothing is installed.

The cache is shared by concurrent processes (the test command's pytest workers): a download and an extraction
hold folder_lock(), and a wheel appears in the cache only whole (downloaded beside it, then renamed in)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "engines"
# SGLang's wheel is cp311-only: asked for by that tag whatever Python runs the download
PIP_ARGS = {"sglang": ("--python-version", "311", "--implementation", "cp", "--abi", "cp311",
                       "--platform", "manylinux_2_34_x86_64")}


def pip_download(project: str, version: str) -> list:
    """The pip command that downloads the wheel (the destination folder is appended)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", f"{project}=={version}", "--only-binary=:all:",
            *PIP_ARGS.get(project, ()), "-d"]


def folder_lock(folder: Path = CACHE):
    """The inter-process lock of `folder` (the wheel cache, or the folder an extraction goes into): one process at a
    time downloads into it or extracts into it. The JIT cache's lock (a timeout naming the lock file)."""
    from flashkda_ext.jit.lock import file_lock
    return file_lock(Path(folder) / ".lock", what=f"the engine files in {folder}")


def find_wheel(project: str, version: str, *, given: Optional[str] = None, cache: Path = CACHE,
               pip: Optional[list] = None) -> Path:
    """The wheel: `given`, else one found locally, else downloaded by `pip` (default pip_download(...)) into
    `cache`. RuntimeError naming the project when none can be had."""
    if given:
        return Path(given)
    pattern = f"{project}-{version}-*.whl"
    folders = [Path(d) for d in os.environ.get("FLASHKDA_EXT_ENGINE_WHEELS", "").split(os.pathsep) if d]
    for folder in folders + [Path(cache)]:
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
    with folder_lock(cache):
        found = sorted(Path(cache).glob(pattern))   # another process may have fetched it while this one waited
        if found:
            return found[0]
        with tempfile.TemporaryDirectory(dir=cache) as part:
            cmd = (pip or pip_download(project, version)) + [part]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                why = res.stderr.strip()[-400:]
            except (subprocess.SubprocessError, OSError) as e:
                why = repr(e)
            for wheel in Path(part).glob(pattern):
                os.replace(wheel, Path(cache) / wheel.name)
    found = sorted(Path(cache).glob(pattern))
    if not found:
        raise RuntimeError(f"{project}=={version}: no local wheel and pip download failed: {why}")
    return found[0]
