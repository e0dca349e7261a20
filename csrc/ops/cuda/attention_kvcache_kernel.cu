// safeattn::_attention_kvcache on CUDA (ops/attention_kvcache.h): the new tokens appended by one
// kernel, then the split-KV decode kernel reading the cache where it is (pages through the block
// table, each row's keys from the cache's lengths), or, where decode cannot take the call, the
// composite route over key ranges filled by one kernel. No host synchronisation.
#include <cmath>
#include <cstdint>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/attention.h"
#include "ops/attention_kvcache.h"
#include "ops/cuda/attention_decode.h"

namespace safeattn::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per element of k (and of v): new token t of sequence b, kv head h, to position
// write_start(b) + t of the cache, through the block table when paged. Elements moved as Vec
// (16 bytes where the rows allow).
template <typename Vec>
__global__ void kvcache_append_kernel(const KvCacheView cache, const Vec* __restrict__ src, Vec* __restrict__ dst,
                                      int64_t total, int64_t row_vecs, int64_t heads, int64_t s_sb, int64_t s_st,
                                      int64_t s_sh, int64_t d_sp, int64_t d_ss, int64_t d_sh) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= total) {
    return;
  }
  const int64_t c = e % row_vecs, h = (e / row_vecs) % heads, t = (e / (row_vecs * heads)) % cache.new_tokens;
  const int64_t b = e / (row_vecs * heads * cache.new_tokens);
  const int position = cache.write_start(b) + static_cast<int>(t);
  dst[cache.page(b, position) * d_sp + cache.slot(position) * d_ss + h * d_sh + c] =
      src[b * s_sb + t * s_st + h * s_sh + c];
}

// Strides in Vec units; `new_rows` [B, Sn, H, Dx] into `cache_rows` [B | pages, S | page, H, Dx].
template <typename Vec>
void append_as(const KvCacheView& cache, const at::Tensor& new_rows, const at::Tensor& cache_rows) {
  const int64_t per = sizeof(Vec) / new_rows.element_size();
  const int64_t row_vecs = new_rows.size(3) / per, heads = new_rows.size(2);
  const int64_t total = new_rows.size(0) * new_rows.size(1) * heads * row_vecs;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  kvcache_append_kernel<Vec><<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      cache, static_cast<const Vec*>(new_rows.const_data_ptr()), static_cast<Vec*>(cache_rows.data_ptr()), total,
      row_vecs, heads, new_rows.stride(0) / per, new_rows.stride(1) / per, new_rows.stride(2) / per,
      cache_rows.stride(0) / per, cache_rows.stride(1) / per, cache_rows.stride(2) / per);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Vectors of 16 bytes where every stride, the row and both pointers allow it, else one element.
void append(const KvCacheView& cache, const at::Tensor& new_rows, const at::Tensor& cache_rows) {
  if (new_rows.numel() == 0) {
    return;
  }
  const at::Tensor rows = new_rows.stride(3) == 1 ? new_rows : new_rows.contiguous();
  TORCH_CHECK(cache_rows.stride(3) == 1, "_attention_kvcache: the cache's last dim must have stride 1");
  const int64_t elem = rows.element_size();
  auto fits = [&](int64_t bytes) {
    if (bytes % elem != 0 || rows.size(3) * elem % bytes != 0 ||
        reinterpret_cast<uintptr_t>(rows.const_data_ptr()) % bytes != 0 ||
        reinterpret_cast<uintptr_t>(cache_rows.data_ptr()) % bytes != 0) {
      return false;
    }
    for (int d = 0; d < 3; ++d) {
      if (rows.stride(d) * elem % bytes != 0 || cache_rows.stride(d) * elem % bytes != 0) {
        return false;
      }
    }
    return true;
  };
  if (fits(16)) {
    append_as<int4>(cache, rows, cache_rows);
  } else if (elem == 8) {
    append_as<int64_t>(cache, rows, cache_rows);
  } else if (elem == 4) {
    append_as<int>(cache, rows, cache_rows);
  } else {
    append_as<int16_t>(cache, rows, cache_rows);
  }
}

__global__ void kvcache_ranges_kernel(const KvCacheView cache, int* __restrict__ ranges, int64_t rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < rows) {
    cache.key_range(r / cache.q_len, static_cast<int>(r % cache.q_len), ranges[2 * r], ranges[2 * r + 1]);
  }
}

std::tuple<at::Tensor, at::Tensor> attention_kvcache_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& block_table, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(q.device());
  const KvCacheView cache = checked_kv_cache_view(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal,
                                                  window_left, window_right, sinks);
  const int64_t batch = q.size(0), q_len = q.size(1);
  if (k.has_value() && cache.new_tokens > 0) {
    append(cache, *k, k_cache);
    append(cache, *v, v_cache);
  }
  if (attention_kvcache_decode_rejects(q, k_cache, v_cache, cache.capacity) == nullptr) {
    const at::Tensor sink_logits = sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();
    return attention_kvcache_decode(q, k_cache, v_cache, cache,
                                    scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3))),
                                    softcap, sink_logits);
  }
  at::Tensor key_ranges = at::empty({batch, q_len, 2}, cache_seqlens.options());
  const int64_t rows = batch * q_len;
  if (rows > 0) {
    kvcache_ranges_kernel<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0,
                            c10::cuda::getCurrentCUDAStream()>>>(cache, key_ranges.data_ptr<int>(), rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return attention_kvcache_composite(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, key_ranges,
                                     /*kv_end=*/-1, softcap, sinks, /*append=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  m.impl("_attention_kvcache", &attention_kvcache_cuda);
}

}  // namespace safeattn::cuda
