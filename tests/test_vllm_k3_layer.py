"""The opt-in adapter of Kimi K3's own prefill (flashkda_ext/integrations/vllm/k3_layer.py) against the real vLLM
0.34.0 code: `_flashkda_prefill` compiled from the wheel's kda.py (scripts/vllm_step_metadata.py) is the original
each adapter wraps, with its real signature; the K3 layer's source says how it is called. FlashKDA itself (a CUDA
extension) cannot run here: a fallback test wraps a recorder of the same signature."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch

import vllm_wheel
from vllm_wheel import real, real_fn, tree  # noqa: F401  (fixtures)
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.integrations.vllm import k3_layer
from flashkda_ext.reference import kda_recurrent

H, K, V = 2, 8, 8
SITE = k3_layer.SITE
K3_LAYER = "vllm.models.kimi_k3.nvidia.kda"


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def layer_call(lengths, state_dtype, seed=0, **extra):
    """The layer's call: q/k/v [1, T, H, D], raw gate, beta logits a strided view of a projection, the gathered
    initial state and the final-state and output buffers (poisoned) in the pool's dtype."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    proj = torch.randn(1, T, H + 3, generator=gen)
    call = dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
                v=torch.randn(1, T, H, V, generator=gen), g=torch.randn(1, T, H, K, generator=gen),
                beta=proj[..., :H], A_log=torch.randn(H, generator=gen) * 0.5,
                dt_bias=torch.randn(H * K, generator=gen) * 0.5, lower_bound=-5.0,
                initial_state=(torch.randn(N, H, V, K, generator=gen) * 0.3).to(state_dtype),
                cu_seqlens=torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32),
                out=torch.full((1, T, H, V), float("nan")), final_state=torch.full((N, H, V, K), float("nan"),
                                                                                   dtype=state_dtype),
                workspace=torch.empty(64, dtype=torch.uint8))
    call.update(extra)
    return call


def test_the_layer_calls_it_by_its_module_global_name_with_keywords_it_takes(tree, real_fn):
    """Rebinding kda.py's attribute reaches every call: `_forward` calls the bare name (a global looked up at call
    time), nothing imports it by name elsewhere in the module, and every keyword is a parameter of the adapter."""
    src = ast.parse(vllm_wheel.source(tree, K3_LAYER))
    calls = [n for n in ast.walk(src) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "_flashkda_prefill"]
    assert calls and all(not c.args for c in calls)
    params = set(inspect.signature(k3_layer.serve_flashkda_prefill).parameters)
    assert all({kw.arg for kw in c.keywords} <= params for c in calls)
    assert not [n for n in ast.walk(src) if isinstance(n, ast.ImportFrom)
                and any(a.name == "_flashkda_prefill" for a in n.names)]
    # the adapter has the real function's signature (what install() checks before rebinding)
    assert fkda_vllm.adapter_for(SITE, real_fn).__wrapped__ is real_fn


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_served_into_the_layers_buffers_as_the_triton_backend_computes(real_fn, state_dtype):
    adapter = fkda_vllm.adapter_for(SITE, real_fn)
    call = layer_call([5, 0, 11], state_dtype)
    before = fkda_vllm.STATS[SITE, "served"]
    o, h = adapter(**call)
    assert fkda_vllm.STATS[SITE, "served"] == before + 1
    assert o is call["out"] and h is call["final_state"] and h.dtype == state_dtype
    want_o, want_h, _ = kda_recurrent(call["q"], call["k"], call["v"], call["g"], call["beta"], gate="bounded",
                                      lower_bound=-5.0, A_log=call["A_log"], dt_bias=call["dt_bias"],
                                      cu_seqlens=call["cu_seqlens"], initial_state=call["initial_state"])
    tol = dict(rtol=2e-5, atol=2e-5) if state_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(o.double(), want_o, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(h.double(), want_h, **tol)


@pytest.mark.parametrize("extra,reason", [
    (dict(checkpoint_state=torch.zeros(2, H, V, K), checkpoint_offsets=torch.tensor([0, 4], dtype=torch.int32)),
     "prefix-cache checkpoints"),
    (dict(lower_bound=None), "bounded gate only"),
    (dict(final_state=torch.zeros(2, H, V, K, dtype=torch.bfloat16)), "final_state must be"),
], ids=["checkpoints", "no-bound", "final-state-dtype"])
def test_what_it_does_not_map_runs_flashkda_with_the_reason_counted(real_fn, extra, reason):
    recorder, seen = vllm_wheel.recorder(real_fn, "flashkda")
    adapter = fkda_vllm.adapter_for(SITE, recorder)
    call = layer_call([3, 4], torch.float32, **extra)
    fell = fkda_vllm.STATS[SITE, "fell_back"]
    assert adapter(**call) == "flashkda" and fkda_vllm.STATS[SITE, "fell_back"] == fell + 1
    assert seen and all(seen[0][key] is value for key, value in extra.items())
    assert any(s == SITE and reason in r for s, r in fkda_vllm.REASONS)


def test_without_the_variable_install_leaves_the_k3_layer_alone(real, monkeypatch):
    monkeypatch.delenv(k3_layer.ENV_VAR, raising=False)
    report = fkda_vllm.install()
    assert "k3_layer" not in report and not any(s.startswith("k3_layer.") for s in report)


def test_opted_in_before_vllm_imports_the_layer_install_waits_for_it(real, monkeypatch):
    """vLLM runs install() from its plugin hook before it imports K3's layer module: install() does not import it
    (that would pull vLLM's model stack in at plugin time) but waits for vLLM's import; uninstall() stops waiting."""
    import sys
    from flashkda_ext.integrations.vllm import _post_import
    monkeypatch.setenv(k3_layer.ENV_VAR, "1")
    assert K3_LAYER not in sys.modules
    report = fkda_vllm.install()
    assert report["k3_layer"] == f"deferred: rebound when vLLM imports {K3_LAYER}"
    assert isinstance(report["k3.chunk_kda_with_fused_gate"], list)
    assert K3_LAYER not in sys.modules and _post_import.pending() == [K3_LAYER]
    fkda_vllm.uninstall()
    assert _post_import.pending() == []


def test_the_layers_module_imported_after_install_is_rebound(real, tree, tmp_path, monkeypatch):
    """The wheel's own `_flashkda_prefill` source in a module vLLM imports after install() (a neutral name: the rest
    of kda.py needs vLLM's model stack): rebound right after its import, served, restored by uninstall()."""
    import importlib
    import sys
    src = vllm_wheel.source(tree, K3_LAYER)
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_flashkda_prefill")
    (tmp_path / "vllm").mkdir()
    path = tmp_path / "vllm" / "fk_k3_layer_late_import.py"
    path.write_text("import torch\n\n\n" + ast.get_source_segment(src, fn) + "\n")
    name = "vllm.fk_k3_layer_late_import"           # under the vllm package, as kda.py is
    monkeypatch.setattr(sys.modules["vllm"], "__path__", [*sys.modules["vllm"].__path__, str(tmp_path / "vllm")])
    monkeypatch.setattr(fkda_vllm, "OPT_IN_POINTS", (("k3_layer", name, k3_layer.SERVE, k3_layer.ENV_VAR),))
    monkeypatch.setenv(k3_layer.ENV_VAR, "1")
    assert fkda_vllm.install()["k3_layer"].startswith("deferred")
    module = importlib.import_module(name)
    assert fkda_vllm.DEFERRED[SITE] == [f"{name}._flashkda_prefill"]
    original = module._flashkda_prefill.__wrapped__
    assert original.__code__.co_filename == str(path) and module.__loader__.get_filename(name) == str(path)
    served = fkda_vllm.STATS[SITE, "served"]
    o, h = module._flashkda_prefill(**layer_call([6, 2], torch.float32, seed=3))
    assert fkda_vllm.STATS[SITE, "served"] == served + 1 and not torch.isnan(o).any() and not torch.isnan(h).any()
    fkda_vllm.uninstall()
    assert module._flashkda_prefill is original
    sys.modules.pop(name, None)


def test_opted_in_install_rebinds_the_layers_function_when_already_imported(real, real_fn, monkeypatch):
    """A module under kda.py's name holding the real `_flashkda_prefill` (compiled from the wheel; the rest of
    kda.py is not exercised): install() rebinds it at once, a call through the module serves, uninstall() restores
    it."""
    import sys
    import types
    module = types.ModuleType(K3_LAYER)
    module._flashkda_prefill = real_fn
    monkeypatch.setitem(sys.modules, K3_LAYER, module)
    monkeypatch.setenv(k3_layer.ENV_VAR, "1")
    report = fkda_vllm.install()
    assert f"{K3_LAYER}._flashkda_prefill" in report[SITE]
    assert module._flashkda_prefill is not real_fn and module._flashkda_prefill.__wrapped__ is real_fn
    call = layer_call([6, 2], torch.float32, seed=3)
    served = fkda_vllm.STATS[SITE, "served"]
    o, h = module._flashkda_prefill(**call)
    assert fkda_vllm.STATS[SITE, "served"] == served + 1 and not torch.isnan(o).any() and not torch.isnan(h).any()
    fkda_vllm.uninstall()
    assert module._flashkda_prefill is real_fn
