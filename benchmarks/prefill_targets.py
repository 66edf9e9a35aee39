#!/usr/bin/env python
"""Issue 8's prefill targets, read from bench_prefill.py result files (no GPU needed).

Per file (usually one head count) and over all files together:
  - bounded gate: ours against the better of fla (measured in the same run) and FlashKDA (times quoted
    in issue 8, measured on an H200; FlashKDA is not installable here), event time: rows not ahead,
    and the geomean over that per-row best (target >= 2x);
  - every row: event-time geomean over fla (target >= 4x) and the lowest row (target >= 1.5x);
  - kernel-only geomean over fla's kernels (target >= 2x), when the file has the kernel mode;
  - 32768 tokens at H16: ours <= 0.5 ms.

    python benchmarks/prefill_targets.py benchmarks/results/<run>/prefill_h16.json [more.json ...]

Files whose cases carry a cuDNN arm (bench_prefill.py --peers cudnn) are also read against issue 46's
targets: not slower than cuDNN wherever cuDNN's output is finite, geomean >= 1.5x cuDNN there, the long
prompts (B1 T32K H8 <= 0.25 ms, H16 <= 0.45 ms, 1M tokens H16 <= 12 ms per gate) and the throughput
shapes (64x512 H16, 4x4096 H32, 8K H64 <= 0.5 ms each).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# FlashKDA's event times in us as issue 8 quotes them (H16, bounded gate). Its B = 1 rows are quoted
# as one range over H 1..8; the low end (FlashKDA's best) is taken for every H.
FLASHKDA_US = {
    "H16 4x64": 43.0, "H16 16x64": 70.0, "H16 64x64": 200.0, "H16 8x(1024+64)": 300.0, "H16 4x4096": 650.0,
    "H16 8192": 940.0, "H16 16384": 1850.0, "H16 32768": 3670.0,
    **{f"B1 T2048 H{h}": 230.0 for h in (1, 2, 4, 8)},
    **{f"B1 T16384 H{h}": 1600.0 for h in (1, 2, 4, 8)},
}
EVENT_GEOMEAN = 4.0      # over fla, every row
EVENT_MIN = 1.5
BEST_GEOMEAN = 2.0       # over the per-row best of fla and FlashKDA, bounded gate
KERNEL_GEOMEAN = 2.0     # over fla's kernels
LONG_CASE, LONG_US = "H16 32768", 500.0


def _med(arm, mode):
    return ((arm or {}).get("time_us", {}).get(mode) or {}).get("median")


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def evaluate(cases: list) -> dict:
    """The targets over a list of bench_prefill cases."""
    r = {"rows": 0, "event": [], "kernel": [], "best": [], "not_ahead": [], "long": []}
    for c in cases:
        p, arms = c["params"], c["arms"]
        ours = _med(arms.get("ours"), "eager")
        if ours is None:
            continue
        r["rows"] += 1
        fla = _med(arms.get("fla"), "eager")
        name = f"{p['case']} {p['gate']}"
        if fla:
            r["event"].append((name, fla / ours))
        ko, kf = _med(arms.get("ours"), "kernel"), _med(arms.get("fla"), "kernel")
        if ko and kf:
            r["kernel"].append((name, kf / ko))
        if p["gate"] == "bounded":
            peers = {k: v for k, v in (("fla", fla), ("FlashKDA", FLASHKDA_US.get(p["case"]))) if v}
            if peers:
                who, best = min(peers.items(), key=lambda kv: kv[1])
                r["best"].append((name, best / ours, who))
                if best <= ours:
                    r["not_ahead"].append((name, ours, who, best))
        if p["case"] == LONG_CASE:
            r["long"].append((name, ours))
    return r


CUDNN_GEOMEAN = 1.5
ISSUE46_MS = {"H8 B1 T32K": 0.25, "H16 B1 T32K": 0.45, "H16 B1 T1M": 12.0,
              "H16 64x512": 0.5, "H32 4x4096": 0.5, "H64 B1 T8K": 0.5}


def evaluate_cudnn(cases: list) -> dict:
    """Issue 46's targets over bench_prefill cases that carry a cuDNN arm or a cuDNN check (notes.checks:
    whether cuDNN's output was finite); times are the eager medians."""
    r = {"ratios": [], "behind": [], "nonfinite": [], "limits": []}
    for c in cases:
        p, arms = c["params"], c["arms"]
        name = f"{p['case']} {p['gate']}"
        chk = ((c.get("notes") or {}).get("checks") or {}).get("cudnn") or {}
        ours, cud = _med(arms.get("ours"), "eager"), _med(arms.get("cudnn"), "eager")
        if ours and cud:
            if chk.get("finite", True):
                r["ratios"].append((name, cud / ours))
                if cud < ours:
                    r["behind"].append((name, ours / 1e3, cud / 1e3))
            else:
                r["nonfinite"].append(name)
        if p["case"] in ISSUE46_MS and ours:
            r["limits"].append((name, ours / 1e3, ISSUE46_MS[p["case"]]))
    return r


def report_cudnn(title: str, r: dict) -> str:
    lines = [f"== {title}: against cuDNN (issue 46)"]
    if r["ratios"]:
        g = _geomean([x for _, x in r["ratios"]])
        lines.append(f"  where cuDNN is finite: geomean {g:.2f}x (target {CUDNN_GEOMEAN:g}x) over {len(r['ratios'])} "
                     f"rows; behind at {len(r['behind'])}: " + ", ".join(
                         f"{n} {o:.3f} vs {c:.3f} ms" for n, o, c in r["behind"]))
    if r["nonfinite"]:
        lines.append(f"  cuDNN non-finite at {len(r['nonfinite'])}: " + ", ".join(r["nonfinite"]))
    for name, ms, lim in r["limits"]:
        lines.append(f"  {name}: {ms:.3f} ms (target <= {lim:g} ms){'' if ms <= lim else '  MISSED'}")
    return "\n".join(lines)


def report(title: str, r: dict) -> str:
    fmt = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    ev = [x for _, x in r["event"]]
    lines = [f"== {title}: {r['rows']} rows"]
    if r["best"]:
        g = _geomean([x for _, x, _ in r["best"]])
        lines.append(f"  bounded, over the better of fla and FlashKDA (quoted): geomean {fmt(g)}x "
                     f"(target {BEST_GEOMEAN:g}x) over {len(r['best'])} rows; not ahead at "
                     f"{len(r['not_ahead'])}: " + ", ".join(
                         f"{n} {o:.1f} us vs {w} {b:.1f}" for n, o, w, b in r["not_ahead"]))
        low = sorted(r["best"], key=lambda t: t[1])[:3]
        lines.append("    lowest: " + ", ".join(f"{n} {x:.2f}x ({w})" for n, x, w in low))
    if ev:
        worst = min(r["event"], key=lambda t: t[1])
        lines.append(f"  event time over fla: geomean {fmt(_geomean(ev))}x (target {EVENT_GEOMEAN:g}x), "
                     f"min {worst[1]:.2f}x at {worst[0]} (target {EVENT_MIN:g}x)")
    if r["kernel"]:
        worst = min(r["kernel"], key=lambda t: t[1])
        lines.append(f"  kernel time over fla: geomean {fmt(_geomean([x for _, x in r['kernel']]))}x "
                     f"(target {KERNEL_GEOMEAN:g}x), min {worst[1]:.2f}x at {worst[0]}")
    for name, us in r["long"]:
        lines.append(f"  {name}: {us / 1000:.3f} ms (target <= {LONG_US / 1000:g} ms)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="bench_prefill.py result JSON files")
    args = ap.parse_args(argv)
    everything = []
    for path in args.results:
        doc = json.loads(Path(path).read_text())
        cases = doc["cases"]
        everything += cases
        print(report(Path(path).name, evaluate(cases)))
        if any("cudnn" in c["arms"] for c in cases):
            print(report_cudnn(Path(path).name, evaluate_cudnn(cases)))
    if len(args.results) > 1:
        print(report("all files", evaluate(everything)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
