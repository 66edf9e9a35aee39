"""How far back the piece splits' warm-ups walk, on the CPU, for the gate parameters a benchmark draws.

    python3 scripts/warmup_lengths.py [--tokens 32768] [--heads 8] [--gate-params random,fla-init] [--seed 0]
                                      [--true-attenuation]

A split of a sequence's chain starts each piece but the first from a zero state after a warm-up: the chunks before
it whose attenuation bounds sum to <= -24 (log2), or from chunk 0 (csrc/prefill/README.md, "Piece split"). The bound
of a chunk is the sum over its tokens of the largest log2 decay over the 128 keys, so the slowest key of each token
sets the warm-up. For each gate ("bounded" at lower_bound -5, "softplus") and each way of drawing A_log / dt_bias
(benchmarks/gate_params.py; raw gate N(0, 1) as the benchmark's), this prints the warm-up lengths of two splits at
their piece counts on an H200 (2 x 132 CTA slots):
- chunk 64: the state-pass split of prefill_pc8_vt64 / prefill_pc16_vt64g2 (min(pieces, SMs / (tiles x items)));
- chunk 16: the fused kernel's split (prefill_c16p / c16g, c16_split below), and whether c16g's guard
  (a walk past half a piece) hands the call to the chunk-64 kernels.
No GPU: the bounds are computed in float64 from the same formulas as the kernels (not read off them).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from gate_params import KINDS, draw  # noqa: E402

from flashkda_ext.reference.gates import gate_log_decay  # noqa: E402

K = 128
LOG2E = 1.4426950408889634
LOWER_BOUND = -5.0   # the bounded gate's, as the benchmarks'
SMS = 132


PIECE_OVERHEAD_CHUNKS = 2   # csrc/prefill/kda_prefill_args.h, kPieceOverheadChunks


def c16_split(max_pieces, cta_slots, items, chunks, past_one_wave=False, decide_slots=None):
    """The fused split's pieces a sequence (the binding's fused_split_pieces, csrc/prefill/kda_piece_rules.h): 1 where
    one wave of decide_slots (default cta_slots; the role-split kernel's modules decide on two CTAs an SM while their
    pieces fill one) holds the items (unsplit, exact) unless past_one_wave (params.c16_fallback: the guard falls back to
    the kernel unsplit), else pieces_for_waves over cta_slots."""
    decide = cta_slots if decide_slots is None else decide_slots
    if max_pieces <= 1 or (not past_one_wave and decide // items <= 1):
        return 1
    return pieces_for_waves(max_pieces, cta_slots, items, chunks)


def pieces_for_waves(max_pieces, cta_slots, ctas_per_piece, chunks):
    """The fused split's pieces a sequence of `chunks` 16-token chunks (the binding's pieces_for_waves,
    csrc/prefill/kda_prefill_args.h): of 1..max_pieces the fewest chunk steps on the slowest CTA slot, ceil(items x P /
    slots) waves of ceil(chunks / P) chunks plus PIECE_OVERHEAD_CHUNKS (P > 1); of equal steps the fewest waves, then
    the most pieces."""
    best = None
    for p in range(1, max(1, max_pieces) + 1):
        waves = -(-ctas_per_piece * p // cta_slots)
        steps = waves * (-(-chunks // p) + (PIECE_OVERHEAD_CHUNKS if p > 1 else 0))
        if best is None or steps < best[0] or (steps == best[0] and waves <= best[1]):
            best = (steps, waves, p)
    return best[2]


MIN_PIECE_CHUNKS = 8   # csrc/prefill/kda_prefill_args.h, kMinPieceChunks


def piece_steps_estimate(L, cta_slots, heads, num_seqs, chunks):
    """The binding's piece_steps_estimate: the work over the slots plus half a piece of tail."""
    pieces = chunks / L + 0.5 * num_seqs
    return heads * (chunks + PIECE_OVERHEAD_CHUNKS * pieces) / cta_slots + 0.5 * (L + PIECE_OVERHEAD_CHUNKS)


def piece_chunks_for_work(cta_slots, heads, num_seqs, chunks):
    """A mixed-length call's piece length in chunks (the binding's piece_chunks_for_work, csrc/prefill/kda_prefill_args.h;
    prefill_c16gm_*): several waves at L = sqrt(2 a) (the lower estimate of its integer neighbours), or the shortest L
    whose estimated pieces fit one wave where that takes no more steps."""
    slots = max(1, cta_slots)
    a = heads * PIECE_OVERHEAD_CHUNKS * chunks / slots
    lo = max(MIN_PIECE_CHUNKS, int(math.sqrt(2.0 * a)))
    e_lo = piece_steps_estimate(lo, cta_slots, heads, num_seqs, chunks)
    e_hi = piece_steps_estimate(lo + 1, cta_slots, heads, num_seqs, chunks)
    L, est = (lo + 1, e_hi) if e_hi < e_lo else (lo, e_lo)
    room = slots - 0.5 * heads * num_seqs
    if room > 0:
        one = max(MIN_PIECE_CHUNKS, math.ceil(heads * chunks / room))
        if one + PIECE_OVERHEAD_CHUNKS <= est:
            L = one
    return L


def c16_seq_split(max_pieces, cta_slots, heads, num_seqs, tokens):
    """(grid z, L) of prefill_c16gm_* (the binding's c16_split and c16_piece_chunks under params.c16_seq_pieces): L from
    piece_chunks_for_work, z the pieces of a sequence as long as the whole call, at most max_pieces."""
    total = -(-tokens // 16)
    L = piece_chunks_for_work(cta_slots, heads, num_seqs, total)
    return max(1, min(max_pieces, -(-total // L))), L


def own_pieces(chunks, z, L):
    """A sequence's pieces under params.c16_seq_pieces (kda_prefill_c16_kernel): ceil(its chunks / L), 1..z."""
    return min(z, max(1, -(-chunks // L)))


def z_rotate(cta_slots, heads, num_seqs):
    """The guarded modules' grid rotation (the binding's c16_z_rotate: prefill_c16gm_* on the two-CTA kernel, every
    guarded module on the role split): layer z runs piece (z + 1) mod Z where one layer of heads x sequences CTAs fills
    the slots."""
    return 1 if heads * num_seqs >= cta_slots else 0


def greedy_makespan(lens, heads, pieces_of_seq, cta_slots, start=0.3, exit_cost=0.02, rotate=0):
    """Chunk steps on the slowest of cta_slots CTA slots when the fused split's CTAs (grid x = head, y = sequence, z =
    layer, launched in that order; layer z runs piece (z + rotate) mod Z) each take a free slot as it comes: a piece's
    chunks plus PIECE_OVERHEAD_CHUNKS (its warm-up on decaying keys, p > 0) plus `start`; a CTA with no chunks
    `exit_cost`. pieces_of_seq(chunks) -> (grid z, the sequence's own pieces)."""
    import heapq
    ctas = []
    nchs = [-(-n // 16) for n in lens]
    z = max(pieces_of_seq(c)[0] for c in nchs) if nchs else 1
    for layer in range(z):
        p = (layer + rotate) % z
        for nch in nchs:
            own = pieces_of_seq(nch)[1]
            per = -(-nch // own)
            cb = min(nch, p * per)
            ce = min(nch, cb + per)
            cost = exit_cost if (p > 0 and cb >= ce) else ce - cb + (PIECE_OVERHEAD_CHUNKS if p > 0 else 0) + start
            ctas += [cost] * heads
    slots = [0.0] * cta_slots
    for c in ctas:
        heapq.heappush(slots, heapq.heappop(slots) + c)
    return max(slots)


def chunk_bounds(tokens, H, gate, kind, gen, chunk):
    """[chunks, H] float64: each chunk's sum over its tokens of the slowest key's log2 decay."""
    A_log, dt_bias = draw(H, K, gate, kind, generator=gen)
    f = torch.randn(tokens, H, K, generator=gen).bfloat16().double()
    tb = (gate_log_decay(f, gate, A_log, dt_bias, LOWER_BOUND if gate == "bounded" else None) * LOG2E).amax(-1)
    n = tokens // chunk
    return tb[:n * chunk].view(n, chunk, H).sum(1)


def walks(cb, pieces):
    """Per (head, piece > 0): the warm-up in chunks, and whether the walk reached chunk 0."""
    nch, H = cb.shape
    per = (nch + pieces - 1) // pieces
    out = []
    for h in range(H):
        for p in range(1, pieces):
            c0 = p * per
            if c0 >= nch:
                break
            cs, s = c0, 0.0
            while cs > 0 and s > -24.0:
                cs -= 1
                s += float(cb[cs, h])
            out.append((c0 - cs, cs == 0))
    return out, per


def true_attenuation(T, gate, kind, gen, marks):
    """[(tokens, log2 ||P||_2, the bound's log2)] at `marks` for one head: P the product of the per-token transitions
    (I - beta k k^T) Diag(alpha) (state as row vectors, S <- S P), in float64, with isotropic random unit keys and
    beta = sigmoid(N(0, 1)). The splits' bound sums log2 max alpha a token, which ignores what the delta rule erases;
    how much that is depends on how the keys spread (real keys may concentrate), so this is an illustration, not a
    bound a kernel could use."""
    A_log, dt_bias = draw(1, K, gate, kind, generator=gen)
    f = torch.randn(T, K, generator=gen, dtype=torch.float64)
    alpha = torch.exp(gate_log_decay(f.view(T, 1, K), gate, A_log, dt_bias,
                                     LOWER_BOUND if gate == "bounded" else None).view(T, K))
    k = torch.randn(T, K, generator=gen, dtype=torch.float64)
    k = k / k.norm(dim=1, keepdim=True)
    beta = torch.sigmoid(torch.randn(T, generator=gen, dtype=torch.float64))
    P, scale, bound, out = torch.eye(K, dtype=torch.float64), 0.0, 0.0, []
    for t in range(T):
        P = (P - beta[t] * (P @ k[t]).unsqueeze(1) * k[t].unsqueeze(0)) * alpha[t].unsqueeze(0)
        bound += math.log2(float(alpha[t].max()))
        if t % 16 == 15 or t + 1 in marks:   # renormalised: ||P|| leaves float64's range on random gates
            n = float(torch.linalg.matrix_norm(P, 2))
            P, scale = P / n, scale + math.log2(n)
        if t + 1 in marks:
            out.append((t + 1, scale, bound))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--gate-params", default=",".join(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--true-attenuation", action="store_true",
                    help="also ||P||_2 of the transitions' product for one head with random unit keys (float64; slow)")
    args = ap.parse_args(argv)
    T, H = args.tokens, args.heads
    p64 = max(1, min(8 if H <= 8 else 16, SMS // ((2 if H <= 8 else 1) * H)))   # pc8_vt64: 2 V tiles; pc16 groups: 1 CTA
    p16 = c16_split(64, 2 * SMS, H, -(-T // 16))
    print(f"1 x {T} tokens, H{H}: chunk-64 split {p64} pieces of {-(-T // 64 // p64) * 64} tokens, "
          f"chunk-16 split {p16} pieces of {-(-T // 16 // p16) * 16} tokens")
    print(f"{'gate':9s} {'params':9s} {'slowest key nats/token (median)':>32s} | chunk 64: warm-up tokens median / max, "
          f"to chunk 0 | chunk 16: median / max, to chunk 0, c16g hands over")
    for kind in args.gate_params.split(","):
        for gate in ("bounded", "softplus"):
            gen = torch.Generator().manual_seed(args.seed)
            cb64 = chunk_bounds(T, H, gate, kind, gen, 64)
            slow = float((-cb64 / LOG2E / 64).median())
            gen = torch.Generator().manual_seed(args.seed)
            cb16 = chunk_bounds(T, H, gate, kind, gen, 16)
            w64, _ = walks(cb64, p64)
            w16, per16 = walks(cb16, p16)
            med = lambda w: sorted(x for x, _ in w)[len(w) // 2]
            hand = any(x > max(2, per16 // 2) for x, _ in w16)   # the guard: a walk past half a piece
            print(f"{gate:9s} {kind:9s} {slow:32.2e} | {64 * med(w64):6d} / {64 * max(x for x, _ in w64):6d}, "
                  f"{sum(z for _, z in w64)} of {len(w64)} | {16 * med(w16):6d} / {16 * max(x for x, _ in w16):6d}, "
                  f"{sum(z for _, z in w16)} of {len(w16)}, {'yes' if hand else 'no'}")
    if args.true_attenuation:
        marks = [m for m in (64, 256, 1024, 4096, 16384) if m <= T]
        print("one head, random unit keys: log2 of ||P||_2 (the dropped state's true attenuation) / the bound's sum")
        for kind in args.gate_params.split(","):
            for gate in ("bounded", "softplus"):
                res = true_attenuation(T, gate, kind, torch.Generator().manual_seed(args.seed), marks)
                print(f"{gate:9s} {kind:9s} " + "  ".join(f"{t} tok: {a:.1f} / {b:.1f}" for t, a, b in res))


if __name__ == "__main__":
    main()
