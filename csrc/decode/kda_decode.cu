// TVM-FFI binding of the family kda_decode on sm_90a (contract: docs/architecture.md).
// One source builds every decode module; the module record's macros pick the schedule:
//   FKDA_PARAM_SCHEDULE        0 tile, 2 sequential, 3 persistent stream (cp.async ring,
//                              FKDA_PARAM_STAGES deep; grid min(tiles, FKDA_PERSISTENT_K x SMs))
//   FKDA_PARAM_V_TILE          V-rows per CTA (one CTA covers V_TILE of the 128 value columns)
//   FKDA_PARAM_LANES_PER_ROW   lanes sharing one V-row (8 or 16)
//   FKDA_PARAM_STATE_SMEM      1 (tile schedule): the CTA's state tile by one bulk copy into shared memory
//   FKDA_PARAM_BULK_STORE      1 (with state_smem): the updated tile goes back by one bulk copy
//   FKDA_PARAM_GB_F32          1: g and beta are fp32 (read as they are), else bf16 like q, k, v
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/binding.h"
#include "common/cuda_launch.h"
#include "common/pool_args.h"

#if !defined(FKDA_PARAM_SCHEDULE) || !defined(FKDA_PARAM_V_TILE) || !defined(FKDA_PARAM_LANES_PER_ROW) || \
    !defined(FKDA_CONTRACT_JSON)
#error "kda_decode.cu is built from a module record: FKDA_PARAM_SCHEDULE/V_TILE/LANES_PER_ROW missing"
#endif

#include "kda_decode_kernels.cuh"
#include "decode_params.h"

namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;
using namespace fkda_decode;

constexpr bool kStateBf16 = FKDA_STATE_BF16 == 1;
using OffT = std::conditional_t<FKDA_SLOT_OFFSET_BITS == 64, int64_t, int32_t>;
static_assert(FKDA_SLOT_OFFSET_BITS == 32 || FKDA_SLOT_OFFSET_BITS == 64, "offset bits");
static_assert(FKDA_STATE_BF16 == 0 || FKDA_STATE_BF16 == 1, "CUDA decode modules fix the state dtype");
static_assert(FKDA_PARAM_SCHEDULE == 0 || FKDA_PARAM_SCHEDULE == 2 || FKDA_PARAM_SCHEDULE == 3, "schedule");
static_assert(FKDA_CLUSTER_X == 1 && FKDA_CLUSTER_Y == 1 && FKDA_CLUSTER_Z == 1, "no clustered decode schedule");
static_assert((FKDA_PARAM_SCHEDULE == 3) == (FKDA_PERSISTENT_K > 0), "the stream schedule, and only it, is persistent");
#ifndef FKDA_PARAM_STATE_SMEM
#define FKDA_PARAM_STATE_SMEM 0
#endif
static_assert(FKDA_PARAM_STATE_SMEM == 0 || FKDA_PARAM_SCHEDULE == 0, "state_smem: the tile schedule");
#ifndef FKDA_PARAM_BULK_STORE
#define FKDA_PARAM_BULK_STORE 0
#endif
static_assert(FKDA_PARAM_BULK_STORE == 0 || (FKDA_PARAM_BULK_STORE == 1 && FKDA_PARAM_STATE_SMEM),
              "bulk_store: 0, or 1 with state_smem");
#if FKDA_PARAM_SCHEDULE == 3
// the cp.async ring: STAGES x (V_TILE rows x K keys) of state per CTA
static_assert(FKDA_SMEM_BYTES == FKDA_PARAM_STAGES * FKDA_PARAM_V_TILE * FKDA_HEAD_DIM_K * (FKDA_STATE_BF16 ? 2 : 4),
              "smem_bytes must equal stages * v_tile * K * state element size");
#elif FKDA_PARAM_STATE_SMEM
// the tile's state, brought in by one bulk copy
static_assert(FKDA_SMEM_BYTES == FKDA_PARAM_V_TILE * FKDA_HEAD_DIM_K * (FKDA_STATE_BF16 ? 2 : 4),
              "smem_bytes must equal v_tile * K * state element size");
#else
static_assert(FKDA_SMEM_BYTES == 0, "only the stream and state_smem schedules use dynamic shared memory");
#endif

#define FKDA_KERNEL_ARGS kStateBf16, FKDA_PARAM_LANES_PER_ROW, FKDA_PARAM_V_TILE, FKDA_THREADS, OffT

constexpr int kNumVT = FKDA_HEAD_DIM_V / FKDA_PARAM_V_TILE;

using fkda::Checker;
using fkda::Dim;

// [rows, n, d] of dtype `elem` (bf16; fp32 for g in a gb_f32 module) with the inner two dims dense;
// rows may be strided (views of packed projections).
void check_rows_tensor(const Checker& c, const TensorView& t, const char* name, int64_t rows,
                       const char* n_label, int64_t n, const char* d_label, int64_t d,
                       const TensorView& ref, DLDataType elem = fkda::kBF16) {
  fkda::check_cuda_device(c, t, name, ref, "out");
  c.shape(t, name, {{"rows", rows}, {n_label, n}, {d_label, d}});
  c.dtype(t, name, {elem});
  vector_rows(c, t, name, 0);
}

// g and beta: fp32 in a gb_f32 module, else bf16 (kda_decode_kernels.cuh, gb_t)
constexpr DLDataType kGbDtype = std::is_same_v<gb_t, float> ? fkda::kF32 : fkda::kBF16;

void kda_decode(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta,
                Optional<TensorView> A_log, Optional<TensorView> dt_bias, TensorView state,
                TensorView state_indices, TensorView out, int64_t gate_mode, double lower_bound,
                double scale, bool beta_is_logit, bool null_slot0) {
  constexpr int64_t K = FKDA_HEAD_DIM_K, V = FKDA_HEAD_DIM_V;
  static_assert(K == 128 && V == 128, "the decode kernels are written for K = V = 128");
  const Checker c("kda_decode");
  c.device_type(out, "out", kDLCUDA);
  const fkda::QVHeads heads = fkda::qv_heads(c, q, v, 3, "[rows, H, K]", "[rows, HV, V]");
  const int64_t rows = v.size(0), HV = heads.HV, H = heads.H;
  if (rows >= (int64_t(1) << 24)) FKDA_FAIL(c.fn()) << "at most 2^24 rows per call, got " << rows;
  check_rows_tensor(c, q, "q", rows, "H", H, "K", K, out);
  check_rows_tensor(c, k, "k", rows, "H", H, "K", K, out);
  check_rows_tensor(c, v, "v", rows, "HV", HV, "V", V, out);
  check_rows_tensor(c, g, "g", rows, "HV", HV, "K", K, out, kGbDtype);
  fkda::check_cuda_device(c, beta, "beta", out, "out");
  c.shape(beta, "beta", {{"rows", rows}, {"HV", HV}});
  c.dtype(beta, "beta", {kGbDtype});
  fkda::row_stride(c, beta, "beta", 0);  // read element by element: any row stride
  c.shape(out, "out", {{"rows", rows}, {"HV", HV}, {"V", V}});
  c.dtype(out, "out", {fkda::kBF16});
  c.contiguous(out, "out");
  fkda::check_cuda_device(c, state_indices, "state_indices", out, "out");
  c.shape(state_indices, "state_indices", {{"rows", rows}});
  c.dtype(state_indices, "state_indices", {fkda::kI32});
  c.contiguous(state_indices, "state_indices");
  fkda::check_cuda_device(c, state, "state", out, "out");
  c.shape(state, "state", {{"slots", -1}, {"HV", HV}, {"V", V}, {"K", K}});
  c.state_dtype(state, "state", {fkda::kF32, fkda::kBF16});
  const int64_t slots = state.size(0);
  // slots may sit apart (a paged cache), each one dense; offsets reach the pool's span
  const int64_t slot_stride = fkda::checked_pool_stride(c, state, "state", FKDA_SLOT_OFFSET_BITS, true);
  fkda::gate_and_scale(c, gate_mode, lower_bound, A_log, dt_bias, HV, K, out, "out", scale);
  if (dt_bias.has_value() && reinterpret_cast<uintptr_t>(fkda::data_ptr<char>(dt_bias.value())) % 16 != 0) {
    FKDA_FAIL(c.fn()) << "argument 'dt_bias' must be 16-byte aligned";
  }
  if (rows == 0) return;

  DecodeParams p = decode_params(q, k, v, g, beta, A_log, dt_bias, state, state_indices, out, slots, rows, H, HV,
                                 gate_mode, lower_bound, scale, beta_is_logit, null_slot0);
  p.q_row_stride = q.stride(0);
  p.k_row_stride = k.stride(0);
  p.v_row_stride = v.stride(0);
  p.g_row_stride = g.stride(0);
  p.beta_row_stride = beta.stride(0);
  p.slot_stride = slot_stride;

  if (rows * HV * kNumVT > INT32_MAX / 2) {  // tile indices are int in the kernels
    FKDA_FAIL(c.fn()) << "rows * HV = " << rows * HV << " is too large for one call";
  }
  const fkda::cuda::LaunchContext ctx(out);
  const dim3 block(FKDA_THREADS);
  const int64_t tiles = rows * HV * kNumVT;
#if FKDA_PARAM_SCHEDULE == 0
#if FKDA_PARAM_STATE_SMEM
  ctx.launch("kda_decode_tile_tma_kernel", kda_decode_tile_tma_kernel<FKDA_KERNEL_ARGS, FKDA_PARAM_BULK_STORE != 0>,
             dim3(static_cast<unsigned>(tiles)), block, FKDA_SMEM_BYTES, p);
#else
  ctx.launch("kda_decode_tile_kernel", kda_decode_tile_kernel<FKDA_KERNEL_ARGS>,
             dim3(static_cast<unsigned>(tiles)), block, FKDA_SMEM_BYTES, p);
#endif
#elif FKDA_PARAM_SCHEDULE == 3
  ctx.launch("kda_decode_stream_kernel",
             kda_decode_stream_kernel<FKDA_KERNEL_ARGS, FKDA_PARAM_STAGES>,
             dim3(static_cast<unsigned>(ctx.grid(tiles))), block, FKDA_SMEM_BYTES, p,
             static_cast<int>(tiles));
#else
  (void)tiles;
  ctx.launch("kda_decode_seq_kernel", kda_decode_seq_kernel<FKDA_KERNEL_ARGS>,
             dim3(static_cast<unsigned>(HV * kNumVT)), block, FKDA_SMEM_BYTES, p);
#endif
}

// The macros this module was compiled with, as JSON (rendered by flashkda_ext.jit.macros);
// tests compare them with jit/supported.json.
tvm::ffi::String fkda_contract() { return tvm::ffi::String(FKDA_CONTRACT_JSON); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_decode, kda_decode);
// written: state, out
FKDA_EXPORT_CHECKED(kda_decode, (1u << 7) | (1u << 9), -1, -1);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fkda_contract, fkda_contract);
