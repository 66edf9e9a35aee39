// Fused KDA decode on a state pool, sm_90a: per (row, head) the width-4 causal conv over the
// head's q, k, v channels (with the conv cache), SiLU, the gate, l2norm, the recurrent step over
// the [V, K] state and the gated RMSNorm epilogue, in one launch (contract: docs/architecture.md).
//
// Work split (see README.md): a cluster of CL CTAs covers one (row, head); CTA `rank` owns the
// V-rows [rank*V_TILE, (rank+1)*V_TILE) of the state (V_TILE = V / CL) and 1/CL of the prologue
// items (the 3*D conv channels of the head, then the D gate keys). Each prologue item is computed
// by exactly one thread of the cluster, which also writes that channel's conv-cache shift, and
// broadcast into every CTA's shared memory (DSMEM when CL > 1). After one cluster barrier each warp
// runs the step on its V-rows exactly as the plain decode does (16 lanes per V-row, 16-byte state
// accesses, shuffle-tree reductions in a fixed order). The RMSNorm needs sum(o^2) over all V rows:
// each warp's partial goes into every CTA's shared memory, a second barrier, and every CTA sums
// the CL*WARPS partials in the same fixed order (bitwise deterministic, identical in every CTA).
//
// Schedules (FKDA_PARAM_SCHEDULE): 0 tile: grid = rows*H*CL, one (row, head) per cluster;
// 2 sequential: grid = H*CL, each cluster walks every row in order (rows sharing a slot apply in
// row order: every state element and every conv channel is always read and written by the same
// thread, so program order orders them; shared memory reuse is ordered by the two barriers of
// each row, the partial-sum buffer alternates between two halves).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

// the small device helpers of the plain decode (BfVec/unpack_bf, group_sum, StateTraits,
// load_state/store_state): shared, not copied
#include "decode/kda_decode_kernels.cuh"
#include "common/bulk_copy.cuh"
#include "common/grid_dependency.cuh"

namespace fkda_fused {

namespace cg = cooperative_groups;
using fkda_decode::bf16;
using fkda_decode::bf_to_f;
using fkda_decode::group_sum;
using fkda_decode::load_state;
using fkda_decode::StateTraits;
using fkda_decode::store_state;

constexpr int kConvWidth = 4;  // the cache keeps kConvWidth - 1 = 3 previous inputs

struct FusedParams {
  const bf16* x;             // [rows, 3*H*D], rows x_row apart
  const void* conv_weight;   // bf16 or f32 (w_f32): tap w of channel part*H*D + j at part*w_part + j*w_ch + w*w_w
  bf16* conv_state;          // [slots, 3*H*D, 3] in place, strides (cs_slot, cs_ch, cs_w)
  const bf16* g;             // [rows, H, D], rows g_row apart
  const bf16* beta;          // [rows, H] (a logit), rows beta_row apart
  const float* A_log;        // [H] or nullptr (= 0)
  const float* dt_bias;      // [H*D] or nullptr (= 0)
  const int32_t* idx;        // [rows]
  void* state;               // [slots, H, D, D] in place, each slot dense, slot_stride apart
  const bf16* output_gate;   // [rows, H, D], rows og_row apart
  const float* norm_weight;  // [D]
  bf16* out;                 // [rows, H, D] contiguous
  int64_t num_slots;
  int64_t slot_stride;       // elements between slots (>= H*D*D: a paged pool's slots sit apart)
  // fused decode only (fused_layout.h; the fused verify reads dense tensors by its own offsets)
  int64_t x_row, g_row, beta_row, og_row;
  int64_t cs_slot, cs_ch, cs_w;
  int64_t w_part, w_ch, w_w;
  int rows, H;
  int gate_mode;             // 0 softplus, 1 bounded, 2 log
  float lower_bound, scale, norm_eps;
  int null_slot0, w_f32;
};

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float log_decay(const FusedParams& p, float graw, float dt, float a) {
  if (p.gate_mode == 2) return graw;
  if (p.gate_mode == 0) {
    const float x = graw + dt;
    return -a * (x > 20.f ? x : log1pf(expf(x)));
  }
  return p.lower_bound * sigmoidf_(a * (graw + dt));
}

// kSmemState (tile schedule only): the CTA's V_TILE x D state tile comes in by one bulk copy into
// dynamic shared memory instead of 16-byte loads into registers, issued before the prologue's loads
// (1) or after them (2, faster where the prologue's latency shows: 2026-11-29, 60ac868); each pass
// reads its chunks from there. The state then holds no registers while in flight (64 a thread in
// fp32), so more CTAs fit an SM and one CTA's prologue and epilogue overlap other CTAs' state
// traffic.
// kBulkStore (with kSmemState): the updated state goes back over the tile, and thread 0 sends the
// tile to the pool in one bulk copy after barrier #2 (H200, 2026-11-30, 7d0f139: 3-8% faster with
// bf16 state from 2048 work items, level at 1024; slower below that and in fp32).
template <bool kBf16, int CL, int V_TILE, int THREADS, typename OffT, bool kCoherent, int kSmemState = 0,
          bool kBulkStore = false>
struct FusedCta {
  static_assert(!kBulkStore || kSmemState, "the bulk store sends the shared-memory tile");
  static constexpr int D = FKDA_HEAD_DIM_K;
  static_assert(FKDA_HEAD_DIM_K == FKDA_HEAD_DIM_V, "fused decode: K = V = D");
  static constexpr int LPR = FKDA_PARAM_LANES_PER_ROW;  // lanes sharing one V-row
  static constexpr int VEC = StateTraits<kBf16>::VEC;
  using Elem = std::conditional_t<kBf16, bf16, float>;
  static constexpr int KPL = D / LPR;
  static constexpr int CHUNKS = KPL / VEC;
  static constexpr int RPW = 32 / LPR;
  static constexpr int WARPS = THREADS / 32;
  static constexpr int ROWS_PER_WARP = V_TILE / WARPS;
  static constexpr int PASSES = ROWS_PER_WARP / RPW;
  static constexpr int NI = 4 * D;          // prologue items: q, k, v channels, gate keys
  static constexpr int IPC = NI / CL;       // items per CTA
  static constexpr int NRED = CL * WARPS;   // RMSNorm partials
  static constexpr int IPT = IPC / THREADS; // prologue items per thread
  static_assert(V_TILE * CL == D, "the cluster covers all V-rows");
  static_assert(V_TILE % WARPS == 0 && ROWS_PER_WARP % RPW == 0 && PASSES >= 1, "V tile split");
  static_assert(D % (LPR * VEC) == 0 && CHUNKS >= 1, "K must tile by LPR*VEC");
  static_assert(NI % CL == 0 && IPC % THREADS == 0 && IPT >= 1, "prologue split");
  static_assert(PASSES <= LPR, "one writer lane per pass");

  static constexpr uint32_t kTileBytes = uint32_t(V_TILE) * D * sizeof(Elem);  // kSmemState: dynamic smem

  struct Smem {
    float in[NI];         // silu(conv) of q | k | v channels, then exp(g) per key
    float red[2][NRED];   // per-warp sum(o^2), two halves (sequential schedule alternates)
  };

  __device__ static int key_of(int i, int c) { return i * (LPR * VEC) + c * VEC; }

  __device__ static bool is_pad(const FusedParams& p, int32_t slot) {
    return slot < 0 || (p.null_slot0 && slot == 0) || slot >= p.num_slots;
  }

  __device__ static void cluster_sync() {
    if constexpr (CL > 1) cg::this_cluster().sync();
    else __syncthreads();
  }

  // A CTA may write into a peer's shared memory only once the peer has started (CUDA guide;
  // compute-sanitizer racecheck flags the write otherwise). The tile schedule arrives on entry and
  // waits right before its first DSMEM write, so the state loads issued in between overlap it.
  __device__ static void cluster_arrive_relaxed() {
    if constexpr (CL > 1) asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  }
  __device__ static void cluster_wait() {
    if constexpr (CL > 1) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  }

  // Store v into this CTA's smem word and the same word of every other CTA of the cluster.
  __device__ static void broadcast(float* local, float v, unsigned rank) {
    if constexpr (CL > 1) {
      cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
      for (int r = 0; r < CL; ++r) {
        float* dst = (static_cast<unsigned>(r) == rank) ? local : cluster.map_shared_rank(local, r);
        *dst = v;
      }
    } else {
      (void)rank;
      *local = v;
    }
  }

  __device__ static void write_zeros(const FusedParams& p, int row, int h, unsigned rank) {
    bf16* op = p.out + (static_cast<int64_t>(row) * p.H + h) * D + rank * V_TILE;
    for (int j = threadIdx.x; j < V_TILE; j += THREADS) op[j] = __float2bfloat16_rn(0.f);
  }

  // One prologue item j (0 <= j < NI): a conv channel (q | k | v of head h) or a gate key.
  // Split into loads and math so that every item of a thread has its loads in flight before the
  // first conv-cache store (a store through a generic pointer would otherwise order the next
  // item's loads after it).
  struct Raw {
    bf16 x, s0, s1, s2;      // conv: input and the cached three; gate: x = raw g
    float w0, w1, w2, w3;    // conv: weights;                     gate: w0 = dt_bias, w1 = A_log
  };

  __device__ static int64_t conv_channel(const FusedParams& p, int h, int j) {
    return (j / D) * (static_cast<int64_t>(p.H) * D) + static_cast<int64_t>(h) * D + (j % D);
  }
  // the channel's first cached input; the next ones sit p.cs_w apart
  __device__ static bf16* conv_row(const FusedParams& p, int32_t slot, int64_t ch) {
    return p.conv_state + (static_cast<OffT>(slot) * static_cast<OffT>(p.cs_slot) + static_cast<OffT>(ch * p.cs_ch));
  }

  __device__ static void load_item(const FusedParams& p, int row, int h, int32_t slot, int j, Raw& in) {
    if (j < 3 * D) {
      const int64_t ch = conv_channel(p, h, j);
      in.x = p.x[static_cast<int64_t>(row) * p.x_row + ch];
      const bf16* cs = conv_row(p, slot, ch);
      in.s0 = cs[0];
      in.s1 = cs[p.cs_w];
      in.s2 = cs[2 * p.cs_w];
      // scalar loads: any 2- or 4-byte aligned weight tensor (a few bytes per channel), either layout
      const int64_t w_at = (j / D) * p.w_part + (static_cast<int64_t>(h) * D + (j % D)) * p.w_ch;
      if (p.w_f32) {
        const float* w = static_cast<const float*>(p.conv_weight) + w_at;
        in.w0 = __ldg(w); in.w1 = __ldg(w + p.w_w); in.w2 = __ldg(w + 2 * p.w_w); in.w3 = __ldg(w + 3 * p.w_w);
      } else {
        const bf16* w = static_cast<const bf16*>(p.conv_weight) + w_at;
        in.w0 = bf_to_f(__ldg(w)); in.w1 = bf_to_f(__ldg(w + p.w_w));
        in.w2 = bf_to_f(__ldg(w + 2 * p.w_w)); in.w3 = bf_to_f(__ldg(w + 3 * p.w_w));
      }
    } else {
      const int key = j - 3 * D;
      in.x = __ldg(p.g + static_cast<int64_t>(row) * p.g_row + h * D + key);
      in.w0 = p.dt_bias ? __ldg(p.dt_bias + h * D + key) : 0.f;
      in.w1 = p.A_log ? __ldg(p.A_log + h) : 0.f;
    }
  }

  // The item's value; a conv item also shifts its channel's cache (this thread is the only one
  // that touches that channel in this launch).
  __device__ static float finish_item(const FusedParams& p, int h, int32_t slot, int j, const Raw& in) {
    if (j < 3 * D) {
      float acc = in.w0 * bf_to_f(in.s0);
      acc = fmaf(in.w1, bf_to_f(in.s1), acc);
      acc = fmaf(in.w2, bf_to_f(in.s2), acc);
      acc = fmaf(in.w3, bf_to_f(in.x), acc);
      bf16* cs = conv_row(p, slot, conv_channel(p, h, j));
      cs[0] = in.s1;  // shift left, keep x last (bit copies)
      cs[p.cs_w] = in.s2;
      cs[2 * p.cs_w] = in.x;
      return acc * sigmoidf_(acc);  // SiLU
    }
    return expf(log_decay(p, bf_to_f(in.x), in.w0, expf(in.w1)));  // A_log absent: exp(0) = 1
  }

  // This lane's keys of the token in sm.in (the prologue): q and k l2-normalised (q scaled) and the
  // decays. Shared with the fused verify, whose tokens must match this kernel's bit for bit.
  __device__ static void lane_keys(const FusedParams& p, const Smem& sm, int c, float (&qn)[KPL], float (&kn)[KPL],
                                   float (&dec)[KPL]) {
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int key = key_of(i, c) + e;
        qn[i * VEC + e] = sm.in[key];
        kn[i * VEC + e] = sm.in[D + key];
        dec[i * VEC + e] = sm.in[3 * D + key];
      }
    fkda_decode::l2norm_qk<LPR, KPL>(qn, kn, p.scale);
  }

  // The step on one V-row (st: this lane's keys of it, updated in place): decay, kv = S k,
  // u = b (v - kv), S += k u; returns o = S q over the row's lanes. v() reads the row's v: called
  // after the kv reduction, where the kernels always read it (its address math moves otherwise).
  template <typename VRead>
  __device__ static float step_row(float (&st)[KPL], const float (&qn)[KPL], const float (&kn)[KPL],
                                   const float (&dec)[KPL], float b, VRead v) {
    float kv = 0.f;
#pragma unroll
    for (int e = 0; e < KPL; ++e) {
      st[e] *= dec[e];
      kv = fmaf(st[e], kn[e], kv);
    }
    kv = group_sum<LPR>(kv);
    const float u = b * (v() - kv);
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < KPL; ++e) {
      st[e] = fmaf(kn[e], u, st[e]);
      acc = fmaf(st[e], qn[e], acc);
    }
    return group_sum<LPR>(acc);
  }

  // The whole (row, head) for this CTA. `half` picks the partial-sum buffer; `arrived`: this CTA
  // did cluster_arrive_relaxed() and must wait on it before its first DSMEM write.
  // kSmemState: tile = the dynamic shared memory (kTileBytes), bar = its copy's mbarrier (initialised
  // and fenced, with a CTA barrier after it, by the caller); else unused
  __device__ static void run(const FusedParams& p, Smem& sm, int row, int h, unsigned rank, int half,
                             bool arrived, Elem* tile = nullptr, uint64_t* bar = nullptr) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = lane % LPR, r = lane / LPR;
    const int32_t slot = p.idx[row];
    const int vrow0 = rank * V_TILE + warp * ROWS_PER_WARP;
    static_assert(!(kSmemState && kCoherent), "the bulk-copied tile is for the tile schedule (unique slots)");
    // this CTA's V_TILE rows of the slot's state: where the tile comes from (and goes back to)
    auto pool_tile = [&] {
      return static_cast<Elem*>(p.state) + (static_cast<OffT>(slot) * static_cast<OffT>(p.slot_stride) +
                                            static_cast<OffT>((h * D + rank * V_TILE) * D));
    };
    auto issue_tile = [&] {
      if (threadIdx.x == 0) fkda::bulk_load(tile, pool_tile(), kTileBytes, bar);
    };
    if constexpr (kSmemState == 1) issue_tile();  // the state tile first: it has the longest way to come
    // Otherwise the prologue's few loads go first, then the state's: the prologue's math and barrier
    // need only its own loads, so they run while the state is still arriving (issued the other way
    // round, the prologue's loads queued behind the state's and its math came after both).
    Raw raw[IPT];
#pragma unroll
    for (int it = 0; it < IPT; ++it) load_item(p, row, h, slot, rank * IPC + it * THREADS + threadIdx.x, raw[it]);
    // token scalars and epilogue operands, loaded before the prologue's conv-cache stores;
    // lane c < PASSES of each group writes the output of pass c
    const float b_raw = bf_to_f(__ldg(p.beta + static_cast<int64_t>(row) * p.beta_row + h));
    const int64_t orow = (static_cast<int64_t>(row) * p.H + h) * D;
    const int my_vr = vrow0 + c * RPW + r;
    const bool writer = c < PASSES;
    const float nw = writer ? __ldg(p.norm_weight + my_vr) : 0.f;
    const float og = writer ? bf_to_f(__ldg(p.output_gate + static_cast<int64_t>(row) * p.og_row + h * D + my_vr))
                            : 0.f;
    const OffT base = static_cast<OffT>(slot) * static_cast<OffT>(p.slot_stride) +
                      static_cast<OffT>((h * D + vrow0) * D);
    Elem* sb = static_cast<Elem*>(p.state) + base;
    uint4 s[kSmemState ? 1 : PASSES][CHUNKS];  // in flight in registers (unless in shared memory)
    if constexpr (kSmemState == 2) issue_tile();  // the tile after the prologue's loads
    if constexpr (!kSmemState) {
#pragma unroll
      for (int ps = 0; ps < PASSES; ++ps)
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i)
          s[ps][i] = load_state<kCoherent>(
              reinterpret_cast<const uint4*>(sb + (ps * RPW + r) * D + key_of(i, c)));
    }
    if (arrived) cluster_wait();  // every peer has started: its shared memory may be written
#pragma unroll
    for (int it = 0; it < IPT; ++it) {
      const int j = rank * IPC + it * THREADS + threadIdx.x;
      broadcast(&sm.in[j], finish_item(p, h, slot, j, raw[it]), rank);
    }
    cluster_sync();  // #1: the prologue is in every CTA's shared memory
    const float b = sigmoidf_(b_raw);

    float qn[KPL], kn[KPL], dec[KPL];
    lane_keys(p, sm, c, qn, kn, dec);

    float mine = 0.f;  // o of pass c (lanes c < PASSES)
    float part = 0.f;
    if constexpr (kSmemState) fkda::mbar_wait(bar, 0);  // the tile has landed (one use: phase 0)
#pragma unroll
    for (int ps = 0; ps < PASSES; ++ps) {
      float st[KPL];
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i) {
        if constexpr (kSmemState) {
          const uint4 chunk = *reinterpret_cast<const uint4*>(
              tile + (warp * ROWS_PER_WARP + ps * RPW + r) * D + key_of(i, c));
          StateTraits<kBf16>::unpack(chunk, &st[i * VEC]);
        } else {
          StateTraits<kBf16>::unpack(s[ps][i], &st[i * VEC]);
        }
      }
      const float o = step_row(st, qn, kn, dec, b, [&] { return sm.in[2 * D + vrow0 + ps * RPW + r]; });
      part = fmaf(o, o, part);
      if (c == ps) mine = o;
      // this pass's state leaves now, while later passes' loads may still be arriving (kBulkStore: it
      // goes back over the tile, and to the pool in one bulk copy below)
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i) {
        const uint4 packed = StateTraits<kBf16>::pack(&st[i * VEC]);
        if constexpr (kBulkStore)
          *reinterpret_cast<uint4*>(tile + (warp * ROWS_PER_WARP + ps * RPW + r) * D + key_of(i, c)) = packed;
        else
          store_state<kCoherent>(reinterpret_cast<uint4*>(sb + (ps * RPW + r) * D + key_of(i, c)), packed);
      }
    }
    if constexpr (kBulkStore) fkda::fence_smem_to_async();  // the tile's writes, before barrier #2
    // the warp's sum(o^2): groups hold their V-rows' o in every lane; add the groups in lane order
#pragma unroll
    for (int off = LPR; off < 32; off <<= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
    if (lane == 0) broadcast(&sm.red[half][rank * WARPS + warp], part, rank);
    cluster_sync();  // #2: every partial everywhere (and, kBulkStore, the whole tile written)
    if constexpr (kBulkStore) {
      if (threadIdx.x == 0) {
        fkda::bulk_s2g(pool_tile(), tile, kTileBytes);
      }
    }
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < NRED; ++i) total += sm.red[half][i];
    const float inv = 1.f / sqrtf(total / static_cast<float>(D) + p.norm_eps);
    if (writer) p.out[orow + my_vr] = __float2bfloat16_rn(mine * inv * nw * sigmoidf_(og));
    if constexpr (kBulkStore) {
      if (threadIdx.x == 0) fkda::bulk_s2g_wait_read();  // the tile stays until the copy has read it
    }
  }
};

// ---- schedule 0: one (row, head) per cluster of CL CTAs ------------------------------------------

template <bool kBf16, int CL, int V_TILE, int THREADS, typename OffT, int kSmemState, bool kBulkStore>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
fused_kda_decode_tile_kernel(const FusedParams p) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  using T = FusedCta<kBf16, CL, V_TILE, THREADS, OffT, false, kSmemState, kBulkStore>;
  __shared__ typename T::Smem sm;
  extern __shared__ __align__(128) uint8_t dyn_smem[];  // kSmemState: the state tile
  __shared__ uint64_t tile_bar;                         // kSmemState: its bulk copy's completion
  const int item = blockIdx.x / CL;
  const unsigned rank = blockIdx.x % CL;  // 1-D clusters of CL consecutive CTAs
  const int row = item / p.H, h = item % p.H;
  if (T::is_pad(p, __ldg(p.idx + row))) {  // uniform across the cluster: no barrier is skipped
    T::write_zeros(p, row, h, rank);
    return;
  }
  if constexpr (kSmemState) {
    // initialised before any use, a CTA barrier between (arming it in the same thread right after
    // the init drew racecheck hazard warnings)
    if (threadIdx.x == 0) {
      fkda::mbar_init(&tile_bar, 1);
      fkda::mbar_init_fence();
    }
    __syncthreads();
  }
  T::cluster_arrive_relaxed();
  T::run(p, sm, row, h, rank, 0, true, reinterpret_cast<typename T::Elem*>(dyn_smem), &tile_bar);
}

// ---- schedule 2: one head per cluster, every row in order (repeated slots) -----------------------

template <bool kBf16, int CL, int V_TILE, int THREADS, typename OffT>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
fused_kda_decode_seq_kernel(const FusedParams p) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  using T = FusedCta<kBf16, CL, V_TILE, THREADS, OffT, true>;
  __shared__ typename T::Smem sm;
  const int h = blockIdx.x / CL;
  const unsigned rank = blockIdx.x % CL;
  int done = 0;  // processed rows: picks the partial-sum half
  T::cluster_sync();  // every CTA of the cluster has started before any DSMEM write
  for (int row = 0; row < p.rows; ++row) {
    if (T::is_pad(p, p.idx[row])) {
      T::write_zeros(p, row, h, rank);
      continue;
    }
    T::run(p, sm, row, h, rank, done & 1, false);
    ++done;
  }
}

}  // namespace fkda_fused
