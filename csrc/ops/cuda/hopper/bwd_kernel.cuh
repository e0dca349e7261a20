// The sm_90a (Hopper) backward of safeattn::attention on CuTe: TMA loads, wgmma, warp
// specialisation. Built only with -gencode=arch=compute_90a,code=sm_90a; instantiated once per
// (head dim, dtype) in hopper/instances/attention_bwd_sm90_d<D>_<dtype>.cu. Semantics:
// ops/attention.h; what it is given: hopper/bwd_params.h (the rows pre-pass has already made delta
// and row_shift).
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
//             rows' row_shift (and a mixed step's bias tile: kBiasTile), dO with the rows'
//             delta (bulk copies of the padded arrays).
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
// Past head dim 128, and at every head dim when the gradients must be bit-reproducible
// (bwd_dq_pass, DqMode kdQPass), there is no dQ product here: the dQ pass
// (hopper/bwd_dq_kernel.cuh) runs after this kernel, per query tile, and writes grad_q itself.
//
// Mask: an attn_mask's summary (bwd_params.h) skips the (query tile, key tile) steps it
// proves fully masked: the producer walks it and hands each visited step (position, class, diagonal)
// to the consumers with the Q load before it (the first with K and V); diagonal steps are a
// compare, mixed ones read the mask per element (a bool mask's bits, or a float mask's values
// added to the scores; its gradient p (dP - delta) is stored per element when asked for). A float
// mask in the inputs' 16-bit type with aligned rows (bias_tile_fits; kBiasTile) has each mixed
// step's tile (kBlockM query rows x kBlockN keys) brought by TMA with the step's Q, into its Q
// stage, and read from there transposed (ldmatrix .trans); other float masks are gathered.
//
// Numerics: masked elements (causality, keys past kv_len, the mask) get s = -inf, so p = 0 whatever the
// row_shift; a row with no visible key has row_shift +inf and p = 0 for every key; query rows
// past q_len are zero-filled by TMA with row_shift +inf and delta 0 from the padding: every dS of
// theirs is exactly 0 and nothing is written for them. NaN in an input reaches the gradients.
//
// The parts: tiles and layouts (hopper/tile_traits.cuh, KeyTileTraits), roles and barriers
// (pipeline.cuh), the grid's order (tile_scheduler.cuh, KeyTileGrid), the mask (mask.cuh,
// MaskPolicy::KeyMajor), the stores (epilogue.cuh); this file wires them.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "ops/cuda/hopper/bwd_dq_kernel.cuh"
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

// dst[0, bytes) += src[0, bytes) in float32, asynchronously (bulk async-group; 16-byte aligned,
// bytes a multiple of 16).
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(cute::cast_smem_ptr_to_uint(src)), "r"(bytes)
               : "memory");
}

// kMasked: the variant that reads a mask and its summary; the other has none of that code (the
// mask's gathers cost the unmasked kernel registers it cannot spare). kSoftcap: the variant with
// a softcap (a runtime test in the others cost the D = 64 kernel 7%, H200). kBias: the mask is a
// float one (natural units, row_lo, its gradient); not with a softcap (whose dS recovers the
// capped score from p, which the bias moves), and a bool mask's kernel has none of its code.
// kBiasTile: the float mask's mixed tiles arrive by TMA with Q (bias_tile_fits), instead of being
// gathered twice per step from global memory with 2-byte loads (a third of the bias kernel's
// stall samples sat on those values' conversions: notes).
template <typename Element_, class Config, bool kMasked_ = false, bool kSoftcap_ = false, bool kBias_ = false,
          bool kBiasTile_ = false>
struct Bwd {
  using Element = Element_;
  using Mask = MaskPolicy<kMasked_, kBias_, kBiasTile_>;
  static constexpr bool kMasked = Mask::kMasked;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kBias = Mask::kBias;
  static constexpr bool kBiasTile = Mask::kBiasTile;
  static_assert(!kBias || !kSoftcap, "a bias is not taken with a softcap");
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
  using Traits = KeyTileTraits<Element, kHeadDim, kBlockM, kBlockN, kStages, Config::kDqPass>;
  using Scheduler = KeyTileGrid<kBlockM, kBlockN, kMasked>;
  using Block = typename Scheduler::Block;
  using MaskKeys = typename Mask::template KeyMajor<kBlockM, kBlockN>;
  // kSharedKeys, a tile of 64 keys (bwd_key_tile: head dims past 128): both consumer warpgroups
  // work on the same keys (KeyTileTraits); otherwise each owns 64 of the tile's keys.
  static constexpr bool kSharedKeys = Traits::kSharedKeys;
  static constexpr int kSdPRows = Traits::kSdPRows;  // S^T's query rows per warpgroup
  static constexpr int kdKVCols = Traits::kdKVCols;  // dK's, dV's head dim per warpgroup
  static constexpr int kdQMode = Traits::kdQMode;
  static constexpr bool kdQPass = kdQMode == hopper::kdQPass;
  static constexpr bool kdQAlternate = kdQMode == hopper::kdQAlternate;
  static constexpr bool kdQWholeRows = Traits::kdQWholeRows;
  // The bias tiles are read per warpgroup's own keys over all of the step's query rows, and take
  // the room of a dQ stage buffer: not with 64-key tiles (kSharedKeys) nor the dQ pass.
  static constexpr bool kTakesBiasTile = !kSharedKeys && !kdQPass;
  static_assert(!kBiasTile || kTakesBiasTile, "no bias tiles for this tile shape");
  static constexpr int kdQWarpgroupsM = Traits::kdQWarpgroupsM;
  static constexpr int kdQWarpgroupsN = Traits::kdQWarpgroupsN;
  // dQ through shared memory: each warpgroup's 64-row product (kdQTileElems floats) is staged in
  // register order, element i of thread t at (i / 2) * 256 + 2 t + i % 2 (float2 stores of
  // consecutive threads: no bank conflict), and added by one bulk reduce-add into dq_accum, which
  // keeps that order per tile (dq_tile_offset; the conversion kernel reads it back). Two stage
  // buffers where they fit (kdQBuffers): the bulk read of one overlaps the next tile. With the dQ
  // pass there is no stage (a 16-byte placeholder).
  static constexpr int kdQTileElems = 64 * (kHeadDim / kdQWarpgroupsN);

  // Where dQ element (r, c) of a kBlockM-row tile sits in dq_accum's tile.
  static __host__ __device__ __forceinline__ int dq_tile_offset(int r, int c) {
    constexpr int kN = kHeadDim / kdQWarpgroupsN;
    const int region = kdQWholeRows ? 0 : (kdQWarpgroupsM == 2 ? r / 64 : 0) * kdQWarpgroupsN + c / kN;
    const int rr = r % 64, cc = c % kN;
    const int t = (rr / 16) * 32 + (rr % 8) * 4 + (cc % 8) / 2;
    const int i = (cc / 8) * 4 + ((rr % 16) / 8) * 2 + cc % 2;
    return region * kdQTileElems + (i / 2) * 256 + 2 * t + i % 2;
  }

  using TiledMmaSdP = typename Traits::TiledMmaSdP;  // S^T = K Q^T, dP^T = V dO^T
  using TiledMmadKV = typename Traits::TiledMmadKV;  // dV += P^T dO, dK += dS^T Q
  using TiledMmadQ = typename Traits::TiledMmadQ;    // dQ = dS K
  using SmemLayoutK = typename Traits::SmemLayoutK;
  using SmemLayoutQ = typename Traits::SmemLayoutQ;
  using SmemLayoutQt = typename Traits::SmemLayoutQt;
  using SmemLayoutKt = typename Traits::SmemLayoutKt;
  static constexpr int kDsBuffers = Traits::kDsBuffers;
  using SmemLayoutdS = typename Traits::SmemLayoutdS;
  using SmemLayoutdSt = typename Traits::SmemLayoutdSt;
  using R2SCopydS = typename Traits::R2SCopydS;
  using TmaQ = typename Traits::TmaQ;
  using TmaK = typename Traits::TmaK;
  // dK and dV out through K's and V's buffers by TMA (store_dkv_staged), else from registers
  // through their strides (store_dkv); the first takes only 16-byte aligned gradients
  // (launch_bwd_variant refuses others; the extension's always are: attention_bwd_sm90_rejects).
  static constexpr bool kStagedDkv = Traits::kStagedDkv;
  using R2SCopydKV = typename Traits::R2SCopydKV;
  using TmadKV = typename Traits::TmadKV;
  static constexpr uint32_t kBytesRows = kBlockM * sizeof(float);
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element) + kBytesRows;  // + row_shift
  static constexpr uint32_t kBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);
  using SmemLayoutBias = typename Traits::SmemLayoutBias;  // kBiasTile
  using TmaBias = typename Traits::TmaBias;
  static constexpr uint32_t kBytesBias = kBlockM * kBlockN * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  // Q load j carries the visit after its step in slot j % kVisitSlots: written before Q's stage is
  // acquired for load j, read by the consumers before they release it (as in the forward).
  static constexpr int kVisitSlots = kStages + 1;

  template <int kdQBuffers_>
  struct SharedStorageOf {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> d_o;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> ds;
    // A mixed step's float-mask tile, per Q stage: arrives with Q (kBiasTile).
    alignas(1024) cute::array_aligned<Element, kBiasTile ? cosize_v<SmemLayoutBias> : 8> bias;
    alignas(16) float row_shift[kStages][kBlockM];           // arrives with Q
    alignas(16) float row_lo[kBias ? kStages : 1][kBlockM];  // arrives with Q (kBias)
    alignas(16) float delta[kStages][kBlockM];               // arrives with dO
    // [buffer][warpgroup][kdQTileElems]
    alignas(128) float dq_stage[kdQPass ? 4 : kdQBuffers_ * kMmaWGs * kdQTileElems];
    typename Pipeline::SharedStorage pipe_q;
    typename Pipeline::SharedStorage pipe_do;
    cutlass::arch::ClusterTransactionBarrier kv_full;
    TileVisit first_visit;              // kMasked: the first step visited, published with K and V
    TileVisit next_visit[kVisitSlots];  // kMasked: per Q load, the step visited after it
  };
  static constexpr int kMaxSmemBytes = 227 * 1024;  // an H100's, an H200's CTA
  // Two dQ stage buffers, or one where the bias tiles leave no room for two (kBiasTile at D = 96
  // and 128: at D = 128 the plain kernel fills 226 of 227 KB, and the two bias stages are 32 KB,
  // one dQ buffer's size; add_dq_stage and dq_stage_read order the one buffer's reuse).
  static constexpr int kdQBuffers = sizeof(SharedStorageOf<2>) <= kMaxSmemBytes ? 2 : 1;
  using SharedStorage = SharedStorageOf<kdQBuffers>;
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kMaxSmemBytes, "more shared memory than an H100 CTA can have");
  static_assert(kdQBuffers == 2 || kBiasTile, "only the bias tiles give up a dQ stage buffer");

  struct Params : BwdInputParams<TmaQ, TmaK> {  // mask_tiles: kBwdMaskTileRows x bwd_key_tile(D)
    float* dq_accum;                            // [B, Hq, q_pad / kBlockM tiles, kBlockM * D in dq_tile_offset order]
    Element* grad_k;
    Element* grad_v;
    int64_t dk_sb, dk_sh, dk_si, dv_sb, dv_sh, dv_si;
    float* grad_mask;                    // BwdSm90Params::grad_mask (kBias only)
    int64_t grad_mask_sb, grad_mask_sh;  // BwdSm90Params::grad_mask_sb, grad_mask_sh
    bool grad_mask_adds;                 // BwdSm90Params::grad_mask_adds
    void* grad_mask_16;                  // BwdSm90Params::grad_mask_16 (kBias only)
    bool batch_inner;                    // BwdSm90Params::batch_inner
    TmaBias tma_bias;                    // kBiasTile: the mask as (rows, keys, head, batch)
    TmaShape shape_bias;                 // its head and batch extents are 1 where it broadcasts
    TmadKV tma_dk, tma_dv;               // kStagedDkv: grad_k and grad_v as TMA writes them
  };
  static_assert(!kMasked || (kBlockM == kBwdMaskTileRows && kBlockN == bwd_key_tile(kHeadDim)),
                "a masked step is one tile of the mask summary");

  // The first step from `step` on that the mask summary does not rule out for key tile n_block
  // (position `steps`: none), with its class and diagonal. Step s is query tile m_begin + s % m_count
  // of head kv_head * group + s / m_count. The producer walks kWalkLoads summary bytes per round
  // trip (all in flight at once), so a long masked run (the keys a causal mask hides from the
  // first query tiles) costs a few round trips instead of one per step; a head's walk ends at its
  // column's last query tile not masked (the summary's query_end, loaded with the first round):
  // past a window's or a chunk's band the rest of the column is masked, and walking it cost each
  // key tile of a 256-key window at S = 32768 some 30 round trips after its last step.
  static constexpr int kWalkLoads = 8;
  static constexpr uint32_t kLowBits = 0x5555u;  // the low bit of each of kWalkLoads 2-bit classes
  static_assert(attn::kTileMasked == 0 && attn::kTileDiagonal < 4 && 2 * kWalkLoads <= 16);

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
      const int m_end = min(p.m_blocks, p.mask_tiles.query_end_at(batch, head, n_block));
      for (; m < p.m_blocks; m += kWalkLoads) {
        // The round's classes, two bits each (an array indexed by the first hit lived in local
        // memory); loads past m_blocks are not issued, hits past m_end not taken.
        uint32_t classes = 0;
#pragma unroll
        for (int j = 0; j < kWalkLoads; ++j) {
          if (m + j < p.m_blocks) {
            classes |= uint32_t{column[int64_t{m + j} * p.mask_tiles.stride_q]} << (2 * j);
          }
        }
        const int inside = m_end - m;
        const uint32_t low_bits = inside >= kWalkLoads ? kLowBits : kLowBits & ((1u << (2 * max(inside, 0))) - 1u);
        const uint32_t hits = (classes | classes >> 1) & low_bits;  // bit 2 j: tile m + j not masked
        if (hits != 0u) {
          const int j = (__ffs(hits) - 1) / 2;
          const uint8_t tile_class = (classes >> (2 * j)) & 3u;
          const int diagonal =
              tile_class == attn::kTileDiagonal ? p.mask_tiles.diagonal_at(batch, head, m + j, n_block) : 0;
          return TileVisit{group_head * m_count + m + j - m_begin, tile_class, diagonal};
        }
        if (inside <= kWalkLoads) {
          break;
        }
      }
    }
    return TileVisit{steps, attn::kTileMasked, 0};
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
    // The bias's tile of a step (kBiasTile): its query rows and the key tile's keys, of its head
    // and batch where it has them.
    Tensor sBias = make_tensor(make_smem_ptr(smem.bias.data()), SmemLayoutBias{});
    auto cta_bias = p.tma_bias.get_slice(_0{});
    Tensor tBsB = group_modes<0, 3>(cta_bias.partition_D(sBias));  // (TMA, stage)
    auto bias_tile = [&](int head, int m_block) {
      Tensor gBias = local_tile(bias_plane(p.tma_bias, p.shape_bias, head, batch), Shape<Int<kBlockM>, Int<kBlockN>>{},
                                make_coord(m_block, n_block));
      return group_modes<0, 3>(cta_bias.partition_S(gBias));
    };
    PipelineState write_q = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_do = cutlass::make_producer_start_state<Pipeline>();
    for (int q_loads = 0; visit.position < steps; ++q_loads) {
      const int step = visit.position;
      const int head = kv_head * p.group + step / m_count;
      const int m_block = m_begin + step % m_count;
      const bool with_bias = kBiasTile && visit.tile_class == attn::kTileMixed;
      visit = visit_from(p, block, step + 1, steps, m_begin);
      if constexpr (kMasked) {
        write_visit(smem.next_visit[q_loads % kVisitSlots], visit);
      }
      const int64_t row_offset = (int64_t{batch} * p.heads + head) * p.q_pad + int64_t{m_block} * kBlockM;
      Tensor gQ = local_tile(p.tma_q.get_tma_tensor(p.shape_q)(_, _, head, batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(m_block, _0{}));
      Tensor gdO = local_tile(tma_do.get_tma_tensor(p.shape_q)(_, _, head, batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                              make_coord(m_block, _0{}));

      // A mixed step's bias tile (kBiasTile) rides Q's stage and mbarrier: its bytes are expected
      // before any copy of the stage starts, so the phase cannot complete without them. Normal
      // eviction: a bias shared by the heads (or the batch) is read again by the CTAs of the other
      // heads of this key tile, which run side by side.
      pipe_q.producer_acquire(write_q);
      uint64_t* q_bar = pipe_q.producer_get_barrier(write_q);
      if (with_bias) {
        cutlass::arch::ClusterTransactionBarrier::expect_transaction(q_bar, kBytesBias);
      }
      copy(p.tma_q.with(*q_bar, 0, TMA::CacheHintSm90::EVICT_LAST), group_modes<0, 3>(cta_q.partition_S(gQ)),
           tQsQ(_, write_q.index()));
      if (with_bias) {
        copy(p.tma_bias.with(*q_bar, 0, TMA::CacheHintSm90::EVICT_NORMAL), bias_tile(head, m_block),
             tBsB(_, write_q.index()));
      }
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

  // kSharedKeys: P^T (buffers 2, 3) and dS^T (0, 1) as the dK / dV products' A, from shared memory
  // (MMA, 1, M / 16, buffer); otherwise they come from registers.
  template <class ThrMma, class SmemdSt>
  static __device__ __forceinline__ auto shared_dkv_operand(ThrMma& wg_dkv, const SmemdSt& sdSt) {
    if constexpr (kSharedKeys) {
      return wg_dkv.partition_fragment_A(sdSt);
    } else {
      return 0;
    }
  }

  // The first step visited, published with K and V (kv_full has been waited for); without a mask
  // the first step.
  static __device__ __forceinline__ TileVisit first_visit(SharedStorage& smem, int steps) {
    TileVisit next{0, attn::kTileVisible, 0};
    if constexpr (kMasked) {
      if (steps > 0) {
        next = read_visit(smem.first_visit);
      }
    }
    return next;
  }

  // The visit after `step`, once its Q load has landed; without a mask every step is visited.
  static __device__ __forceinline__ TileVisit visit_after_load(SharedStorage& smem, int& q_reads, int step) {
    if constexpr (kMasked) {
      return read_visit(smem.next_visit[q_reads++ % kVisitSlots]);
    } else {
      return TileVisit{step + 1, attn::kTileVisible, 0};
    }
  }

  // Every bulk reduce-add of this warpgroup done (not only read: the kernel's end).
  static __device__ __forceinline__ void wait_dq_added(int mma_thread, int steps) {
    if constexpr (!kdQPass) {
      if (mma_thread % 128 == 0 && steps > 0) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      }
    }
  }

  // A warpgroup's dQ stored to its stage, not yet added (head < 0: none).
  struct PendingdQ {
    int head, row0, visit;
  };
  static __device__ __forceinline__ void add_pending_dq(const Params& p, SharedStorage& smem, PendingdQ& pending,
                                                        int batch, int wg, int mma_thread) {
    if constexpr (!kdQPass) {
      if (pending.head >= 0) {
        add_dq_stage(p, smem, batch, pending.head, pending.row0, pending.visit, pending.visit % 2, wg, mma_thread);
        pending.head = -1;
      }
    }
  }

  // dV += P^T dO or dK += dS^T Q: P^T and dS^T from registers, or with kSharedKeys from shared
  // memory (shared_a's `buffer`).
  template <class Mma, class SharedA, class RegsA, class B, class C>
  static __device__ __forceinline__ void dkv_product(Mma& mma, const SharedA& shared_a, int buffer, const RegsA& regs_a,
                                                     const B& b, C& c) {
    if constexpr (kSharedKeys) {
      wgmma_batch<false>(mma, shared_a(_, _, _, buffer), b, c);
    } else {
      wgmma_batch<false>(mma, regs_a, b, c);
    }
  }

  // Both warpgroups wrote their dS of the step (buffer). Where one warpgroup multiplies dQ per step
  // (kdQAlternate) only that one waits for the other's dS; the other arrives and goes on. Barrier
  // ids alternate with the step: the arriving warpgroup multiplies the next step's dQ, so its wait
  // there (the other id) needs this step's dQ warpgroup to have finished this step, dQ product
  // included; that orders both the dS buffer's reuse two steps on and a fast warpgroup's next
  // arrival on this id.
  static __device__ __forceinline__ void ds_written(bool dq_here, int buffer) {
    if constexpr (kdQAlternate) {
      if (dq_here) {
        named_barrier_sync(kBwdDsWritten + buffer, kMmaThreads);
      } else {
        named_barrier_arrive(kBwdDsWritten + buffer, kMmaThreads);
      }
    } else {
      named_barrier_sync(kBwdDsWritten, kMmaThreads);
    }
  }

  // This warpgroup's dQ of a step (rows row0.. of `head`) added into dq_accum: stored to its stage
  // buffer (dq_stage_slot) at the step's end, while dK runs, and added by one bulk reduce-add
  // (add_dq_stage) during the warpgroup's next step (alternating: one without a dQ product of its
  // own), once that step's S^T and dP^T are issued, so that the fence, the barrier and the bulk
  // copy's issue overlap the tensor cores instead of lengthening the step they belong to (storing
  // there too made ptxas wait for S^T and dP^T before reading the dQ registers: 27% slower at
  // D = 64).
  static __device__ __forceinline__ float* dq_stage_slot(SharedStorage& smem, int visit, int buffer, int wg) {
    const int slot = kdQBuffers == 1 ? 0 : kdQAlternate ? visit / 2 % 2 : buffer;
    return smem.dq_stage + (slot * kMmaWGs + wg) * kdQTileElems;
  }
  // Thread 0 waits for the bulk read of the buffer's last tile (two buffers: in add_dq_stage, for
  // the tile before; one: in dq_stage_read, for the tile add_dq_stage has just issued); a dS
  // barrier this warpgroup waits at between that and its next stores into the same buffer (every
  // step's; with kdQAlternate that of its next dQ step) orders the two.
  template <class FragdQ>
  static __device__ __forceinline__ void store_dq_stage(const FragdQ& dq, SharedStorage& smem, int visit, int buffer,
                                                        int wg, int mma_thread) {
    float* stage = dq_stage_slot(smem, visit, buffer, wg);
#pragma unroll
    for (int i = 0; i < size(dq); i += 2) {
      *reinterpret_cast<float2*>(stage + (i / 2) * 256 + 2 * (mma_thread % 128)) = make_float2(dq(i), dq(i + 1));
    }
  }
  static __device__ __forceinline__ void add_dq_stage(const Params& p, SharedStorage& smem, int batch, int head,
                                                      int row0, int visit, int buffer, int wg, int mma_thread) {
    cutlass::arch::fence_view_async_shared();  // the stores, visible to the bulk copy
    named_barrier_sync(kBwdDqStaged + wg, 128);
    if (mma_thread % 128 == 0) {
      const int region = kdQWholeRows ? 0 : wg;
      float* dq_tile = p.dq_accum + ((int64_t{batch} * p.heads + head) * p.q_pad + row0) * kHeadDim;
      bulk_reduce_add(dq_tile + region * kdQTileElems, dq_stage_slot(smem, visit, buffer, wg),
                      kdQTileElems * sizeof(float));
      tma_store_arrive();  // commit
      if constexpr (kdQBuffers == 2) {
        tma_store_wait<1>();  // the previous tile's stage buffer has been read
      }
    }
  }
  // One stage buffer (kdQBuffers): its bulk read, issued at this step's start (add_pending), done
  // before this warpgroup's next stores into it (this step's end, or with kdQAlternate its next dQ
  // step's). Thread 0 waits here, before the step's dS barrier: every thread of the warpgroup
  // waits at that barrier (or, with kdQAlternate on a step without a dQ product, at the next dQ
  // step's) before its stores, and the read has had the step's S^T, dP^T and dV to finish.
  static __device__ __forceinline__ void dq_stage_read(int mma_thread) {
    if constexpr (!kdQPass && kdQBuffers == 1) {
      if (mma_thread % 128 == 0) {
        tma_store_wait<0>();
      }
    }
  }

  // kBiasTile: a mixed step's bias values (its Q stage's tile: query rows, keys contiguous) added
  // to S^T, which goes to natural units. A thread's S^T elements pair adjacent query rows of one
  // key, so the tile is read transposed: ldmatrix .trans hands thread t of an 8 x 8 block (8 query
  // rows of 8 keys, each a 16-byte piece) rows 2 (t % 4) and 2 (t % 4) + 1 of key t / 4, that is
  // accumulator elements 2 kr + 4 c and its + 1 of key row kr, query block c. Each call reads four
  // blocks, (kr, c) = (j % 2, 2 m + j / 2) for block j (its row addresses from lanes 8 j .. 8 j + 7):
  // elements 8 m .. 8 m + 7. The eight rows of a block sit in distinct banks (SmemLayoutBiasTile's
  // swizzle), against the 8-way conflict of plain 2-byte reads down a column. A -inf element
  // masks its score (set, not added to: NaN behind it does not leak), so tile_bits gathers
  // nothing for it. Rows past q_len and keys past kv_len were zero-filled by TMA (their p is 0
  // through row_shift, or their scores are -inf after mask_tile).
  template <class FragS>
  static __device__ __forceinline__ void add_bias_tile(FragS& s, const Params& p, const SharedStorage& smem, int stage,
                                                       int wg, int mma_thread) {
    static_assert(decltype(size(s))::value == kBlockM / 2 && kBlockM % 16 == 0);
    Tensor sBias = make_tensor(make_smem_ptr(smem.bias.data()), SmemLayoutBias{});
    const int lane = mma_thread % 32, block = lane / 8;
    const int key = 64 * wg + 16 * ((mma_thread % 128) / 32) + 8 * (block % 2);
    const int query = 8 * (block / 2) + lane % 8;
    // One address per thread, the reads at constant offsets from it: 16 query rows on, or a stage
    // on, is a multiple of 1024 bytes, which the swizzle (bits 7-9 of the byte address into bits
    // 4-6) leaves as it is. (An address per read, held across the step loop, spilled more.)
    using PlainLayout = decltype(get_nonswizzle_portion(SmemLayoutBias{}));
    constexpr uint32_t kRows16Bytes = PlainLayout{}(16, 0, 0) * sizeof(Element);
    constexpr uint32_t kStageBytes = PlainLayout{}(0, 0, 1) * sizeof(Element);
    static_assert(kRows16Bytes % 1024 == 0 && kStageBytes % 1024 == 0, "offsets the swizzle leaves alone");
    const uint32_t address = cast_smem_ptr_to_uint(&sBias(query, key, 0)) + stage * kStageBytes;
#pragma unroll
    for (int m = 0; m < kBlockM / 16; ++m) {
      cutlass::AlignedArray<Element, 8> values;
      ldmatrix_x4_trans(address + m * kRows16Bytes, reinterpret_cast<uint32_t(&)[4]>(values));
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float bias = static_cast<float>(values[e]);
        const int i = 8 * m + e;
        s(i) = bias == -INFINITY ? -INFINITY : fmaf(s(i), p.score.natural_scale, bias);
      }
    }
  }

  // P^T of a step from its masked scores: p = exp2(s scale log2(e) - row_shift). A float mask
  // (row_lo): natural units (unit 1 where its values were added, which took the scores there), the
  // shift subtracted before the change of base, then row_lo (BwdSm90Params::row_lo; a row of huge
  // biases cancels exactly and keeps lse_lo).
  template <class FragS>
  static __device__ __forceinline__ void probabilities(FragS& s, const Params& p, const float* row_shift,
                                                       const float* row_lo, bool bias_step, int query_base) {
    if constexpr (kBias) {
      const float unit = bias_step ? 1.0f : p.score.natural_scale;
#pragma unroll
      for (int i = 0; i < size(s); ++i) {
        const int c = query_base + MaskKeys::acc_col(i);
        s(i) = exp2_approx(fmaf(fmaf(s(i), unit, -row_shift[c]), attn::kLog2e, -row_lo[c]));
      }
    } else {
#pragma unroll
      for (int i = 0; i < size(s); ++i) {
        s(i) = exp2_approx(fmaf(s(i), kSoftcap ? 1.0f : p.score.scale, -row_shift[query_base + MaskKeys::acc_col(i)]));
      }
    }
  }

  // dS^T = scale P^T (dP^T - delta) over dP^T's registers. With a softcap, d score / d dot =
  // scale (1 - t^2), t = score / softcap_post, the score recovered from p: log2 p + row_shift
  // (p = 0 contributes nothing, whatever its score). With a float mask's gradient, p (dP - delta)
  // of the step's elements inside [q_len, kv_len) is stored (rounded to Element into
  // grad_mask_16 where that is given), or added to those of the other (batch, query head)s that
  // share its element (a mask broadcast over the batch or the heads: grad_mask_adds). `head` is
  // the query head (the step's, of the CTA's kv group).
  template <class FragS>
  static __device__ __forceinline__ void scores_gradient(FragS& dp, const FragS& prob, const Params& p,
                                                         const float* row_shift, const float* delta, int batch,
                                                         int head, int row0, int key0, int keys_in_tile, int key_base,
                                                         int query_base) {
    if constexpr (kSoftcap) {
      const float inv_cap = 1.0f / p.score.softcap_post;
#pragma unroll
      for (int i = 0; i < size(dp); ++i) {
        const float pr = prob(i), shift = row_shift[query_base + MaskKeys::acc_col(i)];
        const float t = (log2_approx(pr) + shift) * inv_cap;
        const float dscore = pr > 0.0f ? p.score.natural_scale * (1.0f - t * t) : 0.0f;
        dp(i) = dscore * pr * (dp(i) - delta[query_base + MaskKeys::acc_col(i)]);
      }
    } else if (kBias && (p.grad_mask != nullptr || p.grad_mask_16 != nullptr)) {
      const int last_row = p.q_len - 1 - row0;
      const bool add = p.grad_mask_adds;
      const int64_t base = (batch * p.grad_mask_sb + head * p.grad_mask_sh + row0) * p.kv_len + key0;
      float* grad = p.grad_mask + base;
      Element* grad_16 = static_cast<Element*>(p.grad_mask_16) + base;
#pragma unroll
      for (int i = 0; i < size(dp); ++i) {
        const int key = key_base + MaskKeys::acc_row(i), row = query_base + MaskKeys::acc_col(i);
        const float ds = prob(i) * (dp(i) - delta[query_base + MaskKeys::acc_col(i)]);
        if (key < keys_in_tile && row <= last_row) {
          const int64_t at = int64_t{row} * p.kv_len + key;
          if (p.grad_mask_16 != nullptr) {
            grad_16[at] = static_cast<Element>(ds);
          } else if (add) {
            atomicAdd(grad + at, ds);
          } else {
            grad[at] = ds;
          }
        }
        dp(i) = p.score.natural_scale * ds;
      }
    } else {
#pragma unroll
      for (int i = 0; i < size(dp); ++i) {
        dp(i) = p.score.natural_scale * prob(i) * (dp(i) - delta[query_base + MaskKeys::acc_col(i)]);
      }
    }
  }

  // dK and dV of the tile's keys (zero when no query sees them), rounded, from the thread's rows
  // key_base and + 8 (column dkv_col_base holds the lane's 2 (lane % 4)); keys past kv_len are
  // not written.
  template <class FragKV>
  static __device__ __forceinline__ void store_dkv(const Params& p, const FragKV& dk_acc, const FragKV& dv_acc,
                                                   int batch, int kv_head, int key0, int keys_in_tile, int key_base,
                                                   int dkv_col_base, int lane) {
    const int col0 = dkv_col_base - 2 * (lane % 4);
    Element* dk = p.grad_k + batch * p.dk_sb + kv_head * p.dk_sh + int64_t{key0 + key_base} * p.dk_si + col0;
    Element* dv = p.grad_v + batch * p.dv_sb + kv_head * p.dv_sh + int64_t{key0 + key_base} * p.dv_si + col0;
    store_rows<kdKVCols>(dk_acc, dk, p.dk_si, key_base, keys_in_tile, lane);
    store_rows<kdKVCols>(dv_acc, dv, p.dv_si, key_base, keys_in_tile, lane);
  }

  // dK and dV through K's and V's buffers (kStagedDkv): once neither warpgroup's products read K
  // or V (each has waited for its last; with no step the producer loads nothing), each rounds its
  // 64 keys' rows into both buffers by stmatrix and one thread stores the two tiles by TMA (keys
  // past kv_len lie outside the tensors: TMA leaves them), waiting for the copies before the CTA
  // ends.
  template <class FragKV>
  static __device__ __forceinline__ void store_dkv_staged(const Params& p, SharedStorage& smem, const FragKV& dk_acc,
                                                          const FragKV& dv_acc, int batch, int kv_head, int key0,
                                                          int mma_thread) {
    named_barrier_sync(kBwdDkvStaged, kMmaThreads);
    Tensor sK = smem_tensor(smem.k.data(), SmemLayoutK{});
    Tensor sV = smem_tensor(smem.v.data(), SmemLayoutK{});
    R2SCopydKV r2s;
    auto thr = r2s.get_slice(mma_thread);
    auto stage = [&](const FragKV& acc, auto& buffer) {  // one at a time: half the rounded registers
      Tensor rounded = make_fragment_like<Element>(acc);
      convert_fragment<Element>(acc, rounded);
      copy(r2s, thr.retile_S(rounded), thr.partition_D(buffer));
    };
    stage(dk_acc, sK);
    stage(dv_acc, sV);
    cutlass::arch::fence_view_async_shared();  // the stores, visible to TMA
    named_barrier_sync(kBwdDkvStaged, kMmaThreads);
    if (mma_thread == 0) {
      const int n_block = key0 / kBlockN;
      const auto tile = Shape<Int<kBlockN>, Int<kHeadDim>>{};
      Tensor gdK =
          local_tile(p.tma_dk.get_tma_tensor(p.shape_k)(_, _, kv_head, batch), tile, make_coord(n_block, _0{}));
      Tensor gdV =
          local_tile(p.tma_dv.get_tma_tensor(p.shape_k)(_, _, kv_head, batch), tile, make_coord(n_block, _0{}));
      auto cta_dk = p.tma_dk.get_slice(_0{});
      auto cta_dv = p.tma_dv.get_slice(_0{});
      copy(p.tma_dk, cta_dk.partition_S(sK), cta_dk.partition_D(gdK));
      copy(p.tma_dv, cta_dv.partition_S(sV), cta_dv.partition_D(gdV));
      tma_store_arrive();
      tma_store_wait<0>();
    }
  }

  static __device__ void consume(const Params& p, const Block& block, SharedStorage& smem, Pipeline& pipe_q,
                                 Pipeline& pipe_do, int steps, int m_begin) {
    const int n_block = block.n_block, kv_head = block.kv_head, batch = block.batch;
    const int m_count = p.m_blocks - m_begin;
    const int mma_thread = threadIdx.x - 128;
    const int wg = __shfl_sync(0xffffffff, mma_thread / 128, 0);  // warp-uniform to the compiler
    Tensor sdSt = smem_tensor(smem.ds.data(), SmemLayoutdSt{});
    TiledMmaSdP mma_sdp;
    TiledMmadKV mma_dkv;
    TiledMmadQ mma_dq;
    auto wg_sdp = mma_sdp.get_slice(wg * 128);
    auto wg_dkv = mma_dkv.get_slice(wg * 128);
    auto wg_dq = mma_dq.get_slice(kdQAlternate ? 0 : wg * 128);
    Tensor tSrK = wg_sdp.partition_fragment_A(smem_tensor(smem.k.data(), SmemLayoutK{}));  // (MMA, 1, D / 16): own keys
    Tensor tSrV = wg_sdp.partition_fragment_A(smem_tensor(smem.v.data(), SmemLayoutK{}));  // (MMA, 1, D / 16)
    Tensor tSrQ = wg_sdp.partition_fragment_B(smem_tensor(smem.q.data(), SmemLayoutQ{}));  // (MMA, 1, D / 16, stage)
    Tensor tSrdO = wg_sdp.partition_fragment_B(smem_tensor(smem.d_o.data(), SmemLayoutQ{}));
    Tensor tdVrdO =
        wg_dkv.partition_fragment_B(smem_tensor(smem.d_o.data(), SmemLayoutQt{}));  // (MMA, 1, M / 16, stage)
    Tensor tdKrQ = wg_dkv.partition_fragment_B(smem_tensor(smem.q.data(), SmemLayoutQt{}));
    Tensor tdQrdS =
        wg_dq.partition_fragment_A(smem_tensor(smem.ds.data(), SmemLayoutdS{}));             // (MMA, 1, N / 16, buffer)
    Tensor tdQrKt = wg_dq.partition_fragment_B(smem_tensor(smem.k.data(), SmemLayoutKt{}));  // (MMA, 1, N / 16)

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    // P^T and dS^T as the A operand of the dK/dV products: k block kb holds accumulator elements
    // [8 kb, 8 kb + 8) of S^T (the wgmma accumulator and A-fragment orders agree).
    Tensor tdVrP = make_tensor<Element>(typename Traits::RegLayoutP{});
    Tensor tdKrdS = make_tensor<Element>(typename Traits::RegLayoutP{});
    static_assert(decltype(size(tSrS))::value == kSdPRows / 2 && decltype(size(tdVrP))::value == kSdPRows / 2);
    auto shared_a = shared_dkv_operand(wg_dkv, sdSt);
    R2SCopydS r2s_ds;
    auto thr_r2s_ds = r2s_ds.get_slice(mma_thread);
    Tensor tdSsdS = thr_r2s_ds.partition_D(sdSt);  // (CPY, CPY_M, CPY_N, buffer)
    // tdKrdS's (tdVrP's) registers seen in the accumulator's layout, as the copy's source.
    Tensor tdSrdS = thr_r2s_ds.retile_S(make_tensor(tdKrdS.data(), tSrS.layout()));
    Tensor tPrP = thr_r2s_ds.retile_S(make_tensor(tdVrP.data(), tSrS.layout()));

    // Accumulator element i of a 64 x N wgmma (thread t of the warpgroup) sits at row 16 (t / 32) +
    // (t % 32) / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (t % 4) + i % 2 (MaskPolicy::KeyMajor).
    const int row_base = 16 * ((mma_thread % 128) / 32) + (mma_thread % 32) / 4;
    const int col_base = 2 * (mma_thread % 4);
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
    // The visited steps (the producer's walk, with each Q load) and their mask bits, one step ahead.
    auto head_of = [&](int step) { return kv_head * p.group + step / m_count; };
    auto m_block_of = [&](int step) { return m_begin + step % m_count; };
    int q_reads = 0;
    auto mask_bits = [&](const TileVisit& visit) {
      return MaskKeys::template tile_bits<decltype(size(tSrS))::value>(
          p, visit, steps, batch, kv_head, m_begin, m_count, key0, keys_in_tile, key_base, query_base);
    };
    // This warpgroup's dQ of a step is stored at the step's end, added during its next one.
    int visited = 0;              // the steps not skipped: dS and the dQ stage alternate over them
    PendingdQ pending{-1, 0, 0};  // this warpgroup's dQ stored, not yet added
    auto add_pending = [&] { add_pending_dq(p, smem, pending, batch, wg, mma_thread); };
    TileVisit next = first_visit(smem, steps);
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
      next = visit_after_load(smem, q_reads, step);
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
        if constexpr (kBiasTile) {
          add_bias_tile(tSrS, p, smem, read_q.index(), wg, mma_thread);
        } else {
          MaskKeys::add_bias(tSrS, p, batch, head, row0, key0, keys_in_tile, key_base, query_base);
        }
      }

      MaskKeys::mask_tile(tSrS, p, keep, row0, key0, keys_in_tile, key_base, query_base);
      const float* row_shift = smem.row_shift[read_q.index()];
      probabilities(tSrS, p, row_shift, kBias ? smem.row_lo[read_q.index()] : nullptr, bias_step, query_base);
      convert_fragment<Element>(tSrS, tdVrP);
      if constexpr (kSharedKeys) {
        // P^T to shared memory (buffer 2 + buffer): each warpgroup's query rows, both read it.
        copy(r2s_ds, tPrP, tdSsdS(_, _, _, 2 + buffer));
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(kBwdPWritten, kMmaThreads);
      }
      dkv_product(mma_dkv, shared_a, 2 + buffer, tdVrP, tdVrdO(_, _, _, read_do.index()), tdVrdV);
      warpgroup_wait<1>();  // dP^T done, dV may still run

      const float* delta = smem.delta[read_do.index()];
      scores_gradient(tdPrdP, tSrS, p, row_shift, delta, batch, head, m_block_of(step) * kBlockM, key0, keys_in_tile,
                      key_base, query_base);
      convert_fragment<Element>(tdPrdP, tdKrdS);

      // dS^T to shared memory as dS (query rows contiguous), for the dQ product, or with
      // kSharedKeys for the dK product.
      if constexpr (!kdQPass || kSharedKeys) {
        copy(r2s_ds, tdSrdS, tdSsdS(_, _, _, buffer));
        cutlass::arch::fence_view_async_shared();  // the stores, visible to wgmma
        dq_stage_read(mma_thread);
        ds_written(dq_here, buffer);
      }
      if (!kdQPass && dq_here) {
        wgmma_batch<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrKt, tdQrdQ);
      }
      // dK after dQ: dQ's staging below runs while the tensor cores do dK.
      dkv_product(mma_dkv, shared_a, buffer, tdKrdS, tdKrQ(_, _, _, read_q.index()), tdKrdK);
      warpgroup_wait<1>();  // dV and dQ done, dK may still run
      if constexpr (!kdQPass) {
        warpgroup_fence_operand(tdQrdQ);  // dQ's registers are read below, not before the wait
      }
      pipe_do.consumer_release(read_do);
      ++read_do;
      if (!kdQPass && dq_here) {
        store_dq_stage(tdQrdQ, smem, visit, buffer, wg, mma_thread);
        pending = PendingdQ{head, row0, visit};  // added by add_pending, next step or after the last
      }
      warpgroup_wait<0>();  // dK done: its Q (and the bias tile, read in add_bias_tile) can go
      pipe_q.consumer_release(read_q);
      ++read_q;
    }
    add_pending();
    wait_dq_added(mma_thread, steps);

    if constexpr (kStagedDkv) {
      store_dkv_staged(p, smem, tdKrdK, tdVrdV, batch, kv_head, key0, mma_thread);
    } else {
      store_dkv(p, tdKrdK, tdVrdV, batch, kv_head, key0, keys_in_tile, key_base, dkv_col_base, mma_thread % 32);
    }
  }
};

// The dK/dV kernel: a CTA per (key tile, kv head, batch), its block from the grid (KeyTileGrid).
template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1) bwd_kernel(const __grid_constant__ typename Kernel::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto& smem = shared_storage<typename Kernel::SharedStorage>();
  using Pipeline = typename Kernel::Pipeline;
  const bool producer = in_producer_warpgroup();
  const typename Kernel::Block block = Kernel::Scheduler::block_coords(p);
  const int m_begin = Kernel::Scheduler::first_m_block(p, block.n_block);
  const int steps = p.group * (p.m_blocks - m_begin);

  if (threadIdx.x == 0) {
    p.prefetch_descriptors();
    if constexpr (Kernel::kBiasTile) {
      cute::prefetch_tma_descriptor(p.tma_bias.get_tma_descriptor());
    }
    if constexpr (Kernel::kStagedDkv) {
      cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
    }
    smem.kv_full.init(1);
  }
  // dO and delta: the same byte count as Q and row_shift.
  const auto pipe_params = tma_pipeline_params<Pipeline>(Kernel::kBytesQ, producer, Kernel::kMmaThreads);
  typename Pipeline::Params pipe_q_params = pipe_params;
  if constexpr (Kernel::kBias) {
    pipe_q_params.transaction_bytes += Kernel::kBytesRows;  // row_lo with Q
  }
  // (A mixed step's bias tile, kBiasTile, is added to its own load's count by the producer.)
  // The constructors initialise the barriers (warp 0) and fence the initialisation.
  Pipeline pipe_q(smem.pipe_q, pipe_q_params, ClusterShape{});
  Pipeline pipe_do(smem.pipe_do, pipe_params, ClusterShape{});
  __syncthreads();

  run_roles<Kernel::kProducerRegs, Kernel::kConsumerRegs>(
      producer,
      [&] {
        if (steps > 0) {
          Kernel::produce(p, block, smem, pipe_q, pipe_do, steps, m_begin);
        }
      },
      [&] { Kernel::consume(p, block, smem, pipe_q, pipe_do, steps, m_begin); });
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
template <typename T, class Config, bool kMasked, bool kSoftcap, bool kBias = false, bool kBiasTile = false>
cudaError_t launch_bwd_variant(const BwdSm90Params& a, cudaStream_t stream) {
  using namespace cute;
  using Element = typename CutlassElement<T>::type;
  using Kernel = detail::Bwd<Element, Config, kMasked, kSoftcap, kBias, kBiasTile>;
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
  if constexpr (Kernel::kStagedDkv) {
    // TMA writes grad_k and grad_v, as attention_bwd_sm90_rejects asks of every call.
    if (!detail::tma_writable<Element>(a.grad_k, a.batch, a.kv_heads, a.dk_sb, a.dk_sh, a.dk_si) ||
        !detail::tma_writable<Element>(a.grad_v, a.batch, a.kv_heads, a.dv_sb, a.dv_sh, a.dv_si)) {
      return cudaErrorInvalidValue;
    }
    using Tile = Shape<Int<Config::kBlockN>, Int<D>>;
    p.tma_dk = detail::tma_store_view<Element, typename Kernel::SmemLayoutK, Tile>(
        a.grad_k, a.batch, a.kv_heads, a.kv_len, D, a.dk_sb, a.dk_sh, a.dk_si);
    p.tma_dv = detail::tma_store_view<Element, typename Kernel::SmemLayoutK, Tile>(
        a.grad_v, a.batch, a.kv_heads, a.kv_len, D, a.dv_sb, a.dv_sh, a.dv_si);
  }
  p.mask_tiles = a.mask_tiles;
  p.grad_mask = a.grad_mask;
  p.grad_mask_sb = a.grad_mask_sb, p.grad_mask_sh = a.grad_mask_sh;
  p.grad_mask_adds = a.grad_mask_adds;
  p.grad_mask_16 = a.grad_mask_16;
  p.batch_inner = a.batch_inner;
  if constexpr (kBiasTile) {  // the mask as TMA reads it (bias_tile_fits), broadcast dims of extent 1
    Tensor mBias = detail::tma_bias_view<Element>(a.mask, a.batch, a.heads, a.q_len, a.kv_len);
    p.shape_bias = mBias.shape();
    p.tma_bias = make_tma_copy(SM90_TMA_LOAD{}, mBias, take<0, 2>(typename Kernel::SmemLayoutBias{}),
                               Shape<Int<Config::kBlockM>, Int<Config::kBlockN>>{}, _1{});
  }
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

// The variant with the mask's code when a.mask_tiles holds a summary (a float mask's: kBias, by
// TMA tiles where the mask and the tile shape allow it: kBiasTile), with the softcap's when there
// is one (cudaErrorInvalidValue for a float mask with a softcap, and for a tile shape that does
// not match the summary's tiles: only the standalone check has those). D = 256 (64-key tiles) and
// the dQ pass's route (deterministic calls) keep gathering the bias.
template <typename T, class Config, bool kSoftcap>
cudaError_t launch_bwd_masking(const BwdSm90Params& a, cudaStream_t stream) {
  if (a.mask_tiles.ptr == nullptr) {
    return launch_bwd_variant<T, Config, false, kSoftcap>(a, stream);
  }
  if constexpr (Config::kBlockM == kBwdMaskTileRows && Config::kBlockN == bwd_key_tile(Config::kHeadDim)) {
    if (!a.mask.is_bias()) {
      return launch_bwd_variant<T, Config, true, kSoftcap>(a, stream);
    }
    if constexpr (!kSoftcap) {
      using Element = typename CutlassElement<T>::type;
      if constexpr (detail::Bwd<Element, Config, true, false, true>::kTakesBiasTile) {
        if (bias_tile_fits<T>(a.mask)) {
          return launch_bwd_variant<T, Config, true, false, true, true>(a, stream);
        }
      }
      return launch_bwd_variant<T, Config, true, false, true>(a, stream);
    }
  }
  return cudaErrorInvalidValue;
}
template <typename T, class Config>
cudaError_t launch_bwd_config(const BwdSm90Params& a, cudaStream_t stream) {
  return a.score.softcap_post > 0.0f ? launch_bwd_masking<T, Config, true>(a, stream)
                                     : launch_bwd_masking<T, Config, false>(a, stream);
}

template <typename T, int kHeadDim>
cudaError_t launch_attention_bwd_sm90(const BwdSm90Params& params, cudaStream_t stream) {
  using Config = typename DefaultBwdConfig<kHeadDim>::type;
  if constexpr (!Config::kDqPass) {
    if (bwd_dq_pass(kHeadDim, params.deterministic)) {
      return launch_bwd_config<T, DqPassBwdConfig<Config>>(params, stream);
    }
  }
  return launch_bwd_config<T, Config>(params, stream);
}

}  // namespace safeattn::cuda::hopper
