"""Where a kernel's time goes, from an Nsight Compute SASS source export, split at its barriers.

    ncu -i report.ncu-rep --page source --csv --print-source sass > k.csv
    python3 scripts/ncu_sass_segments.py k.csv --ctas 8208 --warps 8

The SASS export has per-instruction stall samples and execution counts but no CUDA line numbers
(ncu's CUDA-source page came back without metrics for these kernels), so the instructions are cut
into segments at every BAR (CTA barrier) in address order: one segment is one phase of a kernel
written as barrier-separated steps. Prints each segment's share of stall samples and of executed
instructions, its instructions per warp, and its most executed opcodes; then, over the whole kernel,
the stall reasons (the export's stall_* columns) and the opcodes by share of samples against share
of instructions (an opcode with many more samples than instructions is where warps wait).
--show N (repeatable) lists segment N instruction by instruction: its share of the samples,
executions per warp and the SASS text (how the runs of 2026-11-29 (dcd53fb) found the gate loop's
branch per row).
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
import sys


def read_rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        rows = list(csv.reader(f))
    heads = [i for i, r in enumerate(rows) if "Address" in r and "Source" in r]
    # a report of several launches (ncu --launch-count N) exports one table each, every one under its own header:
    # the first launch's table is read
    end = heads[1] if len(heads) > 1 else len(rows)
    return rows[heads[0]], rows[heads[0] + 1:end]


def opcode(sass: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())  # drop a predicate guard
    return text.split()[0].split(".")[0] if text else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz accepted)")
    ap.add_argument("--ctas", type=int, required=True, help="CTAs of the profiled launch")
    ap.add_argument("--warps", type=int, required=True, help="warps per CTA")
    ap.add_argument("--min-share", type=float, default=0.3, help="hide segments below this %% of both")
    ap.add_argument("--top", type=int, default=10, help="stall reasons and opcodes listed at the end")
    ap.add_argument("--show", type=int, action="append", default=[], help="list segment N's instructions")
    a = ap.parse_args(argv)
    head, rows = read_rows(a.csv)
    col = {c: i for i, c in enumerate(head)}
    samp, execd = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    per_warp = a.ctas * a.warps
    segs, cur = [], None
    for r in rows:
        if len(r) <= max(samp, execd):
            continue
        if cur is None:
            cur = dict(start=r[0], s=0.0, e=0.0, ops=collections.Counter(), rows=[])
        cur["rows"].append(r)
        op, e = opcode(r[1]), float(r[execd] or 0)
        cur["s"] += float(r[samp] or 0)
        cur["e"] += e
        cur["ops"][op] += e
        if op == "BAR":
            cur["end"] = r[0]
            segs.append(cur)
            cur = None
    if cur is not None:
        cur["end"] = "end"
        segs.append(cur)
    ts = sum(s["s"] for s in segs) or 1.0
    te = sum(s["e"] for s in segs) or 1.0
    print(f"{te / per_warp:.0f} instructions per warp, {ts:.0f} stall samples")
    print(f"{'segment':>4s} {'addresses':>13s} {'samples':>8s} {'instr':>7s} {'/warp':>6s}  top opcodes (per warp)")
    for i, s in enumerate(segs):
        ps, pe = 100 * s["s"] / ts, 100 * s["e"] / te
        if ps < a.min_share and pe < a.min_share:
            continue
        top = ", ".join(f"{k}:{v / per_warp:.0f}" for k, v in s["ops"].most_common(8))
        print(f"{i:4d} {s['start'][-5:]:>6s}-{s['end'][-5:]:<6s} {ps:7.1f}% {pe:6.1f}% {s['e'] / per_warp:6.0f}  {top}")
    print_reasons(head, rows, samp, execd, a.top)
    for i in a.show:
        if not 0 <= i < len(segs):
            print(f"no segment {i} (0..{len(segs) - 1})")
            continue
        print(f"segment {i}: address, % of all samples, executions per warp, instruction")
        for r in segs[i]["rows"]:
            print(f"  {r[0][-5:]:>5s} {100 * float(r[samp] or 0) / ts:6.2f}% {float(r[execd] or 0) / per_warp:7.2f}  {r[1].strip()}")
    return 0


def print_reasons(head, rows, samp, execd, top):
    """Stall reasons over the whole kernel, and opcodes by share of samples vs of instructions."""
    reasons = [(i, c[len("stall_"):]) for i, c in enumerate(head)
               if c.startswith("stall_") and "Not Issued" not in c]
    by_reason, by_op_s, by_op_e = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        if len(r) <= max([samp, execd] + [i for i, _ in reasons]):
            continue
        for i, name in reasons:
            by_reason[name] += float(r[i] or 0)
        op = opcode(r[1])
        by_op_s[op] += float(r[samp] or 0)
        by_op_e[op] += float(r[execd] or 0)
    tr = sum(by_reason.values())
    if tr > 0:
        print("stall reasons: " + ", ".join(f"{k} {100 * v / tr:.1f}%" for k, v in by_reason.most_common(top) if v))
    ts, te = sum(by_op_s.values()) or 1.0, sum(by_op_e.values()) or 1.0
    print("opcodes (samples / instructions): " + ", ".join(
        f"{k} {100 * v / ts:.1f}/{100 * by_op_e[k] / te:.1f}%" for k, v in by_op_s.most_common(top)))


if __name__ == "__main__":
    sys.exit(main())
