// The safeattn operator library. Each op adds its schema with TORCH_LIBRARY_FRAGMENT in
// csrc/ops/<op>.cpp and its kernels with TORCH_LIBRARY_IMPL in the backend files.
#include "safeattn.h"

#include <ATen/core/dispatch/Dispatcher.h>
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

BuildInfo build_info() {
  BuildInfo info;
  info.version = SAFEATTN_VERSION;
  info.torch_version = TORCH_VERSION;
  info.cpu_isas = cpu::compiled_isas();
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
#endif
  const std::pair<c10::DispatchKey, const char*> keys[] = {
      {c10::DispatchKey::CPU, "CPU"},
      {c10::DispatchKey::CUDA, "CUDA"},
      {c10::DispatchKey::Meta, "Meta"},
      {c10::DispatchKey::Autograd, "Autograd"},
  };
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("safeattn::", 0) != 0) {
      continue;
    }
    auto handle = c10::Dispatcher::singleton().findOp(name);
    if (!handle.has_value() || !handle->hasSchema()) {
      continue;
    }
    std::vector<std::string>& found = info.op_kernels[name.name.substr(10)];
    for (const auto& [key, label] : keys) {
      if (handle->hasKernelForDispatchKey(key)) {
        found.emplace_back(label);
      }
    }
  }
  return info;
}

}  // namespace safeattn
