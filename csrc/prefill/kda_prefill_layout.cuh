// KDA prefill on sm_90a: the chunked (WY / UT) form of docs DESIGN.md 2b, in two kernels (the
// chunk preparation, kda_prefill_prep.cuh; the ordered state pass, kda_prefill_state.cuh). This
// file holds what both share: the sizes, the workspace slot layout that one writes and the other
// reads, the state pass's arguments, and the small PTX / fragment helpers.
//
// Chunk slots: sequence n owns slots floor(cu[n]/64) + n + c, c < ceil(len_n/64). These never
// overlap and are < floor(T/64) + N, so a CTA finds its (sequence, chunk) by a binary search of
// cu_seqlens on the device (no host copy) and slots in the gaps exit at once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/bulk_copy.cuh"
#include "common/grid_dependency.cuh"

namespace fkda_prefill {

using bf16 = __nv_bfloat16;

constexpr int kC = 64;   // chunk
constexpr int kK = 128;  // key head dim
constexpr int kV = 128;  // value head dim

constexpr int kLdB = kK + 8;       // bf16 rows of 128 (+16 B so ldmatrix rows hit distinct banks)
constexpr int kLdG = kK + 4;       // fp32 rows of G
constexpr int kLdM = kC + 4;       // 64x64 matrices of fp32 or split words (L, X): 16-byte rows
constexpr int kLdX = kC + 8;       // bf16 64x64 matrices

// One workspace slot per (chunk slot, value head), laid out exactly as the state pass keeps it in
// shared memory (padded rows), so it moves with one bulk copy: [W | Qg | Kd] bf16 [64][kLdB],
// Aqk bf16 [64][kLdX], exp(G_C) fp32 [128], then U in 16-column blocks bf16 [8][64][kLdU16]
// (a V tile of the state pass is a run of whole blocks). U's rows are not padded: it is only read
// and written as 4-byte pairs (2-way bank conflicts), and padding made it a third of every slot's
// bytes that carry nothing.
constexpr int kLdU16 = 16;
constexpr size_t kWsW = 0;
constexpr size_t kWsQg = kWsW + size_t(kC) * kLdB * 2;
constexpr size_t kWsKd = kWsQg + size_t(kC) * kLdB * 2;
constexpr size_t kWsA = kWsKd + size_t(kC) * kLdB * 2;
constexpr size_t kWsGc = kWsA + size_t(kC) * kLdX * 2;
constexpr size_t kWsU = kWsGc + size_t(kK) * 4;
constexpr size_t kUBlockBytes = size_t(kC) * kLdU16 * 2;
#ifndef FKDA_PARAM_PIECES
#define FKDA_PARAM_PIECES 1
#endif
// The most pieces a sequence's state pass is split into (1: one CTA walks every chunk, exact). With
// P > 1 the prep also writes the bound below and a copy of each sequence's initial state (see
// workspace_bytes), and the binding picks the pieces of a call at launch (StateArgs::pieces, <= P).
constexpr int kPieces = FKDA_PARAM_PIECES;
// (1..64: the chunk-64 records use up to 16; the fused kernel's prefill_c16p_* records, which read it too, 64)
static_assert(kPieces >= 1 && kPieces <= 64, "FKDA_PARAM_PIECES must be 1..64");
// After U, with pieces only, one fp32: the chunk's log2 attenuation bound (sum over its valid tokens of
// the largest per-token log2 decay over the 128 keys, <= 0 for the decaying gates), whose state pass
// reads it to size a piece's warm-up (kda_prefill_state.cuh, piece_start). Its own 128 bytes keep the
// slot a multiple of 128; without pieces the slot stays as it was (the unsplit modules' layout and
// workspace size untouched).
constexpr size_t kWsBound = kWsU + (kV / 16) * kUBlockBytes;
constexpr size_t kSlotBytes = kWsBound + (kPieces > 1 ? 128 : 0);
static_assert(kWsU % 16 == 0 && kWsBound % 16 == 0 && kSlotBytes % 128 == 0, "bulk copies need 16 B alignment");
// Element offset of U[row][col] inside the U area.
__host__ __device__ constexpr int u_off(int row, int col) {
  return (col >> 4) * (kC * kLdU16) + row * kLdU16 + (col & 15);
}

inline int64_t num_chunk_slots(int64_t total_tokens, int64_t num_seqs) {
  return total_tokens / kC + num_seqs;
}
// The binding rounds a caller's workspace pointer up to kWorkspaceAlign (bulk copies want it; XLA
// only promises 128-byte buffers), so the size asked for carries that slack.
constexpr int64_t kWorkspaceAlign = 256;
// With pieces, after the chunk slots: a copy of every (sequence, head)'s initial state, [N][HV][V][K]
// of the state dtype, made by the prep (a piece that is not the one writing the final state reads it
// there, never from initial_state, which may be final_state itself: a pool updated in place).
inline int64_t init_copy_offset(int64_t total_tokens, int64_t num_seqs, int64_t value_heads) {
  return num_chunk_slots(total_tokens, num_seqs) * value_heads * int64_t(kSlotBytes);
}
inline int64_t workspace_bytes(int64_t total_tokens, int64_t num_seqs, int64_t value_heads,
                               int64_t state_bytes) {
  const int64_t copy = kPieces > 1 ? num_seqs * value_heads * kV * kK * state_bytes : 0;
  return init_copy_offset(total_tokens, num_seqs, value_heads) + copy + kWorkspaceAlign;
}

// ---- small PTX helpers ---------------------------------------------------------------------------
using fkda::smem_u32;
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
// D += A (16x16, row) * B (16x8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rsqrt_ftz(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The gates' per-step decay before its multiplier, shared by the prep's Log2Gate and prefill_c16: softplus in log2
// units, log2(1 + 2^y) = max(y, 0) + log2(1 + 2^-|y|) (finite for every finite y; below 2^-24 it gives 0), and the
// bounded gate's sigmoid 1 / (1 + 2^z).
__device__ __forceinline__ float log2_softplus(float y) { return fmaxf(y, 0.f) + lg2(1.f + ex2(-fabsf(y))); }
__device__ __forceinline__ float sigmoid_of_ex2(float z) { return rcp_ftz(1.f + ex2(z)); }

__device__ __forceinline__ void cp_async16(void* s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(s)), "l"(g));
}
// 16 bytes, or zeros when bytes == 0 (nothing is read then; g must still be a mapped address).
__device__ __forceinline__ void cp_async16_zfill(void* s, const void* g, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(s)), "l"(g), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Fragment loaders (mma m16n8k16 layouts). A 16x16 tile from a row-major [m][k] array:
__device__ __forceinline__ void load_a(uint32_t* a, const bf16* base, int ld, int m0, int k0,
                                       int lane) {
  ldsm_x4(a, base + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + k0 + (lane >> 4) * 8);
}
// A 16x16 tile whose storage is transposed ([k][m] row-major):
__device__ __forceinline__ void load_a_t(uint32_t* a, const bf16* base, int ld, int m0, int k0,
                                         int lane) {
  ldsm_x4_t(a, base + (k0 + (lane & 7) + (lane >> 4) * 8) * ld + m0 + ((lane >> 3) & 1) * 8);
}
// B for two n8 tiles (k16 x n16) from a [k][n] row-major array: b[0..1] tile n0, b[2..3] n0+8.
__device__ __forceinline__ void load_b_kn(uint32_t* b, const bf16* base, int ld, int k0, int n0,
                                          int lane) {
  ldsm_x4_t(b, base + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}
// B for two n8 tiles from an [n][k] row-major array.
__device__ __forceinline__ void load_b_nk(uint32_t* b, const bf16* base, int ld, int n0, int k0,
                                          int lane) {
  ldsm_x4(b, base + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
// A bf16 pair (element 0 in the low half, as pack_bf16 makes it) to floats by its bits: a bf16 is the top half of
// its float, so element 0 is the word shifted up 16 and element 1 the word with its low half cleared. The same
// values as __bfloat1622float2 in 2 instructions instead of 3 (and, on pack_bf16's result, 5: ptxas kept an
// identity byte permute), so the split-bf16 operands and every bf16 load unpack cheaper.
__device__ __forceinline__ float2 bf16x2_bits_to_float2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ float2 ld_bf16x2(const bf16* p) {
  return bf16x2_bits_to_float2(*reinterpret_cast<const uint32_t*>(p));
}
// (x0, x1) = hi + lo in bf16 pairs (hi = bf16(x), lo = bf16(x - hi)): ~16 bits of each x (the prep's and the
// 16-token kernel's split-bf16 products).
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16(x0, x1);
  const float2 h = bf16x2_bits_to_float2(hi);
  lo = pack_bf16(x0 - h.x, x1 - h.y);
}
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = bf16x2_bits_to_float2(w[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void unpack4(const uint2& u, float* f) {
  const float2 x = bf16x2_bits_to_float2(u.x), y = bf16x2_bits_to_float2(u.y);
  f[0] = x.x; f[1] = x.y; f[2] = y.x; f[3] = y.y;
}
__device__ __forceinline__ uint2 pack4(const float* f) {
  return make_uint2(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]));
}
__device__ __forceinline__ void load4(const float* p, float* f) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  f[0] = x.x; f[1] = x.y; f[2] = x.z; f[3] = x.w;
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 u;
  u.x = pack_bf16(f[0], f[1]);
  u.y = pack_bf16(f[2], f[3]);
  u.z = pack_bf16(f[4], f[5]);
  u.w = pack_bf16(f[6], f[7]);
  return u;
}

__device__ __forceinline__ int64_t load_cu(const void* cu, int cu64, int64_t i) {
  return cu64 ? static_cast<const int64_t*>(cu)[i] : int64_t(static_cast<const int32_t*>(cu)[i]);
}
// ---- the ordered state update of one chunk: shared by the state pass and by the prep kernel's
// path for sequences of one chunk (StateArgs::single) ------------------------------------------
struct StateArgs {
  const uint8_t* ws;
  const void* cu;
  int cu64;
  int N, HV;
  const void* init;         // [slots or N, HV, V, K] or null
  void* fin;                // may alias init (pool in place)
  const int32_t* idx;       // pool indices or null
  int64_t num_slots;        // pool slots: an index >= this is treated as padding (never out of bounds)
  int64_t slot_stride;      // elements between init / fin slots (HV*V*K dense; more for a paged pool)
  int null_slot0;
  void* ckpt;               // [N, Cc, HV, V, K] or null
  int tma;                  // 1: bulk copies on mbarriers; 0: cp.async
  int single;               // 1: sequences of one chunk are finished by the prep kernel
  int64_t ckpt_count;
  int64_t ckpt_every;
  bf16* out;                // [T, HV, V]
#if FKDA_PARAM_PIECES > 1  // (only there, so the kernels' parameters of the other modules stay as they were)
  uint8_t* init_copy;       // the prep's copy of the initial states, [N][HV][V][K] (workspace_bytes)
  int pieces;               // this call's pieces a sequence, 1..kPieces (chunk64_state_pieces in the binding)
#endif
#if FKDA_PARAM_GUARD == 1   // (modules prefill_c16g_*: kda_prefill_c16g.cu)
  const int* guard;         // null: run; else run only when the fused kernel before set the word (its fallback)
#endif
#if FKDA_PARAM_CHAIN_GUARD == 1  // (modules prefill_c16g2_*: the piece pass guarded in turn by the unsplit chain)
  int* chain;               // set by kda_chain_decide_kernel where a piece's warm-up passes its own length
  int stage;                // 0: the piece pass; 1: the unsplit chain, which runs only where `chain` is set
#endif
};
#if FKDA_PARAM_GUARD == 1
// A guarded module's chunk-64 kernels skip the call while the guard word is clear (the fused 16-token kernel launched
// before them served it). Read after the kernel's wait for the previous grid, so that kernel's store is visible.
__device__ __forceinline__ bool guard_skips(const StateArgs& a) {
  return a.guard != nullptr && *reinterpret_cast<const volatile int*>(a.guard) == 0;
}
#endif
// The prep's copy of sequence n's initial state (head hv) in the workspace; null without pieces.
template <typename ST>
__device__ __forceinline__ ST* init_copy_of(const StateArgs& a, int n, int hv) {
#if FKDA_PARAM_PIECES > 1
  return reinterpret_cast<ST*>(a.init_copy) + (size_t(n) * a.HV + hv) * kV * kK;
#else
  return nullptr;
#endif
}


}  // namespace fkda_prefill
