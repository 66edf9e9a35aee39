"""Building one module from its spec record with ninja, into the cache, named by identity.

Cache layout (root: $FLASHKDA_EXT_CACHE_DIR, default ~/.cache/flashkda_ext):

    <cache>/<name>-<identity[:16]>/   <name>.so, meta.json, build.log, ptxas.log (CUDA),
                                      fkda_macros.h, build.ninja
    <cache>/.locks/<name>-<identity[:16]>.lock     one filelock per identity, held while building
    <cache>/.tmp/                                  builds in progress (renamed into place when done);
                                                   a folder whose lock is free is a dead build's and
                                                   is removed by the next build
    <cache>/.deps/                                 cached compiler dependency scans (depscan.py)
    <cache>/.failed/<name>-<identity[:16]>/        the last failed (or unloadable) build, to inspect

An artifact counts only when meta.json names the identity and the .so's size and sha256 match;
anything else (truncated, corrupt, half-written) is moved away and rebuilt. ninja runs in its own
process group that dies with the calling process, so a killed build leaves no compiler running.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import List, Optional, Tuple

from ninja import ninja_syntax

from . import commands, roots, toolchain
from .errors import BuildError, ToolchainError
from .identity import identity_inputs, identity_of
from .lock import file_lock, try_lock
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
    files: dict = dataclasses.field(default_factory=dict)  # {csrc-relative path: sha256} it read


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


def _sh(argv: List[str]) -> str:
    """A shell command line for a ninja variable: shell-quoted here, ninja-escaped by the caller."""
    return " ".join(shlex.quote(a) for a in argv)


def include_flags(csrc: Path) -> List[str]:
    """-I flags of a module's sources (kept here for callers of the builder's API)."""
    return commands.include_flags(csrc)


def _write_ninja(tmp: Path, record: dict, arch: str, csrc: Path) -> str:
    """build.ninja in tmp, written with ninja's own ninja_syntax; returns the .so's name."""
    so_name = f"{record['name']}.so"
    steps = commands.compile_steps(record, arch, csrc, tmp / "fkda_macros.h")
    with open(tmp / "build.ninja", "w") as f:
        w = ninja_syntax.Writer(f, width=120)
        w.variable("ninja_required_version", "1.3")
        w.rule("cxx", command="$cmd -c $in -o $out", description="CXX $in")
        # the -Xptxas -v report of each .cu is kept beside its object for the registry check
        w.rule("nvcc", command="$cmd -c $in -o $out > $out.log 2>&1; rc=$$?; cat $out.log; "
                               "exit $$rc", description="NVCC $in")
        w.rule("link", command="$link $in -o $out $ldflags", description="LINK $out")
        objs = []
        for i, step in enumerate(steps):
            obj = f"obj/{i}_{step.source.stem}.o"
            objs.append(obj)
            w.build(obj, step.rule, str(step.source),
                    variables={"cmd": ninja_syntax.escape(_sh(step.argv))})
        w.build(so_name, "link", objs,
                variables={"link": ninja_syntax.escape(_sh(commands.link_argv(record))),
                           "ldflags": ninja_syntax.escape(_sh(commands.link_libs(record)))})
        w.default(so_name)
    return so_name


def _die_with_parent():
    """preexec_fn for the build: SIGTERM when the process that started it dies (even by SIGKILL).

    ninja, on SIGTERM, terminates the process group of every command it runs (each compiler runs
    in its own group), so nothing outlives the Python process. Linux only (prctl); elsewhere the
    new session and the killpg on exceptions still apply. The kernel ties PDEATHSIG to the thread
    that forked: that thread waits for ninja, so it outlives the build."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def pre():  # runs between fork and exec: one C call and two syscalls, no Python lock
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return pre


_PR_SET_PDEATHSIG = 1


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop ninja's process group: SIGTERM (ninja then stops its compilers), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_ninja(cmd: List[str]) -> Tuple[int, str]:
    """Run ninja in its own session (a terminal's Ctrl-C reaches Python, which stops the group)
    that dies with this process; (returncode, combined output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_die_with_parent())
    try:
        out, _ = proc.communicate()
    except BaseException:
        _stop_group(proc)
        raise
    return proc.returncode, out


_TMP_RE = re.compile(r"^(?:stale-)?([a-z][a-z0-9_]*-[0-9a-f]{16})-[A-Za-z0-9_]{8}$")


def lock_path(cache: Path, art: str) -> Path:
    return cache / ".locks" / f"{art}.lock"


def reclaim_abandoned(cache: Path, held: Optional[str] = None) -> List[Path]:
    """Remove .tmp/ folders of builds that died: a folder's build holds its identity's lock for as
    long as it runs, so a folder whose lock is free (or held by this caller: held) is abandoned."""
    removed = []
    tmpdir = cache / ".tmp"
    try:
        entries = list(tmpdir.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_RE.match(entry.name)
        if not m:
            continue
        art = m.group(1)
        if art == held:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            continue
        lock = try_lock(lock_path(cache, art))
        if lock is None:  # a live build owns it
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            lock.release()
    return removed


def _run_build(record: dict, arch: str, inputs: dict, identity: str, root, cache: Path,
               jobs: Optional[int]) -> float:
    name = record["name"]
    art = artifact_name(name, identity)
    (cache / ".tmp").mkdir(parents=True, exist_ok=True)
    reclaim_abandoned(cache, held=art)
    tmp = Path(tempfile.mkdtemp(prefix=art + "-", dir=cache / ".tmp"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the artifact dir should be readable
    t0 = time.perf_counter()
    try:
        (tmp / "fkda_macros.h").write_text(inputs["macros"])
        so_name = _write_ninja(tmp, record, arch, roots.csrc_dir(root))
        rc, output = _run_ninja(_ninja() + ["-C", str(tmp), "-j", str(_jobs(jobs))])
        (tmp / "build.log").write_text(output)
        if os.environ.get("FLASHKDA_EXT_VERBOSE") == "1":
            sys.stderr.write(output)
        if rc != 0:
            failed = cache / ".failed" / art
            shutil.rmtree(failed, ignore_errors=True)
            failed.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, failed)
            tail = output[-12000:]
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
        inputs = identity_inputs(record, arch, root, cache=cache_root)
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
                               time.perf_counter() - t0, inputs["compiler"], inputs["files"])
    with file_lock(lock_path(cache_root, artifact_name(name, identity)),
                   what=f"the build of module '{name}'"):
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
                       time.perf_counter() - t0, inputs["compiler"], inputs["files"])


def discard_artifact(art_dir: Path, reason: str) -> Path:
    """Move a cached artifact folder that verifies but cannot be used (e.g. it does not load) to
    .failed/ under its lock, with the reason beside it; return where it went."""
    art_dir = Path(art_dir)
    cache = art_dir.parent
    failed = cache / ".failed" / art_dir.name
    with file_lock(lock_path(cache, art_dir.name), what=f"the artifact {art_dir}"):
        if art_dir.exists():  # else another process discarded it first: keep its report
            shutil.rmtree(failed, ignore_errors=True)
            failed.parent.mkdir(parents=True, exist_ok=True)
            os.rename(art_dir, failed)
            (failed / "discarded.txt").write_text(reason + "\n")
    return failed


def build_module(name: str, arch: Optional[str] = None, *, root=None, cache=None,
                 jobs: Optional[int] = None, force: bool = False) -> Path:
    """Path of the module's .so, building it first if needed."""
    return ensure_built(name, arch, root=root, cache=cache, jobs=jobs, force=force).path
