// Compiled only in CUDA builds: reports what nvcc compiled, for build_info(), and what the device
// has, for the kernels' grid sizes. It also proves, in every CI run, that the CUDA toolchain path
// of the build works.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ops/cuda/head_dim_switch.h"
#include "safeattn.h"

namespace safeattn::cuda {

std::vector<std::string> compiled_archs() {
  std::vector<std::string> archs;
#ifdef __CUDA_ARCH_LIST__
  // nvcc defines __CUDA_ARCH_LIST__ as e.g. 800,900 (arch * 10) in every compilation pass.
  for (int arch : {__CUDA_ARCH_LIST__}) {
    archs.push_back(std::to_string(arch / 10));
  }
#endif
  return archs;
}

std::vector<int> attention_head_dims(bool backward, bool sm90) {
  // setup.py passes the kept head dims of each family (all multiples of 16) as bits d / 16.
  const uint64_t bits =
      sm90 ? (backward ? kBwdSm90HeadDims : kFwdSm90HeadDims) : (backward ? kBwdHeadDims : kFwdHeadDims);
  std::vector<int> dims;
  for (int k = 1; k < 64; ++k) {
    if ((bits >> k) & 1u) {
      dims.push_back(16 * k);
    }
  }
  return dims;
}

int64_t multiprocessor_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

int64_t multiprocessor_count() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return multiprocessor_count(device);
}

std::string toolkit_version() {
  // No iostreams in .cu files: on some hosts nvcc's host pass pulls in a second copy of them.
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
}

}  // namespace safeattn::cuda
