"""The opt-in adapter of Kimi K3's native fused decode (flashkda_ext/integrations/vllm/k3_native.py) against the real
vLLM 0.34.0 code: `fused_kda_decode` compiled from the wheel's vllm/_custom_ops.py is the original each adapter wraps
(with its real signature); K3's layer source (vllm/models/kimi_k3/nvidia/kda.py) says how it is called, which head
counts reach it (its own is_fused_kda_decode_supported, compiled from the wheel) and how the layer builds the
width-major conv weight it passes. vLLM's `_C` extension, which the wrapper calls, loads only on a CUDA machine with
vLLM's build: the fallback tests wrap a recorder of the same signature."""
from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch

import vllm_wheel
from vllm_wheel import real, tree  # noqa: F401  (fixtures)
import vllm_step_metadata  # noqa: E402  (scripts/, put on the path by vllm_wheel)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vllm_native  # noqa: E402  (the layer's inputs, shared with the GPU benchmark)
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.integrations.vllm import k3_native
from flashkda_ext.reference.decode import fused_kda_decode_step

SITE = k3_native.SITE
K3_LAYER = "vllm.models.kimi_k3.nvidia.kda"
CUSTOM_OPS = "vllm._custom_ops"
H, D = 2, 128
C = 3 * H * D


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


@pytest.fixture
def real_fn(tree):
    """vLLM's wrapper `fused_kda_decode`, compiled from the wheel's _custom_ops.py (it calls torch.ops._C)."""
    return vllm_step_metadata.fused_kda_decode(tree)


def layer_call(rows, gen, conv_layout="SD", lower_bound=-5.0, slots=6, indices=None):
    """The layer's call as benchmarks/bench_vllm_native.py builds it (x, output_gate, raw_beta column slices of one
    projection; the conv cache and the fp32 state in one paged cache; the width-major weight as the layer's loader
    fills it; out poisoned), and the conv weight in the reference's [3*H*D, 4]."""
    call, _, weight = bench_vllm_native.layer_call(rows, H, gen, "cpu", conv_layout, lower_bound, slots,
                                                   list(range(rows, 0, -1)) if indices is None else indices)
    return call, weight


def test_the_layer_calls_the_module_attribute_with_keywords_the_adapter_takes(tree, real_fn):
    """Rebinding vllm._custom_ops.fused_kda_decode reaches every call: kda.py binds the module as `ops` and calls
    `ops.fused_kda_decode` with keywords only, each a parameter of the adapter; nothing imports the name itself."""
    src = ast.parse(vllm_wheel.source(tree, K3_LAYER))
    assert any(isinstance(n, ast.ImportFrom) and n.module == "vllm" and
               any(a.name == "_custom_ops" and a.asname == "ops" for a in n.names) for n in ast.walk(src))
    calls = [n for n in ast.walk(src) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "fused_kda_decode" and isinstance(n.func.value, ast.Name) and n.func.value.id == "ops"]
    assert len(calls) == 1 and not calls[0].args
    params = set(inspect.signature(k3_native.serve_fused_kda_decode).parameters)
    assert {kw.arg for kw in calls[0].keywords} <= params
    assert {kw.arg for kw in calls[0].keywords} >= {"x", "weight", "bias", "conv_state", "lower_bound", "output_gate"}
    assert not [n for n in ast.walk(src) if isinstance(n, ast.ImportFrom)
                and any(a.name == "fused_kda_decode" for a in n.names)]
    assert fkda_vllm.adapter_for(SITE, real_fn).__wrapped__ is real_fn


def test_which_k3_configurations_reach_the_native_decode(tree):
    """K3's own is_fused_kda_decode_supported (compiled from the wheel) on an sm_90 platform with vLLM's `_C`
    holding the op (the only two facts stood in for: no GPU and no `_C` here): 12 / 24 / 48 / 96 heads a GPU, fp32
    state; not Kimi K3's TP12 (8 heads), not bf16 state, not with speculation."""
    platform = types.SimpleNamespace(is_device_capability=lambda cap: cap == 90,
                                     is_device_capability_family=lambda fam: False)
    fake_torch = types.SimpleNamespace(ops=types.SimpleNamespace(_C=types.SimpleNamespace(fused_kda_decode=object())),
                                       bfloat16=torch.bfloat16, float32=torch.float32)
    supported = vllm_step_metadata.compile_nodes(tree / "vllm/models/kimi_k3/nvidia/kda.py",
                                                 ("is_fused_kda_decode_supported",),
                                                 {"torch": fake_torch, "current_platform": platform}
                                                 )["is_fused_kda_decode_supported"]
    bf, f32 = torch.bfloat16, torch.float32
    assert [h for h in (8, 12, 16, 24, 32, 48, 96) if supported(h, 128, 4, 0, bf, bf, f32)] == [12, 24, 48, 96]
    assert not supported(12, 128, 4, 0, bf, bf, bf) and not supported(12, 128, 4, 2, bf, bf, f32)


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_served_in_place_on_the_layers_paged_cache(real_fn, conv_layout, lower_bound):
    gen = torch.Generator().manual_seed(7)
    call, weight = layer_call(4, gen, conv_layout, lower_bound, indices=[3, 1, -1, 4])
    conv0, state0 = call["conv_state"].clone(), call["state"].clone()
    adapter = fkda_vllm.adapter_for(SITE, real_fn)
    served = fkda_vllm.STATS[SITE, "served"]
    o = adapter(**call)
    assert fkda_vllm.STATS[SITE, "served"] == served + 1 and o is call["out"]
    gate = "softplus" if lower_bound is None else "bounded"
    want, want_conv, want_state = fused_kda_decode_step(
        call["x"], weight, conv0, call["raw_g"][0], call["raw_beta"][0], call["A_log"], call["dt_bias"],
        call["state_indices"], state0, call["output_gate"], call["norm_weight"], gate=gate, lower_bound=lower_bound)
    torch.testing.assert_close(o[0].double(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(o[0, 2], torch.zeros_like(o[0, 2]))       # the padding row (-1)
    assert torch.equal(call["conv_state"], want_conv)
    torch.testing.assert_close(call["state"].double(), want_state.double(), rtol=1e-6, atol=1e-6)
    for s in (0, 2, 5):     # slots no row names (0 is vLLM's null block): bitwise as they were
        assert torch.equal(call["conv_state"][s], conv0[s]) and torch.equal(call["state"][s], state0[s])


def test_null_block_rows_are_padding_and_out_none_is_allocated(real_fn):
    gen = torch.Generator().manual_seed(8)
    call, _ = layer_call(3, gen, indices=[0, 2, 0])
    call["out"] = None
    conv0, state0 = call["conv_state"].clone(), call["state"].clone()
    o = fkda_vllm.adapter_for(SITE, real_fn)(**call)
    assert tuple(o.shape) == (1, 3, H, D) and o.dtype == torch.bfloat16
    assert torch.equal(o[0, 0], torch.zeros(H, D, dtype=torch.bfloat16)) and torch.equal(o[0, 2], o[0, 0])
    assert torch.equal(call["state"][0], state0[0]) and torch.equal(call["conv_state"][0], conv0[0])
    assert not torch.equal(call["state"][2], state0[2])


def test_an_index_past_int32_is_a_named_error_before_any_write(real_fn):
    gen = torch.Generator().manual_seed(9)
    call, _ = layer_call(2, gen)
    call["state_indices"] = torch.tensor([2 ** 32 + 1, 2], dtype=torch.int64)     # would wrap to slot 1
    conv0, state0 = call["conv_state"].clone(), call["state"].clone()
    with pytest.raises(ValueError, match="state_indices"):
        fkda_vllm.adapter_for(SITE, real_fn)(**call)
    assert torch.equal(call["conv_state"], conv0) and torch.equal(call["state"], state0)
    assert torch.isnan(call["out"]).all()


@pytest.mark.parametrize("change,reason", [
    (lambda c: c.update(bias=torch.zeros(C)), "conv bias"),
    (lambda c: c.update(output_gate=None), "without the gated RMSNorm"),
    (lambda c: c.update(norm_weight=None), "without the gated RMSNorm"),
    (lambda c: c.update(conv_state=c["conv_state"].contiguous()[:, :, :2]), "does not serve"),
    (lambda c: c.update(out=torch.empty(2, H, D, dtype=torch.bfloat16)), "out must be"),
    # the canonical [3*H*D, 4] (which flashkda_ext's op reads): the layer never passes it, vLLM's kernel's reading unknown
    (lambda c: c.update(weight=c["weight"].permute(0, 2, 1).reshape(3 * H * D, 4).contiguous()), "width-major"),
], ids=["bias", "no-gate", "no-norm-weight", "conv-shape", "out-shape", "canonical-weight"])
def test_what_it_does_not_map_runs_vllms_kernel_with_the_reason_counted(real_fn, change, reason):
    recorder, seen = vllm_wheel.recorder(real_fn, "vllm")
    gen = torch.Generator().manual_seed(10)
    call, _ = layer_call(2, gen)
    change(call)
    conv0, state0 = call["conv_state"].clone(), call["state"].clone()
    fell = fkda_vllm.STATS[SITE, "fell_back"]
    assert fkda_vllm.adapter_for(SITE, recorder)(**call) == "vllm"
    assert fkda_vllm.STATS[SITE, "fell_back"] == fell + 1 and len(seen) == 1
    assert any(s == SITE and reason in r for s, r in fkda_vllm.REASONS)
    assert torch.equal(call["conv_state"], conv0) and torch.equal(call["state"], state0)


def test_install_rebinds_the_module_attribute_only_when_opted_in(real, real_fn, monkeypatch):
    """A module under vllm._custom_ops's name holding the real wrapper (the rest of _custom_ops.py needs vLLM's
    compiled extensions): without the variable install() leaves it; with it, the attribute is rebound, a call
    through the module serves, and uninstall() restores it."""
    import sys
    module = types.ModuleType(CUSTOM_OPS)
    module.fused_kda_decode = real_fn
    monkeypatch.setitem(sys.modules, CUSTOM_OPS, module)
    monkeypatch.delenv(k3_native.ENV_VAR, raising=False)
    assert SITE not in fkda_vllm.install() and module.fused_kda_decode is real_fn
    fkda_vllm.uninstall()
    monkeypatch.setenv(k3_native.ENV_VAR, "1")
    report = fkda_vllm.install()
    assert report[SITE] == [f"{CUSTOM_OPS}.fused_kda_decode"] and module.fused_kda_decode.__wrapped__ is real_fn
    gen = torch.Generator().manual_seed(12)
    call, _ = layer_call(2, gen)
    served = fkda_vllm.STATS[SITE, "served"]
    o = module.fused_kda_decode(**call)
    assert fkda_vllm.STATS[SITE, "served"] == served + 1 and not torch.isnan(o).any()
    fkda_vllm.uninstall()
    assert module.fused_kda_decode is real_fn


def test_the_benchmark_dry_run_serves_and_agrees_with_the_reference(tree, tmp_path):
    """benchmarks/bench_vllm_native.py's logic on the CPU: the adapter over the wheel's wrapper serves every point,
    its output, state and conv cache against flashkda_ext.reference (vLLM's `_C` runs on the GPU only)."""
    import json
    assert bench_vllm_native.main(["--dry-run", "--no-plot", "--no-progress", "--engine-dir", str(tree),
                                   "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_vllm_native.json").read_text())
    assert len(doc["accuracy"]) == 2 and all(a["served"] and a["ok"] and a["conv_bitwise"] for a in doc["accuracy"])


def test_vllm_runs_the_kimi_kda_layers_python_on_every_step(tree):
    """Why the adapters' host path counts (docs/integrations.md, "Breakable CUDA graphs"): vLLM 0.34 runs Kimi K3 and
    Kimi-Linear with breakable CUDA graphs by default, and both KDA layers' `_forward` is a break point
    (eager_break_during_capture): replay calls it as Python, so an adapter's host work runs at every step."""
    config = ast.parse(vllm_wheel.source(tree, "vllm.config.vllm"))
    default = next(n.value for n in config.body if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", None) == "DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES" for t in n.targets))
    names = {c.value for c in ast.walk(default) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    assert {"KimiK3ForConditionalGeneration", "KimiLinearForCausalLM"} <= names
    for layer in (K3_LAYER, "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"):
        fns = [n for n in ast.walk(ast.parse(vllm_wheel.source(tree, layer)))
               if isinstance(n, ast.FunctionDef) and n.name == "_forward"]
        assert fns and all(any(getattr(d, "id", None) == "eager_break_during_capture" for d in f.decorator_list)
                           for f in fns), layer
    assert "def eager_break_during_capture" in vllm_wheel.source(tree, "vllm.compilation.breakable_cudagraph")
