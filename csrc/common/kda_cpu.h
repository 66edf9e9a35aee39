// The math of one KDA token (DESIGN.md section 2) for the CPU backend, in double precision.
//
// State storage is [.., V, K] (key index last): each of the V value columns of the K x V state is
// one contiguous row of K elements, so a step walks rows j = 0..V-1 and each row is independent.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "binding.h"
#include "host_dtype.h"

namespace fkda {
namespace cpu {

constexpr double kL2NormEps = 1e-6;         // inside the sqrt, as every KDA implementation does
constexpr double kSoftplusThreshold = 20.0;  // softplus(x) = x above it

inline double softplus(double x) { return x > kSoftplusThreshold ? x : std::log1p(std::exp(x)); }
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// x <- factor * x / sqrt(sum x^2 + eps)
inline void l2norm_scale(double* x, int64_t n, double factor) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double r = factor / std::sqrt(ss + kL2NormEps);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

// Gate parameters, checked by Checker::gate_params; pointers are null when absent.
struct Gate {
  GateMode mode;
  double lower_bound;
  const float* A_log;    // [HV]
  const float* dt_bias;  // [HV*K]

  // decay[i] = exp(g_i) for value head hv, from the raw gate row g_raw[K].
  void decay(const double* g_raw, int64_t hv, int64_t K, double* decay_out) const {
    const double a = A_log ? std::exp(static_cast<double>(A_log[hv])) : 1.0;
    for (int64_t i = 0; i < K; ++i) {
      const double b = dt_bias ? static_cast<double>(dt_bias[hv * K + i]) : 0.0;
      double g;
      switch (mode) {
        case GateMode::kSoftplus: g = -a * softplus(g_raw[i] + b); break;
        case GateMode::kBounded: g = lower_bound * sigmoid(a * (g_raw[i] + b)); break;
        default: g = g_raw[i]; break;
      }
      decay_out[i] = std::exp(g);
    }
  }
};

inline Gate make_gate(GateMode mode, double lower_bound, const OptTensor& A_log,
                      const OptTensor& dt_bias) {
  return Gate{mode, lower_bound, A_log.has_value() ? data_ptr<const float>(A_log.value()) : nullptr,
              dt_bias.has_value() ? data_ptr<const float>(dt_bias.value()) : nullptr};
}

// One delta-rule step of one (row, value head) on state rows S[V][K] of storage type TS:
//   S = S * decay[key];  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q (after the update).
// q is scaled and normalised, k normalised. Each row is rounded to TS once, after the update.
template <typename TS>
inline void delta_step(TS* S, int64_t K, int64_t V, const double* q, const double* k,
                       const double* decay, double beta, const double* v, double* o, double* row) {
  for (int64_t j = 0; j < V; ++j) {
    TS* s = S + j * K;
    double pred = 0.0;
    for (int64_t i = 0; i < K; ++i) {
      row[i] = to_double(s[i]) * decay[i];
      pred += row[i] * k[i];
    }
    const double u = beta * (v[j] - pred);
    double acc = 0.0;
    for (int64_t i = 0; i < K; ++i) {
      row[i] += k[i] * u;
      acc += row[i] * q[i];
      s[i] = from_double<TS>(row[i]);
    }
    o[j] = acc;
  }
}

// The fused ops' token r after the conv (fused_kda_decode, fused_kda_verify): per head h, q and k
// normalised (q scaled), the delta step on S [H][D][D] (storage type TS), then the gated RMSNorm
// out = rmsnorm(o) * norm_weight * sigmoid(output_gate) stored to out's row r.
struct FusedStepIO {
  FloatSpan g, beta, output_gate, out;  // [.., H, D], [.., H], [.., H, D], [.., H, D] by row
  const float* norm_weight;             // [D]
  double scale, norm_eps;
  int64_t g_row, beta_row, og_row;      // elements between rows of g, beta, output_gate (out: dense)
};

struct FusedScratch {
  explicit FusedScratch(int64_t D) : graw(D), decay(D), orow(D), gate_row(D), row(D) {}
  std::vector<double> graw, decay, orow, gate_row, row;
};

template <typename TS>
inline void fused_token_step(TS* S, double* q, double* k, const double* v, int64_t r, int64_t H, int64_t D,
                             const Gate& gate, const FusedStepIO& io, FusedScratch& s) {
  for (int64_t h = 0; h < H; ++h) {
    l2norm_scale(q + h * D, D, io.scale);
    l2norm_scale(k + h * D, D, 1.0);
    io.g.load(r * io.g_row + h * D, D, s.graw.data());
    gate.decay(s.graw.data(), h, D, s.decay.data());
    const double b = sigmoid(io.beta.get(r * io.beta_row + h));
    delta_step(S + h * D * D, D, D, q + h * D, k + h * D, s.decay.data(), b, v + h * D, s.orow.data(),
               s.row.data());
    double ms = 0.0;
    for (int64_t i = 0; i < D; ++i) ms += s.orow[i] * s.orow[i];
    const double inv_rms = 1.0 / std::sqrt(ms / static_cast<double>(D) + io.norm_eps);
    io.output_gate.load(r * io.og_row + h * D, D, s.gate_row.data());
    for (int64_t i = 0; i < D; ++i) {
      s.orow[i] = s.orow[i] * inv_rms * static_cast<double>(io.norm_weight[i]) * sigmoid(s.gate_row[i]);
    }
    io.out.store((r * H + h) * D, D, s.orow.data());
  }
}

// Call f(T{}) with the state storage type of `kind`: float32, float64 or bfloat16.
template <typename F>
inline void with_state_type(FloatKind kind, F&& f) {
  switch (kind) {
    case FloatKind::kFloat32: f(float{}); break;
    case FloatKind::kFloat64: f(double{}); break;
    case FloatKind::kBFloat16: f(bf16_t{}); break;
    default: break;
  }
}

inline FloatSpan span_of(const TensorView& t) {
  return FloatSpan{data_ptr<void>(t), float_kind(t.dtype())};
}

// The CPU backend's input dtypes for decode and prefill: q any float type, k, v, g and beta as q,
// out as v (the CUDA modules take bf16 only). gb_f32 (kda_decode): g and beta may each be float32
// instead, read as they are (FloatSpan reads any float kind).
inline void check_input_dtypes(const Checker& c, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& g, const TensorView& beta, const TensorView& out,
                               bool gb_f32 = false) {
  c.dtype(q, "q", {kF32, kF64, kBF16, kF16});
  c.same_dtype_as(k, "k", q, "q");
  c.same_dtype_as(v, "v", q, "q");
  if (gb_f32) {
    c.dtype(g, "g", {q.dtype(), kF32});
    c.dtype(beta, "beta", {q.dtype(), kF32});
  } else {
    c.same_dtype_as(g, "g", q, "q");
    c.same_dtype_as(beta, "beta", q, "q");
  }
  c.same_dtype_as(out, "out", v, "v");
}

// The CPU backend's dtypes for the fused ops: x any float type; g, beta, output_gate, conv_state and
// out as x; conv_weight as x or float32; norm_weight float32; the state float32, float64 or bfloat16.
inline void check_fused_dtypes(const Checker& c, const TensorView& x, const TensorView& g, const TensorView& beta,
                               const TensorView& output_gate, const TensorView& conv_state, const TensorView& out,
                               const TensorView& conv_weight, const TensorView& norm_weight,
                               const TensorView& state) {
  c.dtype(x, "x", {kF32, kF64, kBF16, kF16});
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{g, "g"}, {beta, "beta"},
                                {output_gate, "output_gate"}, {conv_state, "conv_state"}, {out, "out"}}) {
    c.same_dtype_as(t, name, x, "x");
  }
  c.dtype(conv_weight, "conv_weight", {x.dtype(), kF32});
  c.dtype(norm_weight, "norm_weight", {kF32});
  c.state_dtype(state, "state", {kF32, kF64, kBF16});
}

inline bool is_padding(int64_t index, bool null_slot0) { return index < 0 || (null_slot0 && index == 0); }

}  // namespace cpu
}  // namespace fkda
