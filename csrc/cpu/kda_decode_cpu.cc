// CPU backend, family kda_decode: one token per row on a state pool [slots, HV, V, K], in place.
//
// Rows run in order, so rows that share a slot behave as sequential steps. A padding row
// (index < 0, or 0 with null_slot0) gets a zero output and touches no state.
#include <vector>

#include "../common/kda_cpu.h"
#include "../common/pool_args.h"
#include "../common/row_stride.h"

namespace {

using fkda::Checker;
using fkda::Dim;
using fkda::OptTensor;
using fkda::TensorView;
namespace cpu = fkda::cpu;

void kda_decode(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta,
                OptTensor A_log, OptTensor dt_bias, TensorView state, TensorView state_indices,
                TensorView out, int64_t gate_mode, double lower_bound, double scale,
                bool beta_is_logit, bool null_slot0) {
  const Checker c("kda_decode");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{q, "q"}, {k, "k"}, {v, "v"},
                                {g, "g"}, {beta, "beta"}, {state, "state"},
                                {state_indices, "state_indices"}, {out, "out"}}) {
    c.device_type(t, name, kDLCPU);
  }
  const fkda::QVHeads heads = fkda::qv_heads(c, q, v, 3, "[rows, H, K]", "[rows, HV, V]");
  const int64_t rows = q.size(0), H = heads.H, K = heads.K, HV = heads.HV, V = heads.V;
  c.shape(k, "k", {{"rows", rows}, {"H", H}, {"K", K}});
  c.shape(v, "v", {{"rows", rows}, {"HV", HV}, {"V", V}});
  c.shape(g, "g", {{"rows", rows}, {"HV", HV}, {"K", K}});
  c.shape(beta, "beta", {{"rows", rows}, {"HV", HV}});
  const int64_t slots = fkda::pool_slots(c, state, "[slots, HV, V, K]", {"HV", HV}, {"V", V}, {"K", K});
  c.shape(state_indices, "state_indices", {{"rows", rows}});
  c.shape(out, "out", {{"rows", rows}, {"HV", HV}, {"V", V}});

  fkda::cpu::check_input_dtypes(c, q, k, v, g, beta, out, /*gb_f32=*/true);
  c.state_dtype(state, "state", {fkda::kF32, fkda::kF64, fkda::kBF16});
  c.dtype(state_indices, "state_indices", {fkda::kI32});
  // the rows of q..beta may sit apart (views of a packed projection), each row dense
  const int64_t qr = fkda::row_stride(c, q, "q", 0), kr = fkda::row_stride(c, k, "k", 0),
                vr = fkda::row_stride(c, v, "v", 0), gr = fkda::row_stride(c, g, "g", 0),
                br = fkda::row_stride(c, beta, "beta", 0);
  c.contiguous(state_indices, "state_indices");
  c.contiguous(out, "out");
  // the pool's slots may sit apart (a paged cache); each slot is dense
  const int64_t slot_stride = fkda::checked_pool_stride(c, state, "state", FKDA_SLOT_OFFSET_BITS, false);

  const fkda::GateMode mode = c.gate_mode(gate_mode);
  c.lower_bound(mode, lower_bound);
  c.gate_params(mode, A_log, dt_bias, HV, K, q, "q");
  c.positive_finite(scale, "scale");
  c.slot_indices_host(state_indices, "state_indices", slots);

  const cpu::Gate gate = cpu::make_gate(mode, lower_bound, A_log, dt_bias);
  const fkda::FloatSpan qs = cpu::span_of(q), ks = cpu::span_of(k), vs = cpu::span_of(v),
                        gs = cpu::span_of(g), bs = cpu::span_of(beta), os = cpu::span_of(out);
  const int32_t* idx = fkda::data_ptr<const int32_t>(state_indices);
  const int64_t group = HV / H;

  std::vector<double> qn(H * K), kn(H * K), decay(K), graw(K), vrow(V), orow(V), row(K);
  cpu::with_state_type(fkda::float_kind(state.dtype()), [&](auto tag) {
    using TS = decltype(tag);
    TS* pool = fkda::data_ptr<TS>(state);
    for (int64_t r = 0; r < rows; ++r) {
      if (cpu::is_padding(idx[r], null_slot0)) {
        os.fill_zero(r * HV * V, HV * V);
        continue;
      }
      qs.load(r * qr, H * K, qn.data());
      ks.load(r * kr, H * K, kn.data());
      for (int64_t h = 0; h < H; ++h) {
        cpu::l2norm_scale(qn.data() + h * K, K, scale);
        cpu::l2norm_scale(kn.data() + h * K, K, 1.0);
      }
      TS* slot = pool + static_cast<int64_t>(idx[r]) * slot_stride;
      for (int64_t hv = 0; hv < HV; ++hv) {
        const int64_t h = hv / group;  // value head hv reads q/k head hv / (HV / H)
        gs.load(r * gr + hv * K, K, graw.data());
        gate.decay(graw.data(), hv, K, decay.data());
        double b = bs.get(r * br + hv);
        if (beta_is_logit) b = cpu::sigmoid(b);
        vs.load(r * vr + hv * V, V, vrow.data());
        cpu::delta_step(slot + hv * V * K, K, V, qn.data() + h * K, kn.data() + h * K,
                        decay.data(), b, vrow.data(), orow.data(), row.data());
        os.store((r * HV + hv) * V, V, orow.data());
      }
    }
  });
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_decode, kda_decode);
// written: state, out
FKDA_EXPORT_CHECKED(kda_decode, (1u << 7) | (1u << 9), -1, -1);
FKDA_EXPORT_CONTRACT();
