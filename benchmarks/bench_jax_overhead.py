"""Host overhead of the JAX front end against the torch op, on one small decode.

Both call the very same compiled module; what differs is the path to it. Arms:

    torch_op   flashkda_ext.kda_decode(..., out=out)        validation + dispatch + TVM-FFI call
    torch_ffi  the module's TVM-FFI function called directly  (the floor: no Python checks)
    jax_jit    a jax.jit step, pool donated                 XLA dispatch + FFI target + C++ reorder
    jax_eager  flashkda_ext.jax.kda_decode on concrete arrays (memoized validation + cached jit, donating)
    jax_floor  a jax.jit step with the same arguments, pool donated, that runs one tiny XLA kernel
               instead of our target: XLA's own dispatch cost, the floor jax_jit cannot go below

Two timings per arm, medians over interleaved rounds (arms in order A B C D, then D C B A, ...):

    wall   one call, synchronized before and after, host clock: what a caller waiting on the
           result sees (kernel time included)
    issue  N calls back to back, then one synchronization, divided by N: the per-call cost of
           issuing work when the host is the bottleneck

The number to quote is jax_jit - torch_op (negative: JAX is cheaper) with the GPU named.

    python benchmarks/bench_jax_overhead.py                      # CUDA when available, else CPU
    python benchmarks/bench_jax_overhead.py --device cpu --rows 4 --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "flashkda_ext" / "__init__.py").is_file() and str(_REPO) not in sys.path:
    sys.path.append(str(_REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="H = HV")
    p.add_argument("--dim", type=int, default=None, help="K = V (default 128 on CUDA, 32 on CPU)")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--issue-calls", type=int, default=200, help="calls per 'issue' sample")
    p.add_argument("--samples", type=int, default=200, help="'wall' samples per arm")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    import jax
    import jax.numpy as jnp

    import flashkda_ext as fk
    import flashkda_ext.jax as kj
    from flashkda_ext import dispatch, validation

    jdev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    jax.config.update("jax_default_device", jdev)
    R, H, S = args.rows, args.heads, args.slots
    D = args.dim or (128 if device == "cuda" else 32)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)

    def r(*shape, dtype=dt):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    t = dict(q=r(R, H, D), k=r(R, H, D), v=r(R, H, D), g=r(R, H, D), beta=r(R, H),
             A_log=r(H, dtype=torch.float32), dt_bias=r(H * D, dtype=torch.float32))
    pool = 0.01 * r(S, H, D, D, dtype=torch.float32)
    idx = torch.randperm(S, generator=gen)[:R].to(torch.int32).to(device)
    out = torch.empty(R, H, D, dtype=dt, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    call = validation.check_kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], state=pool, state_indices=idx,
                                       A_log=t["A_log"], dt_bias=t["dt_bias"])
    fn = dispatch.function("kda_decode", call.route_meta())

    def torch_op():
        fk.kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], state=pool, state_indices=idx, A_log=t["A_log"],
                      dt_bias=t["dt_bias"], out=out)

    def torch_ffi():
        fn(t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], pool, idx, out, call.gate_mode,
           call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0)

    def to_jax(x):
        return jax.device_put(jnp.asarray(jax.dlpack.from_dlpack(x.contiguous().clone())), jdev)

    j = {n: to_jax(x) for n, x in t.items()}
    jidx = to_jax(idx)
    box = {"pool": to_jax(pool), "eager_pool": to_jax(pool), "floor_pool": to_jax(pool)}
    step = jax.jit(lambda p, q, k, v, g, b, a, d, i: kj.kda_decode(q, k, v, g, b, state=p, state_indices=i,
                                                                   A_log=a, dt_bias=d), donate_argnums=0)

    def jax_jit():
        o, box["pool"] = step(box["pool"], j["q"], j["k"], j["v"], j["g"], j["beta"], j["A_log"], j["dt_bias"], jidx)
        box["out"] = o

    floor = jax.jit(lambda p, q, k, v, g, b, a, d, i: (jnp.negative(q), p), donate_argnums=0)

    def jax_floor():
        o, box["floor_pool"] = floor(box["floor_pool"], j["q"], j["k"], j["v"], j["g"], j["beta"], j["A_log"],
                                     j["dt_bias"], jidx)
        box["floor_out"] = o

    def jax_eager():
        o, box["eager_pool"] = kj.kda_decode(j["q"], j["k"], j["v"], j["g"], j["beta"], state=box["eager_pool"],
                                             state_indices=jidx, A_log=j["A_log"], dt_bias=j["dt_bias"])
        box["out"] = o

    def jax_sync():
        jax.block_until_ready((box["pool"], box["eager_pool"], box["floor_pool"], box.get("out"),
                               box.get("floor_out")))

    arms = {"torch_op": (torch_op, sync), "torch_ffi": (torch_ffi, sync),
            "jax_jit": (jax_jit, jax_sync), "jax_eager": (jax_eager, jax_sync), "jax_floor": (jax_floor, jax_sync)}
    for f, s in arms.values():             # warm-up: module load, registration, XLA compile
        for _ in range(20):
            f()
        s()

    wall = {n: [] for n in arms}
    issue = {n: [] for n in arms}
    order = list(arms)
    for rnd in range(args.rounds):
        for name in (order if rnd % 2 == 0 else order[::-1]):
            f, s = arms[name]
            for _ in range(max(1, args.samples // args.rounds)):
                s()
                t0 = time.perf_counter()
                f()
                s()
                wall[name].append((time.perf_counter() - t0) * 1e6)
            for _ in range(5):
                s()
                t0 = time.perf_counter()
                for _ in range(args.issue_calls):
                    f()
                s()
                issue[name].append((time.perf_counter() - t0) * 1e6 / args.issue_calls)

    med = lambda xs: statistics.median(xs)  # noqa: E731
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "jax": jax.__version__, "torch": torch.__version__,
        "shape": {"rows": R, "H": H, "HV": H, "K": D, "V": D, "slots": S, "dtype": str(dt).replace("torch.", "")},
        "module": dispatch.module_name("kda_decode", call.route_meta()),
        "wall_us": {n: med(v) for n, v in wall.items()},
        "issue_us": {n: med(v) for n, v in issue.items()},
    }
    result["jax_jit_minus_torch_op_us"] = {m: result[f"{m}_us"]["jax_jit"] - result[f"{m}_us"]["torch_op"]
                                           for m in ("wall", "issue")}
    print(f"{result['device']}  module {result['module']}  shape {result['shape']}")
    print(f"{'arm':<10} {'wall us':>10} {'issue us':>10}")
    for n in arms:
        print(f"{n:<10} {result['wall_us'][n]:>10.2f} {result['issue_us'][n]:>10.2f}")
    result["jax_jit_minus_jax_floor_us"] = {m: result[f"{m}_us"]["jax_jit"] - result[f"{m}_us"]["jax_floor"]
                                            for m in ("wall", "issue")}
    d = result["jax_jit_minus_torch_op_us"]
    print(f"jax_jit - torch_op: wall {d['wall']:+.2f} us, issue {d['issue']:+.2f} us")
    d = result["jax_jit_minus_jax_floor_us"]
    print(f"jax_jit - jax_floor (our part of a jitted call): wall {d['wall']:+.2f} us, issue {d['issue']:+.2f} us")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
