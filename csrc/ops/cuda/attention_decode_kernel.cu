// Split-KV decode forward of safeattn::attention (see attention_decode.h). Semantics: those of
// ops/attention.h, as the tensor-core forward (attention_fwd.cuh) gives them; the float64
// reference is python/safeattn/reference.py.
//
// Decoding reads the whole KV cache for a few query rows per head: the work is bytes, not flops.
// The prefill forward spends a 128-row query tile on those rows and reads each kv head once per
// query head of its group, one CTA per (batch, head) walking the whole cache. Here instead:
//   1. split kernel: one CTA per (KV split, kv head, batch) holds every query row of the kv
//      head's group (rows = group * Q <= 16: one MMA row tile, padded with zero rows) and walks
//      its split's keys in tiles of 64, double buffered by cp.async as in the prefill forward.
//      The splits share the keys some row sees (with key ranges, the union of the rows' ranges:
//      a KV cache's filled length, a window), so a cache's unused slots are never read.
//      Each of the 4 warps takes 16 keys of every tile with its own online softmax state:
//      S = Q K^T and O += P V by mma.sync (K and V read once per kv head, a few instructions per
//      16 keys), no cross-warp step inside the loop. At the end the warps' states are merged
//      through shared memory, and the split's normalised output and lse go to an fp32 workspace.
//   2. combine kernel: one warp per row merges the splits' partials by their lse (with the
//      sink logit in the denominator when there are sinks) and writes out and lse.
// The split count fills the GPU once: CTAs resident per SM (occupancy) x SMs over B x Hkv.
// Numerics as in the tensor-core forward: a row (or split, or warp) with no visible key keeps
// m = -inf and uses 0 as its exponent offset, so it contributes exactly 0 and never NaN; a masked
// element is -inf whatever its score; a NaN score makes its row's out and lse NaN.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "ops/attention_kvcache.h"
#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_decode.h"
#include "ops/cuda/attention_fwd.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "safeattn.h"

namespace safeattn::cuda {
namespace {

using attn::Causal;
using attn::KeyRangeView;
using attn::kLn2;
using attn::kLog2e;
using attn::MaskView;
using attn::ScoreRule;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxRows = 16;   // query rows per kv head (group * Q): one MMA row tile
constexpr int kWarpKeys = 16;  // keys of a tile per warp: one k16 step of P V
constexpr int kTileKeys = kWarpKeys * kWarps;
constexpr int kMaxSplits = 256;
// The head dims the decode kernels are compiled for (bit D / 16): 64 and 128.
constexpr uint64_t kDecodeHeadDims = (uint64_t{1} << (64 / 16)) | (uint64_t{1} << (128 / 16));
constexpr int kCombineWarps = 4;

struct DecodeParams {
  const void* q;  // [B, Hq, Q, D], unit inner stride, 16-byte aligned rows
  const void* k;  // [B, Hkv, KV, D]
  const void* v;  // [B, Hkv, KV, D]
  int64_t q_sb, q_sh, q_si;
  int64_t k_sb, k_sh, k_si;
  int64_t v_sb, v_sh, v_si;
  float* o_part;    // [B * Hq * Q, splits, D]: each split's output, normalised by its own sum
  float* lse_part;  // [B * Hq * Q, splits]: each split's lse, log2 domain (-inf: no visible key)
  int64_t hq, group, q_len;
  int64_t kv_end;   // keys at or past it are visible to no row (kv_len, or less by causal)
  int splits;       // CTAs per (batch, kv head), sharing the tiles of the keys its rows see
  int rows;         // group * q_len: row r is query i = r / group of head hk * group + r % group
  ScoreRule score;  // log2 units, a floating mask's values converted to them
  Causal causal;
  MaskView mask;
  KeyRangeView ranges;  // null: every row's keys are [0, kv_end)
  // A KV cache's rules instead (seqlens non-null: _attention_kvcache): each row's keys, and with a
  // block table where key j of batch b lives, k + page(b, j) * k_sb + slot(j) * k_si (k_sb the
  // page stride then).
  KvCacheView cache;

  // Query i of batch b sees keys [lo, hi) within [0, kv_end): its key range and the causal rule
  // (then the mask, element by element). int32, as key ranges are: kv_end is at most 2^31 - 1
  // (attention_fwd_decode_rejects), and the causal shift is clamped to [-Q, KV].
  __device__ __forceinline__ void row_range(int64_t b, int i, int& lo, int& hi) const {
    if (cache.seqlens != nullptr) {
      cache.key_range(b, i, lo, hi);
      return;
    }
    lo = 0;
    hi = static_cast<int>(causal.kv_end(i + 1, kv_end));
    if (ranges.ptr != nullptr) {
      lo = max(ranges.lo(b, i), 0);
      hi = min(ranges.hi(b, i), hi);
    }
  }
};

template <typename T, int kD>
constexpr size_t decode_smem_bytes() {
  return static_cast<size_t>(kMaxRows + 4 * kTileKeys) * (kD + 8) * sizeof(T);
}

// kPaged: K and V rows through p.cache's block table (a separate instance: the contiguous one
// keeps its registers).
template <typename T, int kD, bool kPaged>
__global__ void __launch_bounds__(kThreads, 3) attention_decode_split_kernel(const DecodeParams p) {
  using namespace attn;  // mma, ldmatrix, cp.async, fast_exp2
  constexpr int kStride = padded_row(kD);
  constexpr int kChunks = kD / 8;   // 16-byte chunks per row
  constexpr int kKSteps = kD / 16;  // k16 steps of Q K^T
  constexpr int kDTiles = kD / 8;   // n8 tiles of an output row
  static_assert(kD % 16 == 0, "decode: head dim");
  // The warps' merge reuses the K/V buffers: m and l per (warp, row), then O per (warp, row).
  static_assert((2 + kD) * kWarps * kMaxRows * sizeof(float) <= 4 * kTileKeys * kStride * sizeof(T),
                "decode: the merge scratch must fit in the K/V buffers");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);  // [kMaxRows][kStride]
  T* s_k = s_q + kMaxRows * kStride;        // [2][kTileKeys][kStride]
  T* s_v = s_k + 2 * kTileKeys * kStride;   // [2][kTileKeys][kStride]

  const int split = blockIdx.x;
  const int64_t hk = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // the MMA fragment's row group and column pair
  const int a_row = (lane % 8) + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);
  const int k_row = (lane % 8) + 8 * (lane / 16), k_col = 8 * ((lane / 8) % 2);

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  // The keys some row of this CTA sees, [lo_min, hi_max), and those every row sees, [lo_max,
  // hi_min): the splits share the first equally, and tiles inside the second need no range test.
  // Keys at or past hi_max are not read (zero-filled in shared memory): a cache's unused slots,
  // whatever they hold, never meet a probability, not even a zero one.
  int lo_min = static_cast<int>(p.kv_end), hi_max = 0, lo_max = 0, hi_min = static_cast<int>(p.kv_end);
  for (int i = 0; i < p.q_len; ++i) {
    int lo, hi;
    p.row_range(b, i, lo, hi);
    if (lo < hi) {
      lo_min = min(lo, lo_min);
      hi_max = max(hi, hi_max);
    }
    lo_max = max(lo, lo_max);
    hi_min = min(hi, hi_min);
  }
  const int first_tile = lo_min / kTileKeys;
  const int n_tiles = lo_min < hi_max ? (hi_max + kTileKeys - 1) / kTileKeys - first_tile : 0;
  const int per_split = (n_tiles + p.splits - 1) / p.splits;
  const int tile_begin = first_tile + min(split * per_split, n_tiles);
  const int tile_end = first_tile + min(split * per_split + per_split, n_tiles);

  // Q rows gathered from their (query, head) positions; rows past p.rows are zeros.
  for (int c = tid; c < kMaxRows * kChunks; c += kThreads) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = r < p.rows;
    const T* src = static_cast<const T*>(p.q);
    if (valid) {
      src += b * p.q_sb + (hk * p.group + r % p.group) * p.q_sh + (r / p.group) * p.q_si + ch * 8;
    }
    cp_async_16(s_q + r * kStride + ch * 8, src, valid);
  }
  auto load_kv = [&](int tile, int stage) {
    const int j0 = tile * kTileKeys;
    T* k_dst = s_k + stage * kTileKeys * kStride;
    T* v_dst = s_v + stage * kTileKeys * kStride;
    if constexpr (kPaged) {
      // Each row of the tile from its own page: the table entries of this thread's rows are read
      // first, all in flight together, and serve K and V both.
      constexpr int kRounds = kTileKeys * kChunks / kThreads;
      static_assert(kTileKeys * kChunks % kThreads == 0, "decode: whole rounds of 16-byte chunks");
      int page[kRounds];
#pragma unroll
      for (int it = 0; it < kRounds; ++it) {
        const int j = j0 + (it * kThreads + tid) / kChunks;
        page[it] = j < hi_max ? p.cache.page(b, j) : -1;
      }
#pragma unroll
      for (int it = 0; it < kRounds; ++it) {
        const int c = it * kThreads + tid, r = c / kChunks, ch = c % kChunks, slot = p.cache.slot(j0 + r);
        const bool valid = page[it] >= 0;
        const int64_t k_off = valid ? page[it] * p.k_sb + slot * p.k_si + hk * p.k_sh + ch * 8 : 0;
        const int64_t v_off = valid ? page[it] * p.v_sb + slot * p.v_si + hk * p.v_sh + ch * 8 : 0;
        cp_async_16(k_dst + r * kStride + ch * 8, static_cast<const T*>(p.k) + k_off, valid);
        cp_async_16(v_dst + r * kStride + ch * 8, static_cast<const T*>(p.v) + v_off, valid);
      }
    } else {
      load_tile<T, kTileKeys, kD, kThreads>(k_dst, k_base + j0 * p.k_si, p.k_si, hi_max - j0, tid);
      load_tile<T, kTileKeys, kD, kThreads>(v_dst, v_base + j0 * p.v_si, p.v_si, hi_max - j0, tid);
    }
  };
  if (tile_begin < tile_end) {
    load_kv(tile_begin, 0);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t q_frag[kKSteps][4];
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    ldmatrix_x4(q_frag[kk], s_q + a_row * kStride + kk * 16 + a_col);
  }

  // This thread's two rows of the fragment, g and g + 8: their query index and mask row.
  // A row past p.rows sees no key: an empty range.
  int64_t row_mask[2];
  int row_lo[2], row_hi[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    const bool row_ok = r < p.rows;
    const int row_query = row_ok ? r / static_cast<int>(p.group) : 0;
    p.row_range(b, row_query, row_lo[half], row_hi[half]);
    row_hi[half] = row_ok ? row_hi[half] : 0;
    const int64_t h = hk * p.group + (row_ok ? r % p.group : 0);
    row_mask[half] = p.mask.kind == attn::MaskKind::kNone ? 0 : p.mask.offset(b, h, row_query, 0);
  }

  float o_acc[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      o_acc[dt][e] = 0.0f;
    }
  }
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  int stage = 0;
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    if (tile + 1 < tile_end) {
      load_kv(tile + 1, stage ^ 1);  // in flight while this tile is computed
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* k_s = s_k + (stage * kTileKeys + warp * kWarpKeys) * kStride;
    const T* v_s = s_v + (stage * kTileKeys + warp * kWarpKeys) * kStride;
    const int j0 = tile * kTileKeys + warp * kWarpKeys;  // this warp's first key

    // ---- S = Q K^T over this warp's 16 keys, in log2 units ----
    float s_acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t kb[4];
      ldmatrix_x4(kb, k_s + k_row * kStride + kk * 16 + k_col);
      mma_pair<T>(s_acc[0], s_acc[1], q_frag[kk], kb);
    }
    p.score.score_all<8>(&s_acc[0][0]);
    // The rows' key ranges (the causal rule in them) and the mask: only where one can hide a key.
    if (p.mask.kind != attn::MaskKind::kNone || j0 < lo_max || j0 + kWarpKeys > hi_min) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = j0 + nt * 8 + 2 * t + e;
            const bool visible = row_lo[half] <= j && j < row_hi[half];
            float x = s_acc[nt][2 * half + e];
            if (visible && p.mask.kind != attn::MaskKind::kNone) {
              x = p.score.masked(x, p.mask.additive(row_mask[half] + j * p.mask.stride_kv));
            }
            s_acc[nt][2 * half + e] = visible ? x : -INFINITY;
          }
        }
      }
    }

    // ---- online softmax (the four threads of a quad hold one row) ----
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx =
          fmaxf(fmaxf(s_acc[0][2 * half], s_acc[0][2 * half + 1]), fmaxf(s_acc[1][2 * half], s_acc[1][2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_max[half], mx);
      const float offset = m_new == -INFINITY ? 0.0f : m_new;  // empty so far: no -inf - -inf
      const float alpha = fast_exp2(row_max[half] - offset);   // old max -inf: 0
      row_max[half] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pr = fast_exp2(s_acc[nt][2 * half + e] - offset);
          s_acc[nt][2 * half + e] = pr;
          sum += pr;
        }
      }
      row_sum[half] = row_sum[half] * alpha + sum;  // per thread; quad-summed at the end
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o_acc[dt][2 * half] *= alpha;
        o_acc[dt][2 * half + 1] *= alpha;
      }
    }

    // ---- O += P V: P in registers is the A operand ----
    const uint32_t pa[4] = {pack2<T>(s_acc[0][0], s_acc[0][1]), pack2<T>(s_acc[0][2], s_acc[0][3]),
                            pack2<T>(s_acc[1][0], s_acc[1][1]), pack2<T>(s_acc[1][2], s_acc[1][3])};
#pragma unroll
    for (int dp = 0; dp < kD / 16; ++dp) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_s + a_row * kStride + dp * 16 + a_col);
      mma_pair<T>(o_acc[2 * dp], o_acc[2 * dp + 1], pa, vb);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    stage ^= 1;
  }
  cp_async_wait<0>();

  // ---- merge the warps' states (the K/V buffers are free now), then the split's partials ----
  float* stat = reinterpret_cast<float*>(s_k);  // [2][kWarps][kMaxRows]: m, then l
  float* o_s = stat + 2 * kWarps * kMaxRows;    // [kWarps][kMaxRows][kD], unnormalised
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    float l = row_sum[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0) {
      stat[warp * kMaxRows + r] = row_max[half];
      stat[(kWarps + warp) * kMaxRows + r] = l;
    }
    float* o_row = o_s + (warp * kMaxRows + r) * kD + 2 * t;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      o_row[dt * 8] = o_acc[dt][2 * half];
      o_row[dt * 8 + 1] = o_acc[dt][2 * half + 1];
    }
  }
  __syncthreads();
  // Per row: a warp counts unless its sum is 0 (no visible key; NaN counts), with exponent offset
  // m (0 when m = -inf); weights 2^(offset - top) replace the m slots, 1 / l goes to slot 0 of l.
  if (tid < kMaxRows) {
    const int r = tid;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float m = stat[w * kMaxRows + r], l = stat[(kWarps + w) * kMaxRows + r];
      top = l == 0.0f ? top : fmaxf(top, m == -INFINITY ? 0.0f : m);
    }
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float m = stat[w * kMaxRows + r], l = stat[(kWarps + w) * kMaxRows + r];
      const float weight = l == 0.0f ? 0.0f : exp2f((m == -INFINITY ? 0.0f : m) - top);
      stat[w * kMaxRows + r] = weight;
      total += weight * l;
    }
    const bool empty = top == -INFINITY;
    stat[kWarps * kMaxRows + r] = empty ? 0.0f : 1.0f / total;
    if (r < p.rows) {
      const int64_t h = hk * p.group + r % p.group, i = r / p.group;
      const int64_t row = (b * p.hq + h) * p.q_len + i;
      p.lse_part[row * p.splits + split] = empty ? -INFINITY : top + log2f(total);
    }
  }
  __syncthreads();
  for (int c = tid; c < p.rows * kD; c += kThreads) {
    const int r = c / kD, col = c % kD;
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = stat[w * kMaxRows + r];
      acc += weight == 0.0f ? 0.0f : weight * o_s[(w * kMaxRows + r) * kD + col];  // 0, not 0 * NaN
    }
    const int64_t h = hk * p.group + r % p.group, i = r / p.group;
    const int64_t row = (b * p.hq + h) * p.q_len + i;
    p.o_part[(row * p.splits + split) * kD + col] = acc * stat[kWarps * kMaxRows + r];
  }
}

// One warp per query row (b, h, i): lse = log-sum-exp of the splits' lse (and the sink logit),
// out = sum over splits of 2^(lse_split - lse) * out_split. Lane s holds the lse and weight of
// splits s, s + 32, ... (each read once) and broadcasts them; each lane owns kD / 32 consecutive
// output columns, read with one vector load per split, eight splits in flight at a time.
template <typename T, int kD>
__global__ void __launch_bounds__(kCombineWarps * 32)
    attention_decode_combine_kernel(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                                    const float* __restrict__ sinks, T* __restrict__ out, int64_t o_sb, int64_t o_sh,
                                    int64_t o_si, float* __restrict__ lse, float* __restrict__ lse_lo,
                                    int64_t total_rows, int64_t hq, int64_t q_len, int splits) {
  static_assert(kD == 64 || kD == 128, "decode combine: a float2 or float4 per lane");
  constexpr int kVec = kD / 32;
  constexpr int kLaneSplits = kMaxSplits / 32;
  using Vec = std::conditional_t<kVec == 4, float4, float2>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= total_rows) {
    return;
  }
  const float* lse_row = lse_part + row * splits;
  float x[kLaneSplits];
  float mx = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int k = 0; k < kLaneSplits; ++k) {
    const int s = lane + 32 * k;
    x[k] = s < splits ? lse_row[s] : -INFINITY;
    nan |= x[k] != x[k];
    mx = fmaxf(mx, x[k]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
  }
  nan = __any_sync(0xffffffffu, nan);
  float total = 0.0f;
  if (mx != -INFINITY) {
#pragma unroll
    for (int k = 0; k < kLaneSplits; ++k) {
      total += exp2f(x[k] - mx);  // an empty split (or none): exp2(-inf) = 0
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    total += __shfl_xor_sync(0xffffffffu, total, offset);
  }
  const int64_t h = (row / q_len) % hq;
  const float row_lse2 = mx == -INFINITY ? -INFINITY : mx + log2f(total);
  float lse2 = row_lse2;
  if (sinks != nullptr) {
    lse2 = attn::log2_add_exp2(row_lse2, sinks[h] * kLog2e);  // the sink joins the denominator only
  }
  if (nan) {
    lse2 = NAN;
  }
  const bool empty = row_lse2 == -INFINITY && !nan;

  float acc[kVec] = {};
  if (!empty) {
    const float* o_col = o_part + row * splits * kD + lane * kVec;
#pragma unroll
    for (int k = 0; k < kLaneSplits; ++k) {
      if (32 * k >= splits) {
        break;
      }
      const float lane_weight = x[k] == -INFINITY ? 0.0f : exp2f(x[k] - lse2);
      const int n = splits - 32 * k < 32 ? splits - 32 * k : 32;
#pragma unroll 8
      for (int s = 0; s < n; ++s) {
        const float w = __shfl_sync(0xffffffffu, lane_weight, s);
        const Vec o = *reinterpret_cast<const Vec*>(o_col + (32 * k + s) * kD);  // an empty split's row is 0
        acc[0] = fmaf(w, o.x, acc[0]);
        acc[1] = fmaf(w, o.y, acc[1]);
        if constexpr (kVec == 4) {
          acc[2] = fmaf(w, o.z, acc[2]);
          acc[3] = fmaf(w, o.w, acc[3]);
        }
      }
    }
  }
  const int64_t i = row % q_len, b = row / (q_len * hq);
  T* o = out + b * o_sb + h * o_sh + i * o_si + lane * kVec;
#pragma unroll
  for (int e = 0; e < kVec; e += 2) {
    *reinterpret_cast<uint32_t*>(o + e) = attn::pack2<T>(acc[e], acc[e + 1]);  // an empty row is exactly 0
  }
  if (lane == 0) {
    lse[row] = lse2 * kLn2;
    if (lse_lo != nullptr) {
      // The product's rounding error (log2 units: no row here is huge, see natural_units).
      lse_lo[row] = lse2 == -INFINITY || lse2 != lse2 ? 0.0f : fmaf(lse2, kLn2, -lse[row]);
    }
  }
}

// What the combine kernel writes: out (rows strided, unit inner stride), lse and lse_lo
// ([B, Hq, Q] float32 contiguous; lse_lo may be null), reading sinks ([Hq] float32, or null).
struct DecodeOutputs {
  void* out = nullptr;
  int64_t o_sb = 0, o_sh = 0, o_si = 0;
  float* lse = nullptr;
  float* lse_lo = nullptr;
  const float* sinks = nullptr;
};

template <typename T, int kD, bool kPaged>
void launch_decode(DecodeParams p, const DecodeOutputs& o, int64_t batch, int64_t hkv, at::TensorOptions options) {
  constexpr size_t kSmem = decode_smem_bytes<T, kD>();
  auto kernel = &attention_decode_split_kernel<T, kD, kPaged>;
  if constexpr (kSmem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  }
  // One wave: as many splits as the resident CTAs (per SM, by occupancy) leave to each (batch,
  // kv head), each split at least one key tile. The occupancy of one kernel does not change.
  static const int resident = [&] {
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, kSmem));
    return std::max(n, 1);
  }();
  // With key ranges a (batch, kv head) may see fewer keys than kv_end: its splits then share
  // those (the kernel divides them), and some may get none.
  const int64_t tiles = (p.kv_end + kTileKeys - 1) / kTileKeys;
  const int64_t slots = multiprocessor_count() * resident;
  p.splits = static_cast<int>(std::clamp<int64_t>(slots / (batch * hkv), 1, std::clamp<int64_t>(tiles, 1, kMaxSplits)));

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t total_rows = batch * p.hq * p.q_len;
  const at::TensorOptions f32 = options.dtype(at::kFloat);
  const at::Tensor o_part = at::empty({total_rows, p.splits, kD}, f32);
  const at::Tensor lse_part = at::empty({total_rows, p.splits}, f32);
  p.o_part = o_part.data_ptr<float>();
  p.lse_part = lse_part.data_ptr<float>();
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(hkv), static_cast<unsigned>(batch));
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t blocks = (total_rows + kCombineWarps - 1) / kCombineWarps;
  attention_decode_combine_kernel<T, kD><<<static_cast<unsigned>(blocks), kCombineWarps * 32, 0, stream>>>(
      p.o_part, p.lse_part, o.sinks, static_cast<T*>(o.out), o.o_sb, o.o_sh, o.o_si, o.lse, o.lse_lo, total_rows, p.hq,
      p.q_len, p.splits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_decode(at::ScalarType dtype, int64_t head_dim, const DecodeParams& p, const DecodeOutputs& o, int64_t batch,
                int64_t hkv, at::TensorOptions options) {
  with_head_dim<kDecodeHeadDims>(head_dim, [&](auto dim) {
    constexpr int kD = decltype(dim)::value;
    const bool paged = p.cache.block_table != nullptr;
    if (dtype == at::kBFloat16) {
      paged ? launch_decode<__nv_bfloat16, kD, true>(p, o, batch, hkv, options)
            : launch_decode<__nv_bfloat16, kD, false>(p, o, batch, hkv, options);
    } else {
      paged ? launch_decode<__half, kD, true>(p, o, batch, hkv, options)
            : launch_decode<__half, kD, false>(p, o, batch, hkv, options);
    }
  });
}

// What both routes ask of the call's shape: rows = query rows per kv head (group x Q).
const char* decode_shape_rejects(at::ScalarType dtype, int64_t head_dim, int64_t dv, int64_t rows, int64_t batch,
                                 int64_t hkv, int64_t kv_len) {
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return "dtype is not float16 or bfloat16";
  }
  if (!has_head_dim<kDecodeHeadDims>(head_dim) || dv != head_dim) {
    return "head dim is not 64 or 128 with D == Dv";
  }
  if (rows < 1 || rows > kMaxRows) {
    return "more than 16 query rows per kv head (query heads per kv head x Q)";
  }
  if (batch > 65535 || hkv > 65535) {
    return "batch or kv heads above 65535 (grid y and z)";
  }
  if (kv_len > int64_t{1} << 30) {
    return "more than 2^30 keys (key indices are int32)";
  }
  return nullptr;
}

DecodeParams decode_params(const at::Tensor& q, int64_t hq, int64_t q_len, int64_t group, double scale,
                           double softcap) {
  DecodeParams p{};
  p.q = q.const_data_ptr();
  p.hq = hq;
  p.group = group;
  p.q_len = q_len;
  p.rows = static_cast<int>(group * q_len);
  p.score = attn::score_rule(scale, softcap, /*natural=*/false, /*log2_mask=*/true);
  return p;
}

}  // namespace

const char* attention_fwd_decode_rejects(const AttentionFwdArgs& a) {
  if (a.out.numel() == 0) {
    return "an empty output";
  }
  const int64_t hkv = a.key.size(1);
  if (const char* reason =
          decode_shape_rejects(a.query.scalar_type(), a.query.size(3), a.value.size(3),
                               a.query.size(1) / hkv * a.query.size(2), a.query.size(0), hkv, a.key.size(2))) {
    return reason;
  }
  if (a.out.stride(3) != 1 || !attn::rows_aligned_16(a.query) || !attn::rows_aligned_16(a.key) ||
      !attn::rows_aligned_16(a.value)) {
    return "query, key or value rows not 16-byte aligned, or out's last dim strided";
  }
  // A floating mask needs natural score units (attention_common.cuh, exp_of), which this kernel
  // does not have: the prefill kernel takes those calls.
  if (attn::natural_units(a.mask)) {
    return "a float mask (this kernel scores in log2 units only)";
  }
  if (!a.lse.is_contiguous() || a.lse.scalar_type() != at::kFloat) {
    return "lse is not contiguous float32";
  }
  return nullptr;
}

void attention_fwd_decode(const AttentionFwdArgs& a) {
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2);
  DecodeParams p = decode_params(a.query, hq, q_len, hq / hkv, a.scale, a.softcap);
  p.k = a.key.const_data_ptr();
  p.v = a.value.const_data_ptr();
  p.q_sb = a.query.stride(0), p.q_sh = a.query.stride(1), p.q_si = a.query.stride(2);
  p.k_sb = a.key.stride(0), p.k_sh = a.key.stride(1), p.k_si = a.key.stride(2);
  p.v_sb = a.value.stride(0), p.v_sh = a.value.stride(1), p.v_si = a.value.stride(2);
  p.causal = attn::causal_rule(a);
  p.mask = attn::make_mask_view(a.mask);
  p.ranges = attn::make_key_range_view(a.key_ranges);
  // Keys at or past kv_end are hidden from every row by the causal rule (the last row, q_len - 1,
  // sees keys j <= q_len - 1 + shift): they are not read.
  p.kv_end = a.is_causal ? std::clamp<int64_t>(q_len + p.causal.shift, 0, kv_len) : kv_len;
  DecodeOutputs o;
  o.out = a.out.data_ptr();
  o.o_sb = a.out.stride(0), o.o_sh = a.out.stride(1), o.o_si = a.out.stride(2);
  o.lse = a.lse.data_ptr<float>();
  o.lse_lo = a.lse_lo.defined() ? a.lse_lo.data_ptr<float>() : nullptr;
  o.sinks = a.sinks.defined() ? a.sinks.const_data_ptr<float>() : nullptr;
  run_decode(a.query.scalar_type(), a.query.size(3), p, o, batch, hkv, a.query.options());
}

const char* attention_kvcache_decode_rejects(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             int64_t capacity) {
  if (q.numel() == 0) {
    return "an empty output";
  }
  const int64_t hkv = k_cache.size(2);
  if (const char* reason = decode_shape_rejects(q.scalar_type(), q.size(3), v_cache.size(3),
                                                q.size(2) / hkv * q.size(1), q.size(0), hkv, capacity)) {
    return reason;
  }
  if (!attn::rows_aligned_16(q) || !attn::rows_aligned_16(k_cache) || !attn::rows_aligned_16(v_cache)) {
    return "q, k_cache or v_cache rows not 16-byte aligned";
  }
  return nullptr;
}

std::tuple<at::Tensor, at::Tensor> attention_kvcache_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                            const at::Tensor& v_cache, const KvCacheView& cache,
                                                            double scale, double softcap, const at::Tensor& sinks) {
  // q [B, Sq, Hq, D]; a contiguous cache [B, S, Hkv, D], a paged one [pages, page_size, Hkv, D].
  const int64_t batch = q.size(0), q_len = q.size(1), hq = q.size(2), hkv = k_cache.size(2);
  DecodeParams p = decode_params(q, hq, q_len, hq / hkv, scale, softcap);
  p.k = k_cache.const_data_ptr();
  p.v = v_cache.const_data_ptr();
  p.q_sb = q.stride(0), p.q_sh = q.stride(2), p.q_si = q.stride(1);
  p.k_sb = k_cache.stride(0), p.k_sh = k_cache.stride(2), p.k_si = k_cache.stride(1);
  p.v_sb = v_cache.stride(0), p.v_sh = v_cache.stride(2), p.v_si = v_cache.stride(1);
  p.cache = cache;
  p.kv_end = cache.capacity;
  at::Tensor out = at::empty({batch, q_len, hq, v_cache.size(3)}, q.options());
  at::Tensor lse = at::empty({batch, hq, q_len}, q.options().dtype(at::kFloat));
  DecodeOutputs o;
  o.out = out.data_ptr();
  o.o_sb = out.stride(0), o.o_sh = out.stride(2), o.o_si = out.stride(1);
  o.lse = lse.data_ptr<float>();
  o.sinks = sinks.defined() ? sinks.const_data_ptr<float>() : nullptr;
  run_decode(q.scalar_type(), q.size(3), p, o, batch, hkv, q.options());
  return {out, lse};
}

}  // namespace safeattn::cuda
