// Host side: the argument checks and parameter fills the two kda_prefill bindings share (kda_prefill.cu,
// the chunk-64 kernels; kda_prefill_c16.cu, the fused 16-token chunks): the token tensors, cu_seqlens,
// and the states / pool. Each binding calls the checks in its own order with its own checks between
// (gate, checkpoints, workspace), so a call fails on the same argument, with the same message, as
// before they were shared.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "../common/binding.h"
#include "../common/pool_args.h"
#include "kda_piece_rules.h"

namespace fkda {

struct PrefillDims {
  int64_t B, Tb, T, H, K, HV, V;  // T = B x Tb: the packed row of tokens cu_seqlens describes
};

// q, k [B, T, H, K], v, out [B, T, HV, V], g [B, T, HV, K], beta [B, T, HV]: CUDA (q), bf16,
// contiguous, 16-byte aligned, on q's device; head dims and counts this build serves.
inline PrefillDims prefill_token_args(const Checker& ck, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& g, const TensorView& beta,
                                      const TensorView& out) {
  ck.device_type(q, "q", kDLCUDA);
  ck.ndim(q, "q", 4, "[B, T, H, K]");
  // B > 1 rows of T tokens are contiguous, so they are the packed row of B * T tokens that
  // cu_seqlens (built by the caller) describes: the caller's own tensors are passed, never reshaped.
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
  return PrefillDims{B, Tb, T, H, K, HV, V};
}

// cu_seqlens [N+1], int32 or int64, contiguous, on q's device; returns N (1..65535: grid y / z).
inline int64_t prefill_seq_count(const Checker& ck, const TensorView& cu_seqlens, const TensorView& q) {
  const char* fn = ck.fn();
  ck.same_device(cu_seqlens, "cu_seqlens", q, "q");
  ck.dtype(cu_seqlens, "cu_seqlens", {kI32, kI64});
  ck.ndim(cu_seqlens, "cu_seqlens", 1, "[N+1]");
  ck.contiguous(cu_seqlens, "cu_seqlens");
  const int64_t N = cu_seqlens.size(0) - 1;
  FKDA_CHECK(N >= 1, fn) << "argument 'cu_seqlens' must hold at least 2 offsets, got " << N + 1;
  // (a piece-split call has N x pieces <= the SM count CTAs in z, or one piece: N)
  FKDA_CHECK(N <= 65535, fn) << "at most 65535 sequences per call, got " << N;
  return N;
}

// What every kda_prefill binding checks first, in this order: the token tensors, the gate (mode, lower bound, A_log /
// dt_bias), scale, cu_seqlens. Returns the dims, the gate mode and N.
struct PrefillCall {
  PrefillDims dm;
  GateMode gm;
  int64_t N;
};
inline PrefillCall prefill_call_args(const Checker& ck, const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& g, const TensorView& beta, const TensorView& out,
                                     const OptTensor& A_log, const OptTensor& dt_bias, const TensorView& cu_seqlens,
                                     int64_t gate_mode, double lower_bound, double scale) {
  const PrefillDims dm = prefill_token_args(ck, q, k, v, g, beta, out);
  const GateMode gm = ck.gate_mode(gate_mode);
  ck.lower_bound(gm, lower_bound);
  ck.gate_params(gm, A_log, dt_bias, dm.HV, dm.K, q, "q");
  ck.positive_finite(scale, "scale");
  return PrefillCall{dm, gm, prefill_seq_count(ck, cu_seqlens, q)};
}

// A caller's workspace: uint8, contiguous, 16-byte aligned, on q's device, at least `need` bytes.
inline void prefill_workspace_arg(const Checker& ck, const OptTensor& workspace, const TensorView& q, int64_t need) {
  if (!workspace.has_value()) return;
  const TensorView& w = workspace.value();
  ck.same_device(w, "workspace", q, "q");
  ck.dtype(w, "workspace", {kU8});
  ck.contiguous(w, "workspace");
  ck.aligned(w, "workspace", 16);
  FKDA_CHECK(w.numel() >= need, ck.fn()) << "argument 'workspace' must hold at least " << need
                                         << " bytes (kda_prefill_workspace_bytes), got " << w.numel();
}

struct PrefillStates {
  bool pool;            // state_indices given: the states are a pool of `slots` slots
  int64_t slots;        // N without a pool
  int64_t slot_stride;  // elements between slots (HV x V x K when dense or absent)
};

// initial_state / final_state [N or slots, HV, V, K] (fp32 or bf16 as the module's state), and
// state_indices [N] int32 when they are a pool.
inline PrefillStates prefill_state_args(const Checker& ck, const TensorView& q, const OptTensor& initial_state,
                                        const OptTensor& final_state, const OptTensor& state_indices, int64_t N,
                                        int64_t HV, int64_t V, int64_t K) {
  const char* fn = ck.fn();
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
  // elements between slots: dense states are contiguous; a pool's slots may sit apart (a paged
  // cache), each dense, with one stride for initial and final state (the kernels take one)
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
  return PrefillStates{pool, slots, slot_stride};
}

// The token inputs and cu_seqlens of a kernel parameter struct with these fields (fkda_prefill::PrepArgs,
// fkda_c16::Args).
template <typename Params>
inline void set_token_inputs(Params& p, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& g, const TensorView& beta, const OptTensor& A_log,
                             const OptTensor& dt_bias, const TensorView& cu_seqlens, int64_t N) {
  p.q = data_ptr<__nv_bfloat16>(q);
  p.k = data_ptr<__nv_bfloat16>(k);
  p.v = data_ptr<__nv_bfloat16>(v);
  p.g = data_ptr<__nv_bfloat16>(g);
  p.beta = data_ptr<__nv_bfloat16>(beta);
  p.A_log = A_log.has_value() ? data_ptr<float>(A_log.value()) : nullptr;
  p.dt_bias = dt_bias.has_value() ? data_ptr<float>(dt_bias.value()) : nullptr;
  p.cu = data_ptr<void>(cu_seqlens);
  p.cu64 = same_dtype(cu_seqlens.dtype(), kI64) ? 1 : 0;
  p.N = static_cast<int>(N);
}

// The states / pool of a kernel parameter struct with these fields (fkda_prefill::StateArgs, fkda_c16::Args).
template <typename Params>
inline void set_states(Params& p, const OptTensor& initial_state, const OptTensor& final_state,
                       const OptTensor& state_indices, const PrefillStates& ps, bool null_slot0) {
  p.init = initial_state.has_value() ? data_ptr<void>(initial_state.value()) : nullptr;
  p.fin = final_state.has_value() ? data_ptr<void>(final_state.value()) : nullptr;
  p.idx = ps.pool ? data_ptr<int32_t>(state_indices.value()) : nullptr;
  p.num_slots = ps.slots;
  p.slot_stride = ps.slot_stride;
  p.null_slot0 = null_slot0 ? 1 : 0;
}

}  // namespace fkda
