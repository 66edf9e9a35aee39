"""`python -m flashkda_ext` / `flashkda-ext`: info, selftest, build, trace, bench.

    flashkda-ext info [--json] [-v]          versions, GPU, cache and AOT dirs, spec summary
    flashkda-ext selftest [--quick] [--seed N] [--only GLOB] [--no-compile-check] [--json FILE]
                                             every route this machine can run, against the reference
    flashkda-ext build [GLOB ...] [--all] [--backend B] [--arch A] [--force] [--aot DIR] [--list]
    flashkda-ext trace list | trace dump OP [--heads H] [--value-heads HV] [--head-dim D] ...
    flashkda-ext bench decode|prefill|fused|overhead|trace|jax|all [--quick] [script flags ...]

One module per subcommand (info.py, selftest.py with selftest_cases.py and selftest_shapes.py,
build.py, trace.py, bench.py), each with add_parser(sub) and the function it runs; this file only
puts the parser together and dispatches.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from . import bench, build, info, selftest, trace

SUBCOMMANDS = (info, selftest, build, trace, bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashkda-ext",
                                description="KDA kernels for Hopper: info, selftest, build, trace, bench")
    sub = p.add_subparsers(dest="cmd")
    for cmd in SUBCOMMANDS:
        cmd.add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `flashkda-ext trace dump ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


def _main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # bench passes the flags it does not know on to the script; every other command parses strictly
    args, extra = parser.parse_known_args(argv) if argv[:1] == ["bench"] else (parser.parse_args(argv), [])
    if args.cmd is None:
        parser.print_help()
        return 0
    if getattr(args, "takes_extra", False):
        args.extra = extra
    return args.run(args)
