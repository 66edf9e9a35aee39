// Host side: scalar fields that several kernels' parameter structs carry under the same names
// (fkda_decode::DecodeParams, fkda_fused::FusedParams, fkda_prefill::PrepArgs), converted one way for
// every binding: counts to int, options to float (the precision the kernels use).
#pragma once

#include <cstdint>

namespace fkda {

// H, HV and group = HV / H, the value heads one q/k head serves (the bindings check HV % H == 0).
template <typename Params>
inline void set_heads(Params& p, int64_t H, int64_t HV) {
  p.H = static_cast<int>(H);
  p.HV = static_cast<int>(HV);
  p.group = static_cast<int>(HV / H);
}

// gate_mode (0 softplus, 1 bounded, 2 log), the bounded gate's lower bound and the q scale.
template <typename Params>
inline void set_gate_scale(Params& p, int64_t gate_mode, double lower_bound, double scale) {
  p.gate_mode = static_cast<int>(gate_mode);
  p.lower_bound = static_cast<float>(lower_bound);
  p.scale = static_cast<float>(scale);
}

}  // namespace fkda
