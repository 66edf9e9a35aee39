"""Module identity: the same inputs give the same id from any checkout path; changing any one input
(record, a source, an included header, a macro, flags, arch, compiler or tvm-ffi version) changes it.
The files hashed are the ones the compiler itself reports reading (depscan)."""
import json
import shutil

import pytest

from flashkda_ext import supported
from flashkda_ext.devtools import testing
from flashkda_ext.jit import depscan, get_record, module_identity, toolchain
from flashkda_ext.jit.identity import identity_inputs, include_closure

COMPILER = {"cxx": "g++ (test) 12.2.0"}
TVM = "0.1.15.post2"


def _id(root, name="toy_cpu", arch="host", rec=None, compiler=COMPILER, tvm=TVM):
    rec = rec if rec is not None else get_record(name, root)
    return module_identity(rec, arch, root, compiler=compiler, tvm_ffi_version=tvm,
                           cache=root.parent / "cache")


def _files(root, name="toy_cpu", arch="host"):
    return identity_inputs(get_record(name, root), arch, root, compiler=COMPILER,
                           tvm_ffi_version=TVM, cache=root.parent / "cache")["files"]


def test_include_closure_follows_quoted_and_angle_includes(tmp_path):
    root = testing.make_tree(tmp_path)
    (root / "csrc" / "common" / "toy.h").write_text(
        '#pragma once\n#include "inner.h"\n#include <common/angle.h>\n#include <vector>\n')
    (root / "csrc" / "common" / "inner.h").write_text("#pragma once\n")
    (root / "csrc" / "common" / "angle.h").write_text("#pragma once\n")
    assert include_closure(["cpu/toy.cc"], root / "csrc") == \
        ["common/angle.h", "common/inner.h", "common/toy.h", "cpu/toy.cc"]


def _add_includes(root):
    """toy.cc reads a header through -I csrc with angle brackets, and one outside csrc/ through a
    quoted relative path; the angle header reads a third only when a macro of its own says so."""
    src = root / "csrc" / "cpu" / "toy.cc"
    src.write_text('#include <common/angle.h>\n#include "../../extra/outside.h"\n' + src.read_text())
    (root / "csrc" / "common" / "angle.h").write_text("#pragma once\ninline int angle() { return 1; }\n")
    (root / "extra").mkdir()
    (root / "extra" / "outside.h").write_text("#pragma once\ninline int outside() { return 2; }\n")


def test_identity_covers_angle_includes_and_files_outside_csrc(tmp_path):
    root = testing.make_tree(tmp_path / "a")
    _add_includes(root)
    files = _files(root)
    assert sorted(files) == ["../extra/outside.h", "common/angle.h", "common/toy.h", "cpu/toy.cc"]
    # nothing of the toolchain or tvm-ffi is listed: their versions stand for them
    assert not any("tvm" in f or f.startswith("/") for f in files)
    base = _id(root)
    seen = {base}
    for rel in ("csrc/common/angle.h", "extra/outside.h"):
        p = root / rel
        old = p.read_text()
        p.write_text(old + "// edited\n")
        assert _id(root) not in seen, rel  # the edit is seen, not a stale cached scan
        seen.add(_id(root))
        p.write_text(old)
        assert _id(root) == base
    # a cached scan is reused only while every file it listed is unchanged: a new include in the
    # angle header is found by the next scan
    (root / "csrc" / "common" / "deeper.h").write_text("#pragma once\n")
    angle = root / "csrc" / "common" / "angle.h"
    angle.write_text(angle.read_text() + "#include <common/deeper.h>\n")
    assert "common/deeper.h" in _files(root) and _id(root) not in seen
    # the relative layout, not the absolute path, enters: a copy elsewhere agrees
    other = tmp_path / "elsewhere" / "b"
    shutil.copytree(root, other)
    assert _id(other) == _id(root)


def test_scan_cache_is_used_and_checked(tmp_path, monkeypatch):
    root = testing.make_tree(tmp_path / "t")
    first = _files(root)
    calls = []
    real = depscan.run_scan
    monkeypatch.setattr(depscan, "run_scan", lambda *a: calls.append(a) or real(*a))
    assert _files(root) == first and calls == []  # hit: no compiler run
    hdr = root / "csrc" / "common" / "toy.h"
    hdr.write_text(hdr.read_text() + "// edit\n")
    rec = get_record("toy_cpu", root)
    with pytest.raises(depscan.NotScanned, match="toy_cpu"):  # the cached scan no longer holds
        identity_inputs(rec, "host", root, cache=root.parent / "cache", scan=False)
    assert calls == []
    assert _files(root)["common/toy.h"] != first["common/toy.h"] and len(calls) == 1
    assert identity_inputs(rec, "host", root, cache=root.parent / "cache", scan=False)["files"] \
        == _files(root)


def test_preprocessor_failure_names_module_and_file(tmp_path):
    root = testing.make_tree(tmp_path / "t")
    src = root / "csrc" / "cpu" / "toy.cc"
    src.write_text("#include <common/missing.h>\n" + src.read_text())
    with pytest.raises(Exception, match=r"module 'toy_cpu'.*cpu/toy.cc(.|\n)*missing.h"):
        _files(root)


def test_parse_depfile():
    text = "fkda_dep: /a/b.cc /c/with\\ space.h \\\n  rel/x.h /d/$$dollar.h\n"
    assert depscan.parse_depfile(text) == ["/a/b.cc", "/c/with space.h", "rel/x.h", "/d/$dollar.h"]


def test_stable_across_checkout_paths(tmp_path):
    a = testing.make_tree(tmp_path / "first checkout")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert _id(a) == _id(b)
    assert _id(a) == _id(a)  # deterministic within a process
    assert "first checkout" not in json.dumps(identity_inputs(get_record("toy_cpu", a), "host", a,
                                                              compiler=COMPILER, tvm_ffi_version=TVM))


def test_local_toolchain_identity_is_stable(tmp_path):
    root = testing.make_tree(tmp_path)
    rec = get_record("toy_cpu", root)
    cache = tmp_path / "cache"
    assert module_identity(rec, "host", root, cache=cache) == module_identity(rec, "host", root,
                                                                              cache=cache)


def test_sensitive_to_every_input(tmp_path):
    root = testing.make_tree(tmp_path, cuda=True)
    base = _id(root)
    rec = get_record("toy_cpu", root)
    seen = {base}

    def changed(new_id):
        assert new_id not in seen
        seen.add(new_id)

    # the record (any field), including a param that becomes a macro
    changed(_id(root, rec=dict(rec, description="other words")))
    changed(_id(root, rec=dict(rec, params={"add": 2})))
    # flags
    changed(_id(root, rec=dict(rec, flags=["-ffast-math"])))
    # versions
    changed(_id(root, compiler={"cxx": "g++ (test) 13.1.0"}))
    changed(_id(root, tvm="0.1.16"))
    # the source, then a header it includes (restored in between)
    src = root / "csrc" / "cpu" / "toy.cc"
    old = src.read_text()
    src.write_text(old + "// edit\n")
    changed(_id(root))
    src.write_text(old)
    assert _id(root) == base
    hdr = root / "csrc" / "common" / "toy.h"
    old_h = hdr.read_text()
    hdr.write_text(old_h + "// edit\n")
    changed(_id(root))
    hdr.write_text(old_h)
    assert _id(root) == base


@pytest.mark.skipif(not toolchain.have_nvcc(), reason="the CUDA dependency scan runs nvcc")
def test_cuda_identity_sensitive_to_supported_set_and_arch(tmp_path):
    root = testing.make_tree(tmp_path / "t", cuda=True)
    # a rendered macro that comes from jit/supported.json, not the record
    cuda_rec = get_record("toy_cuda", root)
    cuda_base = _id(root, rec=cuda_rec, arch="sm_90a")
    sup = root / "jit" / "supported.json"
    data = json.loads(sup.read_text())
    data["families"]["kda_decode"]["cuda"]["value_heads"] = [8, 16]
    sup.write_text(json.dumps(data))
    supported.clear_cache()
    try:
        assert _id(root, rec=cuda_rec, arch="sm_90a") != cuda_base
    finally:
        supported.clear_cache()
    # arch
    assert _id(root, rec=cuda_rec, arch="sm_100a") != _id(root, rec=cuda_rec, arch="sm_90a")


def test_unrelated_file_does_not_change_identity(tmp_path):
    root = testing.make_tree(tmp_path)
    base = _id(root)
    (root / "csrc" / "common" / "unused.h").write_text("int unused;\n")
    assert _id(root) == base
