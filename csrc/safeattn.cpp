// The safeattn operator library. Each op adds its schema with TORCH_LIBRARY_FRAGMENT in
// csrc/ops/<op>.cpp and its kernels with TORCH_LIBRARY_IMPL in the backend files.
#include "safeattn.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/version.h>

#include "common/isa_dispatch.h"

#ifndef SAFEATTN_VERSION
#define SAFEATTN_VERSION "unknown"
#endif

TORCH_LIBRARY(safeattn, m) {
  // Schemas live next to their ops (csrc/ops/<op>.cpp).
}

namespace safeattn {

int cpu_parallel_threads() {
  const int threads = at::get_num_threads();
  std::vector<std::atomic<bool>> seen(threads);
  at::parallel_for(0, 64 * static_cast<int64_t>(threads), 1,
                   [&](int64_t, int64_t) { seen[at::get_thread_num()] = true; });
  return static_cast<int>(std::count_if(seen.begin(), seen.end(), [](const std::atomic<bool>& s) { return s.load(); }));
}

BuildInfo build_info() {
  BuildInfo info;
  info.version = SAFEATTN_VERSION;
  info.torch_version = TORCH_VERSION;
  info.cpu_isas = cpu::compiled_isas();
  info.cpu_isas_runnable = cpu::runnable_isas();
  info.cpu_isa_in_use = cpu::isa_name(cpu::runtime_isa());
  // The best compiled variant at or below the runtime ISA is the one that runs.
  for (int i = static_cast<int>(cpu::runtime_isa()); i >= 0; --i) {
    const std::string name = cpu::isa_name(static_cast<cpu::Isa>(i));
    if (std::find(info.cpu_isas.begin(), info.cpu_isas.end(), name) != info.cpu_isas.end()) {
      info.cpu_isa_in_use = name;
      break;
    }
  }
#ifdef SAFEATTN_WITH_CUDA
  info.with_cuda = true;
  info.cuda_version = cuda::toolkit_version();
  info.cuda_archs = cuda::compiled_archs();
  info.attention_fwd_head_dims = cuda::attention_head_dims(/*backward=*/false, /*sm90=*/false);
  info.attention_bwd_head_dims = cuda::attention_head_dims(/*backward=*/true, /*sm90=*/false);
  info.attention_sm90_fwd_head_dims = cuda::attention_head_dims(/*backward=*/false, /*sm90=*/true);
  info.attention_sm90_bwd_head_dims = cuda::attention_head_dims(/*backward=*/true, /*sm90=*/true);
#endif
  return info;
}

}  // namespace safeattn
