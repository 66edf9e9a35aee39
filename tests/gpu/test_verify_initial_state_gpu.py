"""GPU tests of kda_verify's second start pool (initial_state, initial_state_indices) and step rows
(state [R, T_max, HV, V, K], state_indices [N]) on every CUDA kda_verify module
(jit/modules/verify_cuda.json); SGLang's target_verify on them is tested in
tests/test_integrations_sglang_overhead.py (CUDA graph, bitwise) and tests/gpu/test_sglang_gpu.py.

Per module: against the reference on fresh random inputs (outputs NaN-poisoned), with padding start
indices (negative, 0 with null_slot0) and indices past the second pool (padding on a GPU: nothing reads
the values), a paged (strided) second pool, empty requests; the second pool bitwise unchanged; every
slot no stored token names bitwise unchanged; padding requests exact zeros; and bitwise equal to the
same call without initial_state whose read slots hold copies of the start states (the second pool
changes where the start state is read, nothing else). initial_state = state (the same pool) through the
op. Step rows: bitwise the call on the R * T_max slots with the slot table they stand for, rows out of
range (negative, past R) making the request padding. Run:
python3 -m pytest -q tests/gpu/test_verify_initial_state_gpu.py
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import flashkda_ext  # noqa: E402
from flashkda_ext import reference as REF  # noqa: E402
from gpu_common import bits, paged_like, prebuild_selected, rel_l2, sdtype  # noqa: E402
from test_verify_gpu import NAMES, RECORDS, K, V, LENS, call_module, make  # noqa: E402

INIT_SLOTS = 7


@pytest.fixture(scope="module", autouse=True)
def _prebuild(request):
    prebuild_selected(request)


def with_second_pool(gen, a, starts, paged=False):
    """a plus initial_state [INIT_SLOTS, HV, V, K] (random, the pool's dtype; paged: slots apart) and
    initial_state_indices = starts; num_accepted_tokens dropped (refused with initial_state)."""
    HV = a["state"].shape[1]
    init = (torch.randn(INIT_SLOTS, HV, V, K, generator=gen, device="cuda") * 0.5).to(a["state"].dtype)
    if paged:
        _, init, _ = paged_like(init, seed=7)
    return dict(a, num_accepted_tokens=None, initial_state=init,
                initial_state_indices=torch.tensor(starts, dtype=torch.int32, device="cuda"))


def reference(a, null_slot0=False):
    # the kernel's padding rule for starts past the second pool, made explicit for the reference (which
    # refuses them, as the CPU backend does)
    starts = a["initial_state_indices"].clone()
    starts[starts >= INIT_SLOTS] = -1
    return REF.kda_verify_step(
        a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"], state_indices=a["state_indices"],
        cu_seqlens=a["cu_seqlens"], gate="softplus", A_log=a["A_log"], dt_bias=a["dt_bias"], null_slot0=null_slot0,
        initial_state=a["initial_state"], initial_state_indices=starts)


def outs_of(name, cases, T, HV):
    """Each case run through module name into its own NaN-poisoned output [1, T, HV, V], synchronized."""
    outs = []
    for x in cases:
        out = torch.full((1, T, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        call_module(name, x, out)
        outs.append(out)
    torch.cuda.synchronize()
    return outs


def starts_for(N):
    """Live starts (one repeated: a read-only pool), a negative one, one past the pool, one 0."""
    pattern = [3, -1, 3, INIT_SLOTS + 5, 0, 6, 2]
    return [pattern[n % len(pattern)] for n in range(N)]


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("null_slot0", [False, True])
@pytest.mark.parametrize("cols", [1, 3, 8, 12])
@pytest.mark.parametrize("name", NAMES)
def test_second_pool_matches_reference(name, cols, null_slot0, paged):
    gen = torch.Generator(device="cuda").manual_seed(3000 + cols)
    lens = list(LENS[cols]) + [0]  # and an empty request (graph padding)
    a = make(gen, lens, cols, 2, 8, sdtype(RECORDS[name]))
    a = with_second_pool(gen, a, starts_for(len(lens)), paged)
    pool0, init0 = a["state"].clone(), a["initial_state"].clone()
    ref_out, ref_pool = reference(a, null_slot0)
    out = torch.full((1, sum(lens), 8, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    call_module(name, a, out, null_slot0=null_slot0)
    torch.cuda.synchronize()
    what = f"{name} T_max={cols} null_slot0={null_slot0} paged={paged}"
    assert not torch.isnan(out.float()).any(), f"{what}: an output element was never written"
    assert rel_l2(out.float(), ref_out) < 1.2e-2, what
    assert torch.equal(bits(a["initial_state"]), bits(init0)), f"{what}: initial_state was written"
    starts = a["initial_state_indices"].clone()
    starts[starts >= INIT_SLOTS] = -1
    plan = REF.verify_plan(a["cu_seqlens"].cpu(), a["state_indices"].cpu(), None, pool0.shape[0], null_slot0,
                           starts.cpu(), INIT_SLOTS)
    written = {w for _, _, read, ws in plan if read is not None for w in ws if w is not None}
    tol = 4e-3 if a["state"].dtype == torch.float32 else 1e-2
    for s in range(pool0.shape[0]):
        if s in written:
            assert rel_l2(a["state"][s].float(), ref_pool[s].double()) < tol, (what, s)
        else:
            assert torch.equal(bits(a["state"][s]), bits(pool0[s])), f"{what}: slot {s} changed"
    pads = [(s, e) for s, e, read, _ in plan if read is None and e > s]
    assert pads, "the case must hold a padding request"
    for s, e in pads:
        assert torch.equal(out[0, s:e], torch.zeros_like(out[0, s:e])), f"{what}: padding output not zero"


@pytest.mark.parametrize("cols", [2, 4, 8])
@pytest.mark.parametrize("name", NAMES)
def test_second_pool_equals_copied_start_states_bitwise(name, cols):
    gen = torch.Generator(device="cuda").manual_seed(4000 + cols)
    lens = LENS[cols]
    a = make(gen, lens, cols, 4, 4, sdtype(RECORDS[name]))
    a = with_second_pool(gen, a, [(2 * n + 1) % INIT_SLOTS for n in range(len(lens))])
    b = dict(a, state=a["state"].clone(), initial_state=None, initial_state_indices=None,
             num_accepted_tokens=torch.ones(len(lens), dtype=torch.int32, device="cuda"))
    for n, i in enumerate(a["initial_state_indices"].tolist()):
        b["state"][int(a["state_indices"][n, 0])] = a["initial_state"][i]
    outs = outs_of(name, (a, b), sum(lens), 4)
    assert torch.equal(bits(outs[0]), bits(outs[1])), name
    assert torch.equal(bits(a["state"]), bits(b["state"])), name


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,cols", [([3, 1, 2, 3], 3), ([1, 1, 1], 1), ([8, 2, 5], 8)])
def test_op_with_initial_state_equal_to_state(state_dtype, lens, cols):
    """initial_state = state through the public op (routing included): starts from spare slots of the pool
    and from a slot the request itself writes, as the reference computes them."""
    gen = torch.Generator(device="cuda").manual_seed(5000 + cols)
    a = make(gen, lens, cols, 4, 4, state_dtype)
    idx = a["state_indices"]
    spare = sorted(set(range(a["state"].shape[0])) - set(idx.flatten().tolist()))
    starts = [int(idx[0, cols - 1])] + [spare[n % len(spare)] for n in range(1, len(lens))]  # own slot, spares
    starts_t = torch.tensor(starts, dtype=torch.int32, device="cuda")
    ref_out, ref_pool = REF.kda_verify_step(
        a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"], state_indices=idx, cu_seqlens=a["cu_seqlens"],
        A_log=a["A_log"], dt_bias=a["dt_bias"], initial_state=a["state"], initial_state_indices=starts_t)
    pool0 = a["state"].clone()
    out = flashkda_ext.kda_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], state=a["state"], state_indices=idx,
                                  cu_seqlens=a["cu_seqlens"], A_log=a["A_log"], dt_bias=a["dt_bias"],
                                  initial_state=a["state"], initial_state_indices=starts_t)
    torch.cuda.synchronize()
    assert rel_l2(out.float(), ref_out) < 1.2e-2
    tol = 4e-3 if state_dtype == torch.float32 else 1e-2
    assert rel_l2(a["state"].float(), ref_pool.double()) < tol
    named = set(idx.flatten().tolist())
    for s in range(pool0.shape[0]):
        if s not in named:
            assert torch.equal(bits(a["state"][s]), bits(pool0[s]))


@pytest.mark.parametrize("second_pool", [True, False], ids=["initial_state", "accepted"])
@pytest.mark.parametrize("cols", [1, 3, 8, 12])
@pytest.mark.parametrize("name", NAMES)
def test_step_rows_equal_the_slot_table_bitwise(name, cols, second_pool):
    gen = torch.Generator(device="cuda").manual_seed(6000 + cols)
    lens = list(LENS[cols]) + [0]
    N = len(lens)
    R = N + 3
    a = make(gen, lens, cols, 2, 8, sdtype(RECORDS[name]))
    if second_pool:
        a = with_second_pool(gen, a, starts_for(N))
    buf = (torch.randn(R, cols, 8, V, K, generator=gen, device="cuda") * 0.5).to(a["state"].dtype)
    pattern = [R - 1, -1, 0, R + 4, 2, 1, 3, 4, 5, 6]   # a padding row and one past R: padding requests
    rows = [pattern[n % len(pattern)] for n in range(N)]
    live = [0 <= r < R for r in rows]
    table = torch.tensor([[r * cols + t for t in range(cols)] if ok else [-1] * cols for r, ok in zip(rows, live)],
                         dtype=torch.int32, device="cuda")
    flat = buf.clone().view(R * cols, 8, V, K)
    b = dict(a, state=flat, state_indices=table)
    if second_pool:
        b["initial_state_indices"] = a["initial_state_indices"].masked_fill(
            ~torch.tensor(live, device="cuda"), -1)
    a = dict(a, state=buf, state_indices=torch.tensor(rows, dtype=torch.int32, device="cuda"))
    outs = outs_of(name, (a, b), sum(lens), 8)
    assert not torch.isnan(outs[0].float()).any(), name
    assert torch.equal(bits(outs[0]), bits(outs[1])), name
    assert torch.equal(bits(buf.view(R * cols, 8, V, K)), bits(flat)), name
    offsets = a["cu_seqlens"].tolist()
    for n, ok in enumerate(live):
        if not ok:
            s, e = offsets[n], offsets[n + 1]
            assert torch.equal(outs[0][0, s:e], torch.zeros_like(outs[0][0, s:e])), (name, n)
