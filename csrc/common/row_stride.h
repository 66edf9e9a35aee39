// The layout rule on kda_decode's and kda_verify's row-strided inputs (q, k, v, g, beta), shared by
// their CPU and CUDA bindings: flashkda_ext/validation/common.py, _row_strided, is the same rule.
#pragma once

#include <cstdint>
#include <vector>

#include "binding.h"

namespace fkda {

// An input of kda_decode ([rows, n, d], row_dim 0) or kda_verify ([1, T, n, d], row_dim 1): the dims
// after row_dim dense (one of size 1 may carry any stride), the dims before it of size 1 (shapes are
// checked before), and the rows any stride >= one row's elements apart (views of an engine's packed
// projection). Returns the row stride in elements (one row's elements where there is at most one row).
inline int64_t row_stride(const Checker& c, const TensorView& t, const char* name, int row_dim) {
  int64_t inner = 1;
  bool ok = true;
  for (int i = t.ndim() - 1; i > row_dim; --i) {
    if (t.size(i) > 1 && t.stride(i) != inner) ok = false;
    inner *= t.size(i);
  }
  for (int i = 0; i < row_dim; ++i) ok = ok && t.size(i) == 1;
  const bool many = t.size(row_dim) > 1;
  if (!ok || (many && t.stride(row_dim) < inner)) {
    std::vector<int64_t> st(t.ndim());
    for (int i = 0; i < t.ndim(); ++i) st[i] = t.stride(i);
    FKDA_FAIL(c.fn()) << "argument '" << name << "' must have its inner dims contiguous (row-major; the rows may "
                      << "sit any stride >= " << inner << " elements apart), got shape " << shape_str(t)
                      << " with strides " << list_str(st);
  }
  return many ? t.stride(row_dim) : inner;
}

}  // namespace fkda
