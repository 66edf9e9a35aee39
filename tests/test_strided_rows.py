"""kda_decode and kda_verify read row-strided q, k, v, g, beta (docs/api.md, "Layouts"): views whose rows (decode)
or tokens (verify) sit any stride apart, each row's inner [heads, dim] block dense, as engines hand over their
packed projections. On the CPU backend such a call gives bitwise the dense call's results, cold and warm (fast
path); a layout the kernels cannot read is refused naming the argument, by the Python check and by the binding.
"""
import math

import pytest
import torch

import flashkda_ext as fk
from flashkda_ext import jit, validation
from flashkda_ext.ops import clear_call_caches

H, HV, K, V = 2, 4, 8, 16
SLOTS = 9


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int64 if t.element_size() == 8 else torch.int32)


def packed(rows, gen, dtype, gb_dtype, pad=3):
    """q, k, v as column blocks of one [rows, 2HK + HV*V + pad] buffer; g and beta column slices of one
    projection [rows, HV*K + HV + pad] (the layouts vLLM and SGLang hand over)."""
    buf = torch.randn(rows, 2 * H * K + HV * V + pad, generator=gen).to(dtype)
    q = buf[:, :H * K].view(rows, H, K)
    k = buf[:, H * K:2 * H * K].view(rows, H, K)
    v = buf[:, 2 * H * K:2 * H * K + HV * V].view(rows, HV, V)
    proj = torch.randn(rows, HV * K + HV + pad, generator=gen).to(gb_dtype)
    g, beta = proj[:, :HV * K].view(rows, HV, K), proj[:, HV * K:HV * K + HV]
    return q, k, v, g, beta


def gate_args(gen, gate):
    if gate == "bounded":
        return dict(gate="bounded", lower_bound=-5.0, A_log=torch.randn(HV, generator=gen) * 0.3)
    return dict(gate="softplus", A_log=torch.randn(HV, generator=gen) * 0.3,
                dt_bias=torch.randn(HV * K, generator=gen) * 0.5)


def assert_strided_is_dense(views, pool, call):
    """call(inputs, pool copy) -> out on the dense copies of views, then on the views cold and warm (fast path):
    the same output and pool bitwise, the pool written, the output dense."""
    clear_call_caches()
    results = []
    for inputs in (tuple(x.contiguous() for x in views), views, views):   # dense; strided cold; strided warm
        p = pool.clone()
        results.append((call(inputs, p), p))
    (o0, p0), *rest = results
    assert not torch.equal(bits(p0), bits(pool))
    for o, p in rest:
        assert o.is_contiguous()
        assert torch.equal(bits(o), bits(o0)) and torch.equal(bits(p), bits(p0))


CASES = [(torch.float32, torch.float32, torch.float32, "softplus"),
         (torch.bfloat16, torch.float32, torch.bfloat16, "bounded"),
         (torch.bfloat16, torch.bfloat16, torch.float32, "softplus")]


@pytest.mark.parametrize("dtype, gb_dtype, state_dtype, gate", CASES)
def test_decode_of_row_strided_views_is_bitwise_the_dense_call(dtype, gb_dtype, state_dtype, gate):
    gen = torch.Generator().manual_seed(7)
    rows = 6
    views = packed(rows, gen, dtype, gb_dtype)
    assert not any(x.is_contiguous() for x in views)
    pool = (torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3).to(state_dtype)
    idx = torch.tensor([4, -1, 0, 8, 2, 6], dtype=torch.int32)
    kw = gate_args(gen, gate)
    assert_strided_is_dense(views, pool,
                            lambda inputs, p: fk.kda_decode(*inputs, state=p, state_indices=idx, slot_mode="padded",
                                                            **kw))


@pytest.mark.parametrize("dtype, gb_dtype, state_dtype, gate", CASES)
@pytest.mark.parametrize("cols", [1, 3], ids=["as_decode", "verify"])
def test_verify_of_row_strided_views_is_bitwise_the_dense_call(dtype, gb_dtype, state_dtype, gate, cols):
    gen = torch.Generator().manual_seed(11)
    lens = [1, 1, 1] if cols == 1 else [3, 0, 2]
    T = sum(lens)
    views = tuple(x.unsqueeze(0) for x in packed(T, gen, dtype, gb_dtype))
    pool = (torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3).to(state_dtype)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 0]], dtype=torch.int32)[:, :cols].contiguous()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    nat = None if cols == 1 else torch.tensor([2, 1, 3], dtype=torch.int32)
    kw = gate_args(gen, gate)
    assert_strided_is_dense(views, pool,
                            lambda inputs, p: fk.kda_verify(*inputs, state=p, state_indices=idx, cu_seqlens=cu,
                                                            num_accepted_tokens=nat, **kw))


def test_fast_path_keeps_dense_and_strided_calls_apart():
    """One key, two layouts: calls alternating between them each match their own dense result (the
    signature holds the strides, so a strided call never takes a dense call's entry or the reverse)."""
    gen = torch.Generator().manual_seed(5)
    views = packed(4, gen, torch.float32, torch.float32)
    dense = tuple(x.contiguous() for x in views)
    pool = torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3
    idx = torch.tensor([3, 1, 7, 5], dtype=torch.int32)
    kw = gate_args(gen, "softplus")
    clear_call_caches()
    want = fk.kda_decode(*dense, state=pool.clone(), state_indices=idx, **kw)
    for inputs in (views, dense, views, dense):
        assert torch.equal(fk.kda_decode(*inputs, state=pool.clone(), state_indices=idx, **kw), want)


# ---------------------------------------------------------------------------------------------
# refusals: the Python check (CPU, and CUDA's rules on meta stand-ins) and the binding


def decode_args(rows=4, dtype=torch.bfloat16, device="cpu"):
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = (x.to(device) for x in packed(rows, gen, dtype, dtype))
    return dict(q=q, k=k, v=v, g=g, beta=beta, state=torch.zeros(SLOTS, HV, V, K, device=device),
                state_indices=torch.arange(rows, dtype=torch.int32, device=device),
                A_log=torch.zeros(HV, device=device), dt_bias=torch.zeros(HV * K, device=device))


def _check(a, backend=None):
    a = dict(a)
    return validation.check_kda_decode.__wrapped__(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"),
                                                   backend=backend, **a)


def overlapping_rows(x):
    """x with its rows closer than one row apart (each row still dense inside)."""
    inner = math.prod(x.shape[1:])
    return x.as_strided(x.shape, (inner - 1, *x.stride()[1:]))


def heads_apart(x):
    """x with its heads not side by side: [rows, n, d] whose dim n has stride 2d."""
    wide = torch.zeros(x.shape[0], x.shape[1], 2 * x.shape[2], dtype=x.dtype, device=x.device)
    return wide[..., :x.shape[2]]


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("make", [overlapping_rows, heads_apart], ids=["rows_overlap", "inner_not_dense"])
def test_a_layout_the_kernels_cannot_read_is_refused_naming_it(name, make):
    a = decode_args()
    if make is heads_apart and name == "beta":
        a["beta"] = torch.zeros(4, HV, 2, dtype=a["beta"].dtype)[..., 0]     # heads apart
    else:
        a[name] = make(a[name])
    with pytest.raises(ValueError, match=rf"^{name}: expected .*inner dims contiguous.*strides"):
        _check(a)
    pool = a["state"].clone()
    with pytest.raises(ValueError, match=rf"^{name}: "):
        fk.kda_decode(**a)
    assert torch.equal(a["state"], pool)


@pytest.mark.parametrize("name", ["q", "k", "v", "g"])
def test_cuda_refuses_rows_not_16_bytes_apart_and_the_cpu_takes_them(name):
    """Rows 2 elements of bf16 off a 16-byte multiple: the CUDA kernels' 16-byte row loads cannot read them
    (checked on meta stand-ins of the CUDA shapes, which carry strides, no address); the CPU backend reads them.
    beta is read element by element: any row stride on CUDA too."""
    a = decode_args()
    wide = torch.zeros(4, a[name][0].numel() + 2, dtype=torch.bfloat16)
    a[name] = wide[:, :a[name][0].numel()].view(a[name].shape).copy_(a[name])
    _check(a)                                                   # cpu: served
    Kc = Vc = 128
    inner = {"q": (H, Kc), "k": (H, Kc), "v": (HV, Vc), "g": (HV, Kc)}
    meta = {n: torch.empty(4, *s, dtype=torch.bfloat16, device="meta") for n, s in inner.items()}
    meta.update(beta=torch.empty(4, HV + 1, dtype=torch.bfloat16, device="meta")[:, :HV],
                state=torch.empty(SLOTS, HV, Vc, Kc, device="meta"),
                state_indices=torch.empty(4, dtype=torch.int32, device="meta"),
                A_log=torch.empty(HV, device="meta"), dt_bias=torch.empty(HV * Kc, device="meta"))
    _check(meta, backend="cuda")
    n = math.prod(inner[name])
    meta[name] = torch.empty(4, n + 2, dtype=torch.bfloat16, device="meta")[:, :n].view(4, *inner[name])
    with pytest.raises(ValueError, match=rf"^{name}: expected a row stride that is a multiple of 16 bytes"):
        _check(meta, backend="cuda")
    meta[name] = torch.empty(4, n + 8, dtype=torch.bfloat16, device="meta")[:, :n].view(4, *inner[name])
    _check(meta, backend="cuda")                                # 16 bytes more: served


def test_verify_checks_the_token_dim():
    """kda_verify's rows are its tokens (dim 1 of [1, T, n, d]); dim 0 of size 1 may carry any stride."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = (x.unsqueeze(0) for x in packed(4, gen, torch.float32, torch.float32))
    kw = dict(state=torch.zeros(SLOTS, HV, V, K), state_indices=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
              cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32), A_log=torch.zeros(HV),
              dt_bias=torch.zeros(HV * K))
    validation.check_kda_verify.__wrapped__(q, k, v, g, beta, **kw)
    with pytest.raises(ValueError, match=r"^v: expected \[1, T, HV, V\] with its inner dims contiguous"):
        validation.check_kda_verify.__wrapped__(q, k, v.transpose(2, 3).contiguous().transpose(2, 3), g, beta, **kw)
    # a batch of 2 (dim 0 > 1): contiguous as before, then refused as no packed layout
    two = [torch.zeros(2, 2, *x.shape[2:]) for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match=r"^q: expected the packed layout"):
        validation.check_kda_verify.__wrapped__(*two, **kw)
    two[0] = torch.zeros(2, 3, H, K)[:, :2]
    with pytest.raises(ValueError, match=r"^q: expected a contiguous tensor"):
        validation.check_kda_verify.__wrapped__(*two, **kw)


def test_the_cpu_bindings_refuse_overlapping_rows_on_their_own():
    """Straight through TVM-FFI (no Python check in front): the bindings' rule (csrc/common/row_stride.h)."""
    a = decode_args(dtype=torch.float32)
    out = torch.full((4, HV, V), math.nan)
    args = [a["q"], overlapping_rows(a["k"]), a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"],
            a["state_indices"], out, 0, 0.0, K ** -0.5, True, False]
    with pytest.raises(ValueError, match=r"'k' must have its inner dims contiguous.*strides"):
        jit.load_module("cpu_kda_decode")["kda_decode"](*args)
    assert out.isnan().all()
    args[1] = a["k"]                     # row-strided views of the packed buffers: read as they are
    jit.load_module("cpu_kda_decode")["kda_decode"](*args)
    assert not out.isnan().any()
    vq = [x.unsqueeze(0) for x in (a["q"], a["k"], a["v"], a["g"], a["beta"])]
    vq[4] = overlapping_rows(a["beta"]).unsqueeze(0)
    vout = torch.full((1, 4, HV, V), math.nan)
    with pytest.raises(ValueError, match=r"'beta' must have its inner dims contiguous"):
        jit.load_module("cpu_kda_verify")["kda_verify"](
            *vq, a["A_log"], a["dt_bias"], a["state"], torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
            torch.tensor([0, 2, 4], dtype=torch.int32), None, None, None, None, vout, 0, 0.0, K ** -0.5, True,
            False)
    assert vout.isnan().all()


def test_a_strided_view_traces_and_fakes():
    """Under FakeTensorMode (what torch.compile traces with) a row-strided view takes the custom op, whose fake
    runs the same checks on its strides: accepted, and a layout the kernels cannot read refused at trace time."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    a = decode_args(dtype=torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fa = {n: mode.from_tensor(x) for n, x in a.items()}
        out = fk.kda_decode(**fa)
        assert tuple(out.shape) == (4, HV, V) and out.is_contiguous()
        fa["g"] = mode.from_tensor(heads_apart(a["g"]))
        with pytest.raises(ValueError, match=r"^g: expected .*inner dims contiguous"):
            fk.kda_decode(**fa)


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_fla_fused_recurrent_serves_row_strided_views_bitwise_as_dense(kind, monkeypatch):
    """fla's fused_recurrent_kda_fwd (vLLM's decode / spec call) with q, k, v views of one packed buffer and g,
    beta slices of a projection: accepted by the verifier and served without a copy, bitwise the dense call."""
    from flashkda_ext.integrations import fla as fkda_fla
    gen = torch.Generator().manual_seed(13)
    T = 4
    views = tuple(x.unsqueeze(0) for x in packed(T, gen, torch.float32, torch.float32))
    views[3].copy_(-torch.rand(1, T, HV, K, generator=gen))      # g: fla's log decay (<= 0), in the projection
    pool = torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3
    if kind == "decode":
        extra = dict(cu_seqlens=torch.arange(T + 1, dtype=torch.int32),
                     ssm_state_indices=torch.tensor([4, -1, 1, 7], dtype=torch.int32))
    else:
        extra = dict(cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32),
                     ssm_state_indices=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
                     num_accepted_tokens=torch.tensor([2, 1], dtype=torch.int32))
    import flashkda_ext.ops as ops
    seen = []
    for name in ("kda_decode", "kda_verify"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, **kw: seen.append(a[0].data_ptr()) or _real(*a, **kw))
    results = []
    for inputs in (tuple(x.contiguous() for x in views), views):
        p = pool.clone()
        call = dict(zip(("q", "k", "v", "g", "beta"), inputs), initial_state=p, inplace_final_state=True,
                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, **extra)
        assert fkda_fla.fused_recurrent_kda_fwd_verifier(**call) == (True, None)
        o, _ = fkda_fla.serve_fused_recurrent_kda_fwd(**call)
        results.append((o, p))
    (o0, p0), (o1, p1) = results
    assert seen[-1] == views[0].data_ptr()          # the caller's q reached the op (no copy)
    assert not torch.equal(p0, pool)
    assert torch.equal(o1, o0) and torch.equal(p1, p0)


def _rows_as_read_by_definition(x, row_dim, vector):
    """docs/api.md's rule, written out plainly: dims before row_dim of size 1 (else x must be contiguous), the dims
    after it row-major dense (size-1 dims may carry any stride), rows >= one row's elements apart; off the CPU,
    vector rows 16 bytes apart (a meta tensor stands in for the device, without an address)."""
    if any(n != 1 for n in x.shape[:row_dim]):
        return x.is_contiguous()
    inner = x.shape[row_dim + 1:]
    dense = [math.prod(inner[i + 1:]) for i in range(len(inner))]
    if any(n > 1 and s != d for n, s, d in zip(inner, x.stride()[row_dim + 1:], dense)):
        return False
    if x.shape[row_dim] > 1 and x.stride(row_dim) < math.prod(inner):
        return False
    if x.device.type == "cpu":
        return True
    return not (vector and x.shape[row_dim] > 1 and x.stride(row_dim) * x.element_size() % 16)


def test_rows_as_read_is_the_documented_rule_on_random_layouts():
    """The adapters ask rows_as_read of every engine view on every decode step (written for speed: indexing,
    no slices of torch.Size): it must give the rule's answer on any layout, CPU and device (meta)."""
    gen = torch.Generator().manual_seed(11)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=gen))]  # noqa: E731
    seen = set()
    for _ in range(600):
        ndim, row_dim = pick([2, 3, 4]), pick([0, 1])
        shape = [pick([1, 1, 2, 3, 4]) for _ in range(ndim)]
        dense = [math.prod(shape[i + 1:]) for i in range(ndim)]
        stride = [d if int(torch.randint(3, (1,), generator=gen)) else pick([1, 2, 5, 8, 16, 24, 40]) for d in dense]
        for device in ("cpu", "meta"):
            base = torch.empty(4096, dtype=torch.bfloat16, device=device)
            x = base.as_strided(shape, stride)
            for vector in (True, False):
                want = _rows_as_read_by_definition(x, row_dim, vector)
                assert validation.rows_as_read(x, row_dim, vector=vector) is want, (shape, stride, row_dim, device)
                seen.add(want)
    assert seen == {True, False}
