"""Module identity: the same inputs give the same id from any checkout path; changing any one input
(record, a source, an included header, a macro, flags, arch, compiler or tvm-ffi version) changes it."""
import json
import shutil

from flashkda_ext import supported
from flashkda_ext.devtools import testing
from flashkda_ext.jit import get_record, module_identity
from flashkda_ext.jit.identity import identity_inputs, include_closure

COMPILER = {"cxx": "g++ (test) 12.2.0"}
TVM = "0.1.15.post2"


def _id(root, name="toy_cpu", arch="host", rec=None, compiler=COMPILER, tvm=TVM):
    rec = rec if rec is not None else get_record(name, root)
    return module_identity(rec, arch, root, compiler=compiler, tvm_ffi_version=tvm)


def test_include_closure_follows_quoted_includes(tmp_path):
    root = testing.make_tree(tmp_path)
    (root / "csrc" / "common" / "toy.h").write_text('#pragma once\n#include "inner.h"\n')
    (root / "csrc" / "common" / "inner.h").write_text("#pragma once\n")
    assert include_closure(["cpu/toy.cc"], root / "csrc") == \
        ["common/inner.h", "common/toy.h", "cpu/toy.cc"]


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
    assert module_identity(rec, "host", root) == module_identity(rec, "host", root)


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
