#!/usr/bin/env python
"""Where the fast path's host time goes: each step of kda_decode's fast branch timed alone.

The public op's fast path (flashkda_ext/ops.py, fast_path.py) is a handful of Python steps before the
checked module call; benchmarks/bench_overhead.py measures their sum (op minus the direct call).
This script times each step alone on the same tensors (p10 of many blocks: the host's noise floor),
under grad mode and under torch.inference_mode(), so a change to the fast path can be attributed.

    python scripts/fast_path_pieces.py [--device cuda] [--rows 1] [--heads 16] [--dim 128]
"""
from __future__ import annotations

import argparse
import timeit

import torch


def p10_us(fn, n=2000, blocks=40) -> float:
    """p10 over `blocks` timeit blocks of n calls, per call, in us (after a warm-up block)."""
    timeit.repeat(fn, number=300, repeat=1)
    times = sorted(timeit.repeat(fn, number=n, repeat=blocks))
    return times[len(times) // 10] / n * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    a = p.parse_args(argv)
    import flashkda_ext as fk
    from flashkda_ext import custom_ops, dispatch, fast_path, trace, validation

    dev, rows, H, D = torch.device(a.device), a.rows, a.heads, a.dim
    bf = dict(dtype=torch.bfloat16, device=dev)
    q, k, v, g = (torch.randn(rows, H, D, **bf) for _ in range(4))
    beta = torch.randn(rows, H, **bf)
    A_log, dt_bias = torch.randn(H, device=dev), torch.randn(H * D, device=dev)
    state = torch.randn(max(64, 2 * rows), H, D, D, device=dev) * 0.1
    idx = torch.arange(rows, dtype=torch.int32, device=dev)
    out = torch.empty(rows, H, D, **bf)
    kw = dict(state=state, state_indices=idx, A_log=A_log, dt_bias=dt_bias, out=out)
    call = validation.check_kda_decode(q, k, v, g, beta, **kw)
    direct_fn = dispatch.function("kda_decode", call.route_meta())
    tail = (call.gate_mode, call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0)
    fk.kda_decode(q, k, v, g, beta, **kw)  # arms the fast path
    (checked, sig, _), = [e for key, e in fast_path._ENTRIES.items() if key[0] == "kda_decode"]
    T = torch.Tensor
    key = ("kda_decode", rows, "softplus", "unique", type(None), None, type(None), None, bool, True, bool, False)
    steps = {
        "guard: is_compiling": custom_ops._is_compiling,
        "guard: trace.enabled": trace.enabled,
        "guard: type(q)": lambda: type(q) is T,
        "key tuple": lambda: ("kda_decode", q.shape[0], "softplus", "unique", type(None), None, type(None), None,
                              bool, True, bool, False),
        "entry lookup": lambda: fast_path.get(key),
        "plain_ok (10 tensors)": lambda: fast_path.plain_ok((q, k, v, g, beta, A_log, dt_bias, idx), (state, out)),
        "plain_ok in Python (10)": lambda: fast_path._py_plain_ok((q, k, v, g, beta, A_log, dt_bias, idx),
                                                                 (state, out)),
        "checked call, no launch": lambda: checked(sig ^ 2, q, k, v, g, beta, A_log, dt_bias, state, idx, out, *tail),
        "direct call (launch)": lambda: direct_fn(q, k, v, g, beta, A_log, dt_bias, state, idx, out, *tail),
        "checked call (launch)": lambda: checked(sig, q, k, v, g, beta, A_log, dt_bias, state, idx, out, *tail),
        "public op (launch)": lambda: fk.kda_decode(q, k, v, g, beta, **kw),
    }
    native = fast_path.plain_ok is not fast_path._py_plain_ok
    print(f"plain_ok: {'compiled (flag_reader)' if native else 'the Python loop (the compiled test is not built)'}")
    print(f"kda_decode fast path on {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}), "
          f"rows {rows}, H {H}, D {D}: p10 us per step")
    for mode, ctx in (("grad", torch.enable_grad), ("inference_mode", torch.inference_mode)):
        with ctx():
            for name, fn in steps.items():
                print(f"  {mode:14s} {name:26s} {p10_us(fn):7.2f}")
        if dev.type == "cuda":
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
