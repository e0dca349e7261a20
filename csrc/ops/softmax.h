// The safe softmax family: safeattn::safe_softmax, safeattn::masked_softmax and their private
// backward ops.
//
//   safe_softmax(x, dim)                    = softmax(x, dim), a slice of all -inf giving 0
//   masked_softmax(s, mask, scale, dim)     = safe_softmax(x, dim) with
//       x = where(mask, s * scale, -inf)      for a bool mask (False = masked)
//       x = s * scale + mask                  for a float mask (additive, e.g. a learnable bias)
//   backward (both): grad_x = out * (grad_out - sum(grad_out * out, dim)), with every element
//       whose output is 0 given gradient 0 (masked elements, fully masked slices) and left out
//       of the sum, so no inf or NaN arriving at a masked element leaks into its slice;
//       grad_scores = scale * grad_x; grad_mask = grad_x summed to the mask's shape.
// NaN and +inf in the scores propagate (the slice becomes NaN), as in torch.softmax.
//
// Every kernel sees the scores contiguous as [outer, dim_size, inner] (inner == 1 is the
// common last-dim case) and the mask through broadcast strides, never expanded in memory. The
// structs and helpers below are plain data / host-device functions shared by the CPU and CUDA
// kernels.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include "common/isa_dispatch.h"

namespace safeattn {

// A contiguous tensor seen as [outer, dim_size, inner], the softmax running over dim_size.
struct SoftmaxGeometry {
  int64_t outer = 1;
  int64_t dim_size = 1;
  int64_t inner = 1;
};

// Maps a linear (row-major) index over a group of dims of the scores to the offset of the
// matching mask element, through the mask's broadcast strides (0 on broadcast dims). Adjacent
// dims that index the mask as one are merged on the host, so ndim is usually 1 or 2.
struct BroadcastIndex {
  static constexpr int kMaxDims = 8;
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  C10_HOST_DEVICE int64_t offset(int64_t linear) const {
    int64_t off = 0;
    for (int k = ndim - 1; k >= 0; --k) {
      const int64_t size = sizes[k];
      off += (linear % size) * strides[k];
      linear /= size;
    }
    return off;
  }
};

enum class MaskKind : int {
  kNone = 0,
  kBool = 1,     // False = masked
  kFloat = 2,    // additive, same dtype as the scores
  kFloat32 = 3,  // additive, float32 mask on half / bfloat16 scores
};

// Where the mask element of scores element (o, d, i) lives:
//   outer.offset(o) + d * dim_stride + inner.offset(i)
struct MaskGeometry {
  MaskKind kind = MaskKind::kNone;
  BroadcastIndex outer;
  BroadcastIndex inner;
  int64_t dim_stride = 0;
};

namespace softmax_detail {

template <typename acc_t>
C10_HOST_DEVICE inline acc_t neg_inf() {
  return -std::numeric_limits<acc_t>::infinity();
}

// The value a masked softmax normalises: bool masks select (so a NaN or inf score at a masked
// position cannot leak), float masks add.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t masked_score(acc_t score, acc_t scale, bool keep) {
  return keep ? score * scale : neg_inf<acc_t>();
}
template <typename acc_t>
C10_HOST_DEVICE inline acc_t biased_score(acc_t score, acc_t scale, acc_t bias) {
  return score * scale + bias;
}

// What a slice's maximum says about the whole slice.
enum class RowKind : int {
  kNormal = 0,  // finite max: exp(x - max) is in [0, 1], no NaN can arise
  kEmpty = 1,   // max is -inf: every element masked or -inf; the slice is written as 0
  kNaN = 2,     // max is NaN or +inf: the slice is NaN, as torch.softmax gives
};
template <typename acc_t>
C10_HOST_DEVICE inline RowKind row_kind(acc_t max) {
  if (max == neg_inf<acc_t>()) {
    return RowKind::kEmpty;
  }
  // NaN fails both comparisons; +inf fails the second.
  return (max > neg_inf<acc_t>() && max < std::numeric_limits<acc_t>::infinity()) ? RowKind::kNormal : RowKind::kNaN;
}

// One element of the backward: 0 wherever the output is 0 (masked or underflowed; the exact
// gradient there is 0 or below the output's own resolution), so a fully masked slice gets
// exactly 0 whatever grad_out holds.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t grad_element(acc_t grad_out, acc_t out, acc_t dot) {
  return out == acc_t(0) ? acc_t(0) : out * (grad_out - dot);
}
// One term of dot = sum(grad_out * out), skipping zero outputs for the same reason.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t dot_term(acc_t grad_out, acc_t out) {
  return out == acc_t(0) ? acc_t(0) : grad_out * out;
}

}  // namespace softmax_detail

// Forward kernel: out[o, :, i] = safe softmax of the (masked, scaled) scores slice.
//   scores: [outer, dim_size, inner] contiguous, floating; out: same shape and dtype.
//   mask: undefined (kind kNone), bool, or floating (scores' dtype, or float32), read through
//   `mask_geometry` from its own storage (any strides).
using SoftmaxForwardFn = void (*)(const at::Tensor& scores, const at::Tensor& mask, const MaskGeometry& mask_geometry,
                                  double scale, const SoftmaxGeometry& geometry, at::Tensor& out);
// Backward kernel: grad_x as in the file comment.
//   grad_out, out: [outer, dim_size, inner] contiguous, same floating dtype.
//   grad_scores: same shape and dtype, receives scale * grad_x.
//   grad_x: undefined, or same shape in the accumulation dtype (float32; float64 for float64)
//   receiving the unscaled grad_x, which the caller reduces to the mask's shape.
using SoftmaxBackwardFn = void (*)(const at::Tensor& grad_out, const at::Tensor& out, double scale,
                                   const SoftmaxGeometry& geometry, at::Tensor& grad_scores, at::Tensor& grad_x);
SAFEATTN_DECLARE_ISA_STUB(softmax_forward_cpu_stub, SoftmaxForwardFn);
SAFEATTN_DECLARE_ISA_STUB(softmax_backward_cpu_stub, SoftmaxBackwardFn);

// Backend-independent parts (validation, casting, layout, the mask-gradient reduction); each
// backend passes its kernel. The check_* functions are the one source of each op's rules: every
// entry point and the Meta kernels (the fakes) run them, on SymInt sizes (common/checks.h); each
// returns the wrapped dim.
int64_t check_safe_softmax(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype);
int64_t check_masked_softmax(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale, int64_t dim,
                             std::optional<at::ScalarType> dtype);
int64_t check_safe_softmax_backward(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim,
                                    at::ScalarType input_dtype);
int64_t check_masked_softmax_backward(const at::Tensor& grad_out, const at::Tensor& out,
                                      const std::optional<at::Tensor>& mask, double scale, int64_t dim,
                                      at::ScalarType input_dtype, bool mask_requires_grad);

at::Tensor safe_softmax_impl(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype,
                             SoftmaxForwardFn kernel);
at::Tensor safe_softmax_backward_impl(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim,
                                      at::ScalarType input_dtype, SoftmaxBackwardFn kernel);
at::Tensor masked_softmax_impl(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale,
                               int64_t dim, std::optional<at::ScalarType> dtype, SoftmaxForwardFn kernel);
std::tuple<at::Tensor, at::Tensor> masked_softmax_backward_impl(const at::Tensor& grad_out, const at::Tensor& out,
                                                                const std::optional<at::Tensor>& mask, double scale,
                                                                int64_t dim, at::ScalarType input_dtype,
                                                                bool mask_requires_grad, SoftmaxBackwardFn kernel);

// Typed C++ entry points: call the dispatcher (every backend, autograd included).
at::Tensor safe_softmax(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype = std::nullopt);
at::Tensor masked_softmax(const at::Tensor& scores, const std::optional<at::Tensor>& mask = std::nullopt,
                          double scale = 1.0, int64_t dim = -1, std::optional<at::ScalarType> dtype = std::nullopt);

}  // namespace safeattn
