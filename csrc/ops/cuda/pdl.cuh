// Programmatic dependent launch (sm_90 and later): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start before the kernel ahead of it on
// the stream has finished. The earlier kernel says when the later one may be scheduled
// (programmatic_launch_dependents; at its end otherwise), and the later one waits for the
// earlier one's completion and memory (programmatic_wait) before it reads what that wrote.
// Both are no-ops on older GPUs and in a launch without the attribute. No torch.
#pragma once

#include <cuda_runtime.h>

namespace safeattn::cuda {

// Whether launches ask for the programmatic dependency: from CUDA 12.3 on, where stream capture
// records it in a CUDA graph (a step captured with an older runtime launches plainly).
constexpr bool kProgrammaticLaunches = CUDART_VERSION >= 12030;

__device__ __forceinline__ void programmatic_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void programmatic_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace safeattn::cuda
