"""The exact compile and link command lines of a module, machine paths included.

The ninja file (builder) and the dependency scan (depscan, for the identity) both take their
commands from here, so the files the scan reports are the files the build's compiler reads.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List

from . import toolchain


@dataclasses.dataclass
class Compile:
    source: Path        # absolute
    rule: str           # 'cxx' or 'nvcc'
    argv: List[str]     # compiler + flags + include flags + -include macros; no -c/-o


def tvm_ffi_include_dirs() -> List[str]:
    import tvm_ffi.libinfo as libinfo

    return [str(p) for p in libinfo.include_paths()]


def include_flags(csrc: Path) -> List[str]:
    """-I flags of a module's sources: the project's csrc/, then tvm-ffi's headers."""
    incs = ["-I", str(csrc)]
    for p in tvm_ffi_include_dirs():
        incs += ["-I", p]
    return incs


def compile_steps(record: dict, arch: str, csrc: Path, macros_h: Path) -> List[Compile]:
    """One Compile per source of the record, in the record's order."""
    flags = toolchain.compile_flags(record, arch)
    incs = include_flags(csrc)
    header = ["-include", str(macros_h)]
    cxx = toolchain.find_cxx()
    cxx_incs = list(incs)
    nvcc = None
    if record["backend"] == "cuda":
        nvcc = toolchain.find_nvcc()
        cuda_inc = toolchain.cuda_include_dir(nvcc)
        if cuda_inc:
            cxx_incs += ["-I", cuda_inc]
    steps = []
    for src in record["sources"]:
        if src.endswith(".cu"):
            steps.append(Compile(csrc / src, "nvcc", [nvcc] + flags["nvcc"] + incs + header))
        else:
            steps.append(Compile(csrc / src, "cxx", [cxx] + flags["cxx"] + cxx_incs + header))
    return steps


def link_argv(record: dict) -> List[str]:
    """Linker + flags; the objects, -o and the tvm-ffi library flags follow (link_libs)."""
    flags = toolchain.compile_flags(record, "host" if record["backend"] == "cpu"
                                    else record["arches"][0])
    linker = toolchain.find_nvcc() if record["backend"] == "cuda" else toolchain.find_cxx()
    return [linker] + flags["link"]


def link_libs(record: dict) -> List[str]:
    import tvm_ffi.libinfo as libinfo

    lib_dir = str(Path(libinfo.find_libtvm_ffi()).parent)
    if record["backend"] == "cuda":
        return ["-L", lib_dir, "-ltvm_ffi", "-Xlinker", "-rpath", "-Xlinker", lib_dir]
    return ["-L", lib_dir, "-ltvm_ffi", f"-Wl,-rpath,{lib_dir}"]
