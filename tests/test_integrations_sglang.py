"""flashkda_ext.integrations.sglang on the CPU backend: SGLang's decode / extend / target_verify call shapes
(views into a packed projection, fp32 gate and beta beside bf16 q, A_log [1, 1, HV, 1], -1 padding, the
intermediate state buffer of a verify) against flashkda_ext.reference."""
import pytest
import torch

from flashkda_ext.integrations.sglang import FlashKDAExtKernel
from flashkda_ext.reference import kda_decode_step, kda_recurrent

H, K, V, SLOTS = 2, 8, 16, 6     # HV == H; K != V catches a transposed state
TOL = dict(rtol=2e-5, atol=2e-5)


def packed_qkv(T, gen, dtype=torch.float32):
    """q, k, v as SGLang makes them: views into one [T, 2*H*K + H*V] projection, unsqueezed to [1, T, ., .]."""
    mixed = torch.randn(T, 2 * H * K + H * V, generator=gen).to(dtype)
    q, k, v = mixed.split([H * K, H * K, H * V], dim=-1)
    return (q.unflatten(-1, (H, K)).unsqueeze(0), k.unflatten(-1, (H, K)).unsqueeze(0),
            v.unflatten(-1, (H, V)).unsqueeze(0))


def params(gen):
    return torch.randn(1, 1, H, 1, generator=gen) * 0.3, torch.randn(H * K, generator=gen) * 0.5


def test_decode_matches_the_reference_and_updates_the_pool():
    gen = torch.Generator().manual_seed(0)
    N = 4
    q, k, v = packed_qkv(N, gen)
    assert not q.is_contiguous()
    a, b = torch.randn(N, H * K, generator=gen), torch.randn(1, N, H, generator=gen)
    A_log, dt_bias = params(gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    pool0 = pool.clone()
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    o = FlashKDAExtKernel().decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
                                   query_start_loc=torch.arange(N + 1, dtype=torch.int32))
    assert o.shape == (1, N, H, V)
    want_o, want_pool = kda_decode_step(q[0], k[0], v[0], a.view(N, H, K), b[0], state=pool0, state_indices=idx,
                                        A_log=A_log.flatten(), dt_bias=dt_bias)
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)
    assert torch.equal(o[0, 1], torch.zeros(H, V))   # the padding row


def test_decode_with_fp32_gate_and_beta_beside_bf16_q():
    gen = torch.Generator().manual_seed(1)
    N = 3
    q, k, v = packed_qkv(N, gen, torch.bfloat16)
    a, b = torch.randn(1, N, H, K, generator=gen), torch.randn(N, H, generator=gen)   # fp32, as engines make them
    A_log, dt_bias = params(gen)
    pool = torch.zeros(SLOTS, H, V, K)
    idx = torch.tensor([1, 3, 4], dtype=torch.int32)
    from flashkda_ext import ops
    seen = []
    real = ops.kda_decode

    def spy(q, k, v, g, beta, **kw):
        seen.append((g.dtype, beta.dtype))
        return real(q, k, v, g, beta, **kw)
    ops.kda_decode = spy
    try:
        o = FlashKDAExtKernel().decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
                                       cache_indices=idx, query_start_loc=torch.arange(N + 1, dtype=torch.int32))
    finally:
        ops.kda_decode = real
    assert o.dtype == torch.bfloat16
    # kda_decode reads the fp32 gate and beta natively: no cast, and the reference reads the same fp32 values
    assert seen == [(torch.float32, torch.float32)]
    want_o, _ = kda_decode_step(q[0], k[0], v[0], a[0], b, state=torch.zeros(SLOTS, H, V, K),
                                state_indices=idx, A_log=A_log.flatten(), dt_bias=dt_bias)
    torch.testing.assert_close(o[0].double(), want_o, rtol=6e-3, atol=1e-4)


def extend_case(seed=2, lens=(5, 9)):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = packed_qkv(T, gen)
    g = torch.randn(1, T, H, K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)       # activated (SGLang's default)
    A_log, dt_bias = params(gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    qsl = torch.tensor([0, lens[0], T], dtype=torch.int32)
    return q, k, v, g, beta, A_log, dt_bias, pool, qsl, list(lens)


def reference_extend(q, k, v, g, beta, A_log, dt_bias, pool, qsl, idx, checkpoint_every=0):
    return kda_recurrent(q, k, v, g, beta, A_log=A_log.flatten(), dt_bias=dt_bias, beta_is_logit=False,
                         cu_seqlens=qsl, initial_state=pool, state_indices=idx, checkpoint_every=checkpoint_every)


def test_extend_commits_to_the_pool_and_returns_fla_style_chunk_states():
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case()
    pool0 = pool.clone()
    idx = torch.tensor([4, 1], dtype=torch.int32)
    o, h = FlashKDAExtKernel(chunk_size=4).extend(q, k, v, g, beta, ssm_states=pool, cache_indices=idx,
                                                  query_start_loc=qsl, A_log=A_log, dt_bias=dt_bias,
                                                  extend_seq_lens_cpu=lens, return_intermediate_states=True)
    want_o, want_pool, want_ckpt = reference_extend(q, k, v, g, beta, A_log, dt_bias, pool0, qsl, idx,
                                                    checkpoint_every=4)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)
    # h: request 0 (5 tokens) has chunks starting at 0, 4; request 1 (9 tokens) at 0, 4, 8
    assert h.shape == (1, 2 + 3, H, V, K)
    want_h = torch.stack([pool0[4].double(), want_ckpt[0, 0], pool0[1].double(), want_ckpt[1, 0], want_ckpt[1, 1]])
    torch.testing.assert_close(h[0].double(), want_h, **TOL)


def test_extend_names_the_longest_request_for_the_route(monkeypatch):
    """The host lengths SGLang passes go to kda_prefill as max_seqlen (routing only: a long request among short
    ones keeps the fused chunk-16 kernel's one-CTA chain off it); without them the route sees None."""
    from flashkda_ext import ops
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=7, lens=(3, 11))
    seen, real = [], ops.kda_prefill

    def spy(*args, **kw):
        seen.append(kw.get("max_seqlen"))
        return real(*args, **kw)
    monkeypatch.setattr(ops, "kda_prefill", spy)
    idx = torch.tensor([4, 1], dtype=torch.int32)
    kernel = FlashKDAExtKernel()
    kernel.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=idx, query_start_loc=qsl, A_log=A_log,
                  dt_bias=dt_bias, extend_seq_lens_cpu=lens)
    kernel.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=idx, query_start_loc=qsl, A_log=A_log,
                  dt_bias=dt_bias)
    assert seen == [11, None]


def test_decode_and_extend_serve_a_pool_whose_slots_sit_apart():
    """SGLang's MambaPool hands each layer a dense slice; a paged pool (slots apart, docs/semantics.md "Strided
    pools") is served too, as it is: bitwise the dense pool's results, the gaps between slots unchanged."""
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=5)
    pages = torch.randn(SLOTS, 8 + H * V * K, generator=torch.Generator().manual_seed(6))
    paged = pages[:, 4:4 + H * V * K].view(SLOTS, H, V, K)
    paged.copy_(pool)
    pages0 = pages.clone()
    idx = torch.tensor([4, 1], dtype=torch.int32)
    kernel = FlashKDAExtKernel(chunk_size=4)
    for ssm in (paged, pool):
        o = kernel.extend(q, k, v, g, beta, ssm_states=ssm, cache_indices=idx, query_start_loc=qsl, A_log=A_log,
                          dt_bias=dt_bias, extend_seq_lens_cpu=lens)
        o_dec = kernel.decode(q[:, :3], k[:, :3], v[:, :3], g[0, :3].flatten(1), beta[:, :3], A_log=A_log,
                              dt_bias=dt_bias, ssm_states=ssm, cache_indices=torch.tensor([4, -1, 2], dtype=torch.int32),
                              query_start_loc=torch.arange(4, dtype=torch.int32))
        if ssm is paged:
            o_paged, dec_paged = o, o_dec
    assert torch.equal(o_paged, o) and torch.equal(dec_paged, o_dec) and torch.equal(paged, pool)
    assert torch.equal(pages[:, :4], pages0[:, :4]) and torch.equal(pages[:, 4 + H * V * K:], pages0[:, 4 + H * V * K:])


class Recorder:
    """Stands in for SGLang's TritonKDAKernel as the fallback: records the call, returns a marker."""
    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        def call(*args, **kwargs):
            self.calls.append((method, args, kwargs))
            return ("triton", method)
        return call


@pytest.mark.parametrize("extra, reason", [
    (dict(is_spec_decode=True), "draft extend"),
    (dict(chunk_indices=torch.zeros(3, 2, dtype=torch.int32), chunk_offsets=torch.zeros(3, dtype=torch.int32)),
     "chunk tables"),
    (dict(num_state_checkpoints=2, state_checkpoint_indices=torch.zeros(2, dtype=torch.int32)), "checkpoint plan"),
    (dict(A_log=None), "dt_bias without A_log"),
])
def test_extend_fallbacks_are_counted_and_write_nothing(extra, reason):
    from flashkda_ext.integrations.sglang import REASONS, STATS
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=3, lens=(3, 4))
    pool0 = pool.clone()
    call = {**dict(ssm_states=pool, cache_indices=torch.tensor([2, -1], dtype=torch.int32), query_start_loc=qsl,
                   A_log=A_log, dt_bias=dt_bias), **extra}
    before = STATS["extend", "fell_back"]
    with pytest.raises(NotImplementedError, match=reason):
        FlashKDAExtKernel().extend(q, k, v, g, beta, **call)
    fallback = Recorder()
    assert FlashKDAExtKernel(fallback=fallback).extend(q, k, v, g, beta, **call) == ("triton", "extend")
    (method, args, kwargs), = fallback.calls
    assert method == "extend" and args[0] is q and all(kwargs[key] is val for key, val in call.items())
    assert STATS["extend", "fell_back"] == before + 2 and any(reason in r for (m, r) in REASONS if m == "extend")
    assert torch.equal(pool, pool0)


def test_extend_raw_beta_and_bounded_gate():
    q, k, v, g, _, A_log, dt_bias, pool, qsl, lens = extend_case(seed=4)
    b = torch.randn(1, sum(lens), H)
    pool0 = pool.clone()
    idx = torch.tensor([0, 3], dtype=torch.int32)
    o = FlashKDAExtKernel().extend(q, k, v, g, b, ssm_states=pool, cache_indices=idx, query_start_loc=qsl,
                                   A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, beta_is_raw=True)
    want_o, want_pool, _ = kda_recurrent(q, k, v, g, b, gate="bounded", lower_bound=-5.0, A_log=A_log.flatten(),
                                         dt_bias=dt_bias, cu_seqlens=qsl, initial_state=pool0, state_indices=idx)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


def test_bad_calls_are_named():
    kern = FlashKDAExtKernel()
    q, k, v = packed_qkv(3, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="one token per request"):
        kern.decode(q, k, v, torch.zeros(3, H * K), torch.zeros(3, H), A_log=torch.zeros(H), dt_bias=torch.zeros(H * K),
                    ssm_states=torch.zeros(SLOTS, H, V, K), cache_indices=torch.zeros(2, dtype=torch.int32),
                    query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        kern.decode(q, k, v, None, None, A_log=None, dt_bias=None, ssm_states=None, cache_indices=None,
                    query_start_loc=None, replayssm_d=1)


# ---------------------------------------------------------------------------------------------
# target_verify: SGLang's chain verify (committed pool read, per-step states into the intermediate buffer)

def verify_case(lens, steps, rows, cidx, seed=7, dtype=torch.float32, state_dtype=torch.float32, buf_rows=5):
    """A target_verify call as SGLang's KDA backend makes it, with the buffer poisoned (NaN)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = packed_qkv(T, gen, dtype)
    a, b = torch.randn(T, H * K, generator=gen), torch.randn(T, H, generator=gen)   # fp32 raw gate, beta logit
    A_log, dt_bias = params(gen)
    pool = (torch.randn(SLOTS, H, V, K, generator=gen) * 0.3).to(state_dtype)
    buf = torch.full((buf_rows, steps, H, V, K), float("nan"), dtype=state_dtype)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, ssm_states=pool,
                cache_indices=torch.tensor(cidx, dtype=torch.int32), query_start_loc=qsl,
                intermediate_states_buffer=buf, intermediate_state_indices=torch.tensor(rows, dtype=torch.int32))


def call_verify(case, **extra):
    c = dict(case, **extra)
    return FlashKDAExtKernel().target_verify(c.pop("A_log"), c.pop("dt_bias"), c.pop("q"), c.pop("k"), c.pop("v"),
                                             c.pop("a"), c.pop("b"), **c)


def reference_verify(case, parents=None):
    """The token recurrence (kda_decode_step, one token at a time) from each request's committed slot; the
    state after each token stored in the buffer's dtype and continued from there (with parents [N, S], a
    draft tree: token t >= 1 from what token parents[n, t] stored). Returns (out, buffer)."""
    c = case
    q, k, v, pool, buf = c["q"][0], c["k"][0], c["v"][0], c["ssm_states"], c["intermediate_states_buffer"].clone()
    # a / b in fp32 or q's dtype are read as they are (kda_verify's fp32 reads), another float in fp32
    a, b = (x if x.dtype in (torch.float32, q.dtype) else x.float() for x in (c["a"], c["b"]))
    a = a.view(-1, H, K)
    out = torch.zeros(q.shape[0], H, V, dtype=torch.float64)
    offsets = c["query_start_loc"].tolist()
    one = torch.zeros(1, dtype=torch.int32)
    for n, (slot, row) in enumerate(zip(c["cache_indices"].tolist(), c["intermediate_state_indices"].tolist())):
        if slot < 0 or row < 0:
            continue
        state = pool[slot:slot + 1].clone()
        for t, i in enumerate(range(offsets[n], offsets[n + 1])):
            if parents is not None and t > 0:
                state = buf[row, int(parents[n, t])].unsqueeze(0).clone()
            o, state = kda_decode_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], a[i:i + 1], b[i:i + 1], state=state,
                                       state_indices=one, A_log=c["A_log"].flatten(), dt_bias=c["dt_bias"])
            out[i] = o[0]
            buf[row, t] = state[0]
    return out, buf


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_target_verify_matches_the_token_recurrence_and_never_writes_the_pool():
    # 3 requests of 3 drafts (SGLang's shape), buffer rows out of order, its steps (4) above cache_steps (3),
    # request 1 a padding request (cache index -1)
    case = verify_case([3, 3, 3], steps=4, rows=[3, 0, 1], cidx=[4, -1, 2])
    pool0, buf0 = case["ssm_states"].clone(), case["intermediate_states_buffer"].clone()
    o = call_verify(case, cache_steps=3)
    assert o.shape == (1, 9, H, V) and not torch.isnan(o).any()
    want_o, want_buf = reference_verify(dict(case, intermediate_states_buffer=buf0))
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    assert torch.equal(o[0, 3:6], torch.zeros(3, H, V))                        # the padding request
    assert torch.equal(bits(case["ssm_states"]), bits(pool0))                  # the committed pool: untouched
    buf = case["intermediate_states_buffer"]
    for row in (3, 1):
        torch.testing.assert_close(buf[row, :3], want_buf[row, :3], **TOL)
    # everything else stays bitwise as it was (NaN): the padding request's row, unused rows, step 3
    written = torch.zeros(buf.shape[:2], dtype=torch.bool)
    written[3, :3] = written[1, :3] = True
    assert torch.equal(bits(buf[~written]), bits(buf0[~written]))


def test_target_verify_reads_fp32_gate_and_beta_as_they_are():
    """An fp32 raw gate a and beta logit b beside bf16 q (as SGLang's projection may hand them) reach kda_verify as
    fp32 (its routes' _gb32 twins read them; SGLang's kernel reads them unrounded): the result is bitwise
    kda_verify's on the same fp32 values, not on values rounded to q's dtype."""
    from flashkda_ext import ops
    case = verify_case([3, 2], steps=3, rows=[0, 2], cidx=[1, 4], seed=23, dtype=torch.bfloat16)
    buf0 = case["intermediate_states_buffer"].clone()
    o = call_verify(case)
    H_, K_ = case["q"].shape[2], case["q"].shape[3]
    T = case["q"].shape[1]
    common = dict(state=None, state_indices=case["intermediate_state_indices"], cu_seqlens=case["query_start_loc"],
                  max_seqlen=3, A_log=case["A_log"].flatten(), dt_bias=case["dt_bias"], gate="softplus",
                  beta_is_logit=True, initial_state=case["ssm_states"], initial_state_indices=case["cache_indices"])
    outs = {}
    for name, dtype in (("fp32", torch.float32), ("rounded", torch.bfloat16)):
        buf = buf0.clone()
        g = case["a"].to(dtype).view(1, T, H_, K_)
        beta = case["b"].to(dtype).view(1, T, H_)
        outs[name] = ops.kda_verify(case["q"], case["k"], case["v"], g, beta, **dict(common, state=buf)), buf
    assert torch.equal(bits(o), bits(outs["fp32"][0]))
    assert torch.equal(bits(case["intermediate_states_buffer"]), bits(outs["fp32"][1]))
    assert not torch.equal(bits(o), bits(outs["rounded"][0]))     # the cast this replaces would have changed it


@pytest.mark.parametrize("site", ["target_verify", "decode"])
def test_fp16_gate_and_beta_beside_bf16_q_are_read_as_fp32_not_rounded(site):
    """An fp16 raw gate a / beta logit b beside bf16 q (SGLang's kernel reads fp16 unrounded) reaches kda_verify /
    kda_decode widened to fp32 (exact), not rounded to q's bf16: the result is bitwise the call with the fp32-widened
    a / b, and differs from the call with bf16-rounded ones."""
    case = (verify_case([3, 2], steps=3, rows=[0, 2], cidx=[1, 4], seed=29, dtype=torch.bfloat16)
            if site == "target_verify" else     # decode: one token a request
            verify_case([1, 1, 1], steps=1, rows=[0, 2, 4], cidx=[1, 4, 3], seed=29, dtype=torch.bfloat16))
    a16, b16 = case["a"].half(), case["b"].half()
    got = {}
    for name, (a, b) in {"fp16": (a16, b16), "fp32": (a16.float(), b16.float()),
                         "bf16": (a16.bfloat16(), b16.bfloat16())}.items():
        c = dict(case, a=a, b=b, ssm_states=case["ssm_states"].clone(),
                 intermediate_states_buffer=case["intermediate_states_buffer"].clone())
        if site == "target_verify":
            o = call_verify(c)
            got[name] = (bits(o), bits(c["intermediate_states_buffer"]))
        else:
            N = c["q"].shape[1]
            o = FlashKDAExtKernel().decode(c["q"], c["k"], c["v"], a.view(1, N, H, K), b.view(N, H), A_log=c["A_log"],
                                           dt_bias=c["dt_bias"], ssm_states=c["ssm_states"],
                                           cache_indices=c["cache_indices"], query_start_loc=c["query_start_loc"])
            got[name] = (bits(o), bits(c["ssm_states"]))
    assert all(torch.equal(x, y) for x, y in zip(got["fp16"], got["fp32"]))
    assert not torch.equal(got["fp16"][0], got["bf16"][0])      # the rounding this replaces would have changed it


def test_target_verify_mixed_draft_counts_bf16():
    # T_n = 4, 1, 2 (the Triton kernel runs per-request lengths from query_start_loc); bf16 q, pool and buffer
    case = verify_case([4, 1, 2], steps=4, rows=[2, 4, 0], cidx=[0, 5, 3], seed=8, dtype=torch.bfloat16,
                       state_dtype=torch.bfloat16)
    buf0, pool0 = case["intermediate_states_buffer"].clone(), case["ssm_states"].clone()
    o = call_verify(case)
    assert o.dtype == torch.bfloat16
    want_o, want_buf = reference_verify(dict(case, intermediate_states_buffer=buf0))
    torch.testing.assert_close(o[0].double(), want_o, rtol=2e-2, atol=2e-2)
    buf = case["intermediate_states_buffer"]
    for row, n in ((2, 4), (4, 1), (0, 2)):
        torch.testing.assert_close(buf[row, :n].double(), want_buf[row, :n].double(), rtol=2e-2, atol=2e-2)
        assert torch.isnan(buf[row, n:]).all()
    assert torch.isnan(buf[[1, 3]]).all() and torch.equal(bits(case["ssm_states"]), bits(pool0))


def test_target_verify_one_draft_and_requests_without_a_row():
    # cache_steps = 1 (kda_verify serves it with the decode module); request 1 has no buffer row (-1) and is
    # padding, while request 0 owns row 0, the row a clamped -1 would name
    case = verify_case([1, 1, 1], steps=1, rows=[0, -1, 2], cidx=[1, 3, 5], seed=9, buf_rows=3)
    buf0 = case["intermediate_states_buffer"].clone()
    o = call_verify(case, cache_steps=1)
    want_o, want_buf = reference_verify(dict(case, intermediate_states_buffer=buf0))
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    assert torch.equal(o[0, 1], torch.zeros(H, V))
    buf = case["intermediate_states_buffer"]
    torch.testing.assert_close(buf[[0, 2]], want_buf[[0, 2]], **TOL)
    assert torch.isnan(buf[1]).all()


def test_target_verify_empty_requests_write_nothing():
    # requests 1 and 3 have no drafts (T_n = 0) but live cache indices and buffer rows, as a batch padded to a
    # CUDA-graph size may have: they read nothing and their rows stay bitwise as they were (NaN)
    case = verify_case([3, 0, 2, 0], steps=3, rows=[1, 0, 4, 2], cidx=[2, 5, 0, 3], seed=10)
    buf0, pool0 = case["intermediate_states_buffer"].clone(), case["ssm_states"].clone()
    o = call_verify(case)
    assert o.shape == (1, 5, H, V) and not torch.isnan(o).any()
    want_o, want_buf = reference_verify(dict(case, intermediate_states_buffer=buf0))
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    buf = case["intermediate_states_buffer"]
    torch.testing.assert_close(buf[1, :3], want_buf[1, :3], **TOL)
    torch.testing.assert_close(buf[4, :2], want_buf[4, :2], **TOL)
    assert torch.isnan(buf[[0, 2, 3]]).all() and torch.isnan(buf[4, 2:]).all()
    assert torch.equal(bits(case["ssm_states"]), bits(pool0))


@pytest.mark.parametrize("bad, match", [
    (dict(intermediate_states_buffer=None), "intermediate_states_buffer: expected a tensor"),
    (dict(intermediate_states_buffer=torch.zeros(5, 3, H, K, V)), r"intermediate_states_buffer: expected \[R, S"),
    (dict(intermediate_states_buffer=torch.zeros(5, 3, H, V, K, dtype=torch.bfloat16)), "dtype of ssm_states"),
    (dict(intermediate_states_buffer=torch.zeros(3, 5, H, V, K).transpose(0, 1)), "contiguous"),
    (dict(intermediate_state_indices=torch.tensor([1, 1], dtype=torch.int32)), "row 1 is used by requests 0 and 1"),
    (dict(intermediate_state_indices=torch.tensor([0, 5], dtype=torch.int32)), "entry 1 = 5 is out of range"),
    (dict(intermediate_state_indices=torch.tensor([0], dtype=torch.int32)), r"intermediate_state_indices: expected"),
    (dict(intermediate_state_indices=torch.tensor([0, 2**32 + 1])), r"entry \[1\] = 4294967297 is out of range: expected values <= 2147483647"),
    (dict(cache_indices=torch.tensor([1, 2**32 + 4])), r"cache_indices: entry \[1\] = 4294967300 is out of range: expected values <= 2147483647"),
    (dict(cache_indices=torch.tensor([0, SLOTS], dtype=torch.int32)), "cache_indices: entry 1"),
    (dict(ssm_states=torch.zeros(SLOTS, H, K, V)), r"ssm_states: expected the pool"),
    (dict(cache_steps=4), r"cache_steps: expected an int in \[1, S = 3\]"),
    (dict(cache_steps=2), "query_start_loc: a request has 3 draft tokens, more than cache_steps = 2"),
    (dict(replayssm_d=torch.zeros(1)), "unexpected keyword arguments"),
])
def test_target_verify_refusals_write_nothing(bad, match):
    case = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=10)
    buf, pool = case["intermediate_states_buffer"], case["ssm_states"]
    buf0, pool0 = buf.clone(), pool.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        call_verify(case, **bad)
    assert torch.equal(bits(buf), bits(buf0)) and torch.equal(pool, pool0)


# ---------------------------------------------------------------------------------------------
# SGLang 0.5.23's additions: packed decode, the track snapshot, the per-pool row table, index ranges

def test_packed_decode_matches_decode_and_the_reference():
    gen = torch.Generator().manual_seed(11)
    N = 4
    mixed = torch.randn(N, 2 * H * K + H * V, generator=gen)
    a, b = torch.randn(N, H * K, generator=gen), torch.randn(N, H, generator=gen)
    A_log, dt_bias = params(gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    pool0 = pool.clone()
    idx = torch.tensor([3, 0, -1, 5], dtype=torch.int32)
    o = FlashKDAExtKernel().packed_decode(mixed, a, b, A_log=A_log, dt_bias=dt_bias, scale=0.7, ssm_states=pool,
                                          cache_indices=idx, num_v_heads=H, head_v_dim=V, lower_bound=-4.0,
                                          replayssm_d=None, replayssm_k=None, replayssm_g=None,
                                          replayssm_write_pos=None, replayssm_force_flush=None)
    q, k, v = (x.reshape(N, -1, d) for x, d in zip(mixed.split([H * K, H * K, H * V], -1), (K, K, V)))
    want_o, want_pool = kda_decode_step(q, k, v, a.view(N, H, K), b, state=pool0, state_indices=idx,
                                        A_log=A_log.flatten(), dt_bias=dt_bias, gate="bounded", lower_bound=-4.0,
                                        scale=0.7)
    assert o.shape == (1, N, H, V)
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


def test_packed_decode_ring_falls_back_exactly_when_sglangs_triton_switches_kernels():
    gen = torch.Generator().manual_seed(12)
    mixed, a, b = torch.randn(2, 2 * H * K + H * V, generator=gen), torch.randn(2, H * K), torch.randn(2, H)
    A_log, dt_bias = params(gen)
    ring = dict(replayssm_d=torch.zeros(1), replayssm_k=torch.zeros(1), replayssm_g=torch.zeros(1),
                replayssm_write_pos=torch.zeros(2, dtype=torch.int32), replayssm_force_flush=None)
    call = dict(A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, ssm_states=torch.zeros(SLOTS, H, V, K),
                cache_indices=torch.tensor([1, 2], dtype=torch.int32), num_v_heads=H, head_v_dim=V, **ring)
    fallback = Recorder()
    assert FlashKDAExtKernel(fallback=fallback).packed_decode(mixed, a, b, **call) == ("triton", "packed_decode")
    assert fallback.calls[0][2]["replayssm_write_pos"] is ring["replayssm_write_pos"]
    # with a lower_bound SGLang's Triton kernel runs its plain packed decode (the ring is unused): served
    o = FlashKDAExtKernel(fallback=fallback).packed_decode(mixed, a, b, lower_bound=-5.0, **call)
    assert o.shape == (1, 2, H, V) and len(fallback.calls) == 1


@pytest.mark.parametrize("where", ["decode", "packed_decode"])
def test_decode_int64_index_past_int32_is_named_and_writes_nothing(where):
    gen = torch.Generator().manual_seed(13)
    q, k, v = packed_qkv(2, gen)
    A_log, dt_bias = params(gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen)
    pool0 = pool.clone()
    idx = torch.tensor([2**32 + 1, 0])           # wraps to slot 1 if narrowed without a check
    kern = FlashKDAExtKernel()
    with pytest.raises(ValueError, match=r"cache_indices: entry \[0\] = 4294967297 is out of range"):
        if where == "decode":
            kern.decode(q, k, v, torch.zeros(2, H * K), torch.zeros(2, H), A_log=A_log, dt_bias=dt_bias,
                        ssm_states=pool, cache_indices=idx, query_start_loc=torch.arange(3, dtype=torch.int32))
        else:
            kern.packed_decode(torch.randn(2, 2 * H * K + H * V), torch.zeros(2, H * K), torch.zeros(2, H),
                               A_log=A_log, dt_bias=dt_bias, scale=0.3, ssm_states=pool, cache_indices=idx,
                               num_v_heads=H, head_v_dim=V)
    assert torch.equal(pool, pool0)


def test_decode_reads_host_offsets():
    gen = torch.Generator().manual_seed(14)
    q, k, v = packed_qkv(3, gen)
    A_log, dt_bias = params(gen)
    with pytest.raises(ValueError, match=r"query_start_loc: decode expects offsets 0, 1, \.\.\., N"):
        FlashKDAExtKernel().decode(q, k, v, torch.zeros(3, H * K), torch.zeros(3, H), A_log=A_log, dt_bias=dt_bias,
                                   ssm_states=torch.zeros(SLOTS, H, V, K),
                                   cache_indices=torch.tensor([0, 1, 2], dtype=torch.int32),
                                   query_start_loc=torch.tensor([0, 2, 2, 3], dtype=torch.int32))


def test_extend_writes_the_track_snapshot_as_sglangs_chunk_kda():
    """track_state[n] = the fp32 state entering chunk track_chunk_idx[n] (chunks of 4 here); -1 and a chunk
    past the request leave the row alone; h is not materialized (SGLang reads the snapshot instead)."""
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=15, lens=(5, 9))
    qsl = torch.tensor([0, 5, 14, 14], dtype=torch.int32)           # a third, empty request
    idx = torch.tensor([4, 1, 3], dtype=torch.int32)
    pool0 = pool.clone()
    track = torch.full((4, H, V, K), 7.0)
    chunk_idx = torch.tensor([1, 2, 0, 0], dtype=torch.int32)        # request 2 is empty: chunk 0 is past it
    o, h = FlashKDAExtKernel(chunk_size=4).extend(
        q, k, v, g, beta, ssm_states=pool, cache_indices=idx, query_start_loc=qsl, A_log=A_log, dt_bias=dt_bias,
        extend_seq_lens_cpu=[5, 9, 0], return_intermediate_states=True, track_state=track,
        track_chunk_idx=chunk_idx, track_ssm_h_src=torch.tensor([1, 4]), track_ssm_h_batch_src=torch.tensor([0, 1]),
        extend_prefix_lens=torch.tensor([0, 3, 0]), layer_id=3)
    assert h is None
    want_o, want_pool, ckpt = reference_extend(q, k, v, g, beta, A_log, dt_bias, pool0, qsl, idx, checkpoint_every=4)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)
    torch.testing.assert_close(track[0].double(), ckpt[0, 0], **TOL)   # after 4 tokens of request 0
    torch.testing.assert_close(track[1].double(), ckpt[1, 1], **TOL)   # after 8 tokens of request 1
    assert torch.equal(track[2:], torch.full((2, H, V, K), 7.0))


def test_extend_h_only_where_sglang_reads_it():
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=16)
    idx = torch.tensor([4, 1], dtype=torch.int32)
    kern = FlashKDAExtKernel(chunk_size=4)
    o, h = kern.extend(q, k, v, g, beta, ssm_states=pool.clone(), cache_indices=idx, query_start_loc=qsl,
                       A_log=A_log, dt_bias=dt_bias, return_intermediate_states=True,
                       track_ssm_h_src=torch.zeros(0, dtype=torch.int64))
    assert h is None and o.shape == (1, sum(lens), H, V)
    o2, h2 = kern.extend(q, k, v, g, beta, ssm_states=pool.clone(), cache_indices=idx, query_start_loc=qsl,
                         A_log=A_log, dt_bias=dt_bias, return_intermediate_states=True,
                         track_ssm_h_src=torch.tensor([1]))
    assert torch.equal(o, o2) and h2.shape == (1, 5, H, V, K)


def test_extend_out_of_range_index_with_intermediate_states_is_named_not_an_index_error():
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=17)
    pool0 = pool.clone()
    with pytest.raises(ValueError, match="state_indices"):
        FlashKDAExtKernel(chunk_size=4).extend(q, k, v, g, beta, ssm_states=pool,
                                               cache_indices=torch.tensor([1, SLOTS + 3], dtype=torch.int32),
                                               query_start_loc=qsl, A_log=A_log, dt_bias=dt_bias,
                                               return_intermediate_states=True)
    assert torch.equal(pool, pool0)


@pytest.mark.parametrize("intermediate", [False, True])
def test_extend_host_lengths_are_compared_with_the_offsets(intermediate):
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=18, lens=(5, 9))
    pool0 = pool.clone()
    for bad, match in (([9, 5], r"\[9, 5\] disagrees with the lengths in query_start_loc \[5, 9\]"),
                       ([5, 8], "summing to T = 14"), ([14], "expected N = 2 lengths")):
        with pytest.raises(ValueError, match=f"extend_seq_lens_cpu: .*{match}"):
            FlashKDAExtKernel(chunk_size=4).extend(q, k, v, g, beta, ssm_states=pool,
                                                   cache_indices=torch.tensor([1, 2], dtype=torch.int32),
                                                   query_start_loc=qsl, A_log=A_log, dt_bias=dt_bias,
                                                   extend_seq_lens_cpu=bad, return_intermediate_states=intermediate)
    assert torch.equal(pool, pool0)


def test_extend_and_verify_refuse_unknown_keywords():
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=19)
    with pytest.raises(TypeError, match=r"extend: unexpected keyword arguments \['chunk_size_hint'\]"):
        FlashKDAExtKernel().extend(q, k, v, g, beta, ssm_states=pool, cache_indices=torch.tensor([1, 2]),
                                   query_start_loc=qsl, chunk_size_hint=64)


def test_target_verify_takes_the_per_pool_row_table():
    """SGLang 0.5.23 passes its whole row table (pool size + padding rows); request n uses entry n."""
    case = verify_case([3, 3], steps=3, rows=[2, 0], cidx=[1, 4], seed=20)
    short = dict(case, intermediate_states_buffer=case["intermediate_states_buffer"].clone())
    o_short = call_verify(short, cache_steps=3)
    table = torch.tensor([2, 0, 1, 3, 4, 4], dtype=torch.int64)
    o = call_verify(case, intermediate_state_indices=table, cache_steps=3)
    assert torch.equal(o, o_short)
    assert torch.equal(bits(case["intermediate_states_buffer"]), bits(short["intermediate_states_buffer"]))


def test_target_verify_serves_a_draft_tree():
    """topk > 1: retrieve_parent_token [N, S] (int64, as SGLang's eager path allocates it; column 0 junk) is
    served by kda_verify's parent_tokens: token t continues from what its parent stored."""
    from flashkda_ext.integrations.sglang import STATS
    case = verify_case([4, 3], steps=4, rows=[0, 2], cidx=[1, 4], seed=21)
    parents = torch.tensor([[-7, 0, 0, 1], [99, 0, 0, 5]], dtype=torch.int64)   # [1, 3]: past request 1's tokens
    buf0 = case["intermediate_states_buffer"].clone()
    served = STATS["target_verify", "served"]
    o = call_verify(case, retrieve_parent_token=parents, cache_steps=4)
    assert STATS["target_verify", "served"] == served + 1
    want_o, want_buf = reference_verify(dict(case, intermediate_states_buffer=buf0), parents)
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    buf = case["intermediate_states_buffer"]
    torch.testing.assert_close(buf[0, :4], want_buf[0, :4], **TOL)
    torch.testing.assert_close(buf[2, :3], want_buf[2, :3], **TOL)
    assert torch.isnan(buf[2, 3]).all() and torch.isnan(buf[[1, 3, 4]]).all()
    chain = call_verify(dict(case, intermediate_states_buffer=buf0.clone()), cache_steps=4)
    assert not torch.equal(chain, o)   # the tree changed where tokens 2 and 3 start


def test_target_verify_tree_with_a_parent_table_of_other_steps_falls_back():
    case = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=21)
    fallback = Recorder()
    parents = torch.zeros(2, 4, dtype=torch.int64)   # [N, D] with D != the buffer's S = 3 steps
    c = dict(case)
    out = FlashKDAExtKernel(fallback=fallback).target_verify(
        c.pop("A_log"), c.pop("dt_bias"), c.pop("q"), c.pop("k"), c.pop("v"), c.pop("a"), c.pop("b"),
        retrieve_parent_token=parents, cache_steps=3, **c)
    assert out == ("triton", "target_verify")
    assert fallback.calls[0][2]["retrieve_parent_token"] is parents
    with pytest.raises(NotImplementedError, match="draft tree"):
        call_verify(case, retrieve_parent_token=parents)


def test_target_verify_tree_parents_out_of_range_are_refused_before_anything_is_written():
    case = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=22)
    buf0 = case["intermediate_states_buffer"].clone()
    for parents, match in ((torch.tensor([[0, 0, 2], [0, 0, 1]]), r"^retrieve_parent_token: entry \[0, 2\] = 2"),
                           (torch.tensor([[0, 0, 1], [0, 2 ** 32, 1]]), r"^retrieve_parent_token: entry \[1, 1\]")):
        with pytest.raises(ValueError, match=match):
            call_verify(case, retrieve_parent_token=parents, cache_steps=3)
        assert torch.equal(bits(case["intermediate_states_buffer"]), bits(buf0))


@pytest.mark.parametrize("qsl, match", [
    (torch.tensor([2 ** 32, 2 ** 32 + 3, 2 ** 32 + 6]), r"^query_start_loc: entry \[0\] = 4294967296 is out of range"),
    (torch.tensor([0.0, 3.0, 6.0]), r"^query_start_loc: expected an int32 or int64 tensor, got torch.float32"),
])
def test_target_verify_offsets_are_never_narrowed_unchecked(qsl, match):
    """Before: query_start_loc went to int32 by a plain cast: int64 offsets 2**32 + (0, 3, 6) wrapped to
    0, 3, 6 and float offsets were truncated, and both calls were served (the buffer written)."""
    case = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=22)
    buf, pool = case["intermediate_states_buffer"], case["ssm_states"]
    buf0, pool0 = buf.clone(), pool.clone()
    with pytest.raises(ValueError, match=match):
        call_verify(case, query_start_loc=qsl)
    assert torch.equal(bits(buf), bits(buf0)) and torch.equal(pool, pool0)
    # int64 offsets inside the int32 range are served as int32 ones
    o64 = call_verify(case, query_start_loc=torch.tensor([0, 3, 6]))
    case2 = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=22)
    torch.testing.assert_close(o64, call_verify(case2), rtol=0, atol=0)


def test_target_verify_int64_device_offsets_fall_back(monkeypatch):
    """int64 offsets on a device cannot be range-checked without a sync: SGLang's own kernel runs the call."""
    from flashkda_ext.integrations import common_checks
    monkeypatch.setattr(common_checks, "host_values", lambda x: x is None)     # every tensor "on a device"
    case = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=23)
    c = dict(case, query_start_loc=case["query_start_loc"].long())
    fallback = Recorder()
    out = FlashKDAExtKernel(fallback=fallback).target_verify(
        c.pop("A_log"), c.pop("dt_bias"), c.pop("q"), c.pop("k"), c.pop("v"), c.pop("a"), c.pop("b"), **c)
    assert out == ("triton", "target_verify") and fallback.calls[0][2]["query_start_loc"] is c["query_start_loc"]
    assert torch.isnan(case["intermediate_states_buffer"]).all()


def test_extend_track_state_sharing_the_pool_is_refused_before_anything_is_written():
    """track_state is written after the pool is committed. Before: a track_state aliasing pool slots was
    accepted, and the snapshot overwrote slot 1, the final state request 1 had just committed there."""
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=16)
    pool0 = pool.clone()
    idx = torch.tensor([4, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="^track_state: overlaps the memory of ssm_states"):
        FlashKDAExtKernel(chunk_size=4).extend(
            q, k, v, g, beta, ssm_states=pool, cache_indices=idx, query_start_loc=qsl, A_log=A_log,
            dt_bias=dt_bias, extend_seq_lens_cpu=lens, track_state=pool[:2], track_chunk_idx=torch.tensor([1, 1]))
    assert torch.equal(pool, pool0)


# ---------------------------------------------------------------------------------------------------
# arguments read as SGLang 0.5.23's kernels read them: the log gate's lower_bound, bool flags, an absent
# dt_bias, track_chunk_idx without track_state, query_start_loc under its own name

def log_gate_case(seed):
    """extend_case with g a log decay (< 0, never 0): the gate without A_log."""
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=seed)
    return q, k, v, -torch.rand(g.shape, generator=torch.Generator().manual_seed(seed)) - 0.01, beta, pool, qsl


@pytest.mark.parametrize("bad", [True, "x", float("nan"), 7.0])
def test_extend_log_gate_refuses_a_lower_bound_the_bounded_gate_refuses(bad):
    """Before: without A_log, _gate returned the log gate without looking at lower_bound (True, "x", NaN, 7.0
    served). Now the same error as the A_log call, and nothing written."""
    q, k, v, g, beta, pool, qsl = log_gate_case(30)
    _, _, _, _, _, A_log, dt_bias, _, _, _ = extend_case(seed=30)
    pool0 = pool.clone()
    call = dict(ssm_states=pool, cache_indices=torch.tensor([1, 2], dtype=torch.int32), query_start_loc=qsl,
                lower_bound=bad)
    with pytest.raises((TypeError, ValueError), match="^lower_bound: ") as with_A:
        FlashKDAExtKernel().extend(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **call)
    with pytest.raises(with_A.type, match="^lower_bound: ") as without_A:
        FlashKDAExtKernel().extend(q, k, v, g, beta, **call)
    assert str(without_A.value) == str(with_A.value)
    assert torch.equal(pool, pool0)


def test_extend_log_gate_with_a_lower_bound_is_the_log_gate():
    """SGLang's chunk_kda without A_log reads lower_bound only as safe_gate (which intra-chunk kernel runs):
    the gate is g as given, so a valid bound changes nothing (bitwise) and the result is the log gate's."""
    q, k, v, g, beta, pool, qsl = log_gate_case(31)
    idx = torch.tensor([4, 1], dtype=torch.int32)
    pool0, pool_none = pool.clone(), pool.clone()
    o = FlashKDAExtKernel().extend(q, k, v, g, beta, ssm_states=pool, cache_indices=idx, query_start_loc=qsl,
                                   lower_bound=-5.0)
    o_none = FlashKDAExtKernel().extend(q, k, v, g, beta, ssm_states=pool_none, cache_indices=idx,
                                        query_start_loc=qsl)
    assert torch.equal(o, o_none) and torch.equal(pool, pool_none)
    want_o, want_pool, _ = kda_recurrent(q, k, v, g, beta, gate="log", beta_is_logit=False, cu_seqlens=qsl,
                                         initial_state=pool0, state_indices=idx)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


NOT_BOOLS = [("beta_is_raw", "False"), ("beta_is_raw", 0), ("beta_is_raw", torch.tensor(True)),
             ("return_intermediate_states", "no"), ("return_intermediate_states", 1),
             ("output_intermediate_states", 0), ("is_spec_decode", 0)]


@pytest.mark.parametrize("name, value", NOT_BOOLS, ids=[f"{n}={v!r}" for n, v in NOT_BOOLS])
def test_extend_flags_that_are_not_bools_fall_back(name, value):
    """Before: read truthily (beta_is_raw="False" served as True, return_intermediate_states="no" returned
    (o, h), is_spec_decode=0 served). SGLang's call sites pass Python bools: anything else goes to its kernel,
    counted, and nothing is written here."""
    import numpy as np
    from flashkda_ext.integrations.sglang import REASONS
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=32)
    pool0 = pool.clone()
    call = dict(ssm_states=pool, cache_indices=torch.tensor([1, 2], dtype=torch.int32), query_start_loc=qsl,
                A_log=A_log, dt_bias=dt_bias, **{name: value})
    reason = f"{name} of type {'torch.Tensor' if torch.is_tensor(value) else type(value).__name__}, not a bool"
    with pytest.raises(NotImplementedError, match=f"^extend: {reason}"):
        FlashKDAExtKernel().extend(q, k, v, g, beta, **call)
    fallback = Recorder()
    before = sum(n for (m, r), n in REASONS.items() if m == "extend" and r.startswith(reason))
    assert FlashKDAExtKernel(fallback=fallback).extend(q, k, v, g, beta, **call) == ("triton", "extend")
    assert fallback.calls[0][2][name] is value
    assert sum(n for (m, r), n in REASONS.items() if m == "extend" and r.startswith(reason)) == before + 1
    assert torch.equal(pool, pool0)
    # a numpy bool is no Python bool either
    with pytest.raises(NotImplementedError, match="^extend: beta_is_raw of type numpy.bool_?, not a bool"):
        FlashKDAExtKernel().extend(q, k, v, g, beta, **dict(call, beta_is_raw=np.bool_(True)))
    assert torch.equal(pool, pool0)


def test_target_verify_cache_ring_that_is_not_a_bool_falls_back():
    """Before: cache_ring=0 was served (read falsy)."""
    case = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=33)
    buf0 = case["intermediate_states_buffer"].clone()
    with pytest.raises(NotImplementedError, match="^target_verify: cache_ring of type int, not a bool"):
        call_verify(case, cache_steps=3, cache_ring=0)
    c, fallback = dict(case), Recorder()
    out = FlashKDAExtKernel(fallback=fallback).target_verify(
        c.pop("A_log"), c.pop("dt_bias"), c.pop("q"), c.pop("k"), c.pop("v"), c.pop("a"), c.pop("b"),
        cache_steps=3, cache_ring=0, **c)
    assert out == ("triton", "target_verify") and fallback.calls[0][2]["cache_ring"] == 0
    assert torch.equal(bits(case["intermediate_states_buffer"]), bits(buf0))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_extend_without_dt_bias_is_sglangs_gate_without_a_bias(lower_bound):
    """SGLang's chunk_kda adds the bias only where dt_bias is given (HAS_BIAS); g + 0 is g, so no bias is a
    zero bias. Before: the softplus gate without dt_bias was a ValueError."""
    q, k, v, g, beta, A_log, _, pool, qsl, lens = extend_case(seed=34)
    idx = torch.tensor([0, 3], dtype=torch.int32)
    pool0, pool_zero = pool.clone(), pool.clone()
    call = dict(cache_indices=idx, query_start_loc=qsl, A_log=A_log, lower_bound=lower_bound)
    o = FlashKDAExtKernel().extend(q, k, v, g, beta, ssm_states=pool, dt_bias=None, **call)
    o_zero = FlashKDAExtKernel().extend(q, k, v, g, beta, ssm_states=pool_zero, dt_bias=torch.zeros(H * K), **call)
    assert torch.equal(o, o_zero) and torch.equal(pool, pool_zero)
    gate = dict(gate="softplus") if lower_bound is None else dict(gate="bounded", lower_bound=lower_bound)
    want_o, want_pool, _ = kda_recurrent(q, k, v, g, beta, **gate, A_log=A_log.flatten(), dt_bias=torch.zeros(H * K),
                                         beta_is_logit=False, cu_seqlens=qsl, initial_state=pool0, state_indices=idx)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


@pytest.mark.parametrize("where", ["decode", "packed_decode", "target_verify"])
def test_decode_and_verify_without_dt_bias_name_it(where):
    """SGLang's decode and verify kernels read dt_bias unconditionally (no bias-free variant): refused, naming
    dt_bias (before: named A_log), nothing written."""
    gen = torch.Generator().manual_seed(35)
    q, k, v = packed_qkv(2, gen)
    A_log, _ = params(gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen)
    pool0 = pool.clone()
    a, b, idx = torch.randn(2, H * K, generator=gen), torch.randn(2, H, generator=gen), torch.tensor([1, 3])
    with pytest.raises(ValueError, match="^dt_bias: "):
        if where == "decode":
            FlashKDAExtKernel().decode(q, k, v, a, b, A_log=A_log, dt_bias=None, ssm_states=pool, cache_indices=idx,
                                       query_start_loc=torch.arange(3, dtype=torch.int32))
        elif where == "packed_decode":
            FlashKDAExtKernel().packed_decode(torch.randn(2, 2 * H * K + H * V, generator=gen), a, b, A_log=A_log,
                                              dt_bias=None, scale=0.3, ssm_states=pool, cache_indices=idx,
                                              num_v_heads=H, head_v_dim=V)
        else:
            case = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=35)
            buf0 = case["intermediate_states_buffer"].clone()
            try:
                call_verify(case, dt_bias=None)
            finally:
                assert torch.equal(bits(case["intermediate_states_buffer"]), bits(buf0))
    assert torch.equal(pool, pool0)


def test_extend_track_chunk_idx_without_track_state_is_refused():
    """SGLang's chunk_kda asserts track_state and track_chunk_idx come together. Before: the indices were
    ignored and the call served."""
    q, k, v, g, beta, A_log, dt_bias, pool, qsl, lens = extend_case(seed=36)
    pool0 = pool.clone()
    with pytest.raises(ValueError, match="^track_chunk_idx: given without track_state"):
        FlashKDAExtKernel(chunk_size=4).extend(q, k, v, g, beta, ssm_states=pool,
                                               cache_indices=torch.tensor([4, 1], dtype=torch.int32),
                                               query_start_loc=qsl, A_log=A_log, dt_bias=dt_bias,
                                               track_chunk_idx=torch.tensor([1, 0], dtype=torch.int32))
    assert torch.equal(pool, pool0)


BAD_OFFSETS = [(torch.tensor([0.0, 1.0, 2.0]), "torch.float32 on cpu"), (torch.arange(3, device="meta"), "on meta")]


@pytest.mark.parametrize("qsl, match", BAD_OFFSETS, ids=["float", "meta"])
def test_decode_refuses_offsets_of_another_dtype_or_device(qsl, match):
    """Before: decode checked only their shape (and host values, float 0.0, 1.0 == 0, 1): served."""
    gen = torch.Generator().manual_seed(37)
    q, k, v = packed_qkv(2, gen)
    A_log, dt_bias = params(gen)
    pool = torch.randn(SLOTS, H, V, K, generator=gen)
    pool0 = pool.clone()
    with pytest.raises(ValueError, match=f"^query_start_loc: expected int32 or int64 offsets on cpu .*{match}"):
        FlashKDAExtKernel().decode(q, k, v, torch.randn(2, H * K, generator=gen), torch.randn(2, H, generator=gen),
                                   A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=torch.tensor([1, 3]),
                                   query_start_loc=qsl)
    assert torch.equal(pool, pool0)


@pytest.mark.parametrize("qsl, match", [
    (torch.tensor([0.0, 5.0, 14.0]), "expected int32 or int64 offsets on cpu"),
    (torch.tensor([0, 5, 14], dtype=torch.int32, device="meta"), "expected int32 or int64 offsets on cpu"),
    (torch.tensor([0, 0, 5, 0, 14], dtype=torch.int32)[::2], "expected a contiguous tensor"),
    (torch.tensor([0, 9, 5], dtype=torch.int32), "expected non-decreasing offsets from 0 to T = 14"),
], ids=["float", "meta", "strided", "decreasing"])
def test_extend_names_query_start_loc_not_cu_seqlens(qsl, match):
    """Before: kda_prefill's checks named the offsets cu_seqlens, an argument SGLang never passes."""
    q, k, v, g, beta, A_log, dt_bias, pool, _, lens = extend_case(seed=38)
    pool0 = pool.clone()
    with pytest.raises(ValueError, match=f"^query_start_loc: {match}"):
        FlashKDAExtKernel().extend(q, k, v, g, beta, ssm_states=pool, cache_indices=torch.tensor([1, 2]),
                                   query_start_loc=qsl, A_log=A_log, dt_bias=dt_bias)
    assert torch.equal(pool, pool0)


def test_target_verify_names_query_start_loc_on_another_device():
    case = verify_case([3, 3], steps=3, rows=[0, 2], cidx=[1, 4], seed=39)
    buf0 = case["intermediate_states_buffer"].clone()
    with pytest.raises(ValueError, match="^query_start_loc: expected a tensor on cpu"):
        call_verify(case, query_start_loc=case["query_start_loc"].to("meta"))
    assert torch.equal(bits(case["intermediate_states_buffer"]), bits(buf0))


# ---------------------------------------------------------------------------------------------------
# the captured prefill's wrapper (prefill_graph.py): what SGLang's FlashInferKDAPrefillGraph may pass beyond
# what it does pass is refused, naming the argument, before anything is written

def graph_case(seed=11):
    from flashkda_ext.integrations.sglang.prefill_graph import PrefillGraphWrapper
    gen = torch.Generator().manual_seed(seed)
    D, T = 8, 12
    q, k, v, g = (torch.randn(1, T, H, D, generator=gen) for _ in range(4))
    beta = torch.randn(1, T, H, generator=gen)
    pool = torch.randn(SLOTS, H, D, D, generator=gen)
    w = PrefillGraphWrapper("cpu")
    w.plan(torch.tensor([0, 7, 10, 10], dtype=torch.int64))
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=torch.zeros(H), dt_bias=torch.zeros(H * D), initial_state=pool,
              ssm_state_indices=torch.tensor([2, 4, 0], dtype=torch.int32), use_gate_in_kernel=True,
              lower_bound=-5.0, beta_is_logit=True, output=torch.full((1, T, H, D), float("nan")))
    return w, kw


@pytest.mark.parametrize("change, error, match", [
    (dict(use_qk_l2norm_in_kernel=False), ValueError, "use_qk_l2norm_in_kernel"),
    (dict(use_gate_in_kernel=False), ValueError, "use_gate_in_kernel"),
    (dict(output_final_state=True), ValueError, "output_final_state"),
    (dict(checkpoint_every_n_tokens=64), ValueError, "state_checkpoints"),
    (dict(state_checkpoints=torch.zeros(1, H, 8, 8)), ValueError, "state_checkpoints"),
    (dict(ssm_state_indices=None), ValueError, "ssm_state_indices"),
    (dict(ssm_state_indices=torch.tensor([2, 4], dtype=torch.int32)), ValueError, "ssm_state_indices"),
    (dict(ssm_state_indices=torch.tensor([2, 4, 0])), ValueError, "ssm_state_indices"),      # int64
    (dict(dt_bias=None), ValueError, "dt_bias"),
    (dict(output=torch.zeros(1, 12, H, 4)), ValueError, "output"),
    (dict(beta_is_logit=1), TypeError, "beta_is_logit"),
    (dict(new_flashinfer_argument=1), TypeError, "new_flashinfer_argument"),
])
def test_the_captured_prefill_wrapper_refuses_what_it_does_not_serve(change, error, match):
    w, kw = graph_case()
    pool0, out0 = kw["initial_state"].clone(), kw["output"].clone()
    kw.update(change)
    with pytest.raises(error, match=match):
        w.run(**kw)
    assert torch.equal(kw["initial_state"] if kw["initial_state"] is not None else pool0, pool0)
    if kw["output"] is not None and kw["output"].shape == out0.shape:
        assert torch.equal(kw["output"].isnan(), out0.isnan())


def test_the_captured_prefill_wrapper_needs_a_plan():
    from flashkda_ext.integrations.sglang.prefill_graph import PrefillGraphWrapper
    _, kw = graph_case()
    with pytest.raises(RuntimeError, match="before plan"):
        PrefillGraphWrapper("cpu").run(**kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        PrefillGraphWrapper("cpu").plan(torch.tensor([0.0, 3.0]))
    with pytest.raises(TypeError, match="non_blocking"):
        PrefillGraphWrapper("cpu").plan(torch.tensor([0, 3]), non_blocking=None)


def test_the_captured_prefill_wrapper_serves_the_planned_tokens_only():
    """Host offsets ending before T (SGLang's bucket padding): the rows past them stay as they were; the empty
    third sequence's slot (0, as SGLang clamps padding) is neither read nor written."""
    w, kw = graph_case()
    pool0 = kw["initial_state"].clone()
    out, none = w.run(**kw)
    assert out is kw["output"] and none is None
    assert torch.isnan(out[:, 10:]).all() and not torch.isnan(out[:, :10]).any()
    cu = torch.tensor([0, 7, 10], dtype=torch.int32)
    want_o, want_pool, _ = kda_recurrent(*(kw[n][:, :10] for n in ("q", "k", "v", "g", "beta")), gate="bounded",
                                         lower_bound=-5.0, A_log=kw["A_log"], dt_bias=kw["dt_bias"],
                                         beta_is_logit=True, cu_seqlens=cu, initial_state=pool0,
                                         state_indices=torch.tensor([2, 4], dtype=torch.int32))
    torch.testing.assert_close(out[:, :10].double(), want_o, **TOL)
    torch.testing.assert_close(kw["initial_state"][[2, 4]].double(), want_pool[[2, 4]].double(), **TOL)
    assert torch.equal(kw["initial_state"][[0, 1, 3, 5]], pool0[[0, 1, 3, 5]])


@pytest.mark.parametrize("lens", [[512] * 64, [4000] + [100] * 47, [256] + [64] * 127, [1000] + [60] * 127,
                                  [64] * 3 + [0] * 5, [0] * 4, [2048] * 24, [2049] * 24, [30] * 16 + [0] * 112,
                                  [1500] + [1000] * 14 + [500], [1499] + [1000] * 14 + [501], [1024, 64] * 8])
@pytest.mark.parametrize("HV", [8, 16])
def test_the_captured_prefills_device_band_is_the_routes_band(lens, HV):
    """in_band_on_device (the choice a captured call makes on the device between the fused chunk-16 launch and
    the chunk-64 one) agrees with the route engine's own evaluation of the fused rules for the live sequences,
    their longest known, at either side of each band edge; c16g_mixed's too, for its length field longest_vs_mean_pct
    (computed on the device as on the host)."""
    from flashkda_ext import dispatch, jit, validation
    from flashkda_ext.integrations.sglang.prefill_graph import in_band_on_device
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    live_lens = [n for n in lens if n > 0]
    for rule in jit.routes_for("kda_prefill"):
        if not rule["name"].startswith(("fused_chunk16", "c16g_mixed")) or "opt_in" in rule:   # default rules, each its gate
            continue
        gate = rule["when"]["gate"] if isinstance(rule["when"]["gate"], str) else rule["when"]["gate"][0]
        meta = validation.prefill_route_meta("cuda", len(live_lens), HV, sum(lens), max(lens), "f32", "o32",
                                             gate, False, -5.0 if gate == "bounded" else None)
        want = dispatch.rule_matches(rule["when"], meta) if live_lens else False
        got = bool(in_band_on_device(rule["when"], cu, cu[1:] > cu[:-1], HV))
        assert got == want, (rule["name"], lens, HV, meta)


def test_capability_reason_checks_value_heads_not_query_heads():
    """The fallback test reads the supported set with H and HV in their places: on CUDA, 3 query heads over 12
    value heads (HV = 12 supported, group size 4) is served, 6 value heads (not a CUDA head count) falls back
    naming HV; the pool is a CPU tensor and the backend CUDA (the check reads no data)."""
    from types import SimpleNamespace
    from flashkda_ext.integrations.sglang import kernel as sk
    cuda = SimpleNamespace(is_cuda=True, is_cpu=False)
    pool = torch.zeros(1, 1, 1, 1)
    for family in ("kda_decode", "kda_verify", "kda_prefill"):
        assert sk._capability_reason(family, torch.bfloat16, pool, 3, 128, 12, 128, "softplus", cuda, (), ()) is None
        why = sk._capability_reason(family, torch.bfloat16, pool, 6, 128, 6, 128, "softplus", cuda, (), ())
        assert why is not None and "value head count HV = 6" in why, why
