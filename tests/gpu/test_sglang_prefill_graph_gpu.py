"""flashkda_ext's captured SGLang prefill (integrations/sglang/prefill_graph.py) on CUDA: SGLang 0.5.23's real
FlashInferKDAPrefillGraph (from the wheel, copied to .engines/sglang by benchmarks/bench_sglang.py --prepare)
drives PrefillGraphWrapper inside a CUDA graph captured once for a bucket of 2048 tokens and 64 sequence slots,
then replays it for batches of other lengths with the tables refilled in place, as SGLang's breakable prefill
graph does. The bucket takes both launches (the fused chunk-16 kernel by the mean, a chunk-64 module at the
bounds; the device picks one per replay), and the batches fall on both sides. Each replay: the batch's rows
against the float64 recurrence; rows past the batch not written; the live slots' states; every other slot
bitwise unchanged (slot 0 too, where SGLang clamps the padding's -1); and the replay bitwise the same call made
eagerly."""
import sys
import types
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_sglang as bench  # noqa: E402
from gpu_common import rel_l2  # noqa: E402

from flashkda_ext import jit  # noqa: E402
from flashkda_ext.integrations.sglang.prefill_graph import PrefillGraphWrapper, in_band_on_device, launches  # noqa: E402
from flashkda_ext.reference import kda_recurrent  # noqa: E402

DEV, H, D, BUCKET, MAX_SEQS, SLOTS = "cuda", 8, 128, 2048, 64, 80
# (lengths, the fused kernel's band holds): the capture's batch first; then other shapes through the same graph
# (many short sequences: the fused kernel; one long among short ones, few sequences, one-token ones: chunk-64;
# batches ending before the bucket's last token)
BATCHES = [([2048], False), ([32] * 64, True), ([1000] + [20] * 50, False), ([16] * 60, True),
           ([100, 300, 7, 500], False), ([1, 1, 1], False)]


@pytest.fixture(scope="module")
def graph_cls():
    if not (bench.ENGINE / bench.FILES[-1]).exists():
        bench.prepare()
    return bench.load_prefill_graph()


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16])
def test_captured_prefill_replays_other_batches(graph_cls, sdt, lower_bound):
    gen = torch.Generator(device=DEV).manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    q, k, v = (torch.empty(1, BUCKET, H, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    g, beta = torch.empty_like(q), torch.empty(1, BUCKET, H, device=DEV, dtype=torch.bfloat16)
    layer = types.SimpleNamespace(layer_id=0, A_log=(torch.rand(H, generator=gen, device=DEV) - 1.0),
                                  dt_bias=r(H * D) * 0.5, lower_bound=lower_bound)
    pool = torch.empty(SLOTS, H, D, D, device=DEV, dtype=sdt)
    meta = types.SimpleNamespace(cu_seqlens=torch.zeros(MAX_SEQS + 1, dtype=torch.int64, device=DEV),
                                 cache_indices=torch.full((MAX_SEQS,), -1, dtype=torch.int32, device=DEV))
    prefill_graph = graph_cls(wrapper_cls=PrefillGraphWrapper, num_tokens=BUCKET, max_seqs=MAX_SEQS, track=False,
                              device=DEV)

    def load(lens):
        """A new batch in the static buffers and SGLang's tables (padding: empty sequences, slot -1)."""
        slots = torch.randperm(SLOTS, generator=gen, device=DEV)[:len(lens)].tolist()
        if 0 not in slots:
            slots[-1] = 0                                # a live request on slot 0, where the padding points
        for x in (q, k, v):
            x.copy_(r(*x.shape))
        g.copy_(r(*g.shape) - 1.0)
        beta.copy_(r(*beta.shape))
        pool.copy_(r(*pool.shape) * 0.3)
        offsets = [0] + torch.tensor(lens).cumsum(0).tolist()
        meta.cu_seqlens.copy_(torch.tensor(offsets + [offsets[-1]] * (MAX_SEQS - len(lens))))
        meta.cache_indices.copy_(torch.tensor(slots + [-1] * (MAX_SEQS - len(slots)), dtype=torch.int32))
        prefill_graph.fill(meta, list(lens), None)
        return offsets[-1], slots

    def call(states):
        return prefill_graph.run(layer=layer, q=q, k=k, v=v, g=g, beta=beta, ssm_states=states, h_track=None)

    load(BATCHES[0][0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        call(pool.clone())                               # loads the module and makes the layer's wrapper
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        out = call(pool)
    with torch.inference_mode():   # the bucket takes both launches, and the device picks one per replay
        cu, idx = prefill_graph.cu_seqlens, prefill_graph.cache_indices
        args = (q, k, v, g, beta)
        kw = dict(A_log=layer.A_log, dt_bias=layer.dt_bias, gate="softplus" if lower_bound is None else "bounded",
                  lower_bound=lower_bound, state=pool, output_final_state=True, out=torch.empty_like(v))
        assert len(launches(args, kw, cu, idx, cu[1:] > cu[:-1], BUCKET, H)) == 2
    for lens, in_band in BATCHES:
        T, slots = load(lens)
        pool0 = pool.clone()
        with torch.inference_mode():   # out was made in the captured (inference-mode) call
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        gate = dict(gate="softplus") if lower_bound is None else dict(gate="bounded", lower_bound=lower_bound)
        idx = torch.tensor(slots, dtype=torch.int32, device=DEV)
        want_o, want_pool, _ = kda_recurrent(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T],
                                             A_log=layer.A_log, dt_bias=layer.dt_bias, beta_is_logit=True,
                                             cu_seqlens=meta.cu_seqlens[:len(lens) + 1].int(), initial_state=pool0,
                                             state_indices=idx, **gate)
        assert rel_l2(out[:, :T], want_o) < 1e-2, lens
        assert torch.isnan(out[:, T:]).all(), lens
        live = idx.long()
        assert rel_l2(pool[live], want_pool[live]) < (1e-2 if sdt == torch.float32 else 2e-2), lens
        others = [s for s in range(SLOTS) if s not in slots]
        assert torch.equal(pool[others], pool0[others]), lens
        again = pool0.clone()
        with torch.inference_mode():
            eager = call(again)
        torch.cuda.synchronize()
        assert torch.equal(eager[:, :T], out[:, :T]) and torch.equal(again, pool), lens
        rule = next(r for r in jit.routes_for("kda_prefill") if r["name"] == ("fused_chunk16_decay" if lower_bound
                                                                               is None else "fused_chunk16"))
        assert bool(in_band_on_device(rule["when"], cu, cu[1:] > cu[:-1], H)) == in_band, lens
