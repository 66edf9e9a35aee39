"""Context-parallel prefill simulated on one GPU (flashkda_ext.context_parallel.simulate, the same calls
cp_prefill makes on each rank) against one-GPU kda_prefill: 1 x 8192 tokens, H = HV = 16, K = V = 128,
bf16 inputs, R = 2, 4, 8 ranks with the default (equal, mostly off-chunk) cuts; dense fp32 and bf16 pool
states (padding, null slot 0, untouched slots bitwise), checkpoints every 64 tokens (aligned cuts),
bitwise run to run; one case also against the float64 token recurrence. And, with 2+ GPUs, cp_prefill
over NCCL bitwise against simulate() on the same GPU model.

Tolerance: rel. L2 6e-3 (tests/gpu/test_prefill_gpu.py) between the CP result and one-GPU prefill (the
cuts move chunk boundaries, so the two differ by about the kernels' own bf16 error, not bitwise).
"""
from __future__ import annotations

import os
import random
import socket

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import flashkda_ext as fk  # noqa: E402
from flashkda_ext import context_parallel as cp  # noqa: E402
from flashkda_ext.reference import kda_recurrent  # noqa: E402
from gpu_common import bits, rel_l2  # noqa: E402

DEV = torch.device("cuda")
H = HV = 16
K = V = 128
TOL = 6e-3
LAYOUTS = {"one_sequence": [8192], "three_sequences": [1000, 5000, 2192], "with_empty": [4000, 0, 4192]}


def make(lens, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEV)

    d = dict(q=randn(1, T, H, K).bfloat16(), k=randn(1, T, H, K).bfloat16(), v=randn(1, T, HV, V).bfloat16(),
             g=randn(1, T, HV, K).bfloat16(), beta=randn(1, T, HV).bfloat16())
    gk = dict(gate="softplus", A_log=torch.rand(HV, generator=gen, device=DEV) * 0.5 - 1.0,
              dt_bias=randn(HV * K) * 0.5)
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    return d, gk, cu, gen


def one_gpu(d, gk, cu, **kw):
    return fk.kda_prefill(d["q"], d["k"], d["v"], d["g"], d["beta"],
                          cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV), **gk, **kw)


def simulated(d, gk, p, **kw):
    return cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=p, **gk, **kw)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_simulate_dense_matches_one_gpu(layout, world_size):
    seed = random.SystemRandom().randrange(1 << 31)
    d, gk, cu, gen = make(LAYOUTS[layout], seed)
    h0 = torch.randn(len(cu) - 1, HV, V, K, generator=gen, device=DEV) * 0.5
    p = cp.plan(cu, world_size)
    out1, fin1 = one_gpu(d, gk, cu, initial_state=h0)
    res = simulated(d, gk, p, initial_state=h0)
    torch.cuda.synchronize()
    out = torch.cat([r[0] for r in res], dim=1)
    assert not torch.isnan(out).any()
    assert rel_l2(out, out1) < TOL and rel_l2(res[0][1], fin1) < TOL, f"seed {seed}, cuts {p.cuts}"
    again = simulated(d, gk, p, initial_state=h0)
    for x, y in zip(res, again):
        assert torch.equal(bits(x[0]), bits(y[0])) and torch.equal(bits(x[1]), bits(y[1]))


@pytest.mark.parametrize("world_size", [2, 8])
def test_simulate_bf16_pool_with_checkpoints(world_size):
    d, gk, cu, gen = make(LAYOUTS["three_sequences"], 11 + world_size)
    pool = (torch.randn(9, HV, V, K, generator=gen, device=DEV) * 0.5).bfloat16()
    idx = torch.tensor([5, 0, 2], dtype=torch.int32, device=DEV)       # slot 0 is padding (null_slot0)
    p = cp.plan(cu, world_size, checkpoint_every=64)                    # cuts moved onto checkpoints
    pool1, pool2 = pool.clone(), pool.clone()
    # max_seqlen: device offsets give one-device prefill T // 64 checkpoint slots without it, and the
    # plan's host offsets give simulate() the longest sequence's count
    out1, _, ck1 = one_gpu(d, gk, cu, state=pool1, state_indices=idx, null_slot0=True, checkpoint_every=64,
                           max_seqlen=max(LAYOUTS["three_sequences"]))
    res = simulated(d, gk, p, state=pool2, state_indices=idx, null_slot0=True, checkpoint_every=64)
    torch.cuda.synchronize()
    out = torch.cat([r[0] for r in res], dim=1)
    assert rel_l2(out, out1) < TOL
    for slot in (5, 2):
        assert rel_l2(pool2[slot], pool1[slot]) < TOL
    for slot in (0, 1, 3, 4, 6, 7, 8):
        assert torch.equal(bits(pool2[slot]), bits(pool[slot])), f"slot {slot} touched"
    have = [~torch.isnan(r[2].float()).flatten(2).all(-1) for r in res]
    assert int(torch.stack(have).sum(0).max()) <= 1
    merged = torch.full_like(ck1, float("nan"))
    for r, h in zip(res, have):
        merged[h] = r[2][h]
    want = ~torch.isnan(ck1.float()).flatten(2).all(-1)
    assert torch.equal(torch.stack(have).any(0), want)
    assert rel_l2(merged[want], ck1[want]) < TOL


def test_simulate_against_float64_recurrence():
    d, gk, cu, gen = make([3000, 5192], 5)
    h0 = torch.randn(2, HV, V, K, generator=gen, device=DEV) * 0.5
    res = simulated(d, gk, cp.plan(cu, 8), initial_state=h0)
    ref_out, ref_fin, _ = kda_recurrent(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=cu, initial_state=h0,
                                        **gk)
    out = torch.cat([r[0] for r in res], dim=1)
    assert rel_l2(out, ref_out) < TOL and rel_l2(res[0][1], ref_fin) < TOL


def test_summary_on_cuda_is_affine():
    """S_end = S_start @ A + B with A, B from the CUDA kda_prefill, against its own prefill from S_start."""
    d, gk, cu, gen = make([2048], 3)
    s = cp.segment_summary(d["q"], d["k"], d["v"], d["g"], d["beta"], **gk)
    S0 = torch.randn(1, HV, V, K, generator=gen, device=DEV) * 0.5
    _, fin = one_gpu(d, gk, cu, initial_state=S0)
    assert rel_l2(cp.apply_summary(S0[0], s), fin[0]) < TOL


def test_one_call_summary_on_cuda_matches_two_calls():
    """The one-call form (2 HV value heads in one CUDA prefill) against the two-call maps and the
    affine check. Written without a GPU run: the next device run is its first."""
    d, gk, cu, gen = make([2048], 5)
    two = cp.segment_summary(d["q"], d["k"], d["v"], d["g"], d["beta"], **gk)
    one = cp.segment_summary(d["q"], d["k"], d["v"], d["g"], d["beta"], one_call=True, **gk)
    assert rel_l2(one.A, two.A) < TOL and rel_l2(one.B, two.B) < TOL
    S0 = torch.randn(1, HV, V, K, generator=gen, device=DEV) * 0.5
    _, fin = one_gpu(d, gk, cu, initial_state=S0)
    assert rel_l2(cp.apply_summary(S0[0], one), fin[0]) < TOL


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_worker(rank, world_size, port):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        dev = torch.device("cuda", rank)
        d, gk, cu, gen = make(LAYOUTS["three_sequences"], 21)   # the same inputs on every GPU (same Philox stream)
        h0 = torch.randn(3, HV, V, K, generator=gen, device=dev) * 0.5   # the current device: this rank's GPU
        p = cp.plan(cu, world_size)
        sim = cp.simulate(d["q"], d["k"], d["v"], d["g"], d["beta"], plan=p, initial_state=h0, **gk)
        a, b = p.token_range(rank)
        local = [d[n][:, a:b].clone() for n in ("q", "k", "v", "g", "beta")]
        mine = cp.cp_prefill(*local, plan=p, initial_state=h0, **gk)
        torch.cuda.synchronize()
        assert torch.equal(bits(mine[0]), bits(sim[rank][0])), f"rank {rank}: out differs from simulate()"
        assert torch.equal(bits(mine[1]), bits(sim[rank][1])), f"rank {rank}: final differs from simulate()"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_nccl_ranks_match_simulate_bitwise():
    import torch.multiprocessing as mp
    world_size = min(torch.cuda.device_count(), 8)
    mp.spawn(_nccl_worker, args=(world_size, _free_port()), nprocs=world_size, join=True)
