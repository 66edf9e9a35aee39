"""flashkda_ext.integrations.vllm without vllm installed: a fake vllm (tests/vllm_fake.py: vLLM's module
paths, its KDA ops as recording stubs) is rebound by install() and restored by uninstall(); claimed calls,
made as vLLM's KDA layer makes them, are checked against flashkda_ext.reference on the CPU backend, and
unclaimed ones must reach the original stub with the caller's own arguments."""
import inspect
import subprocess
import sys
import types

import pytest
import torch

from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.reference import kda_decode_step, kda_recurrent
from flashkda_ext.reference import verify as ref_verify
from vllm_fake import LAYER, OPS, install_fake_vllm, kda_state_shapes, paged_mamba_cache

H, HV, K, V = 2, 2, 8, 16           # K != V: a transposed state cannot pass
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture
def fake(monkeypatch):
    ns = install_fake_vllm(monkeypatch)
    yield ns
    fkda_vllm.uninstall()


@pytest.fixture
def installed(fake):
    fkda_vllm.install()
    return fake


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def served(entry):
    return fkda_vllm.STATS[entry, "served"]


# ---------------------------------------------------------------------------------------------
# install / uninstall


def test_install_rebinds_the_ops_and_the_layer_and_uninstall_restores(fake, monkeypatch):
    stubs = fake.stubs
    other = types.ModuleType("not_vllm")            # outside vllm: never touched
    other.fused_recurrent_kda = stubs["fused_recurrent_kda"]
    monkeypatch.setitem(sys.modules, "not_vllm", other)

    report = fkda_vllm.install()
    assert fkda_vllm.installed()
    for name in fkda_vllm.ADAPTERS:
        adapter = getattr(fake.ops, name)
        assert adapter is not stubs[name] and adapter.__wrapped__ is stubs[name], name
        assert list(inspect.signature(adapter).parameters) == list(inspect.signature(stubs[name]).parameters)
    assert fake.layer.fused_recurrent_kda is fake.ops.fused_recurrent_kda
    assert fake.layer.chunk_kda_with_fused_gate is fake.ops.chunk_kda_with_fused_gate
    assert sorted(report["fused_recurrent_kda"]) == sorted([f"{OPS}.fused_recurrent_kda", f"{LAYER}.fused_recurrent_kda"])
    assert report["chunk_kda"] == [f"{OPS}.chunk_kda"]
    assert fake.ops.fused_kda_gate is stubs["fused_kda_gate"] and fake.layer.fused_kda_gate is stubs["fused_kda_gate"]
    assert other.fused_recurrent_kda is stubs["fused_recurrent_kda"]

    adapters = {name: getattr(fake.ops, name) for name in fkda_vllm.ADAPTERS}
    # a layer module imported after install() reads the adapter from the ops module
    late = types.ModuleType("vllm.model_executor.layers.late")
    late.fused_recurrent_kda = fake.ops.fused_recurrent_kda
    monkeypatch.setitem(sys.modules, late.__name__, late)
    again = fkda_vllm.install()                      # idempotent: the same adapters, nothing new to rebind
    assert all(getattr(fake.ops, n) is a for n, a in adapters.items()) and all(v == [] for v in again.values())

    restored = fkda_vllm.uninstall()
    assert f"{late.__name__}.fused_recurrent_kda" in restored["fused_recurrent_kda"]
    for name in fkda_vllm.ADAPTERS:
        assert getattr(fake.ops, name) is stubs[name], name
    assert fake.layer.fused_recurrent_kda is stubs["fused_recurrent_kda"]
    assert fake.layer.chunk_kda_with_fused_gate is stubs["chunk_kda_with_fused_gate"]
    assert late.fused_recurrent_kda is stubs["fused_recurrent_kda"]
    assert not fkda_vllm.installed() and fkda_vllm.uninstall() == {}


def test_install_skips_an_op_whose_vllm_signature_changed(fake):
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, new_flag=False):
        raise AssertionError("not called")
    fake.ops.chunk_kda = chunk_kda
    report = fkda_vllm.install()
    assert report["chunk_kda"].startswith("skipped: vLLM's signature") and fake.ops.chunk_kda is chunk_kda
    assert fake.ops.fused_recurrent_kda is not fake.stubs["fused_recurrent_kda"]


def test_install_without_vllm_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)           # import vllm fails
    with pytest.raises(ImportError, match="vLLM's KDA ops module is not importable"):
        fkda_vllm.install()
    assert not fkda_vllm.installed()
    monkeypatch.delenv(fkda_vllm.ENV_VAR, raising=False)
    assert fkda_vllm.install_from_env() is None
    monkeypatch.setenv(fkda_vllm.ENV_VAR, "1")
    with pytest.raises(ImportError, match="is vllm installed"):
        fkda_vllm.install_from_env()


def test_importing_the_adapter_does_not_import_vllm(tmp_path):
    poison = tmp_path / "vllm"
    poison.mkdir()
    (poison / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import flashkda_ext, flashkda_ext.integrations.vllm; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)


# ---------------------------------------------------------------------------------------------
# decode: the layer's fused_recurrent_kda call


def decode_case(seed, N, T, batch, idx, slots=6, dtype=torch.float32):
    """vLLM's decode call: q, k, v views into one projection ([1, T, ., .], T >= N when a CUDA graph padded
    the tokens), the fp32 log gate fused_kda_gate returns, the activated fp32 beta, the fp32 pool with a
    NaN null block (slot 0), ssm_state_indices padded to `batch` entries with the null block."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(T, 2 * H * K + HV * V, generator=gen).to(dtype)
    q, k, v = mixed.split([H * K, H * K, HV * V], dim=-1)
    q, k, v = q.view(1, T, H, K), k.view(1, T, H, K), v.view(1, T, HV, V)
    g = -torch.rand(1, T, HV, K, generator=gen) * 2
    beta = torch.rand(1, T, HV, generator=gen)
    pool = torch.randn(slots, HV, V, K, generator=gen) * 0.3
    pool[0] = float("nan")
    idx = torch.tensor(idx + [0] * (batch - len(idx)), dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, use_qk_l2norm_in_kernel=True,
                cu_seqlens=torch.arange(N + 1, dtype=torch.int32), ssm_state_indices=idx)


@pytest.mark.parametrize("N,T,batch,idx", [(3, 3, 3, [4, -1, 2]),      # eager: T == N
                                           (3, 5, 5, [4, 0, 2])],      # a CUDA graph's padded batch
                         ids=["eager", "graph-padded"])
def test_decode_is_served_and_matches_the_reference(installed, N, T, batch, idx):
    call = decode_case(0, N, T, batch, idx)
    assert not call["q"].is_contiguous()
    pool = call["initial_state"]
    pool0 = pool.clone()
    before = served("fused_recurrent_kda")
    o, final = installed.layer.fused_recurrent_kda(**call)
    assert served("fused_recurrent_kda") == before + 1 and installed.calls == []
    assert final is pool and o.shape == (1, T, HV, V) and o.dtype == call["v"].dtype
    c = {n: call[n][0, :N] for n in ("q", "k", "v", "g", "beta")}
    want_o, want_pool = kda_decode_step(c["q"], c["k"], c["v"], c["g"], c["beta"], state=pool0,
                                        state_indices=call["ssm_state_indices"][:N], gate="log", beta_is_logit=False,
                                        null_slot0=True)
    torch.testing.assert_close(o[0, :N].double(), want_o, **TOL)
    assert torch.equal(o[0, 1], torch.zeros(HV, V))          # the padding request (-1, or the null block 0)
    live = [s for s in idx if s > 0]
    torch.testing.assert_close(pool[live], want_pool[live].to(pool.dtype), **TOL)
    rest = [s for s in range(pool.shape[0]) if s not in live]
    assert torch.equal(bits(pool[rest]), bits(pool0[rest]))   # the null block and unnamed slots, bitwise


def test_decode_with_bf16_q_casts_the_fp32_gate_and_beta_once(installed):
    call = decode_case(1, 3, 3, 4, [2, 5, 1], dtype=torch.bfloat16)
    pool0 = call["initial_state"].clone()
    o, _ = installed.ops.fused_recurrent_kda(**call, num_accepted_tokens=torch.ones(3))   # swallowed, as vLLM does
    assert o.dtype == torch.bfloat16 and installed.calls == []
    c = {n: call[n][0] for n in ("q", "k", "v")}
    want_o, want_pool = kda_decode_step(c["q"], c["k"], c["v"], call["g"][0].bfloat16(), call["beta"][0].bfloat16(),
                                        state=pool0, state_indices=call["ssm_state_indices"][:3], gate="log",
                                        beta_is_logit=False, null_slot0=True)
    torch.testing.assert_close(o[0].double(), want_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(call["initial_state"][[2, 5, 1]], want_pool[[2, 5, 1]].float(), rtol=2e-2, atol=2e-2)


def paged_call(call, page_pad_bytes=0, num_spec=0):
    """The decode call on vLLM's paged mamba cache: the pool's values moved into the recurrent-state view of
    one page per slot (after the three conv states). Returns (call, raw buffer, conv views)."""
    slots = call["initial_state"].shape[0]
    raw, views = paged_mamba_cache(slots, *kda_state_shapes(H, K, HV, V, num_spec), page_pad_bytes, seed=11)
    views[3].copy_(call["initial_state"])
    return dict(call, initial_state=views[3]), raw, views[:3]


@pytest.mark.parametrize("page_pad_bytes", [0, 48], ids=["page", "padded-page"])
def test_decode_on_vllms_paged_cache_is_served_and_equals_the_dense_pool(installed, page_pad_bytes):
    """vLLM's own layout: a slot's conv and recurrent states in one page, the pool a view a page per slot. Served
    (no fallback), the outputs and the slots equal a dense pool's call bitwise, and every byte of the pages
    outside the written slots' recurrent states (conv states, padding, other slots) is unchanged."""
    dense = decode_case(12, 3, 5, 5, [4, 0, 2])
    call, raw, _ = paged_call(dense, page_pad_bytes)
    pool = call["initial_state"]
    assert not pool.is_contiguous() and pool.stride(0) > HV * V * K
    raw0 = raw.clone()
    dense = dict(dense, initial_state=dense["initial_state"].clone())
    before = served("fused_recurrent_kda")
    o, final = installed.layer.fused_recurrent_kda(**call)
    assert served("fused_recurrent_kda") == before + 1 and installed.calls == [], dict(fkda_vllm.REASONS)
    assert final is pool
    o_dense, pool_dense = installed.layer.fused_recurrent_kda(**dense)
    assert torch.equal(bits(o[0, :3]), bits(o_dense[0, :3]))
    assert torch.equal(bits(pool), bits(pool_dense))
    written = torch.zeros_like(raw, dtype=torch.bool)
    for s in (4, 2):    # the bytes of the two live slots' recurrent states
        lo = (pool[s].data_ptr() - raw.data_ptr())
        written[lo:lo + HV * V * K * 4] = True
    assert torch.equal(raw[~written], raw0[~written])
    assert not torch.equal(raw[written], raw0[written])


def test_decode_on_a_paged_cache_with_an_unaligned_page_falls_back(installed):
    call, raw, _ = paged_call(decode_case(13, 3, 3, 3, [1, 2, 3]), page_pad_bytes=4)   # page: 4 bytes past 16
    raw0 = raw.clone()
    fell = fkda_vllm.STATS["fused_recurrent_kda", "fell_back"]
    assert installed.ops.fused_recurrent_kda(**call) == ("original", "fused_recurrent_kda")
    assert fkda_vllm.STATS["fused_recurrent_kda", "fell_back"] == fell + 1
    assert any(e == "fused_recurrent_kda" and "slot stride" in r and "16 bytes" in r
               for (e, r) in fkda_vllm.REASONS), dict(fkda_vllm.REASONS)
    assert torch.equal(raw, raw0)


# ---------------------------------------------------------------------------------------------
# speculative decoding: fused_recurrent_kda_fwd with per-token indices and num_accepted_tokens


def test_spec_decode_fwd_is_served_by_kda_verify(installed):
    gen = torch.Generator().manual_seed(2)
    T = 7
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v, g = torch.randn(1, T, HV, V, generator=gen), -torch.rand(1, T, HV, K, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    pool = torch.randn(9, HV, V, K, generator=gen) * 0.3
    pool[0] = float("nan")
    cu = torch.tensor([0, 2, 5, 7], dtype=torch.int32)
    # request 0: token 1's state stored nowhere (0, the null block); request 1 resumes from its 2nd slot;
    # request 2 reads the null block: padding, its entry 4 is never written
    idx = torch.tensor([[3, 0, -1], [5, 6, 7], [0, 4, -1]], dtype=torch.int32)
    acc = torch.tensor([1, 2, 1], dtype=torch.int32)
    pool0 = pool.clone()
    before = served("fused_recurrent_kda_fwd")
    o, final = installed.ops.fused_recurrent_kda_fwd(q, k, v, g, beta, K ** -0.5, pool, True, cu, idx, acc, True)
    assert served("fused_recurrent_kda_fwd") == before + 1 and installed.calls == []
    assert final is pool and o.shape == (1, T, HV, V)
    want_o, want_pool = ref_verify.kda_verify_step(q, k, v, g, beta, state=pool0, state_indices=idx, cu_seqlens=cu,
                                                   num_accepted_tokens=acc, gate="log", beta_is_logit=False,
                                                   null_slot0=True)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    assert torch.equal(o[0, 5:], torch.zeros(2, HV, V))
    stored = [3, 5, 6, 7]
    torch.testing.assert_close(pool[stored], want_pool[stored].to(pool.dtype), **TOL)
    assert not torch.equal(pool[stored], pool0[stored])
    rest = [0, 1, 2, 4, 8]
    assert torch.equal(bits(pool[rest]), bits(pool0[rest]))

    # the same call on vLLM's paged cache (spec decode keeps 3 + drafts conv inputs a slot): bitwise the same
    raw, views = paged_mamba_cache(9, *kda_state_shapes(H, K, HV, V, num_spec=2), seed=3)
    views[3].copy_(pool0)
    raw0 = raw.clone()
    o_paged, final = installed.ops.fused_recurrent_kda_fwd(q, k, v, g, beta, K ** -0.5, views[3], True, cu, idx, acc,
                                                           True)
    assert final is views[3] and installed.calls == []
    assert torch.equal(bits(o_paged), bits(o)) and torch.equal(bits(views[3]), bits(pool))
    keep = torch.ones(raw.numel(), dtype=torch.bool)
    for s in stored:
        lo = views[3][s].data_ptr() - raw.data_ptr()
        keep[lo:lo + HV * V * K * 4] = False
    assert torch.equal(raw[keep], raw0[keep])


# ---------------------------------------------------------------------------------------------
# prefill: chunk_kda_with_fused_gate (the layer's call) and chunk_kda


def prefill_case(seed, T=11, cu=(0, 4, 11)):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v, raw_g = torch.randn(1, T, HV, V, generator=gen), torch.randn(1, T, HV, K, generator=gen) * 3
    raw_g[0, 2, :, 0] = 25.0                              # past softplus's threshold (20): linear there
    beta = torch.rand(1, T, HV, generator=gen)
    A_log, g_bias = torch.randn(1, 1, HV, 1, generator=gen) * 0.3, torch.randn(HV * K, generator=gen) * 0.5
    h0 = torch.randn(len(cu) - 1, HV, V, K, generator=gen) * 0.3
    return q, k, v, raw_g, beta, A_log, g_bias, h0, torch.tensor(cu, dtype=torch.int32)


def test_prefill_with_fused_gate_is_served_and_matches_the_reference(installed):
    q, k, v, raw_g, beta, A_log, g_bias, h0, cu = prefill_case(3)
    v0 = v.clone()
    before = served("chunk_kda_with_fused_gate")
    o, ht = installed.layer.chunk_kda_with_fused_gate(q=q, k=k, v=v, raw_g=raw_g, beta=beta, A_log=A_log,
                                                      g_bias=g_bias, initial_state=h0, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert served("chunk_kda_with_fused_gate") == before + 1 and installed.calls == []
    assert o.shape == (1, 11, HV, V) and ht.shape == (2, HV, V, K) and ht.dtype == torch.float32
    want_o, want_ht, _ = kda_recurrent(q, k, v0, raw_g, beta, gate="softplus", A_log=A_log.flatten(),
                                       dt_bias=g_bias, beta_is_logit=False, cu_seqlens=cu, initial_state=h0)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(ht.double(), want_ht, **TOL)
    assert torch.equal(v, v0)       # vLLM's Triton writes o over v's storage; the adapter leaves v alone


def test_chunk_kda_with_a_log_gate_is_served(installed):
    q, k, v, _, beta, _, _, h0, cu = prefill_case(4)
    g = -torch.rand(1, 11, HV, K, generator=torch.Generator().manual_seed(5))
    o, ht = installed.ops.chunk_kda(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=cu, ignored_by_vllm=1)
    assert ht is None and installed.calls == []
    want_o, _, _ = kda_recurrent(q, k, v, g, beta, gate="log", beta_is_logit=False, cu_seqlens=cu, initial_state=h0)
    torch.testing.assert_close(o.double(), want_o, **TOL)


# ---------------------------------------------------------------------------------------------
# what is not claimed reaches vLLM's original, with the caller's own arguments


def paged_pool(slots, extra=24, inner_swap=False):
    """A pool a page per slot (vLLM's layout) with `extra` elements before each slot's state; inner_swap: V and
    K swapped in memory (a K-first state seen as [V, K]), which no kernel reads."""
    pages = torch.randn(slots, extra + HV * V * K)
    pool = pages[:, extra:].view(slots, HV, V, K)
    return pool.transpose(2, 3).contiguous().transpose(2, 3) if inner_swap else pool


def _decode_kw(**change):
    call = decode_case(6, 3, 3, 3, [1, 2, 3])
    call.update(change)
    return call


def _prefill_kw(**change):
    q, k, v, raw_g, beta, A_log, g_bias, h0, cu = prefill_case(7)
    call = dict(q=q, k=k, v=v, raw_g=raw_g, beta=beta, A_log=A_log, g_bias=g_bias, initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    call.update(change)
    return call


def _chunk_kw(**change):
    call = _prefill_kw(**change)
    call["g"] = -call.pop("raw_g").abs()
    for n in ("A_log", "g_bias"):
        call.pop(n)
    return call


FALLBACKS = [
    ("fused_recurrent_kda", lambda: _decode_kw(use_qk_l2norm_in_kernel=False), "use_qk_l2norm_in_kernel=True"),
    ("fused_recurrent_kda", lambda: _decode_kw(initial_state=paged_pool(6, extra=3)), "multiple of 16 bytes"),
    ("fused_recurrent_kda", lambda: _decode_kw(initial_state=paged_pool(6, inner_swap=True)), "dims 1-3 contiguous"),
    ("fused_recurrent_kda", lambda: _decode_kw(ssm_state_indices=None, inplace_final_state=False), "state pool only"),
    ("fused_recurrent_kda", lambda: dict(_decode_kw(), q=torch.randn(2, 3, H, K)), "several rows"),
    ("fused_recurrent_kda", lambda: _decode_kw(beta=torch.rand(1, 3, HV, V)), "scalar beta per head"),
    ("fused_recurrent_kda_fwd", lambda: dict(_decode_kw(), scale=None, inplace_final_state=False), "state pool only"),
    ("fused_recurrent_kda_fwd", lambda: dict(_decode_kw(), scale=0.3, num_accepted_tokens=torch.ones(3, dtype=torch.int32)),
     "per-token"),
    ("chunk_kda_with_fused_gate", lambda: _prefill_kw(g_bias=None), "requires A_log and dt_bias"),
    ("chunk_kda_with_fused_gate", lambda: _prefill_kw(initial_state=torch.zeros(2, HV, K, V)), "initial_state"),
    ("chunk_kda", lambda: _chunk_kw(use_qk_l2norm_in_kernel=False, some_vllm_kwarg=3), "use_qk_l2norm_in_kernel"),
]


@pytest.mark.parametrize("entry,make,reason", FALLBACKS, ids=[f"{e}-{r}" for e, _, r in FALLBACKS])
def test_unclaimed_calls_reach_the_original(installed, entry, make, reason):
    call = make()
    fell = fkda_vllm.STATS[entry, "fell_back"]
    result = getattr(installed.ops, entry)(**call)
    assert result == ("original", entry)
    assert fkda_vllm.STATS[entry, "fell_back"] == fell + 1
    assert any(e == entry and reason in r for (e, r) in fkda_vllm.REASONS), dict(fkda_vllm.REASONS)
    [(name, got)] = installed.calls
    assert name == entry
    extra = got.pop("kwargs", {})
    for key, value in call.items():
        assert (extra[key] if key in extra else got[key]) is value, key   # the caller's own objects


def test_training_falls_back(installed):
    q, k, v, _, beta, _, _, h0, cu = prefill_case(8)
    g = -torch.rand(1, 11, HV, K)
    with torch.inference_mode(False), torch.enable_grad():
        q = q.clone().requires_grad_()
        assert installed.ops.chunk_kda(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True,
                                       cu_seqlens=cu) == ("original", "chunk_kda")
    assert any(e == "chunk_kda" and "inference only" in r for (e, r) in fkda_vllm.REASONS)
