// The dQ pass of the sm_90a backward, where dQ is not summed inside the dK/dV kernel (bwd_dq_pass:
// past head dim 128, and deterministic calls). Launched by hopper/bwd_kernel.cuh's launcher after
// the dK/dV kernel; built for sm_90a only. Semantics: ops/attention.h; what it is given:
// hopper/bwd_params.h.
//
// One CTA per (kDqTileRows query rows, query head, batch) = 1 producer warpgroup + 2 consumer
// warpgroups of 64 rows each, the forward's layout (hopper/fwd_kernel.cuh): the key tiles are
// walked from the last visible one down, as the forward walks them, and for each
//   S = Q K^T, dP = dO V^T                  (wgmma, both operands in shared memory)
//   p = exp2(S scale log2(e) - row_shift), dS = scale p (dP - delta)   (as the dK/dV kernel)
//   dQ += dS K                              (wgmma, dS from registers, K^T a view of K)
// and dQ is rounded and stored once at the end: no dq_accum, no atomics, so it is deterministic.
// Its tiles are the forward's (hopper/tile_traits.cuh, QueryTileTraits: S = Q K^T and dP = dO V^T
// as the forward's S, dQ += dS K as its O += P V), and so is its mask code per element
// (hopper/mask.cuh, MaskPolicy::QueryMajor: the same 64 x kBlockN score fragment per warpgroup) and
// the walk over a summary of this kernel's tiles (BwdSm90Params::dq_mask_tiles).
//   shared memory  Q and dO (kDqTileRows x D each, loaded once with the rows' row_shift, delta and
//                  row_lo), K in two stages, V in one: at D = 256 64 + 64 + 64 + 32 KB, at
//                  D = 128 32 + 32 + 32 + 16. V's one stage is refilled once dP is done and is
//                  needed again only by the next dP, after that tile's S and this one's dQ
//                  product; K is read by both S and dQ.
//   registers      per consumer thread: dQ D / 2, S and dP kBlockN / 2 each.
// Numerics as in the dK/dV kernel: masked elements get s = -inf so p = 0; a row with no visible
// key has row_shift +inf (every p 0) and gets dQ = 0; rows past q_len are zero-filled by TMA,
// have row_shift +inf and delta 0, and are not written.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "ops/cuda/hopper/bwd_params.h"
#include "ops/cuda/hopper/epilogue.cuh"
#include "ops/cuda/hopper/mask.cuh"
#include "ops/cuda/hopper/pipeline.cuh"
#include "ops/cuda/hopper/softmax.cuh"
#include "ops/cuda/hopper/tile_scheduler.cuh"
#include "ops/cuda/hopper/tile_traits.cuh"

namespace safeattn::cuda::hopper {
namespace detail {

using namespace cute;

// The parameters both backward kernels (the dK/dV kernel, hopper/bwd_kernel.cuh, and the dQ pass
// below) read, each adding what it writes.
template <class TmaQ, class TmaKV>
struct BwdInputParams {
  TmaQ tma_q, tma_do;
  TmaQ tma_do_clean;          // grad_out_clean, or grad_out again
  const int* grad_out_dirty;  // null, or nonzero: dO is read through tma_do_clean
  TmaKV tma_k, tma_v;
  TmaShape shape_q, shape_k;
  const float* row_shift;  // [B, Hq, q_pad]
  const float* delta;      // [B, Hq, q_pad]
  const float* row_lo;     // [B, Hq, q_pad]: BwdSm90Params::row_lo (kBias only)
  int heads, group, q_len, q_pad, kv_len, m_blocks;
  attn::ScoreRule score;  // log2 units; a softcap when score.softcap_post > 0
  bool causal;
  int64_t causal_shift;
  attn::MaskView mask;               // bool, float (a bias), or none
  attn::TileSummaryView mask_tiles;  // of the kernel's tiles
  attn::KeyRangeView key_ranges;     // null, or one interval of keys per query row
  int head_group;                    // at least 1

  __device__ __forceinline__ void prefetch_descriptors() const {
    cute::prefetch_tma_descriptor(tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_do_clean.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_v.get_tma_descriptor());
  }
};

// What both backward kernels (the dK/dV kernel, hopper/bwd_kernel.cuh, and the dQ pass below)
// read of BwdSm90Params, into their Params (fields of the same names): TMA descriptors of Q and dO
// (and dO's clean copy) as kBlockM x D tiles laid out as smem_q, of K and V as kBlockN x D tiles
// laid out as smem_kv; the rows pre-pass's arrays; sizes, score rule, causality, mask and key ranges.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, class KernelParams, class SmemQ, class SmemKV>
void set_bwd_inputs(KernelParams& p, const BwdSm90Params& a, const SmemQ& smem_q, const SmemKV& smem_kv) {
  p.shape_q = make_shape(int32_t{a.q_len}, int32_t{kHeadDim}, int32_t{a.heads}, int32_t{a.batch});
  p.shape_k = make_shape(int32_t{a.kv_len}, int32_t{kHeadDim}, int32_t{a.kv_heads}, int32_t{a.batch});
  auto q_view = [&](const void* ptr, int64_t sb, int64_t sh, int64_t si) {
    return tma_view<Element>(ptr, a.batch, a.heads, a.q_len, kHeadDim, sb, sh, si);
  };
  auto kv_view = [&](const void* ptr, int64_t sb, int64_t sh, int64_t si) {
    return tma_view<Element>(ptr, a.batch, a.kv_heads, a.kv_len, kHeadDim, sb, sh, si);
  };
  const auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
  const auto tile_k = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, q_view(a.q, a.q_sb, a.q_sh, a.q_si), smem_q, tile_q, _1{});
  p.tma_do = make_tma_copy(SM90_TMA_LOAD{}, q_view(a.grad_out, a.do_sb, a.do_sh, a.do_si), smem_q, tile_q, _1{});
  p.grad_out_dirty = a.grad_out_dirty;
  p.tma_do_clean = a.grad_out_clean == nullptr
                       ? p.tma_do
                       : make_tma_copy(SM90_TMA_LOAD{},
                                       q_view(a.grad_out_clean, int64_t{a.heads} * a.q_len * kHeadDim,
                                              int64_t{a.q_len} * kHeadDim, kHeadDim),
                                       smem_q, tile_q, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, kv_view(a.k, a.k_sb, a.k_sh, a.k_si), smem_kv, tile_k, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, kv_view(a.v, a.v_sb, a.v_sh, a.v_si), smem_kv, tile_k, _1{});
  p.row_shift = a.row_shift;
  p.delta = a.delta;
  p.row_lo = a.row_lo;
  p.heads = a.heads;
  p.group = a.heads / a.kv_heads;
  p.q_len = a.q_len;
  p.q_pad = (a.q_len + kBwdRowPad - 1) / kBwdRowPad * kBwdRowPad;
  p.kv_len = a.kv_len;
  p.m_blocks = (a.q_len + kBlockM - 1) / kBlockM;
  p.score = a.score;
  p.causal = a.causal;
  p.causal_shift = a.causal_shift;
  p.mask = a.mask;
  p.key_ranges = a.key_ranges;
}

template <typename Element_, int kHeadDim_, bool kMasked_ = false, bool kSoftcap_ = false, bool kBias_ = false>
struct BwdDq {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // The dK/dV kernel's variants (mask, softcap, bias: hopper/bwd_kernel.cuh).
  using Mask = MaskPolicy<kMasked_, kBias_>;
  static constexpr bool kMasked = Mask::kMasked;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kBias = Mask::kBias;
  static_assert(!kBias || !kSoftcap, "a bias is not taken with a softcap");
  static constexpr int kBlockM = kDqTileRows;
  static constexpr int kBlockN = dq_key_tile(kHeadDim);
  static constexpr int kMmaWGs = 2;
  static_assert(kBlockM == 64 * kMmaWGs);
  static constexpr int kMmaThreads = 128 * kMmaWGs;
  static constexpr int kThreads = kMmaThreads + 128;
  static constexpr int kKStages = 2;
  static constexpr int kVStages = 1;
  // As the dK/dV kernel: 168 registers per thread at launch, 24 * 128 + 240 * 256 of them.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kMmaThreads <= 168 * kThreads);

  // The forward's tiles of this shape (128 rows, kBlockN keys, two consumer warpgroups).
  using Traits = QueryTileTraits<Element, kHeadDim, kBlockN, kMmaWGs>;
  static_assert(Traits::kBlockM == kBlockM);
  using MaskRows = typename Mask::template QueryMajor<kBlockN>;
  using Scheduler = QueryTileGrid<kBlockM, kBlockN, kMasked>;
  // S = Q K^T and dP = dO V^T: the forward's S (M = query rows, N = keys, K = head dim, K-major).
  using TiledMmaS = typename Traits::TiledMmaQK;
  // dQ += dS K: the forward's O += P V, dS from registers as P, K^T (N = head dim, K = keys, head
  // dim contiguous) as V^T.
  using TiledMmadQ = typename Traits::TiledMmaPV;
  using SmemLayoutQ = typename Traits::SmemLayoutQ;
  using SmemLayoutK = typename Traits::template SmemLayoutK<kKStages>;
  using SmemLayoutV = typename Traits::template SmemLayoutK<kVStages>;
  using SmemLayoutKt = typename Traits::template SmemLayoutKt<kKStages>;

  using TmaQ = typename Traits::TmaQ;
  using TmaKV = typename Traits::template TmaK<kKStages>;
  static constexpr uint32_t kBytesRows = kBlockM * sizeof(float);
  // Q, dO, row_shift, delta (and row_lo with a bias) on one mbarrier.
  static constexpr uint32_t kBytesQdO = 2 * kBlockM * kHeadDim * sizeof(Element) + (kBias ? 3 : 2) * kBytesRows;
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  // K load j carries the visit after its key tile in slot j % kVisitSlots (as in the forward).
  static constexpr int kVisitSlots = kKStages + 1;
  using PipelineK = cutlass::PipelineTmaAsync<kKStages>;
  using PipelineV = cutlass::PipelineTmaAsync<kVStages>;
  // Q and dO land once, with the rows' row_shift, delta (and row_lo) on qdo_full.
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> d_o;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>> v;
    alignas(16) float row_shift[kBlockM];
    alignas(16) float delta[kBlockM];
    alignas(16) float row_lo[kBias ? kBlockM : 4];
    typename PipelineK::SharedStorage pipe_k;
    typename PipelineV::SharedStorage pipe_v;
    cutlass::arch::ClusterTransactionBarrier qdo_full;
    TileVisit first_visit;              // published with Q and dO
    TileVisit next_visit[kVisitSlots];  // kMasked: per K load, the visit after it
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an H100 CTA can have");

  struct Params : BwdInputParams<TmaQ, TmaKV> {  // mask_tiles: BwdSm90Params::dq_mask_tiles
    Element* grad_q;
    int64_t dq_sb, dq_sh, dq_si;
  };

  using Tile = QueryTile;
  static __device__ __forceinline__ TileVisit visit_after(const Params& p, const Tile& t, int n, int lowest) {
    return Mask::visit_after(p, t.batch, t.head, t.m_block, n, lowest);
  }

  // ---- producer ------------------------------------------------------------------------------

  static __device__ void produce(const Params& p, const Tile& t, SharedStorage& smem, PipelineK& pipe_k,
                                 PipelineV& pipe_v) {
    const int kv_head = t.head / p.group;
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutV{});
    // dO without its empty rows' non-finite values (bwd_params.h): one flag read per CTA.
    const TmaQ& tma_do = p.grad_out_dirty != nullptr && *p.grad_out_dirty != 0 ? p.tma_do_clean : p.tma_do;
    Tensor gQ = local_tile(p.tma_q.get_tma_tensor(p.shape_q)(_, _, t.head, t.batch),
                           Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(t.m_block, _0{}));
    Tensor gdO = local_tile(tma_do.get_tma_tensor(p.shape_q)(_, _, t.head, t.batch),
                            Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(t.m_block, _0{}));
    Tensor gK = local_tile(p.tma_k.get_tma_tensor(p.shape_k)(_, _, kv_head, t.batch),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, D, n)
    Tensor gV = local_tile(p.tma_v.get_tma_tensor(p.shape_k)(_, _, kv_head, t.batch),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, D, n)
    auto cta_q = p.tma_q.get_slice(_0{});
    auto cta_do = tma_do.get_slice(_0{});
    auto cta_k = p.tma_k.get_slice(_0{});
    auto cta_v = p.tma_v.get_slice(_0{});
    Tensor tKgK = group_modes<0, 3>(cta_k.partition_S(gK));  // (TMA, n)
    Tensor tKsK = group_modes<0, 3>(cta_k.partition_D(sK));  // (TMA, stage)
    Tensor tVgV = group_modes<0, 3>(cta_v.partition_S(gV));  // (TMA, n)
    Tensor tVsV = group_modes<0, 3>(cta_v.partition_D(sV));  // (TMA, stage)

    const int lowest = kMasked ? p.mask_tiles.first_visible_at(t.batch, t.head, t.m_block) : 0;
    TileVisit visit = visit_after(p, t, t.n_blocks, lowest);
    write_visit(smem.first_visit, visit);  // published by qdo_full's arrive
    auto& qdo_full = smem.qdo_full;
    auto* qdo_bar = reinterpret_cast<uint64_t*>(&qdo_full);
    qdo_full.arrive_and_expect_tx(kBytesQdO);
    copy(p.tma_q.with(*qdo_bar, 0, TMA::CacheHintSm90::EVICT_FIRST), cta_q.partition_S(gQ), cta_q.partition_D(sQ));
    copy(tma_do.with(*qdo_bar, 0, TMA::CacheHintSm90::EVICT_FIRST), cta_do.partition_S(gdO), cta_do.partition_D(sdO));
    const int64_t row_offset = (int64_t{t.batch} * p.heads + t.head) * p.q_pad + int64_t{t.m_block} * kBlockM;
    SM90_BULK_COPY_G2S::copy(p.row_shift + row_offset, qdo_bar, smem.row_shift, kBytesRows);
    SM90_BULK_COPY_G2S::copy(p.delta + row_offset, qdo_bar, smem.delta, kBytesRows);
    if constexpr (kBias) {
      SM90_BULK_COPY_G2S::copy(p.row_lo + row_offset, qdo_bar, smem.row_lo, kBytesRows);
    }

    auto write_k = cutlass::make_producer_start_state<PipelineK>();
    auto write_v = cutlass::make_producer_start_state<PipelineV>();
    // K(n), V(n), K(m), V(m), ...: V's one stage is free once the tile's dP is done, K's second
    // once the tile before's dQ product is.
    for (int k_loads = 0; visit.position >= 0; ++k_loads) {
      const TileVisit after = visit_after(p, t, visit.position, lowest);
      if constexpr (kMasked) {
        write_visit(smem.next_visit[k_loads % kVisitSlots], after);
      }
      pipe_k.producer_acquire(write_k);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(write_k), 0, TMA::CacheHintSm90::EVICT_LAST),
           tKgK(_, visit.position), tKsK(_, write_k.index()));
      ++write_k;
      pipe_v.producer_acquire(write_v);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(write_v), 0, TMA::CacheHintSm90::EVICT_LAST),
           tVgV(_, visit.position), tVsV(_, write_v.index()));
      ++write_v;
      visit = after;
    }
  }

  // ---- consumers -----------------------------------------------------------------------------

  // One consumer thread's rows: row_in_tile + 8 r (r = 0, 1) of the tile's kBlockM; accumulator
  // element i is row (i / 2) % 2, column 8 (i / 4) + 2 (lane % 4) + i % 2 (of the key tile for S,
  // of the head dim for dQ). last_key: the last key each row sees, in [-1, kv_len - 1].
  struct ThreadRows {
    int row_in_tile;
    int64_t tile_row0, row0;
    int last_key[2];
  };

  // The scores of a visited key tile turned into p: the score rule, the bias, the masks (as the
  // forward's), then p = exp2(s scale log2(e) - row_shift) (with a bias: natural units, the shift
  // before the change of base, then row_lo).
  template <class FragS>
  static __device__ __forceinline__ void probabilities(FragS& s, const Params& p, const Tile& t, const ThreadRows& rows,
                                                       const TileVisit& visit, uint64_t keep, const float (&shift)[2],
                                                       const float (&lo)[2], int lane) {
    const int n = visit.position;
    if constexpr (kSoftcap) {
      p.score.softcap_all<decltype(size(s))::value>(raw_pointer_cast(s.data()));
    }
    if constexpr (kBias) {
#pragma unroll
      for (int i = 0; i < size(s); ++i) {
        s(i) *= p.score.natural_scale;
      }
      if (visit.tile_class == attn::kTileMixed) {
        MaskRows::add_bias(s, p, t, n, rows.row0, lane);
      }
    }
    MaskRows::mask_scores(s, p, n, keep, rows.tile_row0, rows.last_key, lane);
#pragma unroll
    for (int i = 0; i < size(s); ++i) {
      const int r = (i / 2) % 2;
      if constexpr (kBias) {
        s(i) = exp2_approx(fmaf(s(i) - shift[r], attn::kLog2e, -lo[r]));
      } else {
        s(i) = exp2_approx(fmaf(s(i), kSoftcap ? 1.0f : p.score.scale, -shift[r]));
      }
    }
  }

  // dS = scale p (dP - delta) over dP's registers; with a softcap, d score / d dot =
  // scale (1 - t^2), t = score / softcap_post, the score recovered from p: log2 p + row_shift
  // (p = 0 contributes nothing, whatever its score).
  template <class FragS>
  static __device__ __forceinline__ void scores_gradient(FragS& dp, const FragS& prob, const Params& p,
                                                         const float (&shift)[2], const float (&delta)[2]) {
    if constexpr (kSoftcap) {
      const float inv_cap = 1.0f / p.score.softcap_post;
#pragma unroll
      for (int i = 0; i < size(dp); ++i) {
        const int r = (i / 2) % 2;
        const float tanh_s = (log2_approx(prob(i)) + shift[r]) * inv_cap;
        const float dscore = prob(i) > 0.0f ? p.score.natural_scale * (1.0f - tanh_s * tanh_s) : 0.0f;
        dp(i) = dscore * prob(i) * (dp(i) - delta[r]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < size(dp); ++i) {
        dp(i) = p.score.natural_scale * prob(i) * (dp(i) - delta[(i / 2) % 2]);
      }
    }
  }

  static __device__ void consume(const Params& p, const Tile& t, SharedStorage& smem, PipelineK& pipe_k,
                                 PipelineV& pipe_v) {
    const int mma_thread = threadIdx.x - 128;
    const int wg = mma_thread / 128;
    const int lane = threadIdx.x % 32;
    TiledMmaS mma_s;
    TiledMmadQ mma_dq;
    auto wg_s = mma_s.get_slice(wg * 128);
    auto wg_dq = mma_dq.get_slice(wg * 128);
    Tensor tSrQ = wg_s.partition_fragment_A(smem_tensor(smem.q.data(), SmemLayoutQ{}));     // (MMA, 1, D / 16)
    Tensor tSrdO = wg_s.partition_fragment_A(smem_tensor(smem.d_o.data(), SmemLayoutQ{}));  // (MMA, 1, D / 16)
    Tensor tSrK = wg_s.partition_fragment_B(smem_tensor(smem.k.data(), SmemLayoutK{}));     // (MMA, 1, D / 16, stage)
    Tensor tSrV = wg_s.partition_fragment_B(smem_tensor(smem.v.data(), SmemLayoutV{}));     // (MMA, 1, D / 16, stage)
    Tensor tdQrK = wg_dq.partition_fragment_B(smem_tensor(smem.k.data(), SmemLayoutKt{}));  // (MMA, 1, N / 16, stage)
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tdPrdP = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    Tensor tdQrdS = make_tensor<Element>(typename Traits::RegLayoutP{});  // dS as the A operand of dQ += dS K
    static_assert(decltype(size(tSrS))::value == kBlockN / 2 && decltype(size(tdQrdS))::value == kBlockN / 2);
    static_assert(decltype(size(tdQrdQ))::value == kHeadDim / 2);
    clear(tdQrdQ);

    // This thread's rows: row_in_tile + 8 r (r = 0, 1); accumulator element i is row (i / 2) % 2,
    // column 8 (i / 4) + 2 (lane % 4) + i % 2 (of the key tile for S, of the head dim for dQ).
    ThreadRows rows;
    rows.row_in_tile = 64 * wg + 16 * ((mma_thread % 128) / 32) + lane / 4;
    rows.tile_row0 = int64_t{t.m_block} * kBlockM;
    rows.row0 = rows.tile_row0 + rows.row_in_tile;
    MaskRows::last_keys(p, rows.row0, rows.last_key);
    const int row_in_tile = rows.row_in_tile;

    smem.qdo_full.wait(0);
    float shift[2], delta[2], lo[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      shift[r] = smem.row_shift[row_in_tile + 8 * r];
      delta[r] = smem.delta[row_in_tile + 8 * r];
      if constexpr (kBias) {
        lo[r] = smem.row_lo[row_in_tile + 8 * r];
      }
    }
    TileVisit visit = read_visit(smem.first_visit);
    typename PipelineK::PipelineState read_k, held_k;
    typename PipelineV::PipelineState read_v;
    bool holding_k = false;  // a K stage still read by the dQ product in flight
    int k_reads = 0;
    // Per visited key tile: S and dP issued (behind the tile before's dQ product), the visit
    // after it read, a mixed tile's mask bits gathered while the products run. The products are
    // issued at the top of the loop body, unconditionally: issued at its bottom under an `if`
    // (the next tile's, when there is one) ptxas serialised every wgmma of the kernel (C7514).
    while (visit.position >= 0) {
      const int n = visit.position;
      pipe_k.consumer_wait(read_k);
      wgmma_batch<true>(mma_s, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
      pipe_v.consumer_wait(read_v);
      wgmma_batch<true>(mma_s, tSrdO, tSrV(_, _, _, read_v.index()), tdPrdP);
      // The visit after this one, written with this tile's K load.
      const TileVisit after =
          kMasked ? read_visit(smem.next_visit[k_reads++ % kVisitSlots]) : TileVisit{n - 1, attn::kTileVisible, 0};
      const uint64_t keep = MaskRows::tile_bits(p, t, visit.position, visit.tile_class, visit.diagonal,
                                                rows.row_in_tile, rows.row0, lane);
      warpgroup_wait<1>();  // S done, and the tile before's dQ product
      warpgroup_fence_operand(tSrS);
      if (holding_k) {
        pipe_k.consumer_release(held_k);
      }
      probabilities(tSrS, p, t, rows, visit, keep, shift, lo, lane);
      warpgroup_wait<0>();              // dP done: V's stage can be refilled
      warpgroup_fence_operand(tdPrdP);  // dP's registers are read below, not before the wait
      pipe_v.consumer_release(read_v);
      ++read_v;
      scores_gradient(tdPrdP, tSrS, p, shift, delta);
      convert_fragment<Element>(tdPrdP, tdQrdS);
      wgmma_batch<false>(mma_dq, tdQrdS, tdQrK(_, _, _, read_k.index()), tdQrdQ);
      held_k = read_k;  // released once the product is done (the next wait)
      holding_k = true;
      ++read_k;
      visit = after;
    }
    warpgroup_wait<0>();
    if (holding_k) {
      pipe_k.consumer_release(held_k);
    }

    // dQ rounded to 16 bits, stored through grad_q's strides (rows past q_len are not).
    store_rows<kHeadDim>(tdQrdQ, p.grad_q + t.batch * p.dq_sb + t.head * p.dq_sh + rows.row0 * p.dq_si, p.dq_si,
                         rows.row0, p.q_len, lane);
  }
};

// The dQ pass: a CTA per (query tile, head, batch), its tile from the grid (QueryTileGrid).
template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    dq_pass_kernel(const __grid_constant__ typename Kernel::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto& smem = shared_storage<typename Kernel::SharedStorage>();
  using PipelineK = typename Kernel::PipelineK;
  using PipelineV = typename Kernel::PipelineV;
  const bool producer = in_producer_warpgroup();
  const typename Kernel::Tile tile = Kernel::Scheduler::tile_of(p);

  if (threadIdx.x == 0) {
    p.prefetch_descriptors();
    smem.qdo_full.init(1);
  }
  // K and V tiles carry the same byte count.
  const auto k_params = tma_pipeline_params<PipelineK>(Kernel::kBytesKV, producer, Kernel::kMmaThreads);
  const auto v_params = tma_pipeline_params<PipelineV>(Kernel::kBytesKV, producer, Kernel::kMmaThreads);
  // The constructors initialise the barriers (warp 0) and fence the initialisation.
  PipelineK pipe_k(smem.pipe_k, k_params, ClusterShape{});
  PipelineV pipe_v(smem.pipe_v, v_params, ClusterShape{});
  __syncthreads();

  run_roles<Kernel::kProducerRegs, Kernel::kConsumerRegs>(
      producer, [&] { Kernel::produce(p, tile, smem, pipe_k, pipe_v); },
      [&] { Kernel::consume(p, tile, smem, pipe_k, pipe_v); });
#endif
}

}  // namespace detail

// Host: the dQ pass of one variant (the dK/dV kernel's: mask, softcap, bias) after the dK/dV
// kernel, on the stream. cudaErrorInvalidValue for a mask without its summary for these tiles
// and for more than 65535 query heads (the grid's y).
template <typename T, int kHeadDim, bool kMasked, bool kSoftcap, bool kBias>
cudaError_t launch_bwd_dq_pass(const BwdSm90Params& a, cudaStream_t stream) {
  using namespace cute;
  using Element = typename CutlassElement<T>::type;
  using Kernel = detail::BwdDq<Element, kHeadDim, kMasked, kSoftcap, kBias>;
  if ((kMasked && a.dq_mask_tiles.ptr == nullptr) || a.heads > 65535 || a.batch > 65535) {
    return cudaErrorInvalidValue;
  }
  typename Kernel::Params p;
  detail::set_bwd_inputs<Element, kHeadDim, Kernel::kBlockM, Kernel::kBlockN>(
      p, a, typename Kernel::SmemLayoutQ{}, take<0, 2>(typename Kernel::SmemLayoutK{}));
  p.grad_q = static_cast<Element*>(a.grad_q);
  p.dq_sb = a.dq_sb, p.dq_sh = a.dq_sh, p.dq_si = a.dq_si;
  p.mask_tiles = a.dq_mask_tiles;
  p.head_group = head_group_for(p.m_blocks, a.heads * a.batch, a.resident_ctas);

  auto kernel = &detail::dq_pass_kernel<Kernel>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) {
    return err;
  }
  kernel<<<dim3(p.m_blocks, a.heads, a.batch), Kernel::kThreads, Kernel::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace safeattn::cuda::hopper
