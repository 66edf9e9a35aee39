"""Bad-input campaign 12 (CPU backend): the engine adapters driven as an integrator would. Each case failed
before its fix, except those marked "guard" (behaviour that was already right, pinned here beside the fix
that depends on it).

- vLLM K3: A_log / dt_bias / g_bias in fp64 are served as vLLM's kernels read them (fp32 per element: guard);
  an integer or complex one was cast by .float() (a complex one losing its imaginary part) and served.
- vLLM lower_bound=True: K3 fell back saying "got 1.0", an int past the float range raised OverflowError; the
  vendored wrappers served it as the no-op it is there.
- K3 fused_recurrent_kda: fuse_gate=1 / 0 / 1.0 was served (`in (None, True, False)` compares by ==), and so
  were chunk_kda_with_fused_gate's int output_final_state / use_qk_l2norm_in_kernel, the vendored wrappers'
  int inplace_final_state, and bailing's no-op safe_gate / lower_bound of any type.
- vLLM integer metadata: an index or offsets tensor of another dtype (or no tensor) raised where the adapter
  should fall back; host values no kernel can run (a slot past the pool, a count outside [1, T_max], offsets
  past T or a request longer than T_max) fell back through the op where they should raise naming the argument.
- fla: lower_bound=True was dropped with the log gate (use_gate_in_kernel=False) and the call served;
  chunk_kda's chunk_size 7, max_num_seqs, safe_gate=True without a lower_bound in [-5, 0) (fla raises),
  disable_recompute with return_intermediate_states (fla asserts) were served; an int flag was read truthily.
- SGLang: target_verify falling back dropped out= (SGLang's kernel takes none); a refused call leaves out
  unwritten, and a bool lower_bound is a TypeError naming it (guards).
"""
from __future__ import annotations

import pytest
import torch

from flashkda_ext.integrations import fla as fkda_fla
from flashkda_ext.integrations import vllm as fkda_vllm
from flashkda_ext.integrations.sglang import FlashKDAExtKernel
from bad_input_cases import fla_chunk_call, fla_decode_call
from sglang_call_probe import packed_qkv, verify_setup
from vllm_adapter_probe import adapter, fell_back

H, K, V, SLOTS = 2, 8, 8, 6


def rand(*s, seed=[1200]):
    seed[0] += 1
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed[0]))


# --- vLLM: the adapter around a stand-in for vLLM's kernel (which cannot run here) ---------------------------

def raises_writing_nothing(call, pool, match):
    """call() raises a ValueError matching `match` without reaching vLLM's original, the pool as it was."""
    pool0 = pool.clone()
    with pytest.raises(ValueError, match=match):
        call()
    assert torch.equal(pool, pool0)


def packed_decode(**bad):
    B = 3
    kw = dict(mixed_qkv=rand(B, 2 * H * K + H * V), raw_g=rand(1, B, H, K), raw_beta=rand(1, B, H), A_log=rand(H),
              dt_bias=rand(H * K), lower_bound=-5.0, initial_state=rand(SLOTS, H, V, K),
              state_indices=torch.tensor([1, 0, 4], dtype=torch.int32))
    kw.update(bad)
    return kw


def chunk(**bad):
    T = 9
    kw = dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, H, V), raw_g=rand(1, T, H, K),
              raw_beta=rand(1, T, H), A_log=rand(H), g_bias=rand(H * K), lower_bound=-5.0,
              initial_state=rand(2, H, V, K), output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.tensor([0, 4, T], dtype=torch.int32))
    kw.update(bad)
    return kw


def verify(**bad):
    """Two requests of 2 and 3 draft tokens, a [2, 3] slot table, a count each."""
    T = 5
    kw = dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, H, V), raw_g=rand(1, T, H, K),
              raw_beta=rand(1, T, H), A_log=rand(H), dt_bias=rand(H * K), lower_bound=-5.0,
              initial_state=rand(8, H, V, K), cu_seqlens=torch.tensor([0, 2, T], dtype=torch.int32),
              ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
              num_accepted_tokens=torch.tensor([1, 2], dtype=torch.int32))
    kw.update(bad)
    return kw


def vendored_decode(**bad):
    N = 3
    kw = dict(q=rand(1, N, H, K), k=rand(1, N, H, K), v=rand(1, N, H, V), g=-rand(1, N, H, K).abs(),
              beta=rand(1, N, H).sigmoid(), initial_state=rand(SLOTS, H, V, K), inplace_final_state=True,
              cu_seqlens=torch.tensor([0, 1, 2, N], dtype=torch.int32),
              ssm_state_indices=torch.tensor([1, 2, 3], dtype=torch.int32))
    kw.update(bad)
    return kw


K3_SITES = {"k3.fused_recurrent_kda_packed_decode": (packed_decode, "dt_bias"),
            "k3.chunk_kda_with_fused_gate": (chunk, "g_bias"),
            "k3.fused_recurrent_kda": (verify, "dt_bias")}


# --- vLLM K3: the gate parameters' dtype ---------------------------------------------------------------------

@pytest.mark.parametrize("site", K3_SITES)
def test_vllm_k3_fp64_gate_parameters_are_served_as_vllms_kernels_read_them(site):
    """Guard (the decision): vLLM's kernels load A_log / dt_bias / g_bias in their own dtype and convert each
    element to fp32 (tl.load(...).to(tl.float32)); the adapter's one .float() gives those values, so an fp64
    call is served, bitwise as the call with the fp32-rounded parameters."""
    make, bias = K3_SITES[site]
    call = make()
    pool = call["initial_state"]
    fp64 = dict(call, A_log=call["A_log"].double(), initial_state=pool.clone(), **{bias: call[bias].double()})
    fp32 = dict(call, A_log=fp64["A_log"].float(), initial_state=pool.clone(), **{bias: fp64[bias].float()})
    fn = adapter(site)
    served = fkda_vllm.STATS[site, "served"]
    got, want = fn(**fp64), fn(**fp32)
    assert fkda_vllm.STATS[site, "served"] == served + 2
    assert all(torch.equal(a, b) for a, b in zip(got, want) if a is not None)
    assert torch.equal(fp64["initial_state"], fp32["initial_state"])


@pytest.mark.parametrize("site", K3_SITES)
@pytest.mark.parametrize("which,dtype", [("A_log", torch.int32), ("A_log", torch.complex64), ("bias", torch.int64),
                                         ("bias", torch.complex64)])
def test_vllm_k3_integer_or_complex_gate_parameters_fall_back(site, which, dtype):
    """Before: .float() made them fp32 (a complex one losing its imaginary part, with a warning) and served."""
    make, bias = K3_SITES[site]
    name = bias if which == "bias" else which
    call = make()
    call[name] = (call[name] * 4).to(dtype)
    pool0 = call["initial_state"].clone()
    fell_back(site, lambda: adapter(site)(**call), f"{name} of dtype {dtype}")
    assert torch.equal(call["initial_state"], pool0)


# --- vLLM: lower_bound=True, and an int past the float range ------------------------------------------------

@pytest.mark.parametrize("site", K3_SITES)
def test_vllm_k3_bool_lower_bound_falls_back_naming_the_bool(site):
    """Before: float(True) reached the op, whose reason said "got 1.0"."""
    call = K3_SITES[site][0](lower_bound=True)
    fell_back(site, lambda: adapter(site)(**call), "lower_bound must be a number or None, got bool True")


@pytest.mark.parametrize("site", K3_SITES)
def test_vllm_k3_int_lower_bound_past_the_float_range_falls_back_named(site):
    """Before: float(-10**400) in the adapter raised OverflowError ("int too large to convert to float")."""
    call = K3_SITES[site][0](lower_bound=-10 ** 400)
    fell_back(site, lambda: adapter(site)(**call), "lower_bound: expected a finite float")


def test_vllm_k3_int_lower_bound_is_served_as_its_float():
    """Guard: with float() gone from the adapter an int bound still reaches the op, which reads it as a float."""
    call = packed_decode(lower_bound=-3)
    as_float = dict(call, lower_bound=-3.0, initial_state=call["initial_state"].clone())
    fn = adapter("k3.fused_recurrent_kda_packed_decode")
    o_int, o_float = fn(**call)[0], fn(**as_float)[0]
    assert torch.equal(o_int, o_float) and torch.equal(call["initial_state"], as_float["initial_state"])


@pytest.mark.parametrize("name,value", [("lower_bound", True), ("safe_gate", 1), ("safe_gate", "yes"),
                                        ("lower_bound", "-5")])
def test_vllm_vendored_bailing_no_op_keywords_of_another_type_fall_back(name, value):
    """Before: bailing_moe_v3's safe_gate / lower_bound were accepted as no-ops whatever their value."""
    call = vendored_decode(**{name: value})
    pool0 = call["initial_state"].clone()
    fell_back("vendored.fused_recurrent_kda", lambda: adapter("vendored.fused_recurrent_kda")(**call), name)
    assert torch.equal(call["initial_state"], pool0)
    # bailing's own values are served
    ok = vendored_decode(safe_gate=True, lower_bound=-5.0)
    assert adapter("vendored.fused_recurrent_kda")(**ok) != "original"


# --- vLLM: fuse_gate and the other flags, True / False objects only ----------------------------------------

@pytest.mark.parametrize("value", [1, 0, 1.0])
def test_vllm_k3_fuse_gate_that_only_equals_a_bool_falls_back(value):
    """Before: `fuse_gate not in (None, True, False)` let 1, 0 and 1.0 through (1 == True) and served them."""
    call = verify(fuse_gate=value)
    pool0 = call["initial_state"].clone()
    fell_back("k3.fused_recurrent_kda", lambda: adapter("k3.fused_recurrent_kda")(**call), "fuse_gate")
    assert torch.equal(call["initial_state"], pool0)
    for ok in (None, True, False):
        assert adapter("k3.fused_recurrent_kda")(**verify(fuse_gate=ok)) != "original"


@pytest.mark.parametrize("site,make,name", [
    ("k3.chunk_kda_with_fused_gate", chunk, "output_final_state"),
    ("k3.chunk_kda_with_fused_gate", chunk, "use_qk_l2norm_in_kernel"),
    ("vendored.fused_recurrent_kda", vendored_decode, "inplace_final_state"),
    ("vendored.fused_recurrent_kda", vendored_decode, "use_qk_l2norm_in_kernel"),
])
def test_vllm_int_flags_fall_back(site, make, name):
    """Before: read truthily (1 served as True)."""
    call = make(**{name: 1})
    pool0 = call["initial_state"].clone()
    fell_back(site, lambda: adapter(site)(**call), name)
    assert torch.equal(call["initial_state"], pool0)


# --- vLLM integer metadata: unmapped falls back, out-of-bounds host values raise ----------------------------

FALLS_BACK = [
    ("k3.fused_recurrent_kda_packed_decode", packed_decode, dict(state_indices=torch.tensor([1., 0., 4.])),
     "state_indices: expected an int32 or int64 tensor, got torch.float32"),
    ("k3.chunk_kda_with_fused_gate", chunk, dict(cu_seqlens=torch.tensor([0., 4., 9.])),
     "cu_seqlens: expected an int32 or int64 tensor"),
    ("k3.chunk_kda_with_fused_gate", chunk, dict(cu_seqlens=torch.tensor([[0, 4, 9]], dtype=torch.int32)),
     "cu_seqlens: expected 1-D offsets"),
    ("k3.fused_recurrent_kda", verify, dict(ssm_state_indices=[[1, 2, 3], [4, 5, 6]]),
     "ssm_state_indices: expected an int32 or int64 tensor, got list"),
    ("k3.fused_recurrent_kda", verify, dict(num_accepted_tokens=torch.tensor([1., 2.])),
     "num_accepted_tokens: expected an int32 or int64 tensor"),
    ("vendored.fused_recurrent_kda", vendored_decode,
     dict(ssm_state_indices=torch.tensor([1, 2, 3], dtype=torch.int16)),
     "ssm_state_indices: expected an int32 or int64 tensor, got torch.int16"),
]


@pytest.mark.parametrize("site,make,bad,reason", FALLS_BACK, ids=[f"{s}-{next(iter(b))}" for s, _, b, _ in FALLS_BACK])
def test_vllm_integer_metadata_the_adapter_does_not_map_falls_back(site, make, bad, reason):
    """Before: a ValueError (dtype) or an AttributeError (a list) raised to the caller."""
    call = make(**bad)
    pool0 = call["initial_state"].clone()
    fell_back(site, lambda: adapter(site)(**call), reason)
    assert torch.equal(call["initial_state"], pool0)


RAISES = [
    ("k3.fused_recurrent_kda_packed_decode", packed_decode,
     dict(state_indices=torch.tensor([1, 6, 4], dtype=torch.int32)),
     r"^state_indices: entry \[1\] = 6 is out of range: expected values <= 5 \(a pool of 6 slots"),
    ("k3.fused_recurrent_kda_packed_decode", packed_decode, dict(state_indices=torch.tensor([1, 60, 4])),
     r"^state_indices: entry \[1\] = 60 is out of range"),
    ("k3.chunk_kda_with_fused_gate", chunk, dict(cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32)),
     r"^cu_seqlens: entry \[2\] = 12 is out of range: expected values in \[0, 9\] \(T = 9 tokens\)"),
    ("k3.chunk_kda_with_fused_gate", chunk, dict(cu_seqlens=torch.tensor([0, 6, 4, 9], dtype=torch.int32)),
     r"^cu_seqlens: expected non-decreasing offsets from 0"),
    ("k3.fused_recurrent_kda", verify, dict(ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 8]], dtype=torch.int32)),
     r"^ssm_state_indices: entry \[1, 2\] = 8 is out of range"),
    ("k3.fused_recurrent_kda", verify, dict(num_accepted_tokens=torch.tensor([0, 2], dtype=torch.int32)),
     r"^num_accepted_tokens: entry \[0\] = 0 is out of range: expected values in \[1, 3\]"),
    ("k3.fused_recurrent_kda", verify, dict(num_accepted_tokens=torch.tensor([1, 4])),
     r"^num_accepted_tokens: entry \[1\] = 4 is out of range"),
    ("k3.fused_recurrent_kda", verify, dict(cu_seqlens=torch.tensor([0, 1, 5], dtype=torch.int32)),
     r"^cu_seqlens: a request of 4 tokens, more than the 3 columns"),
    ("k3.fused_recurrent_kda", verify, dict(cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32)),
     r"^cu_seqlens: entry \[2\] = 6 is out of range"),
    ("vendored.fused_recurrent_kda", vendored_decode,
     dict(ssm_state_indices=torch.tensor([1, 9, 3], dtype=torch.int32)),
     r"^ssm_state_indices: entry \[1\] = 9 is out of range"),
    ("vendored.chunk_kda", None, dict(cu_seqlens=torch.tensor([0, 2, 7])), r"^cu_seqlens: entry \[2\] = 7 is out"),
]


def vendored_chunk(**bad):
    T = 6
    kw = dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, H, V), g=-rand(1, T, H, K).abs(),
              beta=rand(1, T, H).sigmoid(), initial_state=rand(2, H, V, K), output_final_state=True,
              use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 2, T]))
    kw.update(bad)
    return kw


@pytest.mark.parametrize("site,make,bad,match", RAISES, ids=[f"{s}-{i}" for i, (s, _, _, _) in enumerate(RAISES)])
def test_vllm_host_metadata_no_kernel_can_run_raises_naming_it(site, make, bad, match):
    """Before: the op refused it and the call fell back to vLLM's kernel, which reads or writes out of bounds
    with such values (or, for the verify offsets past T, the adapter fell back itself)."""
    call = (make or vendored_chunk)(**bad)
    fallbacks = fkda_vllm.STATS[site, "fell_back"]
    raises_writing_nothing(lambda: adapter(site)(**call), call["initial_state"], match)
    assert fkda_vllm.STATS[site, "fell_back"] == fallbacks


def test_vllm_k3_one_column_table_count_other_than_one_raises():
    """A one-column table names one column: a count of 2 reads past it in vLLM's kernel (before: padding)."""
    call = verify(q=rand(1, 2, H, K), k=rand(1, 2, H, K), v=rand(1, 2, H, V), raw_g=rand(1, 2, H, K),
                  raw_beta=rand(1, 2, H), cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32),
                  ssm_state_indices=torch.tensor([[1], [4]], dtype=torch.int32),
                  num_accepted_tokens=torch.tensor([1, 2], dtype=torch.int32))
    raises_writing_nothing(lambda: adapter("k3.fused_recurrent_kda")(**call), call["initial_state"],
                           r"^num_accepted_tokens: entry \[1\] = 2 is out of range: expected values in \[1, 1\]")
    call["num_accepted_tokens"] = torch.tensor([1, 1], dtype=torch.int32)
    assert adapter("k3.fused_recurrent_kda")(**call) != "original"


def test_vllm_graph_padding_rows_past_the_requests_are_not_checked():
    """Guard for the host checks above: the table and counts vLLM pads to the CUDA-graph batch, rows past the N
    requests hold what vLLM put there (null block, any count) and are neither read nor refused."""
    call = verify(ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6], [99, 99, 99]], dtype=torch.int32),
                  num_accepted_tokens=torch.tensor([1, 2, 0], dtype=torch.int32))
    assert adapter("k3.fused_recurrent_kda")(**call) != "original"
    call = vendored_decode()
    call.update(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32),
                ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 0], [99, 99, 99]], dtype=torch.int32),
                num_accepted_tokens=torch.tensor([1, 3, 0], dtype=torch.int32), q=rand(1, 5, H, K),
                k=rand(1, 5, H, K), v=rand(1, 5, H, V), g=-rand(1, 5, H, K).abs(), beta=rand(1, 5, H).sigmoid())
    call.pop("inplace_final_state")
    fn = adapter("vendored.fused_recurrent_kda_fwd")
    served = fkda_vllm.STATS["vendored.fused_recurrent_kda_fwd", "served"]
    assert fn(**dict(call, scale=K ** -0.5, inplace_final_state=True, use_qk_l2norm_in_kernel=True)) != "original"
    assert fkda_vllm.STATS["vendored.fused_recurrent_kda_fwd", "served"] == served + 1


# --- fla: lower_bound and chunk_kda's hints ---------------------------------------------------------------------


@pytest.fixture
def inference():
    with torch.inference_mode():
        yield


def fla_chunk(**extra):
    return fla_chunk_call(H, K, V, **extra)


def fla_decode(**extra):
    return fla_decode_call(H, K, V, **extra)


@pytest.mark.parametrize("gate_in_kernel", [True, False])
def test_fla_bool_lower_bound_is_refused_naming_the_bool(inference, gate_in_kernel):
    """Before: with the log gate (use_gate_in_kernel=False) lower_bound=True was dropped and the call served;
    with the gate in the kernel the op's refusal named the bool (now the adapter's does, before any mapping)."""
    ok, reason = fkda_fla.chunk_kda_verifier(**fla_chunk(lower_bound=True, use_gate_in_kernel=gate_in_kernel))
    assert not ok and "lower_bound as a number or None, got bool True" in reason
    ok, reason = fkda_fla.fused_recurrent_kda_fwd_verifier(**fla_decode(lower_bound=True,
                                                                        use_gate_in_kernel=gate_in_kernel))
    assert not ok and "got bool True" in reason


REFUSED_HINTS = [
    (dict(chunk_size=7), "chunk_size 32 or 64"),
    (dict(chunk_size=True), "chunk_size 32 or 64"),
    (dict(max_num_seqs=4), "max_num_seqs"),
    (dict(safe_gate=True), "lower_bound in [-5, 0)"),                     # no lower_bound: fla raises
    (dict(safe_gate=True, lower_bound=-6.0), "lower_bound in [-5, 0)"),
    (dict(disable_recompute=True, return_intermediate_states=True), "disable_recompute"),
    (dict(safe_gate=1, lower_bound=-5.0), "safe_gate as a bool"),
    (dict(output_final_state=1), "output_final_state as a bool"),
    (dict(transpose_state_layout=True), "transpose_state_layout"),        # guard: an unknown keyword
]


@pytest.mark.parametrize("extra,reason", REFUSED_HINTS, ids=[next(iter(e)) + str(i)
                                                              for i, (e, _) in enumerate(REFUSED_HINTS)])
def test_fla_chunk_kda_hints_it_cannot_honour_are_refused(inference, extra, reason):
    call = fla_chunk(**extra)
    if extra.get("return_intermediate_states"):
        call["output_final_state"] = False
    before = fkda_fla.STATS["chunk_kda", "refused"]
    ok, why = fkda_fla.chunk_kda_verifier(**call)
    assert not ok and reason in why, why
    assert fkda_fla.STATS["chunk_kda", "refused"] == before + 1


HONOURED_HINTS = [dict(chunk_size=32), dict(safe_gate=True, lower_bound=-5.0), dict(disable_recompute=True),
                  dict(safe_gate=True, use_gate_in_kernel=False, A_log=None, dt_bias=None)]


@pytest.mark.parametrize("extra", HONOURED_HINTS, ids=range(len(HONOURED_HINTS)))
def test_fla_chunk_kda_hints_that_do_not_change_the_result_are_served_exactly(inference, extra):
    """Guard (the other side of the refusals above): chunk_size 32, safe_gate (fla's kernel choice),
    disable_recompute (a backward-pass memory choice) compute the same recurrence: served, equal to the call
    without them."""
    call = fla_chunk(**extra)
    plain = {n: x for n, x in call.items() if n not in ("chunk_size", "safe_gate", "disable_recompute")}
    assert fkda_fla.chunk_kda_verifier(**call) == (True, None)
    o, _ = fkda_fla.serve_chunk_kda(**call)
    want, _ = fkda_fla.serve_chunk_kda(**plain)
    assert torch.equal(o, want)


# --- SGLang: lower_bound and out= -------------------------------------------------------------------------------


def test_sglang_bool_lower_bound_is_a_type_error_naming_it():
    """Guard: the SGLang kernel raises (it has no fallback for bad input); the op names the bool."""
    B = 3
    pool = rand(SLOTS, H, V, K)
    pool0 = pool.clone()
    with pytest.raises(TypeError, match=r"^lower_bound: expected a float < 0, got bool True"):
        FlashKDAExtKernel().packed_decode(rand(B, 2 * H * K + H * V), rand(B, H * K), rand(B, H), A_log=rand(H),
                                          dt_bias=rand(H * K), scale=K ** -0.5, ssm_states=pool,
                                          cache_indices=torch.tensor([0, 1, 2], dtype=torch.int32), num_v_heads=H,
                                          head_v_dim=V, lower_bound=True)
    assert torch.equal(pool, pool0)


def sglang_decode(out, **bad):
    N = 3
    mixed = rand(N, 2 * H * K + H * V)
    q, k, v = packed_qkv(mixed, H, K, V)
    pool = rand(SLOTS, H, V, K)
    kw = dict(A_log=rand(H), dt_bias=rand(H * K), ssm_states=pool,
              cache_indices=torch.tensor([0, 1, 2], dtype=torch.int32),
              query_start_loc=torch.arange(N + 1, dtype=torch.int32), out=out)
    kw.update(bad)
    return pool, lambda kernel=None: (kernel or FlashKDAExtKernel()).decode(q, k, v, rand(N, H * K), rand(N, H), **kw)


def sglang_verify(out, **bad):
    T = 5
    q, k, v, pool, buf, kw = verify_setup(rand, H, K, V, SLOTS)
    kw["out"] = out
    kw.update(bad)
    a, b, A_log, dt_bias = rand(T, H * K), rand(T, H), rand(H), rand(H * K)
    return (pool, buf), lambda kernel=None: (kernel or FlashKDAExtKernel()).target_verify(
        A_log, dt_bias, q, k, v, a, b, **kw)


SGLANG_REFUSED = [
    ("decode", dict(cache_indices=torch.tensor([0, 9, 2], dtype=torch.int32)), r"state_indices"),
    ("decode", dict(lower_bound=True), r"^lower_bound: "),
    ("target_verify", dict(cache_steps=7), r"^cache_steps: "),
    ("target_verify", dict(intermediate_state_indices=torch.tensor([0, 0], dtype=torch.int32)),
     r"^intermediate_state_indices: row 0 is used by requests 0 and 1"),
]


@pytest.mark.parametrize("method,bad,match", SGLANG_REFUSED,
                         ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(SGLANG_REFUSED)])
def test_sglang_refused_call_leaves_out_bitwise_unchanged(method, bad, match):
    """Guard (docs/integrations.md, "SGLang", out=): every check runs before anything is written."""
    T = 3 if method == "decode" else 5
    out = torch.full((1, T, H, V), float("nan"))
    out[0, 0, 0, 0] = 7.0
    out0 = out.clone()
    tensors, call = (sglang_decode if method == "decode" else sglang_verify)(out, **bad)
    tensors = tensors if isinstance(tensors, tuple) else (tensors,)
    before = [t.clone() for t in tensors]
    with pytest.raises((ValueError, TypeError), match=match):
        call()
    assert torch.equal(out.view(torch.int32), out0.view(torch.int32))
    assert all(torch.equal(t.view(torch.int32), b.view(torch.int32)) for t, b in zip(tensors, before))
    # served: the same out receives the result
    tensors, call = (sglang_decode if method == "decode" else sglang_verify)(out)
    assert call() is out and not torch.isnan(out).any()


class _Recorder:
    """SGLang's TritonKDAKernel as the plugin hands it over (a target_verify with its own signature)."""
    def __init__(self):
        self.calls = []

    def target_verify(self, *args, **kwargs):
        self.calls.append(kwargs)
        return torch.full((1, 5, H, V), 3.0)


def test_sglang_target_verify_fallback_writes_out():
    """Before: a verify that fell back (a draft tree then; now one whose parent table is not [N, S]) went without
    out (SGLang's kernel takes none) and out stayed unwritten."""
    out = torch.zeros(1, 5, H, V)
    fallback = _Recorder()
    _, call = sglang_verify(out, retrieve_parent_token=torch.zeros(2, 9, dtype=torch.int64))
    assert call(FlashKDAExtKernel(fallback=fallback)) is out
    assert "out" not in fallback.calls[-1] and torch.equal(out, torch.full_like(out, 3.0))


@pytest.mark.parametrize("bad", [torch.zeros(1, 5, H), torch.zeros(1, 5, H, V, dtype=torch.float64)],
                         ids=["shape", "dtype"])
def test_sglang_target_verify_fallback_checks_out_first(bad):
    fallback = _Recorder()
    _, call = sglang_verify(bad, retrieve_parent_token=torch.zeros(2, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^out: expected a torch.float32 tensor \[1, T, HV, V\]"):
        call(FlashKDAExtKernel(fallback=fallback))
    assert fallback.calls == [] and not bad.any()


def test_sglang_packed_decode_takes_no_out():
    """Guard: packed_decode has no out= (no call site passes one): a TypeError, never ignored."""
    with pytest.raises(TypeError, match=r"^packed_decode: unexpected keyword arguments \['out'\]"):
        FlashKDAExtKernel().packed_decode(rand(3, 2 * H * K + H * V), rand(3, H * K), rand(3, H), A_log=rand(H),
                                          dt_bias=rand(H * K), scale=None, ssm_states=rand(SLOTS, H, V, K),
                                          cache_indices=torch.tensor([0, 1, 2], dtype=torch.int32), num_v_heads=H,
                                          head_v_dim=V, out=torch.zeros(1, 3, H, V))
