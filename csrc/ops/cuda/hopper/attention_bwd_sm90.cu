// attention_bwd_sm90 (attention_bwd_sm90.h): which calls the Hopper backward can take, and its
// parameters. Host code only, compiled like the other .cu files; the kernels are in
// hopper/instances/attention_bwd_sm90_d<D>_<dtype>.cu, built for sm_90a when setup.py found
// CUTLASS.
#include "ops/cuda/hopper/attention_bwd_sm90.h"

#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "ops/cuda/hopper/bwd_params.h"

namespace safeattn::cuda {

const char* attention_bwd_sm90_rejects(const AttentionBwdArgs& a) {
  if (!attn::kWithSm90) {
    return attn::kNoSm90Kernels;
  }
  // Masks are read in place: a float one as a bias, but not with a softcap (its dS recovers the
  // capped score from p, which the bias has moved). The mask's gradient is stored per element
  // where each has one slot (GradMaskWrite::kAssign: [B, Hq, Q, KV]), added into one buffer of
  // the mask's shape over its broadcast batch and head dims (kSumBroadcast: [Bm, Hm, Q, KV]), or
  // written in the mask's own shape and dtype (kOwnShape: [B, Hq, Q, KV]); a mask broadcast over
  // queries or keys, or one with Hkv heads, has its gradient summed by the mma.sync kernels.
  // (AttentionBwdSumsBroadcastFn asks with kOwnShape or kSumBroadcast and no buffer yet.)
  if (attn::natural_units(a.mask) && a.softcap > 0.0) {
    return "a float mask with a softcap";
  }
  if (a.grad_mask_partial.defined() && a.grad_mask_write == GradMaskWrite::kAccumulate) {
    return "the mask's gradient is summed over broadcast dims or a kv group (GradMaskWrite::kAccumulate)";
  }
  if (a.grad_mask_write == GradMaskWrite::kOwnShape) {
    // Written in the mask's dtype.
    const at::ScalarType dtype = a.mask.scalar_type();
    if (dtype != a.query.scalar_type() && dtype != at::kFloat) {
      return "the mask's gradient in its own dtype, neither the inputs' nor float32";
    }
  }
  if (!a.grad_query.defined() || !a.grad_key.defined() || !a.grad_value.defined()) {
    return "not all of grad_query, grad_key and grad_value are wanted";
  }
  if (!has_head_dim<kBwdSm90HeadDims>(a.query.size(3))) {
    return "head dim not compiled for it (SAFEATTN_ATTN_HEAD_DIMS)";
  }
  if (a.key.size(1) > 65535 || a.query.size(0) > 65535) {
    return "batch or kv heads above 65535 (grid y and z)";
  }
  // grad_k and grad_v are written by TMA (16-byte aligned start and strides), grad_q through its
  // strides.
  if (!attn::rows_aligned_16(a.grad_query) || !attn::rows_aligned_16(a.grad_key) ||
      !attn::rows_aligned_16(a.grad_value)) {
    return "a gradient's rows are not 16-byte aligned";
  }
  return attn::sm90_inputs_rejects(a.query, a.key, a.value, a.scale);
}

bool attention_bwd_sm90_deterministic(const AttentionBwdArgs& a) {
  return a.grad_mask_write != GradMaskWrite::kSumBroadcast;
}

bool attention_bwd_sm90_dq_pass(const AttentionBwdArgs& a) {
  return hopper::bwd_dq_pass(static_cast<int>(a.query.size(3)), at::globalContext().deterministicAlgorithms());
}

void attention_bwd_sm90(const AttentionBwdArgs& a, const Sm90BwdRows& rows) {
  // TMA reads rows in place when they are 16-byte aligned; otherwise from an aligned copy.
  const at::Tensor query = attn::with_aligned_rows(a.query);
  const at::Tensor key = attn::with_aligned_rows(a.key);
  const at::Tensor value = attn::with_aligned_rows(a.value);
  const at::Tensor grad_out = attn::with_aligned_rows(a.grad_out);
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), head_dim = query.size(3);
  const bool dq_pass = attention_bwd_sm90_dq_pass(a);
  TORCH_INTERNAL_ASSERT(dq_pass ? !rows.dq_accum.defined()
                                : rows.dq_accum.size(2) == attention_bwd_sm90_row_pitch(q_len) &&
                                      rows.dq_accum.size(3) == head_dim && rows.dq_accum.is_contiguous());

  hopper::BwdSm90Params p;
  p.q = query.const_data_ptr();
  p.k = key.const_data_ptr();
  p.v = value.const_data_ptr();
  p.grad_out = grad_out.const_data_ptr();
  if (rows.grad_out_dirty.defined()) {
    p.grad_out_dirty = rows.grad_out_dirty.const_data_ptr<int>();
    p.grad_out_clean = rows.grad_out_clean.const_data_ptr();
  }
  p.row_shift = rows.row_shift.const_data_ptr<float>();
  p.row_lo = rows.row_lo.defined() ? rows.row_lo.const_data_ptr<float>() : nullptr;
  p.delta = rows.delta.const_data_ptr<float>();
  p.dq_accum = dq_pass ? nullptr : rows.dq_accum.data_ptr<float>();
  p.grad_q = a.grad_query.data_ptr();
  p.grad_k = a.grad_key.data_ptr();
  p.grad_v = a.grad_value.data_ptr();
  p.q_sb = query.stride(0), p.q_sh = query.stride(1), p.q_si = query.stride(2);
  p.k_sb = key.stride(0), p.k_sh = key.stride(1), p.k_si = key.stride(2);
  p.v_sb = value.stride(0), p.v_sh = value.stride(1), p.v_si = value.stride(2);
  p.do_sb = grad_out.stride(0), p.do_sh = grad_out.stride(1), p.do_si = grad_out.stride(2);
  p.dq_sb = a.grad_query.stride(0), p.dq_sh = a.grad_query.stride(1), p.dq_si = a.grad_query.stride(2);
  p.dk_sb = a.grad_key.stride(0), p.dk_sh = a.grad_key.stride(1), p.dk_si = a.grad_key.stride(2);
  p.dv_sb = a.grad_value.stride(0), p.dv_sh = a.grad_value.stride(1), p.dv_si = a.grad_value.stride(2);
  p.batch = static_cast<int>(batch);
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(key.size(1));
  p.q_len = static_cast<int>(q_len);
  p.kv_len = static_cast<int>(key.size(2));
  p.score = attn::score_rule(a.scale, a.softcap, /*natural=*/false);
  p.causal = a.is_causal;
  p.deterministic = at::globalContext().deterministicAlgorithms();
  // The entry point passed q_offset = causal_shift(...) (within [-q_len, kv_len]) and kv_offset 0.
  p.causal_shift = a.q_offset - a.kv_offset;
  p.resident_ctas = at::cuda::getDeviceProperties(query.get_device())->multiProcessorCount;
  // A mask (and the key ranges) is summarised per (query tile, key tile) first: fully masked
  // ones are skipped, and each column of tiles' last query tile not masked is where the dK/dV
  // kernel's walk up the column stops.
  at::Tensor summary, diagonals;
  attn::TileWalkBounds bounds;
  bounds.columns = true;
  // A mask whose gradient is wanted (a learnable bias, dense) is summarised by causality alone,
  // its values unread.
  const bool dense_bias = a.grad_mask_partial.defined();
  attn::set_mask_fields(p, a.mask, a.key_ranges, hopper::kBwdMaskTileRows,
                        hopper::bwd_key_tile(static_cast<int>(head_dim)), summary, diagonals, bounds, dense_bias);
  // The dQ pass walks a query tile's key tiles: its own summary (kDqTileRows rows), with each
  // row's first visible key tile (where its walk down stops).
  at::Tensor dq_summary, dq_diagonals;
  attn::TileWalkBounds dq_bounds;
  dq_bounds.rows = true;
  if (dq_pass && summary.defined()) {
    hopper::BwdSm90Params dq_fields = p;
    attn::set_mask_fields(dq_fields, a.mask, a.key_ranges, hopper::kDqTileRows,
                          hopper::dq_key_tile(static_cast<int>(head_dim)), dq_summary, dq_diagonals, dq_bounds,
                          dense_bias);
    p.dq_mask_tiles = dq_fields.mask_tiles;
  }
  p.batch_inner = p.mask.is_bias() && p.mask.stride_b == 0 && batch > 1;
  if (a.grad_mask_partial.defined() && a.grad_mask_write != GradMaskWrite::kOwnShape) {
    // [B, Hq, Q, KV] float32 (kAssign): the kernel writes the visited tiles' elements, the
    // skipped ones stay 0. [Bm, Hm, Q, KV] zeroed by the caller (kSumBroadcast, Bm in {1, B}, Hm
    // in {1, Hq}): it adds every (batch, query head)'s elements into it, a dim of size 1 read
    // with stride 0. With GQA, Hm = 1 takes all Hq query heads, whichever kv head's CTA runs them.
    const at::Tensor& partial = a.grad_mask_partial;
    const bool adds = a.grad_mask_write == GradMaskWrite::kSumBroadcast;
    const int64_t partial_batch = partial.size(0), partial_heads = partial.size(1);
    TORCH_INTERNAL_ASSERT(a.grad_mask_write != GradMaskWrite::kAccumulate && partial.is_contiguous() &&
                          partial.scalar_type() == at::kFloat && partial.size(2) == q_len &&
                          partial.size(3) == key.size(2));
    TORCH_INTERNAL_ASSERT(adds ? (partial_batch == 1 || partial_batch == batch) &&
                                     (partial_heads == 1 || partial_heads == heads)
                               : partial_batch == batch && partial_heads == heads);
    if (!adds) {
      partial.zero_();
    }
    p.grad_mask = partial.data_ptr<float>();
    p.grad_mask_sb = partial_batch == 1 ? 0 : partial_heads * q_len;  // rows of kv_len
    p.grad_mask_sh = partial_heads == 1 ? 0 : q_len;
    p.grad_mask_adds = adds;
  }
  if (a.grad_mask_write == GradMaskWrite::kOwnShape && a.grad_mask_partial.defined()) {
    // The gradient itself, [B, Hq, Q, KV] in the mask's dtype, zeroed by the caller: each element
    // stored once, float32 as it is, a 16-bit one rounded.
    const at::Tensor& grad = a.grad_mask_partial;
    TORCH_INTERNAL_ASSERT(grad.is_contiguous() && grad.size(0) == batch && grad.size(1) == heads &&
                          grad.size(2) == q_len && grad.size(3) == key.size(2));
    if (grad.scalar_type() == at::kFloat) {
      p.grad_mask = grad.data_ptr<float>();
    } else {
      p.grad_mask_16 = grad.data_ptr();
    }
    p.grad_mask_sb = heads * q_len;  // rows of kv_len
    p.grad_mask_sh = q_len;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  attn::with_16bit_type(query, [&](auto type) {
    attn::launch_for_head_dim<kBwdSm90HeadDims>(head_dim, "attention backward (CUDA, sm_90a)", [&](auto dim) {
      return hopper::launch_attention_bwd_sm90<decltype(type), decltype(dim)::value>(p, stream);
    });
  });
}

}  // namespace safeattn::cuda
