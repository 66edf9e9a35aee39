#!/usr/bin/env python
"""Shrink benchmark results to the compact form kept in benchmarks/results/ (no GPU needed).

A harness run file (benchmarks/harness.py: {"benchmark", "meta", "copy_ceiling", "primary_mode",
"cases": [{"name", "params", "bytes", "arms": {arm: {"time_us": {mode: {median, p10, p90, min, n}},
"bandwidth": {mode: {GBps, pct_copy}}}}}], ...}) keeps the same schema with less in it, so every
reader of run files (decode_targets.py, prefill_targets.py, compare_runs.py, perf_doc.py,
scripts/device.sh's ab stage) reads both forms:

    {"benchmark": str, "compact": 1, "primary_mode": str,
     "meta": {date_utc, gpu, sm_count, torch, triton, fla, flashkda_ext, gate, state, slots, slot_order,
              fla_used, config: {modes, reps, rounds, cold_l2}}       (the keys the run had)
     "copy_ceiling": {"GBps": float} | null,
     "cases": [{"name", "params", "bytes", "notes" (when not empty),
                "arms": {arm: {"time_us": {mode: {"median": us}},
                               "bandwidth": {mode: {"pct_copy": %}}}}}]}

Medians are rounded to 0.001 us and shares of the copy ceiling to 0.01 %; p10 / p90 / min / n, the
per-case speedups and the summary (both derived from the medians) are dropped. Any other JSON is
written back without indentation, its content unchanged. Compacting a compact file changes nothing.

    python benchmarks/results_compact.py FILE.json [...]          # rewrite each file in place
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

META_KEYS = ("date_utc", "gpu", "sm_count", "torch", "triton", "fla", "flashkda_ext", "gate", "state",
             "slots", "slot_order", "fla_used", "cudnn")
CONFIG_KEYS = ("modes", "reps", "rounds", "cold_l2")


def is_run(doc) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("cases"), list) and "meta" in doc


def _arm(rec: dict) -> dict:
    out = {"time_us": {m: {"median": round(t["median"], 3)}
                       for m, t in (rec.get("time_us") or {}).items() if t and t.get("median") is not None}}
    bw = {m: {"pct_copy": round(b["pct_copy"], 2)}
          for m, b in (rec.get("bandwidth") or {}).items() if b and b.get("pct_copy") is not None}
    if bw:
        out["bandwidth"] = bw
    return out


def compact(doc):
    """The compact form of a run document (see the module docstring); other JSON as it is."""
    if not is_run(doc):
        return doc
    meta = {k: doc["meta"][k] for k in META_KEYS if k in doc["meta"]}
    config = doc["meta"].get("config") or {}
    meta["config"] = {k: config[k] for k in CONFIG_KEYS if k in config}
    ceiling = doc.get("copy_ceiling")
    cases = []
    for c in doc["cases"]:
        case = {"name": c["name"], "params": c.get("params") or {}, "bytes": c.get("bytes")}
        if c.get("notes"):
            case["notes"] = c["notes"]
        case["arms"] = {a: _arm(r) for a, r in (c.get("arms") or {}).items()}
        cases.append(case)
    return {"benchmark": doc.get("benchmark"), "compact": 1, "primary_mode": doc.get("primary_mode"),
            "meta": meta, "copy_ceiling": {"GBps": round(ceiling["GBps"], 1)} if ceiling else None,
            "cases": cases}


def dumps(doc) -> str:
    return json.dumps(doc, separators=(",", ":"), sort_keys=False) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    for path in args.files:
        before = path.stat().st_size
        path.write_text(dumps(compact(json.loads(path.read_text()))))
        print(f"{path}: {before} -> {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
