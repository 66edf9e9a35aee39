"""Launch every CUDA module once on small, valid, random inputs: the workload compute-sanitizer
(memcheck, racecheck, synccheck) runs over, one process for all routes.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_routes.py [--only GLOB]

Each module is called straight through its TVM-FFI function (the module ABI of
docs/architecture.md), so every route is covered whatever the routing bands say. Prints one line a
module; exits non-zero if a call raises.
"""
from __future__ import annotations

import argparse
import fnmatch
import sys

import torch

from flashkda_ext import jit, validation

DEV = "cuda"
D = 128


def _r(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _state_dtype(rec):
    return torch.bfloat16 if rec["state_dtype"] == "bfloat16" else torch.float32


def _gb_dtype(rec):
    """The _gb32 twins (decode and verify) read g and beta as fp32; the rest in the inputs' bf16."""
    return torch.float32 if rec["params"].get("gb_f32") else torch.bfloat16


def run_decode(fn, rec):
    rows, H, HV, slots = 3, 2, 4, 6
    idx = [1, 1, 4] if rec["abi"] == "sequential" else [1, -1, 4]
    state = _r(slots, HV, D, D, dtype=_state_dtype(rec), scale=0.1)
    out = torch.full((rows, HV, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    gb = _gb_dtype(rec)
    fn(_r(rows, H, D), _r(rows, H, D), _r(rows, HV, D), _r(rows, HV, D, dtype=gb), _r(rows, HV, dtype=gb),
       _r(HV, dtype=torch.float32, scale=0.3), _r(HV * D, dtype=torch.float32, scale=0.3),
       state, torch.tensor(idx, dtype=torch.int32, device=DEV), out,
       validation.GATE_MODE["softplus"], 0.0, D ** -0.5, True, False)
    return out


def run_prefill(fn, rec, module):
    lens, HV = [70, 0, 65, 40], 2  # 40: a one-chunk sequence (finished by the prep kernel where 'single')
    split = rec["params"].get("pieces", 1) > 1
    if split:   # 16 chunks: pieces that start from zero after a warm-up, not only at chunk 0
        lens = lens + [1024]
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + lens, dtype=torch.int32, device=DEV).cumsum(0).to(torch.int32)
    sdt = _state_dtype(rec)
    init = _r(N, HV, D, D, dtype=sdt, scale=0.1)
    final = torch.full_like(init, float("nan"))
    # the piece-split modules (params.pieces > 1) refuse checkpoints (not exact)
    every = 0 if split else 64
    ckpt = torch.full((N, 1, HV, D, D), float("nan"), dtype=sdt, device=DEV) if every else None
    out = torch.full((1, T, HV, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    ws = None
    if module.implements_function("kda_prefill_workspace_bytes"):
        ws = torch.empty(int(module["kda_prefill_workspace_bytes"](T, N, HV)), dtype=torch.uint8, device=DEV)
    fn(_r(1, T, HV, D), _r(1, T, HV, D), _r(1, T, HV, D), _r(1, T, HV, D), _r(1, T, HV),
       None, None, cu, init, final, None, ckpt, out, ws,
       validation.GATE_MODE["bounded"], -5.0, D ** -0.5, True, False, every)
    # softplus with fast decays: some diagonal blocks exceed the tensor-core range and take the
    # fp32 form, so both paths run in one launch
    fn(_r(1, T, HV, D), _r(1, T, HV, D), _r(1, T, HV, D), _r(1, T, HV, D, scale=8.0), _r(1, T, HV),
       _r(HV, dtype=torch.float32, scale=0.3), _r(HV * D, dtype=torch.float32, scale=0.3), cu, init, final, None,
       ckpt, out, ws,
       validation.GATE_MODE["softplus"], 0.0, D ** -0.5, True, False, every)
    return out


def run_fused(fn, rec):
    rows, H, slots = 3, 8, 6
    C = 3 * H * D
    idx = [2, 2, 5] if rec["abi"] == "sequential" else [2, -1, 5]
    out = torch.full((rows, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    fn(_r(rows, C), _r(C, 4, scale=0.5), _r(slots, C, 3), _r(rows, H, D), _r(rows, H),
       _r(H, dtype=torch.float32, scale=0.3), _r(H * D, dtype=torch.float32, scale=0.3),
       torch.tensor(idx, dtype=torch.int32, device=DEV), _r(slots, H, D, D, dtype=_state_dtype(rec), scale=0.1),
       _r(rows, H, D), _r(D, dtype=torch.float32), out,
       validation.GATE_MODE["softplus"], 0.0, D ** -0.5, 1e-5, False)
    return out


def run_verify(fn, rec):
    # 3 requests of 2, 1, 3 tokens; request 1 is padding, token 1 of request 2 stores nothing. A
    # persistent module gets the three repeated 60 times (1440+ tiles against its 4 x 132 CTAs), so
    # its CTAs walk several tiles with the next one's copies in flight.
    reps = 60 if rec["persistent_k"] > 0 else 1
    H, HV, slots = 2, 4, 12 * reps
    base = torch.tensor([[1, 2, 3], [-1, 5, 6], [7, -1, 9]], dtype=torch.int32)
    idx = torch.cat([torch.where(base >= 0, base + 12 * r, base) for r in range(reps)]).to(DEV)
    cu = torch.tensor([0] + [6 * r + d for r in range(reps) for d in (2, 3, 6)], dtype=torch.int32, device=DEV)
    nacc = torch.tensor([2, 1, 1] * reps, dtype=torch.int32, device=DEV)
    T = 6 * reps
    out = torch.full((1, T, HV, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    gb = _gb_dtype(rec)
    inputs = (_r(1, T, H, D), _r(1, T, H, D), _r(1, T, HV, D), _r(1, T, HV, D, dtype=gb), _r(1, T, HV, dtype=gb),
              _r(HV, dtype=torch.float32, scale=0.3), _r(HV * D, dtype=torch.float32, scale=0.3),
              _r(slots, HV, D, D, dtype=_state_dtype(rec), scale=0.1), idx, cu)
    tail = (out, validation.GATE_MODE["softplus"], 0.0, D ** -0.5, True, False)
    fn(*inputs, nacc, None, None, *tail)
    # again from a second, read-only start pool (initial_state): 4 slots, one start index past them (padding)
    init = _r(4, HV, D, D, dtype=_state_dtype(rec), scale=0.1)
    starts = torch.tensor([3, -1, 9] * reps, dtype=torch.int32, device=DEV)
    fn(*inputs, None, init, starts, *tail)
    # and onto step rows (state [R, T_max, HV, V, K], one row per request; a row past R: padding)
    rows = torch.tensor([2, 0, 5] * reps, dtype=torch.int32, device=DEV)
    buf = _r(3, 3, HV, D, D, dtype=_state_dtype(rec), scale=0.1)
    fn(*inputs[:7], buf, rows, cu, None, init, torch.tensor([3, 1, 0] * reps, dtype=torch.int32, device=DEV), *tail)
    return out


def run_fused_verify(fn, rec):
    # 3 requests of 2, 1, 3 tokens, T_max 3, conv lines of T_max + 2; request 1 is padding
    H, slots, T = 8, 12, 6
    C = 3 * H * D
    idx = torch.tensor([[1, 2, 3], [-1, 5, 6], [7, -1, 9]], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32, device=DEV)
    nacc = torch.tensor([2, 1, 1], dtype=torch.int32, device=DEV)
    out = torch.full((1, T, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    fn(_r(1, T, C), _r(C, 4, scale=0.5), _r(slots, C, 5), _r(1, T, H, D), _r(1, T, H),
       _r(H, dtype=torch.float32, scale=0.3), _r(H * D, dtype=torch.float32, scale=0.3),
       _r(slots, H, D, D, dtype=_state_dtype(rec), scale=0.1), _r(1, T, H, D), _r(D, dtype=torch.float32),
       idx, cu, nacc, out, validation.GATE_MODE["softplus"], 0.0, D ** -0.5, 1e-5, False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="*", help="comma list of globs over module names")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    failed = 0
    for rec in jit.all_records():
        if rec["backend"] != "cuda" or not any(fnmatch.fnmatch(rec["name"], p) for p in args.only.split(",")):
            continue
        try:
            module = jit.load_module(rec["name"])
            fn = module[rec["family"]]
            if rec["family"] == "kda_decode":
                out = run_decode(fn, rec)
            elif rec["family"] == "kda_prefill":
                out = run_prefill(fn, rec, module)
            elif rec["family"] == "kda_verify":
                out = run_verify(fn, rec)
            elif rec["family"] == "fused_kda_verify":
                out = run_fused_verify(fn, rec)
            else:
                out = run_fused(fn, rec)
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(out.float()).all())
            print(f"{rec['name']:32s} ok   finite={finite}", flush=True)
            failed += 0 if finite else 1
        except Exception as e:  # noqa: BLE001 - every route is reported, then the exit code says
            failed += 1
            print(f"{rec['name']:32s} FAIL {type(e).__name__}: {e}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
