// CPU backend, family fused_kda_decode: per row, the width-4 causal depthwise conv over the packed
// q|k|v projection with its cache (in place), SiLU, the KDA step on the state pool (in place), and
// the gated RMSNorm: out = rmsnorm(o) * norm_weight * sigmoid(output_gate). Value heads = key heads
// (group size 1) and K = V = D.
#include <cmath>
#include <vector>

#include "../common/fused_layout.h"
#include "../common/kda_cpu.h"
#include "../common/pool_args.h"

namespace {

using fkda::Checker;
using fkda::OptTensor;
using fkda::TensorView;
namespace cpu = fkda::cpu;

constexpr int64_t kConvWidth = fkda::kFusedConvWidth;

void fused_kda_decode(TensorView x, TensorView conv_weight, TensorView conv_state, TensorView g,
                      TensorView beta, OptTensor A_log, OptTensor dt_bias, TensorView state_indices,
                      TensorView state, TensorView output_gate, TensorView norm_weight, TensorView out,
                      int64_t gate_mode, double lower_bound, double scale, double norm_eps,
                      bool null_slot0) {
  const Checker c("fused_kda_decode");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{x, "x"},
                                {conv_weight, "conv_weight"}, {conv_state, "conv_state"}, {g, "g"},
                                {beta, "beta"}, {state_indices, "state_indices"}, {state, "state"},
                                {output_gate, "output_gate"}, {norm_weight, "norm_weight"}, {out, "out"}}) {
    c.device_type(t, name, kDLCPU);
  }
  // the pool's slots may sit apart (pool_slot_stride below); the rows and caches engines hand over as
  // they hold them: fused_layout.h
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{state_indices, "state_indices"},
                                {norm_weight, "norm_weight"}, {out, "out"}})
    c.contiguous(t, name);
  const fkda::FusedHeads heads = fkda::fused_heads(c, g, 3, "[rows, H, D]");
  const int64_t rows = g.size(0), H = heads.H, D = heads.D, HD = H * D, C = 3 * HD;
  c.shape(x, "x", {{"rows", rows}, {"3*H*D", C}});
  const int64_t slots = fkda::pool_slots(c, state, "[slots, H, D, D]", {"H", H}, {"D", D}, {"D", D});
  c.shape(beta, "beta", {{"rows", rows}, {"H", H}});
  c.shape(state_indices, "state_indices", {{"rows", rows}});
  c.shape(output_gate, "output_gate", {{"rows", rows}, {"H", H}, {"D", D}});
  c.shape(norm_weight, "norm_weight", {{"D", D}});
  c.shape(out, "out", {{"rows", rows}, {"H", H}, {"D", D}});
  const fkda::FusedLayout lay =
      fkda::fused_decode_layout(c, x, g, beta, output_gate, conv_state, conv_weight, slots, H, D);

  cpu::check_fused_dtypes(c, x, g, beta, output_gate, conv_state, out, conv_weight, norm_weight, state);
  c.dtype(state_indices, "state_indices", {fkda::kI32});
  const int64_t slot_stride = fkda::checked_pool_stride(c, state, "state", FKDA_SLOT_OFFSET_BITS, false);
  fkda::pool_offsets_fit(c, "conv_state", lay.cs_span, FKDA_SLOT_OFFSET_BITS);

  const fkda::GateMode mode = c.gate_mode(gate_mode);
  c.lower_bound(mode, lower_bound);
  c.gate_params(mode, A_log, dt_bias, H, D, x, "x");
  c.positive_finite(scale, "scale");
  c.positive_finite(norm_eps, "norm_eps");
  c.slot_indices_host(state_indices, "state_indices", slots);

  const cpu::Gate gate = cpu::make_gate(mode, lower_bound, A_log, dt_bias);
  const fkda::FloatSpan xs = cpu::span_of(x), ws = cpu::span_of(conv_weight), cs = cpu::span_of(conv_state),
                        os = cpu::span_of(out);
  const cpu::FusedStepIO io{cpu::span_of(g), cpu::span_of(beta), cpu::span_of(output_gate), os,
                            fkda::data_ptr<const float>(norm_weight), scale, norm_eps,
                            lay.g_row, lay.beta_row, lay.og_row};
  const int32_t* idx = fkda::data_ptr<const int32_t>(state_indices);

  std::vector<double> xrow(C), w(C * kConvWidth), win(C * (kConvWidth - 1)), y(C);
  cpu::FusedScratch scratch(D);
  for (int64_t ch = 0; ch < C; ++ch)  // w[ch][tap], whichever of the two layouts conv_weight has
    for (int64_t t = 0; t < kConvWidth; ++t)
      w[ch * kConvWidth + t] = ws.get((ch / HD) * lay.w_part + (ch % HD) * lay.w_ch + t * lay.w_w);
  cpu::with_state_type(fkda::float_kind(state.dtype()), [&](auto tag) {
    using TS = decltype(tag);
    TS* pool = fkda::data_ptr<TS>(state);
    for (int64_t r = 0; r < rows; ++r) {
      if (cpu::is_padding(idx[r], null_slot0)) {
        os.fill_zero(r * HD, HD);
        continue;
      }
      const int64_t slot = idx[r];
      // conv over [cache oldest..newest, x], SiLU; then the cache shifts left and keeps x last.
      xs.load(r * lay.x_row, C, xrow.data());
      const int64_t cbase = slot * lay.cs_slot;
      for (int64_t ch = 0; ch < C; ++ch)
        for (int64_t t = 0; t < kConvWidth - 1; ++t)
          win[ch * (kConvWidth - 1) + t] = cs.get(cbase + ch * lay.cs_ch + t * lay.cs_w);
      for (int64_t ch = 0; ch < C; ++ch) {
        const double* wc = w.data() + ch * kConvWidth;
        double* sc = win.data() + ch * (kConvWidth - 1);
        double acc = wc[kConvWidth - 1] * xrow[ch];
        for (int64_t t = 0; t < kConvWidth - 1; ++t) acc += wc[t] * sc[t];
        y[ch] = acc * cpu::sigmoid(acc);
        for (int64_t t = 0; t + 1 < kConvWidth - 1; ++t) sc[t] = sc[t + 1];
        sc[kConvWidth - 2] = xrow[ch];
      }
      for (int64_t ch = 0; ch < C; ++ch)
        for (int64_t t = 0; t < kConvWidth - 1; ++t)
          cs.store(cbase + ch * lay.cs_ch + t * lay.cs_w, 1, &win[ch * (kConvWidth - 1) + t]);

      double* q = y.data();
      double* k = y.data() + HD;
      const double* v = y.data() + 2 * HD;
      TS* slot_state = pool + slot * slot_stride;
      cpu::fused_token_step(slot_state, q, k, v, r, H, D, gate, io, scratch);
    }
  });
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_kda_decode, fused_kda_decode);
// written: conv_state, state, out
FKDA_EXPORT_CHECKED(fused_kda_decode, (1u << 2) | (1u << 8) | (1u << 11), -1, -1);
FKDA_EXPORT_CONTRACT();
