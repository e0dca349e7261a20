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
//      tile (the causal rule skips the tiles above the diagonal). Each of 8 warps owns 16 keys
//      (DkvConfig), and computes the transposed tiles (keys along rows, queries along
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
//        compute dQ_step = dS' K[tile] for the step's queries (each warp 16 queries and a share
//        of the head dim, DkvConfig::kDqCols), added into a zeroed [B, Hq, Q, D] float32 buffer
//        with red.global.add; the buffer is then converted to grad_query. Every key tile of the kv
//        head adds into the same rows, in no fixed order: not bit-reproducible. Used unless
//        deterministic algorithms are on (torch.use_deterministic_algorithms) or a mask
//        gradient is needed (the dQ kernel writes it). Skipped tiles and rows with no visible key
//        add nothing (their dS is 0), so such rows keep the buffer's zeros.
// With a mask, the kernels read its per-tile summary (summarize_mask_tiles, at each kernel's
// tile sizes): fully masked tiles are skipped without loading their operands or the mask, and
// all-visible interior tiles (like the tiles below the causal diagonal) take no per-element test.
//
// Shared-memory tiles are row-major with rows padded by 16 bytes, so that the eight rows an
// ldmatrix reads fall in distinct banks. Out-of-range rows are zero-filled by cp.async; their
// scores are forced to -inf (keys) or their lse to +inf (queries), so they contribute exactly 0.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/head_dim_switch.h"

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
  // The mask's per-tile classes at each kernel's tile sizes (bwd_tile_sizes); null views (all
  // visible) without a mask. Fully masked tiles are skipped, all-visible interior tiles take
  // no per-element test.
  TileSummaryView tiles_dkdv, tiles_dq;
  Causal causal;
  // Score units: log2, or natural with a floating mask (attention_common.cuh, exp_of).
  ScoreRule score;
  int64_t hq, hkv, q_len, kv_len;
};

// The dQ kernel's shape for one head dim: 4 warps, each owning 16 queries; the key step is
// smaller for large head dims so that the dQ accumulator (head_dim floats per thread) plus the
// two score tiles stay in registers.
template <int kHeadDim>
struct DqConfig {
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "tensor-core backward: head_dim 16..128, multiple of 16");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = padded_row(kHeadDim);
  // kDqQueries queries per CTA, kDqKeys keys per step.
  static constexpr int kDqQueries = 16 * kWarps;
  static constexpr int kDqKeys = kHeadDim <= 64 ? 64 : 32;
  static constexpr size_t kDqSmem = sizeof(uint16_t) * kStride * (2 * kDqQueries + 2 * 2 * kDqKeys);
};

// The dK/dV kernel's shape: 8 warps of 16 keys each (128 keys per CTA, one CTA per SM) step over
// 64 queries at a time (FlashAttention-2's 128 keys x 64 queries): each step loads Q and dO once
// for the CTA's keys. Per thread it holds dK and dV (2 x head_dim floats) and the step's two score
// tiles. Measured against the 4-warp, 64-key shape it replaced (H100, B=4 H=16 S=4096 bf16 causal,
// fwd+bwd): 163 vs 148 TFLOP/s at D=128, 108 vs 104 at D=64, 185 vs 164 with causal + padding.
template <int kHeadDim>
struct DkvConfig {
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "tensor-core backward: head_dim 16..128, multiple of 16");
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = padded_row(kHeadDim);
  static constexpr int kKeys = 16 * kWarps;
  static constexpr int kQueries = 64;
  // The step's queries are scored kSubQueries at a time: at D > 64 a 64-query score tile pair
  // next to dK and dV would spill (nvcc 13.0, sm_90: 88 bytes at 255 registers, 8 warps, D=128).
  static constexpr int kSubQueries = kHeadDim <= 64 ? kQueries : 32;
  // Atomic dQ: dS'^T of a step in smem, [kKeys][kDsStride]; warp w computes dQ of the step's
  // queries [16 * (w / kDqWarpsPerRows), +16) and head-dim columns [kDqCols * (w %
  // kDqWarpsPerRows), +kDqCols), so every warp does the same work.
  static constexpr int kDsStride = padded_row(kQueries);
  static constexpr int kDqWarpsPerRows = kWarps / (kQueries / 16);
  static constexpr int kDqCols = kHeadDim / kDqWarpsPerRows;
  static_assert(kDqWarpsPerRows * (kQueries / 16) == kWarps && kDqCols % 16 == 0, "atomic dQ: warp split");

  // K, V; Q and dO double-buffered; row shift, row lo and Delta double-buffered; (atomic dQ) dS'^T.
  static constexpr size_t kSmem =
      sizeof(uint16_t) * kStride * (2 * kKeys + 2 * 2 * kQueries) + sizeof(float) * 3 * 2 * kQueries;
  static constexpr size_t kAtomicDqSmem = kSmem + sizeof(uint16_t) * kKeys * kDsStride;
};

// Host: the (query, key) tile sizes of the dK/dV kernel and of the dQ kernel for head dim d, for
// the mask summaries; false when d has no tensor-core backward in this build.
struct BwdTileSizes {
  int dkdv_q = 0, dkdv_kv = 0, dq_q = 0, dq_kv = 0;
};
inline bool bwd_tile_sizes(int64_t d, BwdTileSizes& sizes) {
  return with_head_dim<kBwdHeadDims>(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    sizes = {DkvConfig<D>::kQueries, DkvConfig<D>::kKeys, DqConfig<D>::kDqQueries, DqConfig<D>::kDqKeys};
  });
}

// Host: the most shared memory the backward kernels of head dim d take (bytes); 0 if none. The
// dK/dV kernel's tiles at D = 96 and 128 (108 and 138 KB) exceed the 99 KB of sm_86 / sm_89 /
// sm_120, whose backward at those head dims takes the ATen path (attention_backward_chunked).
inline size_t bwd_smem_bytes(int64_t d) {
  size_t bytes = 0;
  with_head_dim<kBwdHeadDims>(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    bytes = std::max(DkvConfig<D>::kAtomicDqSmem, DqConfig<D>::kDqSmem);
  });
  return bytes;
}

// What one backward launch runs (the rows pre-pass is the caller's).
struct BwdLaunch {
  int64_t batch = 0;        // the dK/dV kernel's grid covers batches [0, batch)
  int64_t batch_count = 0;  // the dQ kernel's: [params.batch_begin, +batch_count)
  bool run_dkdv = false;
  bool run_dq = false;
};

// Launches the dK/dV and dQ kernels for one dtype and head dim. Defined (with the kernels) only
// where SAFEATTN_ATTN_BWD_DEFINE_KERNELS is set: in the generated attention_bwd_d<D>_<dtype>.cu,
// each of which instantiates one pair.
template <typename T, int kHeadDim>
void launch_attention_bwd(const BwdParams& params, const BwdLaunch& launch, cudaStream_t stream);

#ifdef SAFEATTN_ATTN_BWD_DEFINE_KERNELS

namespace bwd_detail {

// Rows [row0, row0 + kRows) of a [len, kHeadDim] slab (row stride `stride_s` elements) into
// shared memory; rows at or past `len` become zeros.
template <typename T, int kHeadDim, int kRows, int kThreads>
__device__ __forceinline__ void load_rows(T* smem, const T* base, int64_t stride_s, int64_t row0, int64_t len) {
  load_tile<T, kRows, kHeadDim, kThreads, 1>(smem, base + row0 * stride_s, stride_s, len - row0, threadIdx.x);
}

// The exponent of p = 2^x for (query i, key j) from the raw dot product and the row's shift and lo
// (BwdParams::row_shift): the transformed, masked score in the kernel's units minus the row's
// lse; -inf where the element is masked, outside the sequence, or hidden by the causal rule.
// `dscore` gets d score / d dot (the chain rule of the scale and the softcap). `plain`: the tile
// is interior, causally visible and all visible in the mask summary, so none of those tests is
// needed. Without softcap, in log2 units (the common case) it is one multiply and one subtract.
__device__ __forceinline__ float exp2_arg(const BwdParams& p, bool plain, float dot, int64_t b, int64_t h, int64_t i,
                                          int64_t j, float shift, float lo, float& dscore) {
  float x = p.score.score(dot);
  dscore = p.score.derivative(x);
  if (!plain) {
    if (i >= p.q_len || j >= p.kv_len || !p.causal.visible(i, j)) {
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

// The backward's two score-shaped products at once, one warp's 16 rows: acc1 += A1 B1^T and
// acc2 += A2 B2^T (S and dP: A1, A2 = K, V and B1, B2 = Q, dO in the dK/dV kernel, transposed in
// the dQ kernel), over the head dim. A rows a_row.. of shared tiles, B kCols rows; row stride
// padded_row(kHeadDim) (load_tile's); accumulators [kCols / 8][4] in the m16n8 layout.
template <typename T, int kHeadDim, int kCols>
__device__ __forceinline__ void paired_score_products(float (&acc1)[kCols / 8][4], float (&acc2)[kCols / 8][4],
                                                      const T* a1, const T* a2, int a_row, const T* b1, const T* b2,
                                                      int lane) {
  constexpr int kStride = padded_row(kHeadDim);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t fa1[4], fa2[4];
    const int row = a_row + (lane & 15);
    const int col = ks * 16 + (lane >> 4) * 8;
    ldmatrix_x4(fa1, a1 + row * kStride + col);
    ldmatrix_x4(fa2, a2 + row * kStride + col);
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      const int b_row = np * 16 + (lane & 7) + (lane >> 4) * 8;
      const int b_col = ks * 16 + ((lane >> 3) & 1) * 8;
      uint32_t fb1[4], fb2[4];
      ldmatrix_x4(fb1, b1 + b_row * kStride + b_col);
      ldmatrix_x4(fb2, b2 + b_row * kStride + b_col);
      mma_16816<T>(acc1[2 * np], fa1, {fb1[0], fb1[1]});
      mma_16816<T>(acc1[2 * np + 1], fa1, {fb1[2], fb1[3]});
      mma_16816<T>(acc2[2 * np], fa2, {fb2[0], fb2[1]});
      mma_16816<T>(acc2[2 * np + 1], fa2, {fb2[2], fb2[3]});
    }
  }
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

// ---- dK / dV ---------------------------------------------------------------------------------

// The atomic mode's dQ of one dK/dV step: dQ[i0 + m, :] += sum over the tile's 64 keys j of
// dS'[m, j] K[j, :], for the step's queries m < kDkvQueries of query head h, added into
// p.dq_accum with red.global.add (rows past q_len are not written; they hold dS' = 0 anyway).
// ds_s: dS'^T [kDkvKeys][kDsStride] (keys along rows); k_s: K [kDkvKeys][kStride]. dS' already
// holds d score / d(q.k) (the scale, the softcap's derivative): no scale here.
template <typename T, int kHeadDim>
__device__ __forceinline__ void add_step_dq(const BwdParams& p, const T* ds_s, const T* k_s, int64_t b, int64_t h,
                                            int64_t i0, int warp, int lane) {
  using Tr = DkvConfig<kHeadDim>;
  constexpr int kNTiles = Tr::kDqCols / 8;
  const int row0 = 16 * (warp / Tr::kDqWarpsPerRows);           // this warp's queries within the step
  const int col0 = Tr::kDqCols * (warp % Tr::kDqWarpsPerRows);  // and head-dim columns
  float acc[kNTiles][4];
#pragma unroll
  for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[t][e] = 0.0f;
    }
  }
#pragma unroll
  for (int kk = 0; kk < Tr::kKeys / 16; ++kk) {
    // A = dS' [queries x keys] from its transpose: matrix l / 8 of the x4 is (queries +8 when
    // l / 8 is odd, keys +8 when l / 8 >= 2), as ldmatrix_x4 reads a row-major A.
    uint32_t a_ds[4];
    const int a_key = kk * 16 + (lane & 7) + ((lane >> 4) & 1) * 8;
    const int a_query = row0 + ((lane >> 3) & 1) * 8;
    ldmatrix_x4_trans(a_ds, ds_s + a_key * Tr::kDsStride + a_query);
    // B = K [keys x head dim] loaded transposed, as the dQ kernel does.
    const int b_row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int dp = 0; dp < Tr::kDqCols / 16; ++dp) {
      const int b_col = col0 + dp * 16 + (lane >> 4) * 8;
      uint32_t b_k[4];
      ldmatrix_x4_trans(b_k, k_s + b_row * Tr::kStride + b_col);
      mma_16816<T>(acc[2 * dp], a_ds, {b_k[0], b_k[1]});
      mma_16816<T>(acc[2 * dp + 1], a_ds, {b_k[2], b_k[3]});
    }
  }
  // Rows g and g + 8 of the warp's 16 queries, columns 2 * tig (+1) of every n-tile.
  const int g = lane / 4, tig = lane % 4;
  float* dq = p.dq_accum + (b * p.hq + h) * p.q_len * kHeadDim;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t i = i0 + row0 + g + half * 8;
    if (i >= p.q_len) {
      continue;
    }
    float* dq_row = dq + i * kHeadDim + col0 + 2 * tig;
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) {
      // The result unused: RED, not ATOM. One 8-byte red.global.add.v2.f32 on sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float2*>(dq_row + t * 8), make_float2(acc[t][2 * half], acc[t][2 * half + 1]));
#else
      atomicAdd(dq_row + t * 8, acc[t][2 * half]);
      atomicAdd(dq_row + t * 8 + 1, acc[t][2 * half + 1]);
#endif
    }
  }
}

// kAtomicDq: also dQ of every step, added into p.dq_accum (the atomic mode, see the top).
template <typename T, int kHeadDim, bool kAtomicDq>
__global__ void __launch_bounds__(DkvConfig<kHeadDim>::kThreads) attention_bwd_dkdv_kernel(const BwdParams p) {
  using Tr = DkvConfig<kHeadDim>;
  constexpr int kStride = Tr::kStride;
  constexpr int kKeys = Tr::kKeys;
  constexpr int kQueries = Tr::kQueries;
  constexpr int kSubQueries = Tr::kSubQueries;
  constexpr int kQTiles = kSubQueries / 8;  // n-tiles of the score tile
  constexpr int kDTiles = kHeadDim / 8;     // n-tiles of the dK / dV accumulators

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + kKeys * kStride;
  T* q_s = v_s + kKeys * kStride;                                          // [2][kQueries][kStride]
  T* do_s = q_s + 2 * kQueries * kStride;                                  // [2][kQueries][kStride]
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * kQueries * kStride);  // [2][kQueries] row shift
  float* lo_s = lse_s + 2 * kQueries;                                      // [2][kQueries] row lo
  float* delta_s = lo_s + 2 * kQueries;                                    // [2][kQueries]
  // kAtomicDq: dS'^T of the step, [kKeys][kDsStride] (past Tr::kSmem, 16-byte aligned).
  T* ds_s = reinterpret_cast<T*>(delta_s + 2 * kQueries);

  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kKeys;
  const int64_t hk = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t group = p.hq / p.hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;

  const T* k_base = static_cast<const T*>(p.key) + b * p.k_stride_b + hk * p.k_stride_h;
  const T* v_base = static_cast<const T*>(p.value) + b * p.v_stride_b + hk * p.v_stride_h;
  load_rows<T, kHeadDim, kKeys, Tr::kThreads>(k_s, k_base, p.k_stride_s, j0, p.kv_len);
  load_rows<T, kHeadDim, kKeys, Tr::kThreads>(v_s, v_base, p.v_stride_s, j0, p.kv_len);
  cp_async_commit();

  // Queries before first_query(j0) see no key of this tile (j0 is its smallest key).
  const int64_t q_tiles = (p.q_len + kQueries - 1) / kQueries;
  const int64_t first_tile = p.causal.first_query(j0, p.q_len) / kQueries;
  const int64_t tiles_per_head = q_tiles - first_tile;
  const int64_t steps = group * tiles_per_head;

  // Step s: query head hk * group + s / tiles_per_head, query tile first_tile + s % tiles_per_head.
  auto step_head = [&](int64_t step) { return hk * group + step / tiles_per_head; };
  auto step_q_tile = [&](int64_t step) { return first_tile + step % tiles_per_head; };
  // The first step from `step` on whose tile the mask summary does not prove fully masked: the
  // others contribute exactly 0 and are skipped without reading Q, dO or the mask.
  auto next_step = [&](int64_t step) {
    while (step < steps && p.tiles_dkdv.at(b, step_head(step), step_q_tile(step), blockIdx.x) == kTileMasked) {
      ++step;
    }
    return step;
  };
  auto prefetch = [&](int64_t step, int buf) {
    const int64_t h = step_head(step);
    const int64_t i0 = step_q_tile(step) * kQueries;
    const T* q_base = static_cast<const T*>(p.query) + b * p.q_stride_b + h * p.q_stride_h;
    const T* do_base = static_cast<const T*>(p.grad_out) + b * p.do_stride_b + h * p.do_stride_h;
    load_rows<T, kHeadDim, kQueries, Tr::kThreads>(q_s + buf * kQueries * kStride, q_base, p.q_stride_s, i0, p.q_len);
    load_rows<T, kHeadDim, kQueries, Tr::kThreads>(do_s + buf * kQueries * kStride, do_base, p.do_stride_s, i0,
                                                   p.q_len);
    const int64_t row0 = (b * p.hq + h) * p.q_len;
    for (int r = threadIdx.x; r < kQueries; r += Tr::kThreads) {
      const bool valid = i0 + r < p.q_len;
      lse_s[buf * kQueries + r] = valid ? p.row_shift[row0 + i0 + r] : INFINITY;
      lo_s[buf * kQueries + r] = valid && p.score.natural ? p.row_lo[row0 + i0 + r] : 0.0f;
      delta_s[buf * kQueries + r] = valid ? p.delta[row0 + i0 + r] : 0.0f;
    }
  };

  float dk_acc[kDTiles][4];
  float dv_acc[kDTiles][4];
#pragma unroll
  for (int t = 0; t < kDTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dk_acc[t][e] = 0.0f;
      dv_acc[t][e] = 0.0f;
    }
  }

  const int key_row = warp * 16;  // this warp's keys within the tile
  int64_t step = next_step(0);
  if (step < steps) {
    prefetch(step, 0);
  }
  cp_async_commit();
  for (int buf = 0; step < steps; buf ^= 1) {
    const int64_t next = next_step(step + 1);
    if (next < steps) {
      prefetch(next, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const int64_t h = step_head(step);
    const int64_t q_tile = step_q_tile(step);
    const int64_t i0 = q_tile * kQueries;
    const bool plain = plain_tile(p, p.tiles_dkdv.at(b, h, q_tile, blockIdx.x), i0, kQueries, j0, kKeys);

    // The step's queries in sub-tiles of kSubQueries, so that the two score tiles of one
    // sub-tile are all the registers the scores take (not unrolled: the same registers serve
    // every sub-tile).
#pragma unroll 1
    for (int sub = 0; sub < kQueries / kSubQueries; ++sub) {
      const int q0 = sub * kSubQueries;  // the sub-tile's first query within the step
      const T* qt = q_s + (buf * kQueries + q0) * kStride;
      const T* dot = do_s + (buf * kQueries + q0) * kStride;
      const float* lse_t = lse_s + buf * kQueries + q0;
      const float* lo_t = lo_s + buf * kQueries + q0;
      const float* delta_t = delta_s + buf * kQueries + q0;

      // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys and the sub-tile's queries.
      float st[kQTiles][4];
      float dpt[kQTiles][4];
#pragma unroll
      for (int t = 0; t < kQTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          st[t][e] = 0.0f;
          dpt[t][e] = 0.0f;
        }
      }
      paired_score_products<T, kHeadDim, kSubQueries>(st, dpt, k_s, v_s, key_row, qt, dot, lane);

      // P^T and dS'^T in place (st holds p, dpt holds dS').
#pragma unroll
      for (int t = 0; t < kQTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = t * 8 + 2 * tig + (e & 1);
          const int64_t i = i0 + q0 + col;
          const int64_t j = j0 + key_row + g + (e >> 1) * 8;
          float dscore;
          const float prob = fast_exp2(exp2_arg(p, plain, st[t][e], b, h, i, j, lse_t[col], lo_t[col], dscore));
          st[t][e] = prob;
          dpt[t][e] = prob * (dpt[t][e] - delta_t[col]) * dscore;
        }
      }

      // dV += P^T dO and dK += dS'^T Q: A from the registers above, B = dO / Q loaded transposed.
#pragma unroll
      for (int kk = 0; kk < kSubQueries / 16; ++kk) {
        uint32_t a_p[4], a_ds[4];
        a_fragment<T>(st, kk, a_p);
        a_fragment<T>(dpt, kk, a_ds);
        if constexpr (kAtomicDq) {
          // dS'^T as the registers hold it: rows key_row + g (+8), columns q0 + 2 * tig (+1) of
          // the n-tiles 2 * kk and 2 * kk + 1, one 32-bit pair per store.
          T* ds_row = ds_s + (key_row + g) * Tr::kDsStride + q0 + kk * 16 + 2 * tig;
          *reinterpret_cast<uint32_t*>(ds_row) = a_ds[0];
          *reinterpret_cast<uint32_t*>(ds_row + 8 * Tr::kDsStride) = a_ds[1];
          *reinterpret_cast<uint32_t*>(ds_row + 8) = a_ds[2];
          *reinterpret_cast<uint32_t*>(ds_row + 8 * Tr::kDsStride + 8) = a_ds[3];
        }
        const int b_row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int dp = 0; dp < kHeadDim / 16; ++dp) {
          const int b_col = dp * 16 + (lane >> 4) * 8;
          uint32_t b_do[4], b_q[4];
          ldmatrix_x4_trans(b_do, dot + b_row * kStride + b_col);
          ldmatrix_x4_trans(b_q, qt + b_row * kStride + b_col);
          mma_16816<T>(dv_acc[2 * dp], a_p, {b_do[0], b_do[1]});
          mma_16816<T>(dv_acc[2 * dp + 1], a_p, {b_do[2], b_do[3]});
          mma_16816<T>(dk_acc[2 * dp], a_ds, {b_q[0], b_q[1]});
          mma_16816<T>(dk_acc[2 * dp + 1], a_ds, {b_q[2], b_q[3]});
        }
      }
    }
    if constexpr (kAtomicDq) {
      __syncthreads();  // every warp's dS'^T is in ds_s
      add_step_dq<T, kHeadDim>(p, ds_s, k_s, b, h, i0, warp, lane);
    }
    __syncthreads();  // this buffer (and ds_s) is refilled by the next step
    step = next;
  }
  cp_async_wait<0>();

  // Rows g and g + 8 of this warp's keys, columns 2 * tig (+1) of every n-tile.
  T* gk = static_cast<T*>(p.grad_key) + ((b * p.hkv + hk) * p.kv_len) * kHeadDim;
  T* gv = static_cast<T*>(p.grad_value) + ((b * p.hkv + hk) * p.kv_len) * kHeadDim;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = j0 + key_row + g + half * 8;
    if (j >= p.kv_len) {
      continue;
    }
#pragma unroll
    for (int t = 0; t < kDTiles; ++t) {
      const int col = t * 8 + 2 * tig;
      *reinterpret_cast<uint32_t*>(gk + j * kHeadDim + col) = pack2<T>(dk_acc[t][2 * half], dk_acc[t][2 * half + 1]);
      *reinterpret_cast<uint32_t*>(gv + j * kHeadDim + col) = pack2<T>(dv_acc[t][2 * half], dv_acc[t][2 * half + 1]);
    }
  }
}

// ---- dQ (and the mask gradient) --------------------------------------------------------------

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(DqConfig<kHeadDim>::kThreads) attention_bwd_dq_kernel(const BwdParams p) {
  using Tr = DqConfig<kHeadDim>;
  constexpr int kStride = Tr::kStride;
  constexpr int kQueries = Tr::kDqQueries;
  constexpr int kKeys = Tr::kDqKeys;
  constexpr int kKTiles = kKeys / 8;
  constexpr int kDTiles = kHeadDim / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* do_s = q_s + kQueries * kStride;
  T* k_s = do_s + kQueries * kStride;  // [2][kKeys][kStride]
  T* v_s = k_s + 2 * kKeys * kStride;  // [2][kKeys][kStride]

  // Last query tile first: with causal it sees the most keys, and the long CTAs should start
  // early rather than form the tail of the grid.
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
  load_rows<T, kHeadDim, kQueries, Tr::kThreads>(q_s, q_base, p.q_stride_s, i0, p.q_len);
  load_rows<T, kHeadDim, kQueries, Tr::kThreads>(do_s, do_base, p.do_stride_s, i0, p.q_len);
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
    load_rows<T, kHeadDim, kKeys, Tr::kThreads>(k_s + buf * kKeys * kStride, k_base, p.k_stride_s, step * kKeys,
                                                p.kv_len);
    load_rows<T, kHeadDim, kKeys, Tr::kThreads>(v_s + buf * kKeys * kStride, v_base, p.v_stride_s, step * kKeys,
                                                p.kv_len);
  };

  float dq_acc[kDTiles][4];
#pragma unroll
  for (int t = 0; t < kDTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dq_acc[t][e] = 0.0f;
    }
  }
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

  int64_t step = next_step(0);
  if (step < steps) {
    prefetch(step, 0);
  }
  cp_async_commit();
  for (int buf = 0; step < steps; buf ^= 1) {
    const int64_t next = next_step(step + 1);
    if (next < steps) {
      prefetch(next, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const T* kt = k_s + buf * kKeys * kStride;
    const T* vt = v_s + buf * kKeys * kStride;
    const int64_t j0 = step * kKeys;
    const bool plain = plain_tile(p, p.tiles_dq.at(b, h, q_tile, step), i0, kQueries, j0, kKeys);

    float s_acc[kKTiles][4];
    float dp_acc[kKTiles][4];
#pragma unroll
    for (int t = 0; t < kKTiles; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s_acc[t][e] = 0.0f;
        dp_acc[t][e] = 0.0f;
      }
    }
    paired_score_products<T, kHeadDim, kKeys>(s_acc, dp_acc, q_s, do_s, query_row, kt, vt, lane);

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
              fast_exp2(exp2_arg(p, plain, s_acc[t][e], b, h, i, j, row_lse[half], row_lo[half], dscore));
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

// The dK/dV kernel of one shape; params.dq_accum set: the atomic mode, dQ added by this kernel
// (the caller then skips the dQ kernel).
template <typename T, int kHeadDim>
void launch_dkdv(const BwdParams& params, int64_t batch, cudaStream_t stream) {
  using Tr = DkvConfig<kHeadDim>;
  const bool atomic_dq = params.dq_accum != nullptr;
  auto* kernel =
      atomic_dq ? &attention_bwd_dkdv_kernel<T, kHeadDim, true> : &attention_bwd_dkdv_kernel<T, kHeadDim, false>;
  const size_t smem = atomic_dq ? Tr::kAtomicDqSmem : Tr::kSmem;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((params.kv_len + Tr::kKeys - 1) / Tr::kKeys), static_cast<unsigned>(params.hkv),
                  static_cast<unsigned>(batch));
  kernel<<<grid, Tr::kThreads, smem, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace bwd_detail

template <typename T, int kHeadDim>
void launch_attention_bwd(const BwdParams& params, const BwdLaunch& launch, cudaStream_t stream) {
  if (launch.run_dkdv) {
    bwd_detail::launch_dkdv<T, kHeadDim>(params, launch.batch, stream);
  }
  if (launch.run_dq) {
    using Tr = DqConfig<kHeadDim>;
    auto* kernel = &bwd_detail::attention_bwd_dq_kernel<T, kHeadDim>;
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Tr::kDqSmem)));
    const dim3 grid(static_cast<unsigned>((params.q_len + Tr::kDqQueries - 1) / Tr::kDqQueries),
                    static_cast<unsigned>(params.hq), static_cast<unsigned>(launch.batch_count));
    kernel<<<grid, Tr::kThreads, Tr::kDqSmem, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

#endif  // SAFEATTN_ATTN_BWD_DEFINE_KERNELS

}  // namespace safeattn::cuda::attn
