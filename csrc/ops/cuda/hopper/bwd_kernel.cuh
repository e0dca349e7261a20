// The sm_90a (Hopper) backward of safeattn::attention on CuTe: TMA loads, wgmma, warp
// specialisation. Built only with -gencode=arch=compute_90a,code=sm_90a; instantiated once per
// (head dim, dtype) in hopper/attention_bwd_sm90_d<D>_<dtype>.cu. Semantics: ops/attention.h;
// what it is given: hopper/bwd_params.h (the rows pre-pass has already made delta and row_shift).
//
// With s the raw dot products q.k, p = exp2(s * scale log2(e) - row_shift) (the forward's
// probabilities, lse and lse_lo folded into row_shift), dP = dO V^T and
// dS = scale * p * (dP - delta):  dV = P^T dO,  dK = dS^T Q,  dQ = dS K. With a softcap (the
// score rule, attn::ScoreRule) s is softcap * tanh(scale * q.k / softcap) in log2 units and dS
// takes the chain rule's (1 - tanh^2), tanh recovered from p itself (log2 p + row_shift = s), so
// no second fragment of scores is kept.
//
// One CTA per (key tile of kBlockN keys, kv head, batch) = 1 producer warpgroup + 2 consumer
// warpgroups; consumer warpgroup w owns keys [64w, 64w + 64) of the tile (past head dim 128 the
// tile is 64 keys that both share, Bwd::kSharedKeys: below, each warpgroup then computes S^T and
// dP^T for half the query rows, stores P^T to shared memory too, and dV and dK for half the head
// dim, with P^T and dS^T read from shared memory).
//   producer  one thread loads K and V once (TMA, one mbarrier), then streams the query tiles the
//             key tile sees (kBlockM rows, every query head of the kv head's group in turn: GQA
//             sums dK and dV inside the CTA) through two kStages-deep pipelines: Q with the
//             rows' row_shift, dO with the rows' delta (bulk copies of the padded arrays).
//   consumers per query tile, transposed so that keys are the wgmma M dimension and dK, dV stay
//             in registers for the whole CTA:
//               S^T = K Q^T, dP^T = V dO^T   (shared-memory operands)
//               P^T = exp2(...) -> dV += P^T dO   (P^T from registers, dO^T a view of dO)
//               dS^T = scale P^T (dP^T - delta), stored to shared memory as dS (stmatrix);
//               after a barrier of both warpgroups (dQ needs every key of the tile) dQ = dS K
//               (DqMode: at D = 128 each warpgroup multiplies all 128 keys for one 64-wide
//               head-dim half; at D = 64 one warpgroup multiplies all of them, alternating),
//               then dK += dS^T Q (dS^T from registers), so that dQ's staging runs during dK
//               (and its bulk addition during the warpgroup's next step: add_pending).
//               dS has two buffers, so a warpgroup may write the next tile's while the other
//               still reads this one's. The float32 dQ product goes to a shared-memory stage
//               in register order and one thread adds the whole stage into dq_accum with a bulk
//               reduce-add.
//   epilogue  dK and dV rounded to 16 bits and stored through their strides; a second kernel
//             converts dq_accum to grad_q.
// Past head dim 128 (bwd_dq_pass, DqMode kdQPass) there is no dQ product here: the dQ pass
// (hopper/bwd_dq_kernel.cuh) runs after this kernel, per query tile, and writes grad_q itself.
//
// Mask: an attn_mask's summary (bwd_params.h) skips the (query tile, key tile) steps it
// proves fully masked: the producer walks it and hands each visited step (position, class, diagonal)
// to the consumers with the Q load before it (the first with K and V); diagonal steps are a
// compare, mixed ones read the mask per element (a bool mask's bits, or a float mask's values
// added to the scores; its gradient p (dP - delta) is stored per element when asked for).
//
// Numerics: masked elements (causality, keys past kv_len, the mask) get s = -inf, so p = 0 whatever the
// row_shift; a row with no visible key has row_shift +inf and p = 0 for every key; query rows
// past q_len are zero-filled by TMA with row_shift +inf and delta 0 from the padding: every dS of
// theirs is exactly 0 and nothing is written for them. NaN in an input reaches the gradients.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/hopper/bwd_dq_kernel.cuh"
#include "ops/cuda/hopper/bwd_params.h"
#include "ops/cuda/hopper/fwd_kernel.cuh"

namespace safeattn::cuda::hopper {

// How the two consumer warpgroups share the dQ product of a step (M = query rows, K = keys):
//   kdQSplit      both over all the tile's keys, each 64 of 128 rows or a 64-wide head-dim half
//                 (whole 128-byte swizzle rows: head dims that are multiples of 128);
//   kdQAlternate  one over all the keys for whole rows, warpgroup (step % 2): one addition per
//                 step, and the other warpgroup goes on to the next step meanwhile;
//   kdQPass       none: dQ is the dQ pass's (bwd_dq_pass, hopper/bwd_dq_kernel.cuh), and the
//                 dK/dV kernel keeps only dS^T's store (its dK product reads it).
enum DqMode : int { kdQSplit, kdQAlternate, kdQPass };

// Tile shape of one variant. kBlockM query rows per step, kBlockN keys per CTA (64 per consumer
// warpgroup), kStages Q and dO buffers. Registers per consumer thread: dK and dV D/2 each,
// S and dP kBlockM/4 each, dQ kBlockM * D / 256 (kBlockM * D / 128 when one warpgroup's product
// covers whole rows).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct BwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
};

static_assert(kBwdRowPad % 128 == 0, "every kBlockM divides the row padding (bwd_params.h)");

template <int kHeadDim>
struct DefaultBwdConfig;
template <>
struct DefaultBwdConfig<64> {
  using type = BwdConfig<64, 64, 128, 2>;
};
template <>
struct DefaultBwdConfig<96> {  // 48 bytes of spills; 348 TFLOP/s causal on an H100
  using type = BwdConfig<96, 64, 128, 2>;
};
template <>
struct DefaultBwdConfig<128> {
  using type = BwdConfig<128, 64, 128, 2>;
};
// 64 keys shared by the two consumer warpgroups (Bwd::kSharedKeys); dQ in a pass of its own
// (bwd_dq_pass): added from here by atomics it was half the kernel's time (Q, dO, K, V, P and dS
// fill the shared memory, no room is left for a dQ stage).
template <>
struct DefaultBwdConfig<256> {
  using type = BwdConfig<256, 64, bwd_key_tile(256), 2>;
};

namespace detail {

using namespace cute;

// dst[0, bytes) += src[0, bytes) in float32, asynchronously (bulk async-group; 16-byte aligned,
// bytes a multiple of 16).
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(cute::cast_smem_ptr_to_uint(src)), "r"(bytes)
               : "memory");
}

template <typename Element, class FragS, class FragP>
__device__ __forceinline__ void convert_fragment(const FragS& s, FragP& p) {
  constexpr int kN = decltype(size(s))::value;
  static_assert(kN == decltype(size(p))::value);
  cutlass::NumericArrayConverter<Element, float, kN> convert;
  *reinterpret_cast<cutlass::Array<Element, kN>*>(raw_pointer_cast(p.data())) =
      convert(*reinterpret_cast<const cutlass::Array<float, kN>*>(raw_pointer_cast(s.data())));
}

// kMasked: the variant that reads a mask and its summary; the other has none of that code (the
// mask's gathers cost the unmasked kernel registers it cannot spare). kSoftcap: the variant with
// a softcap (a runtime test in the others cost the D = 64 kernel 7%, H200). kBias: the mask is a
// float one (natural units, row_lo, its gradient); not with a softcap (whose dS recovers the
// capped score from p, which the bias moves), and a bool mask's kernel has none of its code.
template <typename Element_, class Config, bool kMasked_ = false, bool kSoftcap_ = false, bool kBias_ = false>
struct Bwd {
  using Element = Element_;
  static constexpr bool kMasked = kMasked_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kBias = kBias_;
  static_assert(!kBias || (kMasked && !kSoftcap), "a bias is a mask, without a softcap");
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr int kMmaWGs = 2;
  static constexpr int kMmaThreads = 128 * kMmaWGs;
  static constexpr int kThreads = kMmaThreads + 128;
  // 168 registers per thread at launch (65536 / 384, rounded down to 8); 24 * 128 + 240 * 256
  // is exactly that pool.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kMmaThreads <= 168 * kThreads);
  // kSharedKeys, a tile of 64 keys (bwd_key_tile: head dims past 128): both consumer warpgroups
  // work on the same keys, each on half the step's query rows for S^T and dP^T and on half the
  // head dim for dK and dV (D / 2 accumulators each for dK and dV would leave no registers for S
  // and dP); P^T then goes through shared memory as dS^T does, and the dK / dV products read
  // both from there. Otherwise each consumer warpgroup owns 64 of the tile's keys.
  static constexpr bool kSharedKeys = kBlockN == 64;
  static_assert(kBlockN == (kSharedKeys ? 64 : 64 * kMmaWGs));
  static constexpr int kSdPRows = kSharedKeys ? kBlockM / kMmaWGs : kBlockM;    // S^T's query rows per warpgroup
  static constexpr int kdKVCols = kSharedKeys ? kHeadDim / kMmaWGs : kHeadDim;  // dK's, dV's head dim per warpgroup
  static_assert(kBlockM == 64 || kBlockM == 128);
  // The dQ product's sharing (DqMode): the dQ pass's head dims have none, else split where the
  // tile allows it, else alternate (at D = 64 on an H200 fwd+bwd 335 -> 359 TFLOP/s against each
  // warpgroup multiplying its own 64 keys: half the reduce-adds per step).
  static constexpr int kdQMode =
      bwd_dq_pass(kHeadDim) ? hopper::kdQPass
                            : (kBlockM == 128 || kHeadDim % 128 == 0 ? hopper::kdQSplit : hopper::kdQAlternate);
  static constexpr bool kdQPass = kdQMode == hopper::kdQPass;
  static constexpr bool kdQAlternate = kdQMode == hopper::kdQAlternate;
  static constexpr bool kdQWholeRows = kdQMode != hopper::kdQSplit;  // one warpgroup's product covers whole rows
  static_assert(kdQWholeRows || kBlockM == 128 || kHeadDim % 128 == 0, "no dQ split for this tile");
  static constexpr int kdQWarpgroupsM = kdQWholeRows ? 1 : kBlockM / 64;
  static constexpr int kdQWarpgroupsN = kdQWholeRows ? 1 : kMmaWGs / kdQWarpgroupsM;
  // Named barrier 0 is __syncthreads; 1: both consumer warpgroups wrote their dS (1 + step % 2
  // with kdQAlternate); 3 + w: warpgroup w staged its dQ.
  static constexpr int kDsBarrier = 1;
  static constexpr int kdQStagedBarrier = 3;
  static constexpr int kPBarrier = 5;  // kSharedKeys: both consumer warpgroups wrote their P^T
  // dQ through shared memory: each warpgroup's 64-row product (kdQTileElems floats) is staged in
  // register order, element i of thread t at (i / 2) * 256 + 2 t + i % 2 (float2 stores of
  // consecutive threads: no bank conflict), and added by one bulk reduce-add into dq_accum, which
  // keeps that order per tile (dq_tile_offset; the conversion kernel reads it back). Two stage
  // buffers: the bulk read of one overlaps the next tile. With the dQ pass there is no stage (a
  // 16-byte placeholder).
  static constexpr int kdQTileElems = 64 * (kHeadDim / kdQWarpgroupsN);
  static constexpr int kdQStageElems = kdQPass ? 4 : 2 * kMmaWGs * kdQTileElems;

  // Where dQ element (r, c) of a kBlockM-row tile sits in dq_accum's tile.
  static __host__ __device__ __forceinline__ int dq_tile_offset(int r, int c) {
    constexpr int kN = kHeadDim / kdQWarpgroupsN;
    const int region = kdQWholeRows ? 0 : (kdQWarpgroupsM == 2 ? r / 64 : 0) * kdQWarpgroupsN + c / kN;
    const int rr = r % 64, cc = c % kN;
    const int t = (rr / 16) * 32 + (rr % 8) * 4 + (cc % 8) / 2;
    const int i = (cc / 8) * 4 + ((rr % 16) / 8) * 2 + cc % 2;
    return region * kdQTileElems + (i / 2) * 256 + 2 * t + i % 2;
  }

  // How the warpgroups split S^T, dP^T, dK and dV: by keys (M), or with kSharedKeys by query
  // rows for S^T / dP^T and by head dim for dK / dV (N).
  using WarpgroupLayout = Layout<Shape<Int<kSharedKeys ? 1 : kMmaWGs>, Int<kSharedKeys ? kMmaWGs : 1>, _1>>;
  // S^T = K Q^T and dP^T = V dO^T: M = keys, N = query rows, K = head dim.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kSdPRows>, Int<kHeadDim>>>(), WarpgroupLayout{}));
  // dV += P^T dO and dK += dS^T Q: A from registers (with kSharedKeys from shared memory, query
  // rows contiguous: K-major), B (N = head dim, K = query rows) is a transposed view of dO / Q,
  // head dim contiguous: MN-major.
  using AtomdKV =
      std::conditional_t<kSharedKeys,
                         decltype(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kdKVCols>, Int<kBlockM>>,
                                                       GMMA::Major::K, GMMA::Major::MN>()),
                         decltype(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kdKVCols>, Int<kBlockM>>,
                                                       GMMA::Major::K, GMMA::Major::MN>())>;
  using TiledMmadKV = decltype(make_tiled_mma(AtomdKV{}, WarpgroupLayout{}));
  // dQ = dS K: A = dS (M = query rows, K = keys) stored query-contiguous (MN-major), B = K^T
  // (N = head dim, K = keys), head dim contiguous (MN-major).
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / kdQWarpgroupsN>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<Int<kdQWarpgroupsM>, Int<kdQWarpgroupsN>, _1>>{}));

  using SmemLayoutK = decltype(tile_to_shape(k_major_atom<Element, kHeadDim>(), Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutQ =
      decltype(tile_to_shape(k_major_atom<Element, kHeadDim>(), Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  // The same bytes seen as (head dim, rows[, stage]).
  using SmemLayoutQt =
      decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                                      Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // dS: (query rows, keys, buffer), query rows contiguous; buffers 0 and 1 hold dS, 2 and 3 P
  // (kSharedKeys).
  static constexpr int kDsBuffers = kSharedKeys ? 4 : 2;
  using SmemLayoutdS =
      decltype(tile_to_shape(mn_major_atom<Element, kBlockM>(), Shape<Int<kBlockM>, Int<kBlockN>, Int<kDsBuffers>>{}));
  // The same bytes seen as dS^T (keys, query rows, buffer): the S^T accumulator's shape.
  using SmemLayoutdSt =
      decltype(composition(SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kDsBuffers>>{},
                                                       Stride<Int<kBlockM>, _1, Int<kBlockM * kBlockN>>{})));
  // dS^T from the accumulator registers into shared memory: stmatrix, four 8 x 8 blocks a call
  // (each block row is 8 consecutive query rows of one key: 16 contiguous bytes of dS).
  using R2SCopydS = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmaSdP{}));

  // Global tensors as TMA sees them: (rows, head dim, head, batch), 32-bit sizes, 64-bit strides.
  using ShapeQKV = TmaShape;
  using StrideQKV = TmaStride;
  using TmaQ = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kBytesRows = kBlockM * sizeof(float);
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element) + kBytesRows;  // + row_shift
  static constexpr uint32_t kBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  // Q load j carries the visit after its step in slot j % kVisitSlots: written before Q's stage is
  // acquired for load j, read by the consumers before they release it (as in the forward).
  static constexpr int kVisitSlots = kStages + 1;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> d_o;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> ds;
    alignas(16) float row_shift[kStages][kBlockM];           // arrives with Q
    alignas(16) float row_lo[kBias ? kStages : 1][kBlockM];  // arrives with Q (kBias)
    alignas(16) float delta[kStages][kBlockM];               // arrives with dO
    alignas(128) float dq_stage[kdQStageElems];              // [buffer][warpgroup][kdQTileElems]
    typename Pipeline::SharedStorage pipe_q;
    typename Pipeline::SharedStorage pipe_do;
    cutlass::arch::ClusterTransactionBarrier kv_full;
    TileVisit first_visit;              // kMasked: the first step visited, published with K and V
    TileVisit next_visit[kVisitSlots];  // kMasked: per Q load, the step visited after it
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an H100 CTA can have");

  struct Params {
    TmaQ tma_q, tma_do;
    TmaQ tma_do_clean;          // grad_out_clean, or grad_out again
    const int* grad_out_dirty;  // null, or nonzero: dO is read through tma_do_clean
    TmaK tma_k, tma_v;
    ShapeQKV shape_q, shape_k;
    const float* row_shift;  // [B, Hq, q_pad]
    const float* delta;      // [B, Hq, q_pad]
    const float* row_lo;     // [B, Hq, q_pad]: BwdParams::row_lo (kBias only)
    float* dq_accum;         // [B, Hq, q_pad / kBlockM tiles, kBlockM * D in dq_tile_offset order]
    Element* grad_k;
    Element* grad_v;
    int64_t dk_sb, dk_sh, dk_si, dv_sb, dv_sh, dv_si;
    int heads, group, q_len, q_pad, kv_len, m_blocks;
    attn::ScoreRule score;  // log2 units; a softcap when score.softcap_post > 0
    bool causal;
    int64_t causal_shift;
    attn::MaskView mask;               // bool, float (a bias), or none
    attn::TileSummaryView mask_tiles;  // kBwdMaskTileRows x bwd_key_tile(D)
    attn::KeyRangeView key_ranges;     // null, or one interval of keys per query row
    float* grad_mask;                  // BwdParams::grad_mask (kBias only)
    bool grad_mask_sums_batch;         // BwdParams::grad_mask_sums_batch
    bool batch_inner;                  // BwdParams::batch_inner
    int head_group;                    // BwdParams::head_group, at least 1
  };
  static_assert(!kMasked || (kBlockM == kBwdMaskTileRows && kBlockN == bwd_key_tile(kHeadDim)),
                "a masked step is one tile of the mask summary");

  // The first step from `step` on that the mask summary does not rule out for key tile n_block
  // (position `steps`: none), with its class and diagonal. Step s is query tile m_begin + s % m_count
  // of head kv_head * group + s / m_count. The producer walks kWalkLoads summary bytes per round
  // trip (all in flight at once), so a long masked run (the keys a causal mask hides from the
  // first query tiles) costs a few round trips instead of one per step.
  static constexpr int kWalkLoads = 8;

  // The (key tile, kv head, batch) of this CTA. The grid is (key tiles, kv heads, batch) and the
  // hardware hands its blocks out in linear order; under causality (or a mask) that order is read
  // as longest_first's over the (batch, kv head)s, so key tile 0 (seen by every query) and the
  // other long ones go first in each group of heads (tile_order.h); the kv head varies fastest
  // in that group, or the batch row with BwdParams::batch_inner.
  struct Block {
    int n_block, kv_head, batch;
  };
  static __device__ __forceinline__ Block block_coords(const Params& p) {
    const int64_t blocks = int64_t{gridDim.x} * gridDim.y * gridDim.z;
    if ((!p.causal && !kMasked) || blocks > INT32_MAX) {
      return Block{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
    }
    const int linear = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    const TileRank r =
        longest_first(linear, static_cast<int>(gridDim.x), static_cast<int>(gridDim.y * gridDim.z), p.head_group);
    if (p.batch_inner) {
      return Block{r.rank, r.head / static_cast<int>(gridDim.z), r.head % static_cast<int>(gridDim.z)};
    }
    return Block{r.rank, r.head % static_cast<int>(gridDim.y), r.head / static_cast<int>(gridDim.y)};
  }
  static __device__ TileVisit visit_from(const Params& p, const Block& block, int step, int steps, int m_begin) {
    if constexpr (!kMasked) {
      return TileVisit{step, attn::kTileVisible, 0};
    }
    const int n_block = block.n_block, kv_head = block.kv_head, batch = block.batch;
    const int m_count = p.m_blocks - m_begin;
    int group_head = step / m_count, m = m_begin + step % m_count;
    for (; group_head < p.group; ++group_head, m = m_begin) {
      const int head = kv_head * p.group + group_head;
      const uint8_t* column = p.mask_tiles.ptr + p.mask_tiles.index(batch, head, 0, n_block);
      for (; m < p.m_blocks; m += kWalkLoads) {
        uint8_t tile_class[kWalkLoads];
#pragma unroll
        for (int j = 0; j < kWalkLoads; ++j) {
          tile_class[j] =
              m + j < p.m_blocks ? column[int64_t{m + j} * p.mask_tiles.stride_q] : uint8_t{attn::kTileMasked};
        }
#pragma unroll
        for (int j = 0; j < kWalkLoads; ++j) {
          if (tile_class[j] != attn::kTileMasked) {
            const int diagonal =
                tile_class[j] == attn::kTileDiagonal ? p.mask_tiles.diagonal_at(batch, head, m + j, n_block) : 0;
            return TileVisit{group_head * m_count + m + j - m_begin, tile_class[j], diagonal};
          }
        }
      }
    }
    return TileVisit{steps, attn::kTileMasked, 0};
  }

  // The query tiles key tile n_block sees: [m_begin, m_blocks) of every head of the group.
  static __device__ __forceinline__ int first_m_block(const Params& p, int n_block) {
    if (!p.causal) {
      return 0;
    }
    // Query i sees key j iff j <= i + shift: the tile's first key is seen from i = j0 - shift on.
    const int64_t first_query = std::max<int64_t>(int64_t{n_block} * kBlockN - p.causal_shift, 0);
    return first_query >= p.q_len ? p.m_blocks : static_cast<int>(first_query / kBlockM);
  }

  // ---- producer ------------------------------------------------------------------------------

  static __device__ void produce(const Params& p, const Block& block, SharedStorage& smem, Pipeline& pipe_q,
                                 Pipeline& pipe_do, int steps, int m_begin) {
    const int n_block = block.n_block, kv_head = block.kv_head, batch = block.batch;
    const int m_count = p.m_blocks - m_begin;
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutK{});
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), SmemLayoutQ{});
    Tensor gK = local_tile(p.tma_k.get_tma_tensor(p.shape_k)(_, _, kv_head, batch),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
    Tensor gV = local_tile(p.tma_v.get_tma_tensor(p.shape_k)(_, _, kv_head, batch),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
    auto cta_k = p.tma_k.get_slice(_0{});
    auto cta_v = p.tma_v.get_slice(_0{});
    auto& kv_full = smem.kv_full;
    TileVisit visit = visit_from(p, block, 0, steps, m_begin);
    if constexpr (kMasked) {
      write_visit(smem.first_visit, visit);  // published by kv_full's arrive
    }
    kv_full.arrive_and_expect_tx(kBytesKV);
    copy(p.tma_k.with(reinterpret_cast<uint64_t&>(kv_full), 0, TMA::CacheHintSm90::EVICT_FIRST), cta_k.partition_S(gK),
         cta_k.partition_D(sK));
    copy(p.tma_v.with(reinterpret_cast<uint64_t&>(kv_full), 0, TMA::CacheHintSm90::EVICT_FIRST), cta_v.partition_S(gV),
         cta_v.partition_D(sV));

    // dO without its empty rows' non-finite values (bwd_params.h): one flag read per CTA.
    const TmaQ& tma_do = p.grad_out_dirty != nullptr && *p.grad_out_dirty != 0 ? p.tma_do_clean : p.tma_do;
    auto cta_q = p.tma_q.get_slice(_0{});
    auto cta_do = tma_do.get_slice(_0{});
    Tensor tQsQ = group_modes<0, 3>(cta_q.partition_D(sQ));      // (TMA, stage)
    Tensor tdOsdO = group_modes<0, 3>(cta_do.partition_D(sdO));  // (TMA, stage)
    PipelineState write_q = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_do = cutlass::make_producer_start_state<Pipeline>();
    for (int q_loads = 0; visit.position < steps; ++q_loads) {
      const int step = visit.position;
      const int head = kv_head * p.group + step / m_count;
      const int m_block = m_begin + step % m_count;
      visit = visit_from(p, block, step + 1, steps, m_begin);
      if constexpr (kMasked) {
        write_visit(smem.next_visit[q_loads % kVisitSlots], visit);
      }
      const int64_t row_offset = (int64_t{batch} * p.heads + head) * p.q_pad + int64_t{m_block} * kBlockM;
      Tensor gQ = local_tile(p.tma_q.get_tma_tensor(p.shape_q)(_, _, head, batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(m_block, _0{}));
      Tensor gdO = local_tile(tma_do.get_tma_tensor(p.shape_q)(_, _, head, batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                              make_coord(m_block, _0{}));

      pipe_q.producer_acquire(write_q);
      uint64_t* q_bar = pipe_q.producer_get_barrier(write_q);
      copy(p.tma_q.with(*q_bar, 0, TMA::CacheHintSm90::EVICT_LAST), group_modes<0, 3>(cta_q.partition_S(gQ)),
           tQsQ(_, write_q.index()));
      SM90_BULK_COPY_G2S::copy(p.row_shift + row_offset, q_bar, smem.row_shift[write_q.index()], kBytesRows);
      if constexpr (kBias) {
        SM90_BULK_COPY_G2S::copy(p.row_lo + row_offset, q_bar, smem.row_lo[write_q.index()], kBytesRows);
      }
      ++write_q;

      pipe_do.producer_acquire(write_do);
      uint64_t* do_bar = pipe_do.producer_get_barrier(write_do);
      copy(tma_do.with(*do_bar, 0, TMA::CacheHintSm90::EVICT_LAST), group_modes<0, 3>(cta_do.partition_S(gdO)),
           tdOsdO(_, write_do.index()));
      SM90_BULK_COPY_G2S::copy(p.delta + row_offset, do_bar, smem.delta[write_do.index()], kBytesRows);
      ++write_do;
    }
  }

  // ---- consumers -----------------------------------------------------------------------------

  static __device__ void consume(const Params& p, const Block& block, SharedStorage& smem, Pipeline& pipe_q,
                                 Pipeline& pipe_do, int steps, int m_begin) {
    const int n_block = block.n_block, kv_head = block.kv_head, batch = block.batch;
    const int m_count = p.m_blocks - m_begin;
    const int mma_thread = threadIdx.x - 128;
    const int wg = __shfl_sync(0xffffffff, mma_thread / 128, 0);  // warp-uniform to the compiler
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutKt{});
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.d_o.data()), SmemLayoutQt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), SmemLayoutdSt{});

    TiledMmaSdP mma_sdp;
    TiledMmadKV mma_dkv;
    TiledMmadQ mma_dq;
    auto wg_sdp = mma_sdp.get_slice(wg * 128);
    auto wg_dkv = mma_dkv.get_slice(wg * 128);
    auto wg_dq = mma_dq.get_slice(kdQAlternate ? 0 : wg * 128);
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);      // (MMA, 1, D / 16): this warpgroup's keys
    Tensor tSrV = wg_sdp.partition_fragment_A(sV);      // (MMA, 1, D / 16)
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);      // (MMA, 1, D / 16, stage)
    Tensor tSrdO = wg_sdp.partition_fragment_B(sdO);    // (MMA, 1, D / 16, stage)
    Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);  // (MMA, 1, M / 16, stage)
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);    // (MMA, 1, M / 16, stage)
    Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);    // (MMA, 1, N / 16, buffer)
    Tensor tdQrKt = wg_dq.partition_fragment_B(sKt);    // (MMA, 1, N / 16)

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    // P^T and dS^T as the A operand of the dK/dV products: k block kb holds accumulator elements
    // [8 kb, 8 kb + 8) of S^T (the wgmma accumulator and A-fragment orders agree).
    using RegLayoutA = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kSdPRows / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;
    Tensor tdVrP = make_tensor<Element>(RegLayoutA{});
    Tensor tdKrdS = make_tensor<Element>(RegLayoutA{});
    static_assert(decltype(size(tSrS))::value == kSdPRows / 2 && decltype(size(tdVrP))::value == kSdPRows / 2);
    // kSharedKeys: P^T (buffers 2, 3) and dS^T (0, 1) as the dK / dV products' A, from shared memory.
    auto shared_a = [&] {
      if constexpr (kSharedKeys) {
        return wg_dkv.partition_fragment_A(sdSt);  // (MMA, 1, M / 16, buffer)
      } else {
        return 0;
      }
    }();
    R2SCopydS r2s_ds;
    auto thr_r2s_ds = r2s_ds.get_slice(mma_thread);
    Tensor tdSsdS = thr_r2s_ds.partition_D(sdSt);  // (CPY, CPY_M, CPY_N, buffer)
    // tdKrdS's (tdVrP's) registers seen in the accumulator's layout (the same order), as the
    // copy's source.
    Tensor tdSrdS = thr_r2s_ds.retile_S(make_tensor(tdKrdS.data(), tSrS.layout()));
    Tensor tPrP = thr_r2s_ds.retile_S(make_tensor(tdVrP.data(), tSrS.layout()));

    // Accumulator element i of a 64 x N wgmma (thread t of the warpgroup) sits at row
    // 16 (t / 32) + (t % 32) / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (t % 4) + i % 2: a
    // per-thread base plus a constant once the loops are unrolled.
    const int row_base = 16 * ((mma_thread % 128) / 32) + (mma_thread % 32) / 4;
    const int col_base = 2 * (mma_thread % 4);
    auto acc_row = [](int i) { return 8 * ((i / 2) % 2); };
    auto acc_col = [](int i) { return 8 * (i / 4) + i % 2; };
    // S^T, dP^T, dK, dV: keys are the rows; S^T's columns are query rows (query_base), dK's and
    // dV's the head dim (dkv_col_base).
    const int key_base = (kSharedKeys ? 0 : 64 * wg) + row_base;
    const int query_base = (kSharedKeys ? kSdPRows * wg : 0) + col_base;
    const int dkv_col_base = (kSharedKeys ? kdKVCols * wg : 0) + col_base;
    static_assert(decltype(size(tdVrdV))::value == kdKVCols / 2);
    static_assert(decltype(size(tdQrdQ))::value == kBlockM * kHeadDim / (kdQWholeRows ? 128 : kMmaThreads));

    clear(tdVrdV);
    clear(tdKrdK);
    const int key0 = n_block * kBlockN;
    const int keys_in_tile = p.kv_len - key0 < kBlockN ? p.kv_len - key0 : int{kBlockN};
    if (steps > 0) {
      smem.kv_full.wait(0);
    }
    PipelineState read_q, read_do;
    // The steps the mask summary does not rule out (the producer's walk, read from shared memory
    // with each Q load), and the mask bits of a mixed or diagonal one (set: visible), one per
    // accumulator element of S^T, found one step ahead (below). Rows past q_len and keys past
    // kv_len read nothing and keep their bit (handled below).
    auto head_of = [&](int step) { return kv_head * p.group + step / m_count; };
    auto m_block_of = [&](int step) { return m_begin + step % m_count; };
    int q_reads = 0;
    // The visit after `step`, once its Q load has landed; without a mask every step is visited.
    auto visit_after_load = [&](int step) -> TileVisit {
      if constexpr (kMasked) {
        return read_visit(smem.next_visit[q_reads++ % kVisitSlots]);
      } else {
        return TileVisit{step + 1, attn::kTileVisible, 0};
      }
    };
    auto mask_bits = [&](const TileVisit& visit) {
      uint32_t keep = ~0u;
      if constexpr (kMasked) {
        const int step = visit.position;
        if (step < steps && visit.tile_class == attn::kTileDiagonal) {
          // A compare: query row (tile-relative) r sees the tile's keys c <= r + diagonal.
          keep = 0;
#pragma unroll
          for (int i = 0; i < size(tSrS); ++i) {
            keep |= uint32_t{key_base + acc_row(i) <= query_base + acc_col(i) + visit.diagonal} << i;
          }
        } else if (step < steps && visit.tile_class == attn::kTileMixed) {
          static_assert(decltype(size(tSrS))::value <= 32);
          const int row0 = m_block_of(step) * kBlockM;
          const int last_row = p.q_len - 1 - row0;
          // Unconditional loads (indices clamped, bounds applied after), all in flight at once. A
          // float mask's bits are its elements that are not -inf (add_bias adds the values).
          auto gather = [&](const auto* mask) {
            mask += p.mask.offset(batch, head_of(step), row0, key0);
#pragma unroll 8
            for (int i = 0; i < size(tSrS); ++i) {
              const int key = key_base + acc_row(i), row = query_base + acc_col(i);
              const bool visible =
                  attn::visible(mask[int64_t{row < last_row ? row : last_row} * p.mask.stride_q +
                                     int64_t{key < keys_in_tile ? key : keys_in_tile - 1} * p.mask.stride_kv]);
              if (!visible && key < keys_in_tile && row <= last_row) {
                keep &= ~(1u << i);
              }
            }
          };
          if (p.mask.ptr != nullptr) {
            p.mask.with_elements(gather);
          }
          if (p.key_ranges.ptr != nullptr) {  // and each row's one interval of keys
#pragma unroll 8
            for (int i = 0; i < size(tSrS); ++i) {
              const int key = key0 + key_base + acc_row(i), row = query_base + acc_col(i);
              const int64_t q = row0 + (row < last_row ? row : last_row);
              if (key < p.key_ranges.lo(batch, q) || key >= p.key_ranges.hi(batch, q)) {
                keep &= ~(1u << i);
              }
            }
          }
        }
      }
      return keep;
    };
    // This warpgroup's dQ of a step (rows row0.. of `head`) added into dq_accum:
    // stored to its stage buffer (dq_stage_slot) at the step's end, while dK runs, and added by
    // one bulk reduce-add (add_dq_stage) during the warpgroup's next step (alternating: one
    // without a dQ product of its own), once that step's S^T and dP^T are issued, so that the
    // fence, the barrier and the bulk copy's issue overlap the tensor cores instead of
    // lengthening the step they belong to (storing there too made ptxas wait for S^T and dP^T
    // before reading the dQ registers: 27% slower at D = 64).
    auto dq_stage_slot = [&](int visit, int buffer) {
      const int slot = kdQAlternate ? visit / 2 % 2 : buffer;
      return smem.dq_stage + (slot * kMmaWGs + wg) * kdQTileElems;
    };
    auto store_dq_stage = [&](int visit, int buffer) {
      // Thread 0 waits for the previous bulk read in add_dq_stage; a dS barrier this warpgroup
      // waits at between that and its next stores into the same buffer (every step's; with
      // kdQAlternate that of its next dQ step) orders the two.
      float* stage = dq_stage_slot(visit, buffer);
#pragma unroll
      for (int i = 0; i < size(tdQrdQ); i += 2) {
        *reinterpret_cast<float2*>(stage + (i / 2) * 256 + 2 * (mma_thread % 128)) =
            make_float2(tdQrdQ(i), tdQrdQ(i + 1));
      }
    };
    auto add_dq_stage = [&](int head, int row0, int visit, int buffer) {
      cutlass::arch::fence_view_async_shared();  // the stores, visible to the bulk copy
      named_barrier_sync(kdQStagedBarrier + wg, 128);
      if (mma_thread % 128 == 0) {
        const int region = kdQWholeRows ? 0 : wg;
        float* dq_tile = p.dq_accum + ((int64_t{batch} * p.heads + head) * p.q_pad + row0) * kHeadDim;
        bulk_reduce_add(dq_tile + region * kdQTileElems, dq_stage_slot(visit, buffer), kdQTileElems * sizeof(float));
        tma_store_arrive();   // commit
        tma_store_wait<1>();  // the previous tile's stage buffer has been read
      }
    };
    int visited = 0;  // the steps not skipped: dS and the dQ stage alternate over them
    struct PendingdQ {
      int head, row0, visit;  // head < 0: none
    };
    PendingdQ pending{-1, 0, 0};  // this warpgroup's dQ stored, not yet added
    auto add_pending = [&] {
      if constexpr (!kdQPass) {
        if (pending.head >= 0) {
          add_dq_stage(pending.head, pending.row0, pending.visit, pending.visit % 2);
          pending.head = -1;
        }
      }
    };
    TileVisit next{0, attn::kTileVisible, 0};
    if constexpr (kMasked) {
      if (steps > 0) {
        next = read_visit(smem.first_visit);  // kv_full has been waited for
      }
    }
    // A float mask's values of a mixed step added to its scores, which go to natural units (the
    // exponent below then takes them with unit 1); its -inf elements are masked after, by
    // mask_bits (NaN behind them does not leak). Loads as in mask_bits: clamped, unconditional;
    // mask_bits read the same elements a step before, so these mostly hit L1 (reading them once,
    // here, with the -inf test folded in, measured 1.2 ms slower at D = 128: notes).
    auto add_bias = [&](int step) {
      const int row0 = m_block_of(step) * kBlockM;
      const int last_row = p.q_len - 1 - row0;
      p.mask.with_values([&](const auto* mask) {
        mask += p.mask.offset(batch, head_of(step), row0, key0);
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          const int key = key_base + acc_row(i), row = query_base + acc_col(i);
          const float bias =
              attn::to_float(mask[int64_t{row < last_row ? row : last_row} * p.mask.stride_q +
                                  int64_t{key < keys_in_tile ? key : keys_in_tile - 1} * p.mask.stride_kv]);
          tSrS(i) = fmaf(tSrS(i), p.score.natural_scale, bias);
        }
      });
    };
    uint32_t keep = mask_bits(next);
    uint8_t step_class = next.tile_class;
    // A step's class arrives with the Q load of the step before; its mask bits (a mixed step's
    // gather) are found at the end of the step before, once the products are done: gathering
    // during them spilled the dK / dV accumulators at D = 128.
    for (int step = next.position; step < steps;
         step = next.position, keep = mask_bits(next), step_class = next.tile_class) {
      const int head = head_of(step);
      const int m_block = m_block_of(step);
      const int visit = visited++;
      const int buffer = visit % 2;
      const bool dq_here = !kdQAlternate || wg == buffer;  // this warpgroup multiplies this step's dQ
      const int row0 = m_block * kBlockM;

      pipe_q.consumer_wait(read_q);
      next = visit_after_load(step);
      wgmma_batch<true>(mma_sdp, tSrK, tSrQ(_, _, _, read_q.index()), tSrS);
      pipe_do.consumer_wait(read_do);
      wgmma_batch<true>(mma_sdp, tSrV, tSrdO(_, _, _, read_do.index()), tdPrdP);
      add_pending();             // the last step's dQ, while S^T and dP^T run
      warpgroup_wait<1>();       // S^T done, dP^T may still run
      if constexpr (kSoftcap) {  // the score rule before the masks (a masked score is -inf, not -softcap)
        p.score.softcap_all<decltype(size(tSrS))::value>(raw_pointer_cast(tSrS.data()));
      }
      // A mixed step of a float mask: the bias, after the softcap, before the masks.
      const bool bias_step = kBias && step_class == attn::kTileMixed;
      if (bias_step) {
        add_bias(step);
      }

      // Masked elements: keys past kv_len, and under causality key > row + shift. limit is the
      // largest visible (key - row) offset within the tile, clamped to int range.
      const int64_t diagonal = int64_t{row0} + p.causal_shift - key0;
      const bool causal_mask = p.causal && diagonal < kBlockN - 1;
      if (keys_in_tile < kBlockN || causal_mask) {
        const int limit = static_cast<int>(std::max<int64_t>(std::min<int64_t>(diagonal, kBlockN), -kBlockM - 1));
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          const int key = key_base + acc_row(i), row = query_base + acc_col(i);
          if (key >= keys_in_tile || (causal_mask && key - row > limit)) {
            tSrS(i) = -INFINITY;
          }
        }
      }
      if (kMasked && ~keep != 0) {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          if (!((keep >> i) & 1u)) {
            tSrS(i) = -INFINITY;
          }
        }
      }
      const float* row_shift = smem.row_shift[read_q.index()];
      if constexpr (kBias) {
        // A float mask: natural units, the shift subtracted before the change of base, then
        // row_lo (BwdParams::row_lo; a row of huge biases cancels exactly and keeps lse_lo).
        const float* row_lo = smem.row_lo[read_q.index()];
        const float unit = bias_step ? 1.0f : p.score.natural_scale;
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          const int c = query_base + acc_col(i);
          tSrS(i) = exp2_approx(fmaf(fmaf(tSrS(i), unit, -row_shift[c]), attn::kLog2e, -row_lo[c]));
        }
      } else {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          tSrS(i) = exp2_approx(fmaf(tSrS(i), kSoftcap ? 1.0f : p.score.scale, -row_shift[query_base + acc_col(i)]));
        }
      }
      convert_fragment<Element>(tSrS, tdVrP);
      if constexpr (kSharedKeys) {
        // P^T to shared memory (buffer 2 + buffer): each warpgroup's query rows, both read it.
        copy(r2s_ds, tPrP, tdSsdS(_, _, _, 2 + buffer));
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(kPBarrier, kMmaThreads);
        wgmma_batch<false>(mma_dkv, shared_a(_, _, _, 2 + buffer), tdVrdO(_, _, _, read_do.index()), tdVrdV);
      } else {
        wgmma_batch<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, read_do.index()), tdVrdV);
      }
      warpgroup_wait<1>();  // dP^T done, dV may still run

      const float* delta = smem.delta[read_do.index()];
      if constexpr (kSoftcap) {
        // d score / d dot = scale (1 - t^2), t = score / softcap_post, the score recovered from
        // p: log2 p + row_shift (p = 0 contributes nothing, whatever its score).
        const float inv_cap = 1.0f / p.score.softcap_post;
#pragma unroll
        for (int i = 0; i < size(tdPrdP); ++i) {
          const float prob = tSrS(i), shift = row_shift[query_base + acc_col(i)];
          const float t = (log2_approx(prob) + shift) * inv_cap;
          const float dscore = prob > 0.0f ? p.score.natural_scale * (1.0f - t * t) : 0.0f;
          tdPrdP(i) = dscore * prob * (tdPrdP(i) - delta[query_base + acc_col(i)]);
        }
      } else if (kBias && p.grad_mask != nullptr) {
        // The float mask's gradient p (dP - delta) of this step's elements inside [q_len, kv_len):
        // stored, or added to the other batches' (a mask shared by the batch).
        const int row0 = m_block_of(step) * kBlockM;
        const int last_row = p.q_len - 1 - row0;
        const bool add = p.grad_mask_sums_batch;
        float* grad = p.grad_mask + ((int64_t{add ? 0 : batch} * p.heads + head) * p.q_len + row0) * p.kv_len + key0;
#pragma unroll
        for (int i = 0; i < size(tdPrdP); ++i) {
          const int key = key_base + acc_row(i), row = query_base + acc_col(i);
          const float ds = tSrS(i) * (tdPrdP(i) - delta[query_base + acc_col(i)]);
          if (key < keys_in_tile && row <= last_row) {
            float* slot = grad + int64_t{row} * p.kv_len + key;
            if (add) {
              atomicAdd(slot, ds);
            } else {
              *slot = ds;
            }
          }
          tdPrdP(i) = p.score.natural_scale * ds;
        }
      } else {
#pragma unroll
        for (int i = 0; i < size(tdPrdP); ++i) {
          tdPrdP(i) = p.score.natural_scale * tSrS(i) * (tdPrdP(i) - delta[query_base + acc_col(i)]);
        }
      }
      convert_fragment<Element>(tdPrdP, tdKrdS);

      // dS^T to shared memory as dS (query rows contiguous), for the dQ product.
      copy(r2s_ds, tdSrdS, tdSsdS(_, _, _, buffer));
      cutlass::arch::fence_view_async_shared();  // the stores, visible to wgmma
      if constexpr (kdQAlternate) {
        // Only the warpgroup that multiplies dQ waits for the other's dS; the other arrives
        // and goes on. Barrier ids alternate with the step: the arriving warpgroup multiplies
        // the next step's dQ, so its wait there (the other id) needs this step's dQ warpgroup
        // to have finished this step, dQ product included; that orders both the dS buffer's
        // reuse two steps on and a fast warpgroup's next arrival on this id.
        if (dq_here) {
          named_barrier_sync(kDsBarrier + buffer, kMmaThreads);
        } else {
          named_barrier_arrive(kDsBarrier + buffer, kMmaThreads);
        }
      } else {
        named_barrier_sync(kDsBarrier, kMmaThreads);
      }
      if (!kdQPass && dq_here) {
        wgmma_batch<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrKt, tdQrdQ);
      }
      // dK after dQ: dQ's staging below runs while the tensor cores do dK.
      if constexpr (kSharedKeys) {
        wgmma_batch<false>(mma_dkv, shared_a(_, _, _, buffer), tdKrQ(_, _, _, read_q.index()), tdKrdK);
      } else {
        wgmma_batch<false>(mma_dkv, tdKrdS, tdKrQ(_, _, _, read_q.index()), tdKrdK);
      }
      warpgroup_wait<1>();              // dV and dQ done, dK may still run
      warpgroup_fence_operand(tdQrdQ);  // dQ's registers are read below, not before the wait
      pipe_do.consumer_release(read_do);
      ++read_do;
      if (!kdQPass && dq_here) {
        store_dq_stage(visit, buffer);
        pending = PendingdQ{head, row0, visit};  // added by add_pending, next step or after the last
      }
      warpgroup_wait<0>();  // dK done: its Q can go
      pipe_q.consumer_release(read_q);
      ++read_q;
    }
    add_pending();
    if constexpr (!kdQPass) {
      if (mma_thread % 128 == 0 && steps > 0) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // every reduce-add done
      }
    }

    // dK and dV of the tile's keys (zero when no query sees them), at per-thread bases plus
    // constant offsets.
    Element* dk = p.grad_k + batch * p.dk_sb + kv_head * p.dk_sh + int64_t{key0 + key_base} * p.dk_si + dkv_col_base;
    Element* dv = p.grad_v + batch * p.dv_sb + kv_head * p.dv_sh + int64_t{key0 + key_base} * p.dv_si + dkv_col_base;
#pragma unroll
    for (int i = 0; i < size(tdKrdK); i += 2) {
      if (key_base + acc_row(i) < keys_in_tile) {
        cutlass::AlignedArray<Element, 2> pair;  // one 4-byte store
        pair[0] = Element(tdKrdK(i));
        pair[1] = Element(tdKrdK(i + 1));
        *reinterpret_cast<cutlass::AlignedArray<Element, 2>*>(dk + acc_row(i) * p.dk_si + acc_col(i)) = pair;
        pair[0] = Element(tdVrdV(i));
        pair[1] = Element(tdVrdV(i + 1));
        *reinterpret_cast<cutlass::AlignedArray<Element, 2>*>(dv + acc_row(i) * p.dv_si + acc_col(i)) = pair;
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1) bwd_kernel(const __grid_constant__ typename Kernel::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  auto& smem = *reinterpret_cast<typename Kernel::SharedStorage*>(smem_raw);
  using Pipeline = typename Kernel::Pipeline;
  const int warp = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 32, 0);
  const bool producer = warp / 4 == 0;
  const typename Kernel::Block block = Kernel::block_coords(p);
  const int m_begin = Kernel::first_m_block(p, block.n_block);
  const int steps = p.group * (p.m_blocks - m_begin);

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do_clean.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    smem.kv_full.init(1);
  }
  // dO and delta: the same byte count as Q and row_shift.
  const auto pipe_params = tma_pipeline_params<Pipeline>(Kernel::kBytesQ, producer, Kernel::kMmaThreads);
  typename Pipeline::Params pipe_q_params = pipe_params;
  if constexpr (Kernel::kBias) {
    pipe_q_params.transaction_bytes += Kernel::kBytesRows;  // row_lo with Q
  }
  // The constructors initialise the barriers (warp 0) and fence the initialisation.
  Pipeline pipe_q(smem.pipe_q, pipe_q_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  Pipeline pipe_do(smem.pipe_do, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  __syncthreads();

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegs>();
    if (threadIdx.x == 0 && steps > 0) {
      Kernel::produce(p, block, smem, pipe_q, pipe_do, steps, m_begin);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegs>();
    Kernel::consume(p, block, smem, pipe_q, pipe_do, steps, m_begin);
  }
#endif
}

// dq_accum (float32, kBlockM-row tiles in Kernel::dq_tile_offset order) rounded into grad_q
// through its strides, 8 consecutive elements of a row per thread: dq_tile_offset keeps such a
// run contiguous and 32-byte aligned (two 16-byte loads); one 16-byte store when grad_q's rows
// are 16-byte aligned (vec16), else four 4-byte ones.
template <class Kernel>
__global__ void __launch_bounds__(256)
    dq_convert_kernel(const float* __restrict__ dq_accum, typename Kernel::Element* grad_q, int64_t sb, int64_t sh,
                      int64_t si, int heads, int q_len, int q_pad, int64_t runs, bool vec16) {
  using Element = typename Kernel::Element;
  constexpr int kHeadDim = Kernel::kHeadDim, kBlockM = Kernel::kBlockM;
  constexpr int kRunsPerRow = kHeadDim / 8;
  static_assert(kHeadDim % 8 == 0);
  for (int64_t run = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; run < runs;
       run += int64_t{gridDim.x} * blockDim.x) {
    const int col = static_cast<int>(run % kRunsPerRow) * 8;
    const int64_t row = run / kRunsPerRow;
    const int64_t i = row % q_len, bh = row / q_len;
    const int64_t h = bh % heads, b = bh / heads;
    const int64_t tile = bh * q_pad + i / kBlockM * kBlockM;
    const float* src = dq_accum + tile * kHeadDim + Kernel::dq_tile_offset(static_cast<int>(i % kBlockM), col);
    const float4 lo = *reinterpret_cast<const float4*>(src);
    const float4 hi = *reinterpret_cast<const float4*>(src + 4);
    cutlass::AlignedArray<Element, 8> out;
    out[0] = Element(lo.x), out[1] = Element(lo.y), out[2] = Element(lo.z), out[3] = Element(lo.w);
    out[4] = Element(hi.x), out[5] = Element(hi.y), out[6] = Element(hi.z), out[7] = Element(hi.w);
    Element* dst = grad_q + b * sb + h * sh + i * si + col;
    if (vec16) {
      *reinterpret_cast<cutlass::AlignedArray<Element, 8>*>(dst) = out;
    } else {
#pragma unroll
      for (int k = 0; k < 8; k += 2) {
        cutlass::AlignedArray<Element, 2> pair;
        pair[0] = out[k], pair[1] = out[k + 1];
        *reinterpret_cast<cutlass::AlignedArray<Element, 2>*>(dst + k) = pair;
      }
    }
  }
}

}  // namespace detail

// Host: builds the TMA descriptors and runs the kernel and the dQ conversion (dq_accum arrives
// zeroed).
template <typename T, class Config, bool kMasked, bool kSoftcap, bool kBias = false>
cudaError_t launch_bwd_variant(const BwdParams& a, cudaStream_t stream) {
  using namespace cute;
  using Element = typename CutlassElement<T>::type;
  using Kernel = detail::Bwd<Element, Config, kMasked, kSoftcap, kBias>;
  constexpr int D = Config::kHeadDim;
  if (a.q_len == 0 || a.kv_len == 0 || a.batch == 0 || a.heads == 0) {
    return cudaErrorInvalidValue;  // the caller handles empty inputs
  }
  const int n_blocks = (a.kv_len + Config::kBlockN - 1) / Config::kBlockN;
  if (a.kv_heads > 65535 || a.batch > 65535) {
    return cudaErrorInvalidValue;
  }
  typename Kernel::Params p;
  detail::set_bwd_inputs<Element, D, Config::kBlockM, Config::kBlockN>(p, a, take<0, 2>(typename Kernel::SmemLayoutQ{}),
                                                                       typename Kernel::SmemLayoutK{});
  p.dq_accum = a.dq_accum;
  p.grad_k = static_cast<Element*>(a.grad_k);
  p.grad_v = static_cast<Element*>(a.grad_v);
  p.dk_sb = a.dk_sb, p.dk_sh = a.dk_sh, p.dk_si = a.dk_si;
  p.dv_sb = a.dv_sb, p.dv_sh = a.dv_sh, p.dv_si = a.dv_si;
  p.mask_tiles = a.mask_tiles;
  p.grad_mask = a.grad_mask;
  p.grad_mask_sums_batch = a.grad_mask_sums_batch;
  p.batch_inner = a.batch_inner;
  p.head_group = a.head_group > 0 ? a.head_group : head_group_for(n_blocks, a.kv_heads * a.batch, a.resident_ctas);

  auto kernel = &detail::bwd_kernel<Kernel>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) {
    return err;
  }
  // Key tile 0 first: under causality it sees the most query tiles.
  kernel<<<dim3(n_blocks, a.kv_heads, a.batch), Kernel::kThreads, Kernel::kSmemBytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) {
    return err;
  }
  if constexpr (Kernel::kdQPass) {
    return launch_bwd_dq_pass<T, D, kMasked, kSoftcap, kBias>(a, stream);
  } else {
    const int64_t runs = int64_t{a.batch} * a.heads * a.q_len * (D / 8);
    const int blocks = static_cast<int>(std::min<int64_t>((runs + 255) / 256, 65536));
    auto aligned16 = [](int64_t x) { return x % 8 == 0; };  // a stride in 2-byte elements
    const bool vec16 = reinterpret_cast<uintptr_t>(a.grad_q) % 16 == 0 && aligned16(a.dq_sb) && aligned16(a.dq_sh) &&
                       aligned16(a.dq_si);
    detail::dq_convert_kernel<Kernel><<<blocks, 256, 0, stream>>>(
        a.dq_accum, static_cast<Element*>(a.grad_q), a.dq_sb, a.dq_sh, a.dq_si, a.heads, a.q_len, p.q_pad, runs, vec16);
    return cudaGetLastError();
  }
}

// The variant with the mask's code when a.mask_tiles holds a summary (a float mask's: kBias), with
// the softcap's when there is one (cudaErrorInvalidValue for a float mask with a softcap, and for
// a tile shape that does not match the summary's tiles: only the standalone check has those).
template <typename T, class Config, bool kSoftcap>
cudaError_t launch_bwd_masking(const BwdParams& a, cudaStream_t stream) {
  if (a.mask_tiles.ptr == nullptr) {
    return launch_bwd_variant<T, Config, false, kSoftcap>(a, stream);
  }
  if constexpr (Config::kBlockM == kBwdMaskTileRows && Config::kBlockN == bwd_key_tile(Config::kHeadDim)) {
    if (!a.mask.is_bias()) {
      return launch_bwd_variant<T, Config, true, kSoftcap>(a, stream);
    }
    if constexpr (!kSoftcap) {
      return launch_bwd_variant<T, Config, true, false, true>(a, stream);
    }
  }
  return cudaErrorInvalidValue;
}
template <typename T, class Config>
cudaError_t launch_bwd_config(const BwdParams& a, cudaStream_t stream) {
  return a.score.softcap_post > 0.0f ? launch_bwd_masking<T, Config, true>(a, stream)
                                     : launch_bwd_masking<T, Config, false>(a, stream);
}

template <typename T, int kHeadDim>
cudaError_t launch_attention_bwd_sm90(const BwdParams& params, cudaStream_t stream) {
  using Config = typename DefaultBwdConfig<kHeadDim>::type;
  return launch_bwd_config<T, Config>(params, stream);
}

}  // namespace safeattn::cuda::hopper
