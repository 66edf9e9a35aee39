"""Registry checks beyond the schema: sources read the rendered macros, and the compiler's resource
report (-Xptxas -v) fits what the record declares. Used by tests and `aot.py --check`.
"""
from __future__ import annotations

import math
import re
from typing import Dict, List

from . import roots
from .identity import include_closure

# Hopper (sm_90) limits per SM / per block.
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256          # registers are allocated per warp in units of 256
SMEM_PER_SM = 233472          # 228 KiB
SMEM_PER_BLOCK = 232448       # 227 KiB opt-in maximum
SMEM_RESERVED_PER_BLOCK = 1024
MAX_THREADS_PER_SM = 2048

_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_DEFINED_RE = re.compile(r"defined\s*\(?\s*\w+\s*\)?|#\s*ifn?def\s+\w+")
_LITERAL_RES = {
    "__launch_bounds__ with a literal": re.compile(r"__launch_bounds__\s*\(\s*\d"),
    "a kernel launch with a literal block size": re.compile(r"<<<[^,<>]+,\s*\d+\s*[,>]"),
    "a literal dynamic shared memory size":
        re.compile(r"cudaFuncAttributeMaxDynamicSharedMemorySize\s*,\s*\d"),
}


def required_macros(record: dict) -> List[str]:
    """The macros a module's sources (with their project headers) must read."""
    need = ["FKDA_MODULE_NAME"]
    if record["backend"] == "cuda":
        need += ["FKDA_THREADS", "FKDA_SMEM_BYTES", "FKDA_MIN_BLOCKS"]
        if math.prod(record["cluster"]) > 1:
            need += ["FKDA_CLUSTER_X", "FKDA_CLUSTER_Y", "FKDA_CLUSTER_Z"]
        if record["persistent_k"] > 0:
            need.append("FKDA_PERSISTENT_K")
    need += [f"FKDA_PARAM_{p.upper()}" for p in sorted(record["params"])]
    return need


def _closure_text(record: dict, root=None) -> Dict[str, str]:
    csrc = roots.csrc_dir(root)
    out = {}
    for rel in include_closure(record["sources"], csrc):
        text = _COMMENT_RE.sub(" ", (csrc / rel).read_text(errors="replace"))
        out[rel] = _DEFINED_RE.sub(" ", text)  # `#if !defined(X)` guards are not uses
    return out


def macro_usage_problems(record: dict, root=None) -> List[str]:
    """What the module's sources fail to read, or hard-code, of its launch macros."""
    texts = _closure_text(record, root)
    allt = "\n".join(texts.values())
    probs = [f"{record['name']}: no source in its include closure reads {m}"
             for m in required_macros(record) if not re.search(rf"\b{m}\b", allt)]
    if record["backend"] == "cuda":
        for rel, text in texts.items():
            for what, rx in _LITERAL_RES.items():
                m = rx.search(text)
                if m:
                    probs.append(f"{record['name']}: {rel} has {what} ({m.group(0).strip()!r}); "
                                 f"use the FKDA_* macro")
    return probs


def parse_ptxas(text: str) -> Dict[str, dict]:
    """{kernel (mangled): {arch, registers, smem, stack, spill_stores, spill_loads}} from -Xptxas -v."""
    kernels: Dict[str, dict] = {}
    cur = None
    pending_props = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '([^']+)'", line)
        if m:
            cur = kernels.setdefault(m.group(1), {"arch": m.group(2), "registers": 0, "smem": 0,
                                                  "stack": 0, "spill_stores": 0, "spill_loads": 0})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            pending_props = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m and pending_props in kernels:
            k = kernels[pending_props]
            k["stack"], k["spill_stores"], k["spill_loads"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur is not None:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
            cur = None
    return kernels


def blocks_by_registers(registers: int, threads: int) -> int:
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    return REGS_PER_SM // (warps * per_warp)


def resource_problems(record: dict, ptxas_text: str) -> List[str]:
    """Where the compiled kernels do not fit the record's smem_bytes and min_blocks (every kernel is
    assumed to launch with FKDA_THREADS threads and FKDA_SMEM_BYTES dynamic shared memory)."""
    name = record["name"]
    kernels = parse_ptxas(ptxas_text)
    if not kernels:
        return [f"{name}: the -Xptxas -v report lists no kernel"]
    probs = []
    threads, dyn, minb = record["threads"], record["smem_bytes"], record["min_blocks"]
    for kname, k in kernels.items():
        block_smem = k["smem"] + dyn
        if block_smem > SMEM_PER_BLOCK:
            probs.append(f"{name}: {kname} needs {k['smem']} static + {dyn} dynamic bytes of shared "
                         f"memory per block, over the {SMEM_PER_BLOCK} limit")
        if (block_smem + SMEM_RESERVED_PER_BLOCK) * minb > SMEM_PER_SM:
            probs.append(f"{name}: {kname}: {minb} blocks x ({k['smem']} static + {dyn} dynamic + "
                         f"{SMEM_RESERVED_PER_BLOCK} reserved) bytes exceed {SMEM_PER_SM} per SM")
        fit = blocks_by_registers(k["registers"], threads)
        if fit < minb:
            probs.append(f"{name}: {kname} uses {k['registers']} registers x {threads} threads: "
                         f"{fit} blocks per SM fit, the record declares min_blocks {minb}")
        if threads * minb > MAX_THREADS_PER_SM:
            probs.append(f"{name}: {minb} blocks x {threads} threads exceed {MAX_THREADS_PER_SM}")
    return probs
