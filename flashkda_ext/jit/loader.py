"""load_module(name): AOT directories first, then a JIT build; one load per module per process.

AOT directories, in order: every folder in $FLASHKDA_EXT_AOT_DIR (os.pathsep-separated), then
flashkda_ext/_aot shipped inside the package. Each folder's manifest.json is checked against
jit/schema/aot_manifest.schema.json (a bad one: ManifestError naming the file and field with JIT
disabled; a warning, then a JIT build, otherwise; a folder that does not exist: named in the error with JIT
disabled, one warning per folder otherwise). An artifact there is used only when its manifest
entry's identity equals the identity recomputed here from the current record, macros, flags, arch,
tvm-ffi version and the current bytes of its source set (with the compiler versions the manifest
records: the loading machine needs no compiler) and the file's sha256 matches. The source set is
recomputed from the shipped sources (their #include closure, which for every record equals the
compiler's own dependency scan: tests/test_aot.py), joined with the files the entry lists; so an
entry that omits a header its sources include, edited or not, never verifies.
Otherwise the module is JIT-built, unless FLASHKDA_EXT_DISABLE_JIT=1, which raises
JitDisabledError. An artifact that verifies but does not load (dlopen refuses it) is moved away
and rebuilt once (JIT cache), or skipped with a warning (AOT, JIT on), or named in the error; so is
one that loads but does not export its record's entry function (a foreign or mismatched module).
"""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .. import paths
from ..switches import env_switch
from . import roots
from .builder import discard_artifact, ensure_built, resolve_arch, sha256_file
from .depscan import sha256_bytes
from .errors import BuildError, JitDisabledError, ManifestError, ModuleMismatchError
from .identity import include_closure, module_identity
from .manifest import read_manifest
from .specs import get_record

_lock = threading.RLock()
_modules: Dict[tuple, object] = {}
_manifests: Dict[str, tuple] = {}
_missing_warned: set = set()     # FLASHKDA_EXT_AOT_DIR folders that do not exist, warned about once each


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
    """$FLASHKDA_EXT_DISABLE_JIT; any other value is refused: a typo must not mean "JIT on" on a
    server meant to run prebuilt modules only."""
    return env_switch("FLASHKDA_EXT_DISABLE_JIT", False, on="never build", off="build when needed")


def _manifest(d: Path) -> Optional[dict]:
    """The folder's checked manifest (None: it has none), cached by the file's mtime and size.
    A bad one raises ManifestError with JIT disabled; with JIT on it warns once and counts as
    absent, so the module is built instead."""
    path = d / "manifest.json"
    try:
        st = path.stat()
        key = (st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    hit = _manifests.get(str(path))
    if hit is None or hit[0] != key:
        try:
            hit = (key, read_manifest(d), None)
        except ManifestError as e:
            hit = (key, None, e)
            if not jit_disabled():
                warnings.warn(f"{e}; ignoring this AOT folder, the module is JIT-built instead",
                              RuntimeWarning, stacklevel=4)
        _manifests[str(path)] = hit
    if hit[2] is not None and jit_disabled():
        raise hit[2]
    return hit[1]


def find_aot(record: dict, arch: str, root=None) -> Tuple[Optional[Path], List[str]]:
    """(path of a verified AOT .so, or None; why each candidate was rejected)."""
    why = []
    csrc = roots.csrc_dir(root)
    shipped = None
    for d in aot_dirs():
        man = _manifest(d)
        if man is None:     # a folder that is not there (a typo) said "no usable manifest.json" too
            if d.exists():
                why.append(f"{d}: no usable manifest.json")
                continue
            why.append(f"{d}: no such folder (FLASHKDA_EXT_AOT_DIR)")
            if str(d) not in _missing_warned and not jit_disabled():
                # as a bad manifest warns: a typo in the variable must not silently mean "build everything"
                _missing_warned.add(str(d))
                warnings.warn(f"FLASHKDA_EXT_AOT_DIR names {d}, which does not exist; the modules it was meant to "
                              f"hold are JIT-built instead", RuntimeWarning, stacklevel=3)
            continue
        entries = [e for e in man["modules"] if e["name"] == record["name"] and e["arch"] == arch]
        if not entries:
            why.append(f"{d}: no entry for {record['name']} ({arch})")
            continue
        if shipped is None:  # read only when an AOT folder has an entry for the module
            shipped = include_closure(record["sources"], csrc)
        for e in entries:
            files = sorted(set(e["files"]) | set(shipped))
            want = module_identity(record, arch, root, compiler=e["compiler"], files=files)
            if e["identity"] != want:
                omitted = [rel for rel in shipped if rel not in e["files"]]
                changed = sorted(rel for rel, h in e["files"].items()
                                 if sha256_bytes(csrc / rel) != h)
                if omitted:
                    what = (f"its entry omits csrc/ files the sources include: "
                            f"{', '.join(omitted[:5])}")
                elif changed:
                    what = f"csrc/ files changed since: {', '.join(changed[:5])}"
                else:
                    what = "other spec, macros, flags or tvm-ffi"
                why.append(f"{d}: {record['name']} was built from other inputs ({what}; identity "
                           f"{e['identity'][:16]} != {want[:16]}); rebuild it with aot.py")
                continue
            so = d / e["file"]
            if not so.is_file() or sha256_file(so) != e["sha256"]:
                why.append(f"{d}: {e['file']} is missing or corrupt (sha256 mismatch)")
                continue
            return so, why
    return None, why


def _load(so: Path):
    import tvm_ffi
    return tvm_ffi.load_module(str(so))


def _open(so: Path, record: dict):
    """The loaded module, checked to export its record's entry function: a foreign or mismatched
    .so (another module's, an old build's) is refused here by name, not at the call as a raw
    AttributeError."""
    mod = _load(so)
    entry = record["entry"]
    if not mod.implements_function(entry):
        raise ModuleMismatchError(
            f"{so} does not export '{entry}', the entry function of module '{record['name']}': "
            f"a foreign or mismatched module file")
    return mod


def _load_aot(record: dict, arch: str, so: Path):
    """The module from a verified AOT file, or None (JIT on: warned) when dlopen refuses it or it
    is not the module its manifest says."""
    name = record["name"]
    try:
        return _open(so, record)
    except Exception as e:  # noqa: BLE001  dlopen's reasons are many (bad ELF, missing symbol)
        msg = (f"flashkda_ext: the AOT artifact {so} of module '{name}' ({arch}) matches its "
               f"manifest but does not load: {e}")
        if jit_disabled():
            raise JitDisabledError(
                f"{msg}. Delete the AOT folder {so.parent} (or rebuild it with `python aot.py "
                f"--arch {arch} --out {so.parent}`), or unset FLASHKDA_EXT_DISABLE_JIT.") from e
        warnings.warn(msg + "; building it instead", RuntimeWarning, stacklevel=3)
        return None


def _load_built(record: dict, arch: str, root, cache):
    """Build (or reuse) and load; a cached artifact that verifies but does not load (or is not
    the module) is moved to .failed/ and rebuilt once, so one bad file cannot wedge the cache."""
    name = record["name"]
    res = ensure_built(name, arch, root=root, cache=cache)
    try:
        return _open(res.path, record)
    except Exception as first:  # noqa: BLE001
        failed = discard_artifact(res.path.parent, f"{res.path} did not load: {first}")
        res = ensure_built(name, arch, root=root, cache=cache)
        try:
            return _open(res.path, record)
        except Exception as second:  # noqa: BLE001
            raise BuildError(
                f"flashkda_ext: module '{name}' ({arch}) was rebuilt in {res.path.parent} but "
                f"still does not load: {second} (the first artifact, which failed with: {first}, "
                f"is in {failed}). Delete {res.path.parent} and check the toolchain.") from second


def load_module(name: str, arch: Optional[str] = None, *, root=None, cache=None):
    """The loaded TVM-FFI module of a spec record (cached per process)."""
    key = (str(roots.data_root(root)), name, arch)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        record = get_record(name, root)
        real_arch = resolve_arch(record, arch)
        so, why = find_aot(record, real_arch, root)
        mod = _load_aot(record, real_arch, so) if so is not None else None
        if mod is None:
            if jit_disabled():
                searched = "; ".join(why) or "no AOT directory (set FLASHKDA_EXT_AOT_DIR)"
                raise JitDisabledError(
                    f"flashkda_ext: module '{name}' ({real_arch}) has no valid AOT artifact and "
                    f"FLASHKDA_EXT_DISABLE_JIT=1 forbids building it. Searched: {searched}. "
                    f"Build one with `python aot.py --arch {real_arch} --out DIR --only {name}` and "
                    f"set FLASHKDA_EXT_AOT_DIR=DIR, or unset FLASHKDA_EXT_DISABLE_JIT.")
            mod = _load_built(record, real_arch, root, cache)
        _modules[key] = mod
        return mod


def clear_cache() -> None:
    """Forget loaded modules (they stay mapped in the process); for tests."""
    with _lock:
        _modules.clear()
        _manifests.clear()
