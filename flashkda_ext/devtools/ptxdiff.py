"""Is a source edit a no-op for the GPU code? Compile a CUDA module's sources to PTX from two data
roots (each a folder holding csrc/ and jit/, e.g. `git archive <rev> csrc jit | tar x -C base`)
and compare every kernel after normalising what carries no meaning: register numbers, label
names, comments and line info. No GPU is needed, only nvcc.

    python3 scripts/ptx_diff.py prefill_vt16_f32 prefill_vt64s_f32 --base .ab_base/base

"Identical byte for byte" (comments and line info aside) is what ptxas sees, so the same nvcc gives
the same machine code: a pure refactor that reports it needs no new GPU run. "Identical up to
register numbers and labels" is the same instruction stream renamed; ptxas's allocation can still
follow the numbering, so treat it as very likely, not certainly, unchanged. For the others the
report gives the instruction counts that changed (moved integer address arithmetic shows up
there) and the number of differing lines. A change of ptxas's schedule alone can move a
latency-bound kernel by a few per cent (2026-11-29, d43aaf2; git history of docs/perf-notes.md): measure those.
"""
from __future__ import annotations

import argparse
import difflib
import errno
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..jit import roots, toolchain
from ..jit.builder import include_flags, resolve_arch
from ..jit.macros import render_header
from ..jit.specs import get_record

_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$][\w$]*)")
_REG = re.compile(r"%(r|rd|rs|f|fd|p|h|hh|b|tmp)\d+\b")
_LABEL = re.compile(r"\$L__\w+")
_REG_DECL = re.compile(r"(%\w+)<\d+>")  # .reg .b32 %r<123>: how many virtual registers
_OPCODE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)")


def strip_debug(lines: Sequence[str]) -> List[str]:
    """PTX lines without comments, line info and blank lines: what ptxas compiles."""
    out = []
    for line in lines:
        line = line.split("//", 1)[0].rstrip()
        s = line.strip()
        if s and not s.startswith((".loc", ".file", ".section")):
            out.append(line)
    return out


def normalise(lines: Sequence[str]) -> List[str]:
    """strip_debug, then virtual register numbers (and counts) and label names erased: they shift
    with any unrelated edit."""
    out = []
    for line in strip_debug(lines):
        line = _REG_DECL.sub(r"\1<>", line) if line.lstrip().startswith(".reg") else line
        out.append(_LABEL.sub("L", _REG.sub(lambda m: "%" + m.group(1), line)))
    return out


def split_entries(ptx: str) -> Dict[str, List[str]]:
    """{kernel name: its lines (strip_debug)}, from each .entry to the next one, or to the debug
    sections -lineinfo appends (their strings name the source file's inlined functions)."""
    entries: Dict[str, List[str]] = {}
    name: Optional[str] = None
    body: List[str] = []
    for line in ptx.splitlines():
        m = _ENTRY.match(line)
        if m or line.lstrip().startswith(".section"):
            if name is not None:
                entries[name] = strip_debug(body)
            name, body = (m.group(1), [line]) if m else (None, [])
        elif name is not None:
            body.append(line)
    if name is not None:
        entries[name] = strip_debug(body)
    return entries


def opcode_counts(lines: Sequence[str]) -> Counter:
    c: Counter = Counter()
    for line in lines:
        m = _OPCODE.match(line)
        if m and not line.strip().startswith("."):
            c[m.group(1)] += 1
    return c


def _renamed(base: Dict[str, List[str]], change: Dict[str, List[str]]):
    """(change, {new name: old name}): change with its one kernel missing from base renamed to base's
    one kernel missing from change (inside the body too: parameter and shared-memory symbols embed
    the mangled name). A template parameter added to a kernel changes only its mangled name; this
    compares the code under it. Unchanged (and {}) when the unmatched kernels are not exactly one on
    each side."""
    only_b, only_c = sorted(set(base) - set(change)), sorted(set(change) - set(base))
    if len(only_b) != 1 or len(only_c) != 1:
        return change, {}
    old, new = only_c[0], only_b[0]
    # "_ZN..." also appears as "_ZZN...E2sm" in local shared symbols: replace the common tail
    o, n = (old[3:], new[3:]) if old.startswith("_ZN") and new.startswith("_ZN") else (old, new)
    out = {k: v for k, v in change.items() if k != old}
    out[new] = [line.replace(o, n) for line in change[old]]
    return out, {new: old}


def compare(base: Dict[str, List[str]], change: Dict[str, List[str]]) -> List[dict]:
    """One row per kernel name in either side: identical, or the line and opcode differences. A
    kernel whose mangled name alone changed (the only unmatched one on each side) is compared under
    base's name, its row marked renamed."""
    rows = []
    change, was = _renamed(base, change)
    for name in sorted(set(base) | set(change)):
        if name not in base or name not in change:
            rows.append({"kernel": name, "status": "only in change" if name not in base else "only in base"})
            continue
        exact = base[name] == change[name]
        a, b = normalise(base[name]), normalise(change[name])
        row = {"kernel": name, "lines": len(a)}
        if name in was:
            row["renamed_from"] = was[name]
        rows.append(row)
        if a == b:
            row.update(status="identical", exact=exact)
            continue
        diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0)
                if d[:1] in "+-" and not d.startswith(("+++", "---"))]
        ca, cb = opcode_counts(a), opcode_counts(b)
        ops = {op: cb[op] - ca[op] for op in sorted(set(ca) | set(cb)) if cb[op] != ca[op]}
        row.update(status="differs", diff_lines=len(diff), opcodes=ops)
    return rows


# the OS refusing to start a process (not a compile that ran and failed): EAGAIN / ENOMEM, and EFAULT, which a
# 2-core CI machine once answered for nvcc started from one of two compiling threads (2026-12-05, passed alone)
_SPAWN_REFUSED = {errno.EAGAIN, errno.ENOMEM, errno.EFAULT}


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    """subprocess.run(cmd) with its output captured; where the process could not be started (_SPAWN_REFUSED), up
    to two more tries, half a second and a second later."""
    for attempt in range(3):
        try:
            return subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            if e.errno not in _SPAWN_REFUSED or attempt == 2:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def compile_module(name: str, root, arch: Optional[str], workdir: Path, kind: str = "ptx",
                   logs: Optional[List[str]] = None) -> List[Path]:
    """nvcc -ptx (or -cubin) of each .cu source of module `name` as the tree at `root` defines it
    (its record's params, macros and compile flags): the files written into workdir. With `logs`,
    each compile's stderr is appended to it (for -cubin: ptxas's -Xptxas -v resource report)."""
    record = get_record(name, root=root)
    if record["backend"] != "cuda":
        raise ValueError(f"module '{name}' is a {record['backend']} module; only CUDA modules have PTX")
    arch = resolve_arch(record, arch or record["arches"][0])
    csrc = roots.csrc_dir(root)
    header = workdir / f"{name}_macros.h"
    header.write_text(render_header(record, root=root))
    flags = toolchain.compile_flags(record, arch)["nvcc"]
    if kind == "ptx" and "-Xptxas" in flags:  # the resource report belongs to ptxas, which -ptx does not run
        i = flags.index("-Xptxas")
        del flags[i:i + 2]
    incs = include_flags(csrc)
    outs = []
    for src in record["sources"]:
        if not src.endswith(".cu"):
            continue
        out = workdir / f"{name}_{Path(src).stem}.{kind}"
        cmd = [toolchain.find_nvcc()] + flags + incs + ["-include", str(header), f"-{kind}", str(csrc / src),
                                                       "-o", str(out)]
        proc = _run(cmd)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc -{kind} failed for {name} ({src}) under {root}:\n{proc.stderr[-4000:]}")
        if logs is not None:
            logs.append(proc.stderr)
        outs.append(out)
    return outs


def module_ptx(name: str, root, arch: Optional[str], workdir: Path) -> Dict[str, List[str]]:
    """The normalised kernels of module `name` as the tree at `root` defines it."""
    kernels: Dict[str, List[str]] = {}
    for out in compile_module(name, root, arch, workdir, "ptx"):
        kernels.update(split_entries(out.read_text()))
    return kernels


def format_rows(module: str, rows: List[dict]) -> List[str]:
    out = []
    for r in rows:
        k = r["kernel"] if len(r["kernel"]) <= 70 else r["kernel"][:67] + "..."
        if "renamed_from" in r:
            k += " (renamed in the change)"
        if r["status"] == "identical":
            how = "byte for byte" if r["exact"] else "up to register numbers and labels"
            out.append(f"{module}  {k}: identical {how} ({r['lines']} lines)")
        elif r["status"] == "differs":
            ops = ", ".join(f"{op} {d:+d}" for op, d in r["opcodes"].items()) or "same opcode counts"
            out.append(f"{module}  {k}: DIFFERS, {r['diff_lines']} lines changed of {r['lines']}; {ops}")
        else:
            out.append(f"{module}  {k}: {r['status']}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="+", help="CUDA module record names")
    p.add_argument("--base", required=True, help="data root of the baseline (holds csrc/ and jit/)")
    p.add_argument("--change", default=None, help="data root of the change (default: this tree)")
    p.add_argument("--arch", default=None, help="default: the record's first arch")
    a = p.parse_args(argv)
    differs = 0
    with tempfile.TemporaryDirectory(prefix="fkda_ptxdiff_") as tmp:
        for name in a.modules:
            wa, wb = Path(tmp) / "base", Path(tmp) / "change"
            wa.mkdir(exist_ok=True)
            wb.mkdir(exist_ok=True)
            rows = compare(module_ptx(name, a.base, a.arch, wa), module_ptx(name, a.change, a.arch, wb))
            differs += sum(r["status"] != "identical" for r in rows)
            print("\n".join(format_rows(name, rows)))
    print(f"{differs} kernel(s) differ" if differs else "every kernel identical")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
