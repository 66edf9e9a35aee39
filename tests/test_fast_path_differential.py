"""The fast path equals the full path (flashkda_ext/fast_path.py; csrc/common/binding.h "Call signatures").

Every invalid call the tests know (a table, plus hypothesis-generated changes of one argument's
shape, dtype, strides, offset, device or flags) is made cold (no fast entry, no validation verdict)
and warm (after a valid call of the same kind armed the fast path): both must raise the same
exception type with the same message, and every tensor the caller passed stays bitwise unchanged.
Valid calls give bitwise the same outputs and written tensors cold and warm, and the warm call does
take the fast path. Runs on the CPU backend in CI; on a GPU machine also over the CUDA routes (each
decode band and state dtype, the fused op, prefill dense / pool / batched).
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashkda_ext
from flashkda_ext import fast_path, ops, validation

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (op, device) -> shape settings. CPU: small dims with K != V (catches transposes). CUDA: one entry
# per decode route band (jit/routes/kda_decode.json: work items x state dtype), K = V = 128.
CPU_DIMS = dict(rows=3, H=2, HV=4, K=8, V=16, slots=6, B=2, T=8, state=torch.float32)
SHAPES = {
    "cpu": [CPU_DIMS, dict(CPU_DIMS, state=torch.bfloat16)],
    "cuda": [dict(rows=r, H=hv, HV=hv, K=128, V=128, slots=r + 3, B=2, T=70, state=sd)
             for r, hv, sd in ((2, 16, torch.float32), (64, 16, torch.float32), (64, 8, torch.float32),
                               (1024, 16, torch.float32), (1, 16, torch.bfloat16), (2, 16, torch.bfloat16),
                               (64, 16, torch.bfloat16), (1024, 16, torch.bfloat16))],
}
INPUT = {"cpu": torch.bfloat16, "cuda": torch.bfloat16}


@pytest.fixture(autouse=True)
def fresh_paths():
    cold()
    yield
    cold()


def cold():
    """Forget every fast entry and memoized verdict: the next call is checked in full."""
    ops.clear_call_caches()


def _rand(gen, dev, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)


def make(op: str, dev: str, d: dict, gen, slot_mode="unique", prefill_mode="dense"):
    """Fresh random valid arguments of one call (never zeros)."""
    r = lambda *s, scale=1.0, dtype=INPUT[dev]: _rand(gen, dev, *s, scale=scale, dtype=dtype)  # noqa: E731
    H, HV, K, V, slots = d["H"], d["HV"], d["K"], d["V"], d["slots"]
    seed = int(torch.randint(1 << 30, (1,), generator=gen, device=dev))
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    if op == "kda_decode":
        rows = d["rows"]
        idx = perm[:rows].to(torch.int32)
        if slot_mode == "repeated":
            idx = idx % max(1, rows // 2 + 1)
        return dict(q=r(rows, H, K), k=r(rows, H, K), v=r(rows, HV, V), g=r(rows, HV, K), beta=r(rows, HV),
                    state=r(slots, HV, V, K, scale=0.5, dtype=d["state"]), state_indices=idx.to(dev),
                    A_log=r(HV, scale=0.3, dtype=torch.float32), dt_bias=r(HV * K, scale=0.5, dtype=torch.float32),
                    slot_mode=slot_mode, out=None)
    if op == "fused_kda_decode":
        rows, D = d["rows"], d["K"]
        Hf = HV
        C = 3 * Hf * D
        return dict(x=r(rows, C), conv_weight=r(C, 4, scale=0.5), conv_state=r(slots, C, 3),
                    g=r(rows, Hf, D), beta=r(rows, Hf), A_log=r(Hf, scale=0.3, dtype=torch.float32),
                    dt_bias=r(Hf * D, scale=0.5, dtype=torch.float32),
                    state_indices=perm[:rows].to(torch.int32).to(dev),
                    state=r(slots, Hf, D, D, scale=0.5, dtype=d["state"]), output_gate=r(rows, Hf, D),
                    norm_weight=r(D, dtype=torch.float32) + 1.0, out=None)
    B, T = d["B"], d["T"]
    a = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=r(HV, scale=0.3, dtype=torch.float32), dt_bias=r(HV, K, scale=0.5, dtype=torch.float32),
             out=None)
    if prefill_mode == "dense":
        a["initial_state"] = r(B, HV, V, K, scale=0.5, dtype=d["state"])
    elif prefill_mode == "pool":
        a["state"] = r(slots, HV, V, K, scale=0.5, dtype=d["state"])
        a["state_indices"] = perm[:B].to(torch.int32).to(dev)
    elif prefill_mode == "packed":
        for n in ("q", "k", "v", "g", "beta"):
            a[n] = a[n].reshape(1, B * T, *a[n].shape[2:])
        a["cu_seqlens"] = torch.tensor([0, 3, 3, B * T], dtype=torch.int32, device=dev)
        a["initial_state"] = r(3, HV, V, K, scale=0.5, dtype=d["state"])
    return a


def invoke(op: str, a: dict):
    if op == "kda_decode":
        kw = {n: a[n] for n in a if n not in ("q", "k", "v", "g", "beta")}
        return flashkda_ext.kda_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)
    if op == "fused_kda_decode":
        pos = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state_indices", "state",
               "output_gate", "norm_weight")
        return flashkda_ext.fused_kda_decode(*(a[n] for n in pos), **{n: a[n] for n in a if n not in pos})
    kw = {n: a[n] for n in a if n not in ("q", "k", "v", "g", "beta")}
    return flashkda_ext.kda_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)


def tensors(a: dict) -> dict:
    return {n: x for n, x in a.items() if isinstance(x, torch.Tensor)}


def snapshot(a: dict) -> dict:
    """The bits of every tensor argument (meta tensors have none: their shape stands in)."""
    return {n: (x.shape if x.is_meta else _bits(x)) for n, x in tensors(a).items()}


def _bits(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = x.detach().resolve_neg().resolve_conj().clone()
    return y.view(torch.uint8) if y.dim() > 0 and y.is_contiguous() and y.dtype.itemsize > 0 else y


def same_bits(x, y) -> bool:
    if isinstance(x, torch.Size) or isinstance(y, torch.Size):
        return x == y
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


def outcome(op: str, a: dict):
    """('raise', type, message) or ('ok', result bits, written bits); asserts that a refused call
    wrote nothing."""
    before = snapshot(a)
    try:
        got = invoke(op, a)
    except Exception as e:  # noqa: BLE001 - the exception itself is what is compared
        after = snapshot(a)
        changed = [n for n in before if not same_bits(before[n], after[n])]
        assert not changed, f"{op}: a refused call ({type(e).__name__}: {e}) changed {changed}"
        return ("raise", type(e), str(e))
    result = got if isinstance(got, tuple) else (got,)
    return ("ok", [None if t is None else _bits(t) for t in result],
            {n: v for n, v in snapshot(a).items()})


def assert_same(op, cold_res, warm_res, what):
    assert cold_res[0] == warm_res[0], f"{op} {what}: cold {cold_res[:3]!r} but warm {warm_res[:3]!r}"
    if cold_res[0] == "raise":
        assert cold_res[1:] == warm_res[1:], f"{op} {what}: cold {cold_res[1:]} but warm {warm_res[1:]}"
        return
    for i, (x, y) in enumerate(zip(cold_res[1], warm_res[1])):
        assert (x is None) == (y is None) and (x is None or same_bits(x, y)), f"{op} {what}: result {i} differs"
    for n in cold_res[2]:
        assert same_bits(cold_res[2][n], warm_res[2][n]), f"{op} {what}: written {n} differs cold / warm"


def clone_args(a: dict) -> dict:
    return {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in a.items()}


def differential(op, dev, d, change, gen, **mode):
    """Cold, then warm, on the same changed arguments (a refused call leaves them as they were;
    a valid one is repeated on a fresh copy of the same inputs)."""
    a = make(op, dev, d, gen, **mode)
    change(a)
    saved = {n: x.detach().clone() for n, x in tensors(a).items() if not x.is_meta}
    cold()
    c = outcome(op, a)
    if c[0] == "ok":  # put back what the accepted call wrote (the same tensors, views and all)
        for n, x in saved.items():
            with torch.inference_mode(a[n].is_inference()), torch.no_grad():
                a[n].copy_(x)
    cold()
    outcome(op, make(op, dev, d, gen, **mode))  # a valid call of the same kind arms the fast path
    assert fast_path.size() > 0 or op == "kda_prefill" and dev == "cpu" and "cu_seqlens" in a
    w = outcome(op, a)
    assert_same(op, c, w, getattr(change, "__name__", "change"))
    return c


# --- the table of known invalid (and edge) calls: name -> (ops, change) -------------------------

def _set(**kv):
    def change(a):
        a.update(kv)
    return change


def _dtype(name, dtype):
    def change(a):
        a[name] = a[name].to(dtype)
    return change


def _noncontig(name):
    def change(a):
        x = a[name]
        a[name] = torch.stack([x, x], dim=-1)[..., 0]  # same shape, strides doubled
    return change


def _offset(name):
    def change(a):
        x = a[name]
        a[name] = torch.cat([x.reshape(-1)[:1], x.reshape(-1)]).narrow(0, 1, x.numel()).view(x.shape)
    return change


def _neg(name):
    def change(a):
        a[name] = torch._neg_view(a[name].neg())  # same values, the negative bit set
    return change


def _meta(name):
    def change(a):
        a[name] = a[name].to("meta")
    return change


def _grad(name):
    def change(a):
        a[name] = a[name].float().to(a[name].dtype).requires_grad_(True)
    return change


def _inference(name):
    def change(a):
        with torch.inference_mode():
            a[name] = a[name].clone()
    return change


def _out_slice(a):  # item 1: a non-contiguous out= (a slice of a larger buffer)
    ref = a["v"]
    big = torch.zeros(*ref.shape[:-1], 2 * ref.shape[-1], dtype=ref.dtype, device=ref.device)
    a["out"] = big[..., : ref.shape[-1]]


def _k_other_batch(a):  # item 2: k [4, T/2, H, K] beside q [2, T, H, K]
    k = a["k"]
    a["k"] = k.reshape(2 * k.shape[0], k.shape[1] // 2, *k.shape[2:])


def _dt_bias_transposed(a):  # item 3: dt_bias [K, HV]: HV*K elements in the wrong shape
    HV = a["A_log"].shape[0]
    a["dt_bias"] = a["dt_bias"].reshape(HV, -1).t().contiguous()


def _dt_bias_strided(a):  # item 3: a non-contiguous dt_bias
    HV = a["A_log"].shape[0]
    a["dt_bias"] = a["dt_bias"].reshape(-1, HV).t()


def _out_over_state(a):  # item 8: out inside the state pool's memory
    want = a["v"].shape if "v" in a and a["v"].dim() == 3 else a["output_gate"].shape
    dt = a["v"].dtype if "v" in a else a["x"].dtype
    flat = a["state"].view(-1).view(torch.uint8)
    n = torch.Size(want).numel() * dt.itemsize
    a["out"] = flat[:n].view(dt).view(want)


def _out_is_input(name):
    def change(a):
        a["out"] = a[name]
    return change


def _state_over_input(a):  # the written pool overlapping an input (q sits inside it)
    q = a["q"]
    flat = a["state"].view(-1).view(torch.uint8)
    a["q"] = flat[: q.numel() * q.dtype.itemsize].view(q.dtype).view(q.shape)


def _max_seqlen_short(a):  # item 9
    a["max_seqlen"] = a["q"].shape[1] - 1
    a["checkpoint_every"] = 1


def _t0(a):  # item 6: T = 0 and no cu_seqlens (valid: B empty sequences)
    for n in ("q", "k", "v", "g", "beta"):
        a[n] = a[n][:, :0].contiguous()


def _pool_no_commit(a):  # item 7: valid: read the pool, commit nothing
    a["output_final_state"] = False


def _initial_state_f16(a):  # item 10: the message names initial_state (pool mode: given at all is wrong)
    B, HV, V, K = a["q"].shape[0], a["v"].shape[2], a["v"].shape[3], a["q"].shape[3]
    a["initial_state"] = torch.ones(B, HV, V, K, dtype=torch.float16, device=a["q"].device) * 0.1


def _idx_int64(a):
    a["state_indices"] = a["state_indices"].long()


def _idx_out_of_range(a):
    a["state_indices"] = a["state_indices"] + 1000


DECODE = ("kda_decode",)
FUSED = ("fused_kda_decode",)
PREFILL = ("kda_prefill",)
DECODES = DECODE + FUSED
ALL = DECODES + PREFILL

TABLE = {
    "q int32": (DECODE + PREFILL, _dtype("q", torch.int32)),
    "x int32": (FUSED, _dtype("x", torch.int32)),
    "k float16": (DECODE + PREFILL, _dtype("k", torch.float16)),
    "beta float32": (PREFILL, _dtype("beta", torch.float32)),
    "g float32": (FUSED + PREFILL, _dtype("g", torch.float32)),
    # kda_decode reads g and beta in q's dtype or fp32 (docs/semantics.md, "Dtypes"): valid there
    "beta float32 (decode)": (DECODE, _dtype("beta", torch.float32)),
    "g float32 (decode)": (DECODE, _dtype("g", torch.float32)),
    "g float16": (DECODE, _dtype("g", torch.float16)),
    "beta float64": (DECODE, _dtype("beta", torch.float64)),
    "A_log bfloat16": (ALL, _dtype("A_log", torch.bfloat16)),
    "dt_bias float64": (ALL, _dtype("dt_bias", torch.float64)),
    "dt_bias [K, HV]": (ALL, _dt_bias_transposed),
    "dt_bias strided": (ALL, _dt_bias_strided),
    "q strided": (DECODE + PREFILL, _noncontig("q")),
    "v strided": (DECODE + PREFILL, _noncontig("v")),
    "x strided": (FUSED, _noncontig("x")),
    "state strided": (DECODES, _noncontig("state")),
    "conv_state strided": (FUSED, _noncontig("conv_state")),
    "q offset": (DECODE + PREFILL, _offset("q")),
    "out slice": (DECODE + PREFILL, _out_slice),
    "k other batch": (PREFILL, _k_other_batch),
    "q meta": (DECODE + PREFILL, _meta("q")),
    "state meta": (DECODES, _meta("state")),
    "x meta": (FUSED, _meta("x")),
    "q neg": (DECODE + PREFILL, _neg("q")),
    "x neg": (FUSED, _neg("x")),
    "state neg": (DECODES, _neg("state")),
    "A_log neg": (ALL, _neg("A_log")),
    "dt_bias neg": (ALL, _neg("dt_bias")),
    "q requires grad": (DECODE + PREFILL, _grad("q")),
    "A_log requires grad": (ALL, _grad("A_log")),
    "state requires grad": (DECODES, _grad("state")),
    "state inference": (DECODES, _inference("state")),
    "out over state": (DECODES, _out_over_state),
    "out is v": (DECODE + PREFILL, _out_is_input("v")),
    "out is output_gate": (FUSED, _out_is_input("output_gate")),
    "state over q": (DECODE, _state_over_input),
    "state_indices int64": (DECODES, _idx_int64),
    "state_indices out of range": (DECODES, _idx_out_of_range),
    "max_seqlen < T": (PREFILL, _max_seqlen_short),
    "checkpoint_every float": (PREFILL, _set(checkpoint_every=4.0)),
    "norm_eps str": (FUSED, _set(norm_eps="1e-5")),
    "scale str": (ALL, _set(scale="0.1")),
    "gate nosuch": (ALL, _set(gate="nosuch")),
    "lower_bound without bounded": (ALL, _set(lower_bound=-1.0)),
    "v None": (DECODE + PREFILL, _set(v=None)),  # out=None: the fast path must not allocate from v first
    "k None": (DECODE + PREFILL, _set(k=None)),
    "output_gate None": (FUSED, _set(output_gate=None)),
    "T = 0": (PREFILL, _t0),
    "initial_state float16": (PREFILL, _initial_state_f16),
}
CASES = [(op, name) for name, (ops_, _) in TABLE.items() for op in ops_]
# edges that must be accepted (and agree cold / warm); CUDA indices are device data, so an index
# past the pool is a padding row there (docs/api.md) while the CPU binding refuses it; only CUDA
# kernels need 16-byte aligned data (an offset view is fine on the CPU)
EXPECT_VALID = {"cpu": {"T = 0", "q offset", "beta float32 (decode)", "g float32 (decode)"},
                "cuda": {"T = 0", "state_indices out of range", "beta float32 (decode)", "g float32 (decode)"}}


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("op,name", CASES, ids=[f"{o}-{n}" for o, n in CASES])
def test_invalid_call_fails_the_same_cold_and_warm(dev, op, name):
    gen = torch.Generator(device=dev).manual_seed(random.SystemRandom().randrange(2**31))
    _, change = TABLE[name]
    for d in SHAPES[dev]:
        for mode in _modes(op):
            res = differential(op, dev, d, change, gen, **mode)
            if name in EXPECT_VALID[dev]:
                assert res[0] == "ok", f"{op} {name} {mode}: expected to be accepted, got {res[1:]}"
            else:
                assert res[0] == "raise", f"{op} {name} {mode}: expected a refusal, the call was accepted"
                assert res[1] in (TypeError, ValueError), f"{op} {name}: {res[1].__name__}: {res[2]}"
                if name.endswith(" None"):  # the full check's message, naming the argument (not torch's own)
                    assert res[2].startswith(name.split()[0] + ":"), f"{op} {name}: {res[2]}"


def _modes(op):
    if op == "kda_decode":
        return [dict(slot_mode="unique"), dict(slot_mode="repeated")]
    if op == "kda_prefill":
        return [dict(prefill_mode="dense"), dict(prefill_mode="pool"), dict(prefill_mode="none")]
    return [{}]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("op", ALL)
def test_valid_calls_are_bitwise_the_same_cold_and_warm_and_take_the_fast_path(dev, op, monkeypatch):
    gen = torch.Generator(device=dev).manual_seed(random.SystemRandom().randrange(2**31))
    for d in SHAPES[dev]:
        for mode in _modes(op) + ([dict(prefill_mode="packed")] if op == "kda_prefill" else []):
            a = make(op, dev, d, gen, **mode)
            b = clone_args(a)
            cold()
            c = outcome(op, a)
            assert c[0] == "ok", c
            cold()
            outcome(op, make(op, dev, d, gen, **mode))  # arms the fast path with other data
            checks = []
            name = {"kda_decode": "check_kda_decode", "fused_kda_decode": "check_fused_kda_decode",
                    "kda_prefill": "check_kda_prefill"}[op]
            real = getattr(validation, name)
            monkeypatch.setattr(validation, name, lambda *x, **k: checks.append(1) or real(*x, **k))
            w = outcome(op, b)
            monkeypatch.setattr(validation, name, real)
            assert_same(op, c, w, f"valid {mode}")
            host_offsets = dev == "cpu" and "cu_seqlens" in a  # checked by value on every call
            assert checks == ([1] if host_offsets else []), f"{op} {mode}: the warm call was checked in full"


def test_pool_prefill_without_final_state_commits_nothing():
    """Item 7: pool mode with output_final_state=False reads the pool and writes nothing back (a
    speculative extend); its output equals the committing call's."""
    dev = "cpu"
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    a = make("kda_prefill", dev, CPU_DIMS, gen, prefill_mode="pool")
    b = clone_args(a)
    pool0 = a["state"].clone()
    out, final = invoke("kda_prefill", dict(a, output_final_state=False))
    assert final is None
    assert torch.equal(a["state"], pool0), "the pool was written although output_final_state=False"
    out_c, final_c = invoke("kda_prefill", b)
    assert final_c is b["state"] and not torch.equal(b["state"], pool0)
    assert torch.equal(out, out_c)


# --- hypothesis: one argument changed in shape, dtype, layout, offset, device or flags ---------

_CHANGES = ("dtype", "shape", "drop_dim", "strided", "offset", "neg", "grad", "inference", "meta")
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)


def _apply(a, name, kind, data):
    x = a[name]
    if kind == "dtype":
        a[name] = x.to(data.draw(st.sampled_from(_DTYPES)))
    elif kind == "shape":
        dim = data.draw(st.integers(0, x.dim() - 1))
        n = max(1, x.shape[dim] + data.draw(st.sampled_from((-1, 1))))
        a[name] = torch.cat([x, x], dim=dim).narrow(dim, 0, n).contiguous() if n > x.shape[dim] \
            else x.narrow(dim, 0, n).contiguous()
    elif kind == "drop_dim":
        a[name] = x.reshape(-1) if x.dim() > 1 else x.reshape(1, -1)
    elif kind == "strided":
        _noncontig(name)(a)
    elif kind == "offset":
        _offset(name)(a)
    elif kind == "neg":
        if x.dtype.is_floating_point:
            _neg(name)(a)
    elif kind == "grad":
        if x.dtype.is_floating_point:
            _grad(name)(a)
    elif kind == "inference":
        _inference(name)(a)
    elif kind == "meta":
        _meta(name)(a)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("op", ALL)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hypothesis_changes_fail_or_pass_the_same_cold_and_warm(dev, op, data):
    d = SHAPES[dev][data.draw(st.integers(0, len(SHAPES[dev]) - 1))]
    mode = data.draw(st.sampled_from(_modes(op)))
    gen = torch.Generator(device=dev).manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    names = sorted(n for n, x in make(op, dev, d, gen, **mode).items() if isinstance(x, torch.Tensor))
    name = data.draw(st.sampled_from(names))
    kind = data.draw(st.sampled_from(_CHANGES))

    def change(a):
        _apply(a, name, kind, data)
    change.__name__ = f"{name} {kind}"
    differential(op, dev, d, change, gen, **mode)
