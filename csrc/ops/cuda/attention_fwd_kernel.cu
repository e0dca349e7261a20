// CUDA forward of safeattn::attention and its CUDA registration.
//
// attention_fwd_cuda runs the path choose_attention_fwd (attention_choice.h) picks, in its order:
//   - the split-KV decode kernels (attention_decode_kernel.cu) for a few query rows per kv head
//     over a long cache;
//   - on an H100/H200, the sm_90a TMA + wgmma kernels (attention_fwd_sm90.h) for what they cover;
//   - the tensor-core kernel (attention_fwd.cuh) for float16 / bfloat16 inputs with D == Dv and
//     a head dim that has a generated instantiation in this build (SAFEATTN_ATTN_FWD_D<D>);
//     a mask is first summarised per tile (summarize_mask_tiles; key ranges with a bool mask
//     or none: summarize_key_ranges) so that whole tiles are skipped or read without the mask;
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
#include "ops/cuda/head_dim_switch.h"
#include "ops/cuda/hopper/attention_fwd_sm90.h"

namespace safeattn::cuda {
namespace {

using attn::FwdParams;

// ---- tensor-core path ------------------------------------------------------------------------

void attention_fwd_tensor_cores(const AttentionFwdArgs& a) {
  // q / k / v are read in place when their rows are aligned, else from an aligned copy.
  const at::Tensor query = attn::with_aligned_rows(a.query);
  const at::Tensor key = attn::with_aligned_rows(a.key);
  const at::Tensor value = attn::with_aligned_rows(a.value);
  const int64_t head_dim = query.size(3);
  const attn::SmemLimits smem = attn::smem_limits(query);
  const bool large = attn::fwd_large_tiles(head_dim, smem.per_block, smem.per_sm, smem.reserved_per_block);
  int block_q = 0, block_kv = 0;
  attn::fwd_tile_sizes(head_dim, large, block_q, block_kv);

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
  at::Tensor summary, diagonals;  // kept alive until the launch is queued (stream-ordered allocator)
  attn::TileWalkBounds bounds;    // each row of tiles' first key tile not masked: where the walk starts
  bounds.rows = true;
  if (a.mask.defined()) {
    p.mask = attn::make_mask_view(a.mask);
  }
  if (a.key_ranges.defined()) {
    // Beside no mask or a bool one (choose_attention_fwd): one summary of both; the causal rule
    // masks the tiles no row sees by causality, as the kernel applies it too.
    summary =
        attn::summarize_key_ranges(a.key_ranges, p.kv_len, a.mask, block_q, block_kv, &diagonals, &bounds, p.causal);
    p.ranges = attn::make_key_range_view(a.key_ranges);
  } else if (a.mask.defined()) {
    // With diagonals: a bool mask's tiles that are one diagonal (a causal mask's, with padding
    // or not) are tested by a compare, without reading the mask. A learnable bias (dense) is not
    // read for it: every tile mixed.
    summary = attn::summarize_mask_tiles(a.mask, block_q, block_kv, &diagonals, &bounds, {},
                                         !(a.mask_requires_grad && a.mask.is_floating_point()));
  }
  if (summary.defined()) {
    p.tiles = attn::make_tile_summary_view(summary, block_q, block_kv, diagonals, bounds);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  attn::with_16bit_type(query, [&](auto type) {
    attn::launch_for_head_dim<kFwdHeadDims>(head_dim, "attention (CUDA, tensor cores)", [&](auto dim) {
      attn::launch_attention_fwd<decltype(type), decltype(dim)::value>(p, large, stream);
    });
  });
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

// ---- registration ----------------------------------------------------------------------------

// What attention's and _attention_forward's CUDA kernels open first (attention_kernel,
// ops/attention.h): the device guard, then the warning on an H100/H200 that this build lacks the
// sm_90a kernels.
struct ForwardEntry {
  OpDeviceGuard guard;
  explicit ForwardEntry(const at::Tensor& query) : guard(query.device()) {
    attn::warn_if_hopper_kernels_missing(query);
  }
};

constexpr AttentionFwdFn kForward = &run_chosen<AttentionFwdArgs, &choose_attention_fwd, &run_forward>;

}  // namespace

const char* attention_fwd_mma_sync_rejects(const AttentionFwdArgs& a) {
  if (const char* reason =
          attn::mma_sync_inputs_rejects(a.query, a.value, has_head_dim<kFwdHeadDims>(a.query.size(3)))) {
    return reason;
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
  using safeattn::attention_kernel, safeattn::cuda::ForwardEntry, safeattn::cuda::kForward;
  m.impl("attention", &attention_kernel<ForwardEntry, kForward, /*kWithLseLo=*/false>);
  m.impl("_attention_forward", &attention_kernel<ForwardEntry, kForward, /*kWithLseLo=*/true>);
}
