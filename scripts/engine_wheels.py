"""The pinned engine wheels (vLLM, SGLang) that the conformance tests, the prepare steps and the GPU benchmarks
read: a local copy in a folder of FLASHKDA_EXT_ENGINE_WHEELS (os.pathsep-separated), else one in the ignored
cache .cache/engines/, else `pip download --no-deps` into that cache. Nothing is installed."""
from __future__ import annotations

import os
import subprocess
import sys
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
    Path(cache).mkdir(parents=True, exist_ok=True)
    cmd = (pip or pip_download(project, version)) + [str(cache)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        why = res.stderr.strip()[-400:]
    except (subprocess.SubprocessError, OSError) as e:
        why = repr(e)
    found = sorted(Path(cache).glob(pattern))
    if not found:
        raise RuntimeError(f"{project}=={version}: no local wheel and pip download failed: {why}")
    return found[0]
