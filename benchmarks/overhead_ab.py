#!/usr/bin/env python
"""The fast path's host cost, before and after a change, from bench_overhead.py result files.

    python benchmarks/overhead_ab.py base1.json change1.json [base2.json change2.json ...]

Files alternate base, change (scripts/device.sh's ab stage with AB_COMPARE=overhead passes them so). For every case,
prints per file the host-mode medians (us per call) of op - direct (grad mode),
op_inference - direct_inference (inside torch.inference_mode()) and custom_op - op where the file has
that arm, then per case the change's mean minus the base's mean of each difference. The host mode
(harness.py) times calls back to back, so these differences are the ops' host work itself.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

DIFFS = (("op-direct", "op", "direct"), ("inf-direct", "op_inference", "direct_inference"),
         ("custom-op", "custom_op", "op"))


def host_medians(path: Path) -> dict:
    """{case: {arm: host median}} of one result file."""
    doc = json.loads(path.read_text())
    out = {}
    for case in doc["cases"]:
        out[case["name"]] = {arm: rec["time_us"]["host"]["median"] for arm, rec in case["arms"].items()
                             if (rec.get("time_us") or {}).get("host", {}).get("median")}
    return out


def main(argv=None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if len(paths) < 2 or len(paths) % 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    runs = [host_medians(p) for p in paths]
    names = [n for n in runs[0] if all(n in r for r in runs)]
    labels = ["base" if i % 2 == 0 else "change" for i in range(len(runs))]
    print("host us per call; columns: " + ", ".join(f"{lab}{i + 1}" for i, lab in enumerate(labels)))
    for label, slow, fast in DIFFS:
        print(f"-- {label}")
        for name in names:
            vals = [r[name][slow] - r[name][fast] if slow in r[name] and fast in r[name] else None for r in runs]
            base = [v for v, lab in zip(vals, labels) if lab == "base" and v is not None]
            change = [v for v, lab in zip(vals, labels) if lab == "change" and v is not None]
            cells = " ".join("    -" if v is None else f"{v:5.2f}" for v in vals)
            delta = (f"{statistics.mean(change) - statistics.mean(base):+5.2f}" if base and change else "    -")
            print(f"  {name:28s} {cells}   change - base {delta}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
