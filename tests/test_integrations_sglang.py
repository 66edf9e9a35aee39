"""flashkda_ext.integrations.sglang on the CPU backend: SGLang's decode / extend call shapes (views into a packed
projection, fp32 gate and beta beside bf16 q, A_log [1, 1, HV, 1], -1 padding) against flashkda_ext.reference."""
import pytest
import torch

from flashkda_ext.integrations.sglang import FlashKDAExtKernel
from flashkda_ext.reference import kda_decode_step, kda_recurrent

H, K, V, SLOTS = 2, 8, 16, 6     # HV == H; K != V catches a transposed state
TOL = dict(rtol=2e-5, atol=2e-5)


def packed_qkv(T, gen, dtype=torch.float32):
    """q, k, v as SGLang makes them: views into one [T, 2*H*K + H*V] projection, unsqueezed to [1, T, ., .]."""
    mixed = torch.randn(T, 2 * H * K + H * V, generator=gen).to(dtype)
    q, k, v = mixed.split([H * K, H * K, H * V], dim=-1)
    return (q.unflatten(-1, (H, K)).unsqueeze(0), k.unflatten(-1, (H, K)).unsqueeze(0),
            v.unflatten(-1, (H, V)).unsqueeze(0))


def params(gen):
    return torch.randn(1, 1, H, 1, generator=gen) * 0.3, torch.randn(H * K, generator=gen) * 0.5


def test_decode_matches_the_reference_and_updates_the_pool():
    gen = torch.Generator().manual_seed(0)
    N = 4
    q, k, v = packed_qkv(N, gen)
    assert not q.is_contiguous()
    a, b = torch.randn(N, H * K, generator=gen), torch.randn(1, N, H, generator=gen)
    A_log, dt_bias = params(gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    pool0 = pool.clone()
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    o = FlashKDAExtKernel().decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
                                   query_start_loc=torch.arange(N + 1, dtype=torch.int32))
    assert o.shape == (1, N, H, V)
    want_o, want_pool = kda_decode_step(q[0], k[0], v[0], a.view(N, H, K), b[0], state=pool0, state_indices=idx,
                                        A_log=A_log.flatten(), dt_bias=dt_bias)
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)
    assert torch.equal(o[0, 1], torch.zeros(H, V))   # the padding row


def test_decode_with_fp32_gate_and_beta_beside_bf16_q():
    gen = torch.Generator().manual_seed(1)
    N = 3
    q, k, v = packed_qkv(N, gen, torch.bfloat16)
    a, b = torch.randn(1, N, H, K, generator=gen), torch.randn(N, H, generator=gen)   # fp32, as engines make them
    A_log, dt_bias = params(gen)
    pool = torch.zeros(SLOTS, H, V, K)
    idx = torch.tensor([1, 3, 4], dtype=torch.int32)
    o = FlashKDAExtKernel().decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
                                   query_start_loc=torch.arange(N + 1, dtype=torch.int32))
    assert o.dtype == torch.bfloat16
    # the adapter's one-pass cast: the reference sees the same bf16 gate and beta
    want_o, _ = kda_decode_step(q[0], k[0], v[0], a[0].bfloat16(), b.bfloat16(), state=torch.zeros(SLOTS, H, V, K),
                                state_indices=idx, A_log=A_log.flatten(), dt_bias=dt_bias)
    torch.testing.assert_close(o[0].double(), want_o, rtol=2e-2, atol=2e-2)


def extend_case(seed=2, lens=(5, 9)):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = packed_qkv(T, gen)
    g = torch.randn(1, T, H, K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)       # activated (SGLang's default)
    A_log, dt_bias = params(gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    qsl = torch.tensor([0, lens[0], T], dtype=torch.int32)
    return q, k, v, g, beta, A_log, dt_bias, pool, qsl, list(lens)


def reference_extend(q, k, v, g, beta, A_log, dt_bias, pool, qsl, idx, checkpoint_every=0):
    return kda_recurrent(q, k, v, g, beta, A_log=A_log.flatten(), dt_bias=dt_bias, beta_is_logit=False,
                         cu_seqlens=qsl, initial_state=pool, state_indices=idx, checkpoint_every=checkpoint_every)


def test_extend_commits_to_the_pool_and_returns_fla_style_chunk_states():
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case()
    pool0 = pool.clone()
    idx = torch.tensor([4, 1], dtype=torch.int32)
    o, h = FlashKDAExtKernel(chunk_size=4).extend(q, k, v, g, beta, ssm_states=pool, cache_indices=idx,
                                                  query_start_loc=qsl, A_log=A_log, dt_bias=dt_bias,
                                                  extend_seq_lens_cpu=lens, return_intermediate_states=True)
    want_o, want_pool, want_ckpt = reference_extend(q, k, v, g, beta, A_log, dt_bias, pool0, qsl, idx,
                                                    checkpoint_every=4)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)
    # h: request 0 (5 tokens) has chunks starting at 0, 4; request 1 (9 tokens) at 0, 4, 8
    assert h.shape == (1, 2 + 3, H, V, K)
    want_h = torch.stack([pool0[4].double(), want_ckpt[0, 0], pool0[1].double(), want_ckpt[1, 0], want_ckpt[1, 1]])
    torch.testing.assert_close(h[0].double(), want_h, **TOL)


def test_extend_spec_decode_never_writes_the_pool_and_pads():
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=3, lens=(3, 4))
    pool0 = pool.clone()
    idx = torch.tensor([2, -1], dtype=torch.int32)
    o = FlashKDAExtKernel().extend(q, k, v, g, beta, ssm_states=pool, cache_indices=idx, query_start_loc=qsl,
                                   A_log=A_log, dt_bias=dt_bias, is_spec_decode=True)
    assert torch.equal(pool, pool0)
    # padding request: starts from a zero state (read as zeros), like the pool path's padding
    init = torch.stack([pool0[2], torch.zeros(H, V, K)])
    want_o, _, _ = kda_recurrent(q, k, v, g, beta, A_log=A_log.flatten(), dt_bias=dt_bias, beta_is_logit=False,
                                 cu_seqlens=qsl, initial_state=init)
    torch.testing.assert_close(o[:, :3].double(), want_o[:, :3], **TOL)


def test_extend_raw_beta_and_bounded_gate():
    q, k, v, g, _, A_log, dt_bias, pool, qsl, lens = extend_case(seed=4)
    b = torch.randn(1, sum(lens), H)
    pool0 = pool.clone()
    idx = torch.tensor([0, 3], dtype=torch.int32)
    o = FlashKDAExtKernel().extend(q, k, v, g, b, ssm_states=pool, cache_indices=idx, query_start_loc=qsl,
                                   A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, beta_is_raw=True)
    want_o, want_pool, _ = kda_recurrent(q, k, v, g, b, gate="bounded", lower_bound=-5.0, A_log=A_log.flatten(),
                                         dt_bias=dt_bias, cu_seqlens=qsl, initial_state=pool0, state_indices=idx)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


def test_bad_calls_are_named():
    kern = FlashKDAExtKernel()
    q, k, v = packed_qkv(3, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="one token per request"):
        kern.decode(q, k, v, torch.zeros(3, H * K), torch.zeros(3, H), A_log=torch.zeros(H), dt_bias=torch.zeros(H * K),
                    ssm_states=torch.zeros(SLOTS, H, V, K), cache_indices=torch.zeros(2, dtype=torch.int32),
                    query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match=r"\[SD\]"):
        kern.target_verify(None, None, q, k, v, None, None, ssm_states=None, cache_indices=None, query_start_loc=None)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        kern.decode(q, k, v, None, None, A_log=None, dt_bias=None, ssm_states=None, cache_indices=None,
                    query_start_loc=None, replayssm_d=1)
