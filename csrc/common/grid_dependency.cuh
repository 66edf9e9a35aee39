// Programmatic dependent launch (PDL, sm_90) from the kernel's side.
//
// A module whose record sets params.pdl = 1 is launched with the programmatic stream serialization
// attribute (cuda_launch.h): the GPU may start its CTAs while the previous kernel in the stream is
// still finishing, which hides the launch latency between back-to-back kernels (0.3-0.5 us per small
// decode step in graph replay on an H200). Correctness then rests on these two calls:
//   wait_for_previous_grid()  before the first global memory access: blocks until every
//                             prerequisite grid has completed and its writes are visible;
//   allow_next_grid()         lets the next PDL-launched kernel start its CTAs early (they wait in
//                             their own wait_for_previous_grid() until this grid completes).
// Both are no-ops when the kernel was launched without the attribute, so every kernel calls them.
#pragma once

namespace fkda {

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// Both, at the top of a kernel: nothing of this grid touches memory before the previous grid is
// done, and the next grid's launch overlaps this one's whole run.
__device__ __forceinline__ void begin_dependent_grid() {
  wait_for_previous_grid();
  allow_next_grid();
}

}  // namespace fkda
