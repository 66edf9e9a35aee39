"""The CPU backend through the real TVM-FFI path (JIT build, load, call from torch and numpy),
against the package reference on fresh random inputs with K != V: every gate, both state dtypes
(and float64), pool rules (padding, repeats, null slot 0, untouched slots), varlen prefill with
empty sequences, dense and pool state, checkpoints, and the fused decode."""
import random

import numpy as np
import pytest
import torch

from flashkda_ext import jit
from flashkda_ext.reference import fused_kda_decode_step, kda_decode_step, kda_recurrent

f64 = torch.float64
GATE_MODE = {"softplus": 0, "bounded": 1, "log": 2}
LOWER_BOUND = -4.0


@pytest.fixture(scope="module")
def mods():
    return {fam: jit.load_module(f"cpu_{fam}") for fam in ("kda_decode", "kda_prefill", "fused_kda_decode")}


def fresh_seed():
    return random.SystemRandom().randrange(2**31)


class Rand:
    """Fresh random tensors; the seed goes into every failure message."""

    def __init__(self):
        self.seed = fresh_seed()
        self.gen = torch.Generator().manual_seed(self.seed)

    def randn(self, *shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=self.gen, dtype=f64) * scale).to(dtype)

    def rand(self, *shape, dtype=torch.float32, lo=0.0, hi=1.0):
        return (lo + (hi - lo) * torch.rand(*shape, generator=self.gen, dtype=f64)).to(dtype)


def gate_inputs(rnd, gate, lead, HV, K, dtype):
    """(g raw, A_log, dt_bias) for a gate; the log gate takes a log decay <= 0 and no parameters."""
    if gate == "log":
        return -rnd.rand(*lead, HV, K, dtype=dtype, lo=0.01, hi=0.7), None, None
    g = rnd.randn(*lead, HV, K, dtype=dtype)
    return g, torch.log(rnd.rand(HV, dtype=f64, lo=0.2, hi=1.5)).float(), rnd.randn(HV * K, scale=0.5)


def tol(dtype):
    """(rtol, atol) for a result stored in `dtype` vs the float64 reference: a little over half an
    ulp for one rounding to nearest even (so truncation fails), a bit more for bf16, whose state
    roundings in a chain of steps may land one ulp apart."""
    return {torch.float64: (1e-10, 1e-10), torch.float32: (2e-6, 1e-6),
            torch.float16: (6e-4, 1e-5), torch.bfloat16: (6e-3, 1e-4)}[dtype]


def assert_close(got, want, dtype, what, seed):
    rtol, atol = tol(dtype)
    torch.testing.assert_close(torch.as_tensor(got).to(f64), want.to(f64), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} (seed {seed}): {m}")


def as_np(t):
    return None if t is None else t.numpy()


# ---------------------------------------------------------------------------------------------
# decode


def decode_case(rnd, gate, in_dtype, rows=7, H=2, HV=4, K=12, V=8, slots=9):
    q = rnd.randn(rows, H, K, dtype=in_dtype)
    k = rnd.randn(rows, H, K, dtype=in_dtype)
    v = rnd.randn(rows, HV, V, dtype=in_dtype)
    beta = rnd.randn(rows, HV, dtype=in_dtype)
    g, A_log, dt_bias = gate_inputs(rnd, gate, (rows,), HV, K, in_dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)


def call_decode(fn, x, pool, idx, out, gate, scale, beta_is_logit, null_slot0, wrap=lambda t: t):
    fn(wrap(x["q"]), wrap(x["k"]), wrap(x["v"]), wrap(x["g"]), wrap(x["beta"]), wrap(x["A_log"]),
       wrap(x["dt_bias"]), pool, wrap(idx), out, GATE_MODE[gate], LOWER_BOUND, scale, beta_is_logit,
       null_slot0)


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("null_slot0", [False, True])
def test_decode_matches_reference(mods, gate, state_dtype, in_dtype, null_slot0):
    rnd = Rand()
    x = decode_case(rnd, gate, in_dtype)
    # padding (-1, -5), a slot used by three rows (applied in row order), slot 0 (null or live),
    # and slots 1, 4, 6, 8 never addressed: they must come back bit-identical
    idx = torch.tensor([3, -1, 0, 3, 5, -5, 3], dtype=torch.int32)[torch.randperm(7, generator=rnd.gen)]
    pool0 = rnd.randn(9, 4, 8, 12, dtype=state_dtype, scale=0.5)
    scale = rnd.rand(1, dtype=f64, lo=0.1, hi=0.5).item()
    pool = pool0.clone()
    out = torch.full((7, 4, 8), float("nan"), dtype=in_dtype)
    call_decode(mods["kda_decode"]["kda_decode"], x, pool, idx, out, gate, scale, True, null_slot0)
    want_out, want_pool = kda_decode_step(
        **x, state=pool0, state_indices=idx, gate=gate, lower_bound=LOWER_BOUND, scale=scale,
        null_slot0=null_slot0)
    assert_close(out, want_out, in_dtype, "out", rnd.seed)
    assert_close(pool, want_pool, state_dtype, "state", rnd.seed)
    pad = (idx < 0) | ((idx == 0) if null_slot0 else torch.zeros_like(idx, dtype=torch.bool))
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), f"padding rows not zero (seed {rnd.seed})"
    untouched = [s for s in range(9) if s not in set(idx.tolist()) or (null_slot0 and s == 0)]
    assert torch.equal(pool[untouched], pool0[untouched]), f"untouched slots changed (seed {rnd.seed})"


@pytest.mark.parametrize("in_dtype,state_dtype", [(torch.float64, torch.float64),
                                                   (torch.float16, torch.float32),
                                                   (torch.float32, torch.float64)])
def test_decode_other_dtypes_and_beta_given(mods, in_dtype, state_dtype):
    rnd = Rand()
    rows = 24  # enough outputs that a rounding that is not to nearest even shows
    x = decode_case(rnd, "bounded", in_dtype, rows=rows, H=1, HV=3, K=10, V=6, slots=6)
    x["beta"] = rnd.rand(rows, 3, dtype=in_dtype, lo=0.05, hi=0.95)  # beta given, not a logit
    x["A_log"] = None                                                  # bounded: A_log optional (= 0)
    idx = torch.randint(-2, 6, (rows,), generator=rnd.gen, dtype=torch.int32)
    pool0 = rnd.randn(6, 3, 6, 10, dtype=state_dtype, scale=0.5)
    pool, out = pool0.clone(), torch.full((rows, 3, 6), float("nan"), dtype=in_dtype)
    call_decode(mods["kda_decode"]["kda_decode"], x, pool, idx, out, "bounded", 0.3, False, False)
    want_out, want_pool = kda_decode_step(**x, state=pool0, state_indices=idx, gate="bounded",
                                          lower_bound=LOWER_BOUND, scale=0.3, beta_is_logit=False)
    assert_close(out, want_out, in_dtype, "out", rnd.seed)
    assert_close(pool, want_pool, state_dtype, "state", rnd.seed)


@pytest.mark.parametrize("gate", ["softplus", "log"])
def test_decode_from_numpy(mods, gate):
    rnd = Rand()
    x = decode_case(rnd, gate, torch.float32, rows=4, H=3, HV=6, K=6, V=10, slots=5)
    idx = torch.tensor([4, 1, -1, 1], dtype=torch.int32)
    pool0 = rnd.randn(5, 6, 10, 6, scale=0.5)
    pool = pool0.numpy().copy()
    out = np.full((4, 6, 10), np.nan, dtype=np.float32)
    call_decode(mods["kda_decode"]["kda_decode"], x, pool, idx, out, gate, 0.25, True, False, wrap=as_np)
    want_out, want_pool = kda_decode_step(**x, state=pool0, state_indices=idx, gate=gate, scale=0.25)
    assert_close(out, want_out, torch.float32, "out", rnd.seed)
    assert_close(pool, want_pool, torch.float32, "state", rnd.seed)


# ---------------------------------------------------------------------------------------------
# prefill


def prefill_case(rnd, gate, in_dtype, T, H=2, HV=4, K=12, V=8):
    q = rnd.randn(1, T, H, K, dtype=in_dtype)
    k = rnd.randn(1, T, H, K, dtype=in_dtype)
    v = rnd.randn(1, T, HV, V, dtype=in_dtype)
    beta = rnd.randn(1, T, HV, dtype=in_dtype)
    g, A_log, dt_bias = gate_inputs(rnd, gate, (1, T), HV, K, in_dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)


def call_prefill(fn, x, cu, init, final, idx, ckpts, out, gate, scale, null_slot0, every, wrap=lambda t: t):
    fn(wrap(x["q"]), wrap(x["k"]), wrap(x["v"]), wrap(x["g"]), wrap(x["beta"]), wrap(x["A_log"]),
       wrap(x["dt_bias"]), wrap(cu), init, final, wrap(idx), ckpts, out, None, GATE_MODE[gate],
       LOWER_BOUND, scale, True, null_slot0, every)


def check_checkpoints(got, want, dtype, seed):
    # entries past a sequence's own count stay as poisoned (NaN), exactly where the reference has NaN
    got = torch.as_tensor(got)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"checkpoint coverage differs (seed {seed})"
    m = ~torch.isnan(want)
    assert_close(got[m], want[m], dtype, "checkpoints", seed)


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_prefill_dense_varlen_matches_reference(mods, gate, state_dtype, cu_dtype):
    rnd = Rand()
    lens = [5, 0, 7, 1, 0, 4]  # empty sequences copy initial to final state
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=cu_dtype)
    T, N = sum(lens), len(lens)
    x = prefill_case(rnd, gate, torch.bfloat16, T)
    init = rnd.randn(N, 4, 8, 12, dtype=state_dtype, scale=0.5)
    init0 = init.clone()
    final = torch.full_like(init, float("nan"))
    every = 2
    ckpts = torch.full((N, 3, 4, 8, 12), float("nan"), dtype=state_dtype)
    out = torch.full((1, T, 4, 8), float("nan"), dtype=torch.bfloat16)
    call_prefill(mods["kda_prefill"]["kda_prefill"], x, cu, init, final, None, ckpts, out, gate, 0.3,
                 False, every)
    want_out, want_final, want_ck = kda_recurrent(
        **x, gate=gate, lower_bound=LOWER_BOUND, scale=0.3, cu_seqlens=cu, initial_state=init0,
        checkpoint_every=every)
    assert torch.equal(init, init0), f"initial_state modified (seed {rnd.seed})"
    assert_close(out, want_out, torch.bfloat16, "out", rnd.seed)
    assert_close(final, want_final, state_dtype, "final_state", rnd.seed)
    check_checkpoints(ckpts, want_ck, state_dtype, rnd.seed)


@pytest.mark.parametrize("null_slot0", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_prefill_pool_in_place(mods, null_slot0, state_dtype):
    rnd = Rand()
    lens = [3, 6, 0, 2]
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)
    T, N, slots = sum(lens), len(lens), 7
    x = prefill_case(rnd, "softplus", torch.float32, T, H=1, HV=2, K=6, V=10)
    # sequence 1 is padding (starts from zeros, writes no state); slot 0 is null or live
    idx = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    pool0 = rnd.randn(slots, 2, 10, 6, dtype=state_dtype, scale=0.5)
    pool = pool0.clone()
    ckpts = torch.full((N, 2, 2, 10, 6), float("nan"), dtype=state_dtype)
    out = torch.full((1, T, 2, 10), float("nan"))
    call_prefill(mods["kda_prefill"]["kda_prefill"], x, cu, pool, pool, idx, ckpts, out, "softplus",
                 0.4, null_slot0, 3)
    want_out, want_pool, want_ck = kda_recurrent(
        **x, gate="softplus", scale=0.4, cu_seqlens=cu, initial_state=pool0, state_indices=idx,
        null_slot0=null_slot0, checkpoint_every=3)
    assert_close(out, want_out, torch.float32, "out", rnd.seed)
    assert_close(pool, want_pool, state_dtype, "pool", rnd.seed)
    check_checkpoints(ckpts, want_ck, state_dtype, rnd.seed)
    live = {4, 2} | (set() if null_slot0 else {0})
    untouched = [s for s in range(slots) if s not in live]
    assert torch.equal(pool[untouched], pool0[untouched]), f"untouched slots changed (seed {rnd.seed})"


def test_prefill_without_initial_state_from_numpy(mods):
    rnd = Rand()
    lens = [4, 0, 9]
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int64)
    T, N = sum(lens), len(lens)
    x = prefill_case(rnd, "bounded", torch.float32, T, H=3, HV=3, K=5, V=7)
    final = np.full((N, 3, 7, 5), np.nan, dtype=np.float32)
    out = np.full((1, T, 3, 7), np.nan, dtype=np.float32)
    call_prefill(mods["kda_prefill"]["kda_prefill"], x, cu, None, final, None, None, out, "bounded",
                 0.5, False, 0, wrap=as_np)
    want_out, want_final, _ = kda_recurrent(**x, gate="bounded", lower_bound=LOWER_BOUND, scale=0.5,
                                            cu_seqlens=cu)
    assert_close(out, want_out, torch.float32, "out", rnd.seed)
    assert_close(final, want_final, torch.float32, "final_state", rnd.seed)
    assert np.all(final[1] == 0), f"empty sequence without initial state: final must be zeros (seed {rnd.seed})"


def test_prefill_float64_end_to_end(mods):
    rnd = Rand()
    cu = torch.tensor([0, 6, 11], dtype=torch.int32)
    x = prefill_case(rnd, "softplus", torch.float64, 11, H=2, HV=2, K=9, V=4)
    init = rnd.randn(2, 2, 4, 9, dtype=f64, scale=0.5)
    final = torch.full_like(init, float("nan"))
    out = torch.full((1, 11, 2, 4), float("nan"), dtype=f64)
    call_prefill(mods["kda_prefill"]["kda_prefill"], x, cu, init, final, None, None, out, "softplus",
                 1 / 3, False, 0)
    want_out, want_final, _ = kda_recurrent(**x, gate="softplus", scale=1 / 3, cu_seqlens=cu,
                                            initial_state=init)
    assert_close(out, want_out, f64, "out", rnd.seed)
    assert_close(final, want_final, f64, "final_state", rnd.seed)


# ---------------------------------------------------------------------------------------------
# fused decode


def fused_case(rnd, gate, dtype, rows, H, D, slots, w_dtype, state_dtype):
    C = 3 * H * D
    x = rnd.randn(rows, C, dtype=dtype)
    conv_weight = rnd.randn(C, 4, dtype=w_dtype, scale=0.5)
    conv_state = rnd.randn(slots, C, 3, dtype=dtype)
    g, A_log, dt_bias = gate_inputs(rnd, gate, (rows,), H, D, dtype)
    beta = rnd.randn(rows, H, dtype=dtype)
    state = rnd.randn(slots, H, D, D, dtype=state_dtype, scale=0.5)
    output_gate = rnd.randn(rows, H, D, dtype=dtype)
    norm_weight = rnd.rand(D, lo=0.5, hi=1.5)
    return dict(x=x, conv_weight=conv_weight, conv_state=conv_state, g=g, beta=beta, A_log=A_log,
                dt_bias=dt_bias, state=state, output_gate=output_gate, norm_weight=norm_weight)


@pytest.mark.parametrize("gate", ["softplus", "bounded", "log"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.float32)])
@pytest.mark.parametrize("null_slot0", [False, True])
def test_fused_decode_matches_reference(mods, gate, state_dtype, dtype, w_dtype, null_slot0):
    rnd = Rand()
    rows, H, D, slots = 6, 2, 8, 7
    a = fused_case(rnd, gate, dtype, rows, H, D, slots, w_dtype, state_dtype)
    idx = torch.tensor([5, 0, -1, 5, 2, 5], dtype=torch.int32)  # slot 5 three times, in row order
    conv0, state0 = a["conv_state"].clone(), a["state"].clone()
    out = torch.full((rows, H, D), float("nan"), dtype=dtype)
    mods["fused_kda_decode"]["fused_kda_decode"](
        a["x"], a["conv_weight"], a["conv_state"], a["g"], a["beta"], a["A_log"], a["dt_bias"], idx,
        a["state"], a["output_gate"], a["norm_weight"], out, GATE_MODE[gate], LOWER_BOUND, 0.35, 1e-5,
        null_slot0)
    want_out, want_conv, want_state = fused_kda_decode_step(
        a["x"], a["conv_weight"], conv0, a["g"], a["beta"], a["A_log"], a["dt_bias"], idx, state0,
        a["output_gate"], a["norm_weight"], gate=gate, lower_bound=LOWER_BOUND, norm_eps=1e-5,
        scale=0.35, null_slot0=null_slot0)
    assert_close(out, want_out, dtype, "out", rnd.seed)
    assert_close(a["conv_state"], want_conv, dtype, "conv_state", rnd.seed)
    assert_close(a["state"], want_state, state_dtype, "state", rnd.seed)
    untouched = [1, 3, 4, 6] + ([0] if null_slot0 else [])
    assert torch.equal(a["state"][untouched], state0[untouched]), f"state slots touched (seed {rnd.seed})"
    assert torch.equal(a["conv_state"][untouched], conv0[untouched]), f"conv slots touched (seed {rnd.seed})"


def test_fused_decode_from_numpy(mods):
    rnd = Rand()
    rows, H, D, slots = 3, 3, 5, 4
    a = fused_case(rnd, "softplus", torch.float32, rows, H, D, slots, torch.float32, torch.float32)
    idx = torch.tensor([1, 3, -1], dtype=torch.int32)
    conv0, state0 = a["conv_state"].clone(), a["state"].clone()
    conv, state = conv0.numpy().copy(), state0.numpy().copy()
    out = np.full((rows, H, D), np.nan, dtype=np.float32)
    mods["fused_kda_decode"]["fused_kda_decode"](
        as_np(a["x"]), as_np(a["conv_weight"]), conv, as_np(a["g"]), as_np(a["beta"]), as_np(a["A_log"]),
        as_np(a["dt_bias"]), as_np(idx), state, as_np(a["output_gate"]), as_np(a["norm_weight"]), out,
        0, 0.0, 0.2, 1e-6, False)
    want_out, want_conv, want_state = fused_kda_decode_step(
        a["x"], a["conv_weight"], conv0, a["g"], a["beta"], a["A_log"], a["dt_bias"], idx, state0,
        a["output_gate"], a["norm_weight"], gate="softplus", norm_eps=1e-6, scale=0.2)
    assert_close(out, want_out, torch.float32, "out", rnd.seed)
    assert_close(conv, want_conv, torch.float32, "conv_state", rnd.seed)
    assert_close(state, want_state, torch.float32, "state", rnd.seed)
