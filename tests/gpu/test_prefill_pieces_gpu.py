"""GPU tests of the piece-split prefill modules (params.pieces > 1: routed by default for long prompts, fp32 and bf16 state; issue 46).

A piece-split module runs each sequence's state pass as P pieces in parallel; piece p > 0 starts from a
zero state at the latest earlier chunk where the chunks' log2 attenuation bounds sum to <= -24 (or from
the true initial state at chunk 0). Against the unsplit module of the same V tile (params.pieces
absent, the same record otherwise):
  - piece 0's chunks (and every piece whose warm-up reaches chunk 0) are the same operations in the same
    order: bitwise equal;
  - the other pieces differ only by the dropped term (below 2^-24 of the state it drops), which the bf16
    roundings of the state path then spread to their own noise level (a perturbation d of a value rounded
    to bf16 comes out with rms sqrt(d ulp)), so those rows are held to the float64 recurrence like the
    unsplit module: the same tolerance, and an error at most 1.1x the unsplit module's on the same rows
    (plus 1e-4). A piece started too late (a wrong bound, wrong units) fails that.
  - the cases above also pass if no piece ever cuts (every walk to chunk 0 is exact), so one case makes the
    cut observable: a nearly tight bound and huge values in the chunks either side of the expected start
    (test_warm_up_starts_where_the_bounds_cross);
  - slow decays (every piece walks back to chunk 0): bitwise equal everywhere, also with the pool updated
    in place (initial_state is final_state; the pieces read the prep's copy, so the writer's store cannot
    feed another piece's start: a test cannot force that ordering, only check the in-place result).
Every output is NaN-poisoned before the call. Helpers (inputs, the float64 recurrence, the module call)
are tests/gpu/test_prefill_gpu.py's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
from gpu_common import bits  # noqa: E402
from test_prefill_gpu import DEV, K, RECORDS, TOL, V, call, load, make, recurrence, rel, sdtype  # noqa: E402

PIECE_RECS = [r for r in RECORDS if r["params"].get("pieces", 1) > 1]
BY_NAME = {r["name"]: r for r in RECORDS}


def unsplit(rec):
    """The record of the same module without pieces and with one 4-warp group a state-pass CTA (its V tile,
    state dtype and every other param): a group does exactly one one-group CTA's operations
    (test_prefill_groups_gpu.py), so piece 0 of a two-group module is bitwise this module too."""
    want = {k: v for k, v in rec["params"].items() if k not in ("pieces", "groups")}
    same = [r for r in RECORDS if r["params"].get("pieces", 1) == 1 and r["params"].get("groups", 1) == 1
            and r["params"] == want and r["state_dtype"] == rec["state_dtype"]]
    assert len(same) == 1, (rec["name"], [r["name"] for r in same])
    return same[0]


SMS = torch.cuda.get_device_properties(DEV).multi_processor_count


def launch_pieces(rec, N, HV):
    """The pieces the binding picks for a call (kda_prefill.cu, state_pieces): one wave of state-pass CTAs,
    V / (vt x groups) a (sequence, head), at most params.pieces, at least 1."""
    tiles = V // (rec["params"]["vt"] * rec["params"].get("groups", 1))
    return max(1, min(rec["params"]["pieces"], SMS // (tiles * HV * N)))


def run(rec, d, gate, init, lb=-5.0, pool_idx=None):
    mod = load(rec["name"])
    N, HV = len(d["cu"]) - 1, d["v"].shape[2]
    if pool_idx is None:
        fin = torch.full((N, HV, V, K), float("nan"), device=DEV).to(sdtype(rec))
        o = call(mod, d, gate, lb=lb, init=init, fin=fin)
    else:  # the pool in place: init is final_state
        fin = init
        o = call(mod, d, gate, lb=lb, init=init, fin=init, idx=pool_idx)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any(), rec["name"]
    return o, fin


def piece0_tokens(lens, P):
    """Token indices (of the packed row) in piece 0 of their sequence: exact, whatever the decay."""
    rows, start = [], 0
    for L in lens:
        nch = -(-L // 64)
        per = -(-nch // P)
        rows.extend(range(start, start + min(L, per * 64)))
        start += L
    return torch.tensor(rows, dtype=torch.long, device=DEV)


CASES = [
    dict(id="one_chunk_h2", lens=[64], H=2, gate="softplus"),
    dict(id="b1_t4096_h4_bounded", lens=[4096], H=4, gate="bounded"),
    dict(id="b1_t4096_h8_softplus", lens=[4096], H=8, gate="softplus"),
    dict(id="b1_t16384_h8_bounded", lens=[16384], H=8, gate="bounded"),
    dict(id="b1_t16384_h2_softplus", lens=[16384], H=2, gate="softplus"),
    dict(id="varlen_h4", lens=[0, 1, 4096, 63, 2000, 1, 0, 130, 700], H=4, gate="softplus"),
    dict(id="varlen_h12_bounded", lens=[1, 3000, 0, 65, 1500], H=12, gate="bounded"),
]


@pytest.mark.parametrize("rec", PIECE_RECS, ids=[r["name"] for r in PIECE_RECS])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_against_recurrence_and_the_unsplit_module(rec, case):
    torch.manual_seed(zlib.crc32(f"{rec['name']}{case['id']}".encode()))
    base = unsplit(rec)
    st = sdtype(rec)
    d = make(case["lens"], case["H"], case["H"], case["gate"])
    N = len(case["lens"])
    init = (torch.randn(N, case["H"], V, K, device=DEV) * 0.5).to(st)
    ro, rf, _ = recurrence(d, case["gate"], -5.0, init)
    o, fin = run(rec, d, case["gate"], init)
    ob, finb = run(base, d, case["gate"], init)
    eo, ef = rel(o[0], ro), rel(fin, rf)
    ebo, ebf = rel(ob[0], ro), rel(finb, rf)
    msg = (f"{rec['name']} vs {base['name']}: out {eo:.3e} / {ebo:.3e}, state {ef:.3e} / {ebf:.3e}, "
           f"out vs unsplit {rel(o[0], ob[0]):.3e}, state vs unsplit {rel(fin, finb):.3e}")
    assert eo < TOL and ef < TOL, msg
    assert eo <= 1.1 * ebo + 1e-4 and ef <= 1.1 * ebf + 1e-4, msg
    rows = piece0_tokens(case["lens"], launch_pieces(rec, len(case["lens"]), case["H"]))
    assert torch.equal(bits(o[0, rows]), bits(ob[0, rows])), "piece 0 is not bitwise the unsplit module: " + msg
    # a sequence of at most one piece's chunks is one piece: bitwise, final state included
    for n, L in enumerate(case["lens"]):
        if -(-L // 64) <= 1:
            assert torch.equal(bits(fin[n]), bits(finb[n])), (n, L, msg)
    # deterministic
    o2, fin2 = run(rec, d, case["gate"], init)
    assert torch.equal(bits(o2), bits(o)) and torch.equal(bits(fin2), bits(fin))


def slow(d, HV):
    """Softplus decays of ~1e-9 a token: no chunk run reaches the 2^-24 bound, every piece starts at chunk 0."""
    d["A_log"] = torch.full((HV,), -20.0, device=DEV)
    return d


SLOW_CASES = [
    dict(id="b1_t16384_h4", lens=[16384], H=4),
    dict(id="varlen_h2", lens=[0, 1, 4096, 63, 2000, 1, 0, 130], H=2),
]


@pytest.mark.parametrize("rec", PIECE_RECS, ids=[r["name"] for r in PIECE_RECS])
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c["id"] for c in SLOW_CASES])
def test_slow_decay_is_bitwise_the_unsplit_module(rec, case):
    torch.manual_seed(zlib.crc32(f"slow{rec['name']}{case['id']}".encode()))
    base = unsplit(rec)
    d = slow(make(case["lens"], case["H"], case["H"], "softplus"), case["H"])
    N = len(case["lens"])
    init = (torch.randn(N, case["H"], V, K, device=DEV) * 0.5).to(sdtype(rec))
    o, fin = run(rec, d, "softplus", init)
    ob, finb = run(base, d, "softplus", init)
    assert torch.equal(bits(o), bits(ob)), f"out differs: rel {rel(o[0], ob[0]):.3e}"
    assert torch.equal(bits(fin), bits(finb)), f"final state differs: rel {rel(fin, finb):.3e}"


SLOW_KEY = (77, 10)  # per head: the one slowly decaying key (the other warp half of the prep in each)
SLOW_G = -0.057373046875  # bf16-exact; x 64 tokens x log2(e) = -5.297 a chunk: 4 chunks -21.2, 5 chunks -26.5


@pytest.mark.parametrize("rec", PIECE_RECS, ids=[r["name"] for r in PIECE_RECS])
def test_warm_up_starts_where_the_bounds_cross(rec):
    """The split does split, and where the bound says. Log gate: every key decays by 0.5 a token but one per
    head (SLOW_KEY, a different prep warp per head), whose bound is -5.297 a chunk, and a weak delta rule
    (beta ~0.01), so the bound is nearly tight: piece p > 0 (first chunk c0) must start from zero at
    c0 - 5. The values of chunk c0 - 5 are scaled by 1e9 and those of c0 - 6 by 1e11: chunk c0's outputs
    are then dominated by what chunk c0 - 5 left (warm-up too short: missing) or by c0 - 6 (too long, or
    no split at all: present). They must match the float64 recurrence run from zero at c0 - 5, and the
    recurrences from c0 - 6 and c0 - 4 must be far from it (checked: the test can tell)."""
    torch.manual_seed(zlib.crc32(f"cut{rec['name']}".encode()))
    C, HV = 64, 2
    P = launch_pieces(rec, 1, HV)
    assert P > 1, (rec["name"], P)
    nch = max(64, 8 * P)  # >= 7 chunks a piece: the scaled chunks c0 - 6, c0 - 5 stay inside piece p - 1
    per = nch // P
    d = make([nch * C], HV, HV, "log")
    g = torch.full_like(d["g"], -0.5)
    for h, s in enumerate(SLOW_KEY):
        g[0, :, h, s] = SLOW_G
    d["g"] = g
    d["beta"] = torch.full_like(d["beta"], -4.6)  # sigmoid: ~0.01
    v = d["v"].float()
    for p in range(1, P):
        c0 = p * per
        v[0, (c0 - 5) * C:(c0 - 4) * C] *= 1e9
        v[0, (c0 - 6) * C:(c0 - 5) * C] *= 1e11
    d["v"] = v.bfloat16()
    o = call(load(rec["name"]), d, "log")
    torch.cuda.synchronize()
    assert torch.isfinite(o).all(), rec["name"]

    def from_zero(cs, c0):  # float64 outputs of chunk c0, the state zero at chunk cs
        t0, t1 = cs * C, (c0 + 1) * C
        sub = {key: d[key][:, t0:t1] for key in ("q", "k", "v", "g", "beta")}
        sub.update(A_log=None, dt_bias=None, cu=[0, t1 - t0])
        return recurrence(sub, "log", -5.0, None)[0][-C:]

    for p in range(1, P):
        c0 = p * per
        want = from_zero(c0 - 5, c0)
        for other in (c0 - 6, c0 - 4):
            assert rel(from_zero(other, c0), want) > 0.5, (p, other)  # the test's own power
        err = rel(o[0, c0 * C:(c0 + 1) * C], want)
        assert err < 2e-2, f"{rec['name']} piece {p} (chunk {c0}): {err:.3e} from the recurrence started at {c0 - 5}"


@pytest.mark.parametrize("rec", PIECE_RECS, ids=[r["name"] for r in PIECE_RECS])
def test_pool_in_place_is_bitwise_the_unsplit_module(rec):
    """initial_state is final_state (a pool with slot indices, a padding row, slot 0 as a real slot): the
    pieces read the prep's copy of the initial state, so the piece that writes the final state cannot feed
    another's start. Slow decays: every piece starts from the initial state at chunk 0."""
    torch.manual_seed(zlib.crc32(f"pool{rec['name']}".encode()))
    base = unsplit(rec)
    lens = [3000, 5, 4096, 700]
    d = slow(make(lens, 4, 4, "softplus"), 4)
    pool0 = (torch.randn(7, 4, V, K, device=DEV) * 0.5).to(sdtype(rec))
    idx = torch.tensor([5, -1, 2, 0], dtype=torch.int32, device=DEV)  # padding, and slot 0 (null_slot0 off)
    pool, poolb = pool0.clone(), pool0.clone()
    o, _ = run(rec, d, "softplus", pool, pool_idx=idx)
    ob, _ = run(base, d, "softplus", poolb, pool_idx=idx)
    assert torch.equal(bits(o), bits(ob)), f"out differs: rel {rel(o[0], ob[0]):.3e}"
    assert torch.equal(bits(pool), bits(poolb)), "pool differs from the unsplit module's"
    assert torch.equal(bits(pool[[1, 3, 4, 6]]), bits(pool0[[1, 3, 4, 6]])), "an unnamed slot changed"
    ro, rf, _ = recurrence(d, "softplus", -5.0, pool0, idx=idx.tolist())
    assert rel(o[0], ro) < TOL
    assert rel(pool[5], rf[0]) < TOL and rel(pool[2], rf[2]) < TOL and rel(pool[0], rf[3]) < TOL


@pytest.mark.parametrize("rec", PIECE_RECS, ids=[r["name"] for r in PIECE_RECS])
def test_workspace_holds_the_initial_state_copy(rec):
    """kda_prefill_workspace_bytes of a piece-split module: the unsplit module's, 128 more bytes a slot (the
    chunk's bound; slots: T // 64 + N a head) and N x HV copies of a state; a caller workspace one byte short
    is refused, naming the argument."""
    mod, modb = load(rec["name"]), load(unsplit(rec)["name"])
    esize = 4 if rec["state_dtype"] == "float32" else 2
    for T, N, HV in ((4096, 1, 8), (100, 3, 2), (0, 2, 1)):
        slots = (T // 64 + N) * HV
        assert (mod["kda_prefill_workspace_bytes"](T, N, HV)
                == modb["kda_prefill_workspace_bytes"](T, N, HV) + slots * 128 + N * HV * V * K * esize)
    d = make([300, 200], 2, 2, "bounded")
    need = mod["kda_prefill_workspace_bytes"](500, 2, 2)
    ws = torch.empty(need - 1, dtype=torch.uint8, device=DEV)
    out = torch.full_like(d["v"], float("nan"))
    with pytest.raises(ValueError, match="workspace"):
        call(mod, d, "bounded", ws=ws, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


# The route through the public op, in a child process (a process routes a call once; opt-in is read then).
_OPT_IN_CHILD = r"""
import sys, torch, flashkda_ext as fk
from flashkda_ext import dispatch, validation
a = torch.load(sys.argv[1])
kw = dict(A_log=a["A_log"], dt_bias=a["dt_bias"], initial_state=a["init"], output_final_state=True)
meta = validation.check_kda_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw).route_meta()
module = dispatch.module_name("kda_prefill", meta)
ckpt_module = dispatch.module_name("kda_prefill", dict(meta, checkpoints=True))
out, fin = fk.kda_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)
torch.cuda.synchronize()
torch.save({"module": module, "ckpt_module": ckpt_module, "out": out, "fin": fin}, sys.argv[2])
"""


@pytest.mark.parametrize("HV,T,opt_in,want", [(8, 8192, "", "prefill_pc8_vt64_f32"),
                                              (16, 8192, "", "prefill_pc16_vt64g2_f32"),
                                              (8, 8192, "exact_chain", "prefill_vt16_f32"),
                                              (24, 16384, "", "prefill_pc16_vt64g2_f32"),
                                              (24, 16384, "exact_chain", "prefill_vt32_f32"),
                                              (8, 8192, "", "prefill_pc8_vt64_bf16"),
                                              (12, 8192, "", "prefill_pc16_vt64g2_bf16"),
                                              (12, 8192, "exact_chain", "prefill_vt16_bf16")])
def test_pieces_route_through_the_op(HV, T, opt_in, want, tmp_path):
    """1 x T tokens, fp32 or bf16 state (the module's): at 8 heads the one-group vt64 split by default, at 12 / 16
    (24, T >= 16384) the two-group split, and the unsplit module with FLASHKDA_EXT_OPT_IN=exact_chain; a call with
    checkpoints never takes a piece split; the op's result is the module's own (bitwise) and right."""
    torch.manual_seed(HV)
    d = make([T], HV, HV, "softplus")
    init = (torch.randn(1, HV, V, K, device=DEV) * 0.5).to(sdtype(BY_NAME[want]))
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(dict(q=d["q"], k=d["k"], v=d["v"], g=d["g"], beta=d["beta"], A_log=d["A_log"],
                    dt_bias=d["dt_bias"], init=init), src)
    env = dict(os.environ, FLASHKDA_EXT_OPT_IN=opt_in)
    subprocess.run([sys.executable, "-c", _OPT_IN_CHILD, str(src), str(dst)], env=env, check=True, timeout=900)
    res = torch.load(dst)
    assert res["module"] == want and not BY_NAME[res["ckpt_module"]]["params"].get("pieces")
    o, fin = run(BY_NAME[want], d, "softplus", init)
    assert torch.equal(bits(res["out"]), bits(o)) and torch.equal(bits(res["fin"]), bits(fin))
    ro, rf, _ = recurrence(d, "softplus", -5.0, init)
    assert rel(o[0], ro) < TOL and rel(fin, rf) < TOL
