"""Ours before / after for the overlapped prefill launch (issue 46): prefill_vt16 (what the route
picks for <= 16 sequences x heads) against prefill_ov_vt16, B = 1, T in {8K, 32K, 128K}, H in
{8, 16}, bounded (lower bound -5) and softplus gates, fp32 initial and final state.

    python3 scripts/prefill_overlap_timing.py [--state f32|bf16] [--reps 10] [--rounds 3] [--out x.json]

Before any timing, per case: both modules on the same fresh inputs, outputs poisoned (NaN), must
give finite outputs equal bitwise (the overlapped launch does the same math; tests/gpu checks both
against the float64 recurrence). Timing: CUDA events around one call, L2 flushed before each
(a 256 MB fill), arms interleaved per round, median per arm over every round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import tvm_ffi

from flashkda_ext import jit

K = V = 128
GATES = {"softplus": 0, "bounded": 1}


def inputs(T, H, gate, state):
    g = torch.Generator(device="cuda").manual_seed(T * 131 + H * 7 + GATES[gate])
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    d = dict(q=r(1, T, H, K).bfloat16(), k=r(1, T, H, K).bfloat16(), v=r(1, T, H, V).bfloat16(),
             g=r(1, T, H, K).bfloat16(), beta=r(1, T, H).bfloat16(), A_log=r(H) * 0.5 - 1.0,
             dt_bias=r(H * K) * 0.5, cu=torch.tensor([0, T], dtype=torch.int32, device="cuda"))
    d["init"] = (r(1, H, V, K) * 0.5).to(state)
    return d


def caller(mod, d, gate):
    T, H = d["q"].shape[1], d["q"].shape[2]
    ws = torch.empty(int(mod["kda_prefill_workspace_bytes"](T, 1, H)), dtype=torch.uint8, device="cuda")
    out = torch.full_like(d["v"], float("nan"))
    fin = torch.full_like(d["init"], float("nan"))

    def run():
        with tvm_ffi.use_torch_stream():
            mod["kda_prefill"](d["q"], d["k"], d["v"], d["g"], d["beta"], d["A_log"], d["dt_bias"], d["cu"],
                               d["init"], fin, None, None, out, ws, GATES[gate], -5.0, K ** -0.5, True, False, 0)
    return run, out, fin


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--tokens", default="8192,32768,131072")
    ap.add_argument("--heads", default="8,16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    state = torch.float32 if a.state == "f32" else torch.bfloat16
    arms = {"before": jit.load_module(f"prefill_vt16_{a.state}"),
            "overlap": jit.load_module(f"prefill_ov_vt16_{a.state}")}
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, bad = [], 0
    for T in map(int, a.tokens.split(",")):
        for H in map(int, a.heads.split(",")):
            for gate in GATES:
                d = inputs(T, H, gate, state)
                runs = {n: caller(m, d, gate) for n, m in arms.items()}
                for run, _, _ in runs.values():
                    run()
                torch.cuda.synchronize()
                (_, ob, fb), (_, oo, fo) = runs["before"], runs["overlap"]
                same = bool(torch.isfinite(ob).all()) and torch.equal(ob, oo) and torch.equal(fb, fo)
                if not same:
                    bad += 1
                    print(f"T{T} H{H} {gate}: MISMATCH between the arms; not timed", flush=True)
                    continue
                times = {n: [] for n in runs}
                for rnd in range(a.rounds):
                    order = list(runs) if rnd % 2 == 0 else list(runs)[::-1]
                    for n in order:
                        run = runs[n][0]
                        for _ in range(a.reps):
                            flush.fill_(float(rnd))
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            e0.record()
                            run()
                            e1.record()
                            e1.synchronize()
                            times[n].append(e0.elapsed_time(e1) * 1e3)
                med = {n: statistics.median(t) for n, t in times.items()}
                overlapped = 2 * 8 * H <= sms
                row = dict(T=T, H=H, gate=gate, state=a.state, before_us=med["before"], overlap_us=med["overlap"],
                           ratio=med["overlap"] / med["before"], overlapped_launch=overlapped)
                rows.append(row)
                print(f"T{T:>6} H{H:>2} {gate:8s} before {med['before']:9.1f} us  overlap {med['overlap']:9.1f} us  "
                      f"ratio {row['ratio']:.3f}{'' if overlapped else '  (ordered fallback)'}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(0), sms=sms, rows=rows, mismatches=bad), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
