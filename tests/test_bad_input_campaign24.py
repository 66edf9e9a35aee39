"""Bad-input campaign 24 (CPU backend): the gate / beta dtypes of the speculative-verify adapters, after b43fa71
(SGLang's target_verify passes an fp32 raw gate `a` / beta logit `b` to kda_verify as they are): SGLang's
FlashKDAExtKernel.target_verify, vLLM 0.34's K3 fused_recurrent_kda (raw_g / raw_beta) and fla's
fused_recurrent_kda_fwd with per-token indices. A served call must equal ops.kda_verify called directly on the values
the adapter's rule gives (bitwise; fp32 never rounded to q's dtype); a refused one names the caller's argument and
writes nothing (buffer poisoned with NaN, pool, compared bit for bit). Each case failed before its fix, except those
marked "guard".

- SGLang (target_verify and decode, which share the gate rule): an integer or bool `a`, `b`, `A_log` or `dt_bias` was
  cast to q's dtype / fp32 and served (a bool beta logit as 0 / 1); the ops refuse such tensors and the fla and vLLM
  adapters do not convert them. Now a TypeError naming it, as for a complex one (guard).
- SGLang: `a` / `b` that is no tensor (None, a list) was an AttributeError ('NoneType' object has no attribute
  'dtype') from the fp32 test b43fa71 put before the tensor check (decode had the same since its fp32 rule). Now a
  TypeError naming it.
- SGLang: `a` / `b` on another device than q was refused by the op as `g` / `beta`, names SGLang's call has not got.
  Now a ValueError naming `a` / `b`.
- guard: fp32 `a` / `b` beside bf16 q, alone or mixed with bf16, as column slices of a wider projection, transposed
  strides, `b` [T, HV] or [1, T, HV]: bitwise kda_verify on those dtypes (not on the rounded values); fp16 / fp64 are
  converted to fp32 (docs/integrations.md; to q's dtype until 2026-12-08, which rounded an fp16 gate); NaN / inf in `a` are served (NaN stays in its request's rows);
  fp64 / bf16 A_log and dt_bias are read as fp32; a wrong element count is named.
- guard, vLLM K3: fp32 / bf16 raw_g / raw_beta (mixed, column slices) served bitwise as kda_verify reads them; fp16,
  fp64, integer, bool, complex, meta or [T, HV]-shaped ones fall back, counted, nothing written.
- guard, fla: the verifier passes fp32 / bf16 g / beta (mixed, column slices) to kda_verify as they are, fp16 cast to
  q's dtype; integer, bool, complex, meta, a transposed g or a [T, HV] beta is refused (fla's Triton runs it).
- SGLang: `a` / `b` (and extend's `g` / `beta`) were read by element count, so an `a` [HV*K, T] (a.t(), or made
  contiguous) or a `b` [HV, T] was served on scrambled values. Now SGLang's layouts only ([1, T, HV, K], [T, HV, K],
  each token flat, or all flat: dense.token_layout), else a ValueError naming it.
"""
from __future__ import annotations

import pytest
import torch

import flashkda_ext.integrations.fla as fkda_fla
from flashkda_ext import ops
from flashkda_ext.integrations.sglang import FlashKDAExtKernel
from test_integrations_sglang import H, K, SLOTS, call_verify, packed_qkv, params, verify_case
from vllm_adapter_probe import adapter, fell_back

REAL_VERIFY = ops.kda_verify
BF, F32 = torch.bfloat16, torch.float32
DT = {"bf16": BF, "f16": torch.float16, "f32": F32, "f64": torch.float64}


def raw(t):
    return t.detach().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def refusal(run, c) -> Exception:
    """run(c) raises, every host tensor of c bitwise as it was (call_outcome's rule, which cannot take meta ones)."""
    before = {n: x.clone() for n, x in c.items() if torch.is_tensor(x) and not x.is_meta}
    with pytest.raises(Exception) as e:
        run(c)
    for n, x in before.items():
        assert torch.equal(raw(x), raw(c[n])), f"a refused call changed {n}"
    return e.value


@pytest.fixture
def seen(monkeypatch):
    """The (g, beta) dtypes every kda_verify call received."""
    got = []

    def spy(q, k, v, g, beta, **kw):
        got.append((g.dtype, beta.dtype))
        return REAL_VERIFY(q, k, v, g, beta, **kw)
    monkeypatch.setattr(ops, "kda_verify", spy)
    return got


def read_as(x, q):
    """The adapters' rule: fp32 or q's dtype as it is, another floating dtype in fp32 (exact for fp16)."""
    return x if x.dtype in (F32, q.dtype) else x.to(F32)


def layout(x, how):
    """x [T, C] as an engine may hand it: a column slice of a wider projection, transposed strides, or reshaped."""
    if how == "col":
        return torch.cat([torch.randn(x.shape[0], 3).to(x.dtype), x, torch.zeros(x.shape[0], 5, dtype=x.dtype)],
                         1)[:, 3:-5]
    if how == "t":
        return x.t().contiguous().t()
    return x if how == "plain" else x.reshape(1, x.shape[0], H, -1).squeeze(-1)   # "lead": [1, T, H(, K)]


# ---------------------------------------------------------------------------------------------
# SGLang target_verify

def sg_case(qdt=BF, seed=23):
    return verify_case([3, 2], steps=3, rows=[0, 2], cidx=[1, 4], seed=seed, dtype=qdt)


def sg_direct(c, a, b, buf0):
    """kda_verify called directly as target_verify's contract says, on a copy of the poisoned buffer."""
    T, buf = c["q"].shape[1], buf0.clone()
    o = REAL_VERIFY(c["q"], c["k"], c["v"], a.reshape(1, T, H, K).contiguous(), b.reshape(1, T, H).contiguous(),
                    state=buf, state_indices=c["intermediate_state_indices"], cu_seqlens=c["query_start_loc"],
                    max_seqlen=3, A_log=c["A_log"].reshape(-1).float(), dt_bias=c["dt_bias"].float(), gate="softplus",
                    beta_is_logit=True, initial_state=c["ssm_states"], initial_state_indices=c["cache_indices"])
    return o, buf


@pytest.mark.parametrize("qdt, adt, bdt, alay, blay", [
    ("bf16", "f32", "bf16", "plain", "plain"), ("bf16", "bf16", "f32", "plain", "plain"),
    ("bf16", "f32", "f32", "col", "col"), ("bf16", "f32", "f32", "lead", "lead"), ("bf16", "f32", "bf16", "t", "col"),
    ("bf16", "f16", "f64", "plain", "plain"), ("f32", "bf16", "f16", "t", "t"), ("f32", "f64", "f32", "col", "lead")])
def test_sglang_verify_serves_each_floating_gate_and_beta_as_kda_verify_reads_them(seen, qdt, adt, bdt, alay, blay):
    c = sg_case(DT[qdt])
    q, buf0, pool0 = c["q"], c["intermediate_states_buffer"].clone(), c["ssm_states"].clone()
    c["a"], c["b"] = layout(c["a"].to(DT[adt]), alay), layout(c["b"].to(DT[bdt]), blay)
    o = call_verify(c)
    a, b = read_as(c["a"], q), read_as(c["b"], q)
    assert seen == [(a.dtype, b.dtype)]
    want_o, want_buf = sg_direct(c, a, b, buf0)
    assert torch.equal(raw(o), raw(want_o)) and torch.equal(raw(c["intermediate_states_buffer"]), raw(want_buf))
    assert torch.equal(raw(c["ssm_states"]), raw(pool0))
    if F32 in (DT[adt], DT[bdt]) and q.dtype != F32:       # not the call on values rounded to q's dtype
        assert not torch.equal(raw(o), raw(sg_direct(c, a.to(q.dtype), b.to(q.dtype), buf0)[0]))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_sglang_verify_serves_nan_and_inf_gates_as_kda_verify(value):    # guard
    c = sg_case()
    buf0 = c["intermediate_states_buffer"].clone()
    c["a"][1, 3] = value                                    # token 1: request 0 (tokens 0..2, buffer row 0)
    o = call_verify(c)
    want_o, want_buf = sg_direct(c, c["a"], read_as(c["b"], c["q"]), buf0)
    assert torch.equal(raw(o), raw(want_o)) and torch.equal(raw(c["intermediate_states_buffer"]), raw(want_buf))
    assert torch.isfinite(o[0, 3:]).all() and torch.isfinite(c["intermediate_states_buffer"][2, :2]).all()
    assert torch.isnan(o[0, 1:3]).any() == (value != value) and torch.isfinite(o[0, :1]).all()


@pytest.mark.parametrize("name, dtype", [("A_log", DT["f64"]), ("A_log", BF), ("dt_bias", DT["f64"]), ("dt_bias", BF)])
def test_sglang_verify_reads_gate_parameters_of_another_width_as_fp32(name, dtype):    # guard
    c = sg_case()
    buf0 = c["intermediate_states_buffer"].clone()
    c[name] = c[name].to(dtype)
    o = call_verify(c)
    assert torch.equal(raw(o), raw(sg_direct(c, c["a"], read_as(c["b"], c["q"]), buf0)[0]))


def decode_case(seed=5, N=3):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = packed_qkv(N, gen, BF)
    A_log, dt_bias = params(gen)
    return dict(q=q, k=k, v=v, a=torch.randn(N, H * K, generator=gen), b=torch.randn(N, H, generator=gen),
                A_log=A_log, dt_bias=dt_bias, ssm_states=torch.randn(SLOTS, H, 16, K, generator=gen),
                cache_indices=torch.tensor([4, -1, 1], dtype=torch.int32),
                query_start_loc=torch.arange(N + 1, dtype=torch.int32))


def call_decode(c):
    c = dict(c)
    return FlashKDAExtKernel().decode(*[c.pop(n) for n in ("q", "k", "v", "a", "b")], **c)


SG_BAD = {  # id: (change, error, the argument named)
    "a_int32": (lambda c: dict(a=c["a"].int()), TypeError, "a"),
    "a_bool": (lambda c: dict(a=c["a"] > 0), TypeError, "a"),
    "b_int64": (lambda c: dict(b=c["b"].long()), TypeError, "b"),
    "b_bool": (lambda c: dict(b=c["b"] > 0), TypeError, "b"),
    "A_log_int32": (lambda c: dict(A_log=c["A_log"].int()), TypeError, "A_log"),
    "dt_bias_bool": (lambda c: dict(dt_bias=c["dt_bias"] > 0), TypeError, "dt_bias"),
    "a_complex": (lambda c: dict(a=c["a"].to(torch.complex64)), TypeError, "a"),                   # guard
    "a_None": (lambda c: dict(a=None), TypeError, "a"),
    "b_list": (lambda c: dict(b=c["b"].tolist()), TypeError, "b"),
    "a_meta": (lambda c: dict(a=c["a"].to("meta")), ValueError, "a"),
    "b_meta_bf16": (lambda c: dict(b=c["b"].bfloat16().to("meta")), ValueError, "b"),
    "A_log_meta": (lambda c: dict(A_log=c["A_log"].to("meta")), ValueError, "A_log"),           # guard
    "a_elements": (lambda c: dict(a=c["a"][:, :-1]), ValueError, "a"),                          # guard
    "b_elements": (lambda c: dict(b=c["b"][:-1]), ValueError, "b"),                             # guard
    "a_neg_view": (lambda c: dict(a=torch._neg_view(c["a"])), ValueError, "a"),                 # guard
    # the tokens elsewhere than first: read by element count, these were served on scrambled values
    "a_transposed": (lambda c: dict(a=c["a"].t()), ValueError, "a"),
    "a_transposed_dense": (lambda c: dict(a=c["a"].t().contiguous()), ValueError, "a"),
    "b_transposed": (lambda c: dict(b=c["b"].t()), ValueError, "b"),
}


@pytest.mark.parametrize("site", ["target_verify", "decode"])
@pytest.mark.parametrize("case", SG_BAD)
def test_sglang_bad_gate_or_beta_is_named_before_anything_is_written(site, case):
    change, error, name = SG_BAD[case]
    c = sg_case() if site == "target_verify" else decode_case()
    c.update(change(c))
    run = call_verify if site == "target_verify" else call_decode
    e = refusal(run, c)
    assert type(e) is error and str(e).startswith(f"{name}: "), repr(e)


# ---------------------------------------------------------------------------------------------
# vLLM 0.34 K3 fused_recurrent_kda (kda_verify with ssm_state_indices [N, T_max])

VL = "k3.fused_recurrent_kda"


def vl_call(qdt=BF, seed=2400, T=5):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(1, T, H, K).to(qdt), k=r(1, T, H, K).to(qdt), v=r(1, T, H, 16).to(qdt), raw_g=r(1, T, H, K),
                raw_beta=r(1, T, H), A_log=r(H), dt_bias=r(H * K), lower_bound=-5.0, initial_state=r(8, H, 16, K),
                cu_seqlens=torch.tensor([0, 2, T], dtype=torch.int32),
                ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
                num_accepted_tokens=torch.tensor([1, 2], dtype=torch.int32))


def vl_direct(c, g, beta, pool0):
    pool = pool0.clone()
    o = REAL_VERIFY(c["q"], c["k"], c["v"], g, beta, state=pool, state_indices=c["ssm_state_indices"],
                    cu_seqlens=c["cu_seqlens"], num_accepted_tokens=c["num_accepted_tokens"], A_log=c["A_log"].float(),
                    dt_bias=c["dt_bias"].float(), lower_bound=-5.0, gate="bounded", scale=K ** -0.5,
                    beta_is_logit=True, null_slot0=True)
    return o, pool


def heads(x, how):
    """raw_g [1, T, H, K] / raw_beta [1, T, H] through layout() on its [T, C] rows."""
    return layout(x[0].reshape(x.shape[1], -1), how).unflatten(1, x.shape[2:]).unsqueeze(0)


@pytest.mark.parametrize("gdt, bdt, how, param", [
    ("f32", "bf16", "plain", None), ("bf16", "f32", "plain", None), ("f32", "f32", "col", None),
    ("f32", "bf16", "col", None), ("f32", "f32", "plain", ("A_log", torch.float64)),
    ("f32", "f32", "plain", ("dt_bias", BF)), ("nan", "f32", "plain", None)])
def test_vllm_k3_verify_serves_fp32_and_bf16_gates_as_kda_verify_reads_them(seen, gdt, bdt, how, param):   # guard
    c = vl_call()
    pool0 = c["initial_state"].clone()
    if gdt == "nan":
        c["raw_g"][0, 3, 1, 2], gdt = float("nan"), "f32"       # request 1's second token
    c["raw_g"], c["raw_beta"] = heads(c["raw_g"].to(DT[gdt]), how), heads(c["raw_beta"].to(DT[bdt]), how)
    if param:
        c[param[0]] = c[param[0]].to(param[1])
    o, pool = adapter(VL)(**c)
    assert pool is c["initial_state"] and seen == [(DT[gdt], DT[bdt])]
    want_o, want_pool = vl_direct(c, c["raw_g"], c["raw_beta"], pool0)
    assert torch.equal(raw(o), raw(want_o)) and torch.equal(raw(pool), raw(want_pool))
    assert torch.isfinite(o[0, :2]).all()     # request 0: untouched by request 1's NaN
    if F32 in (DT[gdt], DT[bdt]):
        assert not torch.equal(raw(o), raw(vl_direct(c, c["raw_g"].to(BF), c["raw_beta"].to(BF), pool0)[0]))


@pytest.mark.parametrize("change, reason", [
    (dict(raw_g=lambda g: g.half()), "raw_g of dtype torch.float16"),
    (dict(raw_g=lambda g: g.double()), "raw_g of dtype torch.float64"),
    (dict(raw_g=lambda g: g.int()), "raw_g of dtype torch.int32"),
    (dict(raw_beta=lambda b: b > 0), "raw_beta of dtype torch.bool"),
    (dict(raw_beta=lambda b: b.to(torch.complex64)), "raw_beta of dtype torch.complex64"),
    (dict(raw_g=lambda g: g.to("meta")), "g: expected a tensor on cpu"),
    (dict(raw_beta=lambda b: b.to("meta")), "beta: expected a tensor on cpu"),
    (dict(raw_beta=lambda b: b[0]), "beta: expected shape [1, T, HV]"),
    (dict(raw_g=lambda g: g.reshape(5, -1)), "g: expected shape [1, T, HV, K]"),
])
def test_vllm_k3_verify_other_gates_fall_back_writing_nothing(change, reason):    # guard
    c = vl_call()
    for n, f in change.items():
        c[n] = f(c[n])
    pool0 = c["initial_state"].clone()
    fell_back(VL, lambda: adapter(VL)(**c), reason)
    assert torch.equal(raw(c["initial_state"]), raw(pool0))


# ---------------------------------------------------------------------------------------------
# fla fused_recurrent_kda_fwd with ssm_state_indices [N, T_max] (kda_verify)

FLA_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True, inplace_final_state=True)


def fla_call(qdt=BF, seed=2401, HV=4, T=3):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(1, T, H, K).to(qdt), k=r(1, T, H, K).to(qdt), v=r(1, T, HV, 16).to(qdt), g=r(1, T, HV, K),
                beta=r(1, T, HV), A_log=r(HV) * 0.3, dt_bias=r(HV * K) * 0.5, initial_state=r(9, HV, 16, K) * 0.3,
                cu_seqlens=torch.tensor([0, 1, T], dtype=torch.int32),
                ssm_state_indices=torch.tensor([[1, 4], [2, 7]], dtype=torch.int32), **FLA_FLAGS)


@pytest.mark.parametrize("qdt, gdt, bdt, how", [
    ("bf16", "f32", "bf16", "plain"), ("bf16", "bf16", "f32", "plain"), ("bf16", "f32", "f32", "col"),
    ("bf16", "f16", "f32", "col"), ("f32", "bf16", "f64", "plain")])
def test_fla_verify_serves_fp32_gates_as_they_are(seen, qdt, gdt, bdt, how):    # guard
    c = fla_call(DT[qdt])
    pool0 = c["initial_state"].clone()
    c["g"], c["beta"] = heads(c["g"].to(DT[gdt]), how), heads(c["beta"].to(DT[bdt]), how)
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**c) == (True, None)
    o, pool = fkda_fla.serve_fused_recurrent_kda_fwd(**c)
    g, beta = read_as(c["g"], c["q"]), read_as(c["beta"], c["q"])
    assert seen == [(g.dtype, beta.dtype)]
    want_pool = pool0.clone()
    want_o = REAL_VERIFY(c["q"], c["k"], c["v"], g, beta, state=want_pool, state_indices=c["ssm_state_indices"],
                         cu_seqlens=c["cu_seqlens"], max_seqlen=2, A_log=c["A_log"], dt_bias=c["dt_bias"],
                         gate="softplus", beta_is_logit=True)
    assert torch.equal(raw(o), raw(want_o)) and torch.equal(raw(pool), raw(want_pool))


@pytest.mark.parametrize("name, change, why", [
    ("g", lambda g: g.int(), "floating-point tensors only"), ("beta", lambda b: b > 0, "floating-point tensors only"),
    ("g", lambda g: g.to(torch.complex64), "floating-point tensors only"),
    ("g", lambda g: g.to("meta"), "g on cpu"), ("beta", lambda b: b.bfloat16().to("meta"), "beta on cpu"),
    ("g", lambda g: g.transpose(2, 3).contiguous().transpose(2, 3), "g: expected [1, T, HV, K] with its inner dims"),
    ("beta", lambda b: b[0], "beta per head [B, T, HV]"), ("A_log", lambda a: a.int(), "torch.int32 tensor of shape")])
def test_fla_verify_refuses_other_gates_writing_nothing(name, change, why):    # guard
    c = fla_call()
    c[name] = change(c[name])
    ok, reason = fkda_fla.fused_recurrent_kda_fwd_verifier(**c)
    assert not ok and why in reason, reason
    refusal(lambda a: fkda_fla.serve_fused_recurrent_kda_fwd(**a), c)      # nothing written if called anyway


@pytest.mark.parametrize("name", ["g", "beta"])
def test_sglang_extend_gate_or_beta_with_the_tokens_elsewhere_is_named(name):
    """extend's g [T, HV*K] / beta [T, HV] transposed (read by element count, served scrambled before): a ValueError
    naming it, the pool bitwise unchanged."""
    from test_integrations_sglang import extend_case
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, _ = extend_case()
    c = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
             cache_indices=torch.tensor([4, 1], dtype=torch.int32), query_start_loc=qsl)
    c[name] = c[name].reshape(q.shape[1], -1).t().contiguous()

    def run(c):
        c = dict(c)
        return FlashKDAExtKernel().extend(*[c.pop(n) for n in ("q", "k", "v", "g", "beta")], **c)
    e = refusal(run, c)
    assert type(e) is ValueError and str(e).startswith(f"{name}: expected shape [1, T, "), repr(e)


def test_sglang_extend_gate_with_each_tokens_values_transposed_is_named():
    """g [1, T, K, HV] (K != HV: the element count and the tokens right, each token's values transposed) was served
    on scrambled values (campaign 27: up to 0.23 apart); a ValueError naming g, the pool bitwise unchanged."""
    from test_integrations_sglang import extend_case
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, _ = extend_case()
    assert g.shape[-1] != g.shape[-2]
    c = dict(q=q, k=k, v=v, g=g.transpose(-1, -2).contiguous(), beta=beta, A_log=A_log, dt_bias=dt_bias,
             ssm_states=pool, cache_indices=torch.tensor([4, 1], dtype=torch.int32), query_start_loc=qsl)

    def run(c):
        c = dict(c)
        return FlashKDAExtKernel().extend(*[c.pop(n) for n in ("q", "k", "v", "g", "beta")], **c)
    e = refusal(run, c)
    assert type(e) is ValueError and str(e).startswith("g: expected shape [1, T, "), repr(e)
