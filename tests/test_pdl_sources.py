"""Programmatic dependent launch (PDL) is safe only if every kernel of a PDL module waits for the
previous grid before it touches memory (csrc/common/grid_dependency.cuh). Source-level checks, no GPU."""
from __future__ import annotations

import re
from pathlib import Path

from flashkda_ext.jit import all_records

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
WAITS = ("fkda::begin_dependent_grid();", "fkda::wait_for_previous_grid();")


def kernel_bodies(text: str):
    """(kernel name, first statement of its body) for every __global__ definition."""
    for m in re.finditer(r"__global__\s+void\b[^;{]*?\b(\w+)\s*\([^)]*\)\s*\{", text, re.S):
        body = text[m.end():]
        first = next((ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("//")), "")
        yield m.group(1), first


def pdl_records():
    for rec in all_records():
        if rec["backend"] == "cuda" and rec["params"].get("pdl"):
            yield rec


def test_every_kernel_of_a_pdl_module_waits_first():
    recs = list(pdl_records())
    assert recs, "no CUDA module launches with PDL"
    dirs = sorted({(CSRC / src).parent for rec in recs for src in rec["sources"]})
    # a source dir's kernels plus the headers it shares (fused decode includes decode's)
    files = sorted({p for d in dirs for p in list(d.glob("*.cu")) + list(d.glob("*.cuh"))})
    seen = []
    for path in files:
        for name, first in kernel_bodies(path.read_text()):
            seen.append(name)
            assert first.startswith(WAITS), (
                f"{path.relative_to(ROOT)}: kernel {name} must start with one of {WAITS} "
                f"(it is launched with PDL), starts with: {first!r}")
    assert len(seen) >= 9, seen  # decode 4, fused decode 2, verify 2, prefill 2


def test_pdl_param_is_zero_or_one():
    for rec in all_records():
        if "pdl" in rec["params"]:
            assert rec["params"]["pdl"] in (0, 1), rec["name"]


def test_the_launcher_reads_the_param():
    launch = (CSRC / "common/cuda_launch.h").read_text()
    assert "FKDA_PARAM_PDL" in launch and "cudaLaunchAttributeProgrammaticStreamSerialization" in launch
    prefill = (CSRC / "prefill/kda_prefill.cu").read_text()
    assert "<<<" not in prefill, "prefill kernels must launch through LaunchContext (PDL, attributes)"
