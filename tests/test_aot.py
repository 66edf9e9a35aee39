"""aot.py round trip on a CPU module: build into a directory, then load it with JIT disabled (a fresh
process, an empty cache); stale or corrupt artifacts are refused; failures exit non-zero by name."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from flashkda_ext import paths
from flashkda_ext.devtools import testing
from flashkda_ext.jit import JitDisabledError, get_record, load_module
from flashkda_ext.jit import loader

AOT_PY = paths.PACKAGE_DIR.parent / "aot.py"
pytestmark = pytest.mark.skipif(not AOT_PY.is_file(), reason="aot.py ships with the repository")


def _aot_module():
    spec = importlib.util.spec_from_file_location("fkda_aot_script", AOT_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHKDA_EXT_AOT_DIR", raising=False)
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT", raising=False)
    return testing.make_tree(tmp_path / "tree")


_LOAD = textwrap.dedent("""
    import json, sys, torch
    from flashkda_ext.jit import load_module
    m = load_module("toy_cpu", root=sys.argv[1])
    x = torch.arange(3, dtype=torch.float32); y = torch.empty(3)
    m["kda_decode"](x, y)
    print(json.dumps(y.tolist()))
""")


def test_round_trip_with_jit_disabled(env, tmp_path, monkeypatch):
    out = tmp_path / "aot"
    r = subprocess.run([sys.executable, str(AOT_PY), "--root", str(env), "--arch", "9.0a",
                        "--out", str(out), "--only", "toy_*"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[1/1] toy_cpu (host) built" in r.stdout
    man = json.loads((out / "manifest.json").read_text())
    (entry,) = man["modules"]
    assert entry["name"] == "toy_cpu" and entry["arch"] == "host"
    assert (out / entry["file"]).is_file() and len(entry["identity"]) == 64

    empty_cache = tmp_path / "empty_cache"
    run_env = dict(os.environ, FLASHKDA_EXT_DISABLE_JIT="1", FLASHKDA_EXT_AOT_DIR=str(out),
                   FLASHKDA_EXT_CACHE_DIR=str(empty_cache))
    r = subprocess.run([sys.executable, "-c", _LOAD, str(env)], capture_output=True, text=True,
                       env=run_env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [1.5, 2.5, 3.5]
    assert not empty_cache.exists() or not any(empty_cache.glob("toy_cpu-*"))  # nothing was built

    # in-process: the verified artifact is found; stale and corrupt ones are refused
    rec = get_record("toy_cpu", env)
    monkeypatch.setenv("FLASHKDA_EXT_AOT_DIR", str(out))
    so, _ = loader.find_aot(rec, "host", env)
    assert so == out / entry["file"]
    hdr = env / "csrc" / "common" / "toy.h"
    old = hdr.read_text()
    hdr.write_text(old + "// changed\n")
    so, why = loader.find_aot(rec, "host", env)
    assert so is None and "identity" in why[-1]
    hdr.write_text(old)
    data = (out / entry["file"]).read_bytes()
    (out / entry["file"]).write_bytes(data[:-10])
    so, why = loader.find_aot(rec, "host", env)
    assert so is None and "sha256" in why[-1]
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", "1")
    loader.clear_cache()
    with pytest.raises(JitDisabledError, match="sha256 mismatch"):
        load_module("toy_cpu", root=env)


def test_list_and_failure_exit(env, tmp_path, capsys):
    aot = _aot_module()
    assert aot.main(["--root", str(env), "--list"]) == 0
    assert "toy_cpu\tcpu\thost\tkda_decode" in capsys.readouterr().out
    (env / "csrc" / "cpu" / "toy.cc").write_text("broken(\n")
    rc = aot.main(["--root", str(env), "--arch", "host", "--out", str(tmp_path / "aot")])
    err = capsys.readouterr()
    assert rc == 1
    assert "toy_cpu (host) FAILED" in err.out and "FAILED modules" in err.err and "toy_cpu" in err.err


def test_arch_selection():
    aot = _aot_module()
    recs = [testing.cpu_record(), testing.cuda_record(),
            testing.cuda_record(name="toy_off", aot=False),
            testing.cuda_record(name="toy_100", arches=["sm_100a"])]
    picked = [(r["name"], a) for r, a in aot.select(recs, {"sm_90a"}, [])]
    assert picked == [("toy_cpu", "host"), ("toy_cuda", "sm_90a")]
    picked = [(r["name"], a) for r, a in aot.select(recs, {"sm_90a"}, ["*_cuda"])]
    assert picked == [("toy_cuda", "sm_90a")]
