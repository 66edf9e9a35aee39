"""The build cache and loader as a serving operator meets them: bad environment values, corrupt
cache entries, a read-only cache. Each test is a defect that was found and fixed (CPU toy module)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from flashkda_ext.devtools import testing
from flashkda_ext.jit import ensure_built, load_module, loader
from flashkda_ext.jit import builder, lock

from jit_tree import tree  # noqa: F401 (the fixture)


def _call(tree) -> list:
    loader.clear_cache()
    y = torch.empty(2)
    load_module("toy_cpu", root=tree)["kda_decode"](torch.zeros(2), y)
    return y.tolist()


@pytest.mark.parametrize("value", ["2", "ture", "maybe", "disable"])
def test_a_misspelt_disable_jit_is_refused_not_read_as_off(tree, monkeypatch, value):
    # a typo used to mean "JIT on": a server meant to run prebuilt-only would compile silently
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", value)
    with pytest.raises(ValueError, match=f"FLASHKDA_EXT_DISABLE_JIT={value!r}"):
        load_module("toy_cpu", root=tree)
    assert not (tree.parent / "cache").exists()  # refused before anything was built


@pytest.mark.parametrize("value,disabled", [("1", True), ("TRUE", True), (" yes ", True),
                                            ("on", True), ("", False), ("0", False),
                                            ("false", False), ("No", False), ("off", False)])
def test_disable_jit_spellings(monkeypatch, value, disabled):
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", value)
    assert loader.jit_disabled() is disabled


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_jobs_below_one_is_refused(monkeypatch, value):
    # used to be clamped to 1 in silence: a one-job build of a CUDA module takes minutes
    monkeypatch.setenv("MAX_JOBS", value)
    with pytest.raises(ValueError, match=f"MAX_JOBS={value!r}"):
        builder._jobs(None)


@pytest.mark.parametrize("value", ["nan", "NaN"])
def test_lock_timeout_nan_is_refused(monkeypatch, value):
    # nan passed the "> 0" test by failing "<= 0", and filelock then waits forever
    monkeypatch.setenv("FLASHKDA_EXT_LOCK_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"FLASHKDA_EXT_LOCK_TIMEOUT={value!r}"):
        lock.lock_timeout()


def test_a_bad_cuda_arch_variable_is_named(monkeypatch):
    monkeypatch.setenv("FLASHKDA_EXT_CUDA_ARCH", "hopper")
    with pytest.raises(ValueError, match="FLASHKDA_EXT_CUDA_ARCH='hopper'"):
        builder.resolve_arch(testing.cuda_record())


def test_info_reports_a_bad_disable_jit_instead_of_crashing(monkeypatch):
    # `info` is what an operator runs to find out what is wrong: it must show the bad value
    from flashkda_ext.cli import info
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", "ture")
    monkeypatch.setattr(info, "spec_summary", lambda verbose=False: "skipped")  # slow, beside the point
    got = info.collect_info()
    assert "FLASHKDA_EXT_DISABLE_JIT='ture'" in got["jit_disabled"]
    assert "FLASHKDA_EXT_DISABLE_JIT='ture'" in info._jit_note(got["jit_disabled"])


@pytest.mark.parametrize("files", [["common/toy.h"], "common/toy.h", 7])
def test_a_corrupt_meta_of_an_older_build_does_not_crash_the_next_build(tree, tmp_path, files):
    # build_reason reads every <name>-*/meta.json to say what changed; a valid-JSON but malformed
    # one (files not a dict) raised AttributeError out of the build
    ensure_built("toy_cpu", root=tree)
    old = tmp_path / "cache" / "toy_cpu-0123456789abcdef"
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({"name": "toy_cpu", "files": files}))
    hdr = tree / "csrc" / "common" / "toy.h"
    hdr.write_text(hdr.read_text().replace("0.5", "0.25"))
    assert _call(tree) == [1.25, 1.25]


@pytest.mark.parametrize("keep", [[], ["common/toy.h"]])
def test_a_cached_scan_without_the_sources_is_not_trusted(tree, tmp_path, keep):
    # a .deps entry that lists none of the module's sources cannot be a real scan (the compiler
    # always reports the source); trusted, it took the sources out of the identity, and a later
    # edit loaded the stale module
    assert _call(tree) == [1.5, 1.5]
    deps = list((tmp_path / "cache" / ".deps").iterdir())
    assert len(deps) == 1
    files = json.loads(deps[0].read_text())["files"]
    deps[0].write_text(json.dumps({"files": {rel: files[rel] for rel in keep}}))  # the hashes hold
    assert _call(tree) == [1.5, 1.5]
    src = tree / "csrc" / "cpu" / "toy.cc"
    src.write_text(src.read_text().replace("+ toy_offset()", "+ 2 * toy_offset()"))
    assert _call(tree) == [2.0, 2.0]


_LOAD_TOY = textwrap.dedent("""
    import sys, torch
    from flashkda_ext.jit import load_module
    y = torch.empty(2)
    load_module("toy_cpu", root=sys.argv[1])["kda_decode"](torch.zeros(2), y)
    print(y.tolist())
""")


def _as_unprivileged() -> list:
    """argv prefix under which file permissions apply: none for a normal user; for root, the
    capabilities that bypass them dropped (setpriv), else the test cannot run."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be enforced")
    caps = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="setpriv / POSIX permissions")
def test_a_read_only_cache_serves_what_it_holds_and_names_itself_when_it_must_build(tree, tmp_path):
    # a warm read-only cache (an image baked at deploy time) loads without writing; a cold one
    # used to raise a bare PermissionError on '.locks' that said neither module nor remedy
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    ensure_built("toy_cpu", root=tree, cache=warm)
    cold.mkdir()
    for d in (warm, cold):
        for p in [d, *d.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
    try:
        for cache, ok in ((warm, True), (cold, False)):
            env = dict(os.environ, FLASHKDA_EXT_CACHE_DIR=str(cache))
            r = subprocess.run(_as_unprivileged() + [sys.executable, "-c", _LOAD_TOY, str(tree)],
                               env=env, capture_output=True, text=True, timeout=120)
            if ok:
                assert r.returncode == 0 and r.stdout.split("\n")[0] == "[1.5, 1.5]", r.stderr
                assert "building" not in r.stderr
            else:
                assert r.returncode != 0
                err = r.stderr.strip().splitlines()[-1]
                assert "BuildError" in err and "module 'toy_cpu'" in err, r.stderr
                assert f"JIT cache {cache}" in err and "FLASHKDA_EXT_CACHE_DIR" in err, r.stderr
    finally:
        for d in (warm, cold):
            for p in [d, *d.rglob("*")]:
                p.chmod(p.stat().st_mode | 0o200)  # so tmp_path can be removed
