#!/usr/bin/env python
"""docs/performance.md and the README's speed block, generated from the results they cite.

The sources are benchmarks/results/current.json: {"ops": {op: [{"file": F, "plot": P}]}}, F and P
paths under benchmarks/results/ in folders named h200-<date>-<commit>, so each figure's date and
commit come from its file's folder; an optional "note" (what changed since the run) is printed under
the op's table. F is a harness run document (benchmarks/harness.py) in its full
or compact form (benchmarks/results_compact.py); the tables read the arms' medians:

    kda_decode        bench_decode.py      arms ours (routed module), fla; graph, eager, wall
    fused_kda_decode  bench_fused_decode.py arms fused, unfused (the engine's sequence), step; graph
    fused_kda_verify  bench_fused_verify.py arms fused, unfused (the engine's sequence), step; graph
    kda_verify        bench_verify.py      arms ours (routed module), fla; graph
    kda_prefill       bench_prefill.py     arms ours, then one column per peer arm the run has
                                           (fla, cudnn, ...); eager (event time) and kernel

The targets come from the same data through benchmarks/decode_targets.py and prefill_targets.py.

current.json's "engines" (one entry per serving-engine call site, its keys in current.json's "about") feeds
the Engines section: bench_vllm.py / bench_sglang.py runs, arm ours (the adapter as the engine calls it)
against the entry's "arm" (the engine's own Triton kernel), medians in the entry's "mode" (graph unless it says
eager), the profiler's kernel time where a run has it, each case's agreement in its notes.

    python benchmarks/perf_doc.py            # rewrite docs/performance.md and the README block
    python benchmarks/perf_doc.py --check    # exit 1 when either differs from what the data give
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_targets  # noqa: E402
import prefill_targets  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = RESULTS / "current.json"
DOC = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
FOLDER = re.compile(r"^(h[12]00)-(\d{4}-\d\d-\d\d)-([0-9a-f]{7})$")   # h100: a day only an H100 was lent
BEGIN = "<!-- begin generated: performance (benchmarks/perf_doc.py; edit the data, not this block) -->"
END = "<!-- end generated: performance -->"
# Peers named in the tables; an arm not listed here gets its own name as the heading.
PEER_NAMES = {"fla": "fla", "cudnn": "cuDNN", "flashkda": "FlashKDA", "opt_in": "opt-in arm"}


class Source:
    """One cited results file: its document, the date and commit of its folder, its links."""

    def __init__(self, entry: dict, root: Path = RESULTS):
        self.file, self.plot, self.note = entry["file"], entry.get("plot"), entry.get("note")
        self.key = ""  # the table's label for it (A, B, ... in the order of the op's sources)
        m = FOLDER.match(Path(self.file).parent.name)
        if not m:
            raise ValueError(f"{self.file}: results folders are named h200-<date>-<commit> (h100-... on an H100)")
        gpu, self.date, self.commit = m.groups()
        self.gpu = "" if gpu == "h200" else f"{gpu.upper()}, "   # the H200 is the default; another GPU is named
        self.doc = json.loads((root / self.file).read_text())

    def cite(self) -> str:
        """'<date>, <commit>, [file](link)', the form every figure carries ('<date>, <commit>, H100, ...' off the
        H200)."""
        return f"{self.date}, {self.commit}, {self.gpu}[{Path(self.file).name}](../benchmarks/results/{self.file})"

    def when(self) -> str:
        return f"{self.date}, {self.commit}" + (f" ({self.gpu[:-2]})" if self.gpu else "")


class Site:
    """One engine call site of current.json's "engines": its entry and the cases of its files it selects.
    "file" is one file or a list of them (runs that add points or measure again): where two hold the
    same point, the later file's case is the one shown."""

    def __init__(self, entry: dict, srcs: list):
        self.engine, self.phase, self.site = entry["engine"], entry["phase"], entry["site"]
        self.arm, self.tol, self.tokens = entry["arm"], entry.get("tol"), entry.get("tokens")
        self.note = entry.get("note")
        self.peer = entry.get("peer", "Triton")   # what the engine's kernel is: its Triton kernel unless named
        # the part of issue 45's grid the engine sends this call site (K3's native decode: 12 / 24 heads of the
        # grid, fp32 state), and whether an fla column applies (fla has no fused conv + norm decode)
        grid = entry.get("grid", {})
        self.heads = tuple(grid.get("heads", ISSUE45["heads"]))
        self.states = tuple(grid.get("states", ISSUE45["states"]))
        self.fla = grid.get("fla", True)
        self.select = entry.get("select", {})
        self.mode = entry.get("mode", "graph")   # eager: prefill / extend, whose engine path syncs on the host
        self.srcs = srcs

    @property
    def name(self) -> str:
        return f"{self.engine} {self.site.split(' (')[0]}"

    def cases(self, keep=lambda case: True):
        """[(case, its Source)] of the selected cases that `keep` accepts, one a point, the later file's
        where files overlap."""
        by_point = {}
        for src in self.srcs:
            for c in src.doc["cases"]:
                if all(c["params"].get(k) == v for k, v in self.select.items()) and keep(c):
                    by_point[_point(c)] = (c, src)
        return list(by_point.values())

    def kernel_cases(self):
        """cases() with both arms' kernel time: a later graph-only run of a point does not hide an earlier
        kernel-time run of it."""
        return self.cases(lambda c: all(_med(c["arms"].get(a), "kernel") for a in ("ours", self.arm)))


def load(path: Path = SOURCES, root: Path = RESULTS) -> dict:
    """{op: [Source]}, and "engines": [Site] (sites sharing a results file share its Source)."""
    data = json.loads(path.read_text())
    out = {op: [Source(e, root) for e in entries] for op, entries in data["ops"].items()}
    files = {}
    out["engines"] = [Site(e, [files.setdefault(f, Source({"file": f}, root))
                               for f in ([e["file"]] if isinstance(e["file"], str) else e["file"])])
                      for e in data.get("engines", [])]
    return out


def _med(arm, mode):
    return ((arm or {}).get("time_us", {}).get(mode) or {}).get("median")


def _pct(arm, mode="graph"):
    return ((arm or {}).get("bandwidth", {}).get(mode) or {}).get("pct_copy")


def _geomean(xs):
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _us(t) -> str:
    if t is None:
        return "-"
    return f"{t:.0f}" if t >= 1000 else f"{t:.1f}"


def _x(r) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _table(head, rows) -> list:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _pair(case, ours="ours", peer="fla", mode="graph"):
    """(ours, the peer's) medians of one case; (None, None) for a point the run does not have."""
    if case is None:
        return None, None
    return _med(case["arms"].get(ours), mode), _med(case["arms"].get(peer), mode)


def _ratios(cases, ours: str, peer: str, mode: str):
    out = []
    for c in cases:
        a, b = _med(c["arms"].get(ours), mode), _med(c["arms"].get(peer), mode)
        if a and b:
            out.append(b / a)
    return out


def _state(src: Source) -> str:
    states = {c["params"].get("state") for c in src.doc["cases"]} - {None}
    return "/".join(sorted(states, reverse=True)) or src.doc["meta"].get("state", "")


def _by_state(src: Source):
    """[(state, cases)] of one run: a run may time several state dtypes (f32 first)."""
    default = src.doc["meta"].get("state", "")
    states = sorted({c["params"].get("state", default) for c in src.doc["cases"]}, reverse=True)
    return [(st, [c for c in src.doc["cases"] if c["params"].get("state", default) == st]) for st in states]


# --- kda_decode ------------------------------------------------------------------------------

DECODE_ROWS = (1, 4, 16, 64, 256, 1024, 4096)


def decode_section(srcs) -> list:
    lines = [
        "Grid (issue 6): heads 8 / 16 / 32 / 64 x rows 1 ... 4096, a pool of 8192 slots, random unique "
        "slots, softplus gate; CUDA-graph replay. Targets: >= 90% (fp32) / 85% (bf16) of copy bandwidth "
        "from 2048 work items (rows x heads); <= 6 us graph replay and <= 20 us per eager call through the "
        "public op at <= 128 work items; faster than fla at every point, geomean >= 1.5x (graph) and >= 5x "
        "(eager).", "",
        "Each cell: ours / fla us, graph replay (fla's time over ours).", ""]
    rows = []
    for src, state, cases in [(src, st, cs) for src in srcs for st, cs in _by_state(src)]:
        by = {(c["params"]["heads"], c["params"]["rows"]): c for c in cases}
        for h in sorted({k[0] for k in by}):
            cells = []
            for r in DECODE_ROWS:
                a, f = _pair(by.get((h, r)))
                cells.append("-" if a is None else f"{_us(a)} / {_us(f)} ({_x(f / a if f else None)})")
            rows.append([state, str(h)] + cells + [src.key])
    lines += _table(["state", "HV"] + [f"rows {r}" for r in DECODE_ROWS] + ["run"], rows)
    lines.append("")
    for src in srcs:
        for state, r in decode_targets.evaluate(src.doc).items():
            g = r["geomean"]
            gm = g.get("ours_graph")
            cases = [c for c in src.doc["cases"] if c["params"]["state"] == state]
            worst = min(_ratios(cases, "ours", "fla", "graph"), default=None)
            who = "public op" if g.get("op_eager") else "module function"
            eager = g.get("op_eager") or g.get("ours_eager")
            bw = decode_targets.BANDWIDTH_TARGET.get(state)
            slower = len(r["not_faster_than_fla"])
            lines.append(
                f"- {state} ({src.when()}): graph geomean {_x(gm)} over fla, slowest {_x(worst)}, "
                + ("faster at every point" if not slower else f"not faster at {slower} points")
                + f"; eager geomean {_x(eager)} ({who}); "
                f">= {bw:g}% of copy from 2048 work items missed at {len(r['bandwidth_misses'])} points"
                + (" (" + ", ".join(f"{h}x{n} {p:.1f}%" for h, n, p, _ in r["bandwidth_misses"]) + ")"
                   if r["bandwidth_misses"] else "")
                + f"; <= 6 us graph at <= 128 work items missed at {len(r['small_graph_misses'])}"
                + f"; <= 20 us eager missed at {len(r['small_eager_misses'])}.")
    return lines


# --- fused_kda_decode ------------------------------------------------------------------------

def _fused_rows(srcs, point, pct=False):
    """A fused op's table rows and per-run figures: each case's fused / unfused (the engine's sequence) /
    plain-step medians (graph), the unfused sequence's time over the fused op's, fused over step, with
    pct the fused op's % of copy; point(params) gives the point's columns. Returns (rows, [(src, state,
    {"over", "small", "large", "within", "pct_2048"})]): over the unfused sequence at every point, at
    <= 64 rows, at >= 1024 rows; fused / step; % of copy from 2048 work items."""
    rows, runs = [], []
    for src, state, cases in [(src, st, cs) for src in srcs for st, cs in _by_state(src)]:
        fig = {k: [] for k in ("over", "small", "large", "within", "pct_2048")}
        for c in cases:
            p, arms = c["params"], c["arms"]
            fu, un, st = (_med(arms.get(k), "graph") for k in ("fused", "unfused", "step"))
            x = un / fu if fu and un else None
            s = fu / st if fu and st else None
            share = _pct(arms.get("fused"))
            for key, keep, val in (("over", True, x), ("small", p["rows"] <= 64, x), ("large", p["rows"] >= 1024, x),
                                   ("within", True, s), ("pct_2048", p.get("work_items", 0) >= 2048, share)):
                if keep and val is not None:
                    fig[key].append(val)
            rows.append([p["state"]] + point(p) + [_us(fu), _us(un), _x(x), _us(st), "-" if s is None else f"{s:.2f}"]
                        + (["-" if share is None else f"{share:.0f}%"] if pct else []) + [src.key])
        runs.append((src, state, fig))
    return rows, runs


def _span(xs, fmt="{:.2f}") -> str:
    return "-" if not xs else f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"


def fused_section(srcs) -> list:
    lines = [
        "Arms (issue 9): the fused op; the unfused sequence an engine runs today (causal conv update with "
        "its cache in torch, fla's gate kernel, fla's recurrent step on the pool in place, gated RMSNorm in "
        "torch); the plain `kda_decode` step at the same shape. Pool of 4096 slots, softplus gate, CUDA-graph "
        "replay. Targets: >= 3x over the unfused sequence at rows <= 64, >= 1.5x at rows >= 1024; the fused "
        "op within 1.15x of the plain step.", ""]
    rows, runs = _fused_rows(srcs, lambda p: [f"{p['rows']} x H{p['heads']}"])
    notes = [f"- {state} ({src.when()}): over the unfused sequence geomean {_x(_geomean(f['over']))}, "
             f"lowest at rows <= 64 {_x(min(f['small'], default=None))}; fused / step "
             f"{min(f['within'], default=0):.2f}-{max(f['within'], default=0):.2f}." for src, state, f in runs]
    lines += _table(["state", "point", "fused us", "unfused us", "x unfused", "step us", "fused / step", "run"],
                    rows)
    return lines + [""] + notes


# --- kda_verify ------------------------------------------------------------------------------

def verify_section(srcs) -> list:
    lines = [
        "Grid (issue 30): draft length T 2 / 4 / 8, HV 16 / 32 / 64, 1-1024 requests; fla's "
        "`fused_recurrent_kda_fwd` with `num_accepted_tokens` in the same run; CUDA-graph replay. % of the "
        "floor: one state read + T state writes + inputs and outputs at the run's copy bandwidth. Targets: "
        "faster than fla at every point, geomean >= 1.5x, >= 85% of the floor from 2048 work items "
        "(requests x HV).", "",
        "Each cell: ours / fla us (fla's time over ours), % of the floor.", ""]
    rows, notes, every = [], [], []
    for src, state, cases in [(src, st, cs) for src in srcs for st, cs in _by_state(src)]:
        reqs = sorted({c["params"]["rows"] for c in cases})
        by = {(c["params"]["T"], c["params"]["heads"], c["params"]["rows"]): c for c in cases}
        for t, h in sorted({k[:2] for k in by}):
            cells = []
            for n in reqs:
                c = by.get((t, h, n))
                a, f = _pair(c)
                cells.append("-" if a is None else
                             f"{_us(a)} / {_us(f)} ({_x(f / a if f else None)}), {_pct(c['arms']['ours']):.0f}%")
            rows.append([state, str(t), str(h)] + cells + [src.key])
        head = ["state", "T", "HV"] + [f"{n} req" for n in reqs] + ["run"]
        rx = _ratios(cases, "ours", "fla", "graph")
        every += rx
        big = [_pct(c["arms"]["ours"]) for c in cases if c["params"]["work_items"] >= 2048]
        notes.append(f"- {state} ({src.when()}): geomean {_x(_geomean(rx))} over fla, slowest "
                     f"{_x(min(rx, default=None))}; from 2048 work items {min(big):.1f}-{max(big):.1f}% of the "
                     "floor.")
    lines += _table(head, rows)
    return lines + [""] + notes + [f"- all {len(every)} points: geomean {_x(_geomean(every))} over fla."]


# --- fused_kda_verify ------------------------------------------------------------------------

def fused_verify_section(srcs) -> list:
    if not srcs:
        return ["Not measured yet: `benchmarks/bench_fused_verify.py` times `fused_kda_verify` against the unfused "
                "engine sequence and the plain `kda_verify`, but benchmarks/results/current.json lists no GPU run "
                "of it (its GPU tests check it against the reference)."]
    lines = [
        "Arms (`benchmarks/bench_fused_verify.py`): the fused op; the unfused sequence an engine runs today for "
        "speculative verify (the causal conv over the draft tokens with its cache in torch, vLLM's layout: a line "
        "of T + 2 inputs read from the accepted position; fla's gate kernel; fla's `fused_recurrent_kda` with "
        "`num_accepted_tokens` and a slot per token, on the pool in place; gated RMSNorm in torch); the plain "
        "`kda_verify` at the same shape. Every request has T draft tokens on T random slots and starts from a "
        "random accepted one; CUDA-graph replay, cold L2. % of copy: the fused op's essential traffic (one state "
        "read and T writes per (request, head), the conv window read and its line written, the tokens' inputs and "
        "output) at the run's copy bandwidth. No issue sets fused verify's targets; fused decode's, for "
        "comparison: >= 3x over the unfused sequence at <= 64 requests, >= 1.5x at >= 1024, the fused op within "
        "1.15x of the plain step.", ""]
    rows, runs = _fused_rows(srcs, lambda p: [str(p["T"]), f"{p['rows']} x H{p['heads']}"], pct=True)
    lines += _table(["state", "T", "requests x heads", "fused us", "unfused us", "x unfused", "step us",
                     "fused / step", "fused % of copy", "run"], rows)
    notes = [f"- {state} ({src.when()}, {src.doc['meta'].get('gate', 'softplus')} gate): over the unfused sequence "
             f"geomean {_x(_geomean(f['over']))}, lowest at <= 64 requests {_x(min(f['small'], default=None))}, at "
             f">= 1024 requests {_x(min(f['large'], default=None))}; fused / step {_span(f['within'])}; from 2048 "
             f"work items {_span(f['pct_2048'], '{:.1f}')}% of copy." for src, state, f in runs]
    return lines + [""] + notes


# --- kda_prefill -----------------------------------------------------------------------------

def _peers(cases) -> list:
    arms = {a for c in cases for a in c["arms"] if a != "ours"}
    return sorted(arms, key=lambda a: (list(PEER_NAMES).index(a) if a in PEER_NAMES else len(PEER_NAMES), a))


def prefill_section(srcs) -> list:
    lines = [
        "Cases (the case name gives the head count): packed variable-length input, softplus and bounded gate "
        "(lower bound -5), fp32 initial and final state, head dim 128; event time (eager, cold L2). Targets (issue "
        "46): not slower than cuDNN's Hopper engine wherever its output is finite, geomean >= 1.5x cuDNN; B1 T32K "
        "H8 <= 0.25 ms, H16 <= 0.45 ms; 1 x 1M tokens H16 <= 12 ms; 64x512 H16, 4x4096 H32 and 8K H64 <= 0.5 ms "
        "each. cuDNN takes the softplus gate as a precomputed fp32 log decay (computed outside its timed call). "
        "Gate parameters drawn at random (benchmarks/gate_params.py, 'random': every key of every token decays fast, "
        "so a piece split's warm-up is a chunk, the favourable case for ours and cuDNN's splits alike) unless a run "
        "says otherwise; on gates like an initialised layer's the splits' warm-ups walk thousands of tokens back "
        "(run A's note).",
        "", "Each peer cell: its event time in us (its time over ours).", ""]
    notes = []
    for src in srcs:
        cases = src.doc["cases"]
        peers = _peers(cases)
        rows = []
        kernel = any(_med(c["arms"].get("ours"), "kernel") for c in cases)
        for c in cases:
            p, arms = c["params"], c["arms"]
            ours = _med(arms.get("ours"), "eager")
            cells = [p["case"], p["gate"], f"`{p['module']}`" if p.get("module") else "-", _us(ours)]
            for peer in peers:
                t = _med(arms.get(peer), "eager")
                cells.append("-" if t is None else f"{_us(t)} ({_x(t / ours if ours else None)})")
            if kernel:
                ko, kf = _med(arms.get("ours"), "kernel"), _med(arms.get("fla"), "kernel")
                cells.append(_x(kf / ko) if ko and kf else "-")
            rows.append(cells + [src.key])
        lines += _table(["case", "gate", "module", "ours us"] + [f"{PEER_NAMES.get(a, a)} us" for a in peers]
                        + (["kernel time x fla"] if kernel else []) + ["run"], rows)
        r = prefill_targets.evaluate(cases)
        ev = [x for _, x in r["event"]]
        kn = [x for _, x in r["kernel"]]
        best = [x for _, x, _ in r["best"]]
        long = "; ".join(f"{n}: {us / 1000:.3f} ms" for n, us in r["long"])
        if "fla" in peers:
            # issue 8's quoted FlashKDA times are H200 times: compared only with an H200 run that did not time it
            quoted = ("; bounded gate over the better of fla and FlashKDA (FlashKDA: issue 8's quoted H200 times, "
                      f"benchmarks/prefill_targets.py, not measured here) geomean {_x(_geomean(best))}, not ahead "
                      f"at {len(r['not_ahead'])} rows" if not src.gpu and "flashkda" not in peers else "")
            notes.append(f"- {src.when()}: event time over fla geomean {_x(_geomean(ev))}, lowest "
                         f"{_x(min(ev, default=None))}"
                         + (f"; kernel time over fla geomean {_x(_geomean(kn))}" if kn else "") + quoted
                         + ("; " + long if long else "") + ".")
        else:   # a cuDNN-only run: no fla figures to state
            notes.append(f"- {src.when()}: no fla arm in this run" + (f"; {long}" if long else "") + ".")
        cud_rows = [c for c in cases if "cudnn" in c["arms"]]
        if cud_rows:
            rc = prefill_targets.evaluate_cudnn(cud_rows)
            missed = [f"{n} {ms:.3f} ms (target {lim:g})" for n, ms, lim in rc["limits"] if ms > lim]
            notes.append(f"- {src.when()}: against cuDNN where its output is finite ({len(rc['ratios'])} rows, "
                         f"{len(rc['nonfinite'])} non-finite): geomean {_x(_geomean([x for _, x in rc['ratios']]))}, "
                         f"behind at {len(rc['behind'])} rows; time limits missed: "
                         + ("; ".join(missed) if missed else "none") + ".")
        for peer in peers:
            if peer not in ("fla", "cudnn") or not cud_rows:
                xs = _ratios(cases, "ours", peer, "eager")
                notes.append(f"- {src.when()}: event time over {PEER_NAMES.get(peer, peer)} geomean "
                             f"{_x(_geomean(xs))}, lowest {_x(min(xs, default=None))}.")
    return lines + [""] + notes


# --- engines (issue 45) ------------------------------------------------------------------------

# Issue 45's acceptance grid: every served call faster than the engine's own Triton kernel at every point.
ISSUE45 = {"rows": (1, 1024), "heads": (8, 12, 24, 32), "states": ("f32", "bf16"),
           "phases": ("decode", "verify", "prefill")}
STATE_NAMES = {"f32": "f32", "bf16": "bf16", "torch.float32": "f32", "torch.bfloat16": "bf16"}


def _timing(mode: str) -> str:
    return "graph replay" if mode == "graph" else "event time (eager)" if mode == "eager" else f"{mode} time"


def _point(case):
    """(state, H, rows) of a case of bench_vllm.py or bench_sglang.py (their params differ in name only)."""
    p = case["params"]
    return STATE_NAMES[p.get("state", p.get("state_dtype"))], p.get("heads", p.get("H")), p["rows"]


def _label(point) -> str:
    st, h, r = point
    return f"{r} row{'' if r == 1 else 's'} H{h} {st}"


def _agreement(site: Site, case):
    """(agrees, the larger rel. L2 of output and written state) from the case's notes."""
    notes = case.get("notes") or {}
    if "agreement" in notes:   # bench_sglang.py: the run's own verdict
        a = notes["agreement"]
        return a["ok"], max(a["o"], a["state"])
    if "rel_l2_out" in notes:  # bench_vllm.py: the errors and whether the adapter served; the bound is the entry's
        if site.tol is None:
            raise ValueError(f"{site.name}: its cases hold rel. L2 but no verdict; give its entry a 'tol'")
        worst = max(notes["rel_l2_out"], notes["rel_l2_state"])
        return notes.get("served") is True and worst < site.tol, worst
    raise ValueError(f"{site.name}: case {case['name']!r} has no agreement in its notes")


def _site_points(site: Site):
    """[(point, ours us, engine us, fla us, agrees, rel. L2, Source)] in grid order (f32 first)."""
    out = []
    for c, src in site.cases():
        a, e = _pair(c, "ours", site.arm, site.mode)
        out.append((_point(c), a, e, _med(c["arms"].get("fla"), site.mode)) + _agreement(site, c) + (src,))
    return sorted(out, key=lambda r: _grid_order(r[0]))


def _grid_order(point):
    return ISSUE45["states"].index(point[0]), point[1], point[2]


def _engine_ratios(pts):
    return [(p, e / a) for p, a, e, *_ in pts if a and e]


def _gaps(site: Site, pts) -> list:
    """What of issue 45's grid this site's run does not have, each as a phrase."""
    states, heads, rows = ({p[0][i] for p in pts} for i in range(3))
    lo, hi = ISSUE45["rows"]
    out = []
    if set(site.heads) - heads:
        out.append("H " + " / ".join(map(str, sorted(set(site.heads) - heads))))
    if set(site.states) - states:
        out.append(" and ".join(sorted(set(site.states) - states, reverse=True)) + " state")
    if rows != set(range(lo, hi + 1)):
        out.append(f"rows {lo}-{hi} other than " + " / ".join(map(str, sorted(rows))))
    have = {p[0] for p in pts}
    # a head count outside the issue's grid (a run's extra H16) adds no holes
    holes = [(st, h, r) for st in sorted(states, key=ISSUE45["states"].index)
             for h in sorted(heads & set(site.heads)) for r in sorted(rows) if (st, h, r) not in have]
    if holes:
        out.append(f"{site.name} at " + ", ".join(map(_label, holes)) + " (inside its run's grid)")
    if site.fla and not any(p[3] for p in pts):
        out.append("an fla arm, issue 45's third column")
    return out


def engines_section(sites) -> list:
    if not sites:
        return ["Not measured yet: benchmarks/results/current.json lists no engine call site."]
    lo, hi = ISSUE45["rows"]
    grid = (f"rows {lo}-{hi}, H " + " / ".join(map(str, ISSUE45["heads"])) + ", "
            + " and ".join(ISSUE45["states"]) + " state")
    lines = [
        "The serving engines' KDA call sites, each through its flashkda_ext adapter (\"ours\", called as the engine "
        "calls it) against the engine's own Triton kernel from its pinned wheel, on identical inputs in one run "
        "(`benchmarks/bench_vllm.py`, `benchmarks/bench_sglang.py`); CUDA-graph replay unless a site says "
        "otherwise, cold L2. Target (issue 45): "
        f"every served call faster than the engine's kernel at every measured point of {grid} (rows: decode rows, "
        "verify requests). Before timing, each point runs both kernels once from identical copies: \"agrees\" is "
        "that check (the larger rel. L2 of the output and the written state in brackets): the run's own verdict "
        "where its cases hold one (SGLang), else the adapter served the call and both are below the entry's "
        "bound (vLLM). vLLM 0.34 runs the Kimi KDA layers with breakable CUDA graphs, the layer's Python at every "
        "step (docs/integrations.md, \"Breakable CUDA graphs\"): there graph replay is the GPU time, and each call's "
        "host path adds where a step is host-bound.", ""]
    gaps, phases = {}, {}
    for site in sites:
        pts = _site_points(site)
        who = site.engine.split()[0]
        fla = any(p[3] for p in pts)
        bounds = {c["params"].get("lower_bound") for c, _ in site.cases()} - {None}
        gates = {src.doc["meta"].get("gate") for _, src in site.cases()} - {None}
        gate = f"bounded (lower bound {min(bounds):g})" if bounds else " / ".join(sorted(gates))
        facts = ([f"Gate {gate}"] if gate else []) + ([f"{site.tokens} tokens per request"] if site.tokens else []) \
            + ([f"agreement bound rel. L2 {site.tol:g}"] if site.tol is not None else [])
        lines += [f"### {site.engine} {site.site}", "",
                  "; ".join(facts) + (". " if facts else "")
                  + f"Each row: ours and {who}'s {site.peer} us, {_timing(site.mode)}, and {who}'s time over ours.", ""]
        rows = []
        for (st, h, r), a, e, f, ok, rel, src in pts:
            rows.append([st, str(h), str(r)] + ([str(site.tokens)] if site.tokens else [])
                        + [_us(a), _us(e)] + ([_us(f)] if fla else [])
                        + [_x(e / a if a and e else None), f"{'yes' if ok else 'no'} ({rel:.1e})", src.key])
        lines += _table(["state", "H", "rows"] + (["tokens"] if site.tokens else []) + ["ours us", f"{who} us"]
                        + (["fla us"] if fla else []) + [f"{who} / ours", "agrees", "run"], rows)
        rx = _engine_ratios(pts)
        slow = min(rx, key=lambda t: t[1], default=None)
        behind = [(p, f"{x:.3f}x") for p, x in rx if x <= 1]
        behind += [(p[0], "not timed") for p in pts if not (p[1] and p[2])]
        agree = sum(1 for p in pts if p[4])
        kernel = sorted(((_point(c), _med(c["arms"][site.arm], "kernel") / _med(c["arms"]["ours"], "kernel"), src)
                         for c, src in site.kernel_cases()), key=lambda t: _grid_order(t[0]))
        lines += ["", f"- {site.name} ({'; '.join(dict.fromkeys(s.when() for s in _runs([site])))}): {who}'s {site.peer} over ours geomean "
                  f"{_x(_geomean(x for _, x in rx))}, slowest {_x(slow and slow[1])}"
                  + (f" ({_label(slow[0])})" if slow else "") + "; issue 45's target (faster at every point) "
                  + (f"met at all {len(pts)} points" if not behind else
                     f"missed at {len(behind)} of {len(pts)} points: "
                     + ", ".join(f"{_label(p)} {x}" for p, x in behind))
                  + f"; outputs agree at {agree} of {len(pts)}."]
        if kernel:   # the profiler's kernel time: the graph replay of a 1-row call is mostly launch
            lines += [f"- {site.name}, kernel time (torch.profiler device spans of one eager call; "
                      f"{who}'s over ours): " + ", ".join(f"{_label(p)} {k:.2f}x ({src.key})" for p, k, src in kernel)
                      + "."]
        lines += [f"- {site.name}: {site.note}"] if site.note else []
        lines.append("")
        for g in _gaps(site, pts):
            gaps.setdefault(g, []).append(site.name)
        phases.setdefault(site.engine, set()).add(site.phase)
    parts = [g if g.startswith(tuple(names)) else f"{g} (every call site)" if len(names) == len(sites)
             else f"{g} ({', '.join(names)})" for g, names in gaps.items()]
    for engine, have in phases.items():
        parts += [f"{ph} through the {engine} adapter (no run)" for ph in ISSUE45["phases"] if ph not in have]
    lines += [f"Not measured of issue 45's grid ({grid}; decode, verify and prefill per engine): "
              + "; ".join(parts) + "."]
    return lines


SECTIONS = (("kda_decode", "Decode (`kda_decode`)", decode_section),
            ("fused_kda_decode", "Fused decode (`fused_kda_decode`)", fused_section),
            ("kda_verify", "Verify (`kda_verify`)", verify_section),
            ("fused_kda_verify", "Fused verify (`fused_kda_verify`)", fused_verify_section),
            ("kda_prefill", "Prefill (`kda_prefill`)", prefill_section),
            ("engines", "Engines (vLLM, SGLang)", engines_section))


def _runs(srcs) -> list:
    """The distinct results files of a section, in order (engine call sites may share one)."""
    out = []
    for s in [x for s in srcs for x in getattr(s, "srcs", [s])]:
        if all(s is not o for o in out):
            out.append(s)
    return out


def _versions(sources) -> str:
    metas = [s.doc["meta"] for srcs in sources.values() for s in _runs(srcs)]
    parts = []
    for key, name in (("gpu", "GPU"), ("torch", "torch"), ("triton", "triton"), ("fla", "fla")):
        vals = sorted({str(m[key]) for m in metas if m.get(key)})
        if vals:
            parts.append(f"{name} {' / '.join(vals)}")
    return ", ".join(parts)


def summary_rows(sources) -> list:
    """(op and state, peer, geomean, slowest, when): the figures the README quotes."""
    out = []
    pairs = {"kda_decode": ("ours", "fla", "graph"), "kda_verify": ("ours", "fla", "graph"),
             "fused_kda_decode": ("fused", "unfused", "graph"), "fused_kda_verify": ("fused", "unfused", "graph"),
             "kda_prefill": ("ours", "fla", "eager")}
    for op, (ours, peer, mode) in pairs.items():
        for src, state, cases in [(src, st, cs) for src in sources.get(op, []) for st, cs in _by_state(src)]:
            # a prefill run's opt-in arm (--opt-in-arm: a candidate of ours) is no peer: the README leaves it out
            peers = [peer] + ([p for p in _peers(cases) if p not in (peer, "opt_in")] if op == "kda_prefill" else [])
            gates = {c["params"].get("gate") for c in cases} if op == "kda_prefill" else set()
            label = f"`{op}`, {state} state" + (f", {gates.pop()} gate" if len(gates) == 1 else "")
            heads = sorted({c["params"]["H"] for c in cases if "H" in c["params"]}) if op == "kda_prefill" else []
            if heads:  # a grid may come in several files, each its head counts
                label += f", H{heads[0]}-{heads[-1]}" if len(heads) > 1 else f", H{heads[0]}"
            slow = {c["params"].get("slow_keys", 0) for c in cases} if op == "kda_prefill" else set()
            if slow - {0}:  # bench_prefill --slow-keys: long-memory channels, a different data regime
                label += f", {max(slow)} slowly decaying key{'s' if max(slow) > 1 else ''} a head"
            drawn = {c["params"].get("gate_params", "random") for c in cases} if op == "kda_prefill" else set()
            if drawn - {"random"}:  # bench_prefill --gate-params: how A_log / dt_bias were drawn, another data regime
                label += ", gate parameters " + " / ".join(sorted(drawn - {"random"}))
            for p in peers:
                xs = _ratios(cases, ours, p, mode)
                if xs:
                    who = "the unfused engine sequence (fla step)" if p == "unfused" else PEER_NAMES.get(p, p)
                    out.append((label, who, mode, _geomean(xs), min(xs), src))
    for site in sources.get("engines", []):
        xs = [x for _, x in _engine_ratios(_site_points(site))]
        if xs:
            out.append((f"{site.name} (adapter)", f"{site.engine.split()[0]}'s {site.peer}", site.mode, _geomean(xs),
                        min(xs), _runs([site])[-1]))
    return out


def readme_block(sources) -> str:
    rows = [[label, who, f"{_x(g)} ({_x(lo)})", "graph replay" if mode == "graph" else "event time",
             f"{src.when()}"] for label, who, mode, g, lo, src in summary_rows(sources)]
    return "\n".join(["On one H200 (an H100 where the run says so), the peer's time over ours (geomean over the "
                      "run's grid, slowest point in brackets); docs/performance.md has the tables, the targets and "
                      "the runs:", ""]
                     + _table(["op", "against", "speedup", "timing", "run (date, commit)"], rows))


def _run_key(i: int) -> str:
    """A table's label for its i-th run: A .. Z, then AA, AB, ... (the Engines section cites more than 26 runs)."""
    key = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        key = chr(ord("A") + r) + key
    return key


def render(sources) -> str:
    out = [
        "<!-- generated by benchmarks/perf_doc.py from benchmarks/results/current.json and the files it "
        "names; edit those, not this file -->",
        "# Performance", "",
        "What each public op does today on an H200, against its targets and its peers (on an H100 where "
        "a run says so: no H200 was lent for it). Each figure names its run: the date, the last commit "
        "measured, the GPU when not the H200, and the results file (under `benchmarks/results/`, "
        "compact JSON). The measurements before these, and the changes tried and not kept, are in the git "
        "history: `git log -- docs/perf-notes.md benchmarks/results` finds the dated notebook and the raw "
        "runs, and `git show <commit>^:docs/perf-notes.md` reads it as it was before its removal.",
        "", "## Method", "",
        f"- **Machine**: {_versions(sources)}; one lent GPU, its host.",
        "- **Harness** (`benchmarks/harness.py`, every benchmark): warm-up calls first (module load, JIT build "
        "and Triton autotuning stay out); arms interleaved A B, B A, ... so clock or thermal drift hits "
        "every arm alike; each figure a **median** over many timed runs (p10 / p90 in the raw output).",
        "- **Cold L2**: before every timed run a buffer of at least twice the L2 is overwritten outside the "
        "timed region (decode and verify rotate their inputs instead: each timed graph holds up to 128 calls "
        "on different slot lists, and times are divided by their count).",
        "- **CUDA-graph replay** (`graph`): a graph of the call replayed and timed with device events; the "
        "number for decode and verify, which engines replay. **Event time** (`eager`): one eager call timed "
        "with device events; **wall**: the host clock around a synchronized call. **Kernel time** "
        "(prefill): the union of the call's kernels' spans from torch.profiler.",
        "- **Copy ceiling** in the same run: a 2 GiB device-to-device copy (bytes read + written); "
        "\"% of copy\" is a case's essential traffic over its median time, divided by it.",
        "- **Peers on identical inputs**, in the same run: fla 0.6 (Triton; `fused_recurrent_kda` on the "
        "same `[slots, HV, V, K]` pool, in place, for decode and verify; `chunk_kda` for prefill), with its "
        "gate, l2norm and beta sigmoid inside its kernels. vLLM's KDA layer calls its own vendored copy of "
        "fla's Triton ops (docs/integrations.md), so the fla column stands for it; the Engines section times "
        "vLLM's and SGLang's own kernels through the adapters. cuDNN: a prefill column "
        "when the run has it (`bench_prefill.py --peers cudnn,fla`). FlashKDA (Kimi K3's own prefill on an "
        "H200, the `_flashkda_C` extension of vLLM 0.34.0's wheel, benchmarks/peer_flashkda.py; bounded gate "
        "only): a prefill column when the run has it (`--peers cudnn,flashkda`, .engines/vllm carried).", ""]
    for op, title, make in SECTIONS:
        srcs = sources.get(op, [])
        runs = _runs(srcs)
        for i, src in enumerate(runs):
            src.key = _run_key(i)
        out += [f"## {title}", ""] + make(srcs)
        out += [f"- Run {src.key}: {src.note}" for src in runs if src.note] + [""]
        if runs:
            out += ["Runs: " + "; ".join(f"{src.key}: {src.cite()}" for src in runs) + ".", ""]
        for src in runs:
            if src.plot:
                out += [f"![{op} {_state(src)} {src.when()}](../benchmarks/results/{src.plot})", ""]
    out += HOW_TO_REPRODUCE
    return "\n".join(out).rstrip("\n") + "\n"


HOW_TO_REPRODUCE = [
    "## How to reproduce", "",
    "On the GPU machine, from a checkout (`scripts/device.sh`; its knobs are at its top, logs and results "
    "go to `$OUT`):", "",
    "    STAGES=\"build tests bench peers\" bash scripts/device.sh", "",
    "`bench` runs bench_decode / bench_fused_decode / bench_verify / bench_prefill over the issues' grids; "
    "`peers` runs prefill against cuDNN and fla (`bench_prefill.py --peers cudnn,fla`) and decode and "
    "verify against fla. Fused verify is in no stage yet: `python3 benchmarks/bench_fused_verify.py --modes graph` "
    "(draft length T 4; `--tokens 2,4,8` for all three of issue 30). One benchmark by hand: "
    "`python3 -m flashkda_ext bench decode --quick`; on a CPU, "
    "`python3 benchmarks/run_all.py --dry-run` checks the scripts on tiny shapes (no numbers). One device "
    "command has 10 minutes: spread the stages (or `OPS`, the benchmarks a bench / peers stage runs) over "
    "calls, e.g. `STAGES=peers OPS=prefill`.", "",
    "The engines (Engines): prepare their kernels here, `python3 scripts/prepare_vllm_engine.py` and "
    "`python3 benchmarks/bench_sglang.py --prepare` (both into the ignored `.engines/`, carried to the device), "
    "then on the device `STAGES=engines bash scripts/device.sh` (both benches over rows 1 / 64 / 1024 and H 8 / "
    "12 / 24 / 32, graph replay; its knobs pick engines, rows, heads, modes, phases and the fla arm), or "
    "`python3 benchmarks/bench_vllm.py --kinds decode,verify --modes graph` and `python3 benchmarks/bench_sglang.py "
    "--phases decode,verify` by hand; prefill is `--kinds prefill` / `--phases extend`. "
    "Point the call sites' entries under `engines` in `benchmarks/results/current.json` at the results.", "",
    "To update this page: copy a run's JSON into `benchmarks/results/h200-<date>-<commit>/` (with a README "
    "saying what ran), `python3 benchmarks/results_compact.py FILE`, point its op's entry of "
    "`benchmarks/results/current.json` at it, then `python3 benchmarks/perf_doc.py` (tests/test_perf_doc.py "
    "fails while this page or the README block differs from the data)."]


def with_readme_block(text: str, block: str) -> str:
    rx = re.compile(re.escape(BEGIN) + r"\n(?:.*?\n)?" + re.escape(END), re.S)
    if not rx.search(text):
        raise ValueError("README.md has no generated performance block")
    return rx.sub(lambda _m: f"{BEGIN}\n{block}\n{END}", text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale; write nothing")
    args = ap.parse_args(argv)
    sources = load()
    want = {DOC: render(sources), README: with_readme_block(README.read_text(), readme_block(sources))}
    stale = [p for p, text in want.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: python3 benchmarks/perf_doc.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(want[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
