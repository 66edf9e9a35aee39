// How many pieces the piece splits cut a sequence into, from host-known sizes only: plain C++ (no CUDA, no tvm-ffi),
// so a CPU test compiles it as it is and holds scripts/warmup_lengths.py's mirror of it to the same answers
// (tests/test_piece_rules_binding.py). Included by kda_prefill_args.h for the bindings.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace fkda {

// A piece-split call's pieces a (sequence, head): as many as one wave of `cta_slots` resident CTAs holds when each
// piece takes `ctas_per_piece` of them, at most `max_pieces`, at least 1 (then the chain is walked whole).
inline int pieces_for_one_wave(int64_t max_pieces, int64_t cta_slots, int64_t ctas_per_piece) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_pieces, cta_slots / ctas_per_piece)));
}

// A piece-split call's pieces a (sequence, head) over as many waves as it takes: of 1..max_pieces, the count whose
// slowest CTA slot walks the fewest chunk steps, ceil(ctas_per_piece x P / cta_slots) waves of a piece's
// ceil(chunks / P) chunks plus kPieceOverheadChunks (P > 1: the walk back on decaying gates, a CTA's start and end);
// of equal steps the fewest waves, then the most pieces (shorter pieces for the longer sequences). One wave where the items are few (B1 H8 T32K: 33 pieces), several where one wave would leave
// slots idle: 96 items (B1 H96 T32K) take 11 pieces in 4 waves, not 2 in 73% of one.
constexpr int64_t kPieceOverheadChunks = 2;
inline int pieces_for_waves(int64_t max_pieces, int64_t cta_slots, int64_t ctas_per_piece, int64_t chunks) {
  int64_t best = 1, best_steps = -1, best_waves = 0;
  for (int64_t p = 1; p <= std::max<int64_t>(1, max_pieces); ++p) {
    const int64_t waves = (ctas_per_piece * p + cta_slots - 1) / cta_slots;
    const int64_t steps = waves * ((chunks + p - 1) / p + (p > 1 ? kPieceOverheadChunks : 0));
    if (best_steps < 0 || steps < best_steps || (steps == best_steps && waves <= best_waves)) {
      best = p;
      best_steps = steps;
      best_waves = waves;
    }
  }
  return static_cast<int>(best);
}

// The fused split's pieces a (sequence, head) (kda_prefill_c16_launch.h, c16_split): 1 where one wave of
// `decide_slots` CTAs already holds the items (unsplit and exact: no warm-up, no guard to trip), unless past_one_wave
// (a guard that falls back to the fused kernel unsplit, params.c16_fallback), else pieces_for_waves over `cta_slots`.
// The two slot counts differ for the role-split kernel (one CTA an SM: cta_slots = SMs), whose split is still decided
// on the two-CTA wave (decide_slots = 2 x SMs): unsplit, 67..132 items would each walk a whole sequence on one SM.
inline int fused_split_pieces(int64_t max_pieces, int64_t decide_slots, int64_t cta_slots, int64_t items, int64_t chunks,
                              bool past_one_wave) {
  if (!past_one_wave && pieces_for_one_wave(max_pieces, decide_slots, items) == 1) return 1;
  return pieces_for_waves(max_pieces, cta_slots, items, chunks);
}

// A mixed-length call's piece length in 16-token chunks (prefill_c16gm_*: each sequence takes ceil(its chunks / L)
// pieces, so a long sequence gets more than a short one; the host knows T, N and HV, not the lengths), of at least
// kMinPieceChunks. Two candidates, the one with fewer estimated steps on the slowest CTA slot (ties: one wave):
// - several waves: est(L) = the work spread over the slots (every chunk-head, and kPieceOverheadChunks for each of
//   T / L + N / 2 pieces a head: half a piece lost to a sequence's remainder) plus half a piece for the last wave's
//   tail; est is a / L + L / 2 + const, least at L = sqrt(2 a), the lower est of its two integer neighbours;
// - one wave: the shortest L whose estimated pieces fit the slots, L + kPieceOverheadChunks steps.
// On the CPU against a greedy schedule of the real lengths (scripts/warmup_lengths.piece_chunks_for_work): within
// 10% of the best L over issue 46's mixed rows (8x(1024+64), ragged7 8K, 2x(8128+64); H8-H96).
constexpr int64_t kMinPieceChunks = 8;
inline double piece_steps_estimate(int64_t L, int64_t cta_slots, int64_t heads, int64_t num_seqs, int64_t chunks) {
  const double pieces = double(chunks) / double(L) + 0.5 * double(num_seqs);
  return double(heads) * (double(chunks) + double(kPieceOverheadChunks) * pieces) / double(cta_slots) +
         0.5 * double(L + kPieceOverheadChunks);
}
inline int piece_chunks_for_work(int64_t cta_slots, int64_t heads, int64_t num_seqs, int64_t chunks) {
  const double slots = double(std::max<int64_t>(1, cta_slots));
  const double a = double(heads) * double(kPieceOverheadChunks) * double(chunks) / slots;
  const int64_t lo = std::max<int64_t>(kMinPieceChunks, static_cast<int64_t>(std::sqrt(2.0 * a)));
  const double est_lo = piece_steps_estimate(lo, cta_slots, heads, num_seqs, chunks);
  const double est_hi = piece_steps_estimate(lo + 1, cta_slots, heads, num_seqs, chunks);
  int64_t L = est_hi < est_lo ? lo + 1 : lo;
  const double est = std::min(est_lo, est_hi);
  const double room = slots - 0.5 * double(heads) * double(num_seqs);  // slots left after the remainders
  if (room > 0.0) {
    const int64_t one = std::max<int64_t>(kMinPieceChunks, static_cast<int64_t>(std::ceil(double(heads) * double(chunks) / room)));
    if (double(one + kPieceOverheadChunks) <= est) L = one;
  }
  return static_cast<int>(std::min<int64_t>(L, 1 << 30));
}

}  // namespace fkda
