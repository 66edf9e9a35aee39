"""load_module(name): AOT directories first, then a JIT build; one load per module per process.

AOT directories, in order: every folder in $FLASHKDA_EXT_AOT_DIR (os.pathsep-separated), then
flashkda_ext/_aot shipped inside the package. An artifact there is used only when its manifest entry's
identity equals the identity recomputed here from the current record, sources, macros, flags, arch and
tvm-ffi version (with the compiler versions the manifest records: the loading machine needs no
compiler) and the file's sha256 matches. Otherwise the module is JIT-built, unless
FLASHKDA_EXT_DISABLE_JIT=1, which raises JitDisabledError.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .. import paths
from . import roots
from .builder import build_module, resolve_arch, sha256_file
from .errors import JitDisabledError
from .identity import module_identity
from .specs import get_record

_lock = threading.RLock()
_modules: Dict[tuple, object] = {}
_manifests: Dict[str, tuple] = {}


def aot_dirs() -> List[Path]:
    out = []
    env = os.environ.get("FLASHKDA_EXT_AOT_DIR")
    if env:
        out += [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    shipped = paths.PACKAGE_DIR / "_aot"
    if shipped.is_dir():
        out.append(shipped)
    return out


def jit_disabled() -> bool:
    return os.environ.get("FLASHKDA_EXT_DISABLE_JIT", "").strip().lower() in ("1", "true", "yes", "on")


def _manifest(d: Path) -> Optional[dict]:
    path = d / "manifest.json"
    try:
        st = path.stat()
    except OSError:
        return None
    key = (st.st_mtime_ns, st.st_size)
    hit = _manifests.get(str(path))
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    _manifests[str(path)] = (key, data)
    return data


def find_aot(record: dict, arch: str, root=None) -> Tuple[Optional[Path], List[str]]:
    """(path of a verified AOT .so, or None; why each candidate was rejected)."""
    why = []
    for d in aot_dirs():
        man = _manifest(d)
        if man is None:
            why.append(f"{d}: no readable manifest.json")
            continue
        entries = [e for e in man.get("modules", [])
                   if e.get("name") == record["name"] and e.get("arch") == arch]
        if not entries:
            why.append(f"{d}: no entry for {record['name']} ({arch})")
            continue
        for e in entries:
            try:
                want = module_identity(record, arch, root, compiler=e["compiler"])
            except KeyError:
                why.append(f"{d}: entry for {record['name']} has no compiler versions")
                continue
            if e.get("identity") != want:
                why.append(f"{d}: {record['name']} was built from other sources, spec or tvm-ffi "
                           f"(identity {str(e.get('identity'))[:16]} != {want[:16]}); rebuild it "
                           f"with aot.py")
                continue
            so = d / e["file"]
            if not so.is_file() or sha256_file(so) != e.get("sha256"):
                why.append(f"{d}: {e['file']} is missing or corrupt (sha256 mismatch)")
                continue
            return so, why
    return None, why


def load_module(name: str, arch: Optional[str] = None, *, root=None, cache=None):
    """The loaded TVM-FFI module of a spec record (cached per process)."""
    import tvm_ffi

    key = (str(roots.data_root(root)), name, arch)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        record = get_record(name, root)
        real_arch = resolve_arch(record, arch)
        so, why = find_aot(record, real_arch, root)
        if so is None:
            if jit_disabled():
                searched = "; ".join(why) or "no AOT directory (set FLASHKDA_EXT_AOT_DIR)"
                raise JitDisabledError(
                    f"flashkda_ext: module '{name}' ({real_arch}) has no valid AOT artifact and "
                    f"FLASHKDA_EXT_DISABLE_JIT=1 forbids building it. Searched: {searched}. "
                    f"Build one with `python aot.py --arch {real_arch} --out DIR --only {name}` and "
                    f"set FLASHKDA_EXT_AOT_DIR=DIR, or unset FLASHKDA_EXT_DISABLE_JIT.")
            so = build_module(name, real_arch, root=root, cache=cache)
        mod = tvm_ffi.load_module(str(so))
        _modules[key] = mod
        return mod


def clear_cache() -> None:
    """Forget loaded modules (they stay mapped in the process); for tests."""
    with _lock:
        _modules.clear()
        _manifests.clear()
