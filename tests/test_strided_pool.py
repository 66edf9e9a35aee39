"""State pools whose slots sit apart (docs/semantics.md, "Strided pools"), on the CPU backend: vLLM keeps each
request's conv and recurrent state in one page, so its pool is a view [slots, HV, V, K] with a slot stride
larger than HV*V*K. Every op that reads a pool takes it (kda_decode, kda_verify, fused_kda_decode,
fused_kda_verify, kda_prefill's pool mode): the results equal the dense pool's call bitwise, and the elements
between slots and the slots no row names stay bitwise unchanged. Pools outside the contract are refused,
naming `state` and the strides expected, before anything is written; the fast path never serves a pool of
other strides under a signature it kept."""
import zlib

import pytest
import torch

import flashkda_ext
from flashkda_ext import custom_ops, fast_path, ops, validation

H, HV, K, V, SLOTS = 2, 4, 8, 16, 7     # K != V: a transposed slot cannot pass
D = 16                                   # the fused ops: HV = H, K = V = D
E = HV * V * K


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def bits(t):
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def paged(slots, inner, dtype, lead, pad, gen):
    """A pool view [slots, *inner] into a random buffer of pages [slots, lead + prod(inner) + pad]: each slot's
    state `lead` elements into its page (vLLM puts the conv state first). Returns (buffer, pool view)."""
    n = 1
    for d in inner:
        n *= d
    buf = (torch.randn(slots, lead + n + pad, generator=gen) * 0.5).to(dtype)
    return buf, buf[:, lead:lead + n].view(slots, *inner)


def outside(buf, pool):
    """A mask of buf's elements that are no element of the pool view (leads and pads between slots)."""
    mask = torch.ones(buf.numel(), dtype=torch.bool)
    base = pool.data_ptr() - buf.data_ptr()
    n = pool[0].numel()
    for s in range(pool.shape[0]):
        lo = (base + s * pool.stride(0) * pool.element_size()) // pool.element_size()
        mask[lo:lo + n] = False
    return mask.view(buf.shape)


def rnd(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


# ---------------------------------------------------------------------------------------------
# one call per op: fn(state, out) runs the op on that pool; `named` the slots it may write


def decode_case(gen, dtype):
    rows = 5
    q, k, v, g, beta = rnd(gen, rows, H, K), rnd(gen, rows, H, K), rnd(gen, rows, HV, V), rnd(gen, rows, HV, K), \
        rnd(gen, rows, HV)
    A, dt = rnd(gen, HV), rnd(gen, HV * K, scale=0.5)
    idx = torch.tensor([5, -1, 0, 2, 3], dtype=torch.int32)      # 0: null slot (null_slot0)

    def fn(state, out):
        return flashkda_ext.kda_decode(q, k, v, g, beta, state=state, state_indices=idx, A_log=A, dt_bias=dt,
                                       slot_mode="padded", null_slot0=True, out=out)
    return fn, (HV, V, K), (rows, HV, V), {5, 2, 3}


def decode_repeated_case(gen, dtype):
    rows = 4
    q, k, v, g, beta = rnd(gen, rows, H, K), rnd(gen, rows, H, K), rnd(gen, rows, HV, V), rnd(gen, rows, HV, K), \
        rnd(gen, rows, HV)
    idx = torch.tensor([4, 1, 4, 4], dtype=torch.int32)

    def fn(state, out):
        return flashkda_ext.kda_decode(q, k, v, -g.abs(), beta, state=state, state_indices=idx, gate="log",
                                       slot_mode="repeated", out=out)
    return fn, (HV, V, K), (rows, HV, V), {4, 1}


def verify_case(gen, dtype, cols=3):
    cu = torch.tensor([0, 2, 3, 6] if cols > 1 else [0, 1, 2, 3], dtype=torch.int32)
    T = int(cu[-1])
    q, k, v, g, beta = rnd(gen, 1, T, H, K), rnd(gen, 1, T, H, K), rnd(gen, 1, T, HV, V), rnd(gen, 1, T, HV, K), \
        rnd(gen, 1, T, HV)
    if cols > 1:
        idx = torch.tensor([[1, 4, -1], [-1, 6, 6], [3, -1, 5]], dtype=torch.int32)   # request 1: padding
        acc = torch.tensor([2, 1, 1], dtype=torch.int32)
        named = {1, 4, 3, 5}
    else:
        idx, acc, named = torch.tensor([[6], [-1], [2]], dtype=torch.int32), None, {6, 2}

    def fn(state, out):
        return flashkda_ext.kda_verify(q, k, v, g, beta, state=state, state_indices=idx, cu_seqlens=cu,
                                       num_accepted_tokens=acc, A_log=rnd(torch.Generator().manual_seed(1), HV),
                                       dt_bias=rnd(torch.Generator().manual_seed(2), HV * K), out=out)
    return fn, (HV, V, K), (1, T, HV, V), named


def fused_args(gen, lead):
    C = 3 * H * D
    return dict(x=rnd(gen, *lead, C), conv_weight=rnd(gen, C, 4, scale=0.5), g=rnd(gen, *lead, H, D),
                beta=rnd(gen, *lead, H), A_log=rnd(gen, H), dt_bias=rnd(gen, H * D, scale=0.5),
                output_gate=rnd(gen, *lead, H, D), norm_weight=1 + rnd(gen, D, scale=0.2))


def fused_decode_case(gen, dtype):
    rows = 4
    a = fused_args(gen, (rows,))
    conv = rnd(gen, SLOTS, 3 * H * D, 3)
    idx = torch.tensor([6, -1, 2, 0], dtype=torch.int32)

    def fn(state, out):
        return flashkda_ext.fused_kda_decode(a["x"], a["conv_weight"], conv.clone(), a["g"], a["beta"], a["A_log"],
                                             a["dt_bias"], idx, state, a["output_gate"], a["norm_weight"],
                                             slot_mode="padded", out=out)
    return fn, (H, D, D), (rows, H, D), {6, 2, 0}


def fused_verify_case(gen, dtype):
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    a = fused_args(gen, (1, 4))
    conv = rnd(gen, SLOTS, 3 * H * D, 5)
    idx = torch.tensor([[5, 1, 3], [2, -1, -1]], dtype=torch.int32)
    acc = torch.tensor([2, 1], dtype=torch.int32)

    def fn(state, out):
        return flashkda_ext.fused_kda_verify(a["x"], a["conv_weight"], conv.clone(), a["g"], a["beta"], a["A_log"],
                                             a["dt_bias"], state, a["output_gate"], a["norm_weight"],
                                             state_indices=idx, cu_seqlens=cu, num_accepted_tokens=acc, out=out)
    return fn, (H, D, D), (1, 4, H, D), {5, 1, 3, 2}


def prefill_case(gen, dtype, commit=True):
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)       # an empty sequence in the middle
    T = 12
    q, k, v, g, beta = rnd(gen, 1, T, H, K), rnd(gen, 1, T, H, K), rnd(gen, 1, T, HV, V), rnd(gen, 1, T, HV, K), \
        rnd(gen, 1, T, HV)
    idx = torch.tensor([3, 6, -1], dtype=torch.int32)

    def fn(state, out):
        return flashkda_ext.kda_prefill(q, k, v, g, beta, A_log=rnd(torch.Generator().manual_seed(3), HV),
                                        dt_bias=rnd(torch.Generator().manual_seed(4), HV * K), cu_seqlens=cu,
                                        state=state, state_indices=idx, output_final_state=commit,
                                        checkpoint_every=4, out=out)
    return fn, (HV, V, K), (1, T, HV, V), {3, 6} if commit else set()


CASES = {
    "decode": decode_case,
    "decode-repeated": decode_repeated_case,
    "verify": verify_case,
    "verify-tmax1": lambda gen, dtype: verify_case(gen, dtype, cols=1),
    "fused_decode": fused_decode_case,
    "fused_verify": fused_verify_case,
    "prefill": prefill_case,
    "prefill-read-only": lambda gen, dtype: prefill_case(gen, dtype, commit=False),
}


def _run(fn, state, out_shape):
    out = torch.full(out_shape, float("nan"))            # poisoned: every element must be written
    res = fn(state, out)
    outs = res if isinstance(res, tuple) else (res,)
    assert outs[0] is out
    assert not torch.isnan(out).any()
    return [t for t in outs if isinstance(t, torch.Tensor) and t is not state]


@pytest.mark.parametrize("dtype,lead,pad", [(torch.float32, 4, 12), (torch.float32, 0, 4),
                                            (torch.bfloat16, 8, 8), (torch.float64, 2, 6)],
                         ids=["f32", "f32-nolead", "bf16", "f64"])
@pytest.mark.parametrize("case", list(CASES))
def test_strided_pool_equals_the_dense_pool_bitwise(case, dtype, lead, pad):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{dtype}".encode()) % 1000)
    fn, inner, out_shape, named = CASES[case](gen, dtype)
    buf, pool = paged(SLOTS, inner, dtype, lead, pad, gen)
    assert not pool.is_contiguous() and pool.stride(0) * pool.element_size() % 16 == 0
    dense = pool.clone()
    buf0, dense0 = buf.clone(), dense.clone()
    got = _run(fn, pool, out_shape)
    want = _run(fn, dense, out_shape)
    for a, b in zip(got, want):
        assert torch.equal(bits(a), bits(b))
    assert torch.equal(bits(pool), bits(dense))                          # every slot as the dense call left it
    keep = outside(buf, pool)
    assert torch.equal(bits(buf[keep]), bits(buf0[keep]))                # leads and pads between slots
    others = [s for s in range(SLOTS) if s not in named]
    assert torch.equal(bits(pool[others]), bits(dense0[others]))          # slots no row names
    if named:
        assert not torch.equal(pool[sorted(named)], dense0[sorted(named)])


# ---------------------------------------------------------------------------------------------
# refusals: named `state`, the strides expected, nothing written


def bad_pools(inner, dtype, gen):
    """{what: (buffer, pool view, text of the refusal)} for pools outside the contract."""
    n = inner[0] * inner[1] * inner[2]
    size = torch.empty((), dtype=dtype).element_size()
    buf, unaligned = paged(SLOTS, inner, dtype, 0, 16 // size - 1, gen)       # a slot stride 1 element off
    swapped = torch.randn(SLOTS, inner[0], inner[2], inner[1], generator=gen).to(dtype)
    raw = torch.randn(SLOTS * n, generator=gen).to(dtype)
    heads = torch.randn(inner[0], SLOTS, inner[1], inner[2], generator=gen).to(dtype)
    return {"unaligned slot stride": (buf, unaligned, "multiple of 16 bytes"),
            "inner dims swapped": (swapped, swapped.transpose(2, 3), "dims 1-3 contiguous"),
            "overlapping slots": (raw, raw.as_strided((SLOTS, *inner), (n // 2, inner[1] * inner[2], inner[2], 1)),
                                  f"slot stride of {n} elements"),
            "heads apart": (heads, heads.transpose(0, 1), "dims 1-3 contiguous")}


@pytest.mark.parametrize("bad", ["unaligned slot stride", "inner dims swapped", "overlapping slots", "heads apart"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_pool_outside_the_contract_is_refused_and_nothing_is_written(case, bad):
    gen = torch.Generator().manual_seed(7)
    fn, inner, out_shape, _ = CASES[case](gen, torch.float32)
    base, pool, text = bad_pools(inner, torch.float32, gen)[bad]
    before = base.clone()
    out = torch.full(out_shape, float("nan"))
    with pytest.raises(ValueError, match=r"^state: expected a pool \[slots, HV, V, K\]") as e:
        fn(pool, out)
    assert text in str(e.value) and str(list(pool.stride())) in str(e.value)
    assert torch.equal(bits(base), bits(before)) and torch.isnan(out).all()


def test_the_error_names_the_strides_expected():
    pool = bad_pools((HV, V, K), torch.float32, torch.Generator().manual_seed(0))["unaligned slot stride"][1]
    with pytest.raises(ValueError) as e:
        validation._slot_stride("state", pool)
    assert str(e.value) == (f"state: expected a pool [slots, HV, V, K] with dims 1-3 contiguous (strides "
                            f"[{V * K}, {K}, 1]) and a slot stride of {E} elements, or more as a multiple of 16 "
                            f"bytes (4 elements of float32); got shape [{SLOTS}, {HV}, {V}, {K}] with strides "
                            f"[{E + 3}, {V * K}, {K}, 1]")


def test_a_dense_state_of_prefill_must_still_be_contiguous():
    gen = torch.Generator().manual_seed(8)
    q, k, v, g, beta = rnd(gen, 2, 3, H, K), rnd(gen, 2, 3, H, K), rnd(gen, 2, 3, HV, V), rnd(gen, 2, 3, HV, K), \
        rnd(gen, 2, 3, HV)
    _, h0 = paged(2, (HV, V, K), torch.float32, 4, 12, gen)
    with pytest.raises(ValueError, match="initial_state: expected a contiguous tensor"):
        flashkda_ext.kda_prefill(q, k, v, -g.abs(), beta, gate="log", initial_state=h0)


# ---------------------------------------------------------------------------------------------
# the fast path and the validation memo: a kept signature never serves a pool of other strides


@pytest.mark.parametrize("case", ["decode", "verify", "fused_decode", "fused_verify", "prefill"])
def test_fast_path_never_reuses_a_signature_across_pool_strides(case, monkeypatch):
    """Dense, then strided (same shape), then strided again (fast), then a strided pool outside the contract:
    each result as its own cold call's, and the last refused with the full check's error."""
    monkeypatch.setattr(fast_path, "ENABLED", True)
    ops.clear_call_caches()
    gen = torch.Generator().manual_seed(9)
    fn, inner, out_shape, _ = CASES[case](gen, torch.float32)
    buf, pool = paged(SLOTS, inner, torch.float32, 4, 12, gen)
    calls = []
    orig_put = fast_path.put

    def counting_put(*a, **kw):
        calls.append(a[0])
        return orig_put(*a, **kw)
    monkeypatch.setattr(fast_path, "put", counting_put)
    dense = pool.clone()
    host_offsets = case == "prefill"       # host cu_seqlens: every call takes the full path
    for _ in range(2):
        want = _run(fn, dense, out_shape)
        assert calls or host_offsets, "the dense call armed the fast path"
        got = _run(fn, pool, out_shape)         # same key, other strides: the full path, then re-armed
        for a, b in zip(got, want):
            assert torch.equal(bits(a), bits(b))
        assert torch.equal(bits(pool), bits(dense))
    armed = len(calls)
    got = _run(fn, pool, out_shape)             # a repeat of the strided call: served by the kept signature
    assert len(calls) == armed or host_offsets
    want = _run(fn, dense, out_shape)
    for a, b in zip(got, want):
        assert torch.equal(bits(a), bits(b))
    assert torch.equal(bits(pool), bits(dense))
    buf, bad, _ = bad_pools(inner, torch.float32, gen)["unaligned slot stride"]
    bad.copy_(pool)
    buf0 = buf.clone()
    with pytest.raises(ValueError, match=r"^state: expected a pool .* multiple of 16 bytes"):
        _run(fn, bad, out_shape)
    assert torch.equal(bits(buf), bits(buf0))


def test_the_validation_memo_keys_pool_strides():
    """Two strided pools that differ only in their slot stride share shape, dtype and (non-)contiguity: the
    memo must not hand the aligned one's verdict to the unaligned one."""
    gen = torch.Generator().manual_seed(10)
    fn, _, out_shape, _ = decode_case(gen, torch.float32)
    _, good = paged(SLOTS, (HV, V, K), torch.float32, 0, 4, gen)
    _, bad = paged(SLOTS, (HV, V, K), torch.float32, 0, 3, gen)
    with fast_path_off():
        _run(fn, good, out_shape)
        with pytest.raises(ValueError, match=r"^state: expected a pool"):   # the Python check, not the binding's
            _run(fn, bad, out_shape)


class fast_path_off:
    def __enter__(self):
        self.was, fast_path.ENABLED = fast_path.ENABLED, False

    def __exit__(self, *exc):
        fast_path.ENABLED = self.was


# ---------------------------------------------------------------------------------------------
# the offset width follows the pool's span (CUDA route metadata, on meta tensors: no memory needed)


def _meta(shape, stride, dtype=torch.bfloat16):
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


@pytest.mark.parametrize("slot_stride,offset", [(128 * 128, "o32"), (2**31 - 128 * 128 - 8, "o32"),
                                                (2**31 - 128 * 128, "o64")])
def test_the_offset_width_follows_the_span(slot_stride, offset):
    """Two slots of one head: 2 * 16384 elements, far from 2^31, but a slot stride near 2^31 puts the second
    slot's last element past int32: its span (not its numel) picks the 64-bit-offset modules."""
    rows, HVc = 2, 1
    q = _meta((rows, 1, 128), (128, 128, 1))
    v = _meta((rows, HVc, 128), (128, 128, 1))
    beta = _meta((rows, HVc), (HVc, 1))
    state = _meta((2, HVc, 128, 128), (slot_stride, 128 * 128, 128, 1), torch.float32)
    idx = _meta((rows,), (1,), torch.int32)
    check = validation.check_kda_decode.__wrapped__
    call = check(q, q, v, v, beta, state=state, state_indices=idx, gate="log", backend="cuda")
    assert call.route_meta()["offset"] == offset
    x = torch.empty_strided((1, 3, 1, 128), (384, 128, 128, 1), dtype=torch.bfloat16, device="meta")
    vx = torch.empty_strided((1, 3, 1, 128), (384, 128, 128, 1), dtype=torch.bfloat16, device="meta")
    cu = _meta((3,), (1,), torch.int32)
    pre = validation.check_kda_prefill.__wrapped__(
        x, x, vx, vx, _meta((1, 3, 1), (3, 1, 1)), gate="log", cu_seqlens=cu, state=state,
        state_indices=_meta((2,), (1,), torch.int32), backend="cuda")
    assert pre.route_meta()["offset"] == offset
    ver = validation.check_kda_verify.__wrapped__(
        x, x, vx, vx, _meta((1, 3, 1), (3, 1, 1)), state=state, state_indices=_meta((2, 2), (2, 1), torch.int32),
        cu_seqlens=cu, gate="log", backend="cuda")
    assert ver.route_meta()["offset"] == offset


# ---------------------------------------------------------------------------------------------
# torch.compile: the custom ops take the strided pool as they take a dense one (mutates_args=state)


def test_compiled_decode_on_a_strided_pool_equals_eager():
    gen = torch.Generator().manual_seed(12)
    fn, inner, out_shape, _ = decode_case(gen, torch.float32)
    buf, pool = paged(SLOTS, inner, torch.float32, 4, 12, gen)
    buf_c = buf.clone()
    pool_c = buf_c[:, 4:4 + E].view(SLOTS, *inner)
    want = _run(fn, pool, out_shape)[0]
    compiled = torch.compile(lambda s: fn(s, None), fullgraph=True, backend="aot_eager")
    got = compiled(pool_c)
    assert torch.equal(bits(got), bits(want)) and torch.equal(bits(buf_c), bits(buf))
    _, bad = paged(SLOTS, inner, torch.float32, 0, 3, gen)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="multiple of 16 bytes"):
        torch.compile(lambda s: fn(s, None), fullgraph=True, backend="aot_eager")(bad)
    assert custom_ops is not None
