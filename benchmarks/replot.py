"""Draws the PNG of saved benchmark results again (the device runs skip plotting to save time).

    python benchmarks/replot.py benchmarks/results/<run>/<name>.json [...]   -> <name>.png beside each

Needs matplotlib; the figure is the harness's (speedup over the baseline per case, % of copy
bandwidth).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main(argv=None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__)
        return 2
    for p in paths:
        out = harness.plot(json.loads(p.read_text()), p.with_suffix(".png"))
        print(f"{p} -> {out if out else 'no plot'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
