"""`flashkda-ext bench NAME [flags]`: run a benchmark script of the checkout's benchmarks/ folder,
its flags (and `--help`) passed on to the script."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional

BENCH_SCRIPTS = {"decode": "bench_decode.py", "prefill": "bench_prefill.py", "fused": "bench_fused_decode.py",
                 "fused_verify": "bench_fused_verify.py",
                 "overhead": "bench_overhead.py", "trace": "bench_trace_overhead.py",
                 "jax": "bench_jax_overhead.py", "all": "run_all.py"}
# scripts with their own small CLI: --quick is not theirs to take
_NO_QUICK = {"trace", "jax"}


def benchmarks_dir() -> Optional[Path]:
    from .. import paths

    d = paths.PACKAGE_DIR.parent / "benchmarks"
    return d if d.is_dir() else None


def cmd_bench(args) -> int:
    extra = args.extra
    if args.which is None:
        # `bench --help` is this command's own help; `bench NAME --help` is the script's
        wants_help = any(a in ("-h", "--help") for a in extra)
        args.parser.print_help(sys.stdout if wants_help else sys.stderr)
        if not wants_help:
            print("bench: name a benchmark: " + ", ".join(BENCH_SCRIPTS), file=sys.stderr)
        return 0 if wants_help else 2
    d = benchmarks_dir()
    if d is None:
        print("bench: benchmarks/ ships with the repository checkout, not the wheel; run from a checkout",
              file=sys.stderr)
        return 2
    script = d / BENCH_SCRIPTS[args.which]
    if not script.is_file():
        print(f"bench: {script} is not there yet", file=sys.stderr)
        return 2
    if args.quick and args.which in _NO_QUICK:     # was dropped in silence: the run was not the quick one asked for
        print(f"bench: --quick: the {args.which} benchmark has no quick mode "
              f"(`flashkda-ext bench {args.which} --help` shows its flags)", file=sys.stderr)
        return 2
    quick = ["--quick"] if args.quick else []
    cmd = [sys.executable, str(script)] + quick + extra
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def add_parser(sub) -> None:
    # no -h of its own: `bench decode --help` shows the script's flags (`bench --help` this help)
    s = sub.add_parser("bench", add_help=False,
                       help="run a benchmark script of benchmarks/ (other flags, --help too, go to the script)",
                       description="Run a script of benchmarks/; the flags after NAME (NAME --help too) go\n"
                                   "to it. Results go where the script's --out says (default: a folder under\n"
                                   "the JIT cache dir, never into the checkout).",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="scripts:\n" + "\n".join(f"  {k:<12} benchmarks/{v}" for k, v in BENCH_SCRIPTS.items()))
    s.add_argument("which", nargs="?", choices=list(BENCH_SCRIPTS), metavar="NAME",
                   help="which benchmark: " + ", ".join(BENCH_SCRIPTS))
    s.add_argument("--quick", action="store_true", help="a small grid and fewer samples (passed on as --quick)")
    s.set_defaults(run=cmd_bench, parser=s, takes_extra=True)
