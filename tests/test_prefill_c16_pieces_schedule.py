"""CPU emulation of the c16p piece schedule (csrc/prefill/kda_prefill_c16.cuh, kPieces > 1; no GPU).

The formulas below are copied from the kernel (not extracted from it): keep them in step. For each (sequence,
piece) it replays the CTA's control flow - the piece's chunks [cb, ce), the warm-up walk back to cs summing each
chunk's attenuation bound until <= -24 (log2) in steps of four chunks (the rows each step loads stay in the
sequence), the zero / initial state start, the 2-deep cp.async ring (the prologue
loads chunk cs, chunk c + 1 is loaded during chunk c, chunk c is read from stage c & 1), the output stores
(c >= cb only) and the final-state writer (ce == nch) - and checks that every token's output is stored exactly once,
every sequence's final state by exactly one piece, and every chunk is read from the stage it was loaded into (the
bug fixed on pf-c16: the prologue loaded chunk cs into stage 0 while the loop read stage cs & 1, so a piece whose
warm-up began on an odd chunk ran its first chunk on a stale or uninitialised stage). Then a float64 token
recurrence run piece by piece (each piece from a zero state at cs, the initial state at cs = 0) is held to the
unsplit recurrence: the dropped state is attenuated below 2^-24.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "scripts")]
from gate_params import draw  # noqa: E402
from warmup_lengths import (c16_seq_split, c16_split, greedy_makespan, own_pieces,  # noqa: E402
                            piece_chunks_for_work, walks, z_rotate)  # walks: per piece > 0, the chunks its warm-up walks back

C = 16
K = V = 128
LOG2E = 1.4426950408889634


def pieces_of(pieces_max, sms, min_blocks, HV, N, tokens):
    """The binding's choice (csrc/prefill/kda_prefill_c16_launch.h, c16_split: scripts/warmup_lengths.c16_split) over
    min_blocks CTAs an SM for the mean sequence's 16-token chunks."""
    return c16_split(pieces_max, min_blocks * sms, HV * N, -(-(tokens // N) // C))


def token_bounds(graw, A_log, dt_bias, lb, gate="bounded"):
    """Per token the largest log2 decay over the keys (float32, as chunk_bounds): [T, HV]."""
    from flashkda_ext.reference.gates import gate_log_decay
    return (gate_log_decay(graw.float(), gate, A_log, dt_bias, lb if gate == "bounded" else None) * LOG2E).amax(-1)


WALK_STEP = 4  # kWalkStep: the chunks whose bounds one walk step computes together


def walk_rows(len_, c, masked=True):
    """The sequence rows (tokens from its first) a walk step at chunk c loads (chunk_bounds: chunks c, c - 1, ..,
    c - 3; token t of chunk cj is row 16 cj + t where t < its token count, else row 0, masked after the load).
    masked=False is the rule without the fallback row (each load at 16 cj + t), for the check's own test."""
    rows = []
    for j in range(WALK_STEP):
        cj = c - j
        nt = min(C, len_ - cj * C) if cj >= 0 else 0
        rows += [cj * C + t if (t < nt or not masked) else 0 for t in range(C)]
    return rows


def schedule(len_, P, bound_of_chunk, stage_fix=True, masked_rows=True):
    """The CTAs of one (sequence, head): a list of dicts (p, cs, cb, ce, writer, reads, walk_rows) as the kernel runs
    them."""
    nch = (len_ + C - 1) // C
    ctas = []
    for p in range(P):
        per = (nch + P - 1) // P
        cb = min(nch, p * per)
        ce = min(nch, cb + per)
        if P > 1 and p > 0 and cb >= ce:
            continue  # returns before any load or store
        if P == 1:
            cb, ce = 0, nch
        writer = ce == nch
        cs, s = cb, 0.0
        rows = []
        if P > 1:
            while cs > 0 and s > -24.0:  # a step: the bounds of cs - 1 .. cs - 4, then up to 4 chunks added
                rows += walk_rows(len_, cs - 1, masked_rows)
                for _ in range(WALK_STEP):
                    if not (cs > 0 and s > -24.0):
                        break
                    cs -= 1
                    s += bound_of_chunk(cs)
        ring = [None, None]
        if cs < ce:
            ring[(cs & 1) if stage_fix else 0] = cs  # the prologue
        reads = []
        for c in range(cs, ce):
            if c + 1 < ce:
                ring[(c + 1) & 1] = c + 1
            reads.append((c, ring[c & 1]))
        ctas.append(dict(p=p, cs=cs, cb=cb, ce=ce, writer=writer, reads=reads, nch=nch, walk_rows=rows))
    return ctas


def check_schedule(lens, P, bound_of, stage_fix=True, masked_rows=True):
    """Schedule invariants; returns the problems found (empty when sound). P: the pieces of every sequence, or a
    function of a sequence's chunks giving its own (params.c16_seq_pieces)."""
    bad = []
    for n, L in enumerate(lens):
        ctas = schedule(L, P((L + C - 1) // C) if callable(P) else P, lambda c: bound_of(n, c), stage_fix, masked_rows)
        stores = [0] * L
        writers = sum(1 for x in ctas if x["writer"])
        if writers != 1:
            bad.append((n, "final state writers", writers))
        for x in ctas:
            for c, got in x["reads"]:
                if got != c:
                    bad.append((n, x["p"], "chunk %d read from a stage holding %s" % (c, got)))
                if c >= x["cb"]:
                    for t in range(c * C, min(L, c * C + C)):
                        stores[t] += 1
            outside = [r for r in x["walk_rows"] if not 0 <= r < L]
            if outside:
                bad.append((n, x["p"], "the walk loads rows %s of a %d-token sequence" % (outside[:4], L)))
            if x["cs"] > 0 and x["cs"] < x["cb"]:
                walked = sum(bound_of(n, c) for c in range(x["cs"], x["cb"]))
                if walked > -24.0:
                    bad.append((n, x["p"], "warm-up bound %.2f > -24" % walked))
        for t, k in enumerate(stores):
            if k != 1:
                bad.append((n, "token %d stored %d times" % (t, k)))
                break
    return bad


def make(lens, HV, seed, near_bound=False):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    d = dict(q=torch.randn(T, HV, K, generator=g), k=torch.randn(T, HV, K, generator=g),
             v=torch.randn(T, HV, V, generator=g), beta=torch.randn(T, HV, generator=g),
             g=torch.randn(T, HV, K, generator=g), A_log=torch.rand(HV, generator=g) * 0.5 - 1.0,
             dt_bias=torch.randn(HV * K, generator=g) * 0.5)
    if near_bound:
        d["g"] = d["g"] + 6.0
        d["A_log"] = d["dt_bias"] = None
    d = {k_: (x.bfloat16().float() if x is not None else None) for k_, x in d.items()}
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    d["cu"] = cu
    return d


def chunk_bounds(d, lb, hv):
    tb = token_bounds(d["g"], d["A_log"], d["dt_bias"], lb)[:, hv].double()

    def bound_of(n, c):
        t0 = d["cu"][n] + c * C
        t1 = min(d["cu"][n + 1], t0 + C)
        return float(tb[t0:t1].sum())

    return bound_of


def run_tokens(d, lb, hv, t0, t1, S, out, store_from):
    """float64 recurrence of head hv over tokens [t0, t1), storing outputs of tokens >= store_from."""
    ea = math.exp(float(d["A_log"][hv])) if d["A_log"] is not None else 1.0
    dtb = d["dt_bias"].view(-1, K)[hv].double() if d["dt_bias"] is not None else torch.zeros(K, dtype=torch.float64)
    for t in range(t0, t1):
        q, k = d["q"][t, hv].double(), d["k"][t, hv].double()
        q = q / torch.sqrt((q * q).sum() + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum() + 1e-6)
        alpha = torch.exp(lb * torch.sigmoid(ea * (d["g"][t, hv].double() + dtb)))
        beta = torch.sigmoid(d["beta"][t, hv].double())
        S = S * alpha.view(1, K)
        u = beta * (d["v"][t, hv].double() - S @ k)
        S = S + u.view(V, 1) * k.view(1, K)
        if t >= store_from:
            out[t] = S @ q
    return S


SCHED_CASES = [  # (lens, HV, P)
    ([4096], 2, 16), ([3000, 1700], 8, 8), ([0, 1, 2000, 17, 900, 16], 4, 5), ([8192], 8, 8), ([33, 16, 5], 2, 16),
    ([512] * 4, 16, 4), ([4096], 1, 64), ([8192], 8, 33),
]


@pytest.mark.parametrize("near_bound", [False, True])
@pytest.mark.parametrize("lens,HV,P", SCHED_CASES)
def test_schedule_sound(lens, HV, P, near_bound):
    d = make(lens, HV, seed=len(lens) * 7 + HV + P, near_bound=near_bound)
    for hv in range(HV):
        assert check_schedule(lens, P, chunk_bounds(d, -5.0, hv)) == []


# Mixed-length batches (prefill_c16gm_*, params.c16_seq_pieces): (lens, HV) with empty, one-token and capped sequences
SEQ_CASES = [([3000, 64, 0, 1, 1200, 17, 700], 4), ([8192, 16, 16, 16], 1), ([1024, 64] * 8, 8),
             ([3000, 1500, 1200, 900, 700, 500, 392], 16)]


@pytest.mark.parametrize("near_bound", [False, True])
@pytest.mark.parametrize("lens,HV", SEQ_CASES)
def test_pieces_from_each_sequences_length_are_sound(lens, HV, near_bound):
    z, L = c16_seq_split(16, 264, HV, len(lens), sum(lens))
    assert z > 1
    d = make(lens, HV, seed=len(lens) * 5 + HV, near_bound=near_bound)
    for hv in range(min(HV, 4)):
        assert check_schedule(lens, lambda nch: own_pieces(nch, z, L), chunk_bounds(d, -5.0, hv)) == []


def test_piece_chunks_for_work_matches_the_binding():
    # csrc/prefill/kda_prefill_args.h, piece_chunks_for_work at 264 CTA slots (an H100 / H200 at 2 CTAs an SM)
    assert piece_chunks_for_work(264, 8, 16, 544) == 22     # 8x(1024+64) H8: one wave of pieces
    assert piece_chunks_for_work(264, 16, 16, 544) == 11    # H16: several waves of short pieces
    assert piece_chunks_for_work(264, 16, 7, 515) == 40     # ragged7 8K H16: one wave
    assert piece_chunks_for_work(264, 48, 7, 515) == 19
    assert piece_chunks_for_work(264, 1, 1, 10) == 8        # at least kMinPieceChunks
    assert c16_seq_split(16, 264, 16, 7, 8192) == (13, 40)  # z: the pieces of one 8192-token sequence
    assert c16_seq_split(16, 264, 48, 7, 8192)[0] == 16     # capped at the module's c16_pieces


@pytest.mark.parametrize("lens", [[1024, 64] * 8, [3000, 1500, 1200, 900, 700, 500, 392]])
def test_piece_length_within_ten_percent_of_the_best_on_a_greedy_schedule(lens):
    """The binding's L against every L from 8 to 96 on a greedy schedule of the real lengths (chunk steps on the
    slowest of 264 slots, scripts/warmup_lengths.greedy_makespan; the grid rotated as the binding does at 336 items),
    and ahead of the mean's split (0.49-0.90x its steps)."""
    for HV in (8, 16, 48):
        z, L = c16_seq_split(16, 264, HV, len(lens), sum(lens))
        got = greedy_makespan(lens, HV, lambda c: (z, own_pieces(c, z, L)), 264, rotate=z_rotate(264, HV, len(lens)))
        best = min(greedy_makespan(lens, HV, lambda c, x=x: (16, own_pieces(c, 16, x)), 264) for x in range(8, 97))
        P = c16_split(64, 264, HV * len(lens), -(-sum(lens) // len(lens) // 16), past_one_wave=True)
        mean = greedy_makespan(lens, HV, lambda c: (P, P), 264)
        assert got <= 1.10 * best and got < 0.95 * mean, (HV, z, L, got, best, mean)


def test_the_old_prologue_stage_is_caught():
    """With the prologue's stage fixed at 0 (commit d795b9f) a piece whose walk stops on an odd chunk reads chunk cs
    from the wrong stage: the emulation must see it on the GPU tests' shapes (near-bound gates walk back one chunk)."""
    lens, HV, P = [40, 16, 300], 4, 16
    d = make(lens, HV, seed=1, near_bound=True)
    bad = check_schedule(lens, P, chunk_bounds(d, -5.0, 0), stage_fix=False)
    assert any("read from a stage" in str(b) for b in bad), bad
    assert check_schedule(lens, P, chunk_bounds(d, -5.0, 0), stage_fix=True) == []


def test_a_walk_load_outside_the_sequence_is_caught():
    """The walk loads all of a step's rows before it masks them (8f0566f): a token past its chunk's end, or a chunk
    below 0, reads the sequence's first row. Without that fallback row a step near the sequence's start loads rows
    before its first token (the chunks below 0), which the emulation must see on the GPU tests' shapes."""
    lens, HV, P = [40, 16, 300], 4, 16
    d = make(lens, HV, seed=1, near_bound=True)
    bad = check_schedule(lens, P, chunk_bounds(d, -5.0, 0), masked_rows=False)
    assert any("the walk loads rows" in str(b) for b in bad), bad
    assert check_schedule(lens, P, chunk_bounds(d, -5.0, 0)) == []


def test_pieces_of_matches_the_binding():
    # one wave where the items are few (the choice before multi-wave pieces)
    assert pieces_of(64, 132, 2, 32, 4, 4 * 4096) == 2
    assert pieces_of(64, 132, 2, 64, 1, 8192) == 4
    assert pieces_of(64, 132, 2, 16, 64, 64 * 512) == 1
    assert pieces_of(64, 132, 2, 16, 1, 32768) == 16    # 2 waves of 33 pieces: the same steps, more waves
    assert pieces_of(64, 132, 2, 8, 1, 32768) == 33     # B1 H8 (Kimi K3 at TP12): a cap of 16 left half the wave empty
    assert pieces_of(64, 132, 2, 8, 1, 8192) == 33      # 32 pieces take as many steps: the most pieces of a wave
    assert pieces_of(64, 132, 2, 12, 1, 32768) == 22
    assert pieces_of(64, 132, 2, 2, 1, 32768) == 64
    assert pieces_of(16, 132, 2, 8, 1, 32768) == 16
    # several waves where one would leave CTA slots idle: B1 H96 (96 items) 4 waves of 11 pieces, not 73% of one wave
    # at 2 (4 x 188 chunk steps against 1026); 4x8192 H24 11 pieces
    assert pieces_of(64, 132, 2, 96, 1, 32768) == 11
    assert pieces_of(64, 132, 2, 24, 4, 4 * 8192) == 11
    assert pieces_of(64, 132, 2, 24, 4, 4 * 2048) == 8
    # unsplit (exact, nothing to guard) where one wave holds the items, though more waves of pieces would take fewer
    # steps on random gates: 4x8192 H48 / H96 (192 / 384 items; 4 / 2 pieces measured 1.17 / 1.03x there, 0.76x at
    # H48 on fla-init gates, where the guard hands over)
    assert pieces_of(64, 132, 2, 48, 4, 4 * 8192) == 1
    assert pieces_of(64, 132, 2, 96, 4, 4 * 8192) == 1
    assert pieces_of(64, 132, 2, 16, 64, 64 * 2048) == 1


def guard_trips(len_, P, bound_of_chunk, pct=50, max_chunks=1 << 30):
    """The guarded modules' hand-over (kda_prefill_c16.cuh, FKDA_PARAM_GUARD): the kernel checks cb - cs against
    max(2, min(max_chunks, per x pct / 100)) (params.c16_guard_pct, c16_guard_max_chunks) before each step of the
    walk, so it trips exactly when some piece's whole walk (schedule's cb - cs) is longer than that."""
    nch = (len_ + C - 1) // C
    per = (nch + P - 1) // P
    limit = max(2, min(max_chunks, per // 2 if pct == 50 else per * pct // 100))
    return any(x["cb"] - x["cs"] > limit for x in schedule(len_, P, bound_of_chunk))


def gpu_test_gates(lens, HV, gate, seed, dt_shift=0.0, slow_key=False):
    """Per-chunk log2 bounds of tests/gpu/test_prefill_c16g_gpu.py's inputs (make's gate distribution, its dt_bias
    shifts), head by head."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    graw = torch.randn(T, HV, K, generator=g).bfloat16().float()
    A_log = torch.rand(HV, generator=g) * 0.5 - 1.0
    dt = (torch.randn(HV, K, generator=g) * 0.5 + dt_shift)
    if slow_key:
        dt[:, 0] = -20.0
    tb = token_bounds(graw, A_log, dt, -5.0, gate).double()   # [T, HV]
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    return [[(lambda n, hv: lambda c: float(tb[cu[n] + c * C:min(cu[n + 1], cu[n] + c * C + C), hv].sum()))(n, hv)
             for n in range(len(lens))] for hv in range(HV)]


def _guard_limits():
    """(c16_guard_pct, c16_guard_max_chunks) of every guarded record (jit/modules/prefill_c16g*_cuda.json), as the kernel
    defaults them (kda_prefill_c16.cuh: 50, no cap)."""
    out = set()
    for f in sorted((ROOT / "jit" / "modules").glob("prefill_c16g*_cuda.json")):
        for m in json.loads(f.read_text())["modules"]:
            prm = m["params"]
            if prm.get("guard") == 1:
                out.add((prm.get("c16_guard_pct", 50), prm.get("c16_guard_max_chunks", 1 << 30)))
    return sorted(out)


GUARD_LIMITS = _guard_limits()


def test_every_guard_limit_is_read():
    assert {(25, 1 << 30), (50, 16), (100, 16)} <= set(GUARD_LIMITS), GUARD_LIMITS


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_the_gpu_tests_premises_on_the_guard(gate):
    """tests/gpu/test_prefill_c16g_gpu.py reads the path a call took off its bits; that needs its inputs far from the
    guard's threshold at the piece counts an H200 picks: on the two-CTA kernel (prefill_c16g_c16_*: 2 x 132 CTAs over 2
    sequences x 4 heads: 33 pieces, 4-6 chunks a piece; the in-place cases' 3 sequences x 2 heads: 44 pieces) and on the
    role split (params.c16_ws 1, one CTA an SM: 16 and 22 pieces). Decaying keys (dt_bias + 8) never trip it; one slow
    key a head (dt_bias -20) always does, at every limit the guarded records set (GUARD_LIMITS: a quarter or half a
    piece; a whole piece or half of one capped at 16 chunks)."""
    for lens, HV, min_blocks, want in (([3000, 1700], 4, 2, 33), ([3000, 40, 500], 2, 2, 44),
                                       ([3000, 1700], 4, 1, 16), ([3000, 40, 500], 2, 1, 22)):
        P = pieces_of(64, 132, min_blocks, HV, len(lens), sum(lens))
        assert P == want
        for seed in range(3):
            fast = gpu_test_gates(lens, HV, gate, seed, dt_shift=8.0)
            slow = gpu_test_gates(lens, HV, "bounded", seed, slow_key=True)
            for hv in range(HV):
                for pct, cap in GUARD_LIMITS:
                    trips = [guard_trips(L, P, fast[hv][n], pct, cap) for n, L in enumerate(lens)]
                    assert not any(trips), (seed, hv, pct)
                    assert guard_trips(lens[0], P, slow[hv][0], pct, cap), (seed, hv, pct)
    # the old shift (+4) is too close for softplus at 33 pieces (2 x 4 heads on the two-CTA kernel): a 4-chunk piece's
    # limit is 2 chunks
    if gate == "softplus":
        lens, HV, P = [3000, 1700], 4, 33
        near = gpu_test_gates(lens, HV, gate, 0, dt_shift=4.0)
        assert any(guard_trips(L, P, near[hv][n]) for hv in range(HV) for n, L in enumerate(lens))


@pytest.mark.parametrize("lens,HV,P,near_bound", [([700, 250], 1, 6, False), ([300], 1, 16, True)])
def test_pieces_recurrence_float64(lens, HV, P, near_bound):
    """Pieces from a zero state after the warm-up give the unsplit recurrence's outputs and final state (float64)."""
    d = make(lens, HV, seed=11, near_bound=near_bound)
    lb, T = -5.0, sum(lens)
    init = torch.randn(len(lens), HV, V, K, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.5
    for hv in range(HV):
        ref = torch.zeros(T, V, dtype=torch.float64)
        got = torch.full((T, V), float("nan"), dtype=torch.float64)
        bound_of = chunk_bounds(d, lb, hv)
        for n, L in enumerate(lens):
            b = d["cu"][n]
            fin_ref = run_tokens(d, lb, hv, b, b + L, init[n, hv].clone(), ref, b)
            fin = None
            ctas = schedule(L, P, lambda c: bound_of(n, c))
            assert any(x["cs"] > 0 for x in ctas)  # some piece starts from zero
            for x in ctas:
                S = init[n, hv].clone() if x["cs"] == 0 else torch.zeros(V, K, dtype=torch.float64)
                S = run_tokens(d, lb, hv, b + x["cs"] * C, min(b + L, b + x["ce"] * C), S, got, b + x["cb"] * C)
                if x["writer"]:
                    fin = S
            assert not torch.isnan(got[b:b + L]).any()
            err = ((got[b:b + L] - ref[b:b + L]).norm() / ref[b:b + L].norm()).item()
            errf = ((fin - fin_ref).norm() / fin_ref.norm()).item()
            assert err < 1e-6 and errf < 1e-6, (n, err, errf)


def test_the_chain_guards_limit_is_a_whole_piece_capped_at_16_chunks():
    """prefill_c16g_vt16 / vt32 (the guard that hands over to the unsplit chain): a piece's warm-up may walk its own
    length or 16 chunks (256 tokens), whichever is shorter. At B1 T32K H8 (33 pieces of 63 chunks) a gate whose slowest
    key decays as at A_log 0 in the SGLang benchmark's draw (warm-ups of 10-12 chunks) splits; at 12 percent of a piece
    (7 chunks, 16f417f) it handed over (measured: 0.769 ms through SGLang's extend, h100-2026-12-05-16f417f, the
    unsplit chain's time; the split takes ~0.31 on random gates). At B1 T8K (16-chunk pieces) the cap is the piece: a
    warm-up of a whole piece still splits."""
    H, T = 2, 32768
    gen = torch.Generator().manual_seed(1)
    graw = (torch.randn(T, H, K, generator=gen) - 1.0).bfloat16()
    dt = torch.randn(H * K, generator=gen) * 0.5
    tb = token_bounds(graw, torch.zeros(H), dt, -5.0).double()
    P = pieces_of(64, 132, 2, 8, 1, T)
    slow_dt = dt.clone()
    slow_dt.view(H, K)[:, 0] = -3.0   # one slower key a head: warm-ups of 15-16 chunks at B1 T8K, a whole piece
    tb_slow = token_bounds(graw[:8192], torch.zeros(H), slow_dt, -5.0).double()
    def bound_of(t, h):   # chunk c's bound of head h, from per-token bounds t [T, H]
        return lambda c: float(t[c * C:(c + 1) * C, h].sum())

    for hv in range(H):
        bound = bound_of(tb, hv)
        assert not guard_trips(T, P, bound, 100, 16), hv
        assert guard_trips(T, P, bound, 12), hv
        bound = bound_of(tb_slow, hv)
        assert not guard_trips(8192, P, bound, 100, 16), hv   # 16 chunks: the piece
        assert guard_trips(8192, P, bound, 100, 8), hv        # a tighter cap would bind here


@pytest.mark.parametrize("draw_kind", ["random", "sglang", "fla-init"])
def test_the_two_stage_guards_premise(draw_kind):
    """prefill_c16g2_pc8_vt64 (route c16g_few) at B1 T32K H8 (Kimi K3 at TP12): the fused split (33 pieces of 63
    chunks of 16, a walk limit of 16 chunks) serves random gates; SGLang's extend draw (A_log uniform in [-2, 0.5], raw
    gate N(-1, 1)) trips it where a head draws A_log near 0.5 (warm-ups of hundreds of tokens; seed 0 here, and the
    H100 run of h100-2026-12-06-14968d6, where the chain served), and kda_chain_decide_kernel then keeps the chunk-64
    piece split (8 pieces of 64 chunks of 64: every warm-up within its piece) where the one-stage modules hand the call
    to the chain; gates drawn as fla initialises a layer walk past a chunk-64 piece, so the unsplit chain does the call."""

    def warmups(tb, chunk, pieces):   # [per head: max warm-up], per from [T, H] per-token bounds
        n = tb.shape[0] // chunk
        cb = tb[:n * chunk].view(n, chunk, -1).sum(1)
        w, per = walks(cb, pieces)
        by_head = len(w) // tb.shape[1]
        return [max(x for x, _ in w[h * by_head:(h + 1) * by_head]) for h in range(tb.shape[1])], per
    H, T = 8, 32768
    P16, P64 = pieces_of(64, 132, 2, H, 1, T), 8
    assert P16 == 33
    trips = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        if draw_kind == "sglang":   # benchmarks/bench_sglang.py: params() and extend_inputs()
            A_log, dt = torch.rand(H, generator=gen) * 2.5 - 2.0, torch.randn(H * K, generator=gen) * 0.5
            graw = (torch.randn(T, H, K, generator=gen) - 1.0).bfloat16()
        else:
            A_log, dt = draw(H, K, "bounded", draw_kind, generator=gen)
            graw = torch.randn(T, H, K, generator=gen).bfloat16()
        tb = token_bounds(graw, A_log, dt, -5.0).double()
        fused, _ = warmups(tb, 16, P16)
        c64, per64 = warmups(tb, 64, P64)
        fused_trips = max(fused) > 16
        chain = max(c64) > per64
        trips.append(fused_trips)
        if draw_kind == "sglang":   # the fused split serves some draws, and the chain is never needed
            assert not chain, (seed, c64)
            continue
        want = {"random": (False, False), "fla-init": (True, True)}[draw_kind]
        assert (fused_trips, chain) == want, (seed, fused, c64)
    if draw_kind == "sglang":
        assert trips[0], "seed 0's draw (a head near A_log 0.5) should trip the fused split's guard"


def test_the_rotated_grid_starts_walking_pieces_in_the_first_wave():
    """ragged7 8K H48 (336 items: one grid layer fills 264 slots): unrotated the first wave holds only first pieces,
    which never walk, so on slow gates the hand-over waits for a whole piece; rotated it holds second pieces. The
    rotation costs nothing on random-gate costs there (greedy schedule), and is off below one layer a wave (256 items)."""
    lens, HV = [3000, 1500, 1200, 900, 700, 500, 392], 48
    z, L = c16_seq_split(16, 264, HV, len(lens), sum(lens))
    assert z_rotate(264, HV, len(lens)) == 1 and z_rotate(264, 16, 16) == 0
    owns = [own_pieces(-(-n // 16), z, L) for n in lens]
    assert z > 1 and sum(o > 1 for o in owns) * HV > 0   # the rotated first layer holds second pieces, which walk
    flat = greedy_makespan(lens, HV, lambda c: (z, own_pieces(c, z, L)), 264)
    rot = greedy_makespan(lens, HV, lambda c: (z, own_pieces(c, z, L)), 264, rotate=1)
    assert rot <= 1.01 * flat, (rot, flat)


def test_the_role_split_full_wave_split_rotates_its_layers():
    """prefill_c16g_c16_* on the role split (one CTA an SM, 132 slots at 132 SMs): 4x8192 H48 (192 items) splits into
    2 pieces past one wave, so unrotated the first wave (132 CTAs) is all first pieces, which never walk, and on slow
    gates the guard waited for one to finish its half sequence (fla-init 2.48 ms against 1.98 on the two-CTA kernel,
    an H100); rotated, every CTA of the first wave is a second piece, which walks and can hand over at once."""
    HV, N, chunks, slots = 48, 4, 8192 // 16, 132
    P = c16_split(64, slots, HV * N, chunks, past_one_wave=True)
    assert P == 2 and z_rotate(slots, HV, N) == 1
    first_wave = [(z + z_rotate(slots, HV, N)) % P for z in range(P) for _ in range(HV * N)][:slots]
    assert all(p > 0 for p in first_wave)
    assert z_rotate(2 * slots, HV, N) == 0   # the two-CTA kernel's 264 slots: layer 0 leaves 72 to second pieces
