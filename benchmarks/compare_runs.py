#!/usr/bin/env python
"""Side-by-side medians of two result files of the same benchmark (an A/B of one change).

    python benchmarks/compare_runs.py A.json B.json [A2.json B2.json ...]

Files go in pairs (before, after). For every case and arm present in both, prints the median of
the run's primary timing mode in each and after / before; then the geomean of that ratio per arm.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def medians(path: Path):
    d = json.loads(path.read_text())
    mode = d["primary_mode"]
    out = {}
    for case in d["cases"]:
        for arm, rec in case["arms"].items():
            t = (rec.get("time_us") or {}).get(mode) or {}
            if t.get("median"):
                out[(case["name"], arm)] = t["median"]
    return mode, out


def compare(a: Path, b: Path) -> None:
    mode, ma = medians(a)
    _, mb = medians(b)
    print(f"## {a.name} -> {b.name} ({mode} median, us)")
    print(f"{'case':28s} {'arm':14s} {'before':>10s} {'after':>10s} {'after/before':>12s}")
    ratios = {}
    for key in sorted(set(ma) & set(mb)):
        r = mb[key] / ma[key]
        ratios.setdefault(key[1], []).append(r)
        print(f"{key[0]:28s} {key[1]:14s} {ma[key]:10.1f} {mb[key]:10.1f} {r:12.3f}")
    for arm, rs in ratios.items():
        g = math.exp(sum(math.log(x) for x in rs) / len(rs))
        print(f"geomean after/before, arm {arm}: {g:.3f} over {len(rs)} cases "
              f"(min {min(rs):.3f}, max {max(rs):.3f})")


def main(argv=None) -> int:
    args = [Path(x) for x in (sys.argv[1:] if argv is None else argv)]
    if len(args) < 2 or len(args) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    for a, b in zip(args[::2], args[1::2]):
        if not (a.exists() and b.exists()):
            print(f"## {a.name} / {b.name}: missing, skipped")
            continue
        compare(a, b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
