"""One timing harness for every flashkda_ext benchmark (decode, prefill, fused decode, trace).

What it does, so that every family is measured the same way:

* cold L2: before every timed run a buffer of at least 2x the L2 size is overwritten, so no run
  finds its inputs (or its state pool) in the cache left by the previous one;
* warm-up runs first (module load, JIT build, Triton autotune stay out of the numbers);
* medians (and p10/p90) over many runs;
* three timing modes per arm:
    graph  - CUDA-graph replay timed with device events (launch gaps removed: small launches),
    eager  - one eager call timed with device events,
    wall   - one eager call timed with the host clock, synchronized before and after: what a
             caller waiting on the result sees, host overhead (validation, dispatch) included;
  and on request (--modes host, --modes kernel) two more:
    host   - blocks of HOST_BLOCK eager calls back to back, host clock, no synchronization or L2
             flush inside a block: per call, the host's issue rate (when the kernels are shorter
             than the host work, as for small decode calls, exactly the host cost of a call); its
             spread is a fraction of wall's, whose sync jitter hides differences of a few us;
    kernel - the GPU time of the kernels one eager call launches, from torch.profiler's device
             events: the union of their [start, end) spans, so launch gaps are left out and kernels
             that overlap (programmatic dependent launch) count once;
* arms interleaved A B B A (then A B B A again ...) so that clock or thermal drift cancels;
* the copy-bandwidth ceiling (a large device-to-device copy, bytes read + written over time)
  measured in the same run, so "% of bandwidth" refers to this GPU as it is right now;
* results as JSON, a PNG plot (matplotlib when importable: speedup per case, % of bandwidth) and a
  progress bar (tqdm when importable, else a plain counter on stderr).

The same code runs on a CPU (device "cpu") as a dry run: host-clock timing only, no graphs, a
small flush buffer. Tests use that mode to check the logic without a GPU.

Peers: fla (flash-linear-attention >= 0.6, Triton) adapters for the recurrent decode and verify and the chunked
prefill live here too (fla_decode_fn, fla_verify_fn, fla_prefill_fn), mapping flashkda_ext's layouts onto fla's
(state [slots, HV, V, K] is fla's state_v_first=True layout).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

# A checkout without `pip install -e .`: let the scripts import the package from the repository.
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "flashkda_ext" / "__init__.py").is_file() and str(_REPO) not in sys.path:
    sys.path.append(str(_REPO))

MODES = ("graph", "eager", "wall")     # the default set
ALL_MODES = MODES + ("host", "kernel")  # only when asked for: host (issue rate), kernel (profiler, slow)
HOST_MODES = ("wall", "host")          # the modes a CPU run has (no device events or graphs)
HOST_BLOCK = 50                        # calls per host-mode sample



def _default_out() -> Path:
    """Where results go without --out: a folder under the JIT cache dir ($FLASHKDA_EXT_CACHE_DIR,
    else ~/.cache/flashkda_ext), so a run never writes into the checkout; results worth keeping are
    copied into benchmarks/results/ by hand, named for what they are."""
    from flashkda_ext import paths

    return paths.cache_dir() / "bench-results"


DEFAULT_OUT = _default_out()


# ---------------------------------------------------------------------------------------------
# configuration


@dataclass
class Config:
    device: str = "cuda"
    warmup: int = 5            # eager warm-up calls per arm (graph capture adds its own)
    reps: int = 60             # timed samples per arm and mode, split over the rounds
    rounds: int = 4            # interleaving rounds: A B, B A, A B, B A ...
    modes: Sequence[str] = MODES
    cold_l2: bool = True
    flush_bytes: int = 0       # 0: max(2 x L2, 256 MiB) on a GPU, 4 MiB on a CPU
    copy_bytes: int = 0        # 0: 2 GiB on a GPU, 16 MiB on a CPU
    out_dir: Path = DEFAULT_OUT
    out_file: Optional[str] = None   # results file name (default <benchmark>.json); --out x.json sets it
    plot: bool = True
    progress: bool = True
    quick: bool = False

    @property
    def is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Flags every benchmark script accepts (run_all.py and `flashkda-ext bench` pass them on)."""
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (dry run)")
    p.add_argument("--quick", action="store_true", help="a small grid and fewer samples")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, few samples: checks the script's logic without a GPU")
    p.add_argument("--reps", type=int, default=None, help="timed samples per arm and mode")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per arm")
    p.add_argument("--rounds", type=int, default=None, help="A B B A interleaving rounds")
    p.add_argument("--modes", default=None,
                   help="comma list of graph,eager,wall,host,kernel (host: back-to-back issue rate; "
                        "kernel: profiler kernel time, slow)")
    p.add_argument("--no-cold-l2", action="store_true", help="do not flush L2 between runs")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default=None, help=f"results folder (default {DEFAULT_OUT}), or a .json file")
    p.add_argument("--no-fla", action="store_true", help="leave the fla (Triton) peer out")


def config_from_args(args) -> Config:
    dry = getattr(args, "dry_run", False)
    device = args.device or ("cuda" if torch.cuda.is_available() and not dry else "cpu")
    quick = bool(args.quick or dry)
    cfg = Config(device=device, quick=quick)
    if quick:
        cfg.reps, cfg.warmup, cfg.rounds = 20, 3, 2
    if dry:
        cfg.reps, cfg.warmup, cfg.rounds = 4, 1, 2
    if not cfg.is_cuda:
        cfg.modes = ("wall",)
    if args.reps is not None:
        cfg.reps = max(1, args.reps)
    if args.warmup is not None:
        cfg.warmup = max(0, args.warmup)
    if args.rounds is not None:
        cfg.rounds = max(1, args.rounds)
    if args.modes:
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        bad = [m for m in modes if m not in ALL_MODES]
        if bad:
            raise SystemExit(f"--modes: unknown {bad}; choose from {list(ALL_MODES)}")
        cfg.modes = modes if cfg.is_cuda else tuple(m for m in modes if m in HOST_MODES) or ("wall",)
    cfg.cold_l2 = not args.no_cold_l2
    cfg.plot = not args.no_plot
    cfg.progress = not args.no_progress
    if args.out:
        out = Path(args.out)
        if out.suffix == ".json":   # the older per-script convention: --out results.json
            cfg.out_dir, cfg.out_file = out.parent if str(out.parent) else Path("."), out.name
        else:
            cfg.out_dir = out
    return cfg


# ---------------------------------------------------------------------------------------------
# environment


def versions() -> dict:
    """Everything a reader needs to reproduce a number: GPU, drivers, library versions, date."""
    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    for mod in ("tvm_ffi", "flashkda_ext", "fla", "triton"):
        info[mod] = _module_version(mod)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_arch=f"sm_{p.major}{p.minor}", sm_count=p.multi_processor_count,
                    gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    l2_bytes=int(getattr(p, "L2_cache_size", 0) or 0))
    else:
        info.update(gpu=None, cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    return info


def _module_version(name: str) -> Optional[str]:
    try:
        import importlib

        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001  a broken optional import is just "absent" here
        return None
    return str(getattr(mod, "__version__", "unknown"))


def fla_version() -> Optional[str]:
    """The installed fla version when its KDA ops import (they need triton and a GPU build)."""
    try:
        import fla  # noqa: F401
        from fla.ops.kda import chunk_kda  # noqa: F401
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: F401
    except Exception:  # noqa: BLE001
        return None
    return _module_version("fla")


# ---------------------------------------------------------------------------------------------
# progress


class Progress:
    """tqdm when importable, else '[i/n] label' lines on stderr; silent when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.n, self.enabled, self._bar = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self._bar = None
        self.desc = desc

    def step(self, label: str = "") -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label[:60])
            self._bar.update(1)
        else:
            sys.stderr.write(f"[{self.desc} {self.n}/{self.total}] {label}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------------------------------------
# statistics


def summarize(samples_us: Sequence[float]) -> dict:
    """Median, p10 and p90 (deciles interpolated between samples, statistics.quantiles'
    'inclusive' method), min and count of the samples."""
    s = sorted(samples_us)
    if not s:
        return {"median": None, "p10": None, "p90": None, "min": None, "n": 0}
    deciles = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
    return {"median": statistics.median(s), "p10": deciles[0], "p90": deciles[-1], "min": s[0], "n": len(s)}


def geomean(xs: Iterable[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (what the docs quote as accuracy)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den > 0 else num


def union_length(spans: Iterable[Tuple[float, float]]) -> float:
    """Total length covered by [start, end) spans (overlaps counted once, gaps left out)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def interleaved_order(names: Sequence[str], rounds: int) -> List[List[str]]:
    """A B, B A, A B, ...: every second round reversed, so a linear drift hits every arm alike."""
    out = []
    for r in range(rounds):
        out.append(list(names) if r % 2 == 0 else list(reversed(names)))
    return out


# ---------------------------------------------------------------------------------------------
# the timer


@dataclass
class Arm:
    """One contender in a case: fn() runs it once on inputs it closes over (outputs preallocated).

    graph: whether fn may be captured in a CUDA graph (False for a path that syncs or allocates
    on the host per call). bytes: memory traffic of one call, for GB/s and % of copy bandwidth
    (defaults to the case's). calls: when fn runs M calls back to back (M rotated input sets that
    together overflow L2, the other way to keep L2 cold), every time is divided by M."""
    name: str
    fn: Callable[[], object]
    graph: bool = True
    bytes: Optional[int] = None
    calls: int = 1   # fn runs this many calls (e.g. one per rotated input set): times are per call


class Timer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self._flush = None
        if cfg.cold_l2:
            n = cfg.flush_bytes or self._default_flush_bytes()
            self._flush = torch.empty(n // 4, dtype=torch.float32, device=self.device)
        self._flush_val = 0.0

    def _default_flush_bytes(self) -> int:
        if self.cfg.is_cuda:
            l2 = int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 0)
            return max(2 * l2, 256 << 20)
        return 4 << 20

    def flush(self) -> None:
        if self._flush is not None:
            self._flush_val = 1.0 - self._flush_val  # a different value each time: no skipped write
            self._flush.fill_(self._flush_val)

    def sync(self) -> None:
        if self.cfg.is_cuda:
            torch.cuda.synchronize(self.device)

    # -- one sample per mode --------------------------------------------------------------------

    def _events(self, run: Callable[[], object], n: int) -> List[float]:
        """n device-event timings of run(), with an L2 flush before each (outside the events)."""
        pairs = []
        for _ in range(n):
            self.flush()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            pairs.append((s, e))
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1e3 for s, e in pairs]

    def _kernel(self, run: Callable[[], object], n: int) -> List[float]:
        """n samples of the kernel time of run(): each call under its own profiler session, the L2
        flush outside it; the union of the call's device-event spans (see union_length)."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        out = []
        for _ in range(n):
            self.flush()
            self.sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                self.sync()
            spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA]
            if not spans:
                raise RuntimeError("the profiler saw no device activity")
            out.append(union_length(spans))
        return out

    def _wall(self, run: Callable[[], object], n: int) -> List[float]:
        out = []
        for _ in range(n):
            self.flush()
            self.sync()
            t0 = time.perf_counter()
            run()
            self.sync()
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    def _host(self, run: Callable[[], object], n: int) -> List[float]:
        """n samples of the per-call time of HOST_BLOCK calls issued back to back (synchronized
        before and after each block, outside the timed span; no L2 flush: this mode times the host)."""
        out = []
        for _ in range(n):
            self.sync()
            t0 = time.perf_counter()
            for _ in range(HOST_BLOCK):
                run()
            out.append((time.perf_counter() - t0) * 1e6 / HOST_BLOCK)
        self.sync()
        return out

    def capture(self, fn: Callable[[], object]):
        """A CUDA graph of fn (warmed up on a side stream first, as capture requires)."""
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize(self.device)
        return g

    def measure(self, arms: Sequence[Arm], *, flush: Optional[bool] = None,
                reps: Optional[int] = None) -> Dict[str, dict]:
        """{arm: {mode: summary (us per call) or {"error": why}}}, arms interleaved A B B A over the
        rounds. flush=False skips the L2 flush for this measurement (inputs rotated instead);
        reps overrides the configured sample count (fewer for multi-millisecond cases)."""
        saved_flush = self._flush
        if flush is False:
            self._flush = None
        try:
            return self._measure(arms, reps or self.cfg.reps)
        finally:
            self._flush = saved_flush

    def _measure(self, arms: Sequence[Arm], reps: int) -> Dict[str, dict]:
        cfg = self.cfg
        runners: Dict[str, Dict[str, Callable]] = {a.name: {} for a in arms}
        errors: Dict[str, Dict[str, str]] = {a.name: {} for a in arms}
        for a in arms:
            try:
                for _ in range(max(1, cfg.warmup)):
                    a.fn()
                self.sync()
            except Exception as e:  # noqa: BLE001  one broken arm must not stop the sweep
                for m in cfg.modes:
                    errors[a.name][m] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                continue
            for m in cfg.modes:
                if m == "kernel" and not cfg.is_cuda:
                    errors[a.name][m] = "kernel time needs a CUDA device"
                elif m == "graph":
                    if not cfg.is_cuda:
                        errors[a.name][m] = "no CUDA graphs on this device"
                    elif not a.graph:
                        errors[a.name][m] = "not graph-capturable"
                    else:
                        try:
                            g = self.capture(a.fn)
                            runners[a.name][m] = g.replay
                        except Exception as e:  # noqa: BLE001
                            errors[a.name][m] = f"capture failed: {type(e).__name__}: {e}"[:300]
                else:
                    runners[a.name][m] = a.fn
        samples: Dict[str, Dict[str, List[float]]] = {a.name: {m: [] for m in cfg.modes} for a in arms}
        per_round = max(1, math.ceil(reps / cfg.rounds))
        # The kernel mode's profiler sessions go in rounds of their own after every other mode: with
        # them between event batches, the eager medians of every prefill row read high on an H200
        # (H16 8192: 361.8 us, against 308.0 with the kernel rounds apart; 2026-11-30, 615ddfc).
        passes = [[m for m in cfg.modes if m != "kernel"], [m for m in cfg.modes if m == "kernel"]]
        schedule = [(modes, order) for modes in passes if modes
                    for order in interleaved_order([a.name for a in arms], cfg.rounds)]
        for modes, order in schedule:
            for name in order:
                for m, run in runners[name].items():
                    if m not in modes:
                        continue
                    try:
                        if m == "wall":
                            samples[name][m] += self._wall(run, per_round)
                        elif m == "host":
                            samples[name][m] += self._host(run, per_round)
                        elif m == "kernel":
                            samples[name][m] += self._kernel(run, per_round)
                        else:
                            samples[name][m] += self._events(run, per_round)
                    except Exception as e:  # noqa: BLE001
                        errors[name][m] = f"{type(e).__name__}: {e}"[:300]
                        runners[name] = {k: v for k, v in runners[name].items() if k != m}
                        break
        out: Dict[str, dict] = {}
        for a in arms:
            res = {}
            for m in cfg.modes:
                if m in errors[a.name]:
                    res[m] = {"error": errors[a.name][m]}
                else:
                    res[m] = summarize([t / max(1, a.calls) for t in samples[a.name][m]])
            out[a.name] = res
        return out

    def copy_bandwidth(self) -> dict:
        """The copy ceiling: a large device-to-device copy, (bytes read + written) / median time."""
        n = self.cfg.copy_bytes or ((2 << 30) if self.cfg.is_cuda else (16 << 20))
        if self.cfg.is_cuda:
            free = torch.cuda.mem_get_info(self.device)[0]
            n = min(n, max(64 << 20, free // 4))
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        src.fill_(1)
        dst = torch.empty_like(src)
        reps = 5 if self.cfg.quick else 20
        for _ in range(3):
            dst.copy_(src)
        if self.cfg.is_cuda:
            ts = self._events(lambda: dst.copy_(src), reps)
        else:
            ts = self._wall(lambda: dst.copy_(src), reps)
        med = statistics.median(ts)
        del src, dst
        return {"bytes": n, "median_us": med, "GBps": 2 * n / (med * 1e-6) / 1e9, "samples": len(ts)}


# ---------------------------------------------------------------------------------------------
# a benchmark run: cases -> JSON + plot


@dataclass
class Case:
    name: str
    params: dict
    arms: List[Arm]
    bytes: Optional[int] = None        # memory traffic of one call (per arm override in Arm.bytes)
    flops: Optional[float] = None
    notes: dict = field(default_factory=dict)
    flush: bool = True                 # False: no L2 flush (the arms rotate input sets instead)
    reps: Optional[int] = None         # samples per arm and mode for this case (default: the config's)


class Run:
    """Collects cases of one benchmark, then writes <out>/<name>.json and <name>.png.

    baseline: the arm every other arm's speedup is quoted against (e.g. "fla"); when a case
    lacks it, no speedup is given for that case."""

    def __init__(self, name: str, cfg: Config, *, baseline: Optional[str] = None, primary_mode: str = None,
                 extra_meta: Optional[dict] = None):
        self.name, self.cfg, self.baseline = name, cfg, baseline
        self.primary_mode = primary_mode or cfg.modes[0]
        if self.primary_mode not in cfg.modes:
            self.primary_mode = cfg.modes[0]
        self.timer = Timer(cfg)
        self.meta = versions()
        self.meta["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
        if extra_meta:
            self.meta.update(extra_meta)
        self.ceiling = self.timer.copy_bandwidth()
        self.results: List[dict] = []
        self.extra: dict = {}          # more top-level JSON fields (e.g. an accuracy table)
        self.skipped: List[dict] = []  # cases that could not be set up: {"case", "error"}
        self._progress: Optional[Progress] = None

    def start(self, total_cases: int) -> None:
        self._progress = Progress(total_cases, self.name, self.cfg.progress)

    def add(self, case: Case) -> dict:
        timings = self.timer.measure(case.arms, flush=case.flush,
                                     reps=min(case.reps, self.cfg.reps) if case.reps else None)
        rec = {"name": case.name, "params": case.params, "bytes": case.bytes, "flops": case.flops,
               "notes": case.notes, "cold_l2": "flush" if case.flush and self.cfg.cold_l2 else
               ("rotated inputs" if any(a.calls > 1 for a in case.arms) else "warm"), "arms": {}}
        for a in case.arms:
            t = timings[a.name]
            nbytes = a.bytes if a.bytes is not None else case.bytes
            arm_rec = {"time_us": t}
            if nbytes:
                bw = {}
                for m, s in t.items():
                    if s.get("median"):
                        gbps = nbytes / (s["median"] * 1e-6) / 1e9
                        bw[m] = {"GBps": gbps, "pct_copy": 100.0 * gbps / self.ceiling["GBps"]}
                arm_rec["bandwidth"] = bw
            rec["arms"][a.name] = arm_rec
        rec["speedup"] = self._speedups(rec)
        self.results.append(rec)
        self._write(partial=True)   # a run cut short by a time limit keeps every finished case
        if self._progress is not None:
            self._progress.step(case.name)
        return rec

    #: results paths taken in this process, by run name: a second benchmark given the same --out x.json
    #: (bench_sglang's phases) writes x_<its name>.json instead of replacing the first one's file
    _taken: Dict[Path, str] = {}

    @property
    def path(self) -> Path:
        path = self.cfg.out_dir / (self.cfg.out_file or f"{self.name}.json")
        owner = Run._taken.setdefault(path, self.name)
        if owner != self.name:
            path = path.with_name(f"{path.stem}_{self.name}{path.suffix}")
        return path

    def document(self, partial: bool = False) -> dict:
        return {"benchmark": self.name, "partial": partial, "meta": self.meta, "copy_ceiling": self.ceiling,
                "baseline": self.baseline, "primary_mode": self.primary_mode,
                "summary": self.summary(), **self.extra, "skipped": self.skipped, "cases": self.results}

    def _write(self, partial: bool) -> Path:
        self.cfg.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.document(partial), indent=1, default=str) + "\n")
        os.replace(tmp, self.path)
        return self.path

    def _speedups(self, rec: dict) -> dict:
        if not self.baseline or self.baseline not in rec["arms"]:
            return {}
        base = rec["arms"][self.baseline]["time_us"]
        out = {}
        for name, arm in rec["arms"].items():
            if name == self.baseline:
                continue
            per = {}
            for m, s in arm["time_us"].items():
                b = base.get(m, {})
                if s.get("median") and b.get("median"):
                    per[m] = b["median"] / s["median"]
            out[name] = per
        return out

    def summary(self) -> dict:
        """Geomean speedup over the baseline per arm and mode; min and max too."""
        out = {}
        arms = sorted({a for r in self.results for a in r.get("speedup", {})})
        for a in arms:
            per = {}
            for m in self.cfg.modes:
                xs = [r["speedup"][a].get(m) for r in self.results if a in r.get("speedup", {})]
                xs = [x for x in xs if x]
                if xs:
                    per[m] = {"geomean": geomean(xs), "min": min(xs), "max": max(xs), "cases": len(xs)}
            out[a] = per
        return out

    def finish(self) -> Path:
        if self._progress is not None:
            self._progress.close()
        path = self._write(partial=False)
        doc = self.document()
        if self.cfg.plot:
            png = plot(doc, path.with_suffix(".png"))
            if png is not None:
                print(f"plot: {png}")
        print(format_table(doc))
        print(f"results: {path}")
        return path


# ---------------------------------------------------------------------------------------------
# output


def _fmt_us(s: dict) -> str:
    if "error" in s:
        return "err"
    m = s.get("median")
    return "-" if m is None else (f"{m:.1f}" if m < 1000 else f"{m / 1000:.2f}ms")


def format_table(doc: dict) -> str:
    """A plain-text table: one line per case, time per arm and mode (us), speedup, % of copy."""
    cases = doc["cases"]
    if not cases:
        return f"{doc['benchmark']}: no cases"
    arms = []
    for c in cases:
        for a in c["arms"]:
            if a not in arms:
                arms.append(a)
    modes = list(doc["meta"]["config"]["modes"])
    base = doc.get("baseline")
    head = ["case"] + [f"{a}:{m}" for a in arms for m in modes]
    others = [a for a in arms if a != base] if base else []
    head += [f"x{a}:{doc['primary_mode']}" for a in others]
    head += [f"%copy:{a}" for a in arms]
    rows = [head]
    pm = doc["primary_mode"]
    for c in cases:
        row = [c["name"]]
        for a in arms:
            for m in modes:
                s = c["arms"].get(a, {}).get("time_us", {}).get(m)
                row.append("-" if s is None else _fmt_us(s))
        for a in others:
            x = c.get("speedup", {}).get(a, {}).get(pm)
            row.append("-" if x is None else f"{x:.2f}")
        for a in arms:
            bw = c["arms"].get(a, {}).get("bandwidth", {}).get(pm)
            row.append("-" if not bw else f"{bw['pct_copy']:.0f}%")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
             for r in rows]
    ceil = doc["copy_ceiling"]
    gpu = doc["meta"].get("gpu") or "CPU (dry run)"
    kinds = sorted({c.get("cold_l2", "flush") for c in cases})
    l2 = "cold L2: " + " / ".join(kinds) if doc["meta"]["config"]["cold_l2"] or "rotated inputs" in kinds \
        else "warm L2"
    lines.insert(0, f"{doc['benchmark']} on {gpu}: copy ceiling {ceil['GBps']:.0f} GB/s; times in us per call "
                    f"(median, {l2})")
    for a, per in doc.get("summary", {}).items():
        parts = [f"{m} geomean {v['geomean']:.2f}x (min {v['min']:.2f}, max {v['max']:.2f}, {v['cases']} cases)"
                 for m, v in per.items()]
        if parts:
            lines.append(f"{a} vs {base}: " + "; ".join(parts))
    for sk in doc.get("skipped", []):
        lines.append(f"skipped {sk['case']}: {sk['error'][:160]}")
    errs = sorted({f"{a}:{m}: {s['error'][:120]}" for c in cases for a, arm in c["arms"].items()
                   for m, s in arm["time_us"].items() if "error" in s})
    for e in errs[:10]:
        lines.append(f"error {e}")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Optional[Path]:
    """Speedup over the baseline per case (primary mode) and % of copy bandwidth; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    cases = doc["cases"]
    if not cases:
        return None
    pm = doc["primary_mode"]
    names = [c["name"] for c in cases]
    arms = []
    for c in cases:
        for a in c["arms"]:
            if a not in arms:
                arms.append(a)
    has_bw = any(c["arms"][a].get("bandwidth", {}).get(pm) for c in cases for a in c["arms"])
    has_sp = any(c.get("speedup") for c in cases)
    panels = int(has_sp) + int(has_bw)
    if panels == 0:
        return None
    fig, axes = plt.subplots(panels, 1, figsize=(max(8, 0.35 * len(names) + 3), 4 * panels), squeeze=False)
    ax_i = 0
    x = list(range(len(names)))
    if has_sp:
        ax = axes[ax_i][0]
        ax_i += 1
        others = [a for a in arms if a != doc.get("baseline")]
        w = 0.8 / max(1, len(others))
        for j, a in enumerate(others):
            ys = [c.get("speedup", {}).get(a, {}).get(pm) or 0 for c in cases]
            ax.bar([i + j * w for i in x], ys, width=w, label=a)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(f"speedup over {doc.get('baseline')} ({pm})")
        ax.set_xticks([i + 0.4 - w / 2 for i in x])
        ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7)
        ax.legend(fontsize=8)
    if has_bw:
        ax = axes[ax_i][0]
        w = 0.8 / max(1, len(arms))
        for j, a in enumerate(arms):
            ys = [(c["arms"].get(a, {}).get("bandwidth", {}).get(pm) or {}).get("pct_copy", 0) for c in cases]
            ax.bar([i + j * w for i in x], ys, width=w, label=a)
        ax.axhline(100.0, color="k", lw=0.8)
        ax.set_ylabel(f"% of copy bandwidth ({doc['copy_ceiling']['GBps']:.0f} GB/s)")
        ax.set_xticks([i + 0.4 - w / 2 for i in x])
        ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7)
        ax.legend(fontsize=8)
    gpu = doc["meta"].get("gpu") or "CPU"
    fig.suptitle(f"{doc['benchmark']} - {gpu} - {doc['meta']['date_utc']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# inputs and peers shared by the scripts


def pick_copy_arms(text: str, configs: Sequence[tuple], is_cuda: bool, option: str = "--slot-copy") -> list:
    """The copy-reference arms a bench's `option` names (a comma list of labels, the first field of each
    config), in config order; a label not among them exits naming them. The references are Triton:
    none without a CUDA device (a dry run), said on stderr."""
    wanted = [c for c in text.split(",") if c]
    picked = [c for c in configs if c[0] in wanted]
    if len(picked) != len(wanted):
        raise SystemExit(f"{option}: expected labels among {[c[0] for c in configs]}, got {wanted}")
    if picked and not is_cuda:
        print(f"{option}: the Triton copy needs a CUDA device; left out of this dry run", file=sys.stderr)
        return []
    return picked


def calls_per_graph(max_calls: int, call_bytes: float, rotate_bytes: float = 256e6) -> int:
    """Calls (one rotated input set each) in one timed graph: enough sets that together they overflow L2
    (rotate_bytes of traffic), at least 2 and at most max_calls. max_calls 1 times a single call per
    graph, as the engines' benchmarks do (its launch latency shows, the L2 flush keeps it cold)."""
    if max_calls < 1:
        raise ValueError(f"max_calls must be >= 1, got {max_calls}")
    return max(min(2, max_calls), min(max_calls, math.ceil(rotate_bytes / call_bytes)))


def in_sequence(calls):
    """One timed run: the calls back to back (a bench's rotated slot tables)."""
    def run():
        for c in calls:
            c()
    return run


def random_unique_slots(rows: int, slots: int, device, *, generator: Optional[torch.Generator] = None,
                        padding: int = 0) -> torch.Tensor:
    """rows distinct slot indices in [0, slots), int32, the first `padding` of them set to -1."""
    if rows > slots:
        raise ValueError(f"rows={rows} > slots={slots}: unique slots impossible")
    idx = torch.randperm(slots, generator=generator)[:rows].to(torch.int32)
    if padding:
        idx[:padding] = -1
    return idx.to(device)


def state_bytes(rows_heads: int, K: int, V: int, state_dtype: torch.dtype) -> int:
    """Bytes of state read + written by rows_heads (row, head) steps."""
    return 2 * rows_heads * K * V * torch.tensor([], dtype=state_dtype).element_size()


def fla_decode_fn(q, k, v, g, beta, *, state, state_indices, A_log=None, dt_bias=None, gate="softplus",
                  lower_bound=None, scale=None, out=None):
    """A zero-argument closure running fla's fused recurrent KDA as a decode step on our pool.

    Ours: q, k [rows, H, K], v [rows, HV, V], g raw [rows, HV, K], beta logits [rows, HV],
    state [slots, HV, V, K] (fla's state_v_first=True layout), int32 state_indices [rows] with no
    padding (fla does not guard negative indices). Each row becomes a batch entry of length 1."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    q4, k4, v4, g4, b3 = (t.unsqueeze(1) for t in (q, k, v, g, beta))
    o4 = out.unsqueeze(1) if out is not None else torch.empty_like(v4)
    gate_kw = _fla_gate_kwargs(gate, A_log, dt_bias, lower_bound)

    def run():
        fused_recurrent_kda_fwd(
            q=q4, k=k4, v=v4, g=g4, beta=b3, initial_state=state,
            scale=scale, output_final_state=False, inplace_final_state=True, state_v_first=True,
            ssm_state_indices=state_indices, use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, out=o4, **gate_kw)
        return o4

    return run


def _fla_gate_kwargs(gate, A_log, dt_bias, lower_bound) -> dict:
    """fused_recurrent_kda_fwd's gate arguments for our gate name: "log" hands over the log decay (no gate
    in fla's kernel), "softplus" / "bounded" the raw gate with A_log, dt_bias (and the bound)."""
    if gate == "log":
        return dict(A_log=None, dt_bias=None, use_gate_in_kernel=False, lower_bound=None)
    return dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                lower_bound=lower_bound if gate == "bounded" else None)


def fla_verify_fn(q, k, v, g, beta, *, state, state_indices, cu_seqlens, num_accepted_tokens, A_log=None,
                  dt_bias=None, gate="softplus", lower_bound=None, scale=None, out=None, fn=None):
    """A zero-argument closure running fla's fused recurrent KDA as a speculative verify on our pool
    (fla >= 0.6: a 2-D ssm_state_indices and num_accepted_tokens, as vLLM calls it).

    Ours: q, k, v, g [1, T, HV, D] (g raw, or the log decay with gate="log"), beta logits [1, T, HV], the
    requests packed by cu_seqlens (int32 [N+1]); state [slots, HV, V, K]; state_indices int32 [N, T_max]
    (the state after token t of request n goes to slot [n, t]), num_accepted_tokens int32 [N] (request n
    starts from slot [n, num_accepted_tokens[n] - 1]). fn: fla's fused_recurrent_kda_fwd (imported when
    None)."""
    if fn is None:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fn
    gate_kw = _fla_gate_kwargs(gate, A_log, dt_bias, lower_bound)
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def run():
        return fn(q, k, v, g, beta, initial_state=state, scale=scale, inplace_final_state=True,
                  state_v_first=True, cu_seqlens=cu_seqlens, ssm_state_indices=state_indices,
                  num_accepted_tokens=num_accepted_tokens, use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, out=out, **gate_kw)

    return run


def fla_prefill_fn(q, k, v, g, beta, *, A_log=None, dt_bias=None, gate="softplus", lower_bound=None,
                   scale=None, cu_seqlens=None, initial_state=None):
    """A zero-argument closure running fla's chunk_kda on our inputs (state [N, HV, V, K] fp32,
    fla's state_v_first=True; cu_seqlens int64 as fla expects; its host copy passed too so fla
    does not synchronize to read it)."""
    from fla.ops.kda import chunk_kda

    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
              output_final_state=True, scale=scale)
    if gate == "log":
        kw.update(use_gate_in_kernel=False)
    else:
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        if gate == "bounded":
            kw.update(lower_bound=lower_bound, safe_gate=lower_bound is not None and -5 <= lower_bound < 0)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64)
        kw.update(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    init = None if initial_state is None else initial_state.float().contiguous()

    def run():
        with torch.inference_mode():
            return chunk_kda(q, k, v, g, beta, initial_state=init, **kw)

    return run


def torch_gate(g, *, gate="softplus", A_log=None, dt_bias=None, lower_bound=None):
    """The gate in plain torch (fp32): what an engine without a fused gate kernel runs."""
    HV, K = g.shape[-2:]
    x = g.float()
    if gate == "log":
        return x
    if dt_bias is not None:
        x = x + dt_bias.view(HV, K)
    if gate == "softplus":
        return -torch.exp(A_log).view(HV, 1) * torch.nn.functional.softplus(x, threshold=20.0)
    a = torch.exp(A_log).view(HV, 1) if A_log is not None else 1.0
    return lower_bound * torch.sigmoid(a * x)


def torch_decode_step(q, k, v, g_log, beta_prob, *, state, state_indices, scale=None, out=None):
    """A vectorized torch decode step (gather, update, scatter) on a [slots, HV, V, K] pool.

    Used as the recurrent step of the unfused sequence when fla is not available (CPU dry runs).
    Rows must address distinct, non-negative slots."""
    rows, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    grp = HV // H
    scale = K ** -0.5 if scale is None else scale
    qf = q.float() * torch.rsqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6) * scale
    kf = k.float() * torch.rsqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    qf, kf = qf.repeat_interleave(grp, dim=1), kf.repeat_interleave(grp, dim=1)
    idx = state_indices.long()
    S = state.index_select(0, idx).float()                           # [rows, HV, V, K]
    S = S * torch.exp(g_log.float()).unsqueeze(2)
    u = beta_prob.float().unsqueeze(-1) * (v.float() - torch.einsum("rhvk,rhk->rhv", S, kf))
    S = S + u.unsqueeze(-1) * kf.unsqueeze(2)
    o = torch.einsum("rhvk,rhk->rhv", S, qf)
    state.index_copy_(0, idx, S.to(state.dtype))
    if out is None:
        return o.to(v.dtype)
    out.copy_(o)
    return out


def torch_verify_step(q, k, v, g_log, beta_prob, *, state, state_indices, num_accepted_tokens, scale=None,
                      out=None):
    """A vectorized torch verify (speculative decoding) on a [slots, HV, V, K] pool, torch_decode_step
    token by token: every request has T = state_indices.shape[1] tokens (rows n*T .. n*T + T - 1 of q, k,
    v [N*T, heads, D], g_log, beta_prob); request n starts from slot state_indices[n,
    num_accepted_tokens[n] - 1] and the state after its token t, in the pool's dtype (the next token
    continues from that stored value), goes to slot state_indices[n, t]. Slots distinct and non-negative.

    Used as the recurrent step of the unfused verify sequence when fla is not available (CPU dry runs)."""
    N, T = state_indices.shape
    idx = state_indices.long()
    read = idx.gather(1, num_accepted_tokens.long().view(N, 1) - 1).view(N)
    cur = state.index_select(0, read)                                # the requests' states, pool dtype
    rows = torch.arange(N, dtype=torch.int32, device=state.device)
    o = torch.empty_like(v) if out is None else out
    tok = lambda x, t: x.view(N, T, *x.shape[1:])[:, t]  # noqa: E731
    for t in range(T):
        torch_decode_step(tok(q, t), tok(k, t), tok(v, t), tok(g_log, t), tok(beta_prob, t), state=cur,
                          state_indices=rows, scale=scale, out=tok(o, t))
        state.index_copy_(0, idx[:, t], cur)
    return o
