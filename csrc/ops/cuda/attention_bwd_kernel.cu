// CUDA backward of safeattn::attention (the private op _attention_backward).
//
// attention_backward_impl (ops/attention.cpp) validates, allocates the gradients and computes
// grad_sinks; attention_bwd_cuda below computes grad_query, grad_key, grad_value and the mask
// gradient's partial sums, on the path choose_attention_bwd (attention_choice.h) picks:
//   - on an H100/H200, with atomics allowed or at a head dim whose dQ has a pass of its own,
//     the sm_90a TMA + wgmma kernels (attention_bwd_sm90.h) after the rows pre-pass, for what
//     they cover: the pre-pass writes their padded row arrays, zeroes dq_accum (where there is
//     one) and reads grad_out as given (no cleaned copy of it unless an empty row holds a
//     non-finite value: Sm90BwdRows);
//   - the paths below read grad_out_without_empty_rows (ops/attention.h);
//   - bf16 / fp16 with D == Dv and a head dim that has an instantiation (attention_bwd.cuh,
//     attention_bwd_d<D>_<dtype>.cu): the rows pre-pass and the mask's (and key ranges') tile summaries here,
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
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "common/cuda_device.h"
#include "ops/attention.h"
#include "ops/attention_composite.h"
#include "ops/cuda/attention_choice.h"
#include "ops/cuda/generic/attention_bwd.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "ops/cuda/hopper/attention_bwd_sm90.h"

namespace safeattn::cuda {
namespace {

using attn::BwdParams;
using attn::kLog2e;

// The mask-gradient staging buffer of one batch chunk stays under this many bytes (at least
// one batch).
constexpr int64_t kMaskGradChunkBytes = int64_t(512) << 20;

// The rows pre-pass: kRowsLanes lanes per query row, each reading 8 elements of dO and O at a
// time (16 bytes when the rows allow it).
constexpr int kRowsLanes = 8;
constexpr int kRowsThreads = 256;

struct RowsArgs {
  const void* grad_out = nullptr;  // [B, Hq, Q, Dv], as given (empty rows not cleaned)
  int64_t go_sb = 0, go_sh = 0, go_ss = 0, go_sd = 0;
  const void* out = nullptr;  // [B, Hq, Q, Dv]
  int64_t o_sb = 0, o_sh = 0, o_ss = 0, o_sd = 0;
  bool vec16 = false;               // both: unit inner stride, rows 16-byte aligned, Dv % 8 == 0
  const float* lse = nullptr;       // [B, Hq, Q] contiguous
  const float* lse_lo = nullptr;    // [B, Hq, Q] contiguous
  const float* grad_lse = nullptr;  // [B, Hq, Q] contiguous, or null
  bool natural = false;             // row_shift in natural units (then row_lo too)
  float* delta = nullptr;           // [B, Hq, pitch]
  float* row_shift = nullptr;       // [B, Hq, pitch]
  float* row_lo = nullptr;          // [B, Hq, pitch] when natural, else null
  float* dq_zero = nullptr;         // null, or [B, Hq, pitch, dq_cols] float32: set to 0
  int* grad_out_dirty = nullptr;    // null, or set to 1 when an empty row's dO is not finite
  int64_t hq = 0, q_len = 0, pitch = 0, dv = 0, dq_cols = 0, rows = 0;  // rows = B * Hq * pitch
};

// Per query row (b, h, i), kRowsLanes lanes: delta = sum_d dO * O - dlse, and the row's shift
// and lo (BwdParams::row_shift): in log2 units shift = (lse + lse_lo) log2(e); in natural units
// (a floating mask) shift = lse and lo = lse_lo log2(e). A row whose lse is -inf (no visible
// key) gets shift +inf, lo 0 and delta 0, whatever its dO holds: every p and dS becomes exactly
// 0 (grad_out_dirty records a non-finite dO there, which the products would still spread). Rows
// i in [q_len, pitch) are padding: shift +inf, delta 0. NaN elsewhere stays NaN.
template <typename scalar_t>
__global__ void __launch_bounds__(kRowsThreads) attention_bwd_rows_kernel(const RowsArgs a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowsThreads / kRowsLanes) + threadIdx.x / kRowsLanes;
  const int lane = threadIdx.x % kRowsLanes;
  if (row >= a.rows) {
    return;  // the whole group: the shuffles below stay within the group's lanes
  }
  const unsigned group_mask = ((1u << kRowsLanes) - 1) << (threadIdx.x % 32 / kRowsLanes * kRowsLanes);
  const int64_t bh = row / a.pitch, i = row % a.pitch;
  if (a.dq_zero != nullptr) {
    float4* dq = reinterpret_cast<float4*>(a.dq_zero + row * a.dq_cols);
    for (int64_t c = lane; c < a.dq_cols / 4; c += kRowsLanes) {
      dq[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  if (i >= a.q_len) {
    if (lane == 0) {
      a.delta[row] = 0.0f;
      a.row_shift[row] = INFINITY;
      if (a.row_lo != nullptr) {
        a.row_lo[row] = 0.0f;
      }
    }
    return;
  }
  const int64_t r = bh * a.q_len + i;  // lse's index
  const int64_t h = bh % a.hq, b = bh / a.hq;
  const float l = a.lse[r];
  const bool empty = l == -INFINITY;
  const scalar_t* go = static_cast<const scalar_t*>(a.grad_out) + b * a.go_sb + h * a.go_sh + i * a.go_ss;
  const scalar_t* o = static_cast<const scalar_t*>(a.out) + b * a.o_sb + h * a.o_sh + i * a.o_ss;
  float sum = 0.0f;
  bool finite = true;
  if (a.vec16) {
    for (int64_t d = 8 * lane; d < a.dv; d += 8 * kRowsLanes) {
      const uint4 gv = *reinterpret_cast<const uint4*>(go + d);
      const uint4 ov = *reinterpret_cast<const uint4*>(o + d);
      const scalar_t* g8 = reinterpret_cast<const scalar_t*>(&gv);
      const scalar_t* o8 = reinterpret_cast<const scalar_t*>(&ov);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float x = attn::to_float(g8[k]);
        sum = fmaf(x, attn::to_float(o8[k]), sum);
        finite = finite && isfinite(x);
      }
    }
  } else {
    for (int64_t d = lane; d < a.dv; d += kRowsLanes) {
      const float x = attn::to_float(go[d * a.go_sd]);
      sum = fmaf(x, attn::to_float(o[d * a.o_sd]), sum);
      finite = finite && isfinite(x);
    }
  }
#pragma unroll
  for (int offset = kRowsLanes / 2; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(group_mask, sum, offset);
  }
  finite = __all_sync(group_mask, finite);
  if (lane == 0) {
    a.delta[row] = empty ? 0.0f : (a.grad_lse != nullptr ? sum - a.grad_lse[r] : sum);
    if (a.natural) {
      a.row_shift[row] = empty ? INFINITY : l;
      a.row_lo[row] = empty ? 0.0f : a.lse_lo[r] * kLog2e;
    } else {
      a.row_shift[row] = empty ? INFINITY : fmaf(l, kLog2e, a.lse_lo[r] * kLog2e);
    }
    if (empty && !finite && a.grad_out_dirty != nullptr) {
      *a.grad_out_dirty = 1;
    }
  }
}

// grad_out with its empty rows (lse -inf) zeroed, into a contiguous copy; only when the rows
// pre-pass found a non-finite value in one (*dirty), else every block returns at once.
template <typename scalar_t>
__global__ void __launch_bounds__(256)
    attention_bwd_clean_grad_out_kernel(const int* __restrict__ dirty, const scalar_t* __restrict__ grad_out,
                                        int64_t sb, int64_t sh, int64_t ss, int64_t sd, const float* __restrict__ lse,
                                        scalar_t* __restrict__ clean, int64_t hq, int64_t q_len, int64_t dv,
                                        int64_t elements) {
  if (*dirty == 0) {
    return;
  }
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < elements; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = e % dv, r = e / dv;  // r: the row (b, h, i) in [B, Hq, Q] order
    const int64_t i = r % q_len, h = r / q_len % hq, b = r / q_len / hq;
    // 0 as raw bits (+0.0 in both 16-bit formats: no conversion needed).
    const scalar_t x = grad_out[b * sb + h * sh + i * ss + d * sd];
    const uint16_t bits = lse[r] == -INFINITY ? uint16_t{0} : *reinterpret_cast<const uint16_t*>(&x);
    *reinterpret_cast<uint16_t*>(clean + e) = bits;
  }
}

// The rows pre-pass over [B, Hq, pitch] rows of args' grad_out, out, lse, lse_lo and grad_lse;
// `a` holds the outputs and the pitch. Returns lse as contiguous float32.
template <typename T>
at::Tensor launch_rows(const AttentionBwdArgs& args, RowsArgs a, cudaStream_t stream) {
  const at::Tensor &grad_out = args.grad_out, &out = args.out;
  const at::Tensor lse = args.lse.to(at::kFloat).contiguous();
  const at::Tensor lse_lo = args.lse_lo.to(at::kFloat).contiguous();
  const at::Tensor grad_lse = args.grad_lse.defined() ? args.grad_lse.to(at::kFloat).contiguous() : at::Tensor();
  a.lse = lse.const_data_ptr<float>();
  a.lse_lo = lse_lo.const_data_ptr<float>();
  a.grad_lse = grad_lse.defined() ? grad_lse.const_data_ptr<float>() : nullptr;
  a.hq = out.size(1), a.q_len = out.size(2), a.rows = out.size(0) * a.hq * a.pitch;
  a.grad_out = grad_out.const_data_ptr();
  a.go_sb = grad_out.stride(0), a.go_sh = grad_out.stride(1), a.go_ss = grad_out.stride(2);
  a.go_sd = grad_out.stride(3);
  a.out = out.const_data_ptr();
  a.o_sb = out.stride(0), a.o_sh = out.stride(1), a.o_ss = out.stride(2), a.o_sd = out.stride(3);
  a.dv = out.size(3);
  a.vec16 = a.dv % 8 == 0 && attn::rows_aligned_16(grad_out) && attn::rows_aligned_16(out);
  const int64_t per_block = kRowsThreads / kRowsLanes;
  attention_bwd_rows_kernel<T>
      <<<static_cast<unsigned>((a.rows + per_block - 1) / per_block), kRowsThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return lse;
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

// The Hopper backward (attention_bwd_sm90.h) after its rows pre-pass: rows padded, dq_accum
// zeroed, and grad_out read as given (Sm90BwdRows: how an empty row's dO is kept out).
template <typename T>
void attention_bwd_hopper(const AttentionBwdArgs& a) {
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t head_dim = a.query.size(3);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::TensorOptions f32 = a.query.options().dtype(at::kFloat);
  const int64_t pitch = attention_bwd_sm90_row_pitch(q_len);
  Sm90BwdRows rows;
  // Written in full by the rows pre-pass (and the clean copy by its kernel whenever it is read):
  // no fill under deterministic algorithms.
  rows.delta = empty_written_in_full({batch, hq, pitch}, f32);
  rows.row_shift = empty_written_in_full({batch, hq, pitch}, f32);
  // A float mask's rows are in natural units, with row_lo, so that a huge bias (finfo.min) keeps
  // lse_lo apart; only its kernel variant (kBias) reads row_lo.
  const bool natural = attn::natural_units(a.mask);
  if (natural) {
    rows.row_lo = empty_written_in_full({batch, hq, pitch}, f32);
  }
  const bool dq_pass = attention_bwd_sm90_dq_pass(a);  // writes grad_query itself
  if (!dq_pass) {
    rows.dq_accum = at::empty({batch, hq, pitch, head_dim}, f32);
  }
  // Only a mask, key ranges or a negative causal shift (query 0 then sees no key) can leave a row empty.
  if (a.mask.defined() || a.key_ranges.defined() || (a.is_causal && a.q_offset - a.kv_offset < 0)) {
    rows.grad_out_dirty = at::zeros({1}, a.query.options().dtype(at::kInt));
  }
  RowsArgs r;
  r.delta = rows.delta.data_ptr<float>();
  r.row_shift = rows.row_shift.data_ptr<float>();
  r.natural = natural;
  r.row_lo = rows.row_lo.defined() ? rows.row_lo.data_ptr<float>() : nullptr;
  r.dq_zero = dq_pass ? nullptr : rows.dq_accum.data_ptr<float>();
  r.dq_cols = head_dim;
  r.grad_out_dirty = rows.grad_out_dirty.defined() ? rows.grad_out_dirty.data_ptr<int>() : nullptr;
  r.pitch = pitch;
  const at::Tensor lse = launch_rows<T>(a, r, stream);
  if (rows.grad_out_dirty.defined()) {
    const at::Tensor& go = a.grad_out;
    rows.grad_out_clean = empty_written_in_full(go.sym_sizes(), go.options());
    const int64_t elements = go.numel();
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((elements + 255) / 256, 1024));
    attention_bwd_clean_grad_out_kernel<T><<<blocks, 256, 0, stream>>>(
        rows.grad_out_dirty.const_data_ptr<int>(), static_cast<const T*>(go.const_data_ptr()), go.stride(0),
        go.stride(1), go.stride(2), go.stride(3), lse.const_data_ptr<float>(),
        static_cast<T*>(rows.grad_out_clean.data_ptr()), hq, q_len, go.size(3), elements);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  attention_bwd_sm90(a, rows);
}

template <typename T>
void attention_bwd_tensor_core(const AttentionBwdArgs& args) {
  TORCH_INTERNAL_ASSERT(
      args.grad_mask_write != GradMaskWrite::kSumBroadcast && args.grad_mask_write != GradMaskWrite::kOwnShape,
      "attention backward (CUDA): a mask gradient summed over broadcast dims in the kernel, or written in "
      "the mask's own shape, is only given to the Hopper kernels (attention_bwd_sums_broadcast)");
  AttentionBwdArgs a = args;
  a.grad_out = grad_out_without_empty_rows(args);
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
  const at::Tensor delta = at::empty({batch, hq, q_len}, f32);
  const at::Tensor row_shift = at::empty({batch, hq, q_len}, f32);
  const at::Tensor row_lo = natural ? at::empty({batch, hq, q_len}, f32) : at::Tensor();
  RowsArgs r;
  r.natural = natural;
  r.delta = delta.data_ptr<float>();
  r.row_shift = row_shift.data_ptr<float>();
  r.row_lo = natural ? row_lo.data_ptr<float>() : nullptr;
  r.pitch = q_len;
  launch_rows<T>(a, r, stream);
  const bool atomic_dq = use_atomic_dq(a);

  BwdParams p{};
  p.query = query.const_data_ptr();
  p.key = key.const_data_ptr();
  p.value = value.const_data_ptr();
  p.grad_out = grad_out.const_data_ptr();
  p.q_stride_b = query.stride(0), p.q_stride_h = query.stride(1), p.q_stride_s = query.stride(2);
  p.k_stride_b = key.stride(0), p.k_stride_h = key.stride(1), p.k_stride_s = key.stride(2);
  p.v_stride_b = value.stride(0), p.v_stride_h = value.stride(1), p.v_stride_s = value.stride(2);
  p.do_stride_b = grad_out.stride(0), p.do_stride_h = grad_out.stride(1), p.do_stride_s = grad_out.stride(2);
  p.row_shift = row_shift.const_data_ptr<float>();
  p.row_lo = natural ? row_lo.const_data_ptr<float>() : nullptr;
  p.delta = delta.const_data_ptr<float>();
  p.grad_query = a.grad_query.data_ptr();
  p.grad_key = a.grad_key.data_ptr();
  p.grad_value = a.grad_value.data_ptr();
  p.grad_mask = nullptr;
  p.batch_begin = 0;
  p.mask = attn::make_mask_view(a.mask);
  at::Tensor summary_dkdv, diagonals_dkdv, summary_dq;  // kept alive until the launches are queued (stream-ordered)
  // Where the walks stop: the dK/dV kernel's up a column at its last query tile not masked, the
  // dQ kernel's along a row starts at its first key tile not masked (TileWalkBounds).
  attn::TileWalkBounds bounds_dkdv, bounds_dq;
  // The dK/dV kernel's large shape where this GPU's blocks may take its shared memory.
  const bool large_tiles = attn::bwd_large_tiles(head_dim, attn::smem_limits(query).per_block);
  p.causal.enabled = a.is_causal;
  p.causal.shift = a.q_offset - a.kv_offset;
  // Key ranges come beside no mask or a bool one (choose_attention_bwd): the summaries are of
  // both, the causal rule masking the tiles no row sees by it, as the kernels apply it too.
  p.ranges = attn::make_key_range_view(a.key_ranges);
  auto summarize = [&](int block_q, int block_kv, at::Tensor* diagonals, attn::TileWalkBounds* bounds) {
    if (a.key_ranges.defined()) {
      at::Tensor unused;  // the dQ kernel reads a diagonal tile's elements
      return attn::summarize_key_ranges(a.key_ranges, kv_len, a.mask, block_q, block_kv,
                                        diagonals != nullptr ? diagonals : &unused, bounds, p.causal);
    }
    // A mask whose gradient is wanted (a learnable bias, dense): not read for the summary.
    return attn::summarize_mask_tiles(a.mask, block_q, block_kv, diagonals, bounds, {},
                                      !(a.grad_mask_partial.defined() && a.mask.is_floating_point()));
  };
  if (a.mask.defined() || a.key_ranges.defined()) {
    attn::BwdTileSizes tiles;
    TORCH_INTERNAL_ASSERT(attn::bwd_tile_sizes(head_dim, large_tiles, tiles),
                          "attention backward (CUDA): no tile sizes for ", head_dim);
    // The atomic mode runs no dQ kernel: its summary is not needed; where the tiles agree the dQ
    // kernel reads the dK/dV kernel's.
    const bool shared = tiles.dq_q == tiles.dkdv_q && tiles.dq_kv == tiles.dkdv_kv;
    bounds_dkdv.columns = true;
    bounds_dkdv.rows = !atomic_dq && shared;
    // With diagonals: the dK/dV kernel tests a bool mask's diagonal tiles by a compare; the dQ
    // kernel, sharing the summary, reads their elements (they are not plain tiles).
    summary_dkdv = summarize(tiles.dkdv_q, tiles.dkdv_kv, &diagonals_dkdv, &bounds_dkdv);
    p.tiles_dkdv = attn::make_tile_summary_view(summary_dkdv, tiles.dkdv_q, tiles.dkdv_kv, diagonals_dkdv, bounds_dkdv);
    if (!atomic_dq) {
      bounds_dq.rows = true;
      summary_dq = shared ? summary_dkdv : summarize(tiles.dq_q, tiles.dq_kv, nullptr, &bounds_dq);
      p.tiles_dq =
          attn::make_tile_summary_view(summary_dq, tiles.dq_q, tiles.dq_kv, {}, shared ? bounds_dkdv : bounds_dq);
    }
  }
  p.score = attn::score_rule(a.scale, a.softcap, natural);
  p.hq = hq;
  p.hkv = hkv;
  p.q_len = q_len;
  p.kv_len = kv_len;

  const at::Tensor& partial = a.grad_mask_partial;
  // dkdv, dq: which kernels a launch runs; the dK/dV kernel covers every batch, the dQ kernel
  // `count` batches from p.batch_begin.
  auto launch = [&](bool dkdv, bool dq, int64_t count) {
    attn::launch_for_head_dim<kBwdHeadDims>(head_dim, "attention backward (CUDA, tensor cores)", [&](auto dim) {
      attn::launch_attention_bwd<T, decltype(dim)::value>(p, attn::BwdLaunch{batch, count, dkdv, dq, large_tiles},
                                                          stream);
    });
  };
  if (atomic_dq) {
    // dQ summed over the key tiles in float32 (zeroed on the stream: rows no step reaches, such
    // as rows with no visible key, stay exactly 0), in the kernel's tiles (DqAccumLayout), then
    // rounded once to the input dtype into grad_query ([B, Hq, Q, D] contiguous, as the dQ
    // kernel writes it).
    const at::Tensor dq_accum = at::zeros({attn::DqAccumLayout::floats(batch * hq, q_len, head_dim)}, f32);
    p.dq_accum = dq_accum.data_ptr<float>();
    launch(/*dkdv=*/true, /*dq=*/false, batch);
    C10_CUDA_CHECK(attn::launch_dq_accum_to_grad(p.dq_accum, static_cast<T*>(p.grad_query), batch * hq, q_len,
                                                 static_cast<int>(head_dim), stream));
    return;
  }
  if (!partial.defined() || a.grad_mask_write == GradMaskWrite::kAssign) {
    // kAssign: the partial is [B, Hq, Q, KV] float32 contiguous, written in full.
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

void run_backward(AttentionPath path, const AttentionBwdArgs& args) {
  switch (path) {
    case AttentionPath::kSm90a:
      attn::with_16bit_type(args.query, [&](auto type) { attention_bwd_hopper<decltype(type)>(args); });
      return;
    case AttentionPath::kMmaSync:
      attn::with_16bit_type(args.query, [&](auto type) { attention_bwd_tensor_core<decltype(type)>(args); });
      return;
    case AttentionPath::kChunkedAten: {
      AttentionBwdArgs cleaned = args;
      cleaned.grad_out = grad_out_without_empty_rows(args);
      attention_backward_chunked(cleaned);
      return;
    }
    default:
      TORCH_INTERNAL_ASSERT(false, "attention backward (CUDA): no kernel for the path ", attention_path_name(path));
  }
}

constexpr AttentionBwdFn kBackward = &run_chosen<AttentionBwdArgs, &choose_attention_bwd, &run_backward>;

}  // namespace

const char* attention_bwd_mma_sync_rejects(const AttentionBwdArgs& a) {
  const int64_t head_dim = a.query.size(3);
  if (const char* reason = attn::mma_sync_inputs_rejects(a.query, a.value, has_head_dim<kBwdHeadDims>(head_dim))) {
    return reason;
  }
  if (!attn::smem_fits(attn::bwd_smem_bytes(head_dim), a.query)) {
    return "its shared memory does not fit this GPU";
  }
  if (a.mask.defined() && a.mask.scalar_type() == at::kDouble) {
    return "a float64 mask";
  }
  // Grid limits (y and z are 16-bit).
  if (a.query.size(0) > 65535 || a.query.size(1) > 65535 || a.key.size(1) > 65535) {
    return "batch, query heads or kv heads above 65535 (grid y and z)";
  }
  return nullptr;
}

}  // namespace safeattn::cuda

TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  // The device guard is all the backward opens first (attention_backward_kernel, ops/attention.h).
  using safeattn::cuda::attention_bwd_sums_broadcast, safeattn::cuda::kBackward, safeattn::cuda::OpDeviceGuard;
  m.impl("_attention_backward",
         &safeattn::attention_backward_kernel<OpDeviceGuard, kBackward, &attention_bwd_sums_broadcast>);
}
