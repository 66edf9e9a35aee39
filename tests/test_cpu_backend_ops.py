"""The public ops on CPU tensors: validation -> route -> the CPU module, end to end, against the
reference on fresh random inputs; plus the per-call time of a small public decode (validation
included) beside the bare TVM-FFI call."""
import random
import time

import pytest
import torch

import flashkda_ext
from flashkda_ext import jit
from flashkda_ext.reference import fused_kda_decode_step, kda_decode_step, kda_recurrent

f64 = torch.float64


def needs_cpu_route(family):
    """The routes file of a family is data another part of the project writes; without a CPU rule the
    public op cannot reach the CPU backend yet, which is a skip, not a pass."""
    try:
        rules = jit.routes_for(family)
    except Exception as e:  # noqa: BLE001 - a missing or unloadable routes file
        pytest.skip(f"jit/routes/{family}.json not loadable yet: {e}")
    if not any(r.get("when", {}).get("device") == "cpu" for r in rules):
        pytest.skip(f"jit/routes/{family}.json has no cpu rule yet")


def gen():
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=f64) * scale).to(dtype)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_public_decode_on_cpu(state_dtype, gate):
    needs_cpu_route("kda_decode")
    g, seed = gen()
    rows, H, HV, K, V, slots = 5, 2, 4, 12, 8, 6
    q, k = randn(g, rows, H, K, dtype=torch.bfloat16), randn(g, rows, H, K, dtype=torch.bfloat16)
    v, gr = randn(g, rows, HV, V, dtype=torch.bfloat16), randn(g, rows, HV, K, dtype=torch.bfloat16)
    beta = randn(g, rows, HV, dtype=torch.bfloat16)
    A_log, dt_bias = randn(g, HV, scale=0.3), randn(g, HV, K, scale=0.5)
    pool0 = randn(g, slots, HV, V, K, dtype=state_dtype, scale=0.5)
    idx = torch.tensor([4, -1, 2, 4, 0], dtype=torch.int32)
    pool = pool0.clone()
    out = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16)
    lb = -3.0 if gate == "bounded" else None
    got = flashkda_ext.kda_decode(q, k, v, gr, beta, state=pool, state_indices=idx, A_log=A_log,
                                  dt_bias=dt_bias, gate=gate, lower_bound=lb, slot_mode="repeated",
                                  out=out)
    assert got is out
    want_out, want_pool = kda_decode_step(q, k, v, gr, beta, state=pool0, state_indices=idx, gate=gate,
                                          A_log=A_log, dt_bias=dt_bias, lower_bound=lb)
    torch.testing.assert_close(out.double(), want_out, rtol=6e-3, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(pool.double(), want_pool.double(), rtol=6e-3, atol=1e-4,
                               msg=lambda m: f"seed {seed}: {m}")


def test_public_prefill_on_cpu_with_checkpoints():
    needs_cpu_route("kda_prefill")
    g, seed = gen()
    lens, H, HV, K, V = [4, 0, 7], 1, 2, 6, 10
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    q, k = randn(g, 1, T, H, K), randn(g, 1, T, H, K)
    v, gr, beta = randn(g, 1, T, HV, V), randn(g, 1, T, HV, K), randn(g, 1, T, HV)
    A_log, dt_bias = randn(g, HV, scale=0.3), randn(g, HV * K, scale=0.5)
    init = randn(g, N, HV, V, K, scale=0.5)
    out, final, ckpts = flashkda_ext.kda_prefill(q, k, v, gr, beta, A_log=A_log, dt_bias=dt_bias,
                                                 cu_seqlens=cu, initial_state=init, checkpoint_every=2)
    want_out, want_final, want_ck = kda_recurrent(q, k, v, gr, beta, A_log=A_log, dt_bias=dt_bias,
                                                  cu_seqlens=cu, initial_state=init, checkpoint_every=2)
    tol = dict(rtol=2e-6, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(final.double(), want_final, **tol)
    assert torch.equal(torch.isnan(ckpts), torch.isnan(want_ck))
    m = ~torch.isnan(want_ck)
    torch.testing.assert_close(ckpts.double()[m], want_ck[m], **tol)


def test_public_fused_decode_on_cpu():
    needs_cpu_route("fused_kda_decode")
    g, seed = gen()
    rows, H, D, slots = 4, 2, 8, 5
    C = 3 * H * D
    x, w = randn(g, rows, C), randn(g, C, 4, scale=0.5)
    conv0, state0 = randn(g, slots, C, 3), randn(g, slots, H, D, D, scale=0.5)
    gr, beta, og = randn(g, rows, H, D), randn(g, rows, H), randn(g, rows, H, D)
    A_log, dt_bias, nw = randn(g, H, scale=0.3), randn(g, H * D, scale=0.5), randn(g, D).abs() + 0.5
    idx = torch.tensor([3, -1, 1, 3], dtype=torch.int32)
    conv, state = conv0.clone(), state0.clone()
    out = flashkda_ext.fused_kda_decode(x, w, conv, gr, beta, A_log, dt_bias, idx, state, og, nw,
                                        gate="softplus", slot_mode="repeated")
    want_out, want_conv, want_state = fused_kda_decode_step(x, w, conv0, gr, beta, A_log, dt_bias, idx, state0,
                                                            og, nw, gate="softplus")
    tol = dict(rtol=2e-6, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(conv.double(), want_conv.double(), **tol)
    torch.testing.assert_close(state.double(), want_state.double(), **tol)


def _per_call_us(fn, n=1000, reps=5):
    for _ in range(100):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return sorted(samples)[reps // 2] * 1e6


def test_public_decode_call_time(capsys):
    """A small decode (1 row, 1 head, K = V = 16, fp32) through the public op and through the bare
    TVM-FFI function: the difference is Python validation + routing."""
    needs_cpu_route("kda_decode")
    g, _ = gen()
    q, k, v, gr = randn(g, 1, 1, 16), randn(g, 1, 1, 16), randn(g, 1, 1, 16), randn(g, 1, 1, 16)
    beta, A_log, dt_bias = randn(g, 1, 1), randn(g, 1), randn(g, 16)
    pool, idx, out = randn(g, 2, 1, 16, 16), torch.tensor([1], dtype=torch.int32), torch.empty(1, 1, 16)
    public = lambda: flashkda_ext.kda_decode(q, k, v, gr, beta, state=pool, state_indices=idx,  # noqa: E731
                                             A_log=A_log, dt_bias=dt_bias, out=out)
    fn = jit.load_module("cpu_kda_decode")["kda_decode"]
    bare = lambda: fn(q, k, v, gr, beta, A_log, dt_bias, pool, idx, out, 0, 0.0, 0.25, True, False)  # noqa: E731
    # the two calls do the same work: one step from the same pool gives bitwise the same output and slot
    pool0 = pool.clone()
    public()
    o_public, s_public = out.clone(), pool.clone()
    pool.copy_(pool0)
    bare()
    assert torch.equal(out, o_public) and torch.equal(pool, s_public)
    # the figures are printed, not asserted: a timing bound here failed under a loaded 2-core machine
    # (2026-12-02); the bound on this cost lives in benchmarks/bench_overhead.py
    t_public, t_bare = _per_call_us(public), _per_call_us(bare)
    with capsys.disabled():
        print(f"\n[cpu backend] small kda_decode: public op {t_public:.1f} us, bare TVM-FFI call {t_bare:.1f} us "
              f"(median of 5 x 1000)")
