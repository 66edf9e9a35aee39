"""Bad-input campaign 27 (CPU backend): SGLang 0.5.23's captured prefill (sglang/prefill_graph.py, driven as
FlashInferKDAPrefillGraph drives it), extend's state tracking (track_state / track_chunk_idx, extend_states.py) and
vLLM 0.34's vendored names for bailing_moe_v3 (vllm/vendored.py). A refused call names the caller's argument and
writes nothing (output / track buffers NaN-poisoned, the pool, compared bit for bit); a vLLM call not mapped falls
back, counted; a served call equals the op called directly, bitwise. Each case failed before its fix, except "guard".

- wrapper: g / beta were read by element count, so g [1, HV*K, T], [HV, K, T] or [1, T, K, HV], beta [1, HV, T],
  [HV, T] or [HV, T, 1] were served on scrambled values. Now [1, T, ...] / [T, ...] of the per-token shape (or each
  token flat), else a ValueError naming it.
- wrapper: ssm_state_indices on another device was a bare RuntimeError (torch.where); initial_state / output on
  another device, an initial_state that is no tensor or a negated view were named state / out (kda_prefill's
  names); a live slot given twice was named by the binding ('cpu_kda_prefill::kda_prefill: argument
  'state_indices''). Now each names SGLang's argument.
- vendored chunk_kda: an initial_state that is no tensor was an AttributeError ('list' object has no attribute
  'is_contiguous'). Now a counted fallback naming it, as for q..beta.
- guard: dtypes, devices, checkpoints, int64 / padded / clamped indices, one token, track buffers and any
  track_chunk_idx value, overlaps; vLLM layouts of the same size, dtypes, devices, indices past int32 / the pool.
- at the end: found here in kernel.py / dense.py (outside this campaign's files), strict xfails until fixed after it.
"""
from __future__ import annotations

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext.integrations.sglang import FlashKDAExtKernel
from flashkda_ext.integrations.sglang.prefill_graph import PrefillGraphWrapper
from vllm_adapter_probe import adapter, fell_back

H, HV, K, V, SLOTS, T = 2, 4, 8, 16, 6, 12       # K != HV catches [K, HV]; K != V a transposed state
NAN = float("nan")
POS = ("q", "k", "v", "g", "beta")


def raw(t):
    return t.detach().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def refusal(run, c, error=Exception, name=None) -> Exception:
    """run(c) raises (naming `name`), every host tensor of c bitwise as it was."""
    before = {n: x.clone() for n, x in c.items() if torch.is_tensor(x) and not x.is_meta}
    with pytest.raises(error) as e:
        run(c)
    for n, x in before.items():
        assert torch.equal(raw(x), raw(c[n])), f"a refused call changed {n}"
    if name is not None:
        assert str(e.value).startswith(f"{name}:"), repr(e.value)
    return e.value


def rnd(seed):
    return lambda *s, gen=torch.Generator().manual_seed(seed): torch.randn(*s, generator=gen)


# ---------------------------------------------------------------------------------------------
# SGLang's captured prefill

def graph_call(offsets=(0, 7, 10, 10), idx=(2, 4, 0), seed=2701, t=T):
    r = rnd(seed)
    w = PrefillGraphWrapper("cpu")
    w.plan(torch.tensor(offsets, dtype=torch.int64))
    return w, dict(q=r(1, t, H, K), k=r(1, t, H, K), v=r(1, t, HV, V), g=r(1, t, HV, K), beta=r(1, t, HV),
                   A_log=r(HV) * 0.3, dt_bias=r(HV * K) * 0.5, initial_state=r(SLOTS, HV, V, K) * 0.3,
                   ssm_state_indices=torch.tensor(idx, dtype=torch.int32), output_final_state=False,
                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
                   output=torch.full((1, t, HV, V), NAN))


def direct_prefill(c, offsets):
    """kda_prefill called directly on what the wrapper serves: the planned rows, empty sequences as padding."""
    n, pool = offsets[-1], c["initial_state"].clone()
    live = [b > a for a, b in zip(offsets, offsets[1:])]
    idx = torch.tensor([s if on else -1 for s, on in zip(c["ssm_state_indices"].tolist(), live)], dtype=torch.int32)
    o = fk.kda_prefill(*(c[x][:, :n] for x in POS), A_log=c["A_log"], dt_bias=c["dt_bias"], gate="bounded",
                       lower_bound=-5.0, beta_is_logit=True, cu_seqlens=torch.tensor(offsets, dtype=torch.int32),
                       state=pool, state_indices=idx, output_final_state=True)[0]
    return o, pool


GRAPH_LAYOUTS = {   # id: (argument, change): the same element count, another layout
    "g_1_HVK_T": ("g", lambda x: x.flatten(2).transpose(1, 2).contiguous()),
    "g_HV_K_T": ("g", lambda x: x[0].permute(1, 2, 0).contiguous()),
    "g_1_T_K_HV": ("g", lambda x: x.transpose(-1, -2).contiguous()),
    "beta_1_HV_T": ("beta", lambda x: x.transpose(1, 2).contiguous()),
    "beta_HV_T": ("beta", lambda x: x[0].t().contiguous()),
    "beta_HV_T_1": ("beta", lambda x: x.permute(2, 1, 0).contiguous()),
}


@pytest.mark.parametrize("case", GRAPH_LAYOUTS)
def test_graph_refuses_a_gate_or_beta_of_another_layout(case):
    name, change = GRAPH_LAYOUTS[case]
    w, c = graph_call()
    c[name] = change(c[name])
    e = refusal(lambda a: w.run(**a), c, ValueError, name)
    assert "expected shape [1, T, " in str(e)


SERVED_LAYOUTS = {   # guard: SGLang's own layouts and views of them, read by their logical values
    "g_T_HV_K": ("g", lambda x: x[0]), "g_1_T_HVK": ("g", lambda x: x.flatten(2)),
    "g_flat": ("g", lambda x: x.flatten()), "g_transposed_strides": ("g", lambda x: x.mT.contiguous().mT),
    "beta_T_HV": ("beta", lambda x: x[0]), "beta_flat": ("beta", lambda x: x.flatten()),
    "beta_column_slice": ("beta", lambda x: torch.cat([x, x], -1)[..., :HV]),
}


@pytest.mark.parametrize("case", [None, *SERVED_LAYOUTS])
def test_guard_graph_serves_sglangs_layouts_as_kda_prefill_directly(case):
    w, c = graph_call()
    want_o, want_pool = direct_prefill(c, [0, 7, 10, 10])     # on SGLang's [1, T, HV, K] / [1, T, HV]
    if case is not None:
        name, change = SERVED_LAYOUTS[case]
        c[name] = change(c[name])
    out, none = w.run(**c)
    assert out is c["output"] and none is None
    assert torch.equal(raw(out[:, :10]), raw(want_o)) and torch.isnan(out[:, 10:]).all()
    assert torch.equal(raw(c["initial_state"]), raw(want_pool))


@pytest.mark.parametrize("offsets, idx, t", [((0, 1), (3,), 1), ((0, 7, 10, 10), (-1, 4, 0), T),
                                             ((0, 0, 5, 9), (0, 0, 5), T), ((0, 12), (5,), T)])
def test_guard_graph_one_token_padding_and_clamped_slots_equal_kda_prefill(offsets, idx, t):
    """One token (SGLang's [1, 1, HV, K] gate: no layout rule may refuse it), a live -1 (padding: zeros in, no
    write), an empty sequence clamped to slot 0 beside a live slot 0: bitwise kda_prefill."""
    w, c = graph_call(offsets, idx, t=t)
    want_o, want_pool = direct_prefill(c, list(offsets))
    out, _ = w.run(**c)
    assert torch.equal(raw(out[:, :offsets[-1]]), raw(want_o)) and torch.equal(raw(c["initial_state"]), raw(want_pool))


GRAPH_NAMED = {   # id: (argument, value, error); "guard_" ids were named so before
    "idx_meta": ("ssm_state_indices", lambda c: c["ssm_state_indices"].to("meta"), ValueError),
    "pool_meta": ("initial_state", lambda c: c["initial_state"].to("meta"), ValueError),
    "output_meta": ("output", lambda c: c["output"].to("meta"), ValueError),
    "pool_list": ("initial_state", lambda c: [0.0], TypeError),
    "pool_negative_view": ("initial_state", lambda c: torch._neg_view(c["initial_state"].neg()), ValueError),
    "idx_live_twice": ("ssm_state_indices", lambda c: torch.tensor([4, 4, 0], dtype=torch.int32), ValueError),
    "guard_g_int": ("g", lambda c: c["g"].int(), TypeError),
    "guard_beta_bool": ("beta", lambda c: c["beta"] > 0, TypeError),
    "guard_A_log_int": ("A_log", lambda c: c["A_log"].long(), TypeError),
    "guard_dt_bias_bool": ("dt_bias", lambda c: c["dt_bias"] > 0, TypeError),
    "guard_q_int": ("q", lambda c: c["q"].int(), ValueError),
    "guard_g_meta": ("g", lambda c: c["g"].to("meta"), ValueError),
    "guard_beta_meta": ("beta", lambda c: c["beta"].to("meta"), ValueError),
    "guard_idx_int64": ("ssm_state_indices", lambda c: c["ssm_state_indices"].long(), ValueError),
    "guard_every_64": ("checkpoint_every_n_tokens", lambda c: 64, ValueError),
    "guard_every_32": ("checkpoint_every_n_tokens", lambda c: 32, ValueError),
    "guard_track": ("state_checkpoints", lambda c: torch.full((3, HV, V, K), NAN), ValueError),
}


@pytest.mark.parametrize("case", GRAPH_NAMED)
def test_graph_names_sglangs_argument_not_the_ops(case):
    name, change, error = GRAPH_NAMED[case]
    w, c = graph_call()
    c[name] = change(c)
    refusal(lambda a: w.run(**a), c, error, name)


# ---------------------------------------------------------------------------------------------
# extend's state tracking

def extend_call(seed=2702, lens=(70, 130, 0)):
    r = rnd(seed)
    n, offsets = sum(lens), [0, *torch.tensor(lens).cumsum(0).tolist()]
    return dict(q=r(1, n, H, K), k=r(1, n, H, K), v=r(1, n, HV, V), g=r(1, n, HV, K), beta=r(1, n, HV).sigmoid(),
                ssm_states=r(SLOTS, HV, V, K) * 0.3, cache_indices=torch.tensor([4, 1, 3], dtype=torch.int32),
                query_start_loc=torch.tensor(offsets, dtype=torch.int32), A_log=r(HV) * 0.3,
                dt_bias=r(HV * K) * 0.5, extend_seq_lens_cpu=list(lens), track_state=torch.full((4, HV, V, K), NAN),
                track_chunk_idx=torch.tensor([1, 2, 0, 0], dtype=torch.int32))


def run_extend(c):
    c = dict(c)
    return FlashKDAExtKernel().extend(*[c.pop(n) for n in POS], **c)


@pytest.mark.parametrize("chunk_idx, kept", [([1, 2, 0, 0], [2, 3]), ([0, -1, 0, 5], [1, 2, 3]),
                                             ([2 ** 32 + 1, 3, 0, 0], [0, 1, 2, 3]), ([-2 ** 63, 0, 0, 0], [0, 2, 3])])
def test_guard_track_rows_are_kda_prefills_checkpoints_bitwise(chunk_idx, kept):
    """Row n: the state entering 64-token chunk c (the start state for c = 0); a negative c, one past the request
    (request 1 has chunks 0..2, request 2 none) or past int32 leaves the row's NaN bits; rows >= N never written."""
    c = extend_call()
    c["track_chunk_idx"] = torch.tensor(chunk_idx, dtype=torch.int64)
    pool0 = c["ssm_states"].clone()
    o = run_extend(c)
    want_pool = pool0.clone()
    want_o, _, ckpt = fk.kda_prefill(*(c[n] for n in POS), A_log=c["A_log"], dt_bias=c["dt_bias"],
                                     beta_is_logit=False, cu_seqlens=c["query_start_loc"], state=want_pool,
                                     state_indices=c["cache_indices"], checkpoint_every=64, max_seqlen=130)
    assert torch.equal(raw(o), raw(want_o)) and torch.equal(raw(c["ssm_states"]), raw(want_pool))
    for n, ci in enumerate(chunk_idx[:3]):
        if n not in kept:
            want = pool0[c["cache_indices"][n]] if ci == 0 else ckpt[n, ci - 1]
            assert torch.equal(raw(c["track_state"][n]), raw(want.float()))
    assert all(torch.isnan(c["track_state"][n]).all() for n in kept)


TRACK_BAD = {   # guard: id: (argument, value)
    **{d: ("track_state", lambda c, d=d: c["track_state"].to(getattr(torch, d))) for d in ("bfloat16", "float64",
                                                                                         "int32")},
    "K_first": ("track_state", lambda c: torch.full((4, HV, K, V), NAN)),
    "transposed_view": ("track_state", lambda c: torch.full((4, HV, K, V), NAN).mT),
    "flat": ("track_state", lambda c: torch.full((4, HV * V * K), NAN)),
    "expanded": ("track_state", lambda c: torch.full((1, HV, V, K), NAN).expand(4, HV, V, K)),
    "two_rows": ("track_state", lambda c: torch.full((2, HV, V, K), NAN)),
    "list": ("track_state", lambda c: [0.0]), "meta": ("track_state", lambda c: c["track_state"].to("meta")),
    "overlaps_pool": ("track_state", lambda c: c["ssm_states"][2:]),
    "overlaps_q": ("track_state", None), "overlaps_chunk_idx": ("track_state", None),
    "idx_float": ("track_chunk_idx", lambda c: c["track_chunk_idx"].float()),
    "idx_bool": ("track_chunk_idx", lambda c: c["track_chunk_idx"] > 0),
    "idx_int16": ("track_chunk_idx", lambda c: c["track_chunk_idx"].short()),
    "idx_2d": ("track_chunk_idx", lambda c: c["track_chunk_idx"][None]),
    "idx_short": ("track_chunk_idx", lambda c: c["track_chunk_idx"][:2]),
    "idx_meta": ("track_chunk_idx", lambda c: c["track_chunk_idx"].to("meta")),
    "idx_list": ("track_chunk_idx", lambda c: [1, 2, 0]), "idx_None": ("track_chunk_idx", lambda c: None),
}


@pytest.mark.parametrize("case", TRACK_BAD)
def test_guard_track_buffers_refused_naming_them_before_anything_is_written(case):
    name, change = TRACK_BAD[case]
    c = extend_call()
    if change is not None:
        c[name] = change(c)
    if case == "overlaps_q":     # q's last rows share the track buffer's first
        buf = torch.full((c["q"].numel() + 1024,), NAN)
        c["q"], c["track_state"] = buf[:c["q"].numel()].view(c["q"].shape).normal_(), buf[-2048:].view(4, HV, V, K)
    if case == "overlaps_chunk_idx":     # the indices in the track buffer's last 4 elements
        c["track_chunk_idx"] = c["track_state"].view(-1)[-4:].view(torch.int32).zero_()
    refusal(run_extend, c, ValueError, name)


# ---------------------------------------------------------------------------------------------
# vLLM 0.34's vendored names (bailing_moe_v3)

def vendored_call(site, seed=2703):
    r = rnd(seed)
    n = {"chunk_kda": 7}.get(site, 3)
    c = dict(q=r(1, n, H, K), k=r(1, n, H, K), v=r(1, n, HV, V), g=-r(1, n, HV, K).abs(), beta=r(1, n, HV).sigmoid(),
             use_qk_l2norm_in_kernel=True)
    if site == "chunk_kda":
        return dict(c, initial_state=r(2, HV, V, K) * 0.3, output_final_state=True,
                    cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32))
    c.update(initial_state=r(SLOTS, HV, V, K) * 0.3, cu_seqlens=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
             ssm_state_indices=torch.tensor([4, 1, 2], dtype=torch.int32))
    if site == "fused_recurrent_kda_fwd":
        c.update(scale=K ** -0.5, inplace_final_state=True, cu_seqlens=torch.tensor([0, 2, 3], dtype=torch.int32),
                 ssm_state_indices=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
                 num_accepted_tokens=torch.tensor([2, 1], dtype=torch.int32))
    return c


SITES = ("fused_recurrent_kda", "fused_recurrent_kda_fwd", "chunk_kda")


@pytest.mark.parametrize("value", [[0.0], 0.5, "h0"], ids=["list", "float", "str"])
def test_vendored_chunk_initial_state_that_is_no_tensor_falls_back_naming_it(value):
    c = vendored_call("chunk_kda")
    c["initial_state"] = value
    fell_back("vendored.chunk_kda", lambda: adapter("vendored.chunk_kda")(**c), "initial_state is ")


VENDORED_FALLBACK = {   # guard: id: (change, the reason names)
    "g_K_HV": (lambda c: c.update(g=c["g"].mT.contiguous()), "g"),
    "g_flat": (lambda c: c.update(g=c["g"].flatten(-2)), "g"),
    "g_heads_first": (lambda c: c.update(g=c["g"].transpose(1, 2).contiguous()), "g"),
    "beta_heads_first": (lambda c: c.update(beta=c["beta"].transpose(1, 2).contiguous()), "beta"),
    "k_K_H": (lambda c: c.update(k=c["k"].mT.contiguous()), "k"),
    "g_int": (lambda c: c.update(g=c["g"].int()), "g"), "g_meta": (lambda c: c.update(g=c["g"].to("meta")), "g"),
    "beta_bool": (lambda c: c.update(beta=c["beta"] > 0.5), "beta"),
    "pool_meta": (lambda c: c.update(initial_state=c["initial_state"].to("meta")), "initial_state"),
    "pool_int": (lambda c: c.update(initial_state=c["initial_state"].int()), "int32"),
    "cu_list": (lambda c: c.update(cu_seqlens=c["cu_seqlens"].tolist()), "cu_seqlens"),
    "cu_float": (lambda c: c.update(cu_seqlens=c["cu_seqlens"].float()), "cu_seqlens"),
    "scale_tensor": (lambda c: c.update(scale=torch.tensor(0.5)), "scale"),
    "l2norm_1": (lambda c: c.update(use_qk_l2norm_in_kernel=1), "use_qk_l2norm_in_kernel"),
    "idx_float": (lambda c: c.update(ssm_state_indices=c["ssm_state_indices"].float()), "ssm_state_indices"),
    "idx_meta": (lambda c: c.update(ssm_state_indices=c["ssm_state_indices"].to("meta")), "ssm_state_indices"),
}


@pytest.mark.parametrize("site, case", [(s, c) for c in VENDORED_FALLBACK for s in SITES
                                        if not (s == "chunk_kda" and c.startswith("idx"))])   # chunk: no indices
def test_guard_vendored_falls_back_counted_on_what_it_does_not_map(site, case):
    c = vendored_call(site)
    change, reason = VENDORED_FALLBACK[case]
    change(c)
    before = c["initial_state"].clone() if not c["initial_state"].is_meta else None
    fell_back("vendored." + site, lambda: adapter("vendored." + site)(**c), reason)
    assert before is None or torch.equal(raw(before), raw(c["initial_state"]))


@pytest.mark.parametrize("site", SITES[:2])
@pytest.mark.parametrize("entry, name", [(2 ** 32 + 1, "ssm_state_indices"), (SLOTS + 4, "ssm_state_indices"),
                                         (2 ** 32 + 3, "cu_seqlens")])
def test_guard_vendored_indices_no_kernel_can_run_raise_naming_them(site, entry, name):
    c = vendored_call(site)
    c[name] = c[name].long()
    c[name].view(-1)[-1] = entry
    refusal(lambda a: adapter("vendored." + site)(**a), c, ValueError, name)


@pytest.mark.parametrize("idx", [[4, 1, 2], [4, -2, 0], [2, 2, 2]])
def test_guard_vendored_decode_is_kda_decode_bitwise(idx):
    c = vendored_call("fused_recurrent_kda")
    c["ssm_state_indices"] = torch.tensor(idx, dtype=torch.int32)
    want_pool = c["initial_state"].clone()
    o, _ = adapter("vendored.fused_recurrent_kda")(**c)
    want = fk.kda_decode(*(c[n][0] for n in POS), state=want_pool, state_indices=c["ssm_state_indices"], gate="log",
                         beta_is_logit=False, null_slot0=True)
    assert torch.equal(raw(o[0]), raw(want)) and torch.equal(raw(c["initial_state"]), raw(want_pool))


def test_guard_vendored_chunk_reads_an_fp16_start_state_as_its_fp32_values():
    a, b = vendored_call("chunk_kda"), vendored_call("chunk_kda")
    a["initial_state"] = a["initial_state"].half()
    b["initial_state"] = a["initial_state"].float()
    got, want = adapter("vendored.chunk_kda")(**a), adapter("vendored.chunk_kda")(**b)
    assert all(torch.equal(raw(x), raw(y)) for x, y in zip(got, want))


# ---------------------------------------------------------------------------------------------
# found by this campaign outside its files and fixed after it: a one-token gate (dense.tokens_first stripped every
# leading 1, refusing SGLang's [1, 1, HV, K]; now dense.token_layout), extend naming ssm_states / cache_indices on
# another device (kda_prefill named them state / state_indices) and keeping track_state off A_log / dt_bias

@pytest.mark.parametrize("where", ["extend", "decode"])
def test_one_token_in_sglangs_gate_layout_is_served(where):
    c = extend_call(lens=(1,))
    c["cache_indices"], c["query_start_loc"] = c["cache_indices"][:1], torch.tensor([0, 1], dtype=torch.int32)
    c = {n: x for n, x in c.items() if not n.startswith(("track", "extend_seq"))}
    if where == "extend":
        run_extend(c)
    else:
        FlashKDAExtKernel().decode(*(c[n] for n in ("q", "k", "v", "g", "beta")), A_log=c["A_log"],
                                   dt_bias=c["dt_bias"], ssm_states=c["ssm_states"], cache_indices=c["cache_indices"],
                                   query_start_loc=c["query_start_loc"])


@pytest.mark.parametrize("name", ["ssm_states", "cache_indices", "A_log", "dt_bias"])
def test_extend_names_its_pool_and_indices_and_keeps_track_state_off_the_parameters(name):
    c = extend_call()
    if name in ("A_log", "dt_bias"):
        c[name] = c["track_state"].view(-1)[:c[name].numel()].copy_(c[name])
        name = "track_state"
    else:
        c.update({name: c[name].to("meta"), "track_state": None, "track_chunk_idx": None})
    refusal(run_extend, c, ValueError, name)
