"""`flashkda-ext selftest`, the main job (README): every route this machine can run, against
flashkda_ext.reference. Without a GPU it runs the CPU backend through TVM-FFI and compile-checks one
CUDA module when nvcc is present; with one it also runs one case per reachable CUDA route and module.
Modules come through the loader the ops use (jit.loader: AOT directories first, a JIT build only when
FLASHKDA_EXT_DISABLE_JIT is unset). It prints one block per case and exits non-zero on a failure."""
from __future__ import annotations

import fnmatch
import json
import os
import random
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

from .common import families, first_line, out_file_problem, shorten
from .selftest_cases import (FIRST_LOAD_S, LINE_WIDTH, RUNNERS, Outcome, Spec, cpu_specs,
                             load_seconds)
from .selftest_shapes import cuda_specs


def pick_compile_module() -> Optional[dict]:
    """The smallest CUDA record (by source bytes), decode family first: the compile check's module."""
    from .. import jit, paths

    recs = [r for r in jit.all_records() if r["backend"] == "cuda"]
    if not recs:
        return None

    def size(r):
        total = 0
        for s in r["sources"]:
            try:
                total += (paths.csrc_dir() / s).stat().st_size
            except OSError:
                pass
        return total

    fam_rank = {"kda_decode": 0, "fused_kda_decode": 1, "kda_prefill": 2}
    return min(recs, key=lambda r: (fam_rank.get(r["family"], 9), size(r), r["name"]))


def compile_check(fresh: bool) -> Outcome:
    import tempfile

    from ..jit import builder, loader, toolchain

    o = Outcome("compile", "CUDA compile check (nvcc)", "nvcc")
    try:
        nvcc = toolchain.find_nvcc()
    except Exception:  # noqa: BLE001
        o.status, o.detail = "SKIP", "skipped: no nvcc"
        return o
    if loader.jit_disabled():
        o.status, o.detail = "SKIP", "skipped: FLASHKDA_EXT_DISABLE_JIT=1 forbids builds"
        return o
    rec = pick_compile_module()
    if rec is None:
        o.status, o.detail = "SKIP", "skipped: no CUDA modules in jit/modules"
        return o
    arch = rec["arches"][0]
    o.route, o.module = arch, rec["name"]
    tmp = tempfile.mkdtemp(prefix="fkda-compile-") if fresh else None
    try:
        res = builder.ensure_built(rec["name"], arch, cache=tmp)
        o.status = "PASS"
        o.detail = (f"built {res.path.name} in {res.seconds:.1f} s with {Path(nvcc).name}" if res.built
                    else "valid artifact already in the JIT cache (identity verified; --fresh-compile rebuilds)")
    except Exception as e:  # noqa: BLE001
        o.status = "FAIL"
        o.detail = first_line(e)
        o.extra_text = str(e)  # type: ignore[attr-defined]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return o



def _jit_builds_needed(names: List[str], failed: Dict[str, str]) -> List[str]:
    """The modules the loader would JIT-build (no valid AOT artifact); with JIT disabled, each of
    them is put in `failed` instead, and nothing is built."""
    from .. import jit
    from ..jit import loader

    need = []
    for n in names:
        try:
            rec = jit.get_record(n)
            so, _ = loader.find_aot(rec, jit.resolve_arch(rec, None))
        except Exception as e:  # noqa: BLE001  reported on the module's cases
            failed[n] = f"{type(e).__name__}: {first_line(e)}"
            continue
        if so is not None:
            continue
        if loader.jit_disabled():
            failed[n] = (f"no valid AOT artifact for {n} and FLASHKDA_EXT_DISABLE_JIT=1 forbids "
                         f"building it (see `flashkda-ext info` for the AOT dirs)")
        else:
            need.append(n)
    return need


def prebuild(names: List[str], workers: Optional[int] = None) -> Dict[str, str]:
    """Get every module ready as the ops would: the ones without a valid AOT artifact are JIT-built
    in parallel threads (each nvcc/g++ a process of its own; none at all when
    FLASHKDA_EXT_DISABLE_JIT=1), then each is loaded once through jit.loader and its load timed
    apart from its build (FIRST_LOAD_S). Returns {name: error} for those that failed (their cases
    then report the error themselves)."""
    import concurrent.futures as cf

    from .. import jit

    names = sorted(set(names))
    failed: Dict[str, str] = {}
    if not names:
        return failed
    t0 = time.perf_counter()
    need = _jit_builds_needed(names, failed)
    if need:
        workers = workers or max(1, min(len(need), os.cpu_count() or 1))
        print(f"JIT: {len(need)} of {len(names)} modules from the cache or built ({workers} in parallel)",
              flush=True)
        with cf.ThreadPoolExecutor(max_workers=workers) as pool:
            futs = {pool.submit(jit.ensure_built, n, None, jobs=1): n for n in need}
            for k, fut in enumerate(cf.as_completed(futs)):
                n = futs[fut]
                try:
                    res = fut.result()
                    state = f"built in {res.seconds:.1f} s" if res.built else "cached"
                except Exception as e:  # noqa: BLE001
                    failed[n] = first_line(e)
                    state = f"FAILED: {failed[n]}"
                print(shorten(f"  [{k + 1}/{len(need)}] {n}: {state}", LINE_WIDTH), flush=True)
    for n in names:
        if n in failed:
            print(shorten(f"  {n}: {failed[n]}", LINE_WIDTH), flush=True)
            continue
        try:
            load_seconds(n)
        except Exception as e:  # noqa: BLE001
            failed[n] = f"{type(e).__name__}: {first_line(e)}"
            print(shorten(f"  {n}: load FAILED: {failed[n]}", LINE_WIDTH), flush=True)
    loaded = [n for n in names if n in FIRST_LOAD_S]
    print(f"modules ready in {time.perf_counter() - t0:.1f} s ({len(loaded)} loaded, "
          f"{sum(FIRST_LOAD_S[n] for n in loaded):.2f} s of it loading)", flush=True)
    return failed


def uncovered_families(cases: List[Spec]) -> List[Outcome]:
    """A FAIL for each family the route files route (jit/routes/<family>.json) that the selftest
    cannot run: no runner, or a CPU module but no CPU case. So a new family is never skipped
    silently."""
    from .. import jit

    try:
        fams = families()
        cpu = {r["family"] for r in jit.all_records() if r["backend"] == "cpu"}
    except Exception as e:  # noqa: BLE001  a broken spec tree is reported by the cases themselves
        return [Outcome("spec", "route files", "-", status="FAIL", detail=f"{type(e).__name__}: {first_line(e)}")]
    out = []
    for fam in fams:
        if fam not in RUNNERS:
            out.append(Outcome(fam, "every case", "-", status="FAIL",
                               detail=f"jit/routes/{fam}.json routes it, but the selftest has no runner "
                                      f"for it (cli/selftest_cases.py RUNNERS)"))
        elif fam in cpu and not any(c.family == fam for c in cases):
            out.append(Outcome(fam, "cpu cases", "cpu", status="FAIL",
                               detail="it has a CPU module but no CPU case (cli/selftest_cases.py cpu_specs)"))
    return out


def _select(specs: List[Spec], outcomes: List[Outcome], pats: List[str]):
    """The cases and pre-failed outcomes that --only's patterns match ('family:case' or family)."""
    specs = [s for s in specs if any(fnmatch.fnmatchcase(f"{s.family}:{s.name}", p)
                                     or fnmatch.fnmatchcase(s.family, p) for p in pats)]
    outcomes = [o for o in outcomes if any(fnmatch.fnmatchcase(o.family, p) for p in pats)]
    return specs, outcomes


# seeds go to torch.Generator.manual_seed as seed + case index: a negative one would alias a large one
# (-1 is 2**64 - 1) and one past 2**64 overflows on every case; this range keeps every case's seed apart
MAX_SEED = 2**63 - 1


def seed_arg(text: str) -> int:
    """argparse type of --seed: a whole number in 0..MAX_SEED."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a whole number in 0..{MAX_SEED}, got {text!r}")
    return value


def _option_problem(args) -> Optional[str]:
    """Options checked before any case runs: --json must be writable at the end of a long run."""
    if args.fresh_compile and args.no_compile_check:
        return "--fresh-compile: there is no compile check to run fresh (--no-compile-check)"
    if args.json is not None:
        problem = out_file_problem("--json", args.json)
        if problem:
            return problem
        # a real write, not os.access (which says yes to root where no file can be made, e.g. in /proc): a new file
        # is created and removed, an existing one opened for append and left as it was
        path = Path(args.json)
        try:
            if path.exists():
                with open(path, "a"):
                    pass
            else:
                with open(path, "x"):
                    pass
                path.unlink()
        except OSError as e:
            return f"--json: cannot write {args.json!r} ({e.strerror or e})"
    return None


def _environment_problem() -> Optional[str]:
    """The settings a run reads, checked before any case runs: FLASHKDA_EXT_DATA_ROOT, FLASHKDA_EXT_DISABLE_JIT, with
    JIT on the builds' FLASHKDA_EXT_LOCK_TIMEOUT and FLASHKDA_EXT_VERBOSE (prebuild runs one job a module: only the
    compile check reads MAX_JOBS, and reports a bad one as its own failure), and FLASHKDA_EXT_OPT_IN. Read later, the
    first two were a traceback, the others failed every case after the builds. The problem (the variable's own error),
    or None."""
    from .. import dispatch
    from ..jit import builder, loader, roots
    from ..jit.errors import SpecError

    try:
        roots.data_root()
        if not loader.jit_disabled():
            builder.check_build_env(1)
        if os.environ.get(dispatch.OPT_IN_ENV, "").strip():
            dispatch.opt_in()
    except SpecError:           # a broken spec file: every row reports it
        return None
    except ValueError as e:
        return str(e)
    return None


def cmd_selftest(args) -> int:
    import torch

    from .. import jit

    problem = _option_problem(args) or _environment_problem()
    if problem:
        print(f"selftest: {problem}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    t_start = time.perf_counter()
    gpu = "GPU " + torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"flashkda_ext selftest: seed {seed} (rerun with --seed {seed})")
    print(shorten(f"torch {torch.__version__}, {gpu}", LINE_WIDTH))
    specs: List[Spec] = []
    try:
        records = jit.all_records()
        why_none = "no CPU module of this family in jit/modules"
    except Exception as e:  # noqa: BLE001  a broken spec file: say so in every row
        records, why_none = [], f"{type(e).__name__}: {first_line(e)[:200]}"
    cpu_families = {r["family"] for r in records if r["backend"] == "cpu"}
    outcomes: List[Outcome] = []
    for s in cpu_specs():
        if s.family in cpu_families:
            specs.append(s)
        else:
            outcomes.append(Outcome(s.family, s.name, "cpu", status="FAIL", detail=why_none))
    outcomes += uncovered_families(cpu_specs())
    unreached: List[str] = []
    if torch.cuda.is_available() and not args.cpu_only:
        free = torch.cuda.mem_get_info()[0]
        cs, unreached = cuda_specs(args.quick, big_pool_bytes=None if args.quick else free // 5,
                                   long_bytes=None if args.quick else free * 4 // 5)
        specs += cs
    if args.only:
        known = sorted({s.family for s in specs} | {o.family for o in outcomes})
        specs, outcomes = _select(specs, outcomes, args.only)
        if not specs and not outcomes:
            print(f"selftest: --only {' '.join(args.only)} matched no case; patterns match "
                  f"'family:case' or a family ({', '.join(known)})", file=sys.stderr)
            return 2
    cpu_modules = [r["name"] for r in records
                   if r["backend"] == "cpu" and any(s.family == r["family"] and s.device == "cpu" for s in specs)]
    prebuild([s.extra["module"] for s in specs if "module" in s.extra] + cpu_modules)
    for i, s in enumerate(specs):
        label = shorten(f"[{i + 1}/{len(specs)}] {s.family} {s.device} {s.name}", LINE_WIDTH - 12)
        print(label + " ...", end="", flush=True)
        try:
            o = RUNNERS[s.family](s, seed + i)
        except Exception as e:  # noqa: BLE001  report and go on with the rest
            o = Outcome(s.family, s.name, s.device, status="FAIL", detail=f"{type(e).__name__}: {first_line(e)}")
            if args.verbose:
                traceback.print_exc()
        outcomes.append(o)
        print(f" {o.status}", flush=True)
    if not torch.cuda.is_available() and not args.no_compile_check:
        print("[compile] CUDA compile check ...", flush=True)  # a build may say more on stderr
        o = compile_check(args.fresh_compile)
        outcomes.append(o)
        print(f"[compile] {o.status}", flush=True)
        if o.status == "FAIL" and args.verbose and hasattr(o, "extra_text"):
            print(o.extra_text)  # type: ignore[attr-defined]
    elif not torch.cuda.is_available():
        outcomes.append(Outcome("compile", "CUDA compile check", "nvcc", status="SKIP",
                                detail="skipped (--no-compile-check)"))
    print()
    for o in outcomes:
        print("\n".join(o.lines()))
    for u in unreached:
        print(shorten(f"note: not reached by the selftest shapes: {u}", LINE_WIDTH))
    failed = [o for o in outcomes if o.status == "FAIL"]
    passed = [o for o in outcomes if o.status == "PASS"]
    ran = [o for o in passed if o.family != "compile"]
    elapsed = time.perf_counter() - t_start
    print(f"\n{len(passed)} passed, {len(failed)} failed, "
          f"{sum(o.status == 'SKIP' for o in outcomes)} skipped in {elapsed:.1f} s")
    print("out/state: max |got - ref| / max |ref| against flashkda_ext.reference in float64;")
    print("load: the module's first load in this process, its build excluded (timed while building)")
    if args.json is not None:
        try:
            Path(args.json).write_text(json.dumps({"seed": seed, "seconds": elapsed, "unreached": unreached,
                                                   "outcomes": [o.__dict__ for o in outcomes]}, indent=2,
                                                  default=str))
        except OSError as e:    # checked first; still refused (a full disk) without a traceback
            print(f"selftest: --json: cannot write {args.json!r} ({e.strerror or e})", file=sys.stderr)
            return 2
    if failed or not ran:
        if not ran:
            print("selftest: no route ran at all", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("selftest", help="every route on this machine against the reference (the main job)")
    s.add_argument("--seed", type=seed_arg, default=None, help=f"random seed, 0..{MAX_SEED} (default: fresh)")
    s.add_argument("--quick", action="store_true", help="fewer CUDA shapes")
    s.add_argument("--only", action="append", default=[], help="glob on 'family:case' or family (repeatable)")
    s.add_argument("--cpu-only", action="store_true", help="skip CUDA routes even with a GPU")
    s.add_argument("--no-compile-check", action="store_true", help="skip the nvcc compile check (no GPU)")
    s.add_argument("--fresh-compile", action="store_true", help="compile check in a temporary cache")
    s.add_argument("--json", default=None, help="also write the results to this file")
    s.add_argument("-v", "--verbose", action="store_true",
                   help="print the traceback of a failing case and the compiler output of a failed check")
    s.set_defaults(run=cmd_selftest)
