"""Bad-input campaign 19 (CPU backend): "raise versus fall back" at the serving-engine call sites. The rule: an adapter
serves a call exactly, or falls back to the engine's own kernel with a counted reason; it raises only where the
engine's kernel could not serve the call correctly either (naming the argument). SGLang is driven through its real
0.5.23 code (tests/sglang_wheel.py: KDAAttnBackend's call sites, KDAKernelDispatcher, TritonKDAKernel, whose Triton
ops are recording stubs); vLLM through its real 0.34.0 modules (tests/vllm_wheel.py). Each case failed before its
fix, except those marked "guard".

- SGLang (packed decode, extend, target_verify): a well-formed call that flashkda_ext's op refuses for what it is,
  not for what is wrong with it, raised the op's ValueError out of SGLang's forward instead of falling back to
  SGLang's Triton kernel, which serves it. Now falls back, counted in STATS / REASONS, with nothing written:
  * an fp16 state pool (`--mamba-ssm-dtype float16`, one of SGLang 0.5.23's choices): the ops keep fp32 / bf16
    (/ fp64 on CPU) states; SGLang's Triton kernels load the state as fp32 and store it in the pool's dtype;
  * on CUDA, a head layout or activation dtype outside jit/supported.json (K or V other than 128, fp16 / fp32
    q, a head count not listed), checked here on meta tensors with the op's backend rule told "cuda" (as
    tests/test_integrations_sglang_overhead.py does): SGLang's Triton kernels take any of these;
  * the pool (decode, extend) or the intermediate state buffer (target_verify) an inference tensor written in
    place outside torch.inference_mode(): torch refuses that update to our ops, SGLang's Triton kernels write
    through the pointer;
  * A_log / dt_bias (the layer's nn.Parameters) requiring grad under grad mode: the ops are inference-only,
    SGLang's kernels compute the forward and record nothing.
  The check costs one torch.is_inference_mode_enabled() and a dict lookup a call: 0.39 us alone, a warm
  packed_decode 27.2 -> 28.4 us with the op replaced by a no-op (CPU, H8, K = V = 128, 4 rows, inference mode).
- vLLM: every op refusal already falls back (run_op): guard for the fp16 / inference pool of the packed decode.
- guard: a lazy negated view of SGLang's gate still raises (SGLang's Triton kernel reads the memory through its
  pointer, without the sign: it cannot serve it either), now under SGLang's name `a` (it was the op's `g`); a fp32
  pool inside inference mode is served.
"""
from __future__ import annotations

import types

import pytest
import torch

from flashkda_ext.integrations import sglang as fk
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.validation import common
from test_integrations_sglang_real import (H, K, V, SLOTS, Mode, backend, extend_inputs, layer, metadata, select,
                                          sgl)  # noqa: F401  (sgl: the real-wheel fixture)
from test_integrations_vllm import packed_decode_call, recorded, stat  # noqa: F401  (recorded: fixture)
from vllm_wheel import real, tree  # noqa: F401  (fixtures)

DIM = 2 * H * K + H * V


def decode_site(s, pool, ly):
    d = select(s)
    N = 3
    gen = torch.Generator().manual_seed(1901)
    be = backend(s, d, pool)
    be.forward_metadata = metadata(torch.arange(N + 1, dtype=torch.int32), torch.tensor([5, 2, -1], dtype=torch.int32))
    mixed = torch.randn(N, DIM, generator=gen)
    a, b = torch.randn(N, H * K, generator=gen), torch.randn(1, N, H, generator=gen)
    return "packed_decode", lambda: be.forward_decode(ly, types.SimpleNamespace(mamba_track_mask=None), mixed, a, b), \
        (pool,)


def extend_site(s, pool, ly):
    d = select(s)
    lens = [7, 5]
    mixed, a, b, qsl = extend_inputs(lens, seed=1902)
    be = backend(s, d, pool)
    be.forward_metadata = metadata(qsl, torch.tensor([1, 4], dtype=torch.int32))
    fb = types.SimpleNamespace(forward_mode=Mode("extend"), extend_prefix_lens=torch.tensor([0, 0]),
                               extend_seq_lens_cpu=lens, mamba_track_mask=None)
    return "extend", lambda: be.forward_extend(ly, fb, mixed, a, b), (pool,)


def verify_site(s, pool, ly, buf=None):
    d = select(s)
    D, N = 3, 2
    gen = torch.Generator().manual_seed(1903)
    be = backend(s, d, pool, draft=D)
    if buf is not None:
        be.cache.intermediate_ssm = buf
    be.forward_metadata = metadata(torch.arange(0, N * D + 1, D, dtype=torch.int32),
                                   torch.tensor([4, 2], dtype=torch.int32))
    T = N * D
    mixed = torch.randn(T, DIM, generator=gen)
    a, b = torch.randn(T, H * K, generator=gen), torch.randn(T, H, generator=gen)
    fb = types.SimpleNamespace(forward_mode=Mode("verify"), req_pool_indices=torch.tensor([3, 1]),
                               spec_info=types.SimpleNamespace(draft_token_num=D, ragged_verify_layout=None))
    return "target_verify", lambda: be.forward_extend(ly, fb, mixed, a, b), (pool, be.cache.intermediate_ssm)


SITES = {"decode": decode_site, "extend": extend_site, "target_verify": verify_site}
TRITON_OP = {"packed_decode": "fused_recurrent_kda_packed_decode", "extend": "chunk_kda",
             "target_verify": "fused_sigmoid_gating_delta_rule_update"}


def falls_back_writing_nothing(s, method, run, written, reason_words):
    """run() reaches SGLang's Triton op (the recording stub) once, counted with a reason containing reason_words;
    nothing ours wrote any tensor before."""
    before = [t.clone() for t in written]
    served, fell = fk.STATS[method, "served"], fk.STATS[method, "fell_back"]
    s.triton_calls.clear()
    run()
    assert [name for name, _ in s.triton_calls] == [TRITON_OP[method]]
    assert fk.STATS[method, "fell_back"] == fell + 1 and fk.STATS[method, "served"] == served
    assert any(m == method and reason_words in r for m, r in fk.REASONS), dict(fk.REASONS)
    for t, t0 in zip(written, before):   # the stubs write nothing: any change would be ours
        assert torch.equal(t, t0) or (torch.isnan(t0).all() and torch.isnan(t).all())


def pool_of(dtype=torch.float32, inference=False):
    gen = torch.Generator().manual_seed(1904)
    if inference:
        with torch.inference_mode():
            return (torch.randn(SLOTS, H, V, K, generator=gen) * 0.3).to(dtype)
    return (torch.randn(SLOTS, H, V, K, generator=gen) * 0.3).to(dtype)


# ---------------------------------------------------------------------------------------------
# SGLang: what its Triton kernel serves falls back, counted

@pytest.mark.parametrize("site", SITES)
def test_sglang_fp16_pool_falls_back_to_sglangs_triton(sgl, site):
    """--mamba-ssm-dtype float16: before, every KDA call raised "state: expected dtype in [...]" from the op."""
    method, run, written = SITES[site](sgl, pool_of(torch.float16), layer(None, seed=1905))
    falls_back_writing_nothing(sgl, method, run, written, "ssm_states: expected dtype in")


@pytest.mark.parametrize("site", ["decode", "extend"])
def test_sglang_inference_pool_outside_inference_mode_falls_back(sgl, site):
    method, run, written = SITES[site](sgl, pool_of(inference=True), layer(None, seed=1906))
    assert not torch.is_inference_mode_enabled()
    falls_back_writing_nothing(sgl, method, run, written, "ssm_states is an inference tensor")


def test_sglang_verify_inference_buffer_outside_inference_mode_falls_back(sgl):
    with torch.inference_mode():
        buf = torch.full((SLOTS + 1, 3, H, V, K), float("nan"))
    method, run, written = verify_site(sgl, pool_of(), layer(None, seed=1907), buf=buf)
    falls_back_writing_nothing(sgl, method, run, written, "intermediate_states_buffer is an inference tensor")


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("param", ["A_log", "dt_bias"])
def test_sglang_parameter_requiring_grad_under_grad_mode_falls_back(sgl, site, param):
    ly = layer(None, seed=1908)
    setattr(ly, param, torch.nn.Parameter(getattr(ly, param)))      # as a model holds it
    method, run, written = SITES[site](sgl, pool_of(), ly)
    with torch.enable_grad():
        falls_back_writing_nothing(sgl, method, run, written, f"{param} requires grad")


@pytest.mark.parametrize("what", ["head_dim_64", "fp16_activations"])
def test_sglang_cuda_layout_outside_the_supported_set_falls_back(sgl, monkeypatch, what):
    """On CUDA the kernels take K = V = 128 and bf16 activations only; before, K = 64 or fp16 q raised the op's
    ValueError out of SGLang's forward_decode. Meta tensors, the op's backend rule told "cuda" (nothing launches)."""
    backend_of = common.backend_of
    monkeypatch.setattr(common, "backend_of", lambda d: "cuda" if d.type == "meta" else backend_of(d))
    d = select(sgl)
    kernel = d.decode_kernel
    Kc, dtype = (64, torch.bfloat16) if what == "head_dim_64" else (128, torch.float16)
    HV = 8
    B = 4
    mixed = torch.empty(B, 3 * HV * Kc, device="meta", dtype=dtype)
    pool = torch.empty(SLOTS, HV, Kc, Kc, device="meta")
    sgl.triton_calls.clear()
    fell = fk.STATS["packed_decode", "fell_back"]
    kernel.packed_decode(mixed, torch.empty(B, HV * Kc, device="meta", dtype=dtype),
                         torch.empty(B, HV, device="meta", dtype=dtype), A_log=torch.empty(HV, device="meta"),
                         dt_bias=torch.empty(HV * Kc, device="meta"), scale=Kc ** -0.5, ssm_states=pool,
                         cache_indices=torch.empty(B, device="meta", dtype=torch.int32), num_v_heads=HV,
                         head_v_dim=Kc, lower_bound=-5.0)
    assert [name for name, _ in sgl.triton_calls] == ["fused_recurrent_kda_packed_decode"]
    assert fk.STATS["packed_decode", "fell_back"] == fell + 1
    word = "head dim K = 64" if what == "head_dim_64" else "expected dtype in ['bfloat16']"
    assert any(m == "packed_decode" and word in r for m, r in fk.REASONS), dict(fk.REASONS)


# ---------------------------------------------------------------------------------------------
# guards

def test_sglang_fp32_pool_inside_inference_mode_is_served_guard(sgl):
    with torch.inference_mode():
        pool = pool_of(inference=True)
        pool0 = pool.clone()
        method, run, _ = decode_site(sgl, pool, layer(None, seed=1909))
        served = fk.STATS[method, "served"]
        sgl.triton_calls.clear()
        run()
    assert fk.STATS[method, "served"] == served + 1 and not sgl.triton_calls
    assert not torch.equal(pool[[5, 2]], pool0[[5, 2]])     # committed in place


def test_sglang_negated_gate_view_still_raises_guard(sgl):
    """SGLang's Triton kernel reads `a` through its data pointer, without the lazy sign: it cannot serve the call
    either, so the op's refusal stands (a ValueError, nothing written, nothing counted)."""
    d = select(sgl)
    pool = pool_of()
    pool0 = pool.clone()
    N = 2
    a = torch._neg_view(torch.randn(N, H * K))
    stats = fk.STATS.copy()
    with pytest.raises(ValueError, match="^a: expected a tensor without the negative bit"):   # SGLang's name
        d.decode_kernel.packed_decode(torch.randn(N, DIM), a, torch.randn(1, N, H), A_log=torch.zeros(H),
                                      dt_bias=torch.zeros(H * K), scale=K ** -0.5, ssm_states=pool,
                                      cache_indices=torch.tensor([1, 2], dtype=torch.int32), num_v_heads=H,
                                      head_v_dim=V)
    assert torch.equal(pool, pool0) and fk.STATS == stats


@pytest.mark.parametrize("kind", ["fp16", "inference"])
def test_vllm_packed_decode_pool_the_op_refuses_falls_back_guard(recorded, kind):
    """vLLM's adapters run every op refusal back to vLLM's kernel (run_op): an fp16 pool or an inference pool
    outside inference mode reaches vLLM's packed decode, counted, nothing written."""
    if kind == "inference":
        with torch.inference_mode():
            pool = torch.randn(6, 2, 8, 8)
    else:
        pool = torch.randn(6, 2, 8, 8).half()
    pool0 = pool.clone()
    call = packed_decode_call(3, [4, 0, 2], pool, -5.0)
    site = "k3.fused_recurrent_kda_packed_decode"
    fell = stat(site, "fell_back")
    with torch.no_grad():
        res = recorded.k3.fused_recurrent_kda_packed_decode(**call)
    assert res == ("original", "fused_recurrent_kda_packed_decode")
    assert stat(site, "fell_back") == fell + 1 and torch.equal(pool, pool0)
