"""flashkda_ext against SGLang 0.5.23's real code (tests/sglang_wheel.py: the pinned wheel's files, imported
by path with only their heavy imports stubbed): the plugin loader and HookRegistry select the kernel, the real
KDAKernelDispatcher routes to it, and the real KDAAttnBackend call sites (forward_decode, forward_extend,
_forward_target_verify) drive it on CPU tensors, compared with flashkda_ext.reference. Every keyword those call
sites pass must be one the adapter's signatures name."""
import importlib.metadata
import inspect
import pathlib
import tomllib
import types

import pytest
import torch

import sglang_wheel
from flashkda_ext.integrations import sglang as fk
from flashkda_ext.reference import kda_decode_step, kda_recurrent

H, K, V = 2, 8, 16
SLOTS = 6
TOL = dict(rtol=3e-5, atol=3e-5)


@pytest.fixture
def sgl():
    s = sglang_wheel.real_sglang()
    yield s
    fk.uninstall()
    sglang_wheel.unload()


def select(s, decode="flashkda_ext", prefill="flashkda_ext", verify="flashkda_ext"):
    """SGLang's plugin loader runs our entry point; the flags name the phases; the real resolve + dispatcher."""
    ep = importlib.metadata.EntryPoint("flashkda_ext", "flashkda_ext.integrations.sglang:plugin", "sglang.srt.plugins")
    s.plugins.entry_points = lambda group: [ep] if group == "sglang.srt.plugins" else []
    s.plugins.load_plugins()
    m = s.config.mamba
    m.linear_attn_backend, m.linear_attn_decode_backend = "triton", decode
    m.linear_attn_prefill_backend, m.linear_attn_verify_backend = prefill, verify
    b = s.utils.resolve_linear_attn_backends()
    return s.kda_backend.KDAKernelDispatcher(b.decode, b.prefill, b.verify)


def test_pyproject_declares_the_entry_point_sglang_loads():
    meta = tomllib.loads((pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["sglang.srt.plugins"] == {
        "flashkda_ext": "flashkda_ext.integrations.sglang:plugin"}


def test_the_plugin_selects_flashkda_ext_per_phase(sgl):
    d = select(sgl, decode="triton")
    assert "flashkda_ext" in sgl.choices.LINEAR_ATTN_KERNEL_BACKEND_CHOICES
    assert isinstance(d.decode_kernel, sgl.kda_triton.TritonKDAKernel)
    assert isinstance(d.extend_kernel, fk.FlashKDAExtKernel) and d.verify_kernel is d.extend_kernel
    assert d.extend_kernel.fallback is d.triton_kernel
    assert d.prefill_backend.is_custom() and d.verify_backend.is_custom()
    # the dispatcher's own rules keep it under the safe gate
    assert d.effective_extend_kernel(-5.0, 128, 2) is d.extend_kernel
    # a CUSTOM phase is ours only where that phase was configured with our name
    with pytest.raises(ValueError, match="Unsupported KDA decode backend"):
        sgl.kda_backend.KDAKernelDispatcher(*([sgl.utils.LinearAttnKernelBackend.CUSTOM] * 3))
    sgl.config.mamba.linear_attn_decode_backend = "flashkda_ext"
    d2 = sgl.kda_backend.KDAKernelDispatcher(*([sgl.utils.LinearAttnKernelBackend.CUSTOM] * 3))
    assert isinstance(d2.decode_kernel, fk.FlashKDAExtKernel) and d2.supports_packed_decode
    assert d2.supports_packed_decode_safe_gate


def test_a_custom_name_that_is_not_ours_stays_refused(sgl):
    with pytest.raises(ValueError, match="Unsupported KDA decode backend"):
        select(sgl, decode="someone_else")


def test_without_the_plugin_sglang_refuses_the_name(sgl):
    E = sgl.utils.LinearAttnKernelBackend
    assert E("flashkda_ext") is E.CUSTOM
    with pytest.raises(NotImplementedError, match="no custom KDA verify kernel"):
        sgl.kda_backend.KDAKernelDispatcher(E.TRITON, E.TRITON, E.CUSTOM)


def test_install_and_uninstall(sgl):
    cls = sgl.kda_backend.KDAKernelDispatcher
    init = cls.__init__
    sgl.config.mamba.linear_attn_backend = "flashkda_ext"
    fk.install()
    E = sgl.utils.LinearAttnKernelBackend
    d = cls(E.CUSTOM, E.CUSTOM, E.TRITON)
    assert isinstance(d.decode_kernel, fk.FlashKDAExtKernel) and d.verify_kernel is d.triton_kernel
    fk.uninstall()
    assert cls.__init__ is init and "flashkda_ext" not in sgl.choices.LINEAR_ATTN_KERNEL_BACKEND_CHOICES
    with pytest.raises(ValueError, match="Unsupported KDA decode backend"):
        cls(E.CUSTOM, E.CUSTOM, E.TRITON)


# ---------------------------------------------------------------------------------------------
# the real call sites

class Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_target_verify(self):
        return self.kind == "verify"

    def is_draft_extend_v2(self):
        return self.kind == "draft_extend"

    def is_extend_without_speculative(self):
        return self.kind == "extend"


def backend(s, dispatcher, pool, *, draft=None):
    """A KDAAttnBackend as its __init__ leaves it, minus the model runner: the real methods run on it."""
    be = object.__new__(s.kda_backend.KDAAttnBackend)
    dim = 2 * H * K + H * V
    cache = types.SimpleNamespace(conv=[torch.zeros(SLOTS, 3, dim)], temporal=pool, replayssm_d=None,
                                  replayssm_k=None, replayssm_g=None, replayssm_rawv=None,
                                  intermediate_ssm=None, intermediate_conv_window=[torch.zeros(SLOTS + 1, 4, 3, dim)])
    if draft:
        cache.intermediate_ssm = torch.full((SLOTS + 1, draft, H, V, K), float("nan"), dtype=pool.dtype)
    be.req_to_token_pool = types.SimpleNamespace(mamba2_layer_cache=lambda layer_id: cache, size=SLOTS)
    be.kernel_dispatcher = dispatcher
    be.prefill_graph_metadata = None
    be._fused_chain_verify_fn = None
    be.verify_intermediate_state_indices = s.utils.build_verify_intermediate_state_indices(SLOTS, "cpu")
    be.cache = cache
    return be


def layer(lower_bound=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return types.SimpleNamespace(
        layer_id=0, q_dim=H * K, k_dim=H * K, v_dim=H * V, head_q_dim=K, head_k_dim=K, head_v_dim=V, num_q_heads=H,
        num_k_heads=H, num_v_heads=H, A_log=torch.randn(1, 1, H, 1, generator=gen) * 0.3,
        dt_bias=torch.randn(H * K, generator=gen) * 0.5, lower_bound=lower_bound, conv_weights=None, bias=None)


def metadata(qsl, idx, **extra):
    fm = dict(query_start_loc=qsl, mamba_cache_indices=idx, logical_num_tokens=None, has_mamba_track_mask=False,
              track_chunk_idx=None, track_ssm_h_src=None, track_ssm_h_batch_src=None, state_checkpoint_cu_starts=None,
              num_state_checkpoints=0, state_checkpoint_every_n_tokens=0, state_checkpoint_indices=None,
              retrieve_next_token=None, retrieve_next_sibling=None, retrieve_parent_token=None)
    fm.update(extra)
    return types.SimpleNamespace(**fm)


def spy_keywords(kernel):
    """Record the keywords each method gets and check each against the method's named parameters."""
    seen = {}
    for name in ("decode", "packed_decode", "extend", "target_verify"):
        method = getattr(kernel, name)
        params = inspect.signature(method).parameters
        named = {p for p, v in params.items() if v.kind is not inspect.Parameter.VAR_KEYWORD}

        def wrapped(*args, _m=method, _name=name, _named=named, **kwargs):
            seen.setdefault(_name, set()).update(kwargs)
            assert set(kwargs) <= _named, f"{_name}: unknown keywords {sorted(set(kwargs) - _named)}"
            return _m(*args, **kwargs)
        setattr(kernel, name, wrapped)
    return seen


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_forward_decode(sgl, lower_bound):
    d = select(sgl)
    seen = spy_keywords(d.decode_kernel)
    gen = torch.Generator().manual_seed(1)
    N = 4
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    pool0 = pool.clone()
    be, ly = backend(sgl, d, pool), layer(lower_bound)
    idx = torch.tensor([5, 0, 3, 1], dtype=torch.int32)
    be.forward_metadata = metadata(torch.arange(N + 1, dtype=torch.int32), idx)
    mixed = torch.randn(N, 2 * H * K + H * V, generator=gen)
    a, b = torch.randn(N, H * K, generator=gen), torch.randn(1, N, H, generator=gen)
    fb = types.SimpleNamespace(mamba_track_mask=None)
    o = be.forward_decode(ly, fb, mixed, a, b)
    assert seen.keys() == {"packed_decode"}          # the packed route: the safe gate too
    q, k, v = (x.reshape(N, H, -1) for x in mixed.split([H * K, H * K, H * V], -1))
    gate = dict(gate="softplus") if lower_bound is None else dict(gate="bounded", lower_bound=lower_bound)
    want_o, want_pool = kda_decode_step(q, k, v, a.view(N, H, K), b[0], state=pool0, state_indices=idx,
                                        A_log=ly.A_log.flatten(), dt_bias=ly.dt_bias, **gate)
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)
    assert fk.STATS["packed_decode", "served"] > 0


def extend_inputs(lens, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    mixed = torch.randn(T, 2 * H * K + H * V, generator=gen)
    a, b = torch.randn(1, T, H * K, generator=gen), torch.randn(1, T, H, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return mixed, a, b, qsl


def reference_extend(ly, mixed, a, b, qsl, pool0, idx, lower_bound=None, every=0):
    T = mixed.shape[0]
    q, k, v = (x.reshape(1, T, H, -1) for x in mixed.split([H * K, H * K, H * V], -1))
    gate = dict(gate="softplus") if lower_bound is None else dict(gate="bounded", lower_bound=lower_bound)
    return kda_recurrent(q, k, v, a.view(1, T, H, K), b, A_log=ly.A_log.flatten(), dt_bias=ly.dt_bias,
                         beta_is_logit=True, cu_seqlens=qsl, initial_state=pool0, state_indices=idx,
                         checkpoint_every=every, **gate)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_forward_extend(sgl, lower_bound):
    d = select(sgl)
    seen = spy_keywords(d.extend_kernel)
    lens = [70, 9]
    mixed, a, b, qsl = extend_inputs(lens, seed=2)
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    pool0 = pool.clone()
    be, ly = backend(sgl, d, pool), layer(lower_bound, seed=4)
    idx = torch.tensor([2, 4], dtype=torch.int32)
    be.forward_metadata = metadata(qsl, idx)
    fb = types.SimpleNamespace(forward_mode=Mode("extend"), extend_prefix_lens=torch.tensor([0, 5]),
                               extend_seq_lens_cpu=lens, mamba_track_mask=None)
    o = be.forward_extend(ly, fb, mixed, a, b)
    assert "extend_prefix_lens" in seen["extend"] and "state_checkpoint_indices" in seen["extend"]
    want_o, want_pool, _ = reference_extend(ly, mixed, a, b, qsl, pool0, idx, lower_bound)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool, want_pool, **TOL)


def test_forward_extend_radix_track_snapshot(sgl):
    """The prefix-cache track path: SGLang asserts supports_track_state_snapshot, allocates the fp32 buffer,
    and its _track_mamba_state_extend copies our snapshot into the track slot."""
    d = select(sgl)
    lens = [150, 40]
    mixed, a, b, qsl = extend_inputs(lens, seed=5)
    gen = torch.Generator().manual_seed(6)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    pool0 = pool.clone()
    be, ly = backend(sgl, d, pool), layer(None, seed=7)
    idx = torch.tensor([1, 3], dtype=torch.int32)
    # request 0 tracks the state after 128 tokens (chunk 2) into slot 5; request 1 tracks nothing
    be.forward_metadata = metadata(
        qsl, idx, has_mamba_track_mask=True, track_chunk_idx=torch.tensor([2, -1], dtype=torch.int32),
        track_ssm_h_src=torch.tensor([2]), track_ssm_h_dst=torch.tensor([5]), track_ssm_h_batch_src=torch.tensor([0]),
        track_ssm_recompute_dst=None, track_ssm_final_src=torch.zeros(0, dtype=torch.int64),
        track_ssm_final_dst=torch.zeros(0, dtype=torch.int64), conv_states_mask_indices=torch.tensor([5]),
        track_conv_indices=torch.tensor([[125, 126, 127]]))
    fb = types.SimpleNamespace(forward_mode=Mode("extend"), extend_prefix_lens=torch.tensor([0, 0]),
                               extend_seq_lens_cpu=lens, mamba_track_mask=torch.tensor([True, False]))
    o = be.forward_extend(ly, fb, mixed, a, b)
    want_o, want_pool, ckpt = reference_extend(ly, mixed, a, b, qsl, pool0, idx, every=64)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool[[1, 3]], want_pool[[1, 3]], **TOL)
    torch.testing.assert_close(pool[5].double(), ckpt[0, 1], **TOL)   # the state after 2 * 64 tokens
    assert torch.equal(pool[[0, 2, 4]], pool0[[0, 2, 4]])


def test_forward_extend_draft_falls_back_to_sglangs_triton(sgl):
    d = select(sgl)
    mixed, a, b, qsl = extend_inputs([5, 6], seed=8)
    pool = torch.zeros(SLOTS, H, V, K)
    be = backend(sgl, d, pool)
    be.forward_metadata = metadata(qsl, torch.tensor([1, 2], dtype=torch.int32))
    fb = types.SimpleNamespace(forward_mode=Mode("draft_extend"), extend_prefix_lens=torch.tensor([0, 0]),
                               extend_seq_lens_cpu=[5, 6], mamba_track_mask=None)
    before = fk.STATS["extend", "fell_back"]
    assert be.forward_extend(layer(), fb, mixed, a, b) == ("triton", "chunk_kda")
    (name, kwargs), = sgl.triton_calls
    assert kwargs["initial_state"] is pool and kwargs["beta_is_raw"] is True
    assert fk.STATS["extend", "fell_back"] == before + 1


# chains (topk = 1), and a draft tree (topk > 1): retrieve_parent_token int64 as SGLang's eager path allocates it,
# column 0 unset; token t starts from its parent's step
TREE = torch.tensor([[-1, 0, 0], [-1, 0, 1]], dtype=torch.int64)


@pytest.mark.parametrize("lower_bound,parents", [(None, None), (-5.0, None), (-5.0, TREE), (None, TREE)],
                         ids=["softplus", "bounded", "bounded-tree", "softplus-tree"])
def test_forward_target_verify(sgl, lower_bound, parents):
    d = select(sgl)
    seen = spy_keywords(d.verify_kernel)
    D, N = 3, 2
    gen = torch.Generator().manual_seed(9)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    pool0 = pool.clone()
    be, ly = backend(sgl, d, pool, draft=D), layer(lower_bound, seed=10)
    idx = torch.tensor([4, 2], dtype=torch.int32)
    qsl = torch.arange(0, N * D + 1, D, dtype=torch.int32)
    be.forward_metadata = metadata(qsl, idx, retrieve_parent_token=parents)
    T = N * D
    mixed = torch.randn(T, 2 * H * K + H * V, generator=gen)
    a, b = torch.randn(T, H * K, generator=gen), torch.randn(T, H, generator=gen)
    fb = types.SimpleNamespace(forward_mode=Mode("verify"), req_pool_indices=torch.tensor([3, 1]),
                               spec_info=types.SimpleNamespace(draft_token_num=D, ragged_verify_layout=None))
    served = fk.STATS["target_verify", "served"]
    o = be.forward_extend(ly, fb, mixed, a, b)
    assert {"intermediate_state_indices", "retrieve_parent_token"} <= seen["target_verify"]
    assert fk.STATS["target_verify", "served"] == served + 1
    assert torch.equal(pool, pool0)                                  # the committed pool is never written
    q, k, v = (x.reshape(T, H, -1) for x in mixed.split([H * K, H * K, H * V], -1))
    gate = dict(gate="softplus") if lower_bound is None else dict(gate="bounded", lower_bound=lower_bound)
    buf = be.cache.intermediate_ssm
    one = torch.zeros(1, dtype=torch.int32)
    for n in range(N):                                             # request n owns scratch row n (SGLang's table)
        steps = [pool0[idx[n]:idx[n] + 1]]                         # the start, then the state after each token
        for t in range(D):
            i = n * D + t
            start = steps[-1] if parents is None or t == 0 else steps[1 + int(parents[n, t])]
            want, state = kda_decode_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], a[i:i + 1].view(1, H, K),
                                          b[i:i + 1], state=start, state_indices=one, A_log=ly.A_log.flatten(),
                                          dt_bias=ly.dt_bias, **gate)
            steps.append(state)
            torch.testing.assert_close(o[0, i].double(), want[0], **TOL)
            torch.testing.assert_close(buf[n, t].double(), state[0].double(), **TOL)
    assert torch.isnan(buf[N:]).all()


# SGLang's breakable prefill CUDA graph: the captured extend (kda_prefill_graph.kda_extend_in_graph) on its real
# tables (KDAPrefillGraphMetadata) and its real plan-and-run driver (FlashInferKDAPrefillGraph)

def test_the_captured_prefill_is_offered_only_when_asked(sgl, monkeypatch):
    """KDAAttnBackend.supports_prefill_graph_extend (real) reads the kernel's prefill_graph_wrapper_cls: ours only
    with FLASHKDA_EXT_SGLANG_PREFILL_GRAPH=1 and no mamba extra buffer; anything but 1 / 0 names the variable."""
    from flashkda_ext.integrations.sglang.prefill_graph import ENV_VAR, PrefillGraphWrapper
    d = select(sgl)
    be = backend(sgl, d, torch.zeros(SLOTS, H, V, K))
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert d.extend_kernel.prefill_graph_wrapper_cls is None and not be.supports_prefill_graph_extend()
    monkeypatch.setenv(ENV_VAR, "1")
    assert d.extend_kernel.prefill_graph_wrapper_cls is PrefillGraphWrapper and be.supports_prefill_graph_extend()
    sgl.config.mamba.enable_mamba_extra_buffer = True
    assert d.extend_kernel.prefill_graph_wrapper_cls is None and not be.supports_prefill_graph_extend()
    sgl.config.mamba.enable_mamba_extra_buffer = False
    # an fp16 pool, by SGLang's flag or its env override: the eager extend, which falls back to SGLang's kernel
    monkeypatch.setattr(sgl.config.mamba, "mamba_ssm_dtype", "float16")
    assert d.extend_kernel.prefill_graph_wrapper_cls is None and not be.supports_prefill_graph_extend()
    monkeypatch.setattr(sgl.config.mamba, "mamba_ssm_dtype", "bfloat16")
    assert d.extend_kernel.prefill_graph_wrapper_cls is PrefillGraphWrapper
    monkeypatch.setitem(sglang_wheel._Envs.DEFAULTS, "SGLANG_MAMBA_SSM_DTYPE", "float16")
    assert d.extend_kernel.prefill_graph_wrapper_cls is None and not be.supports_prefill_graph_extend()
    monkeypatch.setitem(sglang_wheel._Envs.DEFAULTS, "SGLANG_MAMBA_SSM_DTYPE", None)
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=ENV_VAR):
        be.supports_prefill_graph_extend()


def graph_backend(sgl, d, pool, slot_of_request):
    be = backend(sgl, d, pool)
    be.prefill_graph_max_seqs, be.device = 6, "cpu"
    table = torch.tensor(slot_of_request, dtype=torch.int32)
    be.req_to_token_pool.get_mamba_indices = lambda req_pool_indices: table[req_pool_indices]
    be.req_to_token_pool.translate_mamba_indices = lambda indices: indices
    return be


def graph_batch(lens, bucket, requests):
    return types.SimpleNamespace(
        extend_num_tokens=bucket, req_pool_indices=torch.tensor(requests), _original_batch_size=None,
        mamba_track_indices=None, mamba_track_mask=None, extend_seq_lens_cpu=list(lens),
        extend_prefix_lens=torch.tensor([3] * len(lens)), forward_mode=Mode("extend"))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_forward_extend_in_sglangs_prefill_graph(sgl, monkeypatch, lower_bound):
    """One bucket of 96 tokens and 6 sequence slots, as SGLang captures it, then two batches through it: each
    refreshes the real tables (pinned copies: page-locking is the identity on a CPU) and runs the real
    forward_extend -> kda_extend_in_graph -> FlashInferKDAPrefillGraph -> our wrapper. The padded sequences' slot
    indices are clamped to 0 by SGLang: slot 0 is a live request's in the second batch and must hold its own
    state; rows past the batch's tokens are zero; unaddressed slots bitwise unchanged."""
    from flashkda_ext.integrations.sglang.prefill_graph import ENV_VAR, PrefillGraphWrapper
    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    # FlashInferKDAPrefillGraph passes output = empty_like(q): its captured path needs K == V (Kimi's 128 / 128)
    monkeypatch.setitem(globals(), "K", V)
    d = select(sgl)
    gen = torch.Generator().manual_seed(21)
    pool = torch.randn(SLOTS, H, V, K, generator=gen) * 0.3
    be, ly = graph_backend(sgl, d, pool, [5, 0, 3, 1, 2, 4]), layer(lower_bound, seed=22)
    bucket = 96
    meta = be.init_prefill_graph_metadata(graph_batch([bucket], bucket, [0]))     # the capture's batch
    assert isinstance(meta.flashinfer, sgl.kda_flashinfer_prefill_graph.FlashInferKDAPrefillGraph)
    assert meta.flashinfer.wrapper_cls is PrefillGraphWrapper and meta.max_seqs == 6
    for lens, requests in (([40, 30], [0, 2]), ([10, 50, 20, 5], [3, 1, 4, 0])):
        N, T = len(lens), sum(lens)
        be.refresh_prefill_graph_metadata(meta, graph_batch(lens, bucket, requests))
        be.prefill_graph_metadata = meta
        mixed = torch.randn(bucket, 2 * H * K + H * V, generator=gen)
        a, b = torch.randn(1, bucket, H * K, generator=gen), torch.randn(1, bucket, H, generator=gen)
        pool0 = pool.clone()
        o = be.forward_extend(ly, graph_batch(lens, bucket, requests), mixed, a, b)
        slots = torch.tensor([[5, 0, 3, 1, 2, 4][r] for r in requests], dtype=torch.int32)
        qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        want_o, want_pool, _ = reference_extend(ly, mixed[:T], a[:, :T], b[:, :T], qsl, pool0, slots, lower_bound)
        assert o.shape == (1, bucket, H, V)
        torch.testing.assert_close(o[:, :T].double(), want_o, **TOL)
        assert torch.equal(o[:, T:], torch.zeros(1, bucket - T, H, V))
        torch.testing.assert_close(pool[slots.long()], want_pool[slots.long()], **TOL)
        untouched = [s for s in range(SLOTS) if s not in slots.tolist()]
        assert torch.equal(pool[untouched], pool0[untouched])
    assert list(meta.flashinfer.wrappers) == [ly.layer_id]     # one wrapper a layer, planned again per batch


def test_an_unknown_keyword_through_the_real_dispatcher_is_refused(sgl):
    """The dispatcher forwards extras (**kwargs) to the kernel: one the adapter does not know is a TypeError,
    never ignored."""
    d = select(sgl)
    z = torch.zeros(1, 3, H, K)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['new_sglang_argument'\]"):
        d.target_verify(A_log=torch.zeros(H), dt_bias=torch.zeros(H * K), q=z, k=z, v=torch.zeros(1, 3, H, V),
                        a=torch.zeros(3, H * K), b=torch.zeros(3, H), ssm_states=torch.zeros(SLOTS, H, V, K),
                        cache_indices=torch.tensor([0], dtype=torch.int32),
                        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                        intermediate_states_buffer=torch.zeros(2, 3, H, V, K),
                        intermediate_state_indices=torch.tensor([0, 1], dtype=torch.int32), cache_steps=3,
                        retrieve_parent_token=None, new_sglang_argument=1)


@pytest.mark.parametrize("ci", ["true", None])
def test_a_missing_wheel_fails_under_ci_and_skips_elsewhere(ci, monkeypatch, tmp_path):
    monkeypatch.setattr(sglang_wheel, "CACHE", tmp_path)
    monkeypatch.setattr(sglang_wheel, "PIP_DOWNLOAD", [__import__("sys").executable, "-c", "raise SystemExit(1)"])
    monkeypatch.delenv("FLASHKDA_EXT_ENGINE_WHEELS", raising=False)
    if ci:
        monkeypatch.setenv("CI", ci)
    else:
        monkeypatch.delenv("CI", raising=False)
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(expected, match="sglang==0.5.23 wheel not available"):
        sglang_wheel.find_wheel()


def test_every_capability_flag_the_dispatcher_reads_is_declared(sgl):
    """The flags kda_backend.py reads from a kernel, taken from its source: each is set on FlashKDAExtKernel
    itself (not inherited by accident, not left to a getattr default)."""
    import re
    src = (sgl.root / "sglang/srt/layers/attention/linear/kda_backend.py").read_text()
    names = set(re.findall(r"\b((?:supports|uses)_[a-z_]+)", src))
    # read from the backend itself, or from other kernels' instances (cutedsl / ptx / nvidia prefill)
    names -= {"supports_prefill_graph_extend", "supports_ragged_verify_graph", "supports_prefill"}
    assert names and names <= set(vars(fk.FlashKDAExtKernel)), sorted(names - set(vars(fk.FlashKDAExtKernel)))


def test_the_plugin_is_inert_until_a_phase_names_flashkda_ext(sgl):
    d = select(sgl, decode="triton", prefill="triton", verify="triton")
    assert all(isinstance(getattr(d, a), sgl.kda_triton.TritonKDAKernel)
               for a in ("decode_kernel", "extend_kernel", "verify_kernel"))
    target = "sglang.srt.layers.attention.linear.kda_backend.KDAKernelDispatcher.__init__"
    assert target not in sgl.hook_registry.HookRegistry._patched
