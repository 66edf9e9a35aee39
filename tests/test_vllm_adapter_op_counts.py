"""The device ops one vLLM K3 adapter call issues around the flashkda_ext op, pinned.

Under a CUDA-graph replay each small kernel the adapter launches (a copy, a cast, a mask, a fill) costs 2-3 us,
as much as the decode kernel itself at small batches. No GPU here, so the proxy is the aten ops a call
dispatches outside the op (a TorchDispatchMode counter, paused inside kda_decode / kda_verify / kda_prefill),
less views and allocations, which launch nothing. Two devices:
- "cpu": the real op runs (the host-offset branches: cu_seqlens in host memory);
- "meta": the op is a stub that records its arguments, so the adapter takes its device branches (no host
  read of offsets) as on a GPU, with the shapes vLLM's layers pass (bf16 activations, beta a strided view of
  the projection, fp32 A_log / dt_bias, int32 indices).
A count that grows fails here; a count that shrinks should be lowered here with the change that cut it.
"""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashkda_ext.ops as ops
from flashkda_ext.integrations.vllm import k3

H, K = 2, 8                     # K = V: vLLM's recurrent state is [H, D, D]
OPS = ("kda_decode", "kda_verify", "kda_prefill")
# views and allocations launch no kernel; _local_scalar_dense is the host read of host-memory offsets (the CPU
# branch only: on a device it would be a sync, and the meta cases would raise)
NO_LAUNCH = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "as_strided", "unbind", "expand",
             "alias", "detach", "empty", "empty_strided", "empty_like", "split", "split_with_sizes", "t",
             "permute", "transpose", "_reshape_alias", "lift_fresh", "_local_scalar_dense"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _stub(name, args, kwargs):
    """What a meta call of the op returns (the op itself cannot run there)."""
    v = args[2]
    if name == "kda_prefill":
        final = torch.empty((kwargs["cu_seqlens"].shape[0] - 1, *kwargs["initial_state"].shape[1:]),
                            device=v.device) if kwargs["output_final_state"] else None
        return torch.empty_like(v), final
    return kwargs["out"] if kwargs.get("out") is not None else torch.empty_like(v)


@pytest.fixture
def launches(monkeypatch):
    """launches(serve, call) -> ({aten op: count} launched by the adapter, [(op name, args, kwargs)] it made)."""
    def run(serve, call):
        mode, made = _Count(), []

        def wrap(name, real):
            def op(*args, **kwargs):
                made.append((name, args, kwargs))
                mode.paused = True
                try:
                    return _stub(name, args, kwargs) if args[0].device.type == "meta" else real(*args, **kwargs)
                finally:
                    mode.paused = False
            return op

        for name in OPS:
            monkeypatch.setattr(ops, name, wrap(name, getattr(ops, name)))
        with torch.no_grad(), mode:
            serve(**call)
        assert made, "the adapter did not reach the op"
        return {n: c for n, c in mode.ops.items() if n not in NO_LAUNCH}, made
    return run


def _t(dev, dtype, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dev, dtype)


def _i32(values, dev):
    return torch.tensor(values, dtype=torch.int32).to(dev)


def decode(dev, B, out=False, pad=0):
    """The K3 layer's packed decode: post-conv [B, 3*H*K], g1 [1, B, H, K], beta a [1, B, H] view of the projection.
    pad > 0: mixed_qkv a column slice of a [B, 3*H*K + pad] buffer (rows that far apart)."""
    proj = _t(dev, torch.bfloat16, B, H + 8)
    mixed = _t(dev, torch.bfloat16, B, 3 * H * K + pad)[:, :3 * H * K]
    call = dict(mixed_qkv=mixed, raw_g=_t(dev, torch.bfloat16, 1, B, H, K),
                raw_beta=proj[:, :H].unsqueeze(0), A_log=_t(dev, torch.float32, H) * 0.5,
                dt_bias=_t(dev, torch.float32, H * K) * 0.5, lower_bound=-5.0,
                initial_state=_t(dev, torch.float32, B + 1, H, K, K) * 0.1, state_indices=_i32(range(1, B + 1), dev))
    if out:
        call["out"] = torch.empty(1, B, H, K, dtype=torch.bfloat16, device=dev)
    return call


def verify(dev, lengths, t_max, rows=None, tokens=None, out=False, dt_bias=True, accepted=True):
    """The layer's spec call: q/k/v row-strided views of the post-conv buffer, the table [rows, t_max] and counts
    padded to the CUDA-graph batch (rows >= N, null block, count 1), cu_seqlens of the N real requests, and
    `tokens` >= sum(lengths) tokens (the graph's padded token count)."""
    N, rows = len(lengths), rows or len(lengths)
    T = tokens or sum(lengths)
    mixed = _t(dev, torch.bfloat16, T, 3 * H * K)
    q, k, v = (x.unflatten(1, (H, K)).unsqueeze(0) for x in mixed.split(H * K, dim=-1))
    table = [[1 + n * t_max + t for t in range(t_max)] if n < N else [0] * t_max for n in range(rows)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    call = dict(q=q, k=k, v=v, raw_g=_t(dev, torch.bfloat16, 1, T, H, K),
                raw_beta=_t(dev, torch.bfloat16, 1, T, H + 8)[..., :H], A_log=_t(dev, torch.float32, H) * 0.5,
                dt_bias=_t(dev, torch.float32, H * K) * 0.5 if dt_bias else None, lower_bound=-5.0,
                initial_state=_t(dev, torch.float32, rows * t_max + 1, H, K, K) * 0.1, cu_seqlens=_i32(cu, dev),
                ssm_state_indices=_i32(table, dev),
                num_accepted_tokens=_i32([1] * rows, dev) if accepted else None)
    if out:
        call["out"] = torch.zeros(1, T, H, K, dtype=torch.bfloat16, device=dev)
    return call


def one_token(dev, N, table=False):
    """fused_recurrent_kda with one token per request: 1-D indices, or a one-column table with counts."""
    call = verify(dev, [1] * N, 1, accepted=table)
    if not table:
        call["ssm_state_indices"] = call["ssm_state_indices"][:, 0].contiguous()
    return call


def prefill(dev, lengths, h0_dtype):
    T, N = sum(lengths), len(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return dict(q=_t(dev, torch.bfloat16, 1, T, H, K), k=_t(dev, torch.bfloat16, 1, T, H, K),
                v=_t(dev, torch.bfloat16, 1, T, H, K), raw_g=_t(dev, torch.bfloat16, 1, T, H, K),
                raw_beta=_t(dev, torch.bfloat16, 1, T, H + 8)[..., :H], A_log=_t(dev, torch.float32, H) * 0.5,
                g_bias=_t(dev, torch.float32, H * K) * 0.5, lower_bound=-5.0,
                initial_state=_t(dev, h0_dtype, N, H, K, K) * 0.1, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=_i32(cu, dev))


def strided_h0(call):
    """h0 as a [N, H, V, K] view with its slots apart (a paged pool's layout)."""
    h0 = call["initial_state"]
    wide = torch.zeros((h0.shape[0], 2, *h0.shape[1:]), dtype=h0.dtype, device=h0.device)
    wide[:, 0] = h0
    call["initial_state"] = wide[:, 0]
    assert not call["initial_state"].is_contiguous()
    return call


# kda_decode / kda_verify read q|k|v as row-strided views of the post-conv rows and beta as a column slice of its
# projection: no copy (were {"clone": 2}: one permuting copy of q|k|v, one of beta)
PACKED_COPIES = {}
CASES = [
    # (case, serve, build(dev), {device: launches})
    ("decode 1 row", k3.serve_packed_decode, lambda d: decode(d, 1), {"cpu": {}, "meta": {}}),
    ("decode 16 rows", k3.serve_packed_decode, lambda d: decode(d, 16), {"cpu": PACKED_COPIES, "meta": PACKED_COPIES}),
    ("decode 16 rows, out", k3.serve_packed_decode, lambda d: decode(d, 16, out=True),
     {"cpu": PACKED_COPIES, "meta": PACKED_COPIES}),
    # rows 49 elements (98 bytes) apart: the CPU backend reads them as they are; a GPU's 16-byte loads cannot, so
    # on a device the one permuting copy of q|k|v comes back
    ("decode 16 rows, unaligned rows", k3.serve_packed_decode, lambda d: decode(d, 16, pad=1),
     {"cpu": {}, "meta": {"clone": 1}}),
    ("verify 1 request", k3.serve_fused_recurrent, lambda d: verify(d, [4], 4),
     {"cpu": PACKED_COPIES, "meta": PACKED_COPIES}),
    ("verify 3 requests", k3.serve_fused_recurrent, lambda d: verify(d, [4, 2, 3], 4),
     {"cpu": PACKED_COPIES, "meta": PACKED_COPIES}),
    ("verify graph-padded, out", k3.serve_fused_recurrent, lambda d: verify(d, [4, 2, 3], 4, rows=5, tokens=20,
                                                                           out=True),
     {"cpu": PACKED_COPIES, "meta": PACKED_COPIES}),
    # an output made here is zero past the last offset: one fill
    ("verify graph-padded", k3.serve_fused_recurrent, lambda d: verify(d, [4, 2, 3], 4, rows=5, tokens=20),
     {"cpu": {**PACKED_COPIES, "zeros": 1}, "meta": {**PACKED_COPIES, "zeros": 1}}),
    # offsets on a device, more tokens than N * T_max (table not padded): the first N * T_max are passed (views),
    # the output made here is zero past them
    ("verify padded tokens", k3.serve_fused_recurrent, lambda d: verify(d, [4, 2, 3], 4, tokens=20),
     {"cpu": {**PACKED_COPIES, "zeros": 1}, "meta": {**PACKED_COPIES, "zeros": 1}}),
    ("verify bounded gate without dt_bias", k3.serve_fused_recurrent, lambda d: verify(d, [4, 2], 4, dt_bias=False),
     {"cpu": PACKED_COPIES, "meta": PACKED_COPIES}),
    # each one-token request's slot on its token's row (_indices.one_token_rows): host offsets are read in Python
    # (no op where request n is token n); device ones never read back: the one-token requests inside the rows
    # scattered to their rows (sub, eq, ge, lt, two ands, the int64 rows, a fill, where, scatter). K3's layers
    # never call this form (their verify passes a table of k + 1 columns): no step of theirs pays these
    ("one-token rows", k3.serve_fused_recurrent, lambda d: one_token(d, 4),
     {"cpu": {}, "meta": {**PACKED_COPIES, "_to_copy": 1, "sub": 1, "eq": 1, "ge": 1, "bitwise_and": 2, "lt": 1,
                          "full": 1, "scalar_tensor": 1, "where": 1, "scatter_": 1}}),
    # with counts: a count other than 1 makes its request padding (eq, where)
    ("one-token rows, one-column table", k3.serve_fused_recurrent, lambda d: one_token(d, 4, table=True),
     {"cpu": {"eq": 1, "scalar_tensor": 1, "where": 1},
      "meta": {**PACKED_COPIES, "_to_copy": 1, "sub": 1, "eq": 2, "ge": 1, "bitwise_and": 2, "lt": 1, "full": 1,
               "scalar_tensor": 2, "where": 2, "scatter_": 1}}),
    # beta out of its projection; a bf16 h0 read into fp32 (vLLM's fp32 final state) in one pass
    ("prefill, bf16 h0", k3.serve_chunk_with_fused_gate, lambda d: prefill(d, [5, 11], torch.bfloat16),
     {dev: {"clone": 1, "_to_copy": 1} for dev in ("cpu", "meta")}),
    ("prefill, strided bf16 h0", k3.serve_chunk_with_fused_gate,
     lambda d: strided_h0(prefill(d, [5, 11], torch.bfloat16)),
     {dev: {"clone": 1, "_to_copy": 1} for dev in ("cpu", "meta")}),
    ("prefill, fp32 h0", k3.serve_chunk_with_fused_gate, lambda d: prefill(d, [5, 11], torch.float32),
     {dev: {"clone": 1} for dev in ("cpu", "meta")}),
]


@pytest.mark.parametrize("dev", ["cpu", "meta"])
@pytest.mark.parametrize("case,serve,build,want", CASES, ids=[c[0] for c in CASES])
def test_adapter_launches_are_pinned(launches, dev, case, serve, build, want):
    got, _ = launches(serve, build(dev))
    assert got == want[dev], f"{case} on {dev}: {got}"


def test_the_counter_sees_a_launch_the_adapter_makes(launches, monkeypatch):
    """The proxy can fail: one more copy in the adapter shows up as one more clone."""
    real = k3.rows_view     # g and beta of the packed decode
    monkeypatch.setattr(k3, "rows_view", lambda x, d, **kw: real(x, d, **kw).clone())
    got, _ = launches(k3.serve_packed_decode, decode("meta", 16))
    assert got == {"clone": 2}


def test_graph_padded_verify_on_a_device_passes_views_of_the_real_requests(launches):
    """Device offsets (no host read), the table padded to 5 rows and 20 tokens for 3 requests of at most 4: the
    op gets the 3 requests' rows and offsets as given (no cat) and the first 3 * 4 tokens, views of vLLM's own
    row-strided views (no copy), writing into the caller's out."""
    call = verify("meta", [4, 2, 3], 4, rows=5, tokens=20, out=True)
    _, made = launches(k3.serve_fused_recurrent, call)
    (name, args, kw), = made
    assert name == "kda_verify" and all(x.shape[1] == 12 for x in args)
    assert kw["cu_seqlens"] is call["cu_seqlens"]
    assert kw["state_indices"].shape == (3, 4) and kw["num_accepted_tokens"].shape == (3,)
    assert kw["out"].data_ptr() == call["out"].data_ptr() and kw["out"].shape[1] == 12


def test_bounded_gate_without_dt_bias_is_bitwise_the_zero_bias():
    """dt_bias=None reaches the op as None (absent = 0) instead of a zero-filled tensor: the same bits."""
    pool = _t("cpu", torch.float32, 9, H, K, K) * 0.1
    results = []
    for bias in (None, torch.zeros(H * K)):
        call = dict(verify("cpu", [4, 2], 4, dt_bias=False), initial_state=pool.clone(), dt_bias=bias)
        o, state = k3.serve_fused_recurrent(**call)
        results.append((o, state))
    (o0, s0), (o1, s1) = results
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
    assert not torch.equal(s0, pool)        # the call did step the pool
