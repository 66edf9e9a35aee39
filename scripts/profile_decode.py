"""Runs one kda_decode module on one grid point a few times, for a profiler (ncu) to attach to.

    ncu --clock-control none -k regex:kda_decode --launch-skip 4 --launch-count 1 \
        python3 scripts/profile_decode.py --module decode_split8_bf16_o32 --heads 8 --rows 2048

The inputs are bench_decode.py's for that point (pool of --slots slots, random unique slots or
--slot-order, softplus gate), so a profile explains a benchmark row. Each call takes the next of
--lists slot lists in turn, as the benchmark rotates them. Prints the median event time of the
calls after the first two (L2 not flushed: a quick figure, not a benchmark).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode as B  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--module", required=True, help="module record, e.g. decode_split8_f32_o32")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--slots", type=int, default=B.SLOTS)
    p.add_argument("--slot-order", default="random", choices=B.SLOT_ORDERS)
    p.add_argument("--lists", type=int, default=2, help="slot lists the calls rotate through")
    p.add_argument("--calls", type=int, default=8)
    a = p.parse_args()
    if a.rows > a.slots:
        raise SystemExit(f"--rows {a.rows} needs at least that many --slots")
    sdt = torch.bfloat16 if "_bf16_" in a.module else torch.float32
    gen = torch.Generator(device="cuda").manual_seed(a.heads)
    B.SLOTS = a.slots
    pool = torch.empty(a.slots, a.heads, B.V, B.K, dtype=sdt, device="cuda")
    pool.normal_(generator=gen).mul_(0.5)
    case = B.make_case(a.rows, a.heads, gen)
    out = torch.empty(a.rows, a.heads, B.V, dtype=torch.bfloat16, device="cuda")
    slot_bytes = pool[0].numel() * pool.element_size()
    calls = [B.ours_call(a.module, case, pool, B.slot_list(a.rows, a.slot_order, gen, slot_bytes), out)
             for _ in range(a.lists)]
    times = []
    for i in range(a.calls):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        calls[i % a.lists]()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3)
    traffic = a.rows * slot_bytes * 2
    med = statistics.median(times[2:]) if len(times) > 2 else times[-1]
    print(f"{a.module} HV={a.heads} rows={a.rows} {a.slot_order}: {med:.1f} us ({traffic / med / 1e6:.2f} TB/s)")


if __name__ == "__main__":
    main()
