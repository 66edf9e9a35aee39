// Host side: the FusedParams fields fused_kda_decode and fused_kda_verify fill the same way, and the
// bf16 input check both bindings use. Include after fused_decode/fused_kda_decode_kernels.cuh.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "common/binding.h"
#include "common/cuda_launch.h"
#include "common/fused_layout.h"
#include "common/param_fill.h"

namespace fkda_fused {

// A bf16 input on ref's device (named "out" in the messages), of shape dims, contiguous unless `dense`
// is false (the fused decode's rows and caches: fused_layout.h checks their layouts).
inline void check_bf16_input(const fkda::Checker& c, const fkda::TensorView& t, const char* name,
                             std::initializer_list<fkda::Dim> dims, const fkda::TensorView& ref,
                             bool dense = true) {
  fkda::check_cuda_device(c, t, name, ref, "out");
  c.shape(t, name, dims);
  c.dtype(t, name, {fkda::kBF16});
  if (dense) c.contiguous(t, name);
}

// conv_weight bf16 or float32 and norm_weight [D] float32, contiguous, on ref's device. conv_weight's
// shape and layout: [3*H*D, 4] contiguous unless `layout_elsewhere` (the fused decode: fused_layout.h).
inline void check_fused_weights(const fkda::Checker& c, const fkda::TensorView& conv_weight,
                                const fkda::TensorView& norm_weight, int64_t C, int64_t D,
                                const fkda::TensorView& ref, bool layout_elsewhere = false) {
  fkda::check_cuda_device(c, conv_weight, "conv_weight", ref, "out");
  if (!layout_elsewhere) c.shape(conv_weight, "conv_weight", {{"3*H*D", C}, {"width", kConvWidth}});
  c.dtype(conv_weight, "conv_weight", {fkda::kBF16, fkda::kF32});
  if (!layout_elsewhere) c.contiguous(conv_weight, "conv_weight");
  fkda::check_cuda_device(c, norm_weight, "norm_weight", ref, "out");
  c.shape(norm_weight, "norm_weight", {{"D", D}});
  c.dtype(norm_weight, "norm_weight", {fkda::kF32});
  c.contiguous(norm_weight, "norm_weight");
}

inline FusedParams fused_params(const fkda::TensorView& x, const fkda::TensorView& conv_weight,
                                const fkda::TensorView& conv_state, const fkda::TensorView& g,
                                const fkda::TensorView& beta, const fkda::OptTensor& A_log,
                                const fkda::OptTensor& dt_bias, const fkda::TensorView& state_indices,
                                const fkda::TensorView& state, const fkda::TensorView& output_gate,
                                const fkda::TensorView& norm_weight, const fkda::TensorView& out, int64_t slots,
                                int64_t slot_stride, int64_t rows, int64_t H, int64_t gate_mode, double lower_bound, double scale,
                                double norm_eps, bool null_slot0, const fkda::FusedLayout& lay) {
  FusedParams p;
  p.x = fkda::data_ptr<const bf16>(x);
  p.conv_weight = fkda::data_ptr<const void>(conv_weight);
  p.conv_state = fkda::data_ptr<bf16>(conv_state);
  p.g = fkda::data_ptr<const bf16>(g);
  p.beta = fkda::data_ptr<const bf16>(beta);
  p.A_log = A_log.has_value() ? fkda::data_ptr<const float>(A_log.value()) : nullptr;
  p.dt_bias = dt_bias.has_value() ? fkda::data_ptr<const float>(dt_bias.value()) : nullptr;
  p.idx = fkda::data_ptr<const int32_t>(state_indices);
  p.state = fkda::data_ptr<void>(state);
  p.output_gate = fkda::data_ptr<const bf16>(output_gate);
  p.norm_weight = fkda::data_ptr<const float>(norm_weight);
  p.out = fkda::data_ptr<bf16>(out);
  p.num_slots = slots;
  p.slot_stride = slot_stride;
  p.rows = static_cast<int>(rows);
  p.H = static_cast<int>(H);
  fkda::set_gate_scale(p, gate_mode, lower_bound, scale);
  p.norm_eps = static_cast<float>(norm_eps);
  p.null_slot0 = null_slot0 ? 1 : 0;
  p.w_f32 = fkda::same_dtype(conv_weight.dtype(), fkda::kF32) ? 1 : 0;
  p.x_row = lay.x_row;
  p.g_row = lay.g_row;
  p.beta_row = lay.beta_row;
  p.og_row = lay.og_row;
  p.cs_slot = lay.cs_slot;
  p.cs_ch = lay.cs_ch;
  p.cs_w = lay.cs_w;
  p.w_part = lay.w_part;
  p.w_ch = lay.w_ch;
  p.w_w = lay.w_w;
  return p;
}

}  // namespace fkda_fused
