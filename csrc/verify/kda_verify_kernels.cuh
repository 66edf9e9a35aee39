// KDA speculative-decoding verify on a state pool [slots, HV, V, K] (K contiguous), sm_90a.
//
// One CTA per (request, value head, V-tile), the decode tile schedule's layout
// (decode/kda_decode_kernels.cuh: a warp owns whole V-rows, LPR lanes per V-row, 16-byte state
// chunks) with the request's tokens looped inside: the state tile is read once into registers and
// stays there; after each token it is packed to the pool's dtype (kept packed: the next token
// continues from exactly the stored value, so T = 1 is the decode step and token t equals a decode
// call on the state stored after token t - 1) and, when the token's entry is live, stored to its
// slot. The tokens' inputs are staged and prepared in shared memory, S at a time (below).
#pragma once

#include "decode/kda_decode_kernels.cuh"

namespace fkda_verify {

using fkda_decode::DecodeParams;
using fkda_decode::bf16;

// The decode parameters (q .. out with token-major rows: a "row" is a packed token) plus the
// request table and, optionally, a second pool the start states are read from.
struct VerifyParams {
  DecodeParams d;
  const int32_t* cu_seqlens;  // [N+1]
  const int32_t* accepted;    // [N] or nullptr (= column 0)
  int num_seqs, index_cols;   // N, T_max (columns of d.idx, which is [N, T_max])
  // > 0: step rows, the pool is R = num_rows rows of T_max slots (state [R, T_max, HV, V, K] seen as R * T_max
  // slots) and d.idx is [N]: entry (n, t) is d.idx[n] * T_max + t, every entry padding for a padding row
  int num_rows;
  // initial_state [init_slots, HV, V, K] (read only, the pool's dtype) and initial_state_indices [N]:
  // request n starts from init_state[init_idx[n]]; nullptr init_idx: from d.state at its read entry
  const void* init_state;
  const int32_t* init_idx;
  int64_t init_slots, init_slot_stride;  // init_slot_stride in elements
  // parent_tokens [N, T_max] (a draft tree) or nullptr (a chain): token t >= 1 of request n continues from
  // the state stored after its token parent[n * T_max + t] (register-store kernels only: it is read back
  // from the pool by the thread that stored it)
  const int32_t* parent;
};

// Request n's tokens [bos, bos + len) and the slot it starts from (read, in the pool it is read
// from; -1 when the request is padding: a count outside [1, T_max] makes it so, as a padding or
// out-of-range slot does). Tokens past T_max have no slot column: never stored (a valid call has
// T_n <= T_max). len <= 0: nothing to do, and read is not set.
struct Request {
  int bos, len;
  const int32_t* row_idx;  // [T_max]: the slot of each token
  int32_t base;            // step rows: the row's first slot, -1 for a padding row
  int32_t read;
};
// The slot a request starts from: its row's entry at column col, -1 (padding) for a column outside
// [0, T_max).
__device__ __forceinline__ int32_t read_slot(const VerifyParams& vp, const int32_t* row_idx, int col) {
  return (col >= 0 && col < vp.index_cols) ? __ldg(row_idx + col) : -1;
}
// slot, or -1 where it names no slot of a pool of `slots` (negative, 0 with null_slot0, >= slots)
__device__ __forceinline__ int32_t live_or_pad(const VerifyParams& vp, int32_t slot, int64_t slots) {
  return (slot < 0 || (vp.d.null_slot0 && slot == 0) || slot >= slots) ? -1 : slot;
}
// Token t of the request: its raw beta and the slot it stores to (-1 past T_max: not stored).
__device__ __forceinline__ void token_beta_slot(const VerifyParams& vp, const Request& rq, int hv, int t,
                                                fkda_decode::gb_t& beta, int32_t& dst) {
  beta = vp.d.beta[(rq.bos + t) * vp.d.beta_row_stride + hv];
  if (vp.num_rows > 0) dst = rq.base >= 0 && t < vp.index_cols ? rq.base + t : -1;
  else dst = t < vp.index_cols ? __ldg(rq.row_idx + t) : -1;
}
// Entry (n, t)'s slot, or -1 where it stores nothing (padding, past T_max).
__device__ __forceinline__ int32_t entry_slot(const VerifyParams& vp, const Request& rq, int t) {
  if (t < 0 || t >= vp.index_cols) return -1;
  if (vp.num_rows > 0) return rq.base >= 0 ? rq.base + t : -1;
  return live_or_pad(vp, __ldg(rq.row_idx + t), vp.d.num_slots);
}
// A draft tree's parents for a request that is not padding: true (on every thread of the CTA) when one of
// its tokens t >= 1 names a parent outside [0, t) or one whose state is not stored; the request is then
// padding (zeros, nothing stored), decided before anything is written. Column 0 is not read.
template <int THREADS>
__device__ __forceinline__ bool tree_refused(const VerifyParams& vp, const Request& rq, int n) {
  bool bad = false;
  const int32_t* row = vp.parent + static_cast<int64_t>(n) * vp.index_cols;
  for (int t = 1 + threadIdx.x; t < rq.len; t += THREADS) {
    const int32_t pt = t < vp.index_cols ? __ldg(row + t) : -1;
    bad |= pt < 0 || pt >= t || entry_slot(vp, rq, pt) < 0;
  }
  return __syncthreads_or(bad) != 0;
}
// Token t's source when it does not continue from token t - 1 (a tree's branch): its parent's slot; -1
// otherwise (the state registers go on).
__device__ __forceinline__ int32_t tree_source(const VerifyParams& vp, const Request& rq, int n, int t) {
  if (vp.parent == nullptr || t == 0) return -1;
  const int32_t pt = __ldg(vp.parent + static_cast<int64_t>(n) * vp.index_cols + t);
  return pt == t - 1 ? -1 : entry_slot(vp, rq, pt);
}

// With T_max <= kRowAhead the whole slot row is loaded beside cu_seqlens and the count, and the read
// slot picked from registers: one dependent load fewer (about one memory latency) before the state
// load can start. Longer rows load the one entry once the count is known.
constexpr int kRowAhead = 8;
// With a second start pool (init_idx) the read entry is its [N] index, loaded beside cu_seqlens. Step
// rows: the row (d.idx[n]) is loaded beside them too; a padding row makes the request padding (as a
// padding row of kda_decode does), whatever its read entry.
__device__ __forceinline__ Request request_of(const VerifyParams& vp, int n) {
  Request rq;
  rq.row_idx = vp.d.idx + static_cast<int64_t>(n) * vp.index_cols;
  if (vp.num_rows > 0) {
    const int32_t row = __ldg(vp.d.idx + n);
    const int32_t init = vp.init_idx ? __ldg(vp.init_idx + n) : 0;
    const int col = !vp.init_idx && vp.accepted ? __ldg(vp.accepted + n) - 1 : 0;
    rq.bos = __ldg(vp.cu_seqlens + n);
    rq.len = __ldg(vp.cu_seqlens + n + 1) - rq.bos;
    rq.base = live_or_pad(vp, row, vp.num_rows) < 0 ? -1 : row * vp.index_cols;  // < 2^31: the binding
    if (rq.base < 0) rq.read = -1;
    else if (vp.init_idx) rq.read = live_or_pad(vp, init, vp.init_slots);
    else rq.read = col >= 0 && col < vp.index_cols ? rq.base + col : -1;
    return rq;
  }
  if (vp.init_idx) {
    const int32_t init = __ldg(vp.init_idx + n);
    rq.bos = __ldg(vp.cu_seqlens + n);
    rq.len = __ldg(vp.cu_seqlens + n + 1) - rq.bos;
    rq.read = live_or_pad(vp, init, vp.init_slots);
    return rq;
  }
#if !defined(FKDA_PARAM_INDEX_CHAIN) || FKDA_PARAM_INDEX_CHAIN == 0
  int32_t row[kRowAhead];
  const bool ahead = vp.index_cols <= kRowAhead;
#pragma unroll
  for (int i = 0; i < kRowAhead; ++i) row[i] = ahead && i < vp.index_cols ? __ldg(rq.row_idx + i) : -1;
#endif
  rq.bos = __ldg(vp.cu_seqlens + n);
  rq.len = __ldg(vp.cu_seqlens + n + 1) - rq.bos;
  const int col = vp.accepted ? __ldg(vp.accepted + n) - 1 : 0;
  if (rq.len <= 0) return rq;
#if !defined(FKDA_PARAM_INDEX_CHAIN) || FKDA_PARAM_INDEX_CHAIN == 0
  if (ahead) {
    rq.read = -1;
#pragma unroll
    for (int i = 0; i < kRowAhead; ++i) rq.read = i == col ? row[i] : rq.read;  // col outside: -1
    rq.read = live_or_pad(vp, rq.read, vp.d.num_slots);
    return rq;
  }
#endif
  rq.read = live_or_pad(vp, read_slot(vp, rq.row_idx, col), vp.d.num_slots);
  return rq;
}

// The first element of request n's start tile (value head hv, V-rows from vrow0): in the second
// pool when there is one, else in the state pool. rq.read must be live.
template <typename T, typename OffT>
__device__ __forceinline__ const typename T::Elem* read_tile(const VerifyParams& vp, const Request& rq, int hv,
                                                             int vrow0) {
  using Elem = typename T::Elem;
  const bool second = vp.init_idx != nullptr;
  const Elem* pool = static_cast<const Elem*>(second ? vp.init_state : vp.d.state);
  const int64_t stride = second ? vp.init_slot_stride : vp.d.slot_stride;
  return pool +
         (static_cast<OffT>(rq.read) * static_cast<OffT>(stride) + static_cast<OffT>((hv * T::V + vrow0) * T::K));
}

// FKDA_PARAM_JOINT_PASSES = J > 1 (staged kernels): the step's row sums of J passes share one
// butterfly (JointSum below); 1 (default): decode's step_passes, one butterfly per pass and sum.
#if defined(FKDA_PARAM_JOINT_PASSES)
constexpr int kJointPasses = FKDA_PARAM_JOINT_PASSES;
#else
constexpr int kJointPasses = 1;
#endif

// FKDA_PARAM_WIDE_GATE = 1 (staged kernels): the block's decays computed by the whole CTA
// (Staged::prepare_block).
#if defined(FKDA_PARAM_WIDE_GATE)
constexpr bool kWideGate = FKDA_PARAM_WIDE_GATE != 0;
#else
constexpr bool kWideGate = false;
#endif

// FKDA_PARAM_SPLIT_PREP (register-store staged kernels, not with wide_gate; w1v16j4s, f32_192's module): no prep
// block: each token is prepared in registers right before its step, as vLLM's kernel prepares each token inside its
// loop, the prep split between a warp's two lane groups (Staged::split_scalars / split_finish; needs CHUNKS == 32 /
// LPR, w1v16j4's shape): group r computes the gate of chunk r's keys only (half the exp / log1p / division) and one
// of the two l2norm butterflies (group 0 q's sum of squares, group 1 k's), and the halves are exchanged by shuffles
// across the groups (4 decays, 1 sum). Each key's decay and each butterfly are the same operations on the same
// values, so every value is bitwise decode's prepare() (the chained-decode tests hold it bitwise). The first step
// waits for one token's prep instead of the block's, and there is no prep barrier.
#if defined(FKDA_PARAM_SPLIT_PREP)
constexpr int kSplitPrep = FKDA_PARAM_SPLIT_PREP;
#else
constexpr int kSplitPrep = 0;
#endif
static_assert(kSplitPrep == 0 || kSplitPrep == 1, "split_prep: 0 or 1");
static_assert(!(kSplitPrep && kWideGate), "split_prep computes the decays in the lanes: not with wide_gate");

// The row sums of J passes (J values a lane) over each aligned group of LPR lanes, in one
// butterfly. decode's group_sum runs one butterfly a value: log2(LPR) shuffles and adds each, every
// lane ending with the sum. Here, at each of the first log2(J) levels, a lane keeps half of its values
// (the upper half when its lane bit of that level is set) and sends the other half to its partner,
// which keeps that half: J / 2 shuffles a level instead of J. After log2(J) levels a lane holds one
// value's partial sum (the pass own(lane)), and the remaining levels finish it as group_sum does.
// Every add has the operands group_sum gives it, in its order (the lane's own partial sum first, the
// partner's second), so each sum is bitwise group_sum's. No library does a multi-value butterfly
// with this operand order (cub's warp reductions fix their own tree), hence written here.
template <int LPR, int J>
struct JointSum {
  static_assert(J >= 1 && (J & (J - 1)) == 0 && J <= LPR, "J: a power of two, at most LPR");
  // The pass of a group whose sum `lane` ends with.
  __device__ static int own(int lane) {
    int q = 0;
#pragma unroll
    for (int h = J / 2, off = LPR / 2; h >= 1; h >>= 1, off >>= 1) q += (lane & off) ? h : 0;
    return q;
  }
  // A lane of `lane`'s group that ends with pass q's sum.
  __device__ static int owner(int lane, int q) {
    int l = lane & ~(LPR - 1);
#pragma unroll
    for (int h = J / 2, off = LPR / 2; h >= 1; h >>= 1, off >>= 1) l += (q & h) ? off : 0;
    return l;
  }
  // Lanes whose bits below the split levels are zero: one lane of each pass's owners.
  __device__ static bool first_owner(int lane) { return (lane & (LPR / J - 1)) == 0; }
  __device__ static float sum(float (&x)[J], int lane) {
    int off = LPR / 2;
#pragma unroll
    for (int n = J; n > 1; n >>= 1, off >>= 1) {
      const bool hi = lane & off;
#pragma unroll
      for (int j = 0; j < n / 2; ++j) {
        const float send = hi ? x[j] : x[j + n / 2];
        const float keep = hi ? x[j + n / 2] : x[j];
        x[j] = keep + __shfl_xor_sync(0xffffffffu, send, off);
      }
    }
    float s = x[0];
#pragma unroll
    for (; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
  }
};

// A state chunk to fp32. bf16 -> fp32 is exact (the bf16 bits are the float's upper half), so
// each bf16 is its 32-bit word shifted (low half) or masked (high half): one instruction an element,
// where cuda_bf16.h's conversion of the high half compiles to two (PRMT then shift). Bitwise
// StateTraits::unpack.
template <typename State>
__device__ __forceinline__ void unpack_state(const uint4& c, float* f) {
  if constexpr (State::VEC == 8) {
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
    State::unpack(c, f);
  }
}

// decode's step (WarpTile::step_passes, o = S_new q) on groups of J passes with joint row sums:
// per pass the same unpack, decay, k . S, update, q . S and packing, in the same order, so every
// value is bitwise step_passes' (tests/gpu/test_verify_gpu.py: T tokens equal T chained decode
// calls). The lane computes u = beta (v - k . S) for its own pass of the group only (cur.vr[g]: that
// pass's v, placed by the staged token_inputs) and hands it to the group by J shuffles; it stores its
// own pass's output when it is the first of that pass's owners.
template <typename T, int J, typename Chunk, typename Put>
__device__ __forceinline__ void token_step_joint(const DecodeParams& p, const typename T::Item& cur,
                                                 const typename T::Prep& pr, int row, int hv, int vrow0, int lane,
                                                 Chunk&& chunk, Put&& put) {
  constexpr int LPR = 32 / T::RPW, KPL = T::KPL, VEC = T::VEC;
  static_assert(T::PASSES % J == 0, "joint_passes must divide the passes a warp");
  using JS = JointSum<LPR, J>;
  using State = fkda_decode::StateTraits<std::is_same_v<typename T::Elem, bf16>>;
  const int c = lane % LPR, r = lane / LPR;
  auto off = [&](int ps, int i) { return (ps * T::RPW + r) * T::K + T::key_of(i, c); };
  bf16* op = p.out + (static_cast<int64_t>(row) * p.HV + hv) * T::V + vrow0 + r;
#pragma unroll
  for (int g = 0; g < T::PASSES / J; ++g) {
    float s[J][KPL], kv[J], o[J];
#pragma unroll
    for (int q = 0; q < J; ++q) {
#pragma unroll
      for (int i = 0; i < T::CHUNKS; ++i) unpack_state<State>(chunk(g * J + q, i, off(g * J + q, i)), &s[q][i * VEC]);
      kv[q] = 0.f;
#pragma unroll
      for (int e = 0; e < KPL; ++e) {
        s[q][e] *= pr.dec[e];
        kv[q] = fmaf(s[q][e], pr.kn[e], kv[q]);
      }
    }
    const float u_own = pr.beta * (fkda_decode::bf_to_f(cur.vr[g]) - JS::sum(kv, lane));
#pragma unroll
    for (int q = 0; q < J; ++q) {
      const float u = __shfl_sync(0xffffffffu, u_own, JS::owner(lane, q));
      o[q] = 0.f;
#pragma unroll
      for (int e = 0; e < KPL; ++e) {
        s[q][e] = fmaf(pr.kn[e], u, s[q][e]);
        o[q] = fmaf(s[q][e], pr.qn[e], o[q]);
      }
#pragma unroll
      for (int i = 0; i < T::CHUNKS; ++i) put(g * J + q, i, off(g * J + q, i), State::pack(&s[q][i * VEC]));
    }
    const float o_own = JS::sum(o, lane);
    if (JS::first_owner(lane)) op[(g * J + JS::own(lane)) * T::RPW] = __float2bfloat16_rn(o_own);
  }
}

// One token: the step of every V-row of the lane on the state chunks chunk(ps, i, e), the packed
// new state handed to put(ps, i, e, packed); e is chunk (ps, i)'s element offset from the warp's
// first V-row (rows of K elements, as in the pool). The next token must read what put was given.
// With kJointPasses > 1, cur.vr holds the lane's own pass of each group (Staged::token_inputs).
template <typename T, typename OffT, typename Chunk, typename Put>
__device__ __forceinline__ void token_step_on(const DecodeParams& p, typename T::Item& cur, const typename T::Prep& pr,
                                              int row, int hv, int vrow0, int lane, Chunk&& chunk, Put&& put) {
  if constexpr (kJointPasses > 1) {
    token_step_joint<T, kJointPasses>(p, cur, pr, row, hv, vrow0, lane, chunk, put);
  } else {
    const int c = lane % (32 / T::RPW), r = lane / (32 / T::RPW);
    auto off = [&](int ps, int i) { return (ps * T::RPW + r) * T::K + T::key_of(i, c); };
    T::template step_passes<false, false>(
        p, cur, pr, 0.f, row, hv, vrow0, lane, OffT(0), [&](int ps, int i) { return chunk(ps, i, off(ps, i)); },
        [&](int ps, int i, const uint4& packed) { put(ps, i, off(ps, i), packed); });
  }
}

// One token on the state registers, the packed new state kept (the next token continues from the
// stored value) and, when `store`, sent to slot dst: streaming stores, or with kKeep (a draft tree, whose
// branches read stored states back) default-policy stores that stay in L2 for the reload.
template <typename T, typename OffT, bool kKeep = false>
__device__ __forceinline__ void token_step(const DecodeParams& p, typename T::Item& cur, const typename T::Prep& pr,
                                           int row, int hv, int vrow0, int lane, int32_t dst, bool store) {
  using Elem = typename T::Elem;
  Elem* sb = static_cast<Elem*>(p.state) + (store ? T::slot_base(p, dst, hv, vrow0) : OffT(0));
  token_step_on<T, OffT>(
      p, cur, pr, row, hv, vrow0, lane, [&](int ps, int i, int) { return cur.s[ps][i]; },
      [&](int ps, int i, int e, const uint4& packed) {
        cur.s[ps][i] = packed;  // the next token continues from the stored value
        if (store) fkda_decode::store_state<kKeep>(reinterpret_cast<uint4*>(sb + e), packed);
      });
}

// A verify CTA's shape: THREADS / 32 warps share V_TILE V-rows, each warp a decode WarpTile.
template <bool kBf16, int LPR, int V_TILE, int THREADS, typename OffT>
struct VerifyCta {
  static constexpr int WARPS = THREADS / 32;
  static_assert(V_TILE % WARPS == 0, "V tile must split evenly over warps");
  using T = fkda_decode::WarpTile<kBf16, LPR, V_TILE / WARPS, OffT, false>;
};

// ---- the staged variant (FKDA_PARAM_STAGE_T = S > 0) ------------------------------------------
// The same CTA, state registers and per-token step, but every token's inputs are read and
// prepared before the token loop, S tokens at a time, so the loop reads only shared memory: a
// request pays one memory latency for its first S tokens instead of one per token. The block's
// raw q, k, g, v (16-byte cp.async) and beta and slots land in shared memory together, while the
// state tile is in flight; then the token's prep (l2norm of q and k, the gate's exp / log1p per
// key, beta), which every LPR-lane group of the tile kernel recomputes for the same keys, is done
// once per CTA and token: group g of LPR lanes (THREADS / LPR groups) prepares tokens g, g + G,
// ... with decode's own prepare() in the same lane layout (lane c: keys key_of(i, c) + e, the
// same shuffle trees), so each value in shared memory is bitwise the one a tile-kernel lane
// computes, and the step reads it back as lane c's Prep. The state is still packed to the pool's
// dtype after each token: T tokens equal T chained decode calls bitwise, as in the tile kernel.
//
// BULK (FKDA_PARAM_BULK_STATE) > 0: the state tile moves by bulk copy (TMA, cp.async.bulk) both
// ways, as decode's rowtma / quartmabulk do. Thread 0 brings the CTA's V_TILE x K tile (contiguous
// in the pool) into dynamic shared memory (tile 1 of two) in one copy as soon as the read slot is
// known; it lands during the first block's prep. Token t writes its packed chunks into tile t % 2,
// each thread fences them for the async proxy, and after a CTA barrier thread 0 sends the tile to
// the token's slot in one bulk copy when the slot is live. Before that barrier thread 0 waits until
// token t - 1's copy has read its tile, which token t + 1 overwrites: with two tiles a copy reads
// while the next token computes, and one barrier a token orders both. The state stays in the
// registers (taken from the read tile once). The per-token arithmetic is the staged kernel's (the
// same step, packing and prep): bitwise equal.
// The staged CTA's pieces: a block of S tokens' raw inputs (Raw), their prepared values with the block's beta and slots
// (Prepared), and the three steps that move them (issue, prepare_block, token_inputs).
template <bool kBf16, int LPR, int V_TILE, int THREADS, typename OffT, int S>
struct Staged {
  using Cta = VerifyCta<kBf16, LPR, V_TILE, THREADS, OffT>;
  using T = typename Cta::T;
  using BfV = fkda_decode::BfVec<T::VEC>;
  static constexpr int WARPS = Cta::WARPS, K = T::K;
  static constexpr int G = THREADS / LPR;  // lane groups, each preparing whole tokens
  // a CTA may hold more lane groups than S: the first S groups (whole warps) prepare
  static_assert(S >= 1 && S <= THREADS && (S % G == 0 || (G % S == 0 && S % (32 / LPR) == 0)),
                "S tokens split evenly over the lane groups");
  static constexpr int GPW = 32 / LPR;  // lane groups a warp
  static constexpr int M = S >= G ? S / G : 1;  // tokens each lane group prepares
  static constexpr int F4 = T::KPL / 4;         // float4s of one Prep array a lane holds
  static constexpr int KCH = K / 8;             // 16-byte chunks of a token's q (k, g)
  static constexpr int VCH = V_TILE / 8;        // 16-byte chunks of a token's v in this V tile
  static_assert(T::KPL % 4 == 0 && V_TILE % 8 == 0, "16-byte staging");
  // g in its own dtype (gb_t): bf16 beside q and k in qkg, or fp32 (FKDA_PARAM_GB_F32) in its own array
  static constexpr bool kGbF32 = std::is_same_v<fkda_decode::gb_t, float>;
  static constexpr int QKG = kGbF32 ? 2 : 3;    // arrays of qkg
  static constexpr int GCH = K * int(sizeof(fkda_decode::gb_t)) / 16;  // 16-byte chunks of a token's g
  struct RawBf {                // raw q, k, g of each token and the CTA's v slice
    __align__(16) bf16 qkg[S][3][K];
    __align__(16) bf16 v[S][V_TILE];
  };
  struct RawF32 {               // raw q, k and the CTA's v slice, and fp32 g
    __align__(16) bf16 qkg[S][2][K];
    __align__(16) bf16 v[S][V_TILE];
    __align__(16) float g[S][K];
  };
  using Raw = std::conditional_t<kGbF32, RawF32, RawBf>;
  __device__ static const fkda_decode::gb_t* g_of(const Raw& raw, int j) {
    if constexpr (kGbF32) return raw.g[j];
    else return raw.qkg[j][2];
  }
  struct Prepared {
    float4 prep[S][3][F4][LPR];  // lane c's qn, kn, dec of each token: conflict-free float4s
    float beta[S];
    fkda_decode::gb_t beta_raw[S];
    int32_t dst[S];
    int32_t src[S];  // a tree's branch: the slot token j starts from (tree_source), -1: the registers go on
  };

  // Tokens [t0, t0 + nb) of the request at bos: raw q, k, g and v in flight by cp.async (one group).
  __device__ static void issue(const DecodeParams& p, Raw& raw, int bos, int t0, int nb, int h, int hv, int vt) {
    for (int x = threadIdx.x; x < nb * QKG * KCH; x += THREADS) {
      const int j = x / (QKG * KCH), a = (x / KCH) % QKG, w = x % KCH;
      const int64_t row = bos + t0 + j;
      const bf16* src = a == 0   ? p.q + row * p.q_row_stride + h * K
                        : a == 1 ? p.k + row * p.k_row_stride + h * K
                                 : reinterpret_cast<const bf16*>(p.g) + row * p.g_row_stride + hv * K;
      fkda_decode::cp_async16(&raw.qkg[j][a][w * 8], src + w * 8);
    }
    if constexpr (kGbF32) {
      for (int x = threadIdx.x; x < nb * GCH; x += THREADS) {
        const int j = x / GCH, w = x % GCH;
        fkda_decode::cp_async16(&raw.g[j][w * 4], p.g + (bos + t0 + j) * p.g_row_stride + hv * K + w * 4);
      }
    }
    for (int x = threadIdx.x; x < nb * VCH; x += THREADS) {
      const int j = x / VCH, w = x % VCH;
      fkda_decode::cp_async16(&raw.v[j][w * 8], p.v + (bos + t0 + j) * p.v_row_stride + hv * T::V + vt * V_TILE + w * 8);
    }
    fkda_decode::cp_async_commit();
  }

  // The head's dt_bias and A_log into a prepare() input (the same for every token of the head).
  __device__ static void head_inputs(const DecodeParams& p, typename T::Item& in, int hv, int c) {
#pragma unroll
    for (int i = 0; i < T::CHUNKS; ++i) {
#pragma unroll
      for (int e = 0; e < T::VEC / 4; ++e) {
        in.dt[i][e] = p.dt_bias ? __ldg(reinterpret_cast<const float4*>(p.dt_bias + hv * K + T::key_of(i, c)) + e)
                                : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    in.a_log = p.A_log ? __ldg(p.A_log + hv) : 0.f;
  }

  // The block's nb tokens prepared into pp (raw and pp.beta_raw landed, behind a barrier): lane
  // group grp prepares tokens grp, grp + G, ... with decode's prepare() in its own lane layout.
  // kWideGate: the decays (the gate's exp / log1p per key, most of the prep's work) are computed
  // first by every thread of the CTA, one (token, key) each in turn, with decode's gate_decay, and
  // placed where lane c's Prep reads them; the lane groups then do the l2norms and beta only. A
  // key's decay depends on that key alone, so the values are bitwise the per-lane prep's; the CTA's
  // warps share the work instead of waiting at the barrier while one warp prepares (T 2).
  __device__ static void prepare_block(const DecodeParams& p, const Raw& raw, Prepared& pp, typename T::Item& in,
                                       int nb, int grp, int c, int hv) {
    if constexpr (kWideGate) {
      const float a = expf(in.a_log);
      const float* dt_head = p.dt_bias ? p.dt_bias + hv * K : nullptr;
      for (int x = threadIdx.x; x < nb * K; x += THREADS) {
        const int j = x / K, key = x % K;
        const float dt = dt_head ? __ldg(dt_head + key) : 0.f;
        const float d = fkda_decode::gate_decay(p, fkda_decode::gb_to_f(g_of(raw, j)[key]), dt, a);
        // key = key_of(i, col) + e: lane col's element i * VEC + e of its dec array
        constexpr int SPAN = LPR * T::VEC;
        const int i = key / SPAN, col = (key % SPAN) / T::VEC, e = key % T::VEC, idx = i * T::VEC + e;
        reinterpret_cast<float*>(&pp.prep[j][2][idx / 4][col])[idx % 4] = d;
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int j = grp + G * m;
      if (G > S && j >= S) continue;  // warp-uniform (S % (32 / LPR) == 0)
      // a warp none of whose groups has a live token skips the prep (warp-uniform): with T_n < S
      // most warps of the CTA have none (T 2 in a CTA of 4 warps: one warp prepares, not four)
      if ((grp / GPW) * GPW + G * m >= nb) continue;
      const int js = j < nb ? j : 0;  // every lane of a preparing warp runs prepare (its sums shuffle over the warp)
#pragma unroll
      for (int i = 0; i < T::CHUNKS; ++i) {
        in.qr[i] = *reinterpret_cast<const BfV*>(&raw.qkg[js][0][T::key_of(i, c)]);
        in.kr[i] = *reinterpret_cast<const BfV*>(&raw.qkg[js][1][T::key_of(i, c)]);
        in.gr[i] = *reinterpret_cast<const std::remove_reference_t<decltype(in.gr[i])>*>(g_of(raw, js) + T::key_of(i, c));
      }
      in.beta_raw = pp.beta_raw[js];
      typename T::Prep pr;
      T::template prepare<!kWideGate>(p, in, pr);
      if (j < nb) {
#pragma unroll
        for (int f = 0; f < F4; ++f) {
          pp.prep[j][0][f][c] = make_float4(pr.qn[4 * f], pr.qn[4 * f + 1], pr.qn[4 * f + 2], pr.qn[4 * f + 3]);
          pp.prep[j][1][f][c] = make_float4(pr.kn[4 * f], pr.kn[4 * f + 1], pr.kn[4 * f + 2], pr.kn[4 * f + 3]);
          if constexpr (!kWideGate)
            pp.prep[j][2][f][c] = make_float4(pr.dec[4 * f], pr.dec[4 * f + 1], pr.dec[4 * f + 2], pr.dec[4 * f + 3]);
        }
        if (c == 0) pp.beta[j] = pr.beta;
      }
    }
  }

  // Token j of the block: lane c's Prep and the thread's v values, read back from shared memory.
  __device__ static void token_inputs(const Raw& raw, const Prepared& pp, int j, int warp, int c, int r,
                                      typename T::Item& cur, typename T::Prep& pr) {
#pragma unroll
    for (int f = 0; f < F4; ++f) {
      const float4 a = pp.prep[j][0][f][c], b = pp.prep[j][1][f][c], d = pp.prep[j][2][f][c];
      pr.qn[4 * f] = a.x, pr.qn[4 * f + 1] = a.y, pr.qn[4 * f + 2] = a.z, pr.qn[4 * f + 3] = a.w;
      pr.kn[4 * f] = b.x, pr.kn[4 * f + 1] = b.y, pr.kn[4 * f + 2] = b.z, pr.kn[4 * f + 3] = b.w;
      pr.dec[4 * f] = d.x, pr.dec[4 * f + 1] = d.y, pr.dec[4 * f + 2] = d.z, pr.dec[4 * f + 3] = d.w;
    }
    pr.beta = pp.beta[j];
    token_v(raw, j, warp, r, cur);
  }

  // Token j's v values of the thread, placed as token_inputs places them.
  __device__ static void token_v(const Raw& raw, int j, int warp, int r, typename T::Item& cur) {
    if constexpr (kJointPasses > 1) {  // the lane's own pass of each group (token_step_joint)
      const int own = JointSum<LPR, kJointPasses>::own(threadIdx.x % 32);
#pragma unroll
      for (int g = 0; g < T::PASSES / kJointPasses; ++g)
        cur.vr[g] = raw.v[j][warp * (V_TILE / WARPS) + (g * kJointPasses + own) * T::RPW + r];
    } else {
#pragma unroll
      for (int ps = 0; ps < T::PASSES; ++ps) cur.vr[ps] = raw.v[j][warp * (V_TILE / WARPS) + ps * T::RPW + r];
    }
  }

  // kSplitPrep: decode's prepare() split between the warp's two lane groups (lane c of group r = lane / LPR
  // holds keys key_of(i, c), i < CHUNKS = 2, in both groups). split_scalars: group r's share of token j - the gate
  // of chunk r's keys (gate_decay, the same operands), the l2norm sums of squares in prepare's order, then one
  // butterfly a group (group 0 q's sum, group 1 k's; group_sum<LPR>, every lane of a group ends with the same
  // bits) and the other group's sum by one shuffle; the norms' factors and beta as prepare computes them.
  // split_finish: q and k unpacked again and scaled, the other group's 4 decays by shuffles. Bitwise prepare().
  struct SplitHead {  // the head's dt_bias of the lane's gate keys (chunk r) and exp(A_log)
    float4 dt[T::VEC / 4];
    float a;
  };
  struct Split {  // the lane's share of a token's prep
    float qs, ks, beta;
    float d[T::VEC];  // decays of keys key_of(r, c) + e
  };
  using GrV = std::remove_reference_t<decltype(std::declval<typename T::Item>().gr[0])>;
  __device__ static void split_head(const DecodeParams& p, SplitHead& sh, int hv, int c, int r) {
    static_assert(T::CHUNKS == 2 && T::RPW == 2, "the split prep: two lane groups a warp, two chunks a lane");
#pragma unroll
    for (int e = 0; e < T::VEC / 4; ++e)
      sh.dt[e] = p.dt_bias ? __ldg(reinterpret_cast<const float4*>(p.dt_bias + hv * K + T::key_of(r, c)) + e)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
    sh.a = expf(p.A_log ? __ldg(p.A_log + hv) : 0.f);
  }
  __device__ static void split_scalars(const DecodeParams& p, const Raw& raw, const Prepared& pp, int j, int c, int r,
                                       const SplitHead& sh, Split& sp) {
    float ssq = 0.f, ssk = 0.f;
#pragma unroll
    for (int i = 0; i < T::CHUNKS; ++i) {
      float qf[T::VEC], kf[T::VEC];
      fkda_decode::unpack_bf<T::VEC>(*reinterpret_cast<const BfV*>(&raw.qkg[j][0][T::key_of(i, c)]), qf);
      fkda_decode::unpack_bf<T::VEC>(*reinterpret_cast<const BfV*>(&raw.qkg[j][1][T::key_of(i, c)]), kf);
#pragma unroll
      for (int e = 0; e < T::VEC; ++e) {  // l2norm_qk's chains, key by key in its order
        ssq = fmaf(qf[e], qf[e], ssq);
        ssk = fmaf(kf[e], kf[e], ssk);
      }
    }
    const bool hi = r != 0;
    const float x = fkda_decode::group_sum<LPR>(hi ? ssk : ssq);
    const float y = __shfl_xor_sync(0xffffffffu, x, LPR);  // the other group's sum
    sp.qs = p.scale / sqrtf((hi ? y : x) + 1e-6f);
    sp.ks = 1.f / sqrtf((hi ? x : y) + 1e-6f);
    float graw[T::VEC];
    fkda_decode::unpack_gb<T::VEC>(*reinterpret_cast<const GrV*>(g_of(raw, j) + T::key_of(r, c)), graw);
#pragma unroll
    for (int e = 0; e < T::VEC; ++e) {
      const float4 d4 = sh.dt[e / 4];
      const float dt = (e % 4 == 0) ? d4.x : (e % 4 == 1) ? d4.y : (e % 4 == 2) ? d4.z : d4.w;
      sp.d[e] = fkda_decode::gate_decay(p, graw[e], dt, sh.a);
    }
    const float b = fkda_decode::gb_to_f(pp.beta_raw[j]);
    sp.beta = p.beta_is_logit ? 1.f / (1.f + expf(-b)) : b;
  }
  __device__ static void split_finish(const Raw& raw, int j, int c, int r, const Split& sp, typename T::Prep& pr) {
#pragma unroll
    for (int i = 0; i < T::CHUNKS; ++i) {
      fkda_decode::unpack_bf<T::VEC>(*reinterpret_cast<const BfV*>(&raw.qkg[j][0][T::key_of(i, c)]), &pr.qn[i * T::VEC]);
      fkda_decode::unpack_bf<T::VEC>(*reinterpret_cast<const BfV*>(&raw.qkg[j][1][T::key_of(i, c)]), &pr.kn[i * T::VEC]);
    }
#pragma unroll
    for (int e = 0; e < T::KPL; ++e) {
      pr.qn[e] *= sp.qs;
      pr.kn[e] *= sp.ks;
    }
    const bool hi = r != 0;
#pragma unroll
    for (int e = 0; e < T::VEC; ++e) {
      const float o = __shfl_xor_sync(0xffffffffu, sp.d[e], LPR);  // the other group's chunk
      pr.dec[e] = hi ? o : sp.d[e];
      pr.dec[T::VEC + e] = hi ? sp.d[e] : o;
    }
    pr.beta = sp.beta;
  }

  // The thread's state chunks of a [V_TILE][K] tile in shared memory into its state registers.
  __device__ static void state_from_tile(typename T::Item& cur, const typename T::Elem* tile, int warp, int c, int r) {
    const typename T::Elem* src = tile + warp * (V_TILE / WARPS) * K;
#pragma unroll
    for (int ps = 0; ps < T::PASSES; ++ps) {
#pragma unroll
      for (int i = 0; i < T::CHUNKS; ++i)
        cur.s[ps][i] = *reinterpret_cast<const uint4*>(src + (ps * T::RPW + r) * K + T::key_of(i, c));
    }
  }
};

template <bool kBf16, int LPR, int V_TILE, int THREADS, typename OffT, int S, int BULK = 0>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
kda_verify_staged_kernel(const VerifyParams vp) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  static_assert(BULK == 0 || BULK == 1, "bulk_state: 0 or 1");
  using St = Staged<kBf16, LPR, V_TILE, THREADS, OffT, S>;
  using T = typename St::T;
  constexpr int WARPS = St::WARPS, K = St::K;
  __shared__ __align__(16) typename St::Raw raw;
  __shared__ __align__(16) typename St::Prepared pp;
  const DecodeParams& p = vp.d;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = lane % LPR, r = lane / LPR;
  const int grp = threadIdx.x / LPR;
  const fkda_decode::TileCoords tc = fkda_decode::tile_coords<V_TILE, WARPS>(p, warp);
  const int n = tc.row, hv = tc.hv, vt = tc.vt, vrow0 = tc.vrow0;  // plain ints: the lambda below captures them
  Request rq = request_of(vp, n);
  if (rq.len <= 0) return;
  if constexpr (BULK == 0) {
    if (vp.parent != nullptr && rq.read >= 0 && tree_refused<THREADS>(vp, rq, n)) rq.read = -1;
  }
  const int bos = rq.bos, len = rq.len;
  const int h = hv / p.group;
  using Elem = typename T::Elem;
  constexpr uint32_t kTileBytes = uint32_t(V_TILE) * K * sizeof(Elem);
  Elem* tiles = nullptr;  // BULK: two [V_TILE][K] tiles; the read tile lands in tile 1
  uint64_t* bar = nullptr;
  if constexpr (BULK > 0) {
    extern __shared__ __align__(128) uint8_t verify_tiles[];
    __shared__ uint64_t s_bar;
    tiles = reinterpret_cast<Elem*>(verify_tiles);
    bar = &s_bar;
    if (threadIdx.x == 0) {  // waited on only after the first block's barriers
      fkda::mbar_init(bar, 1);
      fkda::mbar_init_fence();
    }
  }
  static_assert(BULK == 0 || !kSplitPrep, "split_prep: register-store kernels (bulk_state 0) only");
  // before the read slot is known: the inputs arrive while the state is requested
  St::issue(p, raw, bos, 0, min(S, len), h, hv, vt);
  if constexpr (BULK > 0) __syncthreads();  // the mbarrier is initialised before it is armed (racecheck
                                            // warned of init / expect_tx hazards without it, 2026-12-02)
  if (rq.read < 0) {  // CTA-uniform (request_of: -1 for every padding read entry)
    fkda_decode::cp_async_wait<0>();  // no copy may outlive the CTA's shared memory
    for (int t = 0; t < len; ++t) T::write_zeros(p, bos + t, hv, vrow0, lane);
    return;
  }
  typename T::Item cur;  // the state registers and, per token, its v (the rest stays unused)
  if constexpr (BULK > 0) {
    if (threadIdx.x == 0)
      fkda::bulk_load(tiles + V_TILE * K, read_tile<T, OffT>(vp, rq, hv, vt * V_TILE), kTileBytes, bar);
  } else {
    T::load_state_at(cur, read_tile<T, OffT>(vp, rq, hv, vrow0), lane);
  }
  typename T::Item in;  // a token's raw inputs for prepare(): dt_bias and A_log are the head's
  St::head_inputs(p, in, hv, c);
  typename St::SplitHead sh;  // kSplitPrep: the lane's gate keys' dt_bias, exp(A_log)
  if constexpr (kSplitPrep) St::split_head(p, sh, hv, c, r);
  for (int t0 = 0; t0 < len; t0 += S) {
    const int nb = min(S, len - t0);
    if (t0 > 0) {
      __syncthreads();  // every warp is done with the previous block
      St::issue(p, raw, bos, t0, nb, h, hv, vt);
    }
    if (threadIdx.x < nb) {  // token t0 + threadIdx.x's beta and slot (and a tree's branch source)
      token_beta_slot(vp, rq, hv, t0 + threadIdx.x, pp.beta_raw[threadIdx.x], pp.dst[threadIdx.x]);
      if constexpr (BULK == 0) pp.src[threadIdx.x] = tree_source(vp, rq, n, t0 + threadIdx.x);
    }
    fkda_decode::cp_async_wait<0>();
    __syncthreads();
    if constexpr (!kSplitPrep) {
      St::prepare_block(p, raw, pp, in, nb, grp, c, hv);
      __syncthreads();
    }
    if constexpr (BULK > 0) {
      if (t0 == 0) {
        fkda::mbar_wait(bar, 0);  // the read tile has landed (it arrived during the prep)
        St::state_from_tile(cur, tiles + V_TILE * K, warp, c, r);  // this thread's chunks
      }
    }
    for (int j = 0; j < nb; ++j) {
      typename T::Prep pr;
      if constexpr (kSplitPrep) {
        typename St::Split sp;  // the lane's share of token j's prep
        St::split_scalars(p, raw, pp, j, c, r, sh, sp);
        St::split_finish(raw, j, c, r, sp, pr);
        St::token_v(raw, j, warp, r, cur);
      } else {
        St::token_inputs(raw, pp, j, warp, c, r, cur, pr);
      }
      const int32_t dst = pp.dst[j];
      if constexpr (BULK > 0) {
        const int t = t0 + j;
        Elem* tile = tiles + (t & 1) * (V_TILE * K);  // token t's packed state
        Elem* wt = tile + warp * (V_TILE / WARPS) * K;
        token_step_on<T, OffT>(
            p, cur, pr, bos + t, hv, vrow0, lane, [&](int ps, int i, int) { return cur.s[ps][i]; },
            [&](int ps, int i, int e, const uint4& packed) {
              cur.s[ps][i] = packed;  // the next token continues from the stored value
              *reinterpret_cast<uint4*>(wt + e) = packed;
            });
        fkda::fence_smem_to_async();  // this thread's tile writes, for the bulk copy
        if (threadIdx.x == 0) fkda::bulk_s2g_wait_read();  // token t - 1's copy has read the other tile
        __syncthreads();
        if (threadIdx.x == 0 && !T::is_pad(p, dst)) {  // a dead slot is never a copy's target
          fkda::bulk_s2g(static_cast<Elem*>(p.state) + T::slot_base(p, dst, hv, vt * V_TILE), tile, kTileBytes);
        }
      } else {
        const int32_t src = pp.src[j];
        if (src >= 0) {  // a tree's branch: the chunks this thread stored after the parent (plain loads, ordered
                         // after its own stores by program order; never the non-coherent path)
          T::template load_state_at<true>(cur, static_cast<const Elem*>(p.state) + T::slot_base(p, src, hv, vrow0),
                                          lane);
        }
        const bool store = !T::is_pad(p, dst);
        if (vp.parent != nullptr) token_step<T, OffT, true>(p, cur, pr, bos + t0 + j, hv, vrow0, lane, dst, store);
        else token_step<T, OffT>(p, cur, pr, bos + t0 + j, hv, vrow0, lane, dst, store);
      }
    }
  }
  if constexpr (BULK > 0) {
    if (threadIdx.x == 0) fkda::bulk_s2g_wait_read();  // the last tile must outlive its copy's reads
  }
}

}  // namespace fkda_verify
