// Host side: the DecodeParams fields kda_decode and kda_verify fill the same way (pointers, counts
// and options) and the rule on their row-strided inputs (vector_rows); each binding sets the row and
// slot strides of its own layout. Include after decode/kda_decode_kernels.cuh.
#pragma once

#include <cstdint>

#include "common/binding.h"
#include "common/param_fill.h"
#include "common/row_stride.h"

namespace fkda_decode {

// q, k, v, g of kda_decode (row_dim 0) and kda_verify (row_dim 1): rows any stride apart
// (fkda::row_stride), each row starting 16-byte aligned for the kernels' 16-byte loads along K / V.
// Returns the row stride in elements.
inline int64_t vector_rows(const fkda::Checker& c, const fkda::TensorView& t, const char* name, int row_dim) {
  const int64_t stride = fkda::row_stride(c, t, name, row_dim);
  const int64_t bytes = t.dtype().bits / 8;
  if (reinterpret_cast<uintptr_t>(fkda::data_ptr<char>(t)) % 16 != 0 ||
      (t.size(row_dim) > 1 && (stride * bytes) % 16 != 0)) {
    FKDA_FAIL(c.fn()) << "argument '" << name << "' must start 16-byte aligned with a row stride "
                      << "that is a multiple of " << 16 / bytes << " elements, got row stride " << stride;
  }
  return stride;
}

inline DecodeParams decode_params(const fkda::TensorView& q, const fkda::TensorView& k, const fkda::TensorView& v,
                                  const fkda::TensorView& g, const fkda::TensorView& beta,
                                  const fkda::OptTensor& A_log, const fkda::OptTensor& dt_bias,
                                  const fkda::TensorView& state, const fkda::TensorView& state_indices,
                                  const fkda::TensorView& out, int64_t slots, int64_t rows, int64_t H, int64_t HV,
                                  int64_t gate_mode, double lower_bound, double scale, bool beta_is_logit,
                                  bool null_slot0) {
  DecodeParams p;
  p.q = fkda::data_ptr<const bf16>(q);
  p.k = fkda::data_ptr<const bf16>(k);
  p.v = fkda::data_ptr<const bf16>(v);
  p.g = fkda::data_ptr<const gb_t>(g);
  p.beta = fkda::data_ptr<const gb_t>(beta);
  p.A_log = A_log.has_value() ? fkda::data_ptr<const float>(A_log.value()) : nullptr;
  p.dt_bias = dt_bias.has_value() ? fkda::data_ptr<const float>(dt_bias.value()) : nullptr;
  p.state = fkda::data_ptr<void>(state);
  p.idx = fkda::data_ptr<const int32_t>(state_indices);
  p.out = fkda::data_ptr<bf16>(out);
  p.num_slots = slots;
  p.rows = static_cast<int>(rows);
  fkda::set_heads(p, H, HV);
  fkda::set_gate_scale(p, gate_mode, lower_bound, scale);
  p.beta_is_logit = beta_is_logit ? 1 : 0;
  p.null_slot0 = null_slot0 ? 1 : 0;
  return p;
}

}  // namespace fkda_decode
