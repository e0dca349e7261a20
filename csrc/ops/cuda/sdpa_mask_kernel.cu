// CUDA kernel of sdpa_mask. Each thread owns 16 bytes of one row (16 bool or 4 float
// elements) and computes the row's interval once; rows whose every feature is an interval
// need no memory read at all, and padding / ids are read from small [B, L] tensors that stay
// in L2. Rows whose byte length is a multiple of 16 are written with 16-byte stores.
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/sdpa_mask.h"

namespace safeattn {
namespace {

using namespace safeattn::sdpa_mask_detail;

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

template <typename T>
constexpr int vec_of() {
  return 16 / static_cast<int>(sizeof(T));
}

// grid.x covers a row's 16-byte chunks, grid.y (strided) covers the B * Q rows.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sdpa_mask_rows_kernel(const SdpaMaskParams p, T* __restrict__ out, const T on, const T off, const bool aligned) {
  constexpr int kVec = vec_of<T>();
  const int64_t col0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kVec;
  if (col0 >= p.kv_length) {
    return;
  }
  const int64_t rows = p.batch_size * p.q_length;
  const bool elementwise = needs_elementwise(p);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t b = row / p.q_length;
    const int64_t q_pos = query_position(p, b, row - b * p.q_length);
    const Interval base = base_interval(p, b, q_pos);
    const RowKeys keys = elementwise ? row_keys(p, b, q_pos) : RowKeys{0, false, -1};
    alignas(16) T vals[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t j = col0 + k;
      // element_attends bounds-checks every index, so the columns past kv_length in the last
      // chunk read nothing outside the inputs (and are not stored).
      const bool attend = elementwise ? element_attends(p, b, base, keys, j) : (j >= base.begin && j < base.end);
      vals[k] = attend ? on : off;
    }
    T* dst = out + row * p.kv_length + col0;
    if (aligned && col0 + kVec <= p.kv_length) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(vals);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (col0 + k < p.kv_length) {
          dst[k] = vals[k];
        }
      }
    }
  }
}

template <typename T>
void launch(const SdpaMaskParams& p, at::Tensor& out, T on, T off) {
  constexpr int kVec = vec_of<T>();
  const int64_t rows = p.batch_size * p.q_length;
  const int64_t chunks = (p.kv_length + kVec - 1) / kVec;
  const dim3 grid(static_cast<unsigned>((chunks + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min(rows, kMaxGridY)));
  // Row starts are 16-byte aligned when a row's bytes are (the allocation itself is).
  const bool aligned = (p.kv_length * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  sdpa_mask_rows_kernel<T><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<T*>(out.data_ptr()), on, off, aligned);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor sdpa_mask_cuda(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                          int64_t kv_offset, const std::optional<at::Tensor>& q_positions, bool causal,
                          std::optional<int64_t> sliding_window, std::optional<int64_t> chunk_size,
                          const std::optional<at::Tensor>& chunk_left_padding,
                          const std::optional<at::Tensor>& padding_mask, const std::optional<at::Tensor>& packed_ids,
                          const std::optional<at::Tensor>& block_ids, std::optional<at::ScalarType> dtype,
                          bool use_finfo_min, std::optional<c10::Device> device) {
  c10::Device where = check_sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, q_positions,
                                      sliding_window, chunk_size, chunk_left_padding, padding_mask, packed_ids,
                                      block_ids, dtype, use_finfo_min, device);
  TORCH_CHECK(where.is_cuda(), "sdpa_mask: the CUDA kernel was asked to build on ", where.str());
  if (!where.has_index()) {
    where = c10::Device(c10::kCUDA, c10::cuda::current_device());
  }
  const c10::cuda::CUDAGuard guard(where);
  // Conversions of the small inputs run on the current stream; nothing waits on the host.
  SdpaMaskInputs in = prepare_sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, q_positions, causal,
                                        sliding_window, chunk_size, chunk_left_padding, padding_mask, packed_ids,
                                        block_ids);
  at::Tensor out = at::empty({batch_size, 1, q_length, kv_length},
                             at::TensorOptions().dtype(dtype.value_or(at::kBool)).device(where));
  if (out.numel() == 0) {
    return out;
  }
  if (out.scalar_type() == at::kBool) {
    launch<bool>(in.params, out, true, false);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sdpa_mask_cuda", [&] {
    const scalar_t off = use_finfo_min ? std::numeric_limits<scalar_t>::lowest()
                                       : -std::numeric_limits<scalar_t>::infinity();
    launch<scalar_t>(in.params, out, scalar_t(0), off);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  m.impl("sdpa_mask", &sdpa_mask_cuda);
}

}  // namespace safeattn
