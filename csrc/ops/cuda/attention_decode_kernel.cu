// Host side of the split-KV decode forward (attention_decode.cuh holds the kernels and their
// design): the checks that decide whether it takes a call, the parameters from tensors, the
// split count and the launches.
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "ops/attention_kvcache.h"
#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_decode.h"
#include "ops/cuda/generic/attention_decode.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "safeattn.h"

namespace safeattn::cuda {
namespace {

using decode::DecodeOutputs;
using decode::DecodeParams;
using decode::kMaxRows;
using decode::kThreads;

// The head dims the decode kernels are compiled for (bit D / 16): 64 and 128.
constexpr uint64_t kDecodeHeadDims = (uint64_t{1} << (64 / 16)) | (uint64_t{1} << (128 / 16));

// Whether the current GPU runs thread block clusters and programmatic dependent launches (sm_90
// and later; torch caches the properties).
bool has_clusters() {
  return at::cuda::getCurrentDeviceProperties()->major >= 9;
}

template <typename T, int kD, decode::KvRows kRows, bool kCluster, class Tiles>
void launch_split(const DecodeParams& p, int64_t batch, int64_t hkv, cudaStream_t stream) {
  constexpr size_t kSmem = Tiles::template smem_bytes<T, kD>();
  auto kernel = &decode::attention_decode_split_kernel<T, kD, kRows, kCluster, Tiles>;
  if constexpr (kSmem > 48 * 1024) {  // each call: the attribute belongs to the current device
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  }
  C10_CUDA_CHECK(decode::launch_split_kernel(kernel, p, batch, hkv, kSmem, stream, kCluster));
}

template <typename T, int kD, decode::KvRows kRows, class Tiles>
void launch_decode(DecodeParams p, const DecodeOutputs& o, int64_t batch, int64_t hkv, int64_t sms,
                   at::TensorOptions options) {
  constexpr size_t kSmem = Tiles::template smem_bytes<T, kD>();
  // One wave: as many splits as the resident CTAs (per SM, by occupancy) leave to each (batch,
  // kv head). The occupancy of one kernel does not change, nor between the cluster instance and
  // the other (the same registers and shared memory). With key ranges a (batch, kv head) may see
  // fewer keys than kv_end: its splits then share those (the kernel divides them), and some may
  // get none.
  static const int resident = [&] {
    auto kernel = &decode::attention_decode_split_kernel<T, kD, kRows, false, Tiles>;
    if (kSmem > 48 * 1024) {
      C10_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
    }
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, kSmem));
    return std::max(n, 1);
  }();
  // The largest cluster of splits (sm_90: 16 where the GPU places one, decode::max_cluster_splits).
  static const int gpu_max_cluster = [&] {
    auto kernel = &decode::attention_decode_split_kernel<T, kD, kRows, true, Tiles>;
    if (kSmem > 48 * 1024) {
      C10_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
    }
    return has_clusters() ? decode::max_cluster_splits(kernel, kSmem) : decode::kMaxClusterSplits;
  }();
  const decode::DecodeLaunch how =
      decode::decode_launch(p.kv_end, batch, hkv, sms * resident, has_clusters(), kRows == decode::KvRows::kPageRows, 8,
                            decode::kLongSplitTiles, decode::step_max_cluster(batch, hkv, sms, gpu_max_cluster), false,
                            decode::split_slots_for(kD, kRows, p.kv_end, batch * hkv, sms, sms * resident));
  p.splits = how.splits;
  p.out = o;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t total_rows = batch * p.hq * p.q_len;
  const bool workspace = p.splits > 1 && !how.cluster;
  at::Tensor o_part, lse_part;  // the splits' partials, for the combine kernel
  if (workspace) {
    const at::TensorOptions f32 = options.dtype(at::kFloat);
    o_part = at::empty({total_rows, p.splits, kD}, f32);
    lse_part = at::empty({total_rows, p.splits}, f32);
    p.o_part = o_part.data_ptr<float>();
    p.lse_part = lse_part.data_ptr<float>();
  }
  if (how.cluster) {
    launch_split<T, kD, kRows, true, Tiles>(p, batch, hkv, stream);
  } else {
    launch_split<T, kD, kRows, false, Tiles>(p, batch, hkv, stream);
  }
  if (workspace) {
    C10_CUDA_CHECK((decode::launch_combine_kernel<T, kD>(p, total_rows, stream, has_clusters())));
  }
}

void run_decode(at::ScalarType dtype, int64_t head_dim, const DecodeParams& p, const DecodeOutputs& o, int64_t batch,
                int64_t hkv, at::TensorOptions options) {
  const int64_t sms = multiprocessor_count();
  const decode::KvRows rows = decode::kv_rows_of(p.cache);
  const int wave_ctas = decode::wave_config_ctas(static_cast<int>(head_dim), p.kv_end, batch, hkv, sms,
                                                 at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin,
                                                 rows == decode::KvRows::kPageRows);
  with_head_dim<kDecodeHeadDims>(head_dim, [&](auto dim) {
    constexpr int kD = decltype(dim)::value;
    auto launch = [&](auto tiles) {
      using Tiles = decltype(tiles);
      decode::with_kv_rows(rows, [&](auto kv_rows) {
        constexpr decode::KvRows kRows = decltype(kv_rows)::value;
        if (dtype == at::kBFloat16) {
          launch_decode<__nv_bfloat16, kD, kRows, Tiles>(p, o, batch, hkv, sms, options);
        } else {
          launch_decode<__half, kD, kRows, Tiles>(p, o, batch, hkv, sms, options);
        }
      });
    };
    if constexpr (decode::DecodeWaveShape<kD, 1>::kHas) {
      if (wave_ctas == 1) {
        launch(decode::DecodeWaveConfig<kD, 1>{});
        return;
      }
    }
    if constexpr (decode::DecodeWaveShape<kD, 2>::kHas) {
      if (wave_ctas == 2) {
        launch(decode::DecodeWaveConfig<kD, 2>{});
        return;
      }
    }
    launch(decode::DecodeConfig<kD>{});
  });
}

// What both routes ask of the call's shape: rows = query rows per kv head (group x Q).
const char* decode_shape_rejects(at::ScalarType dtype, int64_t head_dim, int64_t dv, int64_t rows, int64_t batch,
                                 int64_t hkv, int64_t kv_len) {
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return "dtype is not float16 or bfloat16";
  }
  if (!has_head_dim<kDecodeHeadDims>(head_dim) || dv != head_dim) {
    return "head dim is not 64 or 128 with D == Dv";
  }
  if (rows < 1 || rows > kMaxRows) {
    return "more than 16 query rows per kv head (query heads per kv head x Q)";
  }
  if (batch > 65535 || hkv > 65535) {
    return "batch or kv heads above 65535 (grid y and z)";
  }
  if (kv_len > int64_t{1} << 30) {
    return "more than 2^30 keys (key indices are int32)";
  }
  return nullptr;
}

DecodeParams decode_params(const at::Tensor& q, int64_t hq, int64_t q_len, int64_t group, double scale,
                           double softcap) {
  DecodeParams p{};
  p.q = q.const_data_ptr();
  p.hq = hq;
  p.group = group;
  p.q_len = q_len;
  p.rows = static_cast<int>(group * q_len);
  p.score = attn::score_rule(scale, softcap, /*natural=*/false, /*log2_mask=*/true);
  return p;
}

}  // namespace

const char* attention_fwd_decode_rejects(const AttentionFwdArgs& a) {
  if (a.out.numel() == 0) {
    return "an empty output";
  }
  const int64_t hkv = a.key.size(1);
  if (const char* reason =
          decode_shape_rejects(a.query.scalar_type(), a.query.size(3), a.value.size(3),
                               a.query.size(1) / hkv * a.query.size(2), a.query.size(0), hkv, a.key.size(2))) {
    return reason;
  }
  if (a.out.stride(3) != 1 || !attn::rows_aligned_16(a.query) || !attn::rows_aligned_16(a.key) ||
      !attn::rows_aligned_16(a.value)) {
    return "query, key or value rows not 16-byte aligned, or out's last dim strided";
  }
  // A floating mask needs natural score units (attention_common.cuh, exp_of), which this kernel
  // does not have: the prefill kernel takes those calls.
  if (attn::natural_units(a.mask)) {
    return "a float mask (this kernel scores in log2 units only)";
  }
  if (!a.lse.is_contiguous() || a.lse.scalar_type() != at::kFloat) {
    return "lse is not contiguous float32";
  }
  return nullptr;
}

void attention_fwd_decode(const AttentionFwdArgs& a) {
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2);
  DecodeParams p = decode_params(a.query, hq, q_len, hq / hkv, a.scale, a.softcap);
  p.k = a.key.const_data_ptr();
  p.v = a.value.const_data_ptr();
  p.q_sb = a.query.stride(0), p.q_sh = a.query.stride(1), p.q_si = a.query.stride(2);
  p.k_sb = a.key.stride(0), p.k_sh = a.key.stride(1), p.k_si = a.key.stride(2);
  p.v_sb = a.value.stride(0), p.v_sh = a.value.stride(1), p.v_si = a.value.stride(2);
  p.causal = attn::causal_rule(a);
  p.mask = attn::make_mask_view(a.mask);
  p.ranges = attn::make_key_range_view(a.key_ranges);
  // Keys at or past kv_end are hidden from every row by the causal rule (the last row, q_len - 1,
  // sees keys j <= q_len - 1 + shift): they are not read.
  p.kv_end = a.is_causal ? std::clamp<int64_t>(q_len + p.causal.shift, 0, kv_len) : kv_len;
  DecodeOutputs o;
  o.out = a.out.data_ptr();
  o.o_sb = a.out.stride(0), o.o_sh = a.out.stride(1), o.o_si = a.out.stride(2);
  o.lse = a.lse.data_ptr<float>();
  o.lse_lo = a.lse_lo.defined() ? a.lse_lo.data_ptr<float>() : nullptr;
  o.sinks = a.sinks.defined() ? a.sinks.const_data_ptr<float>() : nullptr;
  run_decode(a.query.scalar_type(), a.query.size(3), p, o, batch, hkv, a.query.options());
}

const char* attention_kvcache_decode_rejects(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             int64_t capacity) {
  if (q.numel() == 0) {
    return "an empty output";
  }
  const int64_t hkv = k_cache.size(2);
  if (const char* reason = decode_shape_rejects(q.scalar_type(), q.size(3), v_cache.size(3),
                                                q.size(2) / hkv * q.size(1), q.size(0), hkv, capacity)) {
    return reason;
  }
  if (!attn::rows_aligned_16(q) || !attn::rows_aligned_16(k_cache) || !attn::rows_aligned_16(v_cache)) {
    return "q, k_cache or v_cache rows not 16-byte aligned";
  }
  return nullptr;
}

std::tuple<at::Tensor, at::Tensor> attention_kvcache_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                            const at::Tensor& v_cache, const KvCacheView& cache,
                                                            double scale, double softcap, const at::Tensor& sinks) {
  // q [B, Sq, Hq, D]; a contiguous cache [B, S, Hkv, D], a paged one [pages, page_size, Hkv, D].
  const int64_t batch = q.size(0), q_len = q.size(1), hq = q.size(2), hkv = k_cache.size(2);
  DecodeParams p = decode_params(q, hq, q_len, hq / hkv, scale, softcap);
  p.k = k_cache.const_data_ptr();
  p.v = v_cache.const_data_ptr();
  p.q_sb = q.stride(0), p.q_sh = q.stride(2), p.q_si = q.stride(1);
  p.k_sb = k_cache.stride(0), p.k_sh = k_cache.stride(2), p.k_si = k_cache.stride(1);
  p.v_sb = v_cache.stride(0), p.v_sh = v_cache.stride(2), p.v_si = v_cache.stride(1);
  p.cache = cache;
  p.kv_end = cache.capacity;
  at::Tensor out = at::empty({batch, q_len, hq, v_cache.size(3)}, q.options());
  at::Tensor lse = at::empty({batch, hq, q_len}, q.options().dtype(at::kFloat));
  DecodeOutputs o;
  o.out = out.data_ptr();
  o.o_sb = out.stride(0), o.o_sh = out.stride(2), o.o_si = out.stride(1);
  o.lse = lse.data_ptr<float>();
  o.sinks = sinks.defined() ? sinks.const_data_ptr<float>() : nullptr;
  run_decode(q.scalar_type(), q.size(3), p, o, batch, hkv, q.options());
  return {out, lse};
}

}  // namespace safeattn::cuda
