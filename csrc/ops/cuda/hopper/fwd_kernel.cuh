// The sm_90a (Hopper) forward of safeattn::attention on CuTe: TMA loads, wgmma, warp
// specialisation. Built only with -gencode=arch=compute_90a,code=sm_90a (wgmma, setmaxnreg);
// instantiated once per (head dim, dtype) in hopper/instances/attention_fwd_sm90_d<D>_<dtype>.cu.
// Semantics: ops/attention.h; what it is given: hopper/fwd_params.h.
//
// One CTA = 1 producer warpgroup + kMmaWGs consumer warpgroups, persistent over the output tiles
// (kBlockM query rows of one (batch, head); consumer warpgroup w owns rows [64w, 64w + 64)).
//   schedule  tiles in (batch, head)-major order, longest causal rows first within a head; CTA c
//             starts with tile c, then takes the next from an atomic counter (causal: unequal
//             tiles stay balanced, and the running tiles share a few heads' K/V in L2) or, with
//             no counter, tile + grid. The producer publishes each tile index (-1: done) and the
//             tile's coordinates with Q's mbarrier, so the consumers follow it.
//   producer  one thread issues TMA loads: Q once per tile into one of kQStages buffers (q_full /
//             q_empty mbarriers; the next tile's Q loads under the current one), then K and V
//             tiles of kBlockN keys into two kStages-deep mbarrier pipelines, from the last key
//             tile down to the first, so the causal and end-of-keys tiles (the only ones that
//             test elements) come first. Keys past kv_len are zero-filled by TMA and masked to
//             -inf; query rows past q_len are zero-filled and never written.
//   consumers S = Q K^T (wgmma, both operands in shared memory, fp32 accumulators), online
//             softmax in registers (log2 domain), O += P V (wgmma, P from registers). The QK
//             product of key tile n-1 is issued before the PV product of tile n, so the tensor
//             cores run while the softmax of the previous tile is computed; with kPingPong the
//             warpgroups also take turns issuing (named barriers), so one's softmax overlaps the
//             other's products.
//   mask      (the kMasked variant) a mask's tile summary: the producer walks it, skipping
//             fully masked key tiles, and hands each visited tile (position, class, diagonal) to the
//             consumers through shared memory with its K load; fully visible tiles read no mask,
//             diagonal ones are a compare, mixed ones gather a bool mask's bits one tile ahead or
//             add a float mask's values (a bias, natural units; the kBias variant) once their
//             scores are in: by TMA with K into shared memory where the mask has the inputs' 16-bit
//             type and aligned rows (kBiasTile), else gathered from global memory.
//   epilogue  O / l rounded to 16 bits, staged in the tile's Q buffer and stored by TMA (two Q
//             buffers), else stored from registers through out's strides; lse and lse_lo (the
//             rounding error of lse) per row, the sink logit added to the denominator where there
//             are sinks (attn::finish_row, as in every kernel).
//   softcap   when given, each tile's scores go through the shared score rule (attn::ScoreRule:
//             softcap * tanh(scale * dot / softcap), log2 units) before the mask.
// setmaxnreg moves registers from the producer warpgroup to the consumers.
//
// The parts: tile shapes and layouts (hopper/tile_traits.cuh), the roles and barriers
// (pipeline.cuh), the schedule (tile_scheduler.cuh), the mask (mask.cuh), the online softmax and
// its safe rows (softmax.cuh), the output (epilogue.cuh); this file wires them.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "ops/cuda/hopper/epilogue.cuh"
#include "ops/cuda/hopper/fwd_params.h"
#include "ops/cuda/hopper/mask.cuh"
#include "ops/cuda/hopper/pipeline.cuh"
#include "ops/cuda/hopper/softmax.cuh"
#include "ops/cuda/hopper/tile_scheduler.cuh"
#include "ops/cuda/hopper/tile_traits.cuh"
#include "ops/cuda/pdl.cuh"

namespace safeattn::cuda::hopper {
namespace detail {

using namespace cute;

// One forward variant: Config's tile shape (FwdTileConfig) with the mask's code of
// MaskPolicy<kMasked, kBias, kBiasTile> (mask.cuh). kBias: a float mask, whose scores the softmax
// takes in natural units (as a runtime branch it cost the bool rows 7%: H100, D = 128, 0.453
// against 0.423 ms). kBiasTile: the float mask has the kernel's element type and TMA's layout
// (bias_tile_fits), and its mixed tiles arrive by TMA with K, into shared memory, instead of being
// gathered from global memory.
template <typename Element_, class Config, bool kMasked_ = false, bool kBias_ = false, bool kBiasTile_ = false>
struct Fwd {
  using Element = Element_;
  using Mask = MaskPolicy<kMasked_, kBias_, kBiasTile_>;
  static constexpr bool kMasked = Mask::kMasked;
  static constexpr bool kBias = Mask::kBias;
  static constexpr bool kBiasTile = Mask::kBiasTile;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr int kQStages = Config::kQStages;
  static constexpr int kMmaWGs = Config::kMmaWGs;
  static constexpr bool kPingPong = Config::kPingPong && kMmaWGs > 1;
  static constexpr int kMmaThreads = 128 * kMmaWGs;
  static constexpr int kThreads = kMmaThreads + 128;
  // Registers per thread after setmaxnreg (multiples of 8). The CTA starts with the launch bound's
  // share (65536 / threads, rounded down to 8: 168 for 384 threads) and setmaxnreg.inc waits until
  // the pool has the registers, so the new split must fit in what the launch gave (24 / 240 does
  // for 2 consumer warpgroups but spills the producer's schedule arithmetic; 32 / 240 hangs).
  static constexpr int kProducerRegs = 32;
  static constexpr int kConsumerRegs = kMmaWGs == 2 ? 232 : 160;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8 > 255 ? 255 : (65536 / kThreads) / 8 * 8;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kMmaThreads <= kLaunchRegs * kThreads);

  using Traits = QueryTileTraits<Element, kHeadDim, kBlockN, kMmaWGs>;
  static_assert(Traits::kBlockM == kBlockM);
  using MaskRows = typename Mask::template QueryMajor<kBlockN>;
  using Scheduler = PersistentTileScheduler<kBlockM, kBlockN, kMasked>;
  using Softmax = OnlineSoftmax<kBlockN, kBias>;
  using Epilogue = OutputEpilogue<Element, kHeadDim, kBias>;
  using Tile = QueryTile;

  using TiledMmaQK = typename Traits::TiledMmaQK;  // S = Q K^T
  using TiledMmaPV = typename Traits::TiledMmaPV;  // O += P V, P from registers
  using SmemLayoutQ = typename Traits::SmemLayoutQ;
  using SmemLayoutK = typename Traits::template SmemLayoutK<kStages>;
  using SmemLayoutVt = typename Traits::template SmemLayoutVt<kStages>;
  using SmemLayoutBias = typename Traits::template SmemLayoutBias<kStages>;  // kBiasTile
  using TmaQ = typename Traits::TmaQ;
  using TmaK = typename Traits::template TmaK<kStages>;
  using TmaV = typename Traits::template TmaVt<kStages>;
  using TmaBias = typename Traits::template TmaBias<kStages>;
  using TmaO = typename Traits::TmaO;
  using R2SCopyO = typename Traits::R2SCopyO;
  using SmemLayoutOWg = typename Traits::SmemLayoutOWg;
  // The output through the tile's Q buffer by TMA (FwdTileConfig::kOutViaQ, store_staged): its
  // release then waits for the copy to have read it, which with one Q buffer would hold up the next
  // tile's Q load (those store from registers, OutputEpilogue::store). Both routes in one kernel,
  // chosen at run time by out's alignment, spilled 44 bytes in the masked variant, so out must suit
  // TMA here. The stores from registers (a quad's exchange, 64-bit addresses and a bounds test per
  // row) were a quarter of the forward's warp instructions at S=512 causal (ncu, D = 128, against
  // cuDNN's 12%). hopper_fwd_check, H200, bf16, D = 128, B x S = 16k, ms, registers -> staged, the
  // same run: S=512 full 0.152 -> 0.146, causal 0.123 -> 0.123 (static schedule 0.127 -> 0.124);
  // S=1024 0.248 -> 0.244, 0.174 -> 0.169; S=4096 0.838 -> 0.837, 0.473 -> 0.472.
  static constexpr bool kOutViaQ = Config::kOutViaQ;
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesBias = kBlockM * kBlockN * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  // K load j carries the visit after its key tile in slot j % kVisitSlots. The producer writes the
  // slot before acquiring K's stage for load j; by then the consumers have released load
  // j - kStages - 1, and they read a load's slot before releasing its stage, so kStages + 1 slots
  // are never overwritten while read. The stage's mbarrier (arrive: release, wait: acquire)
  // publishes the slot with the load.
  static constexpr int kVisitSlots = kStages + 1;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, kQStages * cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutVt>> v;
    alignas(1024) cute::array_aligned<Element, kBiasTile ? cosize_v<SmemLayoutBias> : 8> bias;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    // Per Q buffer: Q landed (TMA transaction count); every consumer thread is done reading it;
    // the tile it belongs to (-1: no more tiles), published by q_full.
    cutlass::arch::ClusterTransactionBarrier q_full[kQStages];
    cutlass::arch::ClusterBarrier q_empty[kQStages];
    int tile_index[kQStages];
    Tile tile[kQStages];                // its coordinates and key tiles (the producer's tile_at)
    TileVisit first_visit[kQStages];    // the tile's first visited key tile, published with its index
    TileVisit next_visit[kVisitSlots];  // kMasked: per K load, the visit after it
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an H100 CTA can have");

  struct Params {
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    TmaShape shape_q, shape_k, shape_vt;
    Element* out;
    int64_t o_sb, o_sh, o_si;
    TmaO tma_o;  // kOutViaQ: out as TMA writes it
    float* lse;
    float* lse_lo;
    int heads, group, q_len, kv_len, m_blocks, tiles;
    int* tile_counter;      // zeroed before the launch: dynamic schedule; null: static
    attn::ScoreRule score;  // log2 units; a softcap when score.softcap_post > 0
    const float* sinks;     // [Hq] or null
    bool causal;
    int64_t causal_shift;
    attn::MaskView mask;               // bool, float (a bias), or none
    TmaBias tma_bias;                  // kBiasTile: the mask as (rows, keys, head, batch)
    TmaShape shape_bias;               // its head and batch extents are 1 where it broadcasts
    attn::TileSummaryView mask_tiles;  // kFwdMaskTileRows x fwd_key_tile(kHeadDim)
    attn::KeyRangeView key_ranges;     // null, or one interval of keys per row
    int head_group;                    // FwdSm90Params::head_group, at least 1
    int batch_heads;                   // batch * heads: tiles / m_blocks
  };
  static_assert(!kMasked || (kBlockM == kFwdMaskTileRows && kBlockN == fwd_key_tile(kHeadDim)),
                "a masked tile is one of the mask summary's tiles");

  static __device__ __forceinline__ TileVisit visit_after(const Params& p, const Tile& t, int n, int lowest) {
    return Mask::visit_after(p, t.batch, t.head, t.m_block, n, lowest);
  }

  // ---- producer ------------------------------------------------------------------------------

  // Every tile, and the end, passes through a Q buffer's q_full with its index and first key tile:
  // the consumers learn what to compute from the producer (the schedule may be dynamic). The walk
  // of a tile starts from visit_after(n_blocks) and stops at the summary's first_visible (below a
  // window or behind padding nothing is visited, and a walk down to 0 held up the last K load).
  static __device__ void produce(const Params& p, SharedStorage& smem, Pipeline& pipe_k, Pipeline& pipe_v) {
    PipelineState write_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_v = cutlass::make_producer_start_state<Pipeline>();
    int q_loads = 0, k_loads = 0;
    for (int index = blockIdx.x;;) {
      const int slot = q_loads % kQStages;
      auto& q_full = smem.q_full[slot];
      if (q_loads >= kQStages) {
        smem.q_empty[slot].wait((q_loads / kQStages - 1) & 1);  // that tile's last QK is done
      }
      ++q_loads;
      if (index >= p.tiles) {
        publish_tile(smem, slot, -1, Tile{}, TileVisit{-1, attn::kTileMasked, 0});
        q_full.arrive();
        break;
      }
      const Tile t = Scheduler::tile_at(p, index);
      const int lowest = kMasked ? p.mask_tiles.first_visible_at(t.batch, t.head, t.m_block) : 0;
      const TileVisit first = visit_after(p, t, t.n_blocks, lowest);
      publish_tile(smem, slot, index, t, first);
      if (first.position < 0) {  // no key visible to any row: the consumers write the empty rows alone
        q_full.arrive();
        index = Scheduler::next_tile(p, index);
        continue;
      }
      index = load_tile(p, smem, pipe_k, pipe_v, write_k, write_v, k_loads, t, slot, index, first, lowest);
    }
  }

  // One tile's loads: Q, then the visited key tiles' K and V in the consumers' order over them,
  // n > m > ...: K(n), then K(m), V(n); ...; V(last). Returns the next tile's index (the atomic's
  // latency hides behind the K/V loads).
  static __device__ __forceinline__ int load_tile(const Params& p, SharedStorage& smem, Pipeline& pipe_k,
                                                  Pipeline& pipe_v, PipelineState& write_k, PipelineState& write_v,
                                                  int& k_loads, const Tile& t, int slot, int index,
                                                  const TileVisit& first, int lowest) {
    auto& q_full = smem.q_full[slot];
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutVt{});
    const int kv_head = t.head / p.group;
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q)(_, _, t.head, t.batch);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k)(_, _, kv_head, t.batch);
    Tensor mVt = p.tma_v.get_tma_tensor(p.shape_vt)(_, _, kv_head, t.batch);
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(t.m_block, _0{}));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data() + slot * cosize_v<SmemLayoutQ>), SmemLayoutQ{});
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));    // (N, D, n)
    Tensor gVt = local_tile(mVt, Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(_0{}, _));  // (D, N, n)
    auto cta_q = p.tma_q.get_slice(_0{});
    auto cta_k = p.tma_k.get_slice(_0{});
    auto cta_v = p.tma_v.get_slice(_0{});
    Tensor tQgQ = group_modes<0, 3>(cta_q.partition_S(gQ));
    Tensor tQsQ = group_modes<0, 3>(cta_q.partition_D(sQ));
    Tensor tKgK = group_modes<0, 3>(cta_k.partition_S(gK));   // (TMA, n)
    Tensor tKsK = group_modes<0, 3>(cta_k.partition_D(sK));   // (TMA, stage)
    Tensor tVgV = group_modes<0, 3>(cta_v.partition_S(gVt));  // (TMA, n)
    Tensor tVsV = group_modes<0, 3>(cta_v.partition_D(sVt));  // (TMA, stage)

    // The bias's tiles of this tile's rows (kBiasTile; its head and batch where it has them).
    Tensor sBias = make_tensor(make_smem_ptr(smem.bias.data()), SmemLayoutBias{});
    auto cta_bias = p.tma_bias.get_slice(_0{});
    Tensor tBsB = group_modes<0, 3>(cta_bias.partition_D(sBias));  // (TMA, stage)
    auto bias_tile = [&](int n) {
      Tensor mBias = bias_plane(p.tma_bias, p.shape_bias, t.head, t.batch);
      Tensor gBias = local_tile(mBias, Shape<Int<kBlockM>, Int<kBlockN>>{}, make_coord(t.m_block, n));
      return group_modes<0, 3>(cta_bias.partition_S(gBias));
    };

    // K of key tile `visit`, with `after`, the visit that follows it; a mixed tile's bias tile
    // (kBiasTile) rides K's stage and mbarrier (its bytes expected before either copy starts).
    auto load_k = [&](const TileVisit& visit, const TileVisit& after) {
      if constexpr (kMasked) {
        write_visit(smem.next_visit[k_loads % kVisitSlots], after);
        ++k_loads;
      }
      pipe_k.producer_acquire(write_k);
      auto* barrier = pipe_k.producer_get_barrier(write_k);
      const bool with_bias = kBiasTile && visit.tile_class == attn::kTileMixed;
      if (with_bias) {
        cutlass::arch::ClusterTransactionBarrier::expect_transaction(barrier, kBytesBias);
      }
      copy(p.tma_k.with(*barrier, 0, TMA::CacheHintSm90::EVICT_LAST), tKgK(_, visit.position),
           tKsK(_, write_k.index()));
      if (with_bias) {
        copy(p.tma_bias.with(*barrier, 0, TMA::CacheHintSm90::EVICT_FIRST), bias_tile(visit.position),
             tBsB(_, write_k.index()));
      }
      ++write_k;
    };
    auto load_v = [&](int n) {
      pipe_v.producer_acquire(write_v);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(write_v), 0, TMA::CacheHintSm90::EVICT_LAST), tVgV(_, n),
           tVsV(_, write_v.index()));
      ++write_v;
    };

    q_full.arrive_and_expect_tx(kBytesQ);
    copy(p.tma_q.with(reinterpret_cast<uint64_t&>(q_full), 0, TMA::CacheHintSm90::EVICT_FIRST), tQgQ, tQsQ);
    const int next = Scheduler::next_tile(p, index);
    int n = first.position;
    TileVisit after = visit_after(p, t, n, lowest);
    load_k(first, after);
    for (int m = after.position; m >= 0; n = m, m = after.position) {
      const TileVisit visit = after;
      after = visit_after(p, t, m, lowest);
      load_k(visit, after);
      load_v(n);
    }
    load_v(n);
    return next;
  }

  // The store stays before the q_full arrive (release; the consumers' wait acquires): CUTLASS's
  // barrier asm has no memory clobber, so the compiler is told here.
  // The tile's coordinates go with it: the consumers would otherwise each repeat tile_at's
  // divisions at every tile's start, before its first product.
  static __device__ __forceinline__ void publish_tile(SharedStorage& smem, int slot, int index, const Tile& t,
                                                      const TileVisit& first) {
    *reinterpret_cast<volatile int*>(&smem.tile_index[slot]) = index;
    volatile int* coordinates = reinterpret_cast<volatile int*>(&smem.tile[slot]);
    coordinates[0] = t.m_block, coordinates[1] = t.head, coordinates[2] = t.batch, coordinates[3] = t.n_blocks;
    write_visit(smem.first_visit[slot], first);
  }

  // ---- consumers -----------------------------------------------------------------------------

  // One consumer thread's rows of a tile: row_in_tile + 8 r (r = 0, 1) of the tile's kBlockM, with
  // the last key each sees (MaskRows::last_keys).
  struct ThreadRows {
    int row_in_tile;
    int64_t tile_row0, row0;
    int last_key[2];
  };

  // With a softcap the scores are softcapped in log2 units before the mask (the score rule of
  // every kernel, attn::ScoreRule); without, the softmax scales the raw dot products itself.
  // (Read from the parameters at each use rather than held in registers: the D = 64 consumers
  // have none to spare.) A float mask (kBias) is a bias added after the softcap, in natural units:
  // its scores are taken to natural units before the masks and the softmax subtracts the row max
  // before the change of base, so that a row of huge biases (finfo.min) cancels exactly.
  static __device__ __forceinline__ bool capped(const Params& p) {
    return p.score.softcap_post > 0.0f;
  }
  // The softmax's unit: the scale taking the scores to log2 units.
  static __device__ __forceinline__ float unit(const Params& p) {
    return kBias ? attn::kLog2e : (capped(p) ? 1.0f : p.score.scale);
  }

  // The ping-pong: consumer warpgroup w issues its products in its turn (barrier kFwdTurn + w),
  // then passes the turn to the next one's barrier.
  static __device__ __forceinline__ void take_turn(int turn_barrier) {
    if constexpr (kPingPong) {
      named_barrier_sync(turn_barrier, 256);
    }
  }
  static __device__ __forceinline__ void pass_turn(int next_turn_barrier) {
    if constexpr (kPingPong) {
      named_barrier_arrive(next_turn_barrier, 256);
    }
  }

  // The element tests of key tile n's scores, after the score rule and a float mask's values:
  // causality and kv_len (where the tile reaches past them), and the mask's bits `keep`.
  template <class FragS>
  static __device__ __forceinline__ void score_rule_and_mask(FragS& s, const Params& p, const SharedStorage& smem,
                                                             const Tile& t, const ThreadRows& rows, int n,
                                                             uint64_t keep, uint8_t tile_class, int k_stage, int lane) {
    if (capped(p)) {
      p.score.softcap_all<decltype(size(s))::value>(raw_pointer_cast(s.data()));
    }
    if constexpr (kBias) {
      const float to_natural = capped(p) ? attn::kLn2 : p.score.natural_scale;
      if (kBiasTile && tile_class == attn::kTileMixed) {
        add_bias_tile(s, smem, k_stage, to_natural, rows.row_in_tile, lane);
      } else {
#pragma unroll
        for (int i = 0; i < decltype(size(s))::value; ++i) {
          s(i) *= to_natural;
        }
        if (!kBiasTile && tile_class == attn::kTileMixed) {
          MaskRows::add_bias(s, p, t, n, rows.row0, lane);
        }
      }
    }
    MaskRows::mask_scores(s, p, n, keep, rows.tile_row0, rows.last_key, lane);
  }

  // kBiasTile: a mixed tile's bias values (in shared memory, in K's stage) added to this thread's
  // scores as they go to natural units (s to_natural + bias). The thread's scores are an
  // accumulator fragment: rows row_in_tile and + 8, keys 8 c + 2 (lane % 4) and + 1, element
  // e + 2 r + 4 c. ldmatrix (not transposed) hands out that layout: its four 8 x 8 blocks j (row
  // addresses from lanes 8 j .. 8 j + 7) are rows + 8 (j % 2) of keys 16 m + 8 (j / 2), elements
  // 8 m + 2 j and + 1, so one call gives elements 8 m .. 8 m + 7 (against eight 4-byte loads). A
  // block's eight 16-byte rows sit in distinct banks (the 128-byte swizzle). A -inf element masks
  // its score (set, not added to: a NaN or inf score behind it does not leak). Rows past q_len and
  // keys past kv_len were zero-filled by TMA (their scores are never written, or are -inf after
  // mask_tile).
  template <class FragS>
  static __device__ __forceinline__ void add_bias_tile(FragS& s, const SharedStorage& smem, int stage, float to_natural,
                                                       int row_in_tile, int lane) {
    static_assert(decltype(size(s))::value == kBlockN / 2 && kBlockN % 16 == 0);
    Tensor sBias = make_tensor(make_smem_ptr(smem.bias.data()), SmemLayoutBias{});
    // One address per thread, the others from it: the 128-byte swizzle XORs a row's byte bits 4-6
    // with its row's bits 7-9, so 16 keys on (32 bytes) within a 64-key atom is the address XOR
    // 32 m, and 64 keys on, or a stage on, a multiple of 1024 bytes it leaves as it is.
    using PlainLayout = decltype(get_nonswizzle_portion(SmemLayoutBias{}));
    static_assert(std::is_same_v<decltype(get_swizzle_portion(SmemLayoutBias{})), Swizzle<3, 4, 3>>);
    static_assert(PlainLayout{}(1, 0, 0) * sizeof(Element) == 128 && PlainLayout{}(0, 16, 0) * sizeof(Element) == 32,
                  "128-byte rows of 64 keys");
    constexpr uint32_t kAtomBytes = kBlockN > 64 ? PlainLayout{}(0, 64, 0) * sizeof(Element) : 0;
    constexpr uint32_t kStageBytes = PlainLayout{}(0, 0, 1) * sizeof(Element);
    static_assert(kAtomBytes % 1024 == 0 && kStageBytes % 1024 == 0, "offsets the swizzle leaves alone");
    const int block = lane / 8;
    const int row = row_in_tile - lane / 4 + 8 * (block % 2) + lane % 8;
    const uint32_t address = cast_smem_ptr_to_uint(&sBias(row, 8 * (block / 2), 0)) + stage * kStageBytes;
#pragma unroll
    for (int m = 0; m < kBlockN / 16; ++m) {
      cutlass::AlignedArray<Element, 8> values;
      ldmatrix_x4((address ^ (32 * (m % 4))) + (m / 4) * kAtomBytes, reinterpret_cast<uint32_t(&)[4]>(values));
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float bias = static_cast<float>(values[e]);
        const int i = 8 * m + e;
        s(i) = bias == -INFINITY ? -INFINITY : fmaf(s(i), to_natural, bias);
      }
    }
  }

  // The output of a tile through its Q buffer (kOutViaQ; every wgmma reading the buffer has
  // completed): each warpgroup's rows finished and rounded into its own 64 rows of it by stmatrix,
  // then one thread of the warpgroup (the one this returns true to) stores them by TMA (rows past
  // q_len lie outside the tensor: TMA leaves them). The others release the buffer to the producer
  // at once; that one once the copy has read it (StagedRelease), a tile later.
  template <class FragO>
  static __device__ __forceinline__ bool store_staged(const Params& p, const Tile& t, Element* q_buffer, const FragO& o,
                                                      const typename Epilogue::Rows& ends, int mma_thread, int wg) {
    Tensor staged = make_fragment_like<Element>(o);
    Epilogue::rounded(o, ends, staged);
    R2SCopyO r2s;
    auto thr = r2s.get_slice(mma_thread);
    copy(r2s, thr.retile_S(staged), thr.partition_D(make_tensor(make_smem_ptr(q_buffer), SmemLayoutQ{})));
    cutlass::arch::fence_view_async_shared();  // the stores, visible to TMA
    named_barrier_sync(kFwdOStaged + wg, 128);
    if (mma_thread % 128 != 0) {
      return false;
    }
    Tensor sO = make_tensor(make_smem_ptr(q_buffer + wg * Traits::kWgRowsOffset), SmemLayoutOWg{});
    Tensor gO = local_tile(p.tma_o.get_tma_tensor(p.shape_q)(_, _, t.head, t.batch), Shape<_64, Int<kHeadDim>>{},
                           make_coord(t.m_block * kMmaWGs + wg, _0{}));
    auto cta = p.tma_o.get_slice(_0{});
    copy(p.tma_o, cta.partition_S(sO), cta.partition_D(gO));
    tma_store_arrive();
    return true;
  }

  // The storing thread's release of its last tile's Q buffer, deferred until the next tile's first
  // product is issued (or its epilogue, or the end), so that its warp does not wait for the copy at
  // the tile's end (against waiting at once, within the runs' spread: S=512 causal 0.122 / 0.123
  // ms, full 0.146 / 0.146, in two runs).
  struct StagedRelease {
    int slot = -1;  // the buffer whose release is pending, or -1
    __device__ __forceinline__ void hold(int buffer) {
      slot = buffer;
    }
    __device__ __forceinline__ void settle(SharedStorage& smem) {
      if (slot >= 0) {
        tma_store_wait<0>();
        smem.q_empty[slot].arrive();
        slot = -1;
      }
    }
  };

  // The tiles the producer publishes, one after the other: S = Q K^T, the mask, the online
  // softmax and O += P V over each tile's visited key tiles, then the epilogue.
  static __device__ void consume(const Params& p, SharedStorage& smem, Pipeline& pipe_k, Pipeline& pipe_v) {
    const int mma_thread = threadIdx.x - 128;
    const int wg = mma_thread / 128;
    const int lane = threadIdx.x % 32;
    const int warp_in_wg = (mma_thread % 128) / 32;
    Tensor sK = smem_tensor(smem.k.data(), SmemLayoutK{});
    Tensor sVt = smem_tensor(smem.v.data(), SmemLayoutVt{});
    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    auto wg_qk = mma_qk.get_slice(wg * 128);
    auto wg_pv = mma_pv.get_slice(wg * 128);
    Tensor tSrK = wg_qk.partition_fragment_B(sK);                                      // (MMA, 1, D / 16, stage)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);                                     // (MMA, 1, N / 16, stage)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});   // ((2, 2, N / 8), 1, 1)
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // ((2, 2, D / 8), 1, 1)
    Tensor tOrP = make_tensor<Element>(typename Traits::RegLayoutP{});                 // P as the A operand of P V
    static_assert(decltype(size(tSrS))::value == kBlockN / 2 && decltype(size(tOrP))::value == kBlockN / 2);
    static_assert(decltype(size(tOrO))::value == kHeadDim / 2);

    PipelineState read_k, read_v;
    int q_loads = 0, k_reads = 0;
    // The visit after key tile n, read once K of tile n has landed (the producer wrote it with
    // that load); without a mask the walk is every tile down to 0.
    auto visit_after_load = [&](int n) -> TileVisit {
      if constexpr (kMasked) {
        return read_visit(smem.next_visit[k_reads++ % kVisitSlots]);
      } else {
        return TileVisit{n - 1, attn::kTileVisible, 0};
      }
    };
    StagedRelease staged_release;  // kOutViaQ
    const int turn_barrier = kFwdTurn + wg;
    const int next_turn_barrier = kFwdTurn + (wg + 1) % kMmaWGs;
    if constexpr (kPingPong) {
      if (wg == kMmaWGs - 1) {  // warpgroup 0 goes first
        named_barrier_arrive(kFwdTurn, 256);
      }
    }

    for (;;) {
      const int slot = q_loads % kQStages;
      smem.q_full[slot].wait((q_loads / kQStages) & 1);
      ++q_loads;
      asm volatile("" ::: "memory");
      const int index = *reinterpret_cast<volatile int*>(&smem.tile_index[slot]);
      if (index < 0) {
        if constexpr (kOutViaQ) {
          staged_release.settle(smem);
        }
        break;
      }
      const TileVisit first = read_visit(smem.first_visit[slot]);
      auto& q_empty = smem.q_empty[slot];
      Tensor tSrQ = wg_qk.partition_fragment_A(  // (MMA, 1, D / 16) descriptors
          make_tensor(make_smem_ptr(smem.q.data() + slot * cosize_v<SmemLayoutQ>), SmemLayoutQ{}));
      const volatile int* published = reinterpret_cast<volatile int*>(&smem.tile[slot]);
      const Tile t{published[0], published[1], published[2], published[3]};
      ThreadRows rows;
      rows.row_in_tile = 64 * wg + 16 * warp_in_wg + lane / 4;
      rows.row0 = int64_t{t.m_block} * kBlockM + rows.row_in_tile;
      MaskRows::last_keys(p, rows.row0, rows.last_key);
      float row_max[2], row_sum[2], correction[2];  // the rows' online softmax (softmax.cuh)
      Softmax::start(row_max, row_sum);
      clear(tOrO);
      rows.tile_row0 = int64_t{t.m_block} * kBlockM;
      // The mask's bits of a key tile (all set unless the tile is mixed or diagonal) are gathered
      // before its products are issued, one tile ahead, so their latency stays off the path from
      // one product to the next.
      auto tile_bits = [&](int n, uint8_t tile_class, int diagonal) {
        return MaskRows::tile_bits(p, t, n, tile_class, diagonal, rows.row_in_tile, rows.row0, lane);
      };

      const int n = first.position;
      if (n < 0) {
        if constexpr (!kOutViaQ) {
          q_empty.arrive();
        }
      } else {
        // The first visited key tile: S, mask, softmax.
        const uint64_t keep = tile_bits(n, first.tile_class, first.diagonal);
        take_turn(turn_barrier);
        pipe_k.consumer_wait(read_k);
        TileVisit after = visit_after_load(n);
        wgmma_batch<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        pass_turn(next_turn_barrier);
        if constexpr (kOutViaQ) {
          staged_release.settle(smem);
        }
        int m = after.position;
        uint64_t keep_m = m >= 0 ? tile_bits(m, after.tile_class, after.diagonal) : ~uint64_t{0};
        uint8_t class_m = after.tile_class;
        warpgroup_wait<0>();
        PipelineState held_k = read_k;  // kBiasTile: the stage holds the bias until score_rule_and_mask
        ++read_k;
        if constexpr (!kBiasTile) {
          pipe_k.consumer_release(held_k);
        }
        if (m < 0 && !kOutViaQ) {
          q_empty.arrive();
        }
        score_rule_and_mask(tSrS, p, smem, t, rows, n, keep, first.tile_class, held_k.index(), lane);
        if constexpr (kBiasTile) {
          pipe_k.consumer_release(held_k);
        }
        Softmax::step(tSrS, row_max, row_sum, correction, unit(p));
        convert_fragment<Element>(tSrS, tOrP);
        // Each further tile m: S of tile m is issued before P V of tile n, the one before it.
        while (m >= 0) {
          take_turn(turn_barrier);
          pipe_k.consumer_wait(read_k);
          after = visit_after_load(m);
          wgmma_batch<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
          pipe_v.consumer_wait(read_v);
          wgmma_batch<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
          pass_turn(next_turn_barrier);
          const int next = after.position;
          const uint64_t keep_next = next >= 0 ? tile_bits(next, after.tile_class, after.diagonal) : ~uint64_t{0};
          const uint8_t class_next = after.tile_class;
          warpgroup_wait<1>();  // S done, P V may still run
          held_k = read_k;
          ++read_k;
          if constexpr (!kBiasTile) {
            pipe_k.consumer_release(held_k);
          }
          if (next < 0 && !kOutViaQ) {
            q_empty.arrive();  // the tile's last read of Q
          }
          score_rule_and_mask(tSrS, p, smem, t, rows, m, keep_m, class_m, held_k.index(), lane);
          if constexpr (kBiasTile) {
            pipe_k.consumer_release(held_k);
          }
          Softmax::step(tSrS, row_max, row_sum, correction, unit(p));
          warpgroup_wait<0>();
          pipe_v.consumer_release(read_v);
          ++read_v;
          Softmax::rescale(tOrO, correction);
          convert_fragment<Element>(tSrS, tOrP);
          m = next;
          keep_m = keep_next;
          class_m = class_next;
        }
        take_turn(turn_barrier);
        pipe_v.consumer_wait(read_v);
        wgmma_batch<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        pass_turn(next_turn_barrier);
        warpgroup_wait<0>();
        pipe_v.consumer_release(read_v);
        ++read_v;
      }
      if constexpr (kOutViaQ) {
        const typename Epilogue::Rows ends = Epilogue::finish(p, t, row_max, row_sum, unit(p), rows.row0, lane);
        staged_release.settle(smem);  // a tile without visits
        if (store_staged(p, t, smem.q.data() + slot * cosize_v<SmemLayoutQ>, tOrO, ends, mma_thread, wg)) {
          staged_release.hold(slot);
        } else {
          q_empty.arrive();
        }
      } else {
        Epilogue::store(p, t, tOrO, row_max, row_sum, unit(p), rows.row0, lane);
      }
    }
  }
};

// The forward kernel: a persistent grid of CTAs (PersistentTileScheduler).
template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1) fwd_kernel(const __grid_constant__ typename Kernel::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto& smem = shared_storage<typename Kernel::SharedStorage>();
  const bool producer = in_producer_warpgroup();

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (Kernel::kOutViaQ) {
      cute::prefetch_tma_descriptor(p.tma_o.get_tma_descriptor());
    }
    if constexpr (Kernel::kBiasTile) {
      cute::prefetch_tma_descriptor(p.tma_bias.get_tma_descriptor());
    }
    for (int s = 0; s < Kernel::kQStages; ++s) {
      smem.q_full[s].init(1);
      smem.q_empty[s].init(Kernel::kMmaThreads);
    }
  }
  const auto pipe_params =
      tma_pipeline_params<typename Kernel::Pipeline>(Kernel::kBytesKV, producer, Kernel::kMmaThreads);
  // The constructors initialise the barriers (warp 0) and fence the initialisation.
  typename Kernel::Pipeline pipe_k(smem.pipe_k, pipe_params, ClusterShape{});
  typename Kernel::Pipeline pipe_v(smem.pipe_v, pipe_params, ClusterShape{});
  __syncthreads();

  run_roles<Kernel::kProducerRegs, Kernel::kConsumerRegs>(
      producer, [&] { Kernel::produce(p, smem, pipe_k, pipe_v); }, [&] { Kernel::consume(p, smem, pipe_k, pipe_v); });
#endif
}

}  // namespace detail

// Host: builds the TMA descriptors and launches one variant. Returns the launch error.
template <typename T, class Config, bool kMasked, bool kBias = false, bool kBiasTile = false>
cudaError_t launch_fwd_variant(const FwdSm90Params& a, cudaStream_t stream) {
  using namespace cute;
  using Element = typename CutlassElement<T>::type;
  using Kernel = detail::Fwd<Element, Config, kMasked, kBias, kBiasTile>;
  constexpr int D = Config::kHeadDim;
  typename Kernel::Params p;
  using detail::tma_dim_stride;
  const int64_t v_plane = int64_t{a.kv_len} * a.v_si;
  p.shape_q = make_shape(int32_t{a.q_len}, int32_t{D}, int32_t{a.heads}, int32_t{a.batch});
  p.shape_k = make_shape(int32_t{a.kv_len}, int32_t{D}, int32_t{a.kv_heads}, int32_t{a.batch});
  p.shape_vt = make_shape(int32_t{D}, int32_t{a.kv_len}, int32_t{a.kv_heads}, int32_t{a.batch});
  Tensor mQ = detail::tma_view<Element>(a.q, a.batch, a.heads, a.q_len, D, a.q_sb, a.q_sh, a.q_si);
  Tensor mK = detail::tma_view<Element>(a.k, a.batch, a.kv_heads, a.kv_len, D, a.k_sb, a.k_sh, a.k_si);
  // V as (head dim, keys, head, batch): V^T's layout in shared memory.
  Tensor mVt = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.v)), p.shape_vt,
                           make_stride(_1{}, a.v_si, tma_dim_stride(a.kv_heads, a.v_sh, v_plane),
                                       tma_dim_stride(a.batch, a.v_sb, v_plane * a.kv_heads)));
  p.tma_q =
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Kernel::SmemLayoutQ{}, Shape<Int<Config::kBlockM>, Int<D>>{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Kernel::SmemLayoutK{}),
                          Shape<Int<Config::kBlockN>, Int<D>>{}, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename Kernel::SmemLayoutVt{}),
                          Shape<Int<D>, Int<Config::kBlockN>>{}, _1{});
  p.out = static_cast<Element*>(a.out);
  p.o_sb = a.o_sb, p.o_sh = a.o_sh, p.o_si = a.o_si;
  if constexpr (Kernel::kOutViaQ) {
    // TMA writes out, as attention_fwd_sm90_rejects asks of every call (rows_aligned_16).
    if (!detail::tma_writable<Element>(a.out, a.batch, a.heads, a.o_sb, a.o_sh, a.o_si)) {
      return cudaErrorInvalidValue;
    }
    p.tma_o = detail::tma_store_view<Element, typename Kernel::SmemLayoutOWg, Shape<_64, Int<D>>>(
        a.out, a.batch, a.heads, a.q_len, D, a.o_sb, a.o_sh, a.o_si);
  }
  p.lse = a.lse;
  p.lse_lo = a.lse_lo;
  p.heads = a.heads;
  p.group = a.heads / a.kv_heads;
  p.q_len = a.q_len;
  p.kv_len = a.kv_len;
  p.m_blocks = (a.q_len + Config::kBlockM - 1) / Config::kBlockM;
  const int64_t tiles = int64_t{p.m_blocks} * a.heads * a.batch;
  if (tiles == 0) {
    return cudaSuccess;
  }
  if (tiles > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  p.tiles = static_cast<int>(tiles);
  p.score = a.score;
  p.sinks = a.sinks;
  p.causal = a.causal;
  p.causal_shift = a.causal_shift;
  p.mask = a.mask;
  if constexpr (kBiasTile) {  // the mask as TMA reads it (bias_tile_fits), broadcast dims of extent 1
    Tensor mBias = detail::tma_bias_view<Element>(a.mask, a.batch, a.heads, a.q_len, a.kv_len);
    p.shape_bias = mBias.shape();
    p.tma_bias = make_tma_copy(SM90_TMA_LOAD{}, mBias, take<0, 2>(typename Kernel::SmemLayoutBias{}),
                               Shape<Int<Config::kBlockM>, Int<Config::kBlockN>>{}, _1{});
  }
  p.mask_tiles = a.mask_tiles;
  p.key_ranges = a.key_ranges;
  p.tile_counter = a.tile_counter;
  p.batch_heads = a.heads * a.batch;
  const int grid = a.max_ctas > 0 ? std::min(p.tiles, a.max_ctas) : p.tiles;
  // K and V bytes per (batch, query head): a kv head's, shared by heads / kv_heads query heads.
  const int64_t kv_bytes = int64_t{2} * a.kv_len * Config::kHeadDim * sizeof(Element) * a.kv_heads / a.heads;
  p.head_group =
      a.head_group > 0 ? a.head_group : fwd_head_group(p.m_blocks, p.batch_heads, grid, kv_bytes, a.l2_bytes);

  auto kernel = &detail::fwd_kernel<Kernel>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) {
    return err;
  }
  // With a tile counter, the kernel on the stream just before this one is its zeroing (the
  // caller's at::zeros): a programmatic dependency lets this launch start and run up to its first
  // counter read (next_tile's wait) while that kernel finishes, which hides most of the gap
  // between the two. Everything before the zeroing has completed when it starts.
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned int>(grid));
  config.blockDim = dim3(Kernel::kThreads);
  config.dynamicSmemBytes = Kernel::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = p.tile_counter != nullptr && kProgrammaticLaunches ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, p);
}

// The masked variant of a bool mask or a float one (kBias).
template <typename T, class Config>
cudaError_t launch_fwd_masked(const FwdSm90Params& a, cudaStream_t stream) {
  return a.mask.is_bias() ? launch_fwd_variant<T, Config, true, true>(a, stream)
                          : launch_fwd_variant<T, Config, true, false>(a, stream);
}

// The variant with the mask's code when a.mask_tiles holds a summary (cudaErrorInvalidValue for
// a tile shape that does not match the summary's tiles: only the standalone check has those).
template <typename T, class Config>
cudaError_t launch_fwd_config(const FwdSm90Params& a, cudaStream_t stream) {
  if (a.mask_tiles.ptr == nullptr) {
    return launch_fwd_variant<T, Config, false>(a, stream);
  }
  if constexpr (Config::kBlockN == fwd_key_tile(Config::kHeadDim) && Config::kBlockM == kFwdMaskTileRows) {
    return launch_fwd_masked<T, Config>(a, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T, int kHeadDim>
cudaError_t launch_attention_fwd_sm90(const FwdSm90Params& params, cudaStream_t stream) {
  if (params.mask_tiles.ptr == nullptr) {
    using Default = typename DefaultFwdConfig<kHeadDim>::type;
    using ShortCausal = typename ShortCausalFwdConfig<kHeadDim>::type;
    if constexpr (!std::is_same_v<ShortCausal, Default>) {
      if (params.causal && params.q_len <= kShortCausalFwdLen && params.kv_len <= kShortCausalFwdLen) {
        return launch_fwd_variant<T, ShortCausal, false>(params, stream);
      }
    }
    return launch_fwd_variant<T, Default, false>(params, stream);
  }
  if (params.mask.is_bias() && bias_tile_fits<T>(params.mask)) {
    return launch_fwd_variant<T, typename BiasFwdConfig<kHeadDim>::type, true, true, true>(params, stream);
  }
  return launch_fwd_masked<T, typename MaskedFwdConfig<kHeadDim>::type>(params, stream);
}

}  // namespace safeattn::cuda::hopper
