"""Decode on a state pool and the fused decode: one token of prefill, pool rules (padding,
null slot 0, repeated slots, untouched slots), and the fused op against a by-hand composition."""
import math

import pytest
import torch

from flashkda_ext.reference import (causal_conv_update, fused_kda_decode_step, kda_decode_step,
                                    kda_recurrent)

f64 = torch.float64


def random_decode(rows, H, HV, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=f64)
    return dict(q=r(rows, H, K), k=r(rows, H, K), v=r(rows, HV, V), g=r(rows, HV, K), beta=r(rows, HV),
                A_log=torch.log(0.1 + 0.5 * torch.rand(HV, generator=gen, dtype=f64)), dt_bias=r(HV * K))


def test_decode_step_equals_one_token_of_prefill():
    x = random_decode(4, H=2, HV=4, K=5, V=3, seed=1)
    pool = torch.randn(6, 4, 3, 5, dtype=f64)
    idx = torch.tensor([5, 0, 2, 3], dtype=torch.int32)
    out, new_pool = kda_decode_step(**x, state=pool, state_indices=idx)
    # prefill with each row as its own sequence of one token (B = rows, T = 1)
    as_prefill = {n: (a[:, None] if n in "q k v g beta".split() else a) for n, a in x.items()}
    p_out, p_pool, _ = kda_recurrent(**as_prefill, initial_state=pool, state_indices=idx)
    torch.testing.assert_close(out, p_out[:, 0], rtol=0, atol=1e-14)
    torch.testing.assert_close(new_pool, p_pool, rtol=0, atol=1e-14)
    assert torch.equal(new_pool[[1, 4]], pool[[1, 4]])


def test_decode_hand_case_with_a_padding_row():
    # the one-token softplus case of test_reference.py, as decode, plus a padding row
    pool = torch.tensor([[[[9.0, 9.0], [9.0, 9.0], [9.0, 9.0]]], [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]],
                        dtype=f64)
    t = lambda a: torch.tensor(a, dtype=f64)
    out, new_pool = kda_decode_step(
        t([[[0.0, -20.0]], [[1.0, 1.0]]]), t([[[40.0, 30.0]], [[1.0, 1.0]]]),
        t([[[1.0, 1.0, 1.0]], [[5.0, 5.0, 5.0]]]), t([[[0.0, 30.0]], [[0.0, 0.0]]]), t([[0.0], [0.0]]),
        state=pool, state_indices=torch.tensor([1, -1], dtype=torch.int32), gate="softplus",
        A_log=t([math.log(2.0)]), dt_bias=t([0.0, 0.0]), scale=1.0)
    torch.testing.assert_close(out, t([[[-0.24, -0.12, 0.0]], [[0.0, 0.0, 0.0]]]), rtol=0, atol=1e-8)
    torch.testing.assert_close(new_pool[1, 0], t([[0.57, 0.24], [0.91, 0.12], [1.25, 0.0]]), rtol=0, atol=1e-8)
    assert torch.equal(new_pool[0], pool[0])


@pytest.mark.parametrize("null_slot0", [False, True])
def test_decode_padding_rows(null_slot0):
    x = random_decode(4, H=1, HV=2, K=4, V=3, seed=2)
    pool = torch.randn(6, 2, 3, 4, dtype=f64)
    before = pool.clone()
    idx = torch.tensor([2, -1, 5, 0], dtype=torch.int32)
    out, new_pool = kda_decode_step(**x, state=pool, state_indices=idx, null_slot0=null_slot0)
    assert torch.equal(pool, before)                           # the input pool is never modified
    assert torch.all(out[1] == 0) and out[0].abs().max() > 0 and out[2].abs().max() > 0
    touched = {2, 5} | (set() if null_slot0 else {0})
    assert (out[3].abs().max() > 0) != null_slot0
    for s in range(6):
        assert torch.equal(new_pool[s], pool[s]) != (s in touched)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_repeated_slots_apply_in_row_order(pool_dtype):
    x = random_decode(5, H=1, HV=2, K=4, V=3, seed=3)
    pool = torch.randn(4, 2, 3, 4, dtype=f64).to(pool_dtype)
    idx = [1, 3, 1, -1, 1]
    out, new_pool = kda_decode_step(**x, state=pool, state_indices=torch.tensor(idx, dtype=torch.int32))
    # the same rows as five separate calls, each on the pool the previous one returned
    seq_pool, seq_out = pool, []
    for r in range(5):
        row = {n: (a[r:r + 1] if n in "q k v g beta".split() else a) for n, a in x.items()}
        o, seq_pool = kda_decode_step(**row, state=seq_pool, state_indices=torch.tensor([idx[r]], dtype=torch.int32))
        seq_out.append(o)
    # Row order: the float64 outputs agree to the last bits only. The token inputs are normalized in one
    # batch here and one row at a time there, and torch's CPU reductions may round the last bit
    # differently between batch shapes (1.1e-16 measured on one host, bitwise on another); a wrong
    # row order would differ at O(1). The pool is stored in its own dtype: bitwise.
    torch.testing.assert_close(out, torch.cat(seq_out), rtol=0, atol=1e-14)
    assert torch.equal(new_pool, seq_pool) and new_pool.dtype == pool_dtype
    # rows 0, 2, 4 on slot 1 are three tokens of one sequence (exact when nothing rounds between steps)
    if pool_dtype == torch.float32:
        seq = {n: (a[[0, 2, 4]][None] if n in "q k v g beta".split() else a) for n, a in x.items()}
        p_out, p_fin, _ = kda_recurrent(**seq, initial_state=pool[1:2].double())
        torch.testing.assert_close(out[[0, 2, 4]], p_out[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(new_pool[1].double(), p_fin[0], rtol=0, atol=1e-6)


def test_causal_conv_update_by_hand():
    t = lambda a: torch.tensor(a, dtype=f64)
    rows = t([[1.0, 2.0, 3.0], [0.0, -1.0, 2.0]])              # oldest first
    w = t([[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, -1.0, 2.0]])
    y, new_rows = causal_conv_update(t([10.0, 5.0]), w, rows)
    # y0 = .1*1 + .2*2 + .3*3 + .4*10 = 5.4; y1 = 0 + 0 - 2 + 2*5 = 8
    torch.testing.assert_close(y, t([5.4, 8.0]), rtol=0, atol=1e-14)
    assert torch.equal(new_rows, t([[2.0, 3.0, 10.0], [-1.0, 2.0, 5.0]]))


# ---- the fused decode against a composition written out here ----

def _by_hand_fused(x, conv_weight, conv_state, g, beta, A_log, dt_bias, idx, state, output_gate,
                   norm_weight, gate, lower_bound, eps, null_slot0):
    rows, H, D = g.shape
    conv, S_pool = conv_state.clone(), state.clone()
    out = torch.zeros(rows, H, D, dtype=f64)
    for r in range(rows):
        s = int(idx[r])
        if s < 0 or (null_slot0 and s == 0):
            continue
        y = torch.zeros(3 * H * D, dtype=f64)
        for c in range(3 * H * D):
            taps = [conv[s, c, 0], conv[s, c, 1], conv[s, c, 2], x[r, c]]
            y[c] = sum(conv_weight[c, w] * taps[w] for w in range(4))
        conv[s] = torch.stack([conv[s, :, 1], conv[s, :, 2], x[r]], dim=1)
        y = y / (1 + torch.exp(-y))                            # SiLU
        for h in range(H):
            q, k, v = (y[i * H * D + h * D: i * H * D + (h + 1) * D] for i in range(3))
            q = q / torch.sqrt((q * q).sum() + 1e-6) * D ** -0.5
            k = k / torch.sqrt((k * k).sum() + 1e-6)
            a = torch.exp(A_log[h]) if A_log is not None else 1.0
            pre = g[r, h] + (dt_bias[h * D:(h + 1) * D] if dt_bias is not None else 0.0)
            if gate == "softplus":
                decay = torch.exp(-a * torch.log1p(torch.exp(pre)))
            else:
                decay = torch.exp(lower_bound / (1 + torch.exp(-a * pre)))
            b = 1 / (1 + torch.exp(-beta[r, h]))
            S_kv = S_pool[s, h].T                              # K x V
            S_kv = decay[:, None] * S_kv
            S_kv = S_kv + b * torch.outer(k, v - S_kv.T @ k)
            o = S_kv.T @ q
            S_pool[s, h] = S_kv.T
            rms = torch.sqrt((o * o).sum() / D + eps)
            out[r, h] = o / rms * norm_weight / (1 + torch.exp(-output_gate[r, h]))
    return out, conv, S_pool


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_fused_decode_equals_composition(gate):
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=f64)
    rows, H, D, slots = 5, 2, 4, 4
    idx = torch.tensor([2, 0, 2, -1, 3], dtype=torch.int32)  # repeat, padding, null slot 0
    args = dict(x=r(rows, 3 * H * D), conv_weight=r(3 * H * D, 4), conv_state=r(slots, 3 * H * D, 3),
                g=r(rows, H, D), beta=r(rows, H), A_log=0.3 * r(H), dt_bias=r(H * D), state_indices=idx,
                state=r(slots, H, D, D), output_gate=r(rows, H, D), norm_weight=r(D))
    if gate == "bounded":
        args["dt_bias"] = None
    lb = -4.0 if gate == "bounded" else None
    out, conv, state = fused_kda_decode_step(**args, gate=gate, lower_bound=lb, norm_eps=1e-5,
                                             null_slot0=True)
    e_out, e_conv, e_state = _by_hand_fused(*args.values(), gate, lb, 1e-5, True)
    torch.testing.assert_close(out, e_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv, e_conv, rtol=0, atol=0)
    torch.testing.assert_close(state, e_state, rtol=1e-12, atol=1e-12)
    assert torch.all(out[[1, 3]] == 0) and out[[0, 2, 4]].abs().min(dim=-1).values.min() > 0
    for s in (0, 1):                                           # null slot 0 and unused slot 1
        assert torch.equal(conv[s], args["conv_state"][s]) and torch.equal(state[s], args["state"][s])


def test_fused_decode_keeps_cache_dtypes():
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen)
    rows, H, D = 2, 1, 4
    out, conv, state = fused_kda_decode_step(
        r(rows, 3 * H * D).bfloat16(), r(3 * H * D, 4), r(3, 3 * H * D, 3).bfloat16(), r(rows, H, D),
        r(rows, H), r(H), r(H * D), torch.tensor([1, 2], dtype=torch.int32), r(3, H, D, D).bfloat16(),
        r(rows, H, D), r(D), gate="softplus", dtype=torch.float32)
    assert out.dtype == torch.float32 and conv.dtype == torch.bfloat16 and state.dtype == torch.bfloat16
    assert torch.isfinite(out).all() and out.abs().max() > 0
