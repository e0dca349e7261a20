// The tensor-core forward of safeattn::attention (FlashAttention-2 style), for 16-bit inputs
// whose head dim has a generated instantiation (attention_fwd_d<D>_<dtype>.cu, made by
// scripts/gen_attention_instances.py). Semantics: ops/attention.h. The generic path: every GPU
// from sm_80 on (the sm_90a kernels in hopper/ take what they cover on Hopper).
//
// One CTA per (query tile, head, batch); each warp owns kMTiles x 16 rows of the query tile
// (FwdTiles: the shape per head dim, FwdConfig: the shape each head dim runs).
//   Q tile   global -> shared (cp.async), then either held in registers (ldmatrix, once) or
//            re-read from shared memory at every key tile (kQInRegs false).
//   K/V      tiles of kBlockN keys, global -> shared by cp.async, in one of two pipelines:
//            staged, kStages >= 2 buffers of K and V: tiles j + 1 .. j + kStages - 1 fly while
//            tile j is computed; interleaved, one V buffer (kVStages = 1): V_j flies during
//            S = Q K_j^T and the softmax, and K_j+1 during O += P V_j with one K buffer
//            (FlashAttention-2's order, in half the shared memory of two stages) or during all of
//            tile j with two (three quarters of it). Rows are padded by 16 bytes (D + 8) or
//            unpadded with their 16-byte chunks swizzled (SmemRows), so the 8 rows an ldmatrix
//            reads fall in 8 different bank groups.
//   S = Q K^T  mma.sync.m16n8k16 (16-bit in, fp32 accumulators), K fragments by ldmatrix; with
//            two 16-row tiles per warp each fragment feeds two MMAs.
//   softmax  online, in registers, in the log2 domain: p = exp2((s - m) * u). Plain scores (no
//            softcap, no float mask, scale > 0) stay raw dot products, the row max taken over
//            them, and u = scale * log2(e) folds the scale into the exponent (one multiply per
//            score fewer); otherwise s is ScoreRule's score and u its unit.
//   O += P V P rounded to 16 bits in registers is directly the A operand; V fragments by
//            ldmatrix.trans. O is rescaled in registers when the row max grows.
//   out      staged through shared memory, written with 16-byte stores through out's strides;
//            lse (natural log, fp32) by one thread per row.
// Key tiles that no query of the tile can see (causal) are never visited; a tile that the mask
// summary (summarize_mask_tiles) proves fully masked is skipped without reading K, V or the
// mask; only tiles on the causal diagonal, at the end of the keys, or that the summary calls
// mixed test elements one by one.
//
// Numerics: a row whose every score is -inf keeps m = -inf and uses 0 as its exponent offset,
// so p = exp2(-inf) = 0 and never exp2(-inf + inf) = NaN; it ends with out 0 and lse -inf (the
// sink logit with sinks). The row max uses fmaxf, which drops NaN, but a NaN score still makes
// its p NaN, and so its row sum, out and lse: NaN is never hidden. A masked element (False, or
// a float bias of -inf) is set to -inf rather than added to, so a NaN or inf score behind it
// stays hidden, as behind a skipped tile.
//
// No torch in the kernel: with SAFEATTN_STANDALONE defined, the header declares the kernel
// without the torch-checked launcher (benchmarks/mma_sync_fwd_check.cu).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "ops/cuda/generic/mma_sync.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "ops/cuda/mask_view.cuh"
#include "ops/cuda/score_rule.cuh"
#include "ops/cuda/tile_order.h"

#if defined(SAFEATTN_ATTN_FWD_DEFINE_KERNELS) && !defined(SAFEATTN_STANDALONE)
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#endif

namespace safeattn::cuda::attn {

// Everything the kernel reads; pointers are already offset to element 0 of each tensor.
struct FwdParams {
  const void* q = nullptr;       // [B, Hq, Q, D], unit inner stride, 16-byte aligned rows
  const void* k = nullptr;       // [B, Hkv, KV, D]
  const void* v = nullptr;       // [B, Hkv, KV, D]
  void* out = nullptr;           // [B, Hq, Q, D] strided view, unit inner stride
  float* lse = nullptr;          // [B, Hq, Q] contiguous
  float* lse_lo = nullptr;       // [B, Hq, Q] contiguous, or null: lse's rounding error
  const float* sinks = nullptr;  // [Hq] or null
  int64_t q_sb = 0, q_sh = 0, q_si = 0;
  int64_t k_sb = 0, k_sh = 0, k_si = 0;
  int64_t v_sb = 0, v_sh = 0, v_si = 0;
  int64_t o_sb = 0, o_sh = 0, o_si = 0;
  int64_t heads = 1;        // Hq
  int64_t group = 1;        // Hq / Hkv: query head h reads kv head h / group
  int64_t batch_heads = 1;  // B * Hq
  int64_t q_len = 0, kv_len = 0;
  // Score units (attention_common.cuh, exp_of): log2, or natural with a floating mask.
  ScoreRule score;
  Causal causal;
  MaskView mask;
  // Null, or each query row's one interval of keys (AttentionFwdArgs::key_ranges), ANDed with a
  // bool mask or none: `tiles` then summarises both (summarize_key_ranges), and a mixed tile
  // tests each element against its row's interval.
  KeyRangeView ranges;
  TileSummaryView tiles;  // null ptr without a mask or key ranges
  // The CTAs' order (ops/cuda/tile_order.h): CTA c computes longest_first(c, query tiles, B * Hq,
  // head_group)'s tile, its rank 0 the head's last query tile. 1: head after head, each head's last
  // tile first; larger: the last tiles of a group of heads first, then the next to last, and so on,
  // so that short tiles fill the grid's tail under causality or a mask summary.
  int head_group = 1;
};

// A forward tile shape: kBlockM queries x kBlockN keys a CTA, kWarps warps of kMTiles 16-row MMA
// tiles each, Q in registers or not, kStages K buffers and kVStages V buffers (the pipelines at
// the top), the CTAs per SM the register budget is set for (__launch_bounds__), and the rows of
// every shared tile padded or swizzled (SmemRows). Registers per thread (fp32 accumulators): S
// kMTiles * kBlockN / 2, O kMTiles * D / 2, Q fragments kMTiles * D / 4 when held.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, bool kQInRegs_, int kStages_, int kMinBlocks_,
          bool kSwizzle_ = false, int kVStages_ = kStages_>
struct FwdTiles {
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kWarps = kWarps_;
  static constexpr bool kQInRegs = kQInRegs_, kSwizzle = kSwizzle_;
  static constexpr int kStages = kStages_, kVStages = kVStages_, kMinBlocks = kMinBlocks_;
  static constexpr int kMTiles = kBlockM / (16 * kWarps);
  using Rows = SmemRows<kHeadDim, kSwizzle>;  // every shared tile's rows: Q, K, V, the output staging
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kBlockM % (16 * kWarps) == 0, "bad tile shape");
  static_assert(kStages >= 1 && kStages <= 4, "one to four K/V buffers");
  // Staged (kVStages = kStages >= 2): K and V of a tile share a stage. Interleaved (kVStages = 1):
  // one V buffer, V_j flying during S = Q K_j^T, and one K buffer (K_j+1 flying during P V_j) or
  // two (K_j+1 flying during all of tile j).
  static constexpr bool kInterleaved = kVStages == 1;
  static_assert(kVStages == kStages || (kInterleaved && kStages <= 2), "staged K/V, or one V buffer and 1-2 K");
  // Double buffered with Q in registers, Q's shared tile is free once loaded, so the second K/V
  // stage reuses it (and the output staging reuses it at the end). Otherwise every buffer has
  // its own rows: Q, then K and V of each stage (staged) or the K buffers then V (interleaved).
  static constexpr bool kAliasQ = kQInRegs && kStages == 2 && !kInterleaved;
  static constexpr int kQRows = kAliasQ && 2 * kBlockN > kBlockM ? 2 * kBlockN : kBlockM;
  static constexpr int kSmemRows = kQRows + (kAliasQ ? 2 : kStages + kVStages) * kBlockN;
  // How tile loads address global memory (load_tile's kWalk): the swizzled shapes and the one of
  // two K buffers with one V walk their rows (D = 128, 64-key tiles: 324 -> 132 bytes of spills
  // interleaved, 112 -> 88 swizzled, nvcc 13.0 sm_90); the padded shapes keep an offset per
  // round, which spills less there (FwdConfig<128>: 28 bytes against 44).
  static constexpr bool kWalkLoads = kSwizzle || (kInterleaved && kStages == 2);
  static constexpr size_t smem_bytes(size_t element_size) {
    return static_cast<size_t>(kSmemRows) * Rows::kStride * element_size;
  }
  // Whether the kernel carries the code that reads a mask and its tile summary (WithoutMask below),
  // and the one that tests key ranges (WithRanges, mma_sync.cuh).
  static constexpr bool kReadsMask = true;
  static constexpr bool kReadsRanges = false;
};

// A shape's kernel without the mask code, for calls with neither a mask nor a summary
// (is_causal, no mask): the element loop of mixed tiles and the summary walks compiled out. The
// mask code's registers cost the plain loop its spills (nvcc 13.0, sm_90: D = 128 32 bytes -> 0,
// D = 64's large shape 32 -> 16). H200, B4 H16 S4096 is_causal (benchmarks/mma_sync_fwd_check.cu):
// D = 128 0.950 -> 0.870 ms, D = 64 large 0.544 -> 0.539. kDispatchWithoutMask sends those calls
// to it (each forward instance compiles two kernels a shape).
template <class Tiles>
struct WithoutMask : Tiles {
  static constexpr bool kReadsMask = false;
};
constexpr bool kDispatchWithoutMask = true;

// The most dynamic shared memory a block may opt into on sm_86 / sm_89 / sm_120 (99 KB; sm_80 and
// sm_87 allow 163 KB, sm_90 227 KB).
constexpr size_t kSmemPerBlockSm86 = 99 * 1024;

// The shape each head dim runs (measured on an H200 against the other shapes of
// benchmarks/mma_sync_fwd_check.cu), FwdShape<D, false>::type. Shared memory must fit the 99 KB a
// block may have on sm_86 / sm_89 / sm_120 at D <= 128 (asserted below; 163 KB on sm_80):
// smem_fits sends a call elsewhere when it does not.
//   D <= 64: 4 warps of 32 rows (each K / V fragment feeds two MMAs), Q held in registers, 64-key
//     tiles double buffered in 36 KB (D = 64: swizzled rows, 32 KB, below).
//   D = 128 (below): 4 warps of 32 rows, Q re-read from shared memory, 64-key tiles in swizzled
//     rows, 96 KB, two CTAs an SM.
//   D = 80 / 96: 8 warps of 16 rows, Q in registers, 64-key tiles (68 KB at D = 96).
//   D = 256: O alone takes 128 registers, so 8 warps of 16 rows, Q from shared memory, 32-key
//     tiles (135 KB).
// A head dim may also have a large shape (FwdShape<D, true>), taken on GPUs whose SMs hold as
// many of its CTAs as it was measured with (fwd_large_tiles: sm_80, sm_90 and sm_100 do, not
// sm_86 / sm_89 / sm_120 with their 100 KB an SM); the others run the same type both ways.
template <int D, bool kLarge>
struct FwdShape {
  static constexpr bool kFourWarps = D <= 64 || D == 128;
  using type = FwdTiles<D, 128, (D >= 128 ? 32 : 64), (kFourWarps ? 4 : 8), (D < 128), 2, (kFourWarps ? 2 : 1)>;
};
// D = 64 in swizzled unpadded rows (32 KB): H200, B4 H16 S4096 bf16, causal 0.639 ms, not 0.679
// with padded rows (non-causal 0.983 / 1.044); 128-key tiles spilled (0.78 ms), 8 warps 0.71.
template <>
struct FwdShape<64, false> {
  using type = FwdTiles<64, 128, 64, 4, true, 2, 2, true>;
};
// D = 64's large shape: FlashAttention-2's 128 x 128 tiles, Q re-read from shared memory (its 32
// registers a thread freed: no spills in the loop), double buffered, 80 KB: two CTAs an SM of
// 164 KB or more. H200, B4 H16 S4096 bf16 (mma_sync_fwd_check), causal / non-causal: 0.541 /
// 0.940 ms against the small shape's 0.600 / 1.027. FlashAttention-2's own single-buffered order
// in 48 KB (which two CTAs would fit on sm_86) spilled 104 bytes and ran 0.603 / 1.022.
template <>
struct FwdShape<64, true> {
  using type = FwdTiles<64, 128, 128, 4, false, 2, 2, true>;
};
// The one line that picks D = 128's shape (FwdTiles<D, BlockM, BlockN, Warps, QInRegs, Stages,
// MinBlocks, Swizzle, VStages>): 64-key tiles in swizzled unpadded rows, 96 KB. H200, B4 H16
// S4096 bf16 (benchmarks/mma_sync_fwd_check.cu): causal 0.977 ms, not 1.600, where the padded
// 32-key shape took 1.180 / 1.958.
template <bool kLarge>
struct FwdShape<128, kLarge> {
  using type = FwdTiles<128, 128, 64, 4, false, 2, 2, true>;
};
template <int D, bool kLarge = false>
using FwdConfig = typename FwdShape<D, kLarge>::type;

// Host: whether head dim d runs a large shape of its own on a GPU whose blocks may opt into
// `smem_per_block` bytes of shared memory and whose SMs have `smem_per_sm`, `reserved_per_block`
// of them taken by each CTA: where an SM holds as many of its CTAs (kMinBlocks) as it was
// measured with. False for a head dim without one.
inline bool fwd_large_tiles(int64_t d, size_t smem_per_block, size_t smem_per_sm, size_t reserved_per_block) {
  bool large = false;
  with_head_dim<kFwdHeadDims>(d, [&](auto dim) {
    using Large = FwdConfig<decltype(dim)::value, true>;
    large = !std::is_same_v<Large, FwdConfig<decltype(dim)::value>> && Large::smem_bytes(2) <= smem_per_block &&
            Large::kMinBlocks * (Large::smem_bytes(2) + reserved_per_block) <= smem_per_sm;
  });
  return large;
}

// Host: the (query, key) tile sizes of head dim d (its large shape when `large`), for the mask
// summary; {0, 0} if none.
inline void fwd_tile_sizes(int64_t d, bool large, int& block_q, int& block_kv) {
  block_q = block_kv = 0;
  with_head_dim<kFwdHeadDims>(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    block_q = large ? FwdConfig<D, true>::kBlockM : FwdConfig<D>::kBlockM;
    block_kv = large ? FwdConfig<D, true>::kBlockN : FwdConfig<D>::kBlockN;
  });
}

// Host: the shared memory the kernel of head dim d takes (bytes, 16-bit elements), its small
// shape by default (the least it takes); 0 if none.
inline size_t fwd_smem_bytes(int64_t d, bool large = false) {
  size_t bytes = 0;
  with_head_dim<kFwdHeadDims>(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    bytes = large ? FwdConfig<D, true>::smem_bytes(2) : FwdConfig<D>::smem_bytes(2);
  });
  return bytes;
}

// Launches the kernel for one (dtype, head dim), its large shape when `large` (fwd_large_tiles),
// on `stream`. Defined (with the kernel) only where SAFEATTN_ATTN_FWD_DEFINE_KERNELS is set: in
// the generated attention_fwd_d<D>_<dtype>.cu, each of which instantiates one pair; the dispatch
// code sees this declaration.
template <typename T, int kHeadDim>
void launch_attention_fwd(const FwdParams& p, bool large, cudaStream_t stream);

#ifdef SAFEATTN_ATTN_FWD_DEFINE_KERNELS

namespace fwd_detail {

// A warp's fragment lanes: ldmatrix row addresses (the A operand and V's .trans share one
// pattern, K another) and the MMA accumulator's row group g and column pair t.
struct Lanes {
  int g, t, a_row, a_col, k_row, k_col;
  __device__ __forceinline__ explicit Lanes(int lane)
      : g(lane / 4),
        t(lane % 4),
        a_row((lane % 8) + 8 * ((lane / 8) % 2)),
        a_col(8 * (lane / 16)),
        k_row((lane % 8) + 8 * (lane / 16)),
        k_col(8 * ((lane / 8) % 2)) {}
};

// S = Q K^T for the warp's rows against one key tile in shared memory (raw dot products).
template <typename T, class Cfg, class QFrag>
__device__ __forceinline__ void score_tile(float (&s)[Cfg::kMTiles][Cfg::kBlockN / 8][4], const QFrag& q_frag,
                                           const T* s_q, const T* k_s, int warp_row0, const Lanes& ln) {
  using Rows = typename Cfg::Rows;
  const uint32_t q_lane = smem_address(s_q + Rows::offset(warp_row0 + ln.a_row, ln.a_col));
  const uint32_t k_lane = smem_address(k_s + Rows::offset(ln.k_row, ln.k_col));
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Cfg::kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[mt][nt][e] = 0.0f;
      }
    }
  }
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
    uint32_t a[Cfg::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
      if constexpr (Cfg::kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          a[mt][e] = q_frag[mt][kk][e];
        }
      } else {
        ldmatrix_x4(a[mt], Rows::moved(q_lane, mt * 16, kk * 16));
      }
    }
#pragma unroll
    for (int np = 0; np < Cfg::kBlockN / 16; ++np) {
      uint32_t kb[4];
      ldmatrix_x4(kb, Rows::moved(k_lane, np * 16, kk * 16));
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
        mma_pair<T>(s[mt][2 * np], s[mt][2 * np + 1], a[mt], kb);
      }
    }
  }
}

// The element tests of key tile `tile` of query tile `q_tile` (summary class tile_class) on the
// causal diagonal, at the end of the keys, or that the mask summary calls mixed or diagonal:
// out-of-range and causally hidden elements become -inf, and (kTileMixed) the mask is applied. In
// tile coordinates (TileBounds, 32-bit): the thread's columns of row r are c = 8 nt + 2 t + e,
// visible when c <= last_key(r) (a kTileDiagonal tile's own diagonal joins the causal one; a mixed
// tile of key ranges also asks lo - j0 <= c < hi - j0 of the row's interval); with
// the row's 2 t taken off once, each element is one compare of the constant 8 nt + e. Without mask
// values (the causal diagonal, a mask's diagonal tiles, the sequence ends) that compare and a
// select are all an element takes.
template <class Cfg>
__device__ __forceinline__ void mask_tile(float (&s)[Cfg::kMTiles][Cfg::kBlockN / 8][4], const FwdParams& p, int64_t b,
                                          int64_t h, int64_t q_tile, int64_t tile, uint8_t tile_class, int warp_row0,
                                          const Lanes& ln) {
  constexpr int kBlockN = Cfg::kBlockN;
  const int64_t i0 = q_tile * Cfg::kBlockM, j0 = tile * kBlockN;
  const bool read_mask = Cfg::kReadsMask && tile_class == kTileMixed;
  TileBounds bounds = tile_bounds(p.causal, p.q_len, p.kv_len, i0, Cfg::kBlockM, j0, kBlockN);
  if (Cfg::kReadsMask && tile_class == kTileDiagonal) {  // row r sees keys c <= r + the mask's diagonal too
    bounds.diagonal = min(bounds.diagonal, p.tiles.diagonal_at(b, h, q_tile, tile));
  }
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_row0 + mt * 16 + ln.g + 8 * half;
      const int last = bounds.last_key(r) - 2 * ln.t;  // the row's last visible column, less 2 t
      if (!read_mask) {
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mt][nt][2 * half + e];
            x = nt * 8 + e <= last ? x : -INFINITY;
          }
        }
      } else {
        const bool in_rows = r < bounds.query_rows;
        const int64_t mask_row = in_rows ? p.mask.offset(b, h, i0 + r, j0) : 0;
        // The row's key interval (key ranges) in the same coordinates: columns first .. last.
        int first = -kBlockN, last_in_range = last;
        if constexpr (Cfg::kReadsRanges) {
          auto column = [](int64_t key) {  // a key relative to j0, clamped into 32 bits
            return static_cast<int>(key < -kBlockN ? -kBlockN : (key > kBlockN ? kBlockN : key));
          };
          if (in_rows) {
            first = column(p.ranges.lo(b, i0 + r) - j0) - 2 * ln.t;
            last_in_range = min(last, column(p.ranges.hi(b, i0 + r) - j0) - 1 - 2 * ln.t);
          }
        }
        // Key ranges may come without a mask: no mask values to add then.
        const bool mask_values = !Cfg::kReadsRanges || p.mask.kind != MaskKind::kNone;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const bool visible = nt * 8 + e >= first && nt * 8 + e <= last_in_range;
            float x = s[mt][nt][2 * half + e];
            if (visible && mask_values) {
              x = p.score.masked(x, p.mask.additive(mask_row + (nt * 8 + 2 * ln.t + e) * p.mask.stride_kv));
            }
            s[mt][nt][2 * half + e] = visible ? x : -INFINITY;
          }
        }
      }
    }
  }
}

// The online softmax step of one key tile: the scores s (units per the top: exponent p =
// exp2((s - m) * unit)) become probabilities, the
// row max and the per-thread row sum move on, and O is rescaled by alpha = exp2((m_old - m_new) *
// unit) where a row's max grew: once the maxima settle (most tiles of a long row) alpha is exactly
// 1 in every row of the warp and the rescale, a multiply per O element, is skipped.
template <class Cfg>
__device__ __forceinline__ void softmax_tile(float (&s)[Cfg::kMTiles][Cfg::kBlockN / 8][4],
                                             float (&o)[Cfg::kMTiles][Cfg::kHeadDim / 8][4],
                                             float (&row_max)[Cfg::kMTiles][2], float (&row_sum)[Cfg::kMTiles][2],
                                             float unit) {
  float alpha[Cfg::kMTiles][2];
  bool rescale = false;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < Cfg::kBlockN / 8; ++nt) {
        mx = fmaxf(mx, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
      }
      // The four threads of a quad hold one row.
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_max[mt][half], mx);
      const float offset = m_new == -INFINITY ? 0.0f : m_new;            // empty so far: no -inf - -inf
      alpha[mt][half] = fast_exp2((row_max[mt][half] - offset) * unit);  // old max -inf: 0
      rescale |= alpha[mt][half] != 1.0f;
      row_max[mt][half] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < Cfg::kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = s[mt][nt][2 * half + e];
          const float pr = fast_exp2((x - offset) * unit);
          s[mt][nt][2 * half + e] = pr;
          sum += pr;
        }
      }
      row_sum[mt][half] = row_sum[mt][half] * alpha[mt][half] + sum;  // per thread; quad-summed at the end
    }
  }
  if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
      for (int dt = 0; dt < Cfg::kHeadDim / 8; ++dt) {
        o[mt][dt][0] *= alpha[mt][0];
        o[mt][dt][1] *= alpha[mt][0];
        o[mt][dt][2] *= alpha[mt][1];
        o[mt][dt][3] *= alpha[mt][1];
      }
    }
  }
}

// O += P V for one key tile, P (the probabilities in s) rounded to T.
template <typename T, class Cfg>
__device__ __forceinline__ void accumulate_pv(float (&o)[Cfg::kMTiles][Cfg::kHeadDim / 8][4],
                                              const float (&s)[Cfg::kMTiles][Cfg::kBlockN / 8][4], const T* v_s,
                                              const Lanes& ln) {
  using Rows = typename Cfg::Rows;
  const uint32_t v_lane = smem_address(v_s + Rows::offset(ln.a_row, ln.a_col));
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    uint32_t pa[Cfg::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
      pa[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      pa[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      pa[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      pa[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < Cfg::kHeadDim / 16; ++dp) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, Rows::moved(v_lane, kk * 16, dp * 16));
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
        mma_pair<T>(o[mt][2 * dp], o[mt][2 * dp + 1], pa[mt], vb);
      }
    }
  }
}

// The end of the tile: rows normalised, lse written (one thread per row), the output staged in
// shared memory (s_out, kBlockM rows laid out as Cfg::Rows) and stored with 16-byte writes through
// out's strides.
template <typename T, class Cfg>
__device__ __forceinline__ void store_tile(float (&o)[Cfg::kMTiles][Cfg::kHeadDim / 8][4],
                                           const float (&row_max)[Cfg::kMTiles][2],
                                           const float (&row_sum)[Cfg::kMTiles][2], float max_unit, const FwdParams& p,
                                           int64_t b, int64_t h, int64_t i0, int rows, T* s_out, int warp_row0,
                                           const Lanes& ln) {
  using Rows = typename Cfg::Rows;
  constexpr int D = Cfg::kHeadDim, kChunks = D / 8, kThreads = Cfg::kWarps * 32;
  const int tid = threadIdx.x;
  const bool warp_active = warp_row0 < rows;
  const int64_t bh = b * p.heads + h;
  const float sink = p.sinks != nullptr ? p.sinks[h] * (p.score.natural ? 1.0f : kLog2e) : 0.0f;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = row_sum[mt][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const bool empty = l == 0.0f;  // no visible key (NaN is not empty)
      const RowEnd end = finish_row(row_max[mt][half] * max_unit, l, p.sinks != nullptr, sink, p.score.natural);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        // An empty row is exactly 0, even if a masked value was NaN (0 * NaN in P V).
        o[mt][dt][2 * half] = empty ? 0.0f : o[mt][dt][2 * half] * end.factor;
        o[mt][dt][2 * half + 1] = empty ? 0.0f : o[mt][dt][2 * half + 1] * end.factor;
      }
      const int r = warp_row0 + mt * 16 + ln.g + 8 * half;
      if (warp_active && ln.t == 0 && r < rows) {
        p.lse[bh * p.q_len + i0 + r] = end.lse;
        if (p.lse_lo != nullptr) {
          p.lse_lo[bh * p.q_len + i0 + r] = end.lse_lo;
        }
      }
    }
  }
  __syncthreads();  // s_out's rows may still be read by other warps (Q, or a K/V stage)
  if (warp_active) {
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp_row0 + mt * 16 + ln.g + 8 * half;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          *reinterpret_cast<uint32_t*>(s_out + Rows::offset(r, dt * 8 + 2 * ln.t)) =
              pack2<T>(o[mt][dt][2 * half], o[mt][dt][2 * half + 1]);
        }
      }
    }
  }
  __syncthreads();
  T* o_base = static_cast<T*>(p.out) + b * p.o_sb + h * p.o_sh + i0 * p.o_si;
  constexpr int kOutChunks = Cfg::kBlockM * kChunks;
#pragma unroll
  for (int it = 0; it < (kOutChunks + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + tid;
    const int r = c / kChunks, ch = c % kChunks;
    if ((kOutChunks % kThreads == 0 || c < kOutChunks) && r < rows) {
      *reinterpret_cast<uint4*>(o_base + r * p.o_si + ch * 8) =
          *reinterpret_cast<const uint4*>(s_out + Rows::offset(r, ch * 8));
    }
  }
}

}  // namespace fwd_detail

template <typename T, class Cfg>
__global__ void __launch_bounds__(Cfg::kWarps * 32, Cfg::kMinBlocks) attention_fwd_kernel(const FwdParams p) {
  using namespace fwd_detail;
  constexpr int D = Cfg::kHeadDim;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kMTiles = Cfg::kMTiles;
  constexpr int kThreads = Cfg::kWarps * 32;
  using Rows = typename Cfg::Rows;
  constexpr int kStride = Rows::kStride;

  extern __shared__ __align__(1024) unsigned char smem_raw[];  // 1024: SmemRows::moved
  // [kQRows] rows: Q, then (kAliasQ) stage 1's K and V, then the output staging.
  T* s_q = reinterpret_cast<T*>(smem_raw);
  // Stage s's K tile ([kBlockN] rows). Staged: V right after each K, stage 1 in Q's rows when
  // kAliasQ. Interleaved: the kStages K buffers, then the one V buffer.
  auto s_k = [&](int stage) -> T* {
    if constexpr (Cfg::kAliasQ) {
      return stage == 0 ? s_q + Cfg::kQRows * kStride : s_q;
    } else if constexpr (Cfg::kInterleaved) {
      return s_q + (Cfg::kQRows + stage * kBlockN) * kStride;
    } else {
      return s_q + (Cfg::kQRows + 2 * stage * kBlockN) * kStride;
    }
  };
  auto s_v = [&](int stage) -> T* {
    if constexpr (Cfg::kInterleaved) {
      return s_q + (Cfg::kQRows + Cfg::kStages * kBlockN) * kStride;
    } else {
      return s_k(stage) + kBlockN * kStride;
    }
  };

  const int tid = threadIdx.x, warp = tid / 32;
  const Lanes ln(tid % 32);
  const int64_t q_tiles = (p.q_len + kBlockM - 1) / kBlockM;
  // The CTAs resident together hold the query tiles of a few heads (p.head_group's), whose K/V
  // share the L2; the longest (under causality, the latest) tiles go first.
  const TileRank order = longest_first(static_cast<int>(blockIdx.x), static_cast<int>(q_tiles),
                                       static_cast<int>(p.batch_heads), p.head_group);
  const int64_t q_tile = q_tiles - 1 - order.rank;
  const int64_t bh = order.head;
  const int64_t b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  const int64_t i0 = q_tile * kBlockM;
  const int rows = static_cast<int>(p.q_len - i0 < kBlockM ? p.q_len - i0 : kBlockM);
  const int warp_row0 = warp * kMTiles * 16;
  // Warps whose rows all lie past q_len (short query tiles, decoding) only help load.
  const bool warp_active = warp_row0 < rows;

  const T* q_base = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  const T* k_base = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;

  // Plain scores stay raw dot products and the scale joins the exponent (see the top).
  const bool fold_scale =
      !p.score.natural && p.score.softcap_post == 0.0f && p.score.scale > 0.0f && p.score.scale < INFINITY;
  const float unit = fold_scale ? p.score.scale : p.score.natural ? kLog2e : 1.0f;

  // Key tiles [0, n_tiles) may hold a key visible to this query tile; of those, the ones the
  // mask summary proves fully masked are skipped.
  const int64_t kv_end = p.causal.kv_end(i0 + rows, p.kv_len);
  const int64_t n_tiles = (kv_end + kBlockN - 1) / kBlockN;
  auto next_tile = [&](int64_t j) {
    if constexpr (Cfg::kReadsMask) {
      while (j < n_tiles && p.tiles.at(b, h, q_tile, j) == kTileMasked) {
        ++j;
      }
    }
    return j;
  };
  // The strides pass through opaque(): each chunk's offset is recomputed per tile (a few integer
  // instructions) instead of held in registers across the loop (spills at D = 128).
  constexpr int kKvRounds = load_rounds(kBlockN, D, kThreads), kQRounds = load_rounds(kBlockM, D, kThreads);
  constexpr bool kWalk = Cfg::kWalkLoads;
  auto load_k = [&](int64_t tile, int stage) {
    const int64_t j0 = tile * kBlockN;
    load_tile<T, kBlockN, D, kThreads, kKvRounds, Rows, kWalk, true>(s_k(stage), k_base + j0 * p.k_si, opaque(p.k_si),
                                                                     p.kv_len - j0, tid);
  };
  auto load_v = [&](int64_t tile, int stage) {
    const int64_t j0 = tile * kBlockN;
    load_tile<T, kBlockN, D, kThreads, kKvRounds, Rows, kWalk, true>(s_v(stage), v_base + j0 * p.v_si, opaque(p.v_si),
                                                                     p.kv_len - j0, tid);
  };

  // In flight before the loop: Q and the first tile's K (interleaved), or Q and the first
  // kStages - 1 tiles' K and V, one commit group a tile (Q in the first).
  load_tile<T, kBlockM, D, kThreads, kQRounds, Rows, kWalk>(s_q, q_base + i0 * p.q_si, p.q_si, rows, tid);
  // From the row's first key tile not masked (the summary's record; 0 without a mask): the keys
  // left padding or a window hides from it are not walked one load at a time.
  int64_t tile = Cfg::kReadsMask ? next_tile(p.tiles.first_visible_at(b, h, q_tile)) : 0;
  int64_t fetch = tile;  // the next tile whose K and V are loaded (staged)
  if constexpr (Cfg::kInterleaved) {
    if (tile < n_tiles) {
      load_k(tile, 0);
    }
    cp_async_commit();
  } else {
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
      if (fetch < n_tiles) {
        load_k(fetch, s);
        load_v(fetch, s);
        fetch = next_tile(fetch + 1);
      }
      cp_async_commit();
    }
  }

  [[maybe_unused]] uint32_t q_frag[Cfg::kQInRegs ? kMTiles : 1][Cfg::kQInRegs ? D / 16 : 1][4];
  if constexpr (Cfg::kQInRegs) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        ldmatrix_x4(q_frag[mt][kk], s_q + Rows::offset(warp_row0 + mt * 16 + ln.a_row, kk * 16 + ln.a_col));
      }
    }
    if constexpr (Cfg::kAliasQ) {
      __syncthreads();  // every warp holds its Q before the first prefetch refills Q's rows
    }
  }

  float o_acc[kMTiles][D / 8][4];
  float row_max[kMTiles][2], row_sum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o_acc[mt][dt][e] = 0.0f;
      }
    }
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  int stage = 0;
  while (tile < n_tiles) {
    const int64_t j0 = tile * kBlockN;
    int64_t next = 0;  // interleaved: the tile after this one
    if constexpr (!Cfg::kInterleaved) {
      // The stage computed last iteration is refilled with the tile kStages - 1 ahead.
      if (fetch < n_tiles) {
        const int refill = stage == 0 ? Cfg::kStages - 1 : stage - 1;
        load_k(fetch, refill);
        load_v(fetch, refill);
        fetch = next_tile(fetch + 1);
      }
      cp_async_commit();
      cp_async_wait<Cfg::kStages - 1>();  // this tile's group (and Q's) complete; later ones may fly
      __syncthreads();
    } else {
      next = next_tile(tile + 1);
      cp_async_wait<0>();  // K (and Q) here; every warp is past the last tile's P V (and S)
      __syncthreads();
      load_v(tile, 0);  // in flight during S = Q K^T and the softmax
      cp_async_commit();
      if constexpr (Cfg::kStages == 2) {
        if (next < n_tiles) {
          load_k(next, stage ^ 1);  // in flight during all of this tile
        }
        cp_async_commit();
      }
    }

    float s_acc[kMTiles][kBlockN / 8][4];
    if (warp_active) {
      score_tile<T, Cfg>(s_acc, q_frag, s_q, s_k(stage), warp_row0, ln);
      if (!fold_scale) {
        p.score.score_all<kMTiles * kBlockN / 8 * 4>(&s_acc[0][0][0]);
      }
      const uint8_t tile_class = Cfg::kReadsMask ? p.tiles.at(b, h, q_tile, tile) : uint8_t{kTileVisible};
      if (tile_class != kTileVisible || j0 + kBlockN > p.kv_len || !p.causal.tile_all_visible(i0, j0 + kBlockN)) {
        mask_tile<Cfg>(s_acc, p, b, h, q_tile, tile, tile_class, warp_row0, ln);
      }
      softmax_tile<Cfg>(s_acc, o_acc, row_max, row_sum, unit);
    }
    if constexpr (Cfg::kInterleaved) {
      cp_async_wait<Cfg::kStages - 1>();  // V here (the next K may fly); every warp is past S = Q K^T
      __syncthreads();
      if constexpr (Cfg::kStages == 1) {
        if (next < n_tiles) {
          load_k(next, 0);  // in flight during P V
        }
        cp_async_commit();
      }
    }
    if (warp_active) {
      accumulate_pv<T, Cfg>(o_acc, s_acc, s_v(stage), ln);
    }
    if constexpr (!Cfg::kInterleaved) {
      __syncthreads();  // every warp is done with this stage before it is refilled
      stage = stage + 1 == Cfg::kStages ? 0 : stage + 1;
      tile = next_tile(tile + 1);
    } else {
      stage ^= Cfg::kStages - 1;
      tile = next;
    }
  }
  cp_async_wait<0>();
  store_tile<T, Cfg>(o_acc, row_max, row_sum, fold_scale ? p.score.scale : 1.0f, p, b, h, i0, rows, s_q, warp_row0, ln);
}

#ifndef SAFEATTN_STANDALONE
namespace fwd_detail {

template <typename T, class Cfg>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  constexpr int kThreads = Cfg::kWarps * 32;
  constexpr size_t kSmem = Cfg::smem_bytes(sizeof(T));
  static_assert(kSmem <= 227 * 1024, "the tiles do not fit in shared memory");
  auto kernel = &attention_fwd_kernel<T, Cfg>;
  if constexpr (kSmem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  }
  const int64_t q_tiles = (p.q_len + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t blocks = q_tiles * p.batch_heads;
  TORCH_CHECK(blocks <= 0x7fffffffLL, "attention (CUDA): too many query tiles (", blocks, ")");
  FwdParams grid_p = p;
  if (p.causal.enabled || p.tiles.ptr != nullptr) {  // tiles of unequal lengths
    // K and V bytes per (batch, query head): a kv head's, shared by its group's query heads.
    grid_p.head_group = fwd_head_group(static_cast<int>(q_tiles), static_cast<int>(p.batch_heads),
                                       resident_ctas<&attention_fwd_kernel<T, Cfg>>(kThreads, kSmem),
                                       2LL * p.kv_len * Cfg::kHeadDim * static_cast<long long>(sizeof(T)) / p.group,
                                       current_l2_bytes());
  }
  kernel<<<static_cast<unsigned>(blocks), kThreads, kSmem, stream>>>(grid_p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fwd_detail

namespace fwd_detail {

// The shape's kernel: with the key ranges' test where the call has key ranges; without its mask
// code where it has no mask (kDispatchWithoutMask).
template <typename T, class Cfg>
void launch_fwd_for_mask(const FwdParams& p, cudaStream_t stream) {
  if constexpr (kMmaSyncReadsKeyRanges) {
    if (p.ranges.ptr != nullptr) {
      launch_fwd<T, WithRanges<Cfg>>(p, stream);
      return;
    }
  }
  if constexpr (kDispatchWithoutMask) {
    if (p.mask.kind == MaskKind::kNone && p.tiles.ptr == nullptr) {
      launch_fwd<T, WithoutMask<Cfg>>(p, stream);
      return;
    }
  }
  launch_fwd<T, Cfg>(p, stream);
}

}  // namespace fwd_detail

template <typename T, int kHeadDim>
void launch_attention_fwd(const FwdParams& p, bool large, cudaStream_t stream) {
  using Small = FwdConfig<kHeadDim, false>;
  using Large = FwdConfig<kHeadDim, true>;
  static_assert(kHeadDim > 128 || Small::smem_bytes(2) <= kSmemPerBlockSm86, "D <= 128 must fit sm_86's 99 KB");
  if constexpr (!std::is_same_v<Small, Large>) {
    if (large) {
      fwd_detail::launch_fwd_for_mask<T, Large>(p, stream);
      return;
    }
  }
  fwd_detail::launch_fwd_for_mask<T, Small>(p, stream);
}
#endif

#endif  // SAFEATTN_ATTN_FWD_DEFINE_KERNELS

}  // namespace safeattn::cuda::attn
