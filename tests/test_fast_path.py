"""The ops' fast path (flashkda_ext/fast_path.py, csrc/common/binding.h "Call signatures"), on the CPU
backend: after one call is validated in full, a call with the same metadata skips Python validation
and goes to the module's signature-checked function, which launches only on the validated signature.
Checked here: the fast path is taken (validation replaced by a tripwire) and gives the reference's
results on fresh inputs; any change a full check would reject still reaches the full check, with
nothing written; the checked function computes signatures without launching; tracing sees every call."""
import json
import random

import pytest
import torch

import flashkda_ext
from flashkda_ext import fast_path, jit, ops, trace, validation
from flashkda_ext.reference import fused_kda_decode_step, kda_decode_step, kda_recurrent

ROWS, H, HV, K, V, SLOTS = 3, 2, 4, 8, 8, 6


@pytest.fixture(autouse=True)
def fresh_paths():
    """No fast entry or validation verdict leaks between tests."""
    ops.clear_call_caches()
    yield
    ops.clear_call_caches()


def gen():
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def decode_inputs(g, rows=ROWS, state_dtype=torch.float32):
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    return dict(q=r(rows, H, K), k=r(rows, H, K), v=r(rows, HV, V), g=r(rows, HV, K), beta=r(rows, HV),
                state=(torch.randn(SLOTS, HV, V, K, generator=g) * 0.5).to(state_dtype),
                state_indices=torch.randperm(SLOTS, generator=g)[:rows].to(torch.int32),
                A_log=torch.randn(HV, generator=g) * 0.3, dt_bias=torch.randn(HV * K, generator=g) * 0.5)


def run_decode(a, out=None, **kw):
    return flashkda_ext.kda_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"],
                                   state_indices=a["state_indices"], A_log=a["A_log"], dt_bias=a["dt_bias"],
                                   out=out, **kw)


def check_decode(a, state0, out, seed):
    want_out, want_state = kda_decode_step(a["q"], a["k"], a["v"], a["g"], a["beta"], state=state0,
                                           state_indices=a["state_indices"], gate="softplus",
                                           A_log=a["A_log"], dt_bias=a["dt_bias"])
    tol = dict(rtol=6e-3, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(a["state"].double(), want_state.double(), **tol)


def tripwire(*args, **kwargs):
    raise AssertionError("the full validation ran: the fast path was not taken")


@pytest.mark.parametrize("given_out", [False, True])
def test_decode_fast_path_is_taken_and_matches_the_reference(given_out, monkeypatch):
    g, seed = gen()
    first = decode_inputs(g)
    run_decode(first)  # validated in full; leaves the fast entry
    monkeypatch.setattr(ops.validation, "check_kda_decode", tripwire)
    for _ in range(3):  # fresh data, same metadata: every call takes the fast path
        a = decode_inputs(g)
        state0 = a["state"].clone()
        out = torch.full((ROWS, HV, V), float("nan"), dtype=torch.bfloat16) if given_out else None
        got = run_decode(a, out=out)
        if given_out:
            assert got is out
        assert not got.isnan().any()
        check_decode(a, state0, got, seed)


def test_decode_fast_path_keeps_one_entry_per_row_count(monkeypatch):
    g, seed = gen()
    for rows in (1, ROWS):
        run_decode(decode_inputs(g, rows=rows))
    monkeypatch.setattr(ops.validation, "check_kda_decode", tripwire)
    for rows in (ROWS, 1, ROWS):
        a = decode_inputs(g, rows=rows)
        state0 = a["state"].clone()
        check_decode(a, state0, run_decode(a), seed)


def _noncontiguous_q(a):
    return dict(a, q=a["q"].transpose(1, 2).contiguous().transpose(1, 2))  # same shape, other strides


@pytest.mark.parametrize("change,match", [
    (_noncontiguous_q, "contiguous"),
    (lambda a: dict(a, state=a["state"].to(torch.float16)), "state"),           # same shape, other dtype
    (lambda a: dict(a, state_indices=a["state_indices"].long()), "state_indices"),
    (lambda a: dict(a, dt_bias=a["dt_bias"][:-1]), "dt_bias"),
    (lambda a: dict(a, A_log=None), "A_log"),                                     # softplus needs it
])
def test_decode_changed_metadata_reaches_the_full_check_and_writes_nothing(change, match):
    g, _ = gen()
    run_decode(decode_inputs(g))  # the fast entry for this key
    bad = change(decode_inputs(g))
    state0 = bad["state"].clone()
    out = torch.full((ROWS, HV, V), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        run_decode(bad, out=out)
    assert out.isnan().all()
    assert torch.equal(bad["state"], state0)


def test_decode_wrong_out_reaches_the_full_check():
    g, _ = gen()
    a = decode_inputs(g)
    run_decode(a, out=torch.empty(ROWS, HV, V, dtype=torch.bfloat16))
    state0 = a["state"].clone()
    with pytest.raises(ValueError, match="out"):
        run_decode(a, out=torch.empty(ROWS, HV, V, dtype=torch.float32))
    with pytest.raises(ValueError, match="out"):
        run_decode(a, out=torch.empty(ROWS, V, HV, dtype=torch.bfloat16).transpose(1, 2))
    assert torch.equal(a["state"], state0)


def test_checked_function_signature_without_launch():
    g, _ = gen()
    a = decode_inputs(g)
    fn = jit.load_module("cpu_kda_decode")["kda_decode_checked"]
    out = torch.full((ROWS, HV, V), float("nan"), dtype=torch.bfloat16)
    state0 = a["state"].clone()
    args = lambda x: (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["state"],  # noqa: E731
                      x["state_indices"], out, 0, 0.0, K ** -0.5, True, False)
    sig = fn(0, *args(a))
    assert sig != 0 and sig & 1
    assert out.isnan().all() and torch.equal(a["state"], state0)        # 0 never matches: no launch
    assert fn(sig ^ 2, *args(a)) == sig                                   # a wrong one: no launch either
    assert out.isnan().all() and torch.equal(a["state"], state0)
    assert fn(0, *args(decode_inputs(g))) == sig                          # other data, same metadata
    for other in (_noncontiguous_q(a), dict(a, A_log=None), dict(a, v=a["v"][:, :, :V - 1])):
        assert fn(0, *args(other)) != sig
    assert fn(sig, *args(a)) == sig                                       # the matching one launches
    assert not out.isnan().any() and not torch.equal(a["state"], state0)


def test_tracing_records_every_call_past_a_fast_entry(tmp_path):
    g, _ = gen()
    run_decode(decode_inputs(g))
    with trace.tracing(tmp_path):
        for _ in range(2):
            run_decode(decode_inputs(g))
    lines = [ln for p in (tmp_path / "workloads").rglob("*.jsonl") for ln in p.read_text().splitlines()]
    assert len(lines) == 2
    assert all(json.loads(ln) for ln in lines)


def fused_inputs(g, rows=ROWS):
    D, C = K, 3 * H * K
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    return dict(x=r(rows, C), conv_weight=r(C, 4, scale=0.5), conv_state=r(SLOTS, C, 3), g=r(rows, H, D),
                beta=r(rows, H), A_log=r(H, scale=0.3), dt_bias=r(H * D, scale=0.5),
                state_indices=torch.randperm(SLOTS, generator=g)[:rows].to(torch.int32),
                state=r(SLOTS, H, D, D, scale=0.5), output_gate=r(rows, H, D), norm_weight=r(D).abs() + 0.5)


FUSED_ORDER = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices", "state",
               "output_gate", "norm_weight")


def test_fused_fast_path_is_taken_and_matches_the_reference(monkeypatch):
    g, seed = gen()
    flashkda_ext.fused_kda_decode(*(fused_inputs(g)[n] for n in FUSED_ORDER))
    monkeypatch.setattr(ops.validation, "check_fused_kda_decode", tripwire)
    for _ in range(2):
        a = fused_inputs(g)
        conv0, state0 = a["conv_state"].clone(), a["state"].clone()
        got = flashkda_ext.fused_kda_decode(*(a[n] for n in FUSED_ORDER))
        want_out, want_conv, want_state = fused_kda_decode_step(
            *(dict(a, conv_state=conv0, state=state0)[n] for n in FUSED_ORDER), gate="softplus")
        tol = dict(rtol=2e-6, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
        torch.testing.assert_close(got.double(), want_out, **tol)
        torch.testing.assert_close(a["conv_state"].double(), want_conv.double(), **tol)
        torch.testing.assert_close(a["state"].double(), want_state.double(), **tol)


def test_fused_changed_metadata_reaches_the_full_check_and_writes_nothing():
    g, _ = gen()
    flashkda_ext.fused_kda_decode(*(fused_inputs(g)[n] for n in FUSED_ORDER))
    a = fused_inputs(g)
    # same shape, width-major with a gap between its taps: a layout the op does not read
    cs = a["conv_state"]
    wide = torch.zeros(cs.shape[0], cs.shape[2], cs.shape[1] + 8, dtype=cs.dtype)
    a["conv_state"] = wide[:, :, :cs.shape[1]].transpose(1, 2)
    a["conv_state"].copy_(cs)
    conv0, state0 = a["conv_state"].clone(), a["state"].clone()
    with pytest.raises(ValueError, match="conv_state"):
        flashkda_ext.fused_kda_decode(*(a[n] for n in FUSED_ORDER))
    assert torch.equal(a["conv_state"], conv0) and torch.equal(a["state"], state0)


def test_fast_path_off_checks_every_call(monkeypatch):
    """FLASHKDA_EXT_FAST_PATH=0 (fast_path.ENABLED False): every call runs the full validation."""
    monkeypatch.setattr(fast_path, "ENABLED", False)
    seen = []
    full = validation.check_kda_decode

    def counting(*args, **kwargs):
        seen.append(1)
        return full(*args, **kwargs)
    monkeypatch.setattr(ops.validation, "check_kda_decode", counting)
    g, seed = gen()
    for _ in range(3):
        a = decode_inputs(g)
        state0 = a["state"].clone()
        check_decode(a, state0, run_decode(a), seed)
    assert len(seen) == 3 and fast_path.size() == 0


def prefill_inputs(g, B=2, T=6, pool=False):
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    a = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=r(HV, scale=0.3), dt_bias=r(HV * K, scale=0.5))
    if pool:
        a.update(state=r(SLOTS, HV, V, K, scale=0.5),
                 state_indices=torch.randperm(SLOTS, generator=g)[:B].to(torch.int32))
    else:
        a["initial_state"] = r(B, HV, V, K, scale=0.5)
    return a


def check_prefill(a, got, seed, state0=None, checkpoint_every=0):
    B, T = a["q"].shape[:2]
    cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32)
    flat = {n: a[n].reshape((1, B * T) + tuple(a[n].shape[2:])) for n in ("q", "k", "v", "g", "beta")}
    init = state0[a["state_indices"].long()] if state0 is not None else a["initial_state"]
    want = kda_recurrent(**flat, A_log=a["A_log"], dt_bias=a["dt_bias"], cu_seqlens=cu, initial_state=init,
                         checkpoint_every=checkpoint_every)
    tol = dict(rtol=2e-6, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(got[0].reshape(1, B * T, HV, V).double(), want[0], **tol)
    final = got[1][a["state_indices"].long()] if state0 is not None else got[1]
    torch.testing.assert_close(final.double(), want[1], **tol)
    if checkpoint_every:
        m = ~torch.isnan(want[2])
        assert torch.equal(torch.isnan(got[2]), torch.isnan(want[2]))
        torch.testing.assert_close(got[2].double()[m], want[2][m], **tol)


@pytest.mark.parametrize("pool,checkpoint_every", [(False, 0), (False, 2), (True, 0)])
def test_prefill_fast_path_is_taken_and_matches_the_reference(pool, checkpoint_every, monkeypatch):
    g, seed = gen()
    flashkda_ext.kda_prefill(**prefill_inputs(g, pool=pool), checkpoint_every=checkpoint_every)
    monkeypatch.setattr(ops.validation, "check_kda_prefill", tripwire)
    for _ in range(2):  # fresh data, same metadata; outputs allocated by the fast path
        a = prefill_inputs(g, pool=pool)
        state0 = a["state"].clone() if pool else None
        check_prefill(a, flashkda_ext.kda_prefill(**a, checkpoint_every=checkpoint_every), seed, state0,
                      checkpoint_every)


def test_prefill_host_offsets_are_checked_on_every_call(monkeypatch):
    """cu_seqlens on the CPU: its values are validated each call, so no fast path."""
    g, _ = gen()
    a = prefill_inputs(g, B=1, T=10)
    a["initial_state"] = a["initial_state"].expand(2, -1, -1, -1).contiguous()
    flashkda_ext.kda_prefill(**a, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        flashkda_ext.kda_prefill(**a, cu_seqlens=torch.tensor([0, 7, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="0 to T"):
        flashkda_ext.kda_prefill(**a, cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))


def test_prefill_changed_metadata_reaches_the_full_check_and_writes_nothing():
    g, _ = gen()
    flashkda_ext.kda_prefill(**prefill_inputs(g))
    a = prefill_inputs(g)
    a["initial_state"] = a["initial_state"].transpose(2, 3).contiguous().transpose(2, 3)  # same shape
    out = torch.full(a["v"].shape, float("nan"))
    with pytest.raises(ValueError, match="initial_state"):
        flashkda_ext.kda_prefill(**a, out=out)
    assert out.isnan().all()
