// KDA speculative-decoding verify on a state pool [slots, HV, V, K] (K contiguous), sm_90a.
//
// One CTA per (request, value head, V-tile), the decode tile schedule's layout
// (decode/kda_decode_kernels.cuh: a warp owns whole V-rows, LPR lanes per V-row, 16-byte state
// chunks) with the request's tokens looped inside: the state tile is read once into registers and
// stays there; after each token it is packed to the pool's dtype (kept packed: the next token
// continues from exactly the stored value, so T = 1 is the decode step and token t equals a decode
// call on the state stored after token t - 1) and, when the token's entry is live, stored to its
// slot. Per token the CTA reads only that token's q, k, g, v, beta, issued one token ahead.
#pragma once

#include "decode/kda_decode_kernels.cuh"

namespace fkda_verify {

using fkda_decode::DecodeParams;
using fkda_decode::bf16;

// The decode parameters (q .. out with token-major rows: a "row" is a packed token) plus the
// request table.
struct VerifyParams {
  DecodeParams d;
  const int32_t* cu_seqlens;  // [N+1]
  const int32_t* accepted;    // [N] or nullptr (= column 0)
  int num_seqs, index_cols;   // N, T_max (columns of d.idx, which is [N, T_max])
};

template <bool kBf16, int LPR, int V_TILE, int THREADS, typename OffT>
__global__ void __launch_bounds__(THREADS, FKDA_MIN_BLOCKS)
kda_verify_tile_kernel(const VerifyParams vp) {
  fkda::begin_dependent_grid();  // PDL: see common/grid_dependency.cuh
  constexpr int WARPS = THREADS / 32;
  static_assert(V_TILE % WARPS == 0, "V tile must split evenly over warps");
  using T = fkda_decode::WarpTile<kBf16, LPR, V_TILE / WARPS, OffT, false>;
  using Elem = typename T::Elem;
  constexpr int NVT = T::V / V_TILE;
  const DecodeParams& p = vp.d;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = lane % LPR, r = lane / LPR;
  const int item = blockIdx.x / NVT, vt = blockIdx.x % NVT;
  const int n = item / p.HV, hv = item % p.HV;
  const int vrow0 = vt * V_TILE + warp * (V_TILE / WARPS);
  const int bos = __ldg(vp.cu_seqlens + n);
  // tokens past T_max have no slot column: never stored (a valid call has T_n <= T_max)
  const int len = __ldg(vp.cu_seqlens + n + 1) - bos;
  if (len <= 0) return;
  const int col = vp.accepted ? __ldg(vp.accepted + n) - 1 : 0;
  const int32_t* row_idx = p.idx + static_cast<int64_t>(n) * vp.index_cols;
  // a count outside [1, T_max] makes the request padding, as an out-of-range slot does
  const int32_t read = (col >= 0 && col < vp.index_cols) ? __ldg(row_idx + col) : -1;
  typename T::Item cur;
  T::load_inputs(p, cur, bos, hv, vrow0, lane);
  if (T::is_pad(p, read)) {
    for (int t = 0; t < len; ++t) T::write_zeros(p, bos + t, hv, vrow0, lane);
    return;
  }
  T::load_state_regs(p, cur, T::slot_base(p, read, hv, vrow0), lane);
  int32_t dst = __ldg(row_idx);  // token 0's slot (index_cols >= 1)
  for (int t = 0; t < len; ++t) {
    const int32_t dst_next = (t + 1 < len && t + 1 < vp.index_cols) ? __ldg(row_idx + t + 1) : -1;
    typename T::Prep pr;
    T::prepare(p, cur, pr);
    typename T::Item nxt;  // the next token's inputs (its state fields stay unused)
    if (t + 1 < len) T::load_inputs(p, nxt, bos + t + 1, hv, vrow0, lane);
    const bool store = t < vp.index_cols && !T::is_pad(p, dst);
    Elem* sb = static_cast<Elem*>(p.state) + (store ? T::slot_base(p, dst, hv, vrow0) : OffT(0));
    T::template step_passes<false, false>(
        p, cur, pr, 0.f, bos + t, hv, vrow0, lane, OffT(0), [&](int ps, int i) { return cur.s[ps][i]; },
        [&](int ps, int i, const uint4& packed) {
          cur.s[ps][i] = packed;  // the next token continues from the stored value
          if (store) {
            const int e = (ps * T::RPW + r) * T::K + T::key_of(i, c);
            fkda_decode::store_state<false>(reinterpret_cast<uint4*>(sb + e), packed);
          }
        });
    if (t + 1 < len) {
#pragma unroll
      for (int i = 0; i < T::CHUNKS; ++i) {
        cur.qr[i] = nxt.qr[i];
        cur.kr[i] = nxt.kr[i];
        cur.gr[i] = nxt.gr[i];  // dt_bias and A_log are the head's, the same for every token
      }
#pragma unroll
      for (int ps = 0; ps < T::PASSES; ++ps) cur.vr[ps] = nxt.vr[ps];
      cur.beta_raw = nxt.beta_raw;
    }
    dst = dst_next;
  }
}

}  // namespace fkda_verify
