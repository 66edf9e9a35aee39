"""The piece split's warm-up bound (csrc/prefill/README.md, "Piece split"), in float64 on the reference's
token step (no GPU): a chunk's bound is the sum over its tokens of the largest log2 decay over the keys;
a piece that starts at chunk c_b runs from a zero state from the latest chunk c_s whose bounds up to c_b
sum to <= -24. Each token maps the state S -> S Diag(alpha) (I - beta k k^T) (unit k, beta in (0, 1)), of
operator norm <= max_d alpha[d], so the dropped state reaches c_b attenuated by at least 2^(the bounds'
sum): the zero-started state differs from the true one by at most that times |S(c_s)| (Frobenius).
A bound per key channel (the largest per-channel sum of log decays, as in cuDNN's kda_fused_sm90.cu
comment near kLogEps) is not one once the delta rule mixes channels: the last test shows it."""
import math

import pytest

torch = pytest.importorskip("torch")
from flashkda_ext.reference.gates import gate_log_decay, l2norm  # noqa: E402
from flashkda_ext.reference.step import delta_step  # noqa: E402

C = 64
LOG2E = 1.0 / math.log(2.0)
EPS_LOG2 = -24.0


def chunk_bounds(g):
    """g [T, HV, K] log decays (nats) -> per chunk and head the sum over tokens of max over keys, log2."""
    T, HV, _ = g.shape
    per_token = g.max(dim=-1).values * LOG2E                       # [T, HV]
    nch = -(-T // C)
    pad = torch.zeros(nch * C - T, HV, dtype=g.dtype)
    return torch.cat([per_token, pad]).view(nch, C, HV).sum(1)    # [nch, HV]


def walk(bounds, cb):
    """The kernel's piece_start: the first chunk of the warm-up before chunk cb (0: from the initial state)."""
    total = 0.0
    for c in range(cb - 1, -1, -1):
        total += float(bounds[c])
        if total <= EPS_LOG2:
            return c
    return 0


def run(S, k, v, g, beta, t0, t1):
    for t in range(t0, t1):
        _, S = delta_step(S, k[t], k[t], v[t], g[t], beta[t])
    return S


def inputs(gate, T, HV, K, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    k = l2norm(r(T, HV, K))
    v = r(T, HV, K)
    beta = torch.sigmoid(r(T, HV))
    A_log = torch.rand(HV, generator=gen, dtype=torch.float64) * 0.5 - 1.0
    dt_bias = r(HV * K) * 0.5
    if gate == "log":
        g = -torch.rand(T, HV, K, generator=gen, dtype=torch.float64) * 0.3 - 0.05  # no key without decay
    elif gate == "tight":  # one decay for every key and a weak delta rule: the bound is nearly reached
        g = (-torch.rand(T, HV, 1, generator=gen, dtype=torch.float64) * 0.3 - 0.05).expand(T, HV, K)
        beta = beta * 0.01
    else:
        g = gate_log_decay(r(T, HV, K), gate, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    return k, v, g, beta


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log", "tight"])
def test_zero_started_piece_is_within_the_bound(gate):
    HV, K, nch = 2, 32, 24
    T = nch * C - 17                                   # a partial last chunk
    k, v, g, beta = inputs(gate, T, HV, K, seed=len(gate))
    bounds = chunk_bounds(g)
    S0 = torch.randn(HV, K, K, dtype=torch.float64) * 3.0
    checked = 0
    for cb in range(1, nch):
        cs = walk(bounds[:, 0].tolist(), cb)
        cs = min(cs, walk(bounds[:, 1].tolist(), cb))  # one start for both heads: the earlier (longer warm-up)
        if cs == 0:
            continue                                   # exact: starts from the true initial state
        S_cs = run(S0.clone(), k, v, g, beta, 0, cs * C)
        true = run(S_cs.clone(), k, v, g, beta, cs * C, cb * C)
        zero = run(torch.zeros_like(S0), k, v, g, beta, cs * C, cb * C)
        for h in range(HV):
            att = 2.0 ** float(bounds[cs:cb, h].sum())
            assert att <= 2.0 ** EPS_LOG2
            diff = float((true[h] - zero[h]).norm())
            assert diff <= att * float(S_cs[h].norm()) * (1 + 1e-9), (cb, cs, h, diff, att)
            if gate == "tight":  # and the bound is not loose by more than the weak delta rule's share
                assert diff >= 0.25 * att * float(S_cs[h].norm()), (cb, cs, h, diff, att)
        checked += 1
    assert checked >= nch // 2, f"only {checked} pieces needed a warm-up: the case does not test the bound"


def test_walk_reaches_chunk_zero_when_decays_are_slow():
    k, v, g, beta = inputs("softplus", 8 * C, 1, 16, seed=3)
    bounds = chunk_bounds(g * 1e-9)
    assert all(walk(bounds[:, 0].tolist(), cb) == 0 for cb in range(1, 8))


def test_a_per_channel_bound_is_not_one():
    """Two keys' channels decaying in turn, one fast and one not at each token, with keys mixing them: every
    channel's own log decays sum to far below -24 over a chunk, yet the dropped state survives at ~2^-1 a
    token. The per-token max over keys (~0 here) says no attenuation, which is the truth."""
    K, T = 2, C
    fast = math.log(1e-6)
    g = torch.zeros(T, 1, K, dtype=torch.float64)
    g[0::2, 0, 1] = fast
    g[1::2, 0, 0] = fast
    k = l2norm(torch.ones(T, 1, K, dtype=torch.float64))
    v = torch.zeros(T, 1, K, dtype=torch.float64)
    beta = torch.full((T, 1), 0.99, dtype=torch.float64)
    S0 = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    S = run(S0.clone(), k, v, g, beta, 0, T)           # v = 0: S is the dropped state's image
    per_channel = float((g[:, 0, :].sum(0) * LOG2E).max())
    per_token = float(chunk_bounds(g)[0, 0])
    survived = math.log2(float(S.norm()) / float(S0.norm()))
    assert per_channel < EPS_LOG2 * 10                  # the per-channel "bound" claims < 2^-240
    assert survived > per_channel + 100                 # but far more survives
    assert per_token >= survived - 1e-9                 # the per-token bound holds
