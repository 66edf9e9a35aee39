// CPU backend, family fused_kda_verify: the fused decode (conv with its cache, SiLU, KDA step,
// gated RMSNorm; csrc/cpu/fused_kda_decode_cpu.cc) over each request's T_n draft tokens, the state
// after every token stored to its own slot as in kda_verify (docs/semantics.md, "Fused verify").
//
// Conv cache line of request n: conv_state[state_indices[n, 0]], [3*H*D, L] with L >= T_max + 2.
// With o = num_accepted_tokens[n] - 1 the three inputs before the first token are line[:, o:o+3];
// afterwards line[:, 0:2] = old line[:, o+1:o+3] and line[:, 2 + j] = token j's input, so the next
// call's window at its accepted offset is the three inputs up to that token.
#include <cmath>
#include <vector>

#include "../common/verify_cpu.h"

namespace {

using fkda::Checker;
using fkda::OptTensor;
using fkda::TensorView;
namespace cpu = fkda::cpu;

constexpr int64_t kConvWidth = 4;

void fused_kda_verify(TensorView x, TensorView conv_weight, TensorView conv_state, TensorView g, TensorView beta,
                      OptTensor A_log, OptTensor dt_bias, TensorView state, TensorView output_gate,
                      TensorView norm_weight, TensorView state_indices, TensorView cu_seqlens,
                      OptTensor num_accepted_tokens, TensorView out, int64_t gate_mode, double lower_bound,
                      double scale, double norm_eps, bool null_slot0) {
  const Checker c("fused_kda_verify");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{x, "x"}, {conv_weight, "conv_weight"},
                                {conv_state, "conv_state"}, {g, "g"}, {beta, "beta"}, {state, "state"},
                                {output_gate, "output_gate"}, {norm_weight, "norm_weight"},
                                {state_indices, "state_indices"}, {cu_seqlens, "cu_seqlens"}, {out, "out"}}) {
    c.device_type(t, name, kDLCPU);
    if (&t != &state) c.contiguous(t, name);  // the pool's slots may sit apart: pool_slot_stride below
  }
  const fkda::FusedHeads heads = fkda::fused_heads(c, g, 4, "[1, T, H, D]");
  const int64_t T = g.size(1), H = heads.H, D = heads.D, HD = H * D, C = 3 * HD;
  c.shape(g, "g", {{"1", 1}, {"T", T}, {"H", H}, {"D", D}});
  c.shape(x, "x", {{"1", 1}, {"T", T}, {"3*H*D", C}});
  c.shape(conv_weight, "conv_weight", {{"3*H*D", C}, {"width", kConvWidth}});
  const int64_t slots = fkda::pool_slots(c, state, "[slots, H, D, D]", {"H", H}, {"D", D}, {"D", D});
  const fkda::SlotTable table = fkda::slot_table(c, state_indices);
  const int64_t N = table.N, cols = table.cols;
  c.ndim(conv_state, "conv_state", 3, "[slots, 3*H*D, L]");
  const int64_t L = conv_state.size(2);
  c.shape(conv_state, "conv_state", {{"slots", slots}, {"3*H*D", C}, {"L", L}});
  if (L < cols + 2) {
    FKDA_FAIL(c.fn()) << "argument 'conv_state' must keep L >= T_max + 2 = " << cols + 2
                      << " inputs a line, got L = " << L;
  }
  c.shape(beta, "beta", {{"1", 1}, {"T", T}, {"H", H}});
  c.shape(output_gate, "output_gate", {{"1", 1}, {"T", T}, {"H", H}, {"D", D}});
  c.shape(norm_weight, "norm_weight", {{"D", D}});
  c.shape(out, "out", {{"1", 1}, {"T", T}, {"H", H}, {"D", D}});
  c.shape(cu_seqlens, "cu_seqlens", {{"N+1", N + 1}});
  cpu::check_fused_dtypes(c, x, g, beta, output_gate, conv_state, out, conv_weight, norm_weight, state);
  c.dtype(state_indices, "state_indices", {fkda::kI32});
  c.dtype(cu_seqlens, "cu_seqlens", {fkda::kI32});
  cpu::check_accepted_tokens(c, num_accepted_tokens, N);
  const int64_t slot_stride = fkda::checked_pool_stride(c, state, "state", FKDA_SLOT_OFFSET_BITS, false);
  c.offsets_fit(conv_state, "conv_state", FKDA_SLOT_OFFSET_BITS);
  const fkda::GateMode mode =
      fkda::gate_and_scale(c, gate_mode, lower_bound, A_log, dt_bias, H, D, x, "x", scale);
  c.positive_finite(norm_eps, "norm_eps");

  const cpu::VerifyPlan plan =
      cpu::verify_host_plan(c, state_indices, cu_seqlens, num_accepted_tokens, T, table, slots, null_slot0);

  // ---- the recurrence ----------------------------------------------------------------------
  const cpu::Gate gate = cpu::make_gate(mode, lower_bound, A_log, dt_bias);
  const fkda::FloatSpan xs = cpu::span_of(x), ws = cpu::span_of(conv_weight), cs = cpu::span_of(conv_state),
                        os = cpu::span_of(out);
  const cpu::FusedStepIO io{cpu::span_of(g), cpu::span_of(beta), cpu::span_of(output_gate), os,
                            fkda::data_ptr<const float>(norm_weight), scale, norm_eps, H * D, H, H * D};
  std::vector<double> w(C * kConvWidth), line(C * L), hist, y(C);
  cpu::FusedScratch scratch(D);
  ws.load(0, C * kConvWidth, w.data());
  cpu::with_state_type(fkda::float_kind(state.dtype()), [&](auto tag) {
    using TS = decltype(tag);
    TS* pool = fkda::data_ptr<TS>(state);
    std::vector<TS> work(H * D * D);  // the request's state between tokens, in the pool's dtype
    for (int64_t n = 0; n < N; ++n) {
      const int64_t len = plan.off[n + 1] - plan.off[n];
      if (len == 0) continue;  // an empty request: its conv line and slots untouched
      const int32_t read = plan.idx[n * cols + plan.read_col[n]], line_slot = plan.idx[n * cols];
      if (plan.pad(read) || plan.pad(line_slot)) {
        os.fill_zero(plan.off[n] * HD, len * HD);
        continue;
      }
      // hist[ch][0..2]: the three inputs before the first token; hist[ch][3 + j]: token j's input
      const int64_t o = plan.read_col[n], HL = kConvWidth - 1 + len;
      cs.load(line_slot * C * L, C * L, line.data());
      hist.assign(C * HL, 0.0);
      for (int64_t ch = 0; ch < C; ++ch) {
        for (int64_t i = 0; i < kConvWidth - 1; ++i) hist[ch * HL + i] = line[ch * L + o + i];
      }
      for (int64_t j = 0; j < len; ++j) {
        xs.load((plan.off[n] + j) * C, C, y.data());
        for (int64_t ch = 0; ch < C; ++ch) hist[ch * HL + kConvWidth - 1 + j] = y[ch];
      }
      const TS* src = pool + static_cast<int64_t>(read) * slot_stride;
      std::copy(src, src + H * D * D, work.begin());
      for (int64_t j = 0; j < len; ++j) {
        const int64_t r = plan.off[n] + j;
        for (int64_t ch = 0; ch < C; ++ch) {  // the conv in fused_kda_decode's order: x term first
          const double* wc = w.data() + ch * kConvWidth;
          const double* hc = hist.data() + ch * HL + j;
          double acc = wc[kConvWidth - 1] * hc[kConvWidth - 1];
          for (int64_t t = 0; t < kConvWidth - 1; ++t) acc += wc[t] * hc[t];
          y[ch] = acc * cpu::sigmoid(acc);
        }
        double* q = y.data();
        double* k = y.data() + HD;
        const double* v = y.data() + 2 * HD;
        cpu::fused_token_step(work.data(), q, k, v, r, H, D, gate, io, scratch);
        const int32_t dst = plan.idx[n * cols + j];
        if (!plan.pad(dst)) std::copy(work.begin(), work.end(), pool + static_cast<int64_t>(dst) * slot_stride);
      }
      // the line after the call: the two inputs before the first token, then every token's input
      for (int64_t ch = 0; ch < C; ++ch) {
        double* lc = line.data() + ch * L;
        const double* hc = hist.data() + ch * HL;
        for (int64_t i = 0; i < kConvWidth - 2 + len; ++i) lc[i] = hc[1 + i];
      }
      cs.store(line_slot * C * L, C * L, line.data());
    }
  });
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_kda_verify, fused_kda_verify);
// written: conv_state (2), state (7), out (13)
FKDA_EXPORT_CHECKED(fused_kda_verify, (1u << 2) | (1u << 7) | (1u << 13), -1, -1);
FKDA_EXPORT_CONTRACT();
