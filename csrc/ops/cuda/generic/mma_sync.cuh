// The building blocks of the mma.sync kernels (sm_80 and later; the generic forward, backward and
// decode kernels): tensor-core and ldmatrix wrappers, cp.async tile loads into padded (or
// swizzled) shared rows, and the special-function and packing helpers of the online softmax.
// Device code only, no torch, so the standalone checks (benchmarks/*_check.cu) include the
// kernels without it.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ops/cuda/tile_order.h"

namespace safeattn::cuda::attn {

// ---- tensor-core and async-copy wrappers (sm_80 and later) -----------------------------------

// D[16x8] (+)= A[16x16] @ B[16x8], fp32 accumulators, A/B as packed pairs of 16-bit values in
// the register layout of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16").
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Two m16n8 tiles side by side: D0 (+)= A @ B[:, 0:8] and D1 (+)= A @ B[:, 8:16], with b the
// four registers of an ldmatrix_x4 of B (two k16 x n8 fragments).
template <typename T>
__device__ __forceinline__ void mma_pair(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]};
  const uint32_t b1[2] = {b[2], b[3]};
  mma_16816<T>(d0, a, b0);
  mma_16816<T>(d1, a, b1);
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t smem_address(uint32_t address) {  // one already
  return address;
}

// Four 8x8 16-bit matrices from shared memory; lane l gives the row address of matrix l / 8 (a
// pointer, or a shared-memory address as smem_address gives).
template <typename Row>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], Row row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row)));
}

// The same, each matrix transposed (B operands stored row-major in K, such as V).
template <typename Row>
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], Row row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row)));
}

// 16 bytes global -> shared without registers; `valid` false writes zeros (tile edges), so
// out-of-range rows never hold garbage that could become NaN in a product. kPrefetch (0, 128 or
// 256): the L2 prefetch size asked with the load (the decode kernel's K and V rows).
template <int kPrefetch = 0>
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  static_assert(kPrefetch == 0 || kPrefetch == 128 || kPrefetch == 256, "cp.async: L2 prefetch of 0, 128 or 256 B");
  const int src_bytes = valid ? 16 : 0;
  const uint32_t dst = smem_address(smem);
  if constexpr (kPrefetch == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
  } else if constexpr (kPrefetch == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
  }
}
// 4 bytes global -> shared (through L1: small indices that neighbouring threads share).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_address(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// The mma.sync kernels' shared-memory row of `elements` 16-bit values, padded by 16 bytes so that
// ldmatrix's eight row addresses fall in different banks.
constexpr int padded_row(int elements) {
  return elements + 8;
}

// Where element (row, col) of a [rows][kElements] 16-bit tile lies in shared memory (an offset in
// elements). Padded (the default): rows padded_row(kElements) apart, as stored. Swizzled: rows
// kElements apart, unpadded, and 16-byte chunk k of row r stored at chunk k ^ (r % 8), so the
// eight rows an ldmatrix reads (eight consecutive rows, one chunk each) still fall in eight
// different bank groups, in 16 bytes a row less (6% of the tile at D = 128). The swizzle permutes
// chunks within each aligned group of eight (128 bytes): kElements must be a multiple of 64.
// Every caller's rows are some base row plus a multiple of 8 or 16, so row % 8 is the lane's and
// the compiler keeps one XOR per distinct (chunk, lane) pair of a loop.
template <int kElements, bool kSwizzled = false>
struct SmemRows {
  static_assert(!kSwizzled || (kElements % 64 == 0 && (kElements & (kElements - 1)) == 0),
                "swizzled rows: a power of two, at least 64 elements");
  static constexpr bool kSwizzle = kSwizzled;
  static constexpr int kStride = kSwizzled ? kElements : padded_row(kElements);
  static __device__ __forceinline__ int offset(int row, int col) {
    if constexpr (kSwizzled) {
      return row * kStride + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
    } else {
      return row * kStride + col;
    }
  }
  // The shared-memory address a lane gives ldmatrix, moved from `lane` (the address of the lane's
  // own row and column, col 0 or 8) by `rows` (a multiple of 8: row % 8 stays) and `cols` (a
  // multiple of 16). Swizzled, the chunk bits of col and cols do not overlap, so the move is an
  // XOR of the address with a constant: one instruction, and no register per (rows, cols). That
  // holds where the tile starts on a whole row of kElements * 2 bytes, as every tile of a kernel
  // whose shared memory is aligned to 1024 bytes does (kElements <= 512); kElements a power of
  // two keeps cols < kElements clear of the row's bits.
  static __device__ __forceinline__ uint32_t moved(uint32_t lane, int rows, int cols) {
    if constexpr (kSwizzled) {
      return (lane ^ static_cast<uint32_t>(cols * 2)) + rows * kStride * 2;
    } else {
      return lane + (rows * kStride + cols) * 2;
    }
  }
};

// The rounds of kThreads 16-byte chunks a kRows x kHeadDim tile load takes.
constexpr int load_rounds(int rows, int head_dim, int threads) {
  return (rows * head_dim / 8 + threads - 1) / threads;
}

// A kRows x kHeadDim tile from global memory (rows `row_stride` elements apart) to shared memory
// (laid out as Rows says: padded rows by default), one 16-byte cp.async per chunk; rows at or past
// valid_rows are zero-filled (their source is not read). kUnroll rounds of kThreads chunks are
// unrolled (default: all of them; the register-bound backward takes 1). kWalk, where every round
// is whole rows: a thread keeps its column and walks its rows with one pointer, kThreads /
// kChunks rows a step, instead of an offset per round (which the compiler may compute once and
// hold in registers across a kernel's loop, or spill). kWholeTiles (with kWalk): a tile of kRows
// valid rows, every tile of a sequence but its last, takes a path of its own without the per-chunk
// row test and source select. kPrefetch: cp_async_16's L2 prefetch size.
template <typename T, int kRows, int kHeadDim, int kThreads, int kUnroll = load_rounds(kRows, kHeadDim, kThreads),
          class Rows = SmemRows<kHeadDim>, bool kWalk = false, bool kWholeTiles = false, int kPrefetch = 0>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t row_stride, int64_t valid_rows, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kTotal = kRows * kChunks;
  if constexpr (kWalk && kThreads % kChunks == 0 && kTotal % kThreads == 0) {
    constexpr int kStep = kThreads / kChunks;
    const int r0 = tid / kChunks, col = tid % kChunks * 8;
    const T* from = src + r0 * row_stride + col;
    if (kWholeTiles && valid_rows >= kRows) {
#pragma unroll kUnroll
      for (int it = 0; it < kTotal / kThreads; ++it) {
        cp_async_16<kPrefetch>(dst + Rows::offset(r0 + it * kStep, col), from, true);
        from += kStep * row_stride;
      }
      return;
    }
#pragma unroll kUnroll
    for (int it = 0; it < kTotal / kThreads; ++it) {
      const bool valid = r0 + it * kStep < valid_rows;
      cp_async_16<kPrefetch>(dst + Rows::offset(r0 + it * kStep, col), valid ? from : src, valid);
      from += kStep * row_stride;
    }
  } else {
#pragma unroll kUnroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
      const int c = it * kThreads + tid;
      if (kTotal % kThreads != 0 && c >= kTotal) {  // head dims such as 80: a ragged last round
        break;
      }
      const int r = c / kChunks, ch = c % kChunks;
      const bool valid = r < valid_rows;
      const T* from = valid ? src + r * row_stride + ch * 8 : src;
      cp_async_16<kPrefetch>(dst + Rows::offset(r, ch * 8), from, valid);
    }
  }
}

// x, as a value the compiler cannot see through: what is computed from it inside a loop is computed
// there, not hoisted out of the loop and held in registers across it (a tile load's per-chunk
// address offsets, in kernels whose accumulators already take nearly every register).
__device__ __forceinline__ int64_t opaque(int64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

// 2^x on the special-function unit (ex2.approx.ftz: 2 ulp, -inf -> 0, NaN -> NaN); results below
// 2^-126 flush to 0, which a probability can afford. exp2f without --use_fast_math adds
// subnormal handling around the same instruction, in the hottest loops.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(2^a + 2^b) without overflow: a row's lse with the sink logit added (both log2 domain).
// -inf when both are -inf; NaN when either is NaN.
__device__ __forceinline__ float log2_add_exp2(float a, float b) {
  const float top = (a != a || a > b) ? a : b;
  return top == -INFINITY ? top : top + log2f(exp2f(a - top) + exp2f(b - top));
}

// Two fp32 values as one register of two 16-bit values (the A operand of P @ V).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// A tile shape's kernels with the per-element test of key ranges (FwdParams / BwdParams::ranges)
// compiled in: a mixed tile's elements are tested against their row's key interval. The shape
// itself (Tiles, kReadsRanges false) carries none of that code, whose registers the plain loops
// would pay for (nvcc 13.0, sm_90: the D = 128 forward's spills 32 -> 80 bytes, the large dK/dV
// kernel's 8 -> 32 bytes of stores): the launchers take this one only for calls with key ranges.
template <class Tiles>
struct WithRanges : Tiles {
  static constexpr bool kReadsRanges = true;
};
// Whether the mma.sync kernels read key ranges (WithRanges; choose_attention_fwd / bwd give them
// the ranges beside no mask or a bool one) rather than get them drawn into the mask (a bool
// [B, 1, Q, KV]: quadratic in a packed batch's tokens). nvcc 13.0 leaves the kernels without
// ranges as they were beside them (sm_90 SASS: the same instructions, parameter offsets aside).
constexpr bool kMmaSyncReadsKeyRanges = true;

// ---- a CTA's place in the grid's order (ops/cuda/tile_order.h) ------------------------------

// The tile, head and batch a CTA computes, kept in kGridCoordBytes at the end of its dynamic
// shared memory and re-read (volatile) wherever used: the dK/dV kernel's. blockIdx itself can be
// read again at any point for free, so the kernels never held it in registers; coordinates
// computed from it (longest_first's) stayed live across the query loop at 255 registers and
// spilled: the D = 128 dK/dV kernel's stack went 24 -> 120 bytes (224 bytes of spill stores), and
// the backward through the extension (fwd+bwd less fwd; H200, B4 H16 S4096 causal) 2.77 -> 2.91
// ms; with GridCoords 0 bytes and 2.65 ms. The forward keeps its coordinates in registers: there
// GridCoords grew the D = 64 large shape's stack 32 -> 72 bytes and its causal forward 0.478 ->
// 0.519 ms.
constexpr size_t kGridCoordBytes = 16;

struct GridCoords {
  const volatile int* s;
  __device__ __forceinline__ int rank() const {  // the tile: rank 0 the longest (tile_order.h)
    return s[0];
  }
  __device__ __forceinline__ int64_t head() const {
    return s[1];
  }
  __device__ __forceinline__ int64_t batch() const {
    return s[2];
  }
};

// CTA (x, y, z) of a (tiles, heads, batches) grid: longest_first's tile of its linear index over
// the heads x batches when head_group > 1 (the launchers set it only for grids of at most
// INT32_MAX CTAs), else (x, y, z) itself. `slot`: kGridCoordBytes of shared memory that nothing
// else uses. Written by thread 0; the barrier makes it visible to the CTA.
__device__ __forceinline__ GridCoords grid_coords(unsigned char* slot, int head_group) {
  int* s = reinterpret_cast<int*>(slot);
  if (threadIdx.x == 0) {
    int rank = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), batch = static_cast<int>(blockIdx.z);
    if (head_group > 1) {
      const int linear = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
      const TileRank r =
          longest_first(linear, static_cast<int>(gridDim.x), static_cast<int>(gridDim.y * gridDim.z), head_group);
      rank = r.rank;
      head = r.head % static_cast<int>(gridDim.y);
      batch = r.head / static_cast<int>(gridDim.y);
    }
    s[0] = rank;
    s[1] = head;
    s[2] = batch;
  }
  __syncthreads();
  return GridCoords{s};
}

}  // namespace safeattn::cuda::attn
