// What the CUDA attention paths share on the host (the views, checks and summaries the kernels'
// parameter structs are made from), and, through the headers it includes, on the device: the
// mma.sync building blocks (mma_sync.cuh), the mask view and causal rule (mask_view.cuh) and the
// score transform (score_rule.cuh). The semantics are those of ops/attention.h;
// python/safeattn/reference.py is the float64 reference.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>

#include "ops/attention.h"
#include "ops/cuda/generic/mma_sync.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "ops/cuda/mask_view.cuh"   // MaskView, TileSummaryView, Causal
#include "ops/cuda/score_rule.cuh"  // kLog2e, ScoreRule, finish_row

namespace safeattn::cuda::attn {

// to_float (16-bit values to float): mask_view.cuh.

// ---- the mask --------------------------------------------------------------------------------

// Host: the view of a [B, Hq, Q, KV] (expanded, stride 0 on broadcast dims) mask tensor, or an
// empty view for an undefined tensor.
MaskView make_mask_view(const at::Tensor& mask);

// Host: whether the kernels hold scores in natural units (a floating mask; see exp_of).
inline bool natural_units(const at::Tensor& mask) {
  return mask.defined() && mask.is_floating_point();
}

// Host: whether the kernels can read a 4-D tensor of 16-bit elements in place with 16-byte loads
// (cp.async, uint4): unit stride along the last dim and every row on a 16-byte boundary. Size-1
// dims are never stepped over, so their strides do not matter.
bool rows_aligned_16(const at::Tensor& t);

// Host: why the mma.sync kernels of either direction cannot take a call, their own conditions
// aside, or nullptr when they can: bf16 / fp16, D == Dv, and a head dim compiled for them
// (`head_dim_compiled`, has_head_dim of the direction's head dims).
const char* mma_sync_inputs_rejects(const at::Tensor& query, const at::Tensor& value, bool head_dim_compiled);

// Host: whether this build has the sm_90a kernels (setup.py defines SAFEATTN_WITH_SM90 when it
// compiles hopper/instances/); without them the head dims of both are none (head_dim_switch.h),
// so their host code instantiates no launcher, and they decline every call with kNoSm90Kernels.
#ifdef SAFEATTN_WITH_SM90
inline constexpr bool kWithSm90 = true;
#else
inline constexpr bool kWithSm90 = false;
#endif
inline constexpr const char* kNoSm90Kernels =
    "this build has no sm_90a kernels (no CUTLASS headers, or SAFEATTN_SM90=0)";

// Host: why both sm_90a kernels (attention_fwd_sm90.cu, attention_bwd_sm90.cu) cannot take a
// call, their head dims aside, or nullptr when they can: they need bf16 / fp16, D == Dv, no empty
// input, sizes below 2^31, an sm_90 device, and scale > 0 with a scale * log2(e) that neither
// rounds to 0 nor overflows in float32 (they take each row's max over raw dot products and scale
// after); and the generic kernels not forced (cuda::generic_kernels_only, safeattn.h).
const char* sm90_inputs_rejects(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale);

// Host: on an sm_90 GPU with a build that lacks the sm_90a kernels (built without CUTLASS or with
// SAFEATTN_SM90=0), a warning, once per process, that names the rebuild command: attention then
// runs the generic kernels at about 40% of the speed, which nothing else would reveal.
void warn_if_hopper_kernels_missing(const at::Tensor& query);

// Host: the tensors' addresses and [B, H, S] strides (elements) that the forward kernels'
// parameter structs share (attention_fwd.cuh and hopper/fwd_params.h): query, key and value as
// the kernel reads them (aligned copies or the inputs), out, lse and lse_lo from `a`.
template <class Params>
void set_forward_tensors(Params& p, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const AttentionFwdArgs& a) {
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  p.out = a.out.data_ptr();
  p.lse = a.lse.data_ptr<float>();
  p.lse_lo = a.lse_lo.defined() ? a.lse_lo.data_ptr<float>() : nullptr;
  p.q_sb = query.stride(0), p.q_sh = query.stride(1), p.q_si = query.stride(2);
  p.k_sb = key.stride(0), p.k_sh = key.stride(1), p.k_si = key.stride(2);
  p.v_sb = value.stride(0), p.v_sh = value.stride(1), p.v_si = value.stride(2);
  p.o_sb = a.out.stride(0), p.o_sh = a.out.stride(1), p.o_si = a.out.stride(2);
}

// Host: whether every size of t is below 2^31 (what kernels with 32-bit indices, such as TMA's
// coordinates, need).
bool sizes_fit_int32(const at::Tensor& t);

// Host: whether a block may take `bytes` of shared memory on t's device (the opt-in limit: 227 KB
// on sm_90 / sm_100, 163 KB on sm_80 / sm_87, 99 KB on sm_86 / sm_89 / sm_120). A kernel whose
// tiles do not fit leaves the call to the next path rather than fail at launch.
bool smem_fits(size_t bytes, const at::Tensor& t);

// Host: the shared-memory limits of t's device that choose the generic kernels' tile shapes
// (fwd_large_tiles, bwd_large_tiles): what a block may opt into, what an SM has, and what each
// block's launch reserves of it.
struct SmemLimits {
  size_t per_block = 0, per_sm = 0, reserved_per_block = 0;
};
SmemLimits smem_limits(const at::Tensor& t);

// Host: t itself when rows_aligned_16(t), else an aligned contiguous copy. A clone, since
// contiguous() returns a contiguous view with an odd offset unchanged.
at::Tensor with_aligned_rows(const at::Tensor& t);

// Host: f(T{}) with T the 16-bit element type of t (__nv_bfloat16 for bfloat16, else __half).
template <typename F>
void with_16bit_type(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kBFloat16) {
    f(__nv_bfloat16{});
  } else {
    f(__half{});
  }
}

// Host: launch(std::integral_constant<int, D>{}) for D == head_dim, which must be one of kDims, the
// head dims a kernel family was compiled for (head_dim_switch.h); `family` begins the message
// otherwise. A launcher that returns its cudaError_t (the sm_90a ones) has it checked here.
template <uint64_t kDims, typename F>
void launch_for_head_dim(int64_t head_dim, const char* family, F&& launch) {
  const bool launched = with_head_dim<kDims>(head_dim, [&](auto dim) {
    if constexpr (std::is_void_v<decltype(launch(dim))>) {
      launch(dim);
    } else {
      C10_CUDA_CHECK(launch(dim));
    }
  });
  TORCH_INTERNAL_ASSERT(launched, family, ": no kernel for head dim ", head_dim);
}

// Host: the causal fields the mma.sync forward's and the decode kernels' parameter structs
// share. The entry point passed q_offset = causal_shift(...), kv_offset 0.
inline Causal causal_rule(const AttentionFwdArgs& a) {
  return Causal{a.is_causal, a.q_offset - a.kv_offset};
}

// ---- per-tile summary of a dense mask ---------------------------------------------------------

// The bounds of the kernels' walks over a summary, each recorded when asked for (int32): with
// `rows`, per row of tiles (Bm, Hm, q tile) the lowest key tile that is not masked, where the
// forward's and the dQ pass's walk down a row stops (TileSummaryView::first_visible); with
// `columns`, per column (Bm, Hm, key tile) one past the highest query tile that is not masked,
// where the dK/dV walk up a column stops (TileSummaryView::query_end): past a narrow mask's
// band that walk would read the rest of the column.
struct TileWalkBounds {
  bool rows = false, columns = false;
  at::Tensor first_visible, query_end;
};

// Host: the summary of a [B, Hq, Q, KV] mask view (as make_mask_view takes it) for tiles of
// block_q queries x block_kv keys: a uint8 tensor [Bm, Hm, ceil(Q / block_q), ceil(KV / block_kv)]
// where Bm (Hm) is 1 when the mask is broadcast over the batch (heads), so each distinct mask
// slice is summarised once. One kernel on the current stream, no host synchronisation. Edge
// tiles look only at the elements inside [Q, KV]. Tile sizes are arguments, so the forward and
// the backward can each ask for their own.
// With `diagonals` (block_q <= 128): also the tiles of a bool mask with 16-byte aligned rows that
// are one diagonal (kTileDiagonal), their diagonals written to *diagonals (int16, the summary's
// shape); the kernels that ask for them read that class (the sm_90a kernels, the generic
// forward and dK/dV kernels).
// With `bounds`: also where the kernels' walks over the summary may stop (TileWalkBounds).
// With `causal` enabled (for kernels that apply the same causal rule themselves): the tiles no
// row of which sees any key are masked without being read (half of a [1, H, S, S] bias's bytes).
// Without `read_values` (a float mask only: a learnable bias, dense, whose every tile the kernels
// read anyway), no value is read: every tile causality leaves is mixed, one slice [1, 1, ...]
// standing for all (a [B, H, 4096, 4096] bf16 bias's summary read 2.1 GB, 0.45 ms on an H200,
// in the forward and again in the backward, to find no tile to skip).
at::Tensor summarize_mask_tiles(const at::Tensor& mask, int block_q, int block_kv, at::Tensor* diagonals = nullptr,
                                TileWalkBounds* bounds = nullptr, Causal causal = {}, bool read_values = true);

// Host: the summary, for the sm_90a kernels, of key ranges ([B, Q, 2] int32, rows of 2
// contiguous: AttentionFwdArgs::key_ranges) ANDed with a bool mask view (or none): uint8
// [B, Hm, ceil(Q / block_q), ceil(KV / block_kv)] with Hm the mask summary's heads (1 without a
// mask), and the diagonals (int16, same shape) of its kTileDiagonal tiles in *diagonals. Tiles of
// at most 128 rows; bounds and causal as summarize_mask_tiles takes them (causal: the tiles no row
// of which sees a key, by causality, are masked, whatever the ranges say; a causal window's ranges
// run to kv_len). Kernels on the current stream, no host synchronisation.
at::Tensor summarize_key_ranges(const at::Tensor& key_ranges, int64_t kv_len, const at::Tensor& mask, int block_q,
                                int block_kv, at::Tensor* diagonals, TileWalkBounds* bounds = nullptr,
                                Causal causal = {});
// Host: the kernels' view of key_ranges (undefined: a null view).
KeyRangeView make_key_range_view(const at::Tensor& key_ranges);

// Host: the view of a summary made by summarize_mask_tiles for the same tile sizes.
TileSummaryView make_tile_summary_view(const at::Tensor& summary, int block_q, int block_kv,
                                       const at::Tensor& diagonals = at::Tensor(), const TileWalkBounds& bounds = {});

// Host: an sm_90a kernel's mask fields (mask, mask_tiles, key_ranges; hopper/fwd_params.h,
// bwd_params.h) from the call's bool mask and key ranges, either or both undefined, summarised
// for tiles of block_q x block_kv (p.kv_len, p.causal and p.causal_shift set before: the tiles
// causality hides are not read). summary, diagonals and bounds hold the summary until the
// launch is queued; bounds says which walks' bounds to record (TileWalkBounds). Neither mask nor
// ranges: the fields stay null (the kernel without mask code). dense_bias: a float mask without
// key ranges is summarised by causality alone (summarize_mask_tiles' read_values false).
template <class Params>
void set_mask_fields(Params& p, const at::Tensor& mask, const at::Tensor& key_ranges, int block_q, int block_kv,
                     at::Tensor& summary, at::Tensor& diagonals, TileWalkBounds& bounds, bool dense_bias = false) {
  const Causal causal{p.causal, p.causal_shift};
  if (key_ranges.defined()) {
    summary = summarize_key_ranges(key_ranges, p.kv_len, mask, block_q, block_kv, &diagonals, &bounds, causal);
    p.key_ranges = make_key_range_view(key_ranges);
  } else if (mask.defined()) {
    summary = summarize_mask_tiles(mask, block_q, block_kv, &diagonals, &bounds, causal,
                                   !(dense_bias && mask.is_floating_point()));
  }
  if (mask.defined()) {
    p.mask = make_mask_view(mask);
  }
  if (summary.defined()) {
    p.mask_tiles = make_tile_summary_view(summary, block_q, block_kv, diagonals, bounds);
  }
}

}  // namespace safeattn::cuda::attn
