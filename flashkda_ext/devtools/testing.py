"""A small, self-contained spec tree (csrc/ + jit/) for tests of the JIT machinery.

make_tree(dir) writes one CPU module ('toy_cpu') whose source includes a project header, and
optionally one tiny CUDA module ('toy_cuda'), plus routes and a copy of the package's
supported.json. Pass the returned root as `root=` (or set FLASHKDA_EXT_DATA_ROOT) to every
flashkda_ext.jit call.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..jit import roots

TOY_HEADER = """\
#pragma once
// Included by the toy sources so that the include closure has a header in it.
inline double toy_offset() { return 0.5; }
"""

TOY_CPU_SOURCE = """\
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>
#include "common/toy.h"

namespace {
// y = x + FKDA_PARAM_ADD + toy_offset(), for a float32 1-D tensor.
void toy(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
  TVM_FFI_ICHECK(x.ndim() == 1 && y.ndim() == 1 && x.size(0) == y.size(0)) << "x, y: 1-D, same size";
  const float* a = static_cast<const float*>(x.data_ptr());
  float* b = static_cast<float*>(y.data_ptr());
  for (int64_t i = 0; i < x.size(0); ++i) b[i] = a[i] + FKDA_PARAM_ADD + toy_offset();
}
tvm::ffi::String contract() { return tvm::ffi::String(FKDA_CONTRACT_JSON); }
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_decode, toy);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fkda_contract, contract);
"""

TOY_CUDA_SOURCE = """\
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include "common/toy.h"

__global__ void __launch_bounds__(FKDA_THREADS, FKDA_MIN_BLOCKS) toy_kernel(float* x, int n) {
  extern __shared__ float buf[];
  int i = blockIdx.x * FKDA_THREADS + threadIdx.x;
  if (i < n) {
    buf[threadIdx.x] = x[i];
    x[i] = buf[threadIdx.x] + FKDA_PARAM_ADD;
  }
}

namespace {
void toy(tvm::ffi::TensorView x) {
  int n = static_cast<int>(x.size(0));
  toy_kernel<<<(n + FKDA_THREADS - 1) / FKDA_THREADS, FKDA_THREADS, FKDA_SMEM_BYTES>>>(
      static_cast<float*>(x.data_ptr()), n);
  TVM_FFI_ICHECK(cudaGetLastError() == cudaSuccess);
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_decode, toy);
"""


def aot_script(module_name: str = "fkda_aot_script"):
    """The repository's aot.py loaded as a module (it is a script beside the package, not part of it), or
    None where the checkout does not have it (an installed wheel)."""
    import importlib.util

    from .. import paths

    path = paths.PACKAGE_DIR.parent / "aot.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(module_name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cpu_record(**overrides) -> dict:
    rec = {
        "name": "toy_cpu", "family": "kda_decode", "backend": "cpu",
        "sources": ["cpu/toy.cc"], "entry": "kda_decode", "abi": "host",
        "threads": 1, "smem_bytes": 0, "min_blocks": 1, "cluster": [1, 1, 1],
        "persistent_k": 0, "state_dtype": "any", "slot_offset_bits": 64, "flags": [],
        "arches": ["host"], "aot": True, "params": {"add": 1},
        "description": "test module: y = x + 1.5",
    }
    rec.update(overrides)
    return rec


def cuda_record(**overrides) -> dict:
    return cpu_record(**{
        "name": "toy_cuda", "backend": "cuda", "sources": ["decode/toy.cu"], "abi": "per_row_grid",
        "threads": 128, "smem_bytes": 512, "min_blocks": 2, "state_dtype": "float32",
        "slot_offset_bits": 32, "arches": ["sm_90a"], "params": {"add": 2},
        "description": "test module: x += 2 on the GPU", **overrides})


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def make_tree(base, *, cuda: bool = False, routes: bool = True) -> Path:
    """Write a spec tree under base; return its root."""
    root = Path(base)
    (root / "csrc" / "common").mkdir(parents=True, exist_ok=True)
    (root / "csrc" / "common" / "toy.h").write_text(TOY_HEADER)
    (root / "csrc" / "cpu").mkdir(exist_ok=True)
    (root / "csrc" / "cpu" / "toy.cc").write_text(TOY_CPU_SOURCE)
    (root / "jit" / "modules").mkdir(parents=True, exist_ok=True)
    (root / "jit" / "routes").mkdir(parents=True, exist_ok=True)
    shutil.copy(roots.jit_dir(None) / "supported.json", root / "jit" / "supported.json")
    write_json(root / "jit" / "modules" / "toy_cpu.json",
               {"description": "toy cpu modules", "modules": [cpu_record()]})
    rules = [{"name": "cpu", "when": {"device": "cpu"}, "module": "toy_cpu"}]
    if cuda:
        (root / "csrc" / "decode").mkdir(exist_ok=True)
        (root / "csrc" / "decode" / "toy.cu").write_text(TOY_CUDA_SOURCE)
        write_json(root / "jit" / "modules" / "toy_cuda.json",
                   {"description": "toy cuda modules", "modules": [cuda_record()]})
        rules.append({"name": "fallback", "when": {"device": "cuda"}, "module": "toy_cuda"})
    if routes:
        write_json(root / "jit" / "routes" / "kda_decode.json",
                   {"family": "kda_decode", "description": "toy routes", "rules": rules})
    return root


def variant_tree(base, dest, module: str = "toy_cuda", **params) -> Path:
    """A copy of the spec tree at base whose record `module` has these params changed (a record
    param reaches the kernel as a macro: the generated code differs); return its root."""
    dest = Path(dest)
    shutil.copytree(base, dest)
    spec = dest / "jit" / "modules" / f"{module}.json"
    data = json.loads(spec.read_text())
    for rec in data["modules"]:
        if rec["name"] == module:
            rec["params"].update(params)
    spec.write_text(json.dumps(data))
    return dest


def call_outcome(run, args: dict, written: tuple = ()) -> tuple:
    """What run(args) does, to compare a cold call with a warm one: ("raise", type, message) when it
    refuses (asserting first that the refused call changed none of args' tensors, bit for bit), else ("ok", a
    copy of its result, copies of args[n] for n in written)."""
    import torch  # here, not at the top: the rest of this module serves torch-free tests too

    def raw(x):  # the bytes, so that an untouched NaN (a torch.empty buffer's garbage) counts as unchanged
        return x.detach().reshape(-1).contiguous().view(torch.uint8)

    before = {n: x.clone() for n, x in args.items() if isinstance(x, torch.Tensor)}
    try:
        out = run(args)
    except Exception as e:  # noqa: BLE001 - returned to be compared
        for n, x in before.items():
            assert torch.equal(raw(x), raw(args[n])), f"a refused call changed {n}"
        return ("raise", type(e), str(e))
    return ("ok", out.clone(), *(args[n].clone() for n in written))


def fused_chain_start(conv0, pool0, accepted: int, read: int, writes) -> tuple:
    """Where a chain of single-token fused_kda_decode calls starts that stands in for one fused
    verify request (docs/semantics.md, "Fused verify"): a one-slot conv cache holding the three
    inputs at the accepted offset of the request's line (conv0[writes[0]]), and a one-slot pool
    holding the state it reads (pool0[read]); both copies, for the chain to update in place."""
    o = accepted - 1
    conv = conv0[:1, :, :3].clone()
    conv[0] = conv0[writes[0], :, o:o + 3]
    return conv, pool0[read:read + 1].clone()
