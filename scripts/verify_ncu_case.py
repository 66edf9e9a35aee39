"""One kda_verify launch per named module at one point of issue 30's grid, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:kda_verify --section SpeedOfLight ... \
        python3 scripts/verify_ncu_case.py --modules verify_stage2j8_bf16_o32,verify_bulk4j4_bf16_o32 --tokens 2

The inputs are bench_verify.py's (random, T tokens a request, distinct slots). Each module is loaded
first and launched once, so the profiled launches are exactly one per module, in the order named.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_verify as bv  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", required=True, help="comma list of verify module names")
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1024)
    args = ap.parse_args()
    names = [m for m in args.modules.split(",") if m]
    gen = torch.Generator(device="cuda").manual_seed(1)
    N, T, HV = args.rows, args.tokens, args.heads
    dtypes = {n: torch.bfloat16 if "_bf16_" in n else torch.float32 for n in names}
    pools = {dt: torch.empty(N * (T + 1), HV, bv.V, bv.K, dtype=dt, device="cuda").normal_(generator=gen)
             for dt in set(dtypes.values())}
    case = bv.make_case(N, T, HV, gen)
    idx, nacc = bv.slot_table(N, T, N * (T + 1), gen)
    out = torch.empty(1, N * T, HV, bv.V, dtype=torch.bfloat16, device="cuda")
    for n in names:
        bv.load(n)
    for n in names:
        bv.ours_call(n, case, pools[dtypes[n]], idx, nacc, out)()
        torch.cuda.synchronize()
        print(f"launched {n}", flush=True)


if __name__ == "__main__":
    main()
