"""The vLLM adapters' own host time, on any machine: each K3 call site (packed decode, speculative verify, the native
fused decode) called through its adapter on CPU tensors with the routed kernel replaced by a no-op (the op's fast-path
entry then returns at once), so what is timed is the Python between vLLM's call and the kernel launch: the adapter's
checks and views, the op's fast path. Beside it the op alone on the same mapped arguments. Under vLLM 0.34's breakable
CUDA graphs this path runs at every decode step of every KDA layer (docs/integrations.md, "Breakable CUDA graphs").

    python3 scripts/adapter_host_time.py [--heads 12] [--calls 3000]

Needs the vLLM wheel's files (`python3 scripts/prepare_vllm_engine.py`, .engines/vllm). On a CPU the host index checks
(slot ranges read on the host) are included, which a GPU call skips; `bench_vllm.py --modes host` on a GPU times the
whole call against vLLM's own.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))


def _per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def _stubbed(fast_path):
    """Replace every fast-path entry's checked function by one that launches nothing (returns the signature)."""
    for key, (_, sig, tail, *extra) in list(fast_path._ENTRIES.items()):
        fast_path._ENTRIES[key] = (lambda s, *a: s, sig, tail, *extra)


def _op_alone(adapter, call: dict, op_module, name: str, calls: int, fast_path) -> float:
    """The op on the arguments the adapter mapped the call to (captured once), stubbed the same way."""
    real, seen = getattr(op_module, name), {}

    def capture(*a, **k):
        seen["a"], seen["k"] = a, k
        return real(*a, **k)
    setattr(op_module, name, capture)
    try:
        adapter(**call)
    finally:
        setattr(op_module, name, real)
    _stubbed(fast_path)
    return _per_call_us(lambda: real(*seen["a"], **seen["k"]), calls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", default=str(ROOT / ".engines" / "vllm"))
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args(argv)
    import bench_vllm
    import bench_vllm_native
    import vllm_step_metadata
    from flashkda_ext import fast_path
    from flashkda_ext import ops as op_module
    ops, fkda_vllm = bench_vllm.load_vllm(Path(args.engine_dir))
    wrapper = vllm_step_metadata.fused_kda_decode(Path(args.engine_dir))
    native = fkda_vllm.adapter_for(bench_vllm_native.SITE, wrapper)

    class Shape:    # bench_vllm.inputs' knobs for decode / verify
        spec_tokens, prefill_len, mixed_prompt, paged = 4, 32, 40, False
    cpu, H = torch.device("cpu"), args.heads
    cases = [(f"packed decode rows={r}", getattr(ops, bench_vllm.NAMES["decode"]), "kda_decode",
              bench_vllm.inputs("decode", r, H, torch.float32, -5.0, Shape, cpu)[0]) for r in (1, 4)]
    cases += [(f"verify requests={r}", getattr(ops, bench_vllm.NAMES["verify"]), "kda_verify",
               bench_vllm.inputs("verify", r, H, torch.float32, -5.0, Shape, cpu)[0]) for r in (1, 16)]
    cases += [(f"native decode rows={r}", native, "fused_kda_decode",
               bench_vllm_native.layer_call(r, H, torch.Generator().manual_seed(r), cpu)[0]) for r in (1, 4)]
    def served() -> int:     # calls served at every site so far
        return sum(n for (_, what), n in fkda_vllm.STATS.items() if what == "served")

    print(f"H{H}, fp32 state, bounded gate; us a call, the kernel replaced by a no-op")
    print(f"{'site':<26} {'adapter':>8} {'op alone':>9}")
    with torch.inference_mode():
        for name, adapter, op_name, call in cases:
            fast_path.clear()
            before = served()
            adapter(**call)     # validated in full once; the entry is then stubbed
            if served() != before + 1:
                raise SystemExit(f"{name}: the adapter did not serve the call ({dict(fkda_vllm.REASONS)})")
            _stubbed(fast_path)
            mine = _per_call_us(lambda: adapter(**call), args.calls)
            alone = _op_alone(adapter, call, op_module, op_name, args.calls, fast_path)
            print(f"{name:<26} {mine:>8.2f} {alone:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
