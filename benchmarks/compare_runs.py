#!/usr/bin/env python
"""Side-by-side medians of result files of the same benchmark (an A/B of one change).

    python benchmarks/compare_runs.py A.json B.json [A2.json B2.json ...]
    python benchmarks/compare_runs.py A1.json,A2.json B1.json,B2.json

Files go in pairs (before, after). For every case and arm present in both, prints the median of
the run's primary timing mode in each and after / before; then the geomean of that ratio per arm,
and per module where the cases name one. A side given as comma-joined files is several rounds of
the same arm (run interleaved with the other side's: A1 B1 B2 A2): each case takes its lowest
median over the rounds, so one round disturbed by something else on the machine does not decide
the row, and the spread between the rounds is printed beside it.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def medians(path: Path):
    d = json.loads(path.read_text())
    mode = d["primary_mode"]
    out, modules = {}, {}
    for case in d["cases"]:
        for arm, rec in case["arms"].items():
            t = (rec.get("time_us") or {}).get(mode) or {}
            if t.get("median"):
                out[(case["name"], arm)] = t["median"]
                module = (case.get("params") or {}).get("module")
                if module:
                    modules[(case["name"], arm)] = module
    return mode, out, modules


def round_medians(paths):
    """(mode, {key: lowest median over the rounds}, {key: max/min over the rounds}, modules) for
    the keys every round has."""
    runs = [medians(p) for p in paths]
    mode = runs[0][0]
    keys = set(runs[0][1]).intersection(*(r[1] for r in runs[1:]))
    best = {k: min(r[1][k] for r in runs) for k in keys}
    spread = {k: max(r[1][k] for r in runs) / best[k] for k in keys}
    modules = {}
    for r in runs:
        modules.update(r[2])
    return mode, best, spread, modules


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def compare(a, b) -> dict:
    """Prints the table; returns {arm: geomean after / before}."""
    a, b = list(a), list(b)
    mode, ma, sa, _ = round_medians(a)
    _, mb, sb, modules = round_medians(b)
    rounds = max(len(a), len(b))
    name = lambda ps: ",".join(p.name for p in ps)
    print(f"## {name(a)} -> {name(b)} ({mode} median, us{', lowest of the rounds' if rounds > 1 else ''})")
    extra = f" {'spread b/a':>11s}" if rounds > 1 else ""
    print(f"{'case':28s} {'arm':14s} {'before':>10s} {'after':>10s} {'after/before':>12s}{extra}")
    ratios, by_module = {}, {}
    for key in sorted(set(ma) & set(mb)):
        r = mb[key] / ma[key]
        ratios.setdefault(key[1], []).append(r)
        if key in modules:
            by_module.setdefault((key[1], modules[key]), []).append(r)
        sp = f" {sa[key]:5.3f}/{sb[key]:5.3f}" if rounds > 1 else ""
        print(f"{key[0]:28s} {key[1]:14s} {ma[key]:10.1f} {mb[key]:10.1f} {r:12.3f}{sp}")
    out = {}
    for arm, rs in ratios.items():
        out[arm] = _geomean(rs)
        print(f"geomean after/before, arm {arm}: {out[arm]:.3f} over {len(rs)} cases "
              f"(min {min(rs):.3f}, max {max(rs):.3f})")
    if len(by_module) > 1:
        for (arm, module), rs in sorted(by_module.items()):
            print(f"  {arm} on {module}: {_geomean(rs):.3f} over {len(rs)} cases")
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) < 2 or len(args) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    for a, b in zip(args[::2], args[1::2]):
        pa, pb = [Path(x) for x in a.split(",")], [Path(x) for x in b.split(",")]
        missing = [p.name for p in pa + pb if not p.exists()]
        if missing:
            print(f"## {a} / {b}: missing {', '.join(missing)}, skipped")
            continue
        compare(pa, pb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
