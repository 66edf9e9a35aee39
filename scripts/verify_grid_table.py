"""Issue 30's verify grid as perf-notes tables, from bench_verify.py results (one or more JSON files,
e.g. one per pool dtype): per pool dtype a T x HV table of "routed / fla us, ratio, % of floor (stem)",
then the geomean over fla of every point together and per dtype, the slowest point, the lowest % of the
floor from 2048 work items, and, with --before (an earlier run's JSON files), each point's routed time
against that run's. --arm-for stage2=stage2chain reads the points routed to stage2 from that arm.

    python3 scripts/verify_grid_table.py RUN.json [RUN2.json] [--before OLD.json ...]
"""
from __future__ import annotations

import argparse
import json
import math


def points(paths):
    out = {}
    for path in paths:
        for c in json.load(open(path))["cases"]:
            out[c["name"]] = c
    return out


def median(case, arm):
    a = case["arms"].get(arm)
    return None if a is None else a["time_us"]["graph"]["median"]


def pct(case, arm):
    return case["arms"][arm]["bandwidth"]["graph"]["pct_copy"]


def fmt_us(t):
    return f"{t:.1f}" if t < 1000 else f"{t:.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--before", nargs="*", default=[])
    ap.add_argument("--arm-for", action="append", default=[], metavar="STEM=ARM",
                    help="read the points routed to STEM from arm ARM of the same run (a probe whose code the "
                         "routed module took since)")
    args = ap.parse_args()
    pts = points(args.runs)
    swap = dict(x.split("=", 1) for x in args.arm_for)
    for c in pts.values():
        arm = swap.get(c["params"]["module"].split("_")[1])
        if arm:
            c["arms"]["ours"] = c["arms"][arm]
    old = points(args.before) if args.before else {}
    ratios, by_state, floor = [], {}, {}
    for state in ("f32", "bf16"):
        cases = [c for c in pts.values() if c["params"]["state"] == state]
        if not cases:
            continue
        Ts = sorted({c["params"]["T"] for c in cases})
        Hs = sorted({c["params"]["heads"] for c in cases})
        Rs = sorted({c["params"]["rows"] for c in cases})
        print(f"\n{state} pool (routed / fla us, ratio, % of floor; the routed module's stem):\n")
        print("| T | HV | " + " | ".join(str(r) for r in Rs) + " |")
        print("|---" * (len(Rs) + 2) + "|")
        for T in Ts:
            for H in Hs:
                cells = []
                for R in Rs:
                    c = pts.get(f"{state}_T{T}_h{H}_r{R}")
                    if c is None:
                        cells.append("-")
                        continue
                    ours, fla = median(c, "ours"), median(c, "fla")
                    stem = c["params"]["module"].split("_")[1]
                    p = pct(c, "ours")
                    if c["params"]["work_items"] >= 2048:
                        floor[state] = min(floor.get(state, 1e9), p)
                    if fla is None:
                        cells.append(f"{fmt_us(ours)}, {p:.0f}% ({stem})")
                        continue
                    r = fla / ours
                    ratios.append(r)
                    by_state.setdefault(state, []).append(r)
                    cells.append(f"{fmt_us(ours)} / {fmt_us(fla)}, {r:.2f}x, {p:.0f}% ({stem})")
                print(f"| {T} | {H} | " + " | ".join(cells) + " |")
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print()
    if ratios:
        print(f"all {len(ratios)} points: geomean {gm(ratios):.3f}x over fla, slowest {min(ratios):.2f}x")
    for state, rs in by_state.items():
        print(f"{state}: {len(rs)} points, geomean {gm(rs):.3f}x, slowest {min(rs):.2f}x, "
              f"lowest % of the floor from 2048 work items {floor.get(state, float('nan')):.1f}%")
    if old:
        rel = {}
        for name, c in pts.items():
            if name in old:
                rel[name] = median(c, "ours") / median(old[name], "ours")
        for state in ("f32", "bf16"):
            xs = [v for k, v in rel.items() if k.startswith(state + "_")]
            if xs:
                print(f"{state}: routed time against --before, geomean {gm(xs):.3f}, "
                      f"range {min(xs):.3f}-{max(xs):.3f} over {len(xs)} points")


if __name__ == "__main__":
    main()
