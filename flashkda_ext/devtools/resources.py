"""The -Xptxas -v resource report of a CUDA module from a device-only compile: nvcc -cubin with the
module record's flags and macros (as ptxdiff compiles), so ptxas sees the same code as in a full
build, without the host compile and the link that make up most of a build's time (3 s against 15 s
for a decode module on one core). The registry test checks every CUDA record with it."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

from .ptxdiff import compile_module


def ptxas_report(name: str, arch: Optional[str] = None, *, root=None) -> str:
    """ptxas's report (registers, smem, spills per kernel) for every .cu source of module `name`."""
    logs: list = []
    with tempfile.TemporaryDirectory(prefix="fkda_ptxas_") as tmp:
        compile_module(name, root, arch, Path(tmp), "cubin", logs=logs)
    return "".join(logs)
