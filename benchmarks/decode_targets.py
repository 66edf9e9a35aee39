#!/usr/bin/env python
"""Issue 6's decode targets, read from a bench_decode.py result file (no GPU needed).

For each state dtype in the file: the points that miss each target, the geomeans against fla, and how
far a geomean could go at all. The cap takes each point's best possible time as
max(state bytes / copy ceiling of the same run, F), F being a floor per call, with fla's times as
measured. It needs the fla arm; the slot-copy arm (--slot-copy) and the public-op arm (--op-arm) are
quoted when present.

    python benchmarks/decode_targets.py benchmarks/results/<run>/<file>.json [--floors 1,2,3]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

BANDWIDTH_TARGET = {"f32": 90.0, "bf16": 85.0}   # % of copy at >= 2048 work items
BANDWIDTH_FROM = 2048                             # work items
SMALL_MAX = 128                                   # work items of the latency targets
SMALL_GRAPH_US = 6.0
SMALL_EAGER_US = 20.0
COPIES = ("copy_p1", "copy_p2", "copy_p4")


def _med(arm, mode):
    return ((arm or {}).get("time_us", {}).get(mode) or {}).get("median")


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _pct(arm):
    return ((arm or {}).get("bandwidth", {}).get("graph") or {}).get("pct_copy")


def evaluate(doc: dict, floors=(1.0, 2.0, 3.0)) -> dict:
    """{state: {...}} from one bench_decode result document."""
    copy_bps = doc["copy_ceiling"]["GBps"] * 1e9
    out = {}
    for state in sorted({c["params"]["state"] for c in doc["cases"]}):
        cases = [c for c in doc["cases"] if c["params"]["state"] == state]
        r = {"points": len(cases), "bandwidth_misses": [], "small_graph_misses": [], "small_eager_misses": [],
             "not_faster_than_fla": [], "geomean": {}, "cap": {}}
        ratios = {}
        caps = {f: {"graph": [], "wall": []} for f in floors}
        for c in cases:
            p, arms = c["params"], c["arms"]
            ours, fla, op = arms.get("ours"), arms.get("fla"), arms.get("op")
            if ours is None:
                continue
            copy = min((arms[k] for k in COPIES if _med(arms.get(k), "graph")),
                       key=lambda a: _med(a, "graph"), default=None)
            where = (p["heads"], p["rows"])
            if p["work_items"] >= BANDWIDTH_FROM and (_pct(ours) or 0) < BANDWIDTH_TARGET.get(state, 0):
                r["bandwidth_misses"].append(where + (_pct(ours), _pct(copy)))
            if p["work_items"] <= SMALL_MAX:
                if _med(ours, "graph") > SMALL_GRAPH_US:
                    r["small_graph_misses"].append(where + (_med(ours, "graph"), _med(copy, "graph")))
                eager = _med(op, "wall") if op else _med(ours, "wall")
                if eager is not None and eager > SMALL_EAGER_US:
                    r["small_eager_misses"].append(where + (eager,))
            if fla is None:
                continue
            if _med(fla, "graph") <= _med(ours, "graph"):
                r["not_faster_than_fla"].append(where)
            for who, arm in (("ours", ours), ("op", op)):
                for mode in ("graph", "eager", "wall"):
                    if _med(arm, mode) and _med(fla, mode):
                        ratios.setdefault(f"{who}_{mode}", []).append(_med(fla, mode) / _med(arm, mode))
            ideal = p["state_bytes"] / copy_bps * 1e6
            for f in floors:
                for mode in ("graph", "wall"):
                    caps[f][mode].append(_med(fla, mode) / max(ideal, f))
        r["geomean"] = {k: _geomean(v) for k, v in sorted(ratios.items())}
        r["cap"] = {f"{f:g} us": {m: _geomean(v) for m, v in caps[f].items()} for f in floors
                    if caps[f]["graph"]}
        out[state] = r
    return out


def report(res: dict) -> str:
    fmt = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = []
    for state, r in res.items():
        lines.append(f"== {state}: {r['points']} points")
        lines.append(f"  >= {BANDWIDTH_TARGET.get(state)}% of copy from {BANDWIDTH_FROM} work items, missed at "
                     f"{len(r['bandwidth_misses'])}: " + ", ".join(
                         f"{h}x{n} {fmt(a)}% (slot copy {fmt(b)}%)" for h, n, a, b in r["bandwidth_misses"]))
        lines.append(f"  <= {SMALL_GRAPH_US:g} us graph at <= {SMALL_MAX} work items, missed at "
                     f"{len(r['small_graph_misses'])}: " + ", ".join(
                         f"{h}x{n} {fmt(a, 2)} us (slot copy {fmt(b, 2)})" for h, n, a, b in r["small_graph_misses"]))
        lines.append(f"  <= {SMALL_EAGER_US:g} us wall at <= {SMALL_MAX} work items (public op when timed), missed at "
                     f"{len(r['small_eager_misses'])}: " + ", ".join(
                         f"{h}x{n} {fmt(a)} us" for h, n, a in r["small_eager_misses"]))
        lines.append(f"  not faster than fla in graph replay at: {r['not_faster_than_fla'] or 'none'}")
        lines.append("  geomean vs fla: " + ", ".join(f"{k} {fmt(v, 2)}x" for k, v in r["geomean"].items()))
        lines.append("  cap (best time = max(bytes / copy ceiling, floor)): " + "; ".join(
            f"floor {f}: graph {fmt(c['graph'], 2)}x, wall {fmt(c['wall'], 2)}x" for f, c in r["cap"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a bench_decode.py result JSON")
    ap.add_argument("--floors", default="1,2,3", help="per-call floors (us) for the geomean caps")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.results).read_text())
    floors = tuple(float(x) for x in args.floors.split(",") if x)
    print(report(evaluate(doc, floors)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
