"""Building one module from its spec record with ninja, into the cache, named by identity.

Cache layout (root: $FLASHKDA_EXT_CACHE_DIR, default ~/.cache/flashkda_ext):

    <cache>/<name>-<identity[:16]>/   <name>.so, meta.json, build.log, ptxas.log (CUDA),
                                      fkda_macros.h, build.ninja
    <cache>/.locks/<name>-<identity[:16]>.lock     one fcntl lock per identity
    <cache>/.tmp/                                  builds in progress (renamed into place when done)
    <cache>/.failed/<name>-<identity[:16]>/        the last failed build, for inspection

An artifact counts only when meta.json names the identity and the .so's size and sha256 match;
anything else (truncated, corrupt, half-written) is moved away and rebuilt.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import List, Optional

from . import roots, toolchain
from .errors import BuildError, ToolchainError
from .identity import identity_inputs, identity_of
from .lock import file_lock
from .specs import get_record


@dataclasses.dataclass
class BuildResult:
    name: str
    arch: str
    identity: str
    path: Path          # the .so
    built: bool         # False when a valid artifact was already there
    seconds: float
    compiler: dict      # version strings that went into the identity


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _device_arch_digits() -> Optional[str]:
    """'90' for an sm_90 device visible to an already-imported torch; None otherwise."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}{minor}"
    except Exception:  # a broken CUDA setup should not hide the real error from the build
        return None
    return None


def resolve_arch(record: dict, arch: Optional[str] = None) -> str:
    """The arch to build: 'host' for CPU modules; for CUDA the given one, else
    $FLASHKDA_EXT_CUDA_ARCH, else the current GPU's, else the record's first."""
    name = record["name"]
    if record["backend"] == "cpu":
        if arch is not None and toolchain.normalize_arch(arch) != "host":
            raise ValueError(f"module '{name}' is a cpu module; it builds for 'host', not {arch!r}")
        return "host"
    arch = arch or os.environ.get("FLASHKDA_EXT_CUDA_ARCH")
    if arch:
        a = toolchain.normalize_arch(arch)
        if a not in record["arches"]:
            raise ValueError(f"module '{name}' is built for {record['arches']}, not {a}")
        return a
    digits = _device_arch_digits()
    if digits is None:
        return record["arches"][0]
    for a in record["arches"]:
        if a[3:].rstrip("af") == digits:
            return a
    raise ValueError(f"module '{name}' supports {record['arches']}, but this GPU is sm_{digits}; "
                     f"use another route or add the arch to its spec record")


def artifact_name(name: str, identity: str) -> str:
    return f"{name}-{identity[:16]}"


def read_valid_meta(art_dir: Path, identity: str) -> Optional[dict]:
    """meta.json of a complete, uncorrupted artifact with this identity; None otherwise."""
    try:
        meta = json.loads((art_dir / "meta.json").read_text())
        so = art_dir / meta["file"]
        if meta.get("identity") != identity or so.stat().st_size != meta["size"]:
            return None
        if sha256_file(so) != meta["sha256"]:
            return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _ninja() -> List[str]:
    found = shutil.which("ninja")
    if found:
        return [found]
    try:
        import ninja  # the pip package ships the binary
        return [os.path.join(ninja.BIN_DIR, "ninja")]
    except ImportError:
        raise ToolchainError("ninja not found; pip install ninja") from None


def _jobs(jobs: Optional[int]) -> int:
    if jobs:
        return max(1, int(jobs))
    env = os.environ.get("MAX_JOBS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"MAX_JOBS={env!r} is not an integer") from None
    return max(1, os.cpu_count() or 1)


def _nq(s: str) -> str:
    """Escape a path for a ninja build line."""
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _cmd(args: List[str]) -> str:
    """Shell-quote, then escape for a ninja variable."""
    return " ".join(shlex.quote(a) for a in args).replace("$", "$$")


def include_flags(csrc: Path) -> List[str]:
    """-I flags of a module's sources: the project's csrc/, then tvm-ffi's headers."""
    import tvm_ffi.libinfo as libinfo

    incs = ["-I", str(csrc)]
    for p in libinfo.include_paths():
        incs += ["-I", str(p)]
    return incs


def _write_ninja(tmp: Path, record: dict, inputs: dict, csrc: Path) -> str:
    import tvm_ffi.libinfo as libinfo

    so_name = f"{record['name']}.so"
    cuda = record["backend"] == "cuda"
    flags = inputs["flags"]
    incs = include_flags(csrc)
    lib_dir = str(Path(libinfo.find_libtvm_ffi()).parent)
    header = ["-include", str(tmp / "fkda_macros.h")]
    cxx = toolchain.find_cxx()
    cxx_incs = list(incs)
    lines = ["ninja_required_version = 1.3", f"cxx = {_cmd([cxx])}"]
    if cuda:
        nvcc = toolchain.find_nvcc()
        cuda_inc = toolchain.cuda_include_dir(nvcc)
        if cuda_inc:
            cxx_incs += ["-I", cuda_inc]
        lines += [f"nvcc = {_cmd([nvcc])}",
                  f"nvccflags = {_cmd(flags['nvcc'] + incs + header)}"]
        linker = [nvcc] + flags["link"]
        ldflags = ["-L", lib_dir, "-ltvm_ffi", "-Xlinker", "-rpath", "-Xlinker", lib_dir]
    else:
        linker = [cxx] + flags["link"]
        ldflags = ["-L", lib_dir, "-ltvm_ffi", f"-Wl,-rpath,{lib_dir}"]
    lines += [
        f"cxxflags = {_cmd(flags['cxx'] + cxx_incs + header)}",
        f"link = {_cmd(linker)}",
        f"ldflags = {_cmd(ldflags)}",
        "",
        "rule cxx",
        "  command = $cxx $cxxflags -c $in -o $out",
        "  description = CXX $in",
        "",
        # the -Xptxas -v report of each .cu is kept beside its object for the registry check
        "rule nvcc",
        "  command = $nvcc $nvccflags -c $in -o $out > ${out}.log 2>&1; rc=$$?; cat ${out}.log; exit $$rc",
        "  description = NVCC $in",
        "",
        "rule link",
        "  command = $link $in -o $out $ldflags",
        "  description = LINK $out",
        "",
    ]
    objs = []
    for i, src in enumerate(record["sources"]):
        rule = "nvcc" if src.endswith(".cu") else "cxx"
        obj = f"obj/{i}_{Path(src).stem}.o"
        objs.append(obj)
        lines.append(f"build {_nq(obj)}: {rule} {_nq(str(csrc / src))}")
    lines.append(f"build {_nq(so_name)}: link {' '.join(_nq(o) for o in objs)}")
    lines.append(f"default {_nq(so_name)}")
    (tmp / "build.ninja").write_text("\n".join(lines) + "\n")
    return so_name


def _run_build(record: dict, arch: str, inputs: dict, identity: str, root, cache: Path,
               jobs: Optional[int]) -> float:
    name = record["name"]
    art = artifact_name(name, identity)
    (cache / ".tmp").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=art + "-", dir=cache / ".tmp"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the artifact dir should be readable
    t0 = time.perf_counter()
    try:
        (tmp / "fkda_macros.h").write_text(inputs["macros"])
        so_name = _write_ninja(tmp, record, inputs, roots.csrc_dir(root))
        cmd = _ninja() + ["-C", str(tmp), "-j", str(_jobs(jobs))]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        (tmp / "build.log").write_text(proc.stdout)
        if os.environ.get("FLASHKDA_EXT_VERBOSE") == "1":
            sys.stderr.write(proc.stdout)
        if proc.returncode != 0:
            failed = cache / ".failed" / art
            shutil.rmtree(failed, ignore_errors=True)
            failed.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, failed)
            tail = proc.stdout[-12000:]
            raise BuildError(
                f"flashkda_ext: building module '{name}' ({record['backend']}, {arch}) failed. "
                f"Compiler output:\n{tail}\n"
                f"The build files are kept in {failed}; fix the source or the spec record "
                f"({name}) and call again.")
        ptxas = sorted((tmp / "obj").glob("*.o.log"))
        if ptxas:
            (tmp / "ptxas.log").write_text("".join(p.read_text() for p in ptxas))
        shutil.rmtree(tmp / "obj", ignore_errors=True)
        for junk in (".ninja_log", ".ninja_deps"):
            (tmp / junk).unlink(missing_ok=True)
        so = tmp / so_name
        seconds = time.perf_counter() - t0
        meta = {"name": name, "arch": arch, "identity": identity, "file": so_name,
                "size": so.stat().st_size, "sha256": sha256_file(so), "build_id": uuid.uuid4().hex,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(seconds, 3), "compiler": inputs["compiler"],
                "tvm_ffi": inputs["tvm_ffi"], "files": inputs["files"]}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        final = cache / art
        if final.exists():  # an invalid leftover: move it out of the way, then drop it
            trash = cache / ".tmp" / f"stale-{art}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        return seconds
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_built(name: str, arch: Optional[str] = None, *, root=None, cache=None,
                 jobs: Optional[int] = None, force: bool = False) -> BuildResult:
    """Build the module unless a valid artifact of its identity is cached; return where it is."""
    record = get_record(name, root)
    arch = resolve_arch(record, arch)
    cache_root = roots.cache_dir(cache)
    try:
        inputs = identity_inputs(record, arch, root)
    except ToolchainError as e:
        raise ToolchainError(f"flashkda_ext: cannot build module '{name}' "
                             f"({record['backend']}, {arch}): {e}") from None
    identity = identity_of(inputs)
    art_dir = cache_root / artifact_name(name, identity)
    t0 = time.perf_counter()
    if not force:
        meta = read_valid_meta(art_dir, identity)
        if meta is not None:
            return BuildResult(name, arch, identity, art_dir / meta["file"], False,
                               time.perf_counter() - t0, inputs["compiler"])
    with file_lock(cache_root / ".locks" / (artifact_name(name, identity) + ".lock")):
        meta = None if force else read_valid_meta(art_dir, identity)
        built = False
        if meta is None:
            _run_build(record, arch, inputs, identity, root, cache_root, jobs)
            meta = read_valid_meta(art_dir, identity)
            if meta is None:
                raise BuildError(f"flashkda_ext: module '{name}' was built but its artifact in "
                                 f"{art_dir} does not verify; remove that folder and retry")
            built = True
    return BuildResult(name, arch, identity, art_dir / meta["file"], built,
                       time.perf_counter() - t0, inputs["compiler"])


def build_module(name: str, arch: Optional[str] = None, *, root=None, cache=None,
                 jobs: Optional[int] = None, force: bool = False) -> Path:
    """Path of the module's .so, building it first if needed."""
    return ensure_built(name, arch, root=root, cache=cache, jobs=jobs, force=force).path
