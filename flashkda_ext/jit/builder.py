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
    <cache>/flag_reader-<identity[:16]>/           the fast path's torch-linked flag test (flag_reader.py),
                                                   built here too (ensure_artifact)

An artifact counts only when meta.json names the identity and the .so's size and sha256 match;
anything else (truncated, corrupt, half-written) is moved away and rebuilt. ninja runs in its own
process group that dies with the calling process, so a killed build leaves no compiler running. Each
build says on stderr what it builds and why, then how long it took.
"""
from __future__ import annotations

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
from ..switches import env_switch
from .lock import file_lock, lock_timeout, try_lock
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
    env = None if arch else os.environ.get("FLASHKDA_EXT_CUDA_ARCH")
    arch = arch or env
    if arch:
        try:
            a = toolchain.normalize_arch(arch)
        except ValueError as e:
            if env:  # name the variable the bad value came from
                raise ValueError(f"FLASHKDA_EXT_CUDA_ARCH={env!r}: {e}") from None
            raise
        if a not in record["arches"]:
            src = f" (FLASHKDA_EXT_CUDA_ARCH={env!r})" if env else ""
            raise ValueError(f"module '{name}' is built for {record['arches']}, not {a}{src}")
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


# ninja reads -j into a C int: a larger count would wrap in silence (2**32 + 1 jobs runs one)
MAX_JOBS_VALUE = 2**31 - 1


def _check_jobs(jobs) -> None:
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int)
                             or not 1 <= jobs <= MAX_JOBS_VALUE):
        # not clamped to 1 in silence (0 or -1 may have meant "every core", which is None)
        raise ValueError(f"jobs: expected an int >= 1 and <= {MAX_JOBS_VALUE} (or None: MAX_JOBS, else every "
                         f"core), got {jobs!r}")


def _jobs(jobs: Optional[int]) -> int:
    if jobs is not None:
        _check_jobs(jobs)
        return jobs
    env = os.environ.get("MAX_JOBS")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"MAX_JOBS={env!r} is not an integer") from None
        if value < 1:  # not clamped in silence: a one-job build may be what made it slow
            raise ValueError(f"MAX_JOBS={env!r} must be at least 1 (or unset: every core)")
        if value > MAX_JOBS_VALUE:
            raise ValueError(f"MAX_JOBS={env!r} must be at most {MAX_JOBS_VALUE} (ninja's -j is a C int)")
        return value
    return max(1, os.cpu_count() or 1)


def _verbose() -> bool:
    """$FLASHKDA_EXT_VERBOSE: a switch; any other value is refused, not read as "off" in silence."""
    return env_switch("FLASHKDA_EXT_VERBOSE", False, on="echo build output")


def check_build_env(jobs: Optional[int] = None) -> None:
    """Read every setting a build would read (jobs / MAX_JOBS, FLASHKDA_EXT_LOCK_TIMEOUT,
    FLASHKDA_EXT_VERBOSE), so a bad one is refused on every call, a cached module's too, and before
    the dependency scan runs the compiler or anything is written to the cache."""
    _jobs(jobs)
    lock_timeout()
    _verbose()


def _sh(argv: List[str]) -> str:
    """A shell command line for a ninja variable: shell-quoted here, ninja-escaped by the caller."""
    return " ".join(shlex.quote(a) for a in argv)


def include_flags(csrc: Path) -> List[str]:
    """-I flags of a module's sources (kept here for callers of the builder's API)."""
    return commands.include_flags(csrc)


def write_ninja(tmp: Path, so_name: str, steps: List[commands.Compile], link: List[str],
                libs: List[str]) -> None:
    """build.ninja in tmp (ninja's own ninja_syntax): compile each step, link the objects to so_name."""
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
        w.build(so_name, "link", objs, variables={"link": ninja_syntax.escape(_sh(link)),
                                                  "ldflags": ninja_syntax.escape(_sh(libs))})
        w.default(so_name)


def _module_writer(record: dict, arch: str, macros: str, csrc: Path):
    """The build-folder writer of a spec record: its macro header and build.ninja."""
    def write(tmp: Path) -> str:
        (tmp / "fkda_macros.h").write_text(macros)
        so_name = f"{record['name']}.so"
        write_ninja(tmp, so_name, commands.compile_steps(record, arch, csrc, tmp / "fkda_macros.h"),
                    commands.link_argv(record), commands.link_libs(record))
        return so_name
    return write


def _with_death_signal(cmd: List[str]) -> List[str]:
    """cmd, started through _die_with_parent.py: SIGTERM when this process dies (even by SIGKILL).
    ninja, on SIGTERM, terminates the process group of every command it runs (each compiler runs in
    its own group), so nothing outlives the Python process. The kernel ties the signal to the thread
    that started the process: that thread waits for ninja, so it outlives the build."""
    return [sys.executable, "-S", "-E", "-s", str(Path(__file__).with_name("_die_with_parent.py")),
            str(os.getpid())] + cmd


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
    proc = subprocess.Popen(_with_death_signal(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
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


def announce(line: str) -> None:
    """One line on stderr: a build never keeps a caller waiting in silence."""
    sys.stderr.write(f"flashkda_ext: {line}\n")
    sys.stderr.flush()


def build_reason(cache: Path, name: str, identity: str, files: Optional[dict] = None) -> str:
    """Why <name>-<identity> is being built: a corrupt copy of it, or an older build of the same
    name whose inputs differ (the changed csrc/ files named when its meta.json lists them)."""
    if (cache / artifact_name(name, identity)).exists():
        return "the cached copy is incomplete or corrupt"
    changed: set = set()
    older = False
    for meta_path in cache.glob(f"{name}-*/meta.json"):
        try:
            old = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(old, dict) or old.get("name") != name:
            continue
        older = True
        old_files = old.get("files")
        if not isinstance(old_files, dict):  # a corrupt meta.json: no file list to compare
            old_files = {}
        if files:
            changed.update(r for r in set(old_files) | set(files) if old_files.get(r) != files.get(r))
    if changed:
        shown = sorted(changed)
        return "sources changed (" + ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "") + ")"
    if older:
        return "inputs changed (spec, flags, compiler or versions)"
    return "not in the cache"


def _run_build(cache: Path, art: str, label: str, hint: str, write, meta_extra: dict,
               jobs: Optional[int]) -> float:
    """Build into a fresh .tmp/ folder (write(tmp) writes build.ninja there and returns the .so's
    name), then rename it to <cache>/<art>. The caller holds art's lock; a failed build goes to
    .failed/<art>."""
    (cache / ".tmp").mkdir(parents=True, exist_ok=True)
    reclaim_abandoned(cache, held=art)
    tmp = Path(tempfile.mkdtemp(prefix=art + "-", dir=cache / ".tmp"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the artifact dir should be readable
    t0 = time.perf_counter()
    try:
        so_name = write(tmp)
        rc, output = _run_ninja(_ninja() + ["-C", str(tmp), "-j", str(_jobs(jobs))])
        (tmp / "build.log").write_text(output)
        if _verbose():
            sys.stderr.write(output)
        if rc != 0:
            failed = cache / ".failed" / art
            shutil.rmtree(failed, ignore_errors=True)
            failed.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, failed)
            raise BuildError(f"flashkda_ext: building {label} failed. Compiler output:\n"
                             f"{output[-12000:]}\nThe build files are kept in {failed}; {hint}.")
        ptxas = sorted((tmp / "obj").glob("*.o.log"))
        if ptxas:
            (tmp / "ptxas.log").write_text("".join(p.read_text() for p in ptxas))
        shutil.rmtree(tmp / "obj", ignore_errors=True)
        for junk in (".ninja_log", ".ninja_deps"):
            (tmp / junk).unlink(missing_ok=True)
        so = tmp / so_name
        seconds = time.perf_counter() - t0
        meta = {**meta_extra, "file": so_name, "size": so.stat().st_size, "sha256": sha256_file(so),
                "build_id": uuid.uuid4().hex,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(seconds, 3)}
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


def _check_writable(cache: Path, label: str) -> None:
    """A build needs .locks/ and .tmp/ to write in: say so by the cache's name, the module's and
    the remedies, not as a bare PermissionError from deep inside the lock (a read-only cache)."""
    try:
        for sub in (".locks", ".tmp"):
            (cache / sub).mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix="probe-", dir=cache / ".tmp"))
    except OSError as e:
        raise BuildError(
            f"flashkda_ext: cannot build {label}: the JIT cache {cache} is not writable ({e}). "
            f"Set FLASHKDA_EXT_CACHE_DIR to a writable folder, or ship the module prebuilt "
            f"(aot.py, FLASHKDA_EXT_AOT_DIR)") from e


def ensure_artifact(cache: Path, name: str, identity: str, label: str, hint: str, write,
                    meta_extra: dict, *, jobs: Optional[int] = None, force: bool = False,
                    files: Optional[dict] = None) -> Tuple[Path, dict, bool]:
    """(folder, meta, built) of the valid artifact <cache>/<name>-<identity[:16]>, built under its
    lock when missing or invalid, with one stderr line before the build (what and why) and one
    after. meta_extra holds "name" and "identity"; files ({csrc path: sha256}) lets the reason name
    the changed files; hint ends a build error (what to do)."""
    art = artifact_name(name, identity)
    art_dir = cache / art
    if not force:
        meta = read_valid_meta(art_dir, identity)
        if meta is not None:
            return art_dir, meta, False
    check_build_env(jobs)   # a bad setting is refused before .locks/ and .tmp/ are written
    _check_writable(cache, label)
    with file_lock(lock_path(cache, art), what=f"the build of {label}"):
        meta = None if force else read_valid_meta(art_dir, identity)  # another process built it
        if meta is not None:
            return art_dir, meta, False
        why = "forced" if force else build_reason(cache, name, identity, files)
        announce(f"building {label}: {why} ...")
        seconds = _run_build(cache, art, label, hint, write, meta_extra, jobs)
        meta = read_valid_meta(art_dir, identity)
        if meta is None:
            raise BuildError(f"flashkda_ext: {label} was built but its artifact in {art_dir} does "
                             f"not verify; remove that folder and retry")
        announce(f"built {label} in {seconds:.1f} s")
        return art_dir, meta, True


def ensure_built(name: str, arch: Optional[str] = None, *, root=None, cache=None,
                 jobs: Optional[int] = None, force: bool = False) -> BuildResult:
    """Build the module unless a valid artifact of its identity is cached; return where it is."""
    check_build_env(jobs)   # on every call, a cached module's too, before the dependency scan runs
    record = get_record(name, root)
    arch = resolve_arch(record, arch)
    cache_root = roots.cache_dir(cache)
    label = f"module '{name}' ({record['backend']}, {arch})"
    try:
        inputs = identity_inputs(record, arch, root, cache=cache_root)
    except ToolchainError as e:
        raise ToolchainError(f"flashkda_ext: cannot build {label}: {e}") from None
    identity = identity_of(inputs)
    t0 = time.perf_counter()
    meta_extra = {"name": name, "arch": arch, "identity": identity, "compiler": inputs["compiler"],
                  "tvm_ffi": inputs["tvm_ffi"], "files": inputs["files"]}
    art_dir, meta, built = ensure_artifact(
        cache_root, name, identity, label, f"fix the source or the spec record ({name}) and call again",
        _module_writer(record, arch, inputs["macros"], roots.csrc_dir(root)), meta_extra,
        jobs=jobs, force=force, files=inputs["files"])
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
