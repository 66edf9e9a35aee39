"""Bad-input campaign 20 (CPU backend): the two opt-in vLLM 0.34.0 K3 adapters, k3_native (`_custom_ops.
fused_kda_decode`, served by flashkda_ext.fused_kda_decode) and k3_layer (K3's FlashKDA prefill `_flashkda_prefill`),
driven through the wheel's own wrapper / function (tests/vllm_wheel.py) with the layer's inputs
(benchmarks/bench_vllm_native.py, tests/test_vllm_k3_layer.py). Each case failed before its fix, except those
marked "guard".

- k3_native / k3_layer: dt_bias=None was served as a zero bias (both gates), a call vLLM's own functions refuse
  (`dt_bias: torch.Tensor` in both signatures; `_flashkda_prefill` calls `dt_bias.view(...)`, `_C.fused_kda_decode`
  takes a Tensor): the adapter guessed what the call means. Now falls back to vLLM's function, counted, with
  nothing written (as k3.serve_packed_decode already did).
- guard: k3_native on norm_eps / lower_bound values no kernel takes as they are (bool, NaN, inf, <= 0 eps,
  >= 0 bound, an int past the float range) falls back, counted, with out, the conv cache and the pool untouched.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import vllm_wheel
import vllm_step_metadata  # noqa: E402  (scripts/, put on the path by vllm_wheel)
from vllm_wheel import real_fn, tree  # noqa: F401  (fixtures; real_fn: the wheel's _flashkda_prefill)
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.integrations.vllm import k3_layer, k3_native
from test_vllm_k3_layer import layer_call as prefill_call

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vllm_native  # noqa: E402

H = 2


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


@pytest.fixture
def decode_fn(tree):
    """vLLM's wrapper `fused_kda_decode`, compiled from the wheel's _custom_ops.py."""
    return vllm_step_metadata.fused_kda_decode(tree)


def decode_call(rows=3, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(2001)
    call, _, _ = bench_vllm_native.layer_call(rows, H, gen, "cpu", "SD", lower_bound, 6, list(range(rows, 0, -1)))
    return call


def falls_back_untouched(site, original, call, reason, written):
    recorder, seen = vllm_wheel.recorder(original, "vllm")
    before = {name: call[name].clone() for name in written}
    fell = fkda_vllm.STATS[site, "fell_back"]
    assert fkda_vllm.adapter_for(site, recorder)(**call) == "vllm"
    assert fkda_vllm.STATS[site, "fell_back"] == fell + 1 and len(seen) == 1
    assert any(s == site and reason in r for s, r in fkda_vllm.REASONS), [r for s, r in fkda_vllm.REASONS if s == site]
    for name, was in before.items():     # bitwise, the NaN-poisoned out included (clone() keeps the strides)
        assert torch.equal(call[name].contiguous().view(torch.uint8), was.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_native_decode_without_dt_bias_falls_back(decode_fn, lower_bound):
    call = decode_call(lower_bound=lower_bound)
    call["dt_bias"] = None
    falls_back_untouched(k3_native.SITE, decode_fn, call, "dt_bias=None", ("out", "conv_state", "state"))


def test_flashkda_prefill_without_dt_bias_falls_back(real_fn):
    call = prefill_call([3, 4], torch.float32, dt_bias=None)
    falls_back_untouched(k3_layer.SITE, real_fn, call, "dt_bias=None", ("out", "final_state", "initial_state"))


@pytest.mark.parametrize("change", [
    dict(norm_eps=True), dict(norm_eps=float("nan")), dict(norm_eps=0.0), dict(norm_eps=-1e-5),
    dict(norm_eps=10 ** 400),
    dict(lower_bound=True), dict(lower_bound=float("nan")), dict(lower_bound=float("-inf")), dict(lower_bound=0),
    dict(lower_bound=1.0), dict(lower_bound=-10 ** 400),
], ids=lambda c: f"{next(iter(c))}={next(iter(c.values()))!r}"[:32])
def test_guard_native_decode_bad_scalars_fall_back_untouched(decode_fn, change):
    """guard"""
    call = decode_call()
    call.update(change)
    falls_back_untouched(k3_native.SITE, decode_fn, call, "", ("out", "conv_state", "state"))
