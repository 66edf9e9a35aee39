// TVM-FFI binding of the family kda_decode on sm_90a (contract: docs/architecture.md).
// One source builds every decode module; the module record's macros pick the schedule:
//   FKDA_PARAM_SCHEDULE        0 tile (cluster when FKDA_CLUSTER_X == 2), 1 persistent, 2 sequential
//   FKDA_PARAM_V_TILE          V-rows per CTA (one CTA covers V_TILE of the 128 value columns)
//   FKDA_PARAM_LANES_PER_ROW   lanes sharing one V-row (8 or 16)
#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <climits>
#include <cstdint>
#include <string>

#if !defined(FKDA_THREADS) || !defined(FKDA_MIN_BLOCKS) || !defined(FKDA_CLUSTER_X) ||            \
    !defined(FKDA_PERSISTENT_K) || !defined(FKDA_STATE_BF16) || !defined(FKDA_SLOT_OFFSET_BITS) || \
    !defined(FKDA_HEAD_DIM_K) || !defined(FKDA_HEAD_DIM_V) || !defined(FKDA_PARAM_SCHEDULE) ||     \
    !defined(FKDA_PARAM_V_TILE) || !defined(FKDA_PARAM_LANES_PER_ROW) ||                           \
    !defined(FKDA_SMEM_BYTES) || !defined(FKDA_NUM_SUPPORTED_VALUE_HEADS) ||                       \
    !defined(FKDA_NUM_SUPPORTED_GROUP_SIZES) || !defined(FKDA_CONTRACT_JSON)
#error "kda_decode.cu is built from a module record: its macros (docs/architecture.md) are missing"
#endif

#include "kda_decode_kernels.cuh"

namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;
using namespace fkda_decode;

constexpr bool kStateBf16 = FKDA_STATE_BF16 == 1;
using OffT = std::conditional_t<FKDA_SLOT_OFFSET_BITS == 64, int64_t, int32_t>;
static_assert(FKDA_SLOT_OFFSET_BITS == 32 || FKDA_SLOT_OFFSET_BITS == 64, "offset bits");
static_assert(FKDA_STATE_BF16 == 0 || FKDA_STATE_BF16 == 1, "CUDA decode modules fix the state dtype");
static_assert(FKDA_PARAM_SCHEDULE >= 0 && FKDA_PARAM_SCHEDULE <= 2, "schedule");
static_assert(FKDA_CLUSTER_X == 1 || (FKDA_CLUSTER_X == 2 && FKDA_PARAM_SCHEDULE == 0),
              "clusters only in the tile schedule, pairs only");
static_assert(FKDA_CLUSTER_Y == 1 && FKDA_CLUSTER_Z == 1, "cluster y/z");
static_assert(FKDA_PARAM_SCHEDULE != 1 || FKDA_PERSISTENT_K > 0, "persistent schedule needs k > 0");
static_assert(FKDA_SMEM_BYTES == 0, "decode kernels use static shared memory only");

#define FKDA_KERNEL_ARGS kStateBf16, FKDA_PARAM_LANES_PER_ROW, FKDA_PARAM_V_TILE, FKDA_THREADS, OffT

constexpr int kNumVT = FKDA_HEAD_DIM_V / FKDA_PARAM_V_TILE;

bool is_dtype(const DLDataType& t, uint8_t code, uint8_t bits) {
  return t.code == code && t.bits == bits && t.lanes == 1;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << FKDA_MODULE_NAME << ": " << what << ": " << cudaGetErrorString(e);
  }
}

template <typename T>
const T* ptr_of(const TensorView& t) {
  return reinterpret_cast<const T*>(static_cast<const char*>(t.data_ptr()) + t.byte_offset());
}
template <typename T>
T* mut_ptr_of(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

// [rows, n, d] with the inner two dims dense; rows may be strided (views of packed projections).
void check_rows_tensor(const TensorView& t, const char* name, int64_t rows, int64_t n, int64_t d,
                       const DLDevice& dev) {
  TVM_FFI_CHECK(t.ndim() == 3, ValueError) << name << ": expected 3 dims, got " << t.ndim();
  TVM_FFI_CHECK(t.size(0) == rows && t.size(1) == n && t.size(2) == d, ValueError)
      << name << ": expected shape [" << rows << ", " << n << ", " << d << "], got [" << t.size(0)
      << ", " << t.size(1) << ", " << t.size(2) << "]";
  TVM_FFI_CHECK(is_dtype(t.dtype(), kDLBfloat, 16), TypeError) << name << ": expected bfloat16";
  TVM_FFI_CHECK(t.device().device_type == kDLCUDA && t.device().device_id == dev.device_id,
                ValueError) << name << ": expected a tensor on cuda:" << dev.device_id;
  TVM_FFI_CHECK(t.stride(2) == 1 && (n == 1 || t.stride(1) == d), ValueError)
      << name << ": inner two dims must be contiguous";
  TVM_FFI_CHECK(rows <= 1 || t.stride(0) >= n * d, ValueError) << name << ": bad row stride";
  // 16-byte (fp32 state: 8-byte) vector loads along K
  TVM_FFI_CHECK(reinterpret_cast<uintptr_t>(ptr_of<char>(t)) % 16 == 0 &&
                    (rows <= 1 || (t.stride(0) * 2) % 16 == 0), ValueError)
      << name << ": base and row stride must be 16-byte aligned";
}

bool value_heads_supported(int64_t hv) {
#if FKDA_NUM_SUPPORTED_VALUE_HEADS > 0
  constexpr int kHeads[] = FKDA_SUPPORTED_VALUE_HEADS;
  for (int h : kHeads)
    if (h == hv) return true;
  return false;
#else
  return hv > 0;
#endif
}

bool group_supported(int64_t gs) {
#if FKDA_NUM_SUPPORTED_GROUP_SIZES > 0
  constexpr int kGroups[] = FKDA_SUPPORTED_GROUP_SIZES;
  for (int x : kGroups)
    if (x == gs) return true;
  return false;
#else
  return gs > 0;
#endif
}

[[maybe_unused]] int sm_count(int device) {
  // cached per device: the attribute query is a driver call per launch otherwise
  static int cache[64] = {0};
  if (device >= 0 && device < 64 && cache[device] > 0) return cache[device];
  int n = 0;
  check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "SM count");
  if (device >= 0 && device < 64) cache[device] = n;
  return n;
}

struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != dev) check_cuda(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev && prev >= 0) cudaSetDevice(prev);
  }
};

// Launch isolated here so it can move onto csrc/common/cuda_launch.h unchanged in meaning.
template <typename... Args>
void launch(void (*kernel)(Args...), unsigned grid, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(FKDA_THREADS, 1, 1);
  cfg.dynamicSmemBytes = FKDA_SMEM_BYTES;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  cfg.numAttrs = 0;
  if (FKDA_CLUSTER_X > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = FKDA_CLUSTER_X;
    attr[0].val.clusterDim.y = FKDA_CLUSTER_Y;
    attr[0].val.clusterDim.z = FKDA_CLUSTER_Z;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, args...), "kernel launch");
  check_cuda(cudaGetLastError(), "kernel launch");
}

void kda_decode(TensorView q, TensorView k, TensorView v, TensorView g, TensorView beta,
                Optional<TensorView> A_log, Optional<TensorView> dt_bias, TensorView state,
                TensorView state_indices, TensorView out, int64_t gate_mode, double lower_bound,
                double scale, bool beta_is_logit, bool null_slot0) {
  constexpr int64_t K = FKDA_HEAD_DIM_K, V = FKDA_HEAD_DIM_V;
  const DLDevice dev = out.device();
  TVM_FFI_CHECK(dev.device_type == kDLCUDA, ValueError) << FKDA_MODULE_NAME << ": out must be on CUDA";
  TVM_FFI_CHECK(v.ndim() == 3, ValueError) << "v: expected [rows, HV, V]";
  TVM_FFI_CHECK(q.ndim() == 3, ValueError) << "q: expected [rows, H, K]";
  const int64_t rows = v.size(0), HV = v.size(1), H = q.size(1);
  TVM_FFI_CHECK(q.size(2) == K && v.size(2) == V, ValueError)
      << FKDA_MODULE_NAME << ": head dims must be K=" << K << ", V=" << V << "; got K=" << q.size(2)
      << ", V=" << v.size(2);
  TVM_FFI_CHECK(H > 0 && HV % H == 0, ValueError) << "HV=" << HV << " must be a multiple of H=" << H;
  TVM_FFI_CHECK(value_heads_supported(HV), ValueError)
      << FKDA_MODULE_NAME << ": HV=" << HV << " not among the supported value heads";
  TVM_FFI_CHECK(group_supported(HV / H), ValueError)
      << FKDA_MODULE_NAME << ": group size HV/H=" << HV / H << " not supported";
  TVM_FFI_CHECK(rows < (int64_t(1) << 24), ValueError) << "rows: at most 2^24";
  check_rows_tensor(q, "q", rows, H, K, dev);
  check_rows_tensor(k, "k", rows, H, K, dev);
  check_rows_tensor(v, "v", rows, HV, V, dev);
  check_rows_tensor(g, "g", rows, HV, K, dev);
  TVM_FFI_CHECK(beta.ndim() == 2 && beta.size(0) == rows && beta.size(1) == HV, ValueError)
      << "beta: expected [rows, HV]";
  TVM_FFI_CHECK(is_dtype(beta.dtype(), kDLBfloat, 16), TypeError) << "beta: expected bfloat16";
  TVM_FFI_CHECK(beta.device().device_type == kDLCUDA && beta.device().device_id == dev.device_id &&
                    (HV == 1 || beta.stride(1) == 1), ValueError)
      << "beta: expected [rows, HV] on the same device, heads contiguous";
  TVM_FFI_CHECK(out.ndim() == 3 && out.size(0) == rows && out.size(1) == HV && out.size(2) == V,
                ValueError) << "out: expected [rows, HV, V]";
  TVM_FFI_CHECK(is_dtype(out.dtype(), kDLBfloat, 16), TypeError) << "out: expected bfloat16 (v's dtype)";
  TVM_FFI_CHECK(out.IsContiguous(), ValueError) << "out: expected contiguous";
  TVM_FFI_CHECK(state_indices.ndim() == 1 && state_indices.size(0) == rows &&
                    is_dtype(state_indices.dtype(), kDLInt, 32) &&
                    state_indices.device().device_id == dev.device_id &&
                    state_indices.device().device_type == kDLCUDA &&
                    (rows <= 1 || state_indices.stride(0) == 1), ValueError)
      << "state_indices: expected int32 [rows], contiguous, on the same device";
  TVM_FFI_CHECK(state.ndim() == 4 && state.size(1) == HV && state.size(2) == V && state.size(3) == K,
                ValueError) << "state: expected pool [slots, HV, V, K]";
  TVM_FFI_CHECK(kStateBf16 ? is_dtype(state.dtype(), kDLBfloat, 16) : is_dtype(state.dtype(), kDLFloat, 32),
                TypeError) << FKDA_MODULE_NAME << ": state must be " << (kStateBf16 ? "bfloat16" : "float32");
  TVM_FFI_CHECK(state.device().device_type == kDLCUDA && state.device().device_id == dev.device_id,
                ValueError) << "state: expected on the same device";
  const int64_t slots = state.size(0);
  TVM_FFI_CHECK(state.stride(3) == 1 && state.stride(2) == K && state.stride(1) == V * K &&
                    (slots <= 1 || state.stride(0) >= HV * V * K), ValueError)
      << "state: each slot [HV, V, K] must be contiguous";
  const int64_t slot_stride = slots <= 1 ? HV * V * K : state.stride(0);
  TVM_FFI_CHECK(reinterpret_cast<uintptr_t>(ptr_of<char>(state)) % 16 == 0 &&
                    (slot_stride * (kStateBf16 ? 2 : 4)) % 16 == 0, ValueError)
      << "state: base and slot stride must be 16-byte aligned";
  if (FKDA_SLOT_OFFSET_BITS == 32) {
    // largest element offset reached: (slots - 1) * slot_stride + HV*V*K - 1
    TVM_FFI_CHECK(slots == 0 || (slots - 1) * slot_stride + HV * V * K - 1 <= INT32_MAX, ValueError)
        << FKDA_MODULE_NAME << ": pool element offsets exceed int32; use the o64 module";
  }
  TVM_FFI_CHECK(gate_mode >= 0 && gate_mode <= 2, ValueError) << "gate_mode: 0, 1 or 2";
  TVM_FFI_CHECK(gate_mode != 1 || lower_bound < 0, ValueError) << "bounded gate needs lower_bound < 0";
  const float* alog_ptr = nullptr;
  const float* dt_ptr = nullptr;
  if (A_log.has_value()) {
    const TensorView a = A_log.value();
    TVM_FFI_CHECK(a.numel() == HV && is_dtype(a.dtype(), kDLFloat, 32) && a.IsContiguous() &&
                      a.device().device_type == kDLCUDA && a.device().device_id == dev.device_id,
                  ValueError) << "A_log: expected float32 [HV] contiguous on the same device";
    alog_ptr = ptr_of<float>(a);
  }
  if (dt_bias.has_value()) {
    const TensorView d = dt_bias.value();
    TVM_FFI_CHECK(d.numel() == HV * K && is_dtype(d.dtype(), kDLFloat, 32) && d.IsContiguous() &&
                      d.device().device_type == kDLCUDA && d.device().device_id == dev.device_id &&
                      reinterpret_cast<uintptr_t>(ptr_of<char>(d)) % 16 == 0,
                  ValueError) << "dt_bias: expected float32 [HV*K] contiguous (16-byte aligned) on the same device";
    dt_ptr = ptr_of<float>(d);
  }
  TVM_FFI_CHECK(gate_mode != 0 || (alog_ptr && dt_ptr), ValueError)
      << "softplus gate needs A_log and dt_bias";
  if (rows == 0) return;

  DecodeParams p;
  p.q = ptr_of<bf16>(q);
  p.k = ptr_of<bf16>(k);
  p.v = ptr_of<bf16>(v);
  p.g = ptr_of<bf16>(g);
  p.beta = ptr_of<bf16>(beta);
  p.A_log = alog_ptr;
  p.dt_bias = dt_ptr;
  p.state = mut_ptr_of<void>(state);
  p.idx = ptr_of<int32_t>(state_indices);
  p.out = mut_ptr_of<bf16>(out);
  p.q_row_stride = q.stride(0);
  p.k_row_stride = k.stride(0);
  p.v_row_stride = v.stride(0);
  p.g_row_stride = g.stride(0);
  p.beta_row_stride = beta.stride(0);
  p.slot_stride = slot_stride;
  p.num_slots = slots;
  p.rows = static_cast<int>(rows);
  p.H = static_cast<int>(H);
  p.HV = static_cast<int>(HV);
  p.group = static_cast<int>(HV / H);
  p.gate_mode = static_cast<int>(gate_mode);
  p.lower_bound = static_cast<float>(lower_bound);
  p.scale = static_cast<float>(scale);
  p.beta_is_logit = beta_is_logit ? 1 : 0;
  p.null_slot0 = null_slot0 ? 1 : 0;

  DeviceGuard guard(dev.device_id);
  cudaStream_t stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev.device_id));
  const int64_t tiles = rows * HV * kNumVT;
#if FKDA_PARAM_SCHEDULE == 0
#if FKDA_CLUSTER_X == 2
  launch(kda_decode_tile_cluster_kernel<FKDA_KERNEL_ARGS>, static_cast<unsigned>(tiles), stream, p);
#else
  launch(kda_decode_tile_kernel<FKDA_KERNEL_ARGS>, static_cast<unsigned>(tiles), stream, p);
#endif
#elif FKDA_PARAM_SCHEDULE == 1
  const int64_t cap = int64_t(FKDA_PERSISTENT_K) * sm_count(dev.device_id);
  const unsigned grid = static_cast<unsigned>(tiles < cap ? tiles : cap);
  launch(kda_decode_persistent_kernel<FKDA_KERNEL_ARGS>, grid, stream, p, static_cast<int>(tiles));
#else
  launch(kda_decode_seq_kernel<FKDA_KERNEL_ARGS>, static_cast<unsigned>(HV * kNumVT), stream, p);
#endif
}

// The macros this module was compiled with, as JSON (rendered by flashkda_ext.jit.macros);
// tests compare them with jit/supported.json.
tvm::ffi::String fkda_contract() { return tvm::ffi::String(FKDA_CONTRACT_JSON); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(kda_decode, kda_decode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fkda_contract, fkda_contract);
