"""Bad-input campaign 25 (CPU backend): vLLM 0.34's Kimi K3 adapters (vllm/k3.py: packed decode,
chunk_kda_with_fused_gate, fused_recurrent_kda; k3_layer.py: K3's own prefill; k3_native.py: its native fused decode),
after campaign 24's class (a gate tensor read by element count, served scrambled). The rule: a served call is bitwise
the op called directly; else a ValueError naming the argument or vLLM's original with the reason counted, nothing
written either way (out poisoned with NaN, pools compared bit for bit). Each case failed before its fix, except those
marked "guard".

- A_log / dt_bias (g_bias) were read by element count (k3._param: reshape(-1)), so a strided view (a transposed [K, H]
  dt_bias, a strided bf16 / fp64 one) was served on its logical order. vLLM's decode / verify kernels read the
  parameter's memory: the packed-decode wrapper raises on it ("`dt_bias` must be contiguous.", the wheel's own wrapper
  below), fused_recurrent_kda asserts, and with fuse_gate=False its gate kernel reads the memory as it lies, which the
  served output was not (max |diff| 0.03). Now a non-contiguous parameter falls back at every K3 site, counted.
- out that is no tensor (a list) was an AttributeError ('list' object has no attribute 'shape') from k3._dense_out,
  neither a fallback nor an error naming out (packed decode, chunk, fused_recurrent, K3's prefill). Now a fallback.
- chunk_kda_with_fused_gate cast initial_state to fp32 whatever its dtype: a complex one (or a conj view) was served on
  its real part, an integer / bool one as numbers. Now a fallback (fp16 / bf16 / fp64 read as fp32: guard).
- guard: raw_g [H*K, T] / [1, T, K, H], raw_beta [1, H, T] / [T, H] fall back at every site (full shape checks); a
  transposed-strides view of the right shape is read as its values, or falls back (native decode); non-floating gates,
  meta tensors, scalars out of range, float / narrow metadata, bad out, overlapping / fp16 pools fall back; indices or
  offsets past int32 / the pool / T are a ValueError naming them; CUDA-graph padding is served as vLLM leaves it.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

from flashkda_ext import ops
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.integrations.vllm import k3_layer, k3_native
from vllm_adapter_probe import adapter as k3_adapter, fell_back
from vllm_wheel import real, tree  # noqa: F401  (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vllm_native  # noqa: E402  (the native decode's layer call, shared with its GPU benchmark)

H, K, V = 2, 8, 8
PD, CH, FR = "k3.fused_recurrent_kda_packed_decode", "k3.chunk_kda_with_fused_gate", "k3.fused_recurrent_kda"
LY, NT = k3_layer.SITE, k3_native.SITE
NAN = float("nan")


def raw(t):
    return t.detach().resolve_neg().resolve_conj().reshape(-1).contiguous().view(torch.uint8).clone()


def site_adapter(site):
    """The adapter of `site` around a stand-in for vLLM's original (returns "original")."""
    point, _, name = site.partition(".")
    if point == "k3":
        return k3_adapter(site)
    body = {"k3_layer": k3_layer.SERVE, "k3_native": k3_native.SERVE}[point][name]

    def original(**kw):
        return "original"
    original.__signature__, original.__name__ = inspect.signature(body), name
    return fkda_vllm.adapter_for(site, original)


def r(gen, *shape):
    return torch.randn(*shape, generator=gen)


def pd_call(B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(mixed_qkv=r(g, B, 3 * H * K), raw_g=r(g, 1, B, H, K), raw_beta=r(g, B, H + 5)[:, :H].unsqueeze(0),
                A_log=r(g, H) * .5, dt_bias=r(g, H * K) * .5, lower_bound=-5.0, initial_state=r(g, 6, H, V, K) * .3,
                state_indices=torch.tensor([3, 1, 4][:B], dtype=torch.int32), out=torch.full((1, B, H, V), NAN))


def ch_call(T=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(q=r(g, 1, T, H, K), k=r(g, 1, T, H, K), v=r(g, 1, T, H, V), raw_g=r(g, 1, T, H, K),
                raw_beta=r(g, 1, T, H), A_log=r(g, H) * .5, g_bias=r(g, H * K) * .5, lower_bound=-5.0,
                initial_state=r(g, 2, H, V, K) * .3, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=torch.tensor([0, 3, T], dtype=torch.int32), out=torch.full((1, T, H, V), NAN))


def fr_call(T=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    return dict(q=r(g, 1, T, H, K), k=r(g, 1, T, H, K), v=r(g, 1, T, H, V), raw_g=r(g, 1, T, H, K),
                raw_beta=r(g, 1, T, H), A_log=r(g, H), dt_bias=r(g, H * K), lower_bound=-5.0,
                initial_state=r(g, 8, H, V, K), cu_seqlens=torch.tensor([0, 2, T], dtype=torch.int32),
                ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
                num_accepted_tokens=torch.tensor([1, 2], dtype=torch.int32), out=torch.full((1, T, H, V), NAN))


def ly_call(seed=3):
    g = torch.Generator().manual_seed(seed)
    return dict(q=r(g, 1, 7, H, K), k=r(g, 1, 7, H, K), v=r(g, 1, 7, H, V), g=r(g, 1, 7, H, K),
                beta=r(g, 1, 7, H + 3)[..., :H], A_log=r(g, H) * .5, dt_bias=r(g, H * K) * .5, lower_bound=-5.0,
                initial_state=r(g, 2, H, V, K) * .3, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32),
                out=torch.full((1, 7, H, V), NAN), final_state=torch.full((2, H, V, K), NAN),
                workspace=torch.empty(64, dtype=torch.uint8))


def nt_call(seed=4):
    return bench_vllm_native.layer_call(3, H, torch.Generator().manual_seed(seed), "cpu", "SD", -5.0, 5, [3, 1, 2])[0]


CALLS = {PD: pd_call, CH: ch_call, FR: fr_call, LY: ly_call, NT: nt_call}
GATE = {PD: ("raw_g", "raw_beta", "dt_bias"), CH: ("raw_g", "raw_beta", "g_bias"), LY: ("g", "beta", "dt_bias")}
GATE[FR] = GATE[NT] = GATE[PD]


def pd_direct(c, pool0):
    """(out, pool) of the op called directly on c's values (contiguous A_log / dt_bias: their memory)."""
    m, B = c["mixed_qkv"], c["mixed_qkv"].shape[0]
    q, k, v = m.view(B, 3, H, K).unbind(1)
    pool = pool0.clone()
    o = ops.kda_decode(q, k, v, c["raw_g"][0].contiguous(), c["raw_beta"][0].contiguous(), state=pool,
                       state_indices=c["state_indices"], A_log=c["A_log"].reshape(-1), dt_bias=c["dt_bias"].reshape(-1),
                       lower_bound=-5.0, gate="bounded", beta_is_logit=True, slot_mode="padded", null_slot0=True)
    return o, pool


def fr_direct(c, pool0):
    pool = pool0.clone()
    o = ops.kda_verify(c["q"], c["k"], c["v"], c["raw_g"].contiguous(), c["raw_beta"].contiguous(), state=pool,
                       state_indices=c["ssm_state_indices"], cu_seqlens=c["cu_seqlens"],
                       num_accepted_tokens=c["num_accepted_tokens"], A_log=c["A_log"], dt_bias=c["dt_bias"],
                       lower_bound=-5.0, gate="bounded", scale=K ** -0.5, beta_is_logit=True, null_slot0=True)
    return o, pool


def untouched(site, c, reason=None, name=None):
    """The call runs vLLM's original with `reason` counted, or (name given) raises a ValueError naming it; either
    way every host tensor of c bitwise as it was."""
    before = {n: raw(x) for n, x in c.items() if torch.is_tensor(x) and not x.is_meta}
    if name is None:
        fell_back(site, lambda: site_adapter(site)(**c), reason)
    else:
        with pytest.raises(ValueError) as e:
            site_adapter(site)(**c)
        assert str(e.value).startswith(f"{name}: "), repr(e.value)
    for n, x in before.items():
        assert torch.equal(x, raw(c[n])), f"the call changed {n}"


# ---------------------------------------------------------------------------------------------
# fixed: a strided A_log / dt_bias is not read by element count

STRIDED = {
    "bias_KH_view": lambda x: x.reshape(H, -1).t(),                                      # [K, H], strides [1, K]
    "bias_bf16_strided": lambda x: torch.stack([x, x], 1).bfloat16()[:, 0],              # stride 2
    "A_log_f64_strided": lambda x: torch.stack([x, -x], 1).double()[:, 0],
}


@pytest.mark.parametrize("site", [PD, CH, FR, LY, NT])
@pytest.mark.parametrize("layout", STRIDED)
def test_a_strided_gate_parameter_falls_back_writing_nothing(site, layout):
    c = CALLS[site]()
    name = "A_log" if layout.startswith("A_log") else GATE[site][2]
    c[name] = STRIDED[layout](c[name])
    assert not c[name].is_contiguous()
    untouched(site, c, f"{name} in memory order")


@pytest.mark.parametrize("fuse_gate", [None, False])
def test_verify_with_a_transposed_dt_bias_is_not_served_on_other_values_than_vllm_reads(fuse_gate):
    """fuse_gate=False: vLLM's gate kernel reads dt_bias's memory (no contiguity check); the adapter served the
    view's logical order, which is not the op on the memory's values."""
    c = fr_call()
    memory, pool0 = c["dt_bias"].clone(), c["initial_state"].clone()
    c.update(dt_bias=memory.reshape(H, K).t(), fuse_gate=fuse_gate)
    untouched(FR, c, "dt_bias in memory order")
    logical = fr_direct(dict(c, dt_bias=c["dt_bias"].reshape(-1)), pool0)[0]
    assert (logical - fr_direct(dict(c, dt_bias=memory), pool0)[0]).abs().max() > 1e-3


def test_the_wheels_packed_decode_refuses_what_now_falls_back_to_it(real):
    """The adapter around vLLM's own wrapper: the transposed dt_bias reaches it, which raises before its kernel
    (served before the fix); the pool and out untouched."""
    c = pd_call()
    c["dt_bias"] = c["dt_bias"].reshape(H, K).t()
    pool0, fell = c["initial_state"].clone(), fkda_vllm.STATS[PD, "fell_back"]
    with pytest.raises(ValueError, match="`dt_bias` must be contiguous"):
        fkda_vllm.adapter_for(PD, real.k3.fused_recurrent_kda_packed_decode)(**c)
    assert fkda_vllm.STATS[PD, "fell_back"] == fell + 1
    assert torch.equal(c["initial_state"], pool0) and torch.isnan(c["out"]).all()


# ---------------------------------------------------------------------------------------------
# fixed: chunk's initial_state of a non-floating dtype (out that is no tensor: FALLBACKS below)

@pytest.mark.parametrize("change", [lambda s: s.to(torch.complex64), lambda s: s.to(torch.complex64).conj(),
                                    lambda s: s.int(), lambda s: s > 0, lambda s: s.tolist()],
                         ids=["complex", "conj", "int32", "bool", "list"])
def test_chunk_initial_state_of_no_floating_dtype_falls_back(change):
    c = ch_call()
    c["initial_state"] = change(c["initial_state"] * 4)
    untouched(CH, c, "initial_state of ")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_chunk_initial_state_of_another_float_is_read_as_fp32(dtype):    # guard
    c = ch_call()
    c["initial_state"] = c["initial_state"].to(dtype)
    o, h = k3_adapter(CH)(**c)
    want = ops.kda_prefill(*(c[n] for n in ("q", "k", "v", "raw_g", "raw_beta")), cu_seqlens=c["cu_seqlens"],
                           A_log=c["A_log"], dt_bias=c["g_bias"], lower_bound=-5.0, gate="bounded", beta_is_logit=True,
                           initial_state=c["initial_state"].float(), output_final_state=True)
    assert o is c["out"] and torch.equal(raw(o), raw(want[0])) and torch.equal(raw(h), raw(want[1]))


def tview(x):
    """x's values with its last two dims' strides transposed (vLLM's wrappers refuse it; its values are plain)."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


SERVED = {  # (site, change): served bitwise as the op called directly on the values
    "pd_raw_g_tview": (PD, lambda c: c.update(raw_g=tview(c["raw_g"]))),
    "pd_raw_beta_tview": (PD, lambda c: c.update(raw_beta=tview(c["raw_beta"]))),
    "fr_raw_g_tview": (FR, lambda c: c.update(raw_g=tview(c["raw_g"]))),
    "fr_raw_beta_tview": (FR, lambda c: c.update(raw_beta=tview(c["raw_beta"]))),
    "pd_bf16_pool": (PD, lambda c: c.update(initial_state=c["initial_state"].bfloat16())),
    "fr_bf16_pool": (FR, lambda c: c.update(initial_state=c["initial_state"].bfloat16())),
    # contiguous, so their memory (what vLLM reads) in another shape; [1, 1, H, 1]: K3's old A_log checkpoints
    "pd_params_reshaped": (PD, lambda c: c.update(dt_bias=c["dt_bias"].reshape(K, H),
                                                  A_log=c["A_log"][None, None, :, None])),
}


@pytest.mark.parametrize("case", SERVED)
def test_values_of_an_unambiguous_layout_are_served_as_the_op_on_them(case):    # guard
    site, change = SERVED[case]
    c = CALLS[site]()
    change(c)
    pool0 = c["initial_state"].clone()
    o, pool = site_adapter(site)(**c)
    want_o, want_pool = (pd_direct if site == PD else fr_direct)(c, pool0)
    assert o is c["out"] and torch.equal(raw(o), raw(want_o.view(o.shape))) and torch.equal(raw(pool), raw(want_pool))


def _set(**changes):
    """A change of the call: each argument made from the call's own value of it (a callable) or replaced."""
    return lambda c: c.update({n: f(c[n]) if callable(f) else f for n, f in changes.items()})


def _gate_cases(site):
    g, beta, bias = GATE[site]
    T = CALLS[site]()[g].shape[1]
    yield f"{g}_HK_T", _set(**{g: lambda x: x.reshape(T, -1).t()}), ""         # the tokens elsewhere
    yield f"{g}_HK_T_dense", _set(**{g: lambda x: x.reshape(T, -1).t().contiguous()}), ""
    yield f"{g}_T_K_H", _set(**{g: lambda x: x.transpose(2, 3)}), ""
    yield f"{beta}_1_H_T", _set(**{beta: lambda x: x.transpose(1, 2).contiguous()}), ""
    yield f"{beta}_T_H", _set(**{beta: lambda x: x[0]}), ""
    dtype = "" if site == NT else "dtype"       # the native op names g / beta: "expected the dtype of x"
    yield f"{g}_int32", _set(**{g: lambda x: x.int()}), dtype
    yield f"{beta}_bool", _set(**{beta: lambda x: x > 0}), dtype
    yield f"{bias}_complex", _set(**{bias: lambda x: x.to(torch.complex64)}), "dtype"
    yield "A_log_int64", _set(A_log=lambda x: x.long()), "dtype"
    yield "lower_bound_bool", _set(lower_bound=True), "number or None"
    yield "lower_bound_tensor", _set(lower_bound=torch.tensor(-5.0)), "number or None"
    for value in (NAN, 2.0, 0.0):
        yield f"lower_bound_{value}", _set(lower_bound=value), "finite value < 0"
    if site in (PD, CH):
        yield "scale_bool", _set(scale=True), "a float or None"
        for value in (0.0, -0.5, NAN):
            yield f"scale_{value}", _set(scale=value), "finite value > 0"
    if site == NT:
        yield "norm_eps_bool", _set(norm_eps=True), "a float > 0"
        for value in (0.0, -1.0, NAN):
            yield f"norm_eps_{value}", _set(norm_eps=value), "finite float > 0"
        for name in ("raw_g", "raw_beta", "output_gate"):       # the op reads rows as they lie, never a copy
            yield f"{name}_tview", _set(**{name: tview}), "inner dims contiguous"
    if site in (PD, CH, FR, LY):
        shape = CALLS[site]()["out"].shape
        yield "out_list", _set(out=[0.0]), "out is list"        # fixed (an AttributeError before)
        yield "out_tuple", _set(out=(1,)), "out is tuple"       # fixed
        yield "out_shape", _set(out=torch.full((*shape[:-1], V + 1), NAN)), "out"
        yield "out_fp64", _set(out=torch.full(shape, NAN, dtype=torch.float64)), "out"
        yield "out_strided", _set(out=torch.full((*shape[:-1], 2 * V), NAN)[..., :V]), "out"
        yield "out_over_gate", lambda c: c.update(out=c[g].view(shape)), "overlaps"
        yield "out_over_pool", lambda c: c.update(out=c["initial_state"].view(-1)[:shape.numel()].view(shape)), \
            "overlaps"
    if site in (PD, FR):
        overlapping = lambda p: torch.randn(2000).as_strided(p.shape, (8, V * K, K, 1))  # noqa: E731
        yield "pool_overlapping", _set(initial_state=overlapping), "state"
        yield "pool_fp16", _set(initial_state=lambda p: p.half()), "state"
        yield "pool_transposed", _set(initial_state=lambda p: p.transpose(-1, -2)), "state"
        yield "pool_zero_stride", _set(initial_state=lambda p: p[:1].expand(p.shape)), "state"
    if site == PD:
        for name in ("mixed_qkv", "raw_g", "raw_beta", "A_log", "dt_bias", "initial_state", "state_indices", "out"):
            yield f"{name}_meta", _set(**{name: lambda x: x.to("meta")}), "meta"


FALLBACKS = {(site, case): (change, reason) for site in CALLS for case, change, reason in _gate_cases(site)}


@pytest.mark.parametrize("site, case", FALLBACKS)
def test_falls_back_to_vllm_writing_nothing(site, case):    # guard, except out_list / out_tuple
    change, reason = FALLBACKS[site, case]
    c = CALLS[site]()
    change(c)
    untouched(site, c, reason)


METADATA = [  # site, argument, value, ValueError (named) or the fallback reason
    (PD, "state_indices", torch.tensor([3, 1, 4]).float(), "int32 or int64"),
    (PD, "state_indices", torch.tensor([3, 1, 4], dtype=torch.int16), "int32 or int64"),
    (PD, "state_indices", torch.tensor([2 ** 32 + 1, 1, 2]), ValueError),       # would wrap to slot 1
    (PD, "state_indices", torch.tensor([-2 ** 33, 1, 2]), ValueError),
    (PD, "state_indices", torch.tensor([3, 1, 6], dtype=torch.int32), ValueError),   # a pool of 6
    (PD, "state_indices", torch.tensor([3, 1], dtype=torch.int32), "shapes outside"),
    (NT, "state_indices", torch.tensor([2 ** 32 + 1, 1, 2]), ValueError),
    (CH, "cu_seqlens", torch.tensor([0, 3, 7]).float(), "int32 or int64"),
    (CH, "cu_seqlens", torch.tensor([0, 2 ** 32 + 3, 7]), ValueError),
    (CH, "cu_seqlens", torch.tensor([0, 3, 5, 7], dtype=torch.int32), "initial_state: expected shape"),
    (LY, "cu_seqlens", torch.tensor([0, 2 ** 32, 7]), ValueError),
    (LY, "cu_seqlens", torch.tensor([0, 3], dtype=torch.int32), "initial_state must be"),
    (FR, "cu_seqlens", torch.tensor([0, 3, 2, 5], dtype=torch.int32), ValueError),
    (FR, "ssm_state_indices", torch.tensor([[1, 2, 3], [4, 5, 6]]).float(), "int32 or int64"),
    (FR, "ssm_state_indices", torch.tensor([[1, 2, 3], [4, 5, 2 ** 32 + 6]]), ValueError),
    (FR, "ssm_state_indices", torch.tensor([[1, 2, 3]], dtype=torch.int32), "cu_seqlens: expected shape"),
    (FR, "num_accepted_tokens", torch.tensor([2 ** 32 + 1, 1]), ValueError),
    (FR, "num_accepted_tokens", torch.tensor([1], dtype=torch.int32), "num_accepted_tokens: expected shape"),
]


@pytest.mark.parametrize("site, name, value, want", METADATA)
def test_integer_metadata_is_narrowed_only_with_a_range_check(site, name, value, want):    # guard
    c = CALLS[site]()
    c[name] = value
    if want is ValueError:
        untouched(site, c, name=name)
    else:
        untouched(site, c, want)


def test_packed_decode_cuda_graph_padding_rows_read_and_write_nothing():    # guard
    c = pd_call(B=4)
    c["state_indices"] = torch.tensor([0, 2, -1, 5], dtype=torch.int32)
    c["mixed_qkv"][[0, 2]] = NAN                             # the padding rows' garbage
    c["raw_g"][0, [0, 2]] = NAN
    pool0 = c["initial_state"].clone()
    o, pool = k3_adapter(PD)(**c)
    want_o, want_pool = pd_direct(c, pool0)
    assert o is c["out"] and torch.equal(raw(o[0]), raw(want_o)) and torch.equal(raw(pool), raw(want_pool))
    assert torch.equal(o[0, [0, 2]], torch.zeros(2, H, V)) and torch.isfinite(o).all()
    assert torch.equal(raw(pool[[0, 1, 3, 4]]), raw(pool0[[0, 1, 3, 4]]))


@pytest.mark.parametrize("with_out", [True, False])
def test_verify_cuda_graph_padding_is_served_as_vllms_kernel_leaves_it(with_out):    # guard
    """The index table and counts padded past N, two tokens past the last offset (NaN): the real requests bitwise
    as the op on them alone; the padding tokens' rows untouched (a given out keeps its poison) or zero."""
    c = fr_call(T=7)
    c["cu_seqlens"] = torch.tensor([0, 2, 5], dtype=torch.int32)
    c["ssm_state_indices"] = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 0, 0]], dtype=torch.int32)
    c["num_accepted_tokens"] = torch.tensor([1, 2, 0], dtype=torch.int32)
    for name in ("q", "k", "v", "raw_g", "raw_beta"):
        c[name][:, 5:] = NAN
    if not with_out:
        del c["out"]
    pool0 = c["initial_state"].clone()
    o, pool = k3_adapter(FR)(**c)
    reqs = {n: (x[:, :5] if n in ("q", "k", "v", "raw_g", "raw_beta") else x) for n, x in c.items()}
    reqs.update(ssm_state_indices=c["ssm_state_indices"][:2], num_accepted_tokens=c["num_accepted_tokens"][:2])
    want_o, want_pool = fr_direct(reqs, pool0)
    assert torch.equal(raw(o[:, :5]), raw(want_o)) and torch.equal(raw(pool), raw(want_pool))
    assert (torch.isnan(o[:, 5:]).all() if with_out else torch.equal(o[:, 5:], torch.zeros(1, 2, H, V)))
