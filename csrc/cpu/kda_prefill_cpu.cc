// CPU backend, family kda_prefill: the token-by-token recurrence over packed variable-length input.
//
// Sequence n covers tokens [cu_seqlens[n], cu_seqlens[n+1]) of the single packed row. Its state
// starts from initial_state (dense [N, HV, V, K], or slot state_indices[n] of a pool) or zeros, is
// carried in double precision through the sequence, and is stored (rounded once) to final_state
// and to the checkpoints after every checkpoint_every tokens.
#include <algorithm>
#include <vector>

#include "../common/kda_cpu.h"
#include "../common/pool_args.h"

namespace {

using fkda::Checker;
using fkda::OptTensor;
using fkda::TensorView;
namespace cpu = fkda::cpu;

// A state-shaped optional argument: on the CPU, with the module's state dtype; contiguous unless it
// is the pool (slots: its slot stride is checked once its shape is, by pool_stride).
void check_state_arg(const Checker& c, const OptTensor& t, const char* name, bool slots) {
  if (!t.has_value()) return;
  const TensorView& s = t.value();
  c.device_type(s, name, kDLCPU);
  c.state_dtype(s, name, {fkda::kF32, fkda::kF64, fkda::kBF16});
  if (slots) return;
  c.contiguous(s, name);
  c.offsets_fit(s, name, FKDA_SLOT_OFFSET_BITS);
}

// The pool's slot stride in elements (its slots may sit apart, as in a paged cache; each is dense),
// its offsets checked against the module's width.
int64_t pool_stride(const Checker& c, const OptTensor& t, const char* name, int64_t dense) {
  if (!t.has_value()) return dense;
  return fkda::checked_pool_stride(c, t.value(), name, FKDA_SLOT_OFFSET_BITS, false);
}

void kda_prefill(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta,
                 OptTensor A_log, OptTensor dt_bias, TensorView cu_seqlens, OptTensor initial_state,
                 OptTensor final_state, OptTensor state_indices, OptTensor checkpoints, TensorView out,
                 OptTensor workspace, int64_t gate_mode, double lower_bound, double scale,
                 bool beta_is_logit, bool null_slot0, int64_t checkpoint_every) {
  const Checker c("kda_prefill");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{q, "q"}, {k, "k"}, {v, "v"},
                                {g, "g"}, {beta, "beta"}, {cu_seqlens, "cu_seqlens"}, {out, "out"}}) {
    c.device_type(t, name, kDLCPU);
    c.contiguous(t, name);
  }
  c.ndim(q, "q", 4, "[B, T, H, K]");
  c.ndim(v, "v", 4, "[B, T, HV, V]");
  // B > 1 contiguous rows of T tokens are the packed row of B * T tokens that cu_seqlens describes.
  const int64_t B = q.size(0), Tb = q.size(1), T = B * Tb, H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3);
  c.shape(q, "q", {{"B", B}, {"T", Tb}, {"H", H}, {"K", K}});
  c.head_dims(K, V);
  c.heads(H, HV);
  c.shape(k, "k", {{"B", B}, {"T", Tb}, {"H", H}, {"K", K}});
  c.shape(v, "v", {{"B", B}, {"T", Tb}, {"HV", HV}, {"V", V}});
  c.shape(g, "g", {{"B", B}, {"T", Tb}, {"HV", HV}, {"K", K}});
  c.shape(beta, "beta", {{"B", B}, {"T", Tb}, {"HV", HV}});
  c.shape(out, "out", {{"B", B}, {"T", Tb}, {"HV", HV}, {"V", V}});
  fkda::cpu::check_input_dtypes(c, q, k, v, g, beta, out);

  c.dtype(cu_seqlens, "cu_seqlens", {fkda::kI32, fkda::kI64});
  c.ndim(cu_seqlens, "cu_seqlens", 1, "[N+1]");
  const std::vector<int64_t> cu = c.cu_seqlens_host(cu_seqlens, "cu_seqlens", T);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;

  const fkda::GateMode mode = c.gate_mode(gate_mode);
  c.lower_bound(mode, lower_bound);
  c.gate_params(mode, A_log, dt_bias, HV, K, q, "q");
  c.positive_finite(scale, "scale");
  if (workspace.has_value()) c.device_type(workspace.value(), "workspace", kDLCPU);  // unused on CPU

  // State arguments: one state dtype for all of them.
  const bool pool_mode = state_indices.has_value();
  check_state_arg(c, initial_state, "initial_state", pool_mode);
  check_state_arg(c, final_state, "final_state", pool_mode);
  check_state_arg(c, checkpoints, "checkpoints", false);
  const TensorView* state_ref = nullptr;
  const char* state_ref_name = nullptr;
  for (const auto& [t, name] : {std::pair<const OptTensor&, const char*>{initial_state, "initial_state"},
                                {final_state, "final_state"}, {checkpoints, "checkpoints"}}) {
    if (!t.has_value()) continue;
    if (state_ref == nullptr) {
      state_ref = &t.value();
      state_ref_name = name;
    } else {
      c.same_dtype_as(t.value(), name, *state_ref, state_ref_name);
    }
  }

  // Dense mode: [N, HV, V, K]. Pool mode: both are [slots, HV, V, K] addressed by state_indices.
  int64_t slots = N;
  std::vector<int64_t> slot_of(N);
  for (int64_t n = 0; n < N; ++n) slot_of[n] = n;
  if (pool_mode) {
    const TensorView& idx = state_indices.value();
    c.device_type(idx, "state_indices", kDLCPU);
    c.dtype(idx, "state_indices", {fkda::kI32});
    c.shape(idx, "state_indices", {{"N", N}});
    c.contiguous(idx, "state_indices");
    FKDA_CHECK(initial_state.has_value() || final_state.has_value(), c.fn())
        << "argument 'state_indices' given (pool mode) but neither 'initial_state' nor 'final_state' "
           "(the pool) was given";
    const TensorView& pool = initial_state.has_value() ? initial_state.value() : final_state.value();
    c.ndim(pool, initial_state.has_value() ? "initial_state" : "final_state", 4, "[slots, HV, V, K]");
    slots = pool.size(0);
    c.slot_indices_host(idx, "state_indices", slots);
    const int32_t* p = fkda::data_ptr<const int32_t>(idx);
    std::vector<int64_t> live;
    for (int64_t n = 0; n < N; ++n) {
      slot_of[n] = cpu::is_padding(p[n], null_slot0) ? -1 : p[n];
      if (slot_of[n] >= 0) live.push_back(slot_of[n]);
    }
    std::sort(live.begin(), live.end());
    const auto dup = std::adjacent_find(live.begin(), live.end());
    FKDA_CHECK(dup == live.end(), c.fn())
        << "argument 'state_indices': slot " << (dup == live.end() ? 0 : *dup)
        << " serves more than one sequence; expected each live slot once in prefill";
  } else {
    FKDA_CHECK(!null_slot0, c.fn()) << "argument 'null_slot0' must be false without state_indices "
                                       "(dense state), got true";
  }
  if (initial_state.has_value()) {
    c.shape(initial_state.value(), "initial_state",
            {{pool_mode ? "slots" : "N", slots}, {"HV", HV}, {"V", V}, {"K", K}});
  }
  if (final_state.has_value()) {
    c.shape(final_state.value(), "final_state",
            {{pool_mode ? "slots" : "N", slots}, {"HV", HV}, {"V", V}, {"K", K}});
  }
  // elements between the states of consecutive slots (dense: one state)
  const int64_t init_stride = pool_mode ? pool_stride(c, initial_state, "initial_state", HV * V * K) : HV * V * K;
  const int64_t fin_stride = pool_mode ? pool_stride(c, final_state, "final_state", HV * V * K) : HV * V * K;

  // Checkpoints [N, C, HV, V, K]: C must hold every sequence's floor(len / checkpoint_every).
  c.non_negative(checkpoint_every, "checkpoint_every");
  FKDA_CHECK(checkpoints.has_value() == (checkpoint_every > 0), c.fn())
      << "argument 'checkpoints' must be given exactly when checkpoint_every > 0, got checkpoints="
      << (checkpoints.has_value() ? "a tensor" : "None") << " with checkpoint_every=" << checkpoint_every;
  int64_t ckpt_capacity = 0;
  if (checkpoints.has_value()) {
    const TensorView& ck = checkpoints.value();
    c.ndim(ck, "checkpoints", 5, "[N, C, HV, V, K]");
    ckpt_capacity = ck.size(1);
    c.shape(ck, "checkpoints", {{"N", N}, {"C", ckpt_capacity}, {"HV", HV}, {"V", V}, {"K", K}});
    for (int64_t n = 0; n < N; ++n) {
      const int64_t need = (cu[n + 1] - cu[n]) / checkpoint_every;
      FKDA_CHECK(need <= ckpt_capacity, c.fn())
          << "argument 'checkpoints' holds C=" << ckpt_capacity << " states per sequence, but sequence "
          << n << " (" << cu[n + 1] - cu[n] << " tokens, checkpoint_every=" << checkpoint_every
          << ") needs " << need;
    }
  }

  const cpu::Gate gate = cpu::make_gate(mode, lower_bound, A_log, dt_bias);
  const fkda::FloatSpan qs = cpu::span_of(q), ks = cpu::span_of(k), vs = cpu::span_of(v),
                        gs = cpu::span_of(g), bs = cpu::span_of(beta), os = cpu::span_of(out);
  const int64_t group = HV / H, VK = V * K;
  const fkda::FloatKind skind = state_ref ? fkda::float_kind(state_ref->dtype()) : fkda::FloatKind::kFloat32;

  std::vector<double> S(VK), qn(K), kn(K), decay(K), graw(K), vrow(V), orow(V), row(K);
  cpu::with_state_type(skind, [&](auto tag) {
    using TS = decltype(tag);
    TS* init = initial_state.has_value() ? fkda::data_ptr<TS>(initial_state.value()) : nullptr;
    TS* fin = final_state.has_value() ? fkda::data_ptr<TS>(final_state.value()) : nullptr;
    TS* ck = checkpoints.has_value() ? fkda::data_ptr<TS>(checkpoints.value()) : nullptr;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t slot = slot_of[n];  // -1: padding (pool mode) - start from zeros, write no state
      for (int64_t hv = 0; hv < HV; ++hv) {
        const int64_t h = hv / group;  // value head hv reads q/k head hv / (HV / H)
        if (init != nullptr && slot >= 0) {
          const TS* src = init + slot * init_stride + hv * VK;
          for (int64_t i = 0; i < VK; ++i) S[i] = fkda::to_double(src[i]);
        } else {
          std::fill(S.begin(), S.end(), 0.0);
        }
        for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
          qs.load((t * H + h) * K, K, qn.data());
          ks.load((t * H + h) * K, K, kn.data());
          cpu::l2norm_scale(qn.data(), K, scale);
          cpu::l2norm_scale(kn.data(), K, 1.0);
          gs.load((t * HV + hv) * K, K, graw.data());
          gate.decay(graw.data(), hv, K, decay.data());
          double b = bs.get(t * HV + hv);
          if (beta_is_logit) b = cpu::sigmoid(b);
          vs.load((t * HV + hv) * V, V, vrow.data());
          cpu::delta_step(S.data(), K, V, qn.data(), kn.data(), decay.data(), b, vrow.data(),
                          orow.data(), row.data());
          os.store((t * HV + hv) * V, V, orow.data());
          const int64_t done = t + 1 - cu[n];
          if (ck != nullptr && done % checkpoint_every == 0) {
            TS* dst = ck + ((n * ckpt_capacity + (done / checkpoint_every - 1)) * HV + hv) * VK;
            for (int64_t i = 0; i < VK; ++i) dst[i] = fkda::from_double<TS>(S[i]);
          }
        }
        if (fin != nullptr && slot >= 0) {
          TS* dst = fin + slot * fin_stride + hv * VK;
          for (int64_t i = 0; i < VK; ++i) dst[i] = fkda::from_double<TS>(S[i]);
        }
      }
    }
  });
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill, kda_prefill);
// written: final_state, checkpoints, out, workspace; the pool
FKDA_EXPORT_CHECKED(kda_prefill, (1u << 9) | (1u << 11) | (1u << 12) | (1u << 13), 8, 9);
FKDA_EXPORT_CONTRACT();
