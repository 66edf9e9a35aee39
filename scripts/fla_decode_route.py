"""GPU timing of fla's decode call (1-D ssm_state_indices, device cu_seqlens) through the adapter, which
since issue 45 routes it to kda_verify with state_indices (idx, -1) (the offsets are only on the device),
against kda_decode on the same rows (the route before, blind to the offsets) and fla's Triton kernel
when fla is installed. CUDA-graph replay, median of 200 replays a point, microseconds.

    python3 scripts/fla_decode_route.py            # H200: rows 1-1024, HV 16 / 32, fp32 and bf16 pools
"""
import os
import statistics

import torch

from flashkda_ext import ops
from flashkda_ext.integrations import fla as fkda_fla

DEV = torch.device("cuda")


def replay_us(fn, reps=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def point(rows, HV, sdtype):
    gen = torch.Generator().manual_seed(rows + HV)
    bf = lambda *s: torch.randn(*s, generator=gen).to(DEV, torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = bf(1, rows, HV, 128), bf(1, rows, HV, 128), bf(1, rows, HV, 128), bf(1, rows, HV, 128), \
        bf(1, rows, HV)
    A_log, dt_bias = torch.rand(HV, device=DEV), torch.randn(HV * 128, device=DEV)
    pool = (torch.randn(rows + 8, HV, 128, 128, generator=gen) * 0.05).to(DEV, sdtype)
    idx = torch.randperm(rows + 8, generator=gen)[:rows].to(DEV, torch.int32)
    cu = torch.arange(rows + 1, dtype=torch.int32, device=DEV)
    out = torch.empty_like(v)
    kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=pool, inplace_final_state=True, state_v_first=True,
              cu_seqlens=cu, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, out=out)
    res = {"adapter (verify route)": replay_us(lambda: fkda_fla.serve_fused_recurrent_kda_fwd(q, k, v, g, beta, **kw)),
           "kda_decode (old route)": replay_us(lambda: ops.kda_decode(
               q[0], k[0], v[0], g[0], beta[0], state=pool, state_indices=idx, A_log=A_log, dt_bias=dt_bias,
               slot_mode="padded", out=out[0]))}
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        os.environ[fkda_fla.ENV_VAR] = "0"
        res["fla Triton"] = replay_us(lambda: fused_recurrent_kda_fwd(q, k, v, g, beta, **kw))
    except ImportError:
        pass
    finally:
        os.environ.pop(fkda_fla.ENV_VAR, None)
    return res


def main():
    print("| rows | HV | pool | " + " | ".join(["adapter (verify route)", "kda_decode (old route)", "fla Triton"]) + " |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for sdtype in (torch.float32, torch.bfloat16):
            for HV in (16, 32):
                for rows in (1, 8, 64, 256, 1024):
                    r = point(rows, HV, sdtype)
                    cells = [f"{r[n]:.1f}" if n in r else "-" for n in
                             ("adapter (verify route)", "kda_decode (old route)", "fla Triton")]
                    print(f"| {rows} | {HV} | {str(sdtype)[6:]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
