#!/usr/bin/env python
"""Run every benchmark in one go and write a summary of the run.

    python benchmarks/run_all.py [--quick] [--dry-run] [--only decode,prefill,fused,fused_verify,trace] [--out DIR]

Each script runs in its own process (one crash or OOM does not take the others down) with the
common flags (harness.add_common_args) passed on; flags this script does not know go to every
script too. Afterwards <out>/summary.md holds, per benchmark, the GPU, versions, date, copy ceiling
and the geomean speedups, plus the per-case table. docs/performance.md is generated from the run
files themselves (benchmarks/perf_doc.py; its docstring says how a new run replaces a cited one).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402

# name -> (script, results stem, whether it takes the harness flags). Scripts that do not (the
# trace and JAX overhead scripts keep their own small CLIs) get only --json <out>/<stem>.json.
BENCHES = {
    "decode": ("bench_decode.py", "decode", True),
    "prefill": ("bench_prefill.py", "prefill", True),
    "fused": ("bench_fused_decode.py", "fused_decode", True),
    "fused_verify": ("bench_fused_verify.py", "fused_verify", True),
    "overhead": ("bench_overhead.py", "host_overhead", True),
    "trace": ("bench_trace_overhead.py", "trace_overhead", False),
    "jax": ("bench_jax_overhead.py", "jax_overhead", False),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help=f"comma list of {','.join(BENCHES)} (default: all)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", default=str(harness.DEFAULT_OUT))
    p.add_argument("--timeout", type=float, default=None, help="seconds per script")
    return p.parse_known_args(argv)


def summary_markdown(out: Path, names) -> str:
    lines = ["# Benchmark summary", ""]
    for name in names:
        stem = BENCHES[name][1]
        path = out / f"{stem}.json"
        if not path.is_file():
            lines += [f"## {name}", "", f"no results ({path.name} missing)", ""]
            continue
        doc = json.loads(path.read_text())
        if "meta" not in doc or "cases" not in doc:   # a script with its own JSON layout
            lines += [f"## {name}", "", "```json", json.dumps(doc, indent=1)[:6000], "```", ""]
            continue
        m = doc["meta"]
        lines += [f"## {name}", "",
                  f"GPU: {m.get('gpu') or 'none (CPU dry run)'} ({m.get('gpu_arch', '-')}, {m.get('sm_count', '-')} SMs); "
                  f"torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), tvm-ffi {m.get('tvm_ffi')}, "
                  f"flashkda_ext {m.get('flashkda_ext')}, fla {m.get('fla') or 'not installed'}, "
                  f"triton {m.get('triton') or '-'}; {m.get('date_utc')}",
                  f"Copy ceiling measured in the same run: {doc['copy_ceiling']['GBps']:.0f} GB/s. "
                  f"Timing: {'cold' if m['config']['cold_l2'] else 'warm'} L2, medians of "
                  f"{m['config']['reps']} runs per arm and mode, arms interleaved A B B A.", ""]
        for arm, per in doc.get("summary", {}).items():
            for mode, v in per.items():
                lines.append(f"- {arm} vs {doc.get('baseline')} ({mode}): geomean {v['geomean']:.2f}x, "
                             f"min {v['min']:.2f}x, max {v['max']:.2f}x over {v['cases']} cases")
        lines += ["", "```", harness.format_table(doc), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args, extra = parse(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHES)
    bad = [n for n in names if n not in BENCHES]
    if bad:
        print(f"--only: unknown {bad}; choose from {list(BENCHES)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    for n in names:
        script = HERE / BENCHES[n][0]
        if not script.is_file():
            print(f"== {n}: {script.name} not found, skipped", flush=True)
            continue
        _, stem, common = BENCHES[n]
        if common:
            cmd = [sys.executable, str(script), "--out", str(out)] + (["--quick"] if args.quick else []) \
                + (["--dry-run"] if args.dry_run else []) + extra
        else:
            cmd = [sys.executable, str(script), "--json", str(out / f"{stem}.json")]
            if n == "jax" and args.dry_run:
                cmd += ["--device", "cpu", "--samples", "8", "--issue-calls", "8", "--rounds", "2"]
        print(f"== {n}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.call(cmd, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"== {n}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failures.append((n, rc))
    md = summary_markdown(out, names)
    (out / "summary.md").write_text(md + "\n")
    print(f"summary: {out / 'summary.md'}")
    if failures:
        print(f"failed: {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
