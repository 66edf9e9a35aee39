"""The SGLang adapter's own device work around the kernels, pinned per call, and its results bitwise.

On an H200 the adapter's target_verify cost 4x SGLang's Triton kernel: besides kda_verify it ran 32 tensor
ops, five of them passes over N states (two gathers, two torch.where, an index_copy_ of the start states),
and packed_decode (decode, extend) copied q, k and v out of mixed_qkv in three kernels. Each op is a launch in a
CUDA graph, each N-state pass costs as much memory traffic as the verify kernel's own start-state read.

GPU proxy: the calls run on meta tensors (shapes and dtypes, no memory), with validation told the device is
a GPU (so no host value is read, as on CUDA) and the kernels replaced by recorders; a TorchDispatchMode
counts every non-view op with a device output and the bytes it writes. A change that adds an op, or a
copy proportional to the pool or the buffer, fails here; one that removes an op updates the pinned count.
"""
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashkda_ext import ops, validation
from flashkda_ext.integrations.sglang import FlashKDAExtKernel
from flashkda_ext.integrations.sglang.dense import dense_qkv
from flashkda_ext.validation import common

_ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}   # no kernel


class _DeviceOps(TorchDispatchMode):
    """(op name, bytes written) of every op that launches device work."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        name = func.overloadpacket.__name__
        if func.is_view or name in _ALLOC or not any(
                isinstance(o, torch.Tensor) and o.device.type != "cpu" for o in outs):
            return out
        if func is torch.ops.aten.index_put_.default:     # writes its values, not all of self
            written = args[2].numel() * args[2].element_size()
        else:
            written = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
        self.ops.append((name, written))
        return out


@pytest.fixture
def gpu_proxy(monkeypatch):
    """Meta tensors validated as CUDA ones; kda_verify / kda_decode recorded, not run. Yields the records."""
    backend_of = common.backend_of
    monkeypatch.setattr(common, "backend_of", lambda d: "cuda" if d.type == "meta" else backend_of(d))
    # meta tensors have no addresses (every pair would overlap); the overlap rule is tested on real tensors
    monkeypatch.setattr(validation, "check_apart", lambda *a, **k: None)
    calls = []

    def recorder(name):
        def kernel(q, k, v, g, beta, **kw):
            calls.append(dict(op=name, dense=all(x.is_contiguous() for x in (q, k, v, g, beta)), g=g.dtype,
                              beta=beta.dtype,
                              **({"initial": kw["initial_state"] is not None} if "initial_state" in kw else {})))
            return torch.empty_like(v) if kw.get("out") is None else kw["out"]
        return kernel
    monkeypatch.setattr(ops, "kda_verify", recorder("kda_verify"))
    monkeypatch.setattr(ops, "kda_decode", recorder("kda_decode"))
    prefill = recorder("kda_prefill")
    monkeypatch.setattr(ops, "kda_prefill", lambda *a, **kw: (prefill(*a, **kw), None))
    return calls


def _counted(fn):
    mode = _DeviceOps()
    with mode:
        fn()
    return mode.ops


HB, KB, VB = 8, 128, 128     # Kimi-Linear's head dims; meta tensors cost nothing at any size


def _packed_views(T, H, HV, dtype=torch.bfloat16, pad=0):
    """q, k, v as SGLang makes them: views into one [T, 2*H*K + HV*V] projection, as [1, T, heads, dim]. pad > 0:
    the projection a column slice of a [T, 2*H*K + HV*V + pad] buffer (its rows that far apart)."""
    mixed = torch.empty(T, 2 * H * KB + HV * VB + pad, device="meta", dtype=dtype)[:, :2 * H * KB + HV * VB]
    q, k, v = mixed.split([H * KB, H * KB, HV * VB], dim=-1)
    return mixed, tuple(x.unflatten(-1, (-1, d)).unsqueeze(0) for x, d in ((q, KB), (k, KB), (v, VB)))


# the adapter's device ops per target_verify call, besides kda_verify: none (kda_verify reads the start
# states from ssm_states itself, initial_state, and writes the buffer as step rows, state_indices = SGLang's
# rows), and none for q / k / v as views into mixed_qkv (kda_verify reads those rows; one copy where their
# rows are not 16-byte aligned). Before kda_verify took initial_state and step
# rows: 20 (a live-request mask, the [N, S] slot table, a copy of the start states into the buffer).
VERIFY_OPS = []


@pytest.mark.parametrize("N", [1, 64, 1024])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", ["dense", "views", "unaligned"],
                         ids=["dense_qkv", "mixed_qkv_views", "mixed_qkv_unaligned_rows"])
def test_target_verify_device_ops_and_bytes(gpu_proxy, N, state_dtype, packed):
    D, P, R = 3, 4 * N + 8, 2 * N + 1     # pool and buffer larger than N states: a pool-sized copy shows
    T = N * D
    if packed == "dense":
        q, k, v = (torch.empty(1, T, HB, d, device="meta", dtype=torch.bfloat16) for d in (KB, KB, VB))
        a = torch.empty(T, HB * KB, device="meta", dtype=torch.bfloat16)
        b = torch.empty(T, HB, device="meta", dtype=torch.bfloat16)
    else:   # a and b column slices of one projection, as SGLang's fused projection gives them
        _, (q, k, v) = _packed_views(T, HB, HB, pad=1 if packed == "unaligned" else 0)
        proj = torch.empty(T, HB * KB + HB + 8, device="meta", dtype=torch.bfloat16)
        a, b = proj[:, :HB * KB], proj[:, HB * KB:HB * KB + HB]
    copied = packed == "unaligned"
    A_log, dt_bias = torch.empty(1, 1, HB, 1, device="meta"), torch.empty(HB * KB, device="meta")
    pool = torch.empty(P, HB, VB, KB, device="meta", dtype=state_dtype)
    buf = torch.empty(R, D, HB, VB, KB, device="meta", dtype=state_dtype)
    ints = lambda *s: torch.empty(*s, device="meta", dtype=torch.int32)  # noqa: E731
    seen = _counted(lambda: FlashKDAExtKernel().target_verify(
        A_log, dt_bias, q, k, v, a, b, ssm_states=pool, cache_indices=ints(N), query_start_loc=ints(N + 1),
        intermediate_states_buffer=buf, intermediate_state_indices=ints(R), cache_steps=D,
        retrieve_parent_token=None))
    names = [n for n, _ in seen]
    assert names == VERIFY_OPS + (["clone"] if copied else []), names
    assert gpu_proxy == [dict(op="kda_verify", dense=packed == "dense", g=torch.bfloat16, beta=torch.bfloat16,
                              initial=True)]
    # no state is copied; the q / k / v copy, where there is one (rows kda_verify cannot read), writes exactly
    # q, k and v once
    assert [w for n, w in seen if n == "clone"] == ([T * HB * (2 * KB + VB) * 2] if copied else [])


@pytest.mark.parametrize("HV, copies", [(HB, 1), (2 * HB, 2)], ids=["H_eq_HV", "GVA"])
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("pad", [0, 1], ids=["aligned_rows", "unaligned_rows"])
def test_packed_decode_copies_q_k_v_only_where_kda_decode_cannot_read_them(gpu_proxy, HV, copies, rows, pad):
    mixed, _ = _packed_views(rows, HB, HV, pad=pad)
    a = torch.empty(rows, HV * KB, device="meta", dtype=torch.bfloat16)
    b = torch.empty(rows, HV, device="meta", dtype=torch.bfloat16)
    A_log, dt_bias = torch.empty(HV, device="meta"), torch.empty(HV * KB, device="meta")
    pool = torch.empty(4 * rows, HV, VB, KB, device="meta")
    idx = torch.empty(rows, device="meta", dtype=torch.int32)
    seen = _counted(lambda: FlashKDAExtKernel().packed_decode(
        mixed, a, b, A_log=A_log, dt_bias=dt_bias, scale=KB ** -0.5, ssm_states=pool, cache_indices=idx,
        num_v_heads=HV, head_v_dim=VB))
    # one row of mixed_qkv is q, k and v dense already; more rows are row-strided views kda_decode reads as
    # they are (were one or two copies), unless the rows are not 16 bytes apart: q | k in one copy, v with them
    # when as wide
    want = [] if rows == 1 or not pad else [("clone", rows * (2 * HB * KB + HV * VB) * 2)] if copies == 1 else [
        ("clone", rows * 2 * HB * KB * 2), ("clone", rows * HV * VB * 2)]
    assert seen == want
    assert gpu_proxy == [dict(op="kda_decode", dense=rows == 1 or bool(pad), g=torch.bfloat16, beta=torch.bfloat16)]


def test_decode_of_mixed_qkv_views_copies_nothing(gpu_proxy):
    T = 32
    _, (q, k, v) = _packed_views(T, HB, HB)
    proj = torch.empty(T, HB * KB + HB + 8, device="meta", dtype=torch.bfloat16)   # a, b: slices of one projection
    a, b = proj[:, :HB * KB], proj[:, HB * KB:HB * KB + HB].unsqueeze(0)
    A_log, dt_bias = torch.empty(HB, device="meta"), torch.empty(HB * KB, device="meta")
    pool = torch.empty(2 * T, HB, VB, KB, device="meta")
    ints = lambda *s: torch.empty(*s, device="meta", dtype=torch.int32)  # noqa: E731
    seen = _counted(lambda: FlashKDAExtKernel().decode(
        q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=ints(T),
        query_start_loc=ints(T + 1)))
    assert seen == []       # was one copy of q / k / v (and one each of a and b)
    assert gpu_proxy == [dict(op="kda_decode", dense=False, g=torch.bfloat16, beta=torch.bfloat16)]


def test_extend_of_mixed_qkv_views_copies_once(gpu_proxy):
    T = 256
    _, (q, k, v) = _packed_views(T, HB, HB)
    g = torch.empty(1, T, HB, KB, device="meta", dtype=torch.bfloat16)
    beta = torch.empty(1, T, HB, device="meta", dtype=torch.bfloat16)
    pool = torch.empty(8, HB, VB, KB, device="meta")
    ints = lambda *s: torch.empty(*s, device="meta", dtype=torch.int32)  # noqa: E731
    seen = _counted(lambda: FlashKDAExtKernel().extend(
        q, k, v, g, beta, ssm_states=pool, cache_indices=ints(2), query_start_loc=ints(3),
        A_log=torch.empty(HB, device="meta"), dt_bias=torch.empty(HB * KB, device="meta"),
        extend_seq_lens_cpu=[100, 156]))
    assert seen == [("clone", T * 3 * HB * KB * 2)]
    assert gpu_proxy == [dict(op="kda_prefill", dense=True, g=torch.bfloat16, beta=torch.bfloat16)]


# ---------------------------------------------------------------------------------------------
# results on the CPU backend, bitwise

H, K, V, SLOTS = 2, 8, 16, 6


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def mixed_views(T, gen, dtype, HV=H):
    mixed = torch.randn(T, 2 * H * K + HV * V, generator=gen).to(dtype)
    q, k, v = mixed.split([H * K, H * K, HV * V], dim=-1)
    return mixed, (q.unflatten(-1, (H, K)).unsqueeze(0), k.unflatten(-1, (H, K)).unsqueeze(0),
                   v.unflatten(-1, (HV, V)).unsqueeze(0))


def test_dense_qkv_copies_values_bitwise_and_leaves_dense_tensors_alone():
    gen = torch.Generator().manual_seed(1)
    for HV in (H, 2 * H):                     # v as wide as q, and wider (two copies)
        _, (q, k, v) = mixed_views(5, gen, torch.bfloat16, HV)
        dq, dk, dv = dense_qkv(q, k, v)
        for x, d in ((q, dq), (k, dk), (v, dv)):
            assert d.is_contiguous() and d.shape == x.shape and d.dtype == x.dtype
            assert torch.equal(bits(d), bits(x))
    q, k, v = (torch.randn(1, 4, H, d, generator=gen) for d in (K, K, V))
    assert all(a is b for a, b in zip(dense_qkv(q, k, v), (q, k, v)))
    # blocks of one buffer that are not side by side (q | v | k): each copied on its own, values unchanged
    mixed = torch.randn(4, 2 * H * K + H * V, generator=gen)
    q, v, k = mixed.split([H * K, H * V, H * K], dim=-1)
    q, k, v = q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (H, V))
    dq, dk, dv = dense_qkv(q, k, v)
    assert all(torch.equal(d, x) and d.is_contiguous() for d, x in ((dq, q), (dk, k), (dv, v)))
    # traced (FakeTensor, torch.compile): plain copies, no storage address read (FakeTensor warns on one)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("error")
        _, (q, k, v) = mixed_views(5, None, torch.float32)
        assert all(x.is_contiguous() for x in dense_qkv(q, k, v))


def verify_case(lens, steps, rows, cidx, seed, dtype, state_dtype, buf_rows=5, dims=(H, K, V), device="cpu"):
    heads, dk, dv = dims
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    mixed = torch.randn(T, heads * (2 * dk + dv), generator=gen).to(dtype)
    q, k, v = (x.unflatten(-1, (heads, d)).unsqueeze(0)
               for x, d in zip(mixed.to(device).split([heads * dk, heads * dk, heads * dv], dim=-1), (dk, dk, dv)))
    a, b = torch.randn(T, heads * dk, generator=gen), torch.randn(T, heads, generator=gen)
    A_log, dt_bias = torch.randn(1, 1, heads, 1, generator=gen) * 0.3, torch.randn(heads * dk, generator=gen) * 0.5
    pool = (torch.randn(SLOTS, heads, dv, dk, generator=gen) * 0.3).to(state_dtype)
    buf = torch.randn(buf_rows, steps, heads, dv, dk, generator=gen).to(state_dtype)
    buf[0, 0, 0, 0, :2] = float("nan")
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    case = dict(A_log=A_log, dt_bias=dt_bias, a=a, b=b, ssm_states=pool, cache_indices=torch.tensor(cidx,
                dtype=torch.int32), query_start_loc=qsl, intermediate_states_buffer=buf,
                intermediate_state_indices=torch.tensor(rows, dtype=torch.int32))
    return dict({n: x.to(device) for n, x in case.items()}, q=q, k=k, v=v)


def by_hand(c):
    """kda_verify on the buffer as a pool of R * S slots, each live request's start state put into step 0 of
    its row by hand; returns (out, buffer)."""
    buf = c["intermediate_states_buffer"].clone()
    R, S, heads, dv, dk = buf.shape
    flat = buf.view(R * S, heads, dv, dk)
    offsets = c["query_start_loc"].tolist()
    slots = torch.full((len(offsets) - 1, S), -1, dtype=torch.int32)
    for n, (slot, row) in enumerate(zip(c["cache_indices"].tolist(), c["intermediate_state_indices"].tolist())):
        if 0 <= slot < SLOTS and 0 <= row < R and offsets[n + 1] > offsets[n]:
            flat[row * S] = c["ssm_states"][slot]
            slots[n] = row * S + torch.arange(S, dtype=torch.int32)
    q = c["q"]
    # fp32 a / b as they are (kda_verify reads them natively), another dtype in q's
    a, b = (x if x.dtype == torch.float32 else x.to(q.dtype) for x in (c["a"], c["b"]))
    o = ops.kda_verify(q.contiguous(), c["k"].contiguous(), c["v"].contiguous(),
                       a.view(1, -1, heads, dk), b.view(1, -1, heads), state=flat,
                       state_indices=slots.to(q.device), cu_seqlens=c["query_start_loc"], max_seqlen=S,
                       A_log=c["A_log"].flatten(), dt_bias=c["dt_bias"], gate="softplus", beta_is_logit=True)
    return o, buf


def call_verify(c):
    c = dict(c)
    return FlashKDAExtKernel().target_verify(c.pop("A_log"), c.pop("dt_bias"), c.pop("q"), c.pop("k"), c.pop("v"),
                                             c.pop("a"), c.pop("b"), cache_steps=3, **c)


@pytest.mark.parametrize("lens, rows, cidx", [
    ([3, 3, 3], [3, 0, 1], [4, -1, 2]),          # a padding request (cache index -1) between live ones
    ([2, 3, 1], [4, -1, 1], [-1, 2, 0]),         # request 0 idle with a row, request 1 live without one
    ([3, 0, 2, 0], [1, 0, 4, 2], [2, 5, 0, 3]),  # empty requests with rows and slots (graph padding)
    ([3, 3], [0, 2], [-1, -1]),                  # every request idle: nothing may be written
    ([3, 2], [-1, 2], [1, -1]),                  # every request idle, request 0 without a row
])
@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
def test_target_verify_is_kda_verify_on_the_buffer_bitwise(lens, rows, cidx, dtype, state_dtype):
    case = verify_case(lens, 3, rows, cidx, seed=len(lens) * 10 + sum(rows), dtype=dtype, state_dtype=state_dtype)
    want_o, want_buf = by_hand(case)
    pool0 = case["ssm_states"].clone()
    o = call_verify(case)
    assert torch.equal(bits(o), bits(want_o))
    assert torch.equal(bits(case["intermediate_states_buffer"]), bits(want_buf))
    assert torch.equal(bits(case["ssm_states"]), bits(pool0))


@pytest.mark.parametrize("HV", [H, 2 * H])
def test_decode_and_packed_decode_of_mixed_qkv_views_are_bitwise_the_dense_call(HV):
    gen = torch.Generator().manual_seed(3)
    N = 4
    mixed, (q, k, v) = mixed_views(N, gen, torch.bfloat16, HV)
    a, b = torch.randn(N, HV * K, generator=gen), torch.randn(N, HV, generator=gen)
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.3, torch.randn(HV * K, generator=gen) * 0.5
    pool = torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    kern = FlashKDAExtKernel()
    results = []
    for qkv in ((q, k, v), tuple(x.contiguous() for x in (q, k, v))):
        p = pool.clone()
        o = kern.decode(*qkv, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=p, cache_indices=idx,
                        query_start_loc=torch.arange(N + 1, dtype=torch.int32))
        results.append((o, p))
    p = pool.clone()
    o = kern.packed_decode(mixed, a, b, A_log=A_log, dt_bias=dt_bias, scale=None, ssm_states=p, cache_indices=idx,
                           num_v_heads=HV, head_v_dim=V)
    results.append((o, p))
    (o0, p0), *rest = results
    for o, p in rest:
        assert torch.equal(bits(o), bits(o0)) and torch.equal(bits(p), bits(p0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cidx", [[4, -1, 2], [-1, -1, -1]], ids=["one_padding_request", "all_idle"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_target_verify_on_cuda_replays_in_a_cuda_graph_bitwise(cidx, state_dtype):
    """On a GPU: no host synchronisation (a CUDA graph captures the call), and a replay gives bitwise
    kda_verify on the hand-filled buffer, every other byte of the buffer and the pool unchanged."""
    case = verify_case([3, 3, 3], 3, [3, 0, 1], cidx, seed=31, dtype=torch.bfloat16, state_dtype=state_dtype,
                       dims=(4, 128, 128), device="cuda")
    buf, pool = case["intermediate_states_buffer"], case["ssm_states"]
    buf0, pool0 = buf.clone(), pool.clone()
    want_o, want_buf = by_hand(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up off the capture (validation, routes, fast path)
        call_verify(case)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = call_verify(case)
    buf.copy_(buf0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(o), bits(want_o))
    assert torch.equal(bits(buf), bits(want_buf)) and torch.equal(bits(pool), bits(pool0))
