"""aot.py round trip on a CPU module: build into a directory, then load it with JIT disabled (a fresh
process, an empty cache); stale or corrupt artifacts are refused; failures exit non-zero by name;
a malformed manifest is an error naming the file and field (JIT off) or a warning and a build."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from flashkda_ext import paths
from flashkda_ext.devtools import testing
from flashkda_ext.jit import JitDisabledError, get_record, load_module
from flashkda_ext.jit import loader

AOT_PY = paths.PACKAGE_DIR.parent / "aot.py"
pytestmark = pytest.mark.skipif(not AOT_PY.is_file(), reason="aot.py ships with the repository")


def _aot_module():
    return testing.aot_script("fkda_aot_script")


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


# --- the manifest is checked against jit/schema/aot_manifest.schema.json -------------------------

@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """One toy_cpu build shared by the manifest tests: with JIT on they fall back to it."""
    from flashkda_ext.jit import ensure_built
    base = tmp_path_factory.mktemp("prebuilt")
    tree = testing.make_tree(base / "tree")
    res = ensure_built("toy_cpu", root=tree, cache=base / "cache")
    return tree, base / "cache", res


@pytest.fixture
def aot_env(prebuilt, monkeypatch):
    tree, cache, res = prebuilt
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(cache))
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT", raising=False)
    loader.clear_cache()
    yield tree, res
    loader.clear_cache()


def _entry(res, fname="toy_cpu.host.so"):
    return {"name": "toy_cpu", "arch": "host", "identity": res.identity, "file": fname,
            "sha256": "", "compiler": res.compiler, "files": res.files}


def _folder(path, res, manifest=None, so_bytes=None):
    """An AOT folder holding a copy of the build (or so_bytes) and the given manifest (default:
    a valid one); manifest may be a string, written as is."""
    from flashkda_ext.jit.builder import sha256_file
    path.mkdir(parents=True, exist_ok=True)
    so = path / "toy_cpu.host.so"
    so.write_bytes(so_bytes if so_bytes is not None else res.path.read_bytes())
    if manifest is None:
        e = _entry(res)
        e["sha256"] = sha256_file(so)
        manifest = {"format": 2, "tvm_ffi": "x", "modules": [e]}
    (path / "manifest.json").write_text(manifest if isinstance(manifest, str)
                                        else json.dumps(manifest))
    return path


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


_BAD_MANIFESTS = {
    "list": ("[]", r"\(top level\): \[\] is not of type 'object'"),
    "not_json": ("{", r"\(file\): is not valid JSON"),
    "modules_null": ({"format": 2, "modules": None}, r"modules: None is not of type 'array'"),
    "no_file": ("ENTRY-file", r"modules/0 \(toy_cpu\): 'file' is a required property"),
    "file_escapes": ("FILE=../outside.so", r"modules/0 \(toy_cpu\): file: '../outside.so' is not a "
                                           r"plain .so file name inside"),
    "file_absolute": ("FILE=/tmp/x.so", r"modules/0 \(toy_cpu\): file: '/tmp/x.so' is not a plain"),
    "file_symlink_out": ("LINK", r"modules/0 \(toy_cpu\): file: 'link.so' resolves to .*outside "
                                 r"the AOT folder"),
    "old_format": ("FORMAT=1", r"format: 2 was expected"),
}


def _bad_manifest(kind, res, folder):
    spec = _BAD_MANIFESTS[kind][0]
    if not isinstance(spec, str) or spec in ("[]", "{"):
        return spec
    e = _entry(res)
    e["sha256"] = "0" * 64
    if spec == "ENTRY-file":
        e = _without(e, "file")
    elif spec.startswith("FILE="):
        e["file"] = spec[5:]
    elif spec == "LINK":
        outside = folder.parent / f"{folder.name}-outside.so"
        outside.write_bytes(res.path.read_bytes())
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "link.so").symlink_to(outside)
        e["file"] = "link.so"
    man = {"format": 2, "modules": [e]}
    if spec.startswith("FORMAT="):
        man["format"] = int(spec[7:])
    return man


@pytest.mark.parametrize("kind", sorted(_BAD_MANIFESTS))
def test_bad_manifest_is_a_clear_error_with_jit_disabled(kind, aot_env, tmp_path, monkeypatch):
    from flashkda_ext.jit.errors import ManifestError
    tree, res = aot_env
    folder = tmp_path / "aot"
    _folder(folder, res, _bad_manifest(kind, res, folder))
    monkeypatch.setenv("FLASHKDA_EXT_AOT_DIR", str(folder))
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", "1")
    with pytest.raises(ManifestError) as ei:
        load_module("toy_cpu", root=tree)
    msg = str(ei.value)
    assert str(folder / "manifest.json") in msg
    assert re.search(_BAD_MANIFESTS[kind][1], msg), msg


@pytest.mark.parametrize("kind", ["list", "modules_null", "no_file", "file_escapes"])
def test_bad_manifest_warns_and_builds_with_jit_on(kind, aot_env, tmp_path, monkeypatch):
    tree, res = aot_env
    folder = tmp_path / "aot"
    _folder(folder, res, _bad_manifest(kind, res, folder))
    monkeypatch.setenv("FLASHKDA_EXT_AOT_DIR", str(folder))
    with pytest.warns(RuntimeWarning, match=r"manifest\.json.*JIT-built instead"):
        mod = load_module("toy_cpu", root=tree)
    x, y = torch.arange(2, dtype=torch.float32), torch.empty(2)
    mod["kda_decode"](x, y)
    assert y.tolist() == [1.5, 2.5]


def test_valid_manifest_is_used(aot_env, tmp_path, monkeypatch):
    tree, res = aot_env
    folder = _folder(tmp_path / "aot", res)
    monkeypatch.setenv("FLASHKDA_EXT_AOT_DIR", str(folder))
    so, why = loader.find_aot(get_record("toy_cpu", tree), "host", tree)
    assert so == folder / "toy_cpu.host.so", why


def test_aot_script_refuses_a_bad_manifest(aot_env, tmp_path, capsys):
    tree, res = aot_env
    aot = _aot_module()
    folder = tmp_path / "aot"
    _folder(folder, res, _bad_manifest("no_file", res, folder))
    rc = aot.main(["--root", str(tree), "--arch", "host", "--out", str(folder)])
    err = capsys.readouterr().err
    assert rc == 2
    assert str(folder / "manifest.json") in err and "'file' is a required property" in err
    # a manifest of another format is replaced (its entries could not verify), with a note
    _folder(folder, res, _bad_manifest("old_format", res, folder))
    rc = aot.main(["--root", str(tree), "--arch", "host", "--out", str(folder)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "starting a new manifest" in out.err
    man = json.loads((folder / "manifest.json").read_text())
    assert man["format"] == 2 and man["modules"][0]["files"] == res.files


def test_unloadable_aot_artifact(aot_env, tmp_path, monkeypatch):
    # the file matches its manifest entry (sha256 and identity) but dlopen refuses it
    tree, res = aot_env
    folder = _folder(tmp_path / "aot", res, so_bytes=b"not an ELF file\n" * 64)
    monkeypatch.setenv("FLASHKDA_EXT_AOT_DIR", str(folder))
    assert loader.find_aot(get_record("toy_cpu", tree), "host", tree)[0] is not None
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError, match=rf"does not load.*Delete the AOT folder {folder}"):
        load_module("toy_cpu", root=tree)
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT")
    with pytest.warns(RuntimeWarning, match="does not load.*building it instead"):
        mod = load_module("toy_cpu", root=tree)
    y = torch.empty(1)
    mod["kda_decode"](torch.zeros(1), y)
    assert y.tolist() == [1.5]


# --- the loader trusts neither the entry's file list nor the file's contents ----------------------

def test_an_entry_that_omits_an_edited_header_is_refused(aot_env, tmp_path, monkeypatch):
    """An entry whose own identity agrees with its own (short) file list: before, an edit to the
    header it leaves out went unseen and the stale .so loaded; the source set is recomputed from
    the shipped sources."""
    from flashkda_ext.jit.builder import sha256_file
    from flashkda_ext.jit.identity import module_identity
    tree, res = aot_env
    rec = get_record("toy_cpu", tree)
    assert "common/toy.h" in res.files
    short = {rel: h for rel, h in res.files.items() if rel != "common/toy.h"}
    e = _entry(res)
    e["files"] = short
    e["identity"] = module_identity(rec, "host", tree, compiler=res.compiler, files=short)
    folder = tmp_path / "aot"
    _folder(folder, res, {"format": 2, "modules": [e]})
    e["sha256"] = sha256_file(folder / e["file"])
    (folder / "manifest.json").write_text(json.dumps({"format": 2, "modules": [e]}))
    hdr = tree / "csrc" / "common" / "toy.h"
    old = hdr.read_text()
    hdr.write_text(old + "// edited after the AOT build\n")
    try:
        monkeypatch.setenv("FLASHKDA_EXT_AOT_DIR", str(folder))
        so, why = loader.find_aot(rec, "host", tree)
        assert so is None
        assert "toy_cpu" in why[-1] and "omits csrc/ files the sources include: common/toy.h" in why[-1]
        monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", "1")
        with pytest.raises(JitDisabledError, match="module 'toy_cpu'.*omits csrc/ files.*common/toy.h"):
            load_module("toy_cpu", root=tree)
    finally:
        hdr.write_text(old)


def test_the_include_closure_is_the_compilers_file_list_for_every_record():
    """The loader's recomputed source set (identity.include_closure, no compiler needed) against the
    compiler's own dependency scan (depscan), once per distinct source set of the AOT records: a
    file only the closure reaches would refuse valid artifacts, one only the compiler reads would
    go unchecked unless the entry lists it."""
    from flashkda_ext import jit
    from flashkda_ext.jit import depscan, toolchain
    from flashkda_ext.jit.identity import include_closure
    from flashkda_ext.jit.macros import render_header
    distinct = {}
    for rec in jit.all_records():
        if rec["aot"] and (rec["backend"] == "cpu" or toolchain.have_nvcc()):
            distinct.setdefault((tuple(rec["sources"]), rec["backend"]), rec)
    assert distinct
    for rec in distinct.values():
        arch = "host" if rec["backend"] == "cpu" else rec["arches"][0]
        scanned = depscan.dependency_hashes(rec, arch, None, render_header(rec))
        assert include_closure(rec["sources"], paths.csrc_dir()) == sorted(scanned), rec["name"]


@pytest.fixture
def foreign(tmp_path, monkeypatch):
    """A tree whose toy_cpu source exports another function than its record's entry (as a .so of
    another module would), built into a fresh cache."""
    from flashkda_ext.jit import ensure_built
    tree = testing.make_tree(tmp_path / "tree")
    src = tree / "csrc" / "cpu" / "toy.cc"
    text = src.read_text()
    assert "EXPORT_TYPED_FUNC(kda_decode," in text
    src.write_text(text.replace("EXPORT_TYPED_FUNC(kda_decode,", "EXPORT_TYPED_FUNC(kda_other,"))
    monkeypatch.setenv("FLASHKDA_EXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHKDA_EXT_AOT_DIR", raising=False)
    monkeypatch.delenv("FLASHKDA_EXT_DISABLE_JIT", raising=False)
    loader.clear_cache()
    yield tree, ensure_built("toy_cpu", root=tree)
    loader.clear_cache()


def test_a_foreign_aot_file_is_a_clear_error_naming_the_module(foreign, tmp_path, monkeypatch):
    tree, res = foreign
    folder = _folder(tmp_path / "aot", res)  # sha256 and identity agree: only its exports differ
    monkeypatch.setenv("FLASHKDA_EXT_AOT_DIR", str(folder))
    monkeypatch.setenv("FLASHKDA_EXT_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError, match=r"does not export 'kda_decode', the entry function "
                                               r"of module 'toy_cpu': a foreign or mismatched"):
        load_module("toy_cpu", root=tree)


def test_a_mismatched_cached_build_is_a_clear_error_naming_the_module(foreign):
    from flashkda_ext.jit import BuildError
    tree, _ = foreign
    with pytest.raises(BuildError, match=r"module 'toy_cpu' \(host\) was rebuilt .* does not export "
                                         r"'kda_decode', the entry function of module 'toy_cpu'"):
        load_module("toy_cpu", root=tree)


@pytest.mark.parametrize("jobs", ["0", "-2", "two"])
def test_a_job_count_below_one_is_refused_by_name(jobs, env, capsys):
    aot = _aot_module()
    with pytest.raises(SystemExit) as exc:      # argparse's exit 2, before a record is read
        aot.main(["--root", str(env), "--list", "--jobs", jobs])
    assert exc.value.code == 2 and "--jobs" in capsys.readouterr().err
