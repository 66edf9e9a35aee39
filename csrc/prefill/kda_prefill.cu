// TVM-FFI binding of the sm_90a prefill kernels (family kda_prefill, docs/architecture.md).
//
// Exports: kda_prefill (the family ABI), kda_prefill_workspace_bytes(total_tokens, num_seqs,
// value_heads) -> bytes of the optional workspace argument, fkda_contract().
// FKDA_PARAM_VT: the value-column tile of the state pass (16, 32 or 64: one module per tile, picked
// by jit/routes/kda_prefill.json from sequences x heads); its chunk ring depth follows the tile
// (default_ring: 3 for tiles 16 and 32, 2 for 64: one CTA an SM).
// FKDA_PARAM_SINGLE: 1 = a sequence of one chunk is finished inside the prep kernel (its state update
// run by the same CTA; the state pass skips it). Wins with many CTAs (>= 256 sequences x heads
// measured), loses with few (the CTA's 4 serial rounds are exposed): a route band, not a default.
// FKDA_PARAM_GROUPS (kda_prefill_state.cuh; default 1): 4-warp groups a state-pass CTA, each its own
// V tile, sharing one copy of every chunk's side data (grid V / (VT x groups) x HV x N).
// FKDA_PARAM_PIECES (kda_prefill_layout.cuh; default 1 = one CTA walks a sequence's chunks): P > 1
// splits each sequence's state pass into up to P pieces run in parallel (chunk64_state_pieces in kda_prefill_chunk64_launch.h: one wave), each
// from a zero state after a warm-up that attenuates the dropped state below 2^-24 (kda_prefill_state.cuh,
// piece_start). Not
// exact, so it writes no checkpoints: a call with checkpoints is refused (the routes never send one).
#include <cuda_runtime.h>

#include "../common/binding.h"
#include "../common/cuda_launch.h"
#include "kda_prefill_args.h"
#include "kda_prefill_chunk64_launch.h"

#if !defined(FKDA_PARAM_VT) || (FKDA_PARAM_VT != 16 && FKDA_PARAM_VT != 32 && FKDA_PARAM_VT != 64)
#error "FKDA_PARAM_VT must be 16, 32 or 64"
#endif
#ifndef FKDA_PARAM_SINGLE
#define FKDA_PARAM_SINGLE 0
#endif
#if FKDA_PARAM_SINGLE != 0 && FKDA_PARAM_SINGLE != 1
#error "FKDA_PARAM_SINGLE must be 0 or 1"
#endif
#if FKDA_PARAM_PIECES > 1 && FKDA_PARAM_SINGLE != 0
#error "FKDA_PARAM_PIECES > 1 is built without FKDA_PARAM_SINGLE (its initial-state copy is the prep's multi-chunk path)"
#endif
// The module record states the state pass launch shape; keep it and the kernels in step.
static_assert(FKDA_THREADS == 128 * fkda_prefill::kGroups,
              "the state pass runs 4 warps a group (module record 'threads' = 128 x params.groups)");
static_assert(fkda_prefill::kV % (FKDA_PARAM_VT * fkda_prefill::kGroups) == 0, "groups x V tile must divide V");
#ifdef FKDA_PARAM_CHUNK
static_assert(FKDA_PARAM_CHUNK == fkda_prefill::kC, "the kernels are written for chunk 64");
#endif
static_assert(FKDA_SMEM_BYTES == fkda_prefill::StateSmem<FKDA_PARAM_VT>::kTotal,
              "module record 'smem_bytes' must equal the state pass shared memory of its V tile");

namespace {

using namespace fkda;
using fkda_prefill::bf16;

#if FKDA_STATE_BF16 == 1
using StateT = __nv_bfloat16;
#else
using StateT = float;
#endif

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
  const int64_t T = pc.dm.T, H = pc.dm.H, HV = pc.dm.HV, V = pc.dm.V, K = pc.dm.K, N = pc.N;
  const PrefillStates ps = prefill_state_args(ck, q, initial_state, final_state, state_indices, N, HV, V, K);
  int64_t ckpt_count = 0;
  if (checkpoints.has_value()) {
    const TensorView& t = checkpoints.value();
    ck.same_device(t, "checkpoints", q, "q");
    ck.state_dtype(t, "checkpoints", {kF32, kBF16});
    ck.ndim(t, "checkpoints", 5, "[N, C, HV, V, K]");
    ckpt_count = t.size(1);
    ck.shape(t, "checkpoints", {{"N", N}, {"C", ckpt_count}, {"HV", HV}, {"V", V}, {"K", K}});
    ck.contiguous(t, "checkpoints");
    FKDA_CHECK(fkda_prefill::kPieces == 1, fn)
        << "argument 'checkpoints': this module splits each sequence into up to " << fkda_prefill::kPieces
        << " pieces (not exact), so it writes no checkpoints; use a module without pieces";
    FKDA_CHECK(checkpoint_every > 0 && checkpoint_every % fkda_prefill::kC == 0, fn)
        << "argument 'checkpoint_every' must be a positive multiple of the chunk ("
        << fkda_prefill::kC << ") when checkpoints are given, got " << checkpoint_every;
  }
  const int64_t need = fkda_prefill::workspace_bytes(T, N, HV, sizeof(StateT));
  prefill_workspace_arg(ck, workspace, q, need);

  // device guard (restored on return), the caller's stream, per-device kernel attributes, PDL
  const fkda::cuda::LaunchContext ctx(q);
  PrefillWorkspace ws(workspace, need, ctx.stream());
  const Chunk64Call call{T, N, H, HV, checkpoints.has_value() ? data_ptr<void>(checkpoints.value()) : nullptr,
                         ckpt_count, checkpoint_every, ws.ptr, gate_mode, lower_bound, scale, beta_is_logit,
                         null_slot0, nullptr};
  launch_chunk64<StateT>(ctx, call, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, final_state,
                         state_indices, ps, out);
  ws.release(ctx.stream());
}

int64_t kda_prefill_workspace_bytes(int64_t total_tokens, int64_t num_seqs, int64_t value_heads) {
  return fkda_prefill::workspace_bytes(total_tokens, num_seqs, value_heads, sizeof(StateT));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill, kda_prefill);
// written: final_state, checkpoints, out, workspace; the pool
FKDA_EXPORT_CHECKED(kda_prefill, (1u << 9) | (1u << 11) | (1u << 12) | (1u << 13), 8, 9);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill_workspace_bytes, kda_prefill_workspace_bytes);
FKDA_EXPORT_CONTRACT();
