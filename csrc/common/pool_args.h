// Argument checks the state-pool bindings (decode, fused decode, verify, fused verify; CPU and CUDA)
// share beyond binding.h's Checker: head counts and dims of q / v, the pool's rank and extents, the
// slot table state_indices [N, T_max], the gate / scale options.
#pragma once

#include <climits>
#include <cstdint>

#include "binding.h"

namespace fkda {

struct QVHeads {
  int64_t H, K, HV, V;
};

// q [.., H, K] and v [.., HV, V] of rank `rank` (layouts as the messages show them); the head dims
// and counts this build serves.
inline QVHeads qv_heads(const Checker& c, const TensorView& q, const TensorView& v, int rank, const char* q_layout,
                        const char* v_layout) {
  c.ndim(q, "q", rank, q_layout);
  c.ndim(v, "v", rank, v_layout);
  const QVHeads h{q.size(rank - 2), q.size(rank - 1), v.size(rank - 2), v.size(rank - 1)};
  c.head_dims(h.K, h.V);
  c.heads(h.H, h.HV);
  return h;
}

struct FusedHeads {
  int64_t H, D;
};

// g [.., H, D] of rank `rank` of a fused op (value heads = key heads, K = V = D).
inline FusedHeads fused_heads(const Checker& c, const TensorView& g, int rank, const char* layout) {
  c.ndim(g, "g", rank, layout);
  const FusedHeads h{g.size(rank - 2), g.size(rank - 1)};
  c.head_dims(h.D, h.D);
  c.heads(h.H, h.H, "g", "g");
  return h;
}

// A state pool [slots, a, b, d] (layout as the messages show it, e.g. "[slots, HV, V, K]"): its slot
// count.
inline int64_t pool_slots(const Checker& c, const TensorView& state, const char* layout, Dim a, Dim b, Dim d) {
  c.ndim(state, "state", 4, layout);
  const int64_t slots = state.size(0);
  c.shape(state, "state", {{"slots", slots}, a, b, d});
  return slots;
}

// The rule on one slot's layout, shared with kda_verify's step rows (verify_layout): dims first..first+2
// of t, a slot's [a, b, d], row-major dense (a dim of size 1 may carry any stride).
inline bool slot_dense(const TensorView& t, int first) {
  const int64_t a = t.size(first), b = t.size(first + 1), d = t.size(first + 2);
  return (d <= 1 || t.stride(first + 2) == 1) && (b <= 1 || t.stride(first + 1) == d) &&
         (a <= 1 || t.stride(first) == b * d);
}

// ... and on the stride between slots (elements of `bytes` bytes): one slot's elements, or more as a
// multiple of 16 bytes.
inline bool slot_stride_ok(int64_t stride, int64_t elems, int64_t bytes) {
  return stride == elems || (stride > elems && (stride * bytes) % 16 == 0);
}

// The slot stride, in elements, of a state pool [slots, a, b, d] (docs/semantics.md, "Strided
// pools"): dims 1-3 dense (strides b*d, d, 1; a dim of size 1 may carry any stride), and a slot
// stride of a*b*d (a dense pool) or more, then a multiple of 16 bytes: serving engines keep each
// slot in a page of its own (vLLM: the conv and recurrent states of a request in one page), and the
// bulk copies (TMA) move 16-byte-aligned tiles from each slot's base. Slots never overlap. A pool of
// at most one slot returns a*b*d (its stride is never used).
inline int64_t pool_slot_stride(const Checker& c, const TensorView& state, const char* name) {
  const int64_t a = state.size(1), b = state.size(2), d = state.size(3), elems = a * b * d;
  const int64_t stride = state.size(0) <= 1 ? elems : state.stride(0);
  const int64_t bytes = state.dtype().bits / 8;
  if (!slot_dense(state, 1) || !slot_stride_ok(stride, elems, bytes)) {
    const int64_t st[4] = {state.stride(0), state.stride(1), state.stride(2), state.stride(3)};
    FKDA_FAIL(c.fn()) << "argument '" << name << "' must have dims 1-3 contiguous (strides " << b * d << ", " << d
                      << ", 1) and a slot stride of " << elems << " elements, or more as a multiple of 16 bytes ("
                      << 16 / (bytes > 0 ? bytes : 1) << " elements); got shape " << shape_str(state)
                      << " with strides " << list_str(st);
  }
  return stride;
}

// Elements from a pool's first to one past its last slot: what its element offsets reach.
inline int64_t pool_span(const TensorView& state, int64_t slot_stride) {
  const int64_t slots = state.size(0);
  return slots <= 0 ? 0 : (slots - 1) * slot_stride + state.size(1) * state.size(2) * state.size(3);
}

// The largest element offset into the pool (span - 1) must fit a signed index of `bits` bits.
inline void pool_offsets_fit(const Checker& c, const char* name, int64_t span, int bits) {
  if (bits >= 64) return;
  const int64_t limit = (int64_t{1} << (bits - 1)) - 1;
  if (span - 1 > limit) {
    FKDA_FAIL(c.fn()) << "argument '" << name << "' spans " << span << " elements, more than this module's "
                      << bits << "-bit slot offsets address (max " << limit << "); use a module with 64-bit "
                      << "offsets (o64)";
  }
}

// The pool checks every binding makes, in this order: the slot stride (pool_slot_stride), the base
// 16-byte aligned when align16 (the CUDA modules' vector and bulk copies), and the span within the
// module's `bits`-bit offsets. Returns the slot stride in elements.
inline int64_t checked_pool_stride(const Checker& c, const TensorView& state, const char* name, int bits,
                                   bool align16) {
  const int64_t stride = pool_slot_stride(c, state, name);
  if (align16) c.aligned(state, name, 16);
  pool_offsets_fit(c, name, pool_span(state, stride), bits);
  return stride;
}

struct PoolLayout {
  int64_t slots, slot_stride;  // slot_stride in elements
};

struct SlotTable {
  int64_t N, cols;  // requests, T_max
};

// The rank and extents of state_indices (its device and dtype: the caller, in its own order).
inline SlotTable slot_table(const Checker& c, const TensorView& state_indices) {
  c.ndim(state_indices, "state_indices", 2, "[N, T_max]");
  const int64_t N = state_indices.size(0), cols = state_indices.size(1);
  if (N < 1 || cols < 1) {
    FKDA_FAIL(c.fn()) << "argument 'state_indices' must be [N, T_max] with N, T_max >= 1, got [" << N << ", "
                      << cols << "]";
  }
  return SlotTable{N, cols};
}

// kda_verify's state and state_indices (docs/semantics.md, "Verify"): a pool [slots, HV, V, K] with a
// slot table [N, T_max], or step rows [R, T_max, HV, V, K] with one row per request [N], entry (n, t)
// being slot row * T_max + t of the R * T_max slots (SGLang's intermediate state buffer). A row's T_max
// slots are dense or apart as a strided pool's (the step stride), rows follow each other at T_max
// steps, and R * T_max fits int32 (the slot indices). Devices and dtypes: the caller.
struct VerifyLayout {
  int64_t N, cols;          // requests, T_max
  int64_t slots, slot_stride;
  int64_t rows;             // step rows: R; 0 for a slot table
};

inline VerifyLayout verify_layout(const Checker& c, const TensorView& state, const TensorView& state_indices, Dim a,
                                  Dim b, Dim d, int bits, bool align16) {
  VerifyLayout l{};
  if (state.ndim() != 5) {
    c.ndim(state, "state", 4, "[slots, HV, V, K] (or step rows [R, T_max, HV, V, K])");
    c.shape(state, "state", {{"slots", -1}, a, b, d});
    const SlotTable t = slot_table(c, state_indices);
    l.N = t.N, l.cols = t.cols, l.slots = state.size(0);
    l.slot_stride = checked_pool_stride(c, state, "state", bits, align16);
    return l;
  }
  c.shape(state, "state", {{"R", -1}, {"T_max", -1}, a, b, d});
  c.ndim(state_indices, "state_indices", 1, "[N] (one row of state per request)");
  l.N = state_indices.size(0), l.cols = state.size(1), l.rows = state.size(0);
  if (l.N < 1 || l.cols < 1) {
    FKDA_FAIL(c.fn()) << "argument 'state_indices' must be [N] and state [R, T_max, ..] with N, T_max >= 1, got N = "
                      << l.N << ", T_max = " << l.cols;
  }
  if (l.rows * l.cols > INT32_MAX) {
    FKDA_FAIL(c.fn()) << "argument 'state' has R * T_max = " << l.rows * l.cols
                      << " slots, more than int32 indices address";
  }
  const int64_t elems = a.value * b.value * d.value;
  // the stride between consecutive slots of the R * T_max (with T_max = 1: between rows)
  const int64_t step = l.cols > 1 ? state.stride(1) : (l.rows > 1 ? state.stride(0) : elems);
  const int64_t bytes = state.dtype().bits / 8;
  if (!slot_dense(state, 2) || !slot_stride_ok(step, elems, bytes) ||
      (l.rows > 1 && state.stride(0) != l.cols * step)) {
    const int64_t st[5] = {state.stride(0), state.stride(1), state.stride(2), state.stride(3), state.stride(4)};
    FKDA_FAIL(c.fn()) << "argument 'state' (step rows [R, T_max, HV, V, K]) must have dims 2-4 contiguous, a step "
                      << "stride of " << elems << " elements or more as a multiple of 16 bytes, and rows T_max steps "
                      << "apart; got shape " << shape_str(state) << " with strides " << list_str(st);
  }
  if (align16) c.aligned(state, "state", 16);
  l.slots = l.rows * l.cols;
  l.slot_stride = step;
  pool_offsets_fit(c, "state", l.slots <= 0 ? 0 : (l.slots - 1) * step + elems, bits);
  return l;
}

// kda_verify's optional second start-state pool (docs/semantics.md, "Verify"): initial_state
// [slots2, HV, V, K] in state's dtype, read only, its slots dense and possibly apart like state's;
// initial_state_indices int32 [N]. Given together or not at all, and never with num_accepted_tokens
// (the start slot is then initial_state_indices[n], no column of state_indices). Devices: the caller.
struct InitialPool {
  const void* data = nullptr;
  const int32_t* idx = nullptr;  // nullptr: no second pool
  int64_t slots = 0, slot_stride = 0;
};

inline InitialPool initial_pool(const Checker& c, const OptTensor& initial_state,
                                const OptTensor& initial_state_indices, const OptTensor& num_accepted_tokens,
                                const TensorView& state, const TensorView& out, Dim a, Dim b, Dim d, int64_t N,
                                int bits, bool align16) {
  if (initial_state.has_value() != initial_state_indices.has_value()) {
    FKDA_FAIL(c.fn()) << "argument '" << (initial_state.has_value() ? "initial_state_indices" : "initial_state")
                      << "' is missing: initial_state and initial_state_indices are given together or not at all";
  }
  if (!initial_state.has_value()) return InitialPool{};
  if (num_accepted_tokens.has_value()) {
    FKDA_FAIL(c.fn()) << "argument 'num_accepted_tokens' must be absent with initial_state (request n starts "
                         "from initial_state[initial_state_indices[n]])";
  }
  const TensorView& init = initial_state.value();
  const TensorView& idx = initial_state_indices.value();
  c.ndim(init, "initial_state", 4, "[slots, HV, V, K]");
  c.shape(init, "initial_state", {{"slots", -1}, a, b, d});
  c.same_dtype_as(init, "initial_state", state, "state");
  c.shape(idx, "initial_state_indices", {{"N", N}});
  c.dtype(idx, "initial_state_indices", {kI32});
  c.contiguous(idx, "initial_state_indices");
  InitialPool p;
  p.slot_stride = checked_pool_stride(c, init, "initial_state", bits, align16);
  // read while state is written: state itself (the same slots), or memory apart from it
  if (Extent::of(init).overlaps(Extent::of(state)) && !same_view(init, state)) {
    FKDA_FAIL(c.fn()) << "argument 'initial_state' overlaps 'state' without being the same view: pass state "
                         "itself or a pool apart from it";
  }
  // out is written while initial_state is read (python: check_apart refuses it first)
  if (Extent::of(init).overlaps(Extent::of(out))) {
    FKDA_FAIL(c.fn()) << "argument 'initial_state' overlaps 'out': the start states are read while out is written";
  }
  p.data = data_ptr<const void>(init);
  p.idx = data_ptr<const int32_t>(idx);
  p.slots = init.size(0);
  return p;
}

// gate_mode, lower_bound, A_log [HV] and dt_bias [HV*K] (on ref's device, ref named ref_name), scale.
inline GateMode gate_and_scale(const Checker& c, int64_t gate_mode, double lower_bound, const OptTensor& A_log,
                               const OptTensor& dt_bias, int64_t HV, int64_t K, const TensorView& ref,
                               const char* ref_name, double scale) {
  const GateMode mode = c.gate_mode(gate_mode);
  c.lower_bound(mode, lower_bound);
  c.gate_params(mode, A_log, dt_bias, HV, K, ref, ref_name);
  c.positive_finite(scale, "scale");
  return mode;
}

}  // namespace fkda
