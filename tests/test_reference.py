"""The reference recurrence, gates and state handling, pinned by hand-derived numbers and by
independent formulations (scalar math, explicit head repetition, prefix runs)."""
import math

import pytest
import torch

from flashkda_ext.reference import gate_log_decay, kda_recurrent, l2norm, softplus

f64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=f64)


def random_prefill(B, T, H, HV, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=f64)
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K),
                beta=r(B, T, HV), A_log=torch.log(0.05 + 0.3 * torch.rand(HV, generator=gen, dtype=f64)),
                dt_bias=0.5 * r(HV * K))


# ---- hand-derived cases (K = 2, V = 3, so a [V,K]/[K,V] mix-up cannot pass) ----

def test_hand_two_tokens_log_gate():
    # Vectors are scaled up so l2norm's eps moves them by < 1e-9: k1 -> (0.6, 0.8), q1 -> (0, 1),
    # k2 -> (0, 1), q2 -> (0.6, -0.8); scale 2 doubles q.
    q = t([[[[0.0, 50.0]], [[30.0, -40.0]]]])                 # [1, 2, 1, 2]
    k = t([[[[30.0, 40.0]], [[0.0, 100.0]]]])
    v = t([[[[1.0, 2.0, 3.0]], [[-1.0, 0.0, 1.0]]]])          # [1, 2, 1, 3]
    g = t([[[[math.log(0.5), math.log(0.25)]], [[0.0, math.log(0.5)]]]])
    beta = t([[[0.5], [1.0]]])
    S0 = t([[[[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]]])          # stored [N, HV, V, K]
    out, final, _ = kda_recurrent(q, k, v, g, beta, gate="log", beta_is_logit=False, scale=2.0,
                                  initial_state=S0)
    # token 1: decay keys by (0.5, 0.25): S = [[.5,0],[0,.5],[.5,.25]]; S k = (.3,.4,.5)
    #   u = .5 * ((1,2,3) - (.3,.4,.5)) = (.35,.8,1.25); S += u k^T -> [[.71,.28],[.48,1.14],[1.25,1.25]]
    #   o = S (2 q) = 2 * (.28, 1.14, 1.25)
    # token 2: decay keys by (1, .5): S = [[.71,.14],[.48,.57],[1.25,.625]]; S k = (.14,.57,.625)
    #   u = (-1,0,1) - that = (-1.14,-.57,.375); only key 1 changes: S = [[.71,-1],[.48,0],[1.25,1]]
    #   o = S (1.2, -1.6) = (.852 + 1.6, .576, 1.5 - 1.6)
    expected_out = t([[[[0.56, 2.28, 2.5]], [[2.452, 0.576, -0.1]]]])
    expected_final = t([[[[0.71, -1.0], [0.48, 0.0], [1.25, 1.0]]]])
    assert out.dtype == f64 and out.shape == (1, 2, 1, 3)
    assert final.shape == (1, 1, 3, 2)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-8)
    torch.testing.assert_close(final, expected_final, rtol=0, atol=1e-8)
    # the same in float32 arithmetic, returned as float32
    out32, final32, _ = kda_recurrent(q, k, v, g, beta, gate="log", beta_is_logit=False, scale=2.0,
                                      initial_state=S0, dtype=torch.float32)
    assert out32.dtype == torch.float32 and final32.dtype == torch.float32
    torch.testing.assert_close(out32, expected_out.float(), rtol=0, atol=1e-5)


def test_hand_one_token_softplus_gate_and_beta_logit():
    # A_log = log 2, dt_bias = 0: key 0 has g_raw 0 -> g = -2 log 2 (decay .25);
    # key 1 has g_raw 30 > 20 -> softplus = 30, g = -60 (decay e^-60 ~ 1e-26, i.e. gone).
    # beta logit 0 -> 0.5. k -> (0.8, 0.6), q -> (0, -1), scale 1.
    S0 = t([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]])
    out, final, _ = kda_recurrent(
        t([[[[0.0, -20.0]]]]), t([[[[40.0, 30.0]]]]), t([[[[1.0, 1.0, 1.0]]]]), t([[[[0.0, 30.0]]]]),
        t([[[0.0]]]), gate="softplus", A_log=t([math.log(2.0)]), dt_bias=t([0.0, 0.0]), scale=1.0,
        initial_state=S0)
    # decayed S = [[.25,0],[.75,0],[1.25,0]]; S k = (.2,.6,1); u = .5 * (1 - S k) = (.4,.2,0)
    # S += u k^T -> [[.57,.24],[.91,.12],[1.25,0]]; o = S q = -(column 1)
    torch.testing.assert_close(out, t([[[[-0.24, -0.12, 0.0]]]]), rtol=0, atol=1e-8)
    torch.testing.assert_close(final, t([[[[0.57, 0.24], [0.91, 0.12], [1.25, 0.0]]]]),
                               rtol=0, atol=1e-8)


# ---- gates, l2norm, scale ----

def _math_softplus(x):
    return x if x > 20 else math.log1p(math.exp(x))


def _math_sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("dt_shape", ["flat", "2d"])
def test_softplus_gate_against_math(dt_shape):
    gen = torch.Generator().manual_seed(1)
    HV, K = 3, 4
    g_raw = 6 * torch.randn(2, 5, HV, K, generator=gen, dtype=f64)
    g_raw[0, 0, 0, 0] = 24.0                                   # past the softplus threshold
    A_log = torch.randn(HV, generator=gen, dtype=f64)
    dt_bias = torch.randn(HV * K, generator=gen, dtype=f64)
    got = gate_log_decay(g_raw, "softplus", A_log=A_log,
                         dt_bias=dt_bias if dt_shape == "flat" else dt_bias.reshape(HV, K))
    assert got.shape == g_raw.shape
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in g_raw.shape)).tolist():
        b, s, h, d = idx
        x = g_raw[b, s, h, d].item() + dt_bias[h * K + d].item()
        expected = -math.exp(A_log[h].item()) * _math_softplus(x)
        assert got[b, s, h, d].item() == pytest.approx(expected, rel=1e-13, abs=1e-15)


@pytest.mark.parametrize("with_params", [True, False])
def test_bounded_gate_against_math(with_params):
    gen = torch.Generator().manual_seed(2)
    HV, K = 2, 3
    g_raw = 3 * torch.randn(4, HV, K, generator=gen, dtype=f64)
    A_log = torch.randn(HV, generator=gen, dtype=f64) if with_params else None
    dt_bias = torch.randn(HV * K, generator=gen, dtype=f64) if with_params else None
    got = gate_log_decay(g_raw, "bounded", A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    for s in range(4):
        for h in range(HV):
            for d in range(K):
                a = math.exp(A_log[h].item()) if with_params else 1.0
                bias = dt_bias[h * K + d].item() if with_params else 0.0
                expected = -5.0 * _math_sigmoid(a * (g_raw[s, h, d].item() + bias))
                assert got[s, h, d].item() == pytest.approx(expected, rel=1e-13)
                assert -5.0 <= got[s, h, d].item() <= 0.0


def test_log_gate_is_identity_and_bf16_upcasts():
    g = -torch.rand(3, 2, 5, dtype=f64)
    assert torch.equal(gate_log_decay(g, "log"), g)
    assert gate_log_decay(g.bfloat16(), "log").dtype == torch.float32


def test_gate_argument_errors():
    g = torch.randn(2, 3, dtype=f64)
    with pytest.raises(ValueError, match="lower_bound"):
        gate_log_decay(g, "bounded")
    with pytest.raises(ValueError, match="lower_bound"):
        gate_log_decay(g, "bounded", lower_bound=0.5)
    with pytest.raises(ValueError, match="A_log"):
        gate_log_decay(g, "softplus", dt_bias=torch.zeros(6, dtype=f64))
    with pytest.raises(ValueError, match="gate"):
        gate_log_decay(g, "sigmoid")
    with pytest.raises(ValueError, match="dt_bias"):
        gate_log_decay(g, "softplus", A_log=torch.zeros(2, dtype=f64), dt_bias=torch.zeros(5, dtype=f64))


def test_softplus_threshold_at_20():
    xs = [19.5, 20.0, 20.0 + 1e-6, 20.5, 25.0, 1000.0, -1000.0]
    got = softplus(t(xs)).tolist()
    # at and below 20 the true softplus (log1p(exp(20)) - 20 = 2.06e-9, visible in float64)
    assert got[0] == pytest.approx(math.log1p(math.exp(19.5)), rel=1e-15)
    assert got[1] == pytest.approx(math.log1p(math.exp(20.0)), rel=1e-15)
    assert got[1] - 20.0 > 1e-9
    # above 20 exactly x, even where exp would overflow
    assert got[2] == 20.0 + 1e-6 and got[3] == 20.5 and got[4] == 25.0 and got[5] == 1000.0
    assert got[6] == 0.0
    # and through the gate with A_log = 0, dt_bias = 0: g = -softplus(x)
    g = gate_log_decay(t(xs).reshape(-1, 1, 1), "softplus", A_log=t([0.0]), dt_bias=t([0.0]))
    assert g.flatten().tolist() == [-x for x in got]


def test_l2norm_uses_eps_inside_the_root():
    x = t([[3e-4, 4e-4, 0.0]])
    denom = math.sqrt(9e-8 + 16e-8 + 1e-6)                     # eps = 1e-6 matters at this size
    torch.testing.assert_close(l2norm(x), t([[3e-4 / denom, 4e-4 / denom, 0.0]]), rtol=1e-14, atol=0)
    torch.testing.assert_close(l2norm(x, eps=0.0), t([[0.6, 0.8, 0.0]]), rtol=1e-14, atol=0)


def test_default_scale_is_inverse_sqrt_k():
    # o = S^T q is linear in q, so the default scale must equal scale=1 times K^-0.5 (K = 6)
    x = random_prefill(1, 7, 1, 1, 6, 3, seed=3)
    out_default, _, _ = kda_recurrent(**x)
    out_one, _, _ = kda_recurrent(**x, scale=1.0)
    torch.testing.assert_close(out_default, out_one * 6 ** -0.5, rtol=1e-12, atol=1e-14)


def test_beta_logit_vs_probability():
    x = random_prefill(1, 5, 1, 2, 4, 3, seed=4)
    as_logit, _, _ = kda_recurrent(**x)
    beta = x.pop("beta")
    as_prob, _, _ = kda_recurrent(**x, beta=torch.sigmoid(beta), beta_is_logit=False)
    torch.testing.assert_close(as_logit, as_prob, rtol=1e-13, atol=1e-14)


# ---- the recurrence against an independent K x V formulation ----

def _matrix_form(q, k, v, g_log, beta_prob, scale, S0_kv):
    """Per (sequence, value head) loop with the state as a K x V matrix and explicit Diag."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out = torch.zeros(B, T, HV, V, dtype=f64)
    finals = torch.zeros(B, HV, K, V, dtype=f64)
    for b in range(B):
        for h in range(HV):
            S = S0_kv[b, h].clone()
            hk = h // (HV // H)
            for s in range(T):
                qv = q[b, s, hk] / torch.sqrt(q[b, s, hk] @ q[b, s, hk] + 1e-6) * scale
                kv = k[b, s, hk] / torch.sqrt(k[b, s, hk] @ k[b, s, hk] + 1e-6)
                S = torch.diag(torch.exp(g_log[b, s, h])) @ S
                u = beta_prob[b, s, h] * (v[b, s, h] - S.T @ kv)
                S = S + torch.outer(kv, u)
                out[b, s, h] = S.T @ qv
            finals[b, h] = S
    return out, finals


def test_recurrence_matches_matrix_form_grouped_heads():
    B, T, H, HV, K, V = 2, 6, 2, 4, 5, 3
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(B, T, H, K, generator=gen, dtype=f64), torch.randn(B, T, H, K, generator=gen, dtype=f64)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=f64)
    g_log = -0.5 * torch.rand(B, T, HV, K, generator=gen, dtype=f64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=f64)
    S0_kv = torch.randn(B, HV, K, V, generator=gen, dtype=f64)
    out, final, _ = kda_recurrent(q, k, v, g_log, beta, gate="log", beta_is_logit=False, scale=0.7,
                                  initial_state=S0_kv.transpose(-1, -2).contiguous())
    ref_out, ref_final_kv = _matrix_form(q, k, v, g_log, beta, 0.7, S0_kv)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, ref_final_kv.transpose(-1, -2), rtol=1e-12, atol=1e-12)


def test_grouped_heads_equal_explicit_repetition():
    x = random_prefill(1, 9, 2, 4, 4, 3, seed=6)               # HV = 2H
    grouped, gfinal, _ = kda_recurrent(**x)
    rep = dict(x, q=x["q"].repeat_interleave(2, dim=2), k=x["k"].repeat_interleave(2, dim=2))
    expanded, efinal, _ = kda_recurrent(**rep)
    torch.testing.assert_close(grouped, expanded, rtol=0, atol=1e-14)
    torch.testing.assert_close(gfinal, efinal, rtol=0, atol=1e-14)
    # the other plausible mapping (hv % H) must give something else
    tiled = dict(x, q=x["q"].repeat(1, 1, 2, 1), k=x["k"].repeat(1, 1, 2, 1))
    assert not torch.allclose(grouped, kda_recurrent(**tiled)[0])


# ---- sequences, states, checkpoints ----

def test_batch_rows_equal_packed_sequences():
    x = random_prefill(2, 7, 1, 2, 4, 3, seed=7)
    S0 = torch.randn(2, 2, 3, 4, dtype=f64)
    out_b, fin_b, _ = kda_recurrent(**x, initial_state=S0)
    packed = {n: (a.reshape(1, 14, *a.shape[2:]) if n in "q k v g beta".split() else a)
              for n, a in x.items()}
    out_p, fin_p, _ = kda_recurrent(**packed, initial_state=S0, cu_seqlens=torch.tensor([0, 7, 14]))
    torch.testing.assert_close(out_p.reshape(2, 7, 2, 3), out_b, rtol=0, atol=0)
    torch.testing.assert_close(fin_p, fin_b, rtol=0, atol=0)
    # sequences must not leak into each other: the second alone from its own state
    alone, _, _ = kda_recurrent(**{n: (a[1:] if n in "q k v g beta".split() else a) for n, a in x.items()},
                                initial_state=S0[1:])
    torch.testing.assert_close(out_p[0, 7:], alone[0], rtol=0, atol=1e-15)


def test_checkpoints_are_final_states_of_prefixes():
    x = random_prefill(1, 30, 1, 2, 4, 3, seed=8)
    cu = [0, 5, 5, 17, 30]                                     # lengths 5, 0, 12, 13
    S0 = torch.randn(4, 2, 3, 4, dtype=f64)
    _, final, ckpt = kda_recurrent(**x, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                   initial_state=S0, checkpoint_every=4)
    assert ckpt.shape == (4, 3, 2, 3, 4)                       # C = max(5, 0, 12, 13) // 4 = 3
    for n in range(4):
        start, length = cu[n], cu[n + 1] - cu[n]
        for c in range(3):
            if c < length // 4:
                end = start + 4 * (c + 1)
                pre = {m: (a[:, start:end] if m in "q k v g beta".split() else a) for m, a in x.items()}
                _, pre_final, _ = kda_recurrent(**pre, initial_state=S0[n:n + 1])
                torch.testing.assert_close(ckpt[n, c], pre_final[0], rtol=0, atol=1e-14)
            else:
                assert torch.isnan(ckpt[n, c]).all()
    torch.testing.assert_close(final[1], S0[1], rtol=0, atol=0)   # empty sequence: state passes through
    assert kda_recurrent(**x)[2] is None


def test_initial_state_dense_equals_pool():
    x = random_prefill(1, 12, 1, 2, 5, 3, seed=9)
    cu = torch.tensor([0, 4, 4, 12])
    pool = torch.randn(6, 2, 3, 5, dtype=f64)
    idx = torch.tensor([3, 0, 1], dtype=torch.int32)
    out_d, fin_d, _ = kda_recurrent(**x, cu_seqlens=cu, initial_state=pool[idx.long()].clone())
    out_p, new_pool, _ = kda_recurrent(**x, cu_seqlens=cu, initial_state=pool, state_indices=idx)
    torch.testing.assert_close(out_p, out_d, rtol=0, atol=0)
    torch.testing.assert_close(new_pool[idx.long()], fin_d, rtol=0, atol=0)
    for s in (2, 4, 5):
        assert torch.equal(new_pool[s], pool[s])               # untouched slots bitwise equal
    assert not torch.equal(new_pool[3], pool[3])


@pytest.mark.parametrize("null_slot0", [False, True])
def test_pool_padding_sequence_starts_from_zero_and_writes_nothing(null_slot0):
    x = random_prefill(1, 10, 1, 1, 4, 3, seed=10)
    cu = torch.tensor([0, 6, 10])
    pool = torch.randn(3, 1, 3, 4, dtype=f64).bfloat16()       # a bf16 pool stays bf16
    pad = 0 if null_slot0 else -1
    idx = torch.tensor([2, pad], dtype=torch.int32)
    out, new_pool, _ = kda_recurrent(**x, cu_seqlens=cu, initial_state=pool, state_indices=idx,
                                     null_slot0=null_slot0)
    dense = torch.stack([pool[2].double(), torch.zeros(1, 3, 4, dtype=f64)])
    out_d, fin_d, _ = kda_recurrent(**x, cu_seqlens=cu, initial_state=dense)
    torch.testing.assert_close(out, out_d, rtol=0, atol=0)
    assert out[0, 6:].abs().max() > 0                          # padded sequence still has output
    assert new_pool.dtype == torch.bfloat16
    assert torch.equal(new_pool[2], fin_d[0].bfloat16())
    assert torch.equal(new_pool[:2], pool[:2])


def test_bf16_inputs_are_upcast_not_computed_in_bf16():
    x = random_prefill(1, 8, 1, 1, 4, 3, seed=11)
    low = {n: a.bfloat16() for n, a in x.items()}
    got, _, _ = kda_recurrent(**low)
    want, _, _ = kda_recurrent(**{n: a.double() for n, a in low.items()})
    assert got.dtype == f64
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_argument_errors():
    x = random_prefill(2, 4, 1, 1, 4, 3, seed=12)
    with pytest.raises(ValueError, match="batch"):
        kda_recurrent(**x, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="one sequence"):
        kda_recurrent(**x, initial_state=torch.zeros(4, 1, 3, 4, dtype=f64),
                      state_indices=torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="initial_state"):
        kda_recurrent(**x, initial_state=torch.zeros(2, 1, 4, 3, dtype=f64))   # [K, V] swapped
    y = random_prefill(1, 4, 3, 4, 4, 3, seed=13)
    with pytest.raises(ValueError, match="multiple"):
        kda_recurrent(**y)
