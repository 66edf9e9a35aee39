// Host side of the chunk-64 kernels (the prep, then the ordered state pass; kda_prefill_prep.cuh,
// kda_prefill_state.cuh), shared by their bindings: kda_prefill.cu (the kernels alone) and kda_prefill_c16g.cu (the
// fused 16-token kernel guarded by them). The arguments are checked by the binding before these run. The module's
// params fix the state pass's V tile, groups and pieces (kda_prefill.cu).
#pragma once

#include <cuda_runtime.h>

#include "../common/binding.h"
#include "../common/cuda_launch.h"
#include "../common/param_fill.h"
#include "../common/pool_args.h"
#include "kda_prefill_args.h"
#include "kda_prefill_prep.cuh"
#include "kda_prefill_state.cuh"

#ifndef FKDA_PARAM_SINGLE  // 1: a sequence of one chunk is finished inside the prep kernel (kda_prefill.cu)
#define FKDA_PARAM_SINGLE 0
#endif

namespace fkda {

// State-pass CTAs a (sequence, head): one per V tile group.
constexpr int kChunk64TileCtas = fkda_prefill::kV / (FKDA_PARAM_VT * fkda_prefill::kGroups);

// A piece-split module's pieces for this call: as many as one wave of state-pass CTAs holds (one CTA
// an SM: the state pass's shared memory), at most the module's kPieces, at least 1 (then the chain is
// walked whole: the unsplit module's operations, bitwise). From the device's SM count, so the same
// module fills an H200 (132 SMs) at 8 heads with 16 pieces and at 48 heads with 2.
inline int chunk64_state_pieces(const fkda::cuda::LaunchContext& ctx, int64_t N, int64_t HV) {
  if (fkda_prefill::kPieces == 1) return 1;
  return pieces_for_one_wave(fkda_prefill::kPieces, ctx.sm_count(), kChunk64TileCtas * HV * N);
}

// The chunk-64 kernels' workspace: the caller's (checked; its pointer rounded up to kWorkspaceAlign, within the slack
// workspace_bytes adds) or `need` bytes taken from the stream's pool, stream-ordered, so a call stays capturable in a
// CUDA graph (as memory nodes); release() gives back what was taken.
struct PrefillWorkspace {
  uint8_t* ptr = nullptr;
  bool own = false;
  PrefillWorkspace(const OptTensor& workspace, int64_t need, cudaStream_t stream) {
    if (workspace.has_value()) {
      const uintptr_t p = reinterpret_cast<uintptr_t>(data_ptr<uint8_t>(workspace.value()));
      const uintptr_t al = static_cast<uintptr_t>(fkda_prefill::kWorkspaceAlign);
      ptr = reinterpret_cast<uint8_t*>((p + al - 1) / al * al);
    } else if (need > 0) {
      FKDA_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ptr), need, stream), "cudaMallocAsync(workspace)");
      own = true;
    }
  }
  void release(cudaStream_t stream) {
    if (own) FKDA_CUDA_CHECK(cudaFreeAsync(ptr, stream), "cudaFreeAsync(workspace)");
    own = false;
  }
};

// What the two kernels read besides the token tensors (checked by the binding).
struct Chunk64Call {
  int64_t T, N, H, HV;
  void* checkpoints;  // or null
  int64_t ckpt_count, checkpoint_every;
  uint8_t* ws;        // aligned to fkda_prefill::kWorkspaceAlign
  int64_t gate_mode;
  double lower_bound, scale;
  bool beta_is_logit, null_slot0;
  const int* guard;   // (guarded modules) null: run; else only where the fused kernel before set the word
  int* chain = nullptr;  // (two-stage modules) the word kda_chain_decide_kernel sets to hand the call to the chain
};

// Launch the prep (when there are tokens), then the state pass (PDL between them).
template <typename StateT>
void launch_chunk64(const fkda::cuda::LaunchContext& ctx, const Chunk64Call& c, const TensorView& q,
                    const TensorView& k, const TensorView& v, const TensorView& g, const TensorView& beta,
                    const OptTensor& A_log, const OptTensor& dt_bias, const TensorView& cu_seqlens,
                    const OptTensor& initial_state, const OptTensor& final_state, const OptTensor& state_indices,
                    const PrefillStates& ps, const TensorView& out) {
  const char* fn = "kda_prefill";
  fkda_prefill::StateArgs sa;
  sa.ws = c.ws;
  sa.cu = data_ptr<void>(cu_seqlens);
  sa.cu64 = same_dtype(cu_seqlens.dtype(), kI64) ? 1 : 0;
  sa.N = static_cast<int>(c.N);
  sa.HV = static_cast<int>(c.HV);
  set_states(sa, initial_state, final_state, state_indices, ps, c.null_slot0);
  sa.ckpt = c.checkpoints;
  sa.ckpt_count = c.ckpt_count;
  sa.ckpt_every = c.checkpoint_every > 0 ? c.checkpoint_every : 1;
  sa.out = data_ptr<fkda_prefill::bf16>(out);
  sa.tma = 1;                  // the state pass moves chunks with bulk copies (TMA)
  sa.single = FKDA_PARAM_SINGLE;  // sequences of one chunk finished inside the prep kernel
  const int pieces = chunk64_state_pieces(ctx, c.N, c.HV);
#if FKDA_PARAM_PIECES > 1
  sa.init_copy = c.ws + fkda_prefill::init_copy_offset(c.T, c.N, c.HV);
  sa.pieces = pieces;
#endif
#if FKDA_PARAM_GUARD == 1
  sa.guard = c.guard;
#endif
#if FKDA_PARAM_CHAIN_GUARD == 1
  static_assert(FKDA_PARAM_GUARD == 1 && fkda_prefill::kPieces > 1 && fkda_prefill::kGroups == 1,
                "params.chain_guard: a guarded one-group piece-split module");
  FKDA_CHECK(c.chain != nullptr, fn) << "internal: a two-stage module without its chain word";
  sa.chain = c.chain;
  sa.stage = 0;
#endif
#if FKDA_PARAM_GUARD != 1
  FKDA_CHECK(c.guard == nullptr, fn) << "internal: a guard word for a module built without one";
#endif

  const int64_t slots_chunks = fkda_prefill::num_chunk_slots(c.T, c.N);
  if (c.T > 0) {
    fkda_prefill::PrepArgs pa;
    set_token_inputs(pa, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, c.N);
    fkda::set_heads(pa, c.H, c.HV);
    fkda::set_gate_scale(pa, c.gate_mode, c.lower_bound, c.scale);
    pa.beta_logit = c.beta_is_logit ? 1 : 0;
    pa.ws = c.ws;
    pa.st = sa;
    // one CTA a (chunk slot, value head), heads adjacent (see the kernel)
    FKDA_CHECK(slots_chunks * c.HV <= 0x7fffffff, fn) << "too many chunks x value heads: " << slots_chunks * c.HV;
    ctx.launch("kda_prep_lite_kernel", fkda_prefill::kda_prep_lite_kernel<StateT>,
               dim3(static_cast<unsigned>(slots_chunks * c.HV)), dim3(fkda_prefill::kLiteThreads),
               fkda_prefill::kLiteSmem, pa);
  }
#if FKDA_PARAM_CHAIN_GUARD == 1  // the piece pass or the chain, picked before either runs
  ctx.launch("kda_chain_decide_kernel", fkda_prefill::kda_chain_decide_kernel,
             dim3(static_cast<unsigned>(c.HV), static_cast<unsigned>(c.N)), dim3(32), 0, sa);
#endif
  using SM = fkda_prefill::StateSmem<FKDA_PARAM_VT>;
  ctx.launch("kda_state_kernel", fkda_prefill::kda_state_kernel<FKDA_PARAM_VT, fkda_prefill::default_ring<FKDA_PARAM_VT>(), StateT>,
             dim3(kChunk64TileCtas, static_cast<unsigned>(c.HV), static_cast<unsigned>(c.N * pieces)),
             dim3(FKDA_THREADS), SM::kTotal, sa);
#if FKDA_PARAM_CHAIN_GUARD == 1
  // the second stage: the unsplit chain at V tile 16 (the fastest chain a sequence) on the same prep's workspace,
  // where kda_chain_decide_kernel found a warm-up longer than its piece (the piece pass above then returned at once)
  constexpr int kChainVT = 16;
  using SM16 = fkda_prefill::StateSmem<kChainVT>;
  sa.stage = 1;
  sa.pieces = 1;
  ctx.launch("kda_state_kernel", fkda_prefill::kda_state_kernel<kChainVT, fkda_prefill::default_ring<kChainVT>(), StateT>,
             dim3(fkda_prefill::kV / kChainVT, static_cast<unsigned>(c.HV), static_cast<unsigned>(c.N)),
             dim3(FKDA_THREADS), SM16::kTotal, sa);
#endif
}

}  // namespace fkda
