"""Benchmark of the CUDA kda_prefill modules against fla's chunk_kda (Triton) on identical inputs.

Cases (issue 8): layer {8192, 16384, 2x8192, 3000+13384, 4x4096, 2x(8128+64), 8x(1024+64), 32768
tokens}, wrapper {4x64, 16x64, 64x64, 16x128, 16x256, 16 random lengths in 17..255}, heads 12 and
16 (--heads), softplus and bounded (lower_bound -5) gates (--gates; log: the softplus gate's decays computed
outside, as the engines' fused gate kernels do), fp32 initial and final state; plus the
small sequences x heads rows B=1, T in {2048, 4096, 16384}, H in {1, 2, 4, 8}.
`--grid issue46` takes issue 46's grid instead: H in {8, 12, 16, 24, 32, 48, 96} (--heads narrows it)
x {B1 T 2K, 8K, 32K, 128K; 4x8192; 64x512; 8x(1024+64); 7 ragged sequences summing to 8192}, and
`--long` adds 1 x 1,048,576 tokens at H16. `--grid mixed` (heads 8, 12 unless --heads): one long request among
short ones (1x4000+47x100 ... 1x256+127x64; vLLM's 255x1+1x4000, 63x1+1x8000), a serving engine's prefill batch;
`--grid serving` (heads 8, 12 unless --heads): batches of whole 512-2048-token prompts (4 / 16 / 64 x 1024, 4 / 16 x
2048, 16 x 512) and issue 46's 8x(1024+64) and ragged 8K rows; with `--known-lengths` the route
sees the longest sequence (max_seqlen, as SGLang's extend passes it) and the route without it is timed beside;
`--longest` routes with it given and nothing more (so an --opt-in-arm A/B runs on the routes that need it).
`--grid wave_edge`: one long prompt among like-length ones at 256-383 sequences x heads (H16 / H24 / H48), the call's
token-heads 104-128 times the longest (chosen at fused_chunk16_wave's lower edge of 128; from their times the edge is
100 since; run it with --longest).

Peers (--peers, default fla,cudnn; flashkda on request): fla's chunk_kda, cuDNN's kda_hopper_cuda engine
(benchmarks/peer_cudnn.py) and vLLM 0.34's FlashKDA, Kimi K3's own prefill on an H200 (benchmarks/peer_flashkda.py,
bounded gate; carry .engines/vllm), each when importable; --fla-heads limits fla to some head counts (each
new head count costs fla a Triton compile). Before timing, each peer's output and final state are
compared with ours (relative L2, and whether the peer's output is finite): rows record both.

Timing goes through benchmarks/harness.py: CUDA events around one call with L2 flushed before each
call (cold L2), median of --reps, ours and fla interleaved A B B A; also the host-inclusive wall time
("wall"), CUDA-graph replay with --modes graph,eager,wall, and the kernel-only time issue 8 asks
for (the union of the call's kernel spans from torch.profiler) with --modes kernel. The module is the one
jit/routes/kda_prefill.json picks for the case (or --module), with a preallocated workspace (as a
CUDA-graph capture would have). fla gets the same tensors: its state in the same [N, HV, V, K] layout
(state_v_first=True), gates and l2norm in its kernels.

    python benchmarks/bench_prefill.py --out bench_prefill.json [--heads 16] [--quick] [--no-fla]
    python benchmarks/bench_prefill.py --grid issue46 --long --modes eager --out DIR --name prefill_grid
    python benchmarks/bench_prefill.py --dry-run       # CPU backend, tiny shapes: checks the logic

`--slow-keys N --slow-bias B` gives N key channels a head the dt_bias B (default -20: those keys barely
decay), as a trained model's long-memory channels do; random gates decay every key fast. `--a-log X` sets every
head's A_log to X (default: uniform in [-1, -0.5]); with the softplus gate a large one (fla's KDA layers draw
exp(A_log) from [1, 16]) decays by several nats a token, which sends prefill_c16's chunks to its elementwise fallback.
`--gate-params fla-init` draws A_log and dt_bias as fla 0.6.0 initialises a KDA layer (benchmarks/gate_params.py):
its slowest keys decay by ~1e-3 nats a token, the regime where every split's warm-up walks thousands of tokens back.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import peer_cudnn  # noqa: E402
import peer_flashkda  # noqa: E402
from gate_params import KINDS as GATE_PARAM_KINDS, draw as gate_params_draw  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
K = V = 128
DEVICE = "cuda"
GATES = {"softplus": 0, "bounded": 1, "log": 2}
# The bounded gate's lower bound in every run here: ours, the route metadata and the peers all take this one.
LOWER_BOUND = -5.0


def load(name):
    from flashkda_ext import jit
    return jit.load_module(name)


def routed_longest(args, lens):
    """The max_seqlen the routes of 'ours' and the opt-in arm see: the longest sequence with --known-lengths or
    --longest (as an engine's adapter passes it), else None (taken at the mean)."""
    return max(lens) if args.known_lengths or args.longest else None


def route_module(num_seqs, heads, total_tokens, gate, opted_in=None, state="f32", max_seqlen=None):
    from flashkda_ext import dispatch, validation
    meta = validation.prefill_route_meta(DEVICE, num_seqs, heads, total_tokens, max_seqlen, state, "o64", gate,
                                         False, lower_bound=LOWER_BOUND)
    return dispatch.module_name("kda_prefill", meta, opted_in)


def cases(heads, quick):
    g = torch.Generator().manual_seed(7)
    rnd = torch.randint(17, 256, (16,), generator=g).tolist()
    layer = {"8192": [8192], "16384": [16384], "2x8192": [8192] * 2, "3000+13384": [3000, 13384],
             "4x4096": [4096] * 4, "2x(8128+64)": [8128, 64] * 2, "8x(1024+64)": [1024, 64] * 8, "32768": [32768]}
    wrap = {"4x64": [64] * 4, "16x64": [64] * 16, "64x64": [64] * 64, "16x128": [128] * 16, "16x256": [256] * 16,
            "16xrand17-255": rnd}
    out = []
    for H in heads:
        for k, v in {**layer, **wrap}.items():
            out.append((f"H{H} {k}", v, H))
    for T in (2048, 4096, 16384):
        for H in (1, 2, 4, 8):
            out.append((f"B1 T{T} H{H}", [T], H))
    return out[:6] if quick else out


ISSUE46_HEADS = (8, 12, 16, 24, 32, 48, 96)
RAGGED_8K = [3000, 1500, 1200, 900, 700, 500, 392]   # 7 sequences, 8192 tokens


def module_call(name, d, gate, N, T, H, dev, in_place=False):
    """(fn, out, fin): one kda_prefill call of module `name` on inputs d, its workspace (when the module asks
    for one), output and final state allocated once, outside the timed call. in_place: as the engines call it, the
    states in a pool of 2N slots (the call's at odd slots, by state_indices) updated in place; each call then starts
    from the state the one before left, so its output is for timing, not for comparing."""
    import tvm_ffi
    mod = load(name)
    ws = None
    if mod.implements_function("kda_prefill_workspace_bytes"):
        ws = torch.empty(max(1, mod["kda_prefill_workspace_bytes"](T, N, H)), dtype=torch.uint8, device=dev)
    out, init, idx = torch.empty_like(d["v"]), d["init"], None
    if in_place:
        init = torch.zeros((2 * N,) + tuple(d["init"].shape[1:]), dtype=d["init"].dtype, device=dev)
        idx = torch.arange(1, 2 * N, 2, dtype=torch.int32, device=dev)
        init[idx.long()] = d["init"]
    fin = init if in_place else torch.empty_like(d["init"])
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], d["A_log"], d["dt_bias"], d["cu"], init, fin, idx, None,
            out, ws, GATES[gate], LOWER_BOUND, K ** -0.5, True, False, 0)

    def fn():
        if DEVICE == "cuda":
            with tvm_ffi.use_torch_stream():
                mod["kda_prefill"](*args)
        else:
            mod["kda_prefill"](*args)
    return fn, out, fin


def issue46_cases(heads, long):
    shapes = {**{f"B1 T{T // 1024}K": [T] for T in (2048, 8192, 32768, 131072)},
              "4x8192": [8192] * 4, "64x512": [512] * 64, "8x(1024+64)": [1024, 64] * 8, "ragged7 8K": RAGGED_8K}
    out = [(f"H{H} {k}", v, H) for H in heads for k, v in shapes.items()]
    out += [("H32 4x4096", [4096] * 4, 32), ("H64 B1 T8K", [8192], 64)]   # issue 46's throughput targets
    if long:
        out.append(("H16 B1 T1M", [1 << 20], 16))
    return out


def serving_cases(heads):
    """Batches of whole prompts of 512-2048 tokens, as vLLM serves Kimi K3's prefills (B x 1024 is where K3's own
    FlashKDA led the chunk-64 routes, h200-2026-12-05-1b1a007), beside issue 46's two mid-length rows."""
    shapes = {"4x1024": [1024] * 4, "16x1024": [1024] * 16, "64x1024": [1024] * 64, "4x2048": [2048] * 4,
              "16x2048": [2048] * 16, "16x512": [512] * 16, "8x(1024+64)": [1024, 64] * 8, "ragged7 8K": RAGGED_8K}
    return [(f"H{H} {k}", v, H) for H in heads for k, v in shapes.items()]


def wave_edge_cases():
    """One long prompt among like-length ones at 256..383 sequences x heads (fused_chunk16_wave's band), the longest
    set so the call's token-heads are 104 .. 128 times its length (work_per_longest; the band's lower edge was 128 when
    these rows were chosen, 100 since): where the role-split kernel's longest chain starts to outlast the chunk-64 call
    or the mixed-length pieces."""
    shapes = {16: {"1x2048+15x752": [2048] + [752] * 15, "1x2048+15x853": [2048] + [853] * 15,   # 104, 116
                   "1x2048+15x956": [2048] + [956] * 15},                                        # 128
              24: {"1x3000+11x909": [3000] + [909] * 11, "1x3000+11x1136": [3000] + [1136] * 11},  # 104, 124
              48: {"1x4000+6x778": [4000] + [778] * 6, "1x4000+6x1112": [4000] + [1112] * 6}}     # 104, 128
    return [(f"H{H} {k}", v, H) for H, rows in shapes.items() for k, v in rows.items()]


def mixed_cases(heads):
    """One long request among short ones, as a serving engine's prefill batch often is (a chunk of a long prompt
    beside new short prompts): the fused chunk-16 band by the mean, split by the longest (work_per_longest)."""
    shapes = {"1x4000+47x100": [4000] + [100] * 47, "1x2000+63x100": [2000] + [100] * 63,
              "1x1000+127x60": [1000] + [60] * 127, "1x512+127x64": [512] + [64] * 127,
              "1x256+127x64": [256] + [64] * 127,
              # vLLM's usual step: one-token decodes first, then one prompt chunk (integrations/vllm/host_lengths.py)
              "255x1+1x4000": [1] * 255 + [4000], "63x1+1x8000": [1] * 63 + [8000]}
    return [(f"H{H} {k}", v, H) for H in heads for k, v in shapes.items()]


def is_b1(case_name):
    """A "B=1" row of either grid: its name holds the word B1 (the layer grid starts with it)."""
    return "B1" in case_name.split()


def dry_cases():
    return [("H2 5+0+9", [5, 0, 9], 2), ("B1 T12 H1", [12], 1)]


def make(lens, H, gate, dev, slow_keys=0, slow_bias=-20.0, a_log=None, gate_params="random"):
    T = sum(lens)
    d = dict(q=torch.randn(1, T, H, K, device=dev).bfloat16(), k=torch.randn(1, T, H, K, device=dev).bfloat16(),
             v=torch.randn(1, T, H, V, device=dev).bfloat16(), g=torch.randn(1, T, H, K, device=dev).bfloat16(),
             beta=torch.randn(1, T, H, device=dev).bfloat16())
    d["A_log"], d["dt_bias"] = gate_params_draw(H, K, gate, gate_params, device=dev)
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    d["cu"] = torch.tensor(cu, dtype=torch.int32, device=dev)
    d["init"] = torch.randn(len(lens), H, V, K, device=dev)
    if slow_keys:   # long-memory channels: a very negative dt_bias gives those keys a log decay near 0 a token
        d["dt_bias"].view(H, K)[:, :slow_keys] = slow_bias
    if a_log is not None:
        d["A_log"].fill_(a_log)
    if gate == "log":  # the softplus gate's decays, computed outside (as an engine's fused gate kernel does), in bf16
        from flashkda_ext.reference.gates import gate_log_decay
        d["g"] = gate_log_decay(d["g"], "softplus", d["A_log"], d["dt_bias"]).bfloat16()
        d["A_log"] = d["dt_bias"] = None
    return d


def agreement(ours, out, fin, peer) -> dict:
    """One call of ours and of the peer on the same inputs: the peer's output and final state against
    ours (relative L2) and whether the peer's output is finite."""
    ours()
    o, s = peer()[:2]
    torch.cuda.synchronize()
    o = o.reshape(out.shape)
    finite = bool(torch.isfinite(o).all())

    def rel(a, b, step=1 << 26):
        """||a - b|| / ||b|| on the device, 2^26 elements at a time: the largest cases hold billions of elements,
        and whole fp32 copies of both ran an 80 GB card out of memory (1 x 1M tokens H16, H96 B1 T128K)."""
        a, b = a.reshape(-1), b.reshape(-1)
        num = den = 0.0
        for i in range(0, b.numel(), step):
            x, y = a[i:i + step].float(), b[i:i + step].float()
            num += (x - y).square().sum(dtype=torch.float64).item()
            den += y.square().sum(dtype=torch.float64).item()
        return (num ** 0.5) / max(den ** 0.5, 1e-30)

    return {"finite": finite, "out_rel_l2": rel(o, out) if finite else float("nan"),
            "state_rel_l2": rel(s, fin) if s.numel() else None}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap)   # --out (folder or .json), --reps, --quick, --no-fla, --dry-run, --modes, ...
    ap.add_argument("--heads", default=None, help="head counts (default 16,12; issue46 grid: all of it)")
    ap.add_argument("--grid", choices=("layer", "issue46", "mixed", "serving", "wave_edge"), default="layer")
    ap.add_argument("--long", action="store_true", help="issue46 grid: add 1 x 1,048,576 tokens at H16")
    ap.add_argument("--peers", default="fla,cudnn",
                    help="comma list of fla, cudnn, flashkda (each when importable; flashkda: bounded gate)")
    ap.add_argument("--fla-heads", default=None, help="run fla only at these head counts")
    ap.add_argument("--gates", default="softplus,bounded")
    ap.add_argument("--module", default=None, help="force one module instead of the route's")
    ap.add_argument("--opt-in-arm", default=None, metavar="TAG",
                    help="A/B in one run: where the route with opt-in TAG picks another module, time it as arm "
                         "'opt_in' beside 'ours' (same inputs, interleaved) and check it against ours")
    ap.add_argument("--known-lengths", action="store_true",
                    help="route 'ours' as a caller passing max_seqlen (the longest sequence) is routed, and where the "
                         "route without it picks another module time that one as arm 'opt_in' beside it (not with "
                         "--opt-in-arm)")
    ap.add_argument("--longest", action="store_true",
                    help="route 'ours' (and the --opt-in-arm) with max_seqlen, the longest sequence, given, as the "
                         "engines' and fla's adapters call the op (rules with max_seqlen_min need it)")
    ap.add_argument("--skip-small", action="store_true",
                    help="leave out the B=1 rows (each new head count costs fla a Triton compile)")
    ap.add_argument("--only-small", action="store_true", help="only the B=1 rows")
    ap.add_argument("--cases", default=None,
                    help="only these case names of the grid, comma-separated (e.g. 'H16 64x512,H32 4x4096')")
    ap.add_argument("--slow-keys", type=int, default=0,
                    help="this many key channels a head decay slowly (dt_bias --slow-bias): a model's long-memory "
                         "channels; a split of the chain must then warm up from further back")
    ap.add_argument("--slow-bias", type=float, default=-20.0, help="dt_bias of the --slow-keys channels")
    ap.add_argument("--a-log", type=float, default=None,
                    help="every head's A_log (default uniform in [-1, -0.5]); the softplus gate's decay a token scales "
                         "with exp(A_log)")
    ap.add_argument("--gate-params", choices=GATE_PARAM_KINDS, default="random",
                    help="how A_log and dt_bias are drawn (benchmarks/gate_params.py): 'random' (every key decays "
                         "fast) or 'fla-init' (as fla 0.6.0 initialises a KDA layer: the slowest keys decay by ~1e-3 "
                         "nats a token, so a split's warm-up walks far back)")
    ap.add_argument("--state", choices=("f32", "bf16"), default="f32", help="the recurrent state's dtype")
    ap.add_argument("--in-place", action="store_true",
                    help="ours (and the opt-in arm) update a pool in place by state_indices, as vLLM and SGLang call "
                         "the op; no agreement checks then (each call starts from the last one's state)")
    ap.add_argument("--name", default="prefill", help="results file stem (when --out is a folder)")
    ap.set_defaults(reps=12, modes="eager,wall")
    return ap.parse_args(argv)


def main(argv=None):
    global K, V, DEVICE
    args = parse(argv)
    cfg = harness.config_from_args(args)
    DEVICE = cfg.device
    dry = args.dry_run or not cfg.is_cuda
    if not cfg.is_cuda:           # dry run: the CPU backend through the same module ABI
        K = V = 16
    dev = torch.device(DEVICE)
    torch.manual_seed(0)
    peers = {p.strip() for p in args.peers.split(",") if p.strip()}
    chunk_kda = None
    if not args.no_fla and "fla" in peers and cfg.is_cuda:
        try:
            from fla.ops.kda import chunk_kda
        except Exception as e:  # noqa: BLE001
            print("fla not importable:", repr(e)[:200])
    def peer_ok(name, module, what):
        """Whether the peer was asked for and loads here (why not, printed)."""
        if name not in peers or not cfg.is_cuda:
            return False
        why = module.available()
        if why:
            print(f"{what} not importable:", why)
        return why is None
    cudnn_ok = peer_ok("cudnn", peer_cudnn, "cuDNN frontend")
    flashkda_ok = peer_ok("flashkda", peer_flashkda, "vLLM's FlashKDA")
    fla_heads = None if args.fla_heads is None else {int(h) for h in args.fla_heads.split(",")}
    if args.known_lengths and args.opt_in_arm:
        raise SystemExit("--known-lengths times the route without max_seqlen as the 'opt_in' arm: not with --opt-in-arm")
    if dry:
        case_list = dry_cases()
    elif args.grid == "mixed":
        case_list = mixed_cases([int(h) for h in (args.heads or "8,12").split(",")])
    elif args.grid == "wave_edge":   # fixed head counts: --heads does not apply
        case_list = wave_edge_cases()
    elif args.grid == "serving":
        case_list = serving_cases([int(h) for h in (args.heads or "8,12").split(",")])
    elif args.grid == "issue46":
        heads = ISSUE46_HEADS if args.heads is None else [int(h) for h in args.heads.split(",")]
        case_list = issue46_cases(heads, args.long)
    else:
        case_list = cases([int(h) for h in (args.heads or "16,12").split(",")], args.quick)
    if args.skip_small:   # "B1 T2048 H1" (layer grid), "H8 B1 T2K" (issue46 grid)
        case_list = [c for c in case_list if not is_b1(c[0])]
    if args.only_small:
        case_list = [c for c in case_list if is_b1(c[0])]
    if args.cases:
        keep = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = sorted(set(keep) - {c[0] for c in case_list})
        if unknown:
            raise SystemExit(f"--cases: not in this grid: {unknown} (known: {[c[0] for c in case_list]})")
        case_list = [c for c in case_list if c[0] in keep]
    gates = args.gates.split(",")
    run = harness.Run(args.name, cfg, baseline="fla" if chunk_kda is not None else None,
                      primary_mode="eager" if cfg.is_cuda else "wall",
                      extra_meta={"fla_used": chunk_kda is not None, "state": args.state,
                                  "cudnn": {"version": peer_cudnn.version(), "engine": peer_cudnn.ENGINE}
                                  if cudnn_ok else None,
                                  "flashkda": "vLLM 0.34.0 _flashkda_C (Kimi K3's prefill)" if flashkda_ok else None})
    run.start(len(gates) * len(case_list))
    rows = []
    pm = run.primary_mode
    for gate in gates:
        for name, lens, H in case_list:
            d = make(lens, H, gate, dev, args.slow_keys, args.slow_bias, args.a_log, args.gate_params)
            if args.state == "bf16":
                d["init"] = d["init"].bfloat16()
            N, T = len(lens), sum(lens)
            longest = routed_longest(args, lens)
            mname = args.module or route_module(N, H, T, gate, state=args.state, max_seqlen=longest)
            ours, out, fin = module_call(mname, d, gate, N, T, H, dev, args.in_place)
            arms = [harness.Arm("ours", ours)]
            checks = {}
            alt_name = (route_module(N, H, T, gate, {args.opt_in_arm}, args.state, longest)
                        if args.opt_in_arm and not args.module else None)
            if args.known_lengths and not args.module:
                alt_name = route_module(N, H, T, gate, state=args.state)
            if alt_name is not None and alt_name != mname:
                alt_fn, alt_out, alt_fin = module_call(alt_name, d, gate, N, T, H, dev, args.in_place)
                if not args.in_place:
                    checks["opt_in"] = agreement(ours, out, fin, lambda f=alt_fn, o=alt_out, s=alt_fin: (f(), o, s)[1:])
                    checks["opt_in"].update(module=alt_name, bitwise=bool(torch.equal(alt_out.view(torch.int16),
                                                                                      out.view(torch.int16))))
                arms.append(harness.Arm("opt_in", alt_fn))
            if cudnn_ok:
                try:
                    cud = peer_cudnn.prefill_fn(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=d["A_log"],
                                                dt_bias=d["dt_bias"], gate=gate, lower_bound=LOWER_BOUND, scale=K ** -0.5,
                                                cu_seqlens=d["cu"], initial_state=d["init"])
                    if not args.in_place:
                        checks["cudnn"] = agreement(ours, out, fin, cud)
                    arms.append(harness.Arm("cudnn", cud))
                except Exception as e:  # noqa: BLE001 - a shape cuDNN refuses is recorded, not fatal
                    checks["cudnn"] = {"error": repr(e)[:300]}
            if flashkda_ok and gate == "bounded":
                try:
                    fk = peer_flashkda.prefill_fn(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=d["A_log"],
                                                  dt_bias=d["dt_bias"], lower_bound=LOWER_BOUND, cu_seqlens=d["cu"],
                                                  initial_state=d["init"])
                    if not args.in_place:
                        checks["flashkda"] = agreement(ours, out, fin, fk)
                    arms.append(harness.Arm("flashkda", fk))
                except Exception as e:  # noqa: BLE001 - a shape FlashKDA refuses is recorded, not fatal
                    checks["flashkda"] = {"error": repr(e)[:300]}
            if chunk_kda is not None and (fla_heads is None or H in fla_heads):
                kw = dict(scale=K ** -0.5, initial_state=d["init"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=d["A_log"],
                          dt_bias=d["dt_bias"], state_v_first=True, cu_seqlens=d["cu"].long())
                if gate == "bounded":
                    kw.update(safe_gate=True, lower_bound=LOWER_BOUND)
                if gate == "log":
                    kw.update(use_gate_in_kernel=False, A_log=None, dt_bias=None)
                arms.append(harness.Arm("fla", lambda d=d, kw=kw: chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"],
                                                                              **kw)))
            # essential traffic: q, k, v, g, beta read, out written, initial state read, final written
            nbytes = T * H * (3 * K + V + 1) * 2 + T * H * V * 2 + 2 * N * H * V * K * d["init"].element_size()
            params = dict(case=name, gate=gate, T=T, N=N, H=H, module=mname)
            if args.state != "f32":
                params["state"] = args.state
            if args.slow_keys:
                params.update(slow_keys=args.slow_keys, slow_bias=args.slow_bias)
            if args.in_place:
                params["in_place"] = True
            if args.a_log is not None:
                params["a_log"] = args.a_log
            if args.gate_params != "random":
                params["gate_params"] = args.gate_params
            rec = run.add(harness.Case(f"{name} {gate}", params, arms, bytes=nbytes,
                                       notes={"checks": checks} if checks else {}))
            ours_t = rec["arms"]["ours"]["time_us"].get(pm, {}).get("median")
            r = dict(case=name, gate=gate, T=T, N=N, H=H, module=mname,
                     ours_ms=None if ours_t is None else ours_t / 1e3, checks=checks)
            for peer in ("cudnn", "flashkda"):   # the peer's ms, and its time over ours
                peer_t = rec["arms"].get(peer, {}).get("time_us", {}).get(pm, {}).get("median")
                if peer_t is not None:
                    r[f"{peer}_ms"] = peer_t / 1e3
                    if ours_t:
                        r[f"vs_{peer}"] = peer_t / ours_t
            if "opt_in" in rec["arms"]:
                alt_t = rec["arms"]["opt_in"]["time_us"].get(pm, {}).get("median")
                if alt_t is not None:
                    r.update(opt_in_module=alt_name, opt_in_ms=alt_t / 1e3)
                    if ours_t:
                        r["opt_in_vs_ours"] = ours_t / alt_t
                    if r.get("cudnn_ms"):
                        r["opt_in_vs_cudnn"] = r["cudnn_ms"] / r["opt_in_ms"]
            if "fla" in rec["arms"]:
                fla_t = rec["arms"]["fla"]["time_us"].get(pm, {}).get("median")
                if fla_t is not None:
                    r["fla_ms"] = fla_t / 1e3
                    if ours_t:
                        r["speedup"] = fla_t / ours_t
            rows.append(r)
            print(json.dumps(r), flush=True)
            del ours, arms  # this case's workspace and buffers go before the next case's inputs
    sp = [r["speedup"] for r in rows if "speedup" in r]
    vc = [r["vs_cudnn"] for r in rows if "vs_cudnn" in r and r["checks"].get("cudnn", {}).get("finite")]
    vf = [r["vs_flashkda"] for r in rows if "vs_flashkda" in r and r["checks"].get("flashkda", {}).get("finite")]
    run.extra.update(device=torch.cuda.get_device_name() if cfg.is_cuda else "cpu", rows=rows,
                     geomean_speedup=harness.geomean(sp), min_speedup=(min(sp) if sp else None),
                     geomean_vs_cudnn_finite=harness.geomean(vc), geomean_vs_flashkda=harness.geomean(vf),
                     time=time.strftime("%Y-%m-%d %H:%M:%S"))
    run.finish()
    f = lambda r, k, fmt="%.4f": fmt % r[k] if r.get(k) is not None else "-"  # noqa: E731
    print("\n%-22s %-9s %-22s %9s %9s %9s %6s %6s %s" % ("case", "gate", "module", "ours ms", "cudnn ms", "fla ms",
                                                         "x cud", "x fla", "cudnn check"))
    for r in rows:
        c = r["checks"].get("cudnn", {})
        note = ("err" if "error" in c else f"rel {c['out_rel_l2']:.1e}" + ("" if c["finite"] else " NONFINITE")) if c else "-"
        print("%-22s %-9s %-22s %9s %9s %9s %6s %6s %s" % (r["case"], r["gate"], r["module"], f(r, "ours_ms"),
                                                          f(r, "cudnn_ms"), f(r, "fla_ms"), f(r, "vs_cudnn", "%.2f"),
                                                          f(r, "speedup", "%.2f"), note))
    if sp:
        print("geomean speedup over fla: %.2fx, min %.2fx" % (harness.geomean(sp), min(sp)))
    if vc:
        print("over cuDNN where its output is finite: geomean %.2fx, min %.2fx over %d rows"
              % (harness.geomean(vc), min(vc), len(vc)))
    if vf:
        print("over vLLM's FlashKDA (bounded gate): geomean %.2fx, min %.2fx over %d rows; %s"
              % (harness.geomean(vf), min(vf), len(vf), ", ".join(
                  "%s %.2fx" % (r["case"], r["vs_flashkda"]) for r in rows if "vs_flashkda" in r)))
    alts = [r for r in rows if "opt_in_ms" in r]
    if alts:
        print("\n%s arm (A/B in this run): %d rows, geomean %.3fx of ours, min %.3fx"
              % ("the route without max_seqlen ('opt_in')" if args.known_lengths else "opt-in %r" % args.opt_in_arm,
                 len(alts), harness.geomean([r["opt_in_vs_ours"] for r in alts]),
                 min(r["opt_in_vs_ours"] for r in alts)))
        for r in alts:
            c = r["checks"].get("opt_in", {})
            print("%-22s %-9s %-24s %9.4f vs %9.4f  %.3fx%s  %s" % (
                r["case"], r["gate"], r["opt_in_module"], r["opt_in_ms"], r["ours_ms"], r["opt_in_vs_ours"],
                " (cudnn %.2fx)" % r["opt_in_vs_cudnn"] if "opt_in_vs_cudnn" in r else "",
                "bitwise" if c.get("bitwise") else "rel %.1e" % c.get("out_rel_l2", float("nan"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
