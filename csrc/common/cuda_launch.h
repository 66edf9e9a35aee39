// Launch conventions shared by every CUDA binding, written once:
//   - a device guard for the tensors' device (restored on exit),
//   - the caller's stream from TVMFFIEnvGetStream (torch's current stream, a JAX stream, ...),
//   - the persistent grid min(work_items, FKDA_PERSISTENT_K * SM count of that device), SM count
//     cached per device,
//   - the dynamic shared memory opt-in (cudaFuncSetAttribute) when a launch asks for > 48 KiB,
//   - cluster launch through cudaLaunchKernelEx when FKDA_CLUSTER_X*Y*Z > 1,
//   - programmatic dependent launch when the record sets params.pdl = 1 (FKDA_PARAM_PDL; the
//     kernels' side is grid_dependency.cuh),
//   - cudaGetLastError checked after every launch.
//
//   fkda::cuda::LaunchContext ctx(q);                       // guard + stream + SM count
//   ctx.launch("kda_decode_kernel", kernel, dim3(ctx.grid(items)), dim3(FKDA_THREADS),
//              FKDA_SMEM_BYTES, args...);
#pragma once

#ifndef __CUDACC__
#error "cuda_launch.h is for CUDA sources compiled by nvcc"
#endif

#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/base.h>
#include <tvm/ffi/extra/cuda/device_guard.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

#include "binding.h"

// Throw a RuntimeError naming the module and what failed, with CUDA's error name and text.
#define FKDA_CUDA_CHECK(stmt, what)                                                              \
  do {                                                                                           \
    cudaError_t fkda_err_ = (stmt);                                                              \
    if (fkda_err_ != cudaSuccess) {                                                              \
      TVM_FFI_THROW(RuntimeError) << FKDA_MODULE_NAME << ": " << (what) << ": "                  \
                                  << cudaGetErrorName(fkda_err_) << " ("                         \
                                  << static_cast<int>(fkda_err_)                                 \
                                  << "): " << cudaGetErrorString(fkda_err_);                     \
    }                                                                                            \
  } while (0)

namespace fkda {
namespace cuda {

constexpr int64_t kClusterSize =
    static_cast<int64_t>(FKDA_CLUSTER_X) * FKDA_CLUSTER_Y * FKDA_CLUSTER_Z;
constexpr size_t kDefaultSmemLimit = 48 * 1024;  // above this a kernel must opt in
constexpr int kPortableClusterSize = 8;          // above this a kernel must opt in
#if defined(FKDA_PARAM_PDL) && FKDA_PARAM_PDL
constexpr bool kProgrammaticLaunch = true;
#else
constexpr bool kProgrammaticLaunch = false;
#endif

inline cudaStream_t stream_of(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(t.device().device_type, t.device().device_id));
}

// Multiprocessor count of `device`, queried once per device.
inline int sm_count(int device) {
  constexpr int kMaxCached = 64;
  static std::atomic<int> cache[kMaxCached];  // zero-initialised: 0 = not queried yet
  if (device >= 0 && device < kMaxCached) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int n = 0;
  FKDA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
                  "cudaDeviceGetAttribute(MultiProcessorCount)");
  if (device >= 0 && device < kMaxCached) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

// Grid size for `items` work items: one CTA each, or a persistent grid of
// FKDA_PERSISTENT_K CTAs per SM that loops over them. Never 0 when items > 0.
inline int64_t grid_for(int64_t items, int device) {
  if (FKDA_PERSISTENT_K <= 0) return items;
  return std::min<int64_t>(items, static_cast<int64_t>(FKDA_PERSISTENT_K) * sm_count(device));
}

// The per-kernel attributes a launch needs, set once per (kernel, device) and raised when a later
// launch asks for more dynamic shared memory. The caller holds the device guard.
inline void prepare_kernel(const void* kernel, size_t smem, int device) {
  // Static shared memory alone is capped at 48 KiB by the compiler, so with no dynamic part and a
  // portable cluster there is nothing to raise.
  if (smem == 0 && kClusterSize <= kPortableClusterSize) return;
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> done;  // smem already allowed
  std::lock_guard<std::mutex> lock(mu);
  auto it = done.find({kernel, device});
  if (it != done.end() && it->second >= smem) return;
  // The 48 KiB default covers static + dynamic together: a kernel with 3 KiB static and exactly
  // 48 KiB dynamic needs the opt-in although its dynamic part alone is within the default.
  cudaFuncAttributes fa;
  FKDA_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel), "cudaFuncGetAttributes");
  if (smem + fa.sharedSizeBytes > kDefaultSmemLimit) {
    FKDA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)),
                    "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  }
  if (kClusterSize > kPortableClusterSize) {
    FKDA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                    "cudaFuncSetAttribute(NonPortableClusterSizeAllowed)");
  }
  done[{kernel, device}] = smem;
}

// Everything one binding call needs to launch on the device of `t`.
class LaunchContext {
 public:
  explicit LaunchContext(const TensorView& t)
      : device_(t.device().device_id), guard_(device_), stream_(stream_of(t)) {}

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  int sm_count() const { return cuda::sm_count(device_); }
  int64_t grid(int64_t items) const { return grid_for(items, device_); }

  // Launch kernel<<<grid, block, smem, stream>>>(args...) (as a cluster launch when the module's
  // cluster size is > 1) and check both the launch and cudaGetLastError. An empty grid is a no-op.
  template <typename... KernelArgs, typename... Args>
  void launch(const char* what, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
              Args&&... args) const {
    if (static_cast<int64_t>(grid.x) * grid.y * grid.z == 0) return;
    if (kClusterSize > 1 && (grid.x % FKDA_CLUSTER_X != 0 || grid.y % FKDA_CLUSTER_Y != 0 ||
                             grid.z % FKDA_CLUSTER_Z != 0)) {
      TVM_FFI_THROW(InternalError) << FKDA_MODULE_NAME << ": " << what << ": grid (" << grid.x << ","
                                   << grid.y << "," << grid.z << ") is not a multiple of the cluster ("
                                   << FKDA_CLUSTER_X << "," << FKDA_CLUSTER_Y << "," << FKDA_CLUSTER_Z
                                   << ")";
    }
    prepare_kernel(reinterpret_cast<const void*>(kernel), smem, device_);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream_;
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    if (kClusterSize > 1) {
      attr[n].id = cudaLaunchAttributeClusterDimension;
      attr[n].val.clusterDim.x = FKDA_CLUSTER_X;
      attr[n].val.clusterDim.y = FKDA_CLUSTER_Y;
      attr[n].val.clusterDim.z = FKDA_CLUSTER_Z;
      ++n;
    }
    if (kProgrammaticLaunch) {  // may start while the previous kernel finishes (see above)
      attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    cfg.attrs = n ? attr : nullptr;
    cfg.numAttrs = n;
    FKDA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what);
    FKDA_CUDA_CHECK(cudaGetLastError(), what);
  }

 private:
  int device_;
  tvm::ffi::CUDADeviceGuard guard_;
  cudaStream_t stream_;
};

}  // namespace cuda

// CUDA tensors of one call: each on a CUDA device, the same one as `ref`.
inline void check_cuda_device(const Checker& c, const TensorView& t, const char* name,
                              const TensorView& ref, const char* ref_name) {
  c.device_type(t, name, kDLCUDA);
  c.same_device(t, name, ref, ref_name);
}

}  // namespace fkda
