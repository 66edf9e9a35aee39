// The CUDA verify bindings' (kda_verify, fused_kda_verify) shared checks of the index tensors; their
// values live on the device and are never read here (the kernels treat what they cannot serve as
// padding).
#pragma once

#include <cstdint>

#include "binding.h"
#include "cuda_launch.h"
#include "pool_args.h"

namespace fkda {

// state_indices int32 contiguous, cu_seqlens int32 [N+1], num_accepted_tokens int32 [N] or absent,
// all on ref's device (named "out" in the messages).
inline void check_verify_indices(const Checker& c, const TensorView& state_indices, const TensorView& cu_seqlens,
                                 const OptTensor& num_accepted_tokens, int64_t N, const TensorView& ref) {
  c.dtype(state_indices, "state_indices", {kI32});
  c.contiguous(state_indices, "state_indices");
  check_cuda_device(c, cu_seqlens, "cu_seqlens", ref, "out");
  c.shape(cu_seqlens, "cu_seqlens", {{"N+1", N + 1}});
  c.dtype(cu_seqlens, "cu_seqlens", {kI32});
  c.contiguous(cu_seqlens, "cu_seqlens");
  if (num_accepted_tokens.has_value()) {
    const TensorView& a = num_accepted_tokens.value();
    check_cuda_device(c, a, "num_accepted_tokens", ref, "out");
    c.shape(a, "num_accepted_tokens", {{"N", N}});
    c.dtype(a, "num_accepted_tokens", {kI32});
    c.contiguous(a, "num_accepted_tokens");
  }
}

}  // namespace fkda
