// Fused speculative-decoding verify on a state pool, sm_90a (docs/semantics.md, "Fused verify").
//
// One CTA per (request, head), the fused decode's `row` layout (csrc/fused_decode: 8 warps x 16
// V-rows, 16 lanes per V-row, 16-byte state chunks, the prologue's 4*D items two a thread) with the
// request's tokens looped inside. The state stays in registers across the tokens (one read, one
// store per token with a live slot; packed to the pool's dtype after every token, and the next token
// continues from the packed value, as kda_verify). Each conv item's thread keeps its channel's window
// (three bf16 inputs) in registers, read once from the request's conv line at the accepted offset,
// and writes the line as the semantics say: line[2 + j] = token j's input as it goes, line[0..1] =
// the window's last two entries at the end. Per token: prologue items into shared memory, barrier,
// the step, the warps' sum(o^2) into shared memory, barrier, the gated RMSNorm.
#pragma once

#include "fused_decode/fused_kda_decode_kernels.cuh"

namespace fkda_fused_verify {

using fkda_decode::bf16;
using fkda_decode::bf_to_f;
using fkda_decode::load_state;
using fkda_decode::StateTraits;
using fkda_decode::store_state;
using fkda_fused::sigmoidf_;

struct FusedVerifyParams {
  fkda_fused::FusedParams f;  // x, g, beta, output_gate, out with token rows; idx = state_indices [N, T_max]
  int64_t conv_len;           // L: inputs a conv line keeps
  const int32_t* cu_seqlens;  // [N+1]
  const int32_t* accepted;    // [N] or nullptr (= column 0)
  int index_cols;             // T_max
};

template <bool kBf16, int THREADS, typename OffT>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
fused_kda_verify_row_kernel(const FusedVerifyParams vp) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  using Cta = fkda_fused::FusedCta<kBf16, 1, FKDA_HEAD_DIM_K, THREADS, OffT, false>;
  constexpr int D = Cta::D, LPR = Cta::LPR, VEC = Cta::VEC, KPL = Cta::KPL, CHUNKS = Cta::CHUNKS;
  constexpr int RPW = Cta::RPW, WARPS = Cta::WARPS, PASSES = Cta::PASSES, IPT = Cta::IPT, NI = Cta::NI;
  using Elem = typename Cta::Elem;
  __shared__ typename Cta::Smem sm;
  const fkda_fused::FusedParams& p = vp.f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = lane % LPR, r = lane / LPR;
  const int n = blockIdx.x / p.H, h = blockIdx.x % p.H;
  const int bos = __ldg(vp.cu_seqlens + n);
  const int len = __ldg(vp.cu_seqlens + n + 1) - bos;
  if (len <= 0) return;
  const int col = vp.accepted ? __ldg(vp.accepted + n) - 1 : 0;
  const int32_t* row_idx = p.idx + static_cast<int64_t>(n) * vp.index_cols;
  const bool col_ok = col >= 0 && col < vp.index_cols;
  const int32_t read = col_ok ? __ldg(row_idx + col) : -1;
  const int32_t line_slot = __ldg(row_idx);
  const int64_t C = 3 * static_cast<int64_t>(p.H) * D;
  if (Cta::is_pad(p, read) || Cta::is_pad(p, line_slot)) {  // CTA-uniform: no barrier is skipped by part of it
    for (int t = 0; t < len; ++t) Cta::write_zeros(p, bos + t, h, 0);
    return;
  }
  // the prologue items of this thread: conv channels (window + weights) or gate keys (dt_bias, A_log)
  bf16 w0[IPT], w1[IPT], w2[IPT];  // conv window, oldest first
  float cw[IPT][4] = {};
#pragma unroll
  for (int it = 0; it < IPT; ++it) w0[it] = w1[it] = w2[it] = __float2bfloat16_rn(0.f);
  float dt[IPT], alog = p.A_log ? __ldg(p.A_log + h) : 0.f;
  bf16* line[IPT];
#pragma unroll
  for (int it = 0; it < IPT; ++it) {
    const int j = it * THREADS + threadIdx.x;
    line[it] = nullptr;
    if (j < 3 * D) {
      const int64_t ch = Cta::conv_channel(p, h, j);
      line[it] = p.conv_state + (static_cast<OffT>(line_slot) * static_cast<OffT>(C * vp.conv_len) +
                                 static_cast<OffT>(ch * vp.conv_len));
      w0[it] = line[it][col];
      w1[it] = line[it][col + 1];
      w2[it] = line[it][col + 2];
      if (p.w_f32) {
        const float* w = static_cast<const float*>(p.conv_weight) + ch * fkda_fused::kConvWidth;
#pragma unroll
        for (int e = 0; e < 4; ++e) cw[it][e] = __ldg(w + e);
      } else {
        const bf16* w = static_cast<const bf16*>(p.conv_weight) + ch * fkda_fused::kConvWidth;
#pragma unroll
        for (int e = 0; e < 4; ++e) cw[it][e] = bf_to_f(__ldg(w + e));
      }
      dt[it] = 0.f;
    } else {
      dt[it] = p.dt_bias ? __ldg(p.dt_bias + h * D + (j - 3 * D)) : 0.f;
    }
  }
  const bf16 keep1[IPT] = {w1[0], w1[IPT - 1]}, keep2[IPT] = {w2[0], w2[IPT - 1]};  // line[0..1] at the end
  static_assert(IPT == 2, "the row layout: two prologue items a thread");
  const int vrow0 = warp * Cta::ROWS_PER_WARP;
  const int my_vr = vrow0 + c * RPW + r;
  const bool writer = c < PASSES;
  const float nw = writer ? __ldg(p.norm_weight + my_vr) : 0.f;
  // the state tile of this thread, from the read slot
  uint4 s[PASSES][CHUNKS];
  {
    const Elem* sb = static_cast<const Elem*>(p.state) +
                     (static_cast<OffT>(read) * static_cast<OffT>(p.slot_stride) + static_cast<OffT>((h * D + vrow0) * D));
#pragma unroll
    for (int ps = 0; ps < PASSES; ++ps)
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i)
        s[ps][i] = load_state<false>(reinterpret_cast<const uint4*>(sb + (ps * RPW + r) * D + Cta::key_of(i, c)));
  }
  for (int t = 0; t < len; ++t) {
    const int row = bos + t;
    // ---- prologue: conv items (SiLU of the width-4 conv, window shifted) and gate keys
#pragma unroll
    for (int it = 0; it < IPT; ++it) {
      const int j = it * THREADS + threadIdx.x;
      float val;
      if (j < 3 * D) {
        const bf16 xin = p.x[static_cast<int64_t>(row) * C + Cta::conv_channel(p, h, j)];
        float acc = cw[it][0] * bf_to_f(w0[it]);
        acc = fmaf(cw[it][1], bf_to_f(w1[it]), acc);
        acc = fmaf(cw[it][2], bf_to_f(w2[it]), acc);
        acc = fmaf(cw[it][3], bf_to_f(xin), acc);
        w0[it] = w1[it];
        w1[it] = w2[it];
        w2[it] = xin;
        // the line keeps every token's input (only this thread touches it); a token past T_max (a
        // cu_seqlens that breaks the contract) is not kept, so nothing lands outside the line
        if (2 + t < vp.conv_len) line[it][2 + t] = xin;
        val = acc * sigmoidf_(acc);
      } else {
        const float graw = bf_to_f(__ldg(p.g + (static_cast<int64_t>(row) * p.H + h) * D + (j - 3 * D)));
        val = expf(fkda_fused::log_decay(p, graw, dt[it], expf(alog)));
      }
      sm.in[j] = val;
    }
    const float b = sigmoidf_(bf_to_f(__ldg(p.beta + static_cast<int64_t>(row) * p.H + h)));
    const int64_t orow = (static_cast<int64_t>(row) * p.H + h) * D;
    const float og = writer ? bf_to_f(__ldg(p.output_gate + orow + my_vr)) : 0.f;
    const int32_t dst = t < vp.index_cols ? __ldg(row_idx + t) : -1;
    const bool store = !Cta::is_pad(p, dst);
    Elem* db = static_cast<Elem*>(p.state) +
               (store ? static_cast<OffT>(dst) * static_cast<OffT>(p.slot_stride) + static_cast<OffT>((h * D + vrow0) * D)
                      : OffT(0));
    __syncthreads();  // #1: the token's prologue is in shared memory
    float qn[KPL], kn[KPL], dec[KPL];
    Cta::lane_keys(p, sm, c, qn, kn, dec);  // as the fused decode: each token bitwise its step
    float mine = 0.f, part = 0.f;
#pragma unroll
    for (int ps = 0; ps < PASSES; ++ps) {
      float st[KPL];
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i) StateTraits<kBf16>::unpack(s[ps][i], &st[i * VEC]);
      const float o =
          Cta::step_row(st, qn, kn, dec, b, [&] { return sm.in[2 * D + vrow0 + ps * RPW + r]; });
      part = fmaf(o, o, part);
      if (c == ps) mine = o;
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i) {
        s[ps][i] = StateTraits<kBf16>::pack(&st[i * VEC]);  // the next token continues from the stored value
        if (store)
          store_state<false>(reinterpret_cast<uint4*>(db + (ps * RPW + r) * D + Cta::key_of(i, c)), s[ps][i]);
      }
    }
#pragma unroll
    for (int off = LPR; off < 32; off <<= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
    if (lane == 0) sm.red[0][warp] = part;
    __syncthreads();  // #2: every warp's partial (and every read of this token's prologue) done
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) total += sm.red[0][i];
    const float inv = 1.f / sqrtf(total / static_cast<float>(D) + p.norm_eps);
    if (writer) p.out[orow + my_vr] = __float2bfloat16_rn(mine * inv * nw * sigmoidf_(og));
    // the next token's prologue writes sm.in only after every thread passed #2; its sm.red writes
    // come after its #1, which every thread reaches only after reading this token's partials
  }
#pragma unroll
  for (int it = 0; it < IPT; ++it) {
    if (line[it] != nullptr) {
      line[it][0] = keep1[it];
      line[it][1] = keep2[it];
    }
  }
  (void)NI;
}

}  // namespace fkda_fused_verify
