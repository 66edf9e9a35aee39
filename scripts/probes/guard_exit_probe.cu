// Probe (issue 46, the guarded piece split on paper: csrc/prefill/README.md): what a launch costs whose CTAs
// read a clear guard word and exit, at the chunk-64 fallback's launch shapes, beside a one-CTA launch. Standalone:
//   nvcc -O2 -arch=sm_90a scripts/probes/guard_exit_probe.cu -o /tmp/guard_exit_probe && /tmp/guard_exit_probe
// Times are device event time over 200 back-to-back launches, divided by 200.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void guard_exit(const int* guard, int* sink) {
  extern __shared__ int smem[];
  if (*guard == 0) return;  // the fallback's launch when the fast path served the call
  smem[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) sink[blockIdx.x] = smem[blockDim.x - 1];
}

static float time_launch(int blocks, int threads, int smem, const int* guard, int* sink) {
  cudaFuncSetAttribute(guard_exit, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 20; ++i) guard_exit<<<blocks, threads, smem>>>(guard, sink);
  cudaEventRecord(a);
  for (int i = 0; i < 200; ++i) guard_exit<<<blocks, threads, smem>>>(guard, sink);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, a, b);
  return ms * 1000.f / 200.f;
}

int main() {
  int *guard, *sink;
  cudaMalloc(&guard, sizeof(int));
  cudaMemset(guard, 0, sizeof(int));
  cudaMalloc(&sink, 1 << 20);
  struct Shape { const char* what; int blocks, threads, smem; };
  const Shape shapes[] = {
      {"one CTA", 1, 256, 0},
      {"prep, B1 T32K H16 (512 chunks x 16 heads)", 8192, 256, 110 * 1024},
      {"prep, 4x4096 H32 / 1x8192 H64 (128 chunks x 64)", 8192, 256, 110 * 1024},
      {"prep, B1 T128K H16", 32768, 256, 110 * 1024},
      {"state pass, B1 T32K H16, 16 pieces, two groups (1 x 16 x 16)", 256, 256, 201 * 1024},
      {"state pass, 4x4096 H32, vt64 (2 x 32 x 4)", 256, 128, 201 * 1024},
  };
  printf("%-64s %8s %8s %8s %10s\n", "launch", "CTAs", "threads", "smem KB", "us/launch");
  for (const Shape& s : shapes) {
    const float us = time_launch(s.blocks, s.threads, s.smem, guard, sink);
    printf("%-64s %8d %8d %8d %10.2f\n", s.what, s.blocks, s.threads, s.smem / 1024, us);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
