"""The fla backend through fla's own dispatch (fla.backends), when fla >= 0.6 imports (it needs triton; CI
does not install it, so this file skips there). On the CPU, fla's Triton kernels cannot run: every call here
is one our backend serves, or a refusal checked through fla's BaseBackend.verify without falling back."""
import pytest
import torch

fla_kda = pytest.importorskip("fla.ops.kda", reason="fla (flash-linear-attention >= 0.6) is not installed")
fla_backends = pytest.importorskip("fla.backends")

from flashkda_ext.integrations import fla as fkda_fla  # noqa: E402
from flashkda_ext.reference import kda_decode_step, kda_recurrent  # noqa: E402

H, K, V = 2, 8, 16


@pytest.fixture(scope="module")
def backend():
    cls = fkda_fla.register()
    yield cls


def test_registered_in_both_registries(backend):
    kda_registry = fla_backends._operation_registries["kda"]
    assert kda_registry._backends[fkda_fla.BACKEND_TYPE].__class__ is backend
    chunk_registry = fla_backends._function_registries[__import__("inspect").unwrap(fla_kda.chunk_kda)]
    assert fkda_fla.BACKEND_TYPE in chunk_registry._backends


def test_chunk_kda_is_served_through_fla_dispatch(backend):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 9, H, K, generator=gen), torch.randn(1, 9, H, K, generator=gen)
    v, g = torch.randn(1, 9, H, V, generator=gen), torch.randn(1, 9, H, K, generator=gen)
    beta, A_log, dt_bias = torch.randn(1, 9, H, generator=gen), torch.randn(H) * 0.3, torch.randn(H * K) * 0.5
    cu = torch.tensor([0, 4, 9])
    served = fkda_fla.STATS["chunk_kda", "served"]
    with torch.inference_mode():
        o, ht = fla_kda.chunk_kda(q, k, v, g, beta, initial_state=None, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=cu,
                                  A_log=A_log, dt_bias=dt_bias)
    assert fkda_fla.STATS["chunk_kda", "served"] == served + 1
    want_o, want_ht, _ = kda_recurrent(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)
    torch.testing.assert_close(o.double(), want_o, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ht.double(), want_ht, rtol=2e-5, atol=2e-5)


def test_vllm_decode_is_served_through_fla_dispatch(backend):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    gen = torch.Generator().manual_seed(1)
    N = 3
    q, k = torch.randn(1, N, H, K, generator=gen), torch.randn(1, N, H, K, generator=gen)
    v, g = torch.randn(1, N, H, V, generator=gen), -torch.rand(1, N, H, K, generator=gen)
    beta = torch.randn(1, N, H, generator=gen)
    pool = torch.randn(4, H, V, K, generator=gen)
    pool0, idx = pool.clone(), torch.tensor([2, -1, 0], dtype=torch.int32)
    with torch.inference_mode():
        o, ht = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                                        state_v_first=True, cu_seqlens=torch.arange(N + 1),
                                        ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True)
    assert ht is pool
    want_o, want_pool = kda_decode_step(q[0], k[0], v[0], g[0], beta[0], state=pool0, state_indices=idx,
                                        gate="log")
    torch.testing.assert_close(o[0].double(), want_o, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pool, want_pool, rtol=2e-5, atol=2e-5)


def test_refusals_reach_fla_verify(backend, monkeypatch):
    b = backend()
    x = torch.zeros(1, 4, H, K)
    ok, why = b.verify("chunk_kda", x.clone().requires_grad_(), x, torch.zeros(1, 4, H, V), x,
                       torch.zeros(1, 4, H), use_qk_l2norm_in_kernel=True)
    assert not ok and "inference only" in why
    with torch.inference_mode():
        ok, why = b.verify("chunk_kda", x, x, torch.zeros(1, 4, H, V), x, torch.zeros(1, 4, H),
                           use_qk_l2norm_in_kernel=True)
    assert not ok and "state_v_first=True" in why
    monkeypatch.setenv(fkda_fla.ENV_VAR, "0")
    assert not b.is_enabled()
