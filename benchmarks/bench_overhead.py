#!/usr/bin/env python
"""Host overhead of the public ops: validation + routing, and trace emission when enabled.

Arms per case, same inputs, interleaved A B B A (harness.py):

  direct   the module's TVM-FFI function called with prepared arguments (no validation, no routing)
  op       the public op (flashkda_ext.kda_decode / fused_kda_decode / kda_prefill), tracing off
  op_full  the same with the signature fast path off: every call validated in full
  op_inference  the op inside torch.inference_mode() (how serving engines call it: the fast path
           then reads only the neg bits of the tensors, not requires_grad / inference flags), read
           against direct_inference, the direct call inside the same context (entering the context
           per call costs a few us itself; an engine enters it once per step)
  custom_op  the torch.library op flashkda_ext::<op> called eagerly (what a torch.compile'd model's
           graph calls); absent on a tree without flashkda_ext/custom_ops.py. Its kernel calls the
           public op, so the note custom_op_over_op (custom_op - op) is the dispatcher's round trip
           (issue 29's target: at most 2 us; scripts/custom_op_floor.py splits it further)
  traced   the public op inside flashkda_ext.trace.tracing(dir): definition once, a workload line
           per call (what FLASHKDA_EXT_TRACE_DIR costs a serving loop)

The interesting numbers are differences of host-inclusive time: op - direct is the price of
validation and dispatch, traced - op the price of tracing. Two modes by default (harness.py): wall
(one call, synchronized: what a waiting caller sees; its sync jitter is several us on a GPU host) and
host (calls back to back: the issue rate, which for these small calls is the host cost itself, with a
spread well under 1 us, so it resolves the differences a fast-path change makes). Speedups are quoted against "op", so the
"direct" column reads as op/direct and "traced" as op/traced (below 1: slower than the op).
Runs on a CPU (the CPU backend) as well as on a GPU (small shapes: overhead dominates).

    python benchmarks/bench_overhead.py [--quick] [--dry-run]

(benchmarks/bench_trace_overhead.py times the disabled-tracing check itself against its 1 us budget;
benchmarks/bench_jax_overhead.py the JAX front end.)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(p)
    p.add_argument("--name", default="host_overhead")
    return p.parse_args(argv)


def _flat(x):
    return None if x is None else x.reshape(-1)


def _custom_op(name):
    """torch.ops.flashkda_ext.<name>.default when this tree registers it (importing flashkda_ext does),
    else None (an older tree in an A/B run)."""
    try:
        return getattr(torch.ops.flashkda_ext, name).default
    except (AttributeError, RuntimeError):
        return None


def _inference(fn):
    """fn run inside torch.inference_mode() (entered per call, as the arm times it)."""
    def run():
        with torch.inference_mode():
            fn()
    return run


def decode_case(rows, H, D, cfg, gen, trace_dir):
    import flashkda_ext as fk
    from flashkda_ext import dispatch, fast_path, trace, validation

    dev = torch.device(cfg.device)
    dt = torch.bfloat16
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype=dt, device=dev)  # noqa: E731
    q, k, v, g, beta = r(rows, H, D), r(rows, H, D), r(rows, H, D), r(rows, H, D), r(rows, H)
    A_log = torch.randn(H, generator=gen).to(dev)
    dt_bias = torch.randn(H * D, generator=gen).to(dev)
    slots = max(64, 2 * rows)
    state = (torch.randn(slots, H, D, D, generator=gen) * 0.1).to(dev)
    idx = harness.random_unique_slots(rows, slots, dev, generator=gen)
    out = torch.empty(rows, H, D, dtype=dt, device=dev)
    kw = dict(state=state, state_indices=idx, A_log=A_log, dt_bias=dt_bias, out=out)
    call = validation.check_kda_decode(q, k, v, g, beta, **kw)
    fn = dispatch.function("kda_decode", call.route_meta())
    flat_bias = _flat(dt_bias)

    def direct():
        fn(q, k, v, g, beta, A_log, flat_bias, state, idx, out, call.gate_mode, call.lower_bound, call.scale,
           call.beta_is_logit, call.null_slot0)

    def op():
        fast_path.ENABLED = True
        fk.kda_decode(q, k, v, g, beta, **kw)

    def op_full():
        fast_path.ENABLED = False
        fk.kda_decode(q, k, v, g, beta, **kw)

    def traced():
        with trace.tracing(trace_dir):
            fk.kda_decode(q, k, v, g, beta, **kw)


    custom = _custom_op("kda_decode")
    arms = [harness.Arm("direct", direct), harness.Arm("op", op), harness.Arm("op_full", op_full),
            harness.Arm("traced", traced, graph=False), harness.Arm("op_inference", _inference(op)),
            harness.Arm("direct_inference", _inference(direct))]
    if custom is not None:
        arms.append(harness.Arm("custom_op", lambda: custom(
            q, k, v, g, beta, state, idx, A_log, dt_bias, None, "softplus", None, True, "unique", False, out)))
    return harness.Case(f"kda_decode_r{rows}_h{H}_d{D}", dict(op="kda_decode", rows=rows, heads=H, head_dim=D), arms)


def fused_case(rows, H, D, cfg, gen, trace_dir):
    import flashkda_ext as fk
    from flashkda_ext import dispatch, fast_path, trace, validation

    dev = torch.device(cfg.device)
    dt = torch.bfloat16
    C = 3 * H * D
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype=dt, device=dev)  # noqa: E731
    x, w, g, beta, og = r(rows, C), r(C, 4), r(rows, H, D), r(rows, H), r(rows, H, D)
    slots = max(64, 2 * rows)
    conv_state = r(slots, C, 3)
    A_log = torch.randn(H, generator=gen).to(dev)
    dt_bias = torch.randn(H * D, generator=gen).to(dev)
    state = (torch.randn(slots, H, D, D, generator=gen) * 0.1).to(dev)
    nw = torch.ones(D, device=dev)
    idx = harness.random_unique_slots(rows, slots, dev, generator=gen)
    out = torch.empty(rows, H, D, dtype=dt, device=dev)
    args = (x, w, conv_state, g, beta, A_log, dt_bias, idx, state, og, nw)
    call = validation.check_fused_kda_decode(*args, out=out)
    fn = dispatch.function("fused_kda_decode", call.route_meta())

    def direct():
        fn(x, w, conv_state, g, beta, A_log, dt_bias, idx, state, og, nw, out, call.gate_mode, call.lower_bound,
           call.scale, call.norm_eps, call.null_slot0)

    def op():
        fast_path.ENABLED = True
        fk.fused_kda_decode(*args, out=out)

    def op_full():
        fast_path.ENABLED = False
        fk.fused_kda_decode(*args, out=out)

    def traced():
        with trace.tracing(trace_dir):
            fk.fused_kda_decode(*args, out=out)


    custom = _custom_op("fused_kda_decode")
    arms = [harness.Arm("direct", direct), harness.Arm("op", op), harness.Arm("op_full", op_full),
            harness.Arm("traced", traced, graph=False), harness.Arm("op_inference", _inference(op)),
            harness.Arm("direct_inference", _inference(direct))]
    if custom is not None:
        arms.append(harness.Arm("custom_op", lambda: custom(
            *args, None, "softplus", 1e-5, None, "unique", False, out)))
    return harness.Case(f"fused_r{rows}_h{H}_d{D}", dict(op="fused_kda_decode", rows=rows, heads=H, head_dim=D),
                        arms)


def prefill_case(lengths, H, D, cfg, gen, trace_dir):
    import flashkda_ext as fk
    from flashkda_ext import fast_path, ops, trace, validation

    dev = torch.device(cfg.device)
    dt = torch.bfloat16
    T = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype=dt, device=dev)  # noqa: E731
    q, k, v, g, beta = r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device=dev)
    A_log = torch.randn(H, generator=gen).to(dev)
    dt_bias = torch.randn(H * D, generator=gen).to(dev)
    init = (torch.randn(len(lengths), H, D, D, generator=gen) * 0.1).to(dev)
    final = torch.empty_like(init)
    out = torch.empty(1, T, H, D, dtype=dt, device=dev)
    ws = None
    if cfg.is_cuda:
        nbytes = fk.prefill_workspace_bytes(q, v, cu_seqlens=cu)
        ws = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
    kw = dict(A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, initial_state=init, final_state=final,
              max_seqlen=max(lengths), out=out, workspace=ws)
    call = validation.check_kda_prefill(q, k, v, g, beta, **{n: x for n, x in kw.items() if n != "workspace"})
    fn = ops._prefill_route(call)[1]["kda_prefill"]

    def direct():
        fn(q, k, v, g, beta, A_log, dt_bias, cu, init, final, None, None, out, ws, call.gate_mode,
           call.lower_bound, call.scale, call.beta_is_logit, call.null_slot0, 0)

    def op():
        fast_path.ENABLED = True
        fk.kda_prefill(q, k, v, g, beta, **kw)

    def op_full():
        fast_path.ENABLED = False
        fk.kda_prefill(q, k, v, g, beta, **kw)

    def traced():
        with trace.tracing(trace_dir):
            fk.kda_prefill(q, k, v, g, beta, **kw)


    custom = _custom_op("kda_prefill")
    arms = [harness.Arm("direct", direct), harness.Arm("op", op), harness.Arm("op_full", op_full),
            harness.Arm("traced", traced, graph=False), harness.Arm("op_inference", _inference(op)),
            harness.Arm("direct_inference", _inference(direct))]
    if custom is not None:
        arms.append(harness.Arm("custom_op", lambda: custom(
            q, k, v, g, beta, A_log, dt_bias, None, "softplus", None, True, cu, init, None, None, True, final, 0,
            None, max(lengths), False, ws, out)))
    name = f"kda_prefill_{len(lengths)}x{lengths[0]}_h{H}_d{D}"
    return harness.Case(name, dict(op="kda_prefill", lengths=list(lengths), heads=H, head_dim=D), arms)


def overhead(slow: dict, fast: dict) -> dict:
    """What the slower arm adds over the faster one, from two wall-time summaries (us): the
    difference of the medians, and the noise it is read against (half of each arm's p10-p90 spread,
    added). A difference inside the noise is not a measured overhead: `us` is then 0 and `resolved`
    False, with the raw difference kept (a negative one is the noise, not a speed-up)."""
    diff = slow["median"] - fast["median"]
    noise = ((slow["p90"] - slow["p10"]) + (fast["p90"] - fast["p10"])) / 2
    resolved = diff > noise
    return {"us": diff if resolved else 0.0, "measured_us": diff, "noise_us": noise, "resolved": resolved}


def format_overhead(name: str, o: dict) -> str:
    if o["resolved"]:
        return f"{name} {o['us']:.1f} us (noise +-{o['noise_us']:.1f})"
    return f"{name} within noise (median difference {o['measured_us']:+.1f} us, noise +-{o['noise_us']:.1f})"


def main(argv=None) -> int:
    args = parse(argv)
    cfg = harness.config_from_args(args)
    if not args.modes:  # graph replay and device events leave the host out: nothing to read here
        cfg.modes = ("wall", "host")
    if cfg.is_cuda:
        D, H = 128, 16
        rows_list = [1, 64] if cfg.quick else [1, 8, 64, 512]
        prefill_lengths = [(64,) * 4] if cfg.quick else [(64,) * 4, (256,) * 16]
    else:
        D, H = (8, 2) if args.dry_run else (32, 4)
        rows_list = [1, 4] if (cfg.quick or args.dry_run) else [1, 8, 64]
        prefill_lengths = [(8, 8)]
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="fkda-trace-bench-") as trace_dir:
        run = harness.Run(args.name, cfg, baseline="op", primary_mode="wall",
                          extra_meta={"what": "host overhead: direct FFI call vs public op vs traced op"})
        builders = [(decode_case, r) for r in rows_list] + [(fused_case, r) for r in rows_list[:2]] + \
                   [(prefill_case, lens) for lens in prefill_lengths]
        run.start(len(builders))
        for build, size in builders:
            try:
                case = build(size, H, D, cfg, gen, trace_dir)
            except Exception as e:  # noqa: BLE001  e.g. a family with no route on this device yet
                print(f"skipped {build.__name__}({size}): {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                run.skipped.append({"case": f"{build.__name__}({size})", "error": f"{type(e).__name__}: {e}"[:400]})
                continue
            rec = run.add(case)
            for mode, suffix in (("wall", ""), ("host", "_host")):
                t = {a: rec["arms"][a]["time_us"].get(mode, {}) for a in rec["arms"]}
                for note, slow, fast in (("validate_dispatch", "op", "direct"), ("full_check", "op_full", "direct"),
                                         ("trace", "traced", "op"),
                                         ("inference_mode", "op_inference", "direct_inference"),
                                         ("custom_op", "custom_op", "direct"),
                                         ("custom_op_over_op", "custom_op", "op")):
                    if t.get(slow, {}).get("median") and t.get(fast, {}).get("median"):
                        rec["notes"][note + suffix] = overhead(t[slow], t[fast])
        run.finish()
        for rec in run.results:
            parts = [format_overhead(k, v) for k, v in rec["notes"].items() if isinstance(v, dict) and "us" in v]
            if parts:
                print(f"{rec['name']}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
