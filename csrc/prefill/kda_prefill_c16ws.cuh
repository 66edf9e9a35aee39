// The fused 16-token-chunk prefill with its work split by role (issue 46; module records prefill_c16ws_*):
// the chunk's preparation and the ordered state update of kda_prefill_c16.cuh, the same operations in the same order
// (so the same bits), run by different warpgroups of one CTA, one CTA an SM:
//   warpgroup 0 (the consumer) holds the [V, K] state in registers (232 a thread) and does step G (V'^T, the output,
//     the state update) and H (the output rows) of chunk c;
//   warpgroups 1 and 2 (the producers, 136 registers a thread) each prepare every other chunk (steps A..F: gate, row
//     scales, decayed operands, L / Aqk, T, W / U), each with its own input ring and scratch, and hand the chunk's
//     operands over in a stage buffer (Qg, Kd, -W, U, Aqk, exp2(G_C)): 4 stages, 2 a producer.
// Why: the fused kernel is latency-bound (2 warps a scheduler, 0.54 eligible, ncu at 64x512 H16) and its state's
// 128 registers a thread allow only 2 CTAs (8 warps) an SM; here 4 warps an SM hold one state and 8 prepare, so 12
// warps run and a chunk's preparation no longer waits behind the previous chunk's state update. Measured (H100):
// the producers bound it (64x512 H16: producers alone 0.407 ms, the consumer alone 0.303, both 0.504).
// Hand-over by named barriers: full[s] (producer arrives, consumer waits) and empty[s] (consumer arrives, producer
// waits before it writes stage s again). Every gate (GATE of kda_prefill_c16.cuh: the producers take the fallback of a
// chunk beyond the factored range as its kernel does), one CTA a (value head, sequence) (kda_prefill_c16ws.cu), or, in
// the guarded modules
// (kda_prefill_c16g.cu, params.c16_ws 1), a sequence's piece after a bounded warm-up as in kda_prefill_c16_kernel, with
// its guard (FKDA_PARAM_GUARD: a warm-up past its limit hands the whole call to the kernels launched after this one).
#pragma once

#include "kda_prefill_c16.cuh"

namespace fkda_c16 {
namespace ws {

constexpr int kProducers = 2;                       // producer warpgroups
constexpr int kWsThreads = 128 * (1 + kProducers);  // 384
constexpr int kStages = 2 * kProducers;             // stage s = chunk & 3: producer p (chunks p, p + 2, ..) owns p, p + 2

// setmaxnreg moves registers between the warpgroups of the CTA's own allocation (168 a thread at launch: 65536 / 384
// rounded down to 8), so the three counts must fit in it: an increase waits until decreases free enough (a hang, on
// the first try at 240 + 2 x 136). Every gate takes 232 / 136: the checked gates had 200 / 152 while their fallback
// code sat inline in the producers' hot path; with the unchecked chunk as its own straight line (produce, step B)
// the bounded gate's split serves them too, 1.008-1.015x on five softplus rows, bitwise equal (H100;
// csrc/prefill/README.md).
constexpr int kLaunchRegs = 168;
constexpr int kConsumerRegs = 232;
constexpr int kProducerRegs = 136;
static_assert(128 * kConsumerRegs + kProducers * 128 * kProducerRegs <= kLaunchRegs * kWsThreads,
              "the warpgroups' registers are the launch's");

// A producer's shared memory: its input ring (2 stages of q, k, v, raw g) and its scratch
constexpr int kPRing = 0;
constexpr int kPQl = kPRing + 2 * kStage;  // bf16 [16][kLdB] Qg lo
constexpr int kPKl = kPQl + kMat;          // Kg lo
constexpr int kPNh = kPKl + kMat;          // Kn hi
constexpr int kPNl = kPNh + kMat;          // Kn lo
constexpr int kPKh = kPNl + kMat;          // Kg hi (L's operand and W's)
constexpr int kPPart = kPKh + kMat;        // fp32 [4][16][kLdP]
constexpr int kPL = kPPart + 4 * kC * kLdP * 4;  // fp32 [16][kLdP]
constexpr int kPT = kPL + kC * kLdP * 4;         // bf16 [16][kLdS]
constexpr int kPTot = kPT + kC * kLdS * 2;
constexpr int kPNrm = kPTot + 4 * kK * 4;
constexpr int kPBeta = kPNrm + 32 * 4;
constexpr int kPBytes = kPBeta + kC * 4;
// A stage (producer -> consumer)
constexpr int kSQh = 0;                    // bf16 [16][kLdB] Qg hi
constexpr int kSKd = kSQh + kMat;          // bf16 Kd
constexpr int kSWn = kSKd + kMat;          // bf16 -W
constexpr int kSU = kSWn + kMat;           // fp32 [16][kLdU] U
constexpr int kSA = kSU + kC * kLdU * 4;   // bf16 [16][kLdS] Aqk
constexpr int kSGc = kSA + kC * kLdS * 2;  // fp32 [128] exp2(G_C)
constexpr int kSBytes = kSGc + kK * 4;
// (kCheck gates) a producer's fallback scratch, Gf and fb_mask of kda_prefill_c16.cuh, in its stage's -W and U: the
// consumer is done with the stage from step A (the empty barrier) and step F writes them after step D's last read
constexpr int kSGf = kSWn;
constexpr int kSMask = kSGf + kC * kLdGf * 4;
static_assert(kSGf % 16 == 0 && kSMask + 2 * 4 <= kSA, "the fallback's scratch fits the stage's -W and U");
constexpr int kOffProducers = 0;
constexpr int kOffStages = kOffProducers + kProducers * kPBytes;
constexpr int kOffOs = kOffStages + kStages * kSBytes;  // the consumer's output staging, bf16 [16][kLdB]
constexpr int kOffWalk = kOffOs + kMat;                 // (pieces) the warm-up walk's maxima, fp32 [4][32]
#if FKDA_PARAM_GUARD == 1
constexpr bool kGuarded = true;  // (prefill_c16g modules: kda_prefill_c16g.cu)
#else
constexpr bool kGuarded = false;
#endif
// (guard) int [4]: [0] the word at the start, [1] the consumer's stop flag, [2 + p] producer p's copy of it
constexpr int kOffFlags = kOffWalk + (kPieces > 1 ? 4 * 32 * 4 : 0);
constexpr int kWsSmemBytes = kOffFlags + (kGuarded ? 16 : 0);
static_assert(kPBytes % 16 == 0 && kSBytes % 16 == 0 && kSU % 16 == 0 && kSA % 16 == 0 && kSGc % 16 == 0 &&
                  kPPart % 16 == 0 && kPL % 16 == 0,
              "alignment");
static_assert(kWsSmemBytes <= 227 * 1024, "one CTA an SM");

// Named barriers (0 is __syncthreads'): a producer's own 1 + p (128 threads); full[s] 3 + s, empty[s] 7 + s (256:
// one producer warpgroup and the consumer); the consumer's own 11 (128)
constexpr int kBarProducer = 1, kBarFull = 3, kBarEmpty = 7, kBarConsumer = 11;
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
// bar.sync that also returns whether pred held in any of the n threads (__syncthreads_or of a named barrier)
__device__ __forceinline__ bool bar_sync_or(int id, int n, bool pred) {
  int any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.s32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(int(pred)), "r"(id), "r"(n)
      : "memory");
  return any != 0;
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_up() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_down() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// The chunks a CTA runs (kda_prefill_c16_kernel's piece split): it stores [cb, ce), starts at cs <= cb (a warm-up from
// a zero state, or chunk 0 from the initial state), and writes the final state if it ends the sequence.
struct Span {
  int cs, cb, ce;
  bool writer;
};

// Producer p of a (value head hv, sequence of len tokens from bos): the chunks cs + p, cs + p + 2, .. < ce, steps A..F
// of kda_prefill_c16_kernel<ST, GATE>, with its fallback where the gate is checked (kCheck).
template <int GATE>
__device__ __forceinline__ void produce(const Args& a, uint8_t* smem, int p, int hv, int hk, int64_t bos, int64_t len,
                                        const Span sp) {
  constexpr int mode = kGateMode<GATE>;
  constexpr bool kCheck = kGateChecked<GATE>;
  const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5;
  const int bar = kBarProducer + p;
  uint8_t* mine = smem + kOffProducers + p * kPBytes;
  bf16* Ql = reinterpret_cast<bf16*>(mine + kPQl);
  bf16* Kl = reinterpret_cast<bf16*>(mine + kPKl);
  bf16* Nh = reinterpret_cast<bf16*>(mine + kPNh);
  bf16* Nl = reinterpret_cast<bf16*>(mine + kPNl);
  bf16* Kh = reinterpret_cast<bf16*>(mine + kPKh);
  float* part = reinterpret_cast<float*>(mine + kPPart);
  float* Lf = reinterpret_cast<float*>(mine + kPL);
  bf16* Tm = reinterpret_cast<bf16*>(mine + kPT);
  float* tot = reinterpret_cast<float*>(mine + kPTot);
  float* nrm = reinterpret_cast<float*>(mine + kPNrm);
  float* betas = reinterpret_cast<float*>(mine + kPBeta);

  const int d4 = 4 * lane;
  float gs, mult;
  gate_scales<mode>(a, hv, gs, mult);
  const float4 gk = gate_offsets4(a, hv, d4, gs);

  const int c0 = sp.cs + p;  // this producer's first chunk
  const RowOffsets ro = row_offsets(a, tid);
  const int64_t t0 = bos + int64_t(c0) * kC;
  size_t base_hk = (size_t(t0) * a.H + hk) * kK, base_hv = (size_t(t0) * a.HV + hv) * kK;
  size_t base_b = size_t(t0) * a.HV + hv;
  const size_t step_hk = size_t(2 * kC) * a.H * kK, step_hv = size_t(2 * kC) * a.HV * kK, step_b = size_t(2 * kC) * a.HV;
  if (c0 < sp.ce) load_chunk(mine + kPRing, a, base_hk, base_hv, chunk_tokens(len, c0), ro, tid);
  cp_async_commit();
  const unsigned short* beta_bits = reinterpret_cast<const unsigned short*>(a.beta);
  unsigned short bnext = 0;
  if (c0 < sp.ce && tid < kC && int64_t(c0) * kC + tid < len) bnext = beta_bits[base_b + size_t(tid) * a.HV];

#pragma unroll 1
  for (int c = c0, i = 0; c < sp.ce; c += 2, ++i) {
    const int nt = chunk_tokens(len, c);
    const uint8_t* ring = mine + kPRing + (i & 1) * kStage;
    const bf16* Qs = reinterpret_cast<const bf16*>(ring);
    const bf16* Ks = Qs + kC * kLdB;
    const bf16* Vs = Ks + kC * kLdB;
    const bf16* Gr = Vs + kC * kLdB;
    const unsigned short bcur_bits = bnext;
#if FKDA_PARAM_GUARD == 1
    volatile int* flags = reinterpret_cast<volatile int*>(smem + kOffFlags);
    if (tid == 0) flags[2 + p] = flags[1];  // one read a chunk, shared by the producer's warps (below the barrier)
#endif
    bar_sync(bar, 128);  // this producer is done with its last chunk (its ring stage, its scratch)
    const int r = c - sp.cs, s = r & (kStages - 1);  // the CTA's r-th chunk, its stage
#if FKDA_PARAM_GUARD == 1
    // the consumer saw the guard word set: the chunks left keep only the hand-over's barriers (no loads, no math); a
    // stale 0 costs one chunk's work, never a wrong one (the consumer set the flag while on an earlier chunk and skips
    // the math from the next one on)
    if (flags[2 + p] != 0) {
      if (r >= kStages) bar_sync(kBarEmpty + s, 256);
      bar_arrive(kBarFull + s, 256);
      continue;
    }
#endif
    if (c + 2 < sp.ce) {
      base_hk += step_hk;
      base_hv += step_hv;
      base_b += step_b;
      const int nt2 = chunk_tokens(len, c + 2);
      load_chunk(mine + kPRing + ((i + 1) & 1) * kStage, a, base_hk, base_hv, nt2, ro, tid);
      bnext = 0;
      if (tid < nt2) bnext = beta_bits[base_b + size_t(tid) * a.HV];
    }
    cp_async_commit();
    cp_async_wait<1>();
    bar_sync(bar, 128);  // chunk c's inputs are in the ring

    uint8_t* st = smem + kOffStages + s * kSBytes;
    bf16* Qh = reinterpret_cast<bf16*>(st + kSQh);
    bf16* Kd = reinterpret_cast<bf16*>(st + kSKd);
    bf16* Aq = reinterpret_cast<bf16*>(st + kSA);
    float* gcs = reinterpret_cast<float*>(st + kSGc);
    float* Gf = reinterpret_cast<float*>(st + kSGf);           // (kCheck) the fallback's scratch
    uint32_t* fb_mask = reinterpret_cast<uint32_t*>(st + kSMask);

    // ---- A. row scales of q (times scale) and k, beta, the gate's running sums of each quarter
    row_scales_and_beta(Qs, Ks, nrm, betas, bcur_bits, nt, a.scale, a.beta_logit, tid);
    float4 gl[4];
    const float4 quarter = gate_run<mode>(gl, Gr, warp, d4, nt, gs, gk, mult);
    *reinterpret_cast<float4*>(tot + warp * kK + d4) = quarter;
    if (r >= kStages) bar_sync(kBarEmpty + s, 256);  // the consumer is done with the CTA's chunk r - 4 (stage s)
    if (mode == 2 && tid == 0) fb_mask[1] = 0;       // (log gate) set in step B where some G rose beyond the range
    // check: whether this chunk takes the range check of step B, the same for the producer's threads (the barrier's
    // vote). The log gate, which may rise, always does; softplus and the bounded gate below -5 only where some quarter's
    // total is below a quarter of the range: otherwise G_C, four such totals added, is within it, the check would find
    // nothing beyond, and the unchecked operands are its bits (1.03-1.04x on softplus rows, H100; csrc/prefill/README.md)
    bool check = kCheck;
    if constexpr (kCheck && mode != 2) {
      check = bar_sync_or(bar, 128, !quarter_within_range(quarter));
    } else {
      bar_sync(bar, 128);
    }

    // ---- B-D. An unchecked chunk (the bounded gate at >= -5 never leaves the factored range, and the quarter test
    // passes most softplus chunks) runs steps B-D as one straight line, the bounded kernel's; the checked chunk
    // (range check, fallback) is the other branch, so the fallback's code stays off the hot path (1.008-1.015x on
    // softplus rows, bitwise equal; csrc/prefill/README.md)
    if (!check) {
      bool wk = false, ultra = false, out = false;
      decayed_operands<mode, false>(tot, gl, nrm, Qs, Ks, Qh, Ql, Kh, Kl, Nh, Nl, Kd, gcs, warp, d4, wk, ultra, out);
      bar_sync(bar, 128);
      lqk_partials(Qh, Ql, Kh, Kl, Nh, Nl, part, warp, lane);  // ---- C
      bar_sync(bar, 128);
      l_and_aqk(part, betas, Lf, Aq, tid);                     // ---- D
    } else {
      // ---- B. the decayed operands, range-checked
      bool wk = false, ultra = false, out = false;
      decayed_operands<mode, true>(tot, gl, nrm, Qs, Ks, Qh, Ql, Kh, Kl, Nh, Nl, Kd, gcs, warp, d4, wk, ultra, out);
      fallback_marks<mode>(fb_mask, ultra, out, warp, lane);
      const bool fallback = bar_sync_or(bar, 128, wk | out);

      // ---- C. L and Aqk partials (elementwise groups: also the chunk's G to Gf)
      const bool elementwise = fallback_elementwise<mode>(fallback, fb_mask);
      if (elementwise) fallback_gates<mode>(Gf, Gr, tot, warp, d4, nt, gs, gk, mult);
      lqk_partials(Qh, Ql, Kh, Kl, Nh, Nl, part, warp, lane);
      bar_sync(bar, 128);

      // ---- D. L and Aqk, or the fallback's rows
      if (fallback) fallback_restore<mode>(tot, Gr, Qs, Ks, nrm, Qh, Kh, warp, d4, nt, gs, gk, mult);
      if (elementwise) {
        fallback_rows<mode>(Qs, Ks, Gf, fb_mask, part, nrm, betas, Lf, Aq, tid);
      } else {
        l_and_aqk(part, betas, Lf, Aq, tid);
      }
    }
    bar_sync(bar, 128);
    if (warp == 0) solve_t(Lf, betas, Tm, lane);  // ---- E
    bar_sync(bar, 128);
    w_and_u(Tm, Kh, Vs, reinterpret_cast<bf16*>(st + kSWn), reinterpret_cast<float*>(st + kSU), warp, lane);  // ---- F
    bar_arrive(kBarFull + s, 256);  // stage s holds the CTA's chunk r
  }
  cp_async_wait<0>();
}

// The consumer: the state in registers, step G and H of every chunk in order (warm-up chunks store no rows), then the
// final state.
template <typename ST>
__device__ __forceinline__ void consume(const Args& a, uint8_t* smem, int hv, int n, int64_t bos, int64_t len,
                                        const Span sp) {
  const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
  bf16* Os = reinterpret_cast<bf16*>(smem + kOffOs);
  int64_t slot = n;
  bool pad = false;
  if (a.idx) {
    const int sl = a.idx[n];
    slot = sl;
    pad = sl < 0 || sl >= a.num_slots || (a.null_slot0 && sl == 0);
  }
  const size_t head = size_t(slot) * size_t(a.slot_stride) + size_t(hv) * kV * kK;
  const ST* src = a.init && !pad && sp.cs == 0 ? static_cast<const ST*>(a.init) + head : nullptr;
  const size_t fin_at = a.fin_dense ? (size_t(n) * a.HV + hv) * kV * kK : head;
  ST* dst = a.fin && !pad && sp.writer ? static_cast<ST*>(a.fin) + fin_at : nullptr;
  bool stopped = false;  // (guard) another piece handed the call over: the chunks left keep only the barriers
#if FKDA_PARAM_GUARD == 1
  int guard_seen = 0;  // the word as consumer thread 0 read it a chunk earlier (the load's latency hides behind a chunk)
  volatile int* stop_flag = reinterpret_cast<volatile int*>(smem + kOffFlags + 4);
#endif
  const RowOffsets ro = row_offsets(a, tid);
  size_t base_hv = (size_t(bos + int64_t(sp.cs) * kC) * a.HV + hv) * kK;
  const size_t step_hv = size_t(kC) * a.HV * kK;

  float S[2][16][4];
  for_frag<16, 2>(warp, g, tq, [&](int mt, int nt, int e, int v, int d) {
    const float2 x = src ? ld_pair<ST>(src + size_t(v) * kK + d) : make_float2(0.f, 0.f);
    S[mt][nt][e] = x.x;
    S[mt][nt][e + 1] = x.y;
  });

  const int runs = sp.ce - sp.cs;
#pragma unroll 1
  for (int r = 0; r < runs; ++r, base_hv += step_hv) {
    const int c = sp.cs + r, nt = chunk_tokens(len, c);
    const int s = r & (kStages - 1);
    const uint8_t* st = smem + kOffStages + s * kSBytes;
    const bf16* Qh = reinterpret_cast<const bf16*>(st + kSQh);
    const bf16* Kd = reinterpret_cast<const bf16*>(st + kSKd);
    const bf16* Wn = reinterpret_cast<const bf16*>(st + kSWn);
    const float* Uf = reinterpret_cast<const float*>(st + kSU);
    const bf16* Aq = reinterpret_cast<const bf16*>(st + kSA);
    const float* gcs = reinterpret_cast<const float*>(st + kSGc);
    bar_sync(kBarFull + s, 256);  // stage s holds chunk c; every consumer thread is past chunk c - 1's output rows

    // ---- G. the ordered part, the state in registers
    if (!stopped) state_step(S, Uf, Wn, Qh, Aq, gcs, Kd, Os, warp, lane);
    if (r + kStages < runs) bar_arrive(kBarEmpty + s, 256);  // stage s is free for the CTA's chunk r + 4
#if FKDA_PARAM_GUARD == 1
    if (tid == 0 && a.guard != nullptr) {
      if (guard_seen) *stop_flag = 1;
      guard_seen = *reinterpret_cast<const volatile int*>(a.guard);
    }
#endif
    bar_sync(kBarConsumer, 128);  // the output rows are staged (and the stop flag written)
    if (stopped) continue;

    // ---- H. the chunk's output rows (16-byte stores, 256 B a row; a warm-up chunk stores nothing)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int idx = tid + i * 128, row = ro.r[i], c8 = (idx & 15) * 8;
      if (row < nt && c >= sp.cb)
        *reinterpret_cast<uint4*>(a.out + base_hv + ro.hv[i]) = *reinterpret_cast<const uint4*>(Os + row * kLdB + c8);
    }
#if FKDA_PARAM_GUARD == 1
    stopped = *stop_flag != 0;  // consumer-uniform: written before the barrier above, read by every consumer thread
#endif
  }
  if (dst && !stopped) {
    for_frag<16, 2>(warp, g, tq, [&](int mt, int nt, int e, int v, int d) {
      st_pair(dst + size_t(v) * kK + d, S[mt][nt][e], S[mt][nt][e + 1]);
    });
  }
}

// One CTA a (value head, sequence[, piece]), 384 threads, one CTA an SM. With pieces (the guarded modules'
// params.c16_pieces; kda_prefill_c16g.cu picks the call's, Args::pieces) a piece's warm-up start is
// kda_prefill_c16_kernel's: the walk back until the chunks' attenuation bounds sum to <= -24 (log2), every warpgroup
// computing the same sums (chunk_bounds' 128-thread mapping in each; the maxima they store to the shared slots are the
// same values). The guard (FKDA_PARAM_GUARD): a piece that starts after the word is set returns, a walk past its limit
// sets it and returns, and a running piece stops at the consumer's next chunk (consume: its stop flag; the producers
// then keep only the barriers).
template <typename ST, int GATE>
__global__ void __launch_bounds__(kWsThreads, 1) kda_prefill_c16ws_kernel(const Args a) {
  fkda::begin_dependent_grid();
  constexpr int mode = kGateMode<GATE>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int wg = threadIdx.x >> 7;
  const int hv = blockIdx.x, n = blockIdx.y;
  const int hk = a.group == 1 ? hv : hv / a.group;
  const int64_t bos = load_cu(a.cu, a.cu64, n), len = load_cu(a.cu, a.cu64, n + 1) - bos;
  const int nch = static_cast<int>((len + kC - 1) / kC);
  Span sp{0, 0, nch, true};
#if FKDA_PARAM_GUARD == 1
  {  // a piece that starts once the word is set stops before its walk; CTA-uniform (one read, shared)
    volatile int* flags = reinterpret_cast<volatile int*>(smem + kOffFlags);
    if (threadIdx.x == 0) {
      flags[0] = a.guard != nullptr && *reinterpret_cast<const volatile int*>(a.guard) != 0;
      flags[1] = 0;
    }
    __syncthreads();
    if (flags[0]) return;
  }
#endif
  if constexpr (kPieces > 1) {
    const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5;
    const int own = a.pieces;
#if FKDA_PARAM_GUARD == 1  // layer 0 holds walking pieces where it fills the wave (Args::z_rotate): a hand-over comes early
    const int p = (static_cast<int>(blockIdx.z) + a.z_rotate) % own;
#else
    const int p = blockIdx.z;
#endif
    const int per = (nch + own - 1) / own;
    sp.cb = min(nch, p * per);
    sp.ce = min(nch, sp.cb + per);
    if (p > 0 && sp.cb >= sp.ce) return;  // CTA-uniform: no chunk (piece 0 of an empty sequence writes its state)
    sp.writer = sp.ce == nch;
    sp.cs = sp.cb;
    float gs, mult;
    gate_scales<mode>(a, hv, gs, mult);
    const int d2 = 2 * (tid & 63), half = tid >> 6;
    const float gc0 = a.dt_bias ? gs * a.dt_bias[hv * kK + d2] : 0.f, gc1 = a.dt_bias ? gs * a.dt_bias[hv * kK + d2 + 1] : 0.f;
    float* red = reinterpret_cast<float*>(smem + kOffWalk);
    float sum = 0.f;
#if FKDA_PARAM_GUARD == 1
    const int limit = max(2, min(kGuardMaxChunks, kGuardPct == 50 ? per / 2 : per * kGuardPct / 100));
#endif
    while (sp.cs > 0 && sum > -24.f) {
      float b[kWalkStep];
      chunk_bounds<mode>(b, a, bos, len, sp.cs - 1, hv, gs, gc0, gc1, mult, d2, half, lane, warp, red);
#pragma unroll
      for (int j = 0; j < kWalkStep; ++j) {
        if (!(sp.cs > 0 && sum > -24.f)) break;  // CTA-uniform (every thread holds the same sums)
#if FKDA_PARAM_GUARD == 1
        if (sp.cb - sp.cs >= limit) {  // CTA-uniform: the kernels after this one take the call
          if (threadIdx.x == 0) *reinterpret_cast<volatile int*>(a.guard) = 1;
          return;
        }
#endif
        --sp.cs;
        sum += b[j];
      }
    }
  }
  if (wg == 0) {
    regs_up<kConsumerRegs>();
    consume<ST>(a, smem, hv, n, bos, len, sp);
  } else {
    regs_down<kProducerRegs>();
    produce<GATE>(a, smem, wg - 1, hv, hk, bos, len, sp);
  }
}

}  // namespace ws
}  // namespace fkda_c16
