// CUDA forward of safeattn::attention and its CUDA registration.
//
// attention_fwd_cuda picks one of four paths:
//   - the split-KV decode kernels (attention_decode_kernel.cu) for a few query rows per kv head
//     over a long cache;
//   - on an H100/H200, the sm_90a TMA + wgmma kernels (attention_fwd_sm90.h) for what they cover;
//   - the tensor-core kernel (attention_fwd.cuh) for float16 / bfloat16 inputs with D == Dv and
//     a head dim that has a generated instantiation in this build (SAFEATTN_ATTN_FWD_D<D>);
//     a mask is first summarised per tile (summarize_mask_tiles) so that whole tiles are
//     skipped or read without the mask;
//   - a generic path for everything else (float32, float64 for gradcheck, other head dims,
//     D != Dv): ATen ops in float32 / float64 over chunks of queries, so memory stays bounded.
// All three give the semantics of ops/attention.h, including the choice of the tensor-core kernel
// that an element masked out (False, or a -inf bias) is -inf whatever its score: a NaN or inf
// behind it never reaches the row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/attention.h"
#include "ops/cuda/attention_decode.h"
#include "ops/cuda/attention_fwd.cuh"
#include "ops/cuda/attention_fwd_sm90.h"
#include "ops/cuda/head_dim_switch.h"

namespace safeattn::cuda {
namespace {

using attn::FwdParams;

// ---- tensor-core path ------------------------------------------------------------------------

template <typename T>
void launch_for_head_dim(int64_t head_dim, const FwdParams& p, cudaStream_t stream) {
  const bool launched = with_head_dim<kFwdHeadDims>(
      head_dim, [&](auto dim) { attn::launch_attention_fwd<T, decltype(dim)::value>(p, stream); });
  TORCH_INTERNAL_ASSERT(launched, "attention (CUDA): no tensor-core kernel for head dim ", head_dim);
}

bool use_tensor_cores(const AttentionFwdArgs& a) {
  const at::ScalarType dtype = a.query.scalar_type();
  return (dtype == at::kHalf || dtype == at::kBFloat16) && a.query.size(3) == a.value.size(3) &&
         has_head_dim<kFwdHeadDims>(a.query.size(3)) && attn::rows_aligned_16(a.out);
}

void attention_fwd_tensor_cores(const AttentionFwdArgs& a) {
  // q / k / v are read in place when their rows are aligned, else from an aligned copy.
  const at::Tensor query = attn::with_aligned_rows(a.query);
  const at::Tensor key = attn::with_aligned_rows(a.key);
  const at::Tensor value = attn::with_aligned_rows(a.value);
  const int64_t head_dim = query.size(3);
  int block_q = 0, block_kv = 0;
  attn::fwd_tile_sizes(head_dim, block_q, block_kv);

  FwdParams p;
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  p.out = a.out.data_ptr();
  p.lse = a.lse.data_ptr<float>();
  p.lse_lo = a.lse_lo.defined() ? a.lse_lo.data_ptr<float>() : nullptr;
  p.sinks = a.sinks.defined() ? a.sinks.data_ptr<float>() : nullptr;
  p.q_sb = query.stride(0), p.q_sh = query.stride(1), p.q_si = query.stride(2);
  p.k_sb = key.stride(0), p.k_sh = key.stride(1), p.k_si = key.stride(2);
  p.v_sb = value.stride(0), p.v_sh = value.stride(1), p.v_si = value.stride(2);
  p.o_sb = a.out.stride(0), p.o_sh = a.out.stride(1), p.o_si = a.out.stride(2);
  p.heads = query.size(1);
  p.group = query.size(1) / key.size(1);
  p.batch_heads = query.size(0) * query.size(1);
  p.q_len = query.size(2);
  p.kv_len = key.size(2);
  p.natural = attn::natural_units(a.mask);
  const double unit = p.natural ? 1.0 : 1.4426950408889634;  // log2(e)
  p.score_scale = static_cast<float>(a.scale * unit);
  if (a.softcap > 0.0) {
    p.softcap_pre = static_cast<float>(a.scale / a.softcap);
    p.softcap_post = static_cast<float>(a.softcap * unit);
  }
  p.causal.enabled = a.is_causal;
  p.causal.shift = a.q_offset - a.kv_offset;
  at::Tensor summary;  // kept alive until the launch is queued (stream-ordered allocator)
  if (a.mask.defined()) {
    p.mask = attn::make_mask_view(a.mask);
    summary = attn::summarize_mask_tiles(a.mask, block_q, block_kv);
    p.tiles = attn::make_tile_summary_view(summary, block_q, block_kv);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (query.scalar_type() == at::kBFloat16) {
    launch_for_head_dim<__nv_bfloat16>(head_dim, p, stream);
  } else {
    launch_for_head_dim<__half>(head_dim, p, stream);
  }
}

// ---- generic path ----------------------------------------------------------------------------

// Correctness, not speed: the dense formula in float32 (float64 for float64 inputs) over
// chunks of queries whose [B, Hq, chunk, KV] scores stay under kChunkElements.
constexpr int64_t kChunkElements = int64_t{1} << 26;

void attention_fwd_generic(const AttentionFwdArgs& a) {
  const at::ScalarType acc = a.query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t head_dim = a.query.size(3);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2), dv = a.value.size(3);
  const int64_t group = hq / hkv;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (kv_len == 0) {  // no key at all: every row is empty
    a.out.zero_();
    if (a.sinks.defined()) {
      a.lse.copy_(a.sinks.view({1, hq, 1}).expand_as(a.lse));
    } else {
      a.lse.fill_(neg_inf);
    }
    if (a.lse_lo.defined()) {
      a.lse_lo.zero_();
    }
    return;
  }
  const at::TensorOptions acc_options = a.query.options().dtype(acc);
  // K^T and V once in acc (a copy; the generic path is not the fast one).
  const at::Tensor key_t = a.key.to(acc).transpose(2, 3);  // [B, Hkv, D, KV]
  const at::Tensor value = a.value.to(acc);                // [B, Hkv, KV, Dv]
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(q_len, kChunkElements / (batch * hq * kv_len)));
  const at::Tensor zero = at::zeros({}, acc_options);
  const at::Tensor minus_inf = at::full({}, neg_inf, acc_options);
  for (int64_t i0 = 0; i0 < q_len; i0 += chunk) {
    const int64_t n = std::min(chunk, q_len - i0);
    // Query heads of one kv group side by side: [B, Hkv, group * n, D], so K/V are not repeated.
    const at::Tensor q = a.query.narrow(2, i0, n).to(acc).reshape({batch, hkv, group * n, head_dim});
    at::Tensor s = at::matmul(q, key_t).view({batch, hq, n, kv_len});
    s.mul_(a.scale);
    if (a.softcap > 0.0) {
      s = at::tanh(s / a.softcap) * a.softcap;
    }
    if (a.mask.defined()) {
      const at::Tensor m = a.mask.narrow(2, i0, n);
      if (m.scalar_type() == at::kBool) {
        s = at::where(m, s, minus_inf);
      } else {
        const at::Tensor bias = m.to(acc);
        s = at::where(bias == neg_inf, minus_inf, s + bias);  // masked stays -inf, even for NaN s
      }
    }
    if (a.is_causal) {
      const at::Tensor rows = at::arange(i0, i0 + n, a.query.options().dtype(at::kLong)).view({n, 1});
      const at::Tensor cols = at::arange(kv_len, a.query.options().dtype(at::kLong)).view({1, kv_len});
      s = at::where(cols <= rows + (a.q_offset - a.kv_offset), s, minus_inf);
    }
    // Row max keeps NaN (amax propagates it); an empty row is shifted by 0, not by -inf.
    const at::Tensor row_max = s.amax(-1, /*keepdim=*/true);
    const at::Tensor offset = at::where(row_max == neg_inf, zero, row_max);
    const at::Tensor prob = at::exp(s - offset);
    const at::Tensor row_sum = prob.sum(-1, /*keepdim=*/true);
    at::Tensor o = at::matmul(prob.view({batch, hkv, group * n, kv_len}), value).view({batch, hq, n, dv});
    // lse = top + log(total) (top: the row max, or the sink logit when larger), by two_sum so
    // that lse_lo keeps what the rounding drops (ops/attention.h); factor normalises the row.
    const at::Tensor empty = row_sum == 0;
    at::Tensor top = at::where(empty, minus_inf, row_max);
    at::Tensor total = row_sum;
    at::Tensor weight = at::ones_like(row_sum);
    if (a.sinks.defined()) {
      const at::Tensor sink = a.sinks.to(acc).view({1, hq, 1, 1}).expand_as(top);
      const at::Tensor row_top = top;
      top = at::where(at::isnan(row_top) | (row_top >= sink), row_top, sink);
      weight = at::where(empty, zero, at::exp(row_top - top));
      total = row_sum * weight + at::exp(sink - top);
    }
    const at::Tensor log_total = at::log(total);
    const at::Tensor lse = top + log_total;
    const at::Tensor b_part = lse - top;
    at::Tensor lse_lo = (top - (lse - b_part)) + (log_total - b_part);
    const at::Tensor row_empty = top == neg_inf;  // no visible key and no sink: lse -inf, lo 0
    lse_lo = at::where(row_empty, zero, lse_lo);
    const at::Tensor factor = at::where(row_empty, zero, weight / total);
    // An empty row is exactly 0, even if a masked value held NaN (0 * NaN in P V).
    o = at::where(empty, zero, o * factor);
    a.out.narrow(2, i0, n).copy_(o);
    a.lse.narrow(2, i0, n).copy_(at::where(row_empty, minus_inf, lse).squeeze(-1));
    if (a.lse_lo.defined()) {
      a.lse_lo.narrow(2, i0, n).copy_(lse_lo.squeeze(-1));
    }
  }
}

void attention_fwd_cuda(const AttentionFwdArgs& args) {
  if (attention_fwd_decode(args)) {  // at most 16 query rows per kv head
    return;
  }
  if (attention_fwd_sm90(args)) {  // Hopper: TMA + wgmma kernels, where they cover the call
    return;
  }
  if (use_tensor_cores(args)) {
    attention_fwd_tensor_cores(args);
  } else {
    attention_fwd_generic(args);
  }
}

// ---- registration ----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                  double dropout_p, bool is_causal, std::optional<double> scale,
                                                  bool enable_gqa, int64_t q_offset, int64_t kv_offset, double softcap,
                                                  const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  auto [out, lse, unused] =
      attention_impl(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset, kv_offset,
                     softcap, sinks, /*with_lse_lo=*/false, &attention_fwd_cuda);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, int64_t q_offset, int64_t kv_offset,
    double softcap, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  return attention_impl(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset, kv_offset,
                        softcap, sinks, /*with_lse_lo=*/true, &attention_fwd_cuda);
}

}  // namespace
}  // namespace safeattn::cuda

// The forward only; _attention_backward's CUDA kernel is registered in attention_bwd_kernel.cu.
TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  m.impl("attention", &safeattn::cuda::attention_cuda);
  m.impl("_attention_forward", &safeattn::cuda::attention_forward_cuda);
}
