"""The vLLM adapters on the H200 against vLLM 0.34.0's own Triton KDA kernels (the real wheel's kimi_k3 nvidia
ops, prepared beforehand with `python3 scripts/prepare_vllm_engine.py` into .engines/vllm and carried):
packed decode, speculative verify and chunk prefill as the layers call them, bf16 and fp32 pools, vLLM's null
block and CUDA-graph padding, a paged pool, CUDA-graph capture of the adapter, int64 indices past int32.
Skips without CUDA; fails when the prepared folder is missing (the acceptance needs vLLM's kernels)."""
import itertools
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from gpu_common import rel_l2, vllm_ops  # noqa: E402,F401  (vllm_ops: a fixture)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vllm  # noqa: E402  (the benchmark's loader and input builders: the layers' calls)

DEV = torch.device("cuda")
TOL = 1e-2


class Args:
    spec_tokens = 4
    prefill_len = 100
    paged = False


def both(ops, fkda_vllm, name, call, pool):
    """(ours (out, state), vLLM's (out, state)) on copies of the pool; asserts the adapter served."""
    adapter = getattr(ops, name)
    site = f"k3.{name}"
    served = fkda_vllm.STATS[site, "served"]
    a, b = bench_vllm.copy_pool(pool), bench_vllm.copy_pool(pool)
    with torch.inference_mode():
        o1, s1 = adapter(**bench_vllm.with_pool(call, a))
        assert fkda_vllm.STATS[site, "served"] == served + 1, dict(fkda_vllm.REASONS)
        o2, s2 = adapter.__wrapped__(**bench_vllm.with_pool(bench_vllm.own_v(name, call), b))
    torch.cuda.synchronize()
    return (o1, a if pool is not None else s1), (o2, b if pool is not None else s2)


def prefill_modules_routed(monkeypatch):
    """The modules flashkda_ext's prefill routes calls to from now on (the fast path's entries dropped, so every
    call takes the routed path)."""
    from flashkda_ext import fast_path
    from flashkda_ext import ops as fk_ops
    seen, real = [], fk_ops._prefill_route

    def spy(call):
        rule, module, chunk = real(call)
        seen.append(rule["module"])
        return rule, module, chunk

    monkeypatch.setattr(fk_ops, "_prefill_route", spy)
    fast_path.clear()
    return seen


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("rows,H", [(1, 8), (37, 12), (256, 32)])
def test_packed_decode_matches_vllm_triton(vllm_ops, rows, H, lower_bound, state_dtype):
    ops, fk = vllm_ops
    call, pool = bench_vllm.inputs("decode", rows, H, state_dtype, lower_bound, Args, DEV, seed=rows)
    if rows > 1:      # CUDA-graph padding: the null block (0) and -1 in the last rows
        call["state_indices"][-1] = 0
        call["state_indices"][-2] = -1
    (o1, p1), (o2, p2) = both(ops, fk, "fused_recurrent_kda_packed_decode", call, pool)
    assert rel_l2(o1, o2) < TOL and rel_l2(p1, p2) < TOL
    if rows > 1:
        assert torch.equal(o1[0, -2:], torch.zeros_like(o1[0, -2:]))
        assert torch.equal(p1[0], pool[0])               # the null block is never written


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,H", [(1, 8), (24, 24), (200, 32)])
def test_verify_matches_vllm_triton(vllm_ops, rows, H, state_dtype):
    ops, fk = vllm_ops
    call, pool = bench_vllm.inputs("verify", rows, H, state_dtype, -5.0, Args, DEV, seed=rows)
    (o1, p1), (o2, p2) = both(ops, fk, "fused_recurrent_kda", call, pool)
    assert rel_l2(o1, o2) < TOL and rel_l2(p1, p2) < TOL


def test_verify_with_cuda_graph_padding_matches_vllm_triton(vllm_ops):
    """vLLM's padded spec batch: table and counts padded to the graph batch (null block, count 1), cu_seqlens
    of the real requests, more tokens than they own; the owned tokens agree and no padded slot is written."""
    ops, fk = vllm_ops
    call, pool = bench_vllm.inputs("verify", 6, 16, torch.float32, -5.0, Args, DEV, seed=3)
    tm = Args.spec_tokens
    n_real = 4
    call["cu_seqlens"] = call["cu_seqlens"][:n_real + 1].clone()
    call["ssm_state_indices"][n_real:] = 0
    call["num_accepted_tokens"][n_real:] = 1
    (o1, p1), (o2, p2) = both(ops, fk, "fused_recurrent_kda", call, pool)
    used = n_real * tm
    assert rel_l2(o1[:, :used], o2[:, :used]) < TOL and rel_l2(p1, p2) < TOL
    assert torch.equal(p1[0], pool[0])


# the fused 16-token-chunk modules: prefill_c16_* (two CTAs an SM) and the role split prefill_c16ws_* that routes
# fused_chunk16 / fused_chunk16_decay have served since e367f72
FUSED_C16 = ("prefill_c16_", "prefill_c16ws_")


# 3 sequences x 16 heads: the chunk-64 modules; 32 x 16 = 512 sequences x heads of <= 2048 tokens: the fused
# 16-token-chunk kernel (routes fused_chunk16 / fused_chunk16_decay), for both gates
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("rows", [3, 32])
def test_prefill_matches_vllm_triton(vllm_ops, lower_bound, state_dtype, rows, monkeypatch):
    ops, fk = vllm_ops
    routed = prefill_modules_routed(monkeypatch)
    call, _ = bench_vllm.inputs("prefill", rows, 16, state_dtype, lower_bound, Args, DEV, seed=5 + rows)
    # unequal lengths summing to rows x 100 tokens (51..149 each, the last one takes the rest)
    lens = [100 + (37 * i) % 99 - 49 for i in range(rows)]
    lens[-1] += rows * Args.prefill_len - sum(lens)
    assert min(lens) > 0
    call["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEV)
    (o1, h1), (o2, h2) = both(ops, fk, "chunk_kda_with_fused_gate", call, None)
    assert len(routed) == 1 and routed[0].startswith(FUSED_C16 if rows == 32 else "prefill_vt"), routed
    assert h1.dtype == h2.dtype == torch.float32
    assert rel_l2(o1, o2) < 2 * TOL and rel_l2(h1, h2) < 2 * TOL


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_a_mixed_step_routes_by_its_prompt_in_vllms_forward_context(vllm_ops, lower_bound, monkeypatch):
    """vLLM's usual prefill step (63 one-token decodes beside a 2000-token prompt, H8) inside the wheel's forward
    context with the step's GDNAttentionMetadata: the decodes and the prompt as two calls (host_lengths.step_parts),
    the prompt on a chunk-64 module; by the mean (the fused 16-token module) when the offsets are a copy the lookup
    cannot find; both agree with vLLM's Triton kernel (given its own v: it writes its output there)."""
    ops, fk = vllm_ops
    routed = prefill_modules_routed(monkeypatch)
    ns = bench_vllm.vllm_step_metadata.load(ROOT / ".engines" / "vllm")
    lengths = [1] * 63 + [2000]
    args = type("A", (Args,), {"mixed_prompt": 2000})
    call, _ = bench_vllm.inputs("mixed", 63, 8, torch.float32, lower_bound, args, DEV, seed=11)
    m = bench_vllm.vllm_step_metadata.step(ns, lengths, DEV)
    call["cu_seqlens"] = m.non_spec_query_start_loc
    with bench_vllm.vllm_step_metadata.forward(ns, {"model.layers.0.self_attn": m}):
        (o1, h1), (o2, h2) = both(ops, fk, "chunk_kda_with_fused_gate", call, None)
        (o3, h3), _ = both(ops, fk, "chunk_kda_with_fused_gate", dict(call, cu_seqlens=call["cu_seqlens"].clone()),
                           None)
    assert len(routed) == 3 and not routed[1].startswith("prefill_c16") and routed[2].startswith(FUSED_C16), \
        routed
    for o, h in ((o1, h1), (o3, h3)):
        assert rel_l2(o, o2) < 2 * TOL and rel_l2(h, h2) < 2 * TOL


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 32])
def test_prefill_agrees_with_k3s_own_flashkda(vllm_ops, state_dtype, rows):
    """Kimi K3's own prefill on an H200 (kda.py's `_flashkda_prefill` over the wheel's FlashKDA extension, the
    layer's "auto" backend with a bounded gate) and ours through the chunk adapter, on the same call: the layer
    hands both backends the same arguments, so they must agree (FlashKDA keeps a bf16 state between chunks)."""
    ops, fk = vllm_ops
    fn, why = bench_vllm.peer_flashkda.load(ROOT / ".engines" / "vllm")
    if fn is None:
        pytest.skip(f"vLLM's FlashKDA extension does not load here: {why}")
    call, _ = bench_vllm.inputs("prefill", rows, 8, state_dtype, -5.0, Args, DEV, seed=21 + rows)
    with torch.inference_mode():
        o1, h1 = ops.chunk_kda_with_fused_gate(**call)
        o2, h2 = bench_vllm.flashkda_arm(fn, call)()
        # the opt-in k3_layer adapter (FLASHKDA_EXT_VLLM_K3_PREFILL) in FlashKDA's place, into the same kind of
        # buffers the layer hands over
        site = "k3_layer._flashkda_prefill"
        served = fk.STATS[site, "served"]
        o3, h3 = bench_vllm.flashkda_arm(fk.adapter_for(site, fn), call)()
        assert fk.STATS[site, "served"] == served + 1, dict(fk.REASONS)
    torch.cuda.synchronize()
    assert h2.dtype == h3.dtype == state_dtype
    assert rel_l2(o1, o2) < 2 * TOL and rel_l2(h1, h2.float()) < 2 * TOL
    assert rel_l2(o3, o2) < 2 * TOL and rel_l2(h3.float(), h2.float()) < 2 * TOL
    assert rel_l2(o3, o1) < TOL and rel_l2(h3.float(), h1) < TOL


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_checkpoints_agrees_with_k3s_own_flashkda(vllm_ops, state_dtype):
    """Prefix caching's "align" mode: K3's layer asks FlashKDA for each request's state at its checkpoint offset
    (offsets from the wheel's compute_mamba_prefill_checkpoints); the opt-in adapter cuts the call there (two
    checkpoints: three kda_prefill calls). Outputs, final states and the checkpoint rows agree with FlashKDA's;
    the rows without a checkpoint stay as they were."""
    ops, fk = vllm_ops
    engine = ROOT / ".engines" / "vllm"
    fn, why = bench_vllm.peer_flashkda.load(engine)
    if fn is None:
        pytest.skip(f"vLLM's FlashKDA extension does not load here: {why}")
    ns = bench_vllm.vllm_step_metadata.load(engine)
    lengths = [1] * 20 + [3000] + [1] * 3 + [700]
    computed = [37] * 20 + [512] + [9] * 3 + [1024]
    m = bench_vllm.vllm_step_metadata.with_checkpoints(ns, bench_vllm.vllm_step_metadata.step(ns, lengths, DEV),
                                                       computed)
    offsets = m.checkpoint.offsets
    cut = [r for r, o in enumerate(offsets) if o]
    rest = [r for r, o in enumerate(offsets) if not o]
    assert len(cut) == 2, offsets
    H, T, N = 8, sum(lengths), len(lengths)
    gen = torch.Generator(device=DEV).manual_seed(17)
    bf = lambda *s: torch.randn(*s, generator=gen, device=DEV).bfloat16()  # noqa: E731
    call = dict(q=bf(1, T, H, 128), k=bf(1, T, H, 128), v=bf(1, T, H, 128), g=bf(1, T, H, 128),
                beta=bf(1, T, H + 8)[..., :H], A_log=torch.rand(H, generator=gen, device=DEV) * 0.5,
                dt_bias=torch.randn(H * 128, generator=gen, device=DEV) * 0.5, lower_bound=-5.0,
                initial_state=(torch.randn(N, H, 128, 128, generator=gen, device=DEV) * 0.05).to(state_dtype),
                cu_seqlens=m.non_spec_query_start_loc, checkpoint_offsets=m.checkpoint.checkpoint_offsets,
                workspace=torch.empty(torch.ops._flashkda_C.get_workspace_size(T, H, N), dtype=torch.uint8,
                                      device=DEV))

    def buffers():
        nan = float("nan")
        return dict(out=torch.full((1, T, H, 128), nan, dtype=torch.bfloat16, device=DEV),
                    final_state=torch.full((N, H, 128, 128), nan, dtype=state_dtype, device=DEV),
                    checkpoint_state=torch.full((N, H, 128, 128), nan, dtype=state_dtype, device=DEV))
    theirs, ours = buffers(), buffers()
    site = "k3_layer._flashkda_prefill"
    served = fk.STATS[site, "served"]
    with torch.inference_mode():
        fn(**call, **theirs)
        with bench_vllm.vllm_step_metadata.forward(ns, {"model.layers.0.self_attn": m}):
            fk.adapter_for(site, fn)(**call, **ours)
    torch.cuda.synchronize()
    assert fk.STATS[site, "served"] == served + 1, dict(fk.REASONS)
    assert rel_l2(ours["out"], theirs["out"]) < 2 * TOL
    assert rel_l2(ours["final_state"].float(), theirs["final_state"].float()) < 2 * TOL
    assert rel_l2(ours["checkpoint_state"][cut].float(), theirs["checkpoint_state"][cut].float()) < 2 * TOL
    assert torch.isnan(ours["checkpoint_state"][rest].float()).all()


def test_decode_on_a_paged_pool_matches_vllm_triton(vllm_ops):
    """vLLM's page: the conv state then the recurrent state, a page per slot; the pool a strided view. Ours and
    vLLM's each on a copy of the whole paged buffer; ours writes only the named slots' states."""
    ops, fk = vllm_ops
    H, rows, slots = 16, 20, 33
    call, dense = bench_vllm.inputs("decode", rows, H, torch.bfloat16, -5.0, Args, DEV, seed=9)
    conv_bytes, state_bytes = 3 * 3 * H * 128 * 2, H * 128 * 128 * 2
    page = conv_bytes + state_bytes + 512
    raw0 = torch.randint(0, 256, (slots * page,), dtype=torch.uint8, device=DEV)

    def paged(raw):
        return torch.as_strided(raw.view(torch.bfloat16), (slots, H, 128, 128), (page // 2, 128 * 128, 128, 1),
                                conv_bytes // 2)

    paged(raw0)[: dense.shape[0]].copy_(dense)
    raw_a, raw_b = raw0.clone(), raw0.clone()
    adapter = ops.fused_recurrent_kda_packed_decode
    served = fk.STATS["k3.fused_recurrent_kda_packed_decode", "served"]
    with torch.inference_mode():
        o1, _ = adapter(**bench_vllm.with_pool(call, paged(raw_a)))
        o2, _ = adapter.__wrapped__(**bench_vllm.with_pool(call, paged(raw_b)))
    torch.cuda.synchronize()
    assert fk.STATS["k3.fused_recurrent_kda_packed_decode", "served"] == served + 1, dict(fk.REASONS)
    n = dense.shape[0]   # the slots the call names; the rest of the buffer is random bytes (NaN as bf16, some)
    assert rel_l2(o1, o2) < TOL and rel_l2(paged(raw_a)[:n], paged(raw_b)[:n]) < TOL
    for raw in (raw_a, raw_b):   # every byte outside the named slots' states is as it was
        paged(raw)[:n].view(torch.int16).zero_()
    paged(raw0)[:n].view(torch.int16).zero_()
    assert torch.equal(raw_a, raw0) and torch.equal(raw_b, raw0)
    written = torch.zeros_like(raw0, dtype=torch.bool)
    for s in call["state_indices"].tolist():
        lo = paged(raw_a)[s].data_ptr() - raw_a.data_ptr()
        written[lo:lo + state_bytes] = True
    assert torch.equal(raw_a[~written], raw0[~written])


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_adapter_captured_in_a_cuda_graph_replays_as_vllm(vllm_ops, kind):
    ops, fk = vllm_ops
    name = bench_vllm.NAMES[kind]
    call, pool = bench_vllm.inputs(kind, 16, 8, torch.bfloat16, -5.0, Args, DEV, seed=11)
    adapter = getattr(ops, name)
    mine, ref = pool.clone(), pool.clone()
    c = bench_vllm.with_pool(call, mine)
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            adapter(**c)                                # warm-up (the validation memo; the module loaded)
        torch.cuda.current_stream().wait_stream(s)
        mine.copy_(pool)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, _ = adapter(**c)
        mine.copy_(pool)
        g.replay()
        o2, _ = adapter.__wrapped__(**bench_vllm.with_pool(call, ref))
    torch.cuda.synchronize()
    assert rel_l2(out, o2) < TOL and rel_l2(mine, ref) < TOL


def test_int64_index_past_int32_is_padding_on_the_gpu(vllm_ops):
    """2**32 + 1 would wrap to slot 1: on the device it becomes padding (zero output, nothing written)."""
    ops, fk = vllm_ops
    call, pool = bench_vllm.inputs("decode", 4, 8, torch.float32, -5.0, Args, DEV, seed=13)
    call["state_indices"] = torch.tensor([2 ** 32 + 1, 2, 3, 4], dtype=torch.int64, device=DEV)
    before = pool.clone()
    with torch.inference_mode():
        o, _ = ops.fused_recurrent_kda_packed_decode(**call)
    torch.cuda.synchronize()
    assert torch.equal(o[0, 0], torch.zeros_like(o[0, 0])) and torch.equal(pool[1], before[1])
    assert not torch.equal(pool[2], before[2])


def test_one_token_indices_after_empty_requests_match_vllm_triton(vllm_ops):
    """1-D slot indices (one token a request) with device offsets [0, 0, 1, 2, 2, 3, 4] (requests 0 and 3 empty,
    tokens 4 and 5 no request's): request n's token is row cu_seqlens[n] on slot n, as vLLM's kernel reads it
    (campaign 13: the rows after an empty request were zeros and never stepped). The owned rows and the whole
    pool agree; the empty requests' slots are not written."""
    ops, fk = vllm_ops
    gen = torch.Generator().manual_seed(11)
    H, K, N = 8, 128, 6
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    call = dict(q=r(1, N, H, K).bfloat16().to(DEV), k=r(1, N, H, K).bfloat16().to(DEV),
                v=r(1, N, H, K).bfloat16().to(DEV), raw_g=r(1, N, H, K).bfloat16().to(DEV),
                raw_beta=r(1, N, H).bfloat16().to(DEV), A_log=(r(H) * 0.5).to(DEV), dt_bias=(r(H * K) * 0.5).to(DEV),
                lower_bound=-5.0, cu_seqlens=torch.tensor([0, 0, 1, 2, 2, 3, 4], dtype=torch.int32, device=DEV),
                ssm_state_indices=torch.tensor([3, 5, 7, 9, 11, 13], dtype=torch.int32, device=DEV))
    pool = (r(16, H, K, K) * 0.3).to(DEV)
    a, b = pool.clone(), pool.clone()
    served = fk.STATS["k3.fused_recurrent_kda", "served"]
    with torch.inference_mode():
        o1, _ = ops.fused_recurrent_kda(**call, initial_state=a)
        assert fk.STATS["k3.fused_recurrent_kda", "served"] == served + 1, dict(fk.REASONS)
        o2, _ = ops.fused_recurrent_kda.__wrapped__(**call, initial_state=b)
    torch.cuda.synchronize()
    assert rel_l2(o1[:, :4], o2[:, :4]) < TOL and rel_l2(a, b) < TOL
    assert torch.equal(a[3], pool[3]) and torch.equal(a[9], pool[9])
    assert not torch.equal(a[5], pool[5]) and not torch.equal(a[13], pool[13])
