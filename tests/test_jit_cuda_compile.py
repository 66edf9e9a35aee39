"""Compile-only of a small CUDA module from its spec with the local nvcc (no GPU needed): the
-gencode target, the saved -Xptxas -v report and the resource check on it."""

import pytest

from flashkda_ext.devtools import testing
from flashkda_ext.jit import ensure_built
from flashkda_ext.jit.checks import parse_ptxas, resource_problems
from flashkda_ext.jit.toolchain import have_nvcc


pytestmark = pytest.mark.skipif(not have_nvcc(), reason="needs nvcc")


def test_toy_cuda_module_compiles(tmp_path):
    root = testing.make_tree(tmp_path / "tree", cuda=True)
    res = ensure_built("toy_cuda", "9.0a", root=root, cache=tmp_path / "cache")
    art = res.path.parent
    assert res.built and res.arch == "sm_90a" and res.path.stat().st_size > 0
    ninja = (art / "build.ninja").read_text()
    assert "-gencode=arch=compute_90a,code=sm_90a" in ninja and "-Xptxas -v" in ninja
    assert "-cudart static" in ninja  # no libcudart.so dependency in the module
    report = (art / "ptxas.log").read_text()
    kernels = parse_ptxas(report)
    assert len(kernels) == 1
    (k,) = kernels.values()
    assert k["arch"] == "sm_90a" and k["registers"] > 0
    rec = testing.cuda_record()
    assert resource_problems(rec, report) == []
    # the same report against a record that claims more than fits must fail
    assert resource_problems(dict(rec, smem_bytes=200000, min_blocks=2), report)
    assert "libcudart.so" not in res.path.read_bytes().decode("latin-1")
