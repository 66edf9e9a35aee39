// TVM-FFI binding of the family kda_verify on sm_90a (contract: docs/architecture.md; semantics:
// docs/semantics.md, "Verify"). One source builds every verify module; the record's macros pick
//   FKDA_PARAM_V_TILE          V-rows per CTA (one CTA covers V_TILE of the 128 value columns)
//   FKDA_PARAM_LANES_PER_ROW   lanes sharing one V-row (16: 8 keys a lane)
//   FKDA_PARAM_STAGE_T         S tokens' inputs prepared at a time in shared memory (the staged kernel)
//   FKDA_PARAM_INDEX_CHAIN     (optional) the read slot loaded after the count, not beside it (stage2j8,
//                              where other CTAs hide the latency)
//   FKDA_PARAM_JOINT_PASSES    (optional) J > 1: the row sums of J passes share one shuffle butterfly
//                              (bitwise the per-pass sums; kda_verify_kernels.cuh)
//   FKDA_PARAM_WIDE_GATE       (optional) 1: the staged prep's decays computed by the whole CTA, not
//                              by the lane groups that prepare the tokens
//   FKDA_PARAM_GB_F32          (optional) 1: g and beta are fp32 (read as they are), else bf16 like q, k, v
//   FKDA_PARAM_BULK_STATE      (optional) 1: the state tile by bulk copy both ways through two tiles of
//                              dynamic shared memory (smem_bytes = 2 * v_tile * K * elem), the token
//                              loop on state registers
//   FKDA_PARAM_SPLIT_PREP      (optional, register-store kernels only) 1: each token prepared in registers
//                              just before its step, split between a warp's two lane groups, no prep block
//                              (kda_verify_kernels.cuh)
// The index values live on the device, so nothing here reads them: the kernel treats a read entry
// that is negative, 0 with null_slot0, >= slots, or a count outside [1, T_max] as a padding request,
// and a token entry that is negative / null / >= slots as "not stored"; with parent_tokens (a draft
// tree, register-store modules only) a parent outside [0, t) or not stored makes the request padding.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/binding.h"
#include "common/cuda_launch.h"
#include "common/verify_module.h"
#include "common/verify_cuda.h"

#if !defined(FKDA_PARAM_V_TILE) || !defined(FKDA_PARAM_LANES_PER_ROW) || !defined(FKDA_CONTRACT_JSON)
#error "kda_verify.cu is built from a module record: FKDA_PARAM_V_TILE/LANES_PER_ROW missing"
#endif

#include "kda_verify_kernels.cuh"
#include "decode/decode_params.h"

namespace {

using namespace fkda::verify_module;
constexpr int kNumVT = FKDA_HEAD_DIM_V / FKDA_PARAM_V_TILE;
#if !defined(FKDA_PARAM_STAGE_T)
#error "kda_verify.cu is built from a module record: FKDA_PARAM_STAGE_T missing"
#endif
#if defined(FKDA_PARAM_BULK_STATE)
static_assert(FKDA_PARAM_BULK_STATE == 1, "bulk_state: 1");
static_assert(FKDA_SMEM_BYTES == 2 * FKDA_PARAM_V_TILE * FKDA_HEAD_DIM_K * (FKDA_STATE_BF16 ? 2 : 4),
              "smem_bytes must equal 2 * v_tile * K * state element size");
constexpr int kBulkState = FKDA_PARAM_BULK_STATE;
#else
constexpr int kBulkState = 0;
#endif

// g and beta: fp32 in a gb_f32 module, else bf16 (decode/kda_decode_kernels.cuh, gb_t)
constexpr DLDataType kGbDtype = std::is_same_v<fkda_decode::gb_t, float> ? fkda::kF32 : fkda::kBF16;

// A packed [1, T, n, d] input of dtype `elem` (bf16; g: kGbDtype); the tokens may sit apart (views of
// an engine's packed projection), each one dense and 16-byte aligned (16-byte loads along K / V).
// Returns the token stride in elements. Without `strided` (out): contiguous.
int64_t check_packed(const Checker& c, const TensorView& t, const char* name, int64_t T, const char* n_label,
                     int64_t n, const char* d_label, int64_t d, const TensorView& ref, DLDataType elem = fkda::kBF16,
                     bool strided = true) {
  fkda::check_cuda_device(c, t, name, ref, "out");
  c.shape(t, name, {{"1", 1}, {"T", T}, {n_label, n}, {d_label, d}});
  c.dtype(t, name, {elem});
  if (strided) return fkda_decode::vector_rows(c, t, name, 1);
  c.contiguous(t, name);
  c.aligned(t, name, 16);
  return n * d;
}

void kda_verify(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta,
                Optional<TensorView> A_log, Optional<TensorView> dt_bias, TensorView state,
                TensorView state_indices, TensorView cu_seqlens, Optional<TensorView> num_accepted_tokens,
                Optional<TensorView> initial_state, Optional<TensorView> initial_state_indices,
                Optional<TensorView> parent_tokens, TensorView out, int64_t gate_mode, double lower_bound,
                double scale, bool beta_is_logit, bool null_slot0) {
  constexpr int64_t K = FKDA_HEAD_DIM_K, V = FKDA_HEAD_DIM_V;
  static_assert(K == 128 && V == 128, "the verify kernels are written for K = V = 128");
  const Checker c("kda_verify");
  c.device_type(out, "out", kDLCUDA);
  const fkda::QVHeads heads = fkda::qv_heads(c, q, v, 4, "[1, T, H, K]", "[1, T, HV, V]");
  const int64_t T = v.size(1), HV = heads.HV, H = heads.H;
  if (T >= (int64_t(1) << 24)) FKDA_FAIL(c.fn()) << "at most 2^24 tokens per call, got " << T;
  const int64_t q_stride = check_packed(c, q, "q", T, "H", H, "K", K, out);
  const int64_t k_stride = check_packed(c, k, "k", T, "H", H, "K", K, out);
  const int64_t v_stride = check_packed(c, v, "v", T, "HV", HV, "V", V, out);
  const int64_t g_stride = check_packed(c, g, "g", T, "HV", HV, "K", K, out, kGbDtype);
  check_packed(c, out, "out", T, "HV", HV, "V", V, out, fkda::kBF16, /*strided=*/false);
  fkda::check_cuda_device(c, beta, "beta", out, "out");
  c.shape(beta, "beta", {{"1", 1}, {"T", T}, {"HV", HV}});
  c.dtype(beta, "beta", {kGbDtype});
  const int64_t beta_stride = fkda::row_stride(c, beta, "beta", 1);  // read element by element: any token stride
  fkda::check_cuda_device(c, state_indices, "state_indices", out, "out");
  fkda::check_cuda_device(c, state, "state", out, "out");
  c.state_dtype(state, "state", {fkda::kF32, fkda::kBF16});
  // a pool with a slot table, or step rows (one row of T_max slots per request)
  const fkda::VerifyLayout pool =
      fkda::verify_layout(c, state, state_indices, {"HV", HV}, {"V", V}, {"K", K}, FKDA_SLOT_OFFSET_BITS, true);
  const int64_t N = pool.N, cols = pool.cols, slots = pool.slots;
  if (T < 1 || T > N * cols) {  // a request has 0 .. T_max tokens
    FKDA_FAIL(c.fn()) << "argument 'q' has T = " << T << " tokens; expected 1 .. N * T_max = " << N * cols
                      << " (each request 0 .. T_max tokens)";
  }
  fkda::check_verify_indices(c, state_indices, cu_seqlens, num_accepted_tokens, N, out);
  const fkda::InitialPool init =
      fkda::verify_initial_pool(c, initial_state, initial_state_indices, num_accepted_tokens, state, {"HV", HV},
                                {"V", V}, {"K", K}, N, FKDA_SLOT_OFFSET_BITS, out);
  if (parent_tokens.has_value()) {  // a draft tree: read back from the pool by the thread that stored it
    const TensorView& pt = parent_tokens.value();
    fkda::check_cuda_device(c, pt, "parent_tokens", out, "out");
    c.shape(pt, "parent_tokens", {{"N", N}, {"T_max", cols}});
    c.dtype(pt, "parent_tokens", {fkda::kI32});
    c.contiguous(pt, "parent_tokens");
    if (kBulkState) {
      FKDA_FAIL(c.fn()) << "argument 'parent_tokens': this module stores the state by bulk copy and cannot read a "
                           "parent's state back; a draft tree needs a register-store module (the routes pick one)";
    }
  }
  fkda::gate_and_scale(c, gate_mode, lower_bound, A_log, dt_bias, HV, K, out, "out", scale);
  if (dt_bias.has_value()) c.aligned(dt_bias.value(), "dt_bias", 16);
  if (N * HV * kNumVT > INT32_MAX / 2) FKDA_FAIL(c.fn()) << "N * HV = " << N * HV << " is too large for one call";

  fkda_verify::VerifyParams vp;
  fkda_decode::DecodeParams& p = vp.d;
  p = fkda_decode::decode_params(q, k, v, g, beta, A_log, dt_bias, state, state_indices, out, slots, T, H, HV,
                                 gate_mode, lower_bound, scale, beta_is_logit, null_slot0);
  p.q_row_stride = q_stride;  // a "row" of the decode tile is one packed token
  p.k_row_stride = k_stride;
  p.v_row_stride = v_stride;
  p.g_row_stride = g_stride;
  p.beta_row_stride = beta_stride;
  p.slot_stride = pool.slot_stride;  // slots may sit apart (a paged cache)
  vp.cu_seqlens = fkda::data_ptr<const int32_t>(cu_seqlens);
  vp.accepted = num_accepted_tokens.has_value() ? fkda::data_ptr<const int32_t>(num_accepted_tokens.value())
                                                : nullptr;
  vp.num_seqs = static_cast<int>(N);
  vp.index_cols = static_cast<int>(cols);
  vp.num_rows = static_cast<int>(pool.rows);
  vp.init_state = init.data;
  vp.init_idx = init.idx;
  vp.init_slots = init.slots;
  vp.init_slot_stride = init.slot_stride;
  vp.parent = parent_tokens.has_value() ? fkda::data_ptr<const int32_t>(parent_tokens.value()) : nullptr;

  const fkda::cuda::LaunchContext ctx(out);
  const int64_t grid = N * HV * kNumVT;  // one CTA per (request, head, V-tile)
  ctx.launch("kda_verify_staged_kernel",
             fkda_verify::kda_verify_staged_kernel<kStateBf16, FKDA_PARAM_LANES_PER_ROW, FKDA_PARAM_V_TILE,
                                                   FKDA_THREADS, OffT, FKDA_PARAM_STAGE_T, kBulkState>,
             dim3(static_cast<unsigned>(grid)), dim3(FKDA_THREADS), FKDA_SMEM_BYTES, vp);
}

tvm::ffi::String fkda_contract() { return tvm::ffi::String(FKDA_CONTRACT_JSON); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_verify, kda_verify);
// written: state (7), out (14); initial_state (11) may be the identical view of state
FKDA_EXPORT_CHECKED(kda_verify, (1u << 7) | (1u << 14), 7, 11);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fkda_contract, fkda_contract);
