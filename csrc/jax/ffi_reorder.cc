// The JAX front end's argument reorder: a TVM-FFI function that wraps a module function so it can be
// registered as an XLA FFI target through jax-tvm-ffi without any Python running per call.
//
// jax-tvm-ffi calls a target with (operands..., results..., attributes...), while every module
// function takes the ABI order of docs/architecture.md (tensors in a fixed order, None for an absent
// optional tensor, outputs as arguments, then the scalars). ffi_reorder(fn, order, n_buffers) returns
// a function that, given args, calls
//
//     fn(args[order[0]] or None, ..., args[order[n-1]] or None, args[n_buffers], args[n_buffers+1], ...)
//
// where order[i] == -1 means "absent: pass None". An operand aliased to a result is the same buffer,
// so `order` may name one buffer index twice. The wrapper only moves AnyViews (DLTensor pointers,
// scalars): it never touches data, allocates nothing per call and works the same for CPU and CUDA
// targets (the stream reaches fn through the TVM-FFI environment, untouched).
//
// Built by flashkda_ext's JIT as the cpu module "ffi_reorder" (jit/modules/ffi_reorder.json).
#include <tvm/ffi/container/array.h>

#include <array>
#include <cstdint>

#include "../common/binding.h"

namespace {

using tvm::ffi::Any;
using tvm::ffi::AnyView;
using tvm::ffi::Function;

// Upper bound of the reordered call's argument count (tensor slots + attributes). The widest ABI,
// kda_prefill, takes 14 tensors and 6 scalars.
constexpr int32_t kMaxArgs = 64;

struct Reorder {
  Function fn;
  int32_t n_buffers;                   // operands + results jax-tvm-ffi passes before the attributes
  int32_t n_slots;                     // ABI tensor slots
  std::array<int32_t, kMaxArgs> slot;  // buffer index per ABI slot, -1 = None

  void operator()(const AnyView* args, int32_t num_args, Any* rv) const {
    const int32_t n_attrs = num_args - n_buffers;
    if (TVM_FFI_PREDICT_FALSE(n_attrs < 0 || n_slots + n_attrs > kMaxArgs)) {
      FKDA_FAIL("ffi_reorder") << "expected " << n_buffers << " buffers plus at most "
                               << kMaxArgs - n_slots << " attributes, got " << num_args
                               << " arguments";
    }
    std::array<AnyView, kMaxArgs> packed;  // AnyView() is None
    for (int32_t i = 0; i < n_slots; ++i) {
      const int32_t j = slot[i];
      if (j >= 0) packed[i] = args[j];
    }
    for (int32_t a = 0; a < n_attrs; ++a) packed[n_slots + a] = args[n_buffers + a];
    fn.CallPacked(packed.data(), n_slots + n_attrs, rv);
  }
};

Function ffi_reorder(Function fn, tvm::ffi::Array<int64_t> order, int64_t n_buffers) {
  if (fn == nullptr) FKDA_FAIL("ffi_reorder") << "argument 'fn' must be a function, got None";
  if (n_buffers < 0 || n_buffers > kMaxArgs) {
    FKDA_FAIL("ffi_reorder") << "argument 'n_buffers' must be in [0, " << kMaxArgs << "], got "
                             << n_buffers;
  }
  const int64_t n_slots = static_cast<int64_t>(order.size());
  if (n_slots > kMaxArgs) {
    FKDA_FAIL("ffi_reorder") << "argument 'order' has " << n_slots << " entries, more than "
                             << kMaxArgs;
  }
  Reorder r{fn, static_cast<int32_t>(n_buffers), static_cast<int32_t>(n_slots), {}};
  r.slot.fill(-1);
  for (int64_t i = 0; i < n_slots; ++i) {
    const int64_t j = order[i];
    if (j < -1 || j >= n_buffers) {
      FKDA_FAIL("ffi_reorder") << "argument 'order': order[" << i << "] = " << j
                               << " is not a buffer index in [0, " << n_buffers
                               << ") or -1 (absent)";
    }
    r.slot[i] = static_cast<int32_t>(j);
  }
  return Function::FromPacked(std::move(r));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(ffi_reorder, ffi_reorder);
FKDA_EXPORT_CONTRACT();
