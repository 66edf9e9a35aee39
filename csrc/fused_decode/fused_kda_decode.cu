// TVM-FFI binding of the family fused_kda_decode on sm_90a (contract: docs/architecture.md).
// One source builds every fused decode module; the module record's macros pick the schedule:
//   FKDA_PARAM_SCHEDULE        0 tile (one (row, head) per cluster of FKDA_CLUSTER_X CTAs),
//                              2 sequential (one head per cluster, rows in order: repeated slots)
//   FKDA_PARAM_V_TILE          V-rows per CTA (= D / FKDA_CLUSTER_X)
//   FKDA_PARAM_LANES_PER_ROW   lanes sharing one V-row
//   FKDA_PARAM_STATE_SMEM      1: the state tile arrives by one bulk copy into dynamic shared memory
//                              (smem_bytes = v_tile * D * state element size), issued before the
//                              prologue's loads; 2: the same, issued after them; absent or 0: registers
//   FKDA_PARAM_BULK_STORE      1 (with state_smem): the updated tile goes back by one bulk copy
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/binding.h"
#include "common/cuda_launch.h"
#include "common/pool_args.h"

#if !defined(FKDA_PARAM_SCHEDULE) || !defined(FKDA_PARAM_V_TILE) || !defined(FKDA_PARAM_LANES_PER_ROW) || \
    !defined(FKDA_CONTRACT_JSON)
#error "fused_kda_decode.cu is built from a module record: FKDA_PARAM_SCHEDULE/V_TILE/LANES_PER_ROW missing"
#endif

#include "fused_kda_decode_kernels.cuh"
#include "fused_params.h"

namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;
using namespace fkda_fused;

constexpr bool kStateBf16 = FKDA_STATE_BF16 == 1;
using OffT = std::conditional_t<FKDA_SLOT_OFFSET_BITS == 64, int64_t, int32_t>;
static_assert(FKDA_SLOT_OFFSET_BITS == 32 || FKDA_SLOT_OFFSET_BITS == 64, "offset bits");
static_assert(FKDA_STATE_BF16 == 0 || FKDA_STATE_BF16 == 1, "CUDA modules fix the state dtype");
static_assert(FKDA_PARAM_SCHEDULE == 0 || FKDA_PARAM_SCHEDULE == 2, "schedule: 0 tile, 2 sequential");
static_assert(FKDA_CLUSTER_Y == 1 && FKDA_CLUSTER_Z == 1, "1-D clusters only");
static_assert(FKDA_PARAM_V_TILE * FKDA_CLUSTER_X == FKDA_HEAD_DIM_V, "a cluster covers all V-rows");
static_assert(FKDA_PERSISTENT_K == 0, "no persistent schedule here");
#ifndef FKDA_PARAM_STATE_SMEM
#define FKDA_PARAM_STATE_SMEM 0
#endif
static_assert(FKDA_PARAM_STATE_SMEM >= 0 && FKDA_PARAM_STATE_SMEM <= 2, "state_smem: 0, 1 or 2");
static_assert(FKDA_PARAM_STATE_SMEM == 0 || FKDA_PARAM_SCHEDULE == 0, "state_smem: tile schedule only");
#ifndef FKDA_PARAM_BULK_STORE
#define FKDA_PARAM_BULK_STORE 0
#endif
static_assert(FKDA_PARAM_BULK_STORE == 0 || (FKDA_PARAM_BULK_STORE == 1 && FKDA_PARAM_STATE_SMEM),
              "bulk_store: 0, or 1 with state_smem");
// state_smem = 1 or 2: the CTA's V_TILE x D state tile in dynamic shared memory; else static only
static_assert(FKDA_SMEM_BYTES == (FKDA_PARAM_STATE_SMEM ? FKDA_PARAM_V_TILE * FKDA_HEAD_DIM_K * (FKDA_STATE_BF16 ? 2 : 4) : 0),
              "smem_bytes must be v_tile * D * state element size with state_smem = 1 or 2, else 0");

#define FKDA_KERNEL_ARGS kStateBf16, FKDA_CLUSTER_X, FKDA_PARAM_V_TILE, FKDA_THREADS, OffT

using fkda::Checker;

void fused_kda_decode(TensorView x, TensorView conv_weight, TensorView conv_state, TensorView g,
                      TensorView beta, Optional<TensorView> A_log, Optional<TensorView> dt_bias,
                      TensorView state_indices, TensorView state, TensorView output_gate,
                      TensorView norm_weight, TensorView out, int64_t gate_mode, double lower_bound,
                      double scale, double norm_eps, bool null_slot0) {
  constexpr int64_t D = FKDA_HEAD_DIM_K;
  static_assert(FKDA_HEAD_DIM_K == 128 && FKDA_HEAD_DIM_V == 128,
                "the fused decode kernels are written for D = 128");
  const Checker c("fused_kda_decode");
  c.device_type(out, "out", kDLCUDA);
  c.ndim(g, "g", 3, "[rows, H, D]");
  const int64_t rows = g.size(0), H = g.size(1), HD = H * g.size(2), C = 3 * HD;
  c.head_dims(g.size(2), g.size(2));
  c.heads(H, H, "g", "g");
  if (rows >= (int64_t(1) << 24)) FKDA_FAIL(c.fn()) << "at most 2^24 rows per call, got " << rows;
  // the rows and the conv cache as an engine holds them (fused_layout.h, below)
  check_bf16_input(c, g, "g", {{"rows", rows}, {"H", H}, {"D", D}}, out, false);
  check_bf16_input(c, x, "x", {{"rows", rows}, {"3*H*D", C}}, out, false);
  check_bf16_input(c, beta, "beta", {{"rows", rows}, {"H", H}}, out, false);
  check_bf16_input(c, output_gate, "output_gate", {{"rows", rows}, {"H", H}, {"D", D}}, out, false);
  check_bf16_input(c, out, "out", {{"rows", rows}, {"H", H}, {"D", D}}, out);
  check_fused_weights(c, conv_weight, norm_weight, C, D, out, true);  // its layout: fused_decode_layout below
  fkda::check_cuda_device(c, state_indices, "state_indices", out, "out");
  c.shape(state_indices, "state_indices", {{"rows", rows}});
  c.dtype(state_indices, "state_indices", {fkda::kI32});
  c.contiguous(state_indices, "state_indices");
  fkda::check_cuda_device(c, state, "state", out, "out");
  c.ndim(state, "state", 4, "[slots, H, D, D]");
  const int64_t slots = state.size(0);
  c.shape(state, "state", {{"slots", slots}, {"H", H}, {"D", D}, {"D", D}});
  c.state_dtype(state, "state", {fkda::kF32, fkda::kBF16});
  // slots may sit apart (a paged cache), each one dense; offsets reach the pool's span
  const int64_t slot_stride = fkda::pool_slot_stride(c, state, "state");
  c.aligned(state, "state", 16);
  check_bf16_input(c, conv_state, "conv_state", {{"slots", slots}, {"3*H*D", C}, {"width-1", kConvWidth - 1}},
                   out, false);
  const fkda::FusedLayout lay = fkda::fused_decode_layout(c, x, g, beta, output_gate, conv_state, conv_weight,
                                                          slots, H, D);
  fkda::pool_offsets_fit(c, "state", fkda::pool_span(state, slot_stride), FKDA_SLOT_OFFSET_BITS);
  fkda::pool_offsets_fit(c, "conv_state", lay.cs_span, FKDA_SLOT_OFFSET_BITS);
  fkda::gate_and_scale(c, gate_mode, lower_bound, A_log, dt_bias, H, D, out, "out", scale);
  c.positive_finite(norm_eps, "norm_eps");
  if (rows == 0) return;

  const FusedParams p = fused_params(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state,
                                     output_gate, norm_weight, out, slots, slot_stride, rows, H, gate_mode,
                                     lower_bound, scale, norm_eps, null_slot0, lay);

  const fkda::cuda::LaunchContext ctx(out);
  const dim3 block(FKDA_THREADS);
#if FKDA_PARAM_SCHEDULE == 0
  ctx.launch("fused_kda_decode_tile_kernel", fused_kda_decode_tile_kernel<FKDA_KERNEL_ARGS, FKDA_PARAM_STATE_SMEM,
                                                                     FKDA_PARAM_BULK_STORE != 0>,
             dim3(static_cast<unsigned>(rows * H * FKDA_CLUSTER_X)), block, FKDA_SMEM_BYTES, p);
#else
  ctx.launch("fused_kda_decode_seq_kernel", fused_kda_decode_seq_kernel<FKDA_KERNEL_ARGS>,
             dim3(static_cast<unsigned>(H * FKDA_CLUSTER_X)), block, FKDA_SMEM_BYTES, p);
#endif
}

// The macros this module was compiled with, as JSON (rendered by flashkda_ext.jit.macros).
tvm::ffi::String fkda_contract() { return tvm::ffi::String(FKDA_CONTRACT_JSON); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_kda_decode, fused_kda_decode);
// written: conv_state, state, out
FKDA_EXPORT_CHECKED(fused_kda_decode, (1u << 2) | (1u << 8) | (1u << 11), -1, -1);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fkda_contract, fkda_contract);
