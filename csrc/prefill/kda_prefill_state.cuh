// The ordered state pass of the sm_90a prefill (kda_prefill_layout.cuh for the shared layout):
//
//   kda_state_kernel      grid (V tiles / kGroups, HV, N x pieces), 128 x kGroups threads. The fp32
//                         state tile lives in registers across the sequence's chunks; three small GEMMs
//                         a chunk (state_chunk_step); chunks arrive by bulk copies (TMA) into a 2-3 deep
//                         ring. kGroups > 1: one CTA holds kGroups 4-warp groups, each its own V tile,
//                         that share one copy of a chunk's [W | Qg | Kd | A | gC] (kGroups x fewer bytes
//                         a chunk moved; a column measured only ~14% faster: csrc/prefill/README.md).
//                         kPieces > 1 (issue 46): a sequence's chunks are split into up to kPieces runs
//                         (StateArgs::pieces, picked at launch) done in parallel, each after a warm-up
//                         from a zero state (piece_start).
//
// state_chunk_step is also the prep kernel's one-chunk path (StateArgs::single).
#pragma once

#include "kda_prefill_layout.cuh"

namespace fkda_prefill {

// ---- state kernel shared memory map --------------------------------------------------------------
#ifndef FKDA_PARAM_GROUPS
#define FKDA_PARAM_GROUPS 1
#endif
// 4-warp groups a state-pass CTA (each a V tile of its own; record param 'groups', default 1).
constexpr int kGroups = FKDA_PARAM_GROUPS;
static_assert(kGroups == 1 || kGroups == 2 || kGroups == 4, "FKDA_PARAM_GROUPS must be 1, 2 or 4");
// Default ring depth of the state pass: chunk c+NS-1 is loading while chunk c is used (3 deep where
// shared memory allows). One CTA an SM at these depths (168-214 KB).
template <int VT>
constexpr int default_ring() { return VT <= 32 ? 3 : 2; }

// G groups of 4 warps: a stage holds the side data once and the U blocks of all G V tiles (a run of
// whole blocks: group j's are the j-th VT / 16 of them); Sb and V' are per group.
template <int VT, int RING = default_ring<VT>(), int G = kGroups>
struct StateSmem {
  static_assert(RING >= 1 && RING <= 3, "ring depth 1..3");
  static constexpr int NS = RING;
  static constexpr int kLdU = VT + 8;                  // Sb and V' rows
  static constexpr int kW = int(kWsW), kQg = int(kWsQg), kKd = int(kWsKd), kA = int(kWsA);
  static constexpr int kGc = int(kWsGc), kU = int(kWsU);
  static constexpr int kSide = int(kWsU);             // bytes of [W | Qg | Kd | A | gC]
  static constexpr int kGroupUBytes = (VT / 16) * int(kUBlockBytes);
  static constexpr int kUBytes = G * kGroupUBytes;    // the CTA's U blocks
  static constexpr int kStage = kSide + kUBytes;
  static constexpr int kSbGroup = kK * kLdU * 2;      // bf16 [128][kLdU] state for the B operand
  static constexpr int kVpGroup = kC * kLdU * 2;      // bf16 [64][kLdU] V'
  static constexpr int kSb = NS * kStage;
  static constexpr int kVp = kSb + G * kSbGroup;
  static constexpr int kBar = kVp + G * kVpGroup;     // NS mbarriers
  static constexpr int kTotal = kBar + NS * 8;
  static_assert(kStage % 16 == 0 && kBar % 8 == 0 && kSbGroup % 16 == 0 && kVpGroup % 16 == 0, "alignment");
};

// acc[0] += acc[1] + ...: the partial sums of a k-reduction split over independent accumulator sets.
template <int KS, int NT>
__device__ __forceinline__ void fold_partial_sums(float (&acc)[KS][NT][4]) {
#pragma unroll
  for (int p = 1; p < KS; ++p)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][nt][e] += acc[p][nt][e];
}

template <typename ST>
__device__ __forceinline__ float ld_state(const ST* p);
template <>
__device__ __forceinline__ float ld_state<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float ld_state<bf16>(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st_state(float* p, float x) { *p = x; }
__device__ __forceinline__ void st_state(bf16* p, float x) { *p = __float2bfloat16(x); }

// Register state tile of a warp (w = 0..3 of a 4-warp group): rows d = 32 w + 16 mt + g (+8),
// columns v = v0 + 8 nt + 2 tq (+1) of one [V][K] state.
template <int VT, typename ST>
__device__ __forceinline__ void store_state_tile(ST* base, const float (&s)[2][VT / 8][4], int w,
                                                 int lane, int v0) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < VT / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = w * 32 + mt * 16 + g + 8 * (e >> 1), vv = v0 + nt * 8 + 2 * tq + (e & 1);
        st_state(base + size_t(vv) * kK + d, s[mt][nt][e]);
      }
}
// The same tile from src, or zeros when src is null.
template <int VT, typename ST>
__device__ __forceinline__ void load_state_tile(float (&s)[2][VT / 8][4], const ST* src, int w, int lane,
                                                int v0) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < VT / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = w * 32 + mt * 16 + g + 8 * (e >> 1), vv = v0 + nt * 8 + 2 * tq + (e & 1);
        s[mt][nt][e] = src ? ld_state(src + size_t(vv) * kK + d) : 0.f;
      }
}
// The bf16 copy of the tile that feeds the B operand of V' = U - W S and O = Qg S ([K][VT + 8]).
template <int VT>
__device__ __forceinline__ void write_state_bf16(bf16* Sb, const float (&s)[2][VT / 8][4], int w, int lane) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < VT / 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<uint32_t*>(Sb + (w * 32 + mt * 16 + g + 8 * h) * (VT + 8) + nt * 8 + 2 * tq) =
            pack_bf16(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
}

// Sequence n's pool slot (or n); true when the row is padding (nothing read or written).
__device__ __forceinline__ bool state_slot(const StateArgs& a, int n, int64_t& slot) {
  slot = n;
  if (!a.idx) return false;
  const int s = a.idx[n];
  slot = s;
  return s < 0 || s >= a.num_slots || (a.null_slot0 && s == 0);
}

// After chunk c of sequence n (length len): the checkpoint that falls on its end, if any
// (checkpoints fall on whole chunks: every % 64 == 0).
template <int VT, typename ST>
__device__ __forceinline__ void store_checkpoint(const StateArgs& a, const float (&s)[2][VT / 8][4], int n,
                                                 int hv, int64_t c, int64_t len, int w, int lane, int v0) {
  if (!a.ckpt) return;
  const int64_t done = (c + 1) * kC;
  if (done <= len && done % a.ckpt_every == 0) {
    const int64_t m = done / a.ckpt_every - 1;
    if (m < a.ckpt_count) {
      ST* dst = static_cast<ST*>(a.ckpt) + ((size_t(n) * a.ckpt_count + m) * a.HV + hv) * kV * kK;
      store_state_tile<VT, ST>(dst, s, w, lane, v0);
    }
  }
}

// The pieces of one chunk for a VT-column tile. A group of 4 warps (w = 0..3) covers the chunk's
// 64 rows, 16 a warp; the state tile of warp w is rows d = 32 w .. 32 w + 31 of S.
// KS: independent accumulator sets per k-reduction. With few V columns a warp holds too few
// independent accumulators to hide the mma latency, so even and odd k-steps go to separate ones
// (KS = 2), summed at the end (H200, 1x32768 H16, vt16: 0.52 vs 0.545 ms).
template <int VT>
constexpr int default_ks() { return VT <= 32 ? 2 : 1; }

// Reads moved to the start of the chunk, off the chain (H200 A/Bs, eager, 2 rounds):
// - U before the W S products: 2-5.5% faster on the rows V tiles 32 and 64 serve (2026-11-29,
//   d43aaf2); at V tile 16 about 0.8% (2026-11-30, 615ddfc, with the output and update interleaved;
//   in the d43aaf2 (2026-11-29) runs, before that, it measured 0.4-2% slower). The prep kernel's
//   one-chunk path (kSplit) keeps the late read.
// - exp(G_C) of the thread's S rows, for the state update: 0.9% faster at V tile 16, 0.4% at 64,
//   0.4-1% slower at 32 (2026-11-30, 615ddfc, 30 / 46 / 4 rows), so not there.
template <int VT, bool kSplit>
constexpr bool early_u() { return VT >= 32 || !kSplit; }
template <int VT, bool kSplit>
constexpr bool early_decay() { return VT != 32 && !kSplit; }

// This thread's U entries of rows 16 w (the pairs store_vprime subtracts from), bf16 pairs.
template <int VT>
__device__ __forceinline__ void load_u_pairs(uint32_t (&u)[VT / 8][2], const bf16* Us, int w, int lane) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int nt = 0; nt < VT / 8; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      u[nt][h] = *reinterpret_cast<const uint32_t*>(Us + u_off(w * 16 + g + 8 * h, nt * 8 + 2 * tq));
}

// V' = U - (W S) for rows 16 w into Vp (ws: W S, partial sums already folded into set 0); U from
// the pairs u (kEarlyU) or read from Us here.
template <int VT, int KS, bool kEarlyU>
__device__ __forceinline__ void store_vprime(bf16* Vp, const uint32_t (&u)[VT / 8][2], const bf16* Us,
                                             const float (&ws)[KS][VT / 8][4], int w, int lane) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int nt = 0; nt < VT / 8; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = w * 16 + g + 8 * h, col = nt * 8 + 2 * tq;
      const float2 uf = bf16x2_bits_to_float2(kEarlyU ? *reinterpret_cast<const uint32_t*>(&u[nt][h])
                                                      : *reinterpret_cast<const uint32_t*>(Us + u_off(row, col)));
      *reinterpret_cast<uint32_t*>(Vp + row * (VT + 8) + col) =
          pack_bf16(uf.x - ws[0][nt][2 * h], uf.y - ws[0][nt][2 * h + 1]);
    }
}

template <int KS, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[KS][NT][4]) {
#pragma unroll
  for (int p = 0; p < KS; ++p)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[p][nt][e] = 0.f;
}

// The pieces of the two products that read V' (after it is complete):
//   o (= Qg S for rows 16 w) += Aqk V' (Aqk lower triangular: k-steps 0..w), rows < valid stored
//   at out + row * out_ld;
//   S = Diag(exp(G_C)) S + Kd^T V' (this warp's 32 rows of S), and Sb refreshed from the new S (the
//   caller makes sure every warp has read the old Sb).
// This thread's rows of exp(G_C): [mt][h] for S rows 32 w + 16 mt + g + 8 h.
__device__ __forceinline__ void load_decays(float (&gd)[2][2], const float* gc, int w, int lane) {
  const int g = lane >> 2;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    gd[mt][0] = gc[w * 32 + mt * 16 + g];
    gd[mt][1] = gc[w * 32 + mt * 16 + g + 8];
  }
}
template <int VT>
__device__ __forceinline__ void decay_state(float (&s)[2][VT / 8][4], const float (&gd)[2][2]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < VT / 8; ++nt) {
      s[mt][nt][0] *= gd[mt][0]; s[mt][nt][1] *= gd[mt][0];
      s[mt][nt][2] *= gd[mt][1]; s[mt][nt][3] *= gd[mt][1];
    }
  }
}
// With KS = 2 the odd k-steps of Kd^T V' go to a second accumulator set t (with few V columns a
// warp holds too few independent accumulators to hide the mma latency), added to S at the end.
template <int VT, int KS>
using UpdatePartial = float[KS == 2 ? 2 : 1][VT / 8][4];
// Kd^T V' at k-step ks for the V' fragment pair np (bb), both 16-row halves of the warp's S rows.
template <int VT, int KS>
__device__ __forceinline__ void update_mma(float (&s)[2][VT / 8][4], UpdatePartial<VT, KS>& t,
                                           const uint32_t (&ak)[2][4], const uint32_t* bb, int ks, int np) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    if (KS == 2 && (ks & 1)) {  // resolved at compile time (unrolled)
      mma_bf16(t[KS == 2 ? mt : 0][2 * np], ak[mt], bb);
      mma_bf16(t[KS == 2 ? mt : 0][2 * np + 1], ak[mt], bb + 2);
    } else {
      mma_bf16(s[mt][2 * np], ak[mt], bb);
      mma_bf16(s[mt][2 * np + 1], ak[mt], bb + 2);
    }
  }
}
template <int VT, int KS>
__device__ __forceinline__ void add_update_partial(float (&s)[2][VT / 8][4], const UpdatePartial<VT, KS>& t) {
  if (KS == 2) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < VT / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] += t[KS == 2 ? mt : 0][nt][e];
  }
}
template <int VT, int KS>
__device__ __forceinline__ void store_output_rows(float (&o)[KS][VT / 8][4], bf16* out, size_t out_ld, int valid,
                                                  int w, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  fold_partial_sums(o);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = w * 16 + g + 8 * h;
    if (row < valid) {
      bf16* op = out + size_t(row) * out_ld;
#pragma unroll
      for (int nt = 0; nt < VT / 8; ++nt)
        *reinterpret_cast<uint32_t*>(op + nt * 8 + 2 * tq) = pack_bf16(o[0][nt][2 * h], o[0][nt][2 * h + 1]);
    }
  }
}

// Both products k-step by k-step (the state pass): each V' fragment is loaded once for both, and
// their mma chains interleave. One after the other, the output's load -> mma latencies sat on the
// state's path to the next chunk (H200 A/B, 2026-11-30, 615ddfc: 2.5% faster on the rows V tile 16
// serves, 3.8% on V tile 32's, 0.3-0.7% on V tile 64's).
// Every accumulator sees the same products in the same order as in the split form below.
template <int VT, int KS>
__device__ __forceinline__ void output_and_update(float (&o)[KS][VT / 8][4], float (&s)[2][VT / 8][4], bf16* Sb,
                                                  const bf16* Vp, const bf16* As, const bf16* Kd,
                                                  const float (&gd)[2][2], bf16* out, size_t out_ld, int valid, int w,
                                                  int lane) {
  constexpr int NP = VT / 16, LDU = VT + 8;
  decay_state<VT>(s, gd);
  UpdatePartial<VT, KS> t;
  zero_acc(t);
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks) {
    // Aqk's blocks above the diagonal (ks > w) are never written: their fragment is loaded anyway
    // and replaced by zeros, so every warp runs the same straight-line code. A branch on the
    // warp-uniform ks <= w made each guarded ldmatrix / mma a predicated one behind a WARPSYNC;
    // warp 3 does every k-step either way, and the others wait for it at the next barrier.
    const bool out_step = ks <= w;
    uint32_t ak[2][4], aa[4];
    load_a_t(ak[0], Kd, kLdB, w * 32, ks * 16, lane);
    load_a_t(ak[1], Kd, kLdB, w * 32 + 16, ks * 16, lane);
    load_a(aa, As, kLdX, w * 16, ks * 16, lane);
#pragma unroll
    for (int e = 0; e < 4; ++e) aa[e] = out_step ? aa[e] : 0u;
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      uint32_t bb[4];
      load_b_kn(bb, Vp, LDU, ks * 16, np * 16, lane);
      update_mma<VT, KS>(s, t, ak, bb, ks, np);
      mma_bf16(o[ks % KS][2 * np], aa, bb);
      mma_bf16(o[ks % KS][2 * np + 1], aa, bb + 2);
    }
  }
  add_update_partial<VT, KS>(s, t);
  write_state_bf16<VT>(Sb, s, w, lane);
  store_output_rows<VT, KS>(o, out, out_ld, valid, w, lane);
}

// The split form (the prep kernel's one-chunk path, whose code stays as it was measured): the
// output first, then the state update.
template <int VT, int KS>
__device__ __forceinline__ void finish_output(float (&o)[KS][VT / 8][4], const bf16* As, const bf16* Vp, bf16* out,
                                              size_t out_ld, int valid, int w, int lane) {
  constexpr int NP = VT / 16, LDU = VT + 8;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    if (ks > w) break;  // warp-uniform; unrolled so that p stays a constant (register arrays)
    const int p = ks % KS;
    uint32_t aa[4];
    load_a(aa, As, kLdX, w * 16, ks * 16, lane);
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      uint32_t bb[4];
      load_b_kn(bb, Vp, LDU, ks * 16, np * 16, lane);
      mma_bf16(o[p][2 * np], aa, bb);
      mma_bf16(o[p][2 * np + 1], aa, bb + 2);
    }
  }
  store_output_rows<VT, KS>(o, out, out_ld, valid, w, lane);
}
template <int VT, int KS>
__device__ __forceinline__ void update_state(float (&s)[2][VT / 8][4], bf16* Sb, const bf16* Vp, const bf16* Kd,
                                             const float (&gd)[2][2], int w, int lane) {
  constexpr int NP = VT / 16, LDU = VT + 8;
  decay_state<VT>(s, gd);
  UpdatePartial<VT, KS> t;
  zero_acc(t);
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks) {
    uint32_t ak[2][4];
    load_a_t(ak[0], Kd, kLdB, w * 32, ks * 16, lane);
    load_a_t(ak[1], Kd, kLdB, w * 32 + 16, ks * 16, lane);
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      uint32_t bb[4];
      load_b_kn(bb, Vp, LDU, ks * 16, np * 16, lane);
      update_mma<VT, KS>(s, t, ak, bb, ks, np);
    }
  }
  add_update_partial<VT, KS>(s, t);
  write_state_bf16<VT>(Sb, s, w, lane);
}

// One chunk for a VT-column tile, by one group of 4 warps: V' = U - W S, O = Qg S + Aqk V' (rows
// < valid stored at out + row * out_ld), S = Diag(exp(G_C)) S + Kd^T V', and Sb refreshed from
// the new S. On entry Sb holds bf16(S); Us is the tile's U blocks (u_off layout, tile-local
// columns). One __syncthreads inside (V' complete): every thread of the CTA calls it. kSplit: the
// output and the update one after the other instead of interleaved (see output_and_update).
template <int VT, int KS = default_ks<VT>(), bool kSplit = false>
__device__ __forceinline__ void state_chunk_step(float (&s)[2][VT / 8][4], bf16* Sb, bf16* Vp, const bf16* Ws,
                                                 const bf16* Qg, const bf16* Kd, const bf16* As, const bf16* Us,
                                                 const float* gc, bf16* out, size_t out_ld, int valid, int w,
                                                 int lane) {
  static_assert(KS == 1 || KS == 2, "one or two accumulator sets");
  constexpr int NT = VT / 8, NP = VT / 16, LDU = VT + 8;
  // V' = U - W S and O = Qg S: rows 16 w of the chunk, one pass over Sb for both.
  uint32_t u[NT][2];
  if (early_u<VT, kSplit>()) load_u_pairs<VT>(u, Us, w, lane);
  float gd[2][2];  // exp(G_C) of this thread's S rows
  if (early_decay<VT, kSplit>()) load_decays(gd, gc, w, lane);
  float a1[KS][NT][4], a2[KS][NT][4];
  zero_acc(a1);
  zero_acc(a2);
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    const int p = ks % KS;
    uint32_t aw[4], aq[4];
    load_a(aw, Ws, kLdB, w * 16, ks * 16, lane);
    load_a(aq, Qg, kLdB, w * 16, ks * 16, lane);
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      uint32_t bb[4];
      load_b_kn(bb, Sb, LDU, ks * 16, np * 16, lane);
      mma_bf16(a1[p][2 * np], aw, bb);
      mma_bf16(a1[p][2 * np + 1], aw, bb + 2);
      mma_bf16(a2[p][2 * np], aq, bb);
      mma_bf16(a2[p][2 * np + 1], aq, bb + 2);
    }
  }
  fold_partial_sums(a1);
  store_vprime<VT, KS, early_u<VT, kSplit>()>(Vp, u, Us, a1, w, lane);
  __syncthreads();  // V' complete
  // Every warp read Sb before the V' barrier above, so the update may overwrite it.
  if constexpr (kSplit) {
    finish_output<VT, KS>(a2, As, Vp, out, out_ld, valid, w, lane);
    load_decays(gd, gc, w, lane);
    update_state<VT, KS>(s, Sb, Vp, Kd, gd, w, lane);
  } else {
    if (!early_decay<VT, kSplit>()) load_decays(gd, gc, w, lane);
    output_and_update<VT, KS>(a2, s, Sb, Vp, As, Kd, gd, out, out_ld, valid, w, lane);
  }
}

// ---------------------------------------------------------------------------------------------
using fkda::bulk_g2s;
using fkda::mbar_expect_tx;
using fkda::mbar_init;
using fkda::mbar_init_fence;
using fkda::mbar_wait;

// Chunk data for one CTA (V tile block vt: its G tiles): [W | Qg | Kd | A | gC] and the tiles' U
// blocks, both contiguous in the workspace. tma: thread 0 issues two bulk copies on the stage's
// mbarrier; else every thread issues 16 B cp.async (one commit group per chunk).
template <int VT, int NS>
__device__ __forceinline__ void issue_chunk(uint8_t* st, const uint8_t* ws, int vt, int tid, bool tma,
                                            uint64_t* bar) {
  using SM = StateSmem<VT, NS>;
  constexpr int kThreads = 128 * kGroups;
  const uint8_t* usrc = ws + kWsU + size_t(vt) * SM::kUBytes;
  if (tma) {
    if (tid == 0) {
      mbar_expect_tx(bar, SM::kSide + SM::kUBytes);
      bulk_g2s(st, ws, SM::kSide, bar);
      bulk_g2s(st + SM::kU, usrc, SM::kUBytes, bar);
    }
  } else {
    for (int e = tid; e < SM::kSide / 16; e += kThreads) cp_async16(st + e * 16, ws + size_t(e) * 16);
    for (int e = tid; e < SM::kUBytes / 16; e += kThreads) cp_async16(st + SM::kU + e * 16, usrc + size_t(e) * 16);
  }
}

// ---- piece split (kPieces > 1) -----------------------------------------------------------------
// A piece that starts at chunk cb > 0 runs from a zero state a few chunks earlier. Dropping the true
// state S there changes the state at cb by P S, P the product of the per-token transitions
// (I - beta k k^T) Diag(alpha_t) in between (K side; keys l2-normalised, beta in (0, 1)), whose
// operator norm is at most prod_t max_d alpha_t[d] = 2^(sum of the chunks' bounds, kWsBound). So the
// warm-up is the shortest run of chunks cb-1, cb-2, ... whose bounds sum to <= -24 (the dropped term
// is below 2^-24 |S|), or reaches chunk 0, where the piece starts from the true initial state and is
// exact: the same operations in the same order as kPieces = 1. Every warp walks (no barrier): a lane
// sums 4 chunks' bounds, a warp scan orders the 128 partial sums, and the first crossing ends it.
constexpr float kPieceLog2Eps = -24.f;
__device__ __forceinline__ int64_t piece_start(const StateArgs& a, int64_t base, int hv, int64_t cb, int lane) {
  float carry = 0.f;  // sum of the chunks already walked
  for (int64_t top = cb; top > 0; top -= 128) {
    float b[4], part = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c = top - 1 - 4 * lane - i;
      b[i] = c >= 0 ? *reinterpret_cast<const float*>(a.ws + (size_t(base + c) * a.HV + hv) * kSlotBytes + kWsBound)
                    : 0.f;
      part += b[i];
    }
    float incl = part;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    float run = carry + incl - part;  // the chunks before this lane's four
    int hit = 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      run += b[i];
      // Only a real chunk may end the walk: this lane's start (carry + incl - part) is rounded apart
      // from the previous lane's end, so past chunk 0 (b = 0) it could cross -24 where the walk did not
      // and return a negative chunk. NaN compares false: walk on (to chunk 0, exact).
      if (hit == 4 && top - 1 - 4 * lane - i >= 0 && run <= kPieceLog2Eps) hit = i;
    }
    const unsigned m = __ballot_sync(0xffffffffu, hit < 4);
    if (m) {
      const int l = __ffs(m) - 1;
      return top - 1 - 4 * l - __shfl_sync(0xffffffffu, hit, l);
    }
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  return 0;
}

template <int VT, int RING, typename ST>
__global__ void __launch_bounds__(FKDA_THREADS, FKDA_MIN_BLOCKS) kda_state_kernel(const StateArgs a) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh (the pieces' bounds are the prep's)
#if FKDA_PARAM_GUARD == 1
  if (guard_skips(a)) return;     // (guarded modules) the fused kernel before served the call
#endif
#if FKDA_PARAM_CHAIN_GUARD == 1   // (two-stage modules) kda_chain_decide_kernel before picked the piece pass or the chain
  if ((*reinterpret_cast<const volatile int*>(a.chain) != 0) != (a.stage == 1)) return;
#endif
  using SM = StateSmem<VT, RING>;
  constexpr int NT = VT / 8;
  extern __shared__ __align__(128) uint8_t smem[];
  // w: the warp within its group; group j takes V tile kGroups x blockIdx.x + j
  const int tid = threadIdx.x, lane = tid & 31, w = kGroups == 1 ? tid >> 5 : (tid >> 5) & 3;
  const int group = kGroups == 1 ? 0 : tid >> 7;
  bf16* Sb = reinterpret_cast<bf16*>(smem + SM::kSb + group * SM::kSbGroup);
  bf16* Vp = reinterpret_cast<bf16*>(smem + SM::kVp + group * SM::kVpGroup);
  const int vt = blockIdx.x, hv = blockIdx.y, HV = a.HV;
#if FKDA_PARAM_PIECES > 1
  const int P = a.pieces;  // this call's pieces a sequence (<= kPieces)
#else
  constexpr int P = 1;
#endif
  const int n = kPieces == 1 ? int(blockIdx.z) : int(blockIdx.z / unsigned(P));
  const int v0 = (vt * kGroups + group) * VT;
  const int u_group = group * SM::kGroupUBytes;  // the group's U blocks within the stage's

  const int64_t bos = load_cu(a.cu, a.cu64, n);
  const int64_t len = load_cu(a.cu, a.cu64, n + 1) - bos;
  const int64_t base = bos / kC + n;
  const int64_t nch = (len + kC - 1) / kC;
  if (a.single && nch == 1) return;  // the prep kernel did this sequence (CTA-uniform)
  int64_t slot;
  const bool pad = state_slot(a, n, slot);

  // Chunks [c0, c1) write output; [cs, c0) are the warm-up. One piece, the last non-empty one (piece
  // 0 for an empty sequence), writes the final state.
  int64_t cs = 0, c0 = 0, c1 = nch;
  bool writer = true;
  const ST* src = a.init && !pad ? static_cast<const ST*>(a.init) + size_t(slot) * size_t(a.slot_stride) + size_t(hv) * kV * kK
                                 : nullptr;
  if constexpr (kPieces > 1) {
    const int piece = int(blockIdx.z - unsigned(n) * unsigned(P));
    const int64_t per = (nch + P - 1) / P;
    c0 = piece * per;
    c1 = c0 + per < nch ? c0 + per : nch;
    if (piece > 0 && c0 >= c1) return;  // an empty piece (CTA-uniform)
    writer = c1 == nch;
    if (piece > 0) cs = piece_start(a, base, hv, c0, lane);
    if (cs > 0) src = nullptr;  // a zero state
    else if (!writer && src)    // the prep's copy (initial_state may be final_state)
      src = init_copy_of<ST>(a, n, hv);
  }

  float s[2][NT][4];
  load_state_tile<VT, ST>(s, src, w, lane, v0);

  constexpr int NS = SM::NS;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + SM::kBar);
  const bool tma = a.tma != 0;
  if (tma) {
    if (tid == 0) {
#pragma unroll
      for (int i = 0; i < NS; ++i) mbar_init(bars + i, 1);
      mbar_init_fence();
    }
    __syncthreads();
  }
  // Chunks cs..cs+NS-2 in flight before the loop (chunk cs alone with a 1-deep ring).
  constexpr int kAhead = NS > 1 ? NS - 1 : 1;
  if (c1 > cs) {
#pragma unroll
    for (int i = 0; i < kAhead; ++i) {
      if (cs + i < c1)
        issue_chunk<VT, NS>(smem + i * SM::kStage, a.ws + (size_t(base + cs + i) * HV + hv) * kSlotBytes, vt,
                            tid, tma, bars + i);
      cp_async_commit();  // one group per chunk, empty past the end, so the wait count is fixed
    }
    write_state_bf16<VT>(Sb, s, w, lane);
  }

  int stage = 0;
  uint32_t parity = 0;  // of the current use of each stage's mbarrier (flips after NS chunks)
  for (int64_t c = cs; c < c1; ++c) {
    uint8_t* st = smem + stage * SM::kStage;
    if (tma) mbar_wait(bars + stage, parity);
    else cp_async_wait<kAhead - 1>();
    __syncthreads();  // chunk c visible; every warp is done with chunk c-1 (its stage is free)
    if (NS > 1) {
      const int ns = stage == 0 ? NS - 1 : stage - 1;  // == (c + NS - 1) % NS, chunk c-1's stage
      if (c + NS - 1 < c1)
        issue_chunk<VT, NS>(smem + ns * SM::kStage,
                            a.ws + (size_t(base + c + NS - 1) * HV + hv) * kSlotBytes, vt, tid, tma,
                            bars + ns);
      cp_async_commit();
    }
    if (stage == NS - 1) parity ^= 1u;
    stage = stage + 1 == NS ? 0 : stage + 1;
    const int64_t left = c < c0 ? 0 : len - c * kC;  // a warm-up chunk stores no output row
    state_chunk_step<VT>(s, Sb, Vp, reinterpret_cast<const bf16*>(st + SM::kW),
                         reinterpret_cast<const bf16*>(st + SM::kQg), reinterpret_cast<const bf16*>(st + SM::kKd),
                         reinterpret_cast<const bf16*>(st + SM::kA), reinterpret_cast<const bf16*>(st + SM::kU + u_group),
                         reinterpret_cast<const float*>(st + SM::kGc),
                         a.out + (size_t(bos + c * kC) * HV + hv) * kV + v0, size_t(HV) * kV,
                         left < kC ? int(left) : kC, w, lane);

    if (NS == 1 && c + 1 < c1) {
      __syncthreads();  // every warp is done with the one stage (and has written its Sb rows)
      issue_chunk<VT, NS>(smem, a.ws + (size_t(base + c + 1) * HV + hv) * kSlotBytes, vt, tid, tma, bars);
      cp_async_commit();
    }
    if constexpr (kPieces == 1) store_checkpoint<VT, ST>(a, s, n, hv, c, len, w, lane, v0);  // (refused with pieces)
  }

  if (writer && a.fin && !pad) {
    ST* dst = static_cast<ST*>(a.fin) + size_t(slot) * size_t(a.slot_stride) + size_t(hv) * kV * kK;
    store_state_tile<VT, ST>(dst, s, w, lane, v0);
  }
}

#if FKDA_PARAM_CHAIN_GUARD == 1
// (two-stage modules, prefill_c16g2_*) Between the prep and the two state passes: one warp a (value head, sequence)
// walks each piece's warm-up as the piece pass would (piece_start) and sets the chain word where one is longer than
// the piece itself, so the piece pass returns at once and the unsplit chain at V tile 16 does the call. Deciding
// before either pass runs keeps the call exact without a grid-wide wait: a piece never starts work the chain redoes,
// and a pool updated in place is read by the chain untouched.
__global__ void kda_chain_decide_kernel(const StateArgs a) {
  fkda::begin_dependent_grid();  // the prep's chunk bounds are complete
  if (guard_skips(a)) return;    // the fused kernel before served the call
  const int hv = blockIdx.x, n = blockIdx.y, lane = threadIdx.x, P = a.pieces;
  const int64_t bos = load_cu(a.cu, a.cu64, n);
  const int64_t len = load_cu(a.cu, a.cu64, n + 1) - bos;
  const int64_t base = bos / kC + n, nch = (len + kC - 1) / kC, per = (nch + P - 1) / P;
  for (int piece = 1; piece < P && piece * per < nch; ++piece) {  // (warp-uniform: piece_start shuffles)
    const int64_t c0 = piece * per;
    if (c0 - piece_start(a, base, hv, c0, lane) > per) {
      if (lane == 0) *reinterpret_cast<volatile int*>(a.chain) = 1;
      return;
    }
  }
}
#endif

}  // namespace fkda_prefill

