// The fused single-kernel prefill with 16-token chunks (issue 46; module records prefill_c16_*,
// opt-in route c16): one CTA a (value head, sequence), 128 threads (4 warps), 2 CTAs an SM. The CTA
// walks its sequence's chunks of 16 tokens in order, prepares each chunk itself (no workspace) and
// updates the [V, K] fp32 state, which lives in registers as mma.sync m16n8k16 accumulator fragments:
// warp w owns value rows 32 w .. 32 w + 31 (2 m-tiles x 16 n-tiles x 4 floats = 128 registers).
//
// Per chunk (C = 16 tokens; G = per-key cumulative log2 decay from the chunk start, <= 0 for every gate that decays):
//   Qg = q exp(G), Kg = k exp(G), Kn = k exp(-G), Kd = k exp(G_C - G)      (elementwise, per thread)
//   L   = Diag(beta) strict_lower(Kg Kn^T), Aqk = lower(Qg Kn^T)            (mma, operands split bf16 hi + lo)
//   T   = (I + L)^-1 Diag(beta)                                             (fp32 forward substitution)
//   W   = T Kg, U = T V                                                     (mma)
//   V'^T = U^T - S W^T,  O^T = S Qg^T + V'^T Aqk^T,  S <- S Diag(exp(G_C)) + V'^T Kd   (mma, S as A operand)
// S as the A operand: the m16n8 accumulators of two adjacent n-tiles are the m16k16 A fragment (pairs
// packed to bf16), as V'^T is for the last two products.
//
// The factored L / Aqk need exp2(-G) finite and exp2(G) normal: G in [-kFactorRange, kFactorRange]. The bounded gate at
// lower_bound >= -5 always is (|G| <= 16 x 5 x log2(e) = 115.4). A group of 4 keys with a G_C below it (a decay of more
// than ~5 nats a token on average over the chunk: softplus, log, or a lower bound below -5) takes, within twice the range,
// the anchor G_C / 2 a key for its L / Aqk operands (Qg and Kg restored after the product); beyond that its Kn entries
// are stored as 0 and the fallback adds its terms of L and Aqk elementwise in fp32 from exp2(G_i - G_j) (fallback_row);
// a log gate that rises beyond the range takes every key that way. The CTA's choice is made at the barrier after the operands
// (__syncthreads_or); the other products are the same either way, since Qg, Kg and Kd are <= 1 and only underflow.
// The gate is a template parameter (GATE): the bounded kernel the binding sends lower_bound >= -5 neither checks nor
// carries the fallback.
//
// Inputs move by cp.async into a 2-deep ring: chunk c + 1's loads are in flight during chunk c.
// Determinism: every sum has a fixed order (mma k-steps in order, the two partial halves of L / Aqk
// added in warp order).
#pragma once

#include <type_traits>

#include "kda_prefill_layout.cuh"

namespace fkda_c16 {

using fkda_prefill::bf16;
using fkda_prefill::cp_async16_zfill;
using fkda_prefill::cp_async_commit;
using fkda_prefill::cp_async_wait;
using fkda_prefill::bf16x2_bits_to_float2;
using fkda_prefill::ex2;
using fkda_prefill::ld_bf16x2;
using fkda_prefill::ldsm_x4;
using fkda_prefill::ldsm_x4_t;
using fkda_prefill::load_a;
using fkda_prefill::load_b_kn;
using fkda_prefill::load_b_nk;
using fkda_prefill::load_cu;
using fkda_prefill::mma_bf16;
using fkda_prefill::pack4;
using fkda_prefill::pack_bf16;
using fkda_prefill::rcp_ftz;
using fkda_prefill::rsqrt_ftz;
using fkda_prefill::split2;
using fkda_prefill::unpack4;

constexpr int kC = 16;         // chunk
constexpr int kK = 128;
constexpr int kV = 128;
constexpr int kThreads = 128;  // 4 warps
constexpr int kLdB = kK + 8;   // bf16 rows of 128 (+16 B: ldmatrix rows on distinct banks)
constexpr int kLdU = kV + 4;   // fp32 rows of U (the U^T fragment reads hit distinct banks)
constexpr int kLdS = kC + 8;   // bf16 16x16 matrices (Aqk, T): 48-byte rows
constexpr int kLdP = kC + 1;   // fp32 16x16 matrices (partials, L)
constexpr float kLog2e = 1.4426950408889634f;
// The range of G (log2 units) the factored operands take: exp2(116) is finite and exp2(-116) normal, with room for
// the low bf16 half of a split (2^-124); 16 bounded steps at lower_bound -5 reach 115.4
constexpr float kFactorRange = 116.f;

// Shared memory (bytes). The ring: 2 stages of q, k, v and the raw gate, bf16 [16][kLdB] each.
constexpr int kMat = kC * kLdB * 2;  // 4352
constexpr int kStage = 4 * kMat;
constexpr int kOffRing = 0;
// the chunk's operands, bf16 [16][kLdB]: Qg, Kg, Kn (hi and lo), Kd; then -W, the output staging
constexpr int kOffQh = kOffRing + 2 * kStage;
constexpr int kOffQl = kOffQh + kMat;
constexpr int kOffKh = kOffQl + kMat;
constexpr int kOffKl = kOffKh + kMat;
constexpr int kOffNh = kOffKl + kMat;
constexpr int kOffNl = kOffNh + kMat;
constexpr int kOffKd = kOffNl + kMat;
constexpr int kOffWn = kOffKd + kMat;
constexpr int kOffO = kOffWn + kMat;
constexpr int kOffU = kOffO + kMat;                    // fp32 [16][kLdU]
constexpr int kOffPart = kOffU + kC * kLdU * 4;        // fp32 [4 warps][16][kLdP]
constexpr int kOffL = kOffPart + 4 * kC * kLdP * 4;    // fp32 [16][kLdP]
constexpr int kOffA = kOffL + kC * kLdP * 4;           // bf16 [16][kLdS]
constexpr int kOffT = kOffA + kC * kLdS * 2;           // bf16 [16][kLdS]
constexpr int kOffGc = kOffT + kC * kLdS * 2;          // fp32 [128] exp2(G_C)
constexpr int kOffTot = kOffGc + kK * 4;               // fp32 [4][128] quarter-chunk gate sums
constexpr int kOffNrm = kOffTot + 4 * kK * 4;          // fp32 [32] q / k row scales
constexpr int kOffBeta = kOffNrm + 32 * 4;             // fp32 [16]
constexpr int kSmemBytes = kOffBeta + kC * 4;
static_assert(kOffU % 16 == 0 && kOffA % 16 == 0 && kOffT % 16 == 0 && kOffGc % 16 == 0, "alignment");
static_assert(2 * kSmemBytes <= 227 * 1024, "two CTAs an SM");
// The fallback (kCheck kernels) keeps the chunk's G, the beyond key groups' mask and a flag in the -W and output staging
// tiles, free from the operands' barrier to step F: fp32 [16][kLdGf] (16-byte rows 4 banks apart), 1 + 1 words
constexpr int kLdGf = kK + 4;
constexpr int kOffGf = kOffWn;
constexpr int kOffMask = kOffGf + kC * kLdGf * 4;
static_assert(kOffO == kOffWn + kMat && kOffMask + 2 * 4 <= kOffO + kMat && kOffGf % 16 == 0, "the fallback's scratch");

struct Args {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const bf16* g;
  const bf16* beta;
  const float* A_log;    // may be null (= 0)
  const float* dt_bias;  // may be null (= 0)
  const void* cu;
  int cu64;
  int N, H, HV, group;
  float lower_bound;
  float scale;
  int beta_logit;
  const void* init;  // [slots or N, HV, V, K] or null
  void* fin;         // may alias init (a pool updated in place)
  int fin_dense;     // 1: fin is [N, HV, V, K], indexed by sequence (kda_prefill_c16g.cu's copy for a pool in place)
  const int32_t* idx;
  int64_t num_slots;
  int64_t slot_stride;
  int null_slot0;
  bf16* out;  // [T, HV, V]
  int pieces;  // this call's pieces a sequence (grid z), 1..kPieces (the binding picks it)
#if FKDA_PARAM_C16_SEQ_PIECES == 1
  int piece_chunks;  // (prefill_c16gm_*) a sequence's pieces from its own length: ceil(chunks / piece_chunks), <= pieces
#endif
#if FKDA_PARAM_C16_SEQ_PIECES == 1 || FKDA_PARAM_GUARD == 1
  int z_rotate;      // 1: grid layer z runs piece (z + 1) mod Z, so where the first layer alone fills a wave, pieces
                     // that walk (and can hand over) start in it, not only first pieces (which never walk); the
                     // two-CTA kernel reads it with seq pieces, the role split in every guarded module
#endif
#if FKDA_PARAM_GUARD == 1
  int* guard;  // set to 1 by a piece whose warm-up passes its limit (zeroed by the binding before the launch)
#endif
#if FKDA_PARAM_C16_FALLBACK == 1
  const int* run_if;  // (prefill_c16g_c16_*) non-null: run only where the word is set (the unsplit fallback launch)
#endif
};

// Pieces (record param 'pieces', default 1: one CTA walks a sequence's chunks, exact). With P > 1 the
// binding launches up to P CTAs a (sequence, head), as many as fill one wave of 2 CTAs an SM: piece p owns the
// chunks [p L, min(nch, (p + 1) L)), L = ceil(nch / P), and starts from a zero state at the latest chunk c_s before
// its first whose chunks' attenuation bounds sum to <= -24 (log2), or from the true initial state at chunk 0; the
// warm-up chunks store nothing. A chunk's bound is the sum over its tokens of the largest log2 decay over the keys:
// each token's transition (I - beta k k^T) Diag(alpha) has operator norm <= max alpha (unit keys, beta in (0, 1)),
// so the dropped state reaches the piece's first chunk attenuated below 2^-24 (csrc/prefill/README.md, "Piece
// split"). The piece that ends at nch writes the final state; checkpoints are refused anyway.
// At most 64 pieces: one H200 wave (264 CTAs) is 33 pieces at 8 sequences x heads, 22 at 12 (a cap of 16 left half
// the wave empty there), and a piece keeps >= 8 chunks at the routes' 8192 tokens a sequence.
#ifdef FKDA_PARAM_C16_PIECES  // a module that also holds chunk-64 kernels (FKDA_PARAM_PIECES is theirs)
constexpr int kPieces = FKDA_PARAM_C16_PIECES;
#else
constexpr int kPieces = FKDA_PARAM_PIECES;
#endif
static_assert(kPieces >= 1 && kPieces <= 64, "the fused kernel's pieces must be 1..64");
// CTAs an SM (launch bounds; the binding's piece count): the record's, or params.c16_min_blocks where the record's
// launch shape is other kernels' (prefill_c16g_*: the state pass's)
#ifdef FKDA_PARAM_C16_MIN_BLOCKS
constexpr int kMinBlocks = FKDA_PARAM_C16_MIN_BLOCKS;
#else
constexpr int kMinBlocks = FKDA_MIN_BLOCKS;
#endif
// Guard (FKDA_PARAM_GUARD 1, modules prefill_c16g_*: kda_prefill_c16g.cu): a piece whose warm-up would pass
// kGuardPct percent of its own length, at most kGuardMaxChunks (at least 2 chunks), sets *a.guard and stops, and
// every other piece stops at its next chunk once it sees the word set: the chunk-64 kernels launched after this one
// then do the whole call (they skip it while it is clear). The walk costs ~0.9 us a chunk walked at B1 H8 on an H100
// (4.7 us while each of a step's loads waited on its own), and a call whose warm-ups walk far back (a slowly decaying
// key) pays it whole before the hand-over: half a piece (the default, params.c16_guard_pct 50) where the fallback is
// the vt64 module of many items; a whole piece, capped at params.c16_guard_max_chunks (16: 256 tokens), where it is
// the unsplit chain of few items (vt16 / vt32). The cap keeps the walk short on gates whose warm-ups go far back
// (fla-init gates, B1 T32K H8: the chain 0.700 ms, the hand-over at 16 chunks 0.733, at 32 0.754, at a whole piece
// 0.774) while warm-ups of a few hundred tokens still split (the SGLang benchmark's gates: up to 160 tokens at B1
// T32K H8).
#ifdef FKDA_PARAM_C16_GUARD_PCT
constexpr int kGuardPct = FKDA_PARAM_C16_GUARD_PCT;
#else
constexpr int kGuardPct = 50;
#endif
static_assert(kGuardPct >= 1 && kGuardPct <= 400, "params.c16_guard_pct: 1..400 percent of a piece");
#ifdef FKDA_PARAM_C16_GUARD_MAX_CHUNKS
constexpr int kGuardMaxChunks = FKDA_PARAM_C16_GUARD_MAX_CHUNKS;
#else
constexpr int kGuardMaxChunks = 1 << 30;  // no cap
#endif
static_assert(kGuardMaxChunks >= 2, "params.c16_guard_max_chunks: at least 2 chunks");

template <typename ST>
__device__ __forceinline__ float2 ld_pair(const ST* p);
template <>
__device__ __forceinline__ float2 ld_pair<float>(const float* p) { return *reinterpret_cast<const float2*>(p); }
template <>
__device__ __forceinline__ float2 ld_pair<bf16>(const bf16* p) {
  return ld_bf16x2(p);
}
__device__ __forceinline__ void st_pair(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
__device__ __forceinline__ void st_pair(bf16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

// The elements a thread holds of a [2][NT][4] array of m16n8 accumulator fragments of its warp's 32 value
// rows (the state S: NT = 16 key tiles; vacc / oacc: NT = 2 token tiles): f(mt, n, e, v, c) for element e
// (e = 0, step, ..: step 2 visits the pairs e, e + 1) of m-tile mt, n-tile n, value row v, column c.
template <int NT, int kStep, typename F>
__device__ __forceinline__ void for_frag(int warp, int g, int tq, F&& f) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; e += kStep) f(mt, n, e, 32 * warp + 16 * mt + g + 8 * (e >> 1), 8 * n + 2 * tq + (e & 1));
}

// The tokens of chunk c of a sequence of len tokens (1..16 for a chunk that exists).
__device__ __forceinline__ int chunk_tokens(int64_t len, int c) {
  const int64_t left = len - int64_t(c) * kC;
  return static_cast<int>(left < kC ? left : kC);
}

// One key's per-step log2 decay before its multiplier mult, from the raw gate input, by gate mode (the prep's Log2Gate):
// bounded sigmoid_of_ex2(raw s + c), s = -ea log2(e), c = s dtb (mult = lower_bound log2(e)); softplus
// log2_softplus(raw s + c), s = log2(e), c = s dtb (mult = -ea); log: raw (mult = log2(e)).
template <int GATE>
__device__ __forceinline__ float gate_value(float raw, float s, float c) {
  if constexpr (GATE == 1) return fkda_prefill::sigmoid_of_ex2(fmaf(raw, s, c));
  else if constexpr (GATE == 0) return fkda_prefill::log2_softplus(fmaf(raw, s, c));
  else return raw;
}

// Step A's gate: the running sums of keys d4 .. d4 + 3 over the warp's tokens 4 warp .. 4 warp + 3 (gl[i] after token
// 4 warp + i; tokens >= nt add 0); returns the quarter's total. The fallback calls it again for the same bits.
template <int GATE>
__device__ __forceinline__ float4 gate_run(float4 (&gl)[4], const bf16* Gr, int warp, int d4, int nt, float s, float4 c,
                                           float mult) {
  float4 run = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = 4 * warp + i;
    const uint2 w = *reinterpret_cast<const uint2*>(Gr + t * kLdB + d4);
    const float2 r01 = bf16x2_bits_to_float2(w.x), r23 = bf16x2_bits_to_float2(w.y);
    const float m = t < nt ? mult : 0.f;
    run.x = fmaf(m, gate_value<GATE>(r01.x, s, c.x), run.x);
    run.y = fmaf(m, gate_value<GATE>(r01.y, s, c.y), run.y);
    run.z = fmaf(m, gate_value<GATE>(r23.x, s, c.z), run.z);
    run.w = fmaf(m, gate_value<GATE>(r23.y, s, c.w), run.w);
    gl[i] = run;
  }
  return run;
}

// The gate's constants of value head hv by gate mode (gate_value's s, and mult: a step's log2 decay is mult x the
// value), and its offsets c = s dt_bias of keys d4 .. d4 + 3.
template <int mode>
__device__ __forceinline__ void gate_scales(const Args& a, int hv, float& gs, float& mult) {
  const float ea = a.A_log ? __expf(a.A_log[hv]) : 1.f;
  gs = mode == 1 ? -ea * kLog2e : kLog2e;
  mult = mode == 1 ? a.lower_bound * kLog2e : mode == 0 ? -ea : kLog2e;
}
__device__ __forceinline__ float4 gate_offsets4(const Args& a, int hv, int d4, float gs) {
  if (!a.dt_bias) return make_float4(0.f, 0.f, 0.f, 0.f);
  const float* db = a.dt_bias + hv * kK + d4;
  return make_float4(gs * db[0], gs * db[1], gs * db[2], gs * db[3]);
}

// The range class of a thread's key group (keys d4 .. d4 + 3) from their G_C (softplus and bounded G fall monotonically,
// so G_C is the least): wide, some key beyond kFactorRange; ultra, beyond twice it (the elementwise fallback). Wide and
// not ultra takes the shifted anchor G_C / 2 (top of the file).
struct GroupRange {
  bool wide, ultra;
};
__device__ __forceinline__ GroupRange group_range(const float4& gcv) {
  const float mn = fminf(fminf(gcv.x, gcv.y), fminf(gcv.z, gcv.w));
  return GroupRange{!(mn >= -kFactorRange), !(mn >= -2.f * kFactorRange)};
}

// Whether a thread's quarter totals (keys d4 .. d4 + 3 over its warp's 4 tokens, gate_run's return) are each at least a
// quarter of the range down: G_C, the sum of four quarters, is then >= -kFactorRange (each partial sum of quarter_sums a
// multiple of -kFactorRange / 4 at the least, and rounding monotone), so no key of the group is wide for a gate whose G
// falls. A NaN total is not within.
__device__ __forceinline__ bool quarter_within_range(const float4& q) {
  constexpr float lim = -0.25f * kFactorRange;
  return q.x >= lim && q.y >= lim && q.z >= lim && q.w >= lim;
}

// From the quarters' gate totals (tot [4][128]): the sum of the quarters before warp's (base) and G_C (gcv) of keys
// d4 .. d4 + 3, in the same order of additions in every thread, so the last token's G is G_C bitwise.
__device__ __forceinline__ void quarter_sums(const float* tot, int warp, int d4, float4& base, float4& gcv) {
  float4 tq4[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) tq4[w] = *reinterpret_cast<const float4*>(tot + w * kK + d4);
  base = make_float4(0.f, 0.f, 0.f, 0.f);
  gcv = tq4[0];
#pragma unroll
  for (int w = 1; w < 4; ++w) {
    if (w == warp) base = gcv;
    gcv = make_float4(gcv.x + tq4[w].x, gcv.y + tq4[w].y, gcv.z + tq4[w].z, gcv.w + tq4[w].w);
  }
}

// The fallback's row i of L and Aqk (a chunk with key groups beyond kFactorRange: their Kn entries were stored as 0,
// so the factored partials (part, step C) hold the other groups' sums): the beyond groups' terms added elementwise in fp32
// from G in Gf (fp32 [16][kLdGf]), sum_d k_id k_jd exp2(G_id - G_jd) and sum_d q_id k_jd exp2(G_id - G_jd) for every
// j <= i (each exp2 <= 1 where the gate decays). A team of 16 lanes (l) takes the row, lane l the key groups l and
// l + 16 (4 keys each: bit g of mask, keys 4 g .. 4 g + 3), every column j an independent sum (the prep's
// diag_row_sums, NT columns); the team's lanes are summed by 4 xor steps in one fixed order and lane l keeps column l:
// L_il = beta_i (partial + the rows' l2norm scales x sum), Aqk_il = partial + scales x sum, zeros above the diagonal.
// With all (a log gate that rose beyond the range) every group, and the partials (whose Kn may be inf) are dropped.
template <int NT>
__device__ __forceinline__ void fallback_row(const bf16* Qs, const bf16* Ks, const float* Gf, uint32_t mask, bool all,
                                             const float* part, const float* nrm, const float* betas, float* Lf,
                                             bf16* Aq, int i, int l) {
  float sL[NT], sA[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) sL[t] = sA[t] = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int grp = l + 16 * h;
    if (all || ((mask >> grp) & 1u)) {
      const int d0 = 4 * grp;
      float qi[4], ki[4];
      unpack4(*reinterpret_cast<const uint2*>(Qs + i * kLdB + d0), qi);
      unpack4(*reinterpret_cast<const uint2*>(Ks + i * kLdB + d0), ki);
      const float4 gi = *reinterpret_cast<const float4*>(Gf + i * kLdGf + d0);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t <= i) {
          float kj[4];
          unpack4(*reinterpret_cast<const uint2*>(Ks + t * kLdB + d0), kj);
          const float4 gj = *reinterpret_cast<const float4*>(Gf + t * kLdGf + d0);
          const float x[4] = {kj[0] * ex2(gi.x - gj.x), kj[1] * ex2(gi.y - gj.y), kj[2] * ex2(gi.z - gj.z),
                              kj[3] * ex2(gi.w - gj.w)};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            sL[t] = fmaf(ki[e], x[e], sL[t]);
            sA[t] = fmaf(qi[e], x[e], sA[t]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
      sL[t] += __shfl_xor_sync(0xffffffffu, sL[t], o);
      sA[t] += __shfl_xor_sync(0xffffffffu, sA[t], o);
    }
  float vl = 0.f, va = 0.f;  // column l's sums (l < NT)
#pragma unroll
  for (int t = 0; t < NT; ++t)
    if (t == l) {
      vl = sL[t];
      va = sA[t];
    }
  float L = 0.f, A = 0.f;
  if (l <= i) {
    const float pl = all ? 0.f : part[i * kLdP + l] + part[2 * kC * kLdP + i * kLdP + l];
    const float pa = all ? 0.f : part[kC * kLdP + i * kLdP + l] + part[3 * kC * kLdP + i * kLdP + l];
    const float nkl = nrm[kC + l];
    L = l < i ? betas[i] * (pl + nrm[kC + i] * nkl * vl) : 0.f;
    A = pa + nrm[i] * nkl * va;
  }
  Lf[i * kLdP + l] = L;
  Aq[i * kLdS + l] = __float2bfloat16(A);
}

// A thread's part of a chunk's rows: for i = 0, 1 the row r = (tid + 128 i) / 16 and the 8 columns from c8, as
// element offsets from the chunk's first row (token t0) in the [T, H, 128] (q, k) and [T, HV, 128] (v, g, out)
// layouts. Computed once: a chunk's addresses are then its first row's (advanced by a constant a chunk) plus these.
// 32 bits: at most 15 x 128 heads (jit/supported.json) x 128 + 120 elements.
struct RowOffsets {
  int r[2];
  uint32_t hk[2], hv[2];
};
__device__ __forceinline__ RowOffsets row_offsets(const Args& a, int tid) {
  RowOffsets o;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int idx = tid + i * kThreads, c8 = (idx & 15) * 8;
    o.r[i] = idx >> 4;
    o.hk[i] = uint32_t(o.r[i] * a.H * kK + c8);
    o.hv[i] = uint32_t(o.r[i] * a.HV * kK + c8);
  }
  return o;
}

// Issue the cp.async loads of one chunk (rows >= nt zero-filled from row 0's address; row 0 of the chunk always
// exists). base_hk / base_hv: the element offsets of the chunk's first token, head hk / hv (K = V = 128).
__device__ __forceinline__ void load_chunk(uint8_t* stage, const Args& a, size_t base_hk, size_t base_hv, int nt,
                                           const RowOffsets& ro, int tid) {
  bf16* Qs = reinterpret_cast<bf16*>(stage);
  bf16* Ks = Qs + kC * kLdB;
  bf16* Vs = Ks + kC * kLdB;
  bf16* Gs = Vs + kC * kLdB;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int idx = tid + i * kThreads, r = ro.r[i], c8 = (idx & 15) * 8;
    const bool in = r < nt;
    const int bytes = in ? 16 : 0;
    const size_t ok = base_hk + (in ? ro.hk[i] : uint32_t(c8)), ov = base_hv + (in ? ro.hv[i] : uint32_t(c8));
    cp_async16_zfill(Qs + r * kLdB + c8, a.q + ok, bytes);
    cp_async16_zfill(Ks + r * kLdB + c8, a.k + ok, bytes);
    cp_async16_zfill(Vs + r * kLdB + c8, a.v + ov, bytes);
    cp_async16_zfill(Gs + r * kLdB + c8, a.g + ov, bytes);
  }
}

// The attenuation bounds of the kWalkStep chunks c, c - 1, ... (see kPieces; gate mode GATE; a chunk below 0 gets 0,
// never used), by the whole CTA (the same values in every thread): thread (kp, half) takes keys d2, d2 + 1 of tokens
// 8 half .. 8 half + 7 of each chunk from global memory; warps reduce the keys, red (32 floats a chunk of shared
// memory) the two warps of each half. Each chunk's sum runs over its tokens in order, as one chunk at a time would.
// Branch-free, so that a step waits for memory once: every load reads a valid row (a token past its chunk's end
// reads the sequence's first token, len > 0 while a piece walks) and is masked after it arrived. Under `if (t < nt)`
// each load sat on its own branch, the step waited for memory 32 times (~4.7 us a chunk walked, on an H100).
constexpr int kWalkStep = 4;
template <int GATE>
__device__ __forceinline__ void chunk_bounds(float (&b)[kWalkStep], const Args& a, int64_t bos, int64_t len, int c,
                                             int hv, float gs, float gc0, float gc1, float mult, int d2, int half,
                                             int lane, int warp, float* red) {
  int nts[kWalkStep];
  uint32_t raw[kWalkStep][8];
#pragma unroll
  for (int j = 0; j < kWalkStep; ++j) {
    const int cj = c - j;
    const int64_t t0 = bos + int64_t(cj) * kC;
    nts[j] = cj >= 0 ? chunk_tokens(len, cj) : 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = 8 * half + i;
      const int64_t row = t < nts[j] ? t0 + t : bos;
      raw[j][i] = *reinterpret_cast<const uint32_t*>(a.g + (size_t(row) * a.HV + hv) * kK + d2);
    }
  }
  float mx[kWalkStep][8];
#pragma unroll
  for (int j = 0; j < kWalkStep; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 x = bf16x2_bits_to_float2(raw[j][i]);
      const float m = fmaxf(mult * gate_value<GATE>(x.x, gs, gc0), mult * gate_value<GATE>(x.y, gs, gc1));
      mx[j][i] = 8 * half + i < nts[j] ? m : -INFINITY;
    }
#pragma unroll
  for (int j = 0; j < kWalkStep; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx[j][i] = fmaxf(mx[j][i], __shfl_xor_sync(0xffffffffu, mx[j][i], o));
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kWalkStep; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) red[32 * j + warp * 8 + i] = mx[j][i];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kWalkStep; ++j) {
    const float* r = red + 32 * j;
    float s = 0.f;
#pragma unroll
    for (int t = 0; t < kC; ++t) {
      const float m = fmaxf(r[(t >> 3) * 16 + (t & 7)], r[(t >> 3) * 16 + 8 + (t & 7)]);
      s = t < nts[j] ? s + m : s;
    }
    b[j] = s;
  }
  __syncthreads();  // red is read before the next step's maxima
}

// The chunk's steps, shared by kda_prefill_c16_kernel (4 warps doing every step) and the role-split kernel
// (kda_prefill_c16ws.cuh: a producer warpgroup's steps A..F, the consumer's G): each on its 128 threads (tid, warp,
// lane of the group), the same operations in the same order in both, so the same bits.

// Step A's row scales of q (times scale) and k (l2norm), and beta of the chunk's tokens (a logit through the sigmoid).
__device__ __forceinline__ void row_scales_and_beta(const bf16* Qs, const bf16* Ks, float* nrm, float* betas,
                                                    unsigned short bcur_bits, int nt, float scale, int beta_logit,
                                                    int tid) {
  const int r = tid >> 2, p = tid & 3;  // rows 0..15 q, 16..31 k; 4 lanes a row
  const bf16* row = (r < kC ? Qs + r * kLdB : Ks + (r - kC) * kLdB);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float f[8];
    fkda_prefill::unpack8(*reinterpret_cast<const uint4*>(row + (p + 4 * i) * 8), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) s = fmaf(f[e], f[e], s);
  }
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  if (p == 0) nrm[r] = rsqrt_ftz(s + 1e-6f) * (r < kC ? scale : 1.f);
  if (tid < kC) {
    const float bcur = __bfloat162float(__ushort_as_bfloat16(bcur_bits));
    betas[tid] = tid < nt ? (beta_logit ? 1.f / (1.f + __expf(-bcur)) : bcur) : 0.f;
  }
}

// Step B: the decayed operands (thread: keys d4 .. d4 + 3 of tokens 4 warp .. 4 warp + 3; 8-byte shared stores) from G
// (the warp's running sums gl over the quarters' totals tot). kCheck (every gate but the bounded one at lower_bound
// >= -5): wk, this thread's key group has a key beyond the range (G_C < -kFactorRange: softplus and bounded G fall
// monotonically, so G_C is the least). Within twice the range the group's operands of L and Aqk take the anchor
// s = G_C / 2 a key (Qg, Kg, Kn by exp2(G - s), exp2(s - G): within 2^116 again; Qh and Kh are restored to exp2(G) after
// step C, for W and the output); beyond it (ultra) its Kn entries are stored as 0 and the fallback adds its terms
// elementwise. out: (log gate, which may rise) some G of this thread's beyond the range while its group's G_C are not:
// the whole chunk elementwise.
template <int mode, bool kCheck>
__device__ __forceinline__ void decayed_operands(const float* tot, const float4 (&gl)[4], const float* nrm, const bf16* Qs,
                                                 const bf16* Ks, bf16* Qh, bf16* Ql, bf16* Kh, bf16* Kl, bf16* Nh, bf16* Nl,
                                                 bf16* Kd, float* gcs, int warp, int d4, bool& wk, bool& ultra, bool& out) {
  float4 base, gcv;
  quarter_sums(tot, warp, d4, base, gcv);
  float sh[4] = {0.f, 0.f, 0.f, 0.f};  // the anchor of each key's L / Aqk operands (0: the chunk start)
  if constexpr (kCheck) {
    const GroupRange gr = group_range(gcv);
    wk = gr.wide;
    ultra = gr.ultra;
    if (wk && !ultra) {
      sh[0] = 0.5f * gcv.x;
      sh[1] = 0.5f * gcv.y;
      sh[2] = 0.5f * gcv.z;
      sh[3] = 0.5f * gcv.w;
    }
  }
  const float ec[4] = {ex2(gcv.x), ex2(gcv.y), ex2(gcv.z), ex2(gcv.w)};
  if (warp == 0) *reinterpret_cast<float4*>(gcs + d4) = make_float4(ec[0], ec[1], ec[2], ec[3]);
  const float bs[4] = {base.x, base.y, base.z, base.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = 4 * warp + i;
    const float G[4] = {gl[i].x + bs[0], gl[i].y + bs[1], gl[i].z + bs[2], gl[i].w + bs[3]};
    if constexpr (mode == 2)
#pragma unroll
      for (int e = 0; e < 4; ++e) out |= !(G[e] <= kFactorRange) | (!(G[e] >= -kFactorRange) & !wk);
    const float nq = nrm[t], nk = nrm[kC + t];
    float q[4], k[4], qe[4], ke[4], kn[4], kd[4];
    unpack4(*reinterpret_cast<const uint2*>(Qs + t * kLdB + d4), q);
    unpack4(*reinterpret_cast<const uint2*>(Ks + t * kLdB + d4), k);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float ex = kCheck ? ex2(G[e] - sh[e]) : ex2(G[e]), ix = kCheck ? ex2(sh[e] - G[e]) : ex2(-G[e]);
      const float qx = q[e] * nq, kx = k[e] * nk;
      qe[e] = qx * ex;
      ke[e] = kx * ex;
      kn[e] = kx * ix;
      kd[e] = kn[e] * ec[e];  // (kCheck: taken again below where the group is beyond the range)
      if constexpr (kCheck) kn[e] = ultra ? 0.f : kn[e];
    }
    const int o = t * kLdB + d4;
    uint2 hi, lo;
    split2(qe[0], qe[1], hi.x, lo.x);
    split2(qe[2], qe[3], hi.y, lo.y);
    *reinterpret_cast<uint2*>(Qh + o) = hi;
    *reinterpret_cast<uint2*>(Ql + o) = lo;
    split2(ke[0], ke[1], hi.x, lo.x);
    split2(ke[2], ke[3], hi.y, lo.y);
    *reinterpret_cast<uint2*>(Kh + o) = hi;
    *reinterpret_cast<uint2*>(Kl + o) = lo;
    split2(kn[0], kn[1], hi.x, lo.x);
    split2(kn[2], kn[3], hi.y, lo.y);
    *reinterpret_cast<uint2*>(Nh + o) = hi;
    *reinterpret_cast<uint2*>(Nl + o) = lo;
    *reinterpret_cast<uint2*>(Kd + o) = pack4(kd);
  }
  if (kCheck && __any_sync(0xffffffffu, wk | out)) {  // Kd = k exp2(G_C - G) in one exponent (shifted, or inf)
    const float gc[4] = {gcv.x, gcv.y, gcv.z, gcv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = 4 * warp + i;
      const float G[4] = {gl[i].x + bs[0], gl[i].y + bs[1], gl[i].z + bs[2], gl[i].w + bs[3]};
      const float nk = nrm[kC + t];
      float k[4], kd[4];
      unpack4(*reinterpret_cast<const uint2*>(Ks + t * kLdB + d4), k);
#pragma unroll
      for (int e = 0; e < 4; ++e) kd[e] = k[e] * nk * ex2(gc[e] - G[e]);
      *reinterpret_cast<uint2*>(Kd + t * kLdB + d4) = pack4(kd);
    }
  }
}

// Step C: L and Aqk partials: warp w takes matrix w & 1 (0: Kg Kn^T, 1: Qg Kn^T) over the key half w >> 1, in split bf16
// (hi hi + hi lo + lo hi), into part [4 warps][16][kLdP].
__device__ __forceinline__ void lqk_partials(const bf16* Qh, const bf16* Ql, const bf16* Kh, const bf16* Kl, const bf16* Nh,
                                             const bf16* Nl, float* part, int warp, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  const bf16* Ah = (warp & 1) ? Qh : Kh;
  const bf16* Al = (warp & 1) ? Ql : Kl;
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int k0 = 64 * (warp >> 1) + 16 * s;
    uint32_t ah[4], al[4], bh[4], bl[4];
    load_a(ah, Ah, kLdB, 0, k0, lane);
    load_a(al, Al, kLdB, 0, k0, lane);
    load_b_nk(bh, Nh, kLdB, 0, k0, lane);
    load_b_nk(bl, Nl, kLdB, 0, k0, lane);
    mma_bf16(acc[0], ah, bh);
    mma_bf16(acc[1], ah, bh + 2);
    mma_bf16(acc[0], ah, bl);
    mma_bf16(acc[1], ah, bl + 2);
    mma_bf16(acc[0], al, bh);
    mma_bf16(acc[1], al, bh + 2);
  }
  float* P = part + warp * kC * kLdP;
#pragma unroll
  for (int nn = 0; nn < 2; ++nn)
#pragma unroll
    for (int e = 0; e < 4; ++e) P[(g + 8 * (e >> 1)) * kLdP + 8 * nn + 2 * tq + (e & 1)] = acc[nn][e];
}

// Step D (every key factored): L (strictly lower, times beta of the row; fp32) and Aqk (lower with the diagonal; bf16)
// from the two key halves' partials, added in warp order. Select, never multiply: above the diagonal the sums may be huge.
__device__ __forceinline__ void l_and_aqk(const float* part, const float* betas, float* Lf, bf16* Aq, int tid) {
  const int m = tid >> 6, e0 = (tid & 63) * 4, i = e0 >> 4, j0 = e0 & 15;
  const float* P0 = part + m * kC * kLdP + i * kLdP;
  const float* P1 = part + (m + 2) * kC * kLdP + i * kLdP;
  if (m == 0) {
    const float b = betas[i];
#pragma unroll
    for (int e = 0; e < 4; ++e) Lf[i * kLdP + j0 + e] = j0 + e < i ? b * (P0[j0 + e] + P1[j0 + e]) : 0.f;
  } else {
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const float x0 = j0 + e <= i ? P0[j0 + e] + P1[j0 + e] : 0.f;
      const float x1 = j0 + e + 1 <= i ? P0[j0 + e + 1] + P1[j0 + e + 1] : 0.f;
      *reinterpret_cast<uint32_t*>(Aq + i * kLdS + j0 + e) = pack_bf16(x0, x1);
    }
  }
}

// The fallback (kCheck kernels: a chunk with key groups beyond kFactorRange) around steps B..D, on the 128 threads of a
// group (kda_prefill_c16_kernel, a role-split producer), the same operations in both. Gf (fp32 [16][kLdGf]) and fb_mask
// (2 words) are scratch that the factored steps leave alone from step A to the end of step D.
// Step B's marks: fb_mask[0], the key groups taken elementwise (bit g: group g is ultra); fb_mask[1] (log gate, cleared
// in step A) set where some G rose beyond the range. The caller ORs wk | out over its threads after them: the chunk
// takes the fallback.
template <int mode>
__device__ __forceinline__ void fallback_marks(uint32_t* fb_mask, bool ultra, bool out, int warp, int lane) {
  if (warp == 0) {  // every warp holds G_C of all 128 keys; warp 0 writes the groups taken elementwise (bit lane)
    const uint32_t m = __ballot_sync(0xffffffffu, ultra);
    if (lane == 0) fb_mask[0] = m;
  }
  if (mode == 2 && out) fb_mask[1] = 1;
}

// Step C's part of the fallback: whether the chunk's rows are taken elementwise (some group ultra, or a log gate that
// rose), and if so (fallback_gates) the chunk's G to Gf, as step B computed it.
template <int mode>
__device__ __forceinline__ bool fallback_elementwise(bool fallback, const uint32_t* fb_mask) {
  return fallback && (fb_mask[0] != 0 || (mode == 2 && fb_mask[1] != 0));
}
template <int mode>
__device__ __forceinline__ void fallback_gates(float* Gf, const bf16* Gr, const float* tot, int warp, int d4, int nt,
                                               float gs, float4 gk, float mult) {
  float4 glf[4], base, gcv;
  gate_run<mode>(glf, Gr, warp, d4, nt, gs, gk, mult);
  quarter_sums(tot, warp, d4, base, gcv);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    *reinterpret_cast<float4*>(Gf + (4 * warp + i) * kLdGf + d4) =
        make_float4(glf[i].x + base.x, glf[i].y + base.y, glf[i].z + base.z, glf[i].w + base.w);
}

// Step D's part of the fallback (a chunk that takes it), before L and Aqk: Qh and Kh of this thread's shifted group back
// to exp2(G), as step B makes them (step C read them shifted).
template <int mode>
__device__ __forceinline__ void fallback_restore(const float* tot, const bf16* Gr, const bf16* Qs, const bf16* Ks,
                                                 const float* nrm, bf16* Qh, bf16* Kh, int warp, int d4, int nt,
                                                 float gs, float4 gk, float mult) {
  float4 base, gcv;
  quarter_sums(tot, warp, d4, base, gcv);
  const GroupRange gr = group_range(gcv);
  if (gr.wide && !gr.ultra) {
    float4 glf[4];
    gate_run<mode>(glf, Gr, warp, d4, nt, gs, gk, mult);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = 4 * warp + i, o = t * kLdB + d4;
      const float G[4] = {glf[i].x + base.x, glf[i].y + base.y, glf[i].z + base.z, glf[i].w + base.w};
      const float nq = nrm[t], nk = nrm[kC + t];
      float q[4], k[4];
      unpack4(*reinterpret_cast<const uint2*>(Qs + o), q);
      unpack4(*reinterpret_cast<const uint2*>(Ks + o), k);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float ex = ex2(G[e]);
        q[e] = q[e] * nq * ex;
        k[e] = k[e] * nk * ex;
      }
      *reinterpret_cast<uint2*>(Qh + o) = pack4(q);
      *reinterpret_cast<uint2*>(Kh + o) = pack4(k);
    }
  }
}

// Step D's elementwise rows (fallback_row): team p (16 lanes) takes the rows p and 15 - p, 17 columns j <= i whatever p.
template <int mode>
__device__ __forceinline__ void fallback_rows(const bf16* Qs, const bf16* Ks, const float* Gf, const uint32_t* fb_mask,
                                              const float* part, const float* nrm, const float* betas, float* Lf,
                                              bf16* Aq, int tid) {
  const uint32_t m = fb_mask[0];
  const bool all = mode == 2 && fb_mask[1] != 0;
  const int p = tid >> 4, l = tid & 15;
  fallback_row<8>(Qs, Ks, Gf, m, all, part, nrm, betas, Lf, Aq, p, l);
  fallback_row<16>(Qs, Ks, Gf, m, all, part, nrm, betas, Lf, Aq, 15 - p, l);
}

// Step E: T = (I + L)^-1 Diag(beta): lane j (< 16) of the calling warp solves column j by forward substitution.
__device__ __forceinline__ void solve_t(const float* Lf, const float* betas, bf16* Tm, int lane) {
  if (lane < kC) {
    const int j = lane;
    float x[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      float s = i == j ? 1.f : 0.f;
#pragma unroll
      for (int k = 0; k < i; ++k) s = fmaf(-Lf[i * kLdP + k], x[k], s);
      x[i] = s;
    }
    const float bj = betas[j];
#pragma unroll
    for (int i = 0; i < kC; ++i) Tm[i * kLdS + j] = __float2bfloat16(x[i] * bj);
  }
}

// Step F: W = T Kg (stored negated: V'^T starts from U^T and adds S (-W)^T) and U = T V; warp w takes columns
// 32 w .. 32 w + 31.
__device__ __forceinline__ void w_and_u(const bf16* Tm, const bf16* Kh, const bf16* Vs, bf16* Wn, float* Uf, int warp,
                                        int lane) {
  const int g = lane >> 2, tq = lane & 3;
  uint32_t at[4];
  load_a(at, Tm, kLdS, 0, 0, lane);
#pragma unroll
  for (int np = 0; np < 2; ++np) {
    const int n0 = 32 * warp + 16 * np;
    uint32_t bk[4], bv[4];
    load_b_kn(bk, Kh, kLdB, 0, n0, lane);
    load_b_kn(bv, Vs, kLdB, 0, n0, lane);
    float w[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float u[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    mma_bf16(w[0], at, bk);
    mma_bf16(w[1], at, bk + 2);
    mma_bf16(u[0], at, bv);
    mma_bf16(u[1], at, bv + 2);
#pragma unroll
    for (int nn = 0; nn < 2; ++nn)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = g + 8 * h, col = n0 + 8 * nn + 2 * tq;
        *reinterpret_cast<uint32_t*>(Wn + row * kLdB + col) = pack_bf16(-w[nn][2 * h], -w[nn][2 * h + 1]);
        *reinterpret_cast<float2*>(Uf + row * kLdU + col) = make_float2(u[nn][2 * h], u[nn][2 * h + 1]);
      }
  }
}

// Step G: the ordered part, the state S in registers (warp w: value rows 32 w .. 32 w + 31): V'^T = U^T + S (-W)^T,
// O^T = S Qg^T + V'^T Aqk^T (staged bf16 in Os), S <- S Diag(exp2(G_C)) + V'^T Kd.
__device__ __forceinline__ void state_step(float (&S)[2][16][4], const float* Uf, const bf16* Wn, const bf16* Qh,
                                           const bf16* Aq, const float* gcs, const bf16* Kd, bf16* Os, int warp, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  float vacc[2][2][4], oacc[2][2][4];
  for_frag<2, 1>(warp, g, tq, [&](int mt, int nn, int e, int v, int t) {
    vacc[mt][nn][e] = Uf[t * kLdU + v];
    oacc[mt][nn][e] = 0.f;
  });
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t bw[4], bq[4];
    load_b_nk(bw, Wn, kLdB, 0, 16 * j, lane);
    load_b_nk(bq, Qh, kLdB, 0, 16 * j, lane);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      uint32_t as[4];
      as[0] = pack_bf16(S[mt][2 * j][0], S[mt][2 * j][1]);
      as[1] = pack_bf16(S[mt][2 * j][2], S[mt][2 * j][3]);
      as[2] = pack_bf16(S[mt][2 * j + 1][0], S[mt][2 * j + 1][1]);
      as[3] = pack_bf16(S[mt][2 * j + 1][2], S[mt][2 * j + 1][3]);
      mma_bf16(vacc[mt][0], as, bw);
      mma_bf16(vacc[mt][1], as, bw + 2);
      mma_bf16(oacc[mt][0], as, bq);
      mma_bf16(oacc[mt][1], as, bq + 2);
    }
  }
  // V'^T as A fragments (tokens 0-7 and 8-15 are the two k halves)
  uint32_t vp[2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    vp[mt][0] = pack_bf16(vacc[mt][0][0], vacc[mt][0][1]);
    vp[mt][1] = pack_bf16(vacc[mt][0][2], vacc[mt][0][3]);
    vp[mt][2] = pack_bf16(vacc[mt][1][0], vacc[mt][1][1]);
    vp[mt][3] = pack_bf16(vacc[mt][1][2], vacc[mt][1][3]);
  }
  {
    uint32_t ba[4];
    load_b_nk(ba, Aq, kLdS, 0, 0, lane);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      mma_bf16(oacc[mt][0], vp[mt], ba);
      mma_bf16(oacc[mt][1], vp[mt], ba + 2);
    }
  }
  for_frag<2, 1>(warp, g, tq, [&](int mt, int nn, int e, int v, int t) {
    Os[t * kLdB + v] = __float2bfloat16(oacc[mt][nn][e]);
  });
  // S <- S Diag(exp(G_C)) + V'^T Kd
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const float2 ec = *reinterpret_cast<const float2*>(gcs + 8 * nt + 2 * tq);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      S[mt][nt][0] *= ec.x;
      S[mt][nt][1] *= ec.y;
      S[mt][nt][2] *= ec.x;
      S[mt][nt][3] *= ec.y;
    }
  }
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    uint32_t bk[4];
    load_b_kn(bk, Kd, kLdB, 0, 16 * p, lane);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      mma_bf16(S[mt][2 * p], vp[mt], bk);
      mma_bf16(S[mt][2 * p + 1], vp[mt], bk + 2);
    }
  }
}

// The kernel's gate (template parameter GATE): the GateMode values, softplus 0, bounded 1, log 2, and kBoundedAnyBound,
// the bounded gate below lower_bound -5. Only GATE 1 (the binding sends it lower_bound >= -5) is known to keep every
// chunk in the factored range; the others check each chunk and may take the fallback (kCheck).
constexpr int kBoundedAnyBound = 3;
// A GATE's gate_value formula (kBoundedAnyBound computes the bounded one) and whether its chunks are checked against the
// factored range (every GATE but 1); kda_prefill_c16_kernel's and the role split's.
template <int GATE>
constexpr int kGateMode = GATE == kBoundedAnyBound ? 1 : GATE;
template <int GATE>
constexpr bool kGateChecked = GATE != 1;

template <typename ST, int GATE>
__global__ void __launch_bounds__(kThreads, kMinBlocks) kda_prefill_c16_kernel(const Args a) {
  fkda::begin_dependent_grid();
#if FKDA_PARAM_C16_FALLBACK == 1  // the guard's fallback launch: the split before handed the call over, or it is done
  if (a.run_if != nullptr && *reinterpret_cast<const volatile int*>(a.run_if) == 0) return;
#endif
#if FKDA_PARAM_GUARD == 1  // a piece of a later wave that starts once the word is set stops before its warm-up walk
  if (a.guard != nullptr && *reinterpret_cast<const volatile int*>(a.guard) != 0) return;
#endif
  constexpr int mode = kGateMode<GATE>;
  constexpr bool kCheck = kGateChecked<GATE>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
  const int hv = blockIdx.x, n = blockIdx.y;
  const int hk = a.group == 1 ? hv : hv / a.group;
  const int64_t bos = load_cu(a.cu, a.cu64, n), len = load_cu(a.cu, a.cu64, n + 1) - bos;

  bf16* Qh = reinterpret_cast<bf16*>(smem + kOffQh);
  bf16* Ql = reinterpret_cast<bf16*>(smem + kOffQl);
  bf16* Kh = reinterpret_cast<bf16*>(smem + kOffKh);
  bf16* Kl = reinterpret_cast<bf16*>(smem + kOffKl);
  bf16* Nh = reinterpret_cast<bf16*>(smem + kOffNh);
  bf16* Nl = reinterpret_cast<bf16*>(smem + kOffNl);
  bf16* Kd = reinterpret_cast<bf16*>(smem + kOffKd);
  bf16* Wn = reinterpret_cast<bf16*>(smem + kOffWn);
  bf16* Os = reinterpret_cast<bf16*>(smem + kOffO);
  float* Uf = reinterpret_cast<float*>(smem + kOffU);
  float* part = reinterpret_cast<float*>(smem + kOffPart);
  float* Lf = reinterpret_cast<float*>(smem + kOffL);
  bf16* Aq = reinterpret_cast<bf16*>(smem + kOffA);
  bf16* Tm = reinterpret_cast<bf16*>(smem + kOffT);
  float* gcs = reinterpret_cast<float*>(smem + kOffGc);
  float* tot = reinterpret_cast<float*>(smem + kOffTot);
  float* nrm = reinterpret_cast<float*>(smem + kOffNrm);
  float* betas = reinterpret_cast<float*>(smem + kOffBeta);
  uint32_t* fb_mask = reinterpret_cast<uint32_t*>(smem + kOffMask);  // (kCheck) the fallback's key groups, [1]: all

  // the state slot (a padding row reads and writes nothing; its outputs run from a zero state)
  int64_t slot = n;
  bool pad = false;
  if (a.idx) {
    const int s = a.idx[n];
    slot = s;
    pad = s < 0 || s >= a.num_slots || (a.null_slot0 && s == 0);
  }
  const size_t head = size_t(slot) * size_t(a.slot_stride) + size_t(hv) * kV * kK;

  // gate constants of this thread's 4 keys d4 .. d4 + 3 (steps A and B: warp w takes tokens 4 w .. 4 w + 3, lane the
  // keys): a step's log2 decay is mult * gate_value(raw, gs, gk)
  const int d4 = 4 * lane;
  float gs, mult;
  gate_scales<mode>(a, hv, gs, mult);
  const float4 gk = gate_offsets4(a, hv, d4, gs);

  // the chunks this CTA stores [cb, ce), the first it runs (cs <= cb), whether it writes the final state
  const int nch = static_cast<int>((len + kC - 1) / kC);
  int cb = 0, ce = nch, cs = 0;
  bool writer = true;
  if constexpr (kPieces > 1) {
#if FKDA_PARAM_C16_SEQ_PIECES == 1  // mixed lengths: a long sequence takes more pieces than a short one
    const int own = min(a.pieces, max(1, (nch + a.piece_chunks - 1) / a.piece_chunks));
    const int p = (static_cast<int>(blockIdx.z) + a.z_rotate) % a.pieces;
#else
    const int own = a.pieces;
    const int p = blockIdx.z;
#endif
    const int per = (nch + own - 1) / own;
    cb = min(nch, p * per);
    ce = min(nch, cb + per);
    if (p > 0 && cb >= ce) return;  // CTA-uniform: no chunk (piece 0 of an empty sequence writes its state)
    writer = ce == nch;
    cs = cb;
    // chunk_bounds' own mapping: thread (kp, half) takes keys d2, d2 + 1 of tokens 8 half .. 8 half + 7
    const int d2 = 2 * (tid & 63), half = tid >> 6;
    const float gc0 = a.dt_bias ? gs * a.dt_bias[hv * kK + d2] : 0.f, gc1 = a.dt_bias ? gs * a.dt_bias[hv * kK + d2 + 1] : 0.f;
    // the walk: chunk cs - 1 added while the sum is above -24, kWalkStep chunks' bounds computed at a time (the same
    // chunks and sums as one at a time; up to kWalkStep - 1 computed and not used at its end)
    float sum = 0.f;
#if FKDA_PARAM_GUARD == 1
    // warm-up chunks before the hand-over
    const int limit = max(2, min(kGuardMaxChunks, kGuardPct == 50 ? per / 2 : per * kGuardPct / 100));
#endif
    while (cs > 0 && sum > -24.f) {
      float b[kWalkStep];
      chunk_bounds<mode>(b, a, bos, len, cs - 1, hv, gs, gc0, gc1, mult, d2, half, lane, warp, part);
#pragma unroll
      for (int j = 0; j < kWalkStep; ++j) {
        if (!(cs > 0 && sum > -24.f)) break;  // CTA-uniform (every thread holds the same sums)
#if FKDA_PARAM_GUARD == 1
        if (cb - cs >= limit) {  // CTA-uniform: the chunk-64 kernels after this one take the call
          if (tid == 0) *reinterpret_cast<volatile int*>(a.guard) = 1;
          return;
        }
#endif
        --cs;
        sum += b[j];
      }
    }
  }
  const ST* src = a.init && !pad && cs == 0 ? static_cast<const ST*>(a.init) + head : nullptr;
  const size_t fin_at = a.fin_dense ? (size_t(n) * a.HV + hv) * kV * kK : head;
  ST* dst = a.fin && !pad && writer ? static_cast<ST*>(a.fin) + fin_at : nullptr;

  // chunk c lives in ring stage c & 1 (a piece's first chunk cs may be odd). Element offsets of chunk cs's first
  // token at head hk ([T, H, 128]) and hv ([T, HV, 128]; also beta's [T, HV] index), advanced by a chunk each step
  const RowOffsets ro = row_offsets(a, tid);
  const int64_t tcs = bos + int64_t(cs) * kC;
  size_t base_hk = (size_t(tcs) * a.H + hk) * kK, base_hv = (size_t(tcs) * a.HV + hv) * kK;
  size_t base_b = size_t(tcs) * a.HV + hv;
  const size_t step_hk = size_t(kC) * a.H * kK, step_hv = size_t(kC) * a.HV * kK, step_b = size_t(kC) * a.HV;
  if (cs < ce) load_chunk(smem + kOffRing + (cs & 1) * kStage, a, base_hk, base_hv, chunk_tokens(len, cs), ro, tid);
  cp_async_commit();

  // S[mt][nt][e]: value row v = 32 warp + 16 mt + g + 8 (e >> 1), key d = 8 nt + 2 tq + (e & 1)
  float S[2][16][4];
  for_frag<16, 2>(warp, g, tq, [&](int mt, int nt, int e, int v, int d) {
    const float2 x = src ? ld_pair<ST>(src + size_t(v) * kK + d) : make_float2(0.f, 0.f);
    S[mt][nt][e] = x.x;
    S[mt][nt][e + 1] = x.y;
  });

  // beta of the next chunk's token tid, as its raw bf16 bits: converted where it is used (step A), so the global load
  // is waited for a whole chunk later, not at the end of the step that issued it
  const unsigned short* beta_bits = reinterpret_cast<const unsigned short*>(a.beta);
  unsigned short bnext = 0;
  if (cs < ce && tid < kC && int64_t(cs) * kC + tid < len) bnext = beta_bits[base_b + size_t(tid) * a.HV];
  bool stopped = false;  // (guarded modules) another piece handed the call to the chunk-64 kernels
#if FKDA_PARAM_GUARD == 1
  int guard_seen = 0;  // the guard word as thread 0 read it a chunk earlier: the load's latency hides behind a chunk
#endif

#pragma unroll 1
  for (int c = cs; c < ce; ++c) {
    const int nt = chunk_tokens(len, c);
    uint8_t* stage = smem + kOffRing + (c & 1) * kStage;
    const bf16* Qs = reinterpret_cast<const bf16*>(stage);
    const bf16* Ks = Qs + kC * kLdB;
    const bf16* Vs = Ks + kC * kLdB;
    const bf16* Gr = Vs + kC * kLdB;
    const unsigned short bcur_bits = bnext;
    const size_t out_hv = base_hv;  // chunk c's first token, head hv (the output rows' layout is v's)
    if (c + 1 < ce) {  // CTA-uniform: the next chunk's loads, in flight during this chunk
      const int nt1 = chunk_tokens(len, c + 1);
      base_hk += step_hk;
      base_hv += step_hv;
      base_b += step_b;
      load_chunk(smem + kOffRing + ((c + 1) & 1) * kStage, a, base_hk, base_hv, nt1, ro, tid);
      bnext = 0;
      if (tid < nt1) bnext = beta_bits[base_b + size_t(tid) * a.HV];
    }
    cp_async_commit();
    cp_async_wait<1>();
    // chunk c's inputs are in the ring; the last chunk is done with every scratch area
#if FKDA_PARAM_GUARD == 1
    if (__syncthreads_or(guard_seen)) {
      stopped = true;
      break;
    }
    // (no guard word: the binding's unsplit launch, nothing to hand over)
    if (tid == 0 && a.guard != nullptr) guard_seen = *reinterpret_cast<const volatile int*>(a.guard);
#else
    __syncthreads();
#endif

    // ---- A. row scales of q (times scale) and k, beta, the gate's running sums of each quarter (warp w: tokens 4 w ..)
    row_scales_and_beta(Qs, Ks, nrm, betas, bcur_bits, nt, a.scale, a.beta_logit, tid);
    float4 gl[4];  // the running sums of keys d4 .. d4 + 3 over the warp's 4 tokens
    *reinterpret_cast<float4*>(tot + warp * kK + d4) = gate_run<mode>(gl, Gr, warp, d4, nt, gs, gk, mult);
    if (mode == 2 && tid == 0) fb_mask[1] = 0;  // (log gate) set in step B where some G rose beyond the range
    __syncthreads();

    // ---- B. the decayed operands (decayed_operands: wk / ultra / out, the key groups beyond the factored range)
    bool wk = false, ultra = false, out = false;
    decayed_operands<mode, kCheck>(tot, gl, nrm, Qs, Ks, Qh, Ql, Kh, Kl, Nh, Nl, Kd, gcs, warp, d4, wk, ultra, out);
    // the CTA's form for this chunk's L and Aqk: factored on tensor cores, with the fallback for the keys beyond the range
    bool fallback = false;
    if constexpr (kCheck) {
      fallback_marks<mode>(fb_mask, ultra, out, warp, lane);
      fallback = __syncthreads_or(wk | out);
    } else {
      __syncthreads();
    }

    // ---- C. L and Aqk partials (lqk_partials). Elementwise groups: also the chunk's G to Gf, as step B computed it
    const bool elementwise = fallback_elementwise<mode>(fallback, fb_mask);
    if (elementwise) fallback_gates<mode>(reinterpret_cast<float*>(smem + kOffGf), Gr, tot, warp, d4, nt, gs, gk, mult);
    lqk_partials(Qh, Ql, Kh, Kl, Nh, Nl, part, warp, lane);
    __syncthreads();

    // ---- D. L (strictly lower, times beta of the row; fp32) and Aqk (lower with the diagonal; bf16): l_and_aqk, or the
    // elementwise fallback's rows
    if (fallback) fallback_restore<mode>(tot, Gr, Qs, Ks, nrm, Qh, Kh, warp, d4, nt, gs, gk, mult);
    if (elementwise) {
      fallback_rows<mode>(Qs, Ks, reinterpret_cast<const float*>(smem + kOffGf), fb_mask, part, nrm, betas, Lf, Aq, tid);
    } else {
      l_and_aqk(part, betas, Lf, Aq, tid);
    }
    __syncthreads();

    // ---- E. T = (I + L)^-1 Diag(beta): lane j of warp 0 solves column j by forward substitution
    if (warp == 0) solve_t(Lf, betas, Tm, lane);
    __syncthreads();

    // ---- F. W = T Kg (stored negated) and U = T V
    w_and_u(Tm, Kh, Vs, Wn, Uf, warp, lane);
    __syncthreads();

    // ---- G. the ordered part, the state in registers
    state_step(S, Uf, Wn, Qh, Aq, gcs, Kd, Os, warp, lane);
    __syncthreads();  // the output rows are staged

    // ---- H. the chunk's output rows (16-byte stores, 256 B a row)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int idx = tid + i * kThreads, r = ro.r[i], c8 = (idx & 15) * 8;
      if (r < nt && c >= cb)  // (a warm-up chunk stores nothing)
        *reinterpret_cast<uint4*>(a.out + out_hv + ro.hv[i]) = *reinterpret_cast<const uint4*>(Os + r * kLdB + c8);
    }
  }
  cp_async_wait<0>();

  if (dst && !stopped) {
    for_frag<16, 2>(warp, g, tq, [&](int mt, int nt, int e, int v, int d) {
      st_pair(dst + size_t(v) * kK + d, S[mt][nt][e], S[mt][nt][e + 1]);
    });
  }
}

// The guarded split on a pool updated in place (kda_prefill_c16g.cu): its pieces wrote each (sequence, head)'s final
// state to the dense copy a.fin ([N, HV, V, K]) so that no piece reads a slot another has already stored; this kernel,
// after the chunk-64 kernels in the stream, moves the copy into the pool (`pool`, slots as the call's) unless the guard
// word is set (then the chunk-64 kernels did the whole call on the pool). One CTA a (value head, sequence).
#if FKDA_PARAM_GUARD == 1
constexpr int kCommitThreads = 256;
template <typename ST>
__global__ void __launch_bounds__(kCommitThreads) kda_prefill_c16_commit_kernel(const Args a, ST* pool) {
  fkda::begin_dependent_grid();  // the fused kernel's copy and the chunk-64 kernels' verdict are complete
  if (*reinterpret_cast<const volatile int*>(a.guard) != 0) return;
  const int hv = blockIdx.x, n = blockIdx.y;
  int64_t slot = n;
  if (a.idx) {
    const int s = a.idx[n];
    if (s < 0 || s >= a.num_slots || (a.null_slot0 && s == 0)) return;  // a padding row: nothing written
    slot = s;
  }
  // element pairs, as the fused kernel stores them (st_pair: the pool's slots are pair-aligned, nothing more)
  using Pair = typename std::conditional<sizeof(ST) == 4, float2, uint32_t>::type;
  const Pair* src = reinterpret_cast<const Pair*>(static_cast<const ST*>(a.fin) + (size_t(n) * a.HV + hv) * kV * kK);
  Pair* dst = reinterpret_cast<Pair*>(pool + size_t(slot) * size_t(a.slot_stride) + size_t(hv) * kV * kK);
  for (int i = threadIdx.x; i < kV * kK / 2; i += kCommitThreads) dst[i] = src[i];
}
#endif

}  // namespace fkda_c16
