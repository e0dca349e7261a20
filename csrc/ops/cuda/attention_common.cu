// Host helpers shared by the CUDA attention forward and backward (see attention_common.cuh).
#include "ops/cuda/attention_common.cuh"

#include "safeattn.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

namespace safeattn::cuda::attn {

MaskView make_mask_view(const at::Tensor& mask) {
  MaskView view;
  if (!mask.defined()) {
    return view;
  }
  TORCH_INTERNAL_ASSERT(mask.dim() == 4, "attention (CUDA): the mask view must be 4-D");
  // The mask's dtype as the kernels name it (mask_view.cuh).
  static constexpr std::pair<at::ScalarType, MaskKind> kKinds[] = {
      {at::kBool, MaskKind::kBool},
      {at::kFloat, MaskKind::kFloat},
      {at::kHalf, MaskKind::kHalf},
      {at::kBFloat16, MaskKind::kBFloat16},
  };
  for (const auto& [dtype, kind] : kKinds) {
    if (dtype == mask.scalar_type()) {
      view.kind = kind;
    }
  }
  TORCH_CHECK(view.kind != MaskKind::kNone, "attention (CUDA): attn_mask of dtype ", mask.scalar_type(),
              " has no CUDA kernel");
  view.ptr = mask.data_ptr();
  view.stride_b = mask.stride(0);
  view.stride_h = mask.stride(1);
  view.stride_q = mask.stride(2);
  view.stride_kv = mask.stride(3);
  return view;
}

bool rows_aligned_16(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0 || t.stride(3) != 1) {
    return false;
  }
  for (int64_t d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) {
      return false;
    }
  }
  return true;
}

bool sizes_fit_int32(const at::Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > std::numeric_limits<int32_t>::max()) {
      return false;
    }
  }
  return true;
}

void warn_if_hopper_kernels_missing(const at::Tensor& query) {
#ifndef SAFEATTN_WITH_SM90
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(query.get_device());
  const at::ScalarType dtype = query.scalar_type();
  if (props->major == 9 && props->minor == 0 && (dtype == at::kHalf || dtype == at::kBFloat16)) {
    TORCH_WARN_ONCE(
        "safeattn was built without its H100/H200 attention kernels (sm_90a: the build found no CUTLASS "
        "headers, or SAFEATTN_SM90=0), so attention on ",
        props->name,
        " runs the generic kernels, about 2x slower. Rebuild with them:\n"
        "    pip install nvidia-cutlass==4.2.0.0\n"
        "    pip install --no-build-isolation --no-deps --no-cache-dir --force-reinstall safeattn\n"
        "(in a source tree: pip install --no-build-isolation --no-deps -e .); `python -m safeattn info` "
        "lists the kernels built.");
  }
#else
  (void)query;
#endif
}

const char* mma_sync_inputs_rejects(const at::Tensor& query, const at::Tensor& value, bool head_dim_compiled) {
  const at::ScalarType dtype = query.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return "dtype is not float16 or bfloat16";
  }
  if (query.size(3) != value.size(3)) {
    return "value's head dim differs from query's (D != Dv)";
  }
  if (!head_dim_compiled) {
    return "head dim not compiled for it (SAFEATTN_ATTN_HEAD_DIMS)";
  }
  return nullptr;
}

const char* sm90_inputs_rejects(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  if (generic_kernels_only()) {
    return "the generic kernels are forced (safeattn._testing.generic_kernels)";
  }
  const at::ScalarType dtype = query.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return "dtype is not float16 or bfloat16";
  }
  const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // as the kernels get it
  if (!(scale > 0.0) || !(scale_log2 > 0.0f) || !std::isfinite(scale_log2)) {
    return "scale * log2(e) is not positive and finite in float32";
  }
  if (value.size(3) != query.size(3)) {
    return "value's head dim differs from query's (D != Dv)";
  }
  if (query.numel() == 0 || key.size(2) == 0) {
    return "an empty input (the other kernels write its empty rows)";
  }
  if (!sizes_fit_int32(query) || !sizes_fit_int32(key)) {
    return "a size of 2^31 or more";
  }
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(query.get_device());
  if (props->major != 9 || props->minor != 0) {
    return "not an sm_90 GPU (H100/H200)";
  }
  return nullptr;
}

bool smem_fits(size_t bytes, const at::Tensor& t) {
  return bytes <= at::cuda::getDeviceProperties(t.get_device())->sharedMemPerBlockOptin;
}

SmemLimits smem_limits(const at::Tensor& t) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(t.get_device());
  return {props->sharedMemPerBlockOptin, props->sharedMemPerMultiprocessor, props->reservedSharedMemPerBlock};
}

at::Tensor with_aligned_rows(const at::Tensor& t) {
  return rows_aligned_16(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

namespace {

constexpr int kSummaryThreads = 256;

// Bit k set iff byte k of w is nonzero.
__device__ __forceinline__ uint32_t nonzero_bytes(uint32_t w) {
  w |= w >> 4;
  w |= w >> 2;
  w |= w >> 1;
  return ((w & 0x01010101u) * 0x10204080u) >> 28;  // bytes' low bits gathered into bits 28..31
}

constexpr int kMaxDiagonalRows = 128;

// Whether a mixed tile is one diagonal d (row r sees exactly its keys c <= r + d), from each
// row's count of visible keys and last visible key (tile-relative; -1: none): every row's visible
// keys are a prefix [0, count), the rows seeing some but not all keys agree on d = count - 1 - r,
// and the rows seeing none or all lie where the rule puts them. Called by every thread of the
// CTA (it synchronises); d is 0 when it returns false. diag_min, diag_max: shared scratch.
__device__ bool one_diagonal(int rows, int cols, const int* row_count, const int* row_last, int* diag_min,
                             int* diag_max, int& d) {
  if (threadIdx.x == 0) {
    *diag_min = INT_MAX;
    *diag_max = INT_MIN;
  }
  __syncthreads();
  bool broken = false;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int count = row_count[r];
    broken |= row_last[r] != count - 1;
    if (count > 0 && count < cols) {
      atomicMin(diag_min, count - 1 - r);
      atomicMax(diag_max, count - 1 - r);
    }
  }
  broken = __syncthreads_or(broken);
  d = *diag_min;
  broken |= d != *diag_max;  // also when no row is partial (d = INT_MAX): not a diagonal
  for (int r = threadIdx.x; r < rows && !broken; r += blockDim.x) {
    const int count = row_count[r];
    broken |= (count == 0 && r + d >= 0) || (count == cols && r + d + 1 < cols);
  }
  broken = __syncthreads_or(broken);
  if (broken) {
    d = 0;
  }
  return !broken;
}

// A summary CTA's tile: x = ((slice * q_tiles) + q_tile) * kv_tiles + kv_tile, its first query
// row i0 and key j0, and its rows and columns inside [q_len, kv_len).
struct SummaryTile {
  int64_t slice, q_tile, kv_tile, i0, j0;
  int rows, cols;
};

__device__ __forceinline__ SummaryTile summary_tile(int64_t x, int64_t q_tiles, int64_t kv_tiles, int block_q,
                                                    int block_kv, int64_t q_len, int64_t kv_len) {
  SummaryTile t;
  t.kv_tile = x % kv_tiles;
  t.q_tile = (x / kv_tiles) % q_tiles;
  t.slice = x / (kv_tiles * q_tiles);
  t.i0 = t.q_tile * block_q;
  t.j0 = t.kv_tile * block_kv;
  t.rows = static_cast<int>(q_len - t.i0 < block_q ? q_len - t.i0 : block_q);
  t.cols = static_cast<int>(kv_len - t.j0 < block_kv ? kv_len - t.j0 : block_kv);
  return t;
}

// The walks' bounds a summary kernel records (TileWalkBounds; a null pointer: not asked for).
struct WalkBoundsOut {
  int* first_visible = nullptr;  // per row of tiles, filled with kv_tiles before: atomicMin
  int* query_end = nullptr;      // per column of tiles, zeroed before: atomicMax
  // Tile x = ((slice * q_tiles) + q_tile) * kv_tiles + kv_tile is not masked. A summary of one row
  // of tiles stands for every query tile (a mask broadcast over the queries): its columns end at
  // INT_MAX, which the kernels clamp to their own query tiles.
  __device__ __forceinline__ void note_not_masked(int64_t x, int64_t q_tiles, int64_t kv_tiles) const {
    const int64_t kv_tile = x % kv_tiles;
    if (first_visible != nullptr) {
      atomicMin(&first_visible[x / kv_tiles], static_cast<int>(kv_tile));
    }
    if (query_end != nullptr) {
      const int end = q_tiles == 1 ? INT_MAX : static_cast<int>(x / kv_tiles % q_tiles + 1);
      atomicMax(&query_end[x / (q_tiles * kv_tiles) * kv_tiles + kv_tile], end);
    }
  }
};

// One CTA per (mask slice, query tile, key tile): x = ((slice * q_tiles) + q_tile) * kv_tiles +
// kv_tile. Each thread looks at a strided share of the tile's elements; the flags are ORed over
// the CTA. vec16: a mask whose rows the host found 16-byte aligned with unit stride along the
// keys (and block_kv a multiple of 16), read 16 bytes per load: 16 keys of a bool mask, 8 16-bit
// or 4 float32 values of a float one (element by element, a [1, H, S, S] bias took half the
// time of the forward it served); the index arithmetic is 32-bit (a tile has at most block_q *
// block_kv elements). diagonal (a bool vec16 mask only, block_q <= 128): each row's count of
// visible keys and last visible key tell whether a mixed tile is one diagonal (row r sees keys
// c <= r + d, and nothing else): kTileDiagonal, d written to diagonal[x]. bounds: the walks'
// bounds asked for (WalkBoundsOut). causal (enabled only where every reader applies the same
// rule): a tile whose keys no row of it sees is masked without being read.
__global__ void __launch_bounds__(kSummaryThreads)
    summarize_mask_tiles_kernel(MaskView mask, int64_t q_len, int64_t kv_len, int block_q, int block_kv,
                                int64_t heads_m, int64_t q_tiles, int64_t kv_tiles, bool vec16, Causal causal,
                                bool read_values, uint8_t* out, int16_t* diagonal, WalkBoundsOut bounds) {
  __shared__ int row_count[kMaxDiagonalRows], row_last[kMaxDiagonalRows];
  __shared__ int diag_min, diag_max;
  const int64_t x = blockIdx.x;
  const SummaryTile tile = summary_tile(x, q_tiles, kv_tiles, block_q, block_kv, q_len, kv_len);
  const int64_t b = tile.slice / heads_m, h = tile.slice % heads_m;
  const int64_t i0 = tile.i0, j0 = tile.j0;
  const int rows = tile.rows, cols = tile.cols;
  if (causal.kv_end(i0 + rows, kv_len) <= j0) {
    if (threadIdx.x == 0) {
      out[x] = kTileMasked;
    }
    return;
  }
  if (!read_values) {  // a dense bias: every tile causality leaves is mixed
    if (threadIdx.x == 0) {
      out[x] = kTileMixed;
      bounds.note_not_masked(x, q_tiles, kv_tiles);
    }
    return;
  }
  const bool rows_stats = diagonal != nullptr;  // vec16 and block_q <= 128: the host checked
  if (rows_stats) {
    for (int r = threadIdx.x; r < rows; r += kSummaryThreads) {
      row_count[r] = 0;
      row_last[r] = -1;
    }
    __syncthreads();
  }
  bool any_visible = false, any_masked = false, any_bias = false;
  auto note_value = [&](float v) {
    const bool masked = v == -INFINITY;
    any_masked |= masked;
    any_visible |= !masked;    // NaN included: it must reach its row
    any_bias |= !(v == 0.0f);  // NaN included
  };
  if (vec16 && mask.is_bias()) {
    mask.with_values([&](const auto* values) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(values)>>;
      constexpr int kPerLoad = 16 / sizeof(T);
      const T* tile = values + mask.offset(b, h, i0, j0);
      // Whole 16-byte chunks, kInFlight loads issued before any is looked at (one at a time, the
      // summary of a [1, H, S, S] bias ran at ~1.2 TB/s); then the columns past the last whole
      // chunk, element by element.
      constexpr int kInFlight = 4;
      const int chunks = cols / kPerLoad, total = rows * chunks;
      for (int e0 = threadIdx.x; e0 < total; e0 += kInFlight * kSummaryThreads) {
        alignas(16) T chunk[kInFlight][kPerLoad];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          const int e = e0 + u * kSummaryThreads;
          if (e < total) {
            const T* row = tile + (e / chunks) * mask.stride_q + kPerLoad * (e % chunks);
            *reinterpret_cast<uint4*>(chunk[u]) = *reinterpret_cast<const uint4*>(row);
          }
        }
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          if (e0 + u * kSummaryThreads < total) {
#pragma unroll
            for (int k = 0; k < kPerLoad; ++k) {
              note_value(to_float(chunk[u][k]));
            }
          }
        }
      }
      const int tail = cols - chunks * kPerLoad;
      for (int e = threadIdx.x; e < rows * tail; e += kSummaryThreads) {
        note_value(to_float(tile[(e / tail) * mask.stride_q + chunks * kPerLoad + e % tail]));
      }
    });
  } else if (vec16) {
    const uint8_t* tile = static_cast<const uint8_t*>(mask.ptr) + mask.offset(b, h, i0, j0);
    const int chunks = (cols + 15) / 16;
    for (int e = threadIdx.x; e < rows * chunks; e += kSummaryThreads) {
      const int r = e / chunks, c = 16 * (e % chunks);
      const uint8_t* keys = tile + r * mask.stride_q + c;
      const int n = cols - c < 16 ? cols - c : 16;
      uint32_t visible = 0;  // bit k: key c + k
      if (n == 16) {
        const uint4 w = *reinterpret_cast<const uint4*>(keys);
        visible = nonzero_bytes(w.x) | nonzero_bytes(w.y) << 4 | nonzero_bytes(w.z) << 8 | nonzero_bytes(w.w) << 12;
      } else {
        for (int k = 0; k < n; ++k) {
          visible |= static_cast<uint32_t>(keys[k] != 0) << k;
        }
      }
      any_visible |= visible != 0u;
      any_masked |= visible != (1u << n) - 1u;
      if (rows_stats && visible != 0u) {
        atomicAdd(&row_count[r], __popc(visible));
        atomicMax(&row_last[r], c + 31 - __clz(visible));
      }
    }
  } else {
    for (int e = threadIdx.x; e < rows * cols; e += kSummaryThreads) {
      const int r = e / cols, c = e % cols;
      note_value(mask.additive(mask.offset(b, h, i0 + r, j0 + c)));
    }
  }
  any_visible = __syncthreads_or(any_visible);
  any_masked = __syncthreads_or(any_masked);
  any_bias = __syncthreads_or(any_bias);
  uint8_t tile_class = !any_visible ? kTileMasked : (!any_masked && !any_bias ? kTileVisible : kTileMixed);
  if (rows_stats && tile_class == kTileMixed) {
    int d = 0;
    if (one_diagonal(rows, cols, row_count, row_last, &diag_min, &diag_max, d)) {
      tile_class = kTileDiagonal;
    }
    if (threadIdx.x == 0) {
      diagonal[x] = static_cast<int16_t>(d);
    }
  }
  if (threadIdx.x == 0) {
    out[x] = tile_class;
    if (tile_class != kTileMasked) {
      bounds.note_not_masked(x, q_tiles, kv_tiles);
    }
  }
}

// A key-range tile's class (and diagonal) combined with the mask's tile (b, h, q_tile, kv_tile):
// masked if either is; the other's class where one is visible; one diagonal if both are the same
// one; else mixed (the kernels test the mask's elements and the ranges).
__device__ __forceinline__ uint8_t combined_class(uint8_t range_class, int range_diagonal,
                                                  const TileSummaryView& mask_tiles, int64_t b, int64_t h,
                                                  int64_t q_tile, int64_t kv_tile, int& d) {
  const uint8_t mask_class = mask_tiles.at(b, h, q_tile, kv_tile);
  d = 0;
  if (range_class == kTileMasked || mask_class == kTileMasked) {
    return kTileMasked;
  }
  if (mask_class == kTileVisible) {
    d = range_diagonal;
    return range_class;
  }
  if (range_class == kTileVisible) {
    d = mask_class == kTileDiagonal ? mask_tiles.diagonal_at(b, h, q_tile, kv_tile) : 0;
    return mask_class;
  }
  if (range_class == kTileDiagonal && mask_class == kTileDiagonal &&
      mask_tiles.diagonal_at(b, h, q_tile, kv_tile) == range_diagonal) {
    d = range_diagonal;
    return kTileDiagonal;
  }
  return kTileMixed;
}

// The key-range summary's work: a warp per (batch, query tile, kRangeTilesPerWarp key tiles),
// kRangeWarps warps a CTA along the key tiles.
constexpr int kRangeTilesPerWarp = 8;
constexpr int kRangeWarps = 4;
constexpr int kRangeRowsPerLane = kMaxDiagonalRows / 32;

// One warp per (batch, query tile, kRangeTilesPerWarp key tiles): each lane holds the intervals
// [lo, hi) of keys (KeyRangeView) of rows lane, lane + 32, ...; the key tiles outside the union
// of the rows' intervals (bounded by causality where it is enabled: a causal window's intervals
// run to kv_len) are masked without a test, and each other tile's class comes from the rows'
// counts of keys inside it, reduced over the warp: masked (no row sees a key), visible (every row
// every key), one diagonal d (every row sees a prefix, c <= r + d: the rows seeing some but not
// all agree on d, those seeing none lie above it and those seeing all below), else mixed. The
// rule of one_diagonal, its row conditions as the last empty and the first full row. Then, for
// each of the mask summary's heads, that class combined with the mask's (combined_class;
// mask_tiles' null ptr: no mask) into out / diagonal at
// ((b * heads_m + h) * q_tiles + q_tile) * kv_tiles + kv_tile (bounds as above). No shared
// memory and no CTA barrier: a CTA per query tile walking its key tiles one barrier at a time
// cost a causal window's 32 key tiles at S=4096 some 20 us.
__global__ void __launch_bounds__(32 * kRangeWarps)
    summarize_key_ranges_kernel(KeyRangeView ranges, TileSummaryView mask_tiles, Causal causal, int64_t q_len,
                                int64_t kv_len, int block_q, int block_kv, int64_t heads_m, int64_t q_tiles,
                                int64_t kv_tiles, uint8_t* out, int16_t* diagonal, WalkBoundsOut bounds) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t b = blockIdx.x / q_tiles, q_tile = blockIdx.x % q_tiles;
  const int64_t t_begin = (int64_t{blockIdx.y} * kRangeWarps + warp) * kRangeTilesPerWarp;
  const int64_t t_end = std::min<int64_t>(t_begin + kRangeTilesPerWarp, kv_tiles);
  if (t_begin >= t_end) {
    return;
  }
  const int64_t i0 = q_tile * block_q;
  const int rows = static_cast<int>(std::min<int64_t>(q_len - i0, block_q));
  // This lane's rows' keys, clamped to [0, kv_len): none past the tile's rows or where hi <= lo.
  int64_t lo[kRangeRowsPerLane], hi[kRangeRowsPerLane];
  int64_t union_lo = kv_len, union_hi = 0;
#pragma unroll
  for (int k = 0; k < kRangeRowsPerLane; ++k) {
    const int r = lane + 32 * k;
    lo[k] = hi[k] = 0;
    if (r < rows) {
      lo[k] = std::max<int64_t>(ranges.lo(b, i0 + r), 0);
      hi[k] = std::min<int64_t>(ranges.hi(b, i0 + r), kv_len);
    }
    if (hi[k] > lo[k]) {
      union_lo = std::min(union_lo, lo[k]);
      union_hi = std::max(union_hi, hi[k]);
    }
  }
  // Intervals are below 2^31 (int32 ranges, clamped): the union reduces in 32 bits.
  union_lo = __reduce_min_sync(0xffffffffu, static_cast<unsigned>(union_lo));
  union_hi = std::min<int64_t>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(union_hi)),
                               causal.kv_end(i0 + rows, kv_len));
  // The key tiles that can hold a visible key: [t_first, t_last); the others are masked.
  const int64_t t_first = std::max<int64_t>(union_lo / block_kv, t_begin);
  const int64_t t_last = std::min<int64_t>(union_lo < union_hi ? (union_hi + block_kv - 1) / block_kv : 0, t_end);
  for (int64_t kv_tile = t_begin; kv_tile < t_end; ++kv_tile) {
    uint8_t range_class = kTileMasked;
    int range_diagonal = 0;
    if (kv_tile >= t_first && kv_tile < t_last) {
      const int64_t j0 = kv_tile * block_kv;
      const int cols = static_cast<int>(std::min<int64_t>(kv_len - j0, block_kv));
      int flags = 0;  // 1: a row sees a key; 2: a row misses a key; 4: a row sees keys not a prefix
      int dmin = INT_MAX, dmax = INT_MIN, last_empty = INT_MIN, first_full = INT_MAX;
#pragma unroll
      for (int k = 0; k < kRangeRowsPerLane; ++k) {
        const int r = lane + 32 * k;
        if (r < rows) {
          // The row's keys inside the tile, tile-relative: [tlo, thi) within [0, cols).
          const int tlo = static_cast<int>(std::min<int64_t>(std::max<int64_t>(lo[k] - j0, 0), cols));
          const int thi = static_cast<int>(std::min<int64_t>(std::max<int64_t>(hi[k] - j0, 0), cols));
          const int count = thi > tlo ? thi - tlo : 0;
          flags |= (count > 0 ? 1 : 0) | (count < cols ? 2 : 0) | (count > 0 && tlo > 0 ? 4 : 0);
          if (count > 0 && count < cols) {
            dmin = min(dmin, count - 1 - r);
            dmax = max(dmax, count - 1 - r);
          }
          last_empty = count == 0 ? max(last_empty, r) : last_empty;
          first_full = count == cols ? min(first_full, r) : first_full;
        }
      }
      flags = static_cast<int>(__reduce_or_sync(0xffffffffu, static_cast<unsigned>(flags)));
      dmin = __reduce_min_sync(0xffffffffu, dmin);
      dmax = __reduce_max_sync(0xffffffffu, dmax);
      last_empty = __reduce_max_sync(0xffffffffu, last_empty);
      first_full = __reduce_min_sync(0xffffffffu, first_full);
      range_class = !(flags & 1) ? kTileMasked : !(flags & 2) ? kTileVisible : kTileMixed;
      // One diagonal d = dmin: prefixes only, the partial rows agree on d (there is one), the
      // empty rows see none (r + d < 0) and the full rows all (r + d + 1 >= cols).
      if (range_class == kTileMixed && !(flags & 4) && dmin != INT_MAX && dmin == dmax &&
          (last_empty == INT_MIN || int64_t{last_empty} + dmin < 0) &&
          (first_full == INT_MAX || int64_t{first_full} + dmin + 1 >= cols)) {
        range_class = kTileDiagonal;
        range_diagonal = dmin;
      }
    }
    for (int64_t h = lane; h < heads_m; h += 32) {
      int d = 0;
      const uint8_t tile_class = combined_class(range_class, range_diagonal, mask_tiles, b, h, q_tile, kv_tile, d);
      const int64_t y = ((b * heads_m + h) * q_tiles + q_tile) * kv_tiles + kv_tile;
      out[y] = tile_class;
      diagonal[y] = static_cast<int16_t>(d);
      if (tile_class != kTileMasked) {
        bounds.note_not_masked(y, q_tiles, kv_tiles);
      }
    }
  }
}

}  // namespace

namespace {

// The bounds asked for in *bounds (null: none), allocated for the summary kernel to lower or raise:
// first_visible one int per row of the summary's tiles, kv_tiles until lowered; query_end one
// per column, 0 until raised.
WalkBoundsOut walk_bounds_out(const at::Tensor& summary, TileWalkBounds* bounds) {
  WalkBoundsOut out;
  if (bounds == nullptr) {
    return out;
  }
  const auto options = summary.options().dtype(at::kInt);
  if (bounds->rows) {
    const int64_t rows = summary.size(0) * summary.size(1) * summary.size(2);
    bounds->first_visible = at::full({rows}, summary.size(3), options);
    out.first_visible = bounds->first_visible.data_ptr<int>();
  }
  if (bounds->columns) {
    bounds->query_end = at::full({summary.size(0) * summary.size(1) * summary.size(3)}, 0, options);
    out.query_end = bounds->query_end.data_ptr<int>();
  }
  return out;
}

}  // namespace

at::Tensor summarize_mask_tiles(const at::Tensor& mask, int block_q, int block_kv, at::Tensor* diagonals,
                                TileWalkBounds* bounds, Causal causal, bool read_values) {
  TORCH_INTERNAL_ASSERT(mask.defined() && mask.dim() == 4 && block_q > 0 && block_kv > 0,
                        "attention (CUDA): summarize_mask_tiles takes a 4-D mask view and positive tile sizes");
  TORCH_INTERNAL_ASSERT(read_values || mask.is_floating_point(), "attention (CUDA): only a bias's values go unread");
  const MaskView view = make_mask_view(mask);
  // Broadcast dims of the expanded view have stride 0 (or size 1): summarise them once; a summary
  // whose values go unread is the same for every slice.
  const int64_t batch_m = (!read_values || mask.size(0) == 1 || mask.stride(0) == 0) ? 1 : mask.size(0);
  const int64_t heads_m = (!read_values || mask.size(1) == 1 || mask.stride(1) == 0) ? 1 : mask.size(1);
  const int64_t q_len = mask.size(2), kv_len = mask.size(3);
  // A mask broadcast over the queries (a [B, 1, 1, KV] key mask) gives every query tile the
  // same class: one row of tiles, read with stride 0 (make_tile_summary_view). Its tiles are
  // never diagonal (identical rows are not one diagonal), so the full first tile's rows stand
  // for a shorter last tile too.
  const bool q_broadcast = q_len == 1 || mask.stride(2) == 0;
  const int64_t q_tiles = q_broadcast ? 1 : (q_len + block_q - 1) / block_q;
  const int64_t kv_tiles = (kv_len + block_kv - 1) / block_kv;
  if (q_broadcast) {
    causal.enabled = false;  // one row of tiles stands for every query tile
  }
  at::Tensor summary = at::empty({batch_m, heads_m, q_tiles, kv_tiles}, mask.options().dtype(at::kByte));
  const WalkBoundsOut bounds_out = walk_bounds_out(summary, bounds);
  const int64_t blocks = summary.numel();
  if (blocks == 0) {
    return summary;
  }
  TORCH_CHECK(blocks <= 0x7fffffffLL, "attention (CUDA): the mask has too many tiles to summarise (", blocks, ")");
  // 16 bytes per load: unit stride along the keys, every row of every slice on a 16-byte
  // boundary, tiles starting on one.
  // A size-1 dim is never stepped over: its stride does not matter.
  const int64_t element_size = mask.element_size();
  auto aligned16 = [&](int dim) { return mask.size(dim) == 1 || mask.stride(dim) * element_size % 16 == 0; };
  const bool vec16 = (kv_len == 1 || mask.stride(3) == 1) && reinterpret_cast<uintptr_t>(mask.data_ptr()) % 16 == 0 &&
                     block_kv % 16 == 0 && aligned16(0) && aligned16(1) && aligned16(2);
  // Diagonal tiles: asked for, and read from aligned bool rows; otherwise no tile is one.
  int16_t* diagonal = nullptr;
  if (diagonals != nullptr && vec16 && mask.scalar_type() == at::kBool) {
    TORCH_INTERNAL_ASSERT(block_q <= kMaxDiagonalRows, "attention (CUDA): diagonal tiles of at most 128 rows");
    *diagonals = at::empty(summary.sizes(), mask.options().dtype(at::kShort));
    diagonal = diagonals->data_ptr<int16_t>();
  }
  summarize_mask_tiles_kernel<<<static_cast<unsigned>(blocks), kSummaryThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      view, q_len, kv_len, block_q, block_kv, heads_m, q_tiles, kv_tiles, vec16, causal, read_values,
      summary.data_ptr<uint8_t>(), diagonal, bounds_out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return summary;
}

at::Tensor summarize_key_ranges(const at::Tensor& key_ranges, int64_t kv_len, const at::Tensor& mask, int block_q,
                                int block_kv, at::Tensor* diagonals, TileWalkBounds* bounds, Causal causal) {
  TORCH_INTERNAL_ASSERT(key_ranges.dim() == 3 && key_ranges.size(2) == 2 && key_ranges.stride(2) == 1 &&
                            key_ranges.stride(1) == 2 && key_ranges.scalar_type() == at::kInt && block_q > 0 &&
                            block_q <= kMaxDiagonalRows && block_kv > 0 && diagonals != nullptr,
                        "attention (CUDA): summarize_key_ranges takes [B, Q, 2] int32 rows and tiles of <= 128 rows");
  const int64_t batch = key_ranges.size(0), q_len = key_ranges.size(1);
  at::Tensor mask_summary, mask_diagonals;
  TileSummaryView mask_tiles;  // null: no mask
  if (mask.defined()) {
    mask_summary = summarize_mask_tiles(mask, block_q, block_kv, &mask_diagonals, nullptr, causal);
    mask_tiles = make_tile_summary_view(mask_summary, block_q, block_kv, mask_diagonals);
  }
  const int64_t heads_m = mask_summary.defined() ? mask_summary.size(1) : 1;
  const int64_t q_tiles = (q_len + block_q - 1) / block_q;
  const int64_t kv_tiles = (kv_len + block_kv - 1) / block_kv;
  at::Tensor summary = at::empty({batch, heads_m, q_tiles, kv_tiles}, key_ranges.options().dtype(at::kByte));
  *diagonals = at::empty(summary.sizes(), key_ranges.options().dtype(at::kShort));
  const WalkBoundsOut bounds_out = walk_bounds_out(summary, bounds);
  constexpr int kTilesPerCta = kRangeTilesPerWarp * kRangeWarps;
  const int64_t blocks = batch * q_tiles, splits = (kv_tiles + kTilesPerCta - 1) / kTilesPerCta;
  if (blocks == 0 || splits == 0) {
    return summary;
  }
  TORCH_CHECK(blocks <= 0x7fffffffLL && splits <= 65535,
              "attention (CUDA): the key ranges have too many tiles to summarise (", blocks, " x ", splits, ")");
  summarize_key_ranges_kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(splits)), 32 * kRangeWarps, 0,
                                c10::cuda::getCurrentCUDAStream()>>>(
      make_key_range_view(key_ranges), mask_tiles, causal, q_len, kv_len, block_q, block_kv, heads_m, q_tiles, kv_tiles,
      summary.data_ptr<uint8_t>(), diagonals->data_ptr<int16_t>(), bounds_out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return summary;
}

KeyRangeView make_key_range_view(const at::Tensor& key_ranges) {
  KeyRangeView view;
  if (key_ranges.defined()) {
    view.ptr = key_ranges.data_ptr<int>();
    view.stride_b = key_ranges.stride(0);
  }
  return view;
}

TileSummaryView make_tile_summary_view(const at::Tensor& summary, int block_q, int block_kv,
                                       const at::Tensor& diagonals, const TileWalkBounds& bounds) {
  TileSummaryView view;
  if (!summary.defined()) {
    return view;
  }
  TORCH_INTERNAL_ASSERT(summary.dim() == 4 && summary.is_contiguous() && summary.scalar_type() == at::kByte,
                        "attention (CUDA): the tile summary must be a contiguous 4-D uint8 tensor");
  view.ptr = summary.data_ptr<uint8_t>();
  view.diagonal = diagonals.defined() ? diagonals.data_ptr<int16_t>() : nullptr;
  view.first_visible = bounds.first_visible.defined() ? bounds.first_visible.data_ptr<int>() : nullptr;
  view.query_end = bounds.query_end.defined() ? bounds.query_end.data_ptr<int>() : nullptr;
  view.kv_tiles = std::max<int64_t>(summary.size(3), 1);
  view.slice_tiles = std::max<int64_t>(summary.size(2) * summary.size(3), 1);
  view.stride_b = summary.size(0) == 1 ? 0 : summary.stride(0);
  view.stride_h = summary.size(1) == 1 ? 0 : summary.stride(1);
  view.stride_q = summary.size(2) == 1 ? 0 : summary.stride(2);  // one row: a key mask, or one tile
  view.block_q = block_q;
  view.block_kv = block_kv;
  return view;
}

}  // namespace safeattn::cuda::attn
