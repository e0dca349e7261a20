// The dQ pass of the sm_90a backward, for the head dims where dQ is not summed inside the dK/dV
// kernel (bwd_dq_pass: past 128). Launched by hopper/bwd_kernel.cuh's launcher after the dK/dV
// kernel; built for sm_90a only. Semantics: ops/attention.h; what it is given: hopper/bwd_params.h.
//
// One CTA per (kDqTileRows query rows, query head, batch) = 1 producer warpgroup + 2 consumer
// warpgroups of 64 rows each, the forward's layout (hopper/fwd_kernel.cuh): the key tiles are
// walked from the last visible one down, as the forward walks them, and for each
//   S = Q K^T, dP = dO V^T                  (wgmma, both operands in shared memory)
//   p = exp2(S scale log2(e) - row_shift), dS = scale p (dP - delta)   (as the dK/dV kernel)
//   dQ += dS K                              (wgmma, dS from registers, K^T a view of K)
// and dQ is rounded and stored once at the end: no dq_accum, no atomics, so it is deterministic.
// The mask code per element is the forward's (Fwd::mask_tile, gather_mask, add_bias: the same
// 64 x kBlockN score fragment per warpgroup), the walk the forward's over a summary of this
// kernel's tiles (BwdParams::dq_mask_tiles).
//   shared memory  Q and dO (kDqTileRows x D each, loaded once with the rows' row_shift, delta and
//                  row_lo), K in two stages, V in one: at D = 256 64 + 64 + 64 + 32 KB. V's one
//                  stage is refilled once dP is done and is needed again only by the next dP,
//                  after that tile's S and this one's dQ product; K is read by both S and dQ.
//   registers      per consumer thread: dQ D / 2, S and dP kBlockN / 2 each.
// Numerics as in the dK/dV kernel: masked elements get s = -inf so p = 0; a row with no visible
// key has row_shift +inf (every p 0) and gets dQ = 0; rows past q_len are zero-filled by TMA,
// have row_shift +inf and delta 0, and are not written.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/cuda/hopper/bwd_params.h"
#include "ops/cuda/hopper/fwd_kernel.cuh"

namespace safeattn::cuda::hopper {
namespace detail {

using namespace cute;

// (rows, head dim, head, batch) as TMA reads a [B, H, L, D] tensor: 32-bit sizes, 64-bit strides
// (a size-1 dim is never stepped over, but TMA still wants its stride a multiple of 16 bytes).
using TmaShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using TmaStride = Stride<int64_t, _1, int64_t, int64_t>;
template <typename Element>
auto tma_view(const void* ptr, int batch, int heads, int len, int head_dim, int64_t sb, int64_t sh, int64_t si) {
  auto dim_stride = [](int64_t size, int64_t stride, int64_t fallback) { return size == 1 ? fallback : stride; };
  const int64_t plane = int64_t{len} * si;
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                     make_shape(int32_t{len}, int32_t{head_dim}, int32_t{heads}, int32_t{batch}),
                     make_stride(si, _1{}, dim_stride(heads, sh, plane), dim_stride(batch, sb, plane * heads)));
}

// What both backward kernels (the dK/dV kernel, hopper/bwd_kernel.cuh, and the dQ pass below)
// read of BwdParams, into their Params (fields of the same names): TMA descriptors of Q and dO
// (and dO's clean copy) as kBlockM x D tiles laid out as smem_q, of K and V as kBlockN x D tiles
// laid out as smem_kv; the rows pre-pass's arrays; sizes, score rule, causality, mask and key ranges.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, class KernelParams, class SmemQ, class SmemKV>
void set_bwd_inputs(KernelParams& p, const BwdParams& a, const SmemQ& smem_q, const SmemKV& smem_kv) {
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
  static constexpr bool kMasked = kMasked_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kBias = kBias_;
  static_assert(!kBias || (kMasked && !kSoftcap), "a bias is a mask, without a softcap");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kDqTileRows;
  static constexpr int kBlockN = bwd_key_tile(kHeadDim);
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

  // The forward kernel of this tile shape (128 rows, kBlockN keys, two consumer warpgroups): its
  // wgmma shapes, Q's layout and its per-element mask code serve this kernel as they are.
  using Forward = Fwd<Element, FwdConfig<kHeadDim, kBlockN, 2, kMmaWGs, false, 1>, kMasked, kBias>;
  static_assert(Forward::kBlockM == kBlockM);
  // S = Q K^T and dP = dO V^T: the forward's S (M = query rows, N = keys, K = head dim, K-major).
  using TiledMmaS = typename Forward::TiledMmaQK;
  // dQ += dS K: the forward's O += P V, dS from registers as P, K^T (N = head dim, K = keys, head
  // dim contiguous) as V^T.
  using TiledMmadQ = typename Forward::TiledMmaPV;
  using SmemLayoutQ = typename Forward::SmemLayoutQ;
  template <int kStages>
  using SmemLayoutKV =
      decltype(tile_to_shape(k_major_atom<Element, kHeadDim>(), Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutK = SmemLayoutKV<kKStages>;
  using SmemLayoutV = SmemLayoutKV<kVStages>;
  // K's bytes seen as K^T (head dim, keys, stage).
  using SmemLayoutKt =
      decltype(composition(SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kKStages>>{},
                                                      Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));

  using GmemTensor =
      decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), TmaShape{}, TmaStride{}));
  using TmaQ =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutK{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kBytesRows = kBlockM * sizeof(float);
  // Q, dO, row_shift, delta (and row_lo with a bias) on one mbarrier.
  static constexpr uint32_t kBytesQdO = 2 * kBlockM * kHeadDim * sizeof(Element) + (kBias ? 3 : 2) * kBytesRows;
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using PipelineK = cutlass::PipelineTmaAsync<kKStages>;
  using PipelineV = cutlass::PipelineTmaAsync<kVStages>;
  // K load j carries the visit after its key tile in slot j % kVisitSlots (as in the forward).
  static constexpr int kVisitSlots = kKStages + 1;

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

  struct Params {
    TmaQ tma_q, tma_do;
    TmaQ tma_do_clean;          // grad_out_clean, or grad_out again
    const int* grad_out_dirty;  // null, or nonzero: dO is read through tma_do_clean
    TmaKV tma_k, tma_v;
    TmaShape shape_q, shape_k;
    const float* row_shift;  // [B, Hq, q_pad]
    const float* delta;      // [B, Hq, q_pad]
    const float* row_lo;     // [B, Hq, q_pad] (kBias only)
    Element* grad_q;
    int64_t dq_sb, dq_sh, dq_si;
    int heads, group, q_len, q_pad, kv_len, m_blocks;
    attn::ScoreRule score;  // log2 units; a softcap when score.softcap_post > 0
    bool causal;
    int64_t causal_shift;
    attn::MaskView mask;               // bool, float (a bias), or none
    attn::TileSummaryView mask_tiles;  // kDqTileRows x kBlockN (BwdParams::dq_mask_tiles)
    attn::KeyRangeView key_ranges;     // null, or one interval of keys per query row
    int head_group;                    // at least 1
  };

  struct Tile {
    int m_block, head, batch;
    int n_blocks;  // key tiles that may be visited: [0, n_blocks)
  };

  // The CTA's tile. The grid is (query tiles, heads, batch), handed out in linear order; under
  // causality (or a mask) read as longest_first's, the longest rows (the last query tiles) first
  // within each group of heads (tile_order.h).
  static __device__ __forceinline__ Tile tile_of(const Params& p) {
    Tile t;
    const int64_t blocks = int64_t{gridDim.x} * gridDim.y * gridDim.z;
    if ((p.causal || kMasked) && blocks <= INT32_MAX) {
      const int linear = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
      const TileRank r =
          longest_first(linear, static_cast<int>(gridDim.x), static_cast<int>(gridDim.y * gridDim.z), p.head_group);
      t.m_block = p.m_blocks - 1 - r.rank;
      t.head = r.head % p.heads;
      t.batch = r.head / p.heads;
    } else {
      t.m_block = static_cast<int>(blockIdx.x);
      t.head = static_cast<int>(blockIdx.y);
      t.batch = static_cast<int>(blockIdx.z);
    }
    int64_t kv_end = p.kv_len;
    if (p.causal) {
      const int64_t q_end = std::min<int64_t>(int64_t{t.m_block + 1} * kBlockM, p.q_len);
      kv_end = std::min<int64_t>(std::max<int64_t>(q_end + p.causal_shift, 0), p.kv_len);
    }
    t.n_blocks = static_cast<int>((kv_end + kBlockN - 1) / kBlockN);
    return t;
  }

  // The key tile visited after tile n (position -1: none): the nearest one below n, at least
  // `lowest`, that the mask summary does not rule out, with its class and diagonal.
  static __device__ __forceinline__ TileVisit visit_after(const Params& p, const Tile& t, int n, int lowest) {
    TileVisit v{n - 1, attn::kTileVisible, 0};
    if constexpr (kMasked) {
      for (; v.position >= lowest; --v.position) {
        v.tile_class = p.mask_tiles.at(t.batch, t.head, t.m_block, v.position);
        if (v.tile_class != attn::kTileMasked) {
          if (v.tile_class == attn::kTileDiagonal) {
            v.diagonal = p.mask_tiles.diagonal_at(t.batch, t.head, t.m_block, v.position);
          }
          return v;
        }
      }
      v.position = -1;
    }
    return v;
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

  static __device__ void consume(const Params& p, const Tile& t, SharedStorage& smem, PipelineK& pipe_k,
                                 PipelineV& pipe_v) {
    const int mma_thread = threadIdx.x - 128;
    const int wg = mma_thread / 128;
    const int lane = threadIdx.x % 32;
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutV{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutKt{});
    TiledMmaS mma_s;
    TiledMmadQ mma_dq;
    auto wg_s = mma_s.get_slice(wg * 128);
    auto wg_dq = mma_dq.get_slice(wg * 128);
    Tensor tSrQ = wg_s.partition_fragment_A(sQ);     // (MMA, 1, D / 16)
    Tensor tSrdO = wg_s.partition_fragment_A(sdO);   // (MMA, 1, D / 16)
    Tensor tSrK = wg_s.partition_fragment_B(sK);     // (MMA, 1, D / 16, stage)
    Tensor tSrV = wg_s.partition_fragment_B(sV);     // (MMA, 1, D / 16, stage)
    Tensor tdQrK = wg_dq.partition_fragment_B(sKt);  // (MMA, 1, N / 16, stage)
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tdPrdP = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    // dS as the A operand of dQ += dS K: k block kb holds accumulator elements [8 kb, 8 kb + 8).
    Tensor tdQrdS = make_tensor<Element>(
        Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>{});
    static_assert(decltype(size(tSrS))::value == kBlockN / 2 && decltype(size(tdQrdS))::value == kBlockN / 2);
    static_assert(decltype(size(tdQrdQ))::value == kHeadDim / 2);
    clear(tdQrdQ);

    // This thread's rows: row_in_tile + 8 r (r = 0, 1); accumulator element i is row (i / 2) % 2,
    // column 8 (i / 4) + 2 (lane % 4) + i % 2 (of the key tile for S, of the head dim for dQ).
    const int row_in_tile = 64 * wg + 16 * ((mma_thread % 128) / 32) + lane / 4;
    const int64_t tile_row0 = int64_t{t.m_block} * kBlockM;
    const int64_t row0 = tile_row0 + row_in_tile;
    int last_key[2];  // the last key each row sees, in [-1, kv_len - 1]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t causal_last = p.causal ? row0 + 8 * r + p.causal_shift : int64_t{p.kv_len};
      last_key[r] = static_cast<int>(std::max<int64_t>(std::min<int64_t>(causal_last, p.kv_len - 1), -1));
    }
    auto needs_mask = [&](int n) {
      const int64_t tile_last_key = int64_t{n + 1} * kBlockN - 1;
      return tile_last_key >= p.kv_len || (p.causal && tile_last_key > tile_row0 + p.causal_shift);
    };
    auto mask_bits = [&](const TileVisit& visit) -> uint64_t {
      if constexpr (kMasked) {
        if (visit.tile_class == attn::kTileDiagonal) {  // a compare: column <= row + diagonal
          uint64_t keep = 0;
#pragma unroll
          for (int i = 0; i < decltype(size(tSrS))::value; ++i) {
            const int column = 8 * (i / 4) + 2 * (lane % 4) + i % 2, row = row_in_tile + 8 * ((i / 2) % 2);
            keep |= uint64_t{column <= row + visit.diagonal} << i;
          }
          return keep;
        }
        if (visit.tile_class == attn::kTileMixed) {
          return Forward::gather_mask(p, t, visit.position, row0, lane);
        }
      }
      return ~uint64_t{0};
    };

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
      const uint64_t keep = mask_bits(visit);
      warpgroup_wait<1>();  // S done, and the tile before's dQ product
      warpgroup_fence_operand(tSrS);
      if (holding_k) {
        pipe_k.consumer_release(held_k);
      }
      // The score rule, the bias, the masks (as the forward's mask_scores), then p.
      if constexpr (kSoftcap) {
        p.score.softcap_all<decltype(size(tSrS))::value>(raw_pointer_cast(tSrS.data()));
      }
      if constexpr (kBias) {
#pragma unroll
        for (int i = 0; i < size(tSrS); ++i) {
          tSrS(i) *= p.score.natural_scale;
        }
        if (visit.tile_class == attn::kTileMixed) {
          Forward::add_bias(tSrS, p, t, n, row0, lane);
        }
      }
      if (needs_mask(n)) {
        Forward::mask_tile(tSrS, n, last_key, lane);
      }
      if constexpr (kMasked) {
        if (~keep != 0) {
          Forward::apply_mask(tSrS, keep);
        }
      }
#pragma unroll
      for (int i = 0; i < size(tSrS); ++i) {
        const int r = (i / 2) % 2;
        if constexpr (kBias) {  // natural units, the shift before the change of base, then row_lo
          tSrS(i) = exp2_approx(fmaf(tSrS(i) - shift[r], attn::kLog2e, -lo[r]));
        } else {
          tSrS(i) = exp2_approx(fmaf(tSrS(i), kSoftcap ? 1.0f : p.score.scale, -shift[r]));
        }
      }
      warpgroup_wait<0>();              // dP done: V's stage can be refilled
      warpgroup_fence_operand(tdPrdP);  // dP's registers are read below, not before the wait
      pipe_v.consumer_release(read_v);
      ++read_v;
      if constexpr (kSoftcap) {
        // d score / d dot = scale (1 - t^2), t = score / softcap_post, the score recovered from
        // p: log2 p + row_shift (p = 0 contributes nothing, whatever its score).
        const float inv_cap = 1.0f / p.score.softcap_post;
#pragma unroll
        for (int i = 0; i < size(tdPrdP); ++i) {
          const int r = (i / 2) % 2;
          const float prob = tSrS(i);
          const float tanh_s = (log2_approx(prob) + shift[r]) * inv_cap;
          const float dscore = prob > 0.0f ? p.score.natural_scale * (1.0f - tanh_s * tanh_s) : 0.0f;
          tdPrdP(i) = dscore * prob * (tdPrdP(i) - delta[r]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < size(tdPrdP); ++i) {
          tdPrdP(i) = p.score.natural_scale * tSrS(i) * (tdPrdP(i) - delta[(i / 2) % 2]);
        }
      }
      Forward::convert_p(tdPrdP, tdQrdS);
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
    Element* dq = p.grad_q + t.batch * p.dq_sb + t.head * p.dq_sh + row0 * p.dq_si + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < size(tdQrdQ); i += 2) {
      const int r = (i / 2) % 2;
      if (row0 + 8 * r < p.q_len) {
        cutlass::AlignedArray<Element, 2> pair;  // one 4-byte store
        pair[0] = Element(tdQrdQ(i));
        pair[1] = Element(tdQrdQ(i + 1));
        *reinterpret_cast<cutlass::AlignedArray<Element, 2>*>(dq + 8 * r * p.dq_si + 8 * (i / 4)) = pair;
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    dq_pass_kernel(const __grid_constant__ typename Kernel::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  auto& smem = *reinterpret_cast<typename Kernel::SharedStorage*>(smem_raw);
  using PipelineK = typename Kernel::PipelineK;
  using PipelineV = typename Kernel::PipelineV;
  const int warp = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 32, 0);
  const bool producer = warp / 4 == 0;
  const typename Kernel::Tile tile = Kernel::tile_of(p);

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do_clean.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    smem.qdo_full.init(1);
  }
  // K and V tiles carry the same byte count.
  const auto k_params = tma_pipeline_params<PipelineK>(Kernel::kBytesKV, producer, Kernel::kMmaThreads);
  const auto v_params = tma_pipeline_params<PipelineV>(Kernel::kBytesKV, producer, Kernel::kMmaThreads);
  // The constructors initialise the barriers (warp 0) and fence the initialisation.
  PipelineK pipe_k(smem.pipe_k, k_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  PipelineV pipe_v(smem.pipe_v, v_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  __syncthreads();

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegs>();
    if (threadIdx.x == 0) {
      Kernel::produce(p, tile, smem, pipe_k, pipe_v);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegs>();
    Kernel::consume(p, tile, smem, pipe_k, pipe_v);
  }
#endif
}

}  // namespace detail

// Host: the dQ pass of one variant (the dK/dV kernel's: mask, softcap, bias) after the dK/dV
// kernel, on the stream. cudaErrorInvalidValue for a mask without its summary for these tiles
// and for more than 65535 query heads (the grid's y).
template <typename T, int kHeadDim, bool kMasked, bool kSoftcap, bool kBias>
cudaError_t launch_bwd_dq_pass(const BwdParams& a, cudaStream_t stream) {
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
