// Argument checks the state-pool bindings (verify and fused verify, CPU and CUDA) share beyond
// binding.h's Checker: the slot table state_indices [N, T_max] and the gate / scale options.
#pragma once

#include <cstdint>

#include "binding.h"

namespace fkda {

struct SlotTable {
  int64_t N, cols;  // requests, T_max
};

// The rank and extents of state_indices (its device and dtype: the caller, in its own order).
inline SlotTable slot_table(const Checker& c, const TensorView& state_indices) {
  c.ndim(state_indices, "state_indices", 2, "[N, T_max]");
  const int64_t N = state_indices.size(0), cols = state_indices.size(1);
  if (N < 1 || cols < 1) FKDA_FAIL(c.fn()) << "argument 'state_indices' must be [N, T_max] with N, T_max >= 1";
  return SlotTable{N, cols};
}

// gate_mode, lower_bound, A_log [HV] and dt_bias [HV*K] (on ref's device, ref named ref_name), scale.
inline GateMode gate_and_scale(const Checker& c, int64_t gate_mode, double lower_bound, const OptTensor& A_log,
                               const OptTensor& dt_bias, int64_t HV, int64_t K, const TensorView& ref,
                               const char* ref_name, double scale) {
  const GateMode mode = c.gate_mode(gate_mode);
  c.lower_bound(mode, lower_bound);
  c.gate_params(mode, A_log, dt_bias, HV, K, ref, ref_name);
  c.positive_finite(scale, "scale");
  return mode;
}

}  // namespace fkda
