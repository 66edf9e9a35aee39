"""Edges of a bad-input campaign on the CPU backend (each failed, or was silently wrong, before):
errors name the argument the caller got wrong and are of the documented kind; inference-only
rules; T = 0; pool prefill without a final state; max_seqlen for unpacked input; outputs that
overlap inputs or the state pool. The cold / warm agreement of all of these is in
tests/test_fast_path_differential.py."""
from __future__ import annotations

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext import ops, reference, validation

H, HV, K, V, SLOTS, ROWS = 2, 4, 8, 16, 6, 3


@pytest.fixture(autouse=True)
def fresh_paths():
    ops.clear_call_caches()
    for f in (validation.check_kda_decode, validation.check_fused_kda_decode, validation.check_kda_prefill):
        f.cache_clear()
    yield
    ops.clear_call_caches()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def decode_args(gen, dtype=torch.bfloat16):
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    return dict(q=r(ROWS, H, K), k=r(ROWS, H, K), v=r(ROWS, HV, V), g=r(ROWS, HV, K), beta=r(ROWS, HV),
                state=torch.randn(SLOTS, HV, V, K, generator=gen), state_indices=torch.tensor([4, 0, 2], dtype=torch.int32),
                A_log=torch.randn(HV, generator=gen) * 0.3, dt_bias=torch.randn(HV * K, generator=gen) * 0.5)


def decode(a, **kw):
    a = dict(a, **kw)
    return fk.kda_decode(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a)


def prefill_args(gen, B=2, T=5):
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
                A_log=torch.randn(HV, generator=gen) * 0.3, dt_bias=torch.randn(HV, K, generator=gen) * 0.5,
                initial_state=torch.randn(B, HV, V, K, generator=gen))


def prefill(a, **kw):
    a = dict(a, **kw)
    return fk.kda_prefill(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a)


def fused_args(gen, D=8, Hf=3):
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    C = 3 * Hf * D
    return dict(x=r(ROWS, C), conv_weight=r(C, 4), conv_state=r(SLOTS, C, 3), g=r(ROWS, Hf, D), beta=r(ROWS, Hf),
                A_log=torch.randn(Hf, generator=gen) * 0.3, dt_bias=torch.randn(Hf * D, generator=gen) * 0.5,
                state_indices=torch.tensor([1, 5, 3], dtype=torch.int32), state=torch.randn(SLOTS, Hf, D, D, generator=gen),
                output_gate=r(ROWS, Hf, D), norm_weight=torch.rand(D, generator=gen) + 0.5)


def fused(a, **kw):
    pos = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices", "state",
           "output_gate", "norm_weight")
    return fk.fused_kda_decode(*(a[n] for n in pos), **kw)


# --- item 10: the message blames the argument the caller got wrong, with the documented kind ---

def test_integer_q_is_blamed_on_q(gen):
    a = decode_args(gen)
    with pytest.raises(ValueError, match=r"^q: expected a floating-point dtype .* got int32"):
        decode(a, q=a["q"].to(torch.int32))
    p = prefill_args(gen)
    with pytest.raises(ValueError, match=r"^q: expected a floating-point dtype"):
        prefill(p, q=p["q"].to(torch.int32))


def test_integer_x_is_blamed_on_x(gen):
    a = fused_args(gen)
    a["x"] = a["x"].to(torch.int32)
    with pytest.raises(ValueError, match=r"^x: expected a floating-point dtype .* got int32"):
        fused(a)


def test_unsupported_initial_state_dtype_is_blamed_on_initial_state(gen):
    p = prefill_args(gen)
    with pytest.raises(ValueError, match=r"^initial_state: expected dtype in .*float16"):
        prefill(p, initial_state=p["initial_state"].half())
    with pytest.raises(ValueError, match=r"^checkpoints: expected dtype in .*float16"):
        prefill(p, initial_state=None, output_final_state=False, checkpoint_every=2,
                checkpoints=torch.zeros(2, 2, HV, V, K, dtype=torch.float16))


@pytest.mark.parametrize("kw,name", [(dict(checkpoint_every=4.0), "checkpoint_every"),
                                     (dict(max_seqlen=5.0), "max_seqlen"), (dict(scale="0.3"), "scale")])
def test_prefill_scalar_of_the_wrong_kind_is_a_type_error(gen, kw, name):
    with pytest.raises(TypeError, match=rf"^{name}: expected"):
        prefill(prefill_args(gen), **kw)


def test_norm_eps_of_the_wrong_kind_is_a_type_error(gen):
    with pytest.raises(TypeError, match=r"^norm_eps: expected a float"):
        fused(fused_args(gen), norm_eps="1e-5")


# --- item 11: inference only -----------------------------------------------------------------

def test_tensors_that_require_grad_are_refused_unless_grad_is_disabled(gen):
    a = decode_args(gen)
    a["A_log"] = a["A_log"].clone().requires_grad_(True)
    state0 = a["state"].clone()
    with pytest.raises(ValueError, match=r"^A_log: requires grad, but the ops are inference-only"):
        decode(a)
    assert torch.equal(a["state"], state0)
    leaf = a["state"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"^state: requires grad"):
        decode(dict(a, A_log=a["A_log"].detach()), state=leaf)
    with torch.no_grad():  # grad disabled: accepted, and equal to the detached call
        out = decode(a)
    want = decode(dict(a, A_log=a["A_log"].detach(), state=state0.clone()))
    assert torch.equal(out, want)


def test_inference_state_is_written_only_in_inference_mode(gen):
    a = decode_args(gen)
    with torch.inference_mode():
        a["state"] = a["state"].clone()
    state0 = a["state"].clone()
    with pytest.raises(ValueError, match=r"^state: an inference tensor .* outside inference mode"):
        decode(a)
    assert torch.equal(a["state"], state0)
    with torch.inference_mode():
        decode(a)
    assert not torch.equal(a["state"], state0)


# --- items 4, 5: meta tensors and lazy negated views --------------------------------------------

def test_meta_and_negated_tensors_get_a_clear_error(gen):
    a = decode_args(gen)
    for _ in range(2):  # cold, then once a valid call armed the fast path
        with pytest.raises(ValueError, match=r"expected a tensor on a CPU or CUDA device, got meta"):
            decode(dict(a, q=a["q"].to("meta"), k=a["k"].to("meta"), v=a["v"].to("meta"),
                        g=a["g"].to("meta"), beta=a["beta"].to("meta")))
        with pytest.raises(ValueError, match=r"^state: expected a tensor on cpu"):
            decode(a, state=a["state"].to("meta"))
        with pytest.raises(ValueError, match=r"^q: expected a tensor without the negative bit"):
            decode(a, q=torch._neg_view(a["q"].neg()))
        decode(dict(a, state=a["state"].clone()))


# --- item 6: T = 0 without cu_seqlens ---------------------------------------------------------

def test_prefill_with_no_tokens_returns_the_initial_state(gen):
    p = prefill_args(gen, B=3, T=0)
    for _ in range(2):
        out, final = prefill(p)
        assert out.shape == (3, 0, HV, V)
        assert torch.equal(final, p["initial_state"]) and final is not p["initial_state"]


# --- item 7: pool prefill without a final state ------------------------------------------------

def test_pool_prefill_without_final_state_matches_the_reference(gen):
    p = prefill_args(gen)
    del p["initial_state"]
    pool = torch.randn(SLOTS, HV, V, K, generator=gen)
    idx = torch.tensor([5, 1], dtype=torch.int32)
    got_pool = pool.clone()
    out, final = prefill(p, state=got_pool, state_indices=idx, output_final_state=False)
    assert final is None and torch.equal(got_pool, pool)
    ref_out, ref_final, _ = reference.kda_recurrent(*(p[n] for n in ("q", "k", "v", "g", "beta")),
                                                    A_log=p["A_log"], dt_bias=p["dt_bias"], initial_state=pool,
                                                    state_indices=idx, output_final_state=False)
    assert ref_final is None
    torch.testing.assert_close(out.double(), ref_out.double(), rtol=1e-2, atol=1e-2)


# --- item 9: max_seqlen of unpacked input -------------------------------------------------------

def test_unpacked_max_seqlen_must_be_t(gen):
    p = prefill_args(gen, T=5)
    with pytest.raises(ValueError, match=r"^max_seqlen: expected T = 5"):
        prefill(p, max_seqlen=4, checkpoint_every=2)
    out, final, ck = prefill(p, max_seqlen=5, checkpoint_every=2)
    assert ck.shape[1] == 2


# --- item 8: outputs apart from inputs and the state pool ----------------------------------------

def test_out_overlapping_the_pool_or_an_input_is_refused(gen):
    a = decode_args(gen)
    inside = a["state"].view(-1).view(torch.bfloat16)[: ROWS * HV * V].view(ROWS, HV, V)
    for _ in range(2):
        state0 = a["state"].clone()
        with pytest.raises(ValueError, match=r"^out: overlaps the memory of state"):
            decode(a, out=inside)
        assert torch.equal(a["state"], state0)
        with pytest.raises(ValueError, match=r"^out: overlaps the memory of v"):
            decode(a, out=a["v"])
        decode(dict(a, state=a["state"].clone()))
    f = fused_args(gen)
    with pytest.raises(ValueError, match=r"^out: overlaps the memory of output_gate"):
        fused(f, out=f["output_gate"])
    p = prefill_args(gen)
    with pytest.raises(ValueError, match=r"^final_state: overlaps the memory of initial_state"):
        prefill(p, final_state=p["initial_state"].view(-1)[1:].reshape(-1)[: p["initial_state"].numel() - 8]
                .new_empty(0).set_(p["initial_state"].untyped_storage(), 4, p["initial_state"].shape))
    # the identical view is a dense state updated in place: allowed
    init = p["initial_state"].clone()
    _, final = prefill(p, initial_state=init, final_state=init)
    _, want = prefill(p)
    assert final is init and torch.equal(init, want)
