"""The chunked (WY/UT) reference equals the token recurrence in float64, for any chunk size."""
import pytest
import torch

from flashkda_ext.reference import kda_chunked, kda_recurrent

f64 = torch.float64


def random_packed(lengths, H, HV, K, V, gate, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=f64)
    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
             gate=gate, cu_seqlens=torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64))
    if gate == "softplus":
        x.update(A_log=torch.log(0.05 + 0.3 * torch.rand(HV, generator=gen, dtype=f64)), dt_bias=0.5 * r(HV * K))
    elif gate == "bounded":
        x.update(A_log=0.3 * r(HV), dt_bias=r(HV, K), lower_bound=-3.0)
    else:
        x["g"] = -0.3 * torch.rand(1, T, HV, K, generator=gen, dtype=f64)
    return x


def assert_same(a, b):
    out_a, fin_a, ck_a = a
    out_b, fin_b, ck_b = b
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=1e-10)
    torch.testing.assert_close(fin_a, fin_b, rtol=0, atol=1e-10)
    if ck_a is None:
        assert ck_b is None
    else:
        assert ck_a.shape == ck_b.shape
        assert torch.equal(torch.isnan(ck_a), torch.isnan(ck_b))
        torch.testing.assert_close(ck_a.nan_to_num(), ck_b.nan_to_num(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
def test_chunked_equals_recurrent_ragged(chunk, gate):
    lengths = [1, chunk - 1, chunk + 1, 0, 2 * chunk + 3]      # ragged tails, an empty sequence
    x = random_packed(lengths, H=1, HV=2, K=6, V=4, gate=gate, seed=chunk)
    S0 = torch.randn(len(lengths), 2, 4, 6, dtype=f64)
    every = 2 * chunk
    rec = kda_recurrent(**x, initial_state=S0, checkpoint_every=every)
    chk = kda_chunked(**x, initial_state=S0, checkpoint_every=every, chunk_size=chunk)
    assert rec[0].abs().max() > 0.1 and rec[2].shape[1] == (2 * chunk + 3) // every
    assert_same(chk, rec)


def test_chunked_pool_mode_and_grouped_heads():
    x = random_packed([5, 9, 0], H=2, HV=4, K=3, V=5, gate="softplus", seed=7)
    pool = torch.randn(5, 4, 5, 3, dtype=f64)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    rec = kda_recurrent(**x, initial_state=pool, state_indices=idx)
    chk = kda_chunked(**x, initial_state=pool, state_indices=idx, chunk_size=4)
    assert_same(chk, rec)
    for s in (0, 2, 3):
        assert torch.equal(chk[1][s], pool[s])


def test_chunked_survives_very_strong_decay():
    # cumulative log decay reaches about -3000 inside a chunk: the pairwise exp(G_i - G_j) form must
    # neither overflow nor produce NaN, and still match the recurrence
    x = random_packed([70, 64], H=1, HV=1, K=4, V=3, gate="log", seed=8)
    x["g"][..., :2] = -50.0
    rec = kda_recurrent(**x)
    chk = kda_chunked(**x, chunk_size=64)
    assert torch.isfinite(chk[0]).all() and torch.isfinite(chk[1]).all()
    assert_same(chk, rec)


def test_checkpoint_every_must_be_a_multiple_of_the_chunk():
    x = random_packed([8], H=1, HV=1, K=2, V=3, gate="log", seed=9)
    with pytest.raises(ValueError, match="multiple"):
        kda_chunked(**x, chunk_size=4, checkpoint_every=6)
