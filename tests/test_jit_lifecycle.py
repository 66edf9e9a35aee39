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

from flashkda_ext.devtools import testing
from flashkda_ext.jit import builder, ensure_built, load_module, loader
from flashkda_ext.jit.errors import LockTimeoutError
from flashkda_ext.jit.lock import file_lock, try_lock


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHKDA_EXT_AOT_DIR", raising=False)
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT", raising=False)
    loader.clear_cache()
    yield testing.make_tree(tmp_path / "tree")
    loader.clear_cache()


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_during_build_stops_ninja_and_its_compilers(tree, tmp_path):
    cxx = tmp_path / "slow-g++"
    cxx.write_text(_SLOW_CXX)
    cxx.chmod(0o755)
    env = dict(os.environ, CXX=str(cxx), FLASHKDA_EXT_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-c", _BUILD, str(tree)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
        for p in procs:  # never leave a sleeper behind, pass or fail (by the pids seen alive)
            if not _alive(p):
                continue
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    # the dead build's temp folder is still there; its lock is free, so it is reclaimed
    cache = tmp_path / "cache"
    left_tmp = [p for p in (cache / ".tmp").iterdir() if p.name.startswith("toy_cpu-")]
    assert len(left_tmp) == 1
    assert builder.reclaim_abandoned(cache) == left_tmp and not left_tmp[0].exists()


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
