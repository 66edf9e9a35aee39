// TVM-FFI binding of the family fused_kda_verify on sm_90a (contract: docs/architecture.md;
// semantics: docs/semantics.md, "Fused verify"). One CTA per (request, head): see
// fused_kda_verify_kernels.cuh. The index values live on the device and are never read here: the
// kernel treats a read entry or a column-0 entry that is negative, 0 with null_slot0, or >= slots,
// and a count outside [1, T_max], as a padding request, and a token entry that is padding as "not
// stored".
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/binding.h"
#include "common/cuda_launch.h"
#include "common/verify_module.h"
#include "common/verify_cuda.h"

#if !defined(FKDA_PARAM_LANES_PER_ROW) || !defined(FKDA_CONTRACT_JSON)
#error "fused_kda_verify.cu is built from a module record: FKDA_PARAM_LANES_PER_ROW missing"
#endif

#include "fused_kda_verify_kernels.cuh"
#include "fused_decode/fused_params.h"

namespace {

using namespace fkda::verify_module;

void fused_kda_verify(TensorView x, TensorView conv_weight, TensorView conv_state, TensorView g, TensorView beta,
                      Optional<TensorView> A_log, Optional<TensorView> dt_bias, TensorView state,
                      TensorView output_gate, TensorView norm_weight, TensorView state_indices,
                      TensorView cu_seqlens, Optional<TensorView> num_accepted_tokens, TensorView out,
                      int64_t gate_mode, double lower_bound, double scale, double norm_eps, bool null_slot0) {
  constexpr int64_t D = FKDA_HEAD_DIM_K;
  static_assert(FKDA_HEAD_DIM_K == 128 && FKDA_HEAD_DIM_V == 128, "the fused verify kernel is written for D = 128");
  const Checker c("fused_kda_verify");
  c.device_type(out, "out", kDLCUDA);
  c.ndim(g, "g", 4, "[1, T, H, D]");
  const int64_t T = g.size(1), H = g.size(2), C = 3 * H * D;
  c.head_dims(g.size(3), g.size(3));
  c.heads(H, H, "g", "g");
  if (T >= (int64_t(1) << 24)) FKDA_FAIL(c.fn()) << "at most 2^24 tokens per call, got " << T;
  fkda_fused::check_bf16_input(c, g, "g", {{"1", 1}, {"T", T}, {"H", H}, {"D", D}}, out);
  fkda_fused::check_bf16_input(c, x, "x", {{"1", 1}, {"T", T}, {"3*H*D", C}}, out);
  fkda_fused::check_bf16_input(c, beta, "beta", {{"1", 1}, {"T", T}, {"H", H}}, out);
  fkda_fused::check_bf16_input(c, output_gate, "output_gate", {{"1", 1}, {"T", T}, {"H", H}, {"D", D}}, out);
  fkda_fused::check_bf16_input(c, out, "out", {{"1", 1}, {"T", T}, {"H", H}, {"D", D}}, out);
  fkda_fused::check_fused_weights(c, conv_weight, norm_weight, C, D, out);
  const fkda::SlotTable table = fkda::verify_slot_table(c, state_indices, T, "x", "", out);
  const int64_t N = table.N, cols = table.cols;
  fkda::check_verify_indices(c, state_indices, cu_seqlens, num_accepted_tokens, N, out);
  const fkda::PoolLayout pool = fkda::verify_pool(c, state, {"H", H}, {"D", D}, {"D", D}, out);
  const int64_t slots = pool.slots;
  fkda::check_cuda_device(c, conv_state, "conv_state", out, "out");
  c.ndim(conv_state, "conv_state", 3, "[slots, 3*H*D, L]");
  const int64_t L = conv_state.size(2);
  c.shape(conv_state, "conv_state", {{"slots", slots}, {"3*H*D", C}, {"L", L}});
  if (L < cols + 2) {
    FKDA_FAIL(c.fn()) << "argument 'conv_state' must keep L >= T_max + 2 = " << cols + 2 << " inputs a line, got "
                      << L;
  }
  c.dtype(conv_state, "conv_state", {fkda::kBF16});
  c.contiguous(conv_state, "conv_state");
  c.offsets_fit(conv_state, "conv_state", FKDA_SLOT_OFFSET_BITS);
  fkda::gate_and_scale(c, gate_mode, lower_bound, A_log, dt_bias, H, D, out, "out", scale);
  c.positive_finite(norm_eps, "norm_eps");

  fkda_fused_verify::FusedVerifyParams vp;
  vp.f = fkda_fused::fused_params(x, conv_weight, conv_state, g, beta, A_log, dt_bias, state_indices, state,
                                  output_gate, norm_weight, out, slots, pool.slot_stride, T, H, gate_mode,
                                  lower_bound, scale, norm_eps, null_slot0,
                                  fkda::dense_fused_layout(slots, H, D));
  vp.conv_len = L;
  vp.cu_seqlens = fkda::data_ptr<const int32_t>(cu_seqlens);
  vp.accepted = num_accepted_tokens.has_value() ? fkda::data_ptr<const int32_t>(num_accepted_tokens.value())
                                                : nullptr;
  vp.index_cols = static_cast<int>(cols);
  if (N * H > INT32_MAX / 2) FKDA_FAIL(c.fn()) << "N * H = " << N * H << " is too large for one call";
  const fkda::cuda::LaunchContext ctx(out);
  ctx.launch("fused_kda_verify_row_kernel",
             fkda_fused_verify::fused_kda_verify_row_kernel<kStateBf16, FKDA_THREADS, OffT>,
             dim3(static_cast<unsigned>(N * H)), dim3(FKDA_THREADS), FKDA_SMEM_BYTES, vp);
}

tvm::ffi::String fkda_contract() { return tvm::ffi::String(FKDA_CONTRACT_JSON); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_kda_verify, fused_kda_verify);
// written: conv_state (2), state (7), out (13)
FKDA_EXPORT_CHECKED(fused_kda_verify, (1u << 2) | (1u << 7) | (1u << 13), -1, -1);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fkda_contract, fkda_contract);
