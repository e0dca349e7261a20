// Tile shapes, wgmma atoms, shared-memory layouts and TMA types of the sm_90a attention kernels,
// in one place. Contract: types and compile-time sizes only, no kernel state. A config names the
// sizes a variant was measured with (benchmarks/notes_attention_cuda.md); the traits turn sizes
// into CuTe types. QueryTileTraits serve the kernels whose consumer warpgroups own 64 query rows
// each (the forward, hopper/fwd_kernel.cuh, and the dQ pass, hopper/bwd_dq_kernel.cuh: S = Q K^T
// and a product with P or dS from registers); KeyTileTraits the dK/dV kernel, whose products are
// transposed so that keys are the wgmma M dimension (hopper/bwd_kernel.cuh).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

#include "ops/cuda/hopper/bwd_params.h"
#include "ops/cuda/hopper/fwd_params.h"
#include "ops/cuda/mask_view.cuh"

namespace safeattn::cuda::hopper {

// ---- forward variants ---------------------------------------------------------------------------

// Tile shape and schedule of one forward variant. Shared memory: Q kBlockM x D, K and V kStages x
// kBlockN x D each (16-bit); registers per consumer thread: S kBlockN / 2, O D / 2, P kBlockN / 4.
template <int kHeadDim_, int kBlockN_, int kStages_, int kMmaWGs_, bool kPingPong_, int kQStages_ = 2>
struct FwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMmaWGs = kMmaWGs_;
  static constexpr int kBlockM = 64 * kMmaWGs_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kPingPong = kPingPong_;
  // Q buffers: with 2 the next tile's Q loads while the current one is still in use.
  static constexpr int kQStages = kQStages_;
  // With two, the output of 128 columns or more goes out through the tile's Q buffer by TMA
  // (Fwd::store_staged), and out must suit TMA (16-byte address and strides: launch_fwd_variant
  // refuses others). D = 64 lost there (hopper_fwd_check, H200, ms, registers -> staged: three
  // warpgroups, which spill 72 bytes with it, S=4096 0.569 -> 0.592 full, 0.340 -> 0.359 causal;
  // S=1024 0.182 -> 0.188, 0.145 -> 0.151; two warpgroups S=512 causal 0.094 -> 0.096).
  static constexpr bool kOutViaQ = kQStages_ >= 2 && kHeadDim_ >= 128;
};

// The variant each head dim runs (measured on an H100, benchmarks/notes_attention_cuda.md).
template <int kHeadDim>
struct DefaultFwdConfig;
template <>
struct DefaultFwdConfig<64> {
  using type = FwdTileConfig<64, 128, 4, 3, true>;  // 192-row tiles: 3 consumer warpgroups
};
template <>
struct DefaultFwdConfig<96> {  // 64-byte swizzled rows; 3 warpgroups spill 168 bytes and halve the speed
  using type = FwdTileConfig<96, 128, 2, 2, true>;
};
template <>
struct DefaultFwdConfig<128> {
  using type = FwdTileConfig<128, 128, 2, 2, true>;
};
// Q (128 x 256, 64 KB) has one buffer and K and V two stages of 64 keys (64 KB each): 192 KB,
// 224 with the bias tiles; registers per consumer thread: O 128, S 32, P 16.
template <>
struct DefaultFwdConfig<256> {
  using type = FwdTileConfig<256, fwd_key_tile(256), 2, 2, true, 1>;
};
// With a mask (the kMasked variant): at D = 64, two consumer warpgroups of 232 registers, since
// the mask's bits and addresses do not fit beside three warpgroups' 160 (168 bytes of spills).
template <int kHeadDim>
struct MaskedFwdConfig {
  using type = typename DefaultFwdConfig<kHeadDim>::type;
};
template <>
struct MaskedFwdConfig<64> {
  using type = FwdTileConfig<64, 128, 4, 2, true>;
};
// is_causal without a mask over at most kShortCausalFwdLen queries and keys
// (launch_attention_fwd_sm90) takes the masked variant's shape: at D = 64 two consumer warpgroups
// (128-row tiles) instead of three, whose 192-row tiles leave a ragged last tile and a larger
// diagonal there; the other head dims, their default. hopper_fwd_check, H200, B x S = 16k, bf16,
// causal ms, three -> two: S=512 0.101 -> 0.093 (again later: 0.099 -> 0.094), S=1024 0.146 ->
// 0.131, but S=2048 0.200 -> 0.208 and S=4096 0.332 -> 0.355 (hence the bound); without causality
// three are faster at every length.
template <int kHeadDim>
using ShortCausalFwdConfig = MaskedFwdConfig<kHeadDim>;
constexpr int kShortCausalFwdLen = 1024;  // the most queries and keys a short causal call has
// With a bias read through shared memory (the kBiasTile variant: a 128 x key tile 16-bit tile per
// K stage, 32 KB each for 128 keys): two K/V stages, and at D = 128 one Q buffer, to stay within
// 227 KB (D = 256 has one already).
template <int kHeadDim>
struct BiasFwdConfig {
  using type = FwdTileConfig<kHeadDim, 128, 2, 2, true>;
};
template <>
struct BiasFwdConfig<128> {
  using type = FwdTileConfig<128, 128, 2, 2, true, 1>;
};
template <>
struct BiasFwdConfig<256> {
  using type = DefaultFwdConfig<256>::type;
};

// ---- backward variants --------------------------------------------------------------------------

// How the two consumer warpgroups of the dK/dV kernel share the dQ product of a step (M = query
// rows, K = keys):
//   kdQSplit      both over all the tile's keys, each 64 of 128 rows or a 64-wide head-dim half
//                 (whole 128-byte swizzle rows: head dims that are multiples of 128);
//   kdQAlternate  one over all the keys for whole rows, warpgroup (step % 2): one addition per
//                 step, and the other warpgroup goes on to the next step meanwhile;
//   kdQPass       none: dQ is the dQ pass's (bwd_dq_pass, hopper/bwd_dq_kernel.cuh); dS^T goes to
//                 shared memory only where the dK product reads it there (kSharedKeys).
enum DqMode : int { kdQSplit, kdQAlternate, kdQPass };

// Tile shape of one dK/dV variant. kBlockM query rows per step, kBlockN keys per CTA (64 per
// consumer warpgroup), kStages Q and dO buffers; kDqPass: dQ is the dQ pass's (bwd_dq_pass), not
// this kernel's. Registers per consumer thread: dK and dV D/2 each, S and dP kBlockM/4 each, dQ
// kBlockM * D / 256 (kBlockM * D / 128 when one warpgroup's product covers whole rows; none with
// kDqPass).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kDqPass_ = bwd_dq_pass(kHeadDim_, false)>
struct BwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kDqPass = kDqPass_;
  static_assert(kDqPass || !bwd_dq_pass(kHeadDim, false), "this head dim's dQ is always the dQ pass's");
};

static_assert(kBwdRowPad % 128 == 0, "every kBlockM divides the row padding (bwd_params.h)");

template <int kHeadDim>
struct DefaultBwdConfig;
template <>
struct DefaultBwdConfig<64> {
  using type = BwdTileConfig<64, 64, 128, 2>;
};
template <>
struct DefaultBwdConfig<96> {  // 48 bytes of spills; 348 TFLOP/s causal on an H100
  using type = BwdTileConfig<96, 64, 128, 2>;
};
template <>
struct DefaultBwdConfig<128> {
  using type = BwdTileConfig<128, 64, 128, 2>;
};
// 64 keys shared by the two consumer warpgroups (KeyTileTraits::kSharedKeys); dQ in a pass of its
// own (bwd_dq_pass): added from here by atomics it was half the kernel's time (Q, dO, K, V, P and
// dS fill the shared memory, no room is left for a dQ stage).
template <>
struct DefaultBwdConfig<256> {
  using type = BwdTileConfig<256, 64, bwd_key_tile(256), 2>;
};
// The same tiles without the dQ product, for the dQ pass (deterministic algorithms).
template <class Config>
using DqPassBwdConfig = BwdTileConfig<Config::kHeadDim, Config::kBlockM, Config::kBlockN, Config::kStages, true>;

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

// The 16-bit K-major / MN-major shared-memory atom with the widest swizzle that divides the
// contiguous extent (128-byte swizzle for head dims that are multiples of 64).
template <typename Element, int kContiguous, class SW128, class SW64, class SW32>
using WidestSwizzle =
    std::conditional_t<kContiguous % 64 == 0, SW128, std::conditional_t<kContiguous % 32 == 0, SW64, SW32>>;
template <typename Element, int kRowElements>
auto k_major_atom() {
  return WidestSwizzle<Element, kRowElements, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_K_SW64_Atom<Element>,
                       GMMA::Layout_K_SW32_Atom<Element>>{};
}
template <typename Element, int kColElements>
auto mn_major_atom() {
  return WidestSwizzle<Element, kColElements, GMMA::Layout_MN_SW128_Atom<Element>, GMMA::Layout_MN_SW64_Atom<Element>,
                       GMMA::Layout_MN_SW32_Atom<Element>>{};
}

// A shared-memory buffer seen through one of the layouts below.
template <class T, class Layout>
__device__ __forceinline__ auto smem_tensor(T* data, Layout layout) {
  return make_tensor(make_smem_ptr(data), layout);
}

// (rows, head dim, head, batch) as TMA reads a [B, H, L, D] tensor: 32-bit sizes, 64-bit strides
// (a size-1 dim is never stepped over, but TMA still wants its stride a multiple of 16 bytes).
using TmaShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using TmaStride = Stride<int64_t, _1, int64_t, int64_t>;
inline int64_t tma_dim_stride(int64_t size, int64_t stride, int64_t fallback) {
  return size == 1 ? fallback : stride;
}
template <typename Element>
auto tma_view(const void* ptr, int batch, int heads, int len, int head_dim, int64_t sb, int64_t sh, int64_t si) {
  const int64_t plane = int64_t{len} * si;
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                     make_shape(int32_t{len}, int32_t{head_dim}, int32_t{heads}, int32_t{batch}),
                     make_stride(si, _1{}, tma_dim_stride(heads, sh, plane), tma_dim_stride(batch, sb, plane * heads)));
}
// Whether TMA can write a [B, H, L, D] 16-bit tensor at ptr with these strides (elements): a
// 16-byte aligned start and row, head and batch strides of whole 16 bytes (a dim of extent 1
// takes tma_view's stride); and the TMA store of `TileShape` tiles from `SmemLayout` into it.
template <typename Element>
bool tma_writable(const void* ptr, int batch, int heads, int64_t sb, int64_t sh, int64_t si) {
  auto aligned = [](int64_t stride) { return stride * int64_t{sizeof(Element)} % 16 == 0; };
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && aligned(si) && (heads == 1 || aligned(sh)) &&
         (batch == 1 || aligned(sb));
}
template <typename Element, class SmemLayout, class TileShape>
auto tma_store_view(void* ptr, int batch, int heads, int len, int head_dim, int64_t sb, int64_t sh, int64_t si) {
  Tensor view = tma_view<Element>(ptr, batch, heads, len, head_dim, sb, sh, si);
  return make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(ptr)), view.layout()),
                       SmemLayout{}, TileShape{}, _1{});
}
// A float mask as TMA reads its tiles (the kBiasTile variants, bias_tile_fits): (rows, keys,
// head, batch), a dim the mask broadcasts over of extent 1 (bias_plane picks index 0 there).
template <typename Element>
auto tma_bias_view(const attn::MaskView& m, int batch, int heads, int q_len, int kv_len) {
  const int32_t bias_heads = m.stride_h == 0 ? 1 : heads, bias_batch = m.stride_b == 0 ? 1 : batch;
  const int64_t plane = int64_t{q_len} * m.stride_q;
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(m.ptr)),
                     make_shape(int32_t{q_len}, int32_t{kv_len}, bias_heads, bias_batch),
                     make_stride(m.stride_q, _1{}, tma_dim_stride(bias_heads, m.stride_h, plane),
                                 tma_dim_stride(bias_batch, m.stride_b, plane * bias_heads)));
}
// The (rows, keys) plane of (batch, head) of a mask seen through tma_bias_view's descriptor.
template <class Tma, class Shape4>
__device__ __forceinline__ auto bias_plane(const Tma& tma_bias, const Shape4& shape_bias, int head, int batch) {
  return tma_bias.get_tma_tensor(shape_bias)(_, _, get<2>(shape_bias) == 1 ? 0 : head,
                                             get<3>(shape_bias) == 1 ? 0 : batch);
}
// A float mask's tiles in shared memory: (rows, keys, stage), keys contiguous in 128-byte
// swizzled rows as TMA writes them. The forward reads two adjacent keys of a row per thread, the
// dK/dV kernel eight rows of one key chunk per ldmatrix lane group: the swizzle puts the eight
// 16-byte pieces in distinct banks for both (no bank conflict).
template <typename Element, int kRows, int kKeys, int kStages>
using SmemLayoutBiasTile =
    decltype(tile_to_shape(k_major_atom<Element, kKeys>(), Shape<Int<kRows>, Int<kKeys>, Int<kStages>>{}));

// ldmatrix of four 8 x 8 blocks of 16-bit elements: lanes 8 j .. 8 j + 7 give the shared addresses
// of block j's eight 16-byte rows, and thread t gets in regs[j] the block's elements (row t / 4,
// columns 2 (t % 4) and 2 (t % 4) + 1), low half first: an accumulator fragment's layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t address, uint32_t (&regs)[4]) {
  asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(address));
}
// The same, transposed: thread t gets in regs[j] block j's elements (row 2 (t % 4), column t / 4)
// and (row 2 (t % 4) + 1, column t / 4), low half first.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t address, uint32_t (&regs)[4]) {
  asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(address));
}

// The TMA copy type of `Shape` tiles of a (rows, head dim, head, batch) tensor into `SmemLayout`.
template <typename Element, class SmemLayout, class TileShape, class GmemStride = TmaStride>
using TmaLoad = decltype(make_tma_copy(
    SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), TmaShape{}, GmemStride{}),
    SmemLayout{}, TileShape{}, _1{}));
// The TMA copy type of `Shape` tiles from `SmemLayout` into a (rows, head dim, head, batch) tensor.
template <typename Element, class SmemLayout, class TileShape, class GmemStride = TmaStride>
using TmaStore = decltype(make_tma_copy(
    SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), TmaShape{}, GmemStride{}),
    SmemLayout{}, TileShape{}, _1{}));

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

// A float32 accumulator fragment rounded into a 16-bit A-operand fragment of the same order.
template <typename Element, class FragS, class FragP>
__device__ __forceinline__ void convert_fragment(const FragS& s, FragP& p) {
  constexpr int kN = decltype(size(s))::value;
  static_assert(kN == decltype(size(p))::value);
  cutlass::NumericArrayConverter<Element, float, kN> convert;
  *reinterpret_cast<cutlass::Array<Element, kN>*>(raw_pointer_cast(p.data())) =
      convert(*reinterpret_cast<const cutlass::Array<float, kN>*>(raw_pointer_cast(s.data())));
}

// An accumulator of a 64 x N wgmma as the A operand of the next product (N = its K): k block kb
// holds accumulator elements [8 kb, 8 kb + 8) (the wgmma accumulator and A-fragment orders agree).
template <int kN>
using RegLayoutA = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;

// Query-major tiles: consumer warpgroup w owns query rows [64w, 64w + 64) of kBlockM. S = Q K^T
// with both operands K-major in shared memory; then a product whose A (P, or dS) comes from
// registers and whose B is MN-major in shared memory: O = P V (V^T: N = head dim, K = keys), or
// dQ = dS K (K^T, the same layout).
template <typename Element, int kHeadDim_, int kBlockN_, int kMmaWGs_>
struct QueryTileTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kMmaWGs = kMmaWGs_;
  static constexpr int kBlockM = 64 * kMmaWGs;
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kBlockN <= 256);

  using AtomLayout = Layout<Shape<Int<kMmaWGs>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(), AtomLayout{}));
  using TiledMmaPV =
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              AtomLayout{}));
  using RegLayoutP = RegLayoutA<kBlockN>;

  using SmemLayoutQ = decltype(tile_to_shape(k_major_atom<Element, kHeadDim>(), Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // K (keys, head dim, stage), head dim contiguous.
  template <int kStages>
  using SmemLayoutK =
      decltype(tile_to_shape(k_major_atom<Element, kHeadDim>(), Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T: (head dim, keys, stage), head dim contiguous, as V is in global memory.
  template <int kStages>
  using SmemLayoutVt = decltype(tile_to_shape(mn_major_atom<Element, kHeadDim>(),
                                              Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  // K's bytes seen as K^T (head dim, keys, stage).
  template <int kStages>
  using SmemLayoutKt =
      decltype(composition(SmemLayoutK<kStages>{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                                               Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));

  // The forward's float-mask tile of each K stage (kBiasTile).
  template <int kStages>
  using SmemLayoutBias = SmemLayoutBiasTile<Element, kBlockM, kBlockN, kStages>;

  using TmaQ = TmaLoad<Element, SmemLayoutQ, Shape<Int<kBlockM>, Int<kHeadDim>>>;
  // The output staged in a Q buffer (OutputEpilogue::rounded): each warpgroup's rows, rounded to
  // 16 bits, written there by stmatrix (four 8 x 8 blocks a call) and stored by one TMA copy of its
  // 64 rows. A warpgroup's rows are SmemLayoutQ's rows 64 w on (kWgRowsOffset elements on, whole
  // swizzle atoms: the 128-byte swizzle reads the same there).
  using R2SCopyO = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmaPV{}));
  using SmemLayoutOWg =
      decltype(composition(SmemLayoutQ{}, make_layout(Shape<_64, Int<kHeadDim>>{}, Stride<_1, Int<kBlockM>>{})));
  static constexpr int kWgRowsOffset = decltype(get_nonswizzle_portion(SmemLayoutQ{})){}(64, 0);
  static_assert(kWgRowsOffset * sizeof(Element) % 1024 == 0, "an offset the swizzle leaves alone");
  using TmaO = TmaStore<Element, SmemLayoutOWg, Shape<_64, Int<kHeadDim>>>;
  template <int kStages>
  using TmaBias = TmaLoad<Element, decltype(take<0, 2>(SmemLayoutBias<kStages>{})), Shape<Int<kBlockM>, Int<kBlockN>>>;
  template <int kStages>
  using TmaK = TmaLoad<Element, decltype(take<0, 2>(SmemLayoutK<kStages>{})), Shape<Int<kBlockN>, Int<kHeadDim>>>;
  // V viewed as (head dim, keys, head, batch).
  template <int kStages>
  using TmaVt = TmaLoad<Element, decltype(take<0, 2>(SmemLayoutVt<kStages>{})), Shape<Int<kHeadDim>, Int<kBlockN>>,
                        Stride<_1, int64_t, int64_t, int64_t>>;
};

// Key-major tiles of the dK/dV kernel: S^T = K Q^T and dP^T = V dO^T (M = keys, N = query rows,
// K = head dim), dV += P^T dO and dK += dS^T Q (M = keys, N = head dim, K = query rows), and the
// dQ product dQ = dS K from shared memory. Consumer warpgroup w owns keys [64w, 64w + 64) of a
// 128-key tile; a tile of 64 keys (kSharedKeys: head dims past 128) is shared by both, each on
// half the step's query rows for S^T and dP^T and on half the head dim for dK and dV (D / 2
// accumulators each for dK and dV would leave no registers for S and dP); P^T then goes through
// shared memory as dS^T does, and the dK / dV products read both from there.
template <typename Element, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kDqPass_>
struct KeyTileTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kMmaWGs = 2;
  static constexpr bool kSharedKeys = kBlockN == 64;
  static_assert(kBlockN == (kSharedKeys ? 64 : 64 * kMmaWGs));
  static constexpr int kSdPRows = kSharedKeys ? kBlockM / kMmaWGs : kBlockM;    // S^T's query rows per warpgroup
  static constexpr int kdKVCols = kSharedKeys ? kHeadDim / kMmaWGs : kHeadDim;  // dK's, dV's head dim per warpgroup
  static_assert(kBlockM == 64 || kBlockM == 128);
  // The dQ product's sharing (DqMode): none with the dQ pass, else split where the tile allows it,
  // else alternate (at D = 64 on an H200 fwd+bwd 335 -> 359 TFLOP/s against each warpgroup
  // multiplying its own 64 keys: half the reduce-adds per step).
  static constexpr int kdQMode = kDqPass_ ? kdQPass : (kBlockM == 128 || kHeadDim % 128 == 0 ? kdQSplit : kdQAlternate);
  static constexpr bool kdQWholeRows = kdQMode != kdQSplit;  // one warpgroup's product covers whole rows
  static_assert(kdQWholeRows || kBlockM == 128 || kHeadDim % 128 == 0, "no dQ split for this tile");
  static constexpr int kdQWarpgroupsM = kdQWholeRows ? 1 : kBlockM / 64;
  static constexpr int kdQWarpgroupsN = kdQWholeRows ? 1 : kMmaWGs / kdQWarpgroupsM;

  // How the warpgroups split S^T, dP^T, dK and dV: by keys (M), or with kSharedKeys by query
  // rows for S^T / dP^T and by head dim for dK / dV (N).
  using WarpgroupLayout = Layout<Shape<Int<kSharedKeys ? 1 : kMmaWGs>, Int<kSharedKeys ? kMmaWGs : 1>, _1>>;
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
  using RegLayoutP = RegLayoutA<kSdPRows>;  // P^T and dS^T as the dK/dV products' A

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

  // A float mask's tile of each Q stage (kBiasTile): the step's kBlockM query rows x kBlockN keys.
  using SmemLayoutBias = SmemLayoutBiasTile<Element, kBlockM, kBlockN, kStages>;

  using TmaQ = TmaLoad<Element, decltype(take<0, 2>(SmemLayoutQ{})), Shape<Int<kBlockM>, Int<kHeadDim>>>;
  using TmaK = TmaLoad<Element, SmemLayoutK, Shape<Int<kBlockN>, Int<kHeadDim>>>;
  using TmaBias = TmaLoad<Element, decltype(take<0, 2>(SmemLayoutBias{})), Shape<Int<kBlockM>, Int<kBlockN>>>;
  // dK and dV staged in K's and V's buffers at the CTA's end (each warpgroup's 64 keys as rows,
  // rounded to 16 bits by stmatrix) and stored by one TMA copy each: not with 64-key tiles
  // (kSharedKeys), whose warpgroups split the head dim.
  static constexpr bool kStagedDkv = !kSharedKeys;
  using R2SCopydKV = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmadKV{}));
  using TmadKV = TmaStore<Element, SmemLayoutK, Shape<Int<kBlockN>, Int<kHeadDim>>>;
};

}  // namespace detail

// Whether a float mask can come as TMA tiles (the kBiasTile variants of the forward and the dK/dV
// kernel): T's element type, keys contiguous, a row stride (no broadcast over the rows) and the
// other strides multiples of 16 bytes, a 16-byte aligned start.
template <typename T>
bool bias_tile_fits(const attn::MaskView& m) {
  constexpr attn::MaskKind kind = std::is_same_v<T, __half> ? attn::MaskKind::kHalf : attn::MaskKind::kBFloat16;
  constexpr int64_t kAlign = 16 / sizeof(T);
  return m.kind == kind && m.stride_kv == 1 && m.stride_q != 0 && m.stride_q % kAlign == 0 &&
         m.stride_h % kAlign == 0 && m.stride_b % kAlign == 0 && reinterpret_cast<uintptr_t>(m.ptr) % 16 == 0;
}

}  // namespace safeattn::cuda::hopper
