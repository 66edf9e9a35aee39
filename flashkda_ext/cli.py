"""`python -m flashkda_ext` / `flashkda-ext`: info, selftest, build, trace, bench.

    flashkda-ext info [--json] [-v]          versions, GPU, cache and AOT dirs, spec summary
    flashkda-ext selftest [--quick] [--seed N] [--only GLOB] [--no-compile-check] [--json FILE]
                                             every route this machine can run, against the reference
    flashkda-ext build [GLOB ...] [--all] [--arch A] [--force] [--aot DIR] [--list]
    flashkda-ext trace list | trace dump OP [--heads H] [--value-heads HV] [--head-dim D] ...
    flashkda-ext bench decode|prefill|fused|overhead|trace|jax|all [--quick] [script flags ...]

`selftest` is the main job (README): on a machine without a GPU it runs the CPU backend through
TVM-FFI against flashkda_ext.reference and compile-checks one CUDA module when nvcc is present; on a
GPU machine it also runs every CUDA route (the shapes are chosen so that each route rule is selected
at least once). It prints a table and exits non-zero if anything failed.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

FAMILIES = ("kda_decode", "kda_prefill", "fused_kda_decode")


# ---------------------------------------------------------------------------------------------
# small helpers


def _table(rows: List[List[str]], head: List[str]) -> str:
    cells = [head] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    sep = "  "
    lines = [sep.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, sep.join("-" * w for w in widths))
    return "\n".join(lines)


def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def _try(fn: Callable, default=None):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  info must never crash on a broken optional part
        return default if default is not None else f"unavailable ({type(e).__name__}: {_first_line(e)})"


# ---------------------------------------------------------------------------------------------
# info


def _compiler_versions() -> Dict[str, str]:
    from .jit import toolchain

    out = {}
    for key, finder in (("cxx", toolchain.find_cxx), ("nvcc", toolchain.find_nvcc)):
        try:
            exe = finder()
        except Exception as e:  # noqa: BLE001
            out[key] = f"not found ({_first_line(e)[:80]})"
            continue
        ver = _try(lambda: toolchain.tool_version(exe), "")
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
        r = _try(lambda: subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip(), "")
        if r:
            out["driver"] = r.splitlines()[0]
    return out


def _artifact_state(rec: dict, arch: str) -> Tuple[bool, bool]:
    """(valid AOT artifact found, valid JIT-cache artifact found) for one record and arch."""
    from .jit import builder, loader
    from .jit.identity import identity_inputs, identity_of

    aot = False
    try:
        so, _ = loader.find_aot(rec, arch)
        aot = so is not None
    except Exception:  # noqa: BLE001
        pass
    cached = False
    try:
        ident = identity_of(identity_inputs(rec, arch))
        art = Path(builder.roots.cache_dir()) / builder.artifact_name(rec["name"], ident)
        cached = art.is_dir() and builder.read_valid_meta(art, ident) is not None
    except Exception:  # noqa: BLE001  no compiler: cannot know the identity, so not "cached"
        pass
    return aot, cached


def spec_summary(verbose: bool = False) -> dict:
    """Modules per family and backend, routes, AOT and cache state."""
    from . import jit

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
    routes = {}
    for fam in FAMILIES:
        try:
            routes[fam] = [{"name": r["name"], "when": r.get("when", {}), "module": r["module"]}
                           for r in jit.routes_for(fam)]
        except KeyError:
            routes[fam] = None
    out = {"families": fams, "routes": routes}
    if verbose:
        out["modules"] = modules
    return out


def collect_info(verbose: bool = False) -> dict:
    import torch

    from . import __version__, paths
    from .jit import loader

    info = {
        "flashkda_ext": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "tvm_ffi": _try(lambda: __import__("tvm_ffi").__version__),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "jax": _try(lambda: __import__("jax").__version__, "not installed"),
        "compilers": _try(_compiler_versions),
        "gpu": _try(_gpu_info),
        "data_root": _try(lambda: str(paths.data_root())),
        "cache_dir": str(paths.cache_dir()),
        "aot_dirs": [str(d) for d in loader.aot_dirs()],
        "jit_disabled": loader.jit_disabled(),
        "trace_dir": os.environ.get("FLASHKDA_EXT_TRACE_DIR"),
        "spec": _try(lambda: spec_summary(verbose)),
    }
    return info


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
    print(f"JIT cache    {info['cache_dir']}{'  (JIT disabled)' if info['jit_disabled'] else ''}")
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
    print(_table(rows, ["family/backend", "modules", "aot", "prebuilt", "cached"]))
    print("\nroutes (first match wins)")
    rows = []
    for fam, rules in spec["routes"].items():
        if rules is None:
            rows.append([fam, "-", "no routes file", "-"])
            continue
        for r in rules:
            when = ", ".join(f"{k}={v}" for k, v in r["when"].items()) or "always"
            rows.append([fam, r["name"], when, r["module"]])
    print(_table(rows, ["family", "rule", "when", "module"]))
    if "modules" in spec:
        print("\nmodule records")
        rows = [[m["name"], m["family"], m["backend"], m["arch"], m["abi"], "yes" if m["aot"] else "no",
                 "yes" if m["aot_prebuilt"] else "no", "yes" if m["jit_cached"] else "no"]
                for m in spec["modules"]]
        print(_table(rows, ["name", "family", "backend", "arch", "abi", "aot", "prebuilt", "cached"]))


def cmd_info(args) -> int:
    info = collect_info(args.verbose)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_info(info)
    return 0


# ---------------------------------------------------------------------------------------------
# selftest: cases


@dataclass
class Outcome:
    family: str
    case: str
    device: str
    route: str = "-"
    module: str = "-"
    status: str = "FAIL"          # PASS, FAIL, SKIP
    out_err: Optional[float] = None
    state_err: Optional[float] = None
    tol: Optional[float] = None
    load_s: Optional[float] = None
    call_ms: Optional[float] = None
    detail: str = ""

    def row(self) -> List[str]:
        e = lambda x: "-" if x is None else f"{x:.1e}"  # noqa: E731
        return [self.family, self.case, self.device, f"{self.route} -> {self.module}", self.status,
                e(self.out_err), e(self.state_err), e(self.tol),
                "-" if self.load_s is None else f"{self.load_s:.1f}",
                "-" if self.call_ms is None else f"{self.call_ms:.2f}", self.detail]


def max_rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64 (NaN or inf anywhere gives inf)."""
    import torch

    g, w = got.detach().to(torch.float64), want.detach().to(torch.float64).to(got.device)
    if g.shape != w.shape:
        return float("inf")
    if g.numel() == 0:
        return 0.0
    if not torch.isfinite(g).all():
        return float("inf")
    den = w.abs().max().item()
    num = (g - w).abs().max().item()
    return num / den if den > 0 else num


def tolerance(*dtypes) -> float:
    """Max relative error allowed for results computed from / stored in these dtypes."""
    import torch

    t = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
    return max(t.get(d, 3e-2) for d in dtypes)


@dataclass
class Spec:
    """One selftest case: a family, a device and the shapes and options of the call."""
    family: str
    name: str
    device: str
    dtype: str = "float32"            # input dtype
    state_dtype: str = "float32"
    gate: str = "softplus"
    H: int = 2
    HV: int = 2
    K: int = 16
    V: int = 24
    rows: int = 4                     # decode / fused
    slots: int = 8
    slot_mode: str = "unique"
    null_slot0: bool = False
    lengths: Tuple[int, ...] = (5, 7)  # prefill: sequence lengths
    varlen: bool = True
    pool: bool = False
    initial: bool = True
    checkpoint_every: int = 0
    max_seqlen_hint: bool = False
    extra: dict = field(default_factory=dict)


LOWER_BOUND = -5.0


class _Rand:
    """Seeded random tensors drawn on the target device (a multi-GiB pool is cheap on a GPU)."""

    def __init__(self, seed: int, device):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.host_gen = torch.Generator().manual_seed(seed + 1)

    def randn(self, *shape, dtype="float32", scale=1.0):
        t = self.torch
        work = t.float64 if dtype == "float64" else t.float32
        x = t.randn(*shape, generator=self.gen, dtype=work, device=self.device)
        return (x * scale).to(getattr(t, dtype))

    def rand(self, *shape, lo=0.0, hi=1.0, dtype="float32"):
        t = self.torch
        work = t.float64 if dtype == "float64" else t.float32
        x = lo + (hi - lo) * t.rand(*shape, generator=self.gen, dtype=work, device=self.device)
        return x.to(getattr(t, dtype))

    def perm(self, n):
        return self.torch.randperm(n, generator=self.host_gen)


def _gate_args(rnd: _Rand, s: Spec, lead: tuple, HV: int, K: int):
    if s.gate == "log":
        return rnd.rand(*lead, HV, K, lo=-0.7, hi=-0.01, dtype=s.dtype), dict(gate="log")
    g = rnd.randn(*lead, HV, K, dtype=s.dtype)
    A_log = rnd.rand(HV, lo=-1.5, hi=0.4)
    dt_bias = rnd.randn(HV * K, scale=0.5)
    kw = dict(gate=s.gate, A_log=A_log, dt_bias=dt_bias)
    if s.gate == "bounded":
        kw["lower_bound"] = LOWER_BOUND
    return g, kw


def _slot_indices(rnd: _Rand, s: Spec, n: int):
    """n slot indices for the spec's slot mode: unique, padded (a -1 and a 0 when null_slot0) or
    repeated (a slot used twice)."""
    import torch

    idx = rnd.perm(s.slots)[:n].tolist()
    if s.null_slot0 and n >= 2:
        if 0 in idx:
            idx.remove(0)
            idx.append(rnd.perm(s.slots)[0].item() or 1)
        idx[1] = 0
    if s.slot_mode in ("padded", "repeated") and n >= 2:
        idx[0] = -1
    if s.slot_mode == "repeated" and n >= 3:
        idx[-1] = idx[-2]
    return torch.tensor(idx, dtype=torch.int32)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _touched_mask(idx, slots: int, null_slot0: bool):
    import torch

    m = torch.zeros(slots, dtype=torch.bool)
    for i in idx.tolist():
        if i >= 0 and not (null_slot0 and i == 0):
            m[i] = True
    return m


def _untouched_equal(before, after, touched) -> bool:
    """True when every slot outside `touched` is bitwise unchanged (one bool per slot: no pool copy)."""
    changed = (before != after).reshape(before.shape[0], -1).any(dim=1)
    return not bool((changed & ~touched.to(changed.device)).any().item())


def _route(family: str, call) -> Tuple[str, str]:
    from . import dispatch

    rule = dispatch.select_rule(family, call.route_meta())
    return rule["name"], rule["module"]


def _timed_call(device: str, fn: Callable):
    _sync(device)
    t0 = time.perf_counter()
    res = fn()
    _sync(device)
    return res, (time.perf_counter() - t0) * 1e3


def _load(module: str) -> float:
    from . import jit

    t0 = time.perf_counter()
    jit.load_module(module)
    return time.perf_counter() - t0


def run_decode(s: Spec, seed: int) -> Outcome:
    import torch

    import flashkda_ext as fk
    from . import validation
    from .reference import kda_decode_step

    o = Outcome(s.family, s.name, s.device)
    rnd = _Rand(seed, s.device)
    rows, H, HV, K, V = s.rows, s.H, s.HV, s.K, s.V
    q, k = rnd.randn(rows, H, K, dtype=s.dtype), rnd.randn(rows, H, K, dtype=s.dtype)
    v = rnd.randn(rows, HV, V, dtype=s.dtype)
    g, gkw = _gate_args(rnd, s, (rows,), HV, K)
    beta = rnd.randn(rows, HV, dtype=s.dtype)
    state = rnd.randn(s.slots, HV, V, K, dtype=s.state_dtype, scale=0.5)
    idx_host = _slot_indices(rnd, s, rows)
    idx = idx_host.to(s.device)
    kw = dict(state_indices=idx, slot_mode=s.slot_mode, null_slot0=s.null_slot0, **gkw)
    call = validation.check_kda_decode(q, k, v, g, beta, state=state, **kw)
    o.route, o.module = _route("kda_decode", call)
    o.load_s = _load(o.module)
    out = torch.full((rows, HV, V), float("nan"), dtype=v.dtype, device=s.device)   # poisoned
    pool = state.clone()
    _, o.call_ms = _timed_call(s.device, lambda: fk.kda_decode(q, k, v, g, beta, state=pool, out=out, **kw))
    ref_out, ref_pool = kda_decode_step(q, k, v, g, beta, state=state, state_indices=idx,
                                        null_slot0=s.null_slot0, **gkw)
    touched = _touched_mask(idx_host, s.slots, s.null_slot0)
    o.out_err = max_rel_err(out, ref_out)
    o.state_err = max_rel_err(pool[touched.to(s.device)], ref_pool[touched.to(s.device)])
    o.tol = tolerance(getattr(torch, s.dtype), getattr(torch, s.state_dtype))
    problems = []
    if not _untouched_equal(state, pool, touched):
        problems.append("an unaddressed slot changed")
    pad = [r for r, i in enumerate(idx_host.tolist()) if i < 0 or (s.null_slot0 and i == 0)]
    if pad and not bool((out[pad] == 0).all().item()):
        problems.append("padding row not zero")
    return _finish(o, problems)


def run_fused(s: Spec, seed: int) -> Outcome:
    import torch

    import flashkda_ext as fk
    from . import validation
    from .reference import fused_kda_decode_step

    o = Outcome(s.family, s.name, s.device)
    rnd = _Rand(seed, s.device)
    rows, H, D = s.rows, s.H, s.K
    C = 3 * H * D
    x = rnd.randn(rows, C, dtype=s.dtype)
    conv_weight = rnd.randn(C, 4, dtype=s.dtype, scale=0.5)
    conv_state = rnd.randn(s.slots, C, 3, dtype=s.dtype)
    g, gkw = _gate_args(rnd, s, (rows,), H, D)
    beta = rnd.randn(rows, H, dtype=s.dtype)
    state = rnd.randn(s.slots, H, D, D, dtype=s.state_dtype, scale=0.5)
    output_gate = rnd.randn(rows, H, D, dtype=s.dtype)
    norm_weight = 1 + rnd.randn(D, scale=0.1)
    idx_host = _slot_indices(rnd, s, rows)
    idx = idx_host.to(s.device)
    A_log, dt_bias = gkw.pop("A_log", None), gkw.pop("dt_bias", None)
    kw = dict(slot_mode=s.slot_mode, null_slot0=s.null_slot0, **gkw)
    call = validation.check_fused_kda_decode(x, conv_weight, conv_state, g, beta, A_log, dt_bias, idx, state,
                                             output_gate, norm_weight, **kw)
    o.route, o.module = _route("fused_kda_decode", call)
    o.load_s = _load(o.module)
    out = torch.full((rows, H, D), float("nan"), dtype=x.dtype, device=s.device)
    pool, cpool = state.clone(), conv_state.clone()
    _, o.call_ms = _timed_call(s.device, lambda: fk.fused_kda_decode(
        x, conv_weight, cpool, g, beta, A_log, dt_bias, idx, pool, output_gate, norm_weight, out=out, **kw))
    gate_kw = {k: v for k, v in gkw.items()}
    ref_out, ref_conv, ref_pool = fused_kda_decode_step(
        x, conv_weight, conv_state, g, beta, A_log, dt_bias, idx, state, output_gate, norm_weight,
        null_slot0=s.null_slot0, **gate_kw)
    touched = _touched_mask(idx_host, s.slots, s.null_slot0).to(s.device)
    o.out_err = max_rel_err(out, ref_out)
    o.state_err = max(max_rel_err(pool[touched], ref_pool[touched]),
                      max_rel_err(cpool[touched], ref_conv[touched]))
    o.tol = tolerance(getattr(torch, s.dtype), getattr(torch, s.state_dtype))
    problems = []
    if not _untouched_equal(state, pool, touched.cpu()) or not _untouched_equal(conv_state, cpool, touched.cpu()):
        problems.append("an unaddressed slot changed")
    pad = [r for r, i in enumerate(idx_host.tolist()) if i < 0 or (s.null_slot0 and i == 0)]
    if pad and not bool((out[pad] == 0).all().item()):
        problems.append("padding row not zero")
    return _finish(o, problems)


def run_prefill(s: Spec, seed: int) -> Outcome:
    import torch

    import flashkda_ext as fk
    from . import validation
    from .reference import kda_recurrent

    o = Outcome(s.family, s.name, s.device)
    rnd = _Rand(seed, s.device)
    H, HV, K, V = s.H, s.HV, s.K, s.V
    if s.varlen:
        B, T, N = 1, sum(s.lengths), len(s.lengths)
        cu = [0]
        for n in s.lengths:
            cu.append(cu[-1] + n)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=s.device)
        longest = max(s.lengths)
    else:
        B, T, N = len(s.lengths), s.lengths[0], len(s.lengths)
        cu_seqlens, longest = None, s.lengths[0]
    q, k = rnd.randn(B, T, H, K, dtype=s.dtype), rnd.randn(B, T, H, K, dtype=s.dtype)
    v = rnd.randn(B, T, HV, V, dtype=s.dtype)
    g, gkw = _gate_args(rnd, s, (B, T), HV, K)
    beta = rnd.randn(B, T, HV, dtype=s.dtype)
    kw = dict(cu_seqlens=cu_seqlens, checkpoint_every=s.checkpoint_every, **gkw)
    if s.max_seqlen_hint:
        kw["max_seqlen"] = longest
    ref_kw = dict(cu_seqlens=cu_seqlens, checkpoint_every=s.checkpoint_every, **gkw)
    idx_host = None
    if s.pool:
        pool0 = rnd.randn(s.slots, HV, V, K, dtype=s.state_dtype, scale=0.5)
        idx_host = _slot_indices(rnd, Spec(**{**s.__dict__, "slot_mode": "padded"}), N)
        idx = idx_host.to(s.device)
        pool = pool0.clone()
        kw.update(state=pool, state_indices=idx, null_slot0=s.null_slot0)
        ref_kw.update(initial_state=pool0, state_indices=idx, null_slot0=s.null_slot0)
    elif s.initial:
        init = rnd.randn(N, HV, V, K, dtype=s.state_dtype, scale=0.5)
        kw.update(initial_state=init)
        ref_kw.update(initial_state=init)
    call = validation.check_kda_prefill(q, k, v, g, beta, **{k_: v_ for k_, v_ in kw.items()})
    o.route, o.module = _route("kda_prefill", call)
    o.load_s = _load(o.module)
    out = torch.full((B, T, HV, V), float("nan"), dtype=v.dtype, device=s.device)
    res, o.call_ms = _timed_call(s.device, lambda: fk.kda_prefill(q, k, v, g, beta, out=out, **kw))
    ref_out, ref_final, ref_ckpt = kda_recurrent(q, k, v, g, beta, **ref_kw)
    o.out_err = max_rel_err(out, ref_out)
    final = res[1]
    problems = []
    if s.pool:
        touched = _touched_mask(idx_host, s.slots, s.null_slot0).to(s.device)
        o.state_err = max_rel_err(final[touched], ref_final[touched])
        if not _untouched_equal(pool0, final, touched.cpu()):
            problems.append("an unaddressed slot changed")
    else:
        o.state_err = max_rel_err(final, ref_final)
    if s.checkpoint_every:
        got = res[2]
        want = ref_ckpt
        n = min(got.shape[1], want.shape[1])
        mask = torch.isfinite(want[:, :n].to(torch.float64))
        err = max_rel_err(torch.where(mask, got[:, :n].to(torch.float64), 0.0), torch.where(mask, want[:, :n], 0.0))
        o.state_err = max(o.state_err, err)
    o.tol = tolerance(getattr(torch, s.dtype), final.dtype)
    return _finish(o, problems)


def _finish(o: Outcome, problems: List[str]) -> Outcome:
    import math

    errs = [e for e in (o.out_err, o.state_err) if e is not None]
    bad = [e for e in errs if not (math.isfinite(e) and e <= o.tol)]
    if bad:
        problems.append(f"error {max(bad):.2e} > tol {o.tol:.0e}" if all(math.isfinite(b) for b in bad)
                        else "NaN/inf or unwritten output")
    o.status = "FAIL" if problems else "PASS"
    o.detail = "; ".join(problems)
    return o


RUNNERS = {"kda_decode": run_decode, "fused_kda_decode": run_fused, "kda_prefill": run_prefill}


def cpu_specs() -> List[Spec]:
    """Small CPU cases with K != V: every gate, every state dtype, every slot mode, varlen with an
    empty sequence, dense and pool state, checkpoints, grouped value heads."""
    c = "cpu"
    return [
        Spec("kda_decode", "f32 softplus padded HV=2H", c, H=2, HV=4, K=16, V=24, rows=5, slots=9,
             slot_mode="padded"),
        Spec("kda_decode", "bf16/bf16-state bounded repeated", c, dtype="bfloat16", state_dtype="bfloat16",
             gate="bounded", H=3, HV=3, K=8, V=12, rows=6, slots=7, slot_mode="repeated"),
        Spec("kda_decode", "f64 log null-slot0", c, dtype="float64", state_dtype="float64", gate="log",
             H=1, HV=2, K=12, V=8, rows=4, slots=6, slot_mode="padded", null_slot0=True),
        Spec("kda_prefill", "f32 softplus varlen(+empty) dense", c, H=2, HV=4, K=16, V=24,
             lengths=(5, 0, 13, 9)),
        Spec("kda_prefill", "bf16 bounded pool ckpt=4", c, dtype="bfloat16", gate="bounded", H=2, HV=2,
             K=8, V=12, lengths=(6, 9, 3), pool=True, slots=6, checkpoint_every=4),
        Spec("kda_prefill", "f64 log batch=2 no-init", c, dtype="float64", state_dtype="float64", gate="log",
             H=1, HV=1, K=12, V=8, lengths=(7, 7), varlen=False, initial=False),
        Spec("fused_kda_decode", "f32 softplus padded", c, H=2, K=16, V=16, rows=4, slots=6,
             slot_mode="padded"),
        Spec("fused_kda_decode", "bf16/bf16-state bounded repeated", c, dtype="bfloat16",
             state_dtype="bfloat16", gate="bounded", H=3, K=8, V=8, rows=5, slots=6, slot_mode="repeated"),
    ]


# ---------------------------------------------------------------------------------------------
# selftest: CUDA case choice (one case per reachable route/module, chosen on host metadata)

_GATES = ("softplus", "bounded", "log")


def _meta_tensors_decode(rows, H, HV, K, V, slots, dtype, state_dtype, gate):
    import torch

    m = dict(device="meta")
    dt, sdt = getattr(torch, dtype), getattr(torch, state_dtype)
    q = torch.empty(rows, H, K, dtype=dt, **m)
    kw = {}
    if gate != "log":
        kw = dict(A_log=torch.empty(HV, **m), dt_bias=torch.empty(HV * K, **m))
    if gate == "bounded":
        kw["lower_bound"] = LOWER_BOUND
    return (q, torch.empty_like(q), torch.empty(rows, HV, V, dtype=dt, **m), torch.empty(rows, HV, K, dtype=dt, **m),
            torch.empty(rows, HV, dtype=dt, **m), torch.empty(slots, HV, V, K, dtype=sdt, **m),
            torch.empty(rows, dtype=torch.int32, **m), kw)


INT32_MAX = 2**31 - 1


def _big_slots(HV: int, V: int, K: int) -> int:
    """The fewest pool slots whose element offsets pass int32 (routes to the o64 twins)."""
    return INT32_MAX // (HV * V * K) + 2


def _cuda_candidates(family: str, quick: bool, big_pool_bytes: Optional[int] = None) -> List[Spec]:
    """Candidate CUDA specs over the supported set (jit/supported.json), including pools past 2^31
    elements (64-bit offsets) when big_pool_bytes (free memory / 4) allows them."""
    from . import supported

    sup = supported.supported(family, "cuda")
    if sup is None:
        return []
    K = (sup["head_dims_k"] or [128])[0]
    V = (sup["head_dims_v"] or [K])[0]
    heads = sorted(sup["value_heads"] or [1, 2, 4, 8, 16, 32, 64])
    heads = [h for h in heads if h <= (64 if quick else 128)]
    states = sup["state_dtypes"] or ["float32", "bfloat16"]
    dtype = "bfloat16" if "bfloat16" in (sup["input_dtypes"] or ["bfloat16"]) else sup["input_dtypes"][0]
    gates = sup["gates"] or list(_GATES)
    groups = sup["group_sizes"] or [1]
    group = 1 if 1 in groups else groups[0]
    out: List[Spec] = []
    if family in ("kda_decode", "fused_kda_decode"):
        modes = sup["slot_modes"] or ["unique", "padded", "repeated"]
        rows_list = [1, 2, 3, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
        i = 0
        for rows in rows_list:
            for hv in heads:
                if hv % group:
                    continue
                for st in states:
                    for mode in modes:
                        if mode != "unique" and rows < 3:
                            continue  # padding and repeats need a few rows to show up
                        gate = gates[i % len(gates)]
                        i += 1
                        vv = V if family == "kda_decode" else K
                        hh = hv // group if family == "kda_decode" else hv
                        out.append(Spec(family, "", "cuda", dtype=dtype, state_dtype=st, gate=gate,
                                        H=hh, HV=hv, K=K, V=vv, rows=rows, slots=max(rows + 2, 16),
                                        slot_mode=mode))
                        big = _big_slots(hv, vv, K)
                        if rows <= 1024 and big_pool_bytes and big * hv * vv * K * (2 if st == "bfloat16" else 4) \
                                <= big_pool_bytes:
                            out.append(Spec(family, "", "cuda", dtype=dtype, state_dtype=st, gate=gate,
                                            H=hh, HV=hv, K=K, V=vv, rows=rows, slots=big, slot_mode=mode))
    else:
        shapes = [(64,), (4 * [64]), (100, 0, 37), (1000,), (2048,), (16 * [64]), (8 * [1024 + 64]),
                  (4096,), (4 * [4096]), (8192,), (16384,)]
        if quick:
            shapes = shapes[:7]
        i = 0
        for lens in shapes:
            lens = tuple(lens) if isinstance(lens, (list, tuple)) else (lens,)
            for hv in heads:
                if hv % group:
                    continue
                for st in states:
                    for pool in (False, True):
                        for ckpt in (0, 64):
                            for hint in (True, False):
                                gate = gates[i % len(gates)]
                                i += 1
                                out.append(Spec(family, "", "cuda", dtype=dtype, state_dtype=st, gate=gate,
                                                H=hv // group, HV=hv, K=K, V=V, lengths=lens, pool=pool,
                                                slots=len(lens) + 2, checkpoint_every=ckpt,
                                                max_seqlen_hint=hint))
                                big = _big_slots(hv, V, K)
                                if pool and sum(lens) <= 256 and big_pool_bytes and \
                                        big * hv * V * K * (2 if st == "bfloat16" else 4) <= big_pool_bytes:
                                    out.append(Spec(family, "", "cuda", dtype=dtype, state_dtype=st, gate=gate,
                                                    H=hv // group, HV=hv, K=K, V=V, lengths=lens, pool=True,
                                                    slots=big, checkpoint_every=ckpt, max_seqlen_hint=hint))
    return out


def _spec_cost(s: Spec) -> int:
    """Work of the case plus the size of its pool (the reference and the checks touch both)."""
    per = s.HV * s.V * s.K
    if s.family == "kda_prefill":
        return 20 * sum(s.lengths) * per + (s.slots if s.pool else len(s.lengths)) * per
    return 20 * s.rows * per + s.slots * per


def _spec_meta(s: Spec):
    """(rule name, module) that the real call of this spec selects, from meta tensors (no GPU work)."""
    import torch

    from . import validation

    if s.family == "kda_decode":
        q, k, v, g, beta, state, idx, kw = _meta_tensors_decode(s.rows, s.H, s.HV, s.K, s.V, s.slots, s.dtype,
                                                                  s.state_dtype, s.gate)
        call = validation.check_kda_decode(q, k, v, g, beta, state=state, state_indices=idx, backend="cuda",
                                           slot_mode=s.slot_mode, gate=s.gate, **kw)
    elif s.family == "fused_kda_decode":
        m = dict(device="meta")
        dt, sdt = getattr(torch, s.dtype), getattr(torch, s.state_dtype)
        H, D, rows = s.H, s.K, s.rows
        C = 3 * H * D
        kw = {} if s.gate != "bounded" else {"lower_bound": LOWER_BOUND}
        A_log = None if s.gate == "log" else torch.empty(H, **m)
        dt_bias = None if s.gate == "log" else torch.empty(H * D, **m)
        call = validation.check_fused_kda_decode(
            torch.empty(rows, C, dtype=dt, **m), torch.empty(C, 4, dtype=dt, **m),
            torch.empty(s.slots, C, 3, dtype=dt, **m), torch.empty(rows, H, D, dtype=dt, **m),
            torch.empty(rows, H, dtype=dt, **m), A_log, dt_bias, torch.empty(rows, dtype=torch.int32, **m),
            torch.empty(s.slots, H, D, D, dtype=sdt, **m), torch.empty(rows, H, D, dtype=dt, **m),
            torch.empty(D, **m), backend="cuda", gate=s.gate, slot_mode=s.slot_mode, **kw)
    else:
        m = dict(device="meta")
        dt, sdt = getattr(torch, s.dtype), getattr(torch, s.state_dtype)
        T, N = sum(s.lengths), len(s.lengths)
        q = torch.empty(1, T, s.H, s.K, dtype=dt, **m)
        kw = dict(cu_seqlens=torch.empty(N + 1, dtype=torch.int32, **m), checkpoint_every=s.checkpoint_every,
                  backend="cuda", gate=s.gate)
        if s.gate != "log":
            kw.update(A_log=torch.empty(s.HV, **m), dt_bias=torch.empty(s.HV * s.K, **m))
        if s.gate == "bounded":
            kw["lower_bound"] = LOWER_BOUND
        if s.max_seqlen_hint:
            kw["max_seqlen"] = max(s.lengths)
        if s.pool:
            kw.update(state=torch.empty(s.slots, s.HV, s.V, s.K, dtype=sdt, **m),
                      state_indices=torch.empty(N, dtype=torch.int32, **m))
        else:
            kw.update(initial_state=torch.empty(N, s.HV, s.V, s.K, dtype=sdt, **m))
        call = validation.check_kda_prefill(q, torch.empty_like(q), torch.empty(1, T, s.HV, s.V, dtype=dt, **m),
                                            torch.empty(1, T, s.HV, s.K, dtype=dt, **m),
                                            torch.empty(1, T, s.HV, dtype=dt, **m), **kw)
    return _route(s.family, call)


def cuda_specs(quick: bool, big_pool_bytes: Optional[int] = None) -> Tuple[List[Spec], List[str]]:
    """One spec per reachable (rule, module), the cheapest that selects it; and the CUDA rules or
    modules no candidate reached (reported, e.g. o64 twins when memory is short)."""
    from . import jit

    chosen: List[Spec] = []
    unreached: List[str] = []
    for fam in FAMILIES:
        cands = sorted(_cuda_candidates(fam, quick, big_pool_bytes), key=_spec_cost)
        if quick:  # no multi-GiB pools: the 64-bit-offset twins are left to the full run
            cands = [c for c in cands if c.slots * c.HV * c.V * c.K <= INT32_MAX]
        seen: Dict[Tuple[str, str], Spec] = {}
        for s in cands:
            try:
                rule, module = _spec_meta(s)
            except (ValueError, TypeError, LookupError):
                continue
            if (rule, module) not in seen:
                s.name = _spec_label(s)
                s.extra["module"] = module
                seen[(rule, module)] = s
        chosen += list(seen.values())
        try:
            rules = [r for r in jit.routes_for(fam) if r.get("when", {}).get("device", "cuda") in ("cuda", ["cuda"])]
        except KeyError:
            rules = []
        hit_rules = {r for r, _ in seen}
        for r in rules:
            if r["name"] not in hit_rules:
                unreached.append(f"{fam}: rule '{r['name']}' ({r['module']})")
        hit_modules = {m for _, m in seen}
        for rec in jit.all_records():
            if rec["family"] == fam and rec["backend"] == "cuda" and rec["name"] not in hit_modules:
                reachable = any(fnmatch.fnmatchcase(rec["name"], r["module"].replace("{state}", "*")
                                                    .replace("{offset}", "*").replace("{gate}", "*")
                                                    .replace("{slot_mode}", "*")) for r in rules)
                if reachable:
                    unreached.append(f"{fam}: module {rec['name']}")
    return chosen, unreached


def _spec_label(s: Spec) -> str:
    st = {"float32": "f32", "bfloat16": "bf16", "float64": "f64"}.get(s.state_dtype, s.state_dtype)
    if s.family == "kda_prefill":
        lens = s.lengths
        if len(set(lens)) == 1 and len(lens) > 1:
            shape = f"{len(lens)}x{lens[0]}"
        else:
            shape = "+".join(map(str, lens))
        extra = (" pool" if s.pool else "") + (f" ckpt={s.checkpoint_every}" if s.checkpoint_every else "")
        if s.pool and s.slots * s.HV * s.V * s.K > INT32_MAX:
            extra += f" slots={s.slots}"
        return f"T={shape} HV={s.HV} {st} {s.gate}{extra}"
    big = f" slots={s.slots}" if s.slots * s.HV * s.V * s.K > INT32_MAX else ""
    return f"rows={s.rows} HV={s.HV} {st} {s.gate} {s.slot_mode}{big}"


# ---------------------------------------------------------------------------------------------
# selftest: compile check (no GPU)


def pick_compile_module() -> Optional[dict]:
    """The smallest CUDA record (by source bytes), decode family first: the compile check's module."""
    from . import jit, paths

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

    from .jit import builder, toolchain

    o = Outcome("compile", "CUDA compile check (nvcc)", "nvcc")
    try:
        nvcc = toolchain.find_nvcc()
    except Exception:  # noqa: BLE001
        o.status, o.detail = "SKIP", "skipped: no nvcc"
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
        o.load_s = res.seconds
        o.status = "PASS"
        o.detail = (f"built {res.path.name} in {res.seconds:.1f} s with {Path(nvcc).name}" if res.built
                    else "valid artifact already in the JIT cache (identity verified; --fresh-compile rebuilds)")
    except Exception as e:  # noqa: BLE001
        o.status = "FAIL"
        o.detail = _first_line(e)[:200]
        o.extra_text = str(e)  # type: ignore[attr-defined]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return o


# ---------------------------------------------------------------------------------------------
# selftest: driver


def prebuild(names: List[str], workers: Optional[int] = None) -> Dict[str, str]:
    """Build (or find cached) modules in parallel threads, each nvcc/g++ a process of its own;
    returns {name: error} for those that failed (their cases then report the error themselves)."""
    import concurrent.futures as cf

    from . import jit

    names = sorted(set(names))
    if not names:
        return {}
    workers = workers or max(1, min(len(names), os.cpu_count() or 1))
    failed: Dict[str, str] = {}
    t0 = time.perf_counter()
    print(f"building {len(names)} modules ({workers} in parallel; cached ones load at once) ...", flush=True)
    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        futs = {pool.submit(jit.ensure_built, n, None, jobs=1): n for n in names}
        for k, fut in enumerate(cf.as_completed(futs)):
            n = futs[fut]
            try:
                res = fut.result()
                state = f"built in {res.seconds:.1f} s" if res.built else "cached"
            except Exception as e:  # noqa: BLE001
                failed[n] = _first_line(e)
                state = f"FAILED: {failed[n][:120]}"
            print(f"  [{k + 1}/{len(names)}] {n}: {state}", flush=True)
    print(f"modules ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return failed


def cmd_selftest(args) -> int:
    import torch

    from . import jit

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    t_start = time.perf_counter()
    print(f"flashkda_ext selftest: seed {seed} (rerun with --seed {seed}); "
          f"torch {torch.__version__}, {'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
    specs: List[Spec] = []
    try:
        records = jit.all_records()
        why_none = "no CPU module of this family in jit/modules"
    except Exception as e:  # noqa: BLE001  a broken spec file: say so in every row
        records, why_none = [], f"{type(e).__name__}: {_first_line(e)[:200]}"
    cpu_families = {r["family"] for r in records if r["backend"] == "cpu"}
    outcomes: List[Outcome] = []
    for s in cpu_specs():
        if s.family in cpu_families:
            specs.append(s)
        else:
            outcomes.append(Outcome(s.family, s.name, "cpu", status="FAIL", detail=why_none))
    unreached: List[str] = []
    if torch.cuda.is_available() and not args.cpu_only:
        free = torch.cuda.mem_get_info()[0]
        cs, unreached = cuda_specs(args.quick, big_pool_bytes=None if args.quick else free // 5)
        specs += cs
    if args.only:
        pats = args.only
        specs = [s for s in specs if any(fnmatch.fnmatchcase(f"{s.family}:{s.name}", p)
                                         or fnmatch.fnmatchcase(s.family, p) for p in pats)]
        outcomes = [o for o in outcomes if any(fnmatch.fnmatchcase(o.family, p) for p in pats)]
    cpu_modules = [r["name"] for r in records
                   if r["backend"] == "cpu" and any(s.family == r["family"] and s.device == "cpu" for s in specs)]
    prebuild([s.extra["module"] for s in specs if "module" in s.extra] + cpu_modules)
    for i, s in enumerate(specs):
        label = f"[{i + 1}/{len(specs)}] {s.family} {s.device} {s.name}"
        print(label + " ...", end="", flush=True)
        try:
            o = RUNNERS[s.family](s, seed + i)
        except Exception as e:  # noqa: BLE001  report and go on with the rest
            o = Outcome(s.family, s.name, s.device, status="FAIL", detail=f"{type(e).__name__}: {_first_line(e)[:160]}")
            if args.verbose:
                traceback.print_exc()
        outcomes.append(o)
        print(f" {o.status}" + (f" ({o.detail})" if o.detail else ""), flush=True)
    if not torch.cuda.is_available() and not args.no_compile_check:
        print("[compile] CUDA compile check ...", end="", flush=True)
        o = compile_check(args.fresh_compile)
        outcomes.append(o)
        print(f" {o.status} ({o.detail})", flush=True)
        if o.status == "FAIL" and args.verbose and hasattr(o, "extra_text"):
            print(o.extra_text)  # type: ignore[attr-defined]
    elif torch.cuda.is_available():
        pass
    else:
        outcomes.append(Outcome("compile", "CUDA compile check", "nvcc", status="SKIP",
                                detail="skipped (--no-compile-check)"))
    head = ["family", "case", "device", "route -> module", "result", "out err", "state err", "tol",
            "load s", "call ms", "detail"]
    print()
    print(_table([o.row() for o in outcomes], head))
    for u in unreached:
        print(f"note: not reached by the selftest shapes: {u}")
    failed = [o for o in outcomes if o.status == "FAIL"]
    passed = [o for o in outcomes if o.status == "PASS"]
    ran = [o for o in passed if o.family != "compile"]
    elapsed = time.perf_counter() - t_start
    print(f"\n{len(passed)} passed, {len(failed)} failed, "
          f"{sum(o.status == 'SKIP' for o in outcomes)} skipped in {elapsed:.1f} s "
          f"(errors: max |got - ref| / max |ref| against flashkda_ext.reference in float64)")
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "seconds": elapsed, "unreached": unreached,
                                               "outcomes": [o.__dict__ for o in outcomes]}, indent=2,
                                              default=str))
    if failed or not ran:
        if not ran:
            print("selftest: no route ran at all", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# build


def _repo_root() -> Optional[Path]:
    from . import paths

    root = paths.PACKAGE_DIR.parent
    return root if (root / "aot.py").is_file() else None


def cmd_build(args) -> int:
    from . import jit

    records = jit.all_records()
    pats = list(args.modules)
    if args.all or not pats:
        if not args.all and not args.list:
            print("build: name modules (glob patterns), or --all; --list shows them", file=sys.stderr)
            return 2
        pats = ["*"]
    chosen = [r for r in records if any(fnmatch.fnmatchcase(r["name"], p) for p in pats)]
    if args.backend:
        chosen = [r for r in chosen if r["backend"] == args.backend]
    if not chosen:
        print(f"build: no module matches {pats} (known: {', '.join(r['name'] for r in records)})", file=sys.stderr)
        return 2
    if args.list:
        print(_table([[r["name"], r["family"], r["backend"], ",".join(r["arches"]), "yes" if r["aot"] else "no"]
                      for r in chosen], ["name", "family", "backend", "arches", "aot"]))
        return 0
    if args.aot:
        root = _repo_root()
        if root is None:
            print("build --aot: aot.py ships with the repository checkout; run it from there", file=sys.stderr)
            return 2
        arch = args.arch or ("host" if all(r["backend"] == "cpu" for r in chosen) else "9.0a")
        cmd = [sys.executable, str(root / "aot.py"), "--arch", arch, "--out", args.aot,
               "--only", ",".join(r["name"] for r in chosen)]
        if args.jobs:
            cmd += ["--jobs", str(args.jobs)]
        print("+ " + " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    import concurrent.futures as cf

    failures = 0
    t0 = time.perf_counter()
    workers = max(1, args.parallel or 1)

    def one(rec):
        arch = None if rec["backend"] == "cpu" else args.arch
        return jit.ensure_built(rec["name"], arch, jobs=args.jobs, force=args.force)

    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
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
                print(f"{tag} FAILED: {_first_line(e)}", flush=True)
                if args.verbose:
                    print(str(e))
    print(f"build: {len(chosen) - failures}/{len(chosen)} ok in {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# trace


def _trace_args(op: str, a) -> Tuple[dict, str]:
    """Public-op arguments as meta tensors for the given const axes (no memory, no device)."""
    import torch

    m = dict(device="meta")
    dt = getattr(torch, a.input_dtype)
    sdt = getattr(torch, a.state_dtype)
    backend = a.backend
    H = a.heads
    HV = a.value_heads or H
    K = a.head_dim_k or a.head_dim
    V = a.head_dim_v or a.head_dim
    rows, slots = a.rows, a.slots
    gate_kw = {"gate": a.gate}
    if a.gate != "log":
        gate_kw.update(A_log=torch.empty(HV, **m), dt_bias=torch.empty(HV * K, **m))
    if a.gate == "bounded":
        gate_kw["lower_bound"] = a.lower_bound
    if op == "kda_decode":
        args = dict(q=torch.empty(rows, H, K, dtype=dt, **m), k=torch.empty(rows, H, K, dtype=dt, **m),
                    v=torch.empty(rows, HV, V, dtype=dt, **m), g=torch.empty(rows, HV, K, dtype=dt, **m),
                    beta=torch.empty(rows, HV, dtype=dt, **m), state=torch.empty(slots, HV, V, K, dtype=sdt, **m),
                    state_indices=torch.empty(rows, dtype=torch.int32, **m), slot_mode=a.slot_mode, **gate_kw)
    elif op == "fused_kda_decode":
        D = a.head_dim
        C = 3 * H * D
        gate_kw = {"gate": a.gate}
        A_log = None if a.gate == "log" else torch.empty(H, **m)
        dt_bias = None if a.gate == "log" else torch.empty(H * D, **m)
        if a.gate == "bounded":
            gate_kw["lower_bound"] = a.lower_bound
        args = dict(x=torch.empty(rows, C, dtype=dt, **m), conv_weight=torch.empty(C, 4, dtype=dt, **m),
                    conv_state=torch.empty(slots, C, 3, dtype=dt, **m), g=torch.empty(rows, H, D, dtype=dt, **m),
                    beta=torch.empty(rows, H, dtype=dt, **m), A_log=A_log, dt_bias=dt_bias,
                    state_indices=torch.empty(rows, dtype=torch.int32, **m),
                    state=torch.empty(slots, H, D, D, dtype=sdt, **m), output_gate=torch.empty(rows, H, D, dtype=dt, **m),
                    norm_weight=torch.empty(D, **m), slot_mode=a.slot_mode, **gate_kw)
    else:
        T, N = a.tokens, a.seqs
        args = dict(q=torch.empty(1, T, H, K, dtype=dt, **m), k=torch.empty(1, T, H, K, dtype=dt, **m),
                    v=torch.empty(1, T, HV, V, dtype=dt, **m), g=torch.empty(1, T, HV, K, dtype=dt, **m),
                    beta=torch.empty(1, T, HV, dtype=dt, **m), cu_seqlens=torch.empty(N + 1, dtype=torch.int32, **m),
                    initial_state=torch.empty(N, HV, V, K, dtype=sdt, **m), checkpoint_every=a.checkpoint_every,
                    **gate_kw)
    return args, backend


def cmd_trace(args) -> int:
    from . import trace

    if args.trace_cmd == "list":
        rows = []
        for op in trace.OPS:
            try:
                t = trace.load_template(op)
            except Exception as e:  # noqa: BLE001
                rows.append([op, "-", "-", f"template error: {_first_line(e)}"])
                continue
            const = [a for a, s in t["axes"].items() if s["type"] == "const"]
            var = [a for a, s in t["axes"].items() if s["type"] == "var"]
            rows.append([op, t.get("op_type", "-"), ",".join(const), ",".join(var)])
        print(_table(rows, ["op", "op_type", "const axes", "var axes"]))
        print(f"\ntemplates: {trace.paths.trace_templates_dir()}; "
              f"dump one with `flashkda-ext trace dump OP --heads H ...`")
        return 0
    op = args.op
    try:
        definition = trace.definition_for_options(op, vars(args))
    except ValueError as e:
        print(f"flashkda-ext trace dump: {e}", file=sys.stderr)
        return 2
    if args.check:
        trace.validate_definition(definition)
    text = json.dumps(definition, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out} ({definition['name']})")
    else:
        print(text)
    return 0


# ---------------------------------------------------------------------------------------------
# bench

BENCH_SCRIPTS = {"decode": "bench_decode.py", "prefill": "bench_prefill.py", "fused": "bench_fused_decode.py",
                 "overhead": "bench_overhead.py", "trace": "bench_trace_overhead.py",
                 "jax": "bench_jax_overhead.py", "all": "run_all.py"}
# scripts with their own small CLI: --quick is not theirs to take
_NO_QUICK = {"trace", "jax"}


def benchmarks_dir() -> Optional[Path]:
    from . import paths

    d = paths.PACKAGE_DIR.parent / "benchmarks"
    return d if d.is_dir() else None


def cmd_bench(args, extra: List[str]) -> int:
    d = benchmarks_dir()
    if d is None:
        print("bench: benchmarks/ ships with the repository checkout, not the wheel; run from a checkout",
              file=sys.stderr)
        return 2
    script = d / BENCH_SCRIPTS[args.which]
    if not script.is_file():
        print(f"bench: {script} is not there yet", file=sys.stderr)
        return 2
    quick = ["--quick"] if args.quick and args.which not in _NO_QUICK else []
    cmd = [sys.executable, str(script)] + quick + extra
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


# ---------------------------------------------------------------------------------------------
# main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashkda-ext", description="KDA kernels for Hopper: info, selftest, build, trace, bench")
    sub = p.add_subparsers(dest="cmd")

    s = sub.add_parser("info", help="versions, GPU, cache and AOT dirs, spec summary")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("-v", "--verbose", action="store_true", help="list every module record")

    s = sub.add_parser("selftest", help="every route on this machine against the reference (the main job)")
    s.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    s.add_argument("--quick", action="store_true", help="fewer CUDA shapes")
    s.add_argument("--only", action="append", default=[], help="glob on 'family:case' or family (repeatable)")
    s.add_argument("--cpu-only", action="store_true", help="skip CUDA routes even with a GPU")
    s.add_argument("--no-compile-check", action="store_true", help="skip the nvcc compile check (no GPU)")
    s.add_argument("--fresh-compile", action="store_true", help="compile check in a temporary cache")
    s.add_argument("--json", default=None, help="also write the results to this file")
    s.add_argument("-v", "--verbose", action="store_true")

    s = sub.add_parser("build", help="JIT-build (or AOT-build) modules by name or glob")
    s.add_argument("modules", nargs="*", help="module names or glob patterns")
    s.add_argument("--all", action="store_true", help="every module record")
    s.add_argument("--backend", choices=["cpu", "cuda"], default=None)
    s.add_argument("--arch", default=None, help="CUDA arch (e.g. 9.0a); default: this GPU's, else the record's first")
    s.add_argument("--force", action="store_true", help="rebuild even when cached")
    s.add_argument("--jobs", type=int, default=None, help="ninja jobs per module (modules in parallel with --aot)")
    s.add_argument("--parallel", type=int, default=1, help="modules built at the same time (default 1)")
    s.add_argument("--aot", default=None, metavar="DIR", help="build into an AOT directory through aot.py")
    s.add_argument("--list", action="store_true", help="list the matching modules, build nothing")
    s.add_argument("-v", "--verbose", action="store_true")

    s = sub.add_parser("trace", help="list trace templates or dump a definition")
    tsub = s.add_subparsers(dest="trace_cmd")
    tsub.add_parser("list", help="the templates and their axes")
    d = tsub.add_parser("dump", help="the flashinfer-bench Definition for given const axes")
    d.add_argument("op", choices=list(FAMILIES))
    d.add_argument("--heads", type=int, default=16, help="H (q/k heads)")
    d.add_argument("--value-heads", type=int, default=None, help="HV (default H)")
    d.add_argument("--head-dim", type=int, default=128, help="K = V = D")
    d.add_argument("--head-dim-k", type=int, default=None)
    d.add_argument("--head-dim-v", type=int, default=None)
    d.add_argument("--input-dtype", default="bfloat16")
    d.add_argument("--state-dtype", default="float32")
    d.add_argument("--gate", default="softplus", choices=list(_GATES))
    d.add_argument("--lower-bound", type=float, default=LOWER_BOUND)
    d.add_argument("--slot-mode", default="unique", choices=["unique", "padded", "repeated"])
    d.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    d.add_argument("--rows", type=int, default=4, help="a var-axis value (does not change the definition)")
    d.add_argument("--slots", type=int, default=64)
    d.add_argument("--tokens", type=int, default=256, help="prefill: total tokens")
    d.add_argument("--seqs", type=int, default=2, help="prefill: sequences")
    d.add_argument("--checkpoint-every", type=int, default=0)
    d.add_argument("--check", action="store_true", help="validate against the definition schema")
    d.add_argument("--out", default=None, help="write to this file")

    # no -h of its own: `bench decode --help` shows the script's flags
    s = sub.add_parser("bench", add_help=False,
                       help="run a benchmark script of benchmarks/ (other flags, --help too, go to the script)")
    s.add_argument("which", choices=list(BENCH_SCRIPTS))
    s.add_argument("--quick", action="store_true")
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
    if argv and argv[0] == "bench":
        args, extra = parser.parse_known_args(argv)
    else:
        args, extra = parser.parse_args(argv), []
    if args.cmd is None:
        parser.print_help()
        return 0
    if args.cmd == "info":
        return cmd_info(args)
    if args.cmd == "selftest":
        return cmd_selftest(args)
    if args.cmd == "build":
        return cmd_build(args)
    if args.cmd == "trace":
        if not args.trace_cmd:
            parser.parse_args(["trace", "--help"])
        return cmd_trace(args)
    if args.cmd == "bench":
        return cmd_bench(args, extra)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
