// CUDA backward of safeattn::attention (the private op _attention_backward).
//
// attention_backward_impl (ops/attention.cpp) validates, allocates the gradients and computes
// grad_sinks; attention_bwd_cuda below computes grad_query, grad_key, grad_value and the mask
// gradient's partial sums:
//   - on an H100/H200, with atomics allowed (use_atomic_dq), the sm_90a TMA + wgmma kernels
//     (attention_bwd_sm90.h) after the rows pre-pass, for what they cover;
//   - bf16 / fp16 with D == Dv and a head dim that has an instantiation (attention_bwd.cuh,
//     attention_bwd_d<D>_<dtype>.cu): the rows pre-pass and the mask's tile summaries here,
//     then the dK/dV and dQ tensor-core kernels. A broadcast mask gets its gradient through a
//     [B, Hq, Q, KV] float32 buffer (batch chunks of bounded size) reduced by at::sum,
//     deterministically. Without a mask gradient and with deterministic algorithms off, the
//     dK/dV kernel adds dQ into a float32 buffer with atomics instead (use_atomic_dq) and the
//     dQ kernel does not run.
//   - everything else (float32, float64 for gradcheck, other head dims, D != Dv): the
//     device-independent ATen backward attention_backward_chunked (ops/attention_composite.h),
//     in float32 / float64 over chunks of queries.
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "ops/attention.h"
#include "ops/attention_composite.h"
#include "ops/cuda/attention_bwd.cuh"
#include "ops/cuda/attention_bwd_sm90.h"
#include "ops/cuda/head_dim_switch.h"

namespace safeattn::cuda {
namespace {

using attn::BwdParams;
using attn::kLog2e;

// The mask-gradient staging buffer of one batch chunk stays under this many bytes (at least
// one batch).
constexpr int64_t kMaskGradChunkBytes = int64_t(512) << 20;

constexpr int kRowsWarps = 8;

// Per query row (b, h, i), one warp: delta = sum_d dO * O - dlse, and the row's shift and lo
// (BwdParams::row_shift): in log2 units shift = (lse + lse_lo) log2(e); in natural units (a
// floating mask) shift = lse and lo = lse_lo log2(e). A row whose lse is -inf (no visible key)
// gets shift +inf and lo 0: every p becomes exactly 0. NaN stays NaN.
template <typename scalar_t>
__global__ void __launch_bounds__(kRowsWarps * 32)
    attention_bwd_rows_kernel(const scalar_t* __restrict__ grad_out, int64_t go_sb, int64_t go_sh, int64_t go_ss,
                              int64_t go_sd, const scalar_t* __restrict__ out, int64_t o_sb, int64_t o_sh, int64_t o_ss,
                              int64_t o_sd, const float* __restrict__ lse, const float* __restrict__ lse_lo,
                              const float* __restrict__ grad_lse, bool natural, float* __restrict__ delta,
                              float* __restrict__ row_shift, float* __restrict__ row_lo, int64_t hq, int64_t q_len,
                              int64_t dv, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) {
    return;
  }
  const int64_t i = row % q_len;
  const int64_t h = (row / q_len) % hq;
  const int64_t b = row / (q_len * hq);
  const scalar_t* go = grad_out + b * go_sb + h * go_sh + i * go_ss;
  const scalar_t* o = out + b * o_sb + h * o_sh + i * o_ss;
  float sum = 0.0f;
  for (int64_t d = lane; d < dv; d += 32) {
    sum += attn::to_float(go[d * go_sd]) * attn::to_float(o[d * o_sd]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  if (lane == 0) {
    delta[row] = grad_lse != nullptr ? sum - grad_lse[row] : sum;
    const float l = lse[row];
    const bool empty = l == -INFINITY;
    if (natural) {
      row_shift[row] = empty ? INFINITY : l;
      row_lo[row] = empty ? 0.0f : lse_lo[row] * kLog2e;
    } else {
      row_shift[row] = empty ? INFINITY : fmaf(l, kLog2e, lse_lo[row] * kLog2e);
    }
  }
}

template <typename T>
void launch_for_head_dim(int64_t head_dim, const BwdParams& params, const attn::BwdLaunch& launch,
                         cudaStream_t stream) {
  const bool launched = with_head_dim<kBwdHeadDims>(
      head_dim, [&](auto dim) { attn::launch_attention_bwd<T, decltype(dim)::value>(params, launch, stream); });
  TORCH_INTERNAL_ASSERT(launched, "attention backward (CUDA): no tensor-core kernel for head_dim ", head_dim);
}

bool tensor_core_supported(const AttentionBwdArgs& a) {
  const at::ScalarType t = a.query.scalar_type();
  if (t != at::kHalf && t != at::kBFloat16) {
    return false;
  }
  const int64_t head_dim = a.query.size(3);
  if (a.value.size(3) != head_dim || !has_head_dim<kBwdHeadDims>(head_dim)) {
    return false;
  }
  if (a.mask.defined() && a.mask.scalar_type() == at::kDouble) {
    return false;
  }
  // Grid limits (y and z are 16-bit).
  return a.query.size(0) <= 65535 && a.query.size(1) <= 65535 && a.key.size(1) <= 65535;
}

// The per-chunk [bc, Hq, Q, KV] dS reduced to grad_mask_partial's [bc, Hm, Qm, KVm].
at::Tensor reduce_mask_grad(const at::Tensor& full, const at::Tensor& partial, int64_t hkv) {
  at::Tensor g = full;
  const int64_t bc = g.size(0), hq = g.size(1), q_len = g.size(2), kv_len = g.size(3);
  if (partial.size(1) != hq) {  // Hm = Hkv: the query heads of one group summed
    g = g.view({bc, hkv, hq / hkv, q_len, kv_len}).sum(2);
  }
  if (partial.size(2) == 1 && q_len != 1) {
    g = g.sum(2, /*keepdim=*/true);
  }
  if (partial.size(3) == 1 && kv_len != 1) {
    g = g.sum(3, /*keepdim=*/true);
  }
  return g;
}

// The atomic dQ mode (attention_bwd.cuh): 5 products instead of 7, not bit-reproducible. Off
// under torch.use_deterministic_algorithms(True) and when the mask gradient is needed (the dQ
// kernel writes it).
bool use_atomic_dq(const AttentionBwdArgs& a) {
  return !at::globalContext().deterministicAlgorithms() && !a.grad_mask_partial.defined() && a.grad_query.defined();
}

template <typename T>
void attention_bwd_tensor_core(const AttentionBwdArgs& a) {
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2), head_dim = a.query.size(3);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor query = attn::with_aligned_rows(a.query);
  const at::Tensor key = attn::with_aligned_rows(a.key);
  const at::Tensor value = attn::with_aligned_rows(a.value);
  const at::Tensor grad_out = attn::with_aligned_rows(a.grad_out);
  const at::TensorOptions f32 = a.query.options().dtype(at::kFloat);

  // The rows pre-pass: Delta and each row's shift and lo, [B, Hq, Q] float32.
  const bool natural = attn::natural_units(a.mask);
  const at::Tensor lse = a.lse.to(at::kFloat).contiguous();
  const at::Tensor lse_lo = a.lse_lo.to(at::kFloat).contiguous();
  const at::Tensor grad_lse = a.grad_lse.defined() ? a.grad_lse.to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor delta = at::empty({batch, hq, q_len}, f32);
  const at::Tensor row_shift = at::empty({batch, hq, q_len}, f32);
  const at::Tensor row_lo = natural ? at::empty({batch, hq, q_len}, f32) : at::Tensor();
  const int64_t rows = batch * hq * q_len;
  {
    const auto& go = a.grad_out;
    const auto& o = a.out;
    const int64_t blocks = (rows + kRowsWarps - 1) / kRowsWarps;
    attention_bwd_rows_kernel<T><<<static_cast<unsigned>(blocks), kRowsWarps * 32, 0, stream>>>(
        static_cast<const T*>(go.const_data_ptr()), go.stride(0), go.stride(1), go.stride(2), go.stride(3),
        static_cast<const T*>(o.const_data_ptr()), o.stride(0), o.stride(1), o.stride(2), o.stride(3),
        lse.const_data_ptr<float>(), lse_lo.const_data_ptr<float>(),
        grad_lse.defined() ? grad_lse.const_data_ptr<float>() : nullptr, natural, delta.data_ptr<float>(),
        row_shift.data_ptr<float>(), natural ? row_lo.data_ptr<float>() : nullptr, hq, q_len, a.value.size(3), rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const bool atomic_dq = use_atomic_dq(a);
  // Hopper: the TMA + wgmma kernels where they cover the call. Their dQ is summed with atomics,
  // so only where the atomic mode is allowed (deterministic algorithms keep the dQ kernel).
  if (atomic_dq && attention_bwd_sm90(a, delta, row_shift)) {
    return;
  }

  BwdParams p{};
  p.query = query.const_data_ptr();
  p.key = key.const_data_ptr();
  p.value = value.const_data_ptr();
  p.grad_out = grad_out.const_data_ptr();
  p.q_stride_b = query.stride(0), p.q_stride_h = query.stride(1), p.q_stride_s = query.stride(2);
  p.k_stride_b = key.stride(0), p.k_stride_h = key.stride(1), p.k_stride_s = key.stride(2);
  p.v_stride_b = value.stride(0), p.v_stride_h = value.stride(1), p.v_stride_s = value.stride(2);
  p.do_stride_b = grad_out.stride(0), p.do_stride_h = grad_out.stride(1), p.do_stride_s = grad_out.stride(2);
  p.natural = natural;
  p.row_shift = row_shift.const_data_ptr<float>();
  p.row_lo = natural ? row_lo.const_data_ptr<float>() : nullptr;
  p.delta = delta.const_data_ptr<float>();
  p.grad_query = a.grad_query.data_ptr();
  p.grad_key = a.grad_key.data_ptr();
  p.grad_value = a.grad_value.data_ptr();
  p.grad_mask = nullptr;
  p.batch_begin = 0;
  p.mask = attn::make_mask_view(a.mask);
  at::Tensor summary_dkdv, summary_dq;  // kept alive until the launches are queued (stream-ordered)
  if (a.mask.defined()) {
    attn::BwdTileSizes tiles;
    TORCH_INTERNAL_ASSERT(attn::bwd_tile_sizes(head_dim, tiles), "attention backward (CUDA): no tile sizes for ",
                          head_dim);
    summary_dkdv = attn::summarize_mask_tiles(a.mask, tiles.dkdv_q, tiles.dkdv_kv);
    p.tiles_dkdv = attn::make_tile_summary_view(summary_dkdv, tiles.dkdv_q, tiles.dkdv_kv);
    // The atomic mode runs no dQ kernel: its summary is not needed.
    if (!atomic_dq) {
      summary_dq = tiles.dq_q == tiles.dkdv_q && tiles.dq_kv == tiles.dkdv_kv
                       ? summary_dkdv
                       : attn::summarize_mask_tiles(a.mask, tiles.dq_q, tiles.dq_kv);
      p.tiles_dq = attn::make_tile_summary_view(summary_dq, tiles.dq_q, tiles.dq_kv);
    }
  }
  p.causal.enabled = a.is_causal;
  p.causal.shift = a.q_offset - a.kv_offset;
  p.transform.scale = static_cast<float>(a.scale);
  p.transform.softcap = static_cast<float>(a.softcap);
  p.hq = hq;
  p.hkv = hkv;
  p.q_len = q_len;
  p.kv_len = kv_len;

  const at::Tensor& partial = a.grad_mask_partial;
  // dkdv, dq: which kernels a launch runs; the dK/dV kernel covers every batch, the dQ kernel
  // `count` batches from p.batch_begin.
  auto launch = [&](bool dkdv, bool dq, int64_t count) {
    launch_for_head_dim<T>(head_dim, p, attn::BwdLaunch{batch, count, dkdv, dq}, stream);
  };
  if (atomic_dq) {
    // dQ summed over the key tiles in float32 (zeroed on the stream: rows no step reaches, such
    // as rows with no visible key, stay exactly 0), then rounded once to the input dtype.
    const at::Tensor dq_accum = at::zeros({batch, hq, q_len, head_dim}, f32);
    p.dq_accum = dq_accum.data_ptr<float>();
    launch(/*dkdv=*/true, /*dq=*/false, batch);
    a.grad_query.copy_(dq_accum);
    return;
  }
  if (!partial.defined() || a.grad_mask_assign) {
    // grad_mask_assign: the partial is [B, Hq, Q, KV] float32 contiguous, written in full.
    p.grad_mask = partial.defined() ? partial.data_ptr<float>() : nullptr;
    launch(/*dkdv=*/true, /*dq=*/true, batch);
    return;
  }
  // A broadcast mask: dS of a batch chunk into a staging buffer, then summed to the partial's
  // shape (fixed-order reductions: deterministic).
  launch(/*dkdv=*/true, /*dq=*/false, batch);
  const int64_t per_batch = hq * q_len * kv_len * static_cast<int64_t>(sizeof(float));
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(batch, kMaskGradChunkBytes / per_batch));
  const at::Tensor staging = at::empty({chunk, hq, q_len, kv_len}, f32);
  for (int64_t b0 = 0; b0 < batch; b0 += chunk) {
    const int64_t count = std::min(chunk, batch - b0);
    const at::Tensor full = staging.narrow(0, 0, count);
    p.grad_mask = full.data_ptr<float>();
    p.batch_begin = b0;
    launch(/*dkdv=*/false, /*dq=*/true, count);
    partial.narrow(0, b0, count).copy_(reduce_mask_grad(full, partial, hkv));
  }
}

void attention_bwd_cuda(const AttentionBwdArgs& args) {
  if (!tensor_core_supported(args)) {
    attention_backward_chunked(args);
    return;
  }
  if (args.query.scalar_type() == at::kBFloat16) {
    attention_bwd_tensor_core<__nv_bfloat16>(args);
  } else {
    attention_bwd_tensor_core<__half>(args);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale, int64_t q_offset,
    int64_t kv_offset, double softcap, const std::optional<at::Tensor>& sinks, bool grad_mask_needed,
    const std::optional<at::Tensor>& lse_lo) {
  const c10::cuda::CUDAGuard guard(query.device());
  return attention_backward_impl(grad_out, grad_lse, query, key, value, out, lse, attn_mask, is_causal, scale, q_offset,
                                 kv_offset, softcap, sinks, grad_mask_needed, lse_lo, &attention_bwd_cuda);
}

}  // namespace
}  // namespace safeattn::cuda

TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  m.impl("_attention_backward", &safeattn::cuda::attention_backward_cuda);
}
