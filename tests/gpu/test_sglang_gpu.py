"""flashkda_ext's SGLang adapter against SGLang 0.5.23's own Triton KDA kernels (TritonKDAKernel from the
wheel, as benchmarks/bench_sglang.py loads it) on the same inputs: packed decode, extend (plain and with the
radix-cache track snapshot) and target_verify, fp32 and bf16 pools, H 8 and 32, K = V = 128.
Skips without CUDA or without Triton; prepares .engines/sglang/ from the wheel when it is missing (the
wheel: FLASHKDA_EXT_ENGINE_WHEELS or .cache/engines/)."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
    pytest.skip("needs a CUDA device and Triton", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_sglang as bench  # noqa: E402

from flashkda_ext.integrations.sglang import FlashKDAExtKernel  # noqa: E402

DEV = "cuda"


@pytest.fixture(scope="module")
def kernels():
    if not (bench.ENGINE / "VERSION").exists():
        bench.prepare()
    return FlashKDAExtKernel(), bench.load_sglang()


STATES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("sdt", STATES)
@pytest.mark.parametrize("H", [8, 32])
@pytest.mark.parametrize("rows", [1, 8, 64, 1024])
def test_packed_decode_agrees(kernels, sdt, H, rows):
    ours, sglang = kernels
    gen = torch.Generator(device=DEV).manual_seed(rows + H)
    inp = bench.decode_inputs(rows, H, sdt, gen, DEV, slots=2 * rows + 4)
    args = (inp.pop("mixed_qkv"), inp.pop("a"), inp.pop("b"))
    res = bench.agreement("packed_decode", ours, sglang, args, inp)
    assert res["ok"], res


@pytest.mark.parametrize("sdt", STATES)
@pytest.mark.parametrize("H", [8, 32])
@pytest.mark.parametrize("rows, length", [(1, 1000), (16, 130), (256, 16)])
def test_extend_agrees(kernels, sdt, H, rows, length):
    ours, sglang = kernels
    gen = torch.Generator(device=DEV).manual_seed(rows + H + length)
    args, kw = bench.extend_inputs([length] * rows, H, sdt, gen, DEV, slots=2 * rows + 4)
    res = bench.agreement("extend", ours, sglang, args, kw)
    assert res["ok"], res


@pytest.mark.parametrize("sdt", STATES)
@pytest.mark.parametrize("lens", [[1000], [4000] + [100] * 32, [130] * 16], ids=["1x1000", "1x4000+32x100", "16x130"])
def test_extend_bounded_gate_agrees(kernels, sdt, lens):
    """Kimi K3's extend: the bounded gate (lower_bound -5) from raw gate and beta logits."""
    ours, sglang = kernels
    gen = torch.Generator(device=DEV).manual_seed(len(lens))
    args, kw = bench.extend_inputs(lens, 8, sdt, gen, DEV, slots=2 * len(lens) + 4, lower_bound=-5.0)
    res = bench.agreement("extend", ours, sglang, args, kw)
    assert res["ok"], res


@pytest.mark.parametrize("sdt", STATES)
def test_extend_track_snapshot_agrees(kernels, sdt):
    """SGLang's radix-cache track path: both kernels write the fp32 state entering chunk track_chunk_idx."""
    ours, sglang = kernels
    gen = torch.Generator(device=DEV).manual_seed(5)
    args, kw = bench.extend_inputs([300] * 3, 8, sdt, gen, DEV, slots=16)
    chunk_idx = torch.tensor([4, -1, 1], dtype=torch.int32, device=DEV)
    snaps, outs = [], []
    for kern in (ours, sglang):
        track = torch.full((3, 8, 128, 128), 7.0, device=DEV)
        kw2 = dict(kw, ssm_states=kw["ssm_states"].clone(), return_intermediate_states=True, track_state=track,
                   track_chunk_idx=chunk_idx, track_ssm_h_src=torch.tensor([4, 11], device=DEV),
                   track_ssm_h_batch_src=torch.tensor([0, 2], device=DEV))
        with torch.inference_mode():
            o, _ = kern.extend(*args, **kw2)
        snaps.append(track)
        outs.append(o)
    assert bench.harness.rel_l2(outs[0].float(), outs[1].float()) < 2e-2
    assert bench.harness.rel_l2(snaps[0][[0, 2]], snaps[1][[0, 2]]) < 1e-2
    assert torch.equal(snaps[0][1], snaps[1][1]) and (snaps[0][1] == 7.0).all()


@pytest.mark.parametrize("sdt", STATES)
@pytest.mark.parametrize("H", [8, 32])
@pytest.mark.parametrize("rows", [1, 32, 512])
def test_target_verify_agrees(kernels, sdt, H, rows):
    ours, sglang = kernels
    gen = torch.Generator(device=DEV).manual_seed(rows * 3 + H)
    args, kw = bench.verify_inputs(rows, 3, H, sdt, gen, DEV, slots=2 * rows + 4)
    res = bench.agreement("target_verify", ours, sglang, args, kw)
    assert res["ok"], res


def test_bench_runs_a_small_grid(tmp_path):
    rc = bench.main(["--quick", "--rows", "1,64", "--heads", "8", "--reps", "3", "--warmup", "1", "--rounds", "1",
                     "--no-plot", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    assert {p.name for p in tmp_path.glob("*.json")} >= {"sglang_decode.json", "sglang_extend.json",
                                                          "sglang_verify.json"}
