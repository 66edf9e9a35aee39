"""Module identity: what a build depends on, hashed.

sha256 over canonical JSON of: the record, the bytes of every project file the compiler reads for
it (its own dependency output, see depscan; paths relative to csrc/), the rendered macro header,
the compile and link flags, the arch, the compiler version strings and tvm_ffi.__version__. No
absolute path enters, so two checkouts agree.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from . import depscan, roots, toolchain
from .macros import render_header

# Bump when the builder changes how artifacts are produced. Not bumped for the compiler-reported
# file list: an artifact built when a read file went unhashed cannot match, because that file is in
# the list now; every current record's identity is unchanged, so existing caches stay valid.
IDENTITY_SCHEME = 1
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*(?:"([^"]+)"|<([^>]+)>)', re.MULTILINE)


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def include_closure(sources: List[str], csrc: Path) -> List[str]:
    """Sources plus every project header reached by #include "..." (relative to the including file,
    then to csrc/) or #include <...> (relative to csrc/), as sorted paths relative to csrc/.

    A text-level approximation for the source checks (checks.py reads the macros each module's
    sources use, over all 100+ records, where running the preprocessor per record would be slow);
    the identity does not use it: it takes the compiler's own list (depscan)."""
    csrc = csrc.resolve()
    seen: Dict[str, Path] = {}
    todo = [csrc / s for s in sources]
    while todo:
        p = todo.pop().resolve()
        try:
            rel = str(p.relative_to(csrc))
        except ValueError:
            continue
        if rel in seen or not p.is_file():
            continue
        seen[rel] = p
        text = p.read_text(errors="replace")
        for quoted, angled in _INCLUDE_RE.findall(text):
            for base in ((p.parent, csrc) if quoted else (csrc,)):
                cand = base / (quoted or angled)
                if cand.is_file():
                    todo.append(cand)
                    break
    return sorted(seen)


def _tvm_ffi_version() -> str:
    import tvm_ffi
    return tvm_ffi.__version__


def identity_inputs(record: dict, arch: str, root=None, *, compiler: Optional[dict] = None,
                    tvm_ffi_version: Optional[str] = None, files: Optional[Iterable[str]] = None,
                    cache=None, scan: bool = True) -> dict:
    """Everything the identity hashes.

    compiler: version strings (default: the local toolchain's). files: the csrc-relative paths a
    build recorded (an AOT manifest entry): their current bytes are hashed and no compiler runs;
    by default the compiler's dependency scan lists them (cached in the JIT cache, see depscan);
    scan=False uses only a cached scan and raises depscan.NotScanned without one."""
    csrc = roots.csrc_dir(root)
    macros = render_header(record, root)
    if files is None:
        hashes = depscan.dependency_hashes(record, arch, root, macros, cache, scan=scan)
    else:
        hashes = {rel: depscan.sha256_bytes(csrc / rel) for rel in files}
    return {
        "scheme": IDENTITY_SCHEME,
        "record": json.loads(canonical_json(record)),
        "files": hashes,
        "macros": macros,
        "flags": toolchain.compile_flags(record, arch),
        "arch": arch,
        "compiler": compiler if compiler is not None else toolchain.versions(record["backend"]),
        "tvm_ffi": tvm_ffi_version if tvm_ffi_version is not None else _tvm_ffi_version(),
    }


def identity_of(inputs: dict) -> str:
    return hashlib.sha256(canonical_json(inputs).encode()).hexdigest()


def module_identity(record: dict, arch: str, root=None, *, compiler: Optional[dict] = None,
                    tvm_ffi_version: Optional[str] = None, files: Optional[Iterable[str]] = None,
                    cache=None) -> str:
    return identity_of(identity_inputs(record, arch, root, compiler=compiler,
                                       tvm_ffi_version=tvm_ffi_version, files=files, cache=cache))
