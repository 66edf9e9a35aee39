"""Helpers the GPU test files share (imported by name: pytest puts this folder on sys.path)."""
from __future__ import annotations

import math
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GATES = {"softplus": 0, "bounded": 1, "log": 2}  # the bindings' gate_mode


def seed(*parts):
    """torch's global seed from the parts' repr (a case's inputs fixed by its parameters)."""
    torch.manual_seed(zlib.crc32(repr(parts).encode()))


def module_records(json_name):
    """The module records of jit/modules/<json_name> as the registry loads them (family records
    expanded into their twins), in the file's order."""
    from flashkda_ext.jit import all_records, specs
    return [r for r in all_records() if specs.record_file(r["name"]) == f"jit/modules/{json_name}"]


def records_by_name(json_name):
    """{name: record} of jit/modules/<json_name>, in the file's order (list() of it: the names a test
    parametrizes over)."""
    return {r["name"]: r for r in module_records(json_name)}


def load(name):
    from flashkda_ext.jit import load_module
    return load_module(name)


def sdtype(rec):
    """A CUDA record's state dtype as a torch dtype."""
    return torch.float32 if rec["state_dtype"] == "float32" else torch.bfloat16


def verify_tables(gen, lens, cols, slots):
    """A verify call's random slot table state_indices [N, T_max] (distinct slots), num_accepted_tokens
    [N] in [1, T_max] (both on the host, drawn from a CPU generator seeded from gen) and cu_seqlens of
    the request lengths `lens` (on gen's device)."""
    N = len(lens)
    cpu = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=gen, device=gen.device)))
    idx = torch.randperm(slots, generator=cpu)[:N * cols].reshape(N, cols).to(torch.int32)
    nacc = torch.randint(1, cols + 1, (N,), generator=cpu, dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=gen.device)
    return idx, nacc, cu


def rel_l2(a, b):
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bits(t):
    """The raw bits of an fp32 or bf16 tensor, for bitwise comparisons (NaN == NaN)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def slot_list(rows, slots, slot_mode, seed, null_slot0=False):
    """Slot indices per row: "unique" (a random permutation), "padded" (every third row padding,
    negative indices of several values, slot 0 on row 2 with null_slot0) or "repeated" (a few slots
    reused in interleaved order, plus padding)."""
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed)).tolist()
    if slot_mode == "unique":
        return perm[:rows]
    if slot_mode == "padded":
        il = [perm[r] if r % 3 != 1 else -1 - (r % 5) for r in range(rows)]
        if null_slot0 and rows > 2:
            il[2] = 0
        return il
    return [perm[(r * 7) % max(1, rows // 3 + 1)] if r % 5 != 4 else -1 for r in range(rows)]


def prebuild_selected(request):
    """Build, in parallel, the modules that this file's selected tests name (param "name") and that
    no AOT directory provides, so the tests do not pay for one nvcc run after another (JIT builds
    are file-locked and independent); a -k selection builds only its own modules."""
    if os.environ.get("FLASHKDA_EXT_DISABLE_JIT") == "1":
        return
    from concurrent.futures import ThreadPoolExecutor

    from flashkda_ext import jit
    from flashkda_ext.jit.loader import find_aot
    names = {item.callspec.params["name"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params}
    todo = []
    for name in sorted(names):
        rec = jit.get_record(name)
        if find_aot(rec, jit.resolve_arch(rec))[0] is None:
            todo.append(name)
    if todo:
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as ex:
            list(ex.map(jit.build_module, todo))


def paged_like(pool, lead_bytes=64, pad_bytes=48, seed=0):
    """pool's values in a view whose slots sit apart, as vLLM's paged cache keeps them (docs/semantics.md,
    "Strided pools"): each slot lead_bytes into a page of lead + slot + pad bytes of random filler (vLLM's conv
    states; page padding). The slot stride is a multiple of 16 bytes and the view 16-byte aligned.
    Returns (pages, view, filler): filler(pages) is every element outside the view, for bitwise checks."""
    size = pool.element_size()
    lead, pad, n = lead_bytes // size, pad_bytes // size, pool[0].numel()
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    pages = torch.randn(pool.shape[0], lead + n + pad, generator=gen, device=pool.device).to(pool.dtype)
    view = pages[:, lead:lead + n].view(pool.shape)
    view.copy_(pool)
    assert not view.is_contiguous() and view.data_ptr() % 16 == 0 and view.stride(0) * size % 16 == 0

    def filler(p):
        return torch.cat([p[:, :lead].flatten(), p[:, lead + n:].flatten()])
    return pages, view, filler


def packed_rows(tensors, row_dim, extra=0):
    """Copies of `tensors` (one dtype, each [1.., rows, *inner] with row_dim the rows) as consecutive column
    blocks of one row-major buffer, as an engine's packed projection holds them (q | k | v; g | beta): row-strided
    views, each row dense, the rows one buffer row apart. The buffer row is padded past the blocks to a 16-byte
    multiple plus 16 bytes, then `extra` elements more (extra > 0 off a 16-byte multiple: rows the CUDA kernels'
    16-byte loads cannot read). The buffer starts 16-byte aligned; so does each view whose offset is."""
    rows = tensors[0].shape[row_dim]
    widths = [math.prod(t.shape[row_dim + 1:]) for t in tensors]
    per16 = 16 // tensors[0].element_size()
    width = sum(widths) + (-sum(widths)) % per16 + per16 + extra
    buf = torch.full((rows, width), float("nan"), dtype=tensors[0].dtype, device=tensors[0].device)
    views, at = [], 0
    for t, w in zip(tensors, widths):
        view = buf[:, at:at + w].view(t.shape)
        view.copy_(t)
        assert rows <= 1 or not view.is_contiguous()
        views.append(view)
        at += w
    return views


@pytest.fixture(scope="module")
def vllm_ops():
    """(vLLM 0.34.0's K3 ops package with the adapters installed, flashkda_ext.integrations.vllm), from the prepared
    folder .engines/vllm (benchmarks/bench_vllm.load_vllm), uninstalled after the module's tests; fails them when
    that folder is missing (the vLLM acceptance needs vLLM's own kernels). A fixture: import it by name."""
    engine = ROOT / ".engines" / "vllm"
    if not (engine / "vllm").is_dir():
        pytest.fail(f"{engine} missing: run `python3 scripts/prepare_vllm_engine.py` and carry .engines/vllm")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vllm
    ops, fkda_vllm = bench_vllm.load_vllm(engine)
    yield ops, fkda_vllm
    fkda_vllm.uninstall()
