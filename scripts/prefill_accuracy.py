"""Output and final-state error of CUDA kda_prefill modules against the float64 token recurrence.

    python3 scripts/prefill_accuracy.py [--modules prefill_vt16_f32,prefill_vt64_f32] [--seeds 11,12,...]

The same fresh random inputs for every module (bf16 q, k, v, g, beta, fp32 initial state), per
case: the benchmark's softplus and bounded inputs (benchmarks/bench_prefill.py), the log gate, and
softplus with fast decays (A_log up to 2: some 16-row blocks span more than 2^100, so a
tensor-core diagonal form falls back to fp32 there). Prints rel. L2 of out and final state per
module and case: a check that a change to the preparation kept its accuracy (no timing). A change
that moves a rounding step gives other errors on one draw: compare over several --seeds (the
geometric mean of each module's errors over the seeds is printed last).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_prefill import K, make  # noqa: E402

GATES = {"softplus": 0, "bounded": 1, "log": 2}
LB = -5.0


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / (b.norm() + 1e-30))


def cases(dev, seed):
    torch.manual_seed(seed)
    lens = [1000, 64, 300, 17]
    out = []
    for gate in ("softplus", "bounded", "log"):
        d = make(lens, 4, gate, dev)
        if gate == "log":  # g is the log decay itself (<= 0); no A_log / dt_bias
            d["g"] = (-torch.rand_like(d["g"].float()) * 0.5).bfloat16()
            d["A_log"] = d["dt_bias"] = None
        out.append((f"{gate} 1000+64+300+17 H4", gate, d))
    d = make([640], 2, "softplus", dev)
    d["A_log"] = torch.rand(2, device=dev) * 2.0
    d["g"] = (d["g"].float() * 2.0 + 1.0).bfloat16()
    out.append(("softplus fast decays 640 H2", "softplus", d))
    return out


def run_module(mod, d, gate):
    import tvm_ffi
    T, N, H = d["q"].shape[1], d["cu"].numel() - 1, d["v"].shape[2]
    ws = torch.empty(max(1, mod["kda_prefill_workspace_bytes"](T, N, H)), dtype=torch.uint8, device=d["q"].device)
    fin, out = torch.full_like(d["init"], float("nan")), torch.full_like(d["v"], float("nan"))
    with tvm_ffi.use_torch_stream():
        mod["kda_prefill"](d["q"], d["k"], d["v"], d["g"], d["beta"], d["A_log"], d["dt_bias"], d["cu"], d["init"], fin,
                           None, None, out, ws, GATES[gate], LB, K ** -0.5, True, False, 0)
    torch.cuda.synchronize()
    return out, fin


# the modules kda_prefill routes fp32-state calls to (jit/routes/kda_prefill.json)
ROUTED = "prefill_vt16_f32,prefill_vt32_f32,prefill_vt64_f32,prefill_vt64s_f32"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", default=ROUTED)
    ap.add_argument("--seeds", default="11", help="comma list of input seeds")
    a = ap.parse_args(argv)
    from flashkda_ext import jit
    from flashkda_ext.reference.prefill import kda_recurrent
    dev = torch.device("cuda")
    names = a.modules.split(",")
    mods = {n: jit.load_module(n) for n in names}
    seeds = [int(x) for x in a.seeds.split(",")]
    logs = {}  # (case, module) -> [log out error, log state error] summed over the seeds
    print(f"{'seed':>4s} {'case':34s} {'module':24s} {'out rel L2':>11s} {'state rel L2':>12s}")
    for seed in seeds:
        for label, gate, d in cases(dev, seed):
            ro, rf, _ = kda_recurrent(d["q"], d["k"], d["v"], d["g"], d["beta"], gate=gate, A_log=d["A_log"],
                                      dt_bias=d["dt_bias"], lower_bound=LB, scale=K ** -0.5,
                                      cu_seqlens=d["cu"].long(), initial_state=d["init"])
            for n in names:
                o, f = run_module(mods[n], d, gate)
                eo, ef = rel(o, ro), rel(f, rf)
                acc = logs.setdefault((label, n), [0.0, 0.0])
                acc[0] += math.log(eo)
                acc[1] += math.log(ef)
                print(f"{seed:4d} {label:34s} {n:24s} {eo:11.3e} {ef:12.3e}", flush=True)
    if len(seeds) > 1:
        print(f"geometric mean over {len(seeds)} seeds")
        for (label, n), (lo, lf) in logs.items():
            print(f"{'gm':>4s} {label:34s} {n:24s} {math.exp(lo / len(seeds)):11.3e} {math.exp(lf / len(seeds)):12.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
