"""The public ops under torch.compile(fullgraph=True) and torch.export (flashkda_ext/custom_ops.py), on CPU.

One small KDA layer step (projections, short conv, gate, unfused decode, fused decode, chunked prefill in
pool mode with checkpoints, gated RMSNorm, output projection) is compiled once per backend and exported
once; every KDA op output (out, the state pools, conv cache, checkpoints) equals eager bitwise. The layer
output equals eager bitwise under eager / aot_eager / export; inductor may fuse and reorder the float math
around the ops (projections, norm), so there the layer output is compared within a tolerance.
"""
import pytest
import torch
import torch.nn.functional as F

import flashkda_ext
from flashkda_ext import custom_ops

H, D, SLOTS, ROWS, T = 2, 16, 5, 3, 8
HD = H * D


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=0.3: torch.randn(*s, generator=gen) * scale  # noqa: E731
    return dict(w_qkv=r(3 * HD, HD), w_g=r(HD, HD), w_beta=r(H, HD), w_gate=r(HD, HD), w_o=r(HD, HD),
                conv_weight=r(3 * HD, 4), A_log=r(H), dt_bias=r(HD), norm_weight=1.0 + r(D))


def make_inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    return dict(x_dec=r(ROWS, HD), x_pre=r(1, T, HD), state=r(SLOTS, H, D, D, scale=0.2),
                conv_state=r(SLOTS, 3 * HD, 3, scale=0.5), dec_idx=torch.tensor([3, -1, 1], dtype=torch.int32),
                fused_idx=torch.tensor([2, -1, 0], dtype=torch.int32),
                pre_idx=torch.tensor([0, 4], dtype=torch.int32),
                cu_seqlens=torch.tensor([0, 5, T], dtype=torch.int32))


def gated_rmsnorm(o, gate, weight, eps=1e-5):
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return (o * weight * torch.sigmoid(gate)).to(gate.dtype)


def kda_layer(p, x_dec, x_pre, state, conv_state, dec_idx, fused_idx, pre_idx, cu_seqlens):
    """One decode step (unfused and fused, on their own pool slots) and one packed prefill of a KDA layer.
    Returns the KDA op outputs and the layer outputs; state and conv_state are updated in place.
    Sizes come from the tensors (tests/gpu/test_integrations_gpu.py runs it at CUDA sizes)."""
    rows, T = x_dec.shape[0], x_pre.shape[1]
    H, D = p["A_log"].shape[0], p["norm_weight"].shape[0]
    HD = H * D
    # unfused decode: conv by hand (the conv cache is left to the fused op), SiLU, then kda_decode
    qkv = F.silu(x_dec @ p["w_qkv"].t())
    q, k, v = (t.reshape(rows, H, D).contiguous() for t in qkv.split(HD, dim=-1))
    g = (x_dec @ p["w_g"].t()).reshape(rows, H, D)
    beta = x_dec @ p["w_beta"].t()
    gate = (x_dec @ p["w_gate"].t()).reshape(rows, H, D)
    o_dec = flashkda_ext.kda_decode(q, k, v, g, beta, state=state, state_indices=dec_idx, A_log=p["A_log"],
                                    dt_bias=p["dt_bias"], slot_mode="padded")
    y_dec = gated_rmsnorm(o_dec, gate, p["norm_weight"]).reshape(rows, HD) @ p["w_o"].t()

    # fused decode of the same rows on other slots (its own conv cache)
    o_fused = flashkda_ext.fused_kda_decode(x_dec @ p["w_qkv"].t(), p["conv_weight"], conv_state, g, beta,
                                            p["A_log"], p["dt_bias"], fused_idx, state, gate, p["norm_weight"],
                                            slot_mode="padded")
    y_fused = o_fused.reshape(rows, HD) @ p["w_o"].t()

    # prefill of two packed sequences into the pool, with checkpoints
    x = x_pre[0]
    xw = (x @ p["w_qkv"].t()).t().unsqueeze(0)                      # [1, 3*HD, T]
    conv = F.conv1d(F.pad(xw, (3, 0)), p["conv_weight"].unsqueeze(1), groups=3 * HD)
    qkv = F.silu(conv[0].t())
    q, k, v = (t.reshape(1, T, H, D).contiguous() for t in qkv.split(HD, dim=-1))
    g = (x @ p["w_g"].t()).reshape(1, T, H, D)
    beta = (x @ p["w_beta"].t()).reshape(1, T, H)
    gate = (x @ p["w_gate"].t()).reshape(1, T, H, D)
    o_pre, pool, ckpt = flashkda_ext.kda_prefill(q, k, v, g, beta, A_log=p["A_log"], dt_bias=p["dt_bias"],
                                                 cu_seqlens=cu_seqlens, state=state, state_indices=pre_idx,
                                                 checkpoint_every=p.get("checkpoint_every", 4),
                                                 max_seqlen=p.get("max_seqlen", 5))
    y_pre = gated_rmsnorm(o_pre, gate, p["norm_weight"]).reshape(T, HD) @ p["w_o"].t()
    return dict(o_dec=o_dec, o_fused=o_fused, o_pre=o_pre, ckpt=ckpt, y_dec=y_dec, y_fused=y_fused, y_pre=y_pre)


KDA_OUTPUTS = ("o_dec", "o_fused", "o_pre", "ckpt", "state", "conv_state")
LAYER_OUTPUTS = ("y_dec", "y_fused", "y_pre")


def run(fn, p, inputs):
    a = {k: v.clone() for k, v in inputs.items()}
    res = fn(p, **a)
    res.update(state=a["state"], conv_state=a["conv_state"])
    return res


def bitwise(a, b):
    return torch.equal(a, b) or (a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))


@pytest.fixture(scope="module")
def eager():
    p, inputs = make_params(), make_inputs()
    return p, inputs, run(kda_layer, p, inputs)


def test_eager_layer_is_sane(eager):
    p, inputs, want = eager
    assert torch.isfinite(want["o_pre"]).all() and torch.isfinite(want["y_fused"]).all()
    assert not torch.equal(want["state"], inputs["state"])          # the ops wrote the pool
    assert torch.equal(want["o_dec"][1], torch.zeros(H, D))          # the padding row
    assert want["ckpt"].shape == (2, 1, H, D, D)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(eager, backend):
    p, inputs, want = eager
    torch._dynamo.reset()
    compiled = torch.compile(kda_layer, backend=backend, fullgraph=True)
    got = run(compiled, p, inputs)
    for name in KDA_OUTPUTS:
        assert bitwise(got[name], want[name]), f"{backend}: {name} differs from eager"
    for name in LAYER_OUTPUTS:
        if backend == "inductor":  # fused/reordered projections and norm: not bitwise
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
        else:
            assert bitwise(got[name], want[name]), f"{backend}: {name} differs from eager"
    # a second call reuses the graph and still matches (the pool starts again from the same values)
    again = run(compiled, p, inputs)
    assert bitwise(again["state"], want["state"])


def test_export_matches_eager(eager):
    p, inputs, want = eager

    class Layer(torch.nn.Module):
        def forward(self, x_dec, x_pre, state, conv_state, dec_idx, fused_idx, pre_idx, cu_seqlens):
            return kda_layer(p, x_dec, x_pre, state, conv_state, dec_idx, fused_idx, pre_idx, cu_seqlens)

    a = {k: v.clone() for k, v in inputs.items()}
    ep = torch.export.export(Layer(), (), kwargs=a)
    functionalized = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
    targets = {str(n.args[0]) if n.target in functionalized else str(n.target)
               for n in ep.graph.nodes if n.op == "call_function"}
    for op in ("flashkda_ext.kda_decode.default", "flashkda_ext.fused_kda_decode.default",
               "flashkda_ext.kda_prefill.default"):
        assert op in targets, f"{op} not in the exported graph: {sorted(targets)}"
    exported = ep.module()
    got = run(lambda _p, **a: exported(**a), p, inputs)
    for name in KDA_OUTPUTS + LAYER_OUTPUTS:
        assert bitwise(got[name], want[name]), f"export: {name} differs from eager"


def test_fake_tensor_call_gives_shapes_and_checks_like_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(4, H, D)
        v = torch.empty(4, H, D)
        st = torch.empty(SLOTS, H, D, D)
        idx = torch.empty(4, dtype=torch.int32)
        out = flashkda_ext.kda_decode(q, q, v, q, torch.empty(4, H), state=st, state_indices=idx, gate="log")
        assert out.shape == (4, H, D) and out.dtype == torch.float32
        o, fs = flashkda_ext.kda_prefill(torch.empty(2, 3, H, D), torch.empty(2, 3, H, D), torch.empty(2, 3, H, D),
                                         torch.empty(2, 3, H, D), torch.empty(2, 3, H), gate="log")
        assert o.shape == (2, 3, H, D) and fs.shape == (2, H, D, D) and fs.dtype == torch.float32
        with pytest.raises(ValueError, match="state_indices: expected dtype int32"):
            flashkda_ext.kda_decode(q, q, v, q, torch.empty(4, H), state=st, state_indices=idx.long(), gate="log")
        with pytest.raises(ValueError, match="beta: expected shape"):
            flashkda_ext.kda_decode(q, q, v, q, torch.empty(4, H + 1), state=st, state_indices=idx, gate="log")


def test_a_bad_call_fails_at_compile_time_with_the_eager_message():
    def step(q, b, st, idx):
        return flashkda_ext.kda_decode(q, q, q, q, b, state=st, state_indices=idx, gate="log")

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="state_indices: expected dtype int32, got int64"):
        compiled(torch.randn(2, H, D), torch.randn(2, H), torch.zeros(SLOTS, H, D, D), torch.zeros(2, dtype=torch.long))


def test_traced_checkpoints_need_a_host_count():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(1, 8, H, D)
        with pytest.raises(ValueError, match="max_seqlen: required under torch.compile"):
            flashkda_ext.kda_prefill(x, x, x, x, torch.empty(1, 8, H), gate="log",
                                     cu_seqlens=torch.empty(3, dtype=torch.int32), checkpoint_every=4)


def test_schemas_name_the_mutated_tensors():
    def mutated(op):
        return {a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated(torch.ops.flashkda_ext.kda_decode) == {"state", "out"}
    assert mutated(torch.ops.flashkda_ext.fused_kda_decode) == {"conv_state", "state", "out"}
    assert mutated(torch.ops.flashkda_ext.kda_prefill) == {"state", "final_state", "checkpoints", "workspace", "out"}
    for op in (torch.ops.flashkda_ext.kda_decode, torch.ops.flashkda_ext.fused_kda_decode,
               torch.ops.flashkda_ext.kda_prefill):
        assert len(op.default._schema.returns) == 0  # never an alias of an input as an output
    assert custom_ops.tracing(torch.ones(1)) is False


def test_tracing_answers_as_torchs_is_fake_for_every_kind_of_tensor():
    """tracing() answers a plain tensor without torch's is_fake (the adapters ask it of several views a decode
    step); a fake, a functional wrapper (of a fake or a real tensor) and a functorch-wrapped tensor still go
    through is_fake, so the answer is is_fake's in every case."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
    real = torch.randn(4, 6)
    with FakeTensorMode():
        fake = torch.empty(4, 6)
    wrapped_real = torch._to_functional_tensor(real)
    wrapped_fake = torch._to_functional_tensor(fake)
    seen = []
    torch.vmap(lambda row: seen.append((row, custom_ops.tracing(row), is_fake(row))) or row)(real)
    assert torch._C._functorch.is_functorch_wrapped_tensor(seen[0][0])
    cases = [(real, False), (real[:, ::2], False), (fake, True), (fake[:, ::2], True), (wrapped_real, False),
             (wrapped_fake, True)]
    for x, want in cases:
        assert is_fake(x) is want and custom_ops.tracing(x) is want
    assert seen[0][1] is seen[0][2] is False


def test_dynamic_rows_and_tokens_compile_once_and_match_eager():
    """Serving loops change the row / token count every step: dynamic=True traces symbolic sizes through
    the fake implementations (and their checks) and still matches eager bitwise."""
    def decode(q, k, v, g, b, st, idx, A, dt):
        return flashkda_ext.kda_decode(q, k, v, g, b, state=st, state_indices=idx, A_log=A, dt_bias=dt) * 2

    def prefill(q, k, v, g, b, cu):
        return flashkda_ext.kda_prefill(q, k, v, g, b, gate="log", cu_seqlens=cu)[0]

    torch._dynamo.reset()
    cd = torch.compile(decode, fullgraph=True, dynamic=True, backend="aot_eager")
    cp = torch.compile(prefill, fullgraph=True, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    A, dt = r(H) * 0.3, r(H * D) * 0.5
    for rows in (3, 5):
        a = (r(rows, H, D), r(rows, H, D), r(rows, H, D), r(rows, H, D), r(rows, H))
        st, idx = r(SLOTS, H, D, D), torch.randperm(SLOTS, generator=gen)[:rows].int()
        st_eager = st.clone()
        assert bitwise(cd(*a, st, idx, A, dt), decode(*a, st_eager, idx, A, dt))
        assert bitwise(st, st_eager)
    for T in (7, 12):
        x, gl, b = r(1, T, H, D), -torch.rand(1, T, H, D, generator=gen), r(1, T, H)
        cu = torch.tensor([0, 3, T], dtype=torch.int32)
        assert bitwise(cp(x, x, x, gl, b, cu), prefill(x, x, x, gl, b, cu))


def test_traced_prefill_returns_what_eager_returns_in_pool_mode():
    """Pool mode returns the pool itself, or None with output_final_state=False (the pool only read)."""
    def pre(x, gl, b, st, idx, keep):
        return flashkda_ext.kda_prefill(x, x, x, gl, b, gate="log", state=st, state_indices=idx,
                                        output_final_state=keep)

    gen = torch.Generator().manual_seed(8)
    x, gl, b = torch.randn(2, 5, H, D, generator=gen), -torch.rand(2, 5, H, D, generator=gen), torch.randn(2, 5, H)
    idx = torch.tensor([3, 0], dtype=torch.int32)
    for keep in (True, False):
        torch._dynamo.reset()
        st_eager = torch.randn(SLOTS, H, D, D, generator=gen)
        st_traced = st_eager.clone()
        before = st_eager.clone()
        o1, s1 = pre(x, gl, b, st_eager, idx, keep)
        o2, s2 = torch.compile(pre, fullgraph=True, backend="aot_eager")(x, gl, b, st_traced, idx, keep)
        assert bitwise(o1, o2) and bitwise(st_eager, st_traced)
        assert (s1 is st_eager and s2 is st_traced) if keep else (s1 is None and s2 is None)
        assert keep or torch.equal(st_traced, before)
