"""Runs kda_prefill on one shape a few times, for a profiler (ncu) to attach to, or (--kernels) prints
each kernel's GPU time from torch.profiler, or (--timeline) one call's kernels on a timeline.

    ncu --clock-control none -k regex:kda_prep --launch-skip 2 --launch-count 1 \
        python3 scripts/profile_prefill.py --tokens 32768 --heads 16
    python3 scripts/profile_prefill.py --lens 1024,64 --repeat 8 --kernels --module prefill_vt64_f32
    python3 scripts/profile_prefill.py --tokens 32768 --heads 8 --timeline

--timeline shows when each kernel of the last call ran, from the first kernel's start (torch.profiler's
device spans: a kernel's first to its last CTA), and how long two kernels ran side by side: whether the
state pass overlaps the prep, ncu (which serializes kernels) cannot show. A PDL dependent's span starts
when its CTAs start, so the routed modules' state pass shows beside the prep even where its CTAs only
wait there (griddepcontrol.wait) for the prep to complete.

Fresh random bf16 inputs, softplus gate (or --gate bounded), fp32 initial state; the first calls
load the module and warm the allocator, so skip them in the profiler. Prints the median event
time of the warm calls (L2 not flushed: a quick before/after figure, not a benchmark).
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import flashkda_ext
from flashkda_ext import jit


def seq_lens(a) -> list[int]:
    if a.lens:
        return [int(x) for x in a.lens.split(",")] * a.repeat
    base, extra = divmod(a.tokens, a.seqs)
    return [base + (i < extra) for i in range(a.seqs)]


def kernel_times(call, calls: int) -> dict[str, float]:
    """Mean GPU time per call of each kernel name (us), from torch.profiler's device events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {k: v / calls for k, v in total.items()}


def call_timeline(call, calls: int) -> list[tuple[str, float, float]]:
    """[(kernel name, start us, end us)] of the last of `calls` calls, from its first kernel's start."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(calls - 1):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    t0 = spans[0][0] if spans else 0.0
    return [(name, start - t0, end - t0) for start, end, name in spans]


def timeline_lines(spans: list[tuple[str, float, float]]) -> list[str]:
    """One line a kernel (start, end, duration in us), then how long each pair of kernels ran side by side."""
    lines = [f"  {'start us':>9} {'end us':>9} {'dur us':>9}  kernel"]
    lines += [f"  {s:9.1f} {e:9.1f} {e - s:9.1f}  {n[:80]}" for n, s, e in spans]
    for i, (na, sa, ea) in enumerate(spans):
        for nb, sb, eb in spans[i + 1:]:
            both = min(ea, eb) - max(sa, sb)
            if both > 0:
                lines.append(f"  side by side {both:.1f} us: {na[:40]} | {nb[:40]}")
    end = max((e for _, _, e in spans), default=0.0)
    busy = sum(e - s for _, s, e in spans)
    lines.append(f"  call: {end:.1f} us from the first kernel's start to the last one's end; kernels' sum {busy:.1f} us")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--seqs", type=int, default=1, help="equal-length sequences packed")
    p.add_argument("--lens", default="", help="comma list of sequence lengths (overrides --tokens/--seqs)")
    p.add_argument("--repeat", type=int, default=1, help="repeat the --lens list this many times")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--gate", default="softplus", choices=["softplus", "bounded"])
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--module", default="", help="call this module record directly instead of the route's")
    p.add_argument("--kernels", action="store_true", help="print each kernel's GPU time (torch.profiler)")
    p.add_argument("--timeline", action="store_true", help="print the last call's kernels on a timeline (torch.profiler)")
    a = p.parse_args()
    torch.manual_seed(0)
    lens = seq_lens(a)
    dev, T, N, H, D = torch.device("cuda"), sum(lens), len(lens), a.heads, 128
    bf = dict(device=dev, dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, T, H, D, **bf) for _ in range(3))
    g = torch.randn(1, T, H, D, **bf)
    beta = torch.randn(1, T, H, **bf)
    A_log = torch.rand(H, device=dev) * 2.0
    dt_bias = torch.randn(H * D, device=dev) * 0.5
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    init = torch.randn(N, H, D, D, device=dev) * 0.1
    kw = dict(A_log=A_log, dt_bias=dt_bias, gate=a.gate, cu_seqlens=cu, initial_state=init)
    if a.gate == "bounded":
        kw["lower_bound"] = -5.0
    if a.module:
        # the module's own ABI (docs/architecture.md), as benchmarks/bench_prefill.py --module calls it
        from flashkda_ext import validation
        import tvm_ffi
        mod = jit.load_module(a.module)
        ws = torch.empty(int(mod["kda_prefill_workspace_bytes"](T, N, H)), dtype=torch.uint8, device=dev)
        out = torch.empty(1, T, H, D, **bf)
        final = torch.empty_like(init)
        gm = validation.GATE_MODE[a.gate]
        lb = -5.0 if a.gate == "bounded" else 0.0

        def call():
            with tvm_ffi.use_torch_stream():
                mod["kda_prefill"](q, k, v, g, beta, A_log, dt_bias, cu, init, final, None, None, out, ws, gm, lb,
                                   D ** -0.5, True, False, 0)
    else:
        def call():
            flashkda_ext.kda_prefill(q, k, v, g, beta, **kw)
    times = []
    for _ in range(a.calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    warm = sorted(times[1:] or times)
    name = a.lens and f"lens {a.lens} x{a.repeat}" or f"T={T} N={N}"
    print(f"{name} H={H} gate={a.gate}{' ' + a.module if a.module else ''}: median "
          f"{warm[len(warm) // 2]:.3f} ms over {len(warm)} warm calls (event time, warm L2)")
    if a.timeline:
        print("\n".join(timeline_lines(call_timeline(call, a.calls))))
    if a.kernels:
        for kname, us in sorted(kernel_times(call, a.calls).items(), key=lambda kv: -kv[1]):
            print(f"  {us:9.1f} us  {kname[:90]}")


if __name__ == "__main__":
    main()
