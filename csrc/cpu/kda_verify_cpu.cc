// CPU backend, family kda_verify: speculative-decoding verify on a state pool [slots, HV, V, K].
//
// Requests run in order; request n reads its initial state from slot
// state_indices[n, num_accepted_tokens[n] - 1] (column 0 without num_accepted_tokens), or from
// initial_state[initial_state_indices[n]] when that second pool is given (read only), runs its
// T_n tokens in order and stores the state after token t into slot state_indices[n, t] (negative,
// or 0 with null_slot0: not stored). The state is kept in the pool's dtype between tokens, so
// token t + 1 continues from exactly what was stored after token t (docs/semantics.md, "Verify");
// with parent_tokens (a draft tree) token t continues from what was stored after token
// parent_tokens[n, t] instead.
// A request whose read entry is padding gets zero outputs and touches nothing. Host values are all
// visible here, so every rule of the op is checked: offsets, counts, slot ranges, and that no slot
// is written twice or read by one request while another writes it.
#include <algorithm>
#include <vector>

#include "../common/row_stride.h"
#include "../common/verify_cpu.h"

namespace {

using fkda::Checker;
using fkda::OptTensor;
using fkda::TensorView;
namespace cpu = fkda::cpu;

void kda_verify(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta, OptTensor A_log,
                OptTensor dt_bias, TensorView state, TensorView state_indices, TensorView cu_seqlens,
                OptTensor num_accepted_tokens, OptTensor initial_state, OptTensor initial_state_indices,
                OptTensor parent_tokens, TensorView out, int64_t gate_mode, double lower_bound,
                double scale, bool beta_is_logit, bool null_slot0) {
  const Checker c("kda_verify");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{q, "q"}, {k, "k"}, {v, "v"},
                                {g, "g"}, {beta, "beta"}, {state, "state"}, {state_indices, "state_indices"},
                                {cu_seqlens, "cu_seqlens"}, {out, "out"}}) {
    c.device_type(t, name, kDLCPU);
  }
  const fkda::QVHeads heads = fkda::qv_heads(c, q, v, 4, "[1, T, H, K]", "[1, T, HV, V]");
  const int64_t T = q.size(1), H = heads.H, K = heads.K, HV = heads.HV, V = heads.V;
  c.shape(q, "q", {{"1", 1}, {"T", T}, {"H", H}, {"K", K}});
  c.shape(k, "k", {{"1", 1}, {"T", T}, {"H", H}, {"K", K}});
  c.shape(v, "v", {{"1", 1}, {"T", T}, {"HV", HV}, {"V", V}});
  c.shape(g, "g", {{"1", 1}, {"T", T}, {"HV", HV}, {"K", K}});
  c.shape(beta, "beta", {{"1", 1}, {"T", T}, {"HV", HV}});
  c.shape(out, "out", {{"1", 1}, {"T", T}, {"HV", HV}, {"V", V}});
  // a pool with a slot table, or step rows (one row of T_max slots per request); slots may sit apart
  const fkda::VerifyLayout layout =
      fkda::verify_layout(c, state, state_indices, {"HV", HV}, {"V", V}, {"K", K}, FKDA_SLOT_OFFSET_BITS, false);
  const int64_t N = layout.N, cols = layout.cols, slots = layout.slots, slot_stride = layout.slot_stride;
  const fkda::SlotTable table{N, cols};
  c.shape(cu_seqlens, "cu_seqlens", {{"N+1", N + 1}});
  fkda::cpu::check_input_dtypes(c, q, k, v, g, beta, out, /*gb_f32=*/true);
  c.state_dtype(state, "state", {fkda::kF32, fkda::kF64, fkda::kBF16});
  c.dtype(state_indices, "state_indices", {fkda::kI32});
  c.dtype(cu_seqlens, "cu_seqlens", {fkda::kI32});
  // the tokens of q..beta may sit apart (views of a packed projection), each token dense
  const int64_t qr = fkda::row_stride(c, q, "q", 1), kr = fkda::row_stride(c, k, "k", 1),
                vr = fkda::row_stride(c, v, "v", 1), gr = fkda::row_stride(c, g, "g", 1),
                br = fkda::row_stride(c, beta, "beta", 1);
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{state_indices, "state_indices"},
                                {cu_seqlens, "cu_seqlens"}, {out, "out"}}) {
    c.contiguous(t, name);
  }
  cpu::check_accepted_tokens(c, num_accepted_tokens, N);
  const fkda::GateMode mode =
      fkda::gate_and_scale(c, gate_mode, lower_bound, A_log, dt_bias, HV, K, q, "q", scale);

  for (const auto& [t, name] : {std::pair<const OptTensor&, const char*>{initial_state, "initial_state"},
                                {initial_state_indices, "initial_state_indices"}}) {
    if (t.has_value()) c.device_type(t.value(), name, kDLCPU);
  }
  const fkda::InitialPool init = fkda::initial_pool(c, initial_state, initial_state_indices, num_accepted_tokens,
                                                    state, out, {"HV", HV}, {"V", V}, {"K", K}, N,
                                                    FKDA_SLOT_OFFSET_BITS, false);
  const bool init_is_state = init.idx && fkda::same_view(initial_state.value(), state);
  const cpu::VerifyPlan plan = cpu::verify_host_plan(c, state_indices, cu_seqlens, num_accepted_tokens, T, table,
                                                     slots, null_slot0, init, init_is_state, layout.rows);
  const int32_t* parents = cpu::tree_parents_host(c, parent_tokens, plan, N, cols);

  // ---- the recurrence ----------------------------------------------------------------------
  const cpu::Gate gate = cpu::make_gate(mode, lower_bound, A_log, dt_bias);
  const fkda::FloatSpan qs = cpu::span_of(q), ks = cpu::span_of(k), vs = cpu::span_of(v),
                        gs = cpu::span_of(g), bs = cpu::span_of(beta), os = cpu::span_of(out);
  const int64_t group = HV / H, slot_elems = HV * V * K;
  std::vector<double> qn(H * K), kn(H * K), decay(K), graw(K), vrow(V), orow(V), row(K);
  cpu::with_state_type(fkda::float_kind(state.dtype()), [&](auto tag) {
    using TS = decltype(tag);
    TS* pool = fkda::data_ptr<TS>(state);
    // where requests start: the second pool (read only) or this one
    const TS* src_pool = init.idx ? static_cast<const TS*>(init.data) : pool;
    const int64_t src_stride = init.idx ? init.slot_stride : slot_stride;
    std::vector<TS> work(slot_elems);  // the request's state between tokens, in the pool's dtype
    for (int64_t n = 0; n < N; ++n) {
      if (plan.off[n + 1] == plan.off[n]) continue;  // an empty request: nothing read or written
      const int32_t read = plan.read[n];
      if (plan.pad(read)) {
        os.fill_zero(plan.off[n] * HV * V, (plan.off[n + 1] - plan.off[n]) * HV * V);
        continue;
      }
      const TS* src = src_pool + static_cast<int64_t>(read) * src_stride;
      std::copy(src, src + slot_elems, work.begin());
      for (int64_t r = plan.off[n]; r < plan.off[n + 1]; ++r) {
        const int64_t t = r - plan.off[n];
        if (parents && t > 0 && parents[n * cols + t] != t - 1) {  // a tree: from what token p stored
          const TS* stored = pool + static_cast<int64_t>(plan.idx[n * cols + parents[n * cols + t]]) * slot_stride;
          std::copy(stored, stored + slot_elems, work.begin());
        }
        qs.load(r * qr, H * K, qn.data());
        ks.load(r * kr, H * K, kn.data());
        for (int64_t h = 0; h < H; ++h) {
          cpu::l2norm_scale(qn.data() + h * K, K, scale);
          cpu::l2norm_scale(kn.data() + h * K, K, 1.0);
        }
        for (int64_t hv = 0; hv < HV; ++hv) {
          const int64_t h = hv / group;
          gs.load(r * gr + hv * K, K, graw.data());
          gate.decay(graw.data(), hv, K, decay.data());
          double b = bs.get(r * br + hv);
          if (beta_is_logit) b = cpu::sigmoid(b);
          vs.load(r * vr + hv * V, V, vrow.data());
          cpu::delta_step(work.data() + hv * V * K, K, V, qn.data() + h * K, kn.data() + h * K,
                          decay.data(), b, vrow.data(), orow.data(), row.data());
          os.store((r * HV + hv) * V, V, orow.data());
        }
        const int32_t dst = plan.idx[n * cols + t];
        if (!plan.pad(dst)) std::copy(work.begin(), work.end(), pool + static_cast<int64_t>(dst) * slot_stride);
      }
    }
  });
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_verify, kda_verify);
// written: state (7), out (14); initial_state (11) may be the identical view of state
FKDA_EXPORT_CHECKED(kda_verify, (1u << 7) | (1u << 14), 7, 11);
FKDA_EXPORT_CONTRACT();
