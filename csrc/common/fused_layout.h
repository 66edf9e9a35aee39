// The layouts fused_kda_decode reads, shared by its CPU and CUDA bindings (the Python rule:
// flashkda_ext/validation/fused_decode.py, its row-strided companions, _conv_cache and _conv_weight): an
// engine's tensors as it holds them, so an adapter passes them without a copy (vLLM 0.34's Kimi K3 native decode: x, beta and output_gate are
// column slices of one projection, the conv cache shares a paged cache with the state pool in either of
// vLLM's two conv layouts, the conv weight is its width-major decode copy).
//   x [rows, 3*H*D], g [rows, H, D], beta [rows, H], output_gate [rows, H, D]: each row dense, the rows any
//     stride >= one row apart (row_stride.h);
//   conv_state [slots, 3*H*D, 3]: each slot channel-major (strides (., 3, 1)) or width-major ((., 1, 3*H*D),
//     vLLM's default "SD" layout seen through a transpose), the slots any stride >= one slot apart;
//   conv_weight [3*H*D, 4] or [3, 4, H*D] (width-major per q | k | v part), contiguous.
// The kernels read all of them element by element: no alignment rule beyond the element's.
#pragma once

#include <cstdint>

#include "binding.h"
#include "row_stride.h"

namespace fkda {

constexpr int64_t kFusedConvWidth = 4;  // the conv cache keeps kFusedConvWidth - 1 previous inputs

struct FusedLayout {
  int64_t x_row, g_row, beta_row, og_row;  // elements between consecutive rows
  int64_t cs_slot, cs_ch, cs_w;            // conv_state: slot, channel, tap
  // conv_weight: channel part * H*D + j (part 0 q, 1 k, 2 v), tap w at part * w_part + j * w_ch + w * w_w
  int64_t w_part, w_ch, w_w;
  int64_t cs_span;                         // elements from conv_state's first to one past its last
};

// Dense tensors throughout (what fused_kda_verify reads).
inline FusedLayout dense_fused_layout(int64_t slots, int64_t H, int64_t D) {
  const int64_t HD = H * D, C = 3 * HD, W1 = kFusedConvWidth - 1;
  return FusedLayout{C, HD, H, HD, C * W1, W1, 1, HD * kFusedConvWidth, kFusedConvWidth, 1, slots * C * W1};
}

// conv_state and conv_weight of an H x D fused decode (shapes and the rows' layouts checked here;
// shapes of x, g, beta, output_gate checked before).
inline FusedLayout fused_decode_layout(const Checker& c, const TensorView& x, const TensorView& g,
                                       const TensorView& beta, const TensorView& output_gate,
                                       const TensorView& conv_state, const TensorView& conv_weight, int64_t slots,
                                       int64_t H, int64_t D) {
  const int64_t HD = H * D, C = 3 * HD, W1 = kFusedConvWidth - 1;
  FusedLayout l{};
  l.x_row = row_stride(c, x, "x", 0);
  l.g_row = row_stride(c, g, "g", 0);
  l.beta_row = row_stride(c, beta, "beta", 0);
  l.og_row = row_stride(c, output_gate, "output_gate", 0);

  c.ndim(conv_state, "conv_state", 3, "[slots, 3*H*D, 3]");
  c.shape(conv_state, "conv_state", {{"slots", slots}, {"3*H*D", C}, {"width-1", W1}});
  l.cs_slot = conv_state.stride(0);
  l.cs_ch = conv_state.stride(1);
  l.cs_w = conv_state.stride(2);
  const bool channel_major = l.cs_ch == W1 && l.cs_w == 1;
  const bool width_major = l.cs_ch == 1 && l.cs_w == C;
  if (!(channel_major || width_major) || (slots > 1 && l.cs_slot < C * W1)) {
    FKDA_FAIL(c.fn()) << "argument 'conv_state' must hold each slot channel-major (strides [., 3, 1]) or "
                      << "width-major (strides [., 1, " << C << "]), the slots at least " << C * W1
                      << " elements apart, got shape " << shape_str(conv_state) << " with strides ["
                      << l.cs_slot << ", " << l.cs_ch << ", " << l.cs_w << "]";
  }
  if (slots <= 1) l.cs_slot = C * W1;  // a size-1 dim may carry any stride: never read
  l.cs_span = slots == 0 ? 0 : (slots - 1) * l.cs_slot + (C - 1) * l.cs_ch + (W1 - 1) * l.cs_w + 1;

  l.w_part = HD * kFusedConvWidth;  // a part's H*D x 4 taps, in either layout
  if (conv_weight.ndim() == 3) {
    c.shape(conv_weight, "conv_weight", {{"3", 3}, {"width", kFusedConvWidth}, {"H*D", HD}});
    l.w_ch = 1;
    l.w_w = HD;
  } else {
    c.shape(conv_weight, "conv_weight", {{"3*H*D", C}, {"width", kFusedConvWidth}});
    l.w_ch = kFusedConvWidth;
    l.w_w = 1;
  }
  c.contiguous(conv_weight, "conv_weight");
  return l;
}

}  // namespace fkda
