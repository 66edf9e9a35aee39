#!/usr/bin/env python
"""Where the custom ops' eager cost goes: torch.ops.flashkda_ext.<op>.default against the public op,
and the dispatcher's own floor.

A torch.compile'd graph run without CUDA-graph capture calls the custom ops eagerly; their kernel
(flashkda_ext/custom_ops.py) calls the public op. So "custom op minus public op" is the dispatcher's
round trip (OpOverload.__call__, every argument boxed into an IValue, the dispatch, every argument
unboxed into a Python object for the kernel) plus whatever the kernel adds. To tell the two apart,
each op's schema is also defined in a scratch namespace with a kernel that does nothing: that op's
time is the floor no kernel can go below. Everything is the p10 of interleaved timeit blocks (the
blocks of all contenders alternate, so load from other processes hits them alike), us per call:

  ops       public op, custom op, the no-op op of the same schema, and custom - public - floor
            (what our kernel adds beyond the floor; ~0 when the kernel is only a Python call)
  counts    no-op ops of 0, 8 and 16 arguments of the kinds the schemas use
  kinds     the cost of one argument of each kind: a no-op op of one Tensor and 16 of that kind,
            minus the one-Tensor op, over 16
  variants  kda_decode's schema registered other ways (backend keys instead of
            CompositeExplicitAutograd, an Autograd fallthrough, no alias annotations, the six
            scalars packed into one str), under grad mode and inference mode

    python scripts/custom_op_floor.py [--device cuda] [--blocks 200] [--only ops,counts,kinds,variants]

(benchmarks/bench_overhead.py's custom_op arm measures the same custom-op call as wall time with the
harness; this script is the fine-grained breakdown.)
"""
from __future__ import annotations

import argparse
import timeit

import torch

SECTIONS = ("ops", "counts", "kinds", "variants")


def bench(fns: dict, *, number: int, blocks: int, sync=None) -> dict:
    """p10 us per call of each fn; the contenders' blocks interleaved."""
    for f in fns.values():
        for _ in range(200):
            f()
    timers = {n: timeit.Timer(f) for n, f in fns.items()}
    times = {n: [] for n in fns}
    for _ in range(blocks):
        for n, t in timers.items():
            times[n].append(t.timeit(number) / number * 1e6)
            if sync is not None:
                sync()  # a queue of device work left behind must not slow the next contender
    return {n: sorted(v)[len(v) // 10] for n, v in times.items()}


def op_calls(dev: torch.device, H: int, D: int):
    """{op: (public call, custom-op call, positional arguments of the custom op)} on one-row /
    one-request inputs (outputs preallocated, as a graph passes them)."""
    import flashkda_ext as fk

    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype=bf, device=dev)  # noqa: E731
    f32 = lambda *s: (torch.randn(*s, generator=gen) * 0.1).to(dev)  # noqa: E731
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    C = 3 * H * D
    A_log, dt_bias, nw, w = f32(H), f32(H * D), torch.ones(D, device=dev), r(C, 4)
    ops = torch.ops.flashkda_ext
    calls = {}

    q, k, v, g, beta, out = r(1, H, D), r(1, H, D), r(1, H, D), r(1, H, D), r(1, H), r(1, H, D)
    state, idx = f32(64, H, D, D), i32(5)
    a = (q, k, v, g, beta, state, idx, A_log, dt_bias, None, "softplus", None, True, "unique", False, out)
    calls["kda_decode"] = (lambda: fk.kda_decode(q, k, v, g, beta, state=state, state_indices=idx, A_log=A_log,
                                                 dt_bias=dt_bias, out=out), a)

    x, conv, fstate, og, fout = r(1, C), r(64, C, 3), f32(64, H, D, D), r(1, H, D), r(1, H, D)
    fa = (x, w, conv, g, beta, A_log, dt_bias, idx, fstate, og, nw)
    calls["fused_kda_decode"] = (lambda: fk.fused_kda_decode(*fa, out=fout),
                                 fa + (None, "softplus", 1e-5, None, "unique", False, fout))

    T = 16
    pq, pk, pv, pg, pb, pout = r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H), r(1, T, H, D)
    cu, init, final = i32(0, 8, 16), f32(2, H, D, D), f32(2, H, D, D)
    ws = None
    if dev.type == "cuda":
        ws = torch.empty(max(fk.prefill_workspace_bytes(pq, pv, cu_seqlens=cu), 1), dtype=torch.uint8, device=dev)
    calls["kda_prefill"] = (
        lambda: fk.kda_prefill(pq, pk, pv, pg, pb, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, initial_state=init,
                               final_state=final, max_seqlen=8, workspace=ws, out=pout),
        (pq, pk, pv, pg, pb, A_log, dt_bias, None, "softplus", None, True, cu, init, None, None, True, final, 0, None,
         8, False, ws, pout))

    vq, vk, vv, vg, vb, vout = r(1, 2, H, D), r(1, 2, H, D), r(1, 2, H, D), r(1, 2, H, D), r(1, 2, H), r(1, 2, H, D)
    vstate, vidx, vcu, nacc = f32(64, H, D, D), i32(3, 7).reshape(1, 2), i32(0, 2), i32(1)
    calls["kda_verify"] = (
        lambda: fk.kda_verify(vq, vk, vv, vg, vb, state=vstate, state_indices=vidx, cu_seqlens=vcu,
                              num_accepted_tokens=nacc, A_log=A_log, dt_bias=dt_bias, out=vout),
        (vq, vk, vv, vg, vb, vstate, vidx, vcu, nacc, None, A_log, dt_bias, None, "softplus", None, True, False, vout))

    fx, fvconv, fvog, fvstate, fvout = r(1, 2, C), r(64, C, 4), r(1, 2, H, D), f32(64, H, D, D), r(1, 2, H, D)
    fva = (fx, w, fvconv, vg, vb, A_log, dt_bias, fvstate, fvog, nw)
    calls["fused_kda_verify"] = (
        lambda: fk.fused_kda_verify(*fva, state_indices=vidx, cu_seqlens=vcu, num_accepted_tokens=nacc, out=fvout),
        fva + (vidx, vcu, nacc, None, None, "softplus", 1e-5, None, False, fvout))
    return {name: (pub, getattr(ops, name).default, args) for name, (pub, args) in calls.items()}


class Scratch:
    """No-op ops defined as custom_ops.py defines the real ones (Library define + impl)."""

    def __init__(self):
        self.lib = torch.library.Library("flashkda_ext_floor", "DEF")  # kept alive with self
        self.n = 0

    def op(self, schema: str, keys=("CompositeExplicitAutograd",), fallthrough=()):
        """The OpOverload of a new op with this schema ("(Tensor a, ...) -> ()") and a no-op kernel."""
        self.n += 1
        name = f"op{self.n}"
        self.lib.define(name + schema)
        for key in keys:
            self.lib.impl(name, _noop, key)
        for key in fallthrough:
            self.lib.impl(name, torch.library.fallthrough_kernel, key)
        return getattr(torch.ops.flashkda_ext_floor, name).default


def _noop(*args):
    return None


def _schema_of(op) -> str:
    s = str(op._schema)
    return s[s.index("("):]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=200, help="timeit blocks per contender")
    p.add_argument("--number", type=int, default=500, help="calls per block")
    p.add_argument("--only", default=",".join(SECTIONS), help="comma list of " + ", ".join(SECTIONS))
    a = p.parse_args(argv)
    only = set(a.only.split(","))
    if only - set(SECTIONS):
        p.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}; choose from {', '.join(SECTIONS)}")
    dev = torch.device(a.device)
    H, D = (16, 128) if dev.type == "cuda" else (2, 8)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    run = lambda fns: bench(fns, number=a.number, blocks=a.blocks, sync=sync)  # noqa: E731
    scratch = Scratch()
    t = torch.zeros(2, device=dev)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"custom-op eager cost on {dev} ({name}), torch {torch.__version__}; p10 us per call")

    calls = op_calls(dev, H, D)
    if "ops" in only:
        print(f"\nops (1 row / 1 request of 2 tokens / 2 x 8 tokens, H {H} D {D}): public, custom op, no-op op of "
              "the same schema (floor), extra = custom - public, kernel = extra - floor")
        for op_name, (pub, custom, args) in calls.items():
            floor_op = scratch.op(_schema_of(custom))
            res = run({"public": pub, "custom": lambda c=custom, x=args: c(*x),
                       "floor": lambda f=floor_op, x=args: f(*x)})
            extra = res["custom"] - res["public"]
            print(f"  {op_name:17s} {len(args):2d} args  public {res['public']:7.2f}  custom {res['custom']:7.2f}  "
                  f"floor {res['floor']:5.2f}  extra {extra:5.2f}  kernel {extra - res['floor']:+5.2f}")

    kinds = {"Tensor": ("Tensor", t), "Tensor? None": ("Tensor?", None), "Tensor? given": ("Tensor?", t),
             "str": ("str", "softplus"), "float? None": ("float?", None), "float? given": ("float?", 1.5),
             "float": ("float", 1e-5), "bool": ("bool", True), "int": ("int", 0), "SymInt": ("SymInt", 8),
             "SymInt? None": ("SymInt?", None)}
    if "counts" in only:
        mix = ["Tensor", "Tensor? given", "str", "float? None", "bool", "int", "Tensor", "Tensor? None"]
        fns = {}
        for n in (0, 1, 8, 16):
            chosen = ["Tensor"] if n == 1 else [mix[i % len(mix)] for i in range(n)]
            op = scratch.op("(" + ", ".join(f"{kinds[c][0]} a{i}" for i, c in enumerate(chosen)) + ") -> ()")
            fns[f"{n} args"] = lambda op=op, x=tuple(kinds[c][1] for c in chosen): op(*x)
        fns["aten.alias (C++ kernel, 1 Tensor)"] = lambda: torch.ops.aten.alias.default(t)
        print("\ncounts: no-op ops by argument count (kinds: " + ", ".join(mix) + ", cycled)")
        for n, us in run(fns).items():
            print(f"  {n:34s} {us:6.2f}")

    if "kinds" in only:
        one = scratch.op("(Tensor a) -> ()")
        fns = {"one Tensor": lambda: one(t)}
        for kind, (ty, val) in kinds.items():
            op = scratch.op("(Tensor a, " + ", ".join(f"{ty} x{i}" for i in range(16)) + ") -> ()")
            fns[kind] = lambda op=op, x=(t,) + (val,) * 16: op(*x)
        res = run(fns)
        print(f"\nkinds: us per argument (16 of a kind after one Tensor, minus the one-Tensor op "
              f"{res['one Tensor']:.2f}, over 16)")
        for kind in kinds:
            print(f"  {kind:14s} {(res[kind] - res['one Tensor']) / 16:6.3f}")

    if "variants" in only:
        _, decode, args = calls["kda_decode"]
        schema = _schema_of(decode)
        plain = schema
        for alias in ("(a5!)", "(a15!)"):
            plain = plain.replace(alias, "")
        tensors = args[:9] + args[15:]
        packed = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a5!) state, Tensor state_indices, "
                  "Tensor? A_log, Tensor? dt_bias, Tensor(a9!) out, str scalars) -> ()")
        variants = {
            "CompositeExplicitAutograd (as registered)": (scratch.op(schema), args),
            "CPU and CUDA keys": (scratch.op(schema, keys=("CPU", "CUDA")), args),
            "+ Autograd fallthrough": (scratch.op(schema, fallthrough=("Autograd",)), args),
            "no alias annotations": (scratch.op(plain), args),
            "six scalars packed in one str": (scratch.op(packed), tensors + ("softplus;;;1;unique;0",)),
        }
        fns = {n: (lambda op=op, x=x: op(*x)) for n, (op, x) in variants.items()}
        print("\nvariants: kda_decode's schema, no-op kernel")
        grad = run(fns)
        with torch.inference_mode():
            inf = run(fns)
        for n in variants:
            print(f"  {n:42s} grad {grad[n]:6.2f}   inference_mode {inf[n]:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
