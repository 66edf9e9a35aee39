// The chunk preparation of the sm_90a prefill (kda_prefill_layout.cuh for the shared layout):
//
//   kda_prep_lite_kernel  grid (chunk slots x HV), 256 threads, 2 CTAs/SM. Everything independent
//                         across chunks: gate + cumsum, l2norm, L and Aqk, (I+L)^-1, W, U,
//                         Q o exp(G), exp(G_C - G) o K, exp(G_C). Written to a workspace slot.
//                         With StateArgs::single, a sequence of one chunk is finished here too
//                         (prep_single_chunk_state, on kda_prefill_state.cuh's chunk step): no
//                         state pass, no wait on the whole grid.
//
// Numerics: G is kept in log2 units, relative to the chunk start, so every exponent taken is of
// a non-positive number (exp(G_i - G_j), j <= i), whatever the gate: no inf, underflow to 0 only
// where the true value is below fp32 range. The tensor-core form of the strictly-lower blocks of
// L and Aqk uses, for row block I, the anchor a = 16 I - 1 (last row before the block):
// exp(G_i - G_j) = exp(G_i - G_a) * exp(G_a - G_j) with both factors <= 1 (i > a >= j).
// The 16x16 diagonal blocks go on tensor cores with a mid-block anchor when the block's gate range
// keeps every factor below 2^100, each operand split into bf16 hi + lo and three products (hi hi +
// hi lo + lo hi: ~16 bits per operand, the accuracy of the fp32 elementwise form at a third of its
// instructions); a block outside that range takes the elementwise form in fp32.
// The decay factors of q and k are taken once per element (prep step 4): F_i = exp(G_i - G_s) and
// R_i = exp(G_e - G_i), s = 16 I - 1 and e = 16 I + 15 around row i's block I; every operand that
// carries a decay is F_i or R_i times a per-key factor exp(G_x - G_y) with x >= y (so <= 1): a
// product underflows only where the true value is below both.
#pragma once

#include "kda_prefill_layout.cuh"
#include "kda_prefill_state.cuh"

namespace fkda_prefill {

constexpr float kLog2e = 1.4426950408889634f;
// The per-step log decay of one key in log2 units (G is kept in log2 units) is mult * value(raw)
// for the raw gate input; the caller folds mult (and the mask of rows past the chunk's end) into
// its running sum's fma. ftz approximations: the input is bf16, and the plain __expf/__logf spent
// extra instructions per call on denormal ranges that cannot matter here. No branches: a branch
// per row (range cases of softplus, rows past the end) serialised a key's rows into a chain of
// MUFU latencies (ncu, 2026-11-29, dcd53fb); straight-line code lets them overlap.
template <int GATE>
struct Log2Gate;
template <>
struct Log2Gate<0> {  // -ea * softplus(raw + dtb), in log2 units (log2_softplus)
  float c, mult;
  __device__ Log2Gate(float dtb, float ea, float) : c(dtb * kLog2e), mult(-ea) {}
  __device__ float value(float raw) const { return log2_softplus(fmaf(raw, kLog2e, c)); }
};
template <>
struct Log2Gate<1> {  // lower_bound * sigmoid(ea (raw + dtb)); mult = lower_bound * log2(e)
  float s, c, mult;
  __device__ Log2Gate(float dtb, float ea, float lb2) : s(-ea * kLog2e), c(-ea * dtb * kLog2e), mult(lb2) {}
  __device__ float value(float raw) const { return sigmoid_of_ex2(fmaf(raw, s, c)); }
};
template <>
struct Log2Gate<2> {  // the log decay itself
  float mult;
  __device__ Log2Gate(float, float, float) : mult(kLog2e) {}
  __device__ float value(float raw) const { return raw; }
};
// Running sums of two adjacent keys' log decays over 16 rows (rows >= nt add 0: their raw input
// is the zero fill, so the value is finite and its multiplier is 0). The pair comes in one 4-byte
// shared load per row. kBound (the piece-split modules): mx[i] = the larger of the pair's log2 decays
// at row i (0 past the chunk's end), for the chunk's attenuation bound (bound_row_max).
template <int GATE, bool kBound>
__device__ __forceinline__ float2 gate_cumsum(float2 (&gl)[16], float (&mx)[16], const bf16* graw, int r0, int nt,
                                             float2 dtb, float ea, float lb2) {
  const Log2Gate<GATE> g0(dtb.x, ea, lb2), g1(dtb.y, ea, lb2);
  float2 run = make_float2(0.f, 0.f);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float2 raw = ld_bf16x2(graw + i * kLdB);
    const bool in = r0 + i < nt;
    if constexpr (kBound) {  // each value once: it feeds both the running sum and the row maximum
      const float v0 = g0.value(raw.x), v1 = g1.value(raw.y);
      run.x = fmaf(in ? g0.mult : 0.f, v0, run.x);
      run.y = fmaf(in ? g1.mult : 0.f, v1, run.y);
      mx[i] = in ? fmaxf(g0.mult * v0, g1.mult * v1) : 0.f;
    } else {
      run.x = fmaf(in ? g0.mult : 0.f, g0.value(raw.x), run.x);
      run.y = fmaf(in ? g1.mult : 0.f, g1.value(raw.y), run.y);
    }
    gl[i] = run;
  }
  return run;
}
// Piece-split modules: the chunk's log2 attenuation bound, sum over rows of the largest log2 decay over
// the 128 keys (kda_prefill_layout.cuh, kWsBound). Each gate warp (64 keys over the 16 rows of quarter
// q) reduces its lanes' row maxima to one row a lane pair in 16 shuffles (each step halves the rows a
// lane holds) and leaves them in rowmax[warp & 1][16 q + row]; bound_store sums them after a barrier.
__device__ __forceinline__ void bound_row_max(const float (&m)[16], float* rowmax, int q, int warp, int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4, b1 = lane & 2;
  float a8[8], a4[4], a2[2];
#pragma unroll
  for (int i = 0; i < 8; ++i)  // rows 8 b4 + i
    a8[i] = fmaxf(b4 ? m[i + 8] : m[i], __shfl_xor_sync(0xffffffffu, b4 ? m[i] : m[i + 8], 16));
#pragma unroll
  for (int i = 0; i < 4; ++i)  // rows 8 b4 + 4 b3 + i
    a4[i] = fmaxf(b3 ? a8[i + 4] : a8[i], __shfl_xor_sync(0xffffffffu, b3 ? a8[i] : a8[i + 4], 8));
#pragma unroll
  for (int i = 0; i < 2; ++i)  // rows 8 b4 + 4 b3 + 2 b2 + i
    a2[i] = fmaxf(b2 ? a4[i + 2] : a4[i], __shfl_xor_sync(0xffffffffu, b2 ? a4[i] : a4[i + 2], 4));
  float a1 = fmaxf(b1 ? a2[1] : a2[0], __shfl_xor_sync(0xffffffffu, b1 ? a2[0] : a2[1], 2));
  a1 = fmaxf(a1, __shfl_xor_sync(0xffffffffu, a1, 1));  // row (lane >> 1) & 15, over the warp's 64 keys
  if (!(lane & 1)) rowmax[(warp & 1) * kC + 16 * q + ((lane >> 1) & 15)] = a1;
}
// One warp: the larger of the two warps' maxima a row, summed over the 64 rows, to the slot.
__device__ __forceinline__ void bound_store(const float* rowmax, uint8_t* ws, int lane) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 2; ++i) s += fmaxf(rowmax[2 * lane + i], rowmax[kC + 2 * lane + i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) *reinterpret_cast<float*>(ws + kWsBound) = s;
}
// The same as one word per value, hi in the low half, lo in the high half: what step 6 reads of L
// and X (a pair of words gives the hi and lo pairs of its fragments with two byte permutes).
__device__ __forceinline__ uint2 split_words(float x0, float x1) {
  uint32_t hi, lo;
  split2(x0, x1, hi, lo);
  return make_uint2(__byte_perm(hi, lo, 0x5410), __byte_perm(hi, lo, 0x7632));
}
// X(row, col) = x0 and X(row + 1, col) = x1 (a column pair), or X(row, col) = x0 and X(row, col + 1)
// = x1 (a row pair, col even): as split words (Xw) and in bf16 (Xb, the words' hi halves).
__device__ __forceinline__ void store_x_column_pair(uint32_t* Xw, bf16* Xb, int row, int col, float x0, float x1) {
  const uint2 w = split_words(x0, x1);
  Xw[row * kLdM + col] = w.x;
  Xw[(row + 1) * kLdM + col] = w.y;
  Xb[row * kLdX + col] = __ushort_as_bfloat16(static_cast<unsigned short>(w.x));
  Xb[(row + 1) * kLdX + col] = __ushort_as_bfloat16(static_cast<unsigned short>(w.y));
}
__device__ __forceinline__ void store_x_row_pair(uint32_t* Xw, bf16* Xb, int row, int col, float x0, float x1) {
  const uint2 w = split_words(x0, x1);
  *reinterpret_cast<uint2*>(Xw + row * kLdM + col) = w;
  *reinterpret_cast<uint32_t*>(Xb + row * kLdX + col) = __byte_perm(w.x, w.y, 0x5410);
}

// Elementwise passes over a 64 x 128 tile in 4-column pieces: item e is row e / 32, columns
// col4(e)..+3, where the 16 items of a half-row take the columns 0..63 or 64..127 in order, so 8
// consecutive lanes' 16-byte shared loads of fp32 G cover 128 contiguous bytes (no bank conflicts).
__device__ __forceinline__ int col4(int e) { return ((e >> 4) & 1) * 64 + (e & 15) * 4; }

// The sequence of a chunk slot: n, the largest with floor(cu[n]/64) + n <= slot (that key is
// strictly increasing in n), its first token bos and its length; cu_at(i) reads offset i (global
// memory, or the prep kernel's staged copy).
struct SeqSpan {
  int n;
  int64_t bos, len;
};
template <typename CuAt>
__device__ __forceinline__ SeqSpan find_seq(const CuAt& cu_at, int N, int64_t slot) {
  int lo = 0, hi = N - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (cu_at(mid) / kC + mid <= slot) lo = mid; else hi = mid - 1;
  }
  const int64_t bos = cu_at(lo);
  return {lo, bos, cu_at(lo + 1) - bos};
}

struct PrepArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const bf16* g;
  const bf16* beta;
  const float* A_log;    // may be null
  const float* dt_bias;  // may be null
  const void* cu;
  int cu64;
  int N, H, HV;
  int group;  // HV / H: value heads per q/k head
  int gate_mode;  // 0 softplus, 1 bounded, 2 log (named as in DecodeParams: common/param_fill.h fills both)
  float lower_bound;
  float scale;
  int beta_logit;
  uint8_t* ws;
  StateArgs st;  // the state pass's arguments: st.single = 1 finishes one-chunk sequences here
};

// Two adjacent entries (row, col) and (row, col + 1), col even, of L (strictly lower, times
// beta_row) and of Aqk (lower, diagonal kept); zeros above. Select, never multiply: above the
// diagonal the sums may be inf / NaN (factors that overflow there), and they must not leak.
__device__ __forceinline__ void store_l_pair(float* Lm, int row, int col, float x0, float x1, float beta) {
  *reinterpret_cast<float2*>(Lm + row * kLdM + col) =
      make_float2(col < row ? beta * x0 : 0.f, col + 1 < row ? beta * x1 : 0.f);
}
// A pair of L below the diagonal blocks (col < row), as split words: step 6 is its only reader.
__device__ __forceinline__ void store_l_split_pair(float* Lm, int row, int col, float x0, float x1, float beta) {
  *reinterpret_cast<uint2*>(Lm + row * kLdM + col) = split_words(beta * x0, beta * x1);
}
__device__ __forceinline__ void store_a_pair(bf16* Aw, int row, int col, float x0, float x1) {
  *reinterpret_cast<uint32_t*>(Aw + row * kLdX + col) = pack_bf16(col <= row ? x0 : 0.f, col + 1 <= row ? x1 : 0.f);
}

// One row i of a diagonal 16x16 block (columns j = j0 + t): this lane's part (keys d = 32 c + 4 dq
// + e) of sum_d k_i k_j exp2(G_i - G_j) and of sum_d q_i k_j exp2(G_i - G_j) for t < NT and t <= last
// (warp-uniform), then summed over the 8 lanes of the group (every lane ends with the full sums).
// The column j is the loop counter, the same in the whole warp, so its k_j and G_j reads are
// shared-memory broadcasts. Sums with j > i are formed (exp2 of a positive number, maybe inf) but
// never kept: diag_row_store selects them away.
template <int NT>
__device__ __forceinline__ void diag_row_sums(const bf16* Qs, const bf16* Ks, const float* Gs, int i, int j0,
                                              int dq, int last, float (&sL)[NT], float (&sA)[NT]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) { sL[t] = 0.f; sA[t] = 0.f; }
#pragma unroll 1
  for (int c = 0; c < 4; ++c) {
    const int d0 = c * 32 + dq * 4;  // the 8 lanes of a group read 32 contiguous keys
    float qi[4], ki[4], gi[4];
    unpack4(*reinterpret_cast<const uint2*>(Qs + i * kLdB + d0), qi);
    unpack4(*reinterpret_cast<const uint2*>(Ks + i * kLdB + d0), ki);
    load4(Gs + i * kLdG + d0, gi);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t <= last) {  // warp-uniform
        float kj[4], gj[4];
        unpack4(*reinterpret_cast<const uint2*>(Ks + (j0 + t) * kLdB + d0), kj);
        load4(Gs + (j0 + t) * kLdG + d0, gj);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float kx = kj[e] * ex2(gi[e] - gj[e]);
          sL[t] = fmaf(ki[e], kx, sL[t]);
          sA[t] = fmaf(qi[e], kx, sA[t]);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t <= last) {
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) {
        sL[t] += __shfl_xor_sync(0xffffffffu, sL[t], o);
        sA[t] += __shfl_xor_sync(0xffffffffu, sA[t], o);
      }
    }
  }
}
// Lane dq of the group writes the columns 2 dq, 2 dq + 1 of row i of the block (sums with t >= NT
// are zeros).
template <int NT>
__device__ __forceinline__ void diag_row_store(float* Lm, bf16* Aw, int i, int blk, int dq, float beta,
                                               const float (&sL)[NT], const float (&sA)[NT]) {
  float l[2] = {0.f, 0.f}, q[2] = {0.f, 0.f};
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if ((t >> 1) == dq) { l[t & 1] = sL[t]; q[t & 1] = sA[t]; }
  }
  store_l_pair(Lm, i, blk * 16 + 2 * dq, l[0], l[1], beta);
  store_a_pair(Aw, i, blk * 16 + 2 * dq, q[0], q[1]);
}

// The diagonal block I of L and Aqk on tensor cores, by its two warps, with no
// staging: each thread builds its mma fragments in registers from shared memory (rows 16 I + g
// and + 8, keys 16 ks + 2 tq, + 1, + 8, + 9): left k_i (q_i) exp2(G_i - G_m), right k_j exp2(G_m -
// G_j), m = 16 I + 7 (the caller checked every factor stays below 2^100), each operand split into
// bf16 hi + lo, products hi hi + (hi lo + lo hi).
// Warp `half` takes the k-steps 4 half .. 4 half + 3 of both matrices and returns its partial sums
// of the matrix it finishes (half 0: L, half 1: Aqk) in `mine`; the other matrix's partial goes to
// `xch` for the other warp (diag_block_finish, after a CTA barrier: one barrier for every block,
// and no named barriers).
struct DiagPartial {
  float v[2][4];  // [n-tile][mma accumulator element]
};
// The operands of row i's keys d, d + 1 in a diagonal block anchored at row m (gm = G[m, d..d+1]):
// k and q scaled by exp2(G_i - G_m), k by exp2(G_m - G_i).
struct DiagOperands {
  float k0, k1, q0, q1, r0, r1;
};
__device__ __forceinline__ DiagOperands diag_operands(const bf16* Qs, const bf16* Ks, const float* Gs, float2 gm,
                                                      int i, int d) {
  const float2 gi = *reinterpret_cast<const float2*>(Gs + i * kLdG + d);
  const float2 kv = ld_bf16x2(Ks + i * kLdB + d);
  const float2 qv = ld_bf16x2(Qs + i * kLdB + d);
  const float f0 = ex2(gi.x - gm.x), f1 = ex2(gi.y - gm.y);
  const float b0 = ex2(gm.x - gi.x), b1 = ex2(gm.y - gi.y);
  return {kv.x * f0, kv.y * f1, qv.x * f0, qv.y * f1, kv.x * b0, kv.y * b1};
}
// A block product's partial sums of L and Aqk: the half this warp finishes stays in registers, the
// other goes to the exchange for the partner warp (diag_block_finish adds them after the barrier).
__device__ __forceinline__ DiagPartial diag_share(float* xch, const float (&L)[2][4], const float (&A)[2][4], int I,
                                                  int half, int lane) {
  DiagPartial mine;
  float* out = xch + ((I * 2 + half) * 32 + lane) * 8;
#pragma unroll
  for (int nn = 0; nn < 2; ++nn)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      out[nn * 4 + e] = half ? L[nn][e] : A[nn][e];
      mine.v[nn][e] = half ? A[nn][e] : L[nn][e];
    }
  return mine;
}
__device__ __forceinline__ DiagPartial diag_block_mma(const bf16* Qs, const bf16* Ks, const float* Gs, float* xch,
                                                      int I, int half, int lane) {
  const int g = lane >> 2, tq = lane & 3, m = 16 * I + 7;
  float hL[2][4], cL[2][4], hA[2][4], cA[2][4];
#pragma unroll
  for (int nn = 0; nn < 2; ++nn)
#pragma unroll
    for (int e = 0; e < 4; ++e) hL[nn][e] = cL[nn][e] = hA[nn][e] = cA[nn][e] = 0.f;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int ks = half * 4 + s;
    // [rr][ch]: row 16 I + g + 8 rr, keys 16 ks + 2 tq + 8 ch (+1)
    uint32_t kh[2][2], kl[2][2], qh[2][2], ql[2][2], rh[2][2], rl[2][2];
#pragma unroll
    for (int ch = 0; ch < 2; ++ch) {
      const int d = ks * 16 + 2 * tq + 8 * ch;
      const float2 gm = *reinterpret_cast<const float2*>(Gs + m * kLdG + d);
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int i = 16 * I + g + 8 * rr;
        const DiagOperands o = diag_operands(Qs, Ks, Gs, gm, i, d);
        split2(o.k0, o.k1, kh[rr][ch], kl[rr][ch]);
        split2(o.q0, o.q1, qh[rr][ch], ql[rr][ch]);
        split2(o.r0, o.r1, rh[rr][ch], rl[rr][ch]);
      }
    }
    // A fragment: (row g, keys 2tq), (row g+8, 2tq), (row g, 2tq+8), (row g+8, 2tq+8);
    // B fragment of n-tile nn (column j = g + 8 nn): (j, keys 2tq), (j, 2tq+8)
    const uint32_t akh[4] = {kh[0][0], kh[1][0], kh[0][1], kh[1][1]};
    const uint32_t aqh[4] = {qh[0][0], qh[1][0], qh[0][1], qh[1][1]};
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) {
      const uint32_t bh[2] = {rh[nn][0], rh[nn][1]};
      mma_bf16(hL[nn], akh, bh);
      mma_bf16(hA[nn], aqh, bh);
      const uint32_t akl[4] = {kl[0][0], kl[1][0], kl[0][1], kl[1][1]};
      const uint32_t aql[4] = {ql[0][0], ql[1][0], ql[0][1], ql[1][1]};
      const uint32_t bl[2] = {rl[nn][0], rl[nn][1]};
      mma_bf16(cL[nn], akh, bl);
      mma_bf16(cL[nn], akl, bh);
      mma_bf16(cA[nn], aqh, bl);
      mma_bf16(cA[nn], aql, bh);
    }
  }
#pragma unroll
  for (int nn = 0; nn < 2; ++nn)
#pragma unroll
    for (int e = 0; e < 4; ++e) hL[nn][e] += cL[nn][e], hA[nn][e] += cA[nn][e];
  return diag_share(xch, hL, hA, I, half, lane);
}
// After the barrier: add the other warp's partial (k-steps 0..3 first in both warps) and write
// the block: L from half 0, Aqk from half 1.
__device__ __forceinline__ void diag_block_finish(const DiagPartial& mine, const float* xch, float* Lm, bf16* Aw,
                                                  const float* betas, int I, int half, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  const float* in = xch + ((I * 2 + (half ^ 1)) * 32 + lane) * 8;
#pragma unroll
  for (int nn = 0; nn < 2; ++nn)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = 16 * I + g + 8 * hh, col = 16 * I + nn * 8 + 2 * tq;
      float x[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float my = mine.v[nn][2 * hh + e], other = in[nn * 4 + 2 * hh + e];
        x[e] = half ? other + my : my + other;
      }
      if (half == 0) store_l_pair(Lm, row, col, x[0], x[1], betas[row]);
      else store_a_pair(Aw, row, col, x[0], x[1]);
    }
}

// Column cc of the inverse of the unit lower-triangular 16x16 diagonal block blk of (I + L), by
// forward substitution into X (split words for step 6, and bf16), on 2 partial sums (a single fma
// chain left the warp waiting on fma latency). Above the diagonal it gives exact zeros. Two blocks
// a warp (16 lanes each): their reads of L are 16 banks apart.
__device__ __forceinline__ void diag_block_inverse_column(const float* Lm, uint32_t* Xw, bf16* Xb, int blk, int cc) {
  const float* Lb = Lm + blk * 16 * kLdM + blk * 16;
  float x[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float s0 = (i == cc) ? 1.f : 0.f, s1 = 0.f;
#pragma unroll
    for (int j = 0; j < i; ++j) {
      if (j & 1) s1 = fmaf(-Lb[i * kLdM + j], x[j], s1);
      else s0 = fmaf(-Lb[i * kLdM + j], x[j], s0);
    }
    x[i] = s0 + s1;
  }
#pragma unroll
  for (int i = 0; i < 16; i += 2) store_x_column_pair(Xw, Xb, blk * 16 + i, blk * 16 + cc, x[i], x[i + 1]);
}

// ---- X = (I + L)^-1 below its diagonal blocks, on tensor cores (step 6) ------------------------
// Every operand is split into bf16 hi + lo (split2) and a 16 x 16 x 16 product is hi lo + lo hi +
// hi hi in fp32: ~16 bits an operand. L below the diagonal blocks and X's diagonal blocks are read
// as split words (split_words, written by their producers); results are split in registers.
// m16n8k16 fragments: A pair r is (row g + 8 (r & 1), columns 2 tq + 8 (r >> 1) + {0, 1}); B pair r
// is (k 2 tq + 8 r + {0, 1}, n g); C c[nn][2 h + e] is (row g + 8 h, column 8 nn + 2 tq + e), which
// read in order is the A fragment of the same 16 x 16 matrix.
struct SplitA {
  uint32_t h[4], l[4];
};
struct SplitB {
  uint32_t h[2], l[2];
};
__device__ __forceinline__ void unword(uint32_t w0, uint32_t w1, uint32_t& h, uint32_t& l) {
  h = __byte_perm(w0, w1, 0x5410);
  l = __byte_perm(w0, w1, 0x7632);
}
// A[m][k] = S[m][k] (TR false, pairs along a row) or S[k][m] (TR true); S split words, rows of kLdM.
template <bool TR>
__device__ __forceinline__ SplitA load_a_split(const uint32_t* S, int g, int tq) {
  SplitA a;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int m = g + 8 * (r & 1), k = 2 * tq + 8 * (r >> 1);
    const uint2 p = TR ? make_uint2(S[k * kLdM + m], S[(k + 1) * kLdM + m])
                       : *reinterpret_cast<const uint2*>(S + m * kLdM + k);
    unword(p.x, p.y, a.h[r], a.l[r]);
  }
  return a;
}
// An n-tile at S: B[k][n] = S[n][k] (NK true, pairs along a row) or S[k][n] (NK false).
template <bool NK>
__device__ __forceinline__ SplitB load_b_split(const uint32_t* S, int g, int tq) {
  SplitB b;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int k = 2 * tq + 8 * r;
    const uint2 p = NK ? *reinterpret_cast<const uint2*>(S + g * kLdM + k)
                       : make_uint2(S[k * kLdM + g], S[(k + 1) * kLdM + g]);
    unword(p.x, p.y, b.h[r], b.l[r]);
  }
  return b;
}
__device__ __forceinline__ SplitA c_as_a_split(const float (&c)[2][4]) {
  SplitA a;
#pragma unroll
  for (int r = 0; r < 4; ++r) split2(c[r >> 1][2 * (r & 1)], c[r >> 1][2 * (r & 1) + 1], a.h[r], a.l[r]);
  return a;
}
__device__ __forceinline__ void mma_split(float* c, const SplitA& a, const SplitB& b) {
  mma_bf16(c, a.h, b.l);
  mma_bf16(c, a.l, b.h);
  mma_bf16(c, a.h, b.h);
}
// c += A B over one k-step for both n-tiles; B's n-tile nn comes from load_b(nn).
template <typename LoadB>
__device__ __forceinline__ void mma16_split(float (&c)[2][4], const SplitA& a, LoadB load_b) {
#pragma unroll
  for (int nn = 0; nn < 2; ++nn) mma_split(c[nn], a, load_b(nn));
}

// Step 6 in two parts around one CTA barrier. Part 1: warp 4 makes X_10 = -(X_11 L_10) X_00, as
// X_10^T = -(X_00^T L_10^T) X_11^T, and warp 5 X_32 = -(X_33 L_32) X_22, each written as split
// words beside the diagonal blocks and in bf16; warps 0-3 meanwhile start the lower-left quarter
// X_BT = -X_BB (L_BT X_TT), warp wq taking block (2 + nh, Jq), Jq = wq >> 1 and nh = wq & 1. It is
// worked transposed (X_BT^T = -Q^T X_BB^T, Q^T = X_TT^T L_BT^T), so that each product's result is
// the next one's A fragment; part 1 makes the term K = Jq of Q^T(Jq, nq) = sum over K = Jq, 1 of
// X_{K,Jq}^T L_{2+nq,K}^T (nq <= nh), which needs neither half. X's diagonal blocks hold exact zeros
// above their diagonals.
struct QuarterTerms {
  float q[2][2][4];  // Q^T(Jq, nq) in C layout
};
__device__ __forceinline__ auto rows_nk_split(const uint32_t* S, int g, int tq) {
  return [=](int nn) { return load_b_split<true>(S + 8 * nn * kLdM, g, tq); };
}
__device__ __forceinline__ const uint32_t* block16(const uint32_t* M, int I, int J) { return M + 16 * I * kLdM + 16 * J; }
__device__ __forceinline__ void quarter_term(QuarterTerms& t, const uint32_t* Lw, const uint32_t* Xw, int wq, int K,
                                             int g, int tq) {
  const int Jq = wq >> 1, nh = wq & 1;
  const SplitA a = load_a_split<true>(block16(Xw, K, Jq), g, tq);
  mma16_split(t.q[0], a, rows_nk_split(block16(Lw, 2, K), g, tq));
  if (nh == 1) mma16_split(t.q[1], a, rows_nk_split(block16(Lw, 3, K), g, tq));
}
__device__ __forceinline__ QuarterTerms inverse_part1(const uint32_t* Lw, uint32_t* Xw, bf16* Xb, int warp, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  QuarterTerms t = {};
  if (warp < 4) {
    quarter_term(t, Lw, Xw, warp, warp >> 1, g, tq);  // K = Jq: X_{Jq,Jq} is a diagonal block
  } else if (warp == 4) {  // X_10^T in C layout: c[nn][2 h + e] is X_10[8 nn + 2 tq + e][g + 8 h]
    float r[2][4] = {}, x[2][4] = {};
    mma16_split(r, load_a_split<true>(block16(Xw, 0, 0), g, tq), rows_nk_split(block16(Lw, 1, 0), g, tq));
    mma16_split(x, c_as_a_split(r), rows_nk_split(block16(Xw, 1, 1), g, tq));
#pragma unroll
    for (int nn = 0; nn < 2; ++nn)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        store_x_column_pair(Xw, Xb, 16 + 8 * nn + 2 * tq, g + 8 * h, -x[nn][2 * h], -x[nn][2 * h + 1]);
  } else if (warp == 5) {  // X_32 in C layout: c[nn][2 h + e] is X_32[g + 8 h][8 nn + 2 tq + e]
    float r[2][4] = {}, x[2][4] = {};
    mma16_split(r, load_a_split<false>(block16(Xw, 3, 3), g, tq),
                [&](int nn) { return load_b_split<false>(block16(Lw, 3, 2) + 8 * nn, g, tq); });
    mma16_split(x, c_as_a_split(r), [&](int nn) { return load_b_split<false>(block16(Xw, 2, 2) + 8 * nn, g, tq); });
#pragma unroll
    for (int nn = 0; nn < 2; ++nn)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        store_x_row_pair(Xw, Xb, 48 + g + 8 * h, 32 + 8 * nn + 2 * tq, -x[nn][2 * h], -x[nn][2 * h + 1]);
  }
  return t;
}
// Part 2 (warps 0-3, after the barrier): the term that needs X_10 (Jq = 0, K = 1), then Y^T = sum
// over kk <= nh of Q^T(Jq, kk) X_{2+nh,2+kk}^T and X block (2 + nh, Jq) = -(Y^T)^T in bf16.
__device__ __forceinline__ void inverse_part2(QuarterTerms& t, const uint32_t* Lw, const uint32_t* Xw, bf16* Xb,
                                              int wq, int lane) {
  const int g = lane >> 2, tq = lane & 3, Jq = wq >> 1, nh = wq & 1;
  if (Jq == 0) quarter_term(t, Lw, Xw, wq, 1, g, tq);
  float y[2][4] = {};
  mma16_split(y, c_as_a_split(t.q[0]), rows_nk_split(block16(Xw, 2 + nh, 2), g, tq));
  if (nh == 1) mma16_split(y, c_as_a_split(t.q[1]), rows_nk_split(block16(Xw, 3, 3), g, tq));
  // y[nn][2 h + e] is X[32 + 16 nh + 8 nn + 2 tq + e][16 Jq + g + 8 h], negated
#pragma unroll
  for (int nn = 0; nn < 2; ++nn)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        Xb[(32 + 16 * nh + 8 * nn + 2 * tq + e) * kLdX + 16 * Jq + g + 8 * h] = __float2bfloat16(-y[nn][2 * h + e]);
}

// ---------------------------------------------------------------------------------------------
// The chunk preparation: 256 threads and ~110 KB of shared memory, so two CTAs share an SM and
// hide each other's latency (a 512-thread, 200 KB, one-CTA-per-SM version measured 1.1-1.4x slower
// on an H200). v is held in registers until it is needed, Aqk goes straight to the workspace, the
// six lower blocks of L / Aqk are one product phase after one elementwise pass (step 4), and each
// region is reused once its contents are dead:
//   [G fp32] -> [X split words | X bf16]     [q | k] -> [q F | k F] -> [beta V | W]
//   [L: fp32 diagonal blocks, split words below them]
//   [raw g, then operands] -> [beta exp(G) k] -> [U]
constexpr int kLiteThreads = FKDA_PARAM_PREP_THREADS;  // the prep kernel's launch shape (record params)
static_assert(FKDA_PARAM_PREP_THREADS == 256, "the prep kernel is written for 8 warps (record param prep_threads)");
constexpr int kLOffG = 0;
constexpr int kLOffX = 0;                                 // after G is dead
constexpr int kLOffXb = kLOffX + kC * kLdM * 4;
constexpr int kLOffQ = kLOffG + kC * kLdG * 4;            // later beta V
constexpr int kLOffK = kLOffQ + kC * kLdB * 2;
constexpr int kLOffL = kLOffK + kC * kLdB * 2;
constexpr int kLOffOp = kLOffL + kC * kLdM * 4;           // 96 rows of operands, later beta exp(G) k
constexpr int kLOffBeta = kLOffOp + 96 * kLdB * 2;
constexpr int kLOffTot = kLOffBeta + kC * 4;
constexpr int kLOffSafe = kLOffTot + 4 * kK * 4;         // int [4]: diagonal block I on tensor cores
constexpr int kLOffSeq = kLOffSafe + 16;                  // SeqOfChunk: kept here, not in registers
constexpr int kLOffBound = kLOffSeq + 16;                 // pieces > 1: float [2][64] row maxima (bound_row_max)
constexpr int kLiteSmem = kLOffBound + (kPieces > 1 ? 2 * kC * 4 : 0);
static_assert(kLOffXb + kC * kLdX * 2 <= kLOffQ, "X as split words and in bf16 fits where G was");
static_assert(kLOffOp % 16 == 0 && kLOffXb % 16 == 0 && kLOffL % 16 == 0, "16 B alignment");
static_assert(2 * (kLiteSmem + 1024) <= 228 * 1024, "two CTAs per SM");
static_assert(96 * kLdB * 2 >= int((kV / 16) * kUBlockBytes) && kLdB * kC * 2 == int(kWsQg - kWsW),
              "U is staged in the operand region, W in k's");

// The CTA's sequence, parked in shared memory from the start to the one-chunk path at the end
// (held in registers it pushed the heavy middle steps over 128 registers).
struct SeqOfChunk {
  int64_t bos;
  int n, len;  // len: -1 unless the sequence is this one chunk and StateArgs::single is set
};

// Shared memory of the one-chunk path (after step 7: W stays in k's region, U in the operand
// region; the rest is dead): Qg in q's region, Kd in L's, and below q's region A, exp(G_C) and the
// two 4-warp groups' bf16 state tiles and V' (V tile 16).
constexpr int kSingleVT = 16;
constexpr int kSOffA = 0;
constexpr int kSOffGc = kSOffA + kC * kLdX * 2;
constexpr int kSOffSb = kSOffGc + kK * 4;
constexpr int kSOffVp = kSOffSb + 2 * kK * (kSingleVT + 8) * 2;
static_assert(kSOffVp + 2 * kC * (kSingleVT + 8) * 2 <= kLOffQ, "one-chunk tiles fit below q's region");
static_assert(kC * kLdM * 4 >= kC * kLdB * 2, "Kd fits in L's region");
constexpr int kCuStaged = kC * kLdM * 4 / 8;  // cu_seqlens offsets (int64) L's region holds at the start

// A sequence of one chunk (StateArgs::single): its state update, done by this CTA instead of the
// state pass (no second kernel, no wait on the whole grid). The two 4-warp groups take V tiles of
// 16 columns, 4 rounds; Qg, Kd, A and exp(G_C) come back from the workspace slot this CTA wrote
// (L2), W and U are still in shared memory.
template <typename ST>
__device__ __forceinline__ void prep_single_chunk_state(const PrepArgs& a, uint8_t* smem, const uint8_t* ws,
                                                        const bf16* Wsm, const bf16* Usm, int n, int hv,
                                                        int64_t bos, int len, int tid) {
  constexpr int VT = kSingleVT;
  const int lane = tid & 31, warp = tid >> 5, w = warp & 3, group = warp >> 2;
  bf16* Qg = reinterpret_cast<bf16*>(smem + kLOffQ);
  bf16* Kd = reinterpret_cast<bf16*>(smem + kLOffL);
  bf16* As = reinterpret_cast<bf16*>(smem + kSOffA);
  float* gc = reinterpret_cast<float*>(smem + kSOffGc);
  bf16* Sb = reinterpret_cast<bf16*>(smem + kSOffSb) + group * kK * (VT + 8);
  bf16* Vp = reinterpret_cast<bf16*>(smem + kSOffVp) + group * kC * (VT + 8);
  constexpr int kQkVec = kC * kLdB * 2 / 16, kAVec = kC * kLdX * 2 / 16, kGcVec = kK * 4 / 16;
  for (int i = tid; i < kQkVec; i += kLiteThreads) {
    cp_async16(Qg + i * 8, ws + kWsQg + i * 16);
    cp_async16(Kd + i * 8, ws + kWsKd + i * 16);
  }
  for (int i = tid; i < kAVec; i += kLiteThreads) cp_async16(As + i * 8, ws + kWsA + i * 16);
  if (tid < kGcVec) cp_async16(gc + tid * 4, ws + kWsGc + tid * 16);
  cp_async_commit();
  const StateArgs& sa = a.st;
  int64_t slot;
  const bool pad = state_slot(sa, n, slot);
  const size_t head = size_t(slot) * size_t(sa.slot_stride) + size_t(hv) * kV * kK;
  const ST* src = sa.init && !pad ? static_cast<const ST*>(sa.init) + head : nullptr;
  ST* dst = sa.fin && !pad ? static_cast<ST*>(sa.fin) + head : nullptr;
  constexpr int kRounds = kV / (2 * VT);
  // The next round's state tile is loaded while this round computes (the rounds are otherwise a
  // chain of load latencies); one accumulator set (KS = 1) keeps both tiles within 128 registers.
  float nx[2][VT / 8][4];
  load_state_tile<VT, ST>(nx, src, w, lane, group * VT);
  cp_async_wait<0>();
#pragma unroll 1
  for (int r = 0; r < kRounds; ++r) {
    const int v0 = (2 * r + group) * VT;
    float s[2][VT / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < VT / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = nx[mt][nt][e];
    write_state_bf16<VT>(Sb, s, w, lane);
    __syncthreads();  // the copies and Sb are complete; the last round is done with V'
    if (r + 1 < kRounds) load_state_tile<VT, ST>(nx, src, w, lane, v0 + 2 * VT);
    state_chunk_step<VT, 1, true>(s, Sb, Vp, Wsm, Qg, Kd, As, Usm + (v0 / 16) * (kC * kLdU16), gc,
                                  sa.out + (size_t(bos) * sa.HV + hv) * kV + v0, size_t(sa.HV) * kV, len, w,
                                  lane);
    store_checkpoint<VT, ST>(sa, s, n, hv, 0, len, w, lane, v0);
    if (dst) store_state_tile<VT, ST>(dst, s, w, lane, v0);
  }
}

// Piece-split modules: the CTA of a sequence's first chunk copies the sequence's initial state (this
// head) to the workspace (StateArgs::init_copy), where the state pass's pieces read it: the final
// state may be the same memory (a pool updated in place), written by another piece. The prep
// finishes before the state pass reads anything (PDL wait), so the copy is never raced.
template <typename ST>
__device__ __forceinline__ void stash_initial_state(const PrepArgs& a, const SeqOfChunk& sq, int hv, int tid) {
  const StateArgs& sa = a.st;
  const int64_t cslot = blockIdx.x / unsigned(a.HV);
  int64_t slot;
  if (cslot != sq.bos / kC + sq.n || !sa.init || state_slot(sa, sq.n, slot)) return;
  const ST* src = static_cast<const ST*>(sa.init) + size_t(slot) * size_t(sa.slot_stride) + size_t(hv) * kV * kK;
  ST* dst = init_copy_of<ST>(sa, sq.n, hv);
#pragma unroll 8
  for (int i = tid; i < kV * kK; i += kLiteThreads) dst[i] = src[i];
}

template <typename ST>
__global__ void __launch_bounds__(FKDA_PARAM_PREP_THREADS, FKDA_PARAM_PREP_MIN_BLOCKS) kda_prep_lite_kernel(const PrepArgs a) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
#if FKDA_PARAM_GUARD == 1
  if (guard_skips(a.st)) return;  // (guarded modules) the fused kernel before served the call
#endif
  extern __shared__ __align__(128) uint8_t smem[];
  float* Gs = reinterpret_cast<float*>(smem + kLOffG);
  uint32_t* Xw = reinterpret_cast<uint32_t*>(smem + kLOffX);  // X: split words (diagonal blocks, X_10, X_32)
  bf16* Xb = reinterpret_cast<bf16*>(smem + kLOffXb);
  bf16* Qs = reinterpret_cast<bf16*>(smem + kLOffQ);
  bf16* Bu = Qs;  // beta V, once q is dead
  bf16* Ks = reinterpret_cast<bf16*>(smem + kLOffK);
  float* Lm = reinterpret_cast<float*>(smem + kLOffL);
  bf16* Op = reinterpret_cast<bf16*>(smem + kLOffOp);
  bf16* Bw = Op;  // beta exp(G) k, once the operands are dead
  float* betas = reinterpret_cast<float*>(smem + kLOffBeta);
  float* tot = reinterpret_cast<float*>(smem + kLOffTot);
  int* safe = reinterpret_cast<int*>(smem + kLOffSafe);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // CTA b is (chunk slot b / HV, value head b % HV): CTAs that run together read the same tokens'
  // rows of q, k, v and g, whose heads are adjacent in memory (slot-major order read one head's rows
  // 64 at a time, 4 KB apart at 16 heads)
  const int64_t slot = blockIdx.x / unsigned(a.HV);
  const int hv = static_cast<int>(blockIdx.x - unsigned(slot) * unsigned(a.HV));
  // The CTA's sequence. Searched in global memory each step is a dependent load (log2 N round
  // trips before the chunk's loads can be addressed), so up to kCuStaged offsets are first read
  // by all threads at once into L's region (free until step 3) and searched there.
  SeqSpan span;
  if (a.N < kCuStaged) {  // CTA-uniform
    int64_t* cus = reinterpret_cast<int64_t*>(smem + kLOffL);
    for (int i = tid; i <= a.N; i += kLiteThreads) cus[i] = load_cu(a.cu, a.cu64, i);
    __syncthreads();
    span = find_seq([cus](int i) { return cus[i]; }, a.N, slot);
  } else {
    span = find_seq([&a](int i) { return load_cu(a.cu, a.cu64, i); }, a.N, slot);
  }
  const int n = span.n;
  const int64_t bos = span.bos, len = span.len;
  const int64_t c = slot - (bos / kC + n);
  if (c * kC >= len) return;  // a gap slot (or an empty sequence)
  SeqOfChunk* seq = reinterpret_cast<SeqOfChunk*>(smem + kLOffSeq);
  if (tid == 0) *seq = SeqOfChunk{bos, n, a.st.single && len <= kC ? int(len) : -1};  // read at the end
  if (tid < 4) safe[tid] = 1;  // cleared by the gate step for a block whose range is too wide
  const int64_t t0 = bos + c * kC;
  const int nt = static_cast<int>(len - c * kC < kC ? len - c * kC : kC);
  const int hk = a.group == 1 ? hv : hv / a.group;  // no integer division for plain MHA
  const int HV = a.HV;
  uint8_t* ws = a.ws + (size_t(slot) * HV + hv) * kSlotBytes;
  bf16* Aw = reinterpret_cast<bf16*>(ws + kWsA);

  // ---- 1. loads. q, k and the raw g go by cp.async straight into shared memory, all in flight at
  // once (rows >= nt zero-filled); v waits in registers until step 5. The raw g sits in the operand
  // region, which is free until step 4.
  bf16* Graw = Op;
  uint4 vreg[4];
  const bf16* vb = a.v + (size_t(t0) * HV + hv) * kV;  // row offsets in 32 bits, as for q, k, g below
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = tid + i * kLiteThreads, r = idx >> 4, c8 = (idx & 15) * 8;
    vreg[i] = make_uint4(0, 0, 0, 0);
    if (r < nt) vreg[i] = *reinterpret_cast<const uint4*>(vb + (uint32_t(r) * uint32_t(HV * kV) + c8));
  }
  {
    // row offsets in 32 bits: at most 63 rows x 128 heads (jit/supported.json) x 128 + 120 elements
    const uint32_t qk_row = uint32_t(a.H) * kK, g_row = uint32_t(HV) * kK;
    const bf16* qb = a.q + (size_t(t0) * a.H + hk) * kK;
    const bf16* kb = a.k + (size_t(t0) * a.H + hk) * kK;
    const bf16* gb = a.g + (size_t(t0) * HV + hv) * kK;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * kLiteThreads, r = idx >> 4, c8 = (idx & 15) * 8;
      const int bytes = r < nt ? 16 : 0;
      const uint32_t rs = r < nt ? uint32_t(r) : 0u;  // row 0 of the chunk always exists
      cp_async16_zfill(Qs + r * kLdB + c8, qb + (rs * qk_row + c8), bytes);
      cp_async16_zfill(Ks + r * kLdB + c8, kb + (rs * qk_row + c8), bytes);
      cp_async16_zfill(Graw + r * kLdB + c8, gb + (rs * g_row + c8), bytes);
    }
    cp_async_commit();
  }
  if (tid < kC) {
    float b = 0.f;
    if (tid < nt) {
      b = __bfloat162float(a.beta[size_t(t0 + tid) * HV + hv]);
      if (a.beta_logit) b = 1.f / (1.f + __expf(-b));
    }
    betas[tid] = b;
  }
  cp_async_wait<0>();
  __syncthreads();
  // l2norm of q (times scale) and k in place: 8 lanes a row (keys 8 j .. 8 j + 7 and 64 + 8 j ..),
  // 4 rows a warp at a time, so a row's sums take 3 shuffle steps (a warp a row took 5, and 5x
  // the shuffles in all); each 8-lane phase of a 16-byte load reads 128 contiguous bytes.
  {
    const int grp = lane >> 3, j = lane & 7;
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const int r = warp * 8 + pass * 4 + grp;
      uint4* qp = reinterpret_cast<uint4*>(Qs + r * kLdB + 8 * j);
      uint4* kp = reinterpret_cast<uint4*>(Ks + r * kLdB + 8 * j);
      float qf[16], kf[16];
      unpack8(qp[0], qf);
      unpack8(qp[8], qf + 8);  // + 64 keys
      unpack8(kp[0], kf);
      unpack8(kp[8], kf + 8);
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        sq = fmaf(qf[e], qf[e], sq);
        sk = fmaf(kf[e], kf[e], sk);
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
      }
      const float nq = rsqrt_ftz(sq + 1e-6f) * a.scale, nk = rsqrt_ftz(sk + 1e-6f);  // >= 1e-6: never denormal
#pragma unroll
      for (int e = 0; e < 16; ++e) { qf[e] *= nq; kf[e] *= nk; }
      qp[0] = pack8(qf);
      qp[8] = pack8(qf + 8);
      kp[0] = pack8(kf);
      kp[8] = pack8(kf + 8);
    }
  }
  {
    // gate + cumsum: a thread takes keys 2 kp, 2 kp + 1 over the 16 rows of quarter q, then adds the
    // totals of the quarters above it
    const int kp = tid & 63, q = tid >> 6, d = 2 * kp;
    const float2 dtb = a.dt_bias ? make_float2(a.dt_bias[hv * kK + d], a.dt_bias[hv * kK + d + 1])
                                 : make_float2(0.f, 0.f);
    const float ea = a.A_log ? __expf(a.A_log[hv]) : 1.f;
    const float lb2 = a.lower_bound * kLog2e;
    float2 gl[16];
    float mx[16];  // read only with pieces (kBound)
    constexpr bool kBound = kPieces > 1;
    const bf16* graw = Graw + q * 16 * kLdB + d;
    const float2 run = a.gate_mode == 0   ? gate_cumsum<0, kBound>(gl, mx, graw, q * 16, nt, dtb, ea, lb2)
                       : a.gate_mode == 1 ? gate_cumsum<1, kBound>(gl, mx, graw, q * 16, nt, dtb, ea, lb2)
                                          : gate_cumsum<2, kBound>(gl, mx, graw, q * 16, nt, dtb, ea, lb2);
    *reinterpret_cast<float2*>(tot + q * kK + d) = run;
    if constexpr (kBound) bound_row_max(mx, reinterpret_cast<float*>(smem + kLOffBound), q, warp, lane);
    // Quarter q is diagonal block q: it goes on tensor cores with the anchor m = 16 q + 7 when every
    // factor exp2(+-(G - G_m)) inside it stays below 2^100 (always for the bounded gate; softplus
    // decays of more than ~9 nats a step fall back to the elementwise form). This thread's running
    // sums already hold G of its keys there (the quarter base cancels), so the check needs neither
    // G from shared memory nor barriers of its own; a warp with a wide key clears the flag.
    {
      const bool wide = !(fmaxf(gl[0].x - gl[7].x, gl[7].x - gl[15].x) <= 100.f) ||
                        !(fmaxf(gl[0].y - gl[7].y, gl[7].y - gl[15].y) <= 100.f);
      if (__any_sync(0xffffffffu, wide) && lane == 0) safe[q] = 0;
    }
    __syncthreads();
    float2 base = make_float2(0.f, 0.f);
    for (int p = 0; p < q; ++p) {
      const float2 t = *reinterpret_cast<const float2*>(tot + p * kK + d);
      base.x += t.x;
      base.y += t.y;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i)
      *reinterpret_cast<float2*>(Gs + (q * 16 + i) * kLdG + d) = make_float2(gl[i].x + base.x, gl[i].y + base.y);
  }
  __syncthreads();  // G and the diagonal blocks' flags (safe) are complete

  // ---- 2. exp(G_C) to the workspace. Aqk's strictly-upper 16x16 blocks are left unwritten, like
  // the slot's row padding: no product uses them (finish_output stops at the diagonal block;
  // output_and_update replaces their fragments by zeros).
  if (tid < kK) reinterpret_cast<float*>(ws + kWsGc)[tid] = ex2(Gs[(kC - 1) * kLdG + tid]);
  if constexpr (kPieces > 1) {
    if (warp == 4) bound_store(reinterpret_cast<const float*>(smem + kLOffBound), ws, lane);
  }

  // ---- 3. diagonal 16x16 blocks of L and Aqk that cannot go on tensor cores: elementwise, fp32.
  // Two warps a block. The 8 lanes of group p own the rows il = p and 15 - p: (p + 1) + (16 - p)
  // = 17 products (i, j <= i) whatever p, so no warp waits on a longer row (a lane per row left
  // the first warp of a block idle half the time). One row after the other, so only one row's
  // sums are live (both at once made the compiler reload operands to stay within 128 registers).
  float* xch = reinterpret_cast<float*>(Op);  // the tensor-core blocks' partial sums, 8 KB; Op is free until step 4
  const bool mma_diag = safe[tid >> 6];  // warp-uniform
  DiagPartial part;
  if (mma_diag) {
    part = diag_block_mma(Qs, Ks, Gs, xch, tid >> 6, warp & 1, lane);
  } else {
    const int blk = tid >> 6, p = (tid >> 3) & 7, dq = tid & 7;
    {
      const int i = blk * 16 + p;
      float sL[8], sA[8];
      diag_row_sums<8>(Qs, Ks, Gs, i, blk * 16, dq, (warp & 1) * 4 + 3, sL, sA);
      diag_row_store<8>(Lm, Aw, i, blk, dq, betas[i], sL, sA);
    }
    {
      const int i = blk * 16 + 15 - p;
      float sL[16], sA[16];
      diag_row_sums<16>(Qs, Ks, Gs, i, blk * 16, dq, 15 - (warp & 1) * 4, sL, sA);
      diag_row_store<16>(Lm, Aw, i, blk, dq, betas[i], sL, sA);
    }
  }

  __syncthreads();  // every partial is in xch
  if (mma_diag) diag_block_finish(part, xch, Lm, Aw, betas, tid >> 6, warp & 1, lane);
  __syncthreads();  // q, k and xch are read: step 4 rewrites them

  // ---- 4. One pass over q, k and G makes every operand that carries a decay (see the top of the
  // file): warp pair I takes the 16 rows of block I, a thread 4 keys of a row at a time, with the
  // block's per-key factors exp(G_s) (s = 16 I - 1), exp(G_C - G_e) (e = 16 I + 15) and, for the
  // lower blocks two or three blocks below, exp(G_{16 I' - 1} - G_e). Out of it:
  //   Qg = q F exp(G_s) and Kd = k R exp(G_C - G_e) to the workspace;
  //   beta exp(G) k = beta k F exp(G_s) in registers (bw) until the operands are dead (step 5);
  //   left operands of the lower blocks (I >= 1): k F in place of k, q F in place of q;
  //   right operands (I <= 2), Op rows: k R at row i (for block I + 1), k R exp(G_{16 (I + 2) - 1}
  //   - G_e) at row 48 + i (for I + 2), k R exp(G_47 - G_e) at row 80 + i (block 0, for block 3).
  // Every lower block (I, J), J < I, is then one 16 x 16 product of L and one of Aqk with the
  // anchor 16 I - 1 (top of the file), the factor exp(G_{16 I - 1} - G_{16 J + 15}) on the right.
  uint2 bw[8];
  {
    const int I = warp >> 1, d0 = col4(lane);
    float gs[4] = {0.f, 0.f, 0.f, 0.f}, ge[4], gc[4], ps[4], ce[4], t2[4], t3[4];
    if (I > 0) load4(Gs + (16 * I - 1) * kLdG + d0, gs);
    load4(Gs + (16 * I + 15) * kLdG + d0, ge);
    load4(Gs + (kC - 1) * kLdG + d0, gc);
    if (I < 2) load4(Gs + (16 * I + 31) * kLdG + d0, t2);
    if (I == 0) load4(Gs + 47 * kLdG + d0, t3);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      ps[e] = ex2(gs[e]);
      ce[e] = ex2(gc[e] - ge[e]);
      t2[e] = I < 2 ? ex2(t2[e] - ge[e]) : 0.f;
      t3[e] = I == 0 ? ex2(t3[e] - ge[e]) : 0.f;
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int i = 16 * I + 8 * (warp & 1) + t;
      const float b = betas[i];
      float x[4], y[4], gi[4], fq[4], fk[4], rk[4], o[4];
      unpack4(*reinterpret_cast<const uint2*>(Qs + i * kLdB + d0), x);
      unpack4(*reinterpret_cast<const uint2*>(Ks + i * kLdB + d0), y);
      load4(Gs + i * kLdG + d0, gi);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float f = ex2(gi[e] - gs[e]), r = ex2(ge[e] - gi[e]);
        fq[e] = x[e] * f;
        fk[e] = y[e] * f;
        rk[e] = y[e] * r;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = fq[e] * ps[e];
      *reinterpret_cast<uint2*>(ws + kWsQg + (i * kLdB + d0) * 2) = pack4(o);
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = rk[e] * ce[e];
      *reinterpret_cast<uint2*>(ws + kWsKd + (i * kLdB + d0) * 2) = pack4(o);
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = fk[e] * ps[e] * b;
      bw[t] = pack4(o);
      if (I > 0) {  // warp-uniform
        *reinterpret_cast<uint2*>(Qs + i * kLdB + d0) = pack4(fq);
        *reinterpret_cast<uint2*>(Ks + i * kLdB + d0) = pack4(fk);
      }
      if (I < 3) *reinterpret_cast<uint2*>(Op + i * kLdB + d0) = pack4(rk);
      if (I < 2) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = rk[e] * t2[e];
        *reinterpret_cast<uint2*>(Op + (48 + i) * kLdB + d0) = pack4(o);
      }
      if (I == 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = rk[e] * t3[e];
        *reinterpret_cast<uint2*>(Op + (80 + i) * kLdB + d0) = pack4(o);
      }
    }
  }
  __syncthreads();  // the operands are complete; G is dead (X lives there)
  if (warp >= 6) {  // the diagonal blocks of X (step 6), beside the products: L's are complete
    diag_block_inverse_column(Lm, Xw, Xb, 2 * (warp - 6) + (lane >> 4), lane & 15);
  } else {  // lower block (I, J): (1,0) (2,0) (2,1) (3,0) (3,1) (3,2), L and Aqk together
    const int I = warp < 1 ? 1 : (warp < 3 ? 2 : 3), J = warp - I * (I - 1) / 2;
    const int rrow = J == I - 1 ? 16 * J : (J == I - 2 ? 48 + 16 * J : 80);
    float accL[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float accA[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t ak[4], aq[4], bfr[4];
      load_a(ak, Ks, kLdB, 16 * I, ks * 16, lane);
      load_a(aq, Qs, kLdB, 16 * I, ks * 16, lane);
      load_b_nk(bfr, Op + rrow * kLdB, kLdB, 0, ks * 16, lane);
      mma_bf16(accL[0], ak, bfr);
      mma_bf16(accL[1], ak, bfr + 2);
      mma_bf16(accA[0], aq, bfr);
      mma_bf16(accA[1], aq, bfr + 2);
    }
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nn = 0; nn < 2; ++nn)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * I + g + 8 * h, col = 16 * J + nn * 8 + 2 * tq;
        store_l_split_pair(Lm, row, col, accL[nn][2 * h], accL[nn][2 * h + 1], betas[row]);
        store_a_pair(Aw, row, col, accA[nn][2 * h], accA[nn][2 * h + 1]);
      }
  }
  __syncthreads();  // the operands are dead; L and the diagonal blocks of X are complete

  // ---- 5. B operands: beta V (into q's region), beta exp(G) k (from step 4, into the operand region),
  // beside the first part of step 6.
  const uint32_t* Lw = reinterpret_cast<const uint32_t*>(Lm);
  QuarterTerms quarter = inverse_part1(Lw, Xw, Xb, warp, lane);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = tid + i * kLiteThreads, r = idx >> 4, c8 = (idx & 15) * 8;
    float x[8];
    unpack8(vreg[i], x);
    const float b = betas[r];
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] *= b;
    *reinterpret_cast<uint4*>(Bu + r * kLdB + c8) = pack8(x);
  }
#pragma unroll
  for (int t = 0; t < 8; ++t)
    *reinterpret_cast<uint2*>(Bw + (16 * (warp >> 1) + 8 * (warp & 1) + t) * kLdB + col4(lane)) = bw[t];
  __syncthreads();  // X_10 and X_32 are written

  // ---- 6. X = (I + L)^-1 below its diagonal blocks (those were made beside the products above), in
  // bf16 only (step 7 reads nothing else), on tensor cores: inverse_part1 above, then part 2 on
  // warps 0-3.
  if (warp < 4) inverse_part2(quarter, Lw, Xw, Xb, warp, lane);
  __syncthreads();  // X in bf16 is complete (X above the diagonal is never read)

  // ---- 7. W = X (beta exp(G) k), U = X (beta V). The fragments are staged in shared memory in the
  // workspace layout (W where k was, U where beta exp(G) k was) and leave in two bulk copies
  // (fragment stores straight to global memory filled only half of each 32-byte sector).
  // X is lower block-triangular, so row block m takes m + 1 k-steps: warp w of group `which` (W: warps
  // 0-3, U: 4-7) takes row blocks m0 = w >> 1 and m1 = 3 - m0 (5 k-steps either way, where one row block
  // a warp gave 1..4 and every warp waited for the longest) over columns 64 h .. 64 h + 63, h = w & 1, each
  // B fragment loaded once for both row blocks. Each element's k-steps run in the same order, so the
  // results are bitwise the one-block-a-warp form's (measured as prep_wu_balance, 2026-12-02: 0.98x the
  // prep's time). acc[8 r + j] is n-tile 8 h + j of row block m0 (r 0) or m1 (r 1).
  {
    const int w = warp & 3, which = warp >> 2, m0 = w >> 1, m1 = 3 - m0, h = w & 1;
    const bf16* Bsrc = which ? Bu : Bw;
    float acc[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    // k-steps 0..m0 feed both row blocks, then m0 + 1..m1 row block m1 alone (two loops: no
    // predicated-off products taking issue slots)
    for (int ks = 0; ks <= m0; ++ks) {
      uint32_t a0[4], a1[4];
      load_a(a0, Xb, kLdX, m0 * 16, ks * 16, lane);
      load_a(a1, Xb, kLdX, m1 * 16, ks * 16, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bfr[4];
        load_b_kn(bfr, Bsrc, kLdB, ks * 16, (4 * h + np) * 16, lane);
        mma_bf16(acc[2 * np], a0, bfr);
        mma_bf16(acc[2 * np + 1], a0, bfr + 2);
        mma_bf16(acc[8 + 2 * np], a1, bfr);
        mma_bf16(acc[8 + 2 * np + 1], a1, bfr + 2);
      }
    }
    for (int ks = m0 + 1; ks <= m1; ++ks) {
      uint32_t a1[4];
      load_a(a1, Xb, kLdX, m1 * 16, ks * 16, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bfr[4];
        load_b_kn(bfr, Bsrc, kLdB, ks * 16, (4 * h + np) * 16, lane);
        mma_bf16(acc[8 + 2 * np], a1, bfr);
        mma_bf16(acc[8 + 2 * np + 1], a1, bfr + 2);
      }
    }
    const int g = lane >> 2, c0 = 2 * (lane & 3);
    __syncthreads();  // every warp is done reading beta exp(G) k before U overwrites it
    // rows 16 m + g and + 8 of row block m0 (r 0) and m1 (r 1), columns 8 (8 h + j) + c0, + 1: one base
    // address a thread, a row-block offset and constant offsets per n-tile j (U: u_off with col >> 4 =
    // 4 h + j / 2 and col & 15 = 8 (j % 2) + c0)
    auto stage = [&](bf16* base, int ld, auto offset) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        bf16* row = base + (r ? m1 : m0) * 16 * ld;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          bf16* d = row + offset(j);
          *reinterpret_cast<uint32_t*>(d) = pack_bf16(acc[8 * r + j][0], acc[8 * r + j][1]);
          *reinterpret_cast<uint32_t*>(d + 8 * ld) = pack_bf16(acc[8 * r + j][2], acc[8 * r + j][3]);
        }
      }
    };
    if (which) stage(Op + u_off(g, c0) + 4 * h * (kC * kLdU16), kLdU16,
                     [](int j) { return (j >> 1) * (kC * kLdU16) + (j & 1) * 8; });
    else stage(Ks + g * kLdB + c0 + 64 * h, kLdB, [](int j) { return j * 8; });
  }
  fkda::fence_smem_to_async();  // the staged W and U, to the bulk copies
  __syncthreads();
  if (seq->len < 0) {  // CTA-uniform; a one-chunk sequence's W and U are used from here
    if constexpr (kPieces > 1) stash_initial_state<ST>(a, *seq, hv, tid);
    if (tid == 0) {
      fkda::bulk_s2g(ws + kWsW, Ks, uint32_t(kC * kLdB * 2));
      fkda::bulk_s2g(ws + kWsU, Op, uint32_t((kV / 16) * kUBlockBytes));
      fkda::bulk_s2g_wait_read();  // shared memory is read before the CTA exits
    }
    return;
  }
  const SeqOfChunk sq = *seq;
  prep_single_chunk_state<ST>(a, smem, ws, Ks, Op, sq.n, hv, sq.bos, sq.len, tid);
}


}  // namespace fkda_prefill
