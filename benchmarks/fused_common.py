"""What the fused-op benchmarks share (bench_fused_decode.py, bench_fused_verify.py): their flags and grid
lists, the inputs they draw, the torch pieces of the unfused sequence an engine runs around the recurrent
step (the causal conv with its cache, the gate, the gated RMSNorm), the fused-vs-unfused agreement check,
and the run over the grid with each case's fused / plain-step ratio (main).

The unfused pieces are closures over preallocated buffers, as the arms are (harness.Arm): each call does
the work an engine does per step and nothing else.
"""
from __future__ import annotations

import sys

import torch

import harness

STATE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
CONV_WIDTH = 4
NORM_EPS = 1e-5


# -- flags and grid ---------------------------------------------------------------------------

def add_args(p, name: str, heads_help: str) -> None:
    """The flags both fused benchmarks take (besides harness.add_common_args)."""
    p.add_argument("--rows", default=None, help="comma list of row (request) counts")
    p.add_argument("--heads", default=None, help=f"comma list of head counts ({heads_help})")
    p.add_argument("--state", default=None, help="comma list of f32,bf16")
    p.add_argument("--gate", default="softplus", choices=["softplus", "bounded"])
    p.add_argument("--lower-bound", type=float, default=-5.0, help="for --gate bounded")
    p.add_argument("--head-dim", type=int, default=None, help="D (128 on GPU)")
    p.add_argument("--name", default=name, help="results file stem")
    p.add_argument("--no-unfused", action="store_true", help="leave the unfused sequence out")


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def grid_lists(args, cfg, rows, heads, states):
    """(rows, heads, states, D) from the flags, else from the (dry run, --quick, full grid) defaults given."""
    dry = args.dry_run or not cfg.is_cuda
    pick = lambda given, d: given if given else d[0] if dry else d[1] if cfg.quick else d[2]  # noqa: E731
    return (pick(args.rows and int_list(args.rows), rows), pick(args.heads and int_list(args.heads), heads),
            pick(args.state and args.state.split(","), states), args.head_dim or (16 if dry else 128))


def gate_kwargs(args) -> dict:
    return dict(gate=args.gate, lower_bound=args.lower_bound if args.gate == "bounded" else None)


def fit_slots(slots: int, need: int, per_slot: int, cfg) -> int:
    """Pool slots: `slots`, at least `need`, and on a GPU no more than ~1/4 of free memory."""
    slots = max(slots, need)
    if cfg.is_cuda:
        slots = max(need, min(slots, int(torch.cuda.mem_get_info(torch.device(cfg.device))[0] // 4 // per_slot)))
    return slots


def randn_makers(gen, dev):
    """(host draw, device draw): inputs drawn on the host from gen, the pools (GBs at 64 heads) on the
    device from a generator seeded by gen (on the host that took minutes)."""
    dgen = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    host = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s)  # noqa: E731
    device = lambda *shape, s=1.0: torch.randn(*shape, generator=dgen, device=dev).mul_(s)  # noqa: E731
    return host, device


# -- the unfused sequence's pieces -----------------------------------------------------------------

def fla_gate_fn():
    try:
        from fla.ops.kda.gate import fused_kda_gate
        return fused_kda_gate
    except Exception:  # noqa: BLE001
        return None


def conv_split_fn(x, conv_weight, conv_state, lines, outs, offsets=None):
    """The causal conv with its cache, in torch: gather each request's conv line, convolve its window with
    its tokens, SiLU, write the line back, split q|k|v into outs.

    x [N * T, C] or [1, N * T, C] (request n's T tokens at rows n*T ...); conv_state [slots, C, L];
    lines [N]: each request's line; offsets [N] or None (0): the window before the first token is
    line[:, o:o+3]. Afterwards line[:, 0:2] = old line[:, o+1:o+3], line[:, 2:2+T] = the tokens, the rest
    unchanged: with L = 3 and T = 1 the decode update (vLLM's causal_conv1d_update), with L = T + 2 and
    offsets = num_accepted_tokens - 1 vLLM's speculative one (docs/semantics.md, "Fused verify").
    outs: (q, k, v) buffers of N * T * C / 3 elements each."""
    N, C, L = lines.numel(), conv_state.shape[1], conv_state.shape[2]
    xt = x.reshape(N, -1, C)
    T, HD, hist_len = xt.shape[1], C // 3, CONV_WIDTH - 1
    lines = lines.long()
    window = None if offsets is None else \
        (offsets.long().view(N, 1, 1) + torch.arange(hist_len, device=x.device)).expand(N, C, hist_len)

    def run():
        line = conv_state.index_select(0, lines)                                   # [N, C, L]
        hist = torch.cat([line[..., :hist_len] if window is None else line.gather(2, window),
                          xt.transpose(1, 2)], dim=-1)                             # [N, C, 3 + T]
        y = torch.nn.functional.silu((hist.unfold(-1, CONV_WIDTH, 1).float()
                                      * conv_weight.float().unsqueeze(1)).sum(-1))  # [N, C, T]
        conv_state.index_copy_(0, lines, hist[..., 1:] if L == T + 2 else
                               torch.cat([hist[..., 1:], line[..., T + 2:]], dim=-1))
        y = y.to(outs[0].dtype).transpose(1, 2).reshape(N * T, C)
        for i, buf in enumerate(outs):
            buf.view(N * T, HD).copy_(y[:, i * HD:(i + 1) * HD])
    return run


def gate_fn(g, A_log, dt_bias, gate_kw, g_log, fla_gate=None):
    """The gate into g_log (fp32 log decay): fla's fused_kda_gate when given, else torch."""
    if fla_gate is not None:
        return lambda: g_log.copy_(fla_gate(g, A_log, dt_bias, lower_bound=gate_kw["lower_bound"]))
    return lambda: g_log.copy_(harness.torch_gate(g, A_log=A_log, dt_bias=dt_bias, **gate_kw))


def gated_rmsnorm_fn(output_gate, norm_weight, out, eps=NORM_EPS):
    """o -> rmsnorm(o) * norm_weight * sigmoid(output_gate), into out (torch, fp32 inside)."""
    def run(o):
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
        out.copy_(of * torch.sigmoid(output_gate.float()))
        return out
    return run


def agreement(fused, unfused, touched, notes: dict, max_bytes: int = 4 << 30) -> None:
    """notes["rel_l2_fused_vs_unfused"]: one call of each from the same pools (catches a layout slip).
    touched: (pool, slot indices) pairs, every slot a call may write; those slots are saved and put back
    afterwards. Skipped when they hold max_bytes or more (the copies would not fit beside the pools)."""
    touched = [(pool, index.flatten().long()) for pool, index in touched]
    if sum(i.numel() * pool[0].numel() * pool.element_size() for pool, i in touched) >= max_bytes:
        return
    saved = [pool.index_select(0, i) for pool, i in touched]

    def restore():
        for (pool, i), s in zip(touched, saved):
            pool.index_copy_(0, i, s)
    try:
        a = fused().clone()
        restore()
        b = unfused().clone()
        notes["rel_l2_fused_vs_unfused"] = harness.rel_l2(a, b)
    except Exception as e:  # noqa: BLE001  the timing afterwards records the failing arm too
        notes["agreement_check_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    restore()


# -- the run ----------------------------------------------------------------------------------------

def use_fla(args, cfg) -> bool:
    """Whether the unfused arm runs fla's kernels (a GPU, fla importable, not --no-fla / --no-unfused)."""
    want = cfg.is_cuda and not (args.no_fla or args.no_unfused)
    have = want and harness.fla_version() is not None
    if want and not have:
        print("fla is not importable: the unfused arm uses a torch step (unfused_torch)", file=sys.stderr)
    return have


def unfused_name(fla: bool) -> str:
    return "unfused" if fla else "unfused_torch"


def main(args, grid, make_case, label) -> int:
    """A fused benchmark's run: the grid's points (grid(args, cfg)) timed one case each (make_case(*point,
    args, cfg, gen, fla) -> harness.Case, arms "fused", the unfused sequence, "step"), the unfused sequence
    the baseline. A point that cannot be set up (out of memory for a huge pool) is recorded as skipped and
    the run goes on. Each record gets fused_over_step (the fused arm's median over the plain step's, per
    mode); at the end the primary mode's geomean and max."""
    cfg = harness.config_from_args(args)
    fla = use_fla(args, cfg)
    gen = torch.Generator().manual_seed(0)
    run = harness.Run(args.name, cfg, baseline=None if args.no_unfused else unfused_name(fla),
                      primary_mode="graph" if cfg.is_cuda else "wall",
                      extra_meta={"fla_used": fla, "gate": args.gate})
    points = grid(args, cfg)
    run.start(len(points))
    for point in points:
        try:
            case = make_case(*point, args, cfg, gen, fla)
        except Exception as e:  # noqa: BLE001
            print(f"skipped {label(*point)}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            run.skipped.append({"case": label(*point), "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        rec = run.add(case)
        f, st = rec["arms"]["fused"]["time_us"], rec["arms"]["step"]["time_us"]
        rec["fused_over_step"] = {m: f[m]["median"] / st[m]["median"] for m in f
                                  if f[m].get("median") and st.get(m, {}).get("median")}
        del case
        if cfg.is_cuda:
            torch.cuda.empty_cache()
    run.finish()
    ratios = [r["fused_over_step"].get(run.primary_mode) for r in run.results]
    ratios = [x for x in ratios if x]
    if ratios:
        print(f"fused / plain step ({run.primary_mode}): geomean {harness.geomean(ratios):.2f}x, "
              f"max {max(ratios):.2f}x")
    return 0
