// attention_fwd_sm90 (attention_fwd_sm90.h): which calls the Hopper forward can take, and its
// parameters. Host code only, compiled like the other .cu files; the kernels are in
// hopper/instances/attention_fwd_sm90_d<D>_<dtype>.cu, built for sm_90a when setup.py found
// CUTLASS.
#include "ops/cuda/hopper/attention_fwd_sm90.h"

#include <algorithm>
#include <cstdint>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "ops/cuda/hopper/fwd_params.h"

namespace safeattn::cuda {

const char* attention_fwd_sm90_rejects(const AttentionFwdArgs& a) {
  if (!attn::kWithSm90) {
    return attn::kNoSm90Kernels;
  }
  // Masks are read in place, bool ones and float ones (a bias) alike.
  if (!has_head_dim<kFwdSm90HeadDims>(a.query.size(3))) {
    return "head dim not compiled for it (SAFEATTN_ATTN_HEAD_DIMS)";
  }
  // out is written with 4-byte stores through its strides.
  if (!attn::rows_aligned_16(a.out)) {
    return "out's rows are not 16-byte aligned";
  }
  return attn::sm90_inputs_rejects(a.query, a.key, a.value, a.scale);
}

void attention_fwd_sm90(const AttentionFwdArgs& a) {
  // TMA reads rows in place when they are 16-byte aligned; otherwise from an aligned copy.
  const at::Tensor query = attn::with_aligned_rows(a.query);
  const at::Tensor key = attn::with_aligned_rows(a.key);
  const at::Tensor value = attn::with_aligned_rows(a.value);
  hopper::FwdSm90Params p;
  attn::set_forward_tensors(p, query, key, value, a);
  p.batch = static_cast<int>(query.size(0));
  p.heads = static_cast<int>(query.size(1));
  p.kv_heads = static_cast<int>(key.size(1));
  p.q_len = static_cast<int>(query.size(2));
  p.kv_len = static_cast<int>(key.size(2));
  p.score = attn::score_rule(a.scale, a.softcap, /*natural=*/false);
  p.sinks = a.sinks.defined() ? a.sinks.const_data_ptr<float>() : nullptr;
  p.causal = a.is_causal;
  // The entry point passed q_offset = causal_shift(...) (within [-q_len, kv_len]) and kv_offset 0.
  p.causal_shift = a.q_offset - a.kv_offset;
  const cudaDeviceProp* device = at::cuda::getDeviceProperties(query.get_device());
  p.max_ctas = device->multiProcessorCount;
  p.l2_bytes = device->l2CacheSize;
  // A mask (and the key ranges) is summarised per tile first (kernels on the stream): the kernel
  // skips the fully masked key tiles, tests the diagonal ones by a compare and reads the mask
  // (computes the ranges) only in the mixed ones.
  // Each row of tiles' lowest key tile not masked: where the walk down the row stops.
  at::Tensor summary, diagonals;
  attn::TileWalkBounds bounds;
  bounds.rows = true;
  // A learnable bias (dense) is summarised by causality alone, its values unread.
  attn::set_mask_fields(p, a.mask, a.key_ranges, hopper::kFwdMaskTileRows,
                        hopper::fwd_key_tile(static_cast<int>(query.size(3))), summary, diagonals, bounds,
                        a.mask_requires_grad);
  // Causal or masked tiles differ in length: the CTAs take them from a counter (zeroed on the
  // stream, kept alive until the launch is queued; the caching allocator orders its reuse after
  // the kernel).
  at::Tensor tile_counter;
  if (a.is_causal || summary.defined()) {
    tile_counter = at::zeros({1}, query.options().dtype(at::kInt));
    p.tile_counter = tile_counter.data_ptr<int>();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  attn::with_16bit_type(query, [&](auto type) {
    attn::launch_for_head_dim<kFwdSm90HeadDims>(query.size(3), "attention (CUDA, sm_90a)", [&](auto dim) {
      return hopper::launch_attention_fwd_sm90<decltype(type), decltype(dim)::value>(p, stream);
    });
  });
}

}  // namespace safeattn::cuda
