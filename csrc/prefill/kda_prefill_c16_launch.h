// Host side of the fused 16-token-chunk kernel (kda_prefill_c16.cuh), shared by its bindings: kda_prefill_c16.cu (the
// kernel alone) and kda_prefill_c16g.cu (the kernel guarded by the chunk-64 kernels). The arguments are checked by the
// binding before these run.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "../common/binding.h"
#include "../common/cuda_launch.h"
#include "../common/param_fill.h"
#include "../common/pool_args.h"
#include "kda_prefill_args.h"
#include "kda_prefill_c16.cuh"
#include "kda_prefill_c16ws.cuh"

namespace fkda {

// The bounded gate's lower bound from which no 16-token chunk leaves the factored range (16 x 5 nats of decay at most,
// kda_prefill_c16.cuh kFactorRange): its kernel needs no check
constexpr double kC16UncheckedLowerBound = -5.0;

// The kernel's parameters of a checked call (pieces 1; the binding sets them).
inline fkda_c16::Args c16_args(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                               const TensorView& beta, const OptTensor& A_log, const OptTensor& dt_bias,
                               const TensorView& cu_seqlens, int64_t N, int64_t H, int64_t HV,
                               const OptTensor& initial_state, const OptTensor& final_state,
                               const OptTensor& state_indices, const PrefillStates& ps, bool null_slot0,
                               const TensorView& out, double lower_bound, double scale, bool beta_is_logit) {
  fkda_c16::Args a;
  set_token_inputs(a, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, N);
  set_heads(a, H, HV);
  a.lower_bound = static_cast<float>(lower_bound);
  a.scale = static_cast<float>(scale);
  a.beta_logit = beta_is_logit ? 1 : 0;
  set_states(a, initial_state, final_state, state_indices, ps, null_slot0);
  a.fin_dense = 0;
  a.out = data_ptr<fkda_c16::bf16>(out);
  a.pieces = 1;
  return a;
}

// initial_state and final_state overlap: a pool updated in place.
inline bool states_overlap(const OptTensor& initial_state, const OptTensor& final_state) {
  return initial_state.has_value() && final_state.has_value() &&
         Extent::of(initial_state.value()).overlaps(Extent::of(final_state.value()));
}

// c16_split below: a module whose guard falls back to the fused kernel unsplit splits past one wave
#if FKDA_PARAM_C16_FALLBACK == 1
constexpr bool kSplitPastOneWave = true;
#else
constexpr bool kSplitPastOneWave = false;
#endif
// (prefill_c16g modules with params.c16_ws 1) the fused split runs the role-split kernel (kda_prefill_c16g.cu)
#if FKDA_PARAM_C16_WS == 1
constexpr bool kC16RoleSplit = true;
#else
constexpr bool kC16RoleSplit = false;
#endif
// The CTA slots of one wave of the fused kernel that splits: one CTA an SM for the role split (params.c16_ws 1), else
// min_blocks CTAs an SM (params.c16_min_blocks, also the two-CTA kernel's bound where a module keeps it for a fallback).
inline int64_t c16_slots(const fkda::cuda::LaunchContext& ctx) {
  return int64_t(kC16RoleSplit ? 1 : fkda_c16::kMinBlocks) * ctx.sm_count();
}
// A call's 16-token chunks if it were one sequence (every chunk-head's work; the longest sequence's bound).
inline int64_t c16_call_chunks(int64_t T) { return (T + fkda_c16::kC - 1) / fkda_c16::kC; }

#if FKDA_PARAM_C16_SEQ_PIECES == 1
// (prefill_c16gm_*) the piece length each sequence's own pieces are cut to (Args::piece_chunks)
inline int c16_piece_chunks(const fkda::cuda::LaunchContext& ctx, int64_t T, int64_t N, int64_t HV) {
  return piece_chunks_for_work(c16_slots(ctx), HV, N, c16_call_chunks(T));
}
#endif
#if FKDA_PARAM_C16_SEQ_PIECES == 1 || FKDA_PARAM_GUARD == 1
// (guarded modules) Args::z_rotate: where one grid layer (HV x N CTAs) fills the wave's slots, its CTAs are all first
// pieces, which never walk, so on slowly decaying gates nothing hands over until they finish a whole piece (~110 us at
// ragged7 8K H48, h100-2026-12-06-ce9c04d; 4x8192 H48 on the role split, 2 pieces: 2.48 ms against 1.98 on the
// two-CTA kernel, whose first layer left slots to second pieces; h100 s33 call 3); rotated, the first layer holds
// second pieces.
inline int c16_z_rotate(const fkda::cuda::LaunchContext& ctx, int64_t N, int64_t HV) {
  return HV * N >= c16_slots(ctx) ? 1 : 0;
}
#endif
#if FKDA_PARAM_C16_SEQ_PIECES == 1
// (prefill_c16gm_*) grid z for pieces of L chunks: the pieces of a sequence as long as the whole call, at most kPieces
inline int c16_seq_layers(int64_t T, int64_t L) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(fkda_c16::kPieces, (c16_call_chunks(T) + L - 1) / L)));
}
#endif

// The pieces a sequence for the kernel's CTA slots, min_blocks an SM, at most the module's (kda_prefill_c16.cuh,
// kPieces): 1 where one wave holds the items already (unsplit and exact: no warm-up, no guard to trip on slowly
// decaying keys, where a split handed over cost 1.31x at 4x8192 H48 on fla-init gates for 1.17x on random ones,
// h100-2026-12-06-d2f1dba); else pieces_for_waves for a sequence of T / N tokens (the mean: the host does not read
// the offsets), over as many waves as keep the slots busiest (B1 H96 T32K: 11 pieces in 4 waves, 1.33x 2 in one).
// A module whose guard falls back to this kernel unsplit (params.c16_fallback, prefill_c16g_c16_*) splits over several
// waves there too: a hand-over then costs the short attempt and the unsplit call.
inline int c16_split(const fkda::cuda::LaunchContext& ctx, int64_t T, int64_t N, int64_t HV) {
  // with the role-split kernel (params.c16_ws 1, one CTA an SM) whether to split is decided on the two-CTA wave: B1
  // T32K H96 (96 items) ran unsplit at 3.58 ms on an H100, 3.16 split over waves on the two-CTA kernel
  // (h100-2026-12-06-3db50e5's grid), 2.81 split on the role-split kernel (h100-2026-12-06-49430f7)
  const int64_t slots = c16_slots(ctx), wave = kC16RoleSplit ? 2 * int64_t(ctx.sm_count()) : slots;
  const int64_t chunks = N > 0 ? (T / N + fkda_c16::kC - 1) / fkda_c16::kC : 0;
  return fused_split_pieces(fkda_c16::kPieces, wave, slots, HV * N, chunks, kSplitPastOneWave);
}

// A call's pieces: c16_split, except that a piece that walks back to chunk 0 reads the initial state while the last
// piece may already store the final state, so when the two overlap (a pool updated in place) the call runs unsplit.
inline int c16_pieces(const fkda::cuda::LaunchContext& ctx, int64_t T, int64_t N, int64_t HV,
                      const OptTensor& initial_state, const OptTensor& final_state) {
  if (fkda_c16::kPieces == 1 || states_overlap(initial_state, final_state)) return 1;
  return c16_split(ctx, T, N, HV);
}

// The kernels' GATE template argument of a call (kda_prefill_c16.cuh): softplus 0, bounded 1 (at lower_bound >= -5,
// unchecked), log 2, kBoundedAnyBound (the bounded gate below -5).
inline int c16_gate(GateMode gm, double lower_bound) {
  if (gm == GateMode::kSoftplus) return 0;
  if (gm == GateMode::kLog) return 2;
  return lower_bound >= kC16UncheckedLowerBound ? 1 : fkda_c16::kBoundedAnyBound;
}

// f(std::integral_constant<int, G>{}) for the kernels' GATE G of a call (c16_gate): one instantiation a gate, in both
// the two-CTA kernel and the role split.
template <typename F>
void with_c16_gate(GateMode gm, double lower_bound, F&& f) {
  switch (c16_gate(gm, lower_bound)) {  // (the cases' order is the kernels' order in the module's PTX)
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case fkda_c16::kBoundedAnyBound: f(std::integral_constant<int, fkda_c16::kBoundedAnyBound>{}); break;
  }
}

// Launch the kernel of the gate (kda_prefill_c16.cuh, GATE): one CTA a (value head, sequence, piece), heads adjacent,
// so CTAs that run together read the same tokens' rows.
template <typename StateT>
void launch_c16(const fkda::cuda::LaunchContext& ctx, const fkda_c16::Args& a, GateMode gm, double lower_bound) {
  with_c16_gate(gm, lower_bound, [&](auto gate) {
    ctx.launch("kda_prefill_c16_kernel", fkda_c16::kda_prefill_c16_kernel<StateT, decltype(gate)::value>,
               dim3(static_cast<unsigned>(a.HV), static_cast<unsigned>(a.N), static_cast<unsigned>(a.pieces)),
               dim3(fkda_c16::kThreads), fkda_c16::kSmemBytes, a);
  });
}

// Launch the role-split kernel of the gate (kda_prefill_c16ws.cuh): one CTA a (value head, sequence, piece), 384
// threads, one CTA an SM.
template <typename StateT>
void launch_c16ws(const fkda::cuda::LaunchContext& ctx, const fkda_c16::Args& a, GateMode gm, double lower_bound) {
  with_c16_gate(gm, lower_bound, [&](auto gate) {
    ctx.launch("kda_prefill_c16ws_kernel", fkda_c16::ws::kda_prefill_c16ws_kernel<StateT, decltype(gate)::value>,
               dim3(static_cast<unsigned>(a.HV), static_cast<unsigned>(a.N), static_cast<unsigned>(a.pieces)),
               dim3(fkda_c16::ws::kWsThreads), fkda_c16::ws::kWsSmemBytes, a);
  });
}

}  // namespace fkda
