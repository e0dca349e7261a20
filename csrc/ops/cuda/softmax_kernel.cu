// CUDA kernels of the softmax family (safe_softmax, masked_softmax and their backward ops).
//
// Last-dim rows (inner == 1), the common case, are in softmax_rows.cuh (one instantiation file
// per dtype); this file holds the other dims, the dispatch and the registration.
// Other dims (inner > 1): one thread per column of the [dim_size, inner] matrix, so
// neighbouring threads read neighbouring addresses and nothing is transposed; statistics go
// through an online (max, sum) per thread (OnlineState), in float32 (float64 for float64).
//
// A fully masked / all -inf row is written as 0 and a row with NaN or +inf as NaN on every path
// (softmax_detail::row_kind); the backward writes 0 wherever the output is 0. No host
// synchronisation; every launch is checked; offsets are 64-bit.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "common/cuda_device.h"
#include "ops/cuda/softmax_rows.cuh"
#include "ops/softmax.h"

namespace safeattn::cuda {

// Instantiated in softmax_rows_<dtype>.cu.
SAFEATTN_SOFTMAX_ROWS_INSTANCES(extern, float);
SAFEATTN_SOFTMAX_ROWS_INSTANCES(extern, double);
SAFEATTN_SOFTMAX_ROWS_INSTANCES(extern, c10::Half);
SAFEATTN_SOFTMAX_ROWS_INSTANCES(extern, c10::BFloat16);

namespace {

using namespace safeattn::softmax_detail;
using rows_detail::element_value;
using rows_detail::mask_ref;
using rows_detail::MaskRef;

// ---- small device helpers ----------------------------------------------------------------

template <typename acc_t>
__device__ __forceinline__ acc_t fast_exp(acc_t x) {
  // Accurate expf (not __expf): the online rescaling multiplies exp errors, and on long
  // columns __expf's relative error reached twice PyTorch's (H100, 6000-long dim-1 softmax).
  // The kernels are memory-bound, so the extra instructions cost nothing measurable.
  if constexpr (std::is_same_v<acc_t, float>) {
    return ::expf(x);  // exp(-inf) = 0
  } else {
    return ::exp(x);
  }
}

// Online (max, sum of exp(x - max)) of a set of values, with NaN / +inf recorded apart so
// that no exp ever sees them (softmax_detail::row_kind reads the result).
template <typename acc_t>
struct OnlineState {
  acc_t max;
  acc_t sum;
  bool bad;  // a NaN or +inf was seen

  __device__ __forceinline__ static OnlineState empty() {
    return {neg_inf<acc_t>(), acc_t(0), false};
  }
  __device__ __forceinline__ void add(acc_t x) {
    if (!(x < std::numeric_limits<acc_t>::infinity())) {  // NaN or +inf
      bad = true;
    } else if (x > max) {
      sum = sum * fast_exp(max - x) + acc_t(1);  // exp(-inf) = 0 while max is -inf
      max = x;
    } else if (x != neg_inf<acc_t>()) {
      sum += fast_exp(x - max);
    }
  }
  __device__ __forceinline__ void merge(const OnlineState& o) {
    const acc_t m = max > o.max ? max : o.max;
    if (m != neg_inf<acc_t>()) {
      sum = sum * fast_exp(max - m) + o.sum * fast_exp(o.max - m);
    }
    max = m;
    bad = bad || o.bad;
  }
  // What the row max means, as row_kind does on the CPU.
  __device__ __forceinline__ RowKind kind() const {
    return bad ? RowKind::kNaN : row_kind(max);
  }
};

template <typename acc_t>
__device__ __forceinline__ acc_t output_value(acc_t x, acc_t max, RowKind kind, acc_t inv) {
  if (kind == RowKind::kEmpty) {
    return acc_t(0);
  }
  if (kind == RowKind::kNaN) {
    return std::numeric_limits<acc_t>::quiet_NaN();
  }
  return fast_exp(x - max) * inv;  // x = -inf gives 0
}

// ---- forward -----------------------------------------------------------------------------

// Other dims: one thread per column (o, i) of the [outer, dim_size, inner] view; neighbouring
// threads take neighbouring i, so every access of a warp is contiguous.
template <typename T>
__global__ void softmax_columns_kernel(const T* __restrict__ scores, T* __restrict__ out, int64_t outer, int64_t n,
                                       int64_t inner, const void* __restrict__ mask, MaskGeometry mg,
                                       acc_type_t<T> scale) {
  using acc_t = acc_type_t<T>;
  const int64_t columns = outer * inner;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < columns;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = c / inner;
    const int64_t i = c % inner;
    const int64_t base = o * n * inner + i;
    const MaskRef m = mask_ref(mask, mg, o, i, sizeof(T));
    // Three passes over the column (it stays in L1/L2): the max, then a compensated sum of
    // exp(x - max), then the output. A running (max, sum) rescaled at every new max, summed
    // plainly, lost up to 1e-6 on 6000-long float32 columns: twice PyTorch's own error.
    OnlineState<acc_t> st = OnlineState<acc_t>::empty();
    for (int64_t d = 0; d < n; ++d) {
      const acc_t x = element_value<T, acc_t>(scores[base + d * inner], scale, m, d);
      st.bad = st.bad || !(x < std::numeric_limits<acc_t>::infinity());  // NaN or +inf
      st.max = x > st.max ? x : st.max;
    }
    const RowKind kind = st.kind();
    acc_t inv = acc_t(0);
    if (kind == RowKind::kNormal) {
      acc_t sum = 0, lost = 0;  // Kahan summation
      for (int64_t d = 0; d < n; ++d) {
        const acc_t term = fast_exp(element_value<T, acc_t>(scores[base + d * inner], scale, m, d) - st.max) - lost;
        const acc_t next = sum + term;
        lost = (next - sum) - term;
        sum = next;
      }
      inv = acc_t(1) / sum;
    }
    for (int64_t d = 0; d < n; ++d) {
      out[base + d * inner] = static_cast<T>(
          output_value(element_value<T, acc_t>(scores[base + d * inner], scale, m, d), st.max, kind, inv));
    }
  }
}

// ---- backward ----------------------------------------------------------------------------

template <typename T>
__global__ void softmax_backward_columns_kernel(const T* __restrict__ grad_out, const T* __restrict__ out,
                                                T* __restrict__ grad_scores, acc_type_t<T>* __restrict__ grad_x,
                                                int64_t outer, int64_t n, int64_t inner, acc_type_t<T> scale) {
  using acc_t = acc_type_t<T>;
  const int64_t columns = outer * inner;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < columns;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t base = (c / inner) * n * inner + c % inner;
    acc_t dot = 0;
    for (int64_t d = 0; d < n; ++d) {
      const int64_t at = base + d * inner;
      dot += dot_term<acc_t>(static_cast<acc_t>(grad_out[at]), static_cast<acc_t>(out[at]));
    }
    for (int64_t d = 0; d < n; ++d) {
      const int64_t at = base + d * inner;
      const acc_t gr = grad_element<acc_t>(static_cast<acc_t>(grad_out[at]), static_cast<acc_t>(out[at]), dot);
      grad_scores[at] = static_cast<T>(gr * scale);
      if (grad_x != nullptr) {
        grad_x[at] = gr;
      }
    }
  }
}

// ---- launch configuration ----------------------------------------------------------------

// The current stream: c10::cuda::getCurrentCUDAStream is what at::cuda::getCurrentCUDAStream
// forwards to (ATen/cuda/CUDAContext.h also pulls in cuSPARSE / cuBLAS headers, which a bare
// toolkit may lack).
cudaStream_t current_stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

// Blocks for `groups` row groups: enough to fill the GPU several times over; the kernels loop.
unsigned int grid_for(int64_t groups) {
  const int64_t sms = multiprocessor_count();
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(groups, sms * 64)));
}

template <typename T>
void forward_typed(const at::Tensor& scores, const at::Tensor& mask, const MaskGeometry& mg, double scale,
                   const SoftmaxGeometry& g, at::Tensor& out) {
  using acc_t = acc_type_t<T>;
  const T* in = scores.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const void* m = mask.defined() ? mask.const_data_ptr() : nullptr;
  const acc_t s = static_cast<acc_t>(scale);
  const cudaStream_t stream = current_stream();
  if (g.inner > 1) {
    constexpr int kThreads = 256;
    softmax_columns_kernel<T><<<grid_for((g.outer * g.inner + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        in, o, g.outer, g.dim_size, g.inner, m, mg, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  launch_softmax_rows<T>(in, o, g.outer, g.dim_size, m, mg, s, stream);
}

template <typename T>
void backward_typed(const at::Tensor& grad_out, const at::Tensor& out, double scale, const SoftmaxGeometry& g,
                    at::Tensor& grad_scores, at::Tensor& grad_x) {
  using acc_t = acc_type_t<T>;
  const T* go = grad_out.const_data_ptr<T>();
  const T* y = out.const_data_ptr<T>();
  T* gs = grad_scores.mutable_data_ptr<T>();
  acc_t* gx = grad_x.defined() ? grad_x.mutable_data_ptr<acc_t>() : nullptr;
  const acc_t s = static_cast<acc_t>(scale);
  const cudaStream_t stream = current_stream();
  if (g.inner > 1) {
    constexpr int kThreads = 256;
    softmax_backward_columns_kernel<T>
        <<<grid_for((g.outer * g.inner + kThreads - 1) / kThreads), kThreads, 0, stream>>>(go, y, gs, gx, g.outer,
                                                                                           g.dim_size, g.inner, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  launch_softmax_backward_rows<T>(go, y, gs, gx, g.outer, g.dim_size, s, stream);
}

void softmax_forward_cuda(const at::Tensor& scores, const at::Tensor& mask, const MaskGeometry& mask_geometry,
                          double scale, const SoftmaxGeometry& geometry, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "safeattn_softmax_cuda",
                                  [&] { forward_typed<scalar_t>(scores, mask, mask_geometry, scale, geometry, out); });
}

void softmax_backward_cuda(const at::Tensor& grad_out, const at::Tensor& out, double scale,
                           const SoftmaxGeometry& geometry, at::Tensor& grad_scores, at::Tensor& grad_x) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "safeattn_softmax_backward_cuda", [&] {
    backward_typed<scalar_t>(grad_out, out, scale, geometry, grad_scores, grad_x);
  });
}

// ---- registration --------------------------------------------------------------------------

at::Tensor safe_softmax_cuda(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  const OpDeviceGuard guard(self.device());
  return safe_softmax_impl(self, dim, dtype, &softmax_forward_cuda);
}

at::Tensor safe_softmax_backward_cuda(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim,
                                      at::ScalarType input_dtype) {
  const OpDeviceGuard guard(out.device());
  return safe_softmax_backward_impl(grad_out, out, dim, input_dtype, &softmax_backward_cuda);
}

at::Tensor masked_softmax_cuda(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale,
                               int64_t dim, std::optional<at::ScalarType> dtype) {
  const OpDeviceGuard guard(scores.device());
  return masked_softmax_impl(scores, mask, scale, dim, dtype, &softmax_forward_cuda);
}

std::tuple<at::Tensor, at::Tensor> masked_softmax_backward_cuda(const at::Tensor& grad_out, const at::Tensor& out,
                                                                const std::optional<at::Tensor>& mask, double scale,
                                                                int64_t dim, at::ScalarType input_dtype,
                                                                bool mask_requires_grad) {
  const OpDeviceGuard guard(out.device());
  return masked_softmax_backward_impl(grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad,
                                      &softmax_backward_cuda);
}

}  // namespace
}  // namespace safeattn::cuda

TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  m.impl("safe_softmax", &safeattn::cuda::safe_softmax_cuda);
  m.impl("_safe_softmax_backward", &safeattn::cuda::safe_softmax_backward_cuda);
  m.impl("masked_softmax", &safeattn::cuda::masked_softmax_cuda);
  m.impl("_masked_softmax_backward", &safeattn::cuda::masked_softmax_backward_cuda);
}
