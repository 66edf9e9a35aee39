"""flashkda_ext.integrations.fla without fla installed (CI): the verifiers' refusals and the mapping of fla's
chunk_kda / fused_recurrent_kda_fwd arguments onto our ops, checked against flashkda_ext.reference on the
CPU backend (fla's Triton kernels do not run on the CPU). tests/test_integrations_fla_registry.py runs the
same calls through fla's own dispatch when fla imports."""
import pytest
import torch

from flashkda_ext.integrations import fla as fkda_fla
from flashkda_ext.reference import kda_decode_step, kda_recurrent, kda_verify_step

B, T, H, HV, K, V = 2, 6, 2, 4, 8, 16
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def inputs(seed=0, B=B, T=T, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale)  # noqa: E731
    return dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, HV, V).to(dtype),
                g=r(B, T, HV, K).to(dtype), beta=r(B, T, HV).to(dtype),
                A_log=r(HV, scale=0.3), dt_bias=r(HV * K, scale=0.5))


FLA_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True)


def test_chunk_kda_varlen_from_a_state_matches_the_reference():
    a = inputs(B=1, T=11)
    cu = torch.tensor([0, 4, 11], dtype=torch.long)
    h0 = torch.randn(2, HV, V, K) * 0.3
    call = dict(a, initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu, **FLA_FLAGS)
    assert fkda_fla.chunk_kda_verifier(**call) == (True, None)
    o, ht = fkda_fla.serve_chunk_kda(**call)
    want_o, want_ht, _ = kda_recurrent(a["q"], a["k"], a["v"], a["g"], a["beta"], A_log=a["A_log"],
                                       dt_bias=a["dt_bias"], cu_seqlens=cu, initial_state=h0)
    assert o.shape == (1, 11, HV, V) and ht.shape == (2, HV, V, K) and ht.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(ht.double(), want_ht, **TOL)


def test_chunk_kda_bounded_gate_activated_beta_and_fp32_beta_beside_bf16_q():
    a = inputs(dtype=torch.bfloat16)
    beta = torch.rand(B, T, HV)        # activated, fp32 (as engines produce it)
    call = dict(a, beta=beta, lower_bound=-5.0, safe_gate=True, output_final_state=False,
                **dict(FLA_FLAGS, use_beta_sigmoid_in_kernel=False))
    assert fkda_fla.chunk_kda_verifier(**call) == (True, None)
    o, ht = fkda_fla.serve_chunk_kda(**call)
    assert ht is None and o.dtype == torch.bfloat16
    # the adapter casts beta to q's dtype in one pass: the reference sees the same bf16 beta
    want_o, _, _ = kda_recurrent(a["q"], a["k"], a["v"], a["g"], beta.to(torch.bfloat16), gate="bounded",
                                 lower_bound=-5.0, A_log=a["A_log"], dt_bias=a["dt_bias"], beta_is_logit=False)
    torch.testing.assert_close(o.double(), want_o, rtol=2e-2, atol=2e-2)


def test_vllm_decode_call_updates_the_pool_in_place():
    """vLLM's KDA decode: q [1, N, H, K], cu_seqlens = arange(N + 1), ssm_state_indices with a padding row,
    the pool [slots, HV, V, K] updated in place, precomputed log gate (use_gate_in_kernel=False)."""
    N, slots = 3, 5
    a = inputs(B=1, T=N)
    g = -torch.rand(1, N, HV, K)
    pool = torch.randn(slots, HV, V, K) * 0.3
    pool0 = pool.clone()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    call = dict(q=a["q"], k=a["k"], v=a["v"], g=g, beta=a["beta"], initial_state=pool, inplace_final_state=True,
                cu_seqlens=torch.arange(N + 1), ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, state_v_first=True)
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
    o, ht = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    assert ht is pool and o.shape == (1, N, HV, V)
    want_o, want_pool = kda_decode_step(a["q"][0], a["k"][0], a["v"][0], g[0], a["beta"][0], state=pool0,
                                        state_indices=idx, gate="log")
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


def test_fused_recurrent_dense_states_in_place_and_as_a_new_final_state():
    a = inputs()
    h0 = torch.randn(B, HV, V, K) * 0.3
    want_o, want_ht, _ = kda_recurrent(a["q"], a["k"], a["v"], a["g"], a["beta"], A_log=a["A_log"],
                                       dt_bias=a["dt_bias"], initial_state=h0)
    # a new fp32 final state
    call = dict(a, initial_state=h0, output_final_state=True, inplace_final_state=False, **FLA_FLAGS)
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
    o, ht = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(ht.double(), want_ht, **TOL)
    # fla's default: the final state written over initial_state, output into a caller-given out
    h = h0.clone()
    out = torch.empty_like(a["v"])
    o2, ht2 = fkda_fla.serve_fused_recurrent_kda_fwd(**dict(a, initial_state=h, out=out, **FLA_FLAGS))
    assert o2 is out and ht2 is h
    torch.testing.assert_close(o2.double(), want_o, **TOL)
    torch.testing.assert_close(h.double(), want_ht, **TOL)


def test_chunk_kda_intermediate_states_are_fla_per_chunk_h():
    """fla's h: the state entering each chunk of 64, [B, NT, HV, V, K] in q's dtype (equal lengths) or
    [1, NT over all sequences, ...] (packed, host lengths from cu_seqlens_cpu)."""
    a = inputs(B=1, T=200)
    cu = torch.tensor([0, 130, 200])
    h0 = torch.randn(2, HV, V, K) * 0.3
    call = dict(a, initial_state=h0, output_final_state=True, return_intermediate_states=True, cu_seqlens=cu,
                cu_seqlens_cpu=cu, **FLA_FLAGS)
    assert fkda_fla.chunk_kda_verifier(**call) == (True, None)
    o, ht, h = fkda_fla.serve_chunk_kda(**call)
    _, want_ht, ckpt = kda_recurrent(a["q"], a["k"], a["v"], a["g"], a["beta"], A_log=a["A_log"],
                                     dt_bias=a["dt_bias"], cu_seqlens=cu, initial_state=h0, checkpoint_every=64)
    assert h.shape == (1, 3 + 2, HV, V, K) and h.dtype == a["q"].dtype   # ceil(130/64) + ceil(70/64) chunks
    want_h = torch.stack([h0[0].double(), ckpt[0, 0], ckpt[0, 1], h0[1].double(), ckpt[1, 0]])
    torch.testing.assert_close(h[0].double(), want_h, **TOL)
    torch.testing.assert_close(ht.double(), want_ht, **TOL)
    # equal lengths, no initial state: h[:, 0] is zero
    b = inputs(B=2, T=70)
    o, ht, h = fkda_fla.serve_chunk_kda(**dict(b, return_intermediate_states=True, **FLA_FLAGS))
    assert ht is None and h.shape == (2, 2, HV, V, K) and torch.equal(h[:, 0], torch.zeros(2, HV, V, K))


REFUSALS = [
    (dict(state_v_first=False), "state_v_first=True"),
    (dict(use_qk_l2norm_in_kernel=False), "use_qk_l2norm_in_kernel=True"),
    (dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), "allow_neg_eigval=False"),
    (dict(cp_context=object()), "context parallel"),
    (dict(return_intermediate_states=True, chunk_size=32), "chunk_size=64"),
    (dict(return_intermediate_states=True, q=torch.zeros(1, 12, H, K), k=torch.zeros(1, 12, H, K),
          v=torch.zeros(1, 12, HV, V), g=torch.zeros(1, 12, HV, K), beta=torch.zeros(1, 12, HV),
          cu_seqlens=torch.tensor([0, 5, 12])), "cu_seqlens_cpu"),
    (dict(use_graph=True), "use_graph"),
    (dict(A_log=None), "requires A_log and dt_bias"),
    (dict(initial_state=torch.zeros(3, HV, V, K)), "initial_state: expected shape"),   # our check's message
    (dict(initial_state=torch.zeros(B, HV, K + 1, V)), "initial_state"),               # K-first [K, V]: refused
]


@pytest.mark.parametrize("change,reason", REFUSALS, ids=[r for _, r in REFUSALS])
def test_chunk_kda_verifier_refuses_with_a_reason(change, reason):
    call = dict(inputs(), **FLA_FLAGS)
    call.update(change)
    ok, why = fkda_fla.chunk_kda_verifier(**call)
    assert ok is False and reason in why, why


def test_verifiers_refuse_training_and_unserved_decode_forms():
    a = inputs()
    with torch.inference_mode(False), torch.enable_grad():
        # grad mode with nothing requiring grad records nothing: served
        assert fkda_fla.chunk_kda_verifier(**dict(a, **FLA_FLAGS)) == (True, None)
        for name in ("q", "v", "g", "beta"):
            grad_in = dict(a, **{name: a[name].clone().requires_grad_()})
            ok, why = fkda_fla.chunk_kda_verifier(**dict(grad_in, **FLA_FLAGS))
            assert not ok and "inference only" in why and "requires grad" in why, (name, why)
    pool = torch.zeros(4, HV, V, K)
    base = dict(inputs(B=1, T=3), initial_state=pool, cu_seqlens=torch.arange(4),
                ssm_state_indices=torch.arange(3, dtype=torch.int32), **FLA_FLAGS)
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**base) == (True, None)
    for change, reason in [(dict(num_accepted_tokens=torch.ones(3, dtype=torch.int32)), "per-token"),
                           (dict(ssm_state_indices=torch.zeros(3, 2, 2, dtype=torch.int32)), "1 or 2 dims"),
                           (dict(inplace_final_state=False), "in place"),
                           (dict(cu_seqlens=torch.tensor([0, 3])), "decode batch"),
                           (dict(beta=torch.zeros(1, 3, HV, V)), "scalar beta per head")]:
        ok, why = fkda_fla.fused_recurrent_kda_fwd_verifier(**dict(base, **change))
        assert not ok and reason in why, (change, why)


def test_cuda_rules_refuse_what_the_kernels_do_not_claim():
    """The CUDA backend's supported set (K = V = 128, bf16) as the verifier applies it, on meta stand-ins."""
    def prefill_args(Kd, Vd, dtype):
        m = lambda *s, dt=dtype: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
        return (m(1, 8, 2, Kd), m(1, 8, 2, Kd), m(1, 8, 2, Vd), m(1, 8, 2, Kd), m(1, 8, 2)), dict(gate="log")
    cuda = torch.device("cuda")
    fkda_fla._validated("kda_prefill", cuda, *prefill_args(128, 128, torch.bfloat16))  # served
    with pytest.raises(fkda_fla.Refused, match="head dim K = 64"):
        fkda_fla._validated("kda_prefill", cuda, *prefill_args(64, 128, torch.bfloat16))
    with pytest.raises(fkda_fla.Refused, match="head dim V = 64"):
        fkda_fla._validated("kda_prefill", cuda, *prefill_args(128, 64, torch.bfloat16))
    with pytest.raises(fkda_fla.Refused, match="float16"):
        fkda_fla._validated("kda_prefill", cuda, *prefill_args(128, 128, torch.float16))


def test_register_needs_fla(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla fails
    monkeypatch.setattr(fkda_fla, "_REGISTERED", None)
    with pytest.raises(ImportError, match="needs fla >= 0.6"):
        fkda_fla.register()
    monkeypatch.delenv("FLASHKDA_EXT_FLA", raising=False)
    assert fkda_fla.register_from_env() is None
    # read as every on/off variable (switches.py): "off" is off (it once registered), a non-switch an error
    for off in ("off", "false", "0"):
        monkeypatch.setenv("FLASHKDA_EXT_FLA", off)
        assert fkda_fla.register_from_env() is None
    monkeypatch.setenv("FLASHKDA_EXT_FLA", "on")
    with pytest.raises(ImportError, match="needs fla >= 0.6"):     # register() was called
        fkda_fla.register_from_env()
    monkeypatch.setenv("FLASHKDA_EXT_FLA", "maybe")
    with pytest.raises(ValueError, match="FLASHKDA_EXT_FLA"):
        fkda_fla.register_from_env()


def test_verdicts_are_reused_only_for_the_same_call_signature():
    fkda_fla._VERDICTS.clear()
    a = inputs()
    call = dict(a, **FLA_FLAGS)
    served = fkda_fla.STATS["chunk_kda", "served"]
    assert fkda_fla.chunk_kda_verifier(**call) == (True, None)
    assert fkda_fla.chunk_kda_verifier(**dict(call, q=a["q"].clone())) == (True, None)   # same signature
    assert len(fkda_fla._VERDICTS) == 1 and fkda_fla.STATS["chunk_kda", "served"] == served + 2
    # a transposed view has other strides: checked again, and refused (not contiguous)
    q_t = a["q"].transpose(1, 2).contiguous().transpose(1, 2)
    ok, why = fkda_fla.chunk_kda_verifier(**dict(call, q=q_t))
    assert not ok and "contiguous" in why and len(fkda_fla._VERDICTS) == 2
    with torch.inference_mode(False), torch.enable_grad():       # grad mode and requires_grad are in the key
        assert fkda_fla.chunk_kda_verifier(**dict(call, q=a["q"].clone().requires_grad_()))[0] is False
        assert fkda_fla.chunk_kda_verifier(**call) == (True, None)


def test_speculative_decoding_call_is_served_by_kda_verify():
    """vLLM's verify call (per-token ssm_state_indices [N, T_max], num_accepted_tokens) maps onto
    kda_verify: the state after token t of request n lands in slot [n, t], the initial state comes
    from slot [n, num_accepted_tokens[n] - 1]; checked against the reference verify step."""
    from flashkda_ext.reference import verify as ref_verify
    a = inputs(seed=3, B=1, T=5)
    pool = torch.randn(9, HV, V, K) * 0.3
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    idx = torch.tensor([[1, 4, -1], [2, 7, 5]], dtype=torch.int32)
    acc = torch.tensor([2, 1], dtype=torch.int32)
    call = dict(a, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=acc,
                inplace_final_state=True, **FLA_FLAGS)
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
    pool0 = pool.clone()
    o, final = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    assert final is pool and o.shape == (1, 5, HV, V)
    want_o, want_pool = ref_verify.kda_verify_step(a["q"], a["k"], a["v"], a["g"], a["beta"], state=pool0,
                                                   state_indices=idx, cu_seqlens=cu, num_accepted_tokens=acc,
                                                   A_log=a["A_log"], dt_bias=a["dt_bias"])
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool.double(), want_pool.double(), **TOL)
    for s in (0, 3, 6, 8):  # slots no entry names
        assert torch.equal(pool[s], pool0[s])


@pytest.mark.parametrize("family", ["kda_decode", "kda_verify", "kda_prefill"])
def test_fp32_gate_and_beta_reach_kda_decode_as_they_are(family, monkeypatch):
    """fp32 g / beta beside bf16 q: kda_decode (vLLM's decode call) and kda_verify (the speculative call) read
    them natively, so the adapter passes them uncast; kda_prefill reads q's dtype, so it gets the one-pass cast.
    The served decode and verify equal the reference on the fp32 values."""
    from flashkda_ext import ops
    seen = {}

    def spy(name):
        real = getattr(ops, name)

        def wrapper(q, k, v, g, beta, **kw):
            seen[name] = (g.dtype, beta.dtype)
            return real(q, k, v, g, beta, **kw)
        return wrapper
    for name in ("kda_decode", "kda_verify", "kda_prefill"):
        monkeypatch.setattr(ops, name, spy(name))
    a = inputs(seed=4, B=1, T=3, dtype=torch.bfloat16)
    a["g"], a["beta"] = torch.randn(1, 3, HV, K), torch.randn(1, 3, HV)   # fp32, as engines make them
    pool = torch.randn(9, HV, V, K) * 0.3
    pool0 = pool.clone()
    if family == "kda_decode":
        extra = dict(cu_seqlens=torch.arange(4, dtype=torch.int32), ssm_state_indices=torch.tensor(
            [4, -1, 1], dtype=torch.int32), inplace_final_state=True)
    elif family == "kda_verify":
        extra = dict(cu_seqlens=torch.tensor([0, 1, 3], dtype=torch.int32),
                     ssm_state_indices=torch.tensor([[1, 4], [2, 7]], dtype=torch.int32), inplace_final_state=True)
    else:
        extra = dict(cu_seqlens=torch.tensor([0, 1, 3], dtype=torch.int32), inplace_final_state=True)
        pool = pool[:2].clone()
    call = dict(a, initial_state=pool, **extra, **FLA_FLAGS)
    assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
    o, _ = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
    want = (torch.float32, torch.float32) if family != "kda_prefill" else (torch.bfloat16, torch.bfloat16)
    assert seen == {family: want}
    if family == "kda_verify":
        want_o, want_pool = kda_verify_step(a["q"], a["k"], a["v"], a["g"], a["beta"], state=pool0,
                                            state_indices=extra["ssm_state_indices"], cu_seqlens=extra["cu_seqlens"],
                                            A_log=a["A_log"], dt_bias=a["dt_bias"])
        torch.testing.assert_close(o.double(), want_o, rtol=6e-3, atol=1e-4)
        torch.testing.assert_close(pool.double(), want_pool.double(), rtol=6e-3, atol=1e-4)
    if family == "kda_decode":
        want_o, want_pool = kda_decode_step(a["q"][0], a["k"][0], a["v"][0], a["g"][0], a["beta"][0], state=pool0,
                                            state_indices=extra["ssm_state_indices"], A_log=a["A_log"],
                                            dt_bias=a["dt_bias"])
        torch.testing.assert_close(o[0].double(), want_o, rtol=6e-3, atol=1e-4)
        torch.testing.assert_close(pool.double(), want_pool.double(), rtol=6e-3, atol=1e-4)


@pytest.mark.parametrize("family", ["kda_decode", "kda_verify"])
def test_fp16_gate_and_beta_beside_bf16_q_are_read_as_fp32_not_rounded(family):
    """An fp16 g / beta beside bf16 q goes to kda_decode / kda_verify in fp32 (exact: fp16 values are fp32 values),
    not in q's bf16 (which drops 3 mantissa bits fla's kernel reads): the result is bitwise the call on the
    fp32-widened values, and differs from the call on the bf16-rounded ones."""
    a = inputs(seed=7, B=1, T=3, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(71)
    g16, b16 = torch.randn(1, 3, HV, K, generator=gen).half(), torch.randn(1, 3, HV, generator=gen).half()
    pool0 = torch.randn(9, HV, V, K, generator=gen) * 0.3
    if family == "kda_decode":
        extra = dict(cu_seqlens=torch.arange(4, dtype=torch.int32),
                     ssm_state_indices=torch.tensor([4, -1, 1], dtype=torch.int32))
    else:
        extra = dict(cu_seqlens=torch.tensor([0, 1, 3], dtype=torch.int32),
                     ssm_state_indices=torch.tensor([[1, 4], [2, 7]], dtype=torch.int32))
    got = {}
    for name, (g, beta) in {"fp16": (g16, b16), "fp32": (g16.float(), b16.float()),
                            "bf16": (g16.bfloat16(), b16.bfloat16())}.items():
        pool = pool0.clone()
        call = dict(a, g=g, beta=beta, initial_state=pool, inplace_final_state=True, **extra, **FLA_FLAGS)
        assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
        o, _ = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
        got[name] = (o.view(torch.int16), pool.view(torch.int32))
    assert all(torch.equal(x, y) for x, y in zip(got["fp16"], got["fp32"]))
    assert not torch.equal(got["fp16"][0], got["bf16"][0])      # the rounding this replaces would have changed it
