"""Bad-input campaign 16 (CPU backend): the serving-engine adapters driven through the real engines' released code
(SGLang 0.5.23's KDAAttnBackend call sites and KDAKernelDispatcher, tests/sglang_wheel.py). Each case failed before
its fix, except those marked "guard" (behaviour that was already right, pinned beside the fix that depends on it).

- SGLang (decode, packed decode, extend, target_verify): a complex A_log / dt_bias (the layer's parameters) or a
  complex gate / beta was cast to a real dtype by torch, which drops the imaginary part with only a warning, and
  the call was served on other values than the caller's (SGLang's Triton kernels take no complex tensor). Now a
  TypeError naming the argument, before anything is written. Real parameters of another width (fp64, fp16) are
  still served, read as fp32 (guard).
- SGLang target_verify: host query_start_loc that does not rise from 0 to T (non-decreasing) was refused by
  kda_verify under its own name, "cu_seqlens: ...", an argument SGLang's call has not got (extend already names
  query_start_loc). Now a ValueError naming query_start_loc, before anything is written.

Every refusal leaves the pool, the intermediate state buffer and the served / fallback counters as they were.
"""
from __future__ import annotations

import types

import pytest
import torch

from flashkda_ext.integrations import sglang as fk
from flashkda_ext.reference import kda_decode_step
from test_integrations_sglang_real import (H, K, V, SLOTS, TOL, Mode, backend, extend_inputs, layer, metadata, select,
                                          sgl)  # noqa: F401  (sgl: the real-wheel fixture)

DIM = 2 * H * K + H * V


def counters():
    return fk.STATS.copy(), fk.REASONS.copy()


# ---------------------------------------------------------------------------------------------
# complex parameters / gates: named, never cast

def complex_of(x: torch.Tensor) -> torch.Tensor:
    """x as complex64 with a nonzero imaginary part (a cast to a real dtype would drop it)."""
    return torch.complex(x.float(), torch.full_like(x.float(), 0.25))


def decode_site(sgl, ly, change=None):
    """forward_decode (SGLang's packed route) on a fresh pool; returns (run, the tensors it may write)."""
    d = select(sgl)
    gen = torch.Generator().manual_seed(1601)
    N = 3
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    be = backend(sgl, d, pool)
    be.forward_metadata = metadata(torch.arange(N + 1, dtype=torch.int32), torch.tensor([5, 2, -1], dtype=torch.int32))
    mixed = torch.randn(N, DIM, generator=gen)
    a, b = torch.randn(N, H * K, generator=gen), torch.randn(1, N, H, generator=gen)
    if change == "gate":
        a = complex_of(a)
    elif change == "beta":
        b = complex_of(b)
    fb = types.SimpleNamespace(mamba_track_mask=None)
    return (lambda: be.forward_decode(ly, fb, mixed, a, b)), (pool,)


def extend_site(sgl, ly, change=None):
    """forward_extend on a fresh pool."""
    d = select(sgl)
    lens = [7, 5]
    mixed, a, b, qsl = extend_inputs(lens, seed=1602)
    if change == "gate":
        a = complex_of(a)
    elif change == "beta":
        b = complex_of(b)
    pool = torch.randn(SLOTS, H, V, K, generator=torch.Generator().manual_seed(1603)) * 0.3
    be = backend(sgl, d, pool)
    be.forward_metadata = metadata(qsl, torch.tensor([1, 4], dtype=torch.int32))
    fb = types.SimpleNamespace(forward_mode=Mode("extend"), extend_prefix_lens=torch.tensor([0, 0]),
                               extend_seq_lens_cpu=lens, mamba_track_mask=None)
    return (lambda: be.forward_extend(ly, fb, mixed, a, b)), (pool,)


def verify_site(sgl, ly, change=None):
    """_forward_target_verify (through forward_extend in verify mode) on a fresh pool and scratch buffer."""
    d = select(sgl)
    D, N = 3, 2
    gen = torch.Generator().manual_seed(1604)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    be = backend(sgl, d, pool, draft=D)
    be.forward_metadata = metadata(torch.arange(0, N * D + 1, D, dtype=torch.int32),
                                   torch.tensor([4, 2], dtype=torch.int32))
    T = N * D
    mixed = torch.randn(T, DIM, generator=gen)
    a, b = torch.randn(T, H * K, generator=gen), torch.randn(T, H, generator=gen)
    if change == "gate":
        a = complex_of(a)
    elif change == "beta":
        b = complex_of(b)
    fb = types.SimpleNamespace(forward_mode=Mode("verify"), req_pool_indices=torch.tensor([3, 1]),
                               spec_info=types.SimpleNamespace(draft_token_num=D, ragged_verify_layout=None))
    return (lambda: be.forward_extend(ly, fb, mixed, a, b)), (pool, be.cache.intermediate_ssm)


SITES = {"decode": decode_site, "extend": extend_site, "target_verify": verify_site}


def refused_writing_nothing(run, written, match):
    before = [t.clone() for t in written]
    stats, reasons = counters()
    with pytest.raises(TypeError, match=match):
        run()
    for t, t0 in zip(written, before):
        assert torch.equal(t, t0) or (torch.isnan(t0).all() and torch.isnan(t).all())
    assert (fk.STATS, fk.REASONS) == (stats, reasons)


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("param", ["A_log", "dt_bias"])
def test_sglang_complex_layer_parameter_is_named_not_cast(sgl, site, param):
    ly = layer(-5.0 if site == "extend" else None, seed=1605)
    setattr(ly, param, complex_of(getattr(ly, param)))
    run, written = SITES[site](sgl, ly)
    refused_writing_nothing(run, written, f"^{param}: .*complex64")


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("which", ["gate", "beta"])
def test_sglang_complex_gate_or_beta_is_named_not_cast(sgl, site, which):
    # SGLang's names: a / b at decode and verify, g / beta at extend (the dispatcher's keywords)
    name = {("decode", "gate"): "a", ("target_verify", "gate"): "a", ("extend", "gate"): "g",
            ("decode", "beta"): "b", ("target_verify", "beta"): "b", ("extend", "beta"): "beta"}[site, which]
    run, written = SITES[site](sgl, layer(None, seed=1606), change=which)
    refused_writing_nothing(run, written, f"^{name}: .*complex64")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_sglang_real_parameters_of_another_width_are_served_as_fp32_guard(sgl, dtype):
    """guard: a real A_log / dt_bias of another floating dtype is read as fp32 (as SGLang's kernels load it)."""
    ly = layer(None, seed=1607)
    ly.A_log, ly.dt_bias = ly.A_log.to(dtype), ly.dt_bias.to(dtype)
    run, (pool,) = decode_site(sgl, ly)
    pool0 = pool.clone()
    served = fk.STATS["packed_decode", "served"]
    o = run()
    assert fk.STATS["packed_decode", "served"] == served + 1
    gen = torch.Generator().manual_seed(1601)     # decode_site's inputs again
    torch.randn(SLOTS, H, V, K, generator=gen)
    mixed = torch.randn(3, DIM, generator=gen)
    a, b = torch.randn(3, H * K, generator=gen), torch.randn(1, 3, H, generator=gen)
    q, k, v = (x.reshape(3, H, -1) for x in mixed.split([H * K, H * K, H * V], -1))
    want_o, want_pool = kda_decode_step(q, k, v, a.view(3, H, K), b[0], state=pool0,
                                        state_indices=torch.tensor([5, 2, -1], dtype=torch.int32),
                                        A_log=ly.A_log.float().flatten(), dt_bias=ly.dt_bias.float())
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


# ---------------------------------------------------------------------------------------------
# target_verify: bad host offsets named as SGLang names them

@pytest.mark.parametrize("offsets,steps", [([0, 3, 5], 3), ([1, 3, 6], 3), ([0, 2, 1, 6], 5)],
                         ids=["last-below-T", "start-above-0", "non-monotone"])
def test_sglang_target_verify_bad_host_offsets_name_query_start_loc(sgl, offsets, steps):
    """Through SGLang's real KDAKernelDispatcher.target_verify: T = 6 draft tokens, offsets that are no packing of
    them. SGLang's call has no cu_seqlens (that is kda_verify's name for them)."""
    d = select(sgl)
    N, T = len(offsets) - 1, 6
    gen = torch.Generator().manual_seed(1608)
    ly = layer(None, seed=1609)
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    a, b = torch.randn(T, H * K, generator=gen), torch.randn(T, H, generator=gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen)
    buf = torch.full((N + 1, steps, H, V, K), float("nan"))
    pool0 = pool.clone()
    stats, reasons = counters()
    with pytest.raises(ValueError, match=r"^query_start_loc: expected non-decreasing offsets from 0 to T = 6"):
        d.target_verify(ly.A_log, ly.dt_bias, q, k, v, a, b, ssm_states=pool,
                        cache_indices=torch.arange(1, N + 1, dtype=torch.int32),
                        query_start_loc=torch.tensor(offsets, dtype=torch.int32), intermediate_states_buffer=buf,
                        intermediate_state_indices=torch.arange(N, dtype=torch.int32), cache_steps=steps,
                        retrieve_parent_token=None)
    assert torch.equal(pool, pool0) and torch.isnan(buf).all()
    assert (fk.STATS, fk.REASONS) == (stats, reasons)
