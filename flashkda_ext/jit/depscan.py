"""Every project file a module's compile reads, as the compiler itself reports it.

The identity must cover each file the compiler read: sources, quoted includes, angle includes found
through `-I csrc` (`#include <common/kda_cpu.h>`), quoted includes that resolve outside csrc/. A
regex over `#include` lines cannot know the compiler's search rules, so the scan runs each compile
command of the module (commands.compile_steps, the build's own argv) with `-M -MF`, which stops
after preprocessing (g++ ~0.3 s, nvcc ~0.3 s per source; nvcc reports the host and device passes
together).

Why a scan before the build rather than the build's own -MD list: the identity names the artifact
folder and must be known before anything is built, and a stale artifact must never load. The scan
result is cached under <cache>/.deps/, keyed by the exact commands and macros, and reused only while
every file it listed still has the sha256 it had (content, not mtimes: an edit inside one mtime
tick, or a checkout that restores old mtimes, still counts). Those hashes are the ones the identity
needs anyway, so a cache hit costs what hashing the closure always cost. What no cache of a file
list can see is a new header that shadows a listed one earlier on the search path; `-I csrc` comes
first and csrc/ files are named uniquely, so that case is left to a source edit.

Files under tvm-ffi's include folders and the compilers' own trees are not hashed: tvm_ffi.__version__
and the compiler version strings in the identity stand for them (and the AOT loading machine,
which has no compiler, could not hash them).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from . import commands, roots, toolchain
from .errors import BuildError

SCAN_SCHEME = 1  # bump when the cached scan format or the classification changes
_TARGET = "fkda_dep"


def sha256_bytes(path: Path) -> Optional[str]:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None  # a file that vanished: no hash equals it


def parse_depfile(text: str) -> List[str]:
    """The prerequisites of a make-style dependency file (gcc / nvcc -M output).

    Hand-written: no maintained library parses make depfiles, and the format is small: line
    continuations, whitespace-separated paths, `\\ ` for a space, `\\#` for '#', `$$` for '$'."""
    body = text.replace("\\\r\n", " ").replace("\\\n", " ")
    _, sep, deps = body.partition(_TARGET + ":")
    if not sep:
        _, sep, deps = body.partition(":")
    out, cur, i = [], [], 0
    while i < len(deps):
        c = deps[i]
        if c == "\\" and i + 1 < len(deps) and deps[i + 1] in " #":
            cur.append(deps[i + 1])
            i += 2
            continue
        if c == "$" and deps[i + 1:i + 2] == "$":
            cur.append("$")
            i += 2
            continue
        if c.isspace():
            if cur:
                out.append("".join(cur))
                cur = []
        else:
            cur.append(c)
        i += 1
    if cur:
        out.append("".join(cur))
    return out


@functools.lru_cache(maxsize=None)
def _compiler_search_dirs(cxx: str) -> tuple:
    """The host compiler's built-in #include <...> search folders (from `-E -v`)."""
    try:
        r = subprocess.run([cxx, "-E", "-x", "c++", "-v", os.devnull], capture_output=True,
                           text=True, timeout=60)
    except OSError:
        return ()
    dirs, inside = [], False
    for line in r.stderr.splitlines():
        if line.startswith("#include <...> search starts here"):
            inside = True
        elif line.startswith("End of search list"):
            break
        elif inside and line.startswith(" "):
            dirs.append(line.strip().split(" (")[0])
    return tuple(str(Path(d).resolve()) for d in dirs)


def toolchain_dirs(record: dict) -> List[Path]:
    """Folders whose files the version strings in the identity stand for."""
    dirs = [Path(d) for d in commands.tvm_ffi_include_dirs()]
    dirs += [Path(d) for d in _compiler_search_dirs(toolchain.find_cxx())]
    if record["backend"] == "cuda":
        nvcc = toolchain.find_nvcc()
        dirs.append(Path(nvcc).resolve().parent.parent)  # the CUDA toolkit root
        inc = toolchain.cuda_include_dir(nvcc)
        if inc:
            dirs.append(Path(inc))
    return [d.resolve() for d in dirs]


def _inside(p: Path, d: Path) -> bool:
    return p == d or d in p.parents


def classify(paths: List[str], csrc: Path, skip: List[Path], cwd: Path) -> List[str]:
    """Project files among the compiler's prerequisites, as posix paths relative to csrc/
    ('common/x.h', or '../extra/y.h' for a file outside it); toolchain files and the generated
    fkda_macros.h (under cwd) are left out."""
    out = set()
    for raw in paths:
        p = Path(raw) if os.path.isabs(raw) else cwd / raw
        p = p.resolve()
        if _inside(p, cwd) or any(_inside(p, d) for d in skip):
            continue
        out.add(Path(os.path.relpath(p, csrc)).as_posix())
    return sorted(out)


def _scan_key(record: dict, arch: str, csrc: Path, macros: str) -> str:
    steps = commands.compile_steps(record, arch, csrc, Path("<fkda_macros.h>"))
    key = {"scheme": SCAN_SCHEME, "steps": [[str(s.source)] + s.argv for s in steps],
           "macros": macros, "compiler": toolchain.versions(record["backend"])}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def run_scan(record: dict, arch: str, csrc: Path, macros: str) -> List[str]:
    """Run the compiler's dependency pass over every source; the project files it read."""
    skip = toolchain_dirs(record)
    found: set = set()
    with tempfile.TemporaryDirectory(prefix="fkda-deps-") as tmp:
        tmpd = Path(tmp).resolve()
        macros_h = tmpd / "fkda_macros.h"
        macros_h.write_text(macros)
        for i, step in enumerate(commands.compile_steps(record, arch, csrc, macros_h)):
            dep = tmpd / f"{i}.d"
            cmd = step.argv + ["-M", "-MF", str(dep), "-MT", _TARGET, str(step.source)]
            r = subprocess.run(cmd, cwd=tmpd, capture_output=True, text=True)
            if r.returncode != 0 or not dep.is_file():
                raise BuildError(
                    f"flashkda_ext: building module '{record['name']}' ({record['backend']}, "
                    f"{arch}) failed: the preprocessor could not read "
                    f"{step.source.relative_to(csrc) if _inside(step.source, csrc) else step.source}."
                    f" Compiler output:\n{(r.stdout + r.stderr)[-12000:]}")
            found.update(classify(parse_depfile(dep.read_text()), csrc, skip, tmpd))
    return sorted(found)



class NotScanned(LookupError):
    """dependency_hashes(scan=False) found no valid cached scan."""


def dependency_hashes(record: dict, arch: str, root, macros: str, cache=None, *,
                      scan: bool = True) -> Dict[str, str]:
    """{path relative to csrc/: sha256} of every project file the module's compile reads.
    scan=False: only from a valid cached scan, else NotScanned (for reports over many modules,
    which should not run the compiler ~100 times)."""
    csrc = roots.csrc_dir(root).resolve()
    key = _scan_key(record, arch, csrc, macros)
    store = roots.cache_dir(cache) / ".deps" / f"{record['name']}-{key[:32]}.json"
    try:
        cached = json.loads(store.read_text())["files"]
        now = {rel: sha256_bytes(csrc / rel) for rel in cached}
        # a real scan always lists the sources themselves; an entry without them is corrupt and
        # would leave them out of the identity (a later edit would load a stale module)
        if now == cached and all(s in cached for s in record["sources"]):
            return now
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not scan:
        raise NotScanned(f"module '{record['name']}' ({arch}): no valid cached dependency scan")
    files = {rel: sha256_bytes(csrc / rel) for rel in run_scan(record, arch, csrc, macros)}
    try:  # best effort: a read-only cache only costs a scan per call
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f"{store.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, store)
    except OSError:
        pass
    return files
