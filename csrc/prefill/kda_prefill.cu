// TVM-FFI binding of the sm_90a prefill kernels (family kda_prefill, docs/architecture.md).
//
// Exports: kda_prefill (the family ABI), kda_prefill_workspace_bytes(total_tokens, num_seqs,
// value_heads) -> bytes of the optional workspace argument, fkda_contract().
// FKDA_PARAM_VT: the value-column tile of the state pass (16, 32 or 64: one module per tile, picked
// by jit/routes/kda_prefill.json from sequences x heads); its chunk ring depth follows the tile
// (default_ring: 3 for tiles 16 and 32, 2 for 64: one CTA an SM).
// FKDA_PARAM_SINGLE: 1 = a sequence of one chunk is finished inside the prep kernel (its state update
// run by the same CTA; the state pass skips it). Wins with many CTAs (>= 256 sequences x heads
// measured), loses with few (the CTA's 4 serial rounds are exposed): a route band, not a default.
// FKDA_PARAM_GROUPS (kda_prefill_state.cuh; default 1): 4-warp groups a state-pass CTA, each its own
// V tile, sharing one copy of every chunk's side data (grid V / (VT x groups) x HV x N).
// FKDA_PARAM_PIECES (kda_prefill_layout.cuh; default 1 = one CTA walks a sequence's chunks): P > 1
// splits each sequence's state pass into up to P pieces run in parallel (state_pieces: one wave), each
// from a zero state after a warm-up that attenuates the dropped state below 2^-24 (kda_prefill_state.cuh,
// piece_start). Not
// exact, so it writes no checkpoints: a call with checkpoints is refused (the routes never send one).
#include <cuda_runtime.h>

#include "../common/binding.h"
#include "../common/cuda_launch.h"
#include "../common/param_fill.h"
#include "../common/pool_args.h"
#include "kda_prefill_args.h"
#include "kda_prefill_prep.cuh"
#include "kda_prefill_state.cuh"

#if !defined(FKDA_PARAM_VT) || (FKDA_PARAM_VT != 16 && FKDA_PARAM_VT != 32 && FKDA_PARAM_VT != 64)
#error "FKDA_PARAM_VT must be 16, 32 or 64"
#endif
#ifndef FKDA_PARAM_SINGLE
#define FKDA_PARAM_SINGLE 0
#endif
#if FKDA_PARAM_SINGLE != 0 && FKDA_PARAM_SINGLE != 1
#error "FKDA_PARAM_SINGLE must be 0 or 1"
#endif
#if FKDA_PARAM_PIECES > 1 && FKDA_PARAM_SINGLE != 0
#error "FKDA_PARAM_PIECES > 1 is built without FKDA_PARAM_SINGLE (its initial-state copy is the prep's multi-chunk path)"
#endif
// The module record states the state pass launch shape; keep it and the kernels in step.
static_assert(FKDA_THREADS == 128 * fkda_prefill::kGroups,
              "the state pass runs 4 warps a group (module record 'threads' = 128 x params.groups)");
static_assert(fkda_prefill::kV % (FKDA_PARAM_VT * fkda_prefill::kGroups) == 0, "groups x V tile must divide V");
#ifdef FKDA_PARAM_CHUNK
static_assert(FKDA_PARAM_CHUNK == fkda_prefill::kC, "the kernels are written for chunk 64");
#endif
static_assert(FKDA_SMEM_BYTES == fkda_prefill::StateSmem<FKDA_PARAM_VT>::kTotal,
              "module record 'smem_bytes' must equal the state pass shared memory of its V tile");

namespace {

using namespace fkda;
using fkda_prefill::bf16;

#if FKDA_STATE_BF16 == 1
using StateT = __nv_bfloat16;
#else
using StateT = float;
#endif

// Fixed per module (its record's params), never switched at run time: one module, one behaviour.
constexpr int kTma = 1;                         // the state pass moves chunks with bulk copies (TMA)
constexpr int kSingle = FKDA_PARAM_SINGLE;       // sequences of one chunk finished inside the prep kernel

// State-pass CTAs a (sequence, head): one per V tile group.
constexpr int kTileCtas = fkda_prefill::kV / (FKDA_PARAM_VT * fkda_prefill::kGroups);

// A piece-split module's pieces for this call: as many as one wave of state-pass CTAs holds (one CTA
// an SM: the state pass's shared memory), at most the module's kPieces, at least 1 (then the chain is
// walked whole: the unsplit module's operations, bitwise). From the device's SM count, so the same
// module fills an H200 (132 SMs) at 8 heads with 16 pieces and at 48 heads with 2.
int state_pieces(const fkda::cuda::LaunchContext& ctx, int64_t N, int64_t HV) {
  if (fkda_prefill::kPieces == 1) return 1;
  return pieces_for_one_wave(fkda_prefill::kPieces, ctx.sm_count(), kTileCtas * HV * N);
}

template <int VT, int RING = fkda_prefill::default_ring<VT>()>
void launch_state(const fkda::cuda::LaunchContext& ctx, const fkda_prefill::StateArgs& sa, int N,
                  int HV, int pieces) {
  using SM = fkda_prefill::StateSmem<VT, RING>;
  ctx.launch("kda_state_kernel", fkda_prefill::kda_state_kernel<VT, RING, StateT>,
             dim3(kTileCtas, HV, N * pieces), dim3(FKDA_THREADS), SM::kTotal, sa);
}

void kda_prefill(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta,
                 OptTensor A_log, OptTensor dt_bias, TensorView cu_seqlens,
                 OptTensor initial_state, OptTensor final_state, OptTensor state_indices,
                 OptTensor checkpoints, TensorView out, OptTensor workspace, int64_t gate_mode,
                 double lower_bound, double scale, bool beta_is_logit, bool null_slot0,
                 int64_t checkpoint_every) {
  const char* fn = "kda_prefill";
  Checker ck(fn);
  const PrefillDims dm = prefill_token_args(ck, q, k, v, g, beta, out);
  const int64_t T = dm.T, H = dm.H, HV = dm.HV, V = dm.V, K = dm.K;
  const GateMode gm = ck.gate_mode(gate_mode);
  ck.lower_bound(gm, lower_bound);
  ck.gate_params(gm, A_log, dt_bias, HV, K, q, "q");
  ck.positive_finite(scale, "scale");
  const int64_t N = prefill_seq_count(ck, cu_seqlens, q);
  const PrefillStates ps = prefill_state_args(ck, q, initial_state, final_state, state_indices, N, HV, V, K);
  int64_t ckpt_count = 0;
  if (checkpoints.has_value()) {
    const TensorView& t = checkpoints.value();
    ck.same_device(t, "checkpoints", q, "q");
    ck.state_dtype(t, "checkpoints", {kF32, kBF16});
    ck.ndim(t, "checkpoints", 5, "[N, C, HV, V, K]");
    ckpt_count = t.size(1);
    ck.shape(t, "checkpoints", {{"N", N}, {"C", ckpt_count}, {"HV", HV}, {"V", V}, {"K", K}});
    ck.contiguous(t, "checkpoints");
    FKDA_CHECK(fkda_prefill::kPieces == 1, fn)
        << "argument 'checkpoints': this module splits each sequence into up to " << fkda_prefill::kPieces
        << " pieces (not exact), so it writes no checkpoints; use a module without pieces";
    FKDA_CHECK(checkpoint_every > 0 && checkpoint_every % fkda_prefill::kC == 0, fn)
        << "argument 'checkpoint_every' must be a positive multiple of the chunk ("
        << fkda_prefill::kC << ") when checkpoints are given, got " << checkpoint_every;
  }
  const int64_t need = fkda_prefill::workspace_bytes(T, N, HV, sizeof(StateT));
  if (workspace.has_value()) {
    const TensorView& w = workspace.value();
    ck.same_device(w, "workspace", q, "q");
    ck.dtype(w, "workspace", {kU8});
    ck.contiguous(w, "workspace");
    ck.aligned(w, "workspace", 16);
    FKDA_CHECK(w.numel() >= need, fn) << "argument 'workspace' must hold at least " << need
                                      << " bytes (kda_prefill_workspace_bytes), got " << w.numel();
  }

  // device guard (restored on return), the caller's stream, per-device kernel attributes, PDL
  const fkda::cuda::LaunchContext ctx(q);
  cudaStream_t stream = ctx.stream();

  uint8_t* ws = nullptr;
  bool own_ws = false;
  if (workspace.has_value()) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(data_ptr<uint8_t>(workspace.value()));
    const uintptr_t a = static_cast<uintptr_t>(fkda_prefill::kWorkspaceAlign);
    ws = reinterpret_cast<uint8_t*>((p + a - 1) / a * a);  // within the slack workspace_bytes adds
  } else if (need > 0) {
    // Stream-ordered, so this stays capturable in a CUDA graph (as a memory node).
    FKDA_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ws), need, stream), "cudaMallocAsync(workspace)");
    own_ws = true;
  }

  fkda_prefill::StateArgs sa;
  sa.ws = ws;
  sa.cu = data_ptr<void>(cu_seqlens);
  sa.cu64 = same_dtype(cu_seqlens.dtype(), kI64) ? 1 : 0;
  sa.N = static_cast<int>(N);
  sa.HV = static_cast<int>(HV);
  set_states(sa, initial_state, final_state, state_indices, ps, null_slot0);
  sa.ckpt = checkpoints.has_value() ? data_ptr<void>(checkpoints.value()) : nullptr;
  sa.ckpt_count = ckpt_count;
  sa.ckpt_every = checkpoint_every > 0 ? checkpoint_every : 1;
  sa.out = data_ptr<bf16>(out);
  sa.tma = kTma;
  sa.single = kSingle;
  const int pieces = state_pieces(ctx, N, HV);
#if FKDA_PARAM_PIECES > 1
  sa.init_copy = ws + fkda_prefill::init_copy_offset(T, N, HV);
  sa.pieces = pieces;
#endif

  const int64_t slots_chunks = fkda_prefill::num_chunk_slots(T, N);
  if (T > 0) {
    fkda_prefill::PrepArgs pa;
    set_token_inputs(pa, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, N);
    fkda::set_heads(pa, H, HV);
    fkda::set_gate_scale(pa, gate_mode, lower_bound, scale);
    pa.beta_logit = beta_is_logit ? 1 : 0;
    pa.ws = ws;
    pa.st = sa;
    // one CTA a (chunk slot, value head), heads adjacent (see the kernel)
    FKDA_CHECK(slots_chunks * HV <= 0x7fffffff, fn) << "too many chunks x value heads: " << slots_chunks * HV;
    ctx.launch("kda_prep_lite_kernel", fkda_prefill::kda_prep_lite_kernel<StateT>,
               dim3(static_cast<unsigned>(slots_chunks * HV)), dim3(fkda_prefill::kLiteThreads),
               fkda_prefill::kLiteSmem, pa);
  }

  launch_state<FKDA_PARAM_VT>(ctx, sa, static_cast<int>(N), static_cast<int>(HV), pieces);
  if (own_ws) FKDA_CUDA_CHECK(cudaFreeAsync(ws, stream), "cudaFreeAsync(workspace)");
}

int64_t kda_prefill_workspace_bytes(int64_t total_tokens, int64_t num_seqs, int64_t value_heads) {
  return fkda_prefill::workspace_bytes(total_tokens, num_seqs, value_heads, sizeof(StateT));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill, kda_prefill);
// written: final_state, checkpoints, out, workspace; the pool
FKDA_EXPORT_CHECKED(kda_prefill, (1u << 9) | (1u << 11) | (1u << 12) | (1u << 13), 8, 9);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_prefill_workspace_bytes, kda_prefill_workspace_bytes);
FKDA_EXPORT_CONTRACT();
