"""The builder and loader on a toy CPU module: build, load, call from torch and numpy; the cache is
reused, corrupt artifacts are rebuilt, concurrent builds produce one build, errors are clear."""
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from flashkda_ext.devtools import testing
from flashkda_ext.jit import BuildError, JitDisabledError, ToolchainError, ensure_built, load_module
from flashkda_ext.jit import builder, loader


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHKDA_EXT_AOT_DIR", raising=False)
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT", raising=False)
    return testing.make_tree(tmp_path / "tree")


def test_build_load_call(tree, tmp_path):
    res = ensure_built("toy_cpu", root=tree)
    assert res.built and res.path.is_file() and res.arch == "host"
    assert res.path.parent.name == f"toy_cpu-{res.identity[:16]}"
    assert res.path.parent.parent == tmp_path / "cache"
    meta = json.loads((res.path.parent / "meta.json").read_text())
    assert meta["identity"] == res.identity and meta["sha256"] == builder.sha256_file(res.path)
    assert "#define FKDA_PARAM_ADD 1" in (res.path.parent / "fkda_macros.h").read_text()
    assert not list((tmp_path / "cache" / ".tmp").iterdir())  # temp build dir renamed away

    again = ensure_built("toy_cpu", root=tree)
    assert not again.built and again.path == res.path

    mod = load_module("toy_cpu", root=tree)
    assert load_module("toy_cpu", root=tree) is mod  # per-process cache
    x = torch.arange(4, dtype=torch.float32)
    y = torch.empty(4)
    mod["kda_decode"](x, y)
    assert torch.equal(y, x + 1.5)
    xn = np.arange(3, dtype=np.float32)
    yn = np.zeros(3, dtype=np.float32)
    mod["kda_decode"](xn, yn)
    np.testing.assert_array_equal(yn, xn + 1.5)
    with pytest.raises(Exception, match="1-D, same size"):  # the ICHECK reaches Python
        mod["kda_decode"](x, torch.empty(5))
    assert json.loads(mod["fkda_contract"]())["FKDA_MODULE_NAME"] == "toy_cpu"


def test_a_build_says_what_it_builds_and_why(tree, capfd):
    """No call waits in silence: one stderr line before a build (module, backend, arch, reason) and
    one after (seconds); nothing when the cache serves."""
    ensure_built("toy_cpu", root=tree)
    err = capfd.readouterr().err.splitlines()
    assert err[0] == "flashkda_ext: building module 'toy_cpu' (cpu, host): not in the cache ..."
    assert err[1].startswith("flashkda_ext: built module 'toy_cpu' (cpu, host) in ") and err[1].endswith(" s")
    assert len(err) == 2
    ensure_built("toy_cpu", root=tree)
    assert capfd.readouterr().err == ""
    hdr = tree / "csrc" / "common" / "toy.h"
    hdr.write_text(hdr.read_text() + "// edited\n")
    ensure_built("toy_cpu", root=tree)
    assert "building module 'toy_cpu' (cpu, host): sources changed (common/toy.h) ..." in capfd.readouterr().err
    res = ensure_built("toy_cpu", root=tree)
    res.path.write_bytes(b"truncated")
    ensure_built("toy_cpu", root=tree)
    assert "(cpu, host): the cached copy is incomplete or corrupt ..." in capfd.readouterr().err
    ensure_built("toy_cpu", root=tree, force=True)
    assert "(cpu, host): forced ..." in capfd.readouterr().err


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta"])
def test_corrupt_artifact_is_rebuilt(tree, damage):
    first = ensure_built("toy_cpu", root=tree)
    so, meta = first.path, first.path.parent / "meta.json"
    data = so.read_bytes()
    if damage == "truncate":
        so.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        so.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    else:
        meta.write_text("{")
    again = ensure_built("toy_cpu", root=tree)
    assert again.built and again.path == so
    assert builder.sha256_file(so) == json.loads(meta.read_text())["sha256"]


def test_source_change_builds_new_artifact(tree):
    first = ensure_built("toy_cpu", root=tree)
    src = tree / "csrc" / "common" / "toy.h"
    src.write_text(src.read_text().replace("0.5", "0.25"))
    second = ensure_built("toy_cpu", root=tree)
    assert second.built and second.identity != first.identity and first.path.is_file()


def test_angle_included_header_edit_never_loads_a_stale_artifact(tree):
    # <common/toy.h> resolves through -I csrc; the compiler's own dependency list covers it
    src = tree / "csrc" / "cpu" / "toy.cc"
    src.write_text(src.read_text().replace('#include "common/toy.h"', "#include <common/toy.h>"))
    x, y = torch.zeros(2), torch.empty(2)
    load_module("toy_cpu", root=tree)["kda_decode"](x, y)
    assert y.tolist() == [1.5, 1.5]
    first = ensure_built("toy_cpu", root=tree)
    assert "common/toy.h" in first.files and not first.built
    hdr = tree / "csrc" / "common" / "toy.h"
    hdr.write_text(hdr.read_text().replace("0.5", "0.25"))
    loader.clear_cache()
    load_module("toy_cpu", root=tree)["kda_decode"](x, y)
    assert y.tolist() == [1.25, 1.25]
    assert ensure_built("toy_cpu", root=tree).identity != first.identity


_RACER = textwrap.dedent("""
    import json, os, sys, time
    from flashkda_ext.jit import ensure_built
    root, go, ready = sys.argv[1], sys.argv[2], sys.argv[3]
    open(ready, "w").close()
    while not os.path.exists(go):   # start building together
        time.sleep(0.01)
    r = ensure_built("toy_cpu", root=root)
    meta = json.load(open(os.path.join(os.path.dirname(r.path), "meta.json")))
    print(json.dumps({"built": r.built, "path": str(r.path), "build_id": meta["build_id"]}))
""")


def test_concurrent_processes_build_once(tree, tmp_path):
    n = 4
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(tree), str(go),
                               str(tmp_path / f"ready{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    deadline = time.time() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(n)) and time.time() < deadline:
        time.sleep(0.05)
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["built"] for r in results) == 1
    assert len({r["path"] for r in results}) == 1 and len({r["build_id"] for r in results}) == 1
    assert not list((tmp_path / "cache" / ".tmp").iterdir())


def test_build_failure_shows_compiler_output(tree, tmp_path):
    (tree / "csrc" / "cpu" / "toy.cc").write_text("this is not C++;\n")
    with pytest.raises(BuildError) as ei:
        ensure_built("toy_cpu", root=tree)
    msg = str(ei.value)
    assert "building module 'toy_cpu'" in msg and "error" in msg and "this is not C++" in msg
    failed = list((tmp_path / "cache" / ".failed").iterdir())
    assert len(failed) == 1 and (failed[0] / "build.log").is_file()


def test_missing_host_compiler(tree, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ToolchainError, match=r"module 'toy_cpu'.*CXX="):
        ensure_built("toy_cpu", root=tree)


def test_missing_nvcc(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    root = testing.make_tree(tmp_path / "tree", cuda=True)
    monkeypatch.setenv("NVCC", "/nonexistent/nvcc")
    with pytest.raises(ToolchainError, match=r"module 'toy_cuda'.*NVCC="):
        ensure_built("toy_cuda", root=root)


def test_disabled_jit_without_aot(tree, monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError, match=r"module 'toy_cpu'.*aot.py"):
        load_module("toy_cpu", root=tree)


def test_max_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert builder._jobs(None) == 3
    assert builder._jobs(2) == 2  # an explicit value (aot.py --jobs) wins
    for bad in (0, -1, 2.0, True, "2"):     # refused by name, never clamped to 1
        with pytest.raises(ValueError, match="jobs: expected an int >= 1"):
            builder._jobs(bad)
    monkeypatch.setenv("MAX_JOBS", "lots")
    with pytest.raises(ValueError, match="MAX_JOBS"):
        builder._jobs(None)
    monkeypatch.delenv("MAX_JOBS")
    assert builder._jobs(None) == max(1, os.cpu_count() or 1)


def test_arch_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHKDA_EXT_CUDA_ARCH", raising=False)
    rec = testing.cuda_record(arches=["sm_90a", "sm_100a"])
    assert builder.resolve_arch(rec, "9.0a") == "sm_90a"
    assert builder.resolve_arch(rec, "sm_100a") == "sm_100a"
    with pytest.raises(ValueError, match="not sm_80"):
        builder.resolve_arch(rec, "8.0")
    with pytest.raises(ValueError, match="cpu module"):
        builder.resolve_arch(testing.cpu_record(), "sm_90a")
    monkeypatch.setenv("FLASHKDA_EXT_CUDA_ARCH", "10.0a")
    assert builder.resolve_arch(rec) == "sm_100a"


def test_loader_cache_is_per_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    a = testing.make_tree(tmp_path / "a")
    b = testing.make_tree(tmp_path / "b")
    (b / "csrc" / "common" / "toy.h").write_text("#pragma once\ninline double toy_offset() { return 10; }\n")
    x = torch.zeros(2)
    ya, yb = torch.empty(2), torch.empty(2)
    load_module("toy_cpu", root=a)["kda_decode"](x, ya)
    load_module("toy_cpu", root=b)["kda_decode"](x, yb)
    assert ya.tolist() == [1.5, 1.5] and yb.tolist() == [11.0, 11.0]
    loader.clear_cache()
