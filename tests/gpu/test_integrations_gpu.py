"""The adoption layer on the H200: torch.compile / CUDA-graph capture of a KDA layer through the custom ops,
the fla backend against fla's own Triton path, and the SGLang-shaped kernel against the reference (the vLLM
adapters: tests/gpu/test_vllm_gpu.py).
Skips without CUDA (fla parts also without fla >= 0.6). Run by scripts/device.sh (STAGES=integrations)."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from gpu_common import rel_l2  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import test_custom_ops as layer  # noqa: E402  (the CPU test's layer, at CUDA sizes here)

from flashkda_ext.reference import kda_decode_step, kda_recurrent  # noqa: E402

DEV = torch.device("cuda")
H, D, SLOTS, ROWS, T = 8, 128, 12, 4, 160
HAS_FLA = importlib.util.find_spec("fla") is not None


def cuda_params():
    """make_params of the CPU test at this file's sizes, bf16 where the CUDA kernels need it."""
    gen = torch.Generator().manual_seed(0)
    HD = H * D
    r = lambda *s, scale=0.05: (torch.randn(*s, generator=gen) * scale)  # noqa: E731
    bf = lambda t: t.to(DEV, torch.bfloat16)  # noqa: E731
    return dict(w_qkv=bf(r(3 * HD, HD)), w_g=bf(r(HD, HD)), w_beta=bf(r(H, HD)), w_gate=bf(r(HD, HD)),
                w_o=bf(r(HD, HD)), conv_weight=bf(r(3 * HD, 4, scale=0.3)), A_log=r(H, scale=0.3).to(DEV),
                dt_bias=r(HD, scale=0.5).to(DEV), norm_weight=(1.0 + r(D)).to(DEV),
                checkpoint_every=64, max_seqlen=96)


def cuda_inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    HD = H * D
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    return dict(x_dec=r(ROWS, HD).to(DEV, torch.bfloat16), x_pre=r(1, T, HD).to(DEV, torch.bfloat16),
                state=r(SLOTS, H, D, D, scale=0.05).to(DEV), conv_state=r(SLOTS, 3 * HD, 3).to(DEV, torch.bfloat16),
                dec_idx=torch.tensor([3, -1, 1, 7], dtype=torch.int32, device=DEV),
                fused_idx=torch.tensor([2, 5, -1, 0], dtype=torch.int32, device=DEV),
                pre_idx=torch.tensor([9, 4], dtype=torch.int32, device=DEV),
                cu_seqlens=torch.tensor([0, 96, T], dtype=torch.int32, device=DEV))


@pytest.fixture(scope="module")
def eager():
    p, inputs = cuda_params(), cuda_inputs()
    with torch.inference_mode():
        return p, inputs, layer.run(layer.kda_layer, p, inputs)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_layer_matches_eager(eager, backend):
    p, inputs, want = eager
    torch._dynamo.reset()
    compiled = torch.compile(layer.kda_layer, backend=backend, fullgraph=True)
    with torch.inference_mode():
        got = layer.run(compiled, p, inputs)
    for name in layer.KDA_OUTPUTS:
        assert layer.bitwise(got[name], want[name]), f"{backend}: {name} differs from eager"
    for name in layer.LAYER_OUTPUTS:
        if backend == "inductor":
            assert rel_l2(got[name], want[name]) < 1e-2, name
        else:
            assert layer.bitwise(got[name], want[name]), f"{backend}: {name} differs from eager"


def test_cuda_graph_of_the_compiled_layer(eager):
    """Capture the inductor-compiled layer in a CUDA graph; replay on fresh input values copied into the
    static buffers; the KDA outputs equal eager on the same values bitwise."""
    p, _, _ = eager
    torch._dynamo.reset()
    compiled = torch.compile(layer.kda_layer, backend="inductor", fullgraph=True)
    static = {k: v.clone() for k, v in cuda_inputs(seed=2).items()}
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                compiled(p, **{k: v.clone() for k, v in static.items()})
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = compiled(p, **static)
        fresh = cuda_inputs(seed=3)
        for k, v in fresh.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = layer.run(layer.kda_layer, p, fresh)
    res = dict(res, state=static["state"], conv_state=static["conv_state"])
    for name in layer.KDA_OUTPUTS:
        assert layer.bitwise(res[name], want[name]), f"graph replay: {name} differs from eager"


# ---------------------------------------------------------------------------------------------
# fla backend: served calls against fla's Triton path (FLA_FLASHKDA_EXT=0)


@pytest.fixture(scope="module")
def fla_backend():
    if not HAS_FLA:
        pytest.skip("fla is not installed")
    from flashkda_ext.integrations import fla as fkda_fla
    fkda_fla.register()
    return fkda_fla


def _both(fkda_fla, key, fn):
    """(ours, fla Triton) results of fn(), checking that ours was served and Triton's was not ours."""
    served = fkda_fla.STATS[key, "served"]
    ours = fn()
    assert fkda_fla.STATS[key, "served"] == served + 1, "flashkda_ext did not serve the call"
    os.environ[fkda_fla.ENV_VAR] = "0"
    try:
        theirs = fn()
    finally:
        os.environ.pop(fkda_fla.ENV_VAR)
    assert fkda_fla.STATS[key, "served"] == served + 1
    return ours, theirs


@pytest.mark.parametrize("gate", ["softplus", "bounded", "softplus+h"])
def test_fla_chunk_kda_served_matches_triton(fla_backend, gate):
    from fla.ops.kda import chunk_kda
    gen = torch.Generator().manual_seed(4)
    Tt, HV = 300, 16
    bf = lambda *s: torch.randn(*s, generator=gen).to(DEV, torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = bf(1, Tt, HV, 128), bf(1, Tt, HV, 128), bf(1, Tt, HV, 128), bf(1, Tt, HV, 128), bf(1, Tt, HV)
    A_log, dt_bias = (torch.rand(HV, generator=gen) * 2).to(DEV), torch.randn(HV * 128, generator=gen).to(DEV)
    cu = torch.tensor([0, 100, 250, Tt], device=DEV)
    h0 = (torch.randn(3, HV, 128, 128, generator=gen) * 0.05).to(DEV)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
              A_log=A_log, dt_bias=dt_bias)
    if gate == "bounded":
        kw.update(safe_gate=True, lower_bound=-5.0)
    if gate == "softplus+h":   # fla's per-chunk states from our checkpoints
        kw.update(return_intermediate_states=True)
    with torch.inference_mode():
        ours, theirs = _both(fla_backend, "chunk_kda", lambda: chunk_kda(q, k, v, g, beta, **kw))
    assert len(ours) == len(theirs)
    for name, a, b in zip(("o", "final_state", "h"), ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_l2(a, b) < 1e-2, name


def test_fla_vllm_decode_served_matches_triton(fla_backend):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    gen = torch.Generator().manual_seed(5)
    N, HV, slots = 64, 16, 96
    bf = lambda *s: torch.randn(*s, generator=gen).to(DEV, torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = bf(1, N, HV, 128), bf(1, N, HV, 128), bf(1, N, HV, 128), bf(1, N, HV, 128), bf(1, N, HV)
    A_log, dt_bias = (torch.rand(HV, generator=gen) * 2).to(DEV), torch.randn(HV * 128, generator=gen).to(DEV)
    pool0 = (torch.randn(slots, HV, 128, 128, generator=gen) * 0.05).to(DEV)
    idx = torch.randperm(slots, generator=gen)[:N].to(DEV, torch.int32)
    pools = []

    def call():
        pool = pool0.clone()
        pools.append(pool)
        return fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                       inplace_final_state=True, state_v_first=True,
                                       cu_seqlens=torch.arange(N + 1, device=DEV, dtype=torch.int32),
                                       ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True)[0]
    with torch.inference_mode():
        o1, o2 = _both(fla_backend, "fused_recurrent_kda_fwd", call)
    assert rel_l2(o1, o2) < 1e-2 and rel_l2(pools[0], pools[1]) < 1e-2


@pytest.mark.parametrize("drafts", [1, 3])
def test_fla_fp16_gate_beside_bf16_q_is_read_unrounded(fla_backend, drafts):
    """An fp16 gate / beta beside bf16 q (fla's kernel reads fp16 as it is): the adapter widens them to fp32 for
    kda_decode (one token a request) / kda_verify (drafts), the _gb32 modules: bitwise the call given fp32 g / beta,
    and within the kernels' tolerance of fla's Triton kernel on the fp16 ones."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    gen = torch.Generator().manual_seed(9)
    N, HV = 8, 16
    T, cols = N * drafts, drafts
    slots = N * cols + 4
    bf = lambda *s: torch.randn(*s, generator=gen).to(DEV, torch.bfloat16)  # noqa: E731
    q, k, v = bf(1, T, HV, 128), bf(1, T, HV, 128), bf(1, T, HV, 128)
    g, beta = torch.randn(1, T, HV, 128, generator=gen).to(DEV, torch.float16), \
        torch.randn(1, T, HV, generator=gen).to(DEV, torch.float16)
    A_log, dt_bias = (torch.rand(HV, generator=gen) * 2).to(DEV), torch.randn(HV * 128, generator=gen).to(DEV)
    pool0 = (torch.randn(slots, HV, 128, 128, generator=gen) * 0.05).to(DEV)
    idx = torch.randperm(slots, generator=gen)[:N * cols].to(DEV, torch.int32)
    idx = idx if drafts == 1 else idx.reshape(N, cols)
    extra = {} if drafts == 1 else {"num_accepted_tokens": torch.randint(1, cols + 1, (N,), generator=gen,
                                                                         dtype=torch.int32).to(DEV)}
    cu = torch.arange(0, T + 1, drafts, device=DEV, dtype=torch.int32)
    pools = []

    def call(gate=g, b=beta):
        pool = pool0.clone()
        pools.append(pool)
        return fused_recurrent_kda_fwd(q, k, v, gate, b, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                       inplace_final_state=True, state_v_first=True, cu_seqlens=cu,
                                       ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, **extra)[0]
    with torch.inference_mode():
        o1, o2 = _both(fla_backend, "fused_recurrent_kda_fwd", call)
        o32 = call(g.float(), beta.float())
    assert torch.equal(o1, o32) and torch.equal(pools[0], pools[2]), "fp16 g / beta not read as their fp32 values"
    assert rel_l2(o1, o2) < 1e-2 and rel_l2(pools[0], pools[1]) < 1e-2


def test_fla_verify_on_a_graph_padded_batch_served_matches_triton(fla_backend):
    """fla's speculative-decoding call (2-D ssm_state_indices, num_accepted_tokens) on a batch padded as vLLM pads
    one to a CUDA-graph size: 5 live requests of 1-4 drafts, then 11 empty ones (the last offset repeated, count
    1, live slots in their rows). Served by kda_verify and run by fla's Triton kernel: the outputs and the pools
    agree, and neither touches an empty request's slots."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    gen = torch.Generator().manual_seed(6)
    lens, cols, HV = [4, 1, 3, 4, 2] + [0] * 11, 4, 16
    N, T = len(lens), sum(lens)
    slots = N * cols + 8
    bf = lambda *s: torch.randn(*s, generator=gen).to(DEV, torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = bf(1, T, HV, 128), bf(1, T, HV, 128), bf(1, T, HV, 128), bf(1, T, HV, 128), bf(1, T, HV)
    A_log, dt_bias = (torch.rand(HV, generator=gen) * 2).to(DEV), torch.randn(HV * 128, generator=gen).to(DEV)
    pool0 = (torch.randn(slots, HV, 128, 128, generator=gen) * 0.05).to(DEV)
    idx = torch.randperm(slots, generator=gen)[:N * cols].reshape(N, cols).to(DEV, torch.int32)
    nacc = torch.randint(1, cols + 1, (N,), generator=gen, dtype=torch.int32).to(DEV)
    nacc[5:] = 1
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    pools = []

    def call():
        pool = pool0.clone()
        pools.append(pool)
        return fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                       inplace_final_state=True, state_v_first=True, cu_seqlens=cu,
                                       ssm_state_indices=idx, num_accepted_tokens=nacc, use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0]
    with torch.inference_mode():
        o1, o2 = _both(fla_backend, "fused_recurrent_kda_fwd", call)
    assert T < N and rel_l2(o1, o2) < 1e-2 and rel_l2(pools[0], pools[1]) < 1e-2
    empty = idx[5:].flatten().long()
    for pool in pools:
        assert torch.equal(pool[empty], pool0[empty]), "an empty request's slot changed"


def test_fla_decode_on_a_graph_padded_batch_served_matches_triton(fla_backend):
    """fla's decode call (1-D ssm_state_indices) on a batch padded as vLLM pads one to a CUDA-graph size:
    5 live one-token requests, then 11 empty ones (the last offset repeated, T = N = 16) whose indices name
    live slots. The offsets are on the device, so the adapter routes the call to kda_verify (issue 45):
    outputs and pools agree with fla's Triton kernel, no empty request's slot changes; replayed from a
    CUDA graph it gives the same. An int64 index that would wrap to a live slot becomes padding."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    gen = torch.Generator().manual_seed(8)
    live, N, HV, slots = 5, 16, 16, 40
    bf = lambda *s: torch.randn(*s, generator=gen).to(DEV, torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = bf(1, N, HV, 128), bf(1, N, HV, 128), bf(1, N, HV, 128), bf(1, N, HV, 128), bf(1, N, HV)
    A_log, dt_bias = (torch.rand(HV, generator=gen) * 2).to(DEV), torch.randn(HV * 128, generator=gen).to(DEV)
    pool0 = (torch.randn(slots, HV, 128, 128, generator=gen) * 0.05).to(DEV)
    idx = torch.randperm(slots, generator=gen)[:N].to(DEV, torch.int32)
    cu = torch.tensor(list(range(live + 1)) + [live] * (N - live), dtype=torch.int32, device=DEV)
    kw = dict(A_log=A_log, dt_bias=dt_bias, inplace_final_state=True, state_v_first=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    pools = []

    def call(index=idx):
        pool = pool0.clone()
        pools.append(pool)
        return fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=index, **kw)[0]
    with torch.inference_mode():
        o1, o2 = _both(fla_backend, "fused_recurrent_kda_fwd", call)
        assert rel_l2(o1, o2) < 1e-2 and rel_l2(pools[0], pools[1]) < 1e-2
        assert torch.equal(o1[0, live:], torch.zeros_like(o1[0, live:]))
        empty = idx[live:].long()
        for pool in pools:
            assert torch.equal(pool[empty], pool0[empty]), "an empty request's slot changed"
        # CUDA graph: captured once, replayed on the same static tensors
        static_pool = pool0.clone()
        call_graph = lambda: fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=static_pool,  # noqa: E731
                                                     ssm_state_indices=idx, **kw)[0]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call_graph()                     # warm-up (JIT, verdict memo)
        torch.cuda.current_stream().wait_stream(s)
        static_pool.copy_(pool0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph = call_graph()
        static_pool.copy_(pool0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_graph, o1) and torch.equal(static_pool, pools[0])
        # 2**32 + 1 would wrap to a live slot: padding instead (zero row, nothing written)
        wrapped = idx.long()
        wrapped[0] = 2 ** 32 + int(idx[1])
        pool = pool0.clone()
        o = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=wrapped, **kw)[0]
        assert torch.equal(o[0, 0], torch.zeros_like(o[0, 0])) and torch.equal(pool[idx[0].long()],
                                                                                pool0[idx[0].long()])
        torch.testing.assert_close(o[0, 1:], o1[0, 1:], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# SGLang-shaped kernel


def _sglang_layer(seed, HV, slots):
    """The SGLang-shaped kernel, a bf16 random maker, the model's A_log ([1, 1, HV, 1]) and dt_bias, and
    an fp32 pool [slots, HV, 128, 128]."""
    from flashkda_ext.integrations.sglang import FlashKDAExtKernel
    gen = torch.Generator().manual_seed(seed)
    bf = lambda *s: torch.randn(*s, generator=gen).to(DEV, torch.bfloat16)  # noqa: E731
    A_log = torch.rand(1, 1, HV, 1, generator=gen).to(DEV)
    dt_bias = torch.randn(HV * 128, generator=gen).to(DEV)
    pool = (torch.randn(slots, HV, 128, 128, generator=gen) * 0.05).to(DEV)
    return FlashKDAExtKernel(), gen, bf, A_log, dt_bias, pool


def test_sglang_kernel_decode_and_extend_on_cuda():
    HV, N, slots = 16, 8, 16
    kern, gen, bf, A_log, dt_bias, pool = _sglang_layer(6, HV, slots)
    idx = torch.randperm(slots, generator=gen)[:N].to(DEV, torch.int32)
    idx[3] = -1
    # decode: fp32 gate and beta logit beside bf16 q
    q, k, v = bf(1, N, HV, 128), bf(1, N, HV, 128), bf(1, N, HV, 128)
    a, b = torch.randn(N, HV * 128, generator=gen).to(DEV), torch.randn(1, N, HV, generator=gen).to(DEV)
    pool0 = pool.clone()
    with torch.inference_mode():
        o = kern.decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
                        query_start_loc=torch.arange(N + 1, device=DEV, dtype=torch.int32))
    # kda_decode reads the fp32 gate and beta as they are (no cast to bf16 first)
    want_o, want_pool = kda_decode_step(q[0], k[0], v[0], a.view(N, HV, 128), b[0],
                                        state=pool0, state_indices=idx, A_log=A_log.flatten(), dt_bias=dt_bias)
    assert rel_l2(o[0], want_o) < 1e-2 and rel_l2(pool, want_pool) < 1e-3
    # extend with per-chunk states for the track buffer
    lens = [70, 130]
    Tt = sum(lens)
    q, k, v, g = bf(1, Tt, HV, 128), bf(1, Tt, HV, 128), bf(1, Tt, HV, 128), bf(1, Tt, HV, 128)
    beta = torch.rand(1, Tt, HV, generator=gen).to(DEV)
    qsl = torch.tensor([0, lens[0], Tt], dtype=torch.int32, device=DEV)
    cidx = torch.tensor([5, 11], dtype=torch.int32, device=DEV)
    pool0 = pool.clone()
    with torch.inference_mode():
        o, h = kern.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=cidx, query_start_loc=qsl, A_log=A_log,
                           dt_bias=dt_bias, extend_seq_lens_cpu=lens, return_intermediate_states=True)
    want_o, want_pool, want_ckpt = kda_recurrent(q, k, v, g, beta.bfloat16(), A_log=A_log.flatten(), dt_bias=dt_bias,
                                                 beta_is_logit=False, cu_seqlens=qsl, initial_state=pool0,
                                                 state_indices=cidx, checkpoint_every=64)
    assert rel_l2(o, want_o) < 1e-2 and rel_l2(pool, want_pool) < 1e-2
    assert h.shape == (1, 2 + 3, HV, 128, 128)
    assert rel_l2(h[0, 1], want_ckpt[0, 0]) < 1e-2 and rel_l2(h[0, 4], want_ckpt[1, 1]) < 1e-2


@pytest.mark.parametrize("ab_dtype", [torch.float32, torch.bfloat16])
def test_sglang_decode_launches_one_kernel(ab_dtype):
    """The adapter's decode with the gate and beta in fp32 (as engines produce them) or bf16 launches the
    decode kernel alone: no conversion kernel before it."""
    from torch.profiler import ProfilerActivity, profile
    HV, N, slots = 16, 4, 8
    kern, gen, bf, A_log, dt_bias, pool = _sglang_layer(7, HV, slots)
    q, k, v = bf(1, N, HV, 128), bf(1, N, HV, 128), bf(1, N, HV, 128)
    a = torch.randn(N, HV * 128, generator=gen).to(DEV, ab_dtype)
    b = torch.randn(1, N, HV, generator=gen).to(DEV, ab_dtype)
    idx = torch.arange(N, dtype=torch.int32, device=DEV)
    qsl = torch.arange(N + 1, device=DEV, dtype=torch.int32)
    A_flat = A_log.reshape(-1).contiguous()
    with torch.inference_mode():
        kern.decode(q, k, v, a, b, A_log=A_flat, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
                    query_start_loc=qsl)  # warm: module loaded, fast path armed
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            kern.decode(q, k, v, a, b, A_log=A_flat, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
                        query_start_loc=qsl)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "kda_decode" in kernels[0], kernels


def _sglang_verify_reference(q, k, v, a, b, A_log, dt_bias, pool, cidx, rows, D, buf):
    """The token recurrence (kda_decode_step, one token at a time) from each live request's slot."""
    HV, Kd = v.shape[2], q.shape[3]
    out = torch.zeros(q.shape[1], HV, v.shape[3], dtype=torch.float64, device=DEV)
    buf = buf.clone()
    one = torch.zeros(1, dtype=torch.int32, device=DEV)
    for n, (slot, row) in enumerate(zip(cidx.tolist(), rows.tolist())):
        if slot < 0:
            continue
        state = pool[slot:slot + 1].clone()
        for t in range(D):
            i = n * D + t
            o, state = kda_decode_step(q[0, i:i + 1], k[0, i:i + 1], v[0, i:i + 1],
                                       a[i:i + 1].view(1, HV, Kd).bfloat16(), b[i:i + 1].bfloat16(), state=state,
                                       state_indices=one, A_log=A_log.flatten(), dt_bias=dt_bias)
            out[i] = o[0]
            buf[row, t] = state[0]
    return out, buf


def test_sglang_target_verify_on_cuda_and_in_a_cuda_graph():
    HV, N, D, R, slots = 16, 8, 4, 12, 16
    Tt = N * D
    kern, gen, bf, A_log, dt_bias, pool = _sglang_layer(7, HV, slots)
    cidx = torch.randperm(slots, generator=gen)[:N].to(DEV, torch.int32)
    cidx[5] = -1                                                   # SGLang's cuda-graph padding
    rows = torch.randperm(R, generator=gen)[:N].to(DEV, torch.int32)
    q, k, v = bf(1, Tt, HV, 128), bf(1, Tt, HV, 128), bf(1, Tt, HV, 128)
    a, b = torch.randn(Tt, HV * 128, generator=gen).to(DEV), torch.randn(Tt, HV, generator=gen).to(DEV)
    qsl = torch.arange(0, Tt + 1, D, dtype=torch.int32, device=DEV)
    buf = torch.full((R, D, HV, 128, 128), float("nan"), device=DEV)
    pool0, buf0 = pool.clone(), buf.clone()
    call = lambda: kern.target_verify(A_log, dt_bias, q, k, v, a, b, ssm_states=pool, cache_indices=cidx,  # noqa
                                      query_start_loc=qsl, intermediate_states_buffer=buf,
                                      intermediate_state_indices=rows, cache_steps=D)
    with torch.inference_mode():
        o = call()
    torch.cuda.synchronize()
    want_o, want_buf = _sglang_verify_reference(q, k, v, a, b, A_log, dt_bias, pool0, cidx, rows, D, buf0)
    live = [n for n in range(N) if n != 5]
    assert rel_l2(o[0], want_o) < 1e-2
    assert torch.equal(o[0, 5 * D:6 * D], torch.zeros_like(o[0, :D]))
    assert torch.equal(pool, pool0)
    live_rows = rows[live].long()
    assert rel_l2(buf[live_rows], want_buf[live_rows]) < 1e-3
    untouched = torch.ones(R, dtype=torch.bool, device=DEV)
    untouched[live_rows] = False
    assert torch.isnan(buf[untouched]).all()
    # the start-state copy and the verify need no host sync: the call captures in a CUDA graph
    buf.copy_(buf0)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph = call()
        buf.copy_(buf0)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o) and torch.equal(pool, pool0)
    assert rel_l2(buf[live_rows], want_buf[live_rows]) < 1e-3
