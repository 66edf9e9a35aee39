"""Runs kda_prefill on one shape a few times, for a profiler (ncu) to attach to.

    ncu --clock-control none -k regex:kda_prep --launch-skip 2 --launch-count 1 \
        python3 scripts/profile_prefill.py --tokens 32768 --heads 16

Fresh random bf16 inputs, softplus gate (or --gate bounded), fp32 initial state; the first calls
load the module and warm the allocator, so skip them in the profiler. Prints the median event
time of the warm calls (L2 not flushed: a quick before/after figure, not a benchmark).
"""
from __future__ import annotations

import argparse

import torch

import flashkda_ext


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--seqs", type=int, default=1, help="equal-length sequences packed")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--gate", default="softplus", choices=["softplus", "bounded"])
    p.add_argument("--calls", type=int, default=4)
    a = p.parse_args()
    torch.manual_seed(0)
    dev, T, H, D = torch.device("cuda"), a.tokens, a.heads, 128
    bf = dict(device=dev, dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, T, H, D, **bf) for _ in range(3))
    g = torch.randn(1, T, H, D, **bf)
    beta = torch.randn(1, T, H, **bf)
    A_log = torch.rand(H, device=dev) * 2.0
    dt_bias = torch.randn(H * D, device=dev) * 0.5
    cu = torch.linspace(0, T, a.seqs + 1, device=dev).round().to(torch.int32)
    init = torch.randn(a.seqs, H, D, D, device=dev) * 0.1
    kw = dict(A_log=A_log, dt_bias=dt_bias, gate=a.gate, cu_seqlens=cu, initial_state=init)
    if a.gate == "bounded":
        kw["lower_bound"] = -5.0
    times = []
    for _ in range(a.calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        flashkda_ext.kda_prefill(q, k, v, g, beta, **kw)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    warm = sorted(times[1:] or times)
    print(f"T={T} N={a.seqs} H={H} gate={a.gate}: median {warm[len(warm) // 2]:.3f} ms over {len(warm)} warm calls "
          f"(event time, warm L2)")

if __name__ == "__main__":
    main()
