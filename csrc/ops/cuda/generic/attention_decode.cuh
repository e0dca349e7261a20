// Split-KV decode forward of safeattn::attention (see attention_decode.h; host code in
// attention_decode_kernel.cu). Semantics: those of ops/attention.h, as the tensor-core forward
// (attention_fwd.cuh) gives them; the float64 reference is python/safeattn/reference.py.
//
// Decoding reads the whole KV cache for a few query rows per head: the work is bytes, not flops.
// The prefill forward spends a 128-row query tile on those rows and reads each kv head once per
// query head of its group, one CTA per (batch, head) walking the whole cache. Here instead:
//   1. split kernel: one CTA per (KV split, kv head, batch) holds every query row of the kv
//      head's group (rows = group * Q <= 16: one MMA row tile, padded with zero rows) and walks
//      its split's keys in tiles of 64, kStages tiles in flight by cp.async. The splits share the
//      keys some row sees (with key ranges, the union of the rows' ranges: a KV cache's filled
//      length, a window), so a cache's unused slots are never read. Each of the 4 warps takes 16
//      keys of every tile with its own online softmax state: S = Q K^T and O += P V by mma.sync
//      (K and V read once per kv head, a few instructions per 16 keys), no cross-warp step inside
//      the loop. At the end the warps' states are merged through shared memory; with one split
//      the CTA writes out and lse itself. Else each split's normalised output and lse are merged
//      by their lse (with the sink logit in the denominator when there are sinks):
//   2. on sm_90 for short caches with few (batch, kv head) pairs (decode_launch), inside the
//      split kernel: up to 16 splits are one thread block cluster, each keeps its
//      partials in shared memory and merges a share of the rows from every split's (distributed
//      shared memory): one kernel a step, no workspace;
//   3. else in the combine kernel, one warp per row, from an fp32 workspace (on sm_90 launched
//      programmatically: scheduled while the splits run, it waits for them, launch_combine_kernel).
// The split count fills the GPU once: CTAs resident per SM (occupancy) x SMs over B x Hkv, a long
// cache's splits at least kLongSplitTiles tiles each (decode_launch).
// Numerics as in the tensor-core forward: a row (or split, or warp) with no visible key keeps
// m = -inf and uses 0 as its exponent offset, so it contributes exactly 0 and never NaN; a masked
// element is -inf whatever its score; a NaN score makes its row's out and lse NaN.
//
// No torch: the standalone check benchmarks/decode_check.cu compiles this header as it is.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "ops/cuda/generic/mma_sync.cuh"
#include "ops/cuda/mask_view.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/score_rule.cuh"
#include "ops/kv_cache_view.h"

namespace safeattn::cuda::decode {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxRows = 16;   // query rows per kv head (group * Q): one MMA row tile
constexpr int kWarpKeys = 16;  // keys of a tile per warp: one k16 step of P V
constexpr int kTileKeys = kWarpKeys * kWarps;
constexpr int kMaxSplits = 256;
constexpr int kCombineWarps = 4;
// The most splits that merge inside a thread block cluster (sm_90: through distributed shared
// memory, no workspace and no combine kernel): the portable cluster size, and the largest one
// sm_90 allows a kernel that asks for it (step_max_cluster says when a step takes it).
constexpr int kMaxClusterSplits = 8;
constexpr int kMaxClusterSplitsNonPortable = 16;

// The split kernel's pipeline: kStages key tiles in shared memory (all of them in flight while
// one is waited for), kMinBlocks CTAs per SM asked of the register allocator.
// kPrefetch: the L2 prefetch size (0, 128 or 256 bytes) each K/V row load asks for. kChains: the
// accumulator chains of a warp's Q K^T over the head dim (1: each MMA waits for the one before;
// 2: even and odd k16 steps apart, added at the end, half the dependent latency).
template <int kStages_, int kMinBlocks_, int kPrefetch_ = 0, int kChains_ = 1>
struct DecodeTiles {
  static_assert(kStages_ >= 2, "decode: at least double buffering");
  static_assert(kPrefetch_ == 0 || kPrefetch_ == 128 || kPrefetch_ == 256, "decode: L2 prefetch size");
  static_assert(kChains_ == 1 || kChains_ == 2, "decode: one or two Q K^T chains");
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kPrefetch = kPrefetch_;
  static constexpr int kChains = kChains_;
  // A paged cache's page ids, kPageSlots tiles of them: fetched kStages tiles ahead of the tile
  // loads that read them, so that no load waits for the block table. Before the loop's first
  // barrier the prologue has fetched the pages of tiles 0 .. 2 kStages - 2 and read those of the
  // first kStages - 1, so each needs a slot of its own (kStages + 1 slots let the fetch for tile
  // kStages + 1 overwrite tile 0's while other threads read it: racecheck, 3+ stages).
  static constexpr int kPageSlots = 2 * kStages - 1;
  template <typename T, int kD>
  static constexpr size_t smem_bytes() {
    return static_cast<size_t>(kMaxRows + 2 * kStages * kTileKeys) * attn::padded_row(kD) * sizeof(T) +
           kPageSlots * kTileKeys * sizeof(int);
  }
};

// The shape each head dim runs. Measured with benchmarks/decode_check.cu (H200, GQA 4, bf16): 3, 4
// or 6 stages (2 or 1 CTAs an SM) ran no faster than 2 (B8 KV131072: 4.10 TB/s each); asking L2
// for 128 bytes with each row's loads did (B128 KV32768 4398 -> 4064 us, B8 KV32768 281 -> 274),
// 256 bytes less so.
template <int kD>
using DecodeConfig = DecodeTiles<2, 3, 128>;

// The shape of a step whose (batch, kv head) pairs fill between half a wave and one wave of
// it (kCtas CTAs on each SM) over a short cache (wave_config_ctas): few CTAs an SM, many tiles
// in flight, so that each pair takes one split (two at most), where DecodeConfig's three CTAs an SM
// cut each pair's few tiles into splits merged by the combine kernel. benchmarks/decode_check.cu
// (H200, 132 SMs, L2 flushed, bf16, us, DecodeConfig -> this):
// - D 128, 4 stages, one CTA an SM (142 KB): B32 Hkv4 KV1024 35.7 -> 30.6, KV4096 84.8 -> 80.1; B8
//   Hkv8 KV1024 24.9 -> 22.2, KV4096 52.3 -> 50.6; outside the rule it lost (B8 Hkv4 KV1024 16.5 ->
//   17.6, B32 Hkv8 KV1024 47.6 -> 49.0). Through the extension (bench decode, GQA 32:4): B32 KV1024
//   30.1 -> 23.8 us, KV4096 78.6 -> 70.6 (cuDNN 22.2, 66.3).
// - D 64, 6 stages, two CTAs an SM (113 KB each): B32 Hkv8 (256 pairs) KV1024 35.7 -> 31.8, KV2048
//   53.9 -> 48.2, KV4096 86.0 -> 80.4; B32 Hkv4 (128) KV1024 26.0 -> 25.2, KV4096 54.0 -> 53.6; below
//   the rule it lost (B8 Hkv8, 64 pairs: KV1024 18.1 -> 20.0; B8 Hkv4 14.3 -> 16.5). Through the
//   extension (GQA 32:8, B32, against cuDNN in the same run): KV1024 0.76x -> 0.94x, KV4096 0.86x ->
//   0.94x; paged 28.5 / 81.7 us.
// Half a wave, not a third: D 128 at 64 pairs (B8 Hkv8, a third of the SMs) ran its paged cache
// 20.3 -> 24.2 us at 1024 keys and 46.5 -> 55.6 at 4096 on this shape, and D 64 gained nothing at
// 128 pairs (B32 Hkv4: 0.65x -> 0.66x).
// D 64 from half a wave to one wave of one CTA an SM: 10 stages (187 KB), contiguous caches only.
// decode_check, B32 Hkv4 (128 pairs), three runs, us: KV1024 24.2 -> 19.2, 26.0 -> 20.8, 25.6 ->
// 21.3; KV2048 36.7 -> 31.7, 36.9 -> 31.4; KV4096 53.7 -> 48.4, 54.0 -> 49.9, 54.9 -> 50.9; but
// paged16 KV2048 38.0 -> 66.1 (61.7 in the third run; the two-CTA shape 44.4): its per-key page
// fetches do not keep up, so pages shorter than a tile keep DecodeConfig (kPageRows false). Through
// the extension (bench decode, cuDNN in the same run): B32 Hkv4 KV1024 19.0 -> 17.4 us (0.64x ->
// 0.79x), KV4096 45.6 -> 45.3. Whole-tile pages take it (their own instance, KvRows::kPageTiles):
// B32 Hkv4 pages of 256, KV1024 / 2048 / 4096, 24.3 / 35.8 / 54.7 -> 20.7 / 31.6 / 52.7 us
// (contiguous 18.8 / 29.5 / 47.9); pages of 64 25.2 / 36.2 / 55.2 -> 20.9 / 32.1 / 52.2.
// DecodeWaveShape<kD, kCtas>: the head dim's shape of kCtas CTAs an SM, if it has one (kHas), and
// whether a paged cache of pages shorter than a key tile takes it (kPageRows; whole-tile pages take
// every shape). A head dim without any runs DecodeConfig everywhere.
template <int kD, int kCtas>
struct DecodeWaveShape {
  static constexpr bool kHas = false;
};
template <>
struct DecodeWaveShape<128, 1> {
  using type = DecodeTiles<4, 1, 128>;
  static constexpr bool kHas = true;
  // B32 Hkv4, pages of 256: 24.7 / 75.4 us, contiguous 24.0 / 70.5. Pages of 16 lose on it
  // (decode_check, L2 flushed, B32 Hkv4 KV2048: 73.4 us against DecodeConfig's 57.3).
  static constexpr bool kPageRows = false;
};
template <>
struct DecodeWaveShape<64, 1> {
  using type = DecodeTiles<10, 1, 128>;
  static constexpr bool kHas = true;
  static constexpr bool kPageRows = false;
};
template <>
struct DecodeWaveShape<64, 2> {
  using type = DecodeTiles<6, 1, 128>;
  static constexpr bool kHas = true;
  static constexpr bool kPageRows = true;  // B32 Hkv8 paged16 KV2048 56.3 -> 55.3 us
};
constexpr int kMaxWaveCtas = 2;  // the most CTAs an SM of any wave shape
template <int kD, int kCtas>
using DecodeWaveConfig = typename DecodeWaveShape<kD, kCtas>::type;
constexpr int64_t kWaveMaxKeys = 4096;  // the longest cache measured faster on the wave shapes

// `smem_optin`: the shared memory a block of the GPU may opt into. A shape is taken only where its
// kCtas CTAs fit an SM as measured (D 128's 142 KB and D 64's two of 113 KB are over the 99 KB of
// sm_86 / sm_89 / sm_120; D 64's 187 KB and its two of 113 KB over sm_80's 163 KB), else
// DecodeConfig. `row_pages`: a paged cache whose pages are shorter than a key tile.
template <int kD, int kCtas>
inline bool uses_wave_shape(int64_t kv_end, int64_t pairs, int64_t sms, size_t smem_optin, bool row_pages) {
  using Shape = DecodeWaveShape<kD, kCtas>;
  if constexpr (!Shape::kHas) {
    return false;
  } else {
    const int64_t wave = sms * kCtas;
    return kCtas * Shape::type::template smem_bytes<__half, kD>() <= smem_optin && 2 * pairs >= wave && pairs <= wave &&
           kv_end <= kWaveMaxKeys && (Shape::kPageRows || !row_pages);
  }
}

// The CTAs an SM of the wave shape a step takes (uses_wave_shape), 0 for DecodeConfig. The ranges
// of pairs (half a wave to a wave) of one and two CTAs an SM do not overlap but at sms pairs, where
// the one-CTA shape is taken.
template <int kD>
inline int wave_shape_ctas(int64_t kv_end, int64_t pairs, int64_t sms, size_t smem_optin, bool row_pages) {
  if (uses_wave_shape<kD, 1>(kv_end, pairs, sms, smem_optin, row_pages)) {
    return 1;
  }
  return uses_wave_shape<kD, 2>(kv_end, pairs, sms, smem_optin, row_pages) ? 2 : 0;
}

inline int wave_config_ctas(int head_dim, int64_t kv_end, int64_t batch, int64_t hkv, int64_t sms, size_t smem_optin,
                            bool row_pages) {
  const int64_t pairs = batch * hkv;
  switch (head_dim) {
    case 64:
      return wave_shape_ctas<64>(kv_end, pairs, sms, smem_optin, row_pages);
    case 128:
      return wave_shape_ctas<128>(kv_end, pairs, sms, smem_optin, row_pages);
    default:
      return 0;
  }
}

// What the step writes when it has one split (else the combine kernel writes it): out (rows
// strided, unit inner stride), lse and lse_lo ([B, Hq, Q] float32 contiguous; lse_lo may be
// null), reading sinks ([Hq] float32, or null).
struct DecodeOutputs {
  void* out = nullptr;
  int64_t o_sb = 0, o_sh = 0, o_si = 0;
  float* lse = nullptr;
  float* lse_lo = nullptr;
  const float* sinks = nullptr;
};

struct DecodeParams {
  const void* q;  // [B, Hq, Q, D], unit inner stride, 16-byte aligned rows
  const void* k;  // [B, Hkv, KV, D]
  const void* v;  // [B, Hkv, KV, D]
  int64_t q_sb, q_sh, q_si;
  int64_t k_sb, k_sh, k_si;
  int64_t v_sb, v_sh, v_si;
  // With splits > 1: each split's output, normalised by its own sum, [B * Hq * Q, splits, D], and
  // lse, [B * Hq * Q, splits], log2 domain (-inf: no visible key). Unused with one split.
  float* o_part;
  float* lse_part;
  DecodeOutputs out;  // written here with one split
  int64_t hq, group, q_len;
  int64_t kv_end;         // keys at or past it are visible to no row (kv_len, or less by causal)
  int splits;             // CTAs per (batch, kv head), sharing the tiles of the keys its rows see
  int rows;               // group * q_len: row r is query i = r / group of head hk * group + r % group
  attn::ScoreRule score;  // log2 units, a floating mask's values converted to them
  attn::Causal causal;
  attn::MaskView mask;
  attn::KeyRangeView ranges;  // null: every row's keys are [0, kv_end)
  // A KV cache's rules instead (seqlens non-null: _attention_kvcache): each row's keys, and with a
  // block table where key j of batch b lives, k + page(b, j) * k_sb + slot(j) * k_si (k_sb the
  // page stride then).
  KvCacheView cache;

  // Query i of batch b sees keys [lo, hi) within [0, kv_end): its key range and the causal rule
  // (then the mask, element by element). int32, as key ranges are: kv_end is at most 2^30
  // (decode_shape_rejects), and the causal shift is clamped to [-Q, KV].
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

// How a step runs: `splits` CTAs per (batch, kv head), merged inside the split kernel as a thread
// block cluster or by the combine kernel (one split: neither).
struct DecodeLaunch {
  int splits;
  bool cluster;
};

// The fewest key tiles a split of a long cache takes (decode_launch; the standalone check varies
// it): one wave of CTAs over few (batch, kv head) pairs cuts a long cache into splits of a few
// tiles, each paying the split's fixed cost (H200, D 128, GQA 8: B1 KV32768 99 splits of 5-6
// tiles 45.3 us, 64 splits of 8 tiles 39.2; D 64 33.5 -> 27.3; splits already this long unchanged).
constexpr int kLongSplitTiles = 8;
// From this many key tiles on (32768 keys) a split of a contiguous cache takes twice that: the same
// check, B1 GQA 8:1 D 128, KV32768 39.1 -> 36.1 us (GQA 4:1 56.6 -> 53.0); D 64 and KV131072
// unchanged; KV16384 slower (25.2 -> 27.6), so not below. Through the extension (H200, bench
// decode, B1 GQA 8:1 D 128 KV32768) contiguous 33.5 -> 29.6 us, but paged 39.2 -> 49.6 while each
// row of a paged tile was looked up by itself. Since a tile in one page loads as a contiguous one
// (pages_hold_whole_tiles), a paged cache of such pages takes them too (the check, pages of 256:
// D 128 KV32768 40.2 -> 36.8 us, the contiguous cache 36.0; D 64 27.8 -> 28.2); pages shorter
// than a tile keep kLongSplitTiles.
constexpr int64_t kLongerSplitFromTiles = 512;

// Whether every key tile of a paged cache lies in one page: pages of a power of two, at least a
// tile long (tiles start at multiples of kTileKeys). Such a tile's rows are one strided run.
inline __host__ __device__ bool pages_hold_whole_tiles(const KvCacheView& cache) {
  return cache.page_shift >= 0 && cache.page_size >= kTileKeys;
}

// How the split kernel finds a key's K and V rows, an instance each: a contiguous cache (or K and
// V tensors); a paged cache whose pages hold whole tiles (one block-table entry a tile, the tile
// loaded as a contiguous one); a paged cache of shorter pages (an entry and a row offset a key).
// One paged instance with both loads in its loop ran 14% more instructions than the contiguous
// one and stalled on instruction fetch (ncu, H200, B1 KV4096 GQA 32:8 D 128, pages of 256: 20.3
// us against 14.0; no-instruction stalls 167 samples against 64). Split (decode_check, L2
// flushed, pages of 256, B1 GQA 32:8 D 128, us): KV8192 24.9 -> 23.4, KV32768 54.1 -> 53.0,
// KV131072 152.7 -> 150.2 (contiguous 22.3, 50.2, 142.0).
enum class KvRows { kContiguous, kPageTiles, kPageRows };

inline KvRows kv_rows_of(const KvCacheView& cache) {
  if (cache.block_table == nullptr) {
    return KvRows::kContiguous;
  }
  return pages_hold_whole_tiles(cache) ? KvRows::kPageTiles : KvRows::kPageRows;
}

// f(std::integral_constant<KvRows, rows>{}): the instance for `rows`.
template <class F>
inline void with_kv_rows(KvRows rows, F&& f) {
  switch (rows) {
    case KvRows::kContiguous:
      f(std::integral_constant<KvRows, KvRows::kContiguous>{});
      return;
    case KvRows::kPageTiles:
      f(std::integral_constant<KvRows, KvRows::kPageTiles>{});
      return;
    case KvRows::kPageRows:
      f(std::integral_constant<KvRows, KvRows::kPageRows>{});
      return;
  }
}

// Splits per (batch, kv head): one wave of `slots` resident CTAs over batch x hkv, at most
// kMaxSplits. With `clusters` (sm_90), a step with few (batch, kv head) pairs (one wave would give
// each more than max_cluster splits) over a short cache (at most cap_tiles key tiles a split at
// max_cluster splits) takes at most max_cluster splits, one cluster: there the combine
// kernel's launch costs more than the longer splits (H200, D 128, GQA 4: B1 KV1024 13.8 -> 11.3 us,
// KV4096 22.6 -> 17.1). Clusters elsewhere lose: B8 KV32768 with 6 splits a cluster took 320 us
// against 281 with the combine kernel. A cache longer than that reach (with clusters or without)
// gives each split at least long_split_tiles tiles (twice that from kLongerSplitFromTiles on, unless
// `row_pages`: a paged cache whose tiles span pages); a shorter one keeps its splits of a tile or
// two (B1 KV1024 in a cluster: 8 splits of 2 tiles 10.3 us, 2 splits of 8 tiles 15.3).
// `split_slots` (0: `slots`): the CTAs the splits fill where they are not one cluster
// (split_slots_for).
inline DecodeLaunch decode_launch(int64_t kv_end, int64_t batch, int64_t hkv, int64_t slots, bool clusters,
                                  bool row_pages, int64_t cap_tiles = 8, int64_t long_split_tiles = kLongSplitTiles,
                                  int64_t max_cluster = kMaxClusterSplits, bool small_clusters = false,
                                  int64_t split_slots = 0) {
  const int64_t tiles = (kv_end + kTileKeys - 1) / kTileKeys;
  const int64_t even = slots / (batch * hkv);
  const bool short_cache = tiles <= max_cluster * cap_tiles;
  if (clusters && even > max_cluster && tiles > 1 && short_cache) {
    return {static_cast<int>(tiles < max_cluster ? tiles : max_cluster), true};
  }
  // Candidate (benchmarks/decode_check.cu): a cluster of the splits one wave gives each pair when
  // fewer than max_cluster fit, if the cache is short for that many.
  if (small_clusters && clusters && even >= 2 && even <= max_cluster && tiles > 1 && tiles <= even * cap_tiles) {
    return {static_cast<int>(tiles < even ? tiles : even), true};
  }
  const bool longer = !row_pages && tiles >= kLongerSplitFromTiles;
  const int64_t min_tiles = short_cache ? 1 : (longer ? 2 : 1) * long_split_tiles;
  const int64_t by_tiles = (tiles + min_tiles - 1) / min_tiles;
  const int64_t most = by_tiles < 1 ? 1 : (by_tiles > kMaxSplits ? kMaxSplits : by_tiles);
  const int64_t fill = (split_slots > 0 ? split_slots : slots) / (batch * hkv);
  return {static_cast<int>(fill < 1 ? 1 : (fill > most ? most : fill)), false};
}

// The CTAs the splits of a step fill outside a cluster (decode_launch's split_slots): a contiguous
// cache at D 128, one an SM (`sms`), each split twice to three times as long, else every
// resident CTA (`slots`). benchmarks/decode_check.cu, H200, DecodeConfig<128> without clusters,
// [B, S, Hkv, D] cache, us, resident CTAs (three an SM) -> one an SM: B8 Hkv8 (64 pairs: 6 -> 2
// splits) KV1024 26.2 -> 23.4, KV4096 54.0 -> 51.6, KV32768 274.2 -> 265.7, KV131072 1018.8 ->
// 1006.9; B8 Hkv4 (12 -> 4) 21.4 -> 18.8, 38.3 -> 35.3, 151.0 -> 145.1, 525.5 -> 517.5; B32 Hkv4
// (3 -> 1) KV1024 37.4 -> 32.7, KV4096 86.7 -> 80.9, KV32768 523.5 -> 513.8; [B, Hkv, S, D] B8 Hkv4
// KV32768 152.2 -> 145.9; B1 mostly within 2% (Hkv8 KV16384 36.2 -> 34.8, KV131072 150.1 -> 144.2;
// Hkv4 KV131072 95.3 -> 87.6). Through the extension (bench decode, cuDNN in the same run): B8
// 32:8 KV1024 0.74x -> 0.83x, KV4096 0.91x -> 0.98x. A paged cache keeps them (B8 Hkv8 KV32768,
// 6 -> 2 splits: pages of 16 288 -> 555 us, of 64 278 -> 289, of 256 275 -> 289), and so does D 64,
// whose tiles carry half the bytes (decode_check --sm-splits: B8 Hkv8 KV4096 34.6 -> 39.6,
// KV32768 153.2 -> 188.1; B1 Hkv8 KV32768 35.8 -> 41.1; only B32 Hkv8 gained, KV1024 36.4 -> 32.1).
// Pages holding whole tiles (KvRows::kPageTiles) take one CTA an SM while its splits stay within
// kPagedSmSplitTiles tiles: decode_check (H200, L2 flushed, pages of 256, us, resident -> SMs,
// two runs alike; the contiguous cache in brackets): B8 Hkv8 KV1024 25.5 -> 22.7 (21.5), KV4096
// 52.6 -> 50.5 (49.2); B1 Hkv4 KV131072 (62 tiles a split) 94.7 -> 86.9 (84.7); B1 Hkv8 KV16384
// 35.6 -> 34.4 (33.0); but longer splits lose: B8 Hkv8 KV32768 (256 tiles) 269 -> 279 (259),
// KV131072 1011 -> 1062, B8 Hkv4 KV131072 518 -> 542, B1 Hkv8 KV131072 (128) 148.0 -> 149.6.
constexpr int64_t kPagedSmSplitTiles = 64;
inline int64_t split_slots_for(int head_dim, KvRows rows, int64_t kv_end, int64_t pairs, int64_t sms, int64_t slots) {
  if (head_dim != 128 || rows == KvRows::kPageRows) {
    return slots;
  }
  if (rows == KvRows::kContiguous) {
    return sms;
  }
  const int64_t tiles = (kv_end + kTileKeys - 1) / kTileKeys;
  const int64_t splits = sms / pairs < 1 ? 1 : sms / pairs;
  return (tiles + splits - 1) / splits <= kPagedSmSplitTiles ? sms : slots;
}

// Launches the split kernel over (splits, hkv, batch), the splits of each (batch, kv head) one
// cluster when `cluster`.
template <class Kernel>
inline cudaError_t launch_split_kernel(Kernel kernel, const DecodeParams& p, int64_t batch, int64_t hkv, size_t smem,
                                       cudaStream_t stream, bool cluster) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(p.splits), static_cast<unsigned>(hkv), static_cast<unsigned>(batch));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(p.splits);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = cluster ? 1 : 0;
  if (cluster && p.splits > kMaxClusterSplits) {  // past the portable size (sm_90: up to 16)
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) {
      return err;
    }
  }
  return cudaLaunchKernelEx(&config, kernel, p);
}

// The most splits a step's cluster takes: `gpu_max` (max_cluster_splits: 16 where the GPU places
// such clusters) while the step's clusters of that size fill at most half the SMs, else the
// portable 8. Where more of them would fill the GPU, the clusters are packed a few CTAs an SM
// inside their GPCs, and 16 splits merged by the combine kernel run faster.
// benchmarks/decode_check.cu, H200, B1, us, 8 -> 16 (D 128 unless said): GQA 8:1 (4 clusters)
// KV4096 16.5 -> 13.1, KV8192 18.6 -> 17.7 (paged 20.5 -> 18.6), D 64 KV4096 13.7 -> 11.1, KV8192
// 15.5 -> 14.5; GQA 4:1 (8 clusters, 128 CTAs) KV4096 16.9 -> 16.7 but KV8192 22.5 -> 23.3 (through
// the extension, bench decode: 17.3 -> 19.8, D 64 14.2 -> 15.0).
inline int step_max_cluster(int64_t batch, int64_t hkv, int64_t sms, int gpu_max) {
  return batch * hkv * gpu_max <= sms / 2 ? gpu_max : kMaxClusterSplits;
}

// The most splits a cluster of `kernel` (the split kernel's cluster instance) takes on the
// current GPU: kMaxClusterSplitsNonPortable where one such cluster fits (cudaOccupancyMaxActiveClusters;
// a GPU partition may have fewer SMs a GPC), else kMaxClusterSplits.
template <class Kernel>
inline int max_cluster_splits(Kernel kernel, size_t smem) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    cudaGetLastError();  // not sm_90 or later: no error left behind
    return kMaxClusterSplits;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kMaxClusterSplitsNonPortable);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = kMaxClusterSplitsNonPortable;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();
    return kMaxClusterSplits;
  }
  return clusters > 0 ? kMaxClusterSplitsNonPortable : kMaxClusterSplits;
}

// The final lse of a row (log2 units) from its lse over the keys: the sink logit joins the
// denominator; NaN stays NaN.
__device__ __forceinline__ float with_sink(float row_lse2, const float* sinks, int64_t h) {
  if (sinks == nullptr || row_lse2 != row_lse2) {
    return row_lse2;
  }
  return attn::log2_add_exp2(row_lse2, sinks[h] * attn::kLog2e);
}

// lse (natural units) of a row and, where asked, lse_lo: the product's rounding error (log2 units:
// no row here is huge, see natural_units).
__device__ __forceinline__ void store_lse(const DecodeOutputs& o, int64_t row, float lse2) {
  o.lse[row] = lse2 * attn::kLn2;
  if (o.lse_lo != nullptr) {
    o.lse_lo[row] = lse2 == -INFINITY || lse2 != lse2 ? 0.0f : fmaf(lse2, attn::kLn2, -o.lse[row]);
  }
}

// Merges one row's splits (split s: its lse, log2 units, -inf when it saw no key, and its output
// normalised by its own sum, kD floats at row_of(s)) and writes out and lse (with the sink logit
// in the denominator when there are sinks): lse = log-sum-exp of the splits' lse, out = sum over
// splits of 2^(lse_split - lse) * out_split. One warp: lane s holds the lse and weight of splits
// s, s + 32, ... (each read once) and broadcasts them; each lane owns kD / 32 consecutive output
// columns, read with one vector load per split, eight splits in flight at a time.
template <typename T, int kD, class LseOf, class RowOf>
__device__ __forceinline__ void combine_row(const DecodeOutputs& o, int splits, LseOf lse_of, RowOf row_of, int64_t row,
                                            int64_t b, int64_t h, int64_t i) {
  static_assert(kD == 64 || kD == 128, "decode combine: a float2 or float4 per lane");
  constexpr int kVec = kD / 32;
  constexpr int kLaneSplits = kMaxSplits / 32;
  using Vec = std::conditional_t<kVec == 4, float4, float2>;
  const int lane = threadIdx.x % 32;
  float x[kLaneSplits];
  float mx = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int k = 0; k < kLaneSplits; ++k) {
    const int s = lane + 32 * k;
    x[k] = s < splits ? lse_of(s) : -INFINITY;
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
  const float row_lse2 = nan ? NAN : (mx == -INFINITY ? -INFINITY : mx + log2f(total));
  const float lse2 = with_sink(row_lse2, o.sinks, h);
  const bool empty = row_lse2 == -INFINITY;

  float acc[kVec] = {};
  if (!empty) {
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
        const Vec v = *reinterpret_cast<const Vec*>(row_of(32 * k + s) + lane * kVec);  // an empty split's row is 0
        acc[0] = fmaf(w, v.x, acc[0]);
        acc[1] = fmaf(w, v.y, acc[1]);
        if constexpr (kVec == 4) {
          acc[2] = fmaf(w, v.z, acc[2]);
          acc[3] = fmaf(w, v.w, acc[3]);
        }
      }
    }
  }
  T* out = static_cast<T*>(o.out) + b * o.o_sb + h * o.o_sh + i * o.o_si + lane * kVec;
#pragma unroll
  for (int e = 0; e < kVec; e += 2) {
    *reinterpret_cast<uint32_t*>(out + e) = attn::pack2<T>(acc[e], acc[e + 1]);  // an empty row is exactly 0
  }
  if (lane == 0) {
    store_lse(o, row, lse2);
  }
}

// Warp w's online-softmax state of its 16 keys per tile: two rows (g, g + 8) per thread.
template <int kD>
struct WarpState {
  float o[kD / 8][4];
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.0f, 0.0f};
};

// The end of the split kernel: the warps' states merged per row through `scratch` (shared memory,
// free by now), then, with one split, out and lse; else the split's partials: to the workspace
// for the combine kernel, or (kCluster: the splits are one thread block cluster) to shared memory,
// where each split merges its share of the rows from every split's.
template <typename T, int kD, bool kCluster>
__device__ __forceinline__ void merge_warps(const DecodeParams& p, const WarpState<kD>& st, float* scratch, int64_t b,
                                            int64_t hk, int split) {
  constexpr int kDTiles = kD / 8;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float* stat = scratch;                           // [2][kWarps][kMaxRows]: m, then l
  float* o_s = stat + 2 * kWarps * kMaxRows;       // [kWarps][kMaxRows][kD], unnormalised
  float* part_lse = o_s + kWarps * kMaxRows * kD;  // kCluster: [kMaxRows], then
  float* part_o = part_lse + kMaxRows;             // [kMaxRows][kD] (16-byte aligned)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    float l = st.sum[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0) {
      stat[warp * kMaxRows + r] = st.max[half];
      stat[(kWarps + warp) * kMaxRows + r] = l;
    }
    float* o_row = o_s + (warp * kMaxRows + r) * kD + 2 * t;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      o_row[dt * 8] = st.o[dt][2 * half];
      o_row[dt * 8 + 1] = st.o[dt][2 * half + 1];
    }
  }
  __syncthreads();
  const bool direct = !kCluster && p.splits == 1;
  // Per row: a warp counts unless its sum is 0 (no visible key; NaN counts), with exponent offset
  // m (0 when m = -inf); weights 2^(offset - top) replace the m slots, and slot 0 of l gets the
  // output's factor: 1 / l (with the sink's share taken out when the CTA writes out itself).
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
    const float row_lse2 = empty ? -INFINITY : top + log2f(total);
    float factor = empty ? 0.0f : 1.0f / total;
    if (r < p.rows) {
      const int64_t h = hk * p.group + r % p.group, i = r / p.group;
      const int64_t row = (b * p.hq + h) * p.q_len + i;
      if (direct) {
        const float lse2 = with_sink(row_lse2, p.out.sinks, h);
        if (p.out.sinks != nullptr && !empty) {
          factor *= exp2f(row_lse2 - lse2);
        }
        store_lse(p.out, row, lse2);
      } else if (kCluster) {
        part_lse[r] = row_lse2;
      } else {
        p.lse_part[row * p.splits + split] = row_lse2;
      }
    }
    stat[kWarps * kMaxRows + r] = factor;
  }
  __syncthreads();
  for (int c = tid; c < p.rows * kD / 2; c += kThreads) {
    const int r = c / (kD / 2), col = c % (kD / 2) * 2;
    float acc[2] = {0.0f, 0.0f};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = stat[w * kMaxRows + r];
      const float* o_w = o_s + (w * kMaxRows + r) * kD + col;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        acc[e] += weight == 0.0f ? 0.0f : weight * o_w[e];  // 0, not 0 * NaN
      }
    }
    const float factor = stat[kWarps * kMaxRows + r];
    const int64_t h = hk * p.group + r % p.group, i = r / p.group;
    if (direct) {
      T* o = static_cast<T*>(p.out.out) + b * p.out.o_sb + h * p.out.o_sh + i * p.out.o_si + col;
      *reinterpret_cast<uint32_t*>(o) = attn::pack2<T>(acc[0] * factor, acc[1] * factor);  // an empty row: 0
    } else {
      const int64_t row = (b * p.hq + h) * p.q_len + i;
      float* o = kCluster ? part_o + r * kD + col : p.o_part + (row * p.splits + split) * kD + col;
      o[0] = acc[0] * factor;
      o[1] = acc[1] * factor;
    }
  }
  if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    cluster.sync();  // every split's partials are in its shared memory
    for (int r = split + p.splits * warp; r < p.rows; r += p.splits * kWarps) {
      const int64_t h = hk * p.group + r % p.group, i = r / p.group;
      combine_row<T, kD>(
          p.out, p.splits, [&](int s) { return cluster.map_shared_rank(part_lse, s)[r]; },
          [&](int s) { return cluster.map_shared_rank(part_o, s) + r * kD; }, (b * p.hq + h) * p.q_len + i, b, h, i);
    }
    cluster.sync();  // no split leaves while another reads its shared memory
#else
    __trap();  // launched as a cluster on sm_90 and later only
#endif
  }
}

// kRows: where K and V rows are (kv_rows_of(p.cache)). kCluster: launched with the splits of each
// (batch, kv head) as one thread block cluster (sm_90), which merge their partials themselves
// (merge_warps).
template <typename T, int kD, KvRows kRows, bool kCluster, class Tiles = DecodeConfig<kD>>
__global__ void __launch_bounds__(kThreads, Tiles::kMinBlocks) attention_decode_split_kernel(const DecodeParams p) {
  using namespace attn;  // mma, ldmatrix, cp.async, fast_exp2
  constexpr bool kPaged = kRows != KvRows::kContiguous;
  constexpr int kStages = Tiles::kStages;
  constexpr int kStride = padded_row(kD);
  constexpr int kChunks = kD / 8;   // 16-byte chunks per row
  constexpr int kKSteps = kD / 16;  // k16 steps of Q K^T
  constexpr int kDTiles = kD / 8;   // n8 tiles of an output row
  static_assert(kD % 16 == 0, "decode: head dim");
  // The warps' merge reuses the K/V buffers: m and l per (warp, row), then O per (warp, row).
  static_assert(
      ((2 + kD) * kWarps + kD + 1) * kMaxRows * sizeof(float) <= 2 * kStages * kTileKeys * kStride * sizeof(T),
      "decode: the merge scratch must fit in the K/V buffers");

  // The combine kernel, launched after this one with a programmatic dependency
  // (launch_combine_kernel), may be scheduled now: it waits for this grid's end before it reads.
  programmatic_launch_dependents();

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);                                    // [kMaxRows][kStride]
  T* s_k = s_q + kMaxRows * kStride;                                          // [kStages][kTileKeys][kStride]
  T* s_v = s_k + kStages * kTileKeys * kStride;                               // [kStages][kTileKeys][kStride]
  int* s_page = reinterpret_cast<int*>(s_v + kStages * kTileKeys * kStride);  // [kPageSlots][kTileKeys]

  const int split = blockIdx.x;
  const int64_t hk = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // the MMA fragment's row group and column pair
  const int a_row = (lane % 8) + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);
  const int k_row = (lane % 8) + 8 * (lane / 16), k_col = 8 * ((lane / 8) % 2);

  const T* k_head = static_cast<const T*>(p.k) + hk * p.k_sh;  // paged: this kv head's rows of page 0
  const T* v_head = static_cast<const T*>(p.v) + hk * p.v_sh;
  const T* k_base = k_head + b * p.k_sb;
  const T* v_base = v_head + b * p.v_sb;
  // Whole-tile pages: this sequence's block-table row (pages of a power of two). With it and k_head,
  // a tile's entry and rows cost a shift, a clamp and two products: the page lookup's 64-bit
  // products and branches per tile (table_entry, slot) were what a paged split at one CTA an SM
  // spent beside a contiguous one (ncu, H200, B8 KV32768 GQA 32:8 D 128, two splits a kv head:
  // 48.8M warp instructions against 43.1M, 276 us against 250). decode_check, L2 flushed, pages of
  // 256, us (contiguous in brackets): that step 281.7 -> 270.1 (259.0), KV131072 1073.6 -> 1028.6
  // (984.5); B1 GQA 32:8 KV4096 17.2 -> 16.7 (16.3); B1 GQA 32:4 KV131072 87.1 -> 84.9 (84.1).
  const int* table_row = kRows == KvRows::kPageTiles ? p.cache.block_table + b * p.cache.table_stride : nullptr;
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
  // This split's key tiles: tile_of(n) for n in [0, n_local), one run of consecutive tiles.
  const int first_tile = lo_min / kTileKeys;
  const int n_tiles = lo_min < hi_max ? (hi_max + kTileKeys - 1) / kTileKeys - first_tile : 0;
  const int per_split = (n_tiles + p.splits - 1) / p.splits;
  const int tile_begin = first_tile + min(split * per_split, n_tiles);
  const int n_local = min(split * per_split + per_split, n_tiles) - min(split * per_split, n_tiles);
  auto tile_of = [&](int n) { return tile_begin + n; };

  // Paged: the page of each key of the split's tile n (of its first key, whole-tile pages) into its
  // slot of s_page, as this thread's part of the next commit group (rows past the split's keys are
  // not looked up).
  auto fetch_pages = [&](int n) {
    constexpr int kEntries = kRows == KvRows::kPageTiles ? 1 : kTileKeys;
    if (kPaged && tid < kEntries) {
      const int j = tile_of(n) * kTileKeys + tid;
      if (n < n_local && j < hi_max) {
        const int* entry =
            kRows == KvRows::kPageTiles ? table_row + (j >> p.cache.page_shift) : p.cache.table_entry(b, j);
        cp_async_4(s_page + n % Tiles::kPageSlots * kTileKeys + tid, entry);
      }
    }
  };
  // Q rows gathered from their (query, head) positions; rows past p.rows are zeros. Q (and, paged,
  // the pages of the first kStages tiles) is a commit group of its own, ahead of the tiles'.
  for (int c = tid; c < kMaxRows * kChunks; c += kThreads) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = r < p.rows;
    const T* src = static_cast<const T*>(p.q);
    if (valid) {
      src += b * p.q_sb + (hk * p.group + r % p.group) * p.q_sh + (r / p.group) * p.q_si + ch * 8;
    }
    cp_async_16(s_q + r * kStride + ch * 8, src, valid);
  }
  if constexpr (kPaged) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      fetch_pages(s);
    }
    cp_async_commit();
    cp_async_wait<0>();  // the first tiles' loads need their pages
    __syncthreads();
  } else {
    cp_async_commit();
  }
  // Rows [j0, j0 + kTileKeys) from k_rows and v_rows (row r at r * k_si, r * v_si; rows at or
  // past hi_max zero-filled, not read) into stage buffers k_dst and v_dst.
  // A thread walks its rows of the tile with one pointer (kWalk), and a whole tile, every tile of
  // the split but the cache's last, loads without the per-chunk row test (kWholeTiles). A 64-bit
  // offset multiplied out per 16-byte chunk was 40% of the split kernel's instructions at batch 1
  // (ncu, H200, B=1 KV4096 GQA 32:8 D 128); walking took that step 16.1 -> 15.7 us in
  // decode_check (other shapes within 1%): with one warp a scheduler, the step waits on its
  // dependencies and barriers more than it issues.
  auto load_rows = [&](T* k_dst, T* v_dst, const T* k_rows, const T* v_rows, int j0) {
    using Rows = SmemRows<kD>;
    static_assert(Rows::kStride == kStride, "decode: the tiles' rows as load_tile lays them out");
    constexpr int kRounds = load_rounds(kTileKeys, kD, kThreads);
    load_tile<T, kTileKeys, kD, kThreads, kRounds, Rows, true, true, Tiles::kPrefetch>(k_dst, k_rows, p.k_si,
                                                                                       hi_max - j0, tid);
    load_tile<T, kTileKeys, kD, kThreads, kRounds, Rows, true, true, Tiles::kPrefetch>(v_dst, v_rows, p.v_si,
                                                                                       hi_max - j0, tid);
  };
  // The split's tile n's K and V rows (rows at or past hi_max zero-filled, not read), and, paged,
  // the pages of its tile n + kStages, in one commit group.
  // Paged, whole-tile pages: a key tile is one strided run from its page's slot, loaded as a
  // contiguous cache's are, without a page lookup and a 64-bit offset per 16-byte chunk
  // (benchmarks/decode_check.cu, H200, L2 flushed, pages of 256, us: B=1 GQA 8:1 KV8192 D 128
  // 29.9 -> 22.7 and D 64 21.8 -> 18.1, the contiguous cache 19.7 and 16.7; B=8 GQA 4:1 KV32768
  // D 128 284 -> 275, contiguous 273).
  auto load_kv = [&](int n, int stage) {
    const int j0 = tile_of(n) * kTileKeys;
    T* k_dst = s_k + stage * kTileKeys * kStride;
    T* v_dst = s_v + stage * kTileKeys * kStride;
    if constexpr (kPaged) {
      if constexpr (kRows == KvRows::kPageTiles) {
        const int64_t page = p.cache.clamp_page(s_page[n % Tiles::kPageSlots * kTileKeys]);
        const int slot = j0 & (p.cache.page_size - 1);
        load_rows(k_dst, v_dst, k_head + page * p.k_sb + slot * p.k_si, v_head + page * p.v_sb + slot * p.v_si, j0);
      } else {
        const int* pages = s_page + n % Tiles::kPageSlots * kTileKeys;
        constexpr int kRounds = kTileKeys * kChunks / kThreads;
        static_assert(kTileKeys * kChunks % kThreads == 0, "decode: whole rounds of 16-byte chunks");
#pragma unroll
        for (int it = 0; it < kRounds; ++it) {
          const int c = it * kThreads + tid, r = c / kChunks, ch = c % kChunks, slot = p.cache.slot(j0 + r);
          const bool valid = j0 + r < hi_max;
          const int64_t page = valid ? p.cache.clamp_page(pages[r]) : 0;
          const int64_t k_off = valid ? page * p.k_sb + slot * p.k_si + hk * p.k_sh + ch * 8 : 0;
          const int64_t v_off = valid ? page * p.v_sb + slot * p.v_si + hk * p.v_sh + ch * 8 : 0;
          cp_async_16<Tiles::kPrefetch>(k_dst + r * kStride + ch * 8, static_cast<const T*>(p.k) + k_off, valid);
          cp_async_16<Tiles::kPrefetch>(v_dst + r * kStride + ch * 8, static_cast<const T*>(p.v) + v_off, valid);
        }
      }
      fetch_pages(n + kStages);
    } else {
      load_rows(k_dst, v_dst, k_base + j0 * p.k_si, v_base + j0 * p.v_si, j0);
    }
  };
  // The first kStages - 1 tiles, a commit group each (empty past the split's end).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_local) {
      load_kv(s, s);
    }
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();  // Q's group
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

  WarpState<kD> st;
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      st.o[dt][e] = 0.0f;
    }
  }

  int stage = 0;
  for (int n = 0; n < n_local; ++n) {
    const int tile = tile_of(n);
    // The tile kStages - 1 ahead goes to the stage the last tile used: every warp is past it.
    if (n + kStages - 1 < n_local) {
      load_kv(n + kStages - 1, stage == 0 ? kStages - 1 : stage - 1);
    }
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // this tile's group complete; the later ones may fly
    __syncthreads();
    const T* k_s = s_k + (stage * kTileKeys + warp * kWarpKeys) * kStride;
    const T* v_s = s_v + (stage * kTileKeys + warp * kWarpKeys) * kStride;
    const int j0 = tile * kTileKeys + warp * kWarpKeys;  // this warp's first key

    // ---- S = Q K^T over this warp's 16 keys, in log2 units ----
    float s_acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    float s_odd[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};  // kChains == 2
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t kb[4];
      ldmatrix_x4(kb, k_s + k_row * kStride + kk * 16 + k_col);
      if (Tiles::kChains == 2 && kk % 2 == 1) {
        mma_pair<T>(s_odd[0], s_odd[1], q_frag[kk], kb);
      } else {
        mma_pair<T>(s_acc[0], s_acc[1], q_frag[kk], kb);
      }
    }
    if constexpr (Tiles::kChains == 2) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        s_acc[e / 4][e % 4] += s_odd[e / 4][e % 4];
      }
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
      const float m_new = fmaxf(st.max[half], mx);
      const float offset = m_new == -INFINITY ? 0.0f : m_new;  // empty so far: no -inf - -inf
      const float alpha = fast_exp2(st.max[half] - offset);    // old max -inf: 0
      st.max[half] = m_new;
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
      st.sum[half] = st.sum[half] * alpha + sum;  // per thread; quad-summed at the end
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        st.o[dt][2 * half] *= alpha;
        st.o[dt][2 * half + 1] *= alpha;
      }
    }

    // ---- O += P V: P in registers is the A operand ----
    const uint32_t pa[4] = {pack2<T>(s_acc[0][0], s_acc[0][1]), pack2<T>(s_acc[0][2], s_acc[0][3]),
                            pack2<T>(s_acc[1][0], s_acc[1][1]), pack2<T>(s_acc[1][2], s_acc[1][3])};
#pragma unroll
    for (int dp = 0; dp < kD / 16; ++dp) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_s + a_row * kStride + dp * 16 + a_col);
      mma_pair<T>(st.o[2 * dp], st.o[2 * dp + 1], pa, vb);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  __syncthreads();
  merge_warps<T, kD, kCluster>(p, st, reinterpret_cast<float*>(s_k), b, hk, split);
}

// One warp per query row (b, h, i) of the step: the splits' partials from the workspace.
template <typename T, int kD>
__global__ void __launch_bounds__(kCombineWarps * 32)
    attention_decode_combine_kernel(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                                    const DecodeOutputs o, int64_t total_rows, int64_t hq, int64_t q_len, int splits) {
  programmatic_wait();  // the split kernel's partials are complete and visible
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  if (row >= total_rows) {
    return;
  }
  const float* lse_row = lse_part + row * splits;
  const float* o_row = o_part + row * splits * kD;
  combine_row<T, kD>(
      o, splits, [&](int s) { return lse_row[s]; }, [&](int s) { return o_row + s * kD; }, row, row / (q_len * hq),
      (row / q_len) % hq, row % q_len);
}

// Launches the combine kernel after the split kernel on `stream`. With `programmatic` (sm_90 and
// later) its launch depends programmatically on the split kernel, which lets it go early
// (programmatic_launch_dependents): its CTAs are scheduled while the splits run and wait in
// programmatic_wait, so the launch's latency leaves the step's critical path.
template <typename T, int kD>
inline cudaError_t launch_combine_kernel(const DecodeParams& p, int64_t total_rows, cudaStream_t stream,
                                         bool programmatic) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>((total_rows + kCombineWarps - 1) / kCombineWarps));
  config.blockDim = dim3(kCombineWarps * 32);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic && kProgrammaticLaunches ? 1 : 0;
  return cudaLaunchKernelEx(&config, &attention_decode_combine_kernel<T, kD>, static_cast<const float*>(p.o_part),
                            static_cast<const float*>(p.lse_part), p.out, total_rows, p.hq, p.q_len, p.splits);
}

}  // namespace safeattn::cuda::decode
