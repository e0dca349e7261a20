// Compiled only in CUDA builds: reports what nvcc compiled, for build_info(). It also proves,
// in every CI run, that the CUDA toolchain path of the build works.
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

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

std::vector<int> attention_head_dims(bool backward) {
  // setup.py passes the kept head dims of each direction as a list, as nvcc does the archs.
  std::vector<int> dims;
#ifdef SAFEATTN_ATTN_FWD_DIMS
  if (!backward) {
    dims = {SAFEATTN_ATTN_FWD_DIMS};
  }
#endif
#ifdef SAFEATTN_ATTN_BWD_DIMS
  if (backward) {
    dims = {SAFEATTN_ATTN_BWD_DIMS};
  }
#endif
  return dims;
}

std::string toolkit_version() {
  // No iostreams in .cu files: on some hosts nvcc's host pass pulls in a second copy of them.
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
}

}  // namespace safeattn::cuda
