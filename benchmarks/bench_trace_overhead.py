"""What tracing costs a public call.

Disabled (the default), every public op pays one check, ``if trace.enabled():``: this script times
that check exactly as ops.py runs it, against an empty loop, and fails (exit 1) if it exceeds the
1 microsecond budget. Enabled, it also times trace.emit for a small kda_decode call (definition
already written, one workload line appended), for information.

    python benchmarks/bench_trace_overhead.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashkda_ext import trace, validation  # noqa: E402

BUDGET_NS = 1000.0


def _per_call_ns(fn, n: int, repeats: int) -> float:
    """Median over repeats of (loop with fn) - (empty loop), per iteration, in ns."""
    def empty(n):
        for _ in range(n):
            pass
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(n)
        t1 = time.perf_counter_ns()
        empty(n)
        t2 = time.perf_counter_ns()
        samples.append(((t1 - t0) - (t2 - t1)) / n)
    return max(statistics.median(samples), 0.0)


def disabled_check(n):
    enabled = trace.enabled
    for _ in range(n):
        if enabled():           # what ops.py does before every launch
            raise AssertionError("tracing should be off")


def disabled_check_module_attr(n):
    for _ in range(n):
        if trace.enabled():     # with the attribute lookup, exactly as written in ops.py
            raise AssertionError("tracing should be off")


def _decode_call():
    rows, H, K = 4, 2, 16
    args = dict(q=torch.randn(rows, H, K), k=torch.randn(rows, H, K), v=torch.randn(rows, H, K),
                g=torch.randn(rows, H, K), beta=torch.randn(rows, H), state=torch.zeros(8, H, K, K),
                state_indices=torch.arange(rows, dtype=torch.int32), A_log=torch.zeros(H),
                dt_bias=torch.zeros(H * K))
    return validation.check_kda_decode(**args), args


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--iters", type=int, default=1_000_000)
    args = p.parse_args(argv)

    saved = trace.directory()
    assert not trace.enabled(), "unset FLASHKDA_EXT_TRACE_DIR to measure the disabled path"
    off = _per_call_ns(disabled_check, args.iters, 7)
    off_attr = _per_call_ns(disabled_check_module_attr, args.iters, 7)

    call, inputs = _decode_call()
    with tempfile.TemporaryDirectory() as d, trace.tracing(d):
        trace.emit("kda_decode", call, inputs)           # first call writes the definition
        times = []
        for _ in range(200):
            t0 = time.perf_counter_ns()
            trace.emit("kda_decode", call, inputs)
            times.append(time.perf_counter_ns() - t0)
        on = statistics.median(times)
    assert trace.directory() == saved

    result = {
        "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "disabled_check_ns": round(off, 1),
        "disabled_check_with_attribute_lookup_ns": round(off_attr, 1),
        "enabled_emit_kda_decode_us": round(on / 1000, 1),
        "budget_ns": BUDGET_NS,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if off_attr < BUDGET_NS else 1


if __name__ == "__main__":
    sys.exit(main())
