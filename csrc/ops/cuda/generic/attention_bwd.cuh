// Tensor-core backward of safeattn::attention (FlashAttention-2 style, mma.sync m16n8k16,
// bf16/fp16 inputs, fp32 math). The semantics are those of ops/attention.h; the CPU twin is
// cpu/attention_bwd_kernel.cpp and the float64 reference python/safeattn/reference.py.
//
// Kernels, launched in this order by attention_bwd_kernel.cu:
//   1. rows (pre-pass): per query row, Delta = rowsum(dO * O) - dlse, and the row's shift: lse in
//      the kernels' score units (attention_common.cuh, exp_of), with lse_lo beside it in natural
//      units (-inf becomes +inf so that a row with no visible key gets p = 0 everywhere, never NaN).
//   2. dK/dV: one CTA per (key tile, kv head, batch). It keeps K and V of its tile in shared
//      memory and walks every query head of its GQA group and every query tile that can see the
//      tile (the causal rule skips the tiles above the diagonal). Its warps split the tile as
//      DkvConfig says, and compute the transposed tiles (keys along rows, queries along
//      columns):
//        S^T = K Q^T     P^T = exp(score(S^T) - lse)     dP^T = V dO^T
//        dS^T = P^T * (dP^T - Delta)     dS'^T = dS^T * d score / d(q.k)
//        dV += P^T dO    dK += dS'^T Q
//   3. dQ, in one of two modes:
//      - deterministic (the dQ kernel): one CTA per (query tile, query head, batch); each warp
//        owns 16 queries and walks the key tiles the queries can see: S = Q K^T, dP = dO V^T, dS
//        as above, dQ += dS' K. The mask gradient (dS: the gradient of the additive mask value,
//        0 where masked) is written here, into a [B, Hq, Q, KV] float32 buffer. No element is
//        written by two CTAs and every loop has a fixed order: results are bit-identical from
//        run to run, at the price of recomputing S and dP (7 products instead of 5).
//      - atomic (FlashAttention-2's way, 5 products): the dK/dV kernel also stores each step's
//        dS'^T in shared memory (input dtype, as the dQ kernel's dS' operand) and its warps
//        compute dQ_step = dS' K[tile] for the step's queries (each warp kDqRows queries and a
//        share of the head dim, kDqCols: BwdTiles), added into a zeroed float32 buffer of [B, Hq,
//        Q, D] in accumulator tiles (DqAccumLayout) with red.global.add; the buffer is then
//        converted to grad_query (dq_accum_to_grad_kernel). Every key tile of the kv
//        head adds into the same rows, in no fixed order: not bit-reproducible. Used unless
//        deterministic algorithms are on (torch.use_deterministic_algorithms) or a mask
//        gradient is needed (the dQ kernel writes it). Skipped tiles and rows with no visible key
//        add nothing (their dS is 0), so such rows keep the buffer's zeros.
// With a mask, the kernels read its per-tile summary (summarize_mask_tiles, at each kernel's
// tile sizes): fully masked tiles are skipped without loading their operands or the mask, and
// all-visible interior tiles (like the tiles below the causal diagonal) take no per-element test.
//
// The dK/dV kernel's tile shape is a BwdTiles type (DkvConfig<D, large>: the shape each head dim
// runs, by the shared memory a block of the GPU may take).
// Two layouts of its warps:
//   - P^T in registers (kWarpsQ = 1, 16 keys a warp): each warp scores its own 16 keys against
//     the whole query step and keeps P^T and dS'^T in registers as the A operands of dV and dK,
//     which it owns for its keys over the whole head dim;
//   - P^T through shared memory (FlashAttention-2's layout): the warps tile S^T as kWarpsK x
//     kWarpsQ blocks (more keys and fewer queries a warp: each ldmatrix'd fragment feeds more
//     MMAs), store P^T and dS'^T to shared memory, and then own dK and dV by blocks of keys x
//     head-dim columns (kDkvCols warps across the head dim).
//
// Shared-memory tiles are row-major with rows padded by 16 bytes, or unpadded with their 16-byte
// chunks swizzled (SmemRows), so that the eight rows an ldmatrix reads fall in distinct banks.
// Out-of-range rows are zero-filled by cp.async; their scores are forced to -inf (keys) or their
// lse to +inf (queries), so they contribute exactly 0.
//
// No torch in the kernels: with SAFEATTN_STANDALONE defined, the header declares the kernels
// without the torch-checked launchers (benchmarks/mma_sync_bwd_check.cu).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ops/cuda/generic/mma_sync.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "ops/cuda/mask_view.cuh"
#include "ops/cuda/score_rule.cuh"
#include "ops/cuda/tile_order.h"

#ifndef SAFEATTN_STANDALONE
#include <c10/cuda/CUDAException.h>

#include "ops/cuda/attention_common.cuh"
#endif

namespace safeattn::cuda::attn {

// What the backward kernels read and write (device pointers, element strides, 64-bit).
struct BwdParams {
  // Inputs in the input dtype; rows of head_dim elements with unit stride, 16-byte aligned.
  const void* query;     // [B, Hq, Q, D]
  const void* key;       // [B, Hkv, KV, D]
  const void* value;     // [B, Hkv, KV, D]
  const void* grad_out;  // [B, Hq, Q, D]
  int64_t q_stride_b, q_stride_h, q_stride_s;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t v_stride_b, v_stride_h, v_stride_s;
  int64_t do_stride_b, do_stride_h, do_stride_s;
  // [B, Hq, Q] contiguous, +inf where lse is -inf: (lse + lse_lo) * log2(e) in log2 units; lse
  // itself in natural units, with row_lo = lse_lo * log2(e) subtracted after the conversion
  // (p = 2^((s - lse) log2(e) - row_lo): a row of finfo.min scores keeps its log(sum)).
  const float* row_shift;
  const float* row_lo;  // [B, Hq, Q] contiguous (natural units only; 0 where lse is -inf)
  const float* delta;   // [B, Hq, Q] contiguous
  void* grad_query;     // [B, Hq, Q, D] contiguous (written)
  void* grad_key;       // [B, Hkv, KV, D] contiguous (written)
  void* grad_value;     // [B, Hkv, KV, D] contiguous (written)
  // Null (deterministic mode: the dQ kernel writes grad_query), or [B, Hq, Q, D] float32
  // contiguous, zeroed: the dK/dV kernel adds dQ into it with atomics (the atomic mode).
  float* dq_accum;
  // Null, or [batch_count, Hq, Q, KV] float32 contiguous for batches [batch_begin, +count):
  // every element of those batches is assigned (dS, 0 where masked or never visited).
  float* grad_mask;
  int64_t batch_begin;
  MaskView mask;
  // Null, or each query row's one interval of keys (AttentionBwdArgs::key_ranges), ANDed with a
  // bool mask or none: the summaries then cover both (summarize_key_ranges), and exp2_arg tests
  // each element of a mixed tile against its row's interval.
  KeyRangeView ranges;
  // The mask's (and key ranges') per-tile classes at each kernel's tile sizes (bwd_tile_sizes);
  // null views (all visible) without either. Fully masked tiles are skipped, all-visible interior
  // tiles take no per-element test.
  TileSummaryView tiles_dkdv, tiles_dq;
  Causal causal;
  // Score units: log2, or natural with a floating mask (attention_common.cuh, exp_of).
  ScoreRule score;
  int64_t hq, hkv, q_len, kv_len;
  // The dK/dV grid's order (ops/cuda/tile_order.h, GridCoords): with head_group_dkdv > 1, CTA (x,
  // y, z)'s linear index read as longest_first's over the (batch, kv head)s in groups of that
  // many, so that the long key tiles (under causality, the first) of a group run first and short
  // ones fill the tail; 1: the grid's own order. The dQ kernel keeps its own order.
  int head_group_dkdv = 1;
};

// The dQ kernel's shape for one head dim: 4 warps, each owning 16 queries; the key step is
// smaller for large head dims so that the dQ accumulator (head_dim floats per thread) plus the
// two score tiles stay in registers.
template <int kHeadDim_>
struct DqConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "tensor-core backward: head_dim 16..128, multiple of 16");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  using Rows = SmemRows<kHeadDim>;
  static constexpr int kStride = Rows::kStride;
  // kDqQueries queries per CTA, kDqKeys keys per step.
  static constexpr int kDqQueries = 16 * kWarps;
  static constexpr int kDqKeys = kHeadDim <= 64 ? 64 : 32;
  static constexpr size_t kDqSmem = sizeof(uint16_t) * kStride * (2 * kDqQueries + 2 * 2 * kDqKeys);
};

// The head-dim columns of one job of the atomic mode's dQ (`rows` queries x that many columns):
// the head dim split over the warps a block of `rows` queries gets, at most 32 accumulators a
// thread (rows x cols / 32).
constexpr int bwd_dq_cols(int head_dim, int warps, int row_blocks, int rows = 16) {
  int cols = warps >= row_blocks ? head_dim / (warps / row_blocks) : head_dim;
  while (cols * rows > 1024 && cols % 32 == 0) {
    cols /= 2;
  }
  return cols;
}

// A dK/dV tile shape: kKeys keys a CTA (its K and V stay in shared memory) stepping over kQueries
// queries at a time, kWarps warps.
//   kWarpsQ     warps across the queries of the step's S^T tile (kWarps / kWarpsQ across its
//               keys). 1 with 16 keys a warp and kDkvCols 1: P^T and dS'^T stay in registers
//               (kPInRegs, see the top); otherwise they pass through shared memory.
//   kSubQueries queries a warp scores at a time (registers: two score tiles of 16 keys x
//               kSubQueries, or of the warp's keys x kSubQueries), so that the score tiles beside
//               dK and dV fit in registers.
//   kStages     Q / dO buffers: 2, the next step's Q and dO load during this one; 1, they load
//               after it (other CTAs on the SM overlap it).
//   kSwizzle    rows unpadded and swizzled (SmemRows) instead of padded by 16 bytes.
//   kDkvCols    (P^T in shared memory) warps across the head dim for dK and dV.
//   kMinBlocks  CTAs an SM the registers are budgeted for (__launch_bounds__).
//   kFoldScale  in log2 units without softcap, d score / d dot the constant scale and the rest of
//               exp2_arg's tests and branches left out of the element loop: on plain tiles
//               (plain_tile) p = 2^(dot * scale - shift) in one FMA; on tiles whose only tests are
//               the causal rule and the sequence ends (TileBounds) one compare an element.
//   kDqRows     (atomic dQ) queries of a warp's dQ job, 16 or 32: with 32, each ldmatrix'd K
//               fragment feeds two MMAs (FlashAttention-2's 32 x 32 warp blocks at D = 128).
//   kPairScores S^T and dP^T in one pass over the head dim (each k-step's K and V fragments live
//               together), or one product after the other (half the fragment registers, so
//               that wider sub-tiles fit: each fragment feeds more MMAs).
// Per thread: dK and dV, 2 * kWarpKeys x kDkvWarpCols / 32 floats, and the two score tiles,
// 2 * kWarpKeys x kSubQueries / 32.
template <int kHeadDim_, int kKeys_, int kQueries_, int kWarps_, int kWarpsQ_, int kSubQueries_, int kStages_,
          bool kSwizzle_ = false, int kDkvCols_ = 1, int kMinBlocks_ = 1, bool kFoldScale_ = false, int kDqRows_ = 16,
          bool kPairScores_ = true>
struct BwdTiles {
  static constexpr int kHeadDim = kHeadDim_, kKeys = kKeys_, kQueries = kQueries_, kWarps = kWarps_;
  static constexpr int kWarpsQ = kWarpsQ_, kSubQueries = kSubQueries_, kStages = kStages_;
  static constexpr bool kSwizzle = kSwizzle_;
  static constexpr int kDkvCols = kDkvCols_, kMinBlocks = kMinBlocks_;
  static constexpr bool kFoldScale = kFoldScale_;
  static constexpr int kDqRows = kDqRows_;
  static constexpr bool kPairScores = kPairScores_;
  static constexpr int kThreads = kWarps * 32;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "tensor-core backward: head_dim 16..128, multiple of 16");
  static_assert(kStages == 1 || kStages == 2, "one or two Q / dO buffers");
  using Rows = SmemRows<kHeadDim, kSwizzle>;  // K, V, Q and dO rows
  static constexpr int kStride = Rows::kStride;

  // The S^T tile's warp blocks: kWarpKeys keys x kWarpQueries queries, scored kSubQueries at a time.
  static constexpr int kWarpsK = kWarps / kWarpsQ;
  static constexpr int kWarpKeys = kKeys / kWarpsK;
  static constexpr int kWarpQueries = kQueries / kWarpsQ;
  static_assert(kWarpsK * kWarpsQ == kWarps && kWarpKeys * kWarpsK == kKeys && kWarpKeys % 16 == 0,
                "S^T tile: warps x 16-key blocks");
  static_assert(kWarpQueries % kSubQueries == 0 && kSubQueries % 16 == 0, "S^T tile: 16-query sub-tiles");
  static constexpr bool kPInRegs = kWarpsQ == 1 && kWarpKeys == 16 && kDkvCols == 1;
  // dK and dV: warp blocks of kDkvWarpKeys keys x kDkvWarpCols head-dim columns.
  static constexpr int kDkvWarpKeys = kKeys / (kWarps / kDkvCols);
  static constexpr int kDkvWarpCols = kHeadDim / kDkvCols;
  static_assert(kDkvWarpKeys % 16 == 0 && kDkvWarpCols % 16 == 0 && kWarps % kDkvCols == 0, "dK/dV: warp blocks");
  // P^T and dS'^T of a step in shared memory, [kKeys][kPStride] (keys along rows).
  static constexpr int kPStride = padded_row(kQueries);
  // Atomic dQ: the step's dQ in jobs of kDqRows queries x kDqCols head-dim columns, kDqJobs / kWarps a warp.
  static_assert(kDqRows % 16 == 0 && kQueries % kDqRows == 0, "atomic dQ: 16-query blocks");
  static constexpr int kDqCols = bwd_dq_cols(kHeadDim, kWarps, kQueries / kDqRows, kDqRows);
  static constexpr int kDqJobs = kQueries / kDqRows * (kHeadDim / kDqCols);
  static_assert(kHeadDim % kDqCols == 0 && kDqCols % 16 == 0 && kDqJobs % kWarps == 0, "atomic dQ: warp split");

  // K, V; Q and dO (kStages buffers); row shift, row lo and Delta (kStages); then P^T (unless in
  // registers) and dS'^T (unless in registers without atomic dQ).
  static constexpr size_t kTilesSmem =
      sizeof(uint16_t) * kStride * (2 * kKeys + 2 * kStages * kQueries) + sizeof(float) * 3 * kStages * kQueries;
  static constexpr size_t smem_bytes(bool atomic_dq) {
    const int score_tiles = kPInRegs ? (atomic_dq ? 1 : 0) : 2;
    return kTilesSmem + sizeof(uint16_t) * score_tiles * kKeys * kPStride + kGridCoordBytes;  // then GridCoords
  }
  // Whether the kernels carry the key ranges' per-element test (WithRanges, mma_sync.cuh).
  static constexpr bool kReadsRanges = false;
};

// The most dynamic shared memory a block may opt into on sm_86 / sm_89 / sm_120 (99 KB).
constexpr size_t kBwdSmemSm86 = 99 * 1024;

// The dK/dV shape each head dim runs, on a GPU whose blocks may opt into at most 99 KB of shared
// memory (kLarge false: sm_86, sm_89, sm_120) or into more (kLarge true: sm_80's 163 KB, sm_90's
// and sm_100's 227 KB; bwd_large_tiles decides at run time). 8 warps of 16 keys each (128 keys per
// CTA, one CTA per SM) step over 64 queries at a time (FlashAttention-2's 128 keys x 64 queries):
// each step loads Q and dO once for the CTA's keys. Above D = 64 the step is scored 32 queries at a
// time: a 64-query score tile pair next to dK and dV spilled (nvcc 13.0, sm_90: 88 bytes at 255
// registers, 8 warps, D = 128). The scale folded into the exponent on plain tiles (kFoldScale):
// benchmarks/mma_sync_bwd_check.cu on an H200, B=4 H=16 S=4096 bf16, causal, atomic dQ: D=64
// 3.98 -> 2.22 ms, D=128 5.14 -> 3.87 ms.
// DkvShape<D, kLarge>::type is the BwdTiles; a head dim without a large shape of its own runs the
// same type (one kernel) both ways.
template <int D, bool kLarge>
struct DkvShape {
  using type = BwdTiles<D, 128, 64, 8, 1, (D <= 64 ? 64 : 32), 2, false, 1, 1, true>;
};
// D = 128 within 99 KB (the shape above needs 155 KB): 64 keys a CTA, 4 warps 2 x 2 over the S^T
// tile scoring 16 queries at a time, P^T and dS'^T through shared memory, dK / dV split by head
// dim, one Q/dO buffer, swizzled rows, 2 CTAs an SM (83 KB): 3.38 ms causal, 6.27 non-causal.
template <>
struct DkvShape<128, false> {
  using type = BwdTiles<128, 64, 64, 4, 2, 16, 1, true, 2, 2, true>;
};
// With more than 99 KB, FlashAttention-2's layouts, P^T and dS'^T through shared memory, swizzled
// rows, one Q/dO buffer, the atomic dQ in jobs of 32 queries. H200 (benchmarks/mma_sync_bwd_check.cu,
// B4 H16 S4096 bf16, causal / non-causal): D = 128, 128 keys x 64 queries, 8 warps 4 x 2 over S^T,
// dK / dV 2 warps across the head dim (134 KB): 2.92 / 5.36 ms (dQ jobs of 16 queries: 2.98 /
// 5.53), against 3.38 / 6.27 for the 99 KB shape (two Q/dO buffers, 166 KB, are over sm_80's 163).
// D = 64, 128 keys x 128 queries, 8 warps 2 x 4 scoring 16 queries at a time (135 KB). With one
// Q/dO buffer the next step's Q and dO load during the step's dQ: H200, causal / non-causal, D = 64
// 1.787 / 3.267 -> 1.716 / 3.060 ms, D = 128 3.028 / 5.640 -> 2.850 / 5.147. D = 64 is scored 32
// queries at a time with S^T and dP^T apart (kPairScores false: each K / V fragment feeds four
// MMAs, as in FlashAttention-2), P^T and dS'^T stored as they are made (no spills in the loop):
// 1.728 / 3.081 -> 1.564 / 2.804 ms. (Before the stores moved it spilled 296 bytes, and a dense
// causal + padding mask ran 2.258 -> 2.398 ms through the extension.) D = 128 the same way, once
// the dQ accumulator tiles were in (same run, causal / non-causal): 2.699 / 4.841 -> 2.592 / 4.646 ms.
template <>
struct DkvShape<128, true> {
  using type = BwdTiles<128, 128, 64, 8, 2, 32, 1, true, 2, 1, true, 32, false>;
};
template <>
struct DkvShape<64, true> {
  using type = BwdTiles<64, 128, 128, 8, 4, 32, 1, true, 2, 1, true, 32, false>;
};
template <int D, bool kLarge = false>
using DkvConfig = typename DkvShape<D, kLarge>::type;

// Host: whether a GPU whose blocks may opt into `smem_optin` bytes runs head dim d's large dK/dV
// shape (DkvConfig<d, true>).
inline bool bwd_large_tiles(int64_t d, size_t smem_optin) {
  bool large = false;
  with_head_dim<kBwdHeadDims>(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    large = DkvConfig<D, true>::smem_bytes(true) <= smem_optin;
  });
  return large;
}

// Host: the (query, key) tile sizes of the dK/dV kernel (its large shape when `large`) and of the
// dQ kernel for head dim d, for the mask summaries; false when d has no tensor-core backward in this build.
struct BwdTileSizes {
  int dkdv_q = 0, dkdv_kv = 0, dq_q = 0, dq_kv = 0;
};
inline bool bwd_tile_sizes(int64_t d, bool large, BwdTileSizes& sizes) {
  return with_head_dim<kBwdHeadDims>(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    using Small = DkvConfig<D, false>;
    using Large = DkvConfig<D, true>;
    sizes = {large ? Large::kQueries : Small::kQueries, large ? Large::kKeys : Small::kKeys, DqConfig<D>::kDqQueries,
             DqConfig<D>::kDqKeys};
  });
}

// Host: the shared memory the backward kernels of head dim d need (bytes), with the dK/dV
// kernel's small shape by default (the least they need); 0 if none. At D = 96 (124 KB) the least
// exceeds the 99 KB of sm_86 / sm_89 / sm_120, whose backward at that head dim takes the ATen path
// (attention_backward_chunked).
inline size_t bwd_smem_bytes(int64_t d, bool large = false) {
  size_t bytes = 0;
  with_head_dim<kBwdHeadDims>(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    const size_t dkdv = large ? DkvConfig<D, true>::smem_bytes(true) : DkvConfig<D, false>::smem_bytes(true);
    bytes = std::max(dkdv, DqConfig<D>::kDqSmem);
  });
  return bytes;
}

// The atomic mode's dQ buffer (BwdParams::dq_accum), float32, zeroed before the dK/dV kernel: per
// (batch, query head), its [Q rounded up to 16, D] rows as 16 x 8 tiles in row-major tile order,
// each tile's 128 values in the order of the m16n8 accumulator's lanes (lane l = 4 g + t holds
// rows g and g + 8, columns 2 t and 2 t + 1, at 4 l .. 4 l + 3). A warp adds a whole tile with
// one 16-byte red a lane: 512 contiguous bytes, 4 cache lines. Its 8-byte adds into [Q, D]
// row-major rows touched 8 lines an instruction (ncu, H200, D=128 is_causal dK/dV kernel: 69M L1
// tag requests for its 69M sectors of atomics against 17M in FlashAttention-2's, and 8% of the
// kernel's stall samples on them, mostly lg throttle). With the tiles (mma_sync_bwd_check, H200,
// B4 H16 S4096, causal / not, ms): D=128 2.924 / 5.246 -> 2.694 / 4.831, D=64 1.558 / 2.795 ->
// 1.425 / 2.546. dq_accum_to_grad_kernel reads it back.
struct DqAccumLayout {
  static constexpr int kTileFloats = 16 * 8;
  __host__ __device__ static constexpr int64_t padded_rows(int64_t q_len) {
    return (q_len + 15) / 16 * 16;
  }
  // Floats of the buffer for `heads` (batch x query heads) of q_len rows and head dim d.
  static constexpr int64_t floats(int64_t heads, int64_t q_len, int64_t d) {
    return heads * padded_rows(q_len) * d;
  }
  // Where the tile of rows row0.. (a multiple of 16) and columns col0.. (a multiple of 8) of
  // head `head` (b * hq + h) starts: (head's first row + row0) * d, then 128 floats a tile.
  __host__ __device__ static constexpr int64_t tile(int64_t head, int64_t q_len, int64_t d, int64_t row0,
                                                    int64_t col0) {
    return (head * padded_rows(q_len) + row0) * d + col0 * 16;
  }
};

// grad_query ([B, Hq, Q, D] contiguous, T) from the atomic mode's dQ buffer (DqAccumLayout),
// rounded once: one thread a lane's four values of a tile (a 16-byte load; the warp reads a
// tile's 512 bytes), rows past q_len left out.
template <typename T>
__global__ void dq_accum_to_grad_kernel(const float* __restrict__ accum, T* __restrict__ grad_query, int64_t q_len,
                                        int d, int64_t quads) {
  const int64_t row_blocks = DqAccumLayout::padded_rows(q_len) / 16, col_blocks = d / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < quads;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = reinterpret_cast<const float4*>(accum)[i];
    const int lane = static_cast<int>(i % 32);
    const int64_t tile = i / 32;
    const int64_t rows_of = tile / col_blocks;  // (head, row block)
    const int64_t head = rows_of / row_blocks;
    const int64_t row = rows_of % row_blocks * 16 + lane / 4;
    const int64_t col = tile % col_blocks * 8 + 2 * (lane % 4);
    T* out = grad_query + (head * q_len + row) * d + col;
    if (row < q_len) {
      *reinterpret_cast<uint32_t*>(out) = pack2<T>(v.x, v.y);
    }
    if (row + 8 < q_len) {
      *reinterpret_cast<uint32_t*>(out + 8 * d) = pack2<T>(v.z, v.w);
    }
  }
}

// Launches dq_accum_to_grad_kernel over `heads` (batch x query heads) of q_len rows; the launch's
// error, if any.
template <typename T>
cudaError_t launch_dq_accum_to_grad(const float* accum, T* grad_query, int64_t heads, int64_t q_len, int d,
                                    cudaStream_t stream) {
  const int64_t quads = DqAccumLayout::floats(heads, q_len, d) / 4;
  const int64_t blocks = std::min<int64_t>((quads + 255) / 256, 8192);
  if (blocks > 0) {
    dq_accum_to_grad_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(accum, grad_query, q_len, d, quads);
  }
  return cudaGetLastError();
}

// What one backward launch runs (the rows pre-pass is the caller's).
struct BwdLaunch {
  int64_t batch = 0;        // the dK/dV kernel's grid covers batches [0, batch)
  int64_t batch_count = 0;  // the dQ kernel's: [params.batch_begin, +batch_count)
  bool run_dkdv = false;
  bool run_dq = false;
  bool large_tiles = false;  // the dK/dV kernel's large shape (bwd_large_tiles)
};

// Launches the dK/dV and dQ kernels for one dtype and head dim. Defined (with the kernels) only
// where SAFEATTN_ATTN_BWD_DEFINE_KERNELS is set: in the generated attention_bwd_d<D>_<dtype>.cu,
// each of which instantiates one pair.
template <typename T, int kHeadDim>
void launch_attention_bwd(const BwdParams& params, const BwdLaunch& launch, cudaStream_t stream);

#ifdef SAFEATTN_ATTN_BWD_DEFINE_KERNELS

namespace bwd_detail {

// Rows [row0, row0 + kRows) of a [len, kHeadDim] slab (row stride `stride_s` elements) into
// shared memory laid out as Rows; rows at or past `len` become zeros. Each thread walks its rows
// with one pointer (load_tile's kWalk), every round unrolled: an offset computed per 16-byte chunk
// in a loop took 33 instructions a chunk, 16% of the D = 128 dK/dV kernel's (ncu, H200).
template <typename T, class Rows, int kHeadDim, int kRows, int kThreads>
__device__ __forceinline__ void load_rows(T* smem, const T* base, int64_t stride_s, int64_t row0, int64_t len) {
  load_tile<T, kRows, kHeadDim, kThreads, load_rounds(kRows, kHeadDim, kThreads), Rows, true>(
      smem, base + row0 * stride_s, stride_s, len - row0, threadIdx.x);
}

// The exponent of p = 2^x for (query i, key j) from the raw dot product and the row's shift and lo
// (BwdParams::row_shift): the transformed, masked score in the kernel's units minus the row's
// lse; -inf where the element is masked, outside the sequence or its row's key interval (key
// ranges), or hidden by the causal rule.
// `dscore` gets d score / d dot (the chain rule of the scale and the softcap). `plain`: the tile
// is interior, causally visible and all visible in the mask summary, so none of those tests is
// needed. Without softcap, in log2 units (the common case) it is one multiply and one subtract.
template <bool kRanges>
__device__ __forceinline__ float exp2_arg(const BwdParams& p, bool plain, float dot, int64_t b, int64_t h, int64_t i,
                                          int64_t j, float shift, float lo, float& dscore) {
  float x = p.score.score(dot);
  dscore = p.score.derivative(x);
  if (!plain) {
    if (i >= p.q_len || j >= p.kv_len || !p.causal.visible(i, j)) {
      return -INFINITY;
    }
    if (kRanges && (j < p.ranges.lo(b, i) || j >= p.ranges.hi(b, i))) {
      return -INFINITY;
    }
    if (p.mask.kind != MaskKind::kNone) {
      x = p.score.masked(x, p.mask.additive(p.mask.offset(b, h, i, j)));
    }
  }
  return p.score.natural ? (x - shift) * kLog2e - lo : x - shift;
}

// A tile of queries [i0, i0 + rows) x keys [j0, j0 + cols) whose summary class is `cls` needs no
// per-element test: inside both sequences, below the causal diagonal, no mask value but 0.
__device__ __forceinline__ bool plain_tile(const BwdParams& p, uint8_t cls, int64_t i0, int rows, int64_t j0,
                                           int cols) {
  return cls == kTileVisible && i0 + rows <= p.q_len && j0 + cols <= p.kv_len &&
         p.causal.tile_all_visible(i0, j0 + cols);
}

// Two products of the backward at once, for kMTiles 16-row blocks of A: acc1 += A1 B1 and acc2 +=
// A2 B2 over kK, accumulators [kMTiles][kN / 8][4] in the m16n8 layout; each B fragment feeds
// kMTiles MMAs of each product. A1, A2: rows a_row.. of shared tiles laid out as RowsA (row-major
// [m][k]). B1, B2: shared tiles laid out as RowsB, either [n][k] (kTransB false: B^T row-major, as
// Q and dO in S^T = K Q^T and dP^T = V dO^T, or K and V in the dQ kernel's S and dP) or [k][n]
// from column b_col.. (kTransB true, loaded transposed: dO and Q in dV += P^T dO and dK += dS'^T Q).
// kSecond false: acc1 += A1 B1 alone (a2, b2 and acc2 untouched; one_product below).
template <typename T, class RowsA, class RowsB, bool kTransB, int kK, int kMTiles, int kN, bool kSecond = true>
__device__ __forceinline__ void paired_products(float (&acc1)[kMTiles][kN / 8][4], float (&acc2)[kMTiles][kN / 8][4],
                                                const T* a1, const T* a2, int a_row, const T* b1, const T* b2,
                                                int b_col, int lane) {
  // Each lane's ldmatrix row address once; every fragment is that address moved by whole 16-row /
  // 16-column blocks (SmemRows::moved: an XOR or an add the compiler folds, not an offset per load).
  const int a_lane_row = a_row + (lane & 15), a_lane_col = (lane >> 4) * 8;
  const uint32_t a1_lane = smem_address(a1 + RowsA::offset(a_lane_row, a_lane_col));
  const uint32_t a2_lane = smem_address(a2 + RowsA::offset(a_lane_row, a_lane_col));
  // B: [n][k] rows (lane & 7) + (lane >> 4) * 8, column ((lane >> 3) & 1) * 8; or [k][n] (loaded
  // transposed) rows (lane & 7) + ((lane >> 3) & 1) * 8, columns b_col + (lane >> 4) * 8.
  const int b_lane_row = (lane & 7) + (kTransB ? (lane >> 3) & 1 : lane >> 4) * 8;
  const int b_lane_col = kTransB ? b_col + (lane >> 4) * 8 : ((lane >> 3) & 1) * 8;
  const uint32_t b1_lane = smem_address(b1 + RowsB::offset(b_lane_row, b_lane_col));
  const uint32_t b2_lane = smem_address(b2 + RowsB::offset(b_lane_row, b_lane_col));
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t fa1[kMTiles][4], fa2[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      ldmatrix_x4(fa1[mt], RowsA::moved(a1_lane, mt * 16, ks * 16));
      if constexpr (kSecond) {
        ldmatrix_x4(fa2[mt], RowsA::moved(a2_lane, mt * 16, ks * 16));
      }
    }
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t fb1[4], fb2[4];
      if constexpr (kTransB) {
        ldmatrix_x4_trans(fb1, RowsB::moved(b1_lane, ks * 16, np * 16));
      } else {
        ldmatrix_x4(fb1, RowsB::moved(b1_lane, np * 16, ks * 16));
      }
      if constexpr (kSecond && kTransB) {
        ldmatrix_x4_trans(fb2, RowsB::moved(b2_lane, ks * 16, np * 16));
      } else if constexpr (kSecond) {
        ldmatrix_x4(fb2, RowsB::moved(b2_lane, np * 16, ks * 16));
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_pair<T>(acc1[mt][2 * np], acc1[mt][2 * np + 1], fa1[mt], fb1);
        if constexpr (kSecond) {
          mma_pair<T>(acc2[mt][2 * np], acc2[mt][2 * np + 1], fa2[mt], fb2);
        }
      }
    }
  }
}

// acc += A B alone, as paired_products takes each pair.
template <typename T, class RowsA, class RowsB, bool kTransB, int kK, int kMTiles, int kN>
__device__ __forceinline__ void one_product(float (&acc)[kMTiles][kN / 8][4], const T* a, int a_row, const T* b,
                                            int b_col, int lane) {
  paired_products<T, RowsA, RowsB, kTransB, kK, kMTiles, kN, false>(acc, acc, a, a, a_row, b, b, b_col, lane);
}

// Accumulator n-tiles 2 kk and 2 kk + 1 (m16n8, float) as the A fragment of an m16n8k16 product
// over those 16 columns, rounded to T.
template <typename T, int kTiles>
__device__ __forceinline__ void a_fragment(const float (&acc)[kTiles][4], int kk, uint32_t (&a)[4]) {
  a[0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// The top of a step of a kStages-buffered loop: the next step's loads (prefetch(next, buf ^ 1),
// two buffers, when there is a next step) go in flight, this step's are waited for, and the CTA
// syncs.
template <int kStages, class Step, class Prefetch>
__device__ __forceinline__ void begin_step(bool has_next, const Step& next, int buf, Prefetch&& prefetch) {
  if constexpr (kStages == 2) {
    if (has_next) {
      prefetch(next, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
}

// A per-query row value (row shift, row lo, Delta: [kQueries] floats in shared memory, from the
// sub-tile's first query) at the columns of this thread's m16n8 accumulators: columns 8 t + 2 tig
// and 8 t + 2 tig + 1 of n-tile t, which every 16-row block of the accumulators repeats. One
// 8-byte load a pair, into registers, instead of a shared-memory read an element.
template <int kNTiles>
__device__ __forceinline__ void load_columns(const float* values, int tig, float (&columns)[kNTiles][2]) {
#pragma unroll
  for (int t = 0; t < kNTiles; ++t) {
    const float2 pair = *reinterpret_cast<const float2*>(values + t * 8 + 2 * tig);
    columns[t][0] = pair.x;
    columns[t][1] = pair.y;
  }
}

// Every float of an accumulator array (float[...][4], any rank) set to 0.
template <class Acc>
__device__ __forceinline__ void zero_fill(Acc& acc) {
  static_assert(std::is_same_v<std::remove_all_extents_t<Acc>, float>, "float accumulators");
  float* values = reinterpret_cast<float*>(&acc);
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(Acc) / sizeof(float)); ++k) {
    values[k] = 0.0f;
  }
}

// ---- dK / dV ---------------------------------------------------------------------------------

// address[0..3] += values in global memory (16-byte aligned), the result unused: RED, not ATOM.
// One 16-byte red.global.add.v4.f32 on sm_90, four 4-byte ones before. In PTX, with the global
// state space named: from a pointer the compiler cannot trace to global memory, atomicAdd would
// be a generic ATOM (sm_90) or test for shared memory (sm_80).
__device__ __forceinline__ void red_add_quad(float* address, const float (&values)[4]) {
  const size_t global = __cvta_generic_to_global(address);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(global), "f"(values[0]), "f"(values[1]),
               "f"(values[2]), "f"(values[3])
               : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(global), "f"(values[0]) : "memory");
  asm volatile("red.global.add.f32 [%0+4], %1;" ::"l"(global), "f"(values[1]) : "memory");
  asm volatile("red.global.add.f32 [%0+8], %1;" ::"l"(global), "f"(values[2]) : "memory");
  asm volatile("red.global.add.f32 [%0+12], %1;" ::"l"(global), "f"(values[3]) : "memory");
#endif
}

// The atomic mode's dQ of one dK/dV step: dQ[i0 + m, :] += sum over the tile's keys j of
// dS'[m, j] K[j, :], for the step's queries m < Cfg::kQueries of query head h, added into
// p.dq_accum (DqAccumLayout) with red.global.add, a tile a warp instruction (16-row blocks wholly
// past q_len are not written; the rows past q_len of the others hold dS' = 0, and the buffer has
// room for them).
// ds_s: dS'^T [kKeys][kPStride] (keys along rows); k_s: K [kKeys] rows laid out as Cfg::Rows.
// dS' already holds d score / d(q.k) (the scale, the softcap's derivative): no scale here. The
// work is Cfg::kDqJobs jobs of kDqRows queries x kDqCols head-dim columns, dealt round the warps.
template <typename T, class Cfg>
__device__ __forceinline__ void add_step_dq(const BwdParams& p, const T* ds_s, const T* k_s, int64_t b, int64_t h,
                                            int64_t i0, int warp, int lane) {
  using Rows = typename Cfg::Rows;
  constexpr int kMTiles = Cfg::kDqRows / 16;
  constexpr int kNTiles = Cfg::kDqCols / 8;
  constexpr int kColBlocks = Cfg::kHeadDim / Cfg::kDqCols;
  auto job_dq = [&](int job) {
    const int row0 = Cfg::kDqRows * (job / kColBlocks);  // the job's queries within the step
    const int col0 = Cfg::kDqCols * (job % kColBlocks);  // and head-dim columns
    float acc[kMTiles][kNTiles][4];
    zero_fill(acc);
    // A = dS' [queries x keys] from its transpose: matrix l / 8 of the x4 is (queries +8 when l / 8
    // is odd, keys +8 when l / 8 >= 2), as ldmatrix_x4 reads a row-major A. B = K [keys x head
    // dim] loaded transposed, as the dQ kernel does. Lane addresses once, moved by 16-key blocks
    // (and A by 16-query blocks).
    using PRows = SmemRows<Cfg::kQueries>;
    const uint32_t a_lane =
        smem_address(ds_s + PRows::offset((lane & 7) + ((lane >> 4) & 1) * 8, row0 + ((lane >> 3) & 1) * 8));
    const uint32_t b_lane =
        smem_address(k_s + Rows::offset((lane & 7) + ((lane >> 3) & 1) * 8, col0 + (lane >> 4) * 8));
#pragma unroll
    for (int kk = 0; kk < Cfg::kKeys / 16; ++kk) {
      uint32_t a_ds[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ldmatrix_x4_trans(a_ds[mt], PRows::moved(a_lane, kk * 16, mt * 16));
      }
#pragma unroll
      for (int dp = 0; dp < Cfg::kDqCols / 16; ++dp) {
        uint32_t b_k[4];
        ldmatrix_x4_trans(b_k, Rows::moved(b_lane, kk * 16, dp * 16));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_pair<T>(acc[mt][2 * dp], acc[mt][2 * dp + 1], a_ds[mt], b_k);
        }
      }
    }
    // Each 16 x 8 accumulator tile whole, the lane's four values at 4 lane of its DqAccumLayout
    // tile: one address for the thread, the rest constant offsets from it (16 rows: 16 D floats;
    // 8 columns: a tile, 128). The address is opaque to the compiler so that it is made once,
    // here: left to itself, nvcc 13.0 rebuilt it (64-bit products) inside each block's branch.
    const int64_t first_row = i0 + row0;
    const int64_t rows_left = p.q_len - first_row;
    float* dq_thread =
        p.dq_accum + DqAccumLayout::tile(b * p.hq + h, p.q_len, Cfg::kHeadDim, first_row, col0) + 4 * lane;
    asm("" : "+l"(dq_thread));
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if (mt * 16 < rows_left) {
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
          red_add_quad(dq_thread + mt * 16 * Cfg::kHeadDim + t * DqAccumLayout::kTileFloats, acc[mt][t]);
        }
      }
    }
  };
  if constexpr (Cfg::kDqJobs == Cfg::kWarps) {
    job_dq(warp);
  } else {
#pragma unroll 1
    for (int job = warp; job < Cfg::kDqJobs; job += Cfg::kWarps) {
      job_dq(job);
    }
  }
}

// One CTA per (key tile, kv head, batch) in the shape Cfg (BwdTiles); kAtomicDq: also dQ of every
// step, added into p.dq_accum (the atomic mode, see the top).
template <typename T, class Cfg, bool kAtomicDq>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) attention_bwd_dkdv_kernel(const BwdParams p) {
  using Rows = typename Cfg::Rows;
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr int kStride = Cfg::kStride, kPStride = Cfg::kPStride;
  constexpr int kKeys = Cfg::kKeys, kQueries = Cfg::kQueries, kSubQueries = Cfg::kSubQueries;
  constexpr int kStages = Cfg::kStages, kThreads = Cfg::kThreads;
  constexpr int kMTiles = Cfg::kWarpKeys / 16;        // 16-key blocks of a warp's S^T block
  constexpr int kQTiles = kSubQueries / 8;            // n-tiles of the score tiles
  constexpr int kDkvMTiles = Cfg::kDkvWarpKeys / 16;  // 16-key blocks of a warp's dK / dV
  constexpr int kDTiles = Cfg::kDkvWarpCols / 8;      // n-tiles of the dK / dV accumulators

  extern __shared__ __align__(1024) unsigned char smem_raw[];  // 1024: SmemRows::moved
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + kKeys * kStride;
  T* q_s = v_s + kKeys * kStride;                                                // [kStages][kQueries] rows
  T* do_s = q_s + kStages * kQueries * kStride;                                  // [kStages][kQueries] rows
  float* lse_s = reinterpret_cast<float*>(do_s + kStages * kQueries * kStride);  // [kStages][kQueries] row shift
  float* lo_s = lse_s + kStages * kQueries;                                      // [kStages][kQueries] row lo
  float* delta_s = lo_s + kStages * kQueries;                                    // [kStages][kQueries]
  // dS'^T of the step, [kKeys][kPStride] (past Cfg::kTilesSmem, 16-byte aligned): with P^T in
  // shared memory or atomic dQ. Then P^T, the same shape, with P^T in shared memory.
  T* ds_s = reinterpret_cast<T*>(delta_s + kStages * kQueries);
  T* p_s = ds_s + kKeys * kPStride;

  // The CTA's key tile (rank 0: under causality the longest, every query sees it), kv head and
  // batch, read again where used (GridCoords): not held in registers across the query loop.
  const GridCoords cta = grid_coords(smem_raw + Cfg::smem_bytes(kAtomicDq) - kGridCoordBytes, p.head_group_dkdv);
  auto j0_at = [&] { return int64_t{cta.rank()} * kKeys; };
  const int64_t group = p.hq / p.hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  // This warp's block of S^T (keys key_row0.., queries query0.. of the step) and of dK / dV (keys
  // dkv_key0.., head-dim columns dkv_col0..); with P^T in registers, 16 keys and every column.
  const int key_row0 = warp % Cfg::kWarpsK * Cfg::kWarpKeys;
  const int query0 = warp / Cfg::kWarpsK * Cfg::kWarpQueries;
  const int dkv_key0 = warp / Cfg::kDkvCols * Cfg::kDkvWarpKeys;
  const int dkv_col0 = warp % Cfg::kDkvCols * Cfg::kDkvWarpCols;

  const T* k_base = static_cast<const T*>(p.key) + cta.batch() * p.k_stride_b + cta.head() * p.k_stride_h;
  const T* v_base = static_cast<const T*>(p.value) + cta.batch() * p.v_stride_b + cta.head() * p.v_stride_h;
  load_rows<T, Rows, kHeadDim, kKeys, kThreads>(k_s, k_base, p.k_stride_s, j0_at(), p.kv_len);
  load_rows<T, Rows, kHeadDim, kKeys, kThreads>(v_s, v_base, p.v_stride_s, j0_at(), p.kv_len);
  cp_async_commit();

  // Queries before first_query(j0) see no key of this tile (j0 is its smallest key).
  const int64_t q_tiles = (p.q_len + kQueries - 1) / kQueries;
  const int64_t first_tile = p.causal.first_query(j0_at(), p.q_len) / kQueries;
  const int64_t tiles_per_head = q_tiles - first_tile;
  const int64_t steps = group * tiles_per_head;

  // Step s: query head hk * group + s / tiles_per_head, query tile first_tile + s % tiles_per_head,
  // both carried along (no division a step).
  struct Step {
    int64_t index, h, q_tile;
  };
  auto advance = [&](Step at) {
    ++at.index;
    if (++at.q_tile == q_tiles) {
      at.q_tile = first_tile;
      ++at.h;
    }
    return at;
  };
  // The first step from `at` on whose tile the mask summary does not prove fully masked: the
  // others contribute exactly 0 and are skipped without reading Q, dO or the mask. A head's
  // column ends at its last query tile not masked (the summary's query_end): the rest of it is
  // not walked.
  auto next_step = [&](Step at) {
    while (steps > at.index) {
      if (at.q_tile >= p.tiles_dkdv.query_end_at(cta.batch(), at.h, cta.rank())) {
        at.index += q_tiles - at.q_tile;  // the next head's first tile
        at.q_tile = first_tile;
        ++at.h;
      } else if (p.tiles_dkdv.at(cta.batch(), at.h, at.q_tile, cta.rank()) == kTileMasked) {
        at = advance(at);
      } else {
        break;
      }
    }
    return at;
  };
  auto prefetch = [&](const Step& at, int buf) {
    const int64_t h = at.h;
    const int64_t i0 = at.q_tile * kQueries;
    const T* q_base = static_cast<const T*>(p.query) + cta.batch() * p.q_stride_b + h * p.q_stride_h;
    const T* do_base = static_cast<const T*>(p.grad_out) + cta.batch() * p.do_stride_b + h * p.do_stride_h;
    load_rows<T, Rows, kHeadDim, kQueries, kThreads>(q_s + buf * kQueries * kStride, q_base, p.q_stride_s, i0, p.q_len);
    load_rows<T, Rows, kHeadDim, kQueries, kThreads>(do_s + buf * kQueries * kStride, do_base, p.do_stride_s, i0,
                                                     p.q_len);
    const int64_t row0 = (cta.batch() * p.hq + h) * p.q_len;
    // By cp.async, in the group of the step's tiles: a plain load would hold the thread until the
    // value arrives (its store to shared memory waits on it), and with one Q/dO buffer it stood
    // before the step's dQ (ncu, H200, D=64: 6% of the dK/dV kernel's stall samples).
    auto load_row_values = [&](int r) {
      const int64_t at = row0 + i0 + r;
      const int slot = buf * kQueries + r;
      if (i0 + r < p.q_len) {
        cp_async_4(lse_s + slot, p.row_shift + at);
        cp_async_4(delta_s + slot, p.delta + at);
        if (p.score.natural) {
          cp_async_4(lo_s + slot, p.row_lo + at);
        } else {
          lo_s[slot] = 0.0f;
        }
      } else {
        lse_s[slot] = INFINITY;
        lo_s[slot] = 0.0f;
        delta_s[slot] = 0.0f;
      }
    };
    if constexpr (kQueries <= kThreads) {
      // One row a thread (every shape): a test, not a loop the compiler unrolls with a remainder.
      if (threadIdx.x < kQueries) {
        load_row_values(threadIdx.x);
      }
    } else {
      for (int r = threadIdx.x; r < kQueries; r += kThreads) {
        load_row_values(r);
      }
    }
  };

  float dk_acc[kDkvMTiles][kDTiles][4];
  float dv_acc[kDkvMTiles][kDTiles][4];
  zero_fill(dk_acc);
  zero_fill(dv_acc);

  Step step = next_step(Step{0, cta.head() * group, first_tile});
  if (steps > step.index) {
    prefetch(step, 0);
  }
  cp_async_commit();
  for (int buf = 0; steps > step.index; buf = kStages == 2 ? buf ^ 1 : 0) {
    const Step next = next_step(advance(step));
    begin_step<kStages>(steps > next.index, next, buf, prefetch);

    const int64_t h = step.h;
    const int64_t q_tile = step.q_tile;
    const int64_t i0 = q_tile * kQueries;
    const uint8_t tile_class = p.tiles_dkdv.at(cta.batch(), h, q_tile, cta.rank());
    const bool plain = plain_tile(p, tile_class, i0, kQueries, j0_at(), kKeys);
    // kFoldScale's cases, in log2 units without softcap: a plain tile (folded), or one whose only
    // per-element tests are the causal rule, the sequence ends and a mask's diagonal (bounded: the
    // causal diagonal, the last tiles of odd lengths, a bool mask's kTileDiagonal tiles), made in
    // tile coordinates by tile_bounds.
    const bool log2_scaled = !p.score.natural && p.score.softcap_post == 0.0f;
    const bool folded = plain && log2_scaled;
    const bool bounded = !plain && log2_scaled && (tile_class == kTileVisible || tile_class == kTileDiagonal);
    const T* q_buf = q_s + buf * kQueries * kStride;
    const T* do_buf = do_s + buf * kQueries * kStride;

    // The warp's queries in sub-tiles of kSubQueries, so that the two score tiles of one
    // sub-tile are all the registers the scores take (not unrolled: the same registers serve
    // every sub-tile).
#pragma unroll 1
    for (int sub = 0; sub < Cfg::kWarpQueries / kSubQueries; ++sub) {
      const int q0 = query0 + sub * kSubQueries;  // the sub-tile's first query within the step
      const T* qt = q_buf + q0 * kStride;
      const T* dot = do_buf + q0 * kStride;
      const float* lse_t = lse_s + buf * kQueries + q0;
      const float* lo_t = lo_s + buf * kQueries + q0;
      const float* delta_t = delta_s + buf * kQueries + q0;

      // S^T = K Q^T and dP^T = V dO^T for this warp's keys and the sub-tile's queries.
      float st[kMTiles][kQTiles][4];
      float dpt[kMTiles][kQTiles][4];
      zero_fill(st);
      zero_fill(dpt);
      if constexpr (Cfg::kPairScores) {
        paired_products<T, Rows, Rows, false, kHeadDim, kMTiles, kSubQueries>(st, dpt, k_s, v_s, key_row0, qt, dot, 0,
                                                                              lane);
      } else {
        one_product<T, Rows, Rows, false, kHeadDim, kMTiles, kSubQueries>(st, k_s, key_row0, qt, 0, lane);
        one_product<T, Rows, Rows, false, kHeadDim, kMTiles, kSubQueries>(dpt, v_s, key_row0, dot, 0, lane);
      }

      // P^T and dS'^T in place (st holds p, dpt holds dS'): prob(mt, t, e, dscore) gives an
      // element's p and d score / d dot; its column is 8 t + 2 tig + (e & 1), its key 16 mt + g +
      // 8 (e >> 1) from key_row0. The row shift and Delta of the thread's columns are read into
      // registers first (load_columns), within each branch so that they live only where used; row
      // lo (natural units, the general path only) is read an element.
      float col_shift[kQTiles][2], col_delta[kQTiles][2];
      // P^T and dS'^T of n-tile t of 16-key block mt to shared memory (P^T through shared
      // memory): rows key_row0 + 16 mt + g (+8), columns q0 + 8 t + 2 tig (+1), one 32-bit pair
      // per store.
      auto store_p_and_ds = [&](int mt, int t) {
        const int offset = (key_row0 + mt * 16 + g) * kPStride + q0 + t * 8 + 2 * tig;
        *reinterpret_cast<uint32_t*>(p_s + offset) = pack2<T>(st[mt][t][0], st[mt][t][1]);
        *reinterpret_cast<uint32_t*>(p_s + offset + 8 * kPStride) = pack2<T>(st[mt][t][2], st[mt][t][3]);
        *reinterpret_cast<uint32_t*>(ds_s + offset) = pack2<T>(dpt[mt][t][0], dpt[mt][t][1]);
        *reinterpret_cast<uint32_t*>(ds_s + offset + 8 * kPStride) = pack2<T>(dpt[mt][t][2], dpt[mt][t][3]);
      };
      // kPairScores false stores each n-tile as soon as it is made, so that no score tile outlives
      // its store: made in one pass and stored in another, its 32-query sub-tiles spilled 296 bytes
      // there (nvcc 13.0, sm_90; 0 this way). The shipped shapes keep the two passes until this is
      // measured on them (D = 128's large shape: 8 -> 20 bytes of spill stores this way).
      constexpr bool kStoreAsMade = !Cfg::kPInRegs && !Cfg::kPairScores;
      auto to_p_and_ds = [&](auto&& prob) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int t = 0; t < kQTiles; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float dscore;
              const float pr = prob(mt, t, e, dscore);
              st[mt][t][e] = pr;
              dpt[mt][t][e] = pr * (dpt[mt][t][e] - col_delta[t][e & 1]) * dscore;
            }
            if constexpr (kStoreAsMade) {
              store_p_and_ds(mt, t);
            }
          }
        }
      };
      if (Cfg::kFoldScale && folded) {
        load_columns(lse_t, tig, col_shift);
        load_columns(delta_t, tig, col_delta);
        to_p_and_ds([&](int mt, int t, int e, float& dscore) {
          dscore = p.score.natural_scale;
          return fast_exp2(fmaf(st[mt][t][e], p.score.scale, -col_shift[t][e & 1]));
        });
      } else if (Cfg::kFoldScale && bounded) {
        // The last visible key row of each of the thread's columns, from its first row key_row0 + g.
        int col_last[kQTiles][2];
        TileBounds bounds = tile_bounds(p.causal, p.q_len, p.kv_len, i0, kQueries, j0_at(), kKeys);
        if (tile_class == kTileDiagonal) {  // query r sees keys c <= r + the mask's diagonal too
          bounds.diagonal = min(bounds.diagonal, p.tiles_dkdv.diagonal_at(cta.batch(), h, q_tile, cta.rank()));
        }
#pragma unroll
        for (int t = 0; t < kQTiles; ++t) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            col_last[t][c] = bounds.last_key(q0 + t * 8 + 2 * tig + c) - (key_row0 + g);
          }
        }
        load_columns(lse_t, tig, col_shift);
        load_columns(delta_t, tig, col_delta);
        // p as exp2_arg makes it (the product and the difference each rounded): the same bits as
        // on the general path.
        to_p_and_ds([&](int mt, int t, int e, float& dscore) {
          dscore = p.score.natural_scale;
          const bool visible = mt * 16 + (e >> 1) * 8 <= col_last[t][e & 1];
          return fast_exp2(visible ? __fmul_rn(st[mt][t][e], p.score.scale) - col_shift[t][e & 1] : -INFINITY);
        });
      } else {
        load_columns(lse_t, tig, col_shift);
        load_columns(delta_t, tig, col_delta);
        const int64_t b = cta.batch(), j_first = j0_at() + key_row0;
        to_p_and_ds([&](int mt, int t, int e, float& dscore) {
          const int col = t * 8 + 2 * tig + (e & 1);
          const int64_t i = i0 + q0 + col;
          const int64_t j = j_first + mt * 16 + g + (e >> 1) * 8;
          return fast_exp2(
              exp2_arg<Cfg::kReadsRanges>(p, plain, st[mt][t][e], b, h, i, j, col_shift[t][e & 1], lo_t[col], dscore));
        });
      }

      if constexpr (Cfg::kPInRegs) {
        // dV += P^T dO and dK += dS'^T Q: A from the registers above, B = dO / Q loaded transposed
        // (lane addresses once, moved by 16-query / 16-column blocks).
        const int b_lane_row = (lane & 7) + ((lane >> 3) & 1) * 8, b_lane_col = (lane >> 4) * 8;
        const uint32_t do_lane = smem_address(dot + Rows::offset(b_lane_row, b_lane_col));
        const uint32_t q_lane = smem_address(qt + Rows::offset(b_lane_row, b_lane_col));
#pragma unroll
        for (int kk = 0; kk < kSubQueries / 16; ++kk) {
          uint32_t a_p[4], a_ds[4];
          a_fragment<T>(st[0], kk, a_p);
          a_fragment<T>(dpt[0], kk, a_ds);
          if constexpr (kAtomicDq) {
            // dS'^T as the registers hold it: rows key_row0 + g (+8), columns q0 + 2 * tig (+1) of
            // the n-tiles 2 * kk and 2 * kk + 1, one 32-bit pair per store.
            T* ds_row = ds_s + (key_row0 + g) * kPStride + q0 + kk * 16 + 2 * tig;
            *reinterpret_cast<uint32_t*>(ds_row) = a_ds[0];
            *reinterpret_cast<uint32_t*>(ds_row + 8 * kPStride) = a_ds[1];
            *reinterpret_cast<uint32_t*>(ds_row + 8) = a_ds[2];
            *reinterpret_cast<uint32_t*>(ds_row + 8 * kPStride + 8) = a_ds[3];
          }
#pragma unroll
          for (int dp = 0; dp < kHeadDim / 16; ++dp) {
            uint32_t b_do[4], b_q[4];
            ldmatrix_x4_trans(b_do, Rows::moved(do_lane, kk * 16, dp * 16));
            ldmatrix_x4_trans(b_q, Rows::moved(q_lane, kk * 16, dp * 16));
            mma_pair<T>(dv_acc[0][2 * dp], dv_acc[0][2 * dp + 1], a_p, b_do);
            mma_pair<T>(dk_acc[0][2 * dp], dk_acc[0][2 * dp + 1], a_ds, b_q);
          }
        }
      } else if constexpr (!kStoreAsMade) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int t = 0; t < kQTiles; ++t) {
            store_p_and_ds(mt, t);
          }
        }
      }
    }
    if constexpr (!Cfg::kPInRegs) {
      // dV += P^T dO and dK += dS'^T Q over the step's queries, for this warp's keys x columns: A
      // from p_s / ds_s, B = dO / Q loaded transposed. First every warp's P^T and dS'^T are in
      // shared memory.
      __syncthreads();
      paired_products<T, SmemRows<kQueries>, Rows, true, kQueries, kDkvMTiles, Cfg::kDkvWarpCols>(
          dv_acc, dk_acc, p_s, ds_s, dkv_key0, do_buf, q_buf, dkv_col0, lane);
    }
    // With one Q/dO buffer, the next step's Q and dO load as soon as no warp reads this step's:
    // with atomic dQ, before this step's dQ (which reads only dS'^T and K), so that the loads
    // overlap it; the next step's top waits for them and syncs before anything is overwritten.
    // ncu (H200, D=64, B4 H16 S4096 causal) had 6% of the kernel's stall samples at the step's
    // end barrier with the loads after the dQ.
    auto prefetch_single = [&] {
      if constexpr (kStages == 1) {
        if (steps > next.index) {
          prefetch(next, 0);
        }
        cp_async_commit();
      }
    };
    if constexpr (kAtomicDq) {
      __syncthreads();  // every warp's dS'^T is in ds_s; no warp reads Q, dO or the row values
      prefetch_single();
      add_step_dq<T, Cfg>(p, ds_s, k_s, cta.batch(), h, i0, warp, lane);
      if constexpr (kStages == 2) {
        __syncthreads();  // ds_s and the other buffer are refilled by the next step
      }
    } else {
      __syncthreads();  // this buffer (and p_s, ds_s) is refilled by the next step
      prefetch_single();
    }
    step = next;
  }
  cp_async_wait<0>();

  // Rows g and g + 8 of each of this warp's 16-key blocks, columns 2 * tig (+1) of every n-tile.
  T* gk = static_cast<T*>(p.grad_key) + ((cta.batch() * p.hkv + cta.head()) * p.kv_len) * kHeadDim;
  T* gv = static_cast<T*>(p.grad_value) + ((cta.batch() * p.hkv + cta.head()) * p.kv_len) * kHeadDim;
  const int64_t j_first = j0_at() + dkv_key0;
#pragma unroll
  for (int mt = 0; mt < kDkvMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t j = j_first + mt * 16 + g + half * 8;
      if (j >= p.kv_len) {
        continue;
      }
#pragma unroll
      for (int t = 0; t < kDTiles; ++t) {
        const int col = dkv_col0 + t * 8 + 2 * tig;
        *reinterpret_cast<uint32_t*>(gk + j * kHeadDim + col) =
            pack2<T>(dk_acc[mt][t][2 * half], dk_acc[mt][t][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(gv + j * kHeadDim + col) =
            pack2<T>(dv_acc[mt][t][2 * half], dv_acc[mt][t][2 * half + 1]);
      }
    }
  }
}

// ---- dQ (and the mask gradient) --------------------------------------------------------------

template <typename T, int kHeadDim, bool kRanges = false>
__global__ void __launch_bounds__(DqConfig<kHeadDim>::kThreads) attention_bwd_dq_kernel(const BwdParams p) {
  using Tr = DqConfig<kHeadDim>;
  constexpr int kStride = Tr::kStride;
  constexpr int kQueries = Tr::kDqQueries;
  constexpr int kKeys = Tr::kDqKeys;
  constexpr int kKTiles = kKeys / 8;
  constexpr int kDTiles = kHeadDim / 8;

  extern __shared__ __align__(1024) unsigned char smem_raw[];  // 1024: SmemRows::moved
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* do_s = q_s + kQueries * kStride;
  T* k_s = do_s + kQueries * kStride;  // [2][kKeys][kStride]
  T* v_s = k_s + 2 * kKeys * kStride;  // [2][kKeys][kStride]

  // Last query tile first: with causal it sees the most keys, and the long CTAs should start
  // early rather than form the tail of the grid. Head after head: the dK/dV kernel's order by
  // groups (GridCoords) cost this kernel spills at 255 registers, and it runs only deterministic.
  const int64_t q_tile = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x);
  const int64_t i0 = q_tile * kQueries;
  const int64_t h = blockIdx.y;
  const int64_t b_rel = blockIdx.z;
  const int64_t b = p.batch_begin + b_rel;
  const int64_t hk = h / (p.hq / p.hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;

  const T* q_base = static_cast<const T*>(p.query) + b * p.q_stride_b + h * p.q_stride_h;
  const T* do_base = static_cast<const T*>(p.grad_out) + b * p.do_stride_b + h * p.do_stride_h;
  const T* k_base = static_cast<const T*>(p.key) + b * p.k_stride_b + hk * p.k_stride_h;
  const T* v_base = static_cast<const T*>(p.value) + b * p.v_stride_b + hk * p.v_stride_h;
  load_rows<T, typename Tr::Rows, kHeadDim, kQueries, Tr::kThreads>(q_s, q_base, p.q_stride_s, i0, p.q_len);
  load_rows<T, typename Tr::Rows, kHeadDim, kQueries, Tr::kThreads>(do_s, do_base, p.do_stride_s, i0, p.q_len);
  cp_async_commit();

  const int query_row = warp * 16;  // this warp's queries within the tile
  // This thread's two rows: shift and lo (BwdParams::row_shift) and Delta; rows past q_len get p = 0.
  float row_lse[2], row_lo[2], row_delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t i = i0 + query_row + g + half * 8;
    const int64_t row = (b * p.hq + h) * p.q_len + i;
    row_lse[half] = i < p.q_len ? p.row_shift[row] : INFINITY;
    row_lo[half] = i < p.q_len && p.score.natural ? p.row_lo[row] : 0.0f;
    row_delta[half] = i < p.q_len ? p.delta[row] : 0.0f;
  }

  // Key tiles past kv_end hold no key visible to these queries (causal) and are not read.
  const int64_t q_end = i0 + kQueries < p.q_len ? i0 + kQueries : p.q_len;
  const int64_t kv_end = p.causal.kv_end(q_end, p.kv_len);
  const int64_t steps = (kv_end + kKeys - 1) / kKeys;

  auto prefetch = [&](int64_t step, int buf) {
    load_rows<T, typename Tr::Rows, kHeadDim, kKeys, Tr::kThreads>(k_s + buf * kKeys * kStride, k_base, p.k_stride_s,
                                                                   step * kKeys, p.kv_len);
    load_rows<T, typename Tr::Rows, kHeadDim, kKeys, Tr::kThreads>(v_s + buf * kKeys * kStride, v_base, p.v_stride_s,
                                                                   step * kKeys, p.kv_len);
  };

  float dq_acc[kDTiles][4];
  zero_fill(dq_acc);
  float* gm_base = p.grad_mask != nullptr ? p.grad_mask + (b_rel * p.hq + h) * p.q_len * p.kv_len : nullptr;
  // The mask gradient of keys [j_begin, j_end) that no step visits (all masked for these
  // queries): 0.
  auto zero_mask_grad = [&](int64_t j_begin, int64_t j_end) {
    const int64_t width = (j_end < p.kv_len ? j_end : p.kv_len) - j_begin;
    if (gm_base == nullptr || width <= 0) {
      return;
    }
    for (int64_t e = threadIdx.x; e < kQueries * width; e += Tr::kThreads) {
      const int64_t i = i0 + e / width;
      if (i < p.q_len) {
        gm_base[i * p.kv_len + j_begin + e % width] = 0.0f;
      }
    }
  };
  // The first key tile from `step` on that the mask summary does not prove fully masked; the
  // skipped ones are read by nobody and get their zero mask gradient here.
  auto next_step = [&](int64_t step) {
    while (step < steps && p.tiles_dq.at(b, h, q_tile, step) == kTileMasked) {
      zero_mask_grad(step * kKeys, (step + 1) * kKeys);
      ++step;
    }
    return step;
  };

  // From the row's first key tile not masked (the summary's record); the tiles before it get
  // their zero mask gradient at once.
  const int64_t first_step = std::min<int64_t>(p.tiles_dq.first_visible_at(b, h, q_tile), steps);
  zero_mask_grad(0, first_step * kKeys);
  int64_t step = next_step(first_step);
  if (step < steps) {
    prefetch(step, 0);
  }
  cp_async_commit();
  for (int buf = 0; step < steps; buf ^= 1) {
    const int64_t next = next_step(step + 1);
    begin_step<2>(next < steps, next, buf, prefetch);

    const T* kt = k_s + buf * kKeys * kStride;
    const T* vt = v_s + buf * kKeys * kStride;
    const int64_t j0 = step * kKeys;
    const bool plain = plain_tile(p, p.tiles_dq.at(b, h, q_tile, step), i0, kQueries, j0, kKeys);

    float s_tile[1][kKTiles][4];
    float dp_tile[1][kKTiles][4];
    float(&s_acc)[kKTiles][4] = s_tile[0];
    float(&dp_acc)[kKTiles][4] = dp_tile[0];
    zero_fill(s_tile);
    zero_fill(dp_tile);
    paired_products<T, typename Tr::Rows, typename Tr::Rows, false, kHeadDim, 1, kKeys>(s_tile, dp_tile, q_s, do_s,
                                                                                        query_row, kt, vt, 0, lane);

    // dS (the mask gradient) and dS' (dp_acc, in place).
#pragma unroll
    for (int t = 0; t < kKTiles; ++t) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t i = i0 + query_row + g + half * 8;
        float ds[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 2 * half + c;
          const int64_t j = j0 + t * 8 + 2 * tig + c;
          float dscore;
          const float prob =
              fast_exp2(exp2_arg<kRanges>(p, plain, s_acc[t][e], b, h, i, j, row_lse[half], row_lo[half], dscore));
          ds[c] = prob * (dp_acc[t][e] - row_delta[half]);
          dp_acc[t][e] = ds[c] * dscore;
        }
        if (gm_base != nullptr && i < p.q_len) {
          const int64_t j = j0 + t * 8 + 2 * tig;
          float* dst = gm_base + i * p.kv_len + j;
          if (j + 1 < p.kv_len && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
            *reinterpret_cast<float2*>(dst) = make_float2(ds[0], ds[1]);
          } else {
            if (j < p.kv_len) {
              dst[0] = ds[0];
            }
            if (j + 1 < p.kv_len) {
              dst[1] = ds[1];
            }
          }
        }
      }
    }

    // dQ += dS' K: A from the registers, B = K loaded transposed.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t a_ds[4];
      a_fragment<T>(dp_acc, kk, a_ds);
      const int b_row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        const int b_col = dp * 16 + (lane >> 4) * 8;
        uint32_t b_k[4];
        ldmatrix_x4_trans(b_k, kt + b_row * kStride + b_col);
        mma_16816<T>(dq_acc[2 * dp], a_ds, {b_k[0], b_k[1]});
        mma_16816<T>(dq_acc[2 * dp + 1], a_ds, {b_k[2], b_k[3]});
      }
    }
    __syncthreads();  // this buffer is refilled by the next step's prefetch
    step = next;
  }
  cp_async_wait<0>();
  zero_mask_grad(steps * kKeys, p.kv_len);  // past kv_end: hidden by the causal rule

  T* gq = static_cast<T*>(p.grad_query) + ((b * p.hq + h) * p.q_len) * kHeadDim;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t i = i0 + query_row + g + half * 8;
    if (i >= p.q_len) {
      continue;
    }
#pragma unroll
    for (int t = 0; t < kDTiles; ++t) {
      const int col = t * 8 + 2 * tig;
      *reinterpret_cast<uint32_t*>(gq + i * kHeadDim + col) = pack2<T>(dq_acc[t][2 * half], dq_acc[t][2 * half + 1]);
    }
  }
}

// The head group of a (tiles, heads, batches) grid of which resident_ctas CTAs run at once:
// head_group_for's (tile_order.h) where its tiles differ in length (`uneven`: causality or a mask
// summary) and it has at most INT32_MAX CTAs (longest_first's arithmetic); 1 otherwise. The
// forward's L2-sized groups lost in the sm_90a backward (notes: "Causal tile order").
inline int grid_head_group(bool uneven, dim3 grid, int resident_ctas) {
  const int64_t heads = int64_t{grid.y} * grid.z;
  if (!uneven || heads * grid.x > INT32_MAX) {
    return 1;
  }
  return head_group_for(static_cast<int>(grid.x), static_cast<int>(heads), resident_ctas);
}

#ifndef SAFEATTN_STANDALONE
// The dK/dV kernel of shape Cfg; params.dq_accum set: the atomic mode, dQ added by this kernel
// (the caller then skips the dQ kernel).
template <typename T, class Cfg>
void launch_dkdv_shape(const BwdParams& params, int64_t batch, cudaStream_t stream) {
  const bool atomic_dq = params.dq_accum != nullptr;
  auto* kernel = atomic_dq ? &attention_bwd_dkdv_kernel<T, Cfg, true> : &attention_bwd_dkdv_kernel<T, Cfg, false>;
  const size_t smem = Cfg::smem_bytes(atomic_dq);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((params.kv_len + Cfg::kKeys - 1) / Cfg::kKeys),
                  static_cast<unsigned>(params.hkv), static_cast<unsigned>(batch));
  BwdParams grid_p = params;
  grid_p.head_group_dkdv =
      grid_head_group(params.causal.enabled || params.tiles_dkdv.ptr != nullptr, grid,
                      atomic_dq ? resident_ctas<&attention_bwd_dkdv_kernel<T, Cfg, true>>(Cfg::kThreads, smem)
                                : resident_ctas<&attention_bwd_dkdv_kernel<T, Cfg, false>>(Cfg::kThreads, smem));
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(grid_p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The shape's dK/dV kernel, with the key ranges' test where the call has key ranges.
template <typename T, class Cfg>
void launch_dkdv(const BwdParams& params, int64_t batch, cudaStream_t stream) {
  if constexpr (kMmaSyncReadsKeyRanges) {
    if (params.ranges.ptr != nullptr) {
      launch_dkdv_shape<T, WithRanges<Cfg>>(params, batch, stream);
      return;
    }
  }
  launch_dkdv_shape<T, Cfg>(params, batch, stream);
}
#endif

}  // namespace bwd_detail

#ifndef SAFEATTN_STANDALONE
template <typename T, int kHeadDim>
void launch_attention_bwd(const BwdParams& params, const BwdLaunch& launch, cudaStream_t stream) {
  if (launch.run_dkdv) {
    if (launch.large_tiles) {
      bwd_detail::launch_dkdv<T, DkvConfig<kHeadDim, true>>(params, launch.batch, stream);
    } else {
      bwd_detail::launch_dkdv<T, DkvConfig<kHeadDim, false>>(params, launch.batch, stream);
    }
  }
  if (launch.run_dq) {
    using Tr = DqConfig<kHeadDim>;
    auto* kernel = &bwd_detail::attention_bwd_dq_kernel<T, kHeadDim, false>;
    if constexpr (kMmaSyncReadsKeyRanges) {
      if (params.ranges.ptr != nullptr) {
        kernel = &bwd_detail::attention_bwd_dq_kernel<T, kHeadDim, true>;
      }
    }
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Tr::kDqSmem)));
    const dim3 grid(static_cast<unsigned>((params.q_len + Tr::kDqQueries - 1) / Tr::kDqQueries),
                    static_cast<unsigned>(params.hq), static_cast<unsigned>(launch.batch_count));
    kernel<<<grid, Tr::kThreads, Tr::kDqSmem, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
#endif

#endif  // SAFEATTN_ATTN_BWD_DEFINE_KERNELS

}  // namespace safeattn::cuda::attn
