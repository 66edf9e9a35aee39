"""The GPU selftest's case choice: candidate CUDA shapes over the supported set
(jit/supported.json), and the cheapest one per reachable (route rule, module), chosen from host
metadata alone (meta tensors, no GPU work), with the rules and modules no candidate reached."""
from __future__ import annotations

import dataclasses
import fnmatch
import itertools
from typing import Dict, List, Optional, Tuple

from .common import GATES, LOWER_BOUND, families
from .selftest_cases import Spec, route_of

def _meta_tensors_decode(rows, H, HV, K, V, slots, dtype, state_dtype, gate, gb_dtype=None):
    import torch

    m = dict(device="meta")
    dt, sdt = getattr(torch, dtype), getattr(torch, state_dtype)
    gbt = getattr(torch, gb_dtype) if gb_dtype else dt
    q = torch.empty(rows, H, K, dtype=dt, **m)
    kw = {}
    if gate != "log":
        kw = dict(A_log=torch.empty(HV, **m), dt_bias=torch.empty(HV * K, **m))
    if gate == "bounded":
        kw["lower_bound"] = LOWER_BOUND
    return (q, torch.empty_like(q), torch.empty(rows, HV, V, dtype=dt, **m), torch.empty(rows, HV, K, dtype=gbt, **m),
            torch.empty(rows, HV, dtype=gbt, **m), torch.empty(slots, HV, V, K, dtype=sdt, **m),
            torch.empty(rows, dtype=torch.int32, **m), kw)


INT32_MAX = 2**31 - 1


def _big_slots(HV: int, V: int, K: int) -> int:
    """The fewest pool slots whose element offsets pass int32 (routes to the o64 twins)."""
    return INT32_MAX // (HV * V * K) + 2


def _add_with_big_twin(out: List[Spec], spec: Spec, big_pool_bytes: Optional[int], allow: bool = True) -> None:
    """spec, and (when allowed and big_pool_bytes holds it) its twin on a pool past 2^31 elements, which
    routes to the 64-bit-offset (o64) modules."""
    out.append(spec)
    big = _big_slots(spec.HV, spec.V, spec.K)
    per = 2 if spec.state_dtype == "bfloat16" else 4
    if allow and big_pool_bytes and big * spec.HV * spec.V * spec.K * per <= big_pool_bytes:
        out.append(dataclasses.replace(spec, slots=big, extra=dict(spec.extra)))


# A prompt of a million tokens (routes whose band starts there); its case's memory a token-head: q, k, v, g and the
# output in bf16, a float32 draw at a time, the reference's float32 output, the chunk-64 kernels' workspace.
LONG_PROMPT = 1 << 20
LONG_BYTES_PER_TOKEN_HEAD = 24 * 128


def _cuda_candidates(family: str, quick: bool, big_pool_bytes: Optional[int] = None,
                     long_bytes: Optional[int] = None) -> List[Spec]:
    """Candidate CUDA specs over the supported set (jit/supported.json), including pools past 2^31
    elements (64-bit offsets) when big_pool_bytes (free memory / 4) allows them, and single prompts of
    LONG_PROMPT tokens at the head counts long_bytes (most of the free memory) holds."""
    from .. import supported

    sup = supported.supported(family, "cuda")
    if sup is None:
        return []
    K = (sup["head_dims_k"] or [128])[0]
    V = (sup["head_dims_v"] or [K])[0]
    heads = sorted(sup["value_heads"] or [1, 2, 4, 8, 16, 32, 64])
    heads = [h for h in heads if h <= (64 if quick else 128)]
    states = sup["state_dtypes"] or ["float32", "bfloat16"]
    dtype = "bfloat16" if "bfloat16" in (sup["input_dtypes"] or ["bfloat16"]) else sup["input_dtypes"][0]
    gates = sup["gates"] or list(GATES)
    groups = sup["group_sizes"] or [1]
    group = 1 if 1 in groups else groups[0]
    heads = [h for h in heads if h % group == 0]
    gate_of = itertools.cycle(gates).__next__   # the gates in turn, one per candidate
    out: List[Spec] = []
    if family in ("kda_decode", "fused_kda_decode"):
        modes = sup["slot_modes"] or ["unique", "padded", "repeated"]
        rows_list = [1, 2, 3, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
        for rows in rows_list:
            for hv in heads:
                for st in states:
                    for mode in modes:
                        if mode != "unique" and rows < 3:
                            continue  # padding and repeats need a few rows to show up
                        # kda_decode: g and beta in q's dtype, and in fp32 (the routes' _gb32 twins)
                        for gb in ((None, "float32") if family == "kda_decode" else (None,)):
                            gate = gate_of()
                            vv = V if family == "kda_decode" else K
                            hh = hv // group if family == "kda_decode" else hv
                            _add_with_big_twin(out, Spec(family, "", "cuda", dtype=dtype, gb_dtype=gb, state_dtype=st,
                                                         gate=gate, H=hh, HV=hv, K=K, V=vv, rows=rows,
                                                         slots=max(rows + 2, 16), slot_mode=mode),
                                               big_pool_bytes, allow=rows <= 1024)
    elif family == "fused_kda_verify":
        # kda_verify's request shapes through the fused op (H == HV, K == V: one head dim D)
        for lens in [(2, 1, 2), (4, 2, 1, 3), (8, 5, 1, 8)]:
            for hv in heads:
                for st in states:
                    _add_with_big_twin(out, Spec(family, "", "cuda", dtype=dtype, state_dtype=st, gate=gate_of(),
                                                 H=hv, HV=hv, K=K, V=K, lengths=lens,
                                                 slots=len(lens) * max(lens) + 4), big_pool_bytes)
    elif family == "kda_verify":
        # requests of mixed draft lengths (T_max 2, 4, 8), one spec per (heads, state, gate) in turn
        shapes = [(2, 1, 2), (4, 2, 1, 3), (8, 5, 1, 8)]
        for lens in shapes:
            for hv in heads:
                for st in states:
                    for gb in (None, "float32"):  # g and beta in q's dtype, and in fp32 (the _gb32 twins)
                        for tree in (False, True):  # chains, and draft trees (parent_tokens: their own rules)
                            _add_with_big_twin(out, Spec(family, "", "cuda", dtype=dtype, gb_dtype=gb, state_dtype=st,
                                                         gate=gate_of(), H=hv // group, HV=hv, K=K, V=V, lengths=lens,
                                                         slots=len(lens) * max(lens) + 4, tree=tree), big_pool_bytes)
    elif family == "kda_prefill":
        # (2400, 15 x 752): one long prompt among 15 shorter ones, token-heads 91 times the longest at 16 heads (below
        # fused_chunk16_wave's 100, so c16g_mixed_many's)
        shapes = [(64,), (4 * [64]), (100, 0, 37), (1000,), (2048,), (16 * [64]), (8 * [1024 + 64]),
                  (4096,), (4 * [4096]), (8192,), (16384,), ([2400] + 15 * [752])]
        if quick:
            shapes = shapes[:7]
        elif long_bytes:
            shapes.append((LONG_PROMPT,))
        for lens in shapes:
            lens = tuple(lens) if isinstance(lens, (list, tuple)) else (lens,)
            for hv in heads:
                if sum(lens) >= LONG_PROMPT and sum(lens) * hv * LONG_BYTES_PER_TOKEN_HEAD > long_bytes:
                    continue
                for st in states:
                    for pool in (False, True):
                        for ckpt in (0, 64):
                            for hint in (True, False):
                                _add_with_big_twin(
                                    out, Spec(family, "", "cuda", dtype=dtype, state_dtype=st, gate=gate_of(),
                                              H=hv // group, HV=hv, K=K, V=V, lengths=lens, pool=pool,
                                              slots=len(lens) + 2, checkpoint_every=ckpt, max_seqlen_hint=hint),
                                    big_pool_bytes, allow=pool and sum(lens) <= 256)
    return out


def _spec_cost(s: Spec) -> int:
    """Work of the case plus the size of its pool (the reference and the checks touch both)."""
    per = s.HV * s.V * s.K
    if s.family == "kda_prefill":
        return 20 * sum(s.lengths) * per + (s.slots if s.pool else len(s.lengths)) * per
    if s.family in ("kda_verify", "fused_kda_verify"):
        return 20 * sum(s.lengths) * per + s.slots * per
    return 20 * s.rows * per + s.slots * per


def _spec_meta(s: Spec):
    """(rule name, module) that the real call of this spec selects, from meta tensors (no GPU work)."""
    import torch

    from .. import validation

    if s.family == "kda_decode":
        q, k, v, g, beta, state, idx, kw = _meta_tensors_decode(s.rows, s.H, s.HV, s.K, s.V, s.slots, s.dtype,
                                                                  s.state_dtype, s.gate, s.gb_dtype)
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
    elif s.family == "kda_verify":
        m = dict(device="meta")
        dt, sdt = getattr(torch, s.dtype), getattr(torch, s.state_dtype)
        gbt = getattr(torch, s.gb_dtype) if s.gb_dtype else dt
        T, N, cols = sum(s.lengths), len(s.lengths), max(s.lengths)
        q = torch.empty(1, T, s.H, s.K, dtype=dt, **m)
        kw = {} if s.gate != "bounded" else {"lower_bound": LOWER_BOUND}
        if s.gate != "log":
            kw.update(A_log=torch.empty(s.HV, **m), dt_bias=torch.empty(s.HV * s.K, **m))
        call = validation.check_kda_verify(
            q, torch.empty_like(q), torch.empty(1, T, s.HV, s.V, dtype=dt, **m),
            torch.empty(1, T, s.HV, s.K, dtype=gbt, **m), torch.empty(1, T, s.HV, dtype=gbt, **m),
            state=torch.empty(s.slots, s.HV, s.V, s.K, dtype=sdt, **m),
            state_indices=torch.empty(N, cols, dtype=torch.int32, **m),
            cu_seqlens=torch.empty(N + 1, dtype=torch.int32, **m),
            num_accepted_tokens=torch.empty(N, dtype=torch.int32, **m), max_seqlen=cols, backend="cuda",
            gate=s.gate, parent_tokens=torch.empty(N, cols, dtype=torch.int32, **m) if s.tree else None, **kw)
    elif s.family == "fused_kda_verify":
        m = dict(device="meta")
        dt, sdt = getattr(torch, s.dtype), getattr(torch, s.state_dtype)
        T, N, cols, H, D = sum(s.lengths), len(s.lengths), max(s.lengths), s.H, s.K
        C = 3 * H * D
        kw = {} if s.gate != "bounded" else {"lower_bound": LOWER_BOUND}
        A_log = None if s.gate == "log" else torch.empty(H, **m)
        dt_bias = None if s.gate == "log" else torch.empty(H * D, **m)
        call = validation.check_fused_kda_verify(
            torch.empty(1, T, C, dtype=dt, **m), torch.empty(C, 4, dtype=dt, **m),
            torch.empty(s.slots, C, cols + 2, dtype=dt, **m), torch.empty(1, T, H, D, dtype=dt, **m),
            torch.empty(1, T, H, dtype=dt, **m), A_log, dt_bias, torch.empty(s.slots, H, D, D, dtype=sdt, **m),
            torch.empty(1, T, H, D, dtype=dt, **m), torch.empty(D, **m),
            state_indices=torch.empty(N, cols, dtype=torch.int32, **m),
            cu_seqlens=torch.empty(N + 1, dtype=torch.int32, **m),
            num_accepted_tokens=torch.empty(N, dtype=torch.int32, **m), max_seqlen=cols, backend="cuda",
            gate=s.gate, **kw)
    elif s.family == "kda_prefill":
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
    else:
        raise LookupError(f"the selftest has no CUDA shapes for family '{s.family}'")
    return route_of(s.family, call)


def _module_pattern(rule: dict) -> str:
    """The names a rule's module template can give: a field the rule's `when` pins to one value (a
    bf16-only rule's {state}) takes that value, any other field is a wildcard."""
    when = rule.get("when", {})
    pattern = rule["module"]
    for field in ("state", "offset", "gate", "slot_mode"):
        value = when.get(field)
        pattern = pattern.replace("{" + field + "}", value if isinstance(value, str) else "*")
    return pattern


def cuda_specs(quick: bool, big_pool_bytes: Optional[int] = None,
               long_bytes: Optional[int] = None) -> Tuple[List[Spec], List[str]]:
    """One spec per reachable (rule, module), the cheapest that selects it; and the CUDA rules or
    modules no candidate reached (reported, e.g. o64 twins or the million-token routes when memory is
    short)."""
    from .. import jit

    chosen: List[Spec] = []
    unreached: List[str] = []
    for fam in families():
        cands = sorted(_cuda_candidates(fam, quick, big_pool_bytes, long_bytes), key=_spec_cost)
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
                reachable = any(fnmatch.fnmatchcase(rec["name"], _module_pattern(r)) for r in rules)
                if reachable:
                    unreached.append(f"{fam}: module {rec['name']}")
    return chosen, unreached


def _spec_label(s: Spec) -> str:
    st = {"float32": "f32", "bfloat16": "bf16", "float64": "f64"}.get(s.state_dtype, s.state_dtype)
    if s.family in ("kda_verify", "fused_kda_verify"):
        big = f" slots={s.slots}" if s.slots * s.HV * s.V * s.K > INT32_MAX else ""
        tree = " tree" if s.tree else ""
        return f"T_n={','.join(map(str, s.lengths))} HV={s.HV} {st} {s.gate}{tree}{big}"
    if s.family == "kda_prefill":
        lens = s.lengths
        if len(set(lens)) == 1 and len(lens) > 1:
            shape = f"{len(lens)}x{lens[0]}"
        else:
            shape = "+".join(map(str, lens))
        extra = (" pool" if s.pool else "") + (f" ckpt={s.checkpoint_every}" if s.checkpoint_every else "")
        if s.pool and s.slots * s.HV * s.V * s.K > INT32_MAX:
            extra += f" slots={s.slots}"
        if s.gb_dtype == "float32":
            extra += " g/beta f32"
        return f"T={shape} HV={s.HV} {st} {s.gate}{extra}"
    big = f" slots={s.slots}" if s.slots * s.HV * s.V * s.K > INT32_MAX else ""
    gb = " g/beta f32" if s.gb_dtype == "float32" else ""
    return f"rows={s.rows} HV={s.HV} {st} {s.gate} {s.slot_mode}{gb}{big}"

