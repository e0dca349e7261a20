// The mask as every CUDA attention kernel reads it (the mma.sync kernels, decode, and the
// sm_90a kernels in hopper/): the element view, its per-tile summary and the causal rule. Plain
// device structs, no torch, so the Hopper parameter structs (hopper/fwd_params.h, bwd_params.h)
// and the standalone checks can hold them; attention_common.cuh makes them from tensors.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace safeattn::cuda::attn {

enum class MaskKind : int { kNone = 0, kBool = 1, kFloat = 2, kHalf = 3, kBFloat16 = 4 };

// attn_mask as the kernels read it: element (b, h, i, j) at
// ptr + b*stride_b + h*stride_h + i*stride_q + j*stride_kv (elements; 0 on broadcast dims).
struct MaskView {
  const void* ptr = nullptr;
  MaskKind kind = MaskKind::kNone;
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_kv = 0;

  __device__ __forceinline__ int64_t offset(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return b * stride_b + h * stride_h + i * stride_q + j * stride_kv;
  }
  // A float mask: an additive bias (any values) rather than visible / masked bits.
  __host__ __device__ __forceinline__ bool is_bias() const {
    return kind == MaskKind::kFloat || kind == MaskKind::kHalf || kind == MaskKind::kBFloat16;
  }
  // A float mask's elements read with their own type: f(ptr) with ptr a const float*, __half* or
  // __nv_bfloat16* (one branch for a whole tile's reads, not one per element). Float kinds only.
  template <class F>
  __device__ __forceinline__ void with_values(F&& f) const {
    switch (kind) {
      case MaskKind::kHalf:
        f(static_cast<const __half*>(ptr));
        break;
      case MaskKind::kBFloat16:
        f(static_cast<const __nv_bfloat16*>(ptr));
        break;
      default:
        f(static_cast<const float*>(ptr));
        break;
    }
  }
  // Any mask's elements read with their own type: f(ptr) as with_values, or with a const bool*.
  template <class F>
  __device__ __forceinline__ void with_elements(F&& f) const {
    if (kind == MaskKind::kBool) {
      f(static_cast<const bool*>(ptr));
    } else {
      with_values(f);
    }
  }
  // The additive value of one element: 0 / -inf for bool (True = attend), the value otherwise.
  __device__ __forceinline__ float additive(int64_t off) const {
    switch (kind) {
      case MaskKind::kBool:
        return static_cast<const bool*>(ptr)[off] ? 0.0f : -INFINITY;
      case MaskKind::kFloat:
        return static_cast<const float*>(ptr)[off];
      case MaskKind::kHalf:
        return __half2float(static_cast<const __half*>(ptr)[off]);
      case MaskKind::kBFloat16:
        return __bfloat162float(static_cast<const __nv_bfloat16*>(ptr)[off]);
      default:
        return 0.0f;
    }
  }
};

// Mask elements and 16-bit values to float by intrinsic: torch builds CUDA code with
// __CUDA_NO_HALF_CONVERSIONS__ and __CUDA_NO_BFLOAT16_CONVERSIONS__ (setup.py too), so a
// static_cast would not compile.
__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Whether a mask element lets its key be seen: True for bool, anything but -inf for a float mask
// (whose values the kernels add).
__device__ __forceinline__ bool visible(bool x) {
  return x;
}
template <class T>
__device__ __forceinline__ bool visible(T x) {
  return to_float(x) != -INFINITY;
}

// Per query row, the one interval of keys [lo, hi) it may see, ANDed with the mask and causality:
// a described mask's windows and chunks (ops/attention.h, key_ranges) evaluated from indices, not
// drawn. int32 pairs at ptr + b * stride_b + 2 i (lo, hi; any values: hi <= lo sees none). A null
// ptr: no interval (every key).
struct KeyRangeView {
  const int* ptr = nullptr;
  int64_t stride_b = 0;

  __device__ __forceinline__ int lo(int64_t b, int64_t i) const {
    return ptr[b * stride_b + 2 * i];
  }
  __device__ __forceinline__ int hi(int64_t b, int64_t i) const {
    return ptr[b * stride_b + 2 * i + 1];
  }
};

// What a (query tile, key tile) block of the mask holds, so that the kernels skip whole tiles
// (kTileMasked: neither K/V nor the mask is read), read no mask (kTileVisible), or read it once
// per element (kTileMixed). NaN counts as mixed, so it reaches the rows it belongs to.
// kTileDiagonal, only in a summary asked for with diagonals (the sm_90a kernels, the generic forward
// and dK/dV kernels; the dQ kernel reads such a tile's elements): a tile that is
// neither masked nor visible whose row r (counted from the tile's first) sees exactly its keys
// c <= r + diagonal (counted from the tile's first key): the diagonal tiles of a causal mask, read
// as a compare instead of the mask's elements.
enum TileClass : uint8_t { kTileMasked = 0, kTileVisible = 1, kTileMixed = 2, kTileDiagonal = 3 };

// The summary as the kernels read it: class of (b, h, q_tile, kv_tile) at
// ptr + b*stride_b + h*stride_h + q_tile*stride_q + kv_tile (0 strides on the mask's broadcast
// dims). A null ptr (no mask) reads as kTileVisible everywhere.
struct TileSummaryView {
  const uint8_t* ptr = nullptr;
  const int16_t* diagonal = nullptr;  // same layout: the diagonal of each kTileDiagonal tile, or null
  // Null, or per row of tiles (b, h, q_tile) the lowest key tile that is not kTileMasked (the
  // row's key tiles when none), at index(b, h, q_tile, 0) / kv_tiles: where a walk down the
  // row's key tiles may stop.
  const int* first_visible = nullptr;
  // Null, or per column of tiles (b, h, kv_tile) one past the highest query tile that is not
  // kTileMasked (0 when none; INT_MAX for a summary of one row of tiles, which stands for every
  // query tile), at index(b, h, 0, 0) / slice_tiles * kv_tiles + kv_tile: where a walk up the
  // column's query tiles may stop.
  const int* query_end = nullptr;
  int64_t kv_tiles = 1;
  int64_t slice_tiles = 1;  // the summary's tiles per (b, h) slice: its rows of tiles x kv_tiles
  int64_t stride_b = 0, stride_h = 0, stride_q = 0;
  int block_q = 0, block_kv = 0;  // the tile sizes it was computed for

  __device__ __forceinline__ int64_t index(int64_t b, int64_t h, int64_t q_tile, int64_t kv_tile) const {
    return b * stride_b + h * stride_h + q_tile * stride_q + kv_tile;
  }
  __device__ __forceinline__ uint8_t at(int64_t b, int64_t h, int64_t q_tile, int64_t kv_tile) const {
    return ptr == nullptr ? static_cast<uint8_t>(kTileVisible) : ptr[index(b, h, q_tile, kv_tile)];
  }
  __device__ __forceinline__ int diagonal_at(int64_t b, int64_t h, int64_t q_tile, int64_t kv_tile) const {
    return diagonal[index(b, h, q_tile, kv_tile)];
  }
  // The lowest key tile of the row (b, h, q_tile) not masked; 0 without the record.
  __device__ __forceinline__ int first_visible_at(int64_t b, int64_t h, int64_t q_tile) const {
    return first_visible == nullptr ? 0 : first_visible[index(b, h, q_tile, 0) / kv_tiles];
  }
  // One past the highest query tile of the column (b, h, kv_tile) not masked; INT_MAX without the
  // record.
  __device__ __forceinline__ int query_end_at(int64_t b, int64_t h, int64_t kv_tile) const {
    return query_end == nullptr ? INT_MAX : query_end[index(b, h, 0, 0) / slice_tiles * kv_tiles + kv_tile];
  }
};

// ---- the causal rule -------------------------------------------------------------------------

// Query i sees key j when kv_offset + j <= q_offset + i (ops/attention.h). `shift` is
// q_offset - kv_offset, so the rule is j <= i + shift.
struct Causal {
  bool enabled = false;
  int64_t shift = 0;

  __device__ __forceinline__ bool visible(int64_t i, int64_t j) const {
    return !enabled || j <= i + shift;
  }
  // Keys [0, end) can be visible to some query before q_end: key tiles at or beyond `end` are
  // skipped without being read. 0 when no key is visible to any of these queries.
  __device__ __forceinline__ int64_t kv_end(int64_t q_end, int64_t kv_len) const {
    if (!enabled) {
      return kv_len;
    }
    const int64_t e = q_end + shift;  // the last query, q_end - 1, sees keys j <= q_end - 1 + shift
    return e < 0 ? 0 : (e < kv_len ? e : kv_len);
  }
  // Every key in [kv_begin, kv_end) is visible to every query in [q_begin, q_end): such a tile
  // needs no per-element causal test.
  __device__ __forceinline__ bool tile_all_visible(int64_t q_begin, int64_t kv_end_exclusive) const {
    return !enabled || kv_end_exclusive - 1 <= q_begin + shift;
  }
  // The first query of [0, q_len) that sees key j (queries before it do not): the backward's
  // per-key-tile start. q_len when none does.
  __device__ __forceinline__ int64_t first_query(int64_t j, int64_t q_len) const {
    if (!enabled) {
      return 0;
    }
    const int64_t f = j - shift;
    return f < 0 ? 0 : (f < q_len ? f : q_len);
  }
};

// The per-element tests of a tile of queries [i0, i0 + rows) x keys [j0, j0 + cols) without mask
// values, in tile coordinates (32-bit): query r of the tile sees key c when c <= last_key(r), which
// holds the causal rule (j <= i + shift, as c - r <= i0 + shift - j0) and both sequence ends. The
// forward and the backward test their causal-diagonal and edge tiles with it.
struct TileBounds {
  int diagonal;    // i0 + shift - j0, clamped to [-rows, cols] (beyond it every key or none is seen)
  int query_rows;  // queries of the tile inside the sequence
  int key_rows;    // keys of the tile inside the sequence
  // The last visible key of query r of the tile, -1 when none.
  __device__ __forceinline__ int last_key(int r) const {
    return r < query_rows ? min(diagonal + r, key_rows - 1) : -1;
  }
};
__device__ __forceinline__ TileBounds tile_bounds(const Causal& causal, int64_t q_len, int64_t kv_len, int64_t i0,
                                                  int rows, int64_t j0, int cols) {
  const int64_t diagonal = causal.enabled ? i0 + causal.shift - j0 : cols;
  return {static_cast<int>(diagonal < -rows ? -rows : (diagonal > cols ? cols : diagonal)),
          static_cast<int>(q_len - i0 < rows ? q_len - i0 : rows),
          static_cast<int>(kv_len - j0 < cols ? kv_len - j0 : cols)};
}

}  // namespace safeattn::cuda::attn
