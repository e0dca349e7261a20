// Schemas, validation, the backend-independent entry points and the CPU registration of the
// softmax family (safe_softmax, masked_softmax and their backward ops).
#include "ops/softmax.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "common/checks.h"

namespace safeattn {

SAFEATTN_DEFINE_ISA_STUB(softmax_forward_cpu_stub, SoftmaxForwardFn);
SAFEATTN_DEFINE_ISA_STUB(softmax_backward_cpu_stub, SoftmaxBackwardFn);

namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

void check_float(const char* op, const char* name, at::ScalarType t) {
  TORCH_CHECK(is_supported_float(t), op, ": ", name, " must be Float, Double, Half or BFloat16, got ", dtype_name(t));
}

// Wraps dim as torch.softmax does (a 0-D tensor takes dim 0 or -1).
int64_t wrap_dim(const char* op, int64_t dim, int64_t ndim) {
  const int64_t n = ndim > 0 ? ndim : 1;
  TORCH_CHECK(dim >= -n && dim < n, op, ": dim ", dim, " is out of range for a ", ndim, "-D tensor (expected in [", -n,
              ", ", n - 1, "])");
  return dim < 0 ? dim + n : dim;
}

SoftmaxGeometry geometry_of(at::IntArrayRef sizes, int64_t dim) {
  SoftmaxGeometry g;
  if (sizes.empty()) {
    return g;
  }
  for (int64_t k = 0; k < dim; ++k) {
    g.outer *= sizes[k];
  }
  g.dim_size = sizes[dim];
  for (int64_t k = dim + 1; k < static_cast<int64_t>(sizes.size()); ++k) {
    g.inner *= sizes[k];
  }
  return g;
}

// The index over dims [begin, end) of the scores into the mask (broadcast strides). Size-1
// dims index nothing; neighbours that step through the mask as one dim are merged.
BroadcastIndex broadcast_index(at::IntArrayRef sizes, at::IntArrayRef strides, int64_t begin, int64_t end) {
  std::vector<int64_t> merged_sizes;
  std::vector<int64_t> merged_strides;
  for (int64_t k = begin; k < end; ++k) {
    if (sizes[k] == 1) {
      continue;
    }
    if (!merged_sizes.empty() && merged_strides.back() == strides[k] * sizes[k]) {
      merged_sizes.back() *= sizes[k];
      merged_strides.back() = strides[k];
      continue;
    }
    merged_sizes.push_back(sizes[k]);
    merged_strides.push_back(strides[k]);
  }
  TORCH_CHECK(static_cast<int>(merged_sizes.size()) <= BroadcastIndex::kMaxDims,
              "masked_softmax: the mask's broadcast pattern needs more than ", BroadcastIndex::kMaxDims,
              " index groups; make the mask contiguous or expand it");
  BroadcastIndex index;
  index.ndim = static_cast<int>(merged_sizes.size());
  for (int k = 0; k < index.ndim; ++k) {
    index.sizes[k] = merged_sizes[k];
    index.strides[k] = merged_strides[k];
  }
  return index;
}

// The mask as the kernels read it: its dtype settled (bool, the scores' dtype, or float32 for
// half/bfloat16 scores) and its broadcast geometry against `scores` (already cast).
struct PreparedMask {
  at::Tensor tensor;
  MaskGeometry geometry;
};

PreparedMask prepare_mask(const std::optional<at::Tensor>& mask, const at::Tensor& scores, int64_t dim) {
  PreparedMask prepared;
  if (!mask.has_value()) {
    return prepared;
  }
  const at::ScalarType compute = scores.scalar_type();
  at::Tensor m = *mask;
  MaskKind kind = MaskKind::kBool;
  if (m.scalar_type() != at::kBool) {
    if (m.scalar_type() == compute) {
      kind = MaskKind::kFloat;
    } else if (compute == at::kHalf || compute == at::kBFloat16) {
      // A float32 bias on reduced-precision scores keeps its precision (added in float32).
      m = m.to(at::kFloat);
      kind = MaskKind::kFloat32;
    } else {
      m = m.to(compute);
      kind = MaskKind::kFloat;
    }
  }
  // A view with stride 0 on every broadcast dim: nothing is copied.
  const at::Tensor expanded = m.expand(scores.sizes());
  const int64_t ndim = scores.dim();
  MaskGeometry& g = prepared.geometry;
  g.kind = kind;
  if (ndim > 0) {
    g.outer = broadcast_index(expanded.sizes(), expanded.strides(), 0, dim);
    g.inner = broadcast_index(expanded.sizes(), expanded.strides(), dim + 1, ndim);
    g.dim_stride = expanded.size(dim) == 1 ? 0 : expanded.stride(dim);
  }
  prepared.tensor = m;
  return prepared;
}

void check_backward_pair(const char* op, const at::Tensor& grad_out, const at::Tensor& out) {
  check_float(op, "out", out.scalar_type());
  check_float(op, "grad_out", grad_out.scalar_type());
  TORCH_CHECK(same_sizes(grad_out.sym_sizes(), out.sym_sizes()), op, ": grad_out has shape ", grad_out.sym_sizes(),
              " but out has shape ", out.sym_sizes());
  common_device(op, std::nullopt, {{"grad_out", grad_out}, {"out", out}});
}

// The mask of masked_softmax and of its backward: dtype, broadcastable to `against` (the scores,
// or the backward's out), same device.
void check_mask(const char* op, const std::optional<at::Tensor>& mask, const char* against_name,
                const at::Tensor& against) {
  if (!mask.has_value()) {
    return;
  }
  const at::ScalarType mt = mask->scalar_type();
  TORCH_CHECK(mt == at::kBool || is_supported_float(mt), op,
              ": mask must be Bool or a floating dtype (Float, Double, Half, BFloat16), got ", dtype_name(mt));
  bool broadcastable = mask->dim() <= against.dim();
  for (int64_t k = 1; broadcastable && k <= mask->dim(); ++k) {
    const c10::SymInt m = mask->sym_size(-k);
    broadcastable = holds(m.sym_eq(1)) || holds(m.sym_eq(against.sym_size(-k)));
  }
  TORCH_CHECK(broadcastable, op, ": mask of shape ", mask->sym_sizes(), " is not broadcastable to ", against_name,
              " of shape ", against.sym_sizes());
  common_device(op, std::nullopt, {{against_name, against}, {"mask", mask}});
}

}  // namespace

int64_t check_safe_softmax(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  constexpr const char* op = "safe_softmax";
  check_float(op, "self", self.scalar_type());
  if (dtype.has_value()) {
    check_float(op, "dtype", *dtype);
  }
  return wrap_dim(op, dim, self.dim());
}

int64_t check_masked_softmax(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale, int64_t dim,
                             std::optional<at::ScalarType> dtype) {
  constexpr const char* op = "masked_softmax";
  check_float(op, "scores", scores.scalar_type());
  if (dtype.has_value()) {
    check_float(op, "dtype", *dtype);
  }
  check_scale(op, scale, dtype.value_or(scores.scalar_type()));
  const int64_t wrapped = wrap_dim(op, dim, scores.dim());
  check_mask(op, mask, "scores", scores);
  return wrapped;
}

int64_t check_safe_softmax_backward(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim,
                                    at::ScalarType input_dtype) {
  constexpr const char* op = "_safe_softmax_backward";
  check_backward_pair(op, grad_out, out);
  check_float(op, "input_dtype", input_dtype);
  return wrap_dim(op, dim, out.dim());
}

int64_t check_masked_softmax_backward(const at::Tensor& grad_out, const at::Tensor& out,
                                      const std::optional<at::Tensor>& mask, double scale, int64_t dim,
                                      at::ScalarType input_dtype, bool mask_requires_grad) {
  constexpr const char* op = "_masked_softmax_backward";
  check_backward_pair(op, grad_out, out);
  check_float(op, "input_dtype", input_dtype);
  check_scale(op, scale, out.scalar_type());
  const int64_t wrapped = wrap_dim(op, dim, out.dim());
  TORCH_CHECK(!mask_requires_grad || (mask.has_value() && mask->is_floating_point()), op,
              ": mask_requires_grad needs a floating mask");
  check_mask(op, mask, "out", out);
  return wrapped;
}

at::Tensor safe_softmax_impl(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype,
                             SoftmaxForwardFn kernel) {
  const int64_t wrapped = check_safe_softmax(self, dim, dtype);
  // As torch.softmax: the input is cast first, the result comes out in that dtype.
  const at::Tensor in = (dtype.has_value() ? self.to(*dtype) : self).contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options());
  if (out.numel() > 0) {
    kernel(in, at::Tensor(), MaskGeometry{}, 1.0, geometry_of(in.sizes(), wrapped), out);
  }
  return out;
}

at::Tensor safe_softmax_backward_impl(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim,
                                      at::ScalarType input_dtype, SoftmaxBackwardFn kernel) {
  const int64_t wrapped = check_safe_softmax_backward(grad_out, out, dim, input_dtype);
  const at::Tensor o = out.contiguous();
  const at::Tensor g = grad_out.to(o.scalar_type()).contiguous();
  at::Tensor grad_in = at::empty(o.sizes(), o.options());
  at::Tensor no_grad_x;
  if (grad_in.numel() > 0) {
    kernel(g, o, 1.0, geometry_of(o.sizes(), wrapped), grad_in, no_grad_x);
  }
  return grad_in.scalar_type() == input_dtype ? grad_in : grad_in.to(input_dtype);
}

at::Tensor masked_softmax_impl(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale,
                               int64_t dim, std::optional<at::ScalarType> dtype, SoftmaxForwardFn kernel) {
  const int64_t wrapped = check_masked_softmax(scores, mask, scale, dim, dtype);
  const at::Tensor in = (dtype.has_value() ? scores.to(*dtype) : scores).contiguous();
  const PreparedMask prepared = prepare_mask(mask, in, wrapped);
  at::Tensor out = at::empty(in.sizes(), in.options());
  if (out.numel() > 0) {
    kernel(in, prepared.tensor, prepared.geometry, scale, geometry_of(in.sizes(), wrapped), out);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> masked_softmax_backward_impl(const at::Tensor& grad_out, const at::Tensor& out,
                                                                const std::optional<at::Tensor>& mask, double scale,
                                                                int64_t dim, at::ScalarType input_dtype,
                                                                bool mask_requires_grad, SoftmaxBackwardFn kernel) {
  const int64_t wrapped =
      check_masked_softmax_backward(grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad);
  const at::Tensor o = out.contiguous();
  const at::Tensor g = grad_out.to(o.scalar_type()).contiguous();
  at::Tensor grad_scores = at::empty(o.sizes(), o.options());
  // The unscaled gradient in the accumulation dtype, reduced below to the mask's shape.
  at::Tensor grad_x;
  if (mask_requires_grad) {
    grad_x = at::empty(o.sizes(), o.options().dtype(o.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  }
  if (grad_scores.numel() > 0) {
    kernel(g, o, scale, geometry_of(o.sizes(), wrapped), grad_scores, grad_x);
  } else if (grad_x.defined()) {
    grad_x.zero_();
  }
  at::Tensor grad_mask;
  if (mask_requires_grad) {
    // A plain sum over the broadcast dims: a fixed reduction order on CPU and CUDA alike (no
    // atomics), so the bias gradient is the same from run to run.
    grad_mask = at::sum_to(grad_x, mask->sizes()).to(mask->scalar_type()).contiguous();
  } else {
    // The schema has no optional outputs; an empty tensor stands for "no gradient".
    grad_mask = at::empty({0}, o.options());
  }
  if (grad_scores.scalar_type() != input_dtype) {
    grad_scores = grad_scores.to(input_dtype);
  }
  return {grad_scores, grad_mask};
}

namespace {

at::Tensor safe_softmax_cpu(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  return safe_softmax_impl(self, dim, dtype, softmax_forward_cpu_stub().pick());
}

at::Tensor safe_softmax_backward_cpu(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim,
                                     at::ScalarType input_dtype) {
  return safe_softmax_backward_impl(grad_out, out, dim, input_dtype, softmax_backward_cpu_stub().pick());
}

at::Tensor masked_softmax_cpu(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale,
                              int64_t dim, std::optional<at::ScalarType> dtype) {
  return masked_softmax_impl(scores, mask, scale, dim, dtype, softmax_forward_cpu_stub().pick());
}

std::tuple<at::Tensor, at::Tensor> masked_softmax_backward_cpu(const at::Tensor& grad_out, const at::Tensor& out,
                                                               const std::optional<at::Tensor>& mask, double scale,
                                                               int64_t dim, at::ScalarType input_dtype,
                                                               bool mask_requires_grad) {
  return masked_softmax_backward_impl(grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad,
                                      softmax_backward_cpu_stub().pick());
}

// The Meta kernels: what torch.compile, torch.export and FakeTensorMode run (sizes may be
// symbolic). The entry points' checks, then outputs as the *_impl functions allocate them
// (contiguous, in the result dtype).
at::Tensor empty_like_in(const at::Tensor& t, at::ScalarType dtype) {
  return at::empty_symint(t.sym_sizes(), t.options().dtype(dtype));
}

at::Tensor safe_softmax_meta(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  check_safe_softmax(self, dim, dtype);
  return empty_like_in(self, dtype.value_or(self.scalar_type()));
}

at::Tensor safe_softmax_backward_meta(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim,
                                      at::ScalarType input_dtype) {
  check_safe_softmax_backward(grad_out, out, dim, input_dtype);
  return empty_like_in(out, input_dtype);
}

at::Tensor masked_softmax_meta(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale,
                               int64_t dim, std::optional<at::ScalarType> dtype) {
  check_masked_softmax(scores, mask, scale, dim, dtype);
  return empty_like_in(scores, dtype.value_or(scores.scalar_type()));
}

std::tuple<at::Tensor, at::Tensor> masked_softmax_backward_meta(const at::Tensor& grad_out, const at::Tensor& out,
                                                                const std::optional<at::Tensor>& mask, double scale,
                                                                int64_t dim, at::ScalarType input_dtype,
                                                                bool mask_requires_grad) {
  check_masked_softmax_backward(grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad);
  return {empty_like_in(out, input_dtype),
          mask_requires_grad ? empty_like_in(*mask, mask->scalar_type()) : at::empty({0}, out.options())};
}

}  // namespace

at::Tensor safe_softmax(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("safeattn::safe_softmax", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, std::optional<at::ScalarType>)>();
  return op.call(self, dim, dtype);
}

at::Tensor masked_softmax(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale, int64_t dim,
                          std::optional<at::ScalarType> dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("safeattn::masked_softmax", "")
                       .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, double, int64_t,
                                         std::optional<at::ScalarType>)>();
  return op.call(scores, mask, scale, dim, dtype);
}

TORCH_LIBRARY_FRAGMENT(safeattn, m) {
  m.def("safe_softmax(Tensor self, int dim, ScalarType? dtype=None) -> Tensor");
  m.def("_safe_softmax_backward(Tensor grad_out, Tensor out, int dim, ScalarType input_dtype) -> Tensor");
  m.def(
      "masked_softmax(Tensor scores, Tensor? mask=None, float scale=1.0, int dim=-1, ScalarType? dtype=None) -> "
      "Tensor");
  // The second output is the mask's gradient (mask's shape and dtype) when mask_requires_grad,
  // else an empty tensor: the schema language has no optional outputs that autograd accepts.
  m.def(
      "_masked_softmax_backward(Tensor grad_out, Tensor out, Tensor? mask, float scale, int dim, "
      "ScalarType input_dtype, bool mask_requires_grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(safeattn, CPU, m) {
  m.impl("safe_softmax", &safe_softmax_cpu);
  m.impl("_safe_softmax_backward", &safe_softmax_backward_cpu);
  m.impl("masked_softmax", &masked_softmax_cpu);
  m.impl("_masked_softmax_backward", &masked_softmax_backward_cpu);
}

// Also the fakes: FakeTensorMode runs a C++ Meta kernel for an op that has no Python fake.
TORCH_LIBRARY_IMPL(safeattn, Meta, m) {
  m.impl("safe_softmax", &safe_softmax_meta);
  m.impl("_safe_softmax_backward", &safe_softmax_backward_meta);
  m.impl("masked_softmax", &masked_softmax_meta);
  m.impl("_masked_softmax_backward", &masked_softmax_backward_meta);
}

// All four ops (the backward ops too: double backward, forward AD, torch.func) get their
// Autograd kernels and vmap rules in Python (python/safeattn/_autograd.py).

}  // namespace safeattn
