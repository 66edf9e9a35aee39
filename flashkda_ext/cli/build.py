"""`flashkda-ext build`: JIT-build modules into the cache by name or glob (or AOT-build them into a
directory through aot.py), or list them."""
from __future__ import annotations

import difflib
import fnmatch
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from .common import first_line, positive_int, table


def _repo_root() -> Optional[Path]:
    from .. import paths

    root = paths.PACKAGE_DIR.parent
    return root if (root / "aot.py").is_file() else None


def _suggestion(pattern: str, names: List[str]) -> str:
    """'; did you mean a, b?' from the closest module names (difflib), or ''."""
    close = difflib.get_close_matches(pattern.strip("*?[]"), names, n=3, cutoff=0.6)
    if close:
        return f"; did you mean {', '.join(close)}?"
    prefixes = sorted({n.split("_")[0] + "_*" for n in names})
    return f" (module names start {', '.join(prefixes)})"


def _option_problem(args) -> Optional[str]:
    """An option the command would ignore or cannot use, named (checked before a record is read)."""
    from ..jit.toolchain import normalize_arch

    if args.aot is not None:
        if not args.aot.strip():            # '' was read as "no --aot": a JIT build into the cache instead
            return f"--aot: expected a directory, got {args.aot!r}"
        if Path(args.aot).exists() and not Path(args.aot).is_dir():
            return f"--aot: expected a directory, got {args.aot!r} (a file)"
    given = [(o, v) for o, v in (("--force", args.force), ("--jobs", args.jobs), ("--parallel", args.parallel),
                                 ("--aot", args.aot), ("--arch", args.arch)) if v not in (None, False)]
    if args.list and given:
        return f"{given[0][0]}: not used with --list (it lists, builds nothing)"
    if args.aot is not None:            # aot.py takes neither: it builds --jobs modules at a time, only what is stale
        for o, v in (("--parallel", args.parallel), ("--force", args.force)):
            if v not in (None, False):
                return f"{o}: not used with --aot (aot.py builds --jobs modules at a time, reusing the JIT cache)"
    if args.arch is not None:
        try:
            normalize_arch(args.arch)
        except ValueError as e:
            return f"--arch: {e}"
    return None


def _arch_problem(arch: str, chosen: List[dict]) -> Optional[str]:
    """--arch that no chosen module builds for (ignored by a CPU module in silence before)."""
    from ..jit.toolchain import normalize_arch

    a = normalize_arch(arch)
    cuda = [r for r in chosen if r["backend"] == "cuda"]
    if a == "host":
        if cuda:
            return f"--arch {arch}: CUDA modules build for a GPU arch, not host (e.g. {cuda[0]['name']})"
        return None
    if not cuda:
        return f"--arch {arch}: the chosen modules are CPU modules (they build for host); --arch is a CUDA arch"
    if not any(a in r["arches"] for r in cuda):
        known = sorted({x for r in cuda for x in r["arches"]})
        return f"--arch {arch}: no chosen CUDA module builds {a} (their arches: {', '.join(known)})"
    return None


def cmd_build(args) -> int:
    from .. import flag_reader, jit
    from ..jit.toolchain import normalize_arch

    problem = _option_problem(args)
    if problem:
        print(f"build: {problem}", file=sys.stderr)
        return 2
    try:
        records = jit.all_records()
    except ValueError as e:     # FLASHKDA_EXT_DATA_ROOT without jit/, a broken spec file: named, not a traceback
        print(f"build: {e}", file=sys.stderr)
        return 2
    pats = list(args.modules)
    if args.all or not pats:
        if not (args.all or args.list or args.backend):
            print("build: name modules (glob patterns), or pass --all or --backend cpu|cuda; "
                  "--list shows them", file=sys.stderr)
            return 2
        pats = ["*"]
    names = [r["name"] for r in records]
    unmatched = [p for p in pats if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        for p in unmatched:
            print(f"build: no module matches {p!r}{_suggestion(p, names)}", file=sys.stderr)
        print("build: `flashkda-ext build --list` shows every module", file=sys.stderr)
        return 2
    chosen = [r for r in records if any(fnmatch.fnmatchcase(r["name"], p) for p in pats)]
    if args.backend:
        chosen = [r for r in chosen if r["backend"] == args.backend]
    if not chosen:
        print(f"build: no {args.backend} module matches {' '.join(pats)} "
              f"(`flashkda-ext build --list --backend {args.backend}` shows them)", file=sys.stderr)
        return 2
    problem = _arch_problem(args.arch, chosen) if args.arch is not None else None
    if problem:
        print(f"build: {problem}", file=sys.stderr)
        return 2
    if args.list:
        print(table([[r["name"], r["family"], r["backend"], ",".join(r["arches"]), "yes" if r["aot"] else "no"]
                      for r in chosen], ["name", "family", "backend", "arches", "aot"]))
        return 0
    if args.aot is not None:
        root = _repo_root()
        if root is None:
            print("build --aot: aot.py ships with the repository checkout; run it from there", file=sys.stderr)
            return 2
        arch = args.arch or ("host" if all(r["backend"] == "cpu" for r in chosen) else "9.0a")
        target = normalize_arch(arch)
        # aot.py builds AOT-whitelisted records of the arch only (and refuses an --only that names
        # another): say which chosen modules that leaves out, and hand it the rest
        fits = [r for r in chosen if r["aot"] and (r["backend"] == "cpu" or target in r["arches"])]
        left = [r["name"] for r in chosen if r not in fits]
        if not fits:
            print(f"build --aot: none of the chosen modules is AOT-whitelisted for {target} "
                  f"(`flashkda-ext build --list` shows the aot column)", file=sys.stderr)
            return 2
        if left:
            print(f"build --aot: {len(left)} chosen module(s) not AOT-whitelisted for {target}, left out: "
                  f"{', '.join(left[:5])}{', ...' if len(left) > 5 else ''}", file=sys.stderr)
        cmd = [sys.executable, str(root / "aot.py"), "--arch", arch, "--out", args.aot,
               "--only", ",".join(r["name"] for r in fits)]
        if args.jobs:
            cmd += ["--jobs", str(args.jobs)]
        print("+ " + " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    import concurrent.futures as cf

    failures = 0
    t0 = time.perf_counter()
    workers = args.parallel or 1

    def one(rec):
        arch = None if rec["backend"] == "cpu" else args.arch
        return jit.ensure_built(rec["name"], arch, jobs=args.jobs, force=args.force)

    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        # the fast path's compiled flag test (flag_reader.py) beside the modules: not a module (a torch
        # extension), and optional (the Python test serves without it), so it never fails the build
        flags = pool.submit(flag_reader.build) if flag_reader.wanted() else None
        futs = {pool.submit(one, rec): rec for rec in chosen}
        if workers == 1:
            print(f"building {len(chosen)} module(s) ...", flush=True)
        else:
            print(f"building {len(chosen)} module(s), {workers} in parallel ...", flush=True)
        for i, fut in enumerate(cf.as_completed(futs)):
            rec = futs[fut]
            tag = f"[{i + 1}/{len(chosen)}] {rec['name']} ({rec['backend']})"
            try:
                res = fut.result()
                state = f"built in {res.seconds:.1f} s" if res.built else "cached"
                print(f"{tag} {state} ({res.arch}) -> {res.path}", flush=True)
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"{tag} FAILED: {first_line(e)}", flush=True)
                if args.verbose:
                    print(str(e))
        if flags is not None:
            try:
                flags.result()
                print(f"fast-path flag test -> {flag_reader.build_dir()}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"fast-path flag test not built ({first_line(e)}): the Python test serves", flush=True)
    print(f"build: {len(chosen) - failures}/{len(chosen)} ok in {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


def add_parser(sub) -> None:
    s = sub.add_parser("build", help="JIT-build (or AOT-build) modules by name or glob")
    s.add_argument("modules", nargs="*", help="module names or glob patterns (none with --backend: all of it)")
    s.add_argument("--all", action="store_true", help="every module record")
    s.add_argument("--backend", choices=["cpu", "cuda"], default=None,
                   help="only this backend's modules; alone, every module of it")
    s.add_argument("--arch", default=None, help="CUDA arch (e.g. 9.0a); default: this GPU's, else the record's first")
    s.add_argument("--force", action="store_true", help="rebuild even when cached")
    s.add_argument("--jobs", type=positive_int, default=None,
                   help="ninja jobs per module (modules in parallel with --aot)")
    s.add_argument("--parallel", type=positive_int, default=None,
                   help="modules built at the same time (default 1)")
    s.add_argument("--aot", default=None, metavar="DIR", help="build into an AOT directory through aot.py")
    s.add_argument("--list", action="store_true", help="list the matching modules, build nothing")
    s.add_argument("-v", "--verbose", action="store_true", help="print a failed build's full compiler output")
    s.set_defaults(run=cmd_build)
