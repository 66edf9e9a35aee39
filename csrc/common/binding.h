// Binding conventions shared by every family and backend (CPU and CUDA).
//
// Every exported function checks its arguments here before touching memory: the last line of
// defence behind flashkda_ext/validation/. A failed check raises a Python ValueError whose
// message names the module, the function, the argument, what was expected and what was received.
// The supported set (head dims, value heads, group sizes, state dtype) is read from the FKDA_*
// macros that the JIT renders from the module record and jit/supported.json, never from literals.
#pragma once

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

// The JIT renders all of these; a hand build that forgets one should fail here, loudly.
#if !defined(FKDA_MODULE_NAME) || !defined(FKDA_FAMILY) || !defined(FKDA_THREADS) ||              \
    !defined(FKDA_SMEM_BYTES) || !defined(FKDA_MIN_BLOCKS) || !defined(FKDA_CLUSTER_X) ||           \
    !defined(FKDA_CLUSTER_Y) || !defined(FKDA_CLUSTER_Z) || !defined(FKDA_PERSISTENT_K) ||          \
    !defined(FKDA_STATE_BF16) || !defined(FKDA_SLOT_OFFSET_BITS) || !defined(FKDA_HEAD_DIM_K) ||    \
    !defined(FKDA_HEAD_DIM_V) || !defined(FKDA_SUPPORTED_VALUE_HEADS) ||                            \
    !defined(FKDA_NUM_SUPPORTED_VALUE_HEADS) || !defined(FKDA_SUPPORTED_GROUP_SIZES) ||             \
    !defined(FKDA_NUM_SUPPORTED_GROUP_SIZES)
#error "flashkda_ext: a FKDA_* macro is missing; build modules through flashkda_ext.jit (see docs/architecture.md)"
#endif

// Raise a ValueError prefixed with "<module>::<fn>: ". Use as FKDA_FAIL(fn) << "details".
#define FKDA_FAIL(fn) TVM_FFI_THROW(ValueError) << FKDA_MODULE_NAME << "::" << (fn) << ": "
// Ad-hoc contract in a binding; the message should still name the argument and both values.
#define FKDA_CHECK(cond, fn) \
  if (TVM_FFI_PREDICT_FALSE(!(cond))) FKDA_FAIL(fn)

namespace fkda {

using tvm::ffi::TensorView;
using OptTensor = tvm::ffi::Optional<tvm::ffi::TensorView>;

// ---------------------------------------------------------------------------------------------
// Enumerations of the module ABI (docs/architecture.md, "Module ABI").

enum class GateMode : int64_t { kSoftplus = 0, kBounded = 1, kLog = 2 };
constexpr int64_t kNumGateModes = 3;

inline const char* gate_mode_name(GateMode m) {
  switch (m) {
    case GateMode::kSoftplus: return "softplus";
    case GateMode::kBounded: return "bounded";
    case GateMode::kLog: return "log";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Data types.

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kF64{kDLFloat, 64, 1};
constexpr DLDataType kF16{kDLFloat, 16, 1};
constexpr DLDataType kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kI64{kDLInt, 64, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};

inline bool same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

inline std::string dtype_name(DLDataType t) {
  std::string base;
  switch (t.code) {
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLBool: base = "bool"; break;
    default: base = "code" + std::to_string(static_cast<int>(t.code)) + "_"; break;
  }
  std::string s = base + std::to_string(static_cast<int>(t.bits));
  if (t.lanes != 1) s += "x" + std::to_string(static_cast<int>(t.lanes));
  return s;
}

inline std::string device_type_name(DLDeviceType t) {
  switch (t) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed";
    default: return "device_type" + std::to_string(static_cast<int>(t));
  }
}

inline std::string device_name(DLDevice d) {
  return device_type_name(d.device_type) + ":" + std::to_string(d.device_id);
}

template <typename Seq>
std::string list_str(const Seq& xs) {
  std::ostringstream os;
  os << "[";
  bool first = true;
  for (const auto& x : xs) {
    os << (first ? "" : ", ") << x;
    first = false;
  }
  os << "]";
  return os.str();
}

inline std::string shape_str(const TensorView& t) {
  std::vector<int64_t> s(t.ndim());
  for (int i = 0; i < t.ndim(); ++i) s[i] = t.size(i);
  return list_str(s);
}

// First element, honouring DLPack's byte_offset.
template <typename T>
inline T* data_ptr(const TensorView& t) {
  return static_cast<T*>(static_cast<void*>(static_cast<char*>(t.data_ptr()) + t.byte_offset()));
}

// ---------------------------------------------------------------------------------------------
// Argument checks. One Checker per exported call; `fn` is the exported function's name.

// A named dimension of an expected shape; value < 0 means "any".
struct Dim {
  const char* label;
  int64_t value;
};

class Checker {
 public:
  explicit Checker(const char* fn) : fn_(fn) {}
  const char* fn() const { return fn_; }

  void device_type(const TensorView& t, const char* name, DLDeviceType type) const {
    if (t.device().device_type != type) {
      FKDA_FAIL(fn_) << "argument '" << name << "' must be a " << device_type_name(type)
                     << " tensor, got one on " << device_name(t.device());
    }
  }

  // t lives on exactly the same device as ref (type and id).
  void same_device(const TensorView& t, const char* name, const TensorView& ref,
                   const char* ref_name) const {
    DLDevice a = t.device(), b = ref.device();
    if (a.device_type != b.device_type || a.device_id != b.device_id) {
      FKDA_FAIL(fn_) << "argument '" << name << "' must be on the same device as '" << ref_name
                     << "' (" << device_name(b) << "), got " << device_name(a);
    }
  }

  void dtype(const TensorView& t, const char* name, std::initializer_list<DLDataType> allowed) const {
    for (DLDataType a : allowed)
      if (same_dtype(t.dtype(), a)) return;
    std::vector<std::string> names;  // each once: a list like {q's dtype, float32} can name one twice
    for (DLDataType a : allowed)
      if (std::find(names.begin(), names.end(), dtype_name(a)) == names.end()) names.push_back(dtype_name(a));
    FKDA_FAIL(fn_) << "argument '" << name << "' must have dtype "
                   << (names.size() == 1 ? names[0] : "one of " + list_str(names)) << ", got "
                   << dtype_name(t.dtype());
  }

  void same_dtype_as(const TensorView& t, const char* name, const TensorView& ref,
                     const char* ref_name) const {
    if (!same_dtype(t.dtype(), ref.dtype())) {
      FKDA_FAIL(fn_) << "argument '" << name << "' must have the dtype of '" << ref_name << "' ("
                     << dtype_name(ref.dtype()) << "), got " << dtype_name(t.dtype());
    }
  }

  void ndim(const TensorView& t, const char* name, int expected, const char* layout) const {
    if (t.ndim() != expected) {
      FKDA_FAIL(fn_) << "argument '" << name << "' must have " << expected << " dims " << layout
                     << ", got " << t.ndim() << " dims with shape " << shape_str(t);
    }
  }

  // Exact shape with named dims, e.g. {{"rows", 3}, {"H", 2}, {"K", 64}}.
  void shape(const TensorView& t, const char* name, std::initializer_list<Dim> dims) const {
    bool ok = t.ndim() == static_cast<int>(dims.size());
    int i = 0;
    for (const Dim& d : dims) {
      if (ok && d.value >= 0 && t.size(i) != d.value) ok = false;
      ++i;
    }
    if (ok) return;
    std::ostringstream want;
    want << "[";
    i = 0;
    for (const Dim& d : dims) {
      want << (i++ ? ", " : "") << d.label;
      if (d.value >= 0) want << "=" << d.value;
    }
    want << "]";
    FKDA_FAIL(fn_) << "argument '" << name << "' must have shape " << want.str() << ", got "
                   << shape_str(t);
  }

  // Compact row-major (dims of size 1 may carry any stride, as DLPack producers normalise them).
  void contiguous(const TensorView& t, const char* name) const {
    if (t.IsContiguous()) return;
    std::vector<int64_t> st(t.ndim());
    for (int i = 0; i < t.ndim(); ++i) st[i] = t.stride(i);
    FKDA_FAIL(fn_) << "argument '" << name << "' must be contiguous (row-major), got shape "
                   << shape_str(t) << " with strides " << list_str(st);
  }

  void aligned(const TensorView& t, const char* name, int64_t bytes) const {
    auto addr = reinterpret_cast<std::uintptr_t>(data_ptr<char>(t));
    if (t.numel() > 0 && addr % static_cast<std::uintptr_t>(bytes) != 0) {
      FKDA_FAIL(fn_) << "argument '" << name << "' must be " << bytes
                     << "-byte aligned, got address offset " << (addr % bytes) << " mod " << bytes;
    }
  }

  // Element offsets of the whole tensor must fit a signed index of `bits` bits.
  void offsets_fit(const TensorView& t, const char* name, int bits) const {
    if (bits >= 64) return;
    const int64_t limit = (int64_t{1} << (bits - 1)) - 1;
    if (t.numel() > limit) {
      FKDA_FAIL(fn_) << "argument '" << name << "' has " << t.numel()
                     << " elements, more than this module's " << bits
                     << "-bit slot offsets address (max " << limit
                     << "); use a module with 64-bit offsets";
    }
  }

  // ---- scalars -------------------------------------------------------------------------------

  GateMode gate_mode(int64_t mode) const {
    if (mode < 0 || mode >= kNumGateModes) {
      FKDA_FAIL(fn_) << "argument 'gate_mode' must be 0 (softplus), 1 (bounded) or 2 (log), got "
                     << mode;
    }
    return static_cast<GateMode>(mode);
  }

  // lower_bound matters only for the bounded gate, where it must be finite and < 0.
  void lower_bound(GateMode mode, double lb) const {
    if (mode == GateMode::kBounded && !(std::isfinite(lb) && lb < 0.0)) {
      FKDA_FAIL(fn_) << "argument 'lower_bound' must be finite and < 0 with the bounded gate, got "
                     << lb;
    }
  }

  // A_log float32 [HV] and dt_bias float32 [HV*K] or [HV, K], on ref's device. softplus needs
  // both; log takes neither (it is the decay itself); bounded takes each optionally (absent = 0),
  // the same rule as flashkda_ext/validation/ and the reference.
  void gate_params(GateMode mode, const OptTensor& A_log, const OptTensor& dt_bias, int64_t HV,
                   int64_t K, const TensorView& ref, const char* ref_name) const {
    if (mode == GateMode::kSoftplus && (!A_log.has_value() || !dt_bias.has_value())) {
      FKDA_FAIL(fn_) << "argument '" << (A_log.has_value() ? "dt_bias" : "A_log")
                     << "' is required by the softplus gate (gate_mode 0), got None";
    }
    if (mode == GateMode::kLog && (A_log.has_value() || dt_bias.has_value())) {
      FKDA_FAIL(fn_) << "argument '" << (A_log.has_value() ? "A_log" : "dt_bias")
                     << "' must be None with the log gate (gate_mode 2: g is the log decay), got a tensor";
    }
    if (A_log.has_value()) {
      const TensorView& a = A_log.value();
      same_device(a, "A_log", ref, ref_name);
      dtype(a, "A_log", {kF32});
      shape(a, "A_log", {{"HV", HV}});
      contiguous(a, "A_log");
    }
    if (dt_bias.has_value()) {
      const TensorView& b = dt_bias.value();
      same_device(b, "dt_bias", ref, ref_name);
      dtype(b, "dt_bias", {kF32});
      if (b.ndim() == 2) {
        shape(b, "dt_bias", {{"HV", HV}, {"K", K}});
      } else {
        shape(b, "dt_bias", {{"HV*K", HV * K}});
      }
      contiguous(b, "dt_bias");
    }
  }

  void positive_finite(double x, const char* name) const {
    if (!(std::isfinite(x) && x > 0.0)) {
      FKDA_FAIL(fn_) << "argument '" << name << "' must be finite and > 0, got " << x;
    }
  }

  void non_negative(int64_t x, const char* name) const {
    if (x < 0) FKDA_FAIL(fn_) << "argument '" << name << "' must be >= 0, got " << x;
  }

  // ---- the supported set, from the FKDA_* macros ---------------------------------------------

  void head_dims(int64_t K, int64_t V) const {
    if (K <= 0 || V <= 0) {
      FKDA_FAIL(fn_) << "head dims must be > 0, got K=" << K << ", V=" << V;
    }
    if (FKDA_HEAD_DIM_K != 0 && K != FKDA_HEAD_DIM_K) {
      FKDA_FAIL(fn_) << "key head dim K must be " << FKDA_HEAD_DIM_K << " for this module, got " << K;
    }
    if (FKDA_HEAD_DIM_V != 0 && V != FKDA_HEAD_DIM_V) {
      FKDA_FAIL(fn_) << "value head dim V must be " << FKDA_HEAD_DIM_V << " for this module, got "
                     << V;
    }
  }

  // HV must be a supported value-head count and a multiple of H with a supported group size. The
  // arguments the counts come from are named in the error (q and v; g for the fused ops, HV = H).
  void heads(int64_t H, int64_t HV, const char* v_name = "v", const char* q_name = "q") const {
    if (H <= 0 || HV <= 0 || HV % H != 0) {
      FKDA_FAIL(fn_) << "argument '" << v_name << "' has HV = " << HV << " value heads; expected a positive "
                     << "multiple of the key heads H = " << H << " of '" << q_name << "'";
    }
    // Arrays are one longer than their list so an empty brace list ({} = any) stays valid C++.
    static constexpr int64_t kHeads[FKDA_NUM_SUPPORTED_VALUE_HEADS + 1] = FKDA_SUPPORTED_VALUE_HEADS;
    static constexpr int64_t kGroups[FKDA_NUM_SUPPORTED_GROUP_SIZES + 1] = FKDA_SUPPORTED_GROUP_SIZES;
    if (!in_list(HV, kHeads, FKDA_NUM_SUPPORTED_VALUE_HEADS)) {
      FKDA_FAIL(fn_) << "value heads HV must be one of "
                     << list_of(kHeads, FKDA_NUM_SUPPORTED_VALUE_HEADS) << " for this module, got "
                     << HV;
    }
    if (!in_list(HV / H, kGroups, FKDA_NUM_SUPPORTED_GROUP_SIZES)) {
      FKDA_FAIL(fn_) << "group size HV/H must be one of "
                     << list_of(kGroups, FKDA_NUM_SUPPORTED_GROUP_SIZES)
                     << " for this module, got HV/H=" << HV << "/" << H << "=" << HV / H;
    }
  }

  // FKDA_STATE_BF16: 0 = float32 only, 1 = bfloat16 only, -1 = any of `any_of`.
  void state_dtype(const TensorView& t, const char* name,
                   std::initializer_list<DLDataType> any_of) const {
    if (FKDA_STATE_BF16 == 1) {
      dtype(t, name, {kBF16});
    } else if (FKDA_STATE_BF16 == 0) {
      dtype(t, name, {kF32});
    } else {
      dtype(t, name, any_of);
    }
  }

  // ---- host-side index checks (only where the indices live in host memory) -------------------

  // Every index in [*, slots): negative ones are padding; a padding index is never dereferenced.
  void slot_indices_host(const TensorView& idx, const char* name, int64_t slots) const {
    const int32_t* p = data_ptr<int32_t>(idx);
    const int64_t n = idx.numel();
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] >= slots) {
        FKDA_FAIL(fn_) << "argument '" << name << "': index " << name << "[" << i << "] = " << p[i]
                       << " is out of range for a pool of " << slots
                       << " slots (expected < " << slots << "; negative = padding)";
      }
    }
  }

  // cu_seqlens (int32 or int64, host memory): starts at 0, non-decreasing, ends at T.
  std::vector<int64_t> cu_seqlens_host(const TensorView& cu, const char* name, int64_t T) const {
    const int64_t n = cu.numel();
    std::vector<int64_t> off(n);
    if (same_dtype(cu.dtype(), kI32)) {
      const int32_t* p = data_ptr<int32_t>(cu);
      for (int64_t i = 0; i < n; ++i) off[i] = p[i];
    } else {
      const int64_t* p = data_ptr<int64_t>(cu);
      for (int64_t i = 0; i < n; ++i) off[i] = p[i];
    }
    if (n < 1 || off[0] != 0) {
      FKDA_FAIL(fn_) << "argument '" << name << "' must start at 0, got "
                     << (n < 1 ? std::string("an empty tensor") : std::to_string(off[0]));
    }
    for (int64_t i = 1; i < n; ++i) {
      if (off[i] < off[i - 1]) {
        FKDA_FAIL(fn_) << "argument '" << name << "' must be non-decreasing, got " << name << "["
                       << i - 1 << "] = " << off[i - 1] << " > " << name << "[" << i
                       << "] = " << off[i];
      }
    }
    if (off[n - 1] != T) {
      FKDA_FAIL(fn_) << "argument '" << name << "' must end at the token count T = " << T
                     << ", got " << name << "[" << n - 1 << "] = " << off[n - 1];
    }
    return off;
  }

 private:
  static bool in_list(int64_t x, const int64_t* xs, int64_t n) {
    if (n == 0) return true;  // empty list = any
    for (int64_t i = 0; i < n; ++i)
      if (xs[i] == x) return true;
    return false;
  }
  static std::string list_of(const int64_t* xs, int64_t n) {
    return list_str(std::vector<int64_t>(xs, xs + n));
  }

  const char* fn_;
};

// ---------------------------------------------------------------------------------------------
// fkda_contract(): the macros this module was compiled with, as JSON keyed by macro name, so tests
// can prove the binding, the module record and jit/supported.json agree. Without the JIT's
// FKDA_CONTRACT_JSON (a hand build) it is assembled from the macros the binding reads.

namespace detail {
inline std::string json_string(const char* s) {
  std::string out = "\"";
  for (const char* c = s; *c; ++c) {
    if (*c == '"' || *c == '\\') out += '\\';
    out += *c;
  }
  return out + "\"";
}
inline std::string json_list(const int64_t* xs, int64_t n) {
  std::string s = "[";
  for (int64_t i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(xs[i]);
  return s + "]";
}
}  // namespace detail

inline tvm::ffi::String contract_json() {
#ifdef FKDA_CONTRACT_JSON
  // The JIT renders the whole contract (FKDA_PARAM_* included) beside the individual macros.
  return tvm::ffi::String(FKDA_CONTRACT_JSON);
#else
  static constexpr int64_t kHeads[FKDA_NUM_SUPPORTED_VALUE_HEADS + 1] = FKDA_SUPPORTED_VALUE_HEADS;
  static constexpr int64_t kGroups[FKDA_NUM_SUPPORTED_GROUP_SIZES + 1] = FKDA_SUPPORTED_GROUP_SIZES;
  std::ostringstream os;
  os << "{"
     << "\"FKDA_MODULE_NAME\":" << detail::json_string(FKDA_MODULE_NAME) << ","
     << "\"FKDA_FAMILY\":" << detail::json_string(FKDA_FAMILY) << ","
     << "\"FKDA_THREADS\":" << static_cast<int64_t>(FKDA_THREADS) << ","
     << "\"FKDA_SMEM_BYTES\":" << static_cast<int64_t>(FKDA_SMEM_BYTES) << ","
     << "\"FKDA_MIN_BLOCKS\":" << static_cast<int64_t>(FKDA_MIN_BLOCKS) << ","
     << "\"FKDA_CLUSTER_X\":" << static_cast<int64_t>(FKDA_CLUSTER_X) << ","
     << "\"FKDA_CLUSTER_Y\":" << static_cast<int64_t>(FKDA_CLUSTER_Y) << ","
     << "\"FKDA_CLUSTER_Z\":" << static_cast<int64_t>(FKDA_CLUSTER_Z) << ","
     << "\"FKDA_PERSISTENT_K\":" << static_cast<int64_t>(FKDA_PERSISTENT_K) << ","
     << "\"FKDA_STATE_BF16\":" << static_cast<int64_t>(FKDA_STATE_BF16) << ","
     << "\"FKDA_SLOT_OFFSET_BITS\":" << static_cast<int64_t>(FKDA_SLOT_OFFSET_BITS) << ","
     << "\"FKDA_HEAD_DIM_K\":" << static_cast<int64_t>(FKDA_HEAD_DIM_K) << ","
     << "\"FKDA_HEAD_DIM_V\":" << static_cast<int64_t>(FKDA_HEAD_DIM_V) << ","
     << "\"FKDA_SUPPORTED_VALUE_HEADS\":"
     << detail::json_list(kHeads, FKDA_NUM_SUPPORTED_VALUE_HEADS) << ","
     << "\"FKDA_NUM_SUPPORTED_VALUE_HEADS\":"
     << static_cast<int64_t>(FKDA_NUM_SUPPORTED_VALUE_HEADS) << ","
     << "\"FKDA_SUPPORTED_GROUP_SIZES\":"
     << detail::json_list(kGroups, FKDA_NUM_SUPPORTED_GROUP_SIZES) << ","
     << "\"FKDA_NUM_SUPPORTED_GROUP_SIZES\":"
     << static_cast<int64_t>(FKDA_NUM_SUPPORTED_GROUP_SIZES) << "}";
  return tvm::ffi::String(os.str());
#endif
}

// ---------------------------------------------------------------------------------------------
// Call signatures: the fast path of the Python ops (flashkda_ext/fast_path.py).
//
// A serving loop calls an op with tensors whose metadata repeats step after step. Python validates
// a call in full once and keeps the signature of its tensor arguments; later calls go to the
// function's `<name>_checked` twin, which launches only when its arguments have that signature.
// The signature covers everything the Python validation reads from a tensor: presence, shape,
// strides, dtype, device and the 16-byte alignment of the data pointer, and one fact about the
// call as a whole: whether a tensor the function writes overlaps any other tensor argument (the
// full check refuses that, and it depends on addresses, which the signature leaves out). It is a
// 64-bit hash: a collision would skip the Python checks, never the binding's own (they run before
// every launch). What DLPack does not carry (autograd and neg/conj bits) the Python side checks.

// The bytes a tensor can touch: [lo, hi) of its device's address space (empty when numel is 0).
struct Extent {
  std::uintptr_t lo = 0, hi = 0;
  int32_t device_type = 0, device_id = 0;

  static Extent of(const TensorView& t) {
    Extent e;
    const DLDevice dev = t.device();
    e.device_type = static_cast<int32_t>(dev.device_type);
    e.device_id = dev.device_id;
    if (t.numel() == 0) return e;
    int64_t last = 0;  // offset of the last element, in elements (strides are never negative here)
    for (int i = 0; i < t.ndim(); ++i) last += (t.size(i) - 1) * t.stride(i);
    const int64_t elem = (int64_t(t.dtype().bits) * t.dtype().lanes + 7) / 8;
    e.lo = reinterpret_cast<std::uintptr_t>(data_ptr<char>(t));
    e.hi = e.lo + static_cast<std::uintptr_t>((last + 1) * elem);
    return e;
  }
  bool overlaps(const Extent& o) const {
    return lo < hi && o.lo < o.hi && device_type == o.device_type && device_id == o.device_id &&
           lo < o.hi && o.lo < hi;
  }
};

inline bool same_view(const TensorView& a, const TensorView& b) {
  if (data_ptr<char>(a) != data_ptr<char>(b) || a.ndim() != b.ndim() || !same_dtype(a.dtype(), b.dtype()))
    return false;
  for (int i = 0; i < a.ndim(); ++i)
    if (a.size(i) != b.size(i) || a.stride(i) != b.stride(i)) return false;
  return true;
}

// Two pools of one paged cache that never share a byte although their extents overlap (vLLM keeps a
// layer's conv cache and state pool in one page a slot): the same slot stride in bytes (dim 0), and no
// slot of one meeting a slot of the other, a slot taken as the bytes from its first element to its last.
// Slot i of a and slot j of b meet when d - fa < (i - j) P < d + fb. The Python rule is
// flashkda_ext/validation/common.py, _slots_apart.
inline int64_t floor_div(int64_t x, int64_t y) { return x / y - ((x % y != 0) && ((x < 0) != (y < 0))); }

inline bool slots_apart(const TensorView& a, const TensorView& b) {
  if (a.ndim() < 2 || b.ndim() < 2 || a.numel() == 0 || b.numel() == 0) return false;
  const DLDevice da = a.device(), db = b.device();
  if (da.device_type != db.device_type || da.device_id != db.device_id) return false;
  const int64_t ea = (int64_t(a.dtype().bits) * a.dtype().lanes + 7) / 8;
  const int64_t eb = (int64_t(b.dtype().bits) * b.dtype().lanes + 7) / 8;
  const int64_t P = a.stride(0) * ea;
  if (P <= 0 || P != b.stride(0) * eb) return false;
  int64_t fa = 1, fb = 1;  // a slot's elements, first to last
  for (int i = 1; i < a.ndim(); ++i) fa += (a.size(i) - 1) * a.stride(i);
  for (int i = 1; i < b.ndim(); ++i) fb += (b.size(i) - 1) * b.stride(i);
  fa *= ea;
  fb *= eb;
  const int64_t d = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(data_ptr<char>(b)) -
                                         reinterpret_cast<std::uintptr_t>(data_ptr<char>(a)));
  const int64_t k_lo = std::max(floor_div(d - fa, P) + 1, -(b.size(0) - 1));
  const int64_t k_hi = std::min(-floor_div(-(d + fb), P) - 1, a.size(0) - 1);
  return k_lo > k_hi;
}

class Signature {
 public:
  void add(const TensorView& t) {
    mix(static_cast<uint64_t>(t.ndim()) + 2);
    for (int i = 0; i < t.ndim(); ++i) {
      mix(static_cast<uint64_t>(t.size(i)));
      mix(static_cast<uint64_t>(t.stride(i)));
    }
    const DLDataType d = t.dtype();
    const DLDevice dev = t.device();
    mix((uint64_t(d.code) << 24) | (uint64_t(d.bits) << 16) | d.lanes);
    mix((uint64_t(dev.device_type) << 32) | uint32_t(dev.device_id));
    mix(reinterpret_cast<std::uintptr_t>(data_ptr<char>(t)) & 15);
  }
  void add(const OptTensor& t) {
    if (t.has_value()) add(t.value());
    else mix(1);  // absent
  }
  template <typename Scalar>
  void add(const Scalar&) {  // scalars are part of the Python side's key, not of the signature
    static_assert(std::is_arithmetic_v<Scalar>,
                  "a checked function's arguments are TensorView, Optional<TensorView> or scalars: any other "
                  "argument would be left out of the signature");
  }
  void mark_overlap() { mix(0x6f7665726c6170ull); }  // a call the full check refuses
  // Never 0: the Python side asks for a signature alone by passing 0 as the expected one.
  // splitmix64's finalizer once, over the running hash.
  int64_t value() const {
    uint64_t z = h_ + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return static_cast<int64_t>((z ^ (z >> 31)) | 1);
  }

 private:
  // One multiply a word (rotate, xor, multiply by an odd constant: the FxHash step): a call mixes
  // ~130 words, and a full finalizer per word was ~0.35 us of the fast path (measured on x86-64).
  void mix(uint64_t x) { h_ = (((h_ << 5) | (h_ >> 59)) ^ x) * 0x517cc1b727220a95ull; }
  uint64_t h_ = 0;
};

// The tensor arguments of one call, in order, for the overlap rule (at most 16).
class CallTensors {
 public:
  void add(const TensorView& t) { push(&t); }
  void add(const OptTensor& t) { push(t.has_value() ? &t.value() : nullptr); }
  template <typename Scalar>
  void add(const Scalar&) {}
  // True when an argument in `written` (bit i = argument i) overlaps another tensor argument; the
  // identical view is allowed only for the pair (alias_a, alias_b) (prefill's pool: read and written
  // in place as initial_state and final_state).
  bool written_overlap(uint32_t written, int alias_a, int alias_b) const {
    Extent e[kMax];  // each argument's extent once, not once per pair
    for (int i = 0; i < n_; ++i)
      if (t_[i] != nullptr) e[i] = Extent::of(*t_[i]);
    for (int i = 0; i < n_; ++i) {
      if (!((written >> i) & 1u) || t_[i] == nullptr) continue;
      for (int j = 0; j < n_; ++j) {
        if (j == i || t_[j] == nullptr) continue;
        if (!e[i].overlaps(e[j])) continue;
        const bool pair = (i == alias_a && j == alias_b) || (i == alias_b && j == alias_a);
        if (pair && same_view(*t_[i], *t_[j])) continue;
        if (!slots_apart(*t_[i], *t_[j])) return true;
      }
    }
    return false;
  }

 private:
  void push(const TensorView* t) {
    if (n_ < kMax) t_[n_++] = t;
  }
  static constexpr int kMax = 16;
  const TensorView* t_[kMax] = {};
  int n_ = 0;
};

// `<name>_checked(expected, args...)`: returns the signature of args; the call runs only when it
// equals `expected`. kWritten: bit i set when argument i (0-based, tensors and scalars counted) is
// written by the function; (kAliasA, kAliasB): the one pair that may be the identical view.
template <typename F, uint32_t kWritten, int kAliasA, int kAliasB>
struct Checked;
template <typename... A, uint32_t kWritten, int kAliasA, int kAliasB>
struct Checked<void (*)(A...), kWritten, kAliasA, kAliasB> {
  static_assert(sizeof...(A) <= 32, "the written mask holds 32 arguments");
  template <void (*Fn)(A...)>
  static int64_t call(int64_t expected, A... a) {
    Signature s;
    (s.add(a), ...);
    CallTensors ts;
    (ts.add(a), ...);
    if (ts.written_overlap(kWritten, kAliasA, kAliasB)) s.mark_overlap();
    const int64_t sig = s.value();
    if (sig == expected) Fn(a...);
    return sig;
  }
};

}  // namespace fkda

// Each module's binding source exports its contract exactly once.
#define FKDA_EXPORT_CONTRACT() TVM_FFI_DLL_EXPORT_TYPED_FUNC(fkda_contract, ::fkda::contract_json)
// The signature-checked twin of an exported function `name` (see Signature above).
// written: mask of the arguments the function writes (bit i = argument i); alias_a / alias_b: the
// one pair of arguments allowed to be the identical view (-1 -1: none). See Checked above.
#define FKDA_EXPORT_CHECKED(name, written, alias_a, alias_b)              \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(name##_checked,                           \
                                (::fkda::Checked<decltype(&name), (written), (alias_a), (alias_b)>::call<&name>))
