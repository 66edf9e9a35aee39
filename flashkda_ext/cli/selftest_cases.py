"""The selftest's cases: one call of a public op on seeded inputs, checked against
flashkda_ext.reference (outputs, touched state slots, untouched slots bitwise, padding rows), and the
small CPU case list. The CUDA case choice is in selftest_shapes.py, the driver in selftest.py."""
from __future__ import annotations

import textwrap
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .common import LOWER_BOUND, shorten

LINE_WIDTH = 100   # selftest output fits a 100-column terminal

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

    def lines(self, width: int = LINE_WIDTH) -> List[str]:
        """The outcome as a short block: status, family, device and case; route and module with
        the errors and times (one line when it fits, else two); the detail wrapped to `width`."""
        e = lambda x: "-" if x is None else f"{x:.1e}"  # noqa: E731
        pad = " " * 6
        out = [shorten(f"{self.status:<4}  {self.family} {self.device}  {self.case}", width)]
        route = f"{self.route} -> {self.module}"
        nums = "" if self.out_err is None and self.state_err is None else \
            f"out {e(self.out_err)}  state {e(self.state_err)}  tol {e(self.tol)}"
        times = ("" if self.load_s is None else f"  load {self.load_s * 1e3:.0f} ms") + \
            ("" if self.call_ms is None else f"  call {self.call_ms:.2f} ms")
        if len(pad + route + "   " + nums + times) <= width:
            out.append(pad + route + "   " + nums + times)
        else:
            out += [shorten(pad + route, width), pad + nums + times]
        if self.detail:
            out += textwrap.wrap(self.detail, width, initial_indent=pad, subsequent_indent=pad)
        return out


def max_rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64 (NaN or inf anywhere gives inf), in slices of 2^26 elements so that a
    long case's float64 copies stay a slice's."""
    import torch

    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    g_all, w_all = got.detach().reshape(-1), want.detach().reshape(-1)
    den = num = 0.0
    step = 1 << 26
    for i in range(0, g_all.numel(), step):
        g = g_all[i:i + step].to(torch.float64)
        w = w_all[i:i + step].to(torch.float64).to(g.device)
        if not torch.isfinite(g).all():
            return float("inf")
        den = max(den, w.abs().max().item())
        num = max(num, (g - w).abs().max().item())
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
    gb_dtype: Optional[str] = None    # kda_decode / kda_verify: g and beta in this dtype (None: the input dtype)
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
    tree: bool = False                # kda_verify: a draft tree (parent_tokens) instead of chains
    extra: dict = field(default_factory=dict)




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
    dtype = s.gb_dtype or s.dtype
    if s.gate == "log":
        return rnd.rand(*lead, HV, K, lo=-0.7, hi=-0.01, dtype=dtype), dict(gate="log")
    g = rnd.randn(*lead, HV, K, dtype=dtype)
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


def _row_problems(untouched_equal: bool, s: Spec, idx_host, out) -> List[str]:
    """A decode call's problems beyond its errors: a changed slot it did not address, or a padding
    row (negative index, or 0 with null_slot0) whose output is not zero."""
    problems = [] if untouched_equal else ["an unaddressed slot changed"]
    pad = [r for r, i in enumerate(idx_host.tolist()) if i < 0 or (s.null_slot0 and i == 0)]
    if pad and not bool((out[pad] == 0).all().item()):
        problems.append("padding row not zero")
    return problems


def route_of(family: str, call) -> Tuple[str, str]:
    from .. import dispatch

    rule = dispatch.select_rule(family, call.route_meta())
    return rule["name"], rule["module"]


def _timed_call(device: str, fn: Callable):
    _sync(device)
    t0 = time.perf_counter()
    res = fn()
    _sync(device)
    return res, (time.perf_counter() - t0) * 1e3


# first load of each module in this process (seconds, build excluded): the selftest driver fills it
# before the cases run, so that a case's "load" is the load and never the build before it
FIRST_LOAD_S: Dict[str, float] = {}


def load_seconds(module: str) -> float:
    """Seconds the module's first load in this process took, through the loader the ops use."""
    from ..jit import loader

    if module not in FIRST_LOAD_S:
        t0 = time.perf_counter()
        loader.load_module(module)
        FIRST_LOAD_S[module] = time.perf_counter() - t0
    return FIRST_LOAD_S[module]


def run_decode(s: Spec, seed: int) -> Outcome:
    import torch

    import flashkda_ext as fk
    from .. import validation
    from ..reference import kda_decode_step

    o = Outcome(s.family, s.name, s.device)
    rnd = _Rand(seed, s.device)
    rows, H, HV, K, V = s.rows, s.H, s.HV, s.K, s.V
    q, k = rnd.randn(rows, H, K, dtype=s.dtype), rnd.randn(rows, H, K, dtype=s.dtype)
    v = rnd.randn(rows, HV, V, dtype=s.dtype)
    g, gkw = _gate_args(rnd, s, (rows,), HV, K)
    beta = rnd.randn(rows, HV, dtype=s.gb_dtype or s.dtype)
    state = rnd.randn(s.slots, HV, V, K, dtype=s.state_dtype, scale=0.5)
    idx_host = _slot_indices(rnd, s, rows)
    idx = idx_host.to(s.device)
    kw = dict(state_indices=idx, slot_mode=s.slot_mode, null_slot0=s.null_slot0, **gkw)
    call = validation.check_kda_decode(q, k, v, g, beta, state=state, **kw)
    o.route, o.module = route_of("kda_decode", call)
    o.load_s = load_seconds(o.module)
    out = torch.full((rows, HV, V), float("nan"), dtype=v.dtype, device=s.device)   # poisoned
    pool = state.clone()
    _, o.call_ms = _timed_call(s.device, lambda: fk.kda_decode(q, k, v, g, beta, state=pool, out=out, **kw))
    ref_out, ref_pool = kda_decode_step(q, k, v, g, beta, state=state, state_indices=idx,
                                        null_slot0=s.null_slot0, **gkw)
    touched = _touched_mask(idx_host, s.slots, s.null_slot0)
    o.out_err = max_rel_err(out, ref_out)
    o.state_err = max_rel_err(pool[touched.to(s.device)], ref_pool[touched.to(s.device)])
    o.tol = tolerance(getattr(torch, s.dtype), getattr(torch, s.state_dtype))
    return _finish(o, _row_problems(_untouched_equal(state, pool, touched), s, idx_host, out))


def run_fused(s: Spec, seed: int) -> Outcome:
    import torch

    import flashkda_ext as fk
    from .. import validation
    from ..reference import fused_kda_decode_step

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
    o.route, o.module = route_of("fused_kda_decode", call)
    o.load_s = load_seconds(o.module)
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
    untouched = _untouched_equal(state, pool, touched.cpu()) and _untouched_equal(conv_state, cpool, touched.cpu())
    return _finish(o, _row_problems(untouched, s, idx_host, out))


# A prefill case of at least this many tokens is checked against the chunked form (reference.kda_chunked, float64)
# instead of the token recurrence (a million sequential token steps take minutes): every head at once, one sequence at
# a time, each in windows of LONG_REFERENCE_WINDOW tokens, since the whole call's inputs in float64 would not fit beside
# the call's own (1M tokens x 12 heads: ~50 GB; a window's: ~400 MB a tensor). The chunked form is itself held to the
# recurrence (tests/test_reference_chunked.py). Its chunk (the reference's, not a kernel's) sets the loop's length
# against the pairwise-decay tensor [HV, C, C, K] of a chunk step: in float64 at 12 heads 200 MB at C = 128 (805 MB at
# 256, 50 MB at 64 with a loop four times as long).
LONG_PREFILL_TOKENS = 1 << 18
LONG_REFERENCE_CHUNK = 128
LONG_REFERENCE_WINDOW = 1 << 15     # whole reference chunks: a window starts where one of the call's chunks would


def _windowed_prefill_reference(q, k, v, g, beta, ref_kw):
    """kda_chunked's (out in float32, final state, None) for the whole call, all heads at once: each sequence in
    windows of LONG_REFERENCE_WINDOW tokens, a window starting from the float64 state the one before ended with, so
    the chunks are those of one kda_chunked call over the sequence; no checkpoints (the long cases take none)."""
    import torch

    from ..reference import kda_chunked
    from ..reference.prefill import _segments, final_states, is_padding

    if ref_kw.get("checkpoint_every"):
        raise ValueError("the windowed reference takes no checkpoints")
    B, T, HV, V = v.shape
    K = q.shape[3]
    cu, init, idx = ref_kw.get("cu_seqlens"), ref_kw.get("initial_state"), ref_kw.get("state_indices")
    null_slot0 = bool(ref_kw.get("null_slot0", False))
    gate_kw = {n: x for n, x in ref_kw.items()
               if n not in ("cu_seqlens", "checkpoint_every", "initial_state", "state_indices", "null_slot0")}
    seqs = _segments(B, T, cu)
    slots = None if idx is None else [int(i) for i in idx.tolist()]
    out = torch.zeros(B, T, HV, V, dtype=torch.float32, device=v.device)
    finals = []
    for n, (b, s, e) in enumerate(seqs):
        padding = slots is not None and is_padding(slots[n], null_slot0)
        S = None if init is None or padding else init[slots[n] if slots is not None else n][None].to(torch.float64)
        for w in range(s, e, LONG_REFERENCE_WINDOW):
            x = min(w + LONG_REFERENCE_WINDOW, e)
            o, S, _ = kda_chunked(q[b:b + 1, w:x], k[b:b + 1, w:x], v[b:b + 1, w:x], g[b:b + 1, w:x],
                                  beta[b:b + 1, w:x], chunk_size=LONG_REFERENCE_CHUNK, initial_state=S, **gate_kw)
            out[b, w:x] = o[0].to(torch.float32)
        finals.append(torch.zeros(HV, V, K, dtype=torch.float64, device=v.device) if S is None else S[0])
    return out, final_states(finals, init, slots, null_slot0, (HV, V, K), torch.float64, v.device), None


def run_prefill(s: Spec, seed: int) -> Outcome:
    import torch

    import flashkda_ext as fk
    from .. import validation
    from ..reference import kda_recurrent

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
    o.route, o.module = route_of("kda_prefill", call)
    o.load_s = load_seconds(o.module)
    out = torch.full((B, T, HV, V), float("nan"), dtype=v.dtype, device=s.device)
    res, o.call_ms = _timed_call(s.device, lambda: fk.kda_prefill(q, k, v, g, beta, out=out, **kw))
    if sum(s.lengths) >= LONG_PREFILL_TOKENS:
        ref_out, ref_final, ref_ckpt = _windowed_prefill_reference(q, k, v, g, beta, ref_kw)
    else:
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



def _verify_requests(rnd, s, N, cols, lens):
    """A verify batch's slot table (on the host, then on s.device), accepted counts and offsets: N requests
    of up to `cols` tokens on distinct slots, request 0 storing one token's state nowhere (not its read
    entry)."""
    import torch
    idx = rnd.perm(s.slots)[: N * cols].reshape(N, cols).to(torch.int32)
    nacc = torch.tensor([1 + (n % cols) for n in range(N)], dtype=torch.int32)
    if cols > 1:
        idx[0, cols - 1 if int(nacc[0]) != cols else 0] = -1
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return idx, idx.to(s.device), nacc.to(s.device), cu.to(s.device)

def run_verify(s: Spec, seed: int) -> Outcome:
    """kda_verify: requests of s.lengths draft tokens, state_indices [N, max length] of distinct
    slots with one padding entry, num_accepted_tokens in [1, max length] (s.tree: random parents, a
    draft tree; request 0's padding entry is its last column, which no token can name); against the
    reference verify step (outputs, every named slot, the other slots bitwise unchanged)."""
    import torch

    import flashkda_ext as fk
    from .. import validation
    from ..reference.verify import kda_verify_step

    o = Outcome(s.family, s.name, s.device)
    rnd = _Rand(seed, s.device)
    H, HV, K, V, lens = s.H, s.HV, s.K, s.V, s.lengths
    N, T, cols = len(lens), sum(lens), max(lens)
    q, k = rnd.randn(1, T, H, K, dtype=s.dtype), rnd.randn(1, T, H, K, dtype=s.dtype)
    v = rnd.randn(1, T, HV, V, dtype=s.dtype)
    g, gkw = _gate_args(rnd, s, (1, T), HV, K)
    beta = rnd.randn(1, T, HV, dtype=s.gb_dtype or s.dtype)
    state = rnd.randn(s.slots, HV, V, K, dtype=s.state_dtype, scale=0.5)
    idx_host, idx, nacc, cu = _verify_requests(rnd, s, N, cols, lens)
    kw = dict(state_indices=idx, cu_seqlens=cu, num_accepted_tokens=nacc, max_seqlen=cols, **gkw)
    if s.tree:
        gen = torch.Generator().manual_seed(seed)
        par = torch.zeros(N, cols, dtype=torch.int32)
        for n, L in enumerate(lens):
            for t in range(1, L):
                par[n, t] = int(torch.randint(0, t, (1,), generator=gen))
        kw["parent_tokens"] = par.to(s.device)
    call = validation.check_kda_verify(q, k, v, g, beta, state=state, **kw)
    o.route, o.module = route_of("kda_verify", call)
    o.load_s = load_seconds(o.module)
    out = torch.full((1, T, HV, V), float("nan"), dtype=v.dtype, device=s.device)   # poisoned
    pool = state.clone()
    _, o.call_ms = _timed_call(s.device, lambda: fk.kda_verify(q, k, v, g, beta, state=pool, out=out, **kw))
    ref_kw = {n: x for n, x in kw.items() if n != "max_seqlen"}
    ref_out, ref_pool = kda_verify_step(q, k, v, g, beta, state=state, **ref_kw)
    touched = torch.zeros(s.slots, dtype=torch.bool)
    touched[idx_host[idx_host >= 0].long()] = True
    t = touched.to(s.device)
    o.out_err = max_rel_err(out, ref_out)
    o.state_err = max_rel_err(pool[t], ref_pool[t].to(pool.dtype))
    o.tol = tolerance(getattr(torch, s.dtype), getattr(torch, s.state_dtype))
    problems = [] if torch.equal(pool[~t], state[~t]) else ["a slot no entry names was written"]
    if torch.isnan(out).any():
        problems.append("unwritten output")
    return _finish(o, problems)


def run_fused_verify(s: Spec, seed: int) -> Outcome:
    """fused_kda_verify: run_verify's requests through the fused op (conv + SiLU + step + gated
    RMSNorm per draft token); against the reference (outputs, every named state slot and conv line,
    the others bitwise unchanged)."""
    import torch

    import flashkda_ext as fk
    from .. import validation
    from ..reference.verify import fused_kda_verify_step

    o = Outcome(s.family, s.name, s.device)
    rnd = _Rand(seed, s.device)
    H, D, lens = s.H, s.K, s.lengths
    N, T, cols, C = len(lens), sum(lens), max(lens), 3 * s.H * s.K
    x = rnd.randn(1, T, C, dtype=s.dtype)
    conv_weight = rnd.randn(C, 4, dtype=s.dtype, scale=0.5)
    conv_state = rnd.randn(s.slots, C, cols + 2, dtype=s.dtype)
    g, gkw = _gate_args(rnd, s, (1, T), H, D)
    beta = rnd.randn(1, T, H, dtype=s.dtype)
    state = rnd.randn(s.slots, H, D, D, dtype=s.state_dtype, scale=0.5)
    output_gate = rnd.randn(1, T, H, D, dtype=s.dtype)
    norm_weight = 1 + rnd.randn(D, scale=0.1)
    idx_host, idx, nacc, cu = _verify_requests(rnd, s, N, cols, lens)
    A_log, dt_bias = gkw.pop("A_log", None), gkw.pop("dt_bias", None)
    args = (x, conv_weight, conv_state, g, beta, A_log, dt_bias, state, output_gate, norm_weight)
    kw = dict(state_indices=idx, cu_seqlens=cu, num_accepted_tokens=nacc, **gkw)
    call = validation.check_fused_kda_verify(*args, max_seqlen=cols, **kw)
    o.route, o.module = route_of("fused_kda_verify", call)
    o.load_s = load_seconds(o.module)
    out = torch.full((1, T, H, D), float("nan"), dtype=x.dtype, device=s.device)   # poisoned
    pool, cpool = state.clone(), conv_state.clone()
    _, o.call_ms = _timed_call(s.device, lambda: fk.fused_kda_verify(
        x, conv_weight, cpool, g, beta, A_log, dt_bias, pool, output_gate, norm_weight, out=out, max_seqlen=cols,
        **kw))
    ref_out, ref_conv, ref_pool = fused_kda_verify_step(*args, **kw)
    touched = torch.zeros(s.slots, dtype=torch.bool)
    touched[idx_host[idx_host >= 0].long()] = True
    lines = torch.zeros(s.slots, dtype=torch.bool)
    lines[idx_host[:, 0][idx_host[:, 0] >= 0].long()] = True
    t, tl = touched.to(s.device), lines.to(s.device)
    o.out_err = max_rel_err(out, ref_out)
    o.state_err = max(max_rel_err(pool[t], ref_pool[t].to(pool.dtype)),
                      max_rel_err(cpool[tl], ref_conv[tl].to(cpool.dtype)))
    o.tol = tolerance(getattr(torch, s.dtype), getattr(torch, s.state_dtype))
    problems = []
    if not (torch.equal(pool[~t], state[~t]) and torch.equal(cpool[~tl], conv_state[~tl])):
        problems.append("a slot or conv line no entry names was written")
    if torch.isnan(out).any():
        problems.append("unwritten output")
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


RUNNERS = {"kda_decode": run_decode, "fused_kda_decode": run_fused, "kda_prefill": run_prefill,
           "kda_verify": run_verify, "fused_kda_verify": run_fused_verify}


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
        Spec("kda_decode", "bf16 fp32-g/beta softplus padded", c, dtype="bfloat16", gb_dtype="float32",
             H=2, HV=4, K=16, V=24, rows=5, slots=9, slot_mode="padded"),
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
        Spec("kda_verify", "f32 softplus T_n=3,1,2 accepted", c, H=2, HV=4, K=16, V=24, lengths=(3, 1, 2),
             slots=12),
        Spec("kda_verify", "bf16/bf16-state bounded T_n=4,2", c, dtype="bfloat16", state_dtype="bfloat16",
             gate="bounded", H=2, HV=2, K=8, V=12, lengths=(4, 2), slots=11),
        Spec("kda_verify", "f32 bounded tree T_n=4,3", c, H=2, HV=4, K=16, V=24, gate="bounded", lengths=(4, 3),
             slots=12, tree=True),
        Spec("fused_kda_verify", "f32 softplus T_n=3,1,2 accepted", c, H=2, HV=2, K=16, V=16,
             lengths=(3, 1, 2), slots=12),
        Spec("fused_kda_verify", "bf16/bf16-state log T_n=4,2", c, dtype="bfloat16", state_dtype="bfloat16",
             gate="log", H=3, HV=3, K=8, V=8, lengths=(4, 2), slots=11),
    ]

