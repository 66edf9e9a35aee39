"""Bad-input campaign 18 (CPU backend): the warm call path's memo (flashkda_ext/fast_path.py, the ops' fast branch).
After a first (cold) call is validated and remembered, a later call with the same memo key takes the warm path; a
call that differs from it only in a property the key and the signature do not capture must be served, or refused,
exactly as the same call cold in a fresh memo. Each case failed before its fix, except those marked "guard"
(behaviour that was already right, pinned beside the fix that depends on it).

- kda_prefill, pool mode with output_final_state=False (a speculative extend: the pool read, nothing committed): the
  full check refuses a pool whose memory overlaps an input (the pool is an output, docs/api.md: "state: overlaps
  the memory of q"), but the module receives such a pool in its initial_state slot, which the binding does not
  write, so the call signature (csrc/common/binding.h, CallTensors) marks no overlap of it with the inputs. A warm
  call whose q, k, v, g, beta, A_log, dt_bias or state_indices lay inside (or across the start of) the pool was
  served where the cold call raised. Now the warm call compares the pool's and the inputs' byte extents (of the
  validated call) with their addresses and takes the full path on any meeting: the same ValueError, nothing
  written.
- guard: the committing pool (output_final_state=True) refuses the same overlaps cold and warm (the signature marks
  them); a valid pool call whose inputs sit in the same storage right after the pool is served warm on the fast
  path (no false alarm), bitwise as cold.
- guard: kda_verify and fused_kda_verify (outside tests/test_fast_path_differential.py's table) refuse an
  overlap, a lazy negated view, an input requiring grad, an inference pool outside inference mode, a strided pool
  and host index values out of range the same way cold and warm, writing nothing.
"""
from __future__ import annotations

import pytest
import torch

import flashkda_ext
from flashkda_ext import fast_path, ops, validation

H, HV, K, V, B, T, SLOTS = 2, 4, 8, 16, 2, 5, 6  # K != V: a transposed state cannot pass
PAD = 4096  # bytes of the shared buffer before the pool


@pytest.fixture(autouse=True)
def fresh():
    ops.clear_call_caches()
    yield
    ops.clear_call_caches()


def _bits(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = x.detach().resolve_neg().clone()
    return y.contiguous().view(-1).view(torch.uint8)


def outcome(run, a: dict):
    """('raise', type, message), asserting that a refused call changed none of a's tensors bit for bit; or
    ('ok', the result's bits, the bits of every tensor argument after the call)."""
    tensors = {n: x for n, x in a.items() if isinstance(x, torch.Tensor)}
    before = {n: _bits(x) for n, x in tensors.items()}
    try:
        got = run(a)
    except Exception as e:  # noqa: BLE001 - the exception itself is what is compared
        changed = [n for n in before if not torch.equal(before[n], _bits(tensors[n]))]
        assert not changed, f"a refused call ({type(e).__name__}: {e}) changed {changed}"
        return ("raise", type(e), str(e))
    got = got if isinstance(got, tuple) else (got,)
    return ("ok", [None if t is None else _bits(t) for t in got], {n: _bits(x) for n, x in tensors.items()})


def same(c, w) -> bool:
    if c[0] != w[0]:
        return False
    if c[0] == "raise":
        return c[1:] == w[1:]
    return (len(c[1]) == len(w[1]) and all((x is None and y is None) or (x is not None and y is not None and
                                                                         torch.equal(x, y)) for x, y in zip(c[1], w[1]))
            and all(torch.equal(c[2][n], w[2][n]) for n in c[2]))


def cold_and_warm(run, build, prime):
    """The call build() makes, cold (fresh memo) and warm (after prime() armed the fast path with other data)."""
    ops.clear_call_caches()
    c = outcome(run, build())
    ops.clear_call_caches()
    assert outcome(run, prime())[0] == "ok"
    assert fast_path.size() == 1, "the priming call did not arm the fast path"
    w = outcome(run, build())
    return c, w


# ---------------------------------------------------------------------------------------------
# kda_prefill on a pool: inputs in the pool's memory

INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_indices")


def _prefill_args(seed: int, output_final_state: bool, place=None, where="inside"):
    """A valid pool-mode call (B rows of T tokens), its pool a view into one shared byte buffer; place names an
    input laid in that buffer too: 'inside' the pool, 'across' its start, or right 'after' its end (valid)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0, dtype=torch.bfloat16: (torch.randn(*s, generator=gen) * scale).to(dtype)  # noqa: E731
    a = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=r(HV, scale=0.3, dtype=torch.float32), dt_bias=r(HV * K, scale=0.5, dtype=torch.float32),
             state_indices=torch.randperm(SLOTS, generator=gen)[:B].to(torch.int32))
    pool = r(SLOTS, HV, V, K, scale=0.5, dtype=torch.float32)
    pool_bytes = pool.numel() * pool.element_size()
    mem = torch.zeros(PAD + pool_bytes + PAD, dtype=torch.uint8)
    state = mem[PAD:PAD + pool_bytes].view(torch.float32).view(pool.shape)
    state.copy_(pool)
    if place is not None:
        x = a[place]
        n = x.numel() * x.element_size()
        at = {"inside": PAD + 256, "across": PAD - (n // 2) // 16 * 16, "after": PAD + pool_bytes}[where]
        y = mem[at:at + n].view(x.dtype).view(x.shape)
        y.copy_(x)  # its own values (valid indices too: the module itself would refuse garbage ones)
        a[place] = y
    a.update(state=state, output_final_state=output_final_state, out=None, _mem=mem)
    return a


def _run_prefill(a):
    kw = {n: x for n, x in a.items() if n not in ("q", "k", "v", "g", "beta", "_mem")}
    return flashkda_ext.kda_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)


@pytest.mark.parametrize("where", ["inside", "across"])
@pytest.mark.parametrize("name", INPUTS)
def test_prefill_read_only_pool_over_an_input_is_refused_warm_as_cold(name, where):
    c, w = cold_and_warm(_run_prefill, lambda: _prefill_args(7, False, name, where),
                         lambda: _prefill_args(3, False))
    assert c[0] == "raise" and c[1] is ValueError, c[:3]
    assert c[2].startswith(f"state: overlaps the memory of {name};"), c[2]
    assert same(c, w), f"cold {c[:3]} but warm {w[:3]}"


@pytest.mark.parametrize("where", ["inside", "across"])
@pytest.mark.parametrize("name", INPUTS)
def test_prefill_committed_pool_over_an_input_is_refused_warm_as_cold_guard(name, where):
    """guard: with output_final_state=True the pool is the module's final_state (written): the signature marks it."""
    c, w = cold_and_warm(_run_prefill, lambda: _prefill_args(7, True, name, where),
                         lambda: _prefill_args(3, True))
    assert c[0] == "raise" and c[2].startswith(f"state: overlaps the memory of {name};"), c[:3]
    assert same(c, w), f"cold {c[:3]} but warm {w[:3]}"


@pytest.mark.parametrize("output_final_state", [False, True])
@pytest.mark.parametrize("name", ["q", "beta", "state_indices"])
def test_prefill_pool_with_an_input_right_after_it_is_served_on_the_fast_path_guard(name, output_final_state,
                                                                                    monkeypatch):
    """guard: an input in the pool's storage but past its last byte shares no memory with it: served cold, and warm
    on the fast path (the warm address test raises no false alarm), bitwise the same; the read-only pool unchanged."""
    ops.clear_call_caches()
    a = _prefill_args(7, output_final_state, name, "after")
    pool0 = a["state"].clone()
    c = outcome(_run_prefill, a)
    assert c[0] == "ok", c[:3]
    if not output_final_state:
        assert torch.equal(a["state"], pool0), "a pool not committed was written"
    ops.clear_call_caches()
    assert outcome(_run_prefill, _prefill_args(3, output_final_state))[0] == "ok"
    checks = []
    real = validation.check_kda_prefill
    monkeypatch.setattr(validation, "check_kda_prefill", lambda *x, **k: checks.append(1) or real(*x, **k))
    w = outcome(_run_prefill, _prefill_args(7, output_final_state, name, "after"))
    assert checks == [], "the warm call was checked in full"
    assert same(c, w), "cold and warm results differ"


# ---------------------------------------------------------------------------------------------
# kda_verify and fused_kda_verify: cold equals warm (guards)

LENS, COLS = [2, 1, 3], 4
D = 8  # fused_kda_verify's head dim


def _verify_args(seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    N, Tt = len(LENS), sum(LENS)
    slots = N * COLS + 3
    return dict(q=r(1, Tt, H, K), k=r(1, Tt, H, K), v=r(1, Tt, HV, V), g=r(1, Tt, HV, K), beta=r(1, Tt, HV),
                state=r(slots, HV, V, K, scale=0.5),
                state_indices=torch.randperm(slots, generator=gen)[:N * COLS].reshape(N, COLS).to(torch.int32),
                cu_seqlens=torch.tensor([0, 2, 3, 6], dtype=torch.int32),
                num_accepted_tokens=torch.randint(1, COLS + 1, (N,), generator=gen, dtype=torch.int32),
                A_log=r(HV, scale=0.3), dt_bias=r(HV * K, scale=0.5), out=torch.zeros(1, Tt, HV, V))


def _fused_verify_args(seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    N, Tt, C = len(LENS), sum(LENS), 3 * H * D
    slots = N * COLS + 3
    return dict(x=r(1, Tt, C), conv_weight=r(C, 4, scale=0.5), conv_state=r(slots, C, COLS + 2), g=r(1, Tt, H, D),
                beta=r(1, Tt, H), A_log=r(H, scale=0.3), dt_bias=r(H * D, scale=0.5), state=r(slots, H, D, D, scale=0.5),
                output_gate=r(1, Tt, H, D), norm_weight=r(D) + 1.0,
                state_indices=torch.randperm(slots, generator=gen)[:N * COLS].reshape(N, COLS).to(torch.int32),
                cu_seqlens=torch.tensor([0, 2, 3, 6], dtype=torch.int32),
                num_accepted_tokens=torch.randint(1, COLS + 1, (N,), generator=gen, dtype=torch.int32),
                out=torch.zeros(1, Tt, H, D))


_FUSED_POS = ("x", "conv_weight", "conv_state", "g", "beta", "A_log", "dt_bias", "state", "output_gate", "norm_weight")


def _run_verify(a):
    return flashkda_ext.kda_verify(*(a[n] for n in ("q", "k", "v", "g", "beta")),
                                   **{n: x for n, x in a.items() if n not in ("q", "k", "v", "g", "beta")})


def _run_fused_verify(a):
    return flashkda_ext.fused_kda_verify(*(a[n] for n in _FUSED_POS),
                                         **{n: x for n, x in a.items() if n not in _FUSED_POS})


def _inside(a, name, host):
    x = a[name]
    a[name] = a[host].view(-1).view(torch.uint8)[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)


def _strided(a, name):
    x = a[name]
    a[name] = torch.stack([x, x], dim=-1)[..., 0]


def _inference(a, name):
    with torch.inference_mode():
        a[name] = a[name].clone()


def _index(a, name, value):
    x = a[name].clone()
    x.view(-1)[0] = value
    a[name] = x


FIRST = {"kda_verify": "q", "fused_kda_verify": "x"}
CHANGES = {
    "first input inside state": lambda a, op: _inside(a, FIRST[op], "state"),
    "out inside state": lambda a, op: _inside(a, "out", "state"),
    "first input neg": lambda a, op: a.update({FIRST[op]: torch._neg_view(a[FIRST[op]].neg())}),
    "A_log requires grad": lambda a, op: a.update(A_log=a["A_log"].clone().requires_grad_(True)),
    "state inference": lambda a, op: _inference(a, "state"),
    "state strided": lambda a, op: _strided(a, "state"),
    "state_indices past the pool": lambda a, op: _index(a, "state_indices", 1000),
    "num_accepted_tokens 0": lambda a, op: _index(a, "num_accepted_tokens", 0),
    "cu_seqlens not from 0": lambda a, op: _index(a, "cu_seqlens", 1),
}
VERIFY_OPS = {"kda_verify": (_run_verify, _verify_args), "fused_kda_verify": (_run_fused_verify, _fused_verify_args)}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("op", list(VERIFY_OPS))
def test_verify_ops_refuse_warm_as_cold_guard(op, change):
    """guard: each change is refused by the full check (ValueError naming an argument) cold, and the same warm."""
    run, make = VERIFY_OPS[op]

    def build():
        a = make(7)
        CHANGES[change](a, op)
        return a
    c, w = cold_and_warm(run, build, lambda: make(3))
    assert c[0] == "raise" and c[1] is ValueError, f"{op} {change}: {c[:3]}"
    assert same(c, w), f"{op} {change}: cold {c[:3]} but warm {w[:3]}"
