// CUDA forward of safeattn::attention and its CUDA registration.
//
// attention_fwd_cuda runs the path choose_attention_fwd (attention_choice.h) picks, in its order:
//   - the split-KV decode kernels (attention_decode_kernel.cu) for a few query rows per kv head
//     over a long cache;
//   - on an H100/H200, the sm_90a TMA + wgmma kernels (attention_fwd_sm90.h) for what they cover;
//   - the tensor-core kernel (attention_fwd.cuh) for float16 / bfloat16 inputs with D == Dv and
//     a head dim that has a generated instantiation in this build (SAFEATTN_ATTN_FWD_D<D>);
//     a mask is first summarised per tile (summarize_mask_tiles) so that whole tiles are
//     skipped or read without the mask;
//   - for everything else (float32, float64 for gradcheck, other head dims, D != Dv), the
//     device-independent ATen forward attention_forward_chunked (ops/attention_composite.h),
//     in float32 / float64 over chunks of queries, so memory stays bounded.
// All four give the semantics of ops/attention.h, including the choice of the tensor-core kernel
// that an element masked out (False, or a -inf bias) is -inf whatever its score: a NaN or inf
// behind it never reaches the row.
#include <cstdint>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/cuda_device.h"
#include "ops/attention.h"
#include "ops/attention_composite.h"
#include "ops/cuda/attention_choice.h"
#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_decode.h"
#include "ops/cuda/generic/attention_fwd.cuh"
#include "ops/cuda/hopper/attention_fwd_sm90.h"
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

void attention_fwd_tensor_cores(const AttentionFwdArgs& a) {
  // q / k / v are read in place when their rows are aligned, else from an aligned copy.
  const at::Tensor query = attn::with_aligned_rows(a.query);
  const at::Tensor key = attn::with_aligned_rows(a.key);
  const at::Tensor value = attn::with_aligned_rows(a.value);
  const int64_t head_dim = query.size(3);
  int block_q = 0, block_kv = 0;
  attn::fwd_tile_sizes(head_dim, block_q, block_kv);

  FwdParams p;
  attn::set_forward_tensors(p, query, key, value, a);
  p.sinks = a.sinks.defined() ? a.sinks.data_ptr<float>() : nullptr;
  p.heads = query.size(1);
  p.group = query.size(1) / key.size(1);
  p.batch_heads = query.size(0) * query.size(1);
  p.q_len = query.size(2);
  p.kv_len = key.size(2);
  p.score = attn::score_rule(a.scale, a.softcap, attn::natural_units(a.mask));
  p.causal = attn::causal_rule(a);
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

void run_forward(AttentionPath path, const AttentionFwdArgs& args) {
  switch (path) {
    case AttentionPath::kDecode:
      attention_fwd_decode(args);
      return;
    case AttentionPath::kSm90a:
      attention_fwd_sm90(args);
      return;
    case AttentionPath::kMmaSync:
      attention_fwd_tensor_cores(args);
      return;
    case AttentionPath::kChunkedAten:
      attention_forward_chunked(args);  // ops/attention_composite.cpp
      return;
    default:
      TORCH_INTERNAL_ASSERT(false, "attention (CUDA): no forward kernel for the path ", attention_path_name(path));
  }
}

// Runs what choose_attention_fwd (attention_choice.h) chose; the arguments are copied only when
// the key ranges are drawn into the mask.
void attention_fwd_cuda(const AttentionFwdArgs& args) {
  const AttentionChoice choice = choose_attention_fwd(args);
  if (choice.draw_key_ranges) {
    run_forward(choice.path, with_key_ranges_drawn(args));
  } else {
    run_forward(choice.path, args);
  }
}

// ---- registration ----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                  double dropout_p, bool is_causal, std::optional<double> scale,
                                                  bool enable_gqa, int64_t q_offset, int64_t kv_offset, double softcap,
                                                  const std::optional<at::Tensor>& sinks,
                                                  const std::optional<at::Tensor>& key_ranges) {
  const OpDeviceGuard guard(query.device());
  attn::warn_if_hopper_kernels_missing(query);
  auto [out, lse, unused] =
      attention_impl(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset, kv_offset,
                     softcap, sinks, key_ranges, /*with_lse_lo=*/false, &attention_fwd_cuda);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, int64_t q_offset, int64_t kv_offset,
    double softcap, const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& key_ranges) {
  const OpDeviceGuard guard(query.device());
  attn::warn_if_hopper_kernels_missing(query);
  return attention_impl(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset, kv_offset,
                        softcap, sinks, key_ranges, /*with_lse_lo=*/true, &attention_fwd_cuda);
}

}  // namespace

const char* attention_fwd_mma_sync_rejects(const AttentionFwdArgs& a) {
  const at::ScalarType dtype = a.query.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return "dtype is not float16 or bfloat16";
  }
  if (a.query.size(3) != a.value.size(3)) {
    return "value's head dim differs from query's (D != Dv)";
  }
  if (!has_head_dim<kFwdHeadDims>(a.query.size(3))) {
    return "head dim not compiled for it (SAFEATTN_ATTN_HEAD_DIMS)";
  }
  if (!attn::rows_aligned_16(a.out)) {
    return "out's rows are not 16-byte aligned";
  }
  if (!attn::smem_fits(attn::fwd_smem_bytes(a.query.size(3)), a.query)) {
    return "its shared memory does not fit this GPU";
  }
  return nullptr;
}

}  // namespace safeattn::cuda

// The forward only; _attention_backward's CUDA kernel is registered in attention_bwd_kernel.cu.
TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  m.impl("attention", &safeattn::cuda::attention_cuda);
  m.impl("_attention_forward", &safeattn::cuda::attention_forward_cuda);
}
