"""Bad-input campaign 26 (CPU backend): tensors read by their element count only, so that a transposed or
otherwise mis-laid-out g / beta / k / A_log / dt_bias / state would be served on scrambled values (the class
campaign 24 found in the SGLang adapter), through fla's adapter, the public ops and the JAX front end. A refused call
names the argument and writes nothing (out poisoned with NaN, the pool, compared bit for bit); a served one equals
the call on the documented layout bitwise. Each case failed before its fix, except those marked "guard".

- fla, fused_recurrent_kda_fwd as a decode batch (1-D ssm_state_indices, vLLM's decode call: kda_decode): k, g and
  beta were reshaped to [rows, H, K] / [rows, HV, K] / [rows, HV] by element count, so g [1, N, K, HV] (K != HV),
  a flat g [1, N, HV*K], beta [HV, N, 1] or k [1, N, K, H] were served on scrambled values, where the verify /
  prefill mappings and the ops refuse them. Now fla's layouts exactly ([B, T, HV, K], [B, T, HV], q's shape), else
  the verifier refuses naming the argument (counted in REASONS; fla runs the call) and the implementation raises
  before anything is written.
- guard, fla: A_log [HV] / [HV, 1] / [1, HV] / [1, 1, HV, 1] and dt_bias [HV*K] / [HV, K] / [1, HV*K] / an [HV, K]
  view with transposed strides are flattened as docs/integrations.md says (logical values, the strides honoured):
  bitwise the call on [HV] / [HV*K], for chunk_kda, decode and verify; a wrong element count is refused naming it.
  fla's other mappings (chunk_kda, verify, dense fused_recurrent) refuse g [.., K, HV], beta [B, HV, T], k
  [.., K, H], a K-first state [.., K, V] and state_v_first=False.
- guard, ops (kda_decode / kda_verify / kda_prefill): A_log only [HV]; dt_bias only [HV*K] or a dense [HV, K]
  ([K, HV], [1, HV*K], a transposed view refused); g [.., K, HV], beta with the heads first refused; at K == HV,
  where the shapes cannot tell, a transposed g / dt_bias view (inner dims not dense) is refused.
- guard, JAX: the same A_log / dt_bias / g / beta / state shapes refused naming them (after a served call), the pool
  neither consumed nor changed; dt_bias [HV, K] served bitwise as [HV*K] and as the torch op.
"""
from __future__ import annotations

import re

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext.integrations import fla as fkda_fla

H, HV, K, V, SLOTS = 2, 4, 8, 16, 6
BF, NAN = torch.bfloat16, float("nan")
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
             state_v_first=True)
POS = ("q", "k", "v", "g", "beta")


def raw(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def refusal(run, c) -> Exception:
    """run(c) raises, every tensor of c bitwise as it was."""
    before = {n: x.clone() for n, x in c.items() if torch.is_tensor(x)}
    with pytest.raises(Exception) as e:
        run(c)
    for n, x in before.items():
        assert torch.equal(raw(x), raw(c[n])), f"a refused call changed {n}"
    return e.value


def rnd(seed):
    gen = torch.Generator().manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=gen)


def fla_call(family, seed=2600, hv=HV, k=K):
    """fla's keywords: 'rows' (decode, B = N rows of one token), 'cu' (decode, B = 1, T = N, cu_seqlens),
    'verify' ([N, T_max] slots), 'chunk' (chunk_kda) or 'dense' (fused_recurrent into a new final state)."""
    r = rnd(seed)
    B, T = {"rows": (3, 1), "cu": (1, 3), "verify": (1, 3)}.get(family, (2, 5))
    c = dict(q=r(B, T, H, k), k=r(B, T, H, k), v=r(B, T, hv, V), g=r(B, T, hv, k), beta=r(B, T, hv),
             A_log=r(hv) * 0.3, dt_bias=r(hv * k) * 0.5, **FLAGS)
    if family in ("rows", "cu", "verify"):
        c.update(initial_state=r(SLOTS, hv, V, k) * 0.3, inplace_final_state=True, out=torch.full((B, T, hv, V), NAN),
                 ssm_state_indices=torch.tensor([4, -1, 1] if family != "verify" else [[1, 4], [2, 5]],
                                                dtype=torch.int32))
    if family in ("cu", "verify"):
        c["cu_seqlens"] = torch.tensor([0, 1, 2, 3] if family == "cu" else [0, 1, 3], dtype=torch.int32)
    if family in ("chunk", "dense"):
        c.update(initial_state=r(B, hv, V, k) * 0.3, output_final_state=True)
    if family == "dense":
        c["inplace_final_state"] = False
    return c


def fla_fns(family):
    if family == "chunk":
        return fkda_fla.chunk_kda_verifier, fkda_fla.serve_chunk_kda
    return fkda_fla.fused_recurrent_kda_fwd_verifier, fkda_fla.serve_fused_recurrent_kda_fwd


# ---------------------------------------------------------------------------------------------
# fla: the decode batch read k / g / beta by element count

DECODE_BAD = {   # id: (argument, change); the scrambled ones first, then shapes fla does not take
    "g_K_HV": ("g", lambda x: x.transpose(-1, -2).contiguous()),
    "g_flat": ("g", lambda x: x.flatten(-2)),
    "beta_heads_first": ("beta", lambda x: x.permute(2, 1, 0).contiguous()),
    "k_K_H": ("k", lambda x: x.transpose(-1, -2).contiguous()),
    "g_extra_dim": ("g", lambda x: x.unsqueeze(2)),
    "g_B_T_swapped": ("g", lambda x: x.transpose(0, 1).contiguous()),
    "beta_B_T_swapped": ("beta", lambda x: x.transpose(0, 1).contiguous()),
}


@pytest.mark.parametrize("family", ["rows", "cu"])
@pytest.mark.parametrize("case", DECODE_BAD)
def test_fla_decode_batch_refuses_another_layout_of_the_same_size(family, case):
    name, change = DECODE_BAD[case]
    c = fla_call(family)
    c[name] = change(c[name])
    before = fkda_fla.REASONS.copy()
    ok, reason = fkda_fla.fused_recurrent_kda_fwd_verifier(**c)
    assert not ok and f"requires {name} of shape" in reason, reason
    assert fkda_fla.REASONS["fused_recurrent_kda_fwd", reason] == before["fused_recurrent_kda_fwd", reason] + 1
    e = refusal(lambda a: fkda_fla.serve_fused_recurrent_kda_fwd(**a), c)    # called anyway: nothing written
    assert f"requires {name} of shape" in str(e), repr(e)


@pytest.mark.parametrize("family", ["rows", "cu"])
def test_fla_decode_batch_serves_fla_layouts_as_kda_decode(family):    # guard
    """g / beta / k in fla's layout, as column slices of wider projections (row-strided): bitwise kda_decode."""
    c = fla_call(family)
    pool0 = c["initial_state"].clone()
    for n, inner in (("k", 2), ("g", 2), ("beta", 1)):     # each token's row dense, the rows 2x apart
        x = c[n].flatten(-inner)
        c[n] = torch.cat([x, torch.randn_like(x)], -1)[..., :x.shape[-1]].unflatten(-1, c[n].shape[-inner:])
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**c) == (True, None)
    o, pool = fkda_fla.serve_fused_recurrent_kda_fwd(**c)
    want_pool = pool0.clone()
    rows = lambda x: x.reshape(3, *x.shape[2:])  # noqa: E731  (the offsets [0, 1, 2, 3]: row n is request n)
    want = fk.kda_decode(*[rows(c[n]) for n in POS], state=want_pool, state_indices=c["ssm_state_indices"],
                         A_log=c["A_log"], dt_bias=c["dt_bias"], slot_mode="padded")
    assert torch.equal(raw(o.reshape(3, HV, V)), raw(want)) and torch.equal(raw(pool), raw(want_pool))


# ---------------------------------------------------------------------------------------------
# fla: A_log / dt_bias flattened as documented; the other mappings' shape refusals

PARAMS = {   # id: (argument, change): each read as the [HV] / [HV*K] of its logical values
    "A_log_HV_1": ("A_log", lambda x: x.reshape(HV, 1)), "A_log_1_HV": ("A_log", lambda x: x.reshape(1, HV)),
    "A_log_1_1_HV_1": ("A_log", lambda x: x.reshape(1, 1, HV, 1)),
    "dt_bias_HV_K": ("dt_bias", lambda x: x.reshape(HV, K)), "dt_bias_1_HVK": ("dt_bias", lambda x: x[None]),
    "dt_bias_HV_K_transposed_strides": ("dt_bias", lambda x: x.reshape(HV, K).t().contiguous().t()),
}


@pytest.mark.parametrize("family", ["chunk", "cu", "verify"])
@pytest.mark.parametrize("case", PARAMS)
def test_fla_flattens_A_log_and_dt_bias_by_their_logical_values(family, case):    # guard
    name, change = PARAMS[case]
    verifier, serve = fla_fns(family)
    c, want = fla_call(family), fla_call(family)
    c[name] = change(c[name])
    assert verifier(**c) == (True, None) and verifier(**want) == (True, None)
    got, want = serve(**c), serve(**want)
    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(got, want))
    assert not torch.isnan(got[0]).any()


FLA_BAD = {   # id: (argument, change, what the reason says)
    "A_log_HVK": ("A_log", lambda x: torch.randn(HV * K), r"A_log: expected shape \[HV\]"),
    "dt_bias_HV": ("dt_bias", lambda x: x[:HV], r"dt_bias: expected shape \[HV\*K\]"),
    "g_K_HV": ("g", lambda x: x.transpose(-1, -2).contiguous(), r"\bg(: expected| of) shape"),
    "beta_heads_first": ("beta", lambda x: x.transpose(-1, -2).contiguous(), r"\bbeta(: expected| of) shape"),
    "k_K_H": ("k", lambda x: x.transpose(-1, -2).contiguous(), r"\bk(: expected| of) shape"),
    "state_K_first": ("initial_state", lambda x: x.transpose(-1, -2).contiguous(), r"state: expected shape"),
    "state_v_first_False": ("state_v_first", lambda x: False, r"state_v_first=True"),
}


@pytest.mark.parametrize("family", ["chunk", "dense", "verify", "rows"])
@pytest.mark.parametrize("case", FLA_BAD)
def test_fla_refuses_wrong_counts_and_transposed_layouts_in_every_mapping(family, case):
    """guard, except the decode batch's ("rows") g / beta / k: served scrambled before the fix."""
    name, change, why = FLA_BAD[case]
    verifier, serve = fla_fns(family)
    c = fla_call(family)
    c[name] = change(c[name])
    ok, reason = verifier(**c)
    assert not ok and re.search(why, reason), reason
    refusal(lambda a: serve(**a), c)


# ---------------------------------------------------------------------------------------------
# the ops

def op_call(op, seed=2601, hv=HV, k=K):
    r = rnd(seed)
    lead = (3,) if op is fk.kda_decode else (1, 5)
    c = dict(q=r(*lead, H, k), k=r(*lead, H, k), v=r(*lead, hv, V), g=r(*lead, hv, k), beta=r(*lead, hv),
             A_log=r(hv) * 0.3, dt_bias=r(hv * k) * 0.5, out=torch.full((*lead, hv, V), NAN))
    if op is fk.kda_decode:
        c.update(state=r(SLOTS, hv, V, k), state_indices=torch.tensor([4, 0, 2], dtype=torch.int32))
    if op is fk.kda_verify:
        c.update(state=r(SLOTS, hv, V, k), state_indices=torch.tensor([[1, 4, -1], [2, 5, 3]], dtype=torch.int32),
                 cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32))
    return c


def run_op(op):
    def run(c):
        c = dict(c)
        return op(*[c.pop(n) for n in POS], **c)
    return run


OPS = {"kda_decode": fk.kda_decode, "kda_verify": fk.kda_verify, "kda_prefill": fk.kda_prefill}
OP_BAD = {   # id: (argument, change)
    "A_log_HV_1": ("A_log", lambda x: x.reshape(HV, 1)), "A_log_1_HV": ("A_log", lambda x: x.reshape(1, HV)),
    "A_log_1_1_HV_1": ("A_log", lambda x: x.reshape(1, 1, HV, 1)), "A_log_2_2": ("A_log", lambda x: x.reshape(2, 2)),
    "dt_bias_K_HV": ("dt_bias", lambda x: x.reshape(K, HV)), "dt_bias_1_HVK": ("dt_bias", lambda x: x[None]),
    "dt_bias_1_HV_K": ("dt_bias", lambda x: x.reshape(1, HV, K)),
    "dt_bias_HV_K_transposed_strides": ("dt_bias", lambda x: x.reshape(K, HV).t()),
    "g_K_HV": ("g", lambda x: x.transpose(-1, -2).contiguous()), "g_flat": ("g", lambda x: x.flatten(-2)),
    "beta_heads_first": ("beta", lambda x: x.transpose(0, -1).contiguous()),
    "beta_trailing_1": ("beta", lambda x: x.unsqueeze(-1)),
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", OP_BAD)
def test_ops_refuse_layouts_of_the_same_size_naming_them(op, case):    # guard
    name, change = OP_BAD[case]
    c = op_call(OPS[op])
    c[name] = change(c[name])
    e = refusal(run_op(OPS[op]), c)
    assert type(e) is ValueError and str(e).startswith(f"{name}: expected"), repr(e)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["g", "dt_bias"])
def test_ops_at_k_equal_hv_refuse_a_transposed_view(op, name):    # guard
    """K == HV: [.., K, HV] and [.., HV, K] have one shape; a transposed view (inner dims not dense) is refused."""
    c = op_call(OPS[op], hv=K)
    c[name] = c[name].reshape(K, K).t() if name == "dt_bias" else c[name].transpose(-1, -2)
    e = refusal(run_op(OPS[op]), c)
    assert type(e) is ValueError and str(e).startswith(f"{name}: expected"), repr(e)


@pytest.mark.parametrize("op", OPS)
def test_ops_read_dt_bias_hv_k_as_hv_times_k(op):    # guard
    a, b = op_call(OPS[op]), op_call(OPS[op])
    a["dt_bias"] = a["dt_bias"].reshape(HV, K)
    got, want = run_op(OPS[op])(a), run_op(OPS[op])(b)
    got, want = (got, want) if torch.is_tensor(got) else (got[0], want[0])
    assert torch.equal(raw(got), raw(want)) and not torch.isnan(got).any()
    if "state" in a:
        assert torch.equal(raw(a["state"]), raw(b["state"]))


# ---------------------------------------------------------------------------------------------
# JAX

def _jax():
    try:
        import jax  # noqa: F401
        import jax_tvm_ffi  # noqa: F401
        import flashkda_ext.jax as kj
    except ImportError:
        return None
    return kj


kj = _jax()
need_jax = pytest.mark.skipif(kj is None, reason="jax / jax_tvm_ffi not importable")


def to_jax(t):
    import jax
    import jax.numpy as jnp
    return jnp.array(jax.dlpack.from_dlpack(t.detach().contiguous().clone()), copy=True)


JAX_BAD = {k: OP_BAD[k] for k in ("A_log_HV_1", "A_log_1_1_HV_1", "dt_bias_K_HV", "dt_bias_1_HVK", "g_K_HV",
                                   "g_flat", "beta_heads_first")}
JAX_BAD["state_K_first"] = ("state", lambda x: x.transpose(-1, -2).contiguous())


@need_jax
@pytest.mark.parametrize("op, case", [(o, c) for o in OPS for c in JAX_BAD
                                      if (o, c) != ("kda_prefill", "state_K_first")])    # dense prefill: no pool
def test_jax_refuses_layouts_of_the_same_size_after_a_served_call_keeping_the_pool(op, case):    # guard
    name, change = JAX_BAD[case]
    c = {n: x for n, x in op_call(OPS[op]).items() if n != "out"}
    fn = getattr(kj, op)
    call = lambda a: fn(*[a[n] for n in POS], **{n: x for n, x in a.items() if n not in POS})  # noqa: E731
    call({n: to_jax(x) for n, x in c.items()})                                                    # warm: served
    c[name] = change(c[name])
    ja = {n: to_jax(x) for n, x in c.items()}
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        call(ja)
    if "state" in ja:
        assert not ja["state"].is_deleted()
        assert torch.equal(raw(torch.from_dlpack(ja["state"]).clone()), raw(c["state"]))


@need_jax
@pytest.mark.parametrize("op", OPS)
def test_jax_reads_dt_bias_hv_k_as_hv_times_k_and_as_the_torch_op(op):    # guard
    c = {n: x for n, x in op_call(OPS[op]).items() if n != "out"}
    fn = getattr(kj, op)
    call = lambda a: fn(*[a[n] for n in POS], **{n: x for n, x in a.items() if n not in POS})  # noqa: E731
    flat = call({n: to_jax(x) for n, x in c.items()})
    got = call({n: to_jax(x.reshape(HV, K) if n == "dt_bias" else x) for n, x in c.items()})
    want = run_op(OPS[op])(c)
    for a, b, t in zip(got, flat, want if isinstance(want, tuple) else (want, c["state"])):
        ta, tb = torch.from_dlpack(a).clone(), torch.from_dlpack(b).clone()
        assert torch.equal(raw(ta), raw(tb)) and torch.equal(raw(ta), raw(t))
