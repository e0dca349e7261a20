// Small helpers for argument checks with messages that name the argument. The fakes in
// python/safeattn/_fake.py raise the same texts, so keep the two in step.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

namespace safeattn {

// "Long", "Float", ... as c10 prints them; _fake.py maps torch dtypes to the same names.
inline std::string dtype_name(at::ScalarType t) {
  return c10::toString(t);
}

struct NamedTensor {
  const char* name;
  const std::optional<at::Tensor>& tensor;
};

// The device every tensor argument must be on: `device` when given, else the first defined
// tensor's, else the CPU. Raises, naming the argument, when a tensor is elsewhere.
inline c10::Device common_device(const char* op, std::optional<c10::Device> device,
                                 std::initializer_list<NamedTensor> tensors) {
  std::optional<c10::Device> found = device;
  const char* found_from = "device";
  for (const NamedTensor& named : tensors) {
    if (!named.tensor.has_value() || !named.tensor->defined()) {
      continue;
    }
    const c10::Device d = named.tensor->device();
    if (!found.has_value()) {
      found = d;
      found_from = named.name;
      continue;
    }
    // A device given without an index ("cuda") accepts any index.
    const bool same = d.type() == found->type() && (!found->has_index() || d.index() == found->index());
    TORCH_CHECK(same, op, ": ", named.name, " is on ", d.str(), ", expected ", found->str(), " (from ", found_from,
                ")");
  }
  return found.value_or(c10::Device(c10::kCPU));
}

}  // namespace safeattn
