// TVM-FFI binding of the fused 16-token-chunk prefill (kda_prefill_c16.cuh; family kda_prefill, the
// same ABI as kda_prefill.cu). A source of its own, so the two-kernel modules' PTX is untouched.
//
// Exports: kda_prefill (the family ABI), kda_prefill_workspace_bytes(total_tokens, num_seqs,
// value_heads) -> 0 (no workspace: a caller's buffer is checked and left unused), fkda_contract().
// What it refuses (the route c16 never sends these; jit/routes/kda_prefill.json):
//   - a gate other than the bounded one, and the bounded gate below lower_bound -5: the factored
//     operands k exp(+-G) of a 16-token chunk stay finite only while |G| <= 16 x 5 nats;
//   - checkpoints (not written by this module).
// FKDA_PARAM_PIECES (default 1): up to that many CTAs a (sequence, head), each a run of its chunks after a bounded
// warm-up from a zero state (kda_prefill_c16.cuh, kPieces); the call's count is picked here, from the SM count.
#include <cuda_runtime.h>

#include <algorithm>

#include "../common/binding.h"
#include "../common/cuda_launch.h"
#include "../common/param_fill.h"
#include "../common/pool_args.h"
#include "kda_prefill_c16.cuh"

#ifdef FKDA_PARAM_CHUNK
static_assert(FKDA_PARAM_CHUNK == fkda_c16::kC, "the kernel is written for chunk 16");
#endif
static_assert(FKDA_THREADS == fkda_c16::kThreads, "module record 'threads' must be 128");
static_assert(FKDA_SMEM_BYTES == fkda_c16::kSmemBytes, "module record 'smem_bytes' must equal the kernel's shared memory");

namespace {

using namespace fkda;
using fkda_c16::bf16;

#if FKDA_STATE_BF16 == 1
using StateT = __nv_bfloat16;
#else
using StateT = float;
#endif

// The most negative lower_bound the factored 16-token operands allow (|G| <= 16 x 5 nats < fp32's
// exp range of 88.7).
constexpr double kMinLowerBound = -5.0;

void kda_prefill(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta,
                 OptTensor A_log, OptTensor dt_bias, TensorView cu_seqlens,
                 OptTensor initial_state, OptTensor final_state, OptTensor state_indices,
                 OptTensor checkpoints, TensorView out, OptTensor workspace, int64_t gate_mode,
                 double lower_bound, double scale, bool beta_is_logit, bool null_slot0,
                 int64_t checkpoint_every) {
  const char* fn = "kda_prefill";
  Checker ck(fn);
  ck.device_type(q, "q", kDLCUDA);
  ck.ndim(q, "q", 4, "[B, T, H, K]");
  const int64_t B = q.size(0), Tb = q.size(1), T = B * Tb, H = q.size(2), K = q.size(3);
  ck.ndim(v, "v", 4, "[B, T, HV, V]");
  const int64_t HV = v.size(2), V = v.size(3);
  ck.head_dims(K, V);
  ck.heads(H, HV);
  ck.shape(q, "q", {{"B", B}, {"T", Tb}, {"H", H}, {"K", K}});
  ck.shape(k, "k", {{"B", B}, {"T", Tb}, {"H", H}, {"K", K}});
  ck.shape(v, "v", {{"B", B}, {"T", Tb}, {"HV", HV}, {"V", V}});
  ck.shape(g, "g", {{"B", B}, {"T", Tb}, {"HV", HV}, {"K", K}});
  ck.shape(beta, "beta", {{"B", B}, {"T", Tb}, {"HV", HV}});
  ck.shape(out, "out", {{"B", B}, {"T", Tb}, {"HV", HV}, {"V", V}});
  struct NamedT { const TensorView* t; const char* name; };
  for (NamedT x : {NamedT{&q, "q"}, NamedT{&k, "k"}, NamedT{&v, "v"}, NamedT{&g, "g"},
                   NamedT{&beta, "beta"}, NamedT{&out, "out"}}) {
    ck.same_device(*x.t, x.name, q, "q");
    ck.dtype(*x.t, x.name, {kBF16});
    ck.contiguous(*x.t, x.name);
    ck.aligned(*x.t, x.name, 16);
  }
  const GateMode gm = ck.gate_mode(gate_mode);
  FKDA_CHECK(gm == GateMode::kBounded, fn)
      << "argument 'gate_mode': this module (16-token chunks) takes the bounded gate (1) only, got "
      << gate_mode << " (" << gate_mode_name(gm) << "); use a chunk-64 module";
  ck.lower_bound(gm, lower_bound);
  FKDA_CHECK(lower_bound >= kMinLowerBound, fn)
      << "argument 'lower_bound' must be >= " << kMinLowerBound
      << " for this module (16-token chunks keep exp(+-G) finite only there), got " << lower_bound
      << "; use a chunk-64 module";
  ck.gate_params(gm, A_log, dt_bias, HV, K, q, "q");
  ck.positive_finite(scale, "scale");
  ck.same_device(cu_seqlens, "cu_seqlens", q, "q");
  ck.dtype(cu_seqlens, "cu_seqlens", {kI32, kI64});
  ck.ndim(cu_seqlens, "cu_seqlens", 1, "[N+1]");
  ck.contiguous(cu_seqlens, "cu_seqlens");
  const int64_t N = cu_seqlens.size(0) - 1;
  FKDA_CHECK(N >= 1, fn) << "argument 'cu_seqlens' must hold at least 2 offsets, got " << N + 1;
  FKDA_CHECK(N <= 65535, fn) << "at most 65535 sequences per call, got " << N;
  FKDA_CHECK(!checkpoints.has_value(), fn)
      << "argument 'checkpoints': this module (16-token chunks) writes no checkpoints; use a chunk-64 module";
  (void)checkpoint_every;

  const bool pool = state_indices.has_value();
  int64_t slots = N;
  if (pool) {
    const TensorView& si = state_indices.value();
    ck.same_device(si, "state_indices", q, "q");
    ck.dtype(si, "state_indices", {kI32});
    ck.shape(si, "state_indices", {{"N", N}});
    ck.contiguous(si, "state_indices");
    FKDA_CHECK(initial_state.has_value() || final_state.has_value(), fn)
        << "argument 'state_indices' needs the pool as initial_state and/or final_state";
    slots = (initial_state.has_value() ? initial_state.value() : final_state.value()).size(0);
  }
  int64_t slot_stride = -1;
  for (int i = 0; i < 2; ++i) {
    const OptTensor& st = i ? final_state : initial_state;
    const char* name = i ? "final_state" : "initial_state";
    if (!st.has_value()) continue;
    const TensorView& t = st.value();
    ck.same_device(t, name, q, "q");
    ck.state_dtype(t, name, {kF32, kBF16});
    ck.shape(t, name, {{pool ? "slots" : "N", slots}, {"HV", HV}, {"V", V}, {"K", K}});
    if (!pool) {
      ck.contiguous(t, name);
      continue;
    }
    const int64_t stride = fkda::pool_slot_stride(ck, t, name);
    ck.aligned(t, name, 16);
    FKDA_CHECK(slot_stride < 0 || stride == slot_stride, fn)
        << "arguments 'initial_state' and 'final_state' (the pool) must have one slot stride, got "
        << slot_stride << " and " << stride;
    slot_stride = stride;
  }
  if (slot_stride < 0) slot_stride = HV * V * K;
  if (workspace.has_value()) {  // none needed; a buffer of the wrong kind is still refused
    const TensorView& w = workspace.value();
    ck.same_device(w, "workspace", q, "q");
    ck.dtype(w, "workspace", {kU8});
    ck.contiguous(w, "workspace");
  }

  const fkda::cuda::LaunchContext ctx(q);
  fkda_c16::Args a;
  a.q = data_ptr<bf16>(q);
  a.k = data_ptr<bf16>(k);
  a.v = data_ptr<bf16>(v);
  a.g = data_ptr<bf16>(g);
  a.beta = data_ptr<bf16>(beta);
  a.A_log = A_log.has_value() ? data_ptr<float>(A_log.value()) : nullptr;
  a.dt_bias = dt_bias.has_value() ? data_ptr<float>(dt_bias.value()) : nullptr;
  a.cu = data_ptr<void>(cu_seqlens);
  a.cu64 = same_dtype(cu_seqlens.dtype(), kI64) ? 1 : 0;
  a.N = static_cast<int>(N);
  a.H = static_cast<int>(H);
  a.HV = static_cast<int>(HV);
  a.group = static_cast<int>(HV / H);
  a.lower_bound = static_cast<float>(lower_bound);
  a.scale = static_cast<float>(scale);
  a.beta_logit = beta_is_logit ? 1 : 0;
  a.init = initial_state.has_value() ? data_ptr<void>(initial_state.value()) : nullptr;
  a.fin = final_state.has_value() ? data_ptr<void>(final_state.value()) : nullptr;
  a.idx = pool ? data_ptr<int32_t>(state_indices.value()) : nullptr;
  a.num_slots = slots;
  a.slot_stride = slot_stride;
  a.null_slot0 = null_slot0 ? 1 : 0;
  a.out = data_ptr<bf16>(out);
  (void)T;
  // Pieces (kda_prefill_c16.cuh, kPieces): as many as one wave of 2 CTAs an SM holds, at most the record's, at least
  // 1. A piece that walks back to chunk 0 reads the initial state while the last piece may already store the final
  // state: when the two overlap (a pool updated in place) the call runs unsplit.
  int pieces = 1;
  if (fkda_c16::kPieces > 1) {
    const int64_t fit = int64_t(FKDA_MIN_BLOCKS) * ctx.sm_count() / (HV * N);
    pieces = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(fkda_c16::kPieces, fit)));
    if (initial_state.has_value() && final_state.has_value() &&
        Extent::of(initial_state.value()).overlaps(Extent::of(final_state.value())))
      pieces = 1;
  }
  a.pieces = pieces;
  // one CTA a (value head, sequence), heads adjacent: CTAs that run together read the same tokens' rows
  ctx.launch("kda_prefill_c16_kernel", fkda_c16::kda_prefill_c16_kernel<StateT>,
             dim3(static_cast<unsigned>(HV), static_cast<unsigned>(N), static_cast<unsigned>(pieces)),
             dim3(fkda_c16::kThreads),
             fkda_c16::kSmemBytes, a);
}

int64_t kda_prefill_workspace_bytes(int64_t, int64_t, int64_t) { return 0; }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill, kda_prefill);
// written: final_state, checkpoints, out, workspace; the pool
FKDA_EXPORT_CHECKED(kda_prefill, (1u << 9) | (1u << 11) | (1u << 12) | (1u << 13), 8, 9);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill_workspace_bytes, kda_prefill_workspace_bytes);
FKDA_EXPORT_CONTRACT();
