"""Draws the PNG of saved benchmark results again (the device runs skip plotting to save time).

    python benchmarks/replot.py benchmarks/results/<run>/<name>.json [...]   -> <name>.png beside each
    python benchmarks/replot.py --baseline cudnn <file>.json                  (speedups over another arm)

Needs matplotlib; the figure is the harness's (speedup over the baseline per case, % of copy
bandwidth). --baseline ARM draws every other arm's speedup over ARM (ARM's time over the arm's, from the
saved medians), e.g. over cuDNN for a run that had no fla baseline.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def rebase(doc: dict, base: str) -> dict:
    """The results with every case's speedups recomputed over arm `base` (cases without it keep none)."""
    pm = doc["primary_mode"]
    doc = dict(doc, baseline=base, cases=[dict(c) for c in doc["cases"]])
    for c in doc["cases"]:
        t = {a: v.get("time_us", {}).get(pm, {}).get("median") for a, v in c["arms"].items()}
        if not t.get(base):
            c.pop("speedup", None)
            continue
        c["speedup"] = {a: {pm: t[base] / x} for a, x in t.items() if a != base and x}
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--baseline", default=None, help="draw speedups over this arm instead of the run's baseline")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.files:
        print(__doc__)
        return 2
    for f in args.files:
        p = Path(f)
        doc = json.loads(p.read_text())
        if args.baseline:
            doc = rebase(doc, args.baseline)
        out = harness.plot(doc, p.with_suffix(".png"))
        print(f"{p} -> {out if out else 'no plot'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
