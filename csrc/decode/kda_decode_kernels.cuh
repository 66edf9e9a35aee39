// KDA decode step on a state pool [slots, HV, V, K] (K contiguous), sm_90a.
//
// Work split: a V-row of the state (one value column, all K keys) evolves independently of every
// other V-row given the token's q, k, g, beta, v (decay, dot with k, rank-one update, dot with q).
// So each warp owns whole V-rows: LPR lanes cover one V-row (16-byte loads along K, coalesced),
// 32/LPR V-rows per warp instruction, PASSES such groups per warp. Per-row reductions are
// LPR-lane shuffle trees (fixed order: deterministic). Every warp recomputes the token's
// normalised q/k and decay for its own keys (cheap, L1-resident), so warps never synchronise.
//
// Schedules (chosen by FKDA_PARAM_SCHEDULE, see README.md):
//   0 tile        grid = rows*HV*(V/V_TILE) CTAs, each one (row, head, V-tile)
//   2 sequential  grid = HV*(V/V_TILE); each warp walks all rows in order (repeated slots safe),
//                 next row prefetched, forwarded in registers when it hits the same slot
//   3 stream      grid = min(tiles, PERSISTENT_K * SMs), grid-stride, a cp.async ring of state tiles
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/grid_dependency.cuh"

namespace fkda_decode {

using bf16 = __nv_bfloat16;

// FKDA_PARAM_GB_F32 = 1: g and beta are fp32 tensors, read as they are (serving engines hand the
// activated gate and sigmoid(beta) over in fp32 beside bf16 q/k/v; a cast to bf16 would cost a
// kernel per call). Otherwise they are bf16 like q, k and v.
#if defined(FKDA_PARAM_GB_F32) && FKDA_PARAM_GB_F32
using gb_t = float;
#else
using gb_t = bf16;
#endif

struct DecodeParams {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const gb_t* g;
  const gb_t* beta;
  const float* A_log;    // [HV] or nullptr (= 0)
  const float* dt_bias;  // [HV*K] or nullptr (= 0)
  void* state;           // pool base
  const int32_t* idx;    // [rows]
  bf16* out;             // [rows, HV, V] contiguous
  int64_t q_row_stride, k_row_stride, v_row_stride, g_row_stride, beta_row_stride;  // elements
  int64_t slot_stride;   // elements between slots
  int64_t num_slots;
  int rows, H, HV, group;
  int gate_mode;         // 0 softplus, 1 bounded, 2 log
  float lower_bound, scale;
  int beta_is_logit, null_slot0;
};

// ---- small helpers ---------------------------------------------------------------------------

template <int N>
struct BfVec;  // N bf16 in one load
template <>
struct BfVec<4> { uint2 raw; };
template <>
struct BfVec<8> { uint4 raw; };

template <int N>
__device__ __forceinline__ BfVec<N> load_bf(const bf16* p) {
  BfVec<N> r;
  if constexpr (N == 4) r.raw = __ldg(reinterpret_cast<const uint2*>(p));
  else r.raw = __ldg(reinterpret_cast<const uint4*>(p));
  return r;
}

template <int N>
__device__ __forceinline__ void unpack_bf(const BfVec<N>& b, float* f) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&b.raw);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
    float2 x = __bfloat1622float2(h);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

__device__ __forceinline__ float bf_to_f(bf16 x) { return __bfloat162float(x); }

// N fp32 values in 16-byte loads (fp32 g: 4 or 8 keys per state chunk).
template <int N>
struct F32Vec { float4 raw[N / 4]; };

// g's chunk of N keys and beta, loaded and converted in their own dtype (gb_t).
template <int N>
__device__ __forceinline__ BfVec<N> load_gb(const bf16* p) { return load_bf<N>(p); }
template <int N>
__device__ __forceinline__ F32Vec<N> load_gb(const float* p) {
  F32Vec<N> r;
#pragma unroll
  for (int j = 0; j < N / 4; ++j) r.raw[j] = __ldg(reinterpret_cast<const float4*>(p) + j);
  return r;
}
template <int N>
__device__ __forceinline__ void unpack_gb(const BfVec<N>& b, float* f) { unpack_bf<N>(b, f); }
template <int N>
__device__ __forceinline__ void unpack_gb(const F32Vec<N>& b, float* f) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    f[4 * j] = b.raw[j].x; f[4 * j + 1] = b.raw[j].y; f[4 * j + 2] = b.raw[j].z; f[4 * j + 3] = b.raw[j].w;
  }
}
__device__ __forceinline__ float gb_to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float gb_to_f(float x) { return x; }

template <int LPR>
__device__ __forceinline__ float group_sum(float x) {
  // butterfly inside aligned groups of LPR lanes; every lane ends with the same sum
#pragma unroll
  for (int off = LPR / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// q <- scale q / ||q||, k <- k / ||k|| in place, each lane holding KPL keys of a row that LPR lanes
// share (the sums of squares go round the group). Shared by the decode and fused decode kernels;
// scale by reference so its load stays next to its use (the generated code is the one the kernels
// had inline, checked by comparing PTX).
template <int LPR, int KPL>
__device__ __forceinline__ void l2norm_qk(float (&qn)[KPL], float (&kn)[KPL], const float& scale) {
  float ssq = 0.f, ssk = 0.f;
#pragma unroll
  for (int e = 0; e < KPL; ++e) {
    ssq = fmaf(qn[e], qn[e], ssq);
    ssk = fmaf(kn[e], kn[e], ssk);
  }
  ssq = group_sum<LPR>(ssq);
  ssk = group_sum<LPR>(ssk);
  const float qs = scale / sqrtf(ssq + 1e-6f);
  const float ks = 1.f / sqrtf(ssk + 1e-6f);
#pragma unroll
  for (int e = 0; e < KPL; ++e) {
    qn[e] *= qs;
    kn[e] *= ks;
  }
}

// One key's decay exp(gate): the raw gate graw, the key's dt_bias dt, a = exp(A_log). prepare()
// runs it per key of a lane; verify's staged prep (wide_gate) spreads the keys over a whole CTA.
__device__ __forceinline__ float gate_decay(const DecodeParams& p, float graw, float dt, float a) {
  float gl;
  if (p.gate_mode == 2) {
    gl = graw;
  } else if (p.gate_mode == 0) {
    const float x = graw + dt;
    gl = -a * (x > 20.f ? x : log1pf(expf(x)));
  } else {
    const float x = a * (graw + dt);
    gl = p.lower_bound / (1.f + expf(-x));
  }
  return expf(gl);
}

// State chunk: 16 bytes = 4 fp32 or 8 bf16 keys.
template <bool kBf16>
struct StateTraits {
  static constexpr int VEC = kBf16 ? 8 : 4;
  __device__ static void unpack(const uint4& c, float* f) {
    if constexpr (kBf16) {
      BfVec<8> b;
      b.raw = c;
      unpack_bf<8>(b, f);
    } else {
      f[0] = __uint_as_float(c.x); f[1] = __uint_as_float(c.y);
      f[2] = __uint_as_float(c.z); f[3] = __uint_as_float(c.w);
    }
  }
  __device__ static uint4 pack(const float* f) {
    uint4 c;
    if constexpr (kBf16) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);  // round to nearest even
        w[i] = *reinterpret_cast<uint32_t*>(&h);
      }
      c = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      c = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                     __float_as_uint(f[3]));
    }
    return c;
  }
};

// Streaming loads/stores: the pool is touched once per call, keep it from evicting inputs in L2.
// kCoherent (sequential schedule) uses plain ld/st so a thread's later load of a slot it stored
// earlier is ordered by program order on the ordinary path.
template <bool kCoherent>
__device__ __forceinline__ uint4 load_state(const uint4* p) {
  if constexpr (kCoherent) return *p;
  else return __ldcs(p);
}
template <bool kCoherent>
__device__ __forceinline__ void store_state(uint4* p, const uint4& c) {
  if constexpr (kCoherent) *p = c;
  else __stcs(p, c);
}

// ---- the per-warp tile -----------------------------------------------------------------------

template <bool kBf16, int LPR, int ROWS_PER_WARP, typename OffT, bool kCoherent>
struct WarpTile {
  static constexpr int K = FKDA_HEAD_DIM_K;
  static constexpr int V = FKDA_HEAD_DIM_V;
  static constexpr int VEC = StateTraits<kBf16>::VEC;
  using Elem = std::conditional_t<kBf16, bf16, float>;
  static constexpr int KPL = K / LPR;        // keys per lane
  static constexpr int CHUNKS = KPL / VEC;   // 16-byte state loads per lane per V-row
  static constexpr int RPW = 32 / LPR;       // V-rows per warp instruction
  static constexpr int PASSES = ROWS_PER_WARP / RPW;
  static_assert(K % (LPR * VEC) == 0 && CHUNKS >= 1, "K must tile by LPR*VEC");
  static_assert(ROWS_PER_WARP % RPW == 0 && PASSES >= 1, "rows per warp must tile by 32/LPR");
  static_assert(VEC % 4 == 0, "dt_bias loads are float4");

  // key of (chunk i, element e) for lane column c: each chunk is LPR*16 contiguous bytes per V-row
  __device__ static int key_of(int i, int c) { return i * (LPR * VEC) + c * VEC; }

  // Everything one lane needs for one (row, head, warp's V-rows), loaded but not yet used.
  struct Item {
    uint4 s[PASSES][CHUNKS];
    BfVec<VEC> qr[CHUNKS], kr[CHUNKS];
    decltype(load_gb<VEC>(static_cast<const gb_t*>(nullptr))) gr[CHUNKS];
    float4 dt[CHUNKS][VEC / 4];
    bf16 vr[PASSES];
    gb_t beta_raw;
    float a_log;
  };

  __device__ static bool is_pad(const DecodeParams& p, int32_t slot) {
    return slot < 0 || (p.null_slot0 && slot == 0) || slot >= p.num_slots;
  }

  __device__ static OffT slot_base(const DecodeParams& p, int32_t slot, int hv, int vrow0) {
    return static_cast<OffT>(slot) * static_cast<OffT>(p.slot_stride) +
           static_cast<OffT>((hv * V + vrow0) * K);
  }

  // Token inputs only (q, k, g, dt_bias, v, beta): independent of the slot.
  __device__ static void load_inputs(const DecodeParams& p, Item& it, int row, int hv, int vrow0,
                                     int lane) {
    const int c = lane % LPR, r = lane / LPR;
    const int h = hv / p.group;
    const bf16* qp = p.q + row * p.q_row_stride + h * K;
    const bf16* kp = p.k + row * p.k_row_stride + h * K;
    const gb_t* gp = p.g + row * p.g_row_stride + hv * K;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int key = key_of(i, c);
      it.qr[i] = load_bf<VEC>(qp + key);
      it.kr[i] = load_bf<VEC>(kp + key);
      it.gr[i] = load_gb<VEC>(gp + key);
#pragma unroll
      for (int j = 0; j < VEC / 4; ++j) {
        it.dt[i][j] = p.dt_bias ? __ldg(reinterpret_cast<const float4*>(p.dt_bias + hv * K + key) + j)
                                : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    const bf16* vp = p.v + row * p.v_row_stride + hv * V + vrow0 + r;
#pragma unroll
    for (int ps = 0; ps < PASSES; ++ps) it.vr[ps] = vp[ps * RPW];
    it.beta_raw = p.beta[row * p.beta_row_stride + hv];
    it.a_log = p.A_log ? __ldg(p.A_log + hv) : 0.f;
  }

  __device__ static void load_state_regs(const DecodeParams& p, Item& it, OffT base, int lane) {
    // typed pointer arithmetic: the element offset (OffT) is scaled to bytes in 64 bits
    load_state_at(it, static_cast<const Elem*>(p.state) + base, lane);
  }
  // The same from the tile's first element sb, in whichever pool (kda_verify's second start pool too); kPlain
  // true: plain loads whatever the schedule (kda_verify's tree branches read back what the thread stored).
  template <bool kPlain = kCoherent>
  __device__ static void load_state_at(Item& it, const Elem* sb, int lane) {
    const int c = lane % LPR, r = lane / LPR;
#pragma unroll
    for (int ps = 0; ps < PASSES; ++ps) {
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i) {
        const int e = (ps * RPW + r) * K + key_of(i, c);
        it.s[ps][i] = load_state<kPlain>(reinterpret_cast<const uint4*>(sb + e));
      }
    }
  }

  // Normalised q (scaled), k, per-key decay exp(g), beta: for this lane's keys.
  struct Prep {
    float qn[KPL], kn[KPL], dec[KPL];
    float beta;
  };

  // kGate = false leaves pr.dec unset (verify's wide_gate prep computes the decays over the CTA).
  template <bool kGate = true>
  __device__ static void prepare(const DecodeParams& p, const Item& it, Prep& pr) {
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      unpack_bf<VEC>(it.qr[i], &pr.qn[i * VEC]);
      unpack_bf<VEC>(it.kr[i], &pr.kn[i * VEC]);
    }
    l2norm_qk<LPR, KPL>(pr.qn, pr.kn, p.scale);
    const float a = expf(it.a_log);
#pragma unroll
    for (int i = 0; i < (kGate ? CHUNKS : 0); ++i) {
      float graw[VEC];
      unpack_gb<VEC>(it.gr[i], graw);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float4 d4 = it.dt[i][e / 4];
        const float dt = (e % 4 == 0) ? d4.x : (e % 4 == 1) ? d4.y : (e % 4 == 2) ? d4.z : d4.w;
        pr.dec[i * VEC + e] = gate_decay(p, graw[e], dt, a);
      }
    }
    const float b = gb_to_f(it.beta_raw);
    pr.beta = p.beta_is_logit ? 1.f / (1.f + expf(-b)) : b;
  }

  // The step on this lane's state registers. Each pass's updated chunks go back into it.s and
  // straight to the pool, so a pass's stores leave while later passes' loads are still arriving
  // (the stores of a CTA no longer wait for its last load).
  __device__ static void compute_and_store(const DecodeParams& p, Item& it, const Prep& pr, int row,
                                           int hv, int vrow0, int lane, OffT base) {
    step_passes<false>(
        p, it, pr, 0.f, row, hv, vrow0, lane, base, [&](int ps, int i) { return it.s[ps][i]; },
        [&](int ps, int i, const uint4& c) { it.s[ps][i] = c; });
  }

  // k . q over the whole row (every lane of the group ends with it): the tile-in-shared-memory
  // path's output sum needs it (step_passes<true>); computed while the tile is still arriving.
  __device__ static float row_kq(const Prep& pr) {
    float kq = 0.f;
#pragma unroll
    for (int e = 0; e < KPL; ++e) kq = fmaf(pr.kn[e], pr.qn[e], kq);
    return group_sum<LPR>(kq);
  }

  // The same step with the state read from a shared-memory tile (this warp's V-rows at
  // warp_tile, rows of K elements, as in the pool) pass by pass: nothing of it waits in registers.
  // kq = row_kq(pr). kBulkStore: the updated state goes back over the tile (the CTA then sends the
  // tile to the pool in one bulk copy) instead of to the pool pass by pass.
  template <bool kBulkStore>
  __device__ static void compute_and_store_from(const DecodeParams& p, Item& it, const Prep& pr, float kq,
                                                int row, int hv, int vrow0, int lane, OffT base,
                                                Elem* warp_tile) {
    const int c = lane % LPR, r = lane / LPR;
    step_passes<true, !kBulkStore>(
        p, it, pr, kq, row, hv, vrow0, lane, base,
        [&](int ps, int i) {
          return *reinterpret_cast<const uint4*>(warp_tile + (ps * RPW + r) * K + key_of(i, c));
        },
        [&](int ps, int i, const uint4& v) {
          if constexpr (kBulkStore) *reinterpret_cast<uint4*>(warp_tile + (ps * RPW + r) * K + key_of(i, c)) = v;
        });
  }

  // chunk(ps, i): the 16-byte state chunk i of pass ps; keep(ps, i, c): the updated chunk (the
  // sequential schedule forwards it to a next row on the same slot). kJointSums: the output as
  // o = (decayed S) q + u (k . q), kq = k . q, so its row sum runs beside the k sum instead of
  // after the update (the shared-memory tile path: 2026-11-30, f5ae208, bf16 rowtma 1.8% faster at
  // 64 heads, and no spill; the register paths measured level or up to 7% slower, so they keep o =
  // S_new q).
  // kToPool: each pass's chunks also go straight to the pool (else keep alone places them).
  template <bool kJointSums, bool kToPool = true, typename Chunk, typename Keep>
  __device__ static void step_passes(const DecodeParams& p, Item& it, const Prep& pr, float kq, int row,
                                     int hv, int vrow0, int lane, OffT base, Chunk&& chunk, Keep&& keep) {
    const int c = lane % LPR, r = lane / LPR;
    bf16* op = p.out + (static_cast<int64_t>(row) * p.HV + hv) * V + vrow0 + r;
    [[maybe_unused]] Elem* sb = static_cast<Elem*>(p.state) + base;
#pragma unroll
    for (int ps = 0; ps < PASSES; ++ps) {
      float s[KPL];
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i) StateTraits<kBf16>::unpack(chunk(ps, i), &s[i * VEC]);
      float kv = 0.f, sq = 0.f;
#pragma unroll
      for (int e = 0; e < KPL; ++e) {
        s[e] *= pr.dec[e];
        kv = fmaf(s[e], pr.kn[e], kv);
        if constexpr (kJointSums) sq = fmaf(s[e], pr.qn[e], sq);
      }
      kv = group_sum<LPR>(kv);
      if constexpr (kJointSums) sq = group_sum<LPR>(sq);
      const float u = pr.beta * (bf_to_f(it.vr[ps]) - kv);
      float o = 0.f;
#pragma unroll
      for (int e = 0; e < KPL; ++e) {
        s[e] = fmaf(pr.kn[e], u, s[e]);
        if constexpr (!kJointSums) o = fmaf(s[e], pr.qn[e], o);
      }
      if constexpr (kJointSums) o = fmaf(u, kq, sq);
      else o = group_sum<LPR>(o);
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i) {
        const uint4 packed = StateTraits<kBf16>::pack(&s[i * VEC]);
        keep(ps, i, packed);
        if constexpr (kToPool) {
          const int e = (ps * RPW + r) * K + key_of(i, c);
          store_state<kCoherent>(reinterpret_cast<uint4*>(sb + e), packed);
        }
      }
      if (c == 0) op[ps * RPW] = __float2bfloat16_rn(o);
    }
  }

  __device__ static void write_zeros(const DecodeParams& p, int row, int hv, int vrow0, int lane) {
    const int c = lane % LPR, r = lane / LPR;
    bf16* op = p.out + (static_cast<int64_t>(row) * p.HV + hv) * V + vrow0 + r;
    if (c == 0) {
#pragma unroll
      for (int ps = 0; ps < PASSES; ++ps) op[ps * RPW] = __float2bfloat16_rn(0.f);
    }
  }
};

// The tile schedules' CTA: blockIdx.x = (row * HV + head) * (V / V_TILE) + V-tile; and this warp's
// first V-row.
struct TileCoords {
  int row, hv, vt, vrow0;
};
template <int V_TILE, int WARPS>
__device__ __forceinline__ TileCoords tile_coords(const DecodeParams& p, int warp) {
  constexpr int NVT = FKDA_HEAD_DIM_V / V_TILE;
  const int tile = blockIdx.x;
  const int item = tile / NVT, vt = tile % NVT;
  return {item / p.HV, item % p.HV, vt, vt * V_TILE + warp * (V_TILE / WARPS)};
}

// ---- schedule 0: one CTA per (row, head, V-tile) ---------------------------------------------

template <bool kBf16, int LPR, int V_TILE, int THREADS, typename OffT>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
kda_decode_tile_kernel(const DecodeParams p) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  constexpr int WARPS = THREADS / 32;
  static_assert(V_TILE % WARPS == 0, "V tile must split evenly over warps");
  using T = WarpTile<kBf16, LPR, V_TILE / WARPS, OffT, false>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto [row, hv, vt, vrow0] = tile_coords<V_TILE, WARPS>(p, warp);
  const int32_t slot = __ldg(p.idx + row);
  typename T::Item it;
  T::load_inputs(p, it, row, hv, vrow0, lane);  // independent of the slot: issued with idx
  if (T::is_pad(p, slot)) {
    T::write_zeros(p, row, hv, vrow0, lane);
    return;
  }
  const OffT base = T::slot_base(p, slot, hv, vrow0);
  T::load_state_regs(p, it, base, lane);
  typename T::Prep pr;
  T::prepare(p, it, pr);
  T::compute_and_store(p, it, pr, row, hv, vrow0, lane, base);
}

// ---- schedule 0 with the state tile by bulk copy (FKDA_PARAM_STATE_SMEM = 1) -------------------
// The same (row, head, V-tile) per CTA, but the tile's V_TILE x K state (contiguous in the pool)
// comes in by one bulk copy (TMA) into dynamic shared memory, and each pass reads its chunks from
// there: no registers hold the state in flight, so more CTAs fit an SM, and the pool sees one
// large contiguous read per CTA. kBulkStore: the updated tile goes back the same way, in one bulk
// copy from shared memory after a CTA barrier, instead of each pass's stores from registers (H200,
// 2026-11-30, 7d0f139, bf16 state: 2-6% faster from 8192 work items (rowtma), 1-3% from 512 (quartma);
// slower in fp32 and at a few rows, where the barrier and the copy's round trip sit on the path).

template <bool kBf16, int LPR, int V_TILE, int THREADS, typename OffT, bool kBulkStore>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
kda_decode_tile_tma_kernel(const DecodeParams p) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  constexpr int WARPS = THREADS / 32;
  using T = WarpTile<kBf16, LPR, V_TILE / WARPS, OffT, false>;
  using Elem = typename T::Elem;
  constexpr uint32_t kTileBytes = uint32_t(V_TILE) * T::K * sizeof(Elem);
  extern __shared__ __align__(128) uint8_t dyn_smem[];
  __shared__ uint64_t bar;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto [row, hv, vt, vrow0] = tile_coords<V_TILE, WARPS>(p, warp);
  if (threadIdx.x == 0) {
    fkda::mbar_init(&bar, 1);
    fkda::mbar_init_fence();
  }
  const int32_t slot = __ldg(p.idx + row);
  typename T::Item it;
  T::load_inputs(p, it, row, hv, vrow0, lane);  // independent of the slot: issued with idx
  __syncthreads();  // the mbarrier is initialised before it is armed or waited on
  if (T::is_pad(p, slot)) {  // CTA-uniform
    T::write_zeros(p, row, hv, vrow0, lane);
    return;
  }
  Elem* st = reinterpret_cast<Elem*>(dyn_smem);
  if (threadIdx.x == 0) {
    fkda::bulk_load(st, static_cast<const Elem*>(p.state) + T::slot_base(p, slot, hv, vt * V_TILE), kTileBytes,
                    &bar);
  }
  typename T::Prep pr;
  T::prepare(p, it, pr);  // while the tile is arriving
  const float kq = T::row_kq(pr);
  fkda::mbar_wait(&bar, 0);
  T::template compute_and_store_from<kBulkStore>(p, it, pr, kq, row, hv, vrow0, lane,
                                                 T::slot_base(p, slot, hv, vrow0), st + warp * (V_TILE / WARPS) * T::K);
  if constexpr (kBulkStore) {
    fkda::fence_smem_to_async();  // this thread's tile writes, for the bulk copy
    __syncthreads();
    if (threadIdx.x == 0) {
      fkda::bulk_s2g(static_cast<Elem*>(p.state) + T::slot_base(p, slot, hv, vt * V_TILE), st, kTileBytes);
      fkda::bulk_s2g_wait_read();  // the tile must outlive the copy's reads
    }
  }
}

// ---- schedule 3: persistent stream with a cp.async ring in shared memory -----------------------
// grid = min(tiles, PERSISTENT_K x SMs), each CTA walks tiles grid-stride; the state of the next
// STAGES-1 tiles is in flight through cp.async into a per-thread ring (each thread copies exactly the 16-byte chunks it later reads, so no barrier is
// needed, only cp.async.wait_group). The slot index runs one tile further ahead in a register and
// the token inputs one tile ahead, so no dependent global load sits on the tile's critical path.

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <bool kBf16, int LPR, int V_TILE, int THREADS, typename OffT, int STAGES>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
kda_decode_stream_kernel(const DecodeParams p, int num_tiles) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  constexpr int WARPS = THREADS / 32;
  using T = WarpTile<kBf16, LPR, V_TILE / WARPS, OffT, false>;
  using Elem = typename T::Elem;
  constexpr int K = T::K;
  constexpr int NVT = T::V / V_TILE;
  constexpr int CPT = T::PASSES * T::CHUNKS;  // 16-byte chunks per thread per tile
  static_assert(STAGES >= 2, "ring depth");
  extern __shared__ uint4 ring[];              // [STAGES][CPT][THREADS]
  __shared__ int s_slot[STAGES][THREADS];      // slot of the tile in each stage, per thread
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int c = lane % LPR, r = lane / LPR;
  auto tile_at = [&](int j) { return static_cast<int>(blockIdx.x) + j * static_cast<int>(gridDim.x); };
  auto row_of = [&](int tt) { return (tt / NVT) / p.HV; };
  auto hv_of = [&](int tt) { return (tt / NVT) % p.HV; };
  auto vrow_of = [&](int tt) { return (tt % NVT) * V_TILE + warp * (V_TILE / WARPS); };
  auto slot_of = [&](int tt) { return tt < num_tiles ? __ldg(p.idx + row_of(tt)) : -1; };
  // issue the state copies of tile tt (slot known) into ring stage st
  auto issue = [&](int tt, int slot, int st) {
    s_slot[st][tid] = slot;
    if (tt < num_tiles && !T::is_pad(p, slot)) {
      const Elem* sb = static_cast<const Elem*>(p.state) + T::slot_base(p, slot, hv_of(tt), vrow_of(tt));
#pragma unroll
      for (int ps = 0; ps < T::PASSES; ++ps) {
#pragma unroll
        for (int i = 0; i < T::CHUNKS; ++i) {
          const int e = (ps * T::RPW + r) * K + T::key_of(i, c);
          cp_async16(&ring[(st * CPT + ps * T::CHUNKS + i) * THREADS + tid], sb + e);
        }
      }
    }
    cp_async_commit();  // one group per tile, empty or not, so the wait count stays uniform
  };
  if (tile_at(0) >= num_tiles) return;
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    const int tt = tile_at(j);
    issue(tt, slot_of(tt), j);
  }
  int slot_ahead = slot_of(tile_at(STAGES - 1));
  typename T::Item cur;
  T::load_inputs(p, cur, row_of(tile_at(0)), hv_of(tile_at(0)), vrow_of(tile_at(0)), lane);
  for (int j = 0;; ++j) {
    const int t = tile_at(j);
    if (t >= num_tiles) break;
    const int st = j % STAGES;
    issue(tile_at(j + STAGES - 1), slot_ahead, (j + STAGES - 1) % STAGES);
    slot_ahead = slot_of(tile_at(j + STAGES));
    typename T::Item nxt;
    const int t1 = tile_at(j + 1);
    if (t1 < num_tiles) T::load_inputs(p, nxt, row_of(t1), hv_of(t1), vrow_of(t1), lane);
    const int row = row_of(t), hv = hv_of(t), vrow0 = vrow_of(t);
    const int slot = s_slot[st][tid];
    cp_async_wait<STAGES - 1>();  // this thread's copies of tile j have landed
    if (T::is_pad(p, slot)) {
      T::write_zeros(p, row, hv, vrow0, lane);
    } else {
#pragma unroll
      for (int ps = 0; ps < T::PASSES; ++ps)
#pragma unroll
        for (int i = 0; i < T::CHUNKS; ++i) cur.s[ps][i] = ring[(st * CPT + ps * T::CHUNKS + i) * THREADS + tid];
      typename T::Prep pr;
      T::prepare(p, cur, pr);
      T::compute_and_store(p, cur, pr, row, hv, vrow0, lane, T::slot_base(p, slot, hv, vrow0));
    }
    cur = nxt;
  }
  cp_async_wait<0>();  // no copy may outlive the CTA's shared memory
}

// ---- schedule 2: sequential over rows per (head, V-tile): exact for repeated slots ------------

template <bool kBf16, int LPR, int V_TILE, int THREADS, typename OffT>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
kda_decode_seq_kernel(const DecodeParams p) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  constexpr int WARPS = THREADS / 32;
  using T = WarpTile<kBf16, LPR, V_TILE / WARPS, OffT, true>;
  constexpr int NVT = T::V / V_TILE;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hv = blockIdx.x / NVT, vt = blockIdx.x % NVT;
  const int vrow0 = vt * V_TILE + warp * (V_TILE / WARPS);
  if (p.rows <= 0) return;
  int slot = __ldg(p.idx + 0);
  int slot1 = p.rows > 1 ? __ldg(p.idx + 1) : -1;
  typename T::Item cur;
  T::load_inputs(p, cur, 0, hv, vrow0, lane);
  if (!T::is_pad(p, slot)) T::load_state_regs(p, cur, T::slot_base(p, slot, hv, vrow0), lane);
  for (int row = 0; row < p.rows; ++row) {
    const bool has_next = row + 1 < p.rows;
    const int slot2 = row + 2 < p.rows ? __ldg(p.idx + row + 2) : -1;
    const bool pad = T::is_pad(p, slot);
    // the next row hits the slot this row is about to update: take it from registers instead.
    // Any other earlier store to its slot was issued by this thread before this load.
    const bool forward = has_next && !pad && slot1 == slot;
    typename T::Item nxt;
    if (has_next) {
      T::load_inputs(p, nxt, row + 1, hv, vrow0, lane);
      if (!forward && !T::is_pad(p, slot1))
        T::load_state_regs(p, nxt, T::slot_base(p, slot1, hv, vrow0), lane);
    }
    if (pad) {
      T::write_zeros(p, row, hv, vrow0, lane);
    } else {
      typename T::Prep pr;
      T::prepare(p, cur, pr);
      T::compute_and_store(p, cur, pr, row, hv, vrow0, lane, T::slot_base(p, slot, hv, vrow0));
      if (forward) {
#pragma unroll
        for (int ps = 0; ps < T::PASSES; ++ps)
#pragma unroll
          for (int i = 0; i < T::CHUNKS; ++i) nxt.s[ps][i] = cur.s[ps][i];
      }
    }
    if (!has_next) break;
    cur = nxt;
    slot = slot1;
    slot1 = slot2;
  }
}

}  // namespace fkda_decode
