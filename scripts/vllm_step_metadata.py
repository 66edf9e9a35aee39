"""What a vLLM 0.34.0 KDA prefill call finds around it in a real step, compiled from the pinned wheel's source
(the folder of prepare_vllm_engine.py), for the conformance tests and benchmarks/bench_vllm.py.

Real (the wheel's source, unmodified, compiled by ast; the rest of each module is not loaded):
- vllm/forward_context.py: ForwardContext, get_forward_context, is_forward_context_available,
  override_forward_context, and the module global they share, as the module `vllm.forward_context`;
- vllm/config/compilation.py: CUDAGraphMode (ForwardContext's default and its __post_init__ check);
- vllm/v1/attention/backends/gdn_attn.py: GDNAttentionMetadata;
- vllm/v1/attention/backends/utils.py: compute_causal_conv1d_metadata and PAD_SLOT_ID, with PIN_MEMORY and
  np_to_pinned_tensor from the real vllm/utils/torch_utils.py (loaded with the K3 ops);
- vllm/models/kimi_k3/nvidia/kda.py: _flashkda_prefill (flashkda_prefill(): the peer of benchmarks/bench_vllm.py);
- prefix-cache checkpoints (mamba_cache_mode "align"): MambaPrefillCheckpointMetadata and
  compute_mamba_prefill_checkpoints (vllm/model_executor/layers/mamba/checkpoint.py), kda_prefill_checkpoint_alignment
  (.../mamba/kda_checkpoint.py), get_mamba_prefill_checkpoint_position and is_mamba_prefill_checkpoint_valid
  (vllm/v1/kv_cache_interface.py), with cdiv from the real vllm/utils/math_utils.py.
Names that the compiled code uses only in annotations (AttentionMetadata, DPMetadata, BatchDescriptor,
UBatchSlices, the checkpoint plans) are empty classes.

step() fills a GDNAttentionMetadata as GDNAttentionMetadataBuilder.build does for a step without speculative
decoding (read from the same file): the non-speculative offsets are the step's query_start_loc, decodes are the
one-token requests, and nums_dict is compute_causal_conv1d_metadata of the host offsets. A conformance test
holds the builder's source to those lines.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import importlib
import sys
import types
import typing
from pathlib import Path

import numpy as np
import torch

FILES = ("vllm/forward_context.py", "vllm/config/compilation.py", "vllm/v1/attention/backends/gdn_attn.py",
         "vllm/v1/attention/backends/utils.py")
_FORWARD_CONTEXT_NAMES = ("ForwardContext", "_forward_context", "get_forward_context",
                          "is_forward_context_available", "override_forward_context")


def _nodes(path: Path, names) -> list:
    """The top-level classes, functions and assignments of `path` named in `names`, in file order."""
    found, seen = [], set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
        elif isinstance(node, ast.AnnAssign):
            name = getattr(node.target, "id", None)
        else:
            continue
        if name in names:
            found.append(node)
            seen.add(name)
    if seen != set(names):
        raise RuntimeError(f"{path}: no top-level {sorted(set(names) - seen)} (the pinned wheel's source changed?)")
    return found


def compile_nodes(path: Path, names, namespace: dict) -> dict:
    """Compile the top-level definitions `names` of the wheel's file `path` into `namespace` (dataclasses look
    their class's module up in sys.modules: a namespace without a module of its own is this one's)."""
    module = ast.fix_missing_locations(ast.Module(body=_nodes(path, names), type_ignores=[]))
    namespace.setdefault("__name__", __name__)
    owner = namespace["__name__"]
    temporary = owner not in sys.modules
    if temporary:
        sys.modules[owner] = types.ModuleType(owner)
        sys.modules[owner].__dict__.update(namespace)
    try:
        exec(compile(module, str(path), "exec"), namespace)
    finally:
        if temporary:
            del sys.modules[owner]
    return namespace


def _placeholders(*names) -> dict:
    return {n: type(n, (), {}) for n in names}


def load(tree: Path) -> types.SimpleNamespace:
    """forward_context (a module object, not put into sys.modules), GDNAttentionMetadata and
    compute_causal_conv1d_metadata from the prepared folder `tree` (its vllm.utils.torch_utils must import)."""
    tree = Path(tree)
    graph_mode = compile_nodes(tree / "vllm/config/compilation.py", ("CUDAGraphMode",),
                               {"enum": enum})["CUDAGraphMode"]
    fc = types.ModuleType("vllm.forward_context")
    fc.__dict__.update(dataclass=dataclasses.dataclass, field=dataclasses.field,
                       contextmanager=contextlib.contextmanager, Any=typing.Any, torch=torch, CUDAGraphMode=graph_mode,
                       **_placeholders("AttentionMetadata", "DPMetadata", "BatchDescriptor", "UBatchSlices"))
    compile_nodes(tree / "vllm/forward_context.py", _FORWARD_CONTEXT_NAMES, fc.__dict__)
    gdn = compile_nodes(tree / "vllm/v1/attention/backends/gdn_attn.py", ("GDNAttentionMetadata",),
                        {"dataclass": dataclasses.dataclass, "torch": torch,
                         **_placeholders("MambaPrefillCheckpointMetadata", "GDNFlashInferCheckpointPlan")})
    torch_utils = sys.modules.get("vllm.utils.torch_utils") or importlib.import_module("vllm.utils.torch_utils")
    utils = compile_nodes(tree / "vllm/v1/attention/backends/utils.py",
                          ("PAD_SLOT_ID", "NULL_BLOCK_ID", "compute_causal_conv1d_metadata"),
                          {"np": np, "torch": torch, "Any": typing.Any, "PIN_MEMORY": torch_utils.PIN_MEMORY,
                           "np_to_pinned_tensor": torch_utils.np_to_pinned_tensor})
    math_utils = sys.modules.get("vllm.utils.math_utils") or importlib.import_module("vllm.utils.math_utils")
    kv = compile_nodes(tree / "vllm/v1/kv_cache_interface.py",
                       ("get_mamba_prefill_checkpoint_position", "is_mamba_prefill_checkpoint_valid"),
                       {"cdiv": math_utils.cdiv})
    ckpt = compile_nodes(tree / "vllm/model_executor/layers/mamba/checkpoint.py",
                         ("compute_mamba_prefill_checkpoints", "_gather_checkpoint_state_indices",
                          "MambaPrefillCheckpointMetadata"),
                         {"dataclass": dataclasses.dataclass, "replace": dataclasses.replace, "torch": torch,
                          "cdiv": math_utils.cdiv, "NULL_BLOCK_ID": utils["NULL_BLOCK_ID"], **kv})
    alignment = compile_nodes(tree / "vllm/model_executor/layers/mamba/kda_checkpoint.py",
                              ("kda_prefill_checkpoint_alignment",), {})["kda_prefill_checkpoint_alignment"]
    return types.SimpleNamespace(forward_context=fc, CUDAGraphMode=graph_mode,
                                 GDNAttentionMetadata=gdn["GDNAttentionMetadata"],
                                 compute_causal_conv1d_metadata=utils["compute_causal_conv1d_metadata"],
                                 MambaPrefillCheckpointMetadata=ckpt["MambaPrefillCheckpointMetadata"],
                                 compute_mamba_prefill_checkpoints=ckpt["compute_mamba_prefill_checkpoints"],
                                 kda_prefill_checkpoint_alignment=alignment)


def flashkda_prefill(tree: Path):
    """K3's `_flashkda_prefill` (vllm/models/kimi_k3/nvidia/kda.py), compiled from the wheel's source: vLLM's own
    prefill of Kimi K3 on sm_90 / sm_10x / sm_12x with a bounded gate (its "auto" backend there). It calls
    torch.ops._flashkda_C.fwd from the wheel's extension (vllm/_flashkda_C.abi3.so, extracted by
    prepare_vllm_engine.py), which only a CUDA machine with vLLM's torch ABI loads."""
    return compile_nodes(Path(tree) / "vllm/models/kimi_k3/nvidia/kda.py", ("_flashkda_prefill",),
                         {"torch": torch})["_flashkda_prefill"]


def fused_kda_decode(tree: Path):
    """vLLM's wrapper `fused_kda_decode` (vllm/_custom_ops.py), compiled from the wheel's source: K3's native fused
    decode, which calls torch.ops._C.fused_kda_decode (vLLM's `_C`, loaded only where a caller loaded it)."""
    return compile_nodes(Path(tree) / "vllm/_custom_ops.py", ("fused_kda_decode",),
                         {"torch": torch})["fused_kda_decode"]


def step(ns: types.SimpleNamespace, lengths, device) -> object:
    """The GDNAttentionMetadata of a step of requests with these query lengths (no speculative decoding), its
    non_spec_query_start_loc an int32 tensor on `device` (the object a KDA layer passes as cu_seqlens)."""
    lengths = [int(n) for n in lengths]
    cu_cpu = torch.tensor([0] + list(np.cumsum(lengths, dtype=np.int64)), dtype=torch.int32)
    num_decodes = sum(1 for n in lengths if n == 1)
    num_prefills = sum(1 for n in lengths if n > 1)
    nums_dict, batch_ptr, token_chunk_offset_ptr = ns.compute_causal_conv1d_metadata(cu_cpu, device=device)
    return ns.GDNAttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=sum(n for n in lengths if n > 1), num_decodes=num_decodes,
        num_decode_tokens=num_decodes, num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=sum(lengths),
        non_spec_query_start_loc=cu_cpu.to(device), nums_dict=nums_dict, batch_ptr=batch_ptr,
        token_chunk_offset_ptr=token_chunk_offset_ptr)


def with_checkpoints(ns: types.SimpleNamespace, m, computed, hash_block_size: int = 16, mamba_block_size: int = 16,
                     backend: str = "flashkda"):
    """m (a step() of these query lengths) with the prefix-cache checkpoints vLLM's MambaPrefillCheckpointBuilder.build
    gives its requests in mamba_cache_mode "align" (no EAGLE block drop, no hash lookahead, cache hits aligned to
    hash_block_size): `computed[r]` tokens of request r were cached before this step (seq_len = computed + query
    length). Its offsets come from the wheel's compute_mamba_prefill_checkpoints with the alignment of K3's
    `backend`; m.checkpoint is None where no request has one (as build returns). The state indices are rows 1..N
    (this file's steps have no block table)."""
    cu = m.non_spec_query_start_loc.cpu()
    query_lens = cu.diff().tolist()
    seq_lens = [int(c) + n for c, n in zip(computed, query_lens)]
    offsets, cols = ns.compute_mamba_prefill_checkpoints(
        seq_lens, query_lens, hash_block_size=hash_block_size, mamba_block_size=mamba_block_size,
        checkpoint_alignment=ns.kda_prefill_checkpoint_alignment(backend), drop_eagle_block=False,
        cache_hit_alignment_tokens=hash_block_size)
    device = m.non_spec_query_start_loc.device
    m.checkpoint = None if not any(offsets) else ns.MambaPrefillCheckpointMetadata(
        torch.tensor(offsets, dtype=torch.int32, device=device),
        torch.tensor([r + 1 if c >= 0 else 0 for r, c in enumerate(cols)], dtype=torch.int64, device=device),
        offsets=offsets, query_lens=query_lens)
    return m


@contextlib.contextmanager
def forward(ns: types.SimpleNamespace, attn_metadata):
    """vLLM's forward context of a step (attn_metadata: {layer name: metadata}, or a list of such dicts) set,
    with `vllm.forward_context` in sys.modules as vLLM has it during a forward."""
    ctx = ns.forward_context.ForwardContext(no_compile_layers={}, attn_metadata=attn_metadata, slot_mapping={})
    previous = sys.modules.get("vllm.forward_context")
    sys.modules["vllm.forward_context"] = ns.forward_context
    try:
        with ns.forward_context.override_forward_context(ctx):
            yield ctx
    finally:
        if previous is None:
            sys.modules.pop("vllm.forward_context", None)
        else:
            sys.modules["vllm.forward_context"] = previous
