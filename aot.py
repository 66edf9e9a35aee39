#!/usr/bin/env python
"""Prebuild the AOT-whitelisted JIT modules into a directory the loader prefers.

    python aot.py --arch 9.0a --out DIR [--jobs N] [--only PATTERN] [--list]

Builds every record with "aot": true whose arches include a named arch (CPU modules always, for
'host'), through the same identity-named build as JIT (the JIT cache is reused), copies each .so into
DIR and writes DIR/manifest.json. Point FLASHKDA_EXT_AOT_DIR at DIR (or ship it as flashkda_ext/_aot)
and the loader uses an artifact whenever its identity matches the current sources and specs.
Exits non-zero, naming every module that failed.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import fnmatch
import json
import os
import shutil
import sys
import time
from pathlib import Path

from flashkda_ext.cli.common import positive_int
from flashkda_ext.jit import all_records, ensure_built
from flashkda_ext.jit.builder import check_build_env, sha256_file
from flashkda_ext.jit.checks import resource_problems
from flashkda_ext.jit.errors import ManifestError
from flashkda_ext.jit.manifest import MANIFEST_FORMAT, check_manifest
from flashkda_ext.jit.toolchain import normalize_arch


def select(records, arches, patterns):
    """[(record, arch)] to build, in spec order."""
    out = []
    for rec in records:
        if not rec["aot"]:
            continue
        if patterns and not any(fnmatch.fnmatchcase(rec["name"], p) for p in patterns):
            continue
        if rec["backend"] == "cpu":
            out.append((rec, "host"))
        else:
            out += [(rec, a) for a in rec["arches"] if a in arches]
    return out


def load_manifest(out_dir: Path) -> dict:
    """The folder's manifest to add to: a fresh one when there is none or it has another format
    (its entries could not verify with this version); ManifestError when it is malformed."""
    path = out_dir / "manifest.json"
    if not path.is_file():
        return {"format": MANIFEST_FORMAT, "modules": []}
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ManifestError(path, "(file)", f"is not valid JSON: {e}") from None
    if isinstance(data, dict) and data.get("format") != MANIFEST_FORMAT:
        print(f"aot: {path} has format {data.get('format')!r}, not {MANIFEST_FORMAT}; its entries "
              f"cannot verify with this version, starting a new manifest", file=sys.stderr)
        return {"format": MANIFEST_FORMAT, "modules": []}
    return check_manifest(path, data)


def build_one(rec, arch, out_dir: Path, root, cache, jobs_per_build):
    res = ensure_built(rec["name"], arch, root=root, cache=cache, jobs=jobs_per_build)
    fname = f"{rec['name']}.{arch}.{res.identity[:16]}.so"
    tmp = out_dir / (fname + ".tmp")
    shutil.copyfile(res.path, tmp)
    os.replace(tmp, out_dir / fname)
    problems = []
    ptxas = res.path.parent / "ptxas.log"
    if rec["backend"] == "cuda" and ptxas.is_file():
        problems = resource_problems(rec, ptxas.read_text())
        shutil.copyfile(ptxas, out_dir / (fname[:-3] + ".ptxas.log"))
    entry = {"name": rec["name"], "arch": arch, "identity": res.identity, "file": fname,
             "sha256": sha256_file(out_dir / fname), "compiler": res.compiler, "files": res.files}
    return entry, res, problems


def _items(ap, option, values):
    """The comma-separated items of a repeatable option; an empty one (`--only ''`, `9.0a,`) is refused,
    not dropped in silence (an empty --only would otherwise mean "everything")."""
    out = []
    for spec in values:
        items = spec.split(",")
        if any(not i.strip() for i in items):
            ap.error(f"{option}: expected comma-separated names, got {spec!r} (an empty item)")
        out += [i.strip() for i in items]
    return out


def _arches(ap, values):
    out = set()
    for a in _items(ap, "--arch", values):
        try:
            out.add(normalize_arch(a))
        except ValueError as e:     # a usage error naming the option, not a traceback
            ap.error(f"--arch: {e}")
    return out


def _check_arches_built(ap, records, arches):
    """A CUDA arch that no AOT CUDA module lists (9.0 for 9.0a) would build the CPU modules only, in silence."""
    known = {a for r in records if r["aot"] and r["backend"] == "cuda" for a in r["arches"]}
    unknown = sorted(a for a in arches if a != "host" and a not in known)
    if known and unknown:
        ap.error(f"--arch: no AOT-whitelisted module builds {', '.join(unknown)} "
                 f"(their arches: {', '.join(sorted(known))})")


def _check_paths(ap, args):
    """--root, --cache and --out, checked before a record is read or anything is built or written."""
    if args.root is not None:
        root = Path(args.root)
        if not ((root / "jit").is_dir() and (root / "csrc").is_dir()):
            ap.error(f"--root: expected a folder holding csrc/ and jit/, got {args.root!r}")
    cache = None if args.cache is None else Path(args.cache)
    if cache is not None and (args.cache == "" or cache.exists() and not cache.is_dir()):
        ap.error(f"--cache: expected a folder (created if missing), got {args.cache!r}")
    if args.list:   # --list builds and writes nothing: an option only a build reads is a mistake
        for option, value in (("--out", args.out), ("--jobs", args.jobs), ("--cache", args.cache)):
            if value is not None:
                ap.error(f"{option}: not used with --list (it builds nothing)")
        return
    if not args.out:
        ap.error("--out DIR is required")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out: expected a directory, got {args.out!r} (a file)")
    base = out.absolute()
    while not base.exists():    # the folder mkdir would create it in
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        ap.error(f"--out: cannot create or write {args.out!r} ({base} is not a writable folder)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", default=[],
                    help="target arch, e.g. 9.0a or sm_90a (repeat or comma-separate); "
                         "'host'/'cpu' alone builds only CPU modules")
    ap.add_argument("--out", help="output directory (created if missing)")
    ap.add_argument("--jobs", type=positive_int, default=None, help="modules built in parallel (default 1)")
    ap.add_argument("--only", action="append", default=[],
                    help="fnmatch pattern of module names (repeat or comma-separate)")
    ap.add_argument("--list", action="store_true", help="list what would be built, build nothing")
    ap.add_argument("--root", help="data root holding csrc/ and jit/ (default: the package's)")
    ap.add_argument("--cache", help="build cache (default: $FLASHKDA_EXT_CACHE_DIR)")
    args = ap.parse_args(argv)

    arches = _arches(ap, args.arch)
    patterns = _items(ap, "--only", args.only)
    _check_paths(ap, args)
    try:
        records = all_records(args.root)
    except ValueError as e:     # FLASHKDA_EXT_DATA_ROOT without jit/, a broken spec file: named, not a traceback
        ap.error(str(e))
    _check_arches_built(ap, records, arches)
    if not arches:
        if not args.list:
            ap.error("--arch is required (e.g. --arch 9.0a, or --arch host for CPU modules only)")
        arches = {a for r in records for a in r["arches"]}
    only_host = arches == {"host"}

    def todo_for(pats):
        return [(r, a) for r, a in select(records, arches, pats) if not (only_host and r["backend"] != "cpu")]

    todo = todo_for(patterns)
    # each pattern must pick something: one that matches nothing is a typo, not "build the rest" in silence
    for p in patterns:
        if not todo_for([p]):
            ap.error(f"--only {p!r} matches no AOT-whitelisted module for --arch {','.join(sorted(arches))} "
                     f"(--list shows them)")

    if args.list:
        for rec, arch in todo:
            print(f"{rec['name']}\t{rec['backend']}\t{arch}\t{rec['family']}")
        return 0
    if not todo:
        print("aot: nothing matches (check --arch / --only and the records' aot flags)",
              file=sys.stderr)
        return 1

    jobs = args.jobs or 1
    # parallel module builds share the cores: give each ninja its slice unless MAX_JOBS says otherwise
    per_build = None if jobs == 1 else max(1, (os.cpu_count() or 1) // jobs)
    # MAX_JOBS, FLASHKDA_EXT_LOCK_TIMEOUT, FLASHKDA_EXT_VERBOSE, refused before --out is made (read only inside
    # each build, every module failed alone after an empty manifest.json was written)
    try:
        check_build_env(per_build)
    except ValueError as e:
        ap.error(str(e))
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:    # checked above; still refused (e.g. /proc, a read-only mount) without a traceback
        ap.error(f"--out: cannot create {args.out!r} ({e.strerror or e})")
    try:
        manifest = load_manifest(out_dir)
    except ManifestError as e:
        print(f"aot: {e}. Fix or delete it (a new one is written when none exists).",
              file=sys.stderr)
        return 2
    failures = []
    done = 0
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {pool.submit(build_one, r, a, out_dir, args.root, args.cache, per_build): (r, a)
                for r, a in todo}
        for fut in cf.as_completed(futs):
            rec, arch = futs[fut]
            done += 1
            tag = f"[{done}/{len(todo)}] {rec['name']} ({arch})"
            try:
                entry, res, problems = fut.result()
            except Exception as e:  # report every failure, keep building the rest
                failures.append((rec["name"], arch, str(e)))
                print(f"{tag} FAILED: {str(e).splitlines()[0]}", flush=True)
                continue
            manifest["modules"] = [m for m in manifest["modules"]
                                   if not (m["name"] == entry["name"] and m["arch"] == arch)]
            manifest["modules"].append(entry)
            state = f"built in {res.seconds:.1f} s" if res.built else "cached"
            print(f"{tag} {state} -> {entry['file']}", flush=True)
            for p in problems:
                failures.append((rec["name"], arch, p))
                print(f"{tag} RESOURCE CHECK FAILED: {p}", flush=True)

    import tvm_ffi
    manifest["tvm_ffi"] = tvm_ffi.__version__
    manifest["modules"].sort(key=lambda m: (m["name"], m["arch"]))
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out_dir / "manifest.json")
    print(f"aot: {len(todo) - len({(n, a) for n, a, _ in failures})}/{len(todo)} modules ok in "
          f"{time.perf_counter() - t0:.1f} s; manifest {out_dir / 'manifest.json'}", flush=True)
    if failures:
        print("aot: FAILED modules:", file=sys.stderr)
        for name, arch, err in failures:
            print(f"  {name} ({arch}):\n    " + "\n    ".join(err.splitlines()[-40:]),
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
