// What the CUDA verify modules' (kda_verify, fused_kda_verify) records fix at compile time, checked
// once here for both bindings, and the names both bindings use (`using namespace fkda::verify_module`
// inside their anonymous namespace). Include after common/binding.h, which checks that the record's
// macros are defined.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "binding.h"

static_assert(FKDA_SLOT_OFFSET_BITS == 32 || FKDA_SLOT_OFFSET_BITS == 64, "offset bits");
static_assert(FKDA_STATE_BF16 == 0 || FKDA_STATE_BF16 == 1, "CUDA verify modules fix the state dtype");
static_assert(FKDA_CLUSTER_X == 1 && FKDA_CLUSTER_Y == 1 && FKDA_CLUSTER_Z == 1, "no clusters");
static_assert(FKDA_PERSISTENT_K == 0, "no persistent verify schedule: one CTA per (request, head, V-tile)");
#if !defined(FKDA_PARAM_BULK_STATE)  // kda_verify.cu checks the bulk_state modules' shared tiles
static_assert(FKDA_SMEM_BYTES == 0, "the verify kernels hold their state in registers (static shared memory only)");
#endif

namespace fkda {
namespace verify_module {

using bf16 = __nv_bfloat16;  // the same type as fkda_decode::bf16
using fkda::Checker;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;
constexpr bool kStateBf16 = FKDA_STATE_BF16 == 1;
using OffT = std::conditional_t<FKDA_SLOT_OFFSET_BITS == 64, int64_t, int32_t>;

}  // namespace verify_module
}  // namespace fkda
