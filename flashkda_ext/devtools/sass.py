"""What ptxas made of a CUDA module, without a GPU: compile it to a cubin (nvcc -cubin with the
module record's flags, as flashkda_ext.devtools.ptxdiff compiles PTX) and read the machine code (SASS)
and resource usage back with cuobjdump. Per kernel: registers, stack (spills), static instruction
count, branches (BRA, BSSY: divergence handling), barriers, MUFU, tensor-core and memory
instructions; with a baseline tree, both side by side.

    python3 scripts/sass_stats.py prefill_vt16_f32 --kernel prep --base /tmp/base

Static counts are not executed counts (a loop body counts once), but they show what a source edit
did to the code that runs: with 9fc51fd (2026-11-29) the gate loop went from a branch per row to
straight-line code (BRA + BSSY 393 -> 206 in the prep kernel) before any device time was spent.
cuobjdump comes with the CUDA toolkit or from PyPI (nvidia-cuda-cuobjdump, with
nvidia-cuda-nvdisasm, which its -sass runs); toolchain.find_cuobjdump looks for both.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..jit import toolchain
from .ptxdiff import compile_module

_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?[^;]*;")
_RES_FUNC = re.compile(r"^\s*Function\s+(\S+?):\s*$")
_RES_KV = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")

# Columns of the report: (label, opcodes counted)
GROUPS = (("BRA", ("BRA",)), ("BSSY", ("BSSY",)), ("BAR", ("BAR",)), ("MUFU", ("MUFU",)),
          ("HMMA", ("HMMA",)), ("LDS", ("LDS", "LDSM")), ("STS", ("STS",)), ("LDG", ("LDG", "LDGSTS")),
          ("STG", ("STG",)), ("spill", ("STL", "LDL")))


def parse_sass(text: str) -> Dict[str, List[str]]:
    """{kernel: its instruction opcodes in order}, from `cuobjdump -sass` output (predicates and
    modifiers dropped: `@!P0 LDG.E.128 R4, ...` -> LDG)."""
    out: Dict[str, List[str]] = {}
    name: Optional[str] = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        if name is not None:
            m = _INSTR.match(line)
            if m:
                out[name].append(m.group(1))
    return out


def parse_res_usage(text: str) -> Dict[str, Dict[str, int]]:
    """{kernel: {"REG": n, "STACK": n, "SHARED": n, "LOCAL": n, ...}} from `cuobjdump -res-usage`."""
    out: Dict[str, Dict[str, int]] = {}
    name: Optional[str] = None
    for line in text.splitlines():
        m = _RES_FUNC.match(line)
        if m:
            name = m.group(1)
            continue
        if name is not None and "REG:" in line:
            out[name] = {k: int(v) for k, v in _RES_KV.findall(line)}
            name = None
    return out


def summarize(opcodes: Sequence[str], res: Optional[Dict[str, int]] = None) -> dict:
    c = Counter(opcodes)
    row = {"instructions": len(opcodes), "opcodes": c}
    for label, ops in GROUPS:
        row[label] = sum(c[o] for o in ops)
    if res:
        row["REG"], row["STACK"] = res.get("REG"), res.get("STACK")
    return row


def module_sass(name: str, root, arch: Optional[str], workdir: Path) -> Dict[str, dict]:
    """{kernel: summarize(...)} of module `name` as the tree at `root` defines it."""
    tool = toolchain.find_cuobjdump()
    env = dict(os.environ, NVDISASM_PATH=toolchain.nvdisasm_dir(tool))  # -sass runs nvdisasm
    kernels: Dict[str, dict] = {}
    for cubin in compile_module(name, root, arch, workdir, "cubin"):
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True,
                              env=env).stdout
        res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = parse_res_usage(res)
        for k, ops in parse_sass(sass).items():
            kernels[k] = summarize(ops, usage.get(k))
    return kernels


def format_row(kernel: str, row: dict, top: int, side: str = "") -> str:
    """One kernel's line; side ("base" / "change") labels it when two trees are compared."""
    k = kernel if len(kernel) <= 60 else kernel[:57] + "..."
    cols = " ".join(f"{label} {row[label]}" for label, _ in GROUPS)
    ops = ", ".join(f"{o}:{n}" for o, n in row["opcodes"].most_common(top))
    lead = f"  {side:6s} " if side else "  "
    return f"{lead}{k}: REG {row.get('REG')} STACK {row.get('STACK')} | {row['instructions']} instr | {cols} | {ops}"


def format_delta(base: dict, change: dict) -> str:
    parts = []
    for label in ("REG", "STACK", "instructions") + tuple(g for g, _ in GROUPS):
        a, b = base.get(label), change.get(label)
        if a != b:
            parts.append(f"{label} {a} -> {b}")
    return "    change vs base: " + (", ".join(parts) if parts else "no difference in these counts")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="+", help="CUDA module record names")
    p.add_argument("--base", default=None, help="data root of a baseline (holds csrc/ and jit/) to compare with")
    p.add_argument("--change", default=None, help="data root of the change (default: this tree)")
    p.add_argument("--kernel", default="", help="only kernels whose (mangled) name matches this regex")
    p.add_argument("--arch", default=None, help="default: the record's first arch")
    p.add_argument("--top", type=int, default=8, help="most frequent opcodes shown per kernel")
    a = p.parse_args(argv)
    pick = re.compile(a.kernel)
    with tempfile.TemporaryDirectory(prefix="fkda_sass_") as tmp:
        for name in a.modules:
            sides = {}
            for side, root in (("base", a.base), ("change", a.change)):
                if side == "base" and root is None:
                    continue
                w = Path(tmp) / side
                w.mkdir(exist_ok=True)
                sides[side] = module_sass(name, root, a.arch, w)
            print(name)
            for k in sorted(sides["change"]):
                if not pick.search(k):
                    continue
                if "base" in sides and k in sides["base"]:
                    print(format_row(k, sides["base"][k], a.top, "base"))
                    print(format_row(k, sides["change"][k], a.top, "change"))
                    print(format_delta(sides["base"][k], sides["change"][k]))
                else:
                    print(format_row(k, sides["change"][k], a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
