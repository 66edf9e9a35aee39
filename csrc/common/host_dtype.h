// Host-side element types and conversions for the CPU backend (and any host code that needs them).
//
// bfloat16 and float16 are stored as raw 16-bit patterns; narrowing rounds to nearest even,
// through float32 first, the way torch converts float64 to these types.
#pragma once

#include <dlpack/dlpack.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fkda {

struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round half to even on the 16 dropped bits
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7F800000u | (mant << 13));  // inf / nan
  return bits_to_float(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

inline uint16_t float_to_f16(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return static_cast<uint16_t>(sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {  // below 2^-14: subnormal; scaling by 2^24 is exact, nearbyint is RNE
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(bits_to_float(ax) * 16777216.0f));
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t h = (((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7FFFFFu) >> 13);
  const uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | h);
}

// Load/store one element as double, for each storage type.
inline double to_double(float x) { return x; }
inline double to_double(double x) { return x; }
inline double to_double(bf16_t x) { return bf16_to_float(x.bits); }
inline double to_double(f16_t x) { return f16_to_float(x.bits); }

template <typename T>
inline T from_double(double x);
template <>
inline float from_double<float>(double x) { return static_cast<float>(x); }
template <>
inline double from_double<double>(double x) { return x; }
template <>
inline bf16_t from_double<bf16_t>(double x) { return bf16_t{float_to_bf16(static_cast<float>(x))}; }
template <>
inline f16_t from_double<f16_t>(double x) { return f16_t{float_to_f16(static_cast<float>(x))}; }

// Floating dtypes the CPU backend reads and writes, chosen at run time from a DLDataType.
enum class FloatKind { kFloat32, kFloat64, kBFloat16, kFloat16, kOther };

inline FloatKind float_kind(DLDataType t) {
  if (t.lanes != 1) return FloatKind::kOther;
  if (t.code == kDLFloat && t.bits == 32) return FloatKind::kFloat32;
  if (t.code == kDLFloat && t.bits == 64) return FloatKind::kFloat64;
  if (t.code == kDLFloat && t.bits == 16) return FloatKind::kFloat16;
  if (t.code == kDLBfloat && t.bits == 16) return FloatKind::kBFloat16;
  return FloatKind::kOther;
}

// Call f(T{}) with T the storage type of `kind` (kind must be a float kind).
template <typename F>
inline void with_float_type(FloatKind kind, F&& f) {
  switch (kind) {
    case FloatKind::kFloat32: f(float{}); break;
    case FloatKind::kFloat64: f(double{}); break;
    case FloatKind::kBFloat16: f(bf16_t{}); break;
    case FloatKind::kFloat16: f(f16_t{}); break;
    default: break;
  }
}

// A typed view of a tensor's elements with a run-time dtype: reads and writes rows as doubles.
struct FloatSpan {
  void* base = nullptr;
  FloatKind kind = FloatKind::kOther;

  double get(int64_t i) const {
    switch (kind) {
      case FloatKind::kFloat32: return static_cast<const float*>(base)[i];
      case FloatKind::kFloat64: return static_cast<const double*>(base)[i];
      case FloatKind::kBFloat16: return to_double(static_cast<const bf16_t*>(base)[i]);
      case FloatKind::kFloat16: return to_double(static_cast<const f16_t*>(base)[i]);
      default: return std::nan("");
    }
  }
  void load(int64_t offset, int64_t n, double* dst) const {
    with_float_type(kind, [&](auto tag) {
      using T = decltype(tag);
      const T* p = static_cast<const T*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = to_double(p[i]);
    });
  }
  void store(int64_t offset, int64_t n, const double* src) const {
    with_float_type(kind, [&](auto tag) {
      using T = decltype(tag);
      T* p = static_cast<T*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = from_double<T>(src[i]);
    });
  }
  void fill_zero(int64_t offset, int64_t n) const {
    with_float_type(kind, [&](auto tag) {
      using T = decltype(tag);
      T* p = static_cast<T*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = from_double<T>(0.0);
    });
  }
};

}  // namespace fkda
