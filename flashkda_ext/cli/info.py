"""`flashkda-ext info`: versions, compilers, GPU, cache and AOT dirs, and the spec summary (modules per
family and backend, routes, what is prebuilt or cached)."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

from .common import families, first_line, table, try_


def _compiler_versions() -> Dict[str, str]:
    from ..jit import toolchain

    out = {}
    for key, finder in (("cxx", toolchain.find_cxx), ("nvcc", toolchain.find_nvcc)):
        try:
            exe = finder()
        except Exception as e:  # noqa: BLE001
            out[key] = f"not found ({first_line(e)[:80]})"
            continue
        ver = try_(lambda: toolchain.tool_version(exe), "")
        line = [ln for ln in str(ver).splitlines() if ln.strip()]
        if key == "nvcc":
            line = [ln for ln in line if "release" in ln] or line
        out[key] = f"{exe}: {line[-1 if key == 'nvcc' else 0].strip() if line else 'unknown version'}"
    return out


def _gpu_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"available": False}
    out = {"available": True, "count": torch.cuda.device_count(), "devices": []}
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["devices"].append({"index": i, "name": p.name, "arch": f"sm_{p.major}{p.minor}",
                               "sm_count": p.multi_processor_count,
                               "memory_gib": round(p.total_memory / 2**30, 1)})
    smi = shutil.which("nvidia-smi")
    if smi:
        r = try_(lambda: subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip(), "")
        if r:
            out["driver"] = r.splitlines()[0]
    return out


def _artifact_state(rec: dict, arch: str) -> Tuple[bool, bool]:
    """(valid AOT artifact found, valid JIT-cache artifact found) for one record and arch."""
    from ..jit import builder, loader
    from ..jit.identity import identity_inputs, identity_of

    aot = False
    try:
        so, _ = loader.find_aot(rec, arch)
        aot = so is not None
    except Exception:  # noqa: BLE001
        pass
    cached = False
    try:
        # a cached dependency scan only: `info` never runs the compiler (no scan yet: not cached)
        ident = identity_of(identity_inputs(rec, arch, scan=False))
        art = Path(builder.roots.cache_dir()) / builder.artifact_name(rec["name"], ident)
        cached = art.is_dir() and builder.read_valid_meta(art, ident) is not None
    except Exception:  # noqa: BLE001  no compiler: cannot know the identity, so not "cached"
        pass
    return aot, cached


def spec_summary(verbose: bool = False) -> dict:
    """Modules per family and backend, routes, AOT and cache state."""
    from .. import jit

    records = jit.all_records()
    fams: Dict[str, dict] = {}
    modules = []
    for rec in records:
        arch = "host" if rec["backend"] == "cpu" else rec["arches"][0]
        aot, cached = _artifact_state(rec, arch)
        key = f"{rec['family']}/{rec['backend']}"
        f = fams.setdefault(key, {"modules": 0, "aot_whitelisted": 0, "aot_prebuilt": 0, "jit_cached": 0})
        f["modules"] += 1
        f["aot_whitelisted"] += int(bool(rec.get("aot")))
        f["aot_prebuilt"] += int(aot)
        f["jit_cached"] += int(cached)
        modules.append({"name": rec["name"], "family": rec["family"], "backend": rec["backend"],
                        "arch": arch, "abi": rec.get("abi"), "aot": bool(rec.get("aot")),
                        "aot_prebuilt": aot, "jit_cached": cached})
    routes = {fam: [{"name": r["name"], "when": r.get("when", {}), "module": r["module"],
                     **({"opt_in": r["opt_in"]} if "opt_in" in r else {})}
                    for r in jit.routes_for(fam)] for fam in families()}
    out = {"families": fams, "routes": routes}
    if verbose:
        out["modules"] = modules
    return out


def collect_info(verbose: bool = False) -> dict:
    import torch

    from .. import __version__, paths
    from ..jit import loader, roots

    info = {
        "flashkda_ext": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "tvm_ffi": try_(lambda: __import__("tvm_ffi").__version__),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "jax": try_(lambda: __import__("jax").__version__, "not installed"),
        "compilers": try_(_compiler_versions),
        "gpu": try_(_gpu_info),
        # the root the JIT machinery reads ($FLASHKDA_EXT_DATA_ROOT wins), not only the package's own
        "data_root": try_(lambda: str(roots.data_root())),
        "cache_dir": str(paths.cache_dir()),
        "aot_dirs": [str(d) for d in loader.aot_dirs()],
        "jit_disabled": try_(loader.jit_disabled),  # a bad value is reported, not a crash
        "trace_dir": os.environ.get("FLASHKDA_EXT_TRACE_DIR"),
        "spec": try_(lambda: spec_summary(verbose)),
    }
    return info


def _jit_note(disabled) -> str:
    if isinstance(disabled, str):  # try_'s "unavailable (ValueError: FLASHKDA_EXT_DISABLE_JIT=...)"
        return f"  (JIT switch {disabled})"
    return "  (JIT disabled)" if disabled else ""


def _print_info(info: dict) -> None:
    gpu = info["gpu"]
    print(f"flashkda_ext {info['flashkda_ext']}   python {info['python']}")
    print(f"platform     {info['platform']}")
    print(f"tvm-ffi      {info['tvm_ffi']}")
    print(f"torch        {info['torch']} (CUDA {info['torch_cuda'] or 'none: CPU build'})")
    print(f"jax          {info['jax']}")
    comp = info["compilers"]
    if isinstance(comp, dict):
        for k, v in comp.items():
            print(f"{k:<12} {v}")
    else:
        print(f"compilers    {comp}")
    if isinstance(gpu, dict) and gpu.get("available"):
        for d in gpu["devices"]:
            print(f"gpu {d['index']:<8} {d['name']} ({d['arch']}, {d['sm_count']} SMs, {d['memory_gib']} GiB)")
        if gpu.get("driver"):
            print(f"driver       {gpu['driver']}")
    else:
        print(f"gpu          none{'' if isinstance(gpu, dict) else ' (' + str(gpu) + ')'}")
    print(f"data root    {info['data_root']}")
    print(f"JIT cache    {info['cache_dir']}{_jit_note(info['jit_disabled'])}")
    print(f"AOT dirs     {', '.join(info['aot_dirs']) or 'none (set FLASHKDA_EXT_AOT_DIR)'}")
    if info["trace_dir"]:
        print(f"trace dir    {info['trace_dir']}")
    spec = info["spec"]
    if not isinstance(spec, dict):
        print(f"spec         {spec}")
        return
    print("\nmodules (family/backend: count, AOT-whitelisted, prebuilt in an AOT dir, in the JIT cache)")
    rows = [[k, v["modules"], v["aot_whitelisted"], v["aot_prebuilt"], v["jit_cached"]]
            for k, v in sorted(spec["families"].items())]
    print(table(rows, ["family/backend", "modules", "aot", "prebuilt", "cached"]))
    print("\nroutes (first match wins)")
    rows = []
    for fam, rules in spec["routes"].items():
        for r in rules:
            when = ", ".join(f"{k}={v}" for k, v in r["when"].items()) or "always"
            if "opt_in" in r:  # considered only when opted in ($FLASHKDA_EXT_OPT_IN)
                when += f" (opt-in: {r['opt_in']})"
            rows.append([fam, r["name"], when, r["module"]])
    print(table(rows, ["family", "rule", "when", "module"]))
    if "modules" in spec:
        print("\nmodule records")
        rows = [[m["name"], m["family"], m["backend"], m["arch"], m["abi"], "yes" if m["aot"] else "no",
                 "yes" if m["aot_prebuilt"] else "no", "yes" if m["jit_cached"] else "no"]
                for m in spec["modules"]]
        print(table(rows, ["name", "family", "backend", "arch", "abi", "aot", "prebuilt", "cached"]))


def cmd_info(args) -> int:
    info = collect_info(args.verbose)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_info(info)
    return 0



def add_parser(sub) -> None:
    s = sub.add_parser("info", help="versions, GPU, cache and AOT dirs, spec summary")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("-v", "--verbose", action="store_true", help="list every module record")
    s.set_defaults(run=cmd_info)
