// TVM-FFI binding of the guarded piece split (modules prefill_c16g_*; family kda_prefill, the same ABI as
// kda_prefill.cu): the fused 16-token-chunk kernel split into pieces (kda_prefill_c16.cuh, FKDA_PARAM_C16_PIECES) and,
// after it in the stream, the chunk-64 kernels of the module's params (FKDA_PARAM_VT / GROUPS / PIECES: the route's
// module before this one), which run only if the fused kernel handed the call over.
//
// Why: the piece split starts each piece from a zero state after a warm-up long enough to attenuate the dropped state
// below 2^-24, which is short on decaying keys (1.09-1.52x the chunk-64 modules) and walks back to chunk 0 on a slowly
// decaying key (up to 11x slower). A route cannot see the gates, so the kernel decides: a piece whose warm-up would
// pass its limit (half its own length; a whole one capped at params.c16_guard_max_chunks, 16, where the fallback is
// the unsplit chain: params.c16_guard_pct 100) sets the guard word and stops, the other pieces stop at their next
// chunk, and the chunk-64 kernels, which skip the call while the word is clear, then do the whole call. Either way one
// of the two computes every output and the final state (the chunk-64 kernels after the fused one, overwriting what it
// wrote).
// A two-stage module (params.chain_guard 1, prefill_c16g2_*) guards the chunk-64 piece split in turn: after the prep,
// kda_chain_decide_kernel sets a second word (after the guard word) where a piece's warm-up is longer than the piece,
// and then the unsplit chain at V tile 16 does the call instead of the piece pass (kda_prefill_state.cuh).
// A module with params.c16_fallback 1 (prefill_c16g_c16_*) falls back to the fused kernel itself, unsplit, instead of
// the chunk-64 kernels (see kUnsplitFallback below).
// When a split would not shorten the slowest CTA slot (c16_split: one wave of 2 CTAs an SM already holds HV x N, or
// more pieces would not pay for their warm-ups) the fused kernel runs alone, unsplit and exact.
// When initial_state and final_state overlap (a pool updated in place, as vLLM and SGLang call it), a piece that walks
// back to chunk 0 reads the initial state while the last piece may already have stored the final state, so the pieces
// store the final states to a dense copy in the workspace instead, and a third kernel after the chunk-64 ones moves the
// copy into the pool unless the guard word is set (the chunk-64 kernels then did the whole call on the untouched pool):
// the same bits as the call out of place, for one more state write and read.
//
// Exports: kda_prefill, kda_prefill_workspace_bytes(total_tokens, num_seqs, value_heads) -> the chunk-64 kernels'
// workspace, the guard word and the final-state copy, fkda_contract(). Refuses checkpoints (the fused kernel writes
// none).
#include <cuda_runtime.h>

#include "../common/binding.h"
#include "../common/cuda_launch.h"
#include "kda_prefill_args.h"
#include "kda_prefill_c16_launch.h"
#include "kda_prefill_chunk64_launch.h"

#if FKDA_PARAM_GUARD != 1
#error "prefill_c16g modules are built with params.guard = 1"
#endif
static_assert(fkda_c16::kPieces > 1, "the guarded split needs params.c16_pieces > 1");
#ifdef FKDA_PARAM_CHUNK  // what the op reads as the route's chunk (checkpoint alignment; this module refuses checkpoints)
static_assert(FKDA_PARAM_CHUNK == fkda_c16::kC, "params.chunk is the fused kernel's, 16");
#endif
static_assert(FKDA_THREADS == 128 * fkda_prefill::kGroups,
              "module record 'threads' is the state pass's: 128 x params.groups");
static_assert(FKDA_SMEM_BYTES == fkda_prefill::StateSmem<FKDA_PARAM_VT>::kTotal,
              "module record 'smem_bytes' must equal the state pass shared memory of its V tile");

namespace {

using namespace fkda;

#if FKDA_STATE_BF16 == 1
using StateT = __nv_bfloat16;
#else
using StateT = float;
#endif

// After the chunk-64 kernels' workspace (its slots and initial-state copy): the guard word, in an aligned block of its
// own, then the final-state copy [N, HV, V, K] (used for a pool updated in place).
constexpr int64_t kGuardBytes = fkda_prefill::kWorkspaceAlign;
#if FKDA_PARAM_CHAIN_GUARD == 1
constexpr bool kChainGuard = true;
#else
constexpr bool kChainGuard = false;
#endif

#if FKDA_PARAM_C16_FALLBACK == 1
// (params.c16_fallback 1, prefill_c16g_c16_*) The guard falls back to the fused kernel unsplit, launched after the split
// to run only where the word is set (Args::run_if): for calls whose items one wave holds already (133..255 at 132
// SMs), which the other modules run unsplit; the split over several waves then costs a hand-over the short attempt.
// The fallback is the two-CTA kernel (params.c16_min_blocks 2) even where the split is the role split: unsplit, its
// 264 slots hold the items in one wave, the role split's 132 in two (4x8192 H48 on fla-init gates: 2.38 ms with the
// role split as the fallback, 1.99 with the two-CTA kernel; h100 s33 call 2, branch pf-ws-more).
constexpr bool kUnsplitFallback = true;
#else
constexpr bool kUnsplitFallback = false;
#endif

// The fused kernel's launch: with params.c16_ws 1 the role split (kda_prefill_c16ws.cuh, one CTA an SM: c16_slots),
// else the two-CTA kernel.
template <typename StateT>
void launch_fused(const fkda::cuda::LaunchContext& ctx, const fkda_c16::Args& a, GateMode gm, double lower_bound) {
#if FKDA_PARAM_C16_WS == 1
  launch_c16ws<StateT>(ctx, a, gm, lower_bound);
#else
  launch_c16<StateT>(ctx, a, gm, lower_bound);
#endif
}

int64_t chunk64_workspace(int64_t T, int64_t N, int64_t HV) {
  // no chunk-64 kernels behind an unsplit fallback: the guard word's block starts the workspace
  return kUnsplitFallback ? fkda_prefill::kWorkspaceAlign : fkda_prefill::workspace_bytes(T, N, HV, sizeof(StateT));
}
int64_t final_copy_bytes(int64_t N, int64_t HV) {
  return N * HV * fkda_c16::kV * fkda_c16::kK * int64_t(sizeof(StateT));
}

void kda_prefill(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta,
                 OptTensor A_log, OptTensor dt_bias, TensorView cu_seqlens,
                 OptTensor initial_state, OptTensor final_state, OptTensor state_indices,
                 OptTensor checkpoints, TensorView out, OptTensor workspace, int64_t gate_mode,
                 double lower_bound, double scale, bool beta_is_logit, bool null_slot0,
                 int64_t checkpoint_every) {
  const char* fn = "kda_prefill";
  Checker ck(fn);
  const PrefillCall pc = prefill_call_args(ck, q, k, v, g, beta, out, A_log, dt_bias, cu_seqlens, gate_mode,
                                           lower_bound, scale);
  const GateMode gm = pc.gm;
  const int64_t T = pc.dm.T, H = pc.dm.H, HV = pc.dm.HV, V = pc.dm.V, K = pc.dm.K, N = pc.N;
  FKDA_CHECK(!checkpoints.has_value(), fn)
      << "argument 'checkpoints': this module (16-token chunks, pieces) writes no checkpoints; use a chunk-64 module";
  (void)checkpoint_every;
  const PrefillStates ps = prefill_state_args(ck, q, initial_state, final_state, state_indices, N, HV, V, K);
  const int64_t c64_need = chunk64_workspace(T, N, HV), need = c64_need + kGuardBytes + final_copy_bytes(N, HV);
  prefill_workspace_arg(ck, workspace, q, need);

  const fkda::cuda::LaunchContext ctx(q);
  cudaStream_t stream = ctx.stream();
  fkda_c16::Args a = c16_args(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, N, H, HV, initial_state, final_state,
                              state_indices, ps, null_slot0, out, lower_bound, scale, beta_is_logit);
#if FKDA_PARAM_C16_SEQ_PIECES == 1  // each sequence's pieces from its own length, pieces of piece_chunks chunks
  a.piece_chunks = c16_piece_chunks(ctx, T, N, HV);
  const int split = c16_seq_layers(T, a.piece_chunks);
#else
  const int split = c16_split(ctx, T, N, HV);
#endif
  a.z_rotate = c16_z_rotate(ctx, N, HV);
  const bool in_place = states_overlap(initial_state, final_state);
  a.guard = nullptr;
#if FKDA_PARAM_C16_FALLBACK == 1
  a.run_if = nullptr;
  fkda_c16::Args unsplit = a;  // the fallback: the call as given (the pool itself in place), one piece
  unsplit.pieces = 1;
#endif
  if (split == 1) {  // unsplit: exact, no warm-up, nothing to guard
    a.pieces = 1;
    launch_fused<StateT>(ctx, a, gm, lower_bound);
    return;
  }

  PrefillWorkspace ws(workspace, need, stream);
  // the used part of the chunk-64 workspace ends kWorkspaceAlign before its size (the alignment slack)
  uint8_t* guard_block = ws.ptr + c64_need - fkda_prefill::kWorkspaceAlign;
  int* guard = reinterpret_cast<int*>(guard_block);
  // the guard word and, in a two-stage module, the chain word after it (params.chain_guard)
  FKDA_CUDA_CHECK(cudaMemsetAsync(guard, 0, (kChainGuard ? 2 : 1) * sizeof(int), stream), "cudaMemsetAsync(guard)");
  StateT* pool = static_cast<StateT*>(a.fin);
  if (in_place) {
    a.fin = guard_block + kGuardBytes;
    a.fin_dense = 1;
  }
  a.pieces = split;
  a.guard = guard;
  launch_fused<StateT>(ctx, a, gm, lower_bound);
#if FKDA_PARAM_C16_FALLBACK == 1
  unsplit.run_if = guard;
  launch_c16<StateT>(ctx, unsplit, gm, lower_bound);
#else
  Chunk64Call call{T, N, H, HV, nullptr, 0, 0, ws.ptr, gate_mode, lower_bound, scale, beta_is_logit, null_slot0,
                   guard};
  if (kChainGuard) call.chain = guard + 1;
  launch_chunk64<StateT>(ctx, call, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, final_state,
                         state_indices, ps, out);
#endif
  if (in_place)
    ctx.launch("kda_prefill_c16_commit_kernel", fkda_c16::kda_prefill_c16_commit_kernel<StateT>,
               dim3(static_cast<unsigned>(HV), static_cast<unsigned>(N)), dim3(fkda_c16::kCommitThreads), 0, a, pool);
  ws.release(stream);
}

int64_t kda_prefill_workspace_bytes(int64_t total_tokens, int64_t num_seqs, int64_t value_heads) {
  return chunk64_workspace(total_tokens, num_seqs, value_heads) + kGuardBytes + final_copy_bytes(num_seqs, value_heads);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill, kda_prefill);
// written: final_state, checkpoints, out, workspace; the pool
FKDA_EXPORT_CHECKED(kda_prefill, (1u << 9) | (1u << 11) | (1u << 12) | (1u << 13), 8, 9);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill_workspace_bytes, kda_prefill_workspace_bytes);
FKDA_EXPORT_CONTRACT();
