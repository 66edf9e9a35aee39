"""Every argument rule of the public ops: one bad argument at a time, the right exception type, and a
message that names the argument, what was expected and what was received. Nothing is launched:
each bad call is made through the public op, whose outputs are poisoned first and must stay so."""
import math

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext import validation as val

ROWS, H, HV, K, V, SLOTS = 3, 2, 4, 8, 6, 5


def decode_args(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    return dict(q=r(ROWS, H, K), k=r(ROWS, H, K), v=r(ROWS, HV, V), g=r(ROWS, HV, K), beta=r(ROWS, HV),
                state=r(SLOTS, HV, V, K, dt=torch.float32),
                state_indices=torch.tensor([0, 3, -1], dtype=torch.int32),
                A_log=r(HV, dt=torch.float32), dt_bias=r(HV * K, dt=torch.float32))


def call_decode(args, **kw):
    a = dict(args)
    q, k, v, g, beta = (a.pop(n) for n in ("q", "k", "v", "g", "beta"))
    a.update(kw)
    return val.check_kda_decode(q, k, v, g, beta, **a)


def test_valid_decode_call_is_accepted_and_described():
    call = call_decode(decode_args())
    assert (call.rows, call.num_heads, call.value_heads, call.head_dim_k, call.head_dim_v) == (ROWS, H, HV, K, V)
    assert call.backend == "cpu" and call.slots == SLOTS and call.offset_bits == 32
    assert math.isclose(call.scale, K ** -0.5)
    assert call.route_meta()["work_items"] == ROWS * HV


def _t(shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


DECODE_BAD = [
    # (description, mutation of args, extra kwargs, exception, words the message must hold)
    ("q not a tensor", {"q": [1, 2]}, {}, TypeError, ["q", "torch.Tensor", "list"]),
    ("q wrong ndim", {"q": _t((ROWS, H * K))}, {}, ValueError, ["q", "3-D"]),
    ("k shape", {"k": _t((ROWS, H, K + 1))}, {}, ValueError, ["k", "shape"]),
    ("v rows", {"v": _t((ROWS + 1, HV, V))}, {}, ValueError, ["v", "leading"]),
    ("HV not multiple of H", {"v": _t((ROWS, 3, V)), "g": _t((ROWS, 3, K)), "beta": _t((ROWS, 3))}, {},
     ValueError, ["HV = 3", "multiple", "H = 2"]),
    ("g shape", {"g": _t((ROWS, HV, K - 1))}, {}, ValueError, ["g", "[rows, HV, K]"]),
    ("beta shape", {"beta": _t((ROWS, HV, 1))}, {}, ValueError, ["beta", "[rows, HV]"]),
    ("dtype mismatch", {"v": _t((ROWS, HV, V), torch.float64)}, {}, ValueError, ["v", "float32", "float64"]),
    ("g dtype", {"g": _t((ROWS, HV, K), torch.float16)}, {}, ValueError, ["g", "dtype of q (float32)", "float16"]),
    ("beta dtype", {"beta": _t((ROWS, HV), torch.float64)}, {}, ValueError, ["beta", "dtype of q (float32)", "float64"]),
    ("non-contiguous q", {"q": _t((ROWS, K, H)).transpose(1, 2)}, {}, ValueError, ["q", "contiguous", "strides"]),
    ("state shape", {"state": _t((SLOTS, HV, K, V))}, {}, ValueError, ["state", "[slots, HV, V, K]"]),
    ("state dtype", {"state": _t((SLOTS, HV, V, K), torch.float16)}, {}, ValueError, ["state", "float16"]),
    ("indices dtype", {"state_indices": torch.tensor([0, 1, 2])}, {}, ValueError, ["state_indices", "int32", "int64"]),
    ("indices length", {"state_indices": torch.tensor([0, 1], dtype=torch.int32)}, {}, ValueError,
     ["state_indices", "[rows]"]),
    ("softplus without A_log", {"A_log": None}, {}, ValueError, ["A_log", "softplus"]),
    ("softplus without dt_bias", {"dt_bias": None}, {}, ValueError, ["dt_bias", "softplus"]),
    ("A_log shape", {"A_log": _t((HV + 1,))}, {}, ValueError, ["A_log", "[HV]"]),
    ("A_log dtype", {"A_log": _t((HV,), torch.float64)}, {}, ValueError, ["A_log", "float32", "float64"]),
    ("dt_bias shape", {"dt_bias": _t((HV * K + 1,))}, {}, ValueError, ["dt_bias", "[HV*K]"]),
    ("bounded without lower_bound", {}, {"gate": "bounded"}, ValueError, ["lower_bound", "bounded"]),
    ("bounded lower_bound >= 0", {}, {"gate": "bounded", "lower_bound": 0.5}, ValueError, ["lower_bound", "< 0", "0.5"]),
    ("bounded lower_bound nan", {}, {"gate": "bounded", "lower_bound": float("nan")}, ValueError, ["lower_bound"]),
    ("lower_bound with softplus", {}, {"lower_bound": -5.0}, ValueError, ["lower_bound", "bounded"]),
    ("log gate with A_log", {}, {"gate": "log"}, ValueError, ["A_log", "log"]),
    ("unknown gate", {}, {"gate": "relu"}, ValueError, ["gate", "relu"]),
    ("scale negative", {}, {"scale": -1.0}, ValueError, ["scale", "> 0"]),
    ("scale type", {}, {"scale": "1"}, TypeError, ["scale", "str"]),
    ("slot mode", {}, {"slot_mode": "shared"}, ValueError, ["slot_mode", "shared"]),
    ("beta_is_logit type", {}, {"beta_is_logit": 1}, TypeError, ["beta_is_logit", "bool"]),
    ("out shape", {}, {"out": _t((ROWS, HV, V + 1))}, ValueError, ["out", "[rows, HV, V]"]),
    ("out dtype", {}, {"out": _t((ROWS, HV, V), torch.float64)}, ValueError, ["out", "float32", "float64"]),
]


@pytest.mark.parametrize("desc,mut,kw,exc,words", DECODE_BAD, ids=[d[0] for d in DECODE_BAD])
def test_decode_rule(desc, mut, kw, exc, words):
    args = decode_args()
    args.update(mut)
    if kw.get("gate") == "log":
        pass  # keeps A_log/dt_bias: the rule under test is that log mode refuses them
    state_before = args["state"].clone() if isinstance(args["state"], torch.Tensor) else None
    with pytest.raises(exc) as info:
        call_decode(args, **kw)
    for w in words:
        assert w in str(info.value), f"{desc}: {w!r} not in {info.value}"
    # the same bad call through the public op launches nothing: the pool is bitwise unchanged
    a = dict(args)
    q, k, v, g, beta = (a.pop(n) for n in ("q", "k", "v", "g", "beta"))
    a.update(kw)
    with pytest.raises(exc):
        fk.kda_decode(q, k, v, g, beta, **a)
    if state_before is not None and isinstance(args["state"], torch.Tensor) \
            and args["state"].shape == state_before.shape:
        assert torch.equal(args["state"], state_before)


def test_cuda_supported_set_rejects_unsupported_dims_on_any_device():
    # backend="cuda" checks against the CUDA supported set: head dim 8 is not 128
    with pytest.raises(ValueError, match=r"q: head dim K = 8 is not supported here; expected one of \[128\]"):
        call_decode(decode_args(torch.bfloat16), backend="cuda")


def test_cuda_head_count_outside_set():
    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    hv = 7
    args = dict(q=r(2, 7, 128), k=r(2, 7, 128), v=r(2, hv, 128), g=r(2, hv, 128), beta=r(2, hv),
                state=torch.randn(3, hv, 128, 128), state_indices=torch.tensor([0, 1], dtype=torch.int32),
                A_log=torch.randn(hv), dt_bias=torch.randn(hv * 128))
    with pytest.raises(ValueError, match="value head count HV = 7"):
        call_decode(args, backend="cuda")
    args.update(q=r(2, 8, 128), k=r(2, 8, 128), v=r(2, 8, 128), g=r(2, 8, 128), beta=r(2, 8),
                state=torch.randn(3, 8, 128, 128), A_log=torch.randn(8), dt_bias=torch.randn(8 * 128))
    assert call_decode(args, backend="cuda").value_heads == 8


def _bf16_cuda_decode_args(g_dtype, beta_dtype, hv=8):
    gen = torch.Generator().manual_seed(3)
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    return dict(q=r(2, hv, 128), k=r(2, hv, 128), v=r(2, hv, 128), g=r(2, hv, 128, dt=g_dtype),
                beta=r(2, hv, dt=beta_dtype), state=torch.randn(3, hv, 128, 128),
                state_indices=torch.tensor([0, 1], dtype=torch.int32), A_log=torch.randn(hv),
                dt_bias=torch.randn(hv * 128))


@pytest.mark.parametrize("g_dtype,beta_dtype,gb", [
    (torch.bfloat16, torch.bfloat16, "input"), (torch.float32, torch.float32, "f32"),
    (torch.float32, torch.bfloat16, "f32"), (torch.bfloat16, torch.float32, "f32")])
def test_decode_takes_fp32_gate_and_beta_beside_bf16_q(g_dtype, beta_dtype, gb):
    """kda_decode reads g and beta in their own dtype, q's or float32 (each on its own), on both backends'
    supported sets; the route metadata says which (gb) and the call keeps both dtypes."""
    for backend in ("cuda", "cpu"):
        call = call_decode(_bf16_cuda_decode_args(g_dtype, beta_dtype), backend=backend)
        assert call.route_meta()["gb"] == gb
        assert (call.g_dtype, call.beta_dtype) == (val.dtype_name(g_dtype), val.dtype_name(beta_dtype))
    casts = call.gb_casts("float32")
    assert casts == tuple((n, "float32") for n, d in (("g", g_dtype), ("beta", beta_dtype)) if d != torch.float32)
    assert call.gb_casts(None) == ()


@pytest.mark.parametrize("name,dtype", [("g", torch.float16), ("beta", torch.float16), ("g", torch.float64),
                                        ("beta", torch.float64)])
def test_decode_refuses_other_gate_dtypes_naming_the_argument(name, dtype):
    args = _bf16_cuda_decode_args(torch.bfloat16, torch.bfloat16)
    args[name] = args[name].to(dtype)
    with pytest.raises(ValueError, match=rf"^{name}: expected the dtype of q \(bfloat16\) or float32, got "):
        call_decode(args, backend="cuda")


def test_fp32_gate_is_read_as_is_by_decode_and_verify_only():
    """kda_prefill still reads g and beta in q's dtype: an fp32 g beside bf16 q is refused there, naming g
    (the adapters cast it for it); kda_verify takes fp32 g / beta as kda_decode does (gb "f32"), and
    refuses another dtype naming it."""
    gen = torch.Generator().manual_seed(4)
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    with pytest.raises(ValueError, match=r"^g: expected the dtype of q \(bfloat16\), got float32"):
        val.check_kda_prefill(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8, dt=torch.float32),
                              r(1, 4, 2), A_log=torch.randn(2), dt_bias=torch.randn(16))
    verify = dict(state=torch.randn(4, 2, 8, 8), state_indices=torch.zeros(2, 2, dtype=torch.int32),
                  cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32), A_log=torch.randn(2), dt_bias=torch.randn(16))
    call = val.check_kda_verify(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8),
                                r(1, 4, 2, dt=torch.float32), **verify)
    assert call.gb == "f32" and call.route_meta()["gb"] == "f32" and call.gb_casts("float32") == (("g", "float32"),)
    with pytest.raises(ValueError, match=r"^beta: expected the dtype of q \(bfloat16\) or float32, got float16"):
        val.check_kda_verify(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, dt=torch.float16),
                             **verify)


def test_cpu_any_dims_accepted():
    call = call_decode(decode_args(torch.float64))
    assert call.input_dtype == "float64"


# ---------------------------------------------------------------------------------------------
# prefill

T = 10


def prefill_args(B=1):
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
                A_log=r(HV), dt_bias=r(HV, K))


def call_prefill(args, **kw):
    a = dict(args)
    q, k, v, g, beta = (a.pop(n) for n in ("q", "k", "v", "g", "beta"))
    a.update(kw)
    return val.check_kda_prefill(q, k, v, g, beta, **a)


def test_valid_prefill_calls():
    call = call_prefill(prefill_args(B=2))
    assert (call.num_seqs, call.total_tokens, call.state_mode) == (2, 2 * T, "dense")
    cu = torch.tensor([0, 3, 3, T], dtype=torch.int64)
    call = call_prefill(prefill_args(), cu_seqlens=cu, initial_state=torch.randn(3, HV, V, K),
                        checkpoint_every=2)
    # host offsets: the longest sequence (7 tokens) sizes the checkpoints, not T
    assert (call.num_seqs, call.checkpoint_slots, call.cu_seqlens_dtype) == (3, 7 // 2, "int64")
    call = call_prefill(prefill_args(), cu_seqlens=cu, state=torch.randn(7, HV, V, K),
                        state_indices=torch.tensor([4, -1, 0], dtype=torch.int32))
    assert (call.state_mode, call.slots) == ("pool", 7)


PREFILL_BAD = [
    ("cu_seqlens dtype", {"cu_seqlens": torch.tensor([0, T], dtype=torch.float32)}, ValueError,
     ["cu_seqlens", "int32 or int64", "float32"]),
    ("cu_seqlens with B>1", {"_B": 2, "cu_seqlens": torch.tensor([0, T], dtype=torch.int32)}, ValueError,
     ["B = 1", "B = 2"]),
    ("cu_seqlens not ending at T", {"cu_seqlens": torch.tensor([0, 4, T - 1], dtype=torch.int32)}, ValueError,
     ["cu_seqlens", "0 to T"]),
    ("cu_seqlens decreasing", {"cu_seqlens": torch.tensor([0, 6, 4, T], dtype=torch.int32)}, ValueError,
     ["cu_seqlens", "non-decreasing"]),
    ("cu_seqlens too short", {"cu_seqlens": torch.tensor([0], dtype=torch.int32)}, ValueError, ["cu_seqlens", "N+1"]),
    ("initial_state N", {"initial_state": torch.randn(2, HV, V, K)}, ValueError, ["initial_state", "N = 1"]),
    ("initial_state layout", {"initial_state": torch.randn(1, HV, K, V)}, ValueError, ["initial_state", "[slots, HV, V, K]"]),
    ("pool without indices", {"state": torch.randn(4, HV, V, K)}, ValueError, ["state_indices", "pool mode"]),
    ("pool with initial_state", {"state": torch.randn(4, HV, V, K), "state_indices": torch.tensor([1], dtype=torch.int32),
                                 "initial_state": torch.randn(1, HV, V, K)}, ValueError, ["initial_state", "pool mode"]),
    ("pool indices length", {"state": torch.randn(4, HV, V, K), "state_indices": torch.tensor([1, 2], dtype=torch.int32)},
     ValueError, ["state_indices", "[N]"]),
    ("null_slot0 without pool", {"null_slot0": True}, ValueError, ["null_slot0", "pool"]),
    ("final_state with output off", {"final_state": torch.randn(1, HV, V, K), "output_final_state": False},
     ValueError, ["final_state", "output_final_state"]),
    ("final_state dtype differs", {"initial_state": torch.randn(1, HV, V, K),
                                   "final_state": torch.randn(1, HV, V, K).to(torch.bfloat16)},
     ValueError, ["final_state", "float32", "bfloat16"]),
    ("checkpoint_every negative", {"checkpoint_every": -2}, ValueError, ["checkpoint_every", ">= 0"]),
    ("checkpoints too small", {"checkpoint_every": 2, "checkpoints": torch.randn(1, 2, HV, V, K)}, ValueError,
     ["checkpoints", ">= 5"]),
    ("checkpoints without every", {"checkpoints": torch.randn(1, 2, HV, V, K)}, ValueError, ["checkpoints", "checkpoint_every = 0"]),
    ("max_seqlen too big", {"max_seqlen": T + 1}, ValueError, ["max_seqlen", f"T = {T}"]),
    ("out shape", {"out": torch.randn(1, T, HV, V + 1)}, ValueError, ["out", "[B, T, HV, V]"]),
    ("dt_bias 2-D wrong", {"dt_bias": torch.randn(K, HV)}, ValueError, ["dt_bias", "[HV, K]"]),
]


@pytest.mark.parametrize("desc,mut,exc,words", PREFILL_BAD, ids=[d[0] for d in PREFILL_BAD])
def test_prefill_rule(desc, mut, exc, words):
    mut = dict(mut)
    args = prefill_args(B=mut.pop("_B", 1))
    kw = {}
    for key, value in mut.items():
        (args if key in args else kw)[key] = value
    with pytest.raises(exc) as info:
        call_prefill(args, **kw)
    for w in words:
        assert w in str(info.value), f"{desc}: {w!r} not in {info.value}"


def test_prefill_checkpoint_multiple_of_chunk():
    with pytest.raises(ValueError, match="checkpoint_every: expected a multiple of the chunk size 64"):
        call_prefill(prefill_args(), checkpoint_every=32, chunk_multiple=64)


# ---------------------------------------------------------------------------------------------
# fused decode

D, FH = 8, 2


def fused_args():
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    C = 3 * FH * D
    return dict(x=r(ROWS, C), conv_weight=r(C, 4), conv_state=r(SLOTS, C, 3), g=r(ROWS, FH, D), beta=r(ROWS, FH),
                A_log=r(FH), dt_bias=r(FH * D), state_indices=torch.tensor([1, -1, 4], dtype=torch.int32),
                state=r(SLOTS, FH, D, D), output_gate=r(ROWS, FH, D), norm_weight=r(D))


def call_fused(args, **kw):
    names = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices", "state",
             "output_gate", "norm_weight")
    return val.check_fused_kda_decode(*(args[n] for n in names), **kw)


def test_valid_fused_call():
    call = call_fused(fused_args())
    assert (call.rows, call.num_heads, call.head_dim, call.slots) == (ROWS, FH, D, SLOTS)


FUSED_BAD = [
    ("x width", {"x": torch.randn(ROWS, 3 * FH * D + 1)}, {}, ["x", "3*H*D"]),
    ("conv_weight layout", {"conv_weight": torch.randn(4, 3 * FH * D)}, {}, ["conv_weight", "[3*H*D, 4]"]),
    ("conv_state layout", {"conv_state": torch.randn(SLOTS, 3, 3 * FH * D)}, {}, ["conv_state", "[slots, 3*H*D, 3]"]),
    ("conv_state slots", {"conv_state": torch.randn(SLOTS + 1, 3 * FH * D, 3)}, {}, ["conv_state", f"{SLOTS} slots"]),
    ("output_gate shape", {"output_gate": torch.randn(ROWS, FH, D + 1)}, {}, ["output_gate", "[rows, H, D]"]),
    ("norm_weight shape", {"norm_weight": torch.randn(D + 1)}, {}, ["norm_weight", "[D]"]),
    ("norm_eps", {}, {"norm_eps": 0.0}, ["norm_eps", "> 0"]),
    ("beta dtype", {"beta": torch.randn(ROWS, FH).double()}, {}, ["beta", "float32", "float64"]),
]


@pytest.mark.parametrize("desc,mut,kw,words", FUSED_BAD, ids=[d[0] for d in FUSED_BAD])
def test_fused_rule(desc, mut, kw, words):
    args = fused_args()
    args.update(mut)
    with pytest.raises(ValueError) as info:
        call_fused(args, **kw)
    for w in words:
        assert w in str(info.value), f"{desc}: {w!r} not in {info.value}"


def test_fused_cuda_head_set():
    args = fused_args()
    with pytest.raises(ValueError, match="head dim K = 8"):
        call_fused(args, backend="cuda")


# ---------------------------------------------------------------------------------------------
# the memo: a remembered verdict never hides a change that a full check would reject


def test_memo_reuses_verdict_only_for_identical_call_signatures():
    val.check_kda_decode.cache_clear()
    args = decode_args()
    first = call_decode(args)
    assert call_decode(args) is first                       # same signature: the remembered verdict
    assert call_decode(args, scale=0.5) is not first        # any scalar change is a new signature
    with pytest.raises(TypeError, match="beta_is_logit"):
        call_decode(args, beta_is_logit=1)                  # 1 is not True for the memo either
    bad = dict(args, q=_t((ROWS, K, H)).transpose(1, 2))    # same shape, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        call_decode(bad)
    bad = dict(args, state=_t((SLOTS, HV, V, K), torch.float16))  # same shape, other dtype
    with pytest.raises(ValueError, match="state"):
        call_decode(bad)


def test_memo_rechecks_host_offsets_by_value():
    val.check_kda_prefill.cache_clear()
    args = prefill_args()
    call_prefill(args, cu_seqlens=torch.tensor([0, 4, T], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        call_prefill(args, cu_seqlens=torch.tensor([0, 8, 4, T], dtype=torch.int32))
    with pytest.raises(ValueError, match="0 to T"):  # same shape and dtype as the accepted call
        call_prefill(args, cu_seqlens=torch.tensor([0, 4, T - 1], dtype=torch.int32))
