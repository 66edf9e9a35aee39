// The CUDA verify bindings' (kda_verify, fused_kda_verify) shared checks of the index tensors; their
// values live on the device and are never read here (the kernels treat what they cannot serve as
// padding).
#pragma once

#include <cstdint>

#include "binding.h"
#include "cuda_launch.h"
#include "pool_args.h"

namespace fkda {

// The slot table state_indices [N, T_max] on ref's device, and T within 1 .. N * T_max tokens (the
// message names the token input `first` and ends with `what`).
inline SlotTable verify_slot_table(const Checker& c, const TensorView& state_indices, int64_t T, const char* first,
                                   const char* what, const TensorView& ref) {
  check_cuda_device(c, state_indices, "state_indices", ref, "out");
  const SlotTable table = slot_table(c, state_indices);
  const int64_t N = table.N, cols = table.cols;
  if (T < 1 || T > N * cols) {  // a request has 0 .. T_max tokens
    FKDA_FAIL(c.fn()) << "argument '" << first << "' has T = " << T << " tokens; expected 1 .. N * T_max = "
                      << N * cols << what;
  }
  return table;
}

// The state pool [slots, a, b, d] on ref's device, f32 or bf16, 16-byte aligned, its slots dense and
// possibly apart (pool_slot_stride; offsets checked against the module's width): slots and stride.
inline PoolLayout verify_pool(const Checker& c, const TensorView& state, Dim a, Dim b, Dim d, const TensorView& ref) {
  check_cuda_device(c, state, "state", ref, "out");
  c.shape(state, "state", {{"slots", -1}, a, b, d});
  c.state_dtype(state, "state", {kF32, kBF16});
  return PoolLayout{state.size(0), checked_pool_stride(c, state, "state", FKDA_SLOT_OFFSET_BITS, true)};
}

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

// kda_verify's second start pool (pool_args.h initial_pool) on the device of out (the call's output, which
// it must not overlap), 16-byte aligned, its offsets within the module's `bits`.
inline InitialPool verify_initial_pool(const Checker& c, const OptTensor& initial_state,
                                       const OptTensor& initial_state_indices, const OptTensor& num_accepted_tokens,
                                       const TensorView& state, Dim a, Dim b, Dim d, int64_t N, int bits,
                                       const TensorView& out) {
  if (initial_state.has_value()) check_cuda_device(c, initial_state.value(), "initial_state", out, "out");
  if (initial_state_indices.has_value())
    check_cuda_device(c, initial_state_indices.value(), "initial_state_indices", out, "out");
  return initial_pool(c, initial_state, initial_state_indices, num_accepted_tokens, state, out, a, b, d, N, bits,
                      true);
}

}  // namespace fkda
