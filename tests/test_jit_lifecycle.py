"""What a build leaves behind when it is killed, what a cached artifact that verifies but does not
load does, and the cache lock's timeout."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from flashkda_ext.jit import builder, ensure_built, load_module, loader
from flashkda_ext.jit.errors import LockTimeoutError
from flashkda_ext.jit.lock import file_lock, try_lock

from jit_tree import tree  # noqa: F401 (the fixture)


def _children() -> dict:
    """{ppid: [pid, ...]} of every process now, from /proc."""
    kids: dict = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _descendants(pid: int) -> dict:
    """{pid: command name} of every descendant of pid."""
    kids, out, todo = _children(), {}, [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            try:
                out[c] = Path(f"/proc/{c}/comm").read_text().strip()
            except OSError:
                continue
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent has not reaped it


# The "compiler" of the killed build: the real g++ for the dependency scan and --version, but a
# compile (-c) first sleeps, so the build is surely running when the test kills its process.
_SLOW_CXX = """#!/bin/sh
case " $* " in *" -c "*) sleep 300 ;; esac
exec g++ "$@"
"""

_BUILD = textwrap.dedent("""
    import sys
    from flashkda_ext.jit import ensure_built
    ensure_built("toy_cpu", root=sys.argv[1])
""")


def _slow_cxx(tmp_path) -> str:
    cxx = tmp_path / "slow-g++"
    cxx.write_text(_SLOW_CXX)
    cxx.chmod(0o755)
    return str(cxx)


def _kill_mid_build(argv, env) -> None:
    """Start argv, wait until its build's compiler runs (the slow g++'s sleep, under ninja), SIGKILL
    the process, and check that nothing it started is left running."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs = {}
    try:
        deadline = time.time() + 180
        while time.time() < deadline and "sleep" not in procs.values():
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.2)
            procs = _descendants(proc.pid)
        assert "sleep" in procs.values() and "ninja" in procs.values(), procs
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and any(_alive(p) for p in procs):
            time.sleep(0.2)
        left = {p: n for p, n in procs.items() if _alive(p)}
        assert not left, f"still running after the build's process was killed: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        for p in procs:  # never leave a sleeper behind, pass or fail (by the pids seen alive)
            if not _alive(p):
                continue
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def _lock_is_free(cache: Path, prefix: str) -> bool:
    """Every lock file of prefix's builds under cache exists (the dead build left it) and is free."""
    locks = list((cache / ".locks").glob(prefix + "-*.lock"))
    for path in locks:
        held = try_lock(path)
        if held is None:
            return False
        held.release()
    return bool(locks)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_during_build_stops_ninja_and_its_compilers(tree, tmp_path):
    cache = tmp_path / "cache"
    env = dict(os.environ, CXX=_slow_cxx(tmp_path), FLASHKDA_EXT_CACHE_DIR=str(cache))
    _kill_mid_build([sys.executable, "-c", _BUILD, str(tree)], env)
    # the dead build's temp folder is still there; its lock is free, so it is reclaimed
    left_tmp = [p for p in (cache / ".tmp").iterdir() if p.name.startswith("toy_cpu-")]
    assert len(left_tmp) == 1 and _lock_is_free(cache, "toy_cpu")
    assert builder.reclaim_abandoned(cache) == left_tmp and not left_tmp[0].exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_process_after_a_killed_build_does_not_block(tree, tmp_path):
    """The next process takes the dead build's lock at once, builds, says so, and leaves no temp
    folder: bounded by the subprocess timeout, not by the lock's 30-minute one."""
    cache = tmp_path / "cache"
    env = dict(os.environ, CXX=_slow_cxx(tmp_path), FLASHKDA_EXT_CACHE_DIR=str(cache))
    _kill_mid_build([sys.executable, "-c", _BUILD, str(tree)], env)
    env.pop("CXX")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", _BUILD, str(tree)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "building module 'toy_cpu' (cpu, host): not in the cache" in r.stderr
    assert time.time() - t0 < 120 and list((cache / ".tmp").iterdir()) == []
    assert len(list(cache.glob("toy_cpu-*/toy_cpu.so"))) == 1


_FLAG_BUILD = textwrap.dedent("""
    from flashkda_ext import flag_reader
    flag_reader.build()
""")

# the next process's armed call: the background build, then which test serves
_FLAG_ARM = textwrap.dedent("""
    from flashkda_ext import fast_path, flag_reader
    fast_path._install(flag_reader.ensure(fast_path._install))
    flag_reader.wait(300)
    print(fast_path.plain_ok is fast_path._py_plain_ok)
""")

# a compiler that fails every compile at once (the fallback path, without a 10 s torch compile)
_BROKEN_CXX = """#!/bin/sh
case " $* " in *" -c "*) echo "broken compiler" >&2; exit 1 ;; esac
exec g++ "$@"
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_flag_reader_build_killed_midway_blocks_nothing(tmp_path):
    """torch's FileBaton left `lock` behind and every later process hung; the builder's lock is
    free once its holder dies. The next process builds (here with a failing compiler: one warning,
    the Python test serves), in bounded time, and reclaims the dead build's temp folder."""
    cache = tmp_path / "cache"
    env = dict(os.environ, CXX=_slow_cxx(tmp_path), FLASHKDA_EXT_CACHE_DIR=str(cache))
    env.pop("FLASHKDA_EXT_DISABLE_JIT", None)
    env.pop("FLASHKDA_EXT_NATIVE_FLAGS", None)
    _kill_mid_build([sys.executable, "-c", _FLAG_BUILD], env)
    assert len(list((cache / ".tmp").glob("flag_reader-*"))) == 1 and _lock_is_free(cache, "flag_reader")
    broken = tmp_path / "broken-g++"
    broken.write_text(_BROKEN_CXX)
    broken.chmod(0o755)
    env["CXX"] = str(broken)
    r = subprocess.run([sys.executable, "-c", _FLAG_ARM], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["True"], r.stderr
    assert "building the fast path's flag reader" in r.stderr
    assert r.stderr.count("RuntimeWarning") == 1 and "did not build" in r.stderr, r.stderr
    assert list((cache / ".tmp").iterdir()) == []
    # the next process does not retry the failed identity: one warning, no build
    r = subprocess.run([sys.executable, "-c", _FLAG_ARM], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["True"], r.stderr
    assert "building" not in r.stderr and r.stderr.count("RuntimeWarning") == 1, r.stderr
    assert "failed to build before" in r.stderr


def test_reclaim_keeps_the_folder_of_a_live_build(tmp_path):
    cache = tmp_path / "cache"
    live = cache / ".tmp" / f"toy_cpu-{'a' * 16}-abcd1234"
    dead = cache / ".tmp" / f"toy_cpu-{'b' * 16}-efgh5678"
    trash = cache / ".tmp" / f"stale-toy_cpu-{'b' * 16}-0badf00d"
    other = cache / ".tmp" / "not-a-build-folder"
    for p in (live, dead, trash, other):
        p.mkdir(parents=True)
    with file_lock(builder.lock_path(cache, f"toy_cpu-{'a' * 16}")):
        removed = builder.reclaim_abandoned(cache)
    assert sorted(removed) == sorted([dead, trash])
    assert live.is_dir() and other.is_dir() and not dead.exists() and not trash.exists()


def test_build_reclaims_its_own_leftovers(tree, tmp_path):
    first = ensure_built("toy_cpu", root=tree)
    leftover = tmp_path / "cache" / ".tmp" / f"{first.path.parent.name}-zzzz9999"
    leftover.mkdir()
    (leftover / "half.o").write_bytes(b"\0")
    again = ensure_built("toy_cpu", root=tree, force=True)
    assert again.built and not leftover.exists()


def test_unloadable_cached_artifact_is_moved_away_and_rebuilt_once(tree, tmp_path):
    res = ensure_built("toy_cpu", root=tree)
    so, meta_path = res.path, res.path.parent / "meta.json"
    so.write_bytes(b"not an ELF file\n" * 64)  # and a meta.json that matches it
    meta = json.loads(meta_path.read_text())
    meta.update(size=so.stat().st_size, sha256=builder.sha256_file(so))
    meta_path.write_text(json.dumps(meta))
    assert builder.read_valid_meta(so.parent, res.identity) is not None
    mod = load_module("toy_cpu", root=tree)
    y = torch.empty(2)
    mod["kda_decode"](torch.zeros(2), y)
    assert y.tolist() == [1.5, 1.5]
    moved = tmp_path / "cache" / ".failed" / so.parent.name
    assert "did not load" in (moved / "discarded.txt").read_text()
    assert (moved / so.name).read_bytes().startswith(b"not an ELF")
    assert builder.read_valid_meta(so.parent, res.identity)["build_id"] != meta["build_id"]


def test_a_module_that_never_loads_names_the_folder(tree, monkeypatch):
    ensure_built("toy_cpu", root=tree)

    def refuse(path):
        raise RuntimeError(f"{path}: invalid ELF header")
    monkeypatch.setattr(loader, "_load", refuse)
    with pytest.raises(Exception, match=r"rebuilt in .*toy_cpu-.* but still does not load.*Delete"):
        load_module("toy_cpu", root=tree)


def test_lock_timeout_names_the_lock_file(tmp_path, monkeypatch):
    path = tmp_path / "locks" / "m.lock"
    with file_lock(path):
        assert try_lock(path) is None
        with pytest.raises(LockTimeoutError, match=rf"0.2 s for the lock {path}"):
            with file_lock(path, timeout=0.2):
                pass
        monkeypatch.setenv("FLASHKDA_EXT_LOCK_TIMEOUT", "0.1")
        with pytest.raises(LockTimeoutError, match="FLASHKDA_EXT_LOCK_TIMEOUT"):
            with file_lock(path):
                pass
    monkeypatch.setenv("FLASHKDA_EXT_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FLASHKDA_EXT_LOCK_TIMEOUT='soon'"):
        with file_lock(path):
            pass


_FORK_COUNT = textwrap.dedent("""
    import os, sys
    forks = []
    os.register_at_fork(before=lambda: forks.append(1))   # the hook JAX's fork warning hangs on
    from flashkda_ext.jit import ensure_built
    ensure_built("toy_cpu", root=sys.argv[1])
    print(len(forks))
""")


def test_a_build_forks_no_python_process(tree, tmp_path):
    """Subprocesses of a build start without a Python-level fork (no preexec_fn), so a process with
    JAX's (or anyone's) threads is never forked: JAX warned on each such fork in the tests."""
    env = dict(os.environ, FLASHKDA_EXT_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", _FORK_COUNT, str(tree)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "building module 'toy_cpu'" in r.stderr and r.stdout.split() == ["0"]
