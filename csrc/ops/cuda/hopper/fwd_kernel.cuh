// The sm_90a (Hopper) forward of safeattn::attention on CuTe: TMA loads, wgmma, warp
// specialisation. Built only with -gencode=arch=compute_90a,code=sm_90a (wgmma, setmaxnreg);
// instantiated once per (head dim, dtype) in hopper/attention_fwd_sm90_d<D>_<dtype>.cu. Semantics:
// ops/attention.h; what it is given: hopper/fwd_params.h.
//
// One CTA = 1 producer warpgroup + kMmaWGs consumer warpgroups, persistent over the output tiles
// (kBlockM query rows of one (batch, head); consumer warpgroup w owns rows [64w, 64w + 64)).
//   schedule  tiles in (batch, head)-major order, longest causal rows first within a head; CTA c
//             starts with tile c, then takes the next from an atomic counter (causal: unequal
//             tiles stay balanced, and the running tiles share a few heads' K/V in L2) or, with
//             no counter, tile + grid. The producer publishes each tile index (-1: done) with Q's
//             mbarrier, so the consumers follow it.
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
//   epilogue  O / l rounded to 16 bits, stored from registers through out's strides; lse and
//             lse_lo (the rounding error of lse) per row, the sink logit added to the
//             denominator where there are sinks (attn::finish_row, as in every kernel).
//   softcap   when given, each tile's scores go through the shared score rule (attn::ScoreRule:
//             softcap * tanh(scale * dot / softcap), log2 units) before the mask.
// setmaxnreg moves registers from the producer warpgroup to the consumers.
//
// Numerics: a row's running max starts at -inf and its exponent offset is 0 while the max is
// -inf, so a row whose scores are all -inf gets p = 0 (never exp2(-inf + inf) = NaN) and ends
// with out 0 (written as 0 even if a V behind it held NaN), lse -inf, lse_lo 0. The max uses
// fmaxf (drops NaN) but a NaN score gives p = NaN, so NaN reaches out and lse. Masked elements
// are set to -inf, never added to, so nothing behind them leaks.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "ops/cuda/hopper/fwd_params.h"
#include "ops/cuda/hopper/tile_order.h"

namespace safeattn::cuda::hopper {

// ---- configuration ------------------------------------------------------------------------------

// Tile shape and schedule of one kernel variant. Shared memory: Q kBlockM x D, K and V kStages x
// kBlockN x D each (16-bit); registers per consumer thread: S kBlockN / 2, O D / 2, P kBlockN / 4.
template <int kHeadDim_, int kBlockN_, int kStages_, int kMmaWGs_, bool kPingPong_, int kQStages_ = 2>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMmaWGs = kMmaWGs_;
  static constexpr int kBlockM = 64 * kMmaWGs_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kPingPong = kPingPong_;
  // Q buffers: with 2 the next tile's Q loads while the current one is still in use.
  static constexpr int kQStages = kQStages_;
};

// The variant each head dim runs (measured on an H100, benchmarks/notes_attention_cuda.md).
template <int kHeadDim>
struct DefaultFwdConfig;
template <>
struct DefaultFwdConfig<64> {
  using type = FwdConfig<64, 128, 4, 3, true>;  // 192-row tiles: 3 consumer warpgroups
};
template <>
struct DefaultFwdConfig<96> {  // 64-byte swizzled rows; 3 warpgroups spill 168 bytes and halve the speed
  using type = FwdConfig<96, 128, 2, 2, true>;
};
template <>
struct DefaultFwdConfig<128> {
  using type = FwdConfig<128, 128, 2, 2, true>;
};
// Q (128 x 256, 64 KB) has one buffer and K and V two stages of 64 keys (64 KB each): 192 KB,
// 224 with the bias tiles; registers per consumer thread: O 128, S 32, P 16.
template <>
struct DefaultFwdConfig<256> {
  using type = FwdConfig<256, fwd_key_tile(256), 2, 2, true, 1>;
};
// With a mask (the kMasked variant): at D = 64, two consumer warpgroups of 232 registers, since
// the mask's bits and addresses do not fit beside three warpgroups' 160 (168 bytes of spills).
template <int kHeadDim>
struct MaskedFwdConfig {
  using type = typename DefaultFwdConfig<kHeadDim>::type;
};
template <>
struct MaskedFwdConfig<64> {
  using type = FwdConfig<64, 128, 4, 2, true>;
};
// With a bias read through shared memory (the kBiasTile variant: a 128 x key tile 16-bit tile per
// K stage, 32 KB each for 128 keys): two K/V stages, and at D = 128 one Q buffer, to stay within
// 227 KB (D = 256 has one already).
template <int kHeadDim>
struct BiasFwdConfig {
  using type = FwdConfig<kHeadDim, 128, 2, 2, true>;
};
template <>
struct BiasFwdConfig<128> {
  using type = FwdConfig<128, 128, 2, 2, true, 1>;
};
template <>
struct BiasFwdConfig<256> {
  using type = DefaultFwdConfig<256>::type;
};

template <typename T>
struct CutlassElement;
template <>
struct CutlassElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<__half> {
  using type = cutlass::half_t;
};

namespace detail {

using namespace cute;

// Named barriers 1.. (0 is __syncthreads): the ping-pong turn of consumer warpgroup w is barrier
// 1 + w, shared by w (sync) and its predecessor (arrive).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The parameters of a TMA pipeline of one CTA (cluster 1x1x1): `bytes` land per stage, thread 0
// leads the producer side, `consumers` threads release each stage.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipeline_params(uint32_t bytes, bool producer, int consumers) {
  typename Pipeline::Params params;
  params.transaction_bytes = bytes;
  params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumers;
  return params;
}

__device__ __forceinline__ float exp2_approx(float x) {  // ex2.approx.ftz: -inf -> 0, NaN -> NaN
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2_approx(float x) {  // lg2.approx.ftz: 0 -> -inf
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A tile the walk over a mask summary visits: its position in the walk's order (outside the walk's
// range: the walk has ended), class and, for a kTileDiagonal one, its diagonal. In both kernels the
// producer walks and hands each visit to the consumers through shared memory with a load's
// mbarrier (arrive: release, wait: acquire), so their loop reads no summary.
struct TileVisit {
  int position, tile_class, diagonal;
};
__device__ __forceinline__ void write_visit(TileVisit& slot, const TileVisit& v) {
  auto& out = reinterpret_cast<volatile TileVisit&>(slot);
  out.position = v.position;
  out.tile_class = v.tile_class;
  out.diagonal = v.diagonal;
  asm volatile("" ::: "memory");  // before the mbarrier arrive that publishes it
}
__device__ __forceinline__ TileVisit read_visit(const TileVisit& slot) {
  asm volatile("" ::: "memory");  // after the mbarrier wait that published it
  const auto& in = reinterpret_cast<const volatile TileVisit&>(slot);
  return TileVisit{in.position, in.tile_class, in.diagonal};
}

// Issues a wgmma batch C (+)= A B over the K blocks and commits it; the caller waits.
template <bool kZeroInit, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_batch(Mma& mma, TA const& a, TB const& b, TC& c) {
  constexpr bool kRegsA = !cute::is_base_of<GMMA::DescriptorIterator, typename Mma::FrgTypeA>::value;
  if constexpr (kRegsA) {
    warpgroup_fence_operand(const_cast<TA&>(a));
  }
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) {
    mma.accumulate_ = GMMA::ScaleOut::Zero;
  }
#pragma unroll
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegsA) {
    warpgroup_fence_operand(const_cast<TA&>(a));
  }
}

// The 16-bit K-major / MN-major shared-memory atom with the widest swizzle that divides the
// contiguous extent (128-byte swizzle for head dims that are multiples of 64).
template <typename Element, int kRowElements>
auto k_major_atom() {
  if constexpr (kRowElements % 64 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kRowElements % 32 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}
template <typename Element, int kColElements>
auto mn_major_atom() {
  if constexpr (kColElements % 64 == 0) {
    return GMMA::Layout_MN_SW128_Atom<Element>{};
  } else if constexpr (kColElements % 32 == 0) {
    return GMMA::Layout_MN_SW64_Atom<Element>{};
  } else {
    return GMMA::Layout_MN_SW32_Atom<Element>{};
  }
}

// kMasked: the variant that reads a mask and its summary; the other has none of that code (the
// mask's gathers cost the unmasked kernel registers it cannot spare). kBias: the mask is a float
// one, whose values are added in natural units; a bool mask's kernel has none of that code (as a
// runtime branch it cost the bool rows 7%: H100, D = 128, 0.453 against 0.423 ms). kBiasTile: the
// float mask has the kernel's element type and TMA's layout (bias_tile_fits), and its mixed tiles
// arrive by TMA with K, into shared memory, instead of being gathered from global memory.
template <typename Element_, class Config, bool kMasked_ = false, bool kBias_ = false, bool kBiasTile_ = false>
struct Fwd {
  using Element = Element_;
  static constexpr bool kMasked = kMasked_;
  static constexpr bool kBias = kBias_;
  static constexpr bool kBiasTile = kBiasTile_;
  static_assert(kMasked || !kBias, "a bias is a mask");
  static_assert(kBias || !kBiasTile, "a bias tile is a bias");
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
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kBlockN <= 256);

  // wgmma: each consumer warpgroup computes 64 rows. S = Q K^T: both operands K-major in shared
  // memory. O = P V: P (A) from registers, V^T (B, N = head dim) MN-major in shared memory.
  using AtomLayout = Layout<Shape<Int<kMmaWGs>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(), AtomLayout{}));
  using TiledMmaPV =
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              AtomLayout{}));

  using SmemLayoutQ = decltype(tile_to_shape(k_major_atom<Element, kHeadDim>(), Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK =
      decltype(tile_to_shape(k_major_atom<Element, kHeadDim>(), Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T: (head dim, keys, stage), head dim contiguous, as V is in global memory.
  using SmemLayoutVt = decltype(tile_to_shape(mn_major_atom<Element, kHeadDim>(),
                                              Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // Global tensors as TMA sees them: (rows, head dim, head, batch), 32-bit sizes, 64-bit strides.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQK = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideVt = Stride<_1, int64_t, int64_t, int64_t>;  // V viewed as (head dim, keys, head, batch)
  using TmaQ = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
      SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
      take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideVt{}),
      take<0, 2>(SmemLayoutVt{}), Shape<Int<kHeadDim>, Int<kBlockN>>{}, _1{}));
  // kBiasTile: the bias's (rows, keys) tile of each K stage, 128-byte swizzled rows (a thread's
  // reads of its accumulator elements then meet no bank conflict).
  using SmemLayoutBias =
      decltype(tile_to_shape(k_major_atom<Element, kBlockN>(), Shape<Int<kBlockM>, Int<kBlockN>, Int<kStages>>{}));
  using TmaBias = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
      take<0, 2>(SmemLayoutBias{}), Shape<Int<kBlockM>, Int<kBlockN>>{}, _1{}));
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
    TileVisit first_visit[kQStages];    // the tile's first visited key tile, published with its index
    TileVisit next_visit[kVisitSlots];  // kMasked: per K load, the visit after it
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an H100 CTA can have");

  struct Params {
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    ShapeQKV shape_q, shape_k, shape_vt;
    Element* out;
    int64_t o_sb, o_sh, o_si;
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
    ShapeQKV shape_bias;               // its head and batch extents are 1 where it broadcasts
    attn::TileSummaryView mask_tiles;  // kFwdMaskTileRows x fwd_key_tile(kHeadDim)
    attn::KeyRangeView key_ranges;     // null, or one interval of keys per row
    int head_group;                    // FwdParams::head_group, at least 1
    int batch_heads;                   // batch * heads: tiles / m_blocks
  };
  static_assert(!kMasked || (kBlockM == kFwdMaskTileRows && kBlockN == fwd_key_tile(kHeadDim)),
                "a masked tile is one of the mask summary's tiles");

  // ---- the tile schedule ---------------------------------------------------------------------

  struct Tile {
    int m_block, head, batch;
    int n_blocks;  // key tiles to visit: [0, n_blocks)
  };

  static __device__ __forceinline__ Tile tile_at(const Params& p, int index) {
    Tile t;
    int bh;
    if (p.causal || kMasked) {
      // Causal (or masked, which is mostly causal): the longest rows first, so that short tiles
      // fill the tail (tile_order.h).
      const TileRank r = longest_first(index, p.m_blocks, p.batch_heads, p.head_group);
      bh = r.head;
      t.m_block = p.m_blocks - 1 - r.rank;
    } else {
      bh = index / p.m_blocks;
      t.m_block = index - bh * p.m_blocks;
    }
    t.head = bh % p.heads;
    t.batch = bh / p.heads;
    int64_t kv_end = p.kv_len;
    if (p.causal) {
      const int64_t q_end = std::min<int64_t>(int64_t{t.m_block + 1} * kBlockM, p.q_len);
      kv_end = std::min<int64_t>(std::max<int64_t>(q_end + p.causal_shift, 0), p.kv_len);
    }
    t.n_blocks = static_cast<int>((kv_end + kBlockN - 1) / kBlockN);
    return t;
  }

  // The mask summary's class of key tile n for the tile's rows (the summary's tiles are the
  // kernel's), and its diagonal when it is kTileDiagonal.
  static __device__ __forceinline__ uint8_t key_tile_class(const Params& p, const Tile& t, int n, int& diagonal) {
    const uint8_t tile_class = p.mask_tiles.at(t.batch, t.head, t.m_block, n);
    if (tile_class == attn::kTileDiagonal) {
      diagonal = p.mask_tiles.diagonal_at(t.batch, t.head, t.m_block, n);
    }
    return tile_class;
  }

  // The key tile visited after tile n: the nearest one below n that the mask summary does not
  // rule out (position -1: none), with its class and diagonal. The walk of a tile starts from
  // visit_after(n_blocks) and stops at `lowest`, the row's lowest visible key tile (the summary's
  // first_visible: below a window or behind padding nothing is visited, and a walk down to 0
  // held up the last K load); only the producer walks a mask's summary.
  static __device__ __forceinline__ TileVisit visit_after(const Params& p, const Tile& t, int n, int lowest) {
    TileVisit v{n - 1, attn::kTileVisible, 0};
    if constexpr (kMasked) {
      for (; v.position >= lowest; --v.position) {
        v.tile_class = key_tile_class(p, t, v.position, v.diagonal);
        if (v.tile_class != attn::kTileMasked) {
          return v;
        }
      }
      v.position = -1;
    }
    return v;
  }

  // ---- producer ------------------------------------------------------------------------------

  static __device__ void produce(const Params& p, SharedStorage& smem, Pipeline& pipe_k, Pipeline& pipe_v) {
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutVt{});
    PipelineState write_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_v = cutlass::make_producer_start_state<Pipeline>();
    int q_loads = 0, k_loads = 0;
    for (int index = blockIdx.x;;) {
      // Every tile, and the end, passes through a Q buffer's q_full with its index and first key
      // tile: the consumers learn what to compute from the producer (the schedule may be dynamic).
      const int slot = q_loads % kQStages;
      auto& q_full = smem.q_full[slot];
      if (q_loads >= kQStages) {
        smem.q_empty[slot].wait((q_loads / kQStages - 1) & 1);  // that tile's last QK is done
      }
      ++q_loads;
      if (index >= p.tiles) {
        publish_tile(smem, slot, -1, TileVisit{-1, attn::kTileMasked, 0});
        q_full.arrive();
        break;
      }
      const Tile t = tile_at(p, index);
      const int lowest = kMasked ? p.mask_tiles.first_visible_at(t.batch, t.head, t.m_block) : 0;
      const TileVisit first = visit_after(p, t, t.n_blocks, lowest);
      publish_tile(smem, slot, index, first);
      int n = first.position;
      if (n < 0) {  // no key visible to any row: the consumers write the empty rows alone
        q_full.arrive();
        index = next_tile(p, index);
        continue;
      }
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
        Tensor mBias = p.tma_bias.get_tma_tensor(p.shape_bias)(_, _, get<2>(p.shape_bias) == 1 ? 0 : t.head,
                                                               get<3>(p.shape_bias) == 1 ? 0 : t.batch);
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
      const int next = next_tile(p, index);  // the atomic's latency hides behind the K/V loads
      // The consumers' order over the visited tiles n > m > ...: K(n), then K(m), V(n); ...; V(last).
      TileVisit after = visit_after(p, t, n, lowest);
      load_k(first, after);
      for (int m = after.position; m >= 0; n = m, m = after.position) {
        const TileVisit visit = after;
        after = visit_after(p, t, m, lowest);
        load_k(visit, after);
        load_v(n);
      }
      load_v(n);
      index = next;
    }
  }

  // The store stays before the q_full arrive (release; the consumers' wait acquires): CUTLASS's
  // barrier asm has no memory clobber, so the compiler is told here.
  static __device__ __forceinline__ void publish_tile(SharedStorage& smem, int slot, int index,
                                                      const TileVisit& first) {
    *reinterpret_cast<volatile int*>(&smem.tile_index[slot]) = index;
    write_visit(smem.first_visit[slot], first);
  }

  // Dynamic: tiles in order (head-major, longest rows first under causal), each taken by the
  // first CTA free, so the CTAs finish together and the running tiles share a few heads' K/V.
  // The kernel may start while the counter's zeroing still runs (the launch's programmatic
  // dependency): the wait returns once that kernel is done (at once after the first time, and
  // on a launch without the dependency).
  static __device__ __forceinline__ int next_tile(const Params& p, int index) {
    if (p.tile_counter == nullptr) {
      return index + static_cast<int>(gridDim.x);
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    return static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1);
  }

  // ---- consumers -----------------------------------------------------------------------------

  // One consumer thread's rows: r = 0, 1 -> row 16 * warp + lane / 4 + 8 r of its warpgroup's 64.
  // Accumulator element e + 2 r + 4 c (c < N / 8) is column 8 c + 2 (lane % 4) + e.
  // last_key[r]: the last key row r sees (causality and kv_len folded in, clamped to int range).
  // One compare with a constant and one select per element: the diagonal tiles cost little more
  // than the others.
  template <class FragS>
  static __device__ __forceinline__ void mask_tile(FragS& s, int n_block, const int (&last_key)[2], int lane) {
    constexpr int kCols = kBlockN / 8;
    const int col0 = n_block * kBlockN + 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int limit = last_key[r] - col0;  // element (c, e) is visible iff 8 c + e <= limit
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (8 * c + e > limit) {
            s(e + 2 * r + 4 * c) = -INFINITY;
          }
        }
      }
    }
  }

  // The bool mask's elements of key tile n_block for this thread's accumulator elements, one bit
  // each (set: visible), eight loads in flight, ANDed with the rows' key intervals where there
  // are any; the consumers gather a tile's bits while the products of the tile before it run.
  // Rows past q_len and keys past kv_len keep their bit (the first are never written, the second
  // are -inf already). P and T: this kernel's Params and Tile, or those of the backward's dQ pass
  // (hopper/bwd_dq_kernel.cuh: the same fields, the same 64 x kBlockN fragment per warpgroup).
  template <class P, class T>
  static __device__ __forceinline__ uint64_t gather_mask(const P& p, const T& t, int n_block, int64_t row0, int lane) {
    constexpr int kElems = kBlockN / 2;
    static_assert(kElems <= 64);
    const int col0 = n_block * kBlockN + 2 * (lane % 4);
    const int64_t last_row = p.q_len - 1 - row0;
    uint64_t keep = ~uint64_t{0};
    // Every load is unconditional (indices clamped into the mask, the bounds applied after), so
    // that the unrolled loads are all in flight at once: a conditional load waits for its test,
    // and one L2 round trip per element made a mixed tile cost about ten plain ones. A float
    // mask's bits are its elements that are not -inf (add_bias adds the values).
    auto gather = [&](const auto* mask) {
      mask += p.mask.offset(t.batch, t.head, row0, 0);
#pragma unroll 8
      for (int i = 0; i < kElems; ++i) {
        const int r = (i / 2) % 2, col = col0 + 8 * (i / 4) + i % 2;  // element e + 2 r + 4 c
        const int64_t row = 8 * r < last_row ? 8 * r : last_row;
        const bool visible =
            attn::visible(mask[row * p.mask.stride_q + (col < p.kv_len ? col : p.kv_len - 1) * p.mask.stride_kv]);
        if (!visible && 8 * r <= last_row && col < p.kv_len) {
          keep &= ~(uint64_t{1} << i);
        }
      }
    };
    if (!kBiasTile && p.mask.ptr != nullptr) {  // kBiasTile: add_bias_tile masks the -inf elements
      p.mask.with_elements(gather);
    }
    if (p.key_ranges.ptr != nullptr) {
      int lo[2], hi[2];  // the interval of this thread's two rows
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = row0 + (8 * r < last_row ? 8 * r : last_row);
        lo[r] = p.key_ranges.lo(t.batch, row);
        hi[r] = p.key_ranges.hi(t.batch, row);
      }
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        const int r = (i / 2) % 2, col = col0 + 8 * (i / 4) + i % 2;
        if (col < lo[r] || col >= hi[r]) {
          keep &= ~(uint64_t{1} << i);
        }
      }
    }
    return keep;
  }

  // A float mask's values of key tile n_block added to this thread's scores (natural units), for
  // the mixed tiles of a float mask (its -inf elements are masked after, by gather_mask's bits: a
  // select per add here spilled 270 bytes at D = 128). Loads as in gather_mask: clamped indices,
  // unconditional, then added; rows past q_len and keys past kv_len read an element inside the
  // mask (their scores are never written, or are -inf after mask_tile).
  template <class FragS, class P, class T>
  static __device__ __forceinline__ void add_bias(FragS& s, const P& p, const T& t, int n_block, int64_t row0,
                                                  int lane) {
    constexpr int kElems = kBlockN / 2;
    const int col0 = n_block * kBlockN + 2 * (lane % 4);
    const int64_t last_row = p.q_len - 1 - row0;
    const int64_t base = p.mask.offset(t.batch, t.head, row0, 0);
    p.mask.with_values([&](const auto* mask) {
      mask += base;
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        const int r = (i / 2) % 2, col = col0 + 8 * (i / 4) + i % 2;  // element e + 2 r + 4 c
        const int64_t row = 8 * r < last_row ? 8 * r : last_row;
        const float bias =
            attn::to_float(mask[row * p.mask.stride_q + (col < p.kv_len ? col : p.kv_len - 1) * p.mask.stride_kv]);
        s(i) += bias;
      }
    });
  }

  // kBiasTile: a mixed tile's bias values (in shared memory, in K's stage) added to this thread's
  // scores (natural units), two adjacent keys per 4-byte read. A -inf element masks its score (set,
  // not added to: a NaN or inf score behind it does not leak). Rows past q_len and keys past
  // kv_len were zero-filled by TMA (their scores are never written, or are -inf after mask_tile).
  template <class FragS>
  static __device__ __forceinline__ void add_bias_tile(FragS& s, const SharedStorage& smem, int stage, int row_in_tile,
                                                       int lane) {
    Tensor sBias = make_tensor(make_smem_ptr(smem.bias.data()), SmemLayoutBias{});
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < kBlockN / 8; ++c) {
        const auto pair = *reinterpret_cast<const cutlass::AlignedArray<Element, 2>*>(
            &sBias(row_in_tile + 8 * r, 8 * c + 2 * (lane % 4), stage));
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float bias = static_cast<float>(pair[e]);
          const int i = e + 2 * r + 4 * c;  // element e + 2 r + 4 c: column 8 c + 2 (lane % 4) + e
          s(i) = bias == -INFINITY ? -INFINITY : s(i) + bias;
        }
      }
    }
  }

  template <class FragS>
  static __device__ __forceinline__ void apply_mask(FragS& s, uint64_t keep) {
#pragma unroll
    for (int i = 0; i < decltype(size(s))::value; ++i) {
      if (!((keep >> i) & 1u)) {
        s(i) = -INFINITY;
      }
    }
  }

  static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  }
  static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
  }

  // Online softmax over one tile of scores (in s, overwritten by p; `unit` takes them to log2
  // units: the scale for raw dot products, 1 for softcapped scores). Returns the factors that
  // rescale the rows' earlier sums and outputs.
  template <class FragS>
  static __device__ __forceinline__ void softmax_step(FragS& s, float (&row_max)[2], float (&row_sum)[2],
                                                      float (&correction)[2], float unit) {
    constexpr int kCols = kBlockN / 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        m = fmaxf(m, fmaxf(s(2 * r + 4 * c), s(1 + 2 * r + 4 * c)));
      }
      m = quad_max(m);
      // While the max is -inf (nothing visible yet) the offset is 0: p = exp2(-inf) = 0, never NaN.
      // kBias (a float mask; its scores in natural units, unit log2(e)): the max subtracted
      // before the change of base, exact for a row of huge values; one FMA otherwise.
      const float offset = m == -INFINITY ? 0.0f : (kBias ? m : m * unit);
      correction[r] =
          exp2_approx(kBias ? (row_max[r] - offset) * unit : row_max[r] * unit - offset);  // 0 while row_max is -inf
      row_max[r] = m;
      float sum = 0.0f;
      if constexpr (kBias) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = e + 2 * r + 4 * c;
            s(i) = exp2_approx((s(i) - offset) * unit);
            sum += s(i);
          }
        }
      } else {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = e + 2 * r + 4 * c;
            const float x = fmaf(s(i), unit, -offset);
            s(i) = exp2_approx(x);
            sum += s(i);
          }
        }
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;  // this thread's columns only, until the end
    }
  }

  template <class FragO>
  static __device__ __forceinline__ void rescale(FragO& o, const float (&correction)[2]) {
#pragma unroll
    for (int i = 0; i < size(o); ++i) {
      o(i) *= correction[(i / 2) % 2];
    }
  }

  template <class FragS, class FragP>
  static __device__ __forceinline__ void convert_p(const FragS& s, FragP& p) {
    constexpr int kN = decltype(size(s))::value;
    cutlass::NumericArrayConverter<Element, float, kN> convert;
    *reinterpret_cast<cutlass::Array<Element, kN>*>(raw_pointer_cast(p.data())) =
        convert(*reinterpret_cast<const cutlass::Array<float, kN>*>(raw_pointer_cast(s.data())));
  }

  static __device__ void consume(const Params& p, SharedStorage& smem, Pipeline& pipe_k, Pipeline& pipe_v) {
    const int mma_thread = threadIdx.x - 128;
    const int wg = mma_thread / 128;
    const int lane = threadIdx.x % 32;
    const int warp_in_wg = (mma_thread % 128) / 32;
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutVt{});
    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    auto wg_qk = mma_qk.get_slice(wg * 128);
    auto wg_pv = mma_pv.get_slice(wg * 128);
    Tensor tSrK = wg_qk.partition_fragment_B(sK);                                      // (MMA, 1, D / 16, stage)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);                                     // (MMA, 1, N / 16, stage)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});   // ((2, 2, N / 8), 1, 1)
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // ((2, 2, D / 8), 1, 1)
    // P as the A operand of O += P V: k block kb holds accumulator elements [8 kb, 8 kb + 8) of S.
    Tensor tOrP = make_tensor<Element>(
        Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>{});
    static_assert(decltype(size(tSrS))::value == kBlockN / 2 && decltype(size(tOrP))::value == kBlockN / 2);
    static_assert(decltype(size(tOrO))::value == kHeadDim / 2);

    PipelineState read_k, read_v;
    int q_loads = 0, k_reads = 0;
    // With a softcap the scores are softcapped in log2 units before the mask (the score rule of
    // every kernel, attn::ScoreRule); without, the softmax scales the raw dot products itself.
    // (Read from the parameters at each use rather than held in registers: the D = 64 consumers
    // have none to spare.)
    // A float mask (kBias) is a bias added after the softcap, in natural units: its scores are
    // taken to natural units before the masks and the softmax subtracts the row max before the
    // change of base, so that a row of huge biases (finfo.min) cancels exactly.
    auto capped = [&] { return p.score.softcap_post > 0.0f; };
    // The softmax's unit: the scale taking tSrS to log2 units.
    auto unit = [&] { return kBias ? attn::kLog2e : (capped() ? 1.0f : p.score.scale); };
    // The visit after key tile n, read once K of tile n has landed (the producer wrote it with
    // that load); without a mask the walk is every tile down to 0.
    auto visit_after_load = [&](int n) -> TileVisit {
      if constexpr (kMasked) {
        return read_visit(smem.next_visit[k_reads++ % kVisitSlots]);
      } else {
        return TileVisit{n - 1, attn::kTileVisible, 0};
      }
    };
    const int turn_barrier = 1 + wg;
    const int next_turn_barrier = 1 + (wg + 1) % kMmaWGs;
    auto take_turn = [&] {
      if constexpr (kPingPong) {
        named_barrier_sync(turn_barrier, 256);
      }
    };
    auto pass_turn = [&] {
      if constexpr (kPingPong) {
        named_barrier_arrive(next_turn_barrier, 256);
      }
    };
    if constexpr (kPingPong) {
      if (wg == kMmaWGs - 1) {  // warpgroup 0 goes first
        named_barrier_arrive(1, 256);
      }
    }

    for (;;) {
      const int slot = q_loads % kQStages;
      smem.q_full[slot].wait((q_loads / kQStages) & 1);
      ++q_loads;
      asm volatile("" ::: "memory");
      const int index = *reinterpret_cast<volatile int*>(&smem.tile_index[slot]);
      if (index < 0) {
        break;
      }
      const TileVisit first = read_visit(smem.first_visit[slot]);
      auto& q_empty = smem.q_empty[slot];
      Tensor tSrQ = wg_qk.partition_fragment_A(  // (MMA, 1, D / 16) descriptors
          make_tensor(make_smem_ptr(smem.q.data() + slot * cosize_v<SmemLayoutQ>), SmemLayoutQ{}));
      const Tile t = tile_at(p, index);
      const int row_in_tile = 64 * wg + 16 * warp_in_wg + lane / 4;
      const int64_t row0 = int64_t{t.m_block} * kBlockM + row_in_tile;
      int last_key[2];  // the last key each row sees, in [-1, kv_len - 1]
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t causal_last = p.causal ? row0 + 8 * r + p.causal_shift : int64_t{p.kv_len};
        last_key[r] = static_cast<int>(std::max<int64_t>(std::min<int64_t>(causal_last, p.kv_len - 1), -1));
      }
      float row_max[2] = {-INFINITY, -INFINITY};  // in the units of the scores in tSrS
      float row_sum[2] = {0.0f, 0.0f};
      float correction[2];
      clear(tOrO);
      const int64_t tile_row0 = int64_t{t.m_block} * kBlockM;
      // Key tile n tests elements when it reaches past kv_len or past the first row's limit.
      auto needs_mask = [&](int n) {
        const int64_t tile_last_key = int64_t{n + 1} * kBlockN - 1;
        return tile_last_key >= p.kv_len || (p.causal && tile_last_key > tile_row0 + p.causal_shift);
      };

      // The mask's bits of key tile n (all set unless the tile is mixed), gathered before its
      // products are issued; then the element tests of its scores: causality and kv_len
      // (needs_mask), and the mask's bits.
      // A diagonal tile's bits are a compare: element e + 2 r + 4 c (column 8 c + 2 (lane % 4) + e
      // of the tile, row row_in_tile + 8 r) is visible iff column <= row + diagonal.
      auto mask_bits = [&](int n, uint8_t tile_class, int diagonal) -> uint64_t {
        if constexpr (kMasked) {
          if (tile_class == attn::kTileDiagonal) {
            uint64_t keep = 0;
#pragma unroll
            for (int i = 0; i < decltype(size(tSrS))::value; ++i) {
              const int column = 8 * (i / 4) + 2 * (lane % 4) + i % 2, row = row_in_tile + 8 * ((i / 2) % 2);
              keep |= uint64_t{column <= row + diagonal} << i;
            }
            return keep;
          }
          if (tile_class == attn::kTileMixed) {
            return gather_mask(p, t, n, row0, lane);
          }
        }
        return ~uint64_t{0};
      };
      auto mask_scores = [&](int n, uint64_t keep, uint8_t tile_class, int k_stage) {
        if (capped()) {
          p.score.softcap_all<decltype(size(tSrS))::value>(raw_pointer_cast(tSrS.data()));
        }
        if constexpr (kBias) {
          const float to_natural = capped() ? attn::kLn2 : p.score.natural_scale;
#pragma unroll
          for (int i = 0; i < decltype(size(tSrS))::value; ++i) {
            tSrS(i) *= to_natural;
          }
          if (tile_class == attn::kTileMixed) {
            if constexpr (kBiasTile) {
              add_bias_tile(tSrS, smem, k_stage, row_in_tile, lane);
            } else {
              add_bias(tSrS, p, t, n, row0, lane);
            }
          }
        }
        if (needs_mask(n)) {
          mask_tile(tSrS, n, last_key, lane);
        }
        if constexpr (kMasked) {
          if (~keep != 0) {
            apply_mask(tSrS, keep);
          }
        }
      };

      const int n = first.position;
      if (n < 0) {
        q_empty.arrive();
      } else {
        // The first visited key tile: S, mask, softmax. The next tile's mask bits (global loads)
        // are read while the tile's products run, one tile ahead, so their latency stays off the
        // path from one product to the next.
        const uint64_t keep = mask_bits(n, first.tile_class, first.diagonal);
        take_turn();
        pipe_k.consumer_wait(read_k);
        TileVisit after = visit_after_load(n);
        wgmma_batch<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        pass_turn();
        int m = after.position;
        uint64_t keep_m = m >= 0 ? mask_bits(m, after.tile_class, after.diagonal) : ~uint64_t{0};
        uint8_t class_m = after.tile_class;
        warpgroup_wait<0>();
        PipelineState held_k = read_k;  // kBiasTile: the stage holds the bias until mask_scores
        ++read_k;
        if constexpr (!kBiasTile) {
          pipe_k.consumer_release(held_k);
        }
        if (m < 0) {
          q_empty.arrive();
        }
        mask_scores(n, keep, first.tile_class, held_k.index());
        if constexpr (kBiasTile) {
          pipe_k.consumer_release(held_k);
        }
        softmax_step(tSrS, row_max, row_sum, correction, unit());
        convert_p(tSrS, tOrP);
        // Each further tile m: S of tile m is issued before P V of tile n, the one before it.
        while (m >= 0) {
          take_turn();
          pipe_k.consumer_wait(read_k);
          after = visit_after_load(m);
          wgmma_batch<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
          pipe_v.consumer_wait(read_v);
          wgmma_batch<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
          pass_turn();
          const int next = after.position;
          const uint64_t keep_next = next >= 0 ? mask_bits(next, after.tile_class, after.diagonal) : ~uint64_t{0};
          const uint8_t class_next = after.tile_class;
          warpgroup_wait<1>();  // S done, P V may still run
          held_k = read_k;
          ++read_k;
          if constexpr (!kBiasTile) {
            pipe_k.consumer_release(held_k);
          }
          if (next < 0) {
            q_empty.arrive();  // the tile's last read of Q
          }
          mask_scores(m, keep_m, class_m, held_k.index());
          if constexpr (kBiasTile) {
            pipe_k.consumer_release(held_k);
          }
          softmax_step(tSrS, row_max, row_sum, correction, unit());
          warpgroup_wait<0>();
          pipe_v.consumer_release(read_v);
          ++read_v;
          rescale(tOrO, correction);
          convert_p(tSrS, tOrP);
          m = next;
          keep_m = keep_next;
          class_m = class_next;
        }
        take_turn();
        pipe_v.consumer_wait(read_v);
        wgmma_batch<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        pass_turn();
        warpgroup_wait<0>();
        pipe_v.consumer_release(read_v);
        ++read_v;
      }
      store_tile(p, t, tOrO, row_max, row_sum, unit(), row0, lane);
    }
  }

  template <class FragO>
  static __device__ __forceinline__ void store_tile(const Params& p, const Tile& t, FragO& o, const float (&row_max)[2],
                                                    float (&row_sum)[2], float unit, int64_t row0, int lane) {
    const int64_t bh = int64_t{t.batch} * p.heads + t.head;
    Element* out = p.out + t.batch * p.o_sb + t.head * p.o_sh;
    const float sink = p.sinks != nullptr ? p.sinks[t.head] * (kBias ? 1.0f : attn::kLog2e) : 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const int64_t row = row0 + 8 * r;
      if (row >= p.q_len) {
        continue;
      }
      // The row's max in log2 units (natural units with a float mask) is the exponent offset
      // softmax_step used (the same product);
      // finish_row adds the sink and gives lse, lse_lo and the normaliser (0 for an empty row).
      const bool empty = sum == 0.0f;
      const attn::RowEnd end =
          attn::finish_row(kBias ? row_max[r] : row_max[r] * unit, sum, p.sinks != nullptr, sink, kBias);
      Element* out_row = out + row * p.o_si + 2 * (lane % 4);
#pragma unroll
      for (int c = 0; c < kHeadDim / 8; ++c) {
        // An empty row is exactly 0 even if a masked V held NaN (0 * NaN in P V).
        const float lo = empty ? 0.0f : o(2 * r + 4 * c) * end.factor;
        const float hi = empty ? 0.0f : o(1 + 2 * r + 4 * c) * end.factor;
        cutlass::AlignedArray<Element, 2> pair;  // one 4-byte store
        pair[0] = Element(lo);
        pair[1] = Element(hi);
        *reinterpret_cast<cutlass::AlignedArray<Element, 2>*>(out_row + 8 * c) = pair;
      }
      if (lane % 4 == 0) {
        p.lse[bh * p.q_len + row] = end.lse;
        if (p.lse_lo != nullptr) {
          p.lse_lo[bh * p.q_len + row] = end.lse_lo;
        }
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1) fwd_kernel(const __grid_constant__ typename Kernel::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  auto& smem = *reinterpret_cast<typename Kernel::SharedStorage*>(smem_raw);
  using Pipeline = typename Kernel::Pipeline;
  const int warp = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 32, 0);
  const int warp_group = warp / 4;
  const bool producer = warp_group == 0;

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (Kernel::kBiasTile) {
      cute::prefetch_tma_descriptor(p.tma_bias.get_tma_descriptor());
    }
    for (int s = 0; s < Kernel::kQStages; ++s) {
      smem.q_full[s].init(1);
      smem.q_empty[s].init(Kernel::kMmaThreads);
    }
  }
  const auto pipe_params = tma_pipeline_params<Pipeline>(Kernel::kBytesKV, producer, Kernel::kMmaThreads);
  // The constructors initialise the barriers (warp 0) and fence the initialisation.
  Pipeline pipe_k(smem.pipe_k, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  Pipeline pipe_v(smem.pipe_v, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  __syncthreads();

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegs>();
    if (threadIdx.x == 0) {
      Kernel::produce(p, smem, pipe_k, pipe_v);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegs>();
    Kernel::consume(p, smem, pipe_k, pipe_v);
  }
#endif
}

}  // namespace detail

// Host: builds the TMA descriptors and launches one variant. Returns the launch error.
template <typename T, class Config, bool kMasked, bool kBias = false, bool kBiasTile = false>
cudaError_t launch_fwd_variant(const FwdParams& a, cudaStream_t stream) {
  using namespace cute;
  using Element = typename CutlassElement<T>::type;
  using Kernel = detail::Fwd<Element, Config, kMasked, kBias, kBiasTile>;
  constexpr int D = Config::kHeadDim;
  typename Kernel::Params p;
  // A size-1 dim is never stepped over; TMA still wants its stride to be a multiple of 16 bytes.
  auto dim_stride = [](int64_t size, int64_t stride, int64_t fallback) { return size == 1 ? fallback : stride; };
  const int64_t q_plane = int64_t{a.q_len} * a.q_si, k_plane = int64_t{a.kv_len} * a.k_si,
                v_plane = int64_t{a.kv_len} * a.v_si;
  p.shape_q = make_shape(int32_t{a.q_len}, int32_t{D}, int32_t{a.heads}, int32_t{a.batch});
  p.shape_k = make_shape(int32_t{a.kv_len}, int32_t{D}, int32_t{a.kv_heads}, int32_t{a.batch});
  p.shape_vt = make_shape(int32_t{D}, int32_t{a.kv_len}, int32_t{a.kv_heads}, int32_t{a.batch});
  Tensor mQ = make_tensor(
      make_gmem_ptr(static_cast<Element const*>(a.q)), p.shape_q,
      make_stride(a.q_si, _1{}, dim_stride(a.heads, a.q_sh, q_plane), dim_stride(a.batch, a.q_sb, q_plane * a.heads)));
  Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.k)), p.shape_k,
                          make_stride(a.k_si, _1{}, dim_stride(a.kv_heads, a.k_sh, k_plane),
                                      dim_stride(a.batch, a.k_sb, k_plane * a.kv_heads)));
  Tensor mVt = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.v)), p.shape_vt,
                           make_stride(_1{}, a.v_si, dim_stride(a.kv_heads, a.v_sh, v_plane),
                                       dim_stride(a.batch, a.v_sb, v_plane * a.kv_heads)));
  p.tma_q =
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Kernel::SmemLayoutQ{}, Shape<Int<Config::kBlockM>, Int<D>>{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Kernel::SmemLayoutK{}),
                          Shape<Int<Config::kBlockN>, Int<D>>{}, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename Kernel::SmemLayoutVt{}),
                          Shape<Int<D>, Int<Config::kBlockN>>{}, _1{});
  p.out = static_cast<Element*>(a.out);
  p.o_sb = a.o_sb, p.o_sh = a.o_sh, p.o_si = a.o_si;
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
    const attn::MaskView& m = a.mask;
    const int64_t plane = int64_t{a.q_len} * m.stride_q;
    const int32_t heads = m.stride_h == 0 ? 1 : a.heads, batch = m.stride_b == 0 ? 1 : a.batch;
    p.shape_bias = make_shape(int32_t{a.q_len}, int32_t{a.kv_len}, heads, batch);
    Tensor mBias = make_tensor(make_gmem_ptr(static_cast<Element const*>(m.ptr)), p.shape_bias,
                               make_stride(m.stride_q, _1{}, dim_stride(heads, m.stride_h, plane),
                                           dim_stride(batch, m.stride_b, plane * heads)));
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
  config.numAttrs = p.tile_counter != nullptr ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, p);
}

// The masked variant of a bool mask or a float one (kBias).
template <typename T, class Config>
cudaError_t launch_fwd_masked(const FwdParams& a, cudaStream_t stream) {
  return a.mask.is_bias() ? launch_fwd_variant<T, Config, true, true>(a, stream)
                          : launch_fwd_variant<T, Config, true, false>(a, stream);
}

// The variant with the mask's code when a.mask_tiles holds a summary (cudaErrorInvalidValue for
// a tile shape that does not match the summary's tiles: only the standalone check has those).
template <typename T, class Config>
cudaError_t launch_fwd_config(const FwdParams& a, cudaStream_t stream) {
  if (a.mask_tiles.ptr == nullptr) {
    return launch_fwd_variant<T, Config, false>(a, stream);
  }
  if constexpr (Config::kBlockN == fwd_key_tile(Config::kHeadDim) && Config::kBlockM == kFwdMaskTileRows) {
    return launch_fwd_masked<T, Config>(a, stream);
  }
  return cudaErrorInvalidValue;
}

// Whether a float mask can come as TMA tiles (the kBiasTile variant): T's element type, keys
// contiguous, a row stride (no broadcast over the rows) and the other strides multiples of 16
// bytes, a 16-byte aligned start.
template <typename T>
bool bias_tile_fits(const attn::MaskView& m) {
  constexpr attn::MaskKind kind = std::is_same_v<T, __half> ? attn::MaskKind::kHalf : attn::MaskKind::kBFloat16;
  constexpr int64_t kAlign = 16 / sizeof(T);
  return m.kind == kind && m.stride_kv == 1 && m.stride_q != 0 && m.stride_q % kAlign == 0 &&
         m.stride_h % kAlign == 0 && m.stride_b % kAlign == 0 && reinterpret_cast<uintptr_t>(m.ptr) % 16 == 0;
}

template <typename T, int kHeadDim>
cudaError_t launch_attention_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  if (params.mask_tiles.ptr == nullptr) {
    return launch_fwd_variant<T, typename DefaultFwdConfig<kHeadDim>::type, false>(params, stream);
  }
  if (params.mask.is_bias() && bias_tile_fits<T>(params.mask)) {
    return launch_fwd_variant<T, typename BiasFwdConfig<kHeadDim>::type, true, true, true>(params, stream);
  }
  return launch_fwd_masked<T, typename MaskedFwdConfig<kHeadDim>::type>(params, stream);
}

}  // namespace safeattn::cuda::hopper
