// Host helpers shared by the CUDA attention forward and backward (see attention_common.cuh).
#include "ops/cuda/attention_common.cuh"

#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

namespace safeattn::cuda::attn {

MaskView make_mask_view(const at::Tensor& mask) {
  MaskView view;
  if (!mask.defined()) {
    return view;
  }
  TORCH_INTERNAL_ASSERT(mask.dim() == 4, "attention (CUDA): the mask view must be 4-D");
  switch (mask.scalar_type()) {
    case at::kBool:
      view.kind = MaskKind::kBool;
      break;
    case at::kFloat:
      view.kind = MaskKind::kFloat;
      break;
    case at::kHalf:
      view.kind = MaskKind::kHalf;
      break;
    case at::kBFloat16:
      view.kind = MaskKind::kBFloat16;
      break;
    default:
      TORCH_CHECK(false, "attention (CUDA): attn_mask of dtype ", mask.scalar_type(), " has no CUDA kernel");
  }
  view.ptr = mask.data_ptr();
  view.stride_b = mask.stride(0);
  view.stride_h = mask.stride(1);
  view.stride_q = mask.stride(2);
  view.stride_kv = mask.stride(3);
  return view;
}

bool rows_aligned_16(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0 || t.stride(3) != 1) {
    return false;
  }
  for (int64_t d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) {
      return false;
    }
  }
  return true;
}

bool sizes_fit_int32(const at::Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > std::numeric_limits<int32_t>::max()) {
      return false;
    }
  }
  return true;
}

bool sm90_inputs_supported(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  const at::ScalarType dtype = query.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return false;
  }
  const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // as the kernels get it
  if (!(scale > 0.0) || !(scale_log2 > 0.0f) || !std::isfinite(scale_log2)) {
    return false;
  }
  if (value.size(3) != query.size(3) || query.numel() == 0 || key.size(2) == 0 || !sizes_fit_int32(query) ||
      !sizes_fit_int32(key)) {
    return false;  // empty inputs: the other paths write the empty rows
  }
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(query.get_device());
  return props->major == 9 && props->minor == 0;
}

at::Tensor with_aligned_rows(const at::Tensor& t) {
  return rows_aligned_16(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

namespace {

constexpr int kSummaryThreads = 256;

// One CTA per (mask slice, query tile, key tile): x = ((slice * q_tiles) + q_tile) * kv_tiles +
// kv_tile. Each thread looks at a strided share of the tile's elements; the three flags are
// ORed over the CTA. vec16: a bool mask whose rows the host found 16-byte aligned with unit stride
// along the keys (and block_kv a multiple of 16), read 16 keys per load; the index arithmetic is
// 32-bit (a tile has at most block_q * block_kv elements).
__global__ void __launch_bounds__(kSummaryThreads)
    summarize_mask_tiles_kernel(MaskView mask, int64_t q_len, int64_t kv_len, int block_q, int block_kv,
                                int64_t heads_m, int64_t q_tiles, int64_t kv_tiles, bool vec16, uint8_t* out) {
  const int64_t x = blockIdx.x;
  const int64_t kv_tile = x % kv_tiles;
  const int64_t q_tile = (x / kv_tiles) % q_tiles;
  const int64_t slice = x / (kv_tiles * q_tiles);
  const int64_t b = slice / heads_m, h = slice % heads_m;
  const int64_t i0 = q_tile * block_q, j0 = kv_tile * block_kv;
  const int rows = static_cast<int>(q_len - i0 < block_q ? q_len - i0 : block_q);
  const int cols = static_cast<int>(kv_len - j0 < block_kv ? kv_len - j0 : block_kv);
  bool any_visible = false, any_masked = false, any_bias = false;
  if (vec16) {
    // Bool (bytes 0 / 1): a word of four visible keys is 0x01010101, of four masked ones 0.
    const uint8_t* tile = static_cast<const uint8_t*>(mask.ptr) + mask.offset(b, h, i0, j0);
    const int chunks = (cols + 15) / 16;
    for (int e = threadIdx.x; e < rows * chunks; e += kSummaryThreads) {
      const int r = e / chunks, c = 16 * (e % chunks);
      const uint8_t* keys = tile + r * mask.stride_q + c;
      if (c + 16 <= cols) {
        const uint4 w = *reinterpret_cast<const uint4*>(keys);
        for (const uint32_t word : {w.x, w.y, w.z, w.w}) {
          any_visible |= word != 0u;
          any_masked |= word != 0x01010101u;
        }
      } else {
        for (int k = 0; k < cols - c; ++k) {
          any_visible |= keys[k] != 0;
          any_masked |= keys[k] == 0;
        }
      }
    }
  } else {
    for (int e = threadIdx.x; e < rows * cols; e += kSummaryThreads) {
      const int r = e / cols, c = e % cols;
      const float v = mask.additive(mask.offset(b, h, i0 + r, j0 + c));
      const bool masked = v == -INFINITY;
      any_masked |= masked;
      any_visible |= !masked;    // NaN included: it must reach its row
      any_bias |= !(v == 0.0f);  // NaN included
    }
  }
  any_visible = __syncthreads_or(any_visible);
  any_masked = __syncthreads_or(any_masked);
  any_bias = __syncthreads_or(any_bias);
  if (threadIdx.x == 0) {
    out[x] = !any_visible ? kTileMasked : (!any_masked && !any_bias ? kTileVisible : kTileMixed);
  }
}

}  // namespace

at::Tensor summarize_mask_tiles(const at::Tensor& mask, int block_q, int block_kv) {
  TORCH_INTERNAL_ASSERT(mask.defined() && mask.dim() == 4 && block_q > 0 && block_kv > 0,
                        "attention (CUDA): summarize_mask_tiles takes a 4-D mask view and positive tile sizes");
  const MaskView view = make_mask_view(mask);
  // Broadcast dims of the expanded view have stride 0 (or size 1): summarise them once.
  const int64_t batch_m = (mask.size(0) == 1 || mask.stride(0) == 0) ? 1 : mask.size(0);
  const int64_t heads_m = (mask.size(1) == 1 || mask.stride(1) == 0) ? 1 : mask.size(1);
  const int64_t q_len = mask.size(2), kv_len = mask.size(3);
  const int64_t q_tiles = (q_len + block_q - 1) / block_q;
  const int64_t kv_tiles = (kv_len + block_kv - 1) / block_kv;
  at::Tensor summary = at::empty({batch_m, heads_m, q_tiles, kv_tiles}, mask.options().dtype(at::kByte));
  const int64_t blocks = summary.numel();
  if (blocks == 0) {
    return summary;
  }
  TORCH_CHECK(blocks <= 0x7fffffffLL, "attention (CUDA): the mask has too many tiles to summarise (", blocks, ")");
  // 16 keys per load: a bool mask with unit stride along the keys, every row of every slice on a
  // 16-byte boundary, tiles starting on one.
  // A size-1 dim is never stepped over: its stride does not matter.
  auto aligned16 = [&](int dim) { return mask.size(dim) == 1 || mask.stride(dim) % 16 == 0; };
  const bool vec16 = mask.scalar_type() == at::kBool && (kv_len == 1 || mask.stride(3) == 1) &&
                     reinterpret_cast<uintptr_t>(mask.data_ptr()) % 16 == 0 && block_kv % 16 == 0 && aligned16(0) &&
                     aligned16(1) && aligned16(2);
  summarize_mask_tiles_kernel<<<static_cast<unsigned>(blocks), kSummaryThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      view, q_len, kv_len, block_q, block_kv, heads_m, q_tiles, kv_tiles, vec16, summary.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return summary;
}

TileSummaryView make_tile_summary_view(const at::Tensor& summary, int block_q, int block_kv) {
  TileSummaryView view;
  if (!summary.defined()) {
    return view;
  }
  TORCH_INTERNAL_ASSERT(summary.dim() == 4 && summary.is_contiguous() && summary.scalar_type() == at::kByte,
                        "attention (CUDA): the tile summary must be a contiguous 4-D uint8 tensor");
  view.ptr = summary.data_ptr<uint8_t>();
  view.stride_b = summary.size(0) == 1 ? 0 : summary.stride(0);
  view.stride_h = summary.size(1) == 1 ? 0 : summary.stride(1);
  view.stride_q = summary.stride(2);
  view.block_q = block_q;
  view.block_kv = block_kv;
  return view;
}

}  // namespace safeattn::cuda::attn
