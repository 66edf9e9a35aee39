// TVM-FFI binding of the role-split fused 16-token-chunk prefill (kda_prefill_c16ws.cuh; family kda_prefill, the ABI
// of kda_prefill.cu; modules prefill_c16ws_*, routes fused_chunk16*): every gate, one CTA a (value head, sequence).
// No workspace (a caller's buffer is checked and left unused); refuses checkpoints.
#include <cuda_runtime.h>

#include "../common/binding.h"
#include "../common/cuda_launch.h"
#include "kda_prefill_args.h"
#include "kda_prefill_c16_launch.h"

#ifdef FKDA_PARAM_CHUNK
static_assert(FKDA_PARAM_CHUNK == fkda_c16::kC, "the kernel is written for chunk 16");
#endif
static_assert(fkda_c16::kPieces == 1, "this binding runs the role-split kernel unsplit (its pieces: kda_prefill_c16g.cu)");
static_assert(FKDA_THREADS == fkda_c16::ws::kWsThreads, "module record 'threads' must be 384");
static_assert(FKDA_SMEM_BYTES == fkda_c16::ws::kWsSmemBytes,
              "module record 'smem_bytes' must equal the kernel's shared memory");

namespace {

using namespace fkda;

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
  const int64_t H = pc.dm.H, HV = pc.dm.HV, V = pc.dm.V, K = pc.dm.K, N = pc.N;
  FKDA_CHECK(!checkpoints.has_value(), fn)
      << "argument 'checkpoints': this module (16-token chunks) writes no checkpoints; use a chunk-64 module";
  (void)checkpoint_every;

  const PrefillStates ps = prefill_state_args(ck, q, initial_state, final_state, state_indices, N, HV, V, K);
  if (workspace.has_value()) {
    const TensorView& w = workspace.value();
    ck.same_device(w, "workspace", q, "q");
    ck.dtype(w, "workspace", {kU8});
    ck.contiguous(w, "workspace");
  }

  const fkda::cuda::LaunchContext ctx(q);
  const fkda_c16::Args a = c16_args(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, N, H, HV, initial_state,
                                    final_state, state_indices, ps, null_slot0, out, lower_bound, scale,
                                    beta_is_logit);
  launch_c16ws<StateT>(ctx, a, pc.gm, lower_bound);
}

int64_t kda_prefill_workspace_bytes(int64_t, int64_t, int64_t) { return 0; }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill, kda_prefill);
// written: final_state, checkpoints, out, workspace; the pool
FKDA_EXPORT_CHECKED(kda_prefill, (1u << 9) | (1u << 11) | (1u << 12) | (1u << 13), 8, 9);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill_workspace_bytes, kda_prefill_workspace_bytes);
FKDA_EXPORT_CONTRACT();
