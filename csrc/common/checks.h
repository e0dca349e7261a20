// Small helpers for argument checks with messages that name the argument. Each op's checks are
// written once, in C++, on symbolic sizes (c10::SymInt): the CPU and CUDA entry points run them
// on concrete sizes, and the Meta kernels (what torch.compile, torch.export and FakeTensorMode
// run) on symbolic ones, so the fake raises the same messages from the same code.
#pragma once

#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/SymBool.h>
#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

namespace safeattn {

// "Long", "Float", ... as c10 prints them.
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

// Whether x is a finite number in the type the kernels compute `input` in (float64 for float64,
// float32 otherwise): a scale or softcap that is not one there cannot be honoured (inf scores,
// inf - inf = NaN; a softcap beyond float32 would be inf).
inline bool finite_in_acc(double x, at::ScalarType input) {
  return std::isfinite(x) && (input == at::kDouble || std::fabs(x) <= std::numeric_limits<float>::max());
}

// The one check of a `scale` argument (attention, masked_softmax): it multiplies the scores in
// the type the kernels compute `input` in, so it must be finite there.
inline void check_scale(const char* op, double scale, at::ScalarType input) {
  TORCH_CHECK(finite_in_acc(scale, input), op, ": scale must be a finite number",
              input == at::kDouble ? "" : " in float32", ", got ", scale);
}

// Whether a condition on sizes holds: plain for concrete sizes; for symbolic ones what
// torch._check does (a guard on a backed size, a deferred runtime assert on an unbacked one), so
// a Meta kernel specialises nothing beyond the condition itself. Call it once per condition and
// combine with && and ||, which short-circuit (h % hkv must not run when hkv is 0).
inline bool holds(const c10::SymBool& condition) {
  return condition.expect_true(__FILE__, __LINE__);
}

// a == b, element by element (see holds).
inline bool same_sizes(c10::SymIntArrayRef a, c10::SymIntArrayRef b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!holds(a[i].sym_eq(b[i]))) {
      return false;
    }
  }
  return true;
}

}  // namespace safeattn
