"""Bad-input campaign 13 (CPU backend): the vLLM adapters driven as an integrator would. Each case failed before
its fix, except those marked "guard".

- One token a request (1-D slot indices, or a one-column table): vLLM's kernels read request n's token at row
  cu_seqlens[n] and its state at slot n, so an empty request moves the rows after it, not their slots. The
  adapters served row r only where request r was exactly token r: the requests after an empty one got zeros and
  no state step, counted as served. A request of two tokens (vLLM's kernel would store its second token's state
  in the next request's slot) was served as padding (K3) or fell back (vendored); host offsets now raise naming
  cu_seqlens, as other host metadata no kernel can run does (_indices).
- bailing_moe_v3's prefill (vLLM's vendored chunk_kda) passes an fp32 gate and beta beside bf16 q: the adapter
  rounded them to bf16 for kda_prefill and counted the call served; vLLM's kernel reads them in fp32. It falls
  back now, as the K3 sites do; the vendored decode / verify forms read fp32 as it is (guard) and fall back on
  any third dtype (fp16 was rounded to bf16).
- A None where vLLM's signature has a tensor raised AttributeError naming nothing: it falls back, named.
"""
from __future__ import annotations

import pytest
import torch

from flashkda_ext.integrations import _indices, common_checks
from flashkda_ext.reference import kda_decode_step, kda_recurrent
from test_bad_input_campaign12 import chunk as k3_chunk  # K3's chunk call, as campaign 12 builds it
from vllm_adapter_probe import adapter, fell_back

H, K, V, SLOTS = 2, 8, 8, 8
TOL = dict(rtol=2e-5, atol=2e-5)


def rand(*s, seed=[1300]):
    seed[0] += 1
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed[0]))


def k3_one_token(cu, idx):
    """K3's fused_recurrent_kda with 1-D indices (T == N: vLLM asserts it), bounded gate."""
    T = len(cu) - 1
    return dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, H, V), raw_g=rand(1, T, H, K),
                raw_beta=rand(1, T, H), A_log=rand(H) * 0.5, dt_bias=rand(H * K) * 0.5, lower_bound=-5.0,
                initial_state=rand(SLOTS, H, V, K) * 0.3, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                ssm_state_indices=torch.tensor(idx, dtype=torch.int32))


def vendored_one_token(cu, idx):
    """bailing_moe_v3's decode through vLLM's vendored fused_recurrent_kda (log gate, activated beta)."""
    T = len(cu) - 1
    return dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, H, V), g=-rand(1, T, H, K).abs() * 0.3,
                beta=rand(1, T, H).sigmoid(), initial_state=rand(SLOTS, H, V, K) * 0.3, use_qk_l2norm_in_kernel=True,
                cu_seqlens=torch.tensor(cu, dtype=torch.int32), ssm_state_indices=torch.tensor(idx, dtype=torch.int32))


ONE_TOKEN = {"k3.fused_recurrent_kda": (k3_one_token, ("raw_g", "raw_beta")),
             "vendored.fused_recurrent_kda": (vendored_one_token, ("g", "beta"))}


@pytest.mark.parametrize("site", ONE_TOKEN)
@pytest.mark.parametrize("cu,rows", [([0, 0, 1, 2], {0: 1, 1: 2}), ([0, 1, 1, 2], {0: 0, 1: 2}),
                                     ([0, 0, 0, 1], {0: 2})], ids=["empty-first", "empty-middle", "two-empty"])
def test_vllm_one_token_requests_after_an_empty_one_are_served_on_their_rows(site, cu, rows):
    """rows: token row -> request. Each request's token is stepped on its own slot; the empty requests' slots
    and the rows no request owns are left alone (zero output)."""
    make, (gname, bname) = ONE_TOKEN[site]
    call = make(cu, [5, 6, 7])
    pool0 = call["initial_state"].clone()
    o, pool = adapter(site)(**call)
    assert pool is call["initial_state"]
    token_rows, requests = list(rows), list(rows.values())
    slots = torch.tensor([5 + n for n in requests], dtype=torch.int32)
    pick = {n: call[n][0, token_rows] for n in ("q", "k", "v", gname, bname)}
    gate = dict(gate="bounded", lower_bound=-5.0, A_log=call["A_log"], dt_bias=call["dt_bias"]) \
        if site.startswith("k3") else dict(gate="log", beta_is_logit=False)
    want_o, want_pool = kda_decode_step(pick["q"], pick["k"], pick["v"], pick[gname], pick[bname], state=pool0,
                                        state_indices=slots, null_slot0=True, **gate)
    torch.testing.assert_close(o[0, token_rows].double(), want_o, **TOL)
    torch.testing.assert_close(pool.double(), want_pool.double(), **TOL)
    for r in set(range(3)) - set(token_rows):
        assert torch.equal(o[0, r], torch.zeros(H, V))
    for s in set(range(SLOTS)) - set(slots.tolist()):
        assert torch.equal(pool[s], pool0[s])


@pytest.mark.parametrize("site", ONE_TOKEN)
@pytest.mark.parametrize("cu", [[0, 2, 2, 3], [0, 0, 1, 3]], ids=["first", "last"])
def test_vllm_one_token_indices_with_a_longer_request_raise_naming_cu_seqlens(site, cu):
    make, _ = ONE_TOKEN[site]
    call = make(cu, [5, 6, 7])
    pool0 = call["initial_state"].clone()
    with pytest.raises(ValueError, match="cu_seqlens: .*at most one token"):
        adapter(site)(**call)
    assert torch.equal(call["initial_state"], pool0)


def test_the_device_mapping_of_one_token_rows_is_the_hosts(monkeypatch):
    """The device path (no host read) gives the host path's rows for offsets within the contract, and padding
    for a request of more tokens or offsets outside the rows (never an index past them)."""
    gen = torch.Generator().manual_seed(13)
    cases = []
    for _ in range(40):
        N = int(torch.randint(1, 9, (), generator=gen))
        lengths = torch.randint(0, 2, (N,), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        cases.append((cu, torch.randint(-1, 50, (N,), generator=gen, dtype=torch.int32), N))
    host = [_indices.one_token_rows(cu, idx, rows) for cu, idx, rows in cases]
    monkeypatch.setattr(_indices, "host_values", lambda x: False)
    for (cu, idx, rows), want in zip(cases, host):
        assert torch.equal(_indices.one_token_rows(cu, idx, rows), want)
    cu = torch.tensor([0, 2, 3, 9, 4], dtype=torch.int32)        # a two-token request, then offsets past the rows
    got = _indices.one_token_rows(cu, torch.tensor([11, 12, 13, 14], dtype=torch.int32), 4)
    assert got.tolist() == [-1, -1, 12, -1]


# --- bailing_moe_v3: the gate's dtype ---------------------------------------------------------------------------

def bailing_chunk(**over):
    T = 12
    kw = dict(q=rand(1, T, H, K).bfloat16(), k=rand(1, T, H, K).bfloat16(), v=rand(1, T, H, V).bfloat16(),
              g=-rand(1, T, H, K).abs() * 0.3, beta=rand(1, T, H).sigmoid(), initial_state=rand(2, H, V, K) * 0.3,
              output_final_state=True, use_qk_l2norm_in_kernel=True, safe_gate=False, lower_bound=None,
              cu_seqlens=torch.tensor([0, 5, T], dtype=torch.int32))
    kw.update(over)
    return kw


def test_vllm_bailing_prefill_with_its_fp32_gate_falls_back():
    """bailing_moe_v3 passes fused_kda_gate's fp32 output and an fp32 beta beside bf16 q; kda_prefill reads them in
    q's dtype, so serving would round what vLLM's kernel reads."""
    fell_back("vendored.chunk_kda", lambda: adapter("vendored.chunk_kda")(**bailing_chunk()),
              "g of dtype torch.float32")


def test_vllm_bailing_prefill_in_qs_dtype_is_served():
    """Guard: g and beta in q's dtype are what kda_prefill reads: served, the float64 reference's result."""
    call = bailing_chunk()
    call.update(g=call["g"].bfloat16(), beta=call["beta"].bfloat16())
    o, h = adapter("vendored.chunk_kda")(**call)
    want_o, want_h, _ = kda_recurrent(*(call[n].double() for n in ("q", "k", "v", "g", "beta")), gate="log",
                                      beta_is_logit=False, cu_seqlens=call["cu_seqlens"],
                                      initial_state=call["initial_state"])
    torch.testing.assert_close(o.double(), want_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.double(), want_h, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["g", "beta"])
def test_vllm_vendored_decode_gate_in_a_third_dtype_falls_back(name):
    call = vendored_one_token([0, 1, 2, 3], [1, 2, 3])
    call.update(q=call["q"].bfloat16(), k=call["k"].bfloat16(), v=call["v"].bfloat16())
    call[name] = call[name].half()
    pool0 = call["initial_state"].clone()
    fell_back("vendored.fused_recurrent_kda", lambda: adapter("vendored.fused_recurrent_kda")(**call),
              f"{name} of dtype torch.float16")
    assert torch.equal(call["initial_state"], pool0)


def test_vllm_vendored_decode_fp32_gate_beside_bf16_q_is_served():
    """Guard: kda_decode reads an fp32 gate and beta as they are (what vLLM's kernel reads)."""
    call = vendored_one_token([0, 1, 2, 3], [1, 2, 3])
    call.update(q=call["q"].bfloat16(), k=call["k"].bfloat16(), v=call["v"].bfloat16())
    pool0 = call["initial_state"].clone()
    o, pool = adapter("vendored.fused_recurrent_kda")(**call)
    want_o, want_pool = kda_decode_step(*(call[n][0] for n in ("q", "k", "v", "g", "beta")), state=pool0,
                                        state_indices=call["ssm_state_indices"], gate="log", beta_is_logit=False,
                                        null_slot0=True)
    torch.testing.assert_close(o[0].double(), want_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pool.double(), want_pool.double(), rtol=2e-2, atol=2e-2)


# --- a None where vLLM passes a tensor --------------------------------------------------------------------------

NONE_CASES = [("k3.chunk_kda_with_fused_gate", k3_chunk, name) for name in ("q", "k", "v", "raw_g", "raw_beta")] + \
    [("k3.fused_recurrent_kda", lambda **o: {**k3_one_token([0, 1, 2], [1, 2]), **o}, name)
     for name in ("q", "v", "raw_g", "raw_beta")] + \
    [("vendored.chunk_kda", bailing_chunk, name) for name in ("q", "k", "v", "g", "beta")] + \
    [("vendored.fused_recurrent_kda", lambda **o: {**vendored_one_token([0, 1, 2], [1, 2]), **o}, name)
     for name in ("q", "k", "v", "g")]


@pytest.mark.parametrize("site,make,name", NONE_CASES, ids=[f"{s}-{n}" for s, _, n in NONE_CASES])
def test_vllm_none_where_a_tensor_is_due_falls_back_naming_it(site, make, name):
    call = make(**{name: None})
    fell_back(site, lambda: adapter(site)(**call), f"{name} is NoneType")


def test_narrow_int32_refuses_unsigned_dtypes_that_would_wrap():
    """An index tensor of uint64 became int64 by wrapping (2**64 - 1 -> -1: padding) before the range check."""
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        with pytest.raises(ValueError, match="ssm_state_indices: .*unsigned"):
            common_checks.narrow_int32("ssm_state_indices", torch.tensor([4, 2], dtype=dtype))
