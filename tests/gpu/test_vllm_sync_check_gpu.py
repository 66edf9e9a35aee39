"""The vLLM adapters under vLLM 0.34.0's own GPU<->CPU sync check (`VLLM_GPU_SYNC_CHECK=error`: the real
vllm/utils/gpu_sync_debug.py from the prepared wheel folder, .engines/vllm): torch's sync debug mode and vLLM's
checkers of non_blocking host copies raise on any sync inside a checked call. vLLM turns the check on after warmup
and runs every step under it, so an adapter that synced would fail a vLLM deployment that enables it.
Every served call kind: packed decode, verify with CUDA-graph padding, chunk prefill, and the mixed step routed
from vLLM's step metadata (host_lengths.py reads only host tensors). Skips without CUDA."""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vllm  # noqa: E402  (the benchmark's loader and input builders: the layers' calls)
from gpu_common import vllm_ops  # noqa: E402,F401  (a fixture)

DEV = torch.device("cuda")


class Args:
    spec_tokens = 4
    prefill_len = 100
    mixed_prompt = 700
    paged = True


@pytest.fixture
def checked(monkeypatch):
    """vLLM's check in error mode, turned on as vLLM does after warmup; its process-wide patches (torch.Tensor.to,
    .cuda, .copy_; the gate) are undone after the test."""
    gsd = sys.modules["vllm.utils.gpu_sync_debug"]
    for name in ("to", "cuda", "copy_"):
        monkeypatch.setattr(torch.Tensor, name, getattr(torch.Tensor, name))
    monkeypatch.setattr(gsd, "_SYNC_CHECK_MODE", "error")
    monkeypatch.setattr(gsd, "_sync_check_enabled", False)
    monkeypatch.setattr(gsd, "_copy_checkers_installed", False)
    gsd.enable_gpu_sync_check()
    return gsd


def run_checked(gsd, fn):
    """fn() once unchecked (the JIT build and first-call work, vLLM's warmup), then once under the check."""
    fn()
    torch.cuda.synchronize()
    out = gsd.with_gpu_sync_check(fn)()
    torch.cuda.synchronize()
    return out


def test_the_check_is_armed(checked):
    """A control: the same wrapper raises on a sync, so the cases below can fail."""
    x = torch.ones(4, device=DEV)
    with pytest.raises(RuntimeError, match="sync"):
        checked.with_gpu_sync_check(lambda: x.sum().item())()


@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_each_call_kind_serves_without_a_sync(vllm_ops, checked, kind, state_dtype):
    ops, fk = vllm_ops
    call, pool = bench_vllm.inputs(kind, 24, 8, state_dtype, -5.0, Args, DEV, seed=2)
    if kind == "verify":        # CUDA-graph padding: the null block and count 1 past the real requests
        call["cu_seqlens"] = call["cu_seqlens"][:21].clone()
        call["ssm_state_indices"][20:] = 0
        call["num_accepted_tokens"][20:] = 1
    adapter = getattr(ops, bench_vllm.NAMES[kind])
    site = f"k3.{bench_vllm.NAMES[kind]}"
    served = fk.STATS[site, "served"]
    with torch.inference_mode():
        run_checked(checked, lambda: adapter(**call))
    assert fk.STATS[site, "served"] == served + 2, dict(fk.REASONS)


def test_the_mixed_step_routed_from_vllms_metadata_serves_without_a_sync(vllm_ops, checked):
    ops, fk = vllm_ops
    ns = bench_vllm.vllm_step_metadata.load(ROOT / ".engines" / "vllm")
    call, _ = bench_vllm.inputs("mixed", 50, 8, torch.float32, -5.0, Args, DEV, seed=3)
    m = bench_vllm.vllm_step_metadata.step(ns, [1] * 50 + [Args.mixed_prompt], DEV)
    call["cu_seqlens"] = m.non_spec_query_start_loc
    key = ("k3.chunk_kda_with_fused_gate", "longest from vLLM's metadata, decodes apart")
    before = fk.ROUTED[key]
    with bench_vllm.vllm_step_metadata.forward(ns, {"model.layers.0.self_attn": m}), torch.inference_mode():
        run_checked(checked, lambda: ops.chunk_kda_with_fused_gate(**call))
    assert fk.ROUTED[key] == before + 2


def test_k3s_prefill_with_checkpoints_cut_serves_without_a_sync(vllm_ops, checked):
    """The opt-in K3 prefill adapter with prefix-cache checkpoints: the decodes apart, the prompt cut at its
    checkpoint (three kda_prefill calls, their offsets copied from pinned host memory), no sync."""
    ops, fk = vllm_ops
    fn, why = bench_vllm.peer_flashkda.load(ROOT / ".engines" / "vllm")
    if fn is None:
        pytest.skip(f"vLLM's FlashKDA extension does not load here: {why}")
    vsm = bench_vllm.vllm_step_metadata
    ns = vsm.load(ROOT / ".engines" / "vllm")
    call, _ = bench_vllm.inputs("mixed", 50, 8, torch.float32, -5.0, Args, DEV, seed=4)
    m = vsm.with_checkpoints(ns, vsm.step(ns, [1] * 50 + [Args.mixed_prompt], DEV), [5] * 50 + [512])
    assert m.checkpoint is not None
    call["cu_seqlens"] = m.non_spec_query_start_loc
    site = "k3_layer._flashkda_prefill"
    # the layer's call with its buffers, the adapter in FlashKDA's place
    layer_call = bench_vllm.flashkda_arm(fk.adapter_for(site, fn), call, m.checkpoint.checkpoint_offsets)
    served = fk.STATS[site, "served"]
    with vsm.forward(ns, {"model.layers.0.self_attn": m}), torch.inference_mode():
        run_checked(checked, layer_call)
    assert fk.STATS[site, "served"] == served + 2, dict(fk.REASONS)
