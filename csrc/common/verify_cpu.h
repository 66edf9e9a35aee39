// The CPU verify modules' (kda_verify, fused_kda_verify) shared argument checks: num_accepted_tokens [N] and every rule on the host values of the
// index tensors (docs/semantics.md, "Verify"): both ops read and write the pool the same way.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "kda_cpu.h"
#include "pool_args.h"

namespace fkda {
namespace cpu {

inline void check_accepted_tokens(const Checker& c, const OptTensor& num_accepted_tokens, int64_t N) {
  if (!num_accepted_tokens.has_value()) return;
  const TensorView& a = num_accepted_tokens.value();
  c.device_type(a, "num_accepted_tokens", kDLCPU);
  c.shape(a, "num_accepted_tokens", {{"N", N}});
  c.dtype(a, "num_accepted_tokens", {kI32});
  c.contiguous(a, "num_accepted_tokens");
}

// What the host values say once checked: request n runs tokens off[n] .. off[n+1]-1 from the state
// in slot read[n]: idx[n * cols + read_col[n]] of the pool, or initial_state_indices[n] of the second
// pool when there is one (kda_verify's initial_state).
struct VerifyPlan {
  std::vector<int64_t> off;
  const int32_t* idx;  // [N, cols]: state_indices, or the table step rows stand for (rows_table)
  std::vector<int64_t> read_col;
  std::vector<int32_t> read;
  bool null_slot0;
  std::vector<int32_t> rows_table;

  // An entry that names no slot: negative, or 0 with null_slot0.
  bool pad(int64_t s) const { return is_padding(s, null_slot0); }
};

// Offsets, token counts, accepted counts, slot ranges; no slot written twice, none read by one
// request while another writes it (padding entries exempt). init: kda_verify's second start pool
// (its indices range-checked; its reads collide with writes only when it is the pool itself, init_is_state).
// rows > 0: step rows (pool_args.h verify_layout), state_indices [N] one row each: entry (n, t) is slot
// row * cols + t, and a padding row makes the request padding.
inline VerifyPlan verify_host_plan(const Checker& c, const TensorView& state_indices, const TensorView& cu_seqlens,
                                   const OptTensor& num_accepted_tokens, int64_t T, SlotTable table, int64_t slots,
                                   bool null_slot0, const InitialPool& init = InitialPool{},
                                   bool init_is_state = false, int64_t rows = 0) {
  const int64_t N = table.N, cols = table.cols;
  std::vector<int64_t> off = c.cu_seqlens_host(cu_seqlens, "cu_seqlens", T);
  const int32_t* idx = data_ptr<const int32_t>(state_indices);
  std::vector<int32_t> rows_table;
  std::vector<bool> pad_row(N, false);
  if (rows > 0) {
    rows_table.resize(N * cols);
    for (int64_t n = 0; n < N; ++n) {
      const int32_t r = idx[n];
      if (r >= rows) {
        FKDA_FAIL(c.fn()) << "argument 'state_indices': entry " << n << " = " << r << " is out of range for state's "
                          << rows << " rows (negative = padding)";
      }
      pad_row[n] = is_padding(r, null_slot0);
      for (int64_t t = 0; t < cols; ++t)
        rows_table[n * cols + t] = pad_row[n] ? -1 : static_cast<int32_t>(r * cols + t);
    }
    idx = rows_table.data();
  } else {
    c.slot_indices_host(state_indices, "state_indices", slots);
  }
  std::vector<int64_t> read_col(N, 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = off[n + 1] - off[n];
    if (len > cols) {  // (>= 0: cu_seqlens_host checked the offsets non-decreasing)
      FKDA_FAIL(c.fn()) << "argument 'cu_seqlens': request " << n << " has " << len
                        << " tokens; expected 0 .. T_max = " << cols;
    }
    if (num_accepted_tokens.has_value()) {
      const int32_t a = data_ptr<const int32_t>(num_accepted_tokens.value())[n];
      if (a < 1 || a > cols) {
        FKDA_FAIL(c.fn()) << "argument 'num_accepted_tokens': entry " << n << " = " << a
                          << " must be in [1, T_max = " << cols << "]";
      }
      read_col[n] = a - 1;
    }
  }
  std::vector<int32_t> read(N);
  for (int64_t n = 0; n < N; ++n) {
    read[n] = init.idx ? init.idx[n] : idx[n * cols + read_col[n]];
    if (init.idx && read[n] >= init.slots) {
      FKDA_FAIL(c.fn()) << "argument 'initial_state_indices': entry " << n << " = " << read[n]
                        << " is out of range for initial_state's " << init.slots << " slots (negative = padding)";
    }
    if (pad_row[n]) read[n] = -1;  // a padding row: a padding request
  }
  auto pad = [&](int64_t s) { return is_padding(s, null_slot0); };
  std::map<int32_t, int64_t> writer;  // slot -> the request writing it
  for (int64_t n = 0; n < N; ++n) {
    if (pad(read[n])) continue;
    for (int64_t t = 0; t < off[n + 1] - off[n]; ++t) {
      const int32_t s = idx[n * cols + t];
      if (pad(s)) continue;
      if (!writer.emplace(s, n).second) {
        FKDA_FAIL(c.fn()) << "argument 'state_indices': slot " << s << " is written twice (requests "
                          << writer[s] << " and " << n << "); written slots must be distinct";
      }
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    if (init.idx && !init_is_state) break;  // a pool apart from the one written
    const int32_t s = read[n];
    auto it = writer.find(s);
    if (off[n + 1] > off[n] && !pad(s) && it != writer.end() && it->second != n) {  // an empty request reads nothing
      FKDA_FAIL(c.fn()) << "argument '" << (init.idx ? "initial_state_indices" : "state_indices") << "': request "
                        << n << " reads slot " << s
                        << ", which request " << it->second << " writes";
    }
  }
  VerifyPlan plan{std::move(off), idx, std::move(read_col), std::move(read), null_slot0, std::move(rows_table)};
  if (rows > 0) plan.idx = plan.rows_table.data();
  return plan;
}

// kda_verify's draft tree: parent_tokens int32 [N, cols] on the CPU, contiguous; for every request that is
// not padding, entry (n, t) of its tokens t >= 1 in [0, t) and naming a token whose entry is live (its
// state is stored: the token continues from it). Column 0 is not read. Returns the entries (nullptr: a chain).
inline const int32_t* tree_parents_host(const Checker& c, const OptTensor& parent_tokens, const VerifyPlan& plan,
                                        int64_t N, int64_t cols) {
  if (!parent_tokens.has_value()) return nullptr;
  const TensorView& pt = parent_tokens.value();
  c.device_type(pt, "parent_tokens", kDLCPU);
  c.shape(pt, "parent_tokens", {{"N", N}, {"T_max", cols}});
  c.dtype(pt, "parent_tokens", {kI32});
  c.contiguous(pt, "parent_tokens");
  const int32_t* par = data_ptr<const int32_t>(pt);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = plan.off[n + 1] - plan.off[n];
    for (int64_t t = 1; t < len; ++t) {
      const int32_t p = par[n * cols + t];
      if (p < 0 || p >= t) {
        FKDA_FAIL(c.fn()) << "argument 'parent_tokens': entry [" << n << ", " << t << "] = " << p
                          << "; expected a token of request " << n << " before it, in [0, " << t << ")";
      }
      if (!plan.pad(plan.read[n]) && plan.pad(plan.idx[n * cols + p])) {
        FKDA_FAIL(c.fn()) << "argument 'parent_tokens': entry [" << n << ", " << t << "] = " << p
                          << " names a token whose state is not stored (its state_indices entry is padding)";
      }
    }
  }
  return par;
}

}  // namespace cpu
}  // namespace fkda
