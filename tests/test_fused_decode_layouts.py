"""fused_kda_decode on the layouts an engine holds (csrc/common/fused_layout.h; validation/fused_decode.py): rows of x,
g, beta and output_gate as column slices of one projection, the conv cache and the state pool interleaved in one
paged cache (vLLM's page: a slot's conv cache, then its state), the conv cache channel-major or width-major, the
conv weight [3*H*D, 4] or width-major [3, 4, H*D]. The CPU module against the float64 reference, outputs poisoned,
untouched slots bitwise unchanged; the layouts it does not read refused by name before anything is written."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flashkda_ext
from flashkda_ext.reference.decode import fused_kda_decode_step
from flashkda_ext.validation.common import _slots_apart

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vllm_native  # noqa: E402  (vLLM's paged cache layout, shared with the benchmark)

H, D, W = 2, 128, 4
HD, C = H * D, 3 * H * D


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def paged(slots, conv_layout, gen):
    """A paged cache as vLLM lays it out (benchmarks/bench_vllm_native.cache_views: per slot a page holding the bf16
    conv cache, then the fp32 state), random bytes under random conv / state values; (conv_state, state, store)."""
    page = C * (W - 1) * 2 + HD * D * 4
    store = torch.randint(0, 255, (slots * page,), dtype=torch.uint8, generator=gen)
    conv, state = bench_vllm_native.cache_views(store, slots, H, {"width": "SD", "channel": "DS"}[conv_layout])
    conv.copy_((0.1 * torch.randn(slots, C, W - 1, generator=gen)).to(torch.bfloat16))
    state.copy_(0.05 * torch.randn(slots, H, D, D, generator=gen))
    return conv, state, store


def engine_rows(rows, gen, dtype=torch.bfloat16):
    """x, g, beta, output_gate as column slices of one projection row (rows further apart than their width)."""
    proj = torch.randn(rows, C + HD + H + HD + 5, generator=gen).to(dtype)
    x = proj[:, :C]
    og = proj[:, C:C + HD].view(rows, H, D)
    beta = proj[:, C + HD:C + HD + H]
    g = proj[:, C + HD + H:C + HD + H + HD].view(rows, H, D)
    return x, g, beta, og


@pytest.mark.parametrize("conv_layout", ["width", "channel"])
@pytest.mark.parametrize("weight_layout", ["channel", "width"])
@pytest.mark.parametrize("gate,lb", [("bounded", -5.0), ("softplus", None)])
def test_engine_layouts_match_the_reference(conv_layout, weight_layout, gate, lb):
    gen = torch.Generator().manual_seed(11)
    rows, slots = 3, 6
    conv, state, store = paged(slots, conv_layout, gen)
    conv0, state0 = conv.clone(), state.clone()
    x, g, beta, og = engine_rows(rows, gen)
    weight = 0.2 * torch.randn(C, W, generator=gen)
    w_arg = weight if weight_layout == "channel" else weight.view(3, HD, W).transpose(1, 2).contiguous()
    A_log, dt_bias, nw = 0.5 * torch.randn(H, generator=gen), 0.1 * torch.randn(HD, generator=gen), \
        torch.randn(D, generator=gen)
    idx = torch.tensor([4, 1, 2], dtype=torch.int32)
    out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16)
    flashkda_ext.fused_kda_decode(x, w_arg, conv, g, beta, A_log, dt_bias, idx, state, og, nw, gate=gate,
                                  lower_bound=lb, out=out)
    want, want_conv, want_state = fused_kda_decode_step(x, weight, conv0, g, beta, A_log, dt_bias, idx, state0, og,
                                                        nw, gate=gate, lower_bound=lb)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(conv, want_conv)      # bit copies of the inputs
    torch.testing.assert_close(state.double(), want_state.double(), rtol=1e-6, atol=1e-6)
    for s in (0, 3, 5):                      # untouched slots: conv cache and state bitwise as they were
        assert torch.equal(conv[s], conv0[s]) and torch.equal(state[s], state0[s])


def test_the_strided_call_is_the_dense_call_bit_for_bit():
    gen = torch.Generator().manual_seed(5)
    rows, slots = 4, 5
    conv, state, _ = paged(slots, "width", gen)
    x, g, beta, og = engine_rows(rows, gen)
    weight = 0.2 * torch.randn(C, W, generator=gen)
    args = dict(A_log=0.5 * torch.randn(H, generator=gen), dt_bias=0.1 * torch.randn(HD, generator=gen),
                state_indices=torch.tensor([1, 3, -1, 0], dtype=torch.int32), norm_weight=torch.randn(D, generator=gen))
    dense = dict(x=x.contiguous(), conv_weight=weight, conv_state=conv.contiguous(), g=g.contiguous(),
                 beta=beta.contiguous(), state=state.contiguous(), output_gate=og.contiguous())
    o_dense = flashkda_ext.fused_kda_decode(**dense, **args, gate="bounded", lower_bound=-5.0, null_slot0=True,
                                            slot_mode="padded")
    o = flashkda_ext.fused_kda_decode(x, weight.view(3, HD, W).transpose(1, 2).contiguous(), conv, g, beta,
                                      state=state, output_gate=og, **args, gate="bounded", lower_bound=-5.0,
                                      null_slot0=True, slot_mode="padded")
    assert torch.equal(o, o_dense) and torch.equal(conv, dense["conv_state"]) and torch.equal(state, dense["state"])
    assert torch.equal(o[2:], torch.zeros_like(o[2:]))      # padding rows (-1, and 0 with null_slot0) write zeros


def _call(rows=2, slots=4, **over):
    gen = torch.Generator().manual_seed(3)
    conv, state, _ = paged(slots, "width", gen)
    x, g, beta, og = engine_rows(rows, gen)
    a = dict(x=x, conv_weight=0.2 * torch.randn(C, W, generator=gen), conv_state=conv, g=g, beta=beta,
             A_log=torch.zeros(H), dt_bias=torch.zeros(HD), state_indices=torch.tensor([1, 2], dtype=torch.int32),
             state=state, output_gate=og, norm_weight=torch.ones(D), out=torch.full((rows, H, D), float("nan"),
                                                                                   dtype=torch.bfloat16))
    a.update(over)
    return a


@pytest.mark.parametrize("name,make,match", [
    ("conv_state", lambda a: torch.zeros(4, 3, C + 8, dtype=torch.bfloat16)[:, :, :C].transpose(1, 2),
     r"conv_state: expected each slot channel-major .* width-major"),
    ("conv_state", lambda a: torch.zeros(4, C, 4, dtype=torch.bfloat16)[:, :, :3], r"conv_state: expected each slot"),
    ("conv_state", lambda a: torch.zeros(1, C, 3, dtype=torch.bfloat16).expand(4, C, 3),
     r"conv_state: .* at least"),
    ("conv_weight", lambda a: torch.zeros(3, HD, W), r"conv_weight: expected shape \[3, 4, H\*D\]"),
    ("conv_weight", lambda a: torch.zeros(W, 3 * HD).t(), r"conv_weight: .*contiguous"),
    ("x", lambda a: a["x"].t().contiguous().t(), r"x: expected \[rows, 3\*H\*D\] with its inner dims contiguous"),
    ("output_gate", lambda a: torch.zeros(2, D, H, dtype=torch.bfloat16).transpose(1, 2), r"output_gate: expected .* inner dims contiguous"),
    ("beta", lambda a: torch.zeros(H, 2, dtype=torch.bfloat16).t(), r"beta: expected .* inner dims contiguous"),
], ids=["width-gap", "channel-gap", "slots-overlap", "weight-shape", "weight-strided", "x-cols", "og-transposed",
        "beta-cols"])
def test_layouts_it_does_not_read_are_refused_by_name_before_any_write(name, make, match):
    a = _call()
    a[name] = make(a)
    conv0, state0 = a["conv_state"].clone(), a["state"].clone()
    with pytest.raises(ValueError, match=match):
        flashkda_ext.fused_kda_decode(**a)
    assert torch.equal(a["conv_state"], conv0) and torch.equal(a["state"], state0) and torch.isnan(a["out"]).all()


def test_interleaved_pools_are_apart_and_a_shared_byte_is_not():
    gen = torch.Generator().manual_seed(1)
    conv, state, store = paged(4, "width", gen)
    assert _slots_apart(conv, state) and _slots_apart(state, conv)
    # the state view one element earlier reaches the last conv tap of each slot
    page = state.stride(0)
    early = torch.as_strided(store.view(torch.float32), state.shape, state.stride(), state.storage_offset() - 1)
    assert not _slots_apart(conv, early)
    # and one element past the page's end would reach the next slot's conv cache
    late = torch.as_strided(store.view(torch.float32), (3, H, D, D), state.stride(), state.storage_offset() + 1)
    assert page * 4 == conv.stride(0) * 2 and not _slots_apart(conv, late)
    a = _call(conv_state=conv, state=early)
    with pytest.raises(ValueError, match="overlaps the memory"):
        flashkda_ext.fused_kda_decode(**a)


def test_interleaved_pools_agree_with_the_bindings_rule_on_the_fast_path():
    """The second call takes the fast path (the binding's signature, with its own overlap rule): an interleaved
    pair is served there as well, and a layout that shares a byte falls to the full check and is refused."""
    gen = torch.Generator().manual_seed(2)
    conv, state, store = paged(4, "width", gen)
    a = _call(conv_state=conv, state=state)
    flashkda_ext.fused_kda_decode(**a)
    before = state.clone()
    flashkda_ext.fused_kda_decode(**a)
    assert not torch.equal(state[1], before[1])      # served again (the slot moved on)
    early = torch.as_strided(store.view(torch.float32), state.shape, state.stride(), state.storage_offset() - 1)
    with pytest.raises(ValueError, match="overlaps the memory"):
        flashkda_ext.fused_kda_decode(**dict(a, state=early))
