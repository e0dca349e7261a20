// The device guard every CUDA op's entry point opens: it makes the op's device current and first
// checks that this build has code for that GPU (check_device_supported in cuda_info.cu), so a
// build for other GPUs fails with a message that says how to rebuild, not with CUDA's "no kernel
// image is available" from whichever launch comes first.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "safeattn.h"

namespace safeattn::cuda {

class OpDeviceGuard {
 public:
  explicit OpDeviceGuard(c10::Device device) : guard_(device) {
    check_device_supported(c10::cuda::current_device());
  }
  // On the device of an op's first tensor argument.
  explicit OpDeviceGuard(const at::Tensor& tensor) : OpDeviceGuard(tensor.device()) {}

 private:
  c10::cuda::CUDAGuard guard_;
};

}  // namespace safeattn::cuda
