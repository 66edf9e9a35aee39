"""flashkda_ext.integrations.vllm against the real vLLM 0.34.0 code (conformance, CPU).

The pinned wheel is fetched and its KDA modules imported by path (tests/vllm_wheel.py: which files, and the
only stubs: vllm.platforms.current_platform as a CPU-only platform, vllm.logger.init_logger, the CustomOp base
of the vendored module's norm class, and bare parent packages). With no wheel: a failure under CI=true, a skip
elsewhere.

- install() rebinds the real modules' names and uninstall() restores them; the adapters keep vLLM's signatures.
- The keyword arguments of every call the real layers make (read from the real sources with ast) are named
  parameters of the adapters: none is swallowed by **kwargs.
- Calls made as the layers make them (packed decode, chunk prefill with the bounded or softplus gate,
  speculative verify; bf16 and fp32 pools, a paged pool, the null block, CUDA-graph padding) are served on the
  CPU backend and compared with flashkda_ext.reference; calls outside what the kernels serve reach vLLM's
  function (a recorder with the real signature: Triton does not run here) with the reason counted.
"""
import ast
import functools
import inspect

import pytest
import torch

import vllm_wheel
from vllm_wheel import real, tree  # noqa: F401  (fixtures)
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.reference import kda_decode_step, kda_recurrent, kda_verify_step

H, K, V = 2, 8, 8               # K = V: vLLM's recurrent state is [H, D, D]
TOL = dict(rtol=2e-5, atol=2e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
K3_NAMES = ("fused_recurrent_kda_packed_decode", "chunk_kda_with_fused_gate", "fused_recurrent_kda")
VENDORED_NAMES = ("fused_recurrent_kda_fwd", "chunk_kda", "fused_recurrent_kda")
LAYERS = ("vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn", "vllm.models.kimi_k3.nvidia.kda")


@pytest.fixture
def recorded(real, monkeypatch):
    """The real modules with vLLM's functions replaced by recorders of the same signature (a fallback here
    cannot run Triton), then install()."""
    calls = []

    def recorder(module, name):
        fn = getattr(module, name)

        @functools.wraps(fn)
        def original(*args, **kwargs):
            calls.append((module.__name__, name, inspect.signature(fn).bind(*args, **kwargs).arguments))
            return ("original", name)
        monkeypatch.setattr(module, name, original)

    for name in K3_NAMES:
        recorder(real.k3, name)
    for name in VENDORED_NAMES:
        recorder(real.vendored, name)
    fkda_vllm.install()
    real.calls = calls
    return real


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def stat(site, what="served"):
    return fkda_vllm.STATS[site, what]


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def paged_pool(slots, dtype, conv_dim, conv_len=3, pad_bytes=0, seed=0):
    """vLLM's paged mamba cache for one KDA layer: a page per slot holding the conv state [conv_len, conv_dim]
    (bf16) then the recurrent state [H, V, K] (dtype); returns (raw bytes, recurrent view [slots, H, V, K])."""
    conv = conv_len * conv_dim * 2
    esize = torch.empty((), dtype=dtype).element_size()
    page = conv + H * V * K * esize + pad_bytes
    raw = torch.randint(0, 256, (slots * page,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    view = torch.as_strided(raw.view(dtype), (slots, H, V, K), (page // esize, V * K, K, 1), conv // esize)
    view.copy_(torch.randn(slots, H, V, K, generator=torch.Generator().manual_seed(seed + 1)) * 0.3)
    return raw, view


# ---------------------------------------------------------------------------------------------
# install / uninstall on the real modules


def test_install_rebinds_the_real_ops_and_uninstall_restores(real):
    originals = {("k3", n): getattr(real.k3, n) for n in K3_NAMES}
    originals.update({("vendored", n): getattr(real.vendored, n) for n in VENDORED_NAMES})
    submodule = real.k3.fused_recurrent          # defines fused_recurrent_kda(_packed_decode): rebound too
    report = fkda_vllm.install()
    assert fkda_vllm.installed()
    for (point, name), original in originals.items():
        module = real.k3 if point == "k3" else real.vendored
        adapter = getattr(module, name)
        assert adapter is not original and adapter.__wrapped__ is original
        assert inspect.signature(adapter) == inspect.signature(original)
        assert f"{module.__name__}.{name}" in report[f"{point}.{name}"]
    assert submodule.fused_recurrent_kda_packed_decode is real.k3.fused_recurrent_kda_packed_decode
    again = fkda_vllm.install()                    # idempotent: the same adapters
    assert all(isinstance(v, list) for v in again.values())
    assert real.k3.fused_recurrent_kda.__wrapped__ is originals["k3", "fused_recurrent_kda"]
    fkda_vllm.uninstall()
    assert not fkda_vllm.installed()
    for (point, name), original in originals.items():
        assert getattr(real.k3 if point == "k3" else real.vendored, name) is original
    assert submodule.fused_recurrent_kda_packed_decode is originals["k3", "fused_recurrent_kda_packed_decode"]


def test_install_skips_a_name_whose_signature_changed(real, monkeypatch):
    def fused_recurrent_kda_packed_decode(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, initial_state,
                                          state_indices, scale=None, out=None):   # lower_bound dropped
        raise AssertionError

    monkeypatch.setattr(real.k3, "fused_recurrent_kda_packed_decode", fused_recurrent_kda_packed_decode)
    report = fkda_vllm.install()
    assert report["k3.fused_recurrent_kda_packed_decode"].startswith("skipped: original: vLLM's signature")
    assert real.k3.fused_recurrent_kda_packed_decode is fused_recurrent_kda_packed_decode


def test_install_without_vllm_says_so(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)
    with pytest.raises(ImportError, match="is vllm installed"):
        fkda_vllm.install()
    assert not fkda_vllm.installed()
    monkeypatch.delenv(fkda_vllm.ENV_VAR, raising=False)
    assert fkda_vllm.install_from_env() is None


@pytest.mark.parametrize("value", ["off", "false", "no", "0", " 0 ", ""])
def test_the_install_switches_read_off_as_off(monkeypatch, value):
    """FLASHKDA_EXT_VLLM and the opt-in adapters' variables are read as every on/off variable is (switches.py):
    "off" / "false" / "no" install nothing (they once meant on: any value but "" / "0" installed)."""
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)   # install() would raise ImportError
    monkeypatch.setenv(fkda_vllm.ENV_VAR, value)
    assert fkda_vllm.install_from_env() is None
    for _point, _module, _bodies, variable in fkda_vllm.OPT_IN_POINTS:
        monkeypatch.setenv(variable, value)
        assert fkda_vllm._opted_in(variable) is False


@pytest.mark.parametrize("value", ["1", "on", "TRUE", "yes"])
def test_the_install_switches_read_on_as_on(monkeypatch, value):
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)
    monkeypatch.setenv(fkda_vllm.ENV_VAR, value)
    with pytest.raises(ImportError, match="is vllm installed"):     # install() was called
        fkda_vllm.install_from_env()
    for _point, _module, _bodies, variable in fkda_vllm.OPT_IN_POINTS:
        monkeypatch.setenv(variable, value)
        assert fkda_vllm._opted_in(variable) is True


@pytest.mark.parametrize("value", ["2", "maybe", "of"])
def test_an_install_switch_that_is_no_switch_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(fkda_vllm.ENV_VAR, value)
    with pytest.raises(ValueError, match=fkda_vllm.ENV_VAR):
        fkda_vllm.install_from_env()
    for _point, _module, _bodies, variable in fkda_vllm.OPT_IN_POINTS:
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=variable):
            fkda_vllm._opted_in(variable)


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_missing_wheel_fails_under_ci_and_skips_elsewhere(monkeypatch, ci):
    def no_wheel():
        raise RuntimeError("pip download vllm==0.34.0 failed: no network")

    monkeypatch.setattr(vllm_wheel, "_wheel", no_wheel)
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(expected, match="no network"):
        vllm_wheel.require()


def test_importing_the_adapter_does_not_import_vllm(tmp_path):
    import subprocess
    import sys
    poison = tmp_path / "vllm"
    poison.mkdir()
    (poison / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import flashkda_ext.integrations.vllm; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)


def test_the_entry_point_names_install_from_env():
    import tomllib
    from pathlib import Path
    py = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    target = py["project"]["entry-points"]["vllm.general_plugins"]["flashkda_ext"]
    module, _, attr = target.partition(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is fkda_vllm.install_from_env


# ---------------------------------------------------------------------------------------------
# what the real layers pass


def _calls(tree, module, names):
    """(callee, [keywords]) of every call to `names` in the real module's source."""
    found = []
    for node in ast.walk(ast.parse(vllm_wheel.source(tree, module))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            assert not node.args, f"{module} calls {node.func.id} positionally"
            found.append((node.func.id, [kw.arg for kw in node.keywords]))
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_the_layers_import_the_k3_ops_at_call_time(tree, layer):
    """The patch point: both layers import the three names from the nvidia K3 ops package inside _forward,
    so the package attributes install() rebinds are what every call reads."""
    src = ast.parse(vllm_wheel.source(tree, layer))
    forwards = [f for f in ast.walk(src) if isinstance(f, ast.FunctionDef) and f.name == "_forward"]
    imported = {a.name for f in forwards for n in ast.walk(f) if isinstance(n, ast.ImportFrom)
                and n.module == vllm_wheel.K3_OPS for a in n.names}
    assert set(K3_NAMES) <= imported


@pytest.mark.parametrize("module,point,names", [
    (LAYERS[0], "k3", K3_NAMES), (LAYERS[1], "k3", K3_NAMES),
    ("vllm.model_executor.models.bailing_moe_v3", "vendored", VENDORED_NAMES)])
def test_every_keyword_the_layers_pass_is_known_to_the_adapter(tree, module, point, names):
    bodies = dict(fkda_vllm.PATCH_POINTS[[p for p, _, _ in fkda_vllm.PATCH_POINTS].index(point)][2])
    calls = _calls(tree, module, names)
    assert {c for c, _ in calls} == set(names)
    for callee, keywords in calls:
        params = inspect.signature(bodies[callee]).parameters
        named = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
        extra = set(keywords) - named
        # the vendored wrappers ignore bailing_moe_v3's safe_gate / lower_bound: the only keywords not named
        assert extra <= (set(fkda_vllm.vendored.IGNORED_BY_VLLM) if point == "vendored" else set()), (callee, extra)


def test_k3s_own_prefill_on_an_h200_is_flashkda_and_the_benchmark_can_time_it(tree):
    """K3's layer on sm_90 with a bounded gate picks FlashKDA ("auto"), vLLM's own CUDA prefill, which install()
    does not rebind (docs/integrations.md): benchmarks/bench_vllm.py times it beside ours. Its wrapper compiles from
    the wheel's source, takes every keyword the layer passes, and the wheel's extension is extracted for the GPU."""
    import vllm_step_metadata
    src = vllm_wheel.source(tree, LAYERS[1])
    assert "capability.major in (9, 10, 12)" in src and 'backend in ("auto", "flashkda")' in src
    fn = vllm_step_metadata.flashkda_prefill(tree)
    params = set(inspect.signature(fn).parameters)
    calls = _calls(tree, LAYERS[1], ("_flashkda_prefill",))
    assert calls and all(set(kw) <= params for _, kw in calls)
    assert (tree / "vllm" / "_flashkda_C.abi3.so").is_file()


# ---------------------------------------------------------------------------------------------
# packed decode (K3 and Kimi-Linear plain decode)


def packed_decode_call(B, idx, state, lower_bound, seed=0, dtype=torch.float32, out=False):
    """The layer's call: the post-conv packed buffer [B, 3*H*K], g1 [1, B, H, K], beta a strided view of the
    projection [1, B, H] (its row also holds the gate), fp32 A_log [H] and dt_bias [H*K]."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(B, H + 5, generator=gen).to(dtype)
    call = dict(mixed_qkv=torch.randn(B, 3 * H * K, generator=gen).to(dtype),
                raw_g=torch.randn(1, B, H, K, generator=gen).to(dtype), raw_beta=proj[:, :H].unsqueeze(0),
                A_log=torch.randn(H, generator=gen) * 0.5, dt_bias=torch.randn(H * K, generator=gen) * 0.5,
                lower_bound=lower_bound, initial_state=state,
                state_indices=torch.tensor(idx, dtype=torch.int32))
    if out:
        call["out"] = torch.full((1, B, H, V), 7.0, dtype=dtype)
    return call


def packed_decode_reference(call, pool0):
    m = call["mixed_qkv"]
    B = m.shape[0]
    q, k, v = m.view(B, 3, H, K).unbind(1)
    gate = dict(gate="softplus") if call["lower_bound"] is None else dict(gate="bounded",
                                                                          lower_bound=call["lower_bound"])
    return kda_decode_step(q, k, v, call["raw_g"][0], call["raw_beta"][0], state=pool0,
                           state_indices=call["state_indices"], A_log=call["A_log"], dt_bias=call["dt_bias"],
                           null_slot0=True, **gate)


@pytest.mark.parametrize("B,idx", [(1, [3]), (4, [5, 0, 2, -1])], ids=["one-row", "null-block-and-padding"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_packed_decode_is_served_and_matches_the_reference(recorded, B, idx, lower_bound, pool_dtype):
    raw, pool = paged_pool(7, pool_dtype, conv_dim=3 * H * K, seed=B)
    raw0, pool0 = raw.clone(), pool.clone()
    call = packed_decode_call(B, idx, pool, lower_bound, seed=B, out=B > 1)
    before = stat("k3.fused_recurrent_kda_packed_decode")
    o, final = recorded.k3.fused_recurrent_kda_packed_decode(**call)
    assert stat("k3.fused_recurrent_kda_packed_decode") == before + 1 and recorded.calls == []
    assert final is pool and o.shape == (1, B, H, V)
    if B > 1:
        assert o is call["out"]
    want_o, want_pool = packed_decode_reference(call, pool0)
    tol = TOL if pool_dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(o[0].double(), want_o, **tol)
    live = [s for s in idx if s > 0]
    torch.testing.assert_close(pool[live].double(), want_pool[live].double(), **tol)
    for r, s in enumerate(idx):
        if s <= 0:
            assert torch.equal(o[0, r], torch.zeros(H, V))          # padding rows: zeros, as vLLM's kernel
    written = torch.zeros_like(raw, dtype=torch.bool)
    for s in live:
        lo = pool[s].data_ptr() - raw.data_ptr()
        written[lo:lo + pool[s].numel() * pool.element_size()] = True
    assert torch.equal(raw[~written], raw0[~written])               # conv states, null block, other slots


def test_packed_decode_with_v_unlike_k_takes_the_three_ranges(recorded):
    """K3 has V == K (one view and an unbind make q, k, v); a layer with V != K (vLLM's kernel takes it) gets the
    three channel ranges [0, HK), [HK, 2HK), [2HK, 2HK + HV) as they are: served, matching the reference."""
    Vw, B, idx = 2 * K, 3, [2, 0, 4]
    gen = torch.Generator().manual_seed(5)
    pool = torch.randn(6, H, Vw, K, generator=gen) * 0.3
    pool0 = pool.clone()
    wide = torch.randn(B, 2 * H * K + H * Vw + 3, generator=gen)
    call = dict(mixed_qkv=wide[:, :2 * H * K + H * Vw], raw_g=torch.randn(1, B, H, K, generator=gen),
                raw_beta=torch.randn(1, B, H, generator=gen), A_log=torch.randn(H, generator=gen) * 0.5,
                dt_bias=torch.randn(H * K, generator=gen) * 0.5, lower_bound=-5.0, initial_state=pool,
                state_indices=torch.tensor(idx, dtype=torch.int32))
    before = stat("k3.fused_recurrent_kda_packed_decode")
    o, _ = recorded.k3.fused_recurrent_kda_packed_decode(**call)
    assert stat("k3.fused_recurrent_kda_packed_decode") == before + 1 and recorded.calls == []
    m, hk = call["mixed_qkv"], H * K
    q, k, v = m[:, :hk].view(B, H, K), m[:, hk:2 * hk].view(B, H, K), m[:, 2 * hk:].view(B, H, Vw)
    want_o, want_pool = kda_decode_step(q, k, v, call["raw_g"][0], call["raw_beta"][0], state=pool0,
                                        state_indices=call["state_indices"], A_log=call["A_log"],
                                        dt_bias=call["dt_bias"], null_slot0=True, gate="bounded", lower_bound=-5.0)
    assert o.shape == (1, B, H, Vw)
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool[[2, 4]].double(), want_pool[[2, 4]].double(), **TOL)
    assert torch.equal(o[0, 1], torch.zeros(H, Vw)) and torch.equal(pool[[0, 1, 3, 5]], pool0[[0, 1, 3, 5]])

def test_packed_decode_bounded_gate_is_not_the_softplus_gate(recorded):
    """The bound changes the answer by far more than the tolerance: serving it as softplus would fail above."""
    pool = torch.randn(4, H, V, K) * 0.3
    call = packed_decode_call(2, [1, 2], pool.clone(), -5.0)
    o, _ = recorded.k3.fused_recurrent_kda_packed_decode(**call)
    soft, _ = packed_decode_reference(dict(call, lower_bound=None), pool)
    assert (o[0].double() - soft).abs().max() > 1e-2


@pytest.mark.parametrize("B", [1, 4])
def test_packed_decode_passes_q_k_v_as_views(recorded, monkeypatch, B):
    """The packed buffer's ranges go to kda_decode as row-strided views (no copy) at any row count."""
    import flashkda_ext.ops as ops
    seen, real_decode = [], ops.kda_decode

    def decode(q, k, v, *args, **kwargs):
        seen.append((q, k, v))
        return real_decode(q, k, v, *args, **kwargs)

    monkeypatch.setattr(ops, "kda_decode", decode)
    call = packed_decode_call(B, list(range(1, B + 1)), torch.randn(B + 1, H, V, K), -5.0)
    recorded.k3.fused_recurrent_kda_packed_decode(**call)
    (q, k, v), = seen
    base, width = call["mixed_qkv"].data_ptr(), call["mixed_qkv"].stride(0)
    assert [t.data_ptr() for t in (q, k, v)] == [base + i * H * K * 4 for i in range(3)]
    assert B == 1 or all(t.stride(0) == width for t in (q, k, v))


def test_packed_decode_copies_rows_the_op_cannot_read(recorded, monkeypatch):
    """Rows closer than one q row apart (an as_strided view whose rows overlap) fail the row check on q, so q, k and v
    go over as dense copies (one check on q stands for all three: they share strides and start H*K elements apart):
    served, matching the reference on the same values."""
    import flashkda_ext.ops as ops
    seen, real_decode = [], ops.kda_decode

    def decode(q, k, v, *args, **kwargs):
        seen.append((q, k, v))
        return real_decode(q, k, v, *args, **kwargs)

    monkeypatch.setattr(ops, "kda_decode", decode)
    B, idx = 3, [1, 3, 2]
    pool = torch.randn(4, H, V, K) * 0.3
    pool0 = pool.clone()
    call = packed_decode_call(B, idx, pool, -5.0)
    base = torch.randn(B * 3 * H * K)
    call["mixed_qkv"] = base.as_strided((B, 3 * H * K), (H * K - 1, 1))
    before = stat("k3.fused_recurrent_kda_packed_decode")
    o, _ = recorded.k3.fused_recurrent_kda_packed_decode(**call)
    assert stat("k3.fused_recurrent_kda_packed_decode") == before + 1 and recorded.calls == []
    (q, k, v), = seen
    assert all(t.is_contiguous() for t in (q, k, v))
    want_o, want_pool = packed_decode_reference(dict(call, mixed_qkv=call["mixed_qkv"].contiguous()), pool0)
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool[idx].double(), want_pool[idx].double(), **TOL)


def test_install_leaves_a_rocm_build_alone(real, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    report = fkda_vllm.install()
    assert not fkda_vllm.installed() and all(r.startswith("skipped: a ROCm build") for r in report.values())


def test_packed_decode_unknown_layout_falls_back_with_the_reason(recorded):
    pool = torch.randn(4, H, V, K)
    call = packed_decode_call(2, [1, 2], pool, None, dtype=torch.float32)
    call["raw_g"] = call["raw_g"].half()                 # a dtype the op would have to cast
    fell = stat("k3.fused_recurrent_kda_packed_decode", "fell_back")
    assert recorded.k3.fused_recurrent_kda_packed_decode(**call) == ("original", "fused_recurrent_kda_packed_decode")
    assert stat("k3.fused_recurrent_kda_packed_decode", "fell_back") == fell + 1
    assert recorded.calls[-1][2]["raw_g"] is call["raw_g"]
    assert any(s == "k3.fused_recurrent_kda_packed_decode" and "raw_g" in r for s, r in fkda_vllm.REASONS)


def test_packed_decode_int64_index_past_int32_raises_and_writes_nothing(recorded):
    pool = torch.randn(4, H, V, K)
    pool0 = pool.clone()
    call = packed_decode_call(2, [1, 2], pool, None)
    call["state_indices"] = torch.tensor([2 ** 32 + 1, 2], dtype=torch.int64)     # would wrap to slot 1
    with pytest.raises(ValueError, match="state_indices"):
        recorded.k3.fused_recurrent_kda_packed_decode(**call)
    assert torch.equal(pool, pool0) and recorded.calls == []


# ---------------------------------------------------------------------------------------------
# chunk prefill with the fused gate


def chunk_call(lengths, lower_bound, h0_dtype=torch.float32, seed=0, **extra):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    N = len(lengths)
    proj = torch.randn(1, T, H + 3, generator=gen)
    call = dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
                v=torch.randn(1, T, H, V, generator=gen), raw_g=torch.randn(1, T, H, K, generator=gen),
                raw_beta=proj[..., :H], A_log=torch.randn(H, generator=gen) * 0.5,
                g_bias=torch.randn(H * K, generator=gen) * 0.5, lower_bound=lower_bound,
                initial_state=(torch.randn(N, H, V, K, generator=gen) * 0.3).to(h0_dtype), output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32))
    call.update(extra)
    return call


def chunk_reference(call, lower_bound):
    gate = dict(gate="softplus") if lower_bound is None else dict(gate="bounded", lower_bound=lower_bound)
    o, h, _ = kda_recurrent(call["q"], call["k"], call["v"], call["raw_g"], call["raw_beta"], A_log=call["A_log"],
                            dt_bias=call["g_bias"], cu_seqlens=call["cu_seqlens"],
                            initial_state=call["initial_state"], **gate)
    return o, h


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("h0_dtype", [torch.float32, torch.bfloat16])
def test_chunk_prefill_is_served_with_the_gate_vllm_computes(recorded, lower_bound, h0_dtype):
    call = chunk_call([5, 0, 11], lower_bound, h0_dtype)
    before = stat("k3.chunk_kda_with_fused_gate")
    o, h = recorded.k3.chunk_kda_with_fused_gate(**call)
    assert stat("k3.chunk_kda_with_fused_gate") == before + 1 and recorded.calls == []
    assert h.dtype == torch.float32                 # vLLM's final state is fp32 whatever the pool's dtype
    want_o, want_h = chunk_reference(call, lower_bound)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(h.double(), want_h, **TOL)
    if lower_bound is not None:
        # the silent wrong answer: the softplus gate differs from the bounded one by far more than TOL
        assert (chunk_reference(call, None)[0] - want_o).abs().max() > 1e-2


def test_chunk_prefill_without_final_state_and_with_out(recorded):
    call = chunk_call([4, 3], -5.0, output_final_state=False, out=torch.empty(1, 7, H, V))
    o, h = recorded.k3.chunk_kda_with_fused_gate(**call)
    assert h is None and o is call["out"]
    torch.testing.assert_close(o.double(), chunk_reference(call, -5.0)[0], **TOL)


@pytest.mark.parametrize("extra,reason", [
    (dict(chunk_indices=None), "unknown arguments ['chunk_indices']"),
    (dict(use_qk_l2norm_in_kernel=False), "use_qk_l2norm_in_kernel=False")])
def test_chunk_prefill_falls_back_on_what_it_does_not_know(recorded, extra, reason):
    call = chunk_call([3], -5.0, **extra)
    fell = stat("k3.chunk_kda_with_fused_gate", "fell_back")
    assert recorded.k3.chunk_kda_with_fused_gate(**call) == ("original", "chunk_kda_with_fused_gate")
    assert stat("k3.chunk_kda_with_fused_gate", "fell_back") == fell + 1
    args = recorded.calls[-1][2]
    for key, value in extra.items():           # the caller's own arguments reach vLLM's function
        assert key in args.get("kwargs", args) and args.get("kwargs", args)[key] is value
    assert any(s == "k3.chunk_kda_with_fused_gate" and reason in r for s, r in fkda_vllm.REASONS)


# ---------------------------------------------------------------------------------------------
# speculative verify: fused_recurrent_kda with [N, T_max] indices and num_accepted_tokens


def spec_call(lengths, table, accepted, pool, lower_bound=-5.0, padded_tokens=0, seed=3, packed=True):
    """The layer's spec call: q/k/v row-strided views of the post-conv buffer (rearranged splits), the index
    table and counts padded to the CUDA-graph batch (null block, count 1) while cu_seqlens holds the real N."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths) + padded_tokens
    mixed = torch.randn(T, 3 * H * K, generator=gen)
    q, k, v = (x.unflatten(1, (H, K)).unsqueeze(0) for x in mixed.split(H * K, dim=-1))
    if not packed:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return dict(q=q, k=k, v=v, raw_g=torch.randn(1, T, H, K, generator=gen),
                raw_beta=torch.randn(1, T, H + 2, generator=gen)[..., :H],
                A_log=torch.randn(H, generator=gen) * 0.5, dt_bias=torch.randn(H * K, generator=gen) * 0.5,
                lower_bound=lower_bound, initial_state=pool,
                cu_seqlens=torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32),
                ssm_state_indices=torch.tensor(table, dtype=torch.int32),
                num_accepted_tokens=None if accepted is None else torch.tensor(accepted, dtype=torch.int32))


def spec_reference(call, pool0, n_real):
    T = int(call["cu_seqlens"][-1])
    gate = dict(gate="softplus") if call["lower_bound"] is None else dict(gate="bounded",
                                                                          lower_bound=call["lower_bound"])
    acc = call["num_accepted_tokens"]
    return kda_verify_step(*(call[n][:, :T] for n in ("q", "k", "v", "raw_g", "raw_beta")), state=pool0,
                           state_indices=call["ssm_state_indices"][:n_real], cu_seqlens=call["cu_seqlens"],
                           num_accepted_tokens=None if acc is None else acc[:n_real], A_log=call["A_log"],
                           dt_bias=call["dt_bias"], null_slot0=True, **gate)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_spec_verify_is_served_and_matches_the_reference(recorded, pool_dtype, lower_bound):
    pool = (torch.randn(16, H, V, K) * 0.3).to(pool_dtype)
    pool0 = pool.clone()
    table = [[1, 2, 3], [4, 5, 6], [0, 8, 9],               # request 2 starts from the null block: padding
             [0, 0, 0], [0, 0, 0]]                          # CUDA-graph padded requests (not in cu_seqlens)
    call = spec_call([3, 2, 2], table, [2, 1, 1, 1, 1], pool, lower_bound, padded_tokens=2)
    before = stat("k3.fused_recurrent_kda")
    o, final = recorded.k3.fused_recurrent_kda(**call)
    assert stat("k3.fused_recurrent_kda") == before + 1 and recorded.calls == [], dict(fkda_vllm.REASONS)
    assert final is pool and o.shape == (1, 9, H, V)
    want_o, want_pool = spec_reference(call, pool0, 3)
    tol = TOL if pool_dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(o[:, :7].double(), want_o, **tol)
    torch.testing.assert_close(pool.double(), want_pool.double(), **tol)
    for s in (0, 7, 8, 9, 10):      # the null block, unnamed slots, request 2's slots: bitwise
        assert torch.equal(bits(pool[s]), bits(pool0[s]))


def test_spec_verify_on_dense_q_and_with_out(recorded):
    pool = torch.randn(8, H, V, K) * 0.3
    pool0 = pool.clone()
    call = spec_call([2, 1], [[1, 2], [3, 4]], [1, 2], pool, packed=False)
    call["out"] = torch.empty(1, 3, H, V)
    o, _ = recorded.k3.fused_recurrent_kda(**call)
    assert o is call["out"]
    want_o, want_pool = spec_reference(call, pool0, 2)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool.double(), want_pool.double(), **TOL)


def test_one_token_indices_serve_each_request_on_its_own_row(recorded):
    """cu_seqlens [0, 0, 1, 2] with 1-D indices (T == N = 3): request 0 is empty, so requests 1 and 2 hold rows 0
    and 1 (vLLM's kernel reads request n's token at row cu_seqlens[n] and its state at slot n); row 2 is no
    request's. Slots 6 and 7 are stepped; the empty request's slot 5 is left alone, row 2 is zeros."""
    pool = torch.randn(8, H, V, K) * 0.3
    pool0 = pool.clone()
    call = spec_call([0, 1, 1], [5, 6, 7], None, pool, padded_tokens=1)
    before = stat("k3.fused_recurrent_kda")
    o, _ = recorded.k3.fused_recurrent_kda(**call)
    assert stat("k3.fused_recurrent_kda") == before + 1 and recorded.calls == [], dict(fkda_vllm.REASONS)
    two = {n: call[n][0, :2] for n in ("q", "k", "v", "raw_g", "raw_beta")}
    want_o, want_pool = kda_decode_step(*(two[n] for n in ("q", "k", "v", "raw_g", "raw_beta")), state=pool0,
                                        state_indices=torch.tensor([6, 7], dtype=torch.int32), gate="bounded",
                                        lower_bound=-5.0, A_log=call["A_log"], dt_bias=call["dt_bias"])
    torch.testing.assert_close(o[0, :2].double(), want_o, **TOL)
    torch.testing.assert_close(pool.double(), want_pool.double(), **TOL)
    assert torch.equal(pool[5], pool0[5]) and torch.equal(o[0, 2], torch.zeros(H, V))


def test_one_token_indices_with_a_two_token_request_raise_naming_cu_seqlens(recorded):
    """cu_seqlens [0, 2, 2, 3] with 1-D indices: vLLM's kernel would store request 0's second token's state in
    slot 6, the empty request's. Host offsets no kernel can run raise, naming them, and nothing is written."""
    pool = torch.randn(8, H, V, K) * 0.3
    pool0 = pool.clone()
    call = spec_call([2, 0, 1], [5, 6, 7], None, pool)
    with pytest.raises(ValueError, match="cu_seqlens: .*request 0 has 2"):
        recorded.k3.fused_recurrent_kda(**call)
    assert torch.equal(pool, pool0) and recorded.calls == []


@pytest.mark.parametrize("name,value", [("ssm_state_indices", [[2 ** 32 + 1, 2], [3, 4]]),
                                        ("num_accepted_tokens", [2 ** 32 + 1, 1])])
def test_spec_int64_past_int32_raises_naming_it_and_writes_nothing(recorded, name, value):
    pool = torch.randn(8, H, V, K)
    pool0 = pool.clone()
    call = spec_call([2, 1], [[1, 2], [3, 4]], [1, 1], pool)
    call[name] = torch.tensor(value, dtype=torch.int64)
    with pytest.raises(ValueError, match=name):
        recorded.k3.fused_recurrent_kda(**call)
    assert torch.equal(pool, pool0) and recorded.calls == []


def test_spec_unknown_fuse_gate_value_falls_back(recorded):
    call = spec_call([1], [[1, 2]], [1], torch.randn(4, H, V, K))
    call["fuse_gate"] = "sometimes"
    assert recorded.k3.fused_recurrent_kda(**call) == ("original", "fused_recurrent_kda")
    assert any(s == "k3.fused_recurrent_kda" and "fuse_gate" in r for s, r in fkda_vllm.REASONS)


# ---------------------------------------------------------------------------------------------
# the vendored fla copy (bailing_moe_v3)


def bailing_decode_call(cu, idx, pool, **extra):
    gen = torch.Generator().manual_seed(9)
    T = len(idx)
    mixed = torch.randn(T, 3 * H * K, generator=gen)
    q, k, v = (x.unflatten(1, (H, K)).unsqueeze(0) for x in mixed.split(H * K, dim=-1))
    return dict(q=q, k=k, v=v, g=-torch.rand(1, T, H, K, generator=gen), beta=torch.rand(1, T, H, generator=gen),
                initial_state=pool, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                ssm_state_indices=torch.tensor(idx, dtype=torch.int32), **extra)


def test_vendored_decode_is_served_with_bailings_ignored_keywords(recorded):
    pool = torch.randn(6, H, V, K) * 0.3
    pool0 = pool.clone()
    call = bailing_decode_call([0, 1, 2, 3], [4, 0, 2], pool, safe_gate=True, lower_bound=-5.0)
    before = stat("vendored.fused_recurrent_kda")
    o, _ = recorded.vendored.fused_recurrent_kda(**call)
    assert stat("vendored.fused_recurrent_kda") == before + 1 and recorded.calls == []
    want_o, want_pool = kda_decode_step(*(call[n][0] for n in ("q", "k", "v", "g", "beta")), state=pool0,
                                        state_indices=call["ssm_state_indices"], gate="log", beta_is_logit=False,
                                        null_slot0=True)
    torch.testing.assert_close(o[0].double(), want_o, **TOL)
    torch.testing.assert_close(pool.double(), want_pool.double(), **TOL)


def test_vendored_decode_of_a_cuda_graph_padded_batch(recorded):
    """T = 5 tokens and indices for the graph's batch, cu_seqlens for the 3 real requests: the 3 are served,
    the padded rows are not (vLLM's kernel runs the N; the layer drops the rest)."""
    pool = torch.randn(6, H, V, K) * 0.3
    pool0 = pool.clone()
    call = bailing_decode_call([0, 1, 2, 3], [4, 0, 2, 0, 0], pool)
    before = stat("vendored.fused_recurrent_kda")
    o, _ = recorded.vendored.fused_recurrent_kda(**call)
    assert stat("vendored.fused_recurrent_kda") == before + 1 and o.shape == (1, 5, H, V)
    want_o, want_pool = kda_decode_step(*(call[n][0, :3] for n in ("q", "k", "v", "g", "beta")), state=pool0,
                                        state_indices=call["ssm_state_indices"][:3], gate="log", beta_is_logit=False,
                                        null_slot0=True)
    torch.testing.assert_close(o[0, :3].double(), want_o, **TOL)
    torch.testing.assert_close(pool.double(), want_pool.double(), **TOL)


def test_vendored_decode_of_a_two_token_request_raises_naming_cu_seqlens(recorded):
    """[0, 2, 2, 3]: one slot a request, a request of two tokens. fla's kernel would store its second token's
    state in the next request's slot (the empty one's), so the host offsets raise, naming them, before anything
    is written (no fallback can run them)."""
    pool = torch.randn(6, H, V, K) * 0.3
    pool0 = pool.clone()
    call = bailing_decode_call([0, 2, 2, 3], [4, 5, 2], pool)
    with pytest.raises(ValueError, match="cu_seqlens: .*request 0 has 2"):
        recorded.vendored.fused_recurrent_kda(**call)
    assert torch.equal(pool, pool0) and recorded.calls == []


def test_vendored_decode_after_an_empty_request_serves_each_request_on_its_own_row(recorded):
    pool = torch.randn(6, H, V, K) * 0.3
    pool0 = pool.clone()
    call = bailing_decode_call([0, 0, 1, 2], [4, 5, 2], pool)
    before = stat("vendored.fused_recurrent_kda")
    o, _ = recorded.vendored.fused_recurrent_kda(**call)
    assert stat("vendored.fused_recurrent_kda") == before + 1 and recorded.calls == []
    want_o, want_pool = kda_decode_step(*(call[n][0, :2] for n in ("q", "k", "v", "g", "beta")), state=pool0,
                                        state_indices=torch.tensor([5, 2], dtype=torch.int32), gate="log",
                                        beta_is_logit=False, null_slot0=True)
    torch.testing.assert_close(o[0, :2].double(), want_o, **TOL)
    torch.testing.assert_close(pool.double(), want_pool.double(), **TOL)
    assert torch.equal(pool[4], pool0[4]) and torch.equal(o[0, 2], torch.zeros(H, V))


def test_vendored_unknown_keyword_falls_back(recorded):
    call = bailing_decode_call([0, 1], [1], torch.randn(3, H, V, K), num_accepted_tokens=torch.ones(1))
    assert recorded.vendored.fused_recurrent_kda(**call) == ("original", "fused_recurrent_kda")
    assert any(s == "vendored.fused_recurrent_kda" and "num_accepted_tokens" in r for s, r in fkda_vllm.REASONS)


def test_vendored_spec_fwd_and_chunk_are_served(recorded):
    pool = torch.randn(10, H, V, K) * 0.3
    pool0 = pool.clone()
    call = spec_call([2, 1], [[1, 2], [3, 4]], [2, 1], pool)
    fwd = dict(q=call["q"].contiguous(), k=call["k"].contiguous(), v=call["v"].contiguous(),
               g=-torch.rand(1, 3, H, K), beta=torch.rand(1, 3, H), scale=K ** -0.5, initial_state=pool,
               inplace_final_state=True, cu_seqlens=call["cu_seqlens"], ssm_state_indices=call["ssm_state_indices"],
               num_accepted_tokens=call["num_accepted_tokens"], use_qk_l2norm_in_kernel=True)
    o, _ = recorded.vendored.fused_recurrent_kda_fwd(**fwd)
    want_o, want_pool = kda_verify_step(fwd["q"], fwd["k"], fwd["v"], fwd["g"], fwd["beta"], state=pool0,
                                        state_indices=fwd["ssm_state_indices"], cu_seqlens=fwd["cu_seqlens"],
                                        num_accepted_tokens=fwd["num_accepted_tokens"], gate="log",
                                        beta_is_logit=False, null_slot0=True)
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(pool.double(), want_pool.double(), **TOL)

    ch = chunk_call([4, 3], None)
    g = -torch.rand(1, 7, H, K)
    o, h = recorded.vendored.chunk_kda(q=ch["q"], k=ch["k"], v=ch["v"], g=g, beta=torch.sigmoid(ch["raw_beta"]),
                                       initial_state=ch["initial_state"], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                       cu_seqlens=ch["cu_seqlens"])
    want_o, want_h, _ = kda_recurrent(ch["q"], ch["k"], ch["v"], g, torch.sigmoid(ch["raw_beta"]), gate="log",
                                      beta_is_logit=False, cu_seqlens=ch["cu_seqlens"],
                                      initial_state=ch["initial_state"])
    torch.testing.assert_close(o.double(), want_o, **TOL)
    torch.testing.assert_close(h.double(), want_h, **TOL)
    assert stat("vendored.fused_recurrent_kda_fwd") >= 1 and stat("vendored.chunk_kda") >= 1
    assert recorded.calls == []


def test_the_benchmark_dry_run_serves_every_kind_and_agrees_with_the_reference(tree, tmp_path):
    """benchmarks/bench_vllm.py's logic on the CPU (a process of its own: it imports vLLM's modules itself)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_vllm.py"), "--dry-run", "--no-plot",
                          "--no-progress", "--state-dtypes", "bfloat16", "--engine-dir", str(tree),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads((tmp_path / "bench_vllm.json").read_text())
    assert {a["case"].split()[0] for a in doc["accuracy"]} == {"decode", "verify", "prefill", "mixed"}
    assert all(a["served"] and a["ok"] for a in doc["accuracy"])
    # the mixed step ran in the wheel's forward context and was routed by its prompt
    mixed = [a for a in doc["accuracy"] if a["case"].startswith("mixed")]
    assert mixed and all(a["routed"] == ["longest from vLLM's metadata, decodes apart"] for a in mixed)
    # the split candidate (decodes and prompt as two calls) gives the one call's answer
    split = [c["notes"] for c in doc["cases"] if c["name"].startswith("mixed")]
    assert split and all(n["split_rel_l2_out"] < 1e-6 and n["split_rel_l2_state"] < 1e-6 for n in split)
    assert not doc["fallback_reasons"]


@pytest.mark.parametrize("table,accepted,reason", [
    ([[1], [2], [3]], [1], "num_accepted_tokens must hold one count per request"),
    ([[1], [2], [3]], [[1], [1], [1]], "num_accepted_tokens must hold one count per request"),
    ("no columns", None, "one-token ssm_state_indices need"),
], ids=["short-counts", "2-D-counts", "zero-column-table"])
def test_one_column_table_with_counts_not_per_request_falls_back(recorded, table, accepted, reason):
    """A one-column table is served by kda_decode row by row. Before: a [1] count tensor broadcast its
    first count over every request (served, pool written), and a [N, 0] table raised IndexError."""
    pool = torch.randn(8, H, V, K) * 0.3
    pool0 = pool.clone()
    call = spec_call([1, 1, 1], [[1], [2], [3]] if table == "no columns" else table, accepted, pool)
    if table == "no columns":
        call["ssm_state_indices"] = torch.zeros(3, 0, dtype=torch.int32)
    fell = stat("k3.fused_recurrent_kda", "fell_back")
    assert recorded.k3.fused_recurrent_kda(**call) == ("original", "fused_recurrent_kda")
    assert stat("k3.fused_recurrent_kda", "fell_back") == fell + 1
    assert any(s == "k3.fused_recurrent_kda" and reason in r for s, r in fkda_vllm.REASONS)
    assert torch.equal(pool, pool0)


def test_the_adapter_host_time_script_runs_every_k3_site(tree):
    """scripts/adapter_host_time.py (docs/integrations.md quotes it) on the real wheel's files: every K3 site is
    served (the script stops otherwise) and timed beside the op alone (no timing asserted here)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "scripts" / "adapter_host_time.py"), "--engine-dir", str(tree),
                          "--heads", "2", "--calls", "20"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith(("packed", "verify", "native"))]
    assert [" ".join(r[:-2]) for r in rows] == ["packed decode rows=1", "packed decode rows=4", "verify requests=1",
                                                "verify requests=16", "native decode rows=1", "native decode rows=4"]
    assert all(float(r[-2]) > 0 and float(r[-1]) > 0 for r in rows)
