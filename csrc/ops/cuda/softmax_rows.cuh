// Last-dim softmax kernels (inner == 1) and their launchers, forward and backward.
//
// Included by one instantiation file per dtype (softmax_rows_<dtype>.cu), so the four dtypes
// compile in parallel; softmax_kernel.cu calls the launchers declared at the bottom.
//
// Forward: each thread loads its share of the row into registers (as acc_t values), then
//   1. the row max, with a NaN-propagating max so that the max alone says what the row is
//      (softmax_detail::row_kind: finite, all -inf, or NaN / +inf), reduced over the row's
//      threads (shuffles, plus one shared-memory step for a block);
//   2. e = exp(x - max) in place and their sum, reduced the same way;
//   3. out = e * (1 / sum), written once.
// So: one read and one write of global memory, one exponential per element (element_exp says
// which and why), no data-dependent branch (an online (max, sum) per element would take two
// exponentials and divergent branches per element: bound by instruction issue).
// Each thread holds 32 values (64 bytes of bfloat16, 128 of float32 in flight; 80 registers
// at most, 24 warps per SM), or 8 for float32 rows that fit one block (48 warps per SM); one
// block per row group, the hardware scheduling them. The threads per row follow the row length:
// groups of 4-32 lanes (several rows per warp), one block of 64-256 threads up to 8192, then
// the row split over a thread-block cluster of 2-8 such blocks (sm_90) that swap their block's
// (max, sum) through distributed shared memory, so that 64k-long rows still give thousands
// of blocks. Longer rows (or no clusters) are read twice: a running (max, sum) per thread,
// rescaled once per batch of vectors, then exp(x - max) / sum (the second read mostly hits L2).
//
// Backward: dot = sum(grad_out * out) per row, then out * (grad_out - dot), with both inputs in
// registers up to 2048 vectors per block and the same cluster split beyond (one block of 1024
// threads for 64k rows spills its caches).
//
// The measurements behind the choices below (values per thread, grids, cluster sizes) are in
// benchmarks/notes_attention_cuda.md, "sdpa_mask and softmax kernels".
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "ops/softmax.h"
#include "safeattn.h"

namespace safeattn::cuda {

template <typename T>
using acc_type_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Last-dim rows: out[r, :] = safe softmax of (masked, scaled) scores[r, :].
//   scores, out: [rows, n] contiguous; mask read through mg (kind kNone: no mask).
template <typename T>
void launch_softmax_rows(const T* scores, T* out, int64_t rows, int64_t n, const void* mask, const MaskGeometry& mg,
                         acc_type_t<T> scale, cudaStream_t stream);

// Last-dim rows of the backward: grad_scores = scale * grad_x (grad_x as in softmax.h).
//   grad_out, out, grad_scores: [rows, n] contiguous; grad_x: null or [rows, n] in acc_t.
template <typename T>
void launch_softmax_backward_rows(const T* grad_out, const T* out, T* grad_scores, acc_type_t<T>* grad_x, int64_t rows,
                                  int64_t n, acc_type_t<T> scale, cudaStream_t stream);

// The explicit instantiations of both launchers for the dtype T: defined once per dtype in
// softmax_rows_<dtype>.cu (PREFIX empty), declared `extern` (PREFIX extern) where they are called.
#define SAFEATTN_SOFTMAX_ROWS_INSTANCES(PREFIX, T)                                                               \
  PREFIX template void launch_softmax_rows<T>(const T*, T*, int64_t, int64_t, const void*, const MaskGeometry&,  \
                                              acc_type_t<T>, cudaStream_t);                                      \
  PREFIX template void launch_softmax_backward_rows<T>(const T*, const T*, T*, acc_type_t<T>*, int64_t, int64_t, \
                                                       acc_type_t<T>, cudaStream_t)

namespace rows_detail {

using namespace safeattn::softmax_detail;

constexpr int kWarp = 32;

// ---- device helpers ------------------------------------------------------------------------

template <typename acc_t>
__device__ __forceinline__ acc_t accurate_exp(acc_t x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return ::expf(x);  // at most 2 ulp; exp(-inf) = 0
  } else {
    return ::exp(x);
  }
}

// exp(d) for the per-element terms, d = x - max <= 0 (or -inf), in float: 2^(d * log2 e) on the
// SFU with ex2.approx.ftz (the instruction behind exp2f, documented at 2 ulp; results below
// 2^-126 flush to 0, which no tolerance can see), plus the rounding of d * log2 e, a relative
// error of about |d| * 2^-24, the size of the rounding of x - max itself. So a few ulp where
// the outputs are large (small |d|), in 2 instructions against about 9 for expf (5 for __expf
// without -ftz=true); expf makes the bfloat16 kernels issue-bound. The approximation holds the
// float32 tolerance because each element takes one exponential against its set's final max (a
// running sum rescaled at every new max would compound the error); the few rescale factors
// (cluster merge, the read-twice path's batches) use accurate_exp.
// -DSAFEATTN_SOFTMAX_ACCURATE_EXP makes every exponential expf.
template <typename acc_t>
__device__ __forceinline__ acc_t element_exp(acc_t d) {
#if defined(SAFEATTN_SOFTMAX_ACCURATE_EXP)
  return accurate_exp(d);
#else
  if constexpr (std::is_same_v<acc_t, float>) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d * 1.4426950408889634f));  // -inf: 0; NaN: NaN
    return r;
  } else {
    return ::exp(d);
  }
#endif
}

// max that returns NaN when either side is NaN (fmaxf would drop it), so that a row's max is
// NaN / +inf / -inf / finite exactly as row_kind expects.
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a > b || a != a) ? a : b;
#endif
}
__device__ __forceinline__ double max_nan(double a, double b) {
  return (a > b || a != a) ? a : b;
}

struct MaxOp {
  template <typename acc_t>
  __device__ __forceinline__ acc_t operator()(acc_t a, acc_t b) const {
    return max_nan(a, b);
  }
};
struct SumOp {
  template <typename acc_t>
  __device__ __forceinline__ acc_t operator()(acc_t a, acc_t b) const {
    return a + b;
  }
};

// All-reduce over the kGroup threads of a row: lanes of a warp (kGroup <= 32, aligned groups,
// so xor stays inside the group) or the whole block (smem: kGroup / 32 slots, one barrier).
// Every thread combines the warps' values in the same order, so all get the same bits. The
// caller makes sure no thread still reads `smem` from an earlier call when this one writes it
// (two alternating slot arrays in the forward, one per row parity in the backward).
template <int kGroup, typename acc_t, typename Op>
__device__ __forceinline__ acc_t group_allreduce(acc_t v, acc_t* smem, Op op) {
  constexpr int kLanes = kGroup < kWarp ? kGroup : kWarp;
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset, kLanes));
  }
  if constexpr (kGroup > kWarp) {
    constexpr int kWarps = kGroup / kWarp;
    if (threadIdx.x % kWarp == 0) {
      smem[threadIdx.x / kWarp] = v;
    }
    __syncthreads();
    v = smem[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      v = op(v, smem[w]);
    }
  }
  return v;
}

// Swaps two values per block across the kSplit blocks of a cluster: each block pushes its
// values into slot [parity][rank] of every block's shared memory, then the cluster barrier
// (release / acquire) makes them visible and each block reads its own copy. The slots alternate
// with the row's parity: a block writes parity p for row r + 2 only after the barrier of row
// r + 1, which every block reaches after it has read row r's slots, so nothing unread is
// overwritten and one barrier per row suffices.
template <int kSplit, typename acc_t>
struct ClusterSlots {
  acc_t a[2][kSplit];
  acc_t b[2][kSplit];
};

template <int kSplit, typename acc_t>
__device__ __forceinline__ void cluster_exchange(ClusterSlots<kSplit, acc_t>& slots, int parity, acc_t a, acc_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned int rank = cluster.block_rank();
  if (threadIdx.x < static_cast<unsigned int>(kSplit)) {
    *cluster.map_shared_rank(&slots.a[parity][rank], threadIdx.x) = a;
    *cluster.map_shared_rank(&slots.b[parity][rank], threadIdx.x) = b;
  }
  cluster.sync();
#else
  __trap();  // the host launches clusters only for sm_90 code (clusters_usable)
#endif
}

__device__ __forceinline__ void cluster_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Distributed shared memory may be written only once every block of the cluster runs.
  cooperative_groups::this_cluster().sync();
#else
  __trap();
#endif
}

// VEC elements of T moved as one access (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}
template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& pack) {
  *reinterpret_cast<Pack<T, VEC>*>(p) = pack;
}

// The mask of one row, the kind being uniform across a launch (no divergence).
struct MaskRef {
  MaskKind kind;
  const char* row;  // the mask element of position 0 along the softmax dim
  int64_t stride;   // elements between consecutive positions along the softmax dim
};

__device__ __forceinline__ MaskRef mask_ref(const void* mask, const MaskGeometry& mg, int64_t outer_index,
                                            int64_t inner_index, int score_size) {
  if (mg.kind == MaskKind::kNone) {
    return {MaskKind::kNone, nullptr, 0};
  }
  const int64_t elem = mg.kind == MaskKind::kBool ? 1 : (mg.kind == MaskKind::kFloat32 ? 4 : score_size);
  const int64_t offset = mg.outer.offset(outer_index) + mg.inner.offset(inner_index);
  return {mg.kind, static_cast<const char*>(mask) + offset * elem, mg.dim_stride};
}

// x for the element at position j along the softmax dim (softmax.h: masked_score, biased_score).
template <typename T, typename acc_t>
__device__ __forceinline__ acc_t element_value(T score, acc_t scale, const MaskRef& mask, int64_t j) {
  const acc_t s = static_cast<acc_t>(score);
  switch (mask.kind) {
    case MaskKind::kBool:
      return masked_score<acc_t>(s, scale, reinterpret_cast<const bool*>(mask.row)[j * mask.stride]);
    case MaskKind::kFloat:
      return biased_score<acc_t>(s, scale, static_cast<acc_t>(reinterpret_cast<const T*>(mask.row)[j * mask.stride]));
    case MaskKind::kFloat32:
      return biased_score<acc_t>(s, scale,
                                 static_cast<acc_t>(reinterpret_cast<const float*>(mask.row)[j * mask.stride]));
    default:
      return s * scale;
  }
}

// The same, with the mask kind known at compile time to be absent or present.
template <bool kMasked, typename T, typename acc_t>
__device__ __forceinline__ acc_t value_at(T score, acc_t scale, const MaskRef& mask, int64_t j) {
  if constexpr (kMasked) {
    return element_value<T, acc_t>(score, scale, mask, j);
  } else {
    return static_cast<acc_t>(score) * scale;
  }
}

// exp(x - shift) never sees -inf - (-inf): an all -inf set uses shift 0 (every term is 0).
template <typename acc_t>
__device__ __forceinline__ acc_t exp_shift(acc_t max) {
  return max == neg_inf<acc_t>() ? acc_t(0) : max;
}

// What multiplies exp(x - shift) on output, from the row's max and sum: 1 / sum for a normal
// row (sum >= 1: the max element contributes exp(0)), 0 for an all -inf row (every e is 0),
// NaN for a row with NaN or +inf (every output NaN, as torch.softmax).
template <typename acc_t>
__device__ __forceinline__ acc_t output_factor(acc_t max, acc_t sum) {
  switch (row_kind(max)) {
    case RowKind::kNormal:
      return acc_t(1) / sum;
    case RowKind::kEmpty:
      return acc_t(0);
    default:
      return std::numeric_limits<acc_t>::quiet_NaN();
  }
}

// Threads per block of a kernel whose rows take kGroup threads.
template <int kGroup>
constexpr int block_threads() {
  return kGroup > kWarp ? kGroup : 128;
}
// Blocks per SM that __launch_bounds__ asks room for. A thread caching 32 values (or reading
// twice): 768 threads (24 warps) per SM, so at most 80 registers (the values plus addressing),
// half for double; a thread caching 8 values (small_forward_cache): 1536 threads, 40 registers.
template <int kGroup, typename T, int kValues>
constexpr int min_blocks() {
  constexpr int per_sm = std::is_same_v<T, double> ? 384 : (kValues <= 8 ? 1536 : 768);
  constexpr int blocks = per_sm / block_threads<kGroup>();
  return blocks > 0 ? blocks : 1;
}

// ---- the row loop both kernels share ------------------------------------------------------

// The vectors [begin, end) of a row that this block takes: the whole row of `vectors`, or with
// kSplit > 1 the part of block blockIdx.x % kSplit of its cluster (kSplit equal chunks).
template <typename index_t>
struct RowPart {
  index_t begin;
  index_t end;
};

template <int kSplit, typename index_t>
__device__ __forceinline__ RowPart<index_t> row_part(index_t vectors) {
  const index_t chunk = kSplit > 1 ? (vectors + kSplit - 1) / kSplit : vectors;
  const index_t begin = kSplit > 1 ? static_cast<index_t>(blockIdx.x % kSplit) * chunk : 0;
  return {begin, kSplit > 1 ? (vectors < begin + chunk ? vectors : begin + chunk) : vectors};
}

// Calls body(row, active, parity) for each row of this thread's group of kGroup lanes, the grid
// (blocks, or clusters of kSplit blocks) looping over the rows. Every thread of a block (and
// every block of a cluster) runs the same iterations: shuffles and barriers need all of them; a
// group past the last row gets active == false and does no memory access. parity alternates
// between iterations (the double-buffered shared slots of a row).
template <int kGroup, int kSplit, typename Body>
__device__ __forceinline__ void for_each_row(int64_t rows, Body&& body) {
  constexpr int kRowsPerBlock = block_threads<kGroup>() / kGroup;
  const int64_t units = gridDim.x / kSplit;  // blocks, or clusters
  if constexpr (kSplit > 1) {
    cluster_start();
  }
  int parity = 0;
  for (int64_t first = static_cast<int64_t>(blockIdx.x / kSplit) * kRowsPerBlock; first < rows;
       first += units * kRowsPerBlock, parity ^= 1) {
    const int64_t row = first + threadIdx.x / kGroup;
    body(row, row < rows, parity);
  }
}

// The packs of vectors v0 + k * kGroup (k < kUnroll) of `in` that lie before `end`.
template <int kGroup, typename T, int VEC, int kUnroll, typename index_t>
__device__ __forceinline__ void load_packs(Pack<T, VEC> (&p)[kUnroll], const T* in, index_t v0, index_t end) {
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const index_t v = v0 + static_cast<index_t>(k) * kGroup;
    if (v < end) {
      p[k] = load_pack<T, VEC>(in + v * VEC);
    }
  }
}

// f(v, x) for the vectors v = v0 + k * kGroup (k < kUnroll) before `end`, x the values of pack k
// (values(p[k], v, x)). A function, not a lambda in the kernel: nvcc 13.0's cudafe++ crashed on
// the generic lambda.
template <int kGroup, typename acc_t, typename T, int VEC, int kUnroll, typename index_t, typename Values, typename F>
__device__ __forceinline__ void for_each_vector(const Pack<T, VEC> (&p)[kUnroll], index_t v0, index_t end,
                                                const Values& values, F&& f) {
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const index_t v = v0 + static_cast<index_t>(k) * kGroup;
    if (v < end) {
      acc_t x[VEC];
      values(p[k], v, x);
      f(v, x);
    }
  }
}

// ---- forward -----------------------------------------------------------------------------

// kGroup threads per row: kGroup <= 32, several rows per block, one per group of lanes; else
// the whole block. kSplit > 1: a cluster of kSplit blocks per row, block `rank` taking the
// vectors [rank * chunk, (rank + 1) * chunk) (its part). Vector v of a part (counted from the
// part's start) belongs to thread v % kGroup. kCache > 0: each thread holds at most kCache
// vectors (the host guarantees that the part fits, so indices within a row fit in 32 bits);
// kCache == 0: the part is read twice. The host guarantees n % VEC == 0 and 16-byte aligned
// rows when VEC > 1.
template <typename T, int VEC, int kGroup, int kCache, int kSplit, bool kMasked>
__global__ void __launch_bounds__(block_threads<kGroup>(), min_blocks<kGroup, T, (kCache > 0 ? kCache * VEC : 32)>())
    softmax_rows_kernel(const T* __restrict__ scores, T* __restrict__ out, int64_t rows, int64_t n,
                        const void* __restrict__ mask, MaskGeometry mg, acc_type_t<T> scale) {
  using acc_t = acc_type_t<T>;
  using index_t = std::conditional_t<(kCache > 0), int, int64_t>;  // vector index within a row
  constexpr int kSlots = kGroup > kWarp ? kGroup / kWarp : 1;
  // Read-twice path: vectors per thread loaded together (64 bytes in flight, 16 values at VEC 1).
  constexpr int kUnroll = VEC > 1 ? 4 : 16;
  __shared__ acc_t red_max[kSlots];
  __shared__ acc_t red_sum[kSlots];
  __shared__ ClusterSlots<kSplit, acc_t> cluster_slots;
  const int t = static_cast<int>(threadIdx.x % kGroup);
  const RowPart<index_t> part = row_part<kSplit>(static_cast<index_t>(n / VEC));
  const index_t part_begin = part.begin, part_end = part.end;
  for_each_row<kGroup, kSplit>(rows, [&](int64_t row, bool active, int parity) {
    const T* in = scores + row * n;
    T* o = out + row * n;
    const MaskRef m =
        (kMasked && active) ? mask_ref(mask, mg, row, 0, sizeof(T)) : MaskRef{MaskKind::kNone, nullptr, 0};
    // The values of vector v (position v * VEC + e along the row).
    auto values = [&](const Pack<T, VEC>& p, index_t v, acc_t(&x)[VEC]) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        x[e] = value_at<kMasked, T, acc_t>(p.v[e], scale, m, static_cast<int64_t>(v) * VEC + e);
      }
    };
    acc_t max = neg_inf<acc_t>();
    acc_t sum = 0;
    if constexpr (kCache > 0) {
      // x: the values, then exp(x - shift); slots past the part stay -inf, then 0.
      acc_t x[kCache][VEC];
      {
        Pack<T, VEC> p[kCache];
#pragma unroll
        for (int k = 0; k < kCache; ++k) {
          const index_t v = part_begin + t + k * kGroup;
          if (active && v < part_end) {
            p[k] = load_pack<T, VEC>(in + static_cast<int64_t>(v) * VEC);
          }
        }
#pragma unroll
        for (int k = 0; k < kCache; ++k) {
          const index_t v = part_begin + t + k * kGroup;
          if (active && v < part_end) {
            values(p[k], v, x[k]);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              x[k][e] = neg_inf<acc_t>();
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          max = max_nan(max, x[k][e]);
        }
      }
      max = group_allreduce<kGroup>(max, red_max, MaxOp{});
      const acc_t shift = exp_shift(max);
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        // Slots past the part are skipped rather than exp'd (short parts leave many).
        if (part_begin + t + k * kGroup < part_end) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            x[k][e] = element_exp(x[k][e] - shift);
            sum += x[k][e];
          }
        }
      }
      sum = group_allreduce<kGroup>(sum, red_sum, SumOp{});
      acc_t factor;
      if constexpr (kSplit > 1) {
        // Each block's sum is relative to its own max: bring them to the row's max. A block
        // whose part is all -inf has sum 0 and weight exp(-inf - row_max) = 0.
        cluster_exchange<kSplit, acc_t>(cluster_slots, parity, max, sum);
        acc_t row_max = cluster_slots.a[parity][0];
#pragma unroll
        for (int c = 1; c < kSplit; ++c) {
          row_max = max_nan(row_max, cluster_slots.a[parity][c]);
        }
        const bool normal = row_kind(row_max) == RowKind::kNormal;
        acc_t row_sum = 0;
        if (normal) {
#pragma unroll
          for (int c = 0; c < kSplit; ++c) {
            row_sum += cluster_slots.b[parity][c] * accurate_exp(cluster_slots.a[parity][c] - row_max);
          }
        }
        factor = output_factor(row_max, row_sum);
        if (normal) {
          factor *= accurate_exp(max - row_max);  // this part's max is -inf: 0 (its e are 0)
        }
      } else {
        factor = output_factor(max, sum);
      }
      if (!active) {
        return;
      }
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const index_t v = part_begin + t + k * kGroup;
        if (v < part_end) {
          Pack<T, VEC> r;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            r.v[e] = static_cast<T>(x[k][e] * factor);
          }
          store_pack<T, VEC>(o + static_cast<int64_t>(v) * VEC, r);
        }
      }
    } else {
      // A running (max, sum of exp(x - max)) per thread, rescaled once per batch of kUnroll
      // vectors. The values are recomputed from the packs rather than kept (registers).
      if (active) {
        for (index_t v0 = part_begin + t; v0 < part_end; v0 += static_cast<index_t>(kUnroll) * kGroup) {
          Pack<T, VEC> p[kUnroll];
          load_packs<kGroup>(p, in, v0, part_end);
          acc_t batch_max = max;
          for_each_vector<kGroup, acc_t>(p, v0, part_end, values, [&](index_t, const acc_t(&x)[VEC]) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              batch_max = max_nan(batch_max, x[e]);
            }
          });
          const acc_t shift = exp_shift(batch_max);
          sum *= accurate_exp(max - shift);  // max == -inf: sum is 0 and stays 0
          for_each_vector<kGroup, acc_t>(p, v0, part_end, values, [&](index_t, const acc_t(&x)[VEC]) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              sum += element_exp(x[e] - shift);
            }
          });
          max = batch_max;
        }
      }
      const acc_t thread_max = max;
      max = group_allreduce<kGroup>(max, red_max, MaxOp{});
      sum = thread_max == neg_inf<acc_t>() ? acc_t(0) : sum * accurate_exp(thread_max - max);
      sum = group_allreduce<kGroup>(sum, red_sum, SumOp{});
      if constexpr (kSplit > 1) {
        cluster_exchange<kSplit, acc_t>(cluster_slots, parity, max, sum);
        max = cluster_slots.a[parity][0];
#pragma unroll
        for (int c = 1; c < kSplit; ++c) {
          max = max_nan(max, cluster_slots.a[parity][c]);
        }
        sum = 0;
        if (row_kind(max) == RowKind::kNormal) {
#pragma unroll
          for (int c = 0; c < kSplit; ++c) {
            sum += cluster_slots.b[parity][c] * accurate_exp(cluster_slots.a[parity][c] - max);
          }
        }
      }
      if (!active) {
        return;
      }
      const acc_t shift = exp_shift(max);
      const acc_t factor = output_factor(max, sum);
      for (index_t v0 = part_begin + t; v0 < part_end; v0 += static_cast<index_t>(kUnroll) * kGroup) {
        Pack<T, VEC> p[kUnroll];
        load_packs<kGroup>(p, in, v0, part_end);
        for_each_vector<kGroup, acc_t>(p, v0, part_end, values, [&](index_t v, const acc_t(&x)[VEC]) {
          Pack<T, VEC> r;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            r.v[e] = static_cast<T>(element_exp(x[e] - shift) * factor);
          }
          store_pack<T, VEC>(o + v * VEC, r);
        });
      }
    }
  });
}

// ---- backward ----------------------------------------------------------------------------

// Same layout as softmax_rows_kernel; grad_out and out cached as packs when kCache > 0.
// grad_x (may be null): the unscaled gradient in acc_t for the mask's gradient.
template <typename T, int VEC, int kGroup, int kCache, int kSplit>
__global__ void __launch_bounds__(block_threads<kGroup>())
    softmax_backward_rows_kernel(const T* __restrict__ grad_out, const T* __restrict__ out, T* __restrict__ grad_scores,
                                 acc_type_t<T>* __restrict__ grad_x, int64_t rows, int64_t n, acc_type_t<T> scale) {
  using acc_t = acc_type_t<T>;
  constexpr int kSlots = kGroup > kWarp ? kGroup / kWarp : 1;
  __shared__ acc_t red[2][kSlots];  // one slot array per row parity
  __shared__ ClusterSlots<kSplit, acc_t> cluster_slots;
  const int t = static_cast<int>(threadIdx.x % kGroup);
  const RowPart<int64_t> part = row_part<kSplit>(n / VEC);
  const int64_t part_begin = part.begin, part_end = part.end;
  for_each_row<kGroup, kSplit>(rows, [&](int64_t row, bool active, int parity) {
    const T* g = grad_out + row * n;
    const T* y = out + row * n;
    acc_t dot = 0;
    Pack<T, VEC> g_cache[kCache > 0 ? kCache : 1];
    Pack<T, VEC> y_cache[kCache > 0 ? kCache : 1];
    if (active) {
      if constexpr (kCache > 0) {
#pragma unroll
        for (int k = 0; k < kCache; ++k) {
          const int64_t v = part_begin + t + static_cast<int64_t>(k) * kGroup;
          if (v < part_end) {
            g_cache[k] = load_pack<T, VEC>(g + v * VEC);
            y_cache[k] = load_pack<T, VEC>(y + v * VEC);
          }
        }
#pragma unroll
        for (int k = 0; k < kCache; ++k) {
          const int64_t v = part_begin + t + static_cast<int64_t>(k) * kGroup;
          if (v < part_end) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              dot += dot_term<acc_t>(static_cast<acc_t>(g_cache[k].v[e]), static_cast<acc_t>(y_cache[k].v[e]));
            }
          }
        }
      } else {
        for (int64_t v = part_begin + t; v < part_end; v += kGroup) {
          const Pack<T, VEC> gp = load_pack<T, VEC>(g + v * VEC);
          const Pack<T, VEC> yp = load_pack<T, VEC>(y + v * VEC);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            dot += dot_term<acc_t>(static_cast<acc_t>(gp.v[e]), static_cast<acc_t>(yp.v[e]));
          }
        }
      }
    }
    dot = group_allreduce<kGroup>(dot, red[parity], SumOp{});
    if constexpr (kSplit > 1) {
      cluster_exchange<kSplit, acc_t>(cluster_slots, parity, dot, acc_t(0));
      dot = 0;
#pragma unroll
      for (int c = 0; c < kSplit; ++c) {
        dot += cluster_slots.a[parity][c];
      }
    }
    if (!active) {
      return;
    }
    auto write = [&](const Pack<T, VEC>& gp, const Pack<T, VEC>& yp, int64_t v) {
      Pack<T, VEC> r;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const acc_t gr = grad_element<acc_t>(static_cast<acc_t>(gp.v[e]), static_cast<acc_t>(yp.v[e]), dot);
        r.v[e] = static_cast<T>(gr * scale);
        if (grad_x != nullptr) {
          grad_x[row * n + v * VEC + e] = gr;
        }
      }
      store_pack<T, VEC>(grad_scores + row * n + v * VEC, r);
    };
    if constexpr (kCache > 0) {
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int64_t v = part_begin + t + static_cast<int64_t>(k) * kGroup;
        if (v < part_end) {
          write(g_cache[k], y_cache[k], v);
        }
      }
    } else {
      for (int64_t v = part_begin + t; v < part_end; v += kGroup) {
        write(load_pack<T, VEC>(g + v * VEC), load_pack<T, VEC>(y + v * VEC), v);
      }
    }
  });
}

// ---- launch configuration ----------------------------------------------------------------

template <int N>
using Int = std::integral_constant<int, N>;

// Vectors per thread the forward keeps in registers: 32 values (16 for one-element vectors,
// whose scalar loads take a register each).
constexpr int forward_cache(int vec) {
  return vec > 1 ? 32 / vec : 16;
}

// Vectors per thread of the float32 forward (4-element vectors) for rows that fit one block: 8
// values, so that 1536 threads fit an SM (40 registers) instead of 768, the fastest of 8, 16 and
// 32 for float32 on H100; 16-bit types are fastest with 32, so they keep forward_cache. 0: none.
constexpr int small_forward_cache(int vec) {
  return vec == 4 ? 2 : 0;
}

inline int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) {
    p *= 2;
  }
  return p;
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

struct RowConfig {
  int group;  // threads per row (per block of the cluster when split > 1)
  int cache;  // vectors per thread kept in registers (0: read twice)
  int split;  // blocks per row (a cluster when > 1)
};

constexpr int kMaxSplit = 8;  // the portable cluster size limit

// Forward, by row length in vectors; `cache` = forward_cache(vec): groups of 4-32 lanes up to
// 32 threads' worth, one block of 64-256 up to 256 threads' worth, then a cluster of 2-8 such
// blocks, then the read-twice path. Rows that fit one block with `small_cache` vectors per
// thread take that instead (when it is not 0; see small_forward_cache).
inline RowConfig forward_config(int64_t vectors, int cache, bool clusters, int small_cache = 0) {
  if (small_cache > 0 && ceil_div(vectors, small_cache) <= 256) {
    cache = small_cache;
  }
  const int64_t threads = ceil_div(vectors, cache);
  if (threads <= kWarp) {
    return {static_cast<int>(std::max<int64_t>(4, next_pow2(threads))), cache, 1};
  }
  if (threads <= 256) {
    return {static_cast<int>(std::max<int64_t>(64, next_pow2(threads))), cache, 1};
  }
  const int64_t split = next_pow2(ceil_div(threads, 256));
  if (clusters && split <= kMaxSplit) {
    return {256, cache, static_cast<int>(split)};
  }
  return {256, 0, clusters ? kMaxSplit : 1};
}

// Backward: lanes of a warp up to 1024 elements, then 256 threads with up to 8 vectors each
// (both at copy bandwidth on H100), then clusters of 2-8 blocks of 256
// threads with 32 values of each input per thread (one 256-thread block holding 64 bfloat16
// values of each input per thread runs one block per SM), then read twice.
inline RowConfig backward_config(int64_t n, int64_t vectors, int vec, bool clusters) {
  if (n <= 1024) {
    const int64_t group = vec > 1 ? std::min<int64_t>(32, std::max<int64_t>(4, next_pow2(vectors))) : 32;
    return {static_cast<int>(group), static_cast<int>(next_pow2(ceil_div(vectors, group))), 1};
  }
  if (vec > 1 && vectors <= 256 * 8) {
    return {256, static_cast<int>(next_pow2(ceil_div(vectors, 256))), 1};
  }
  const int cache = 32 / vec;
  const int64_t split = next_pow2(ceil_div(vectors, 256 * cache));
  if (vec > 1 && clusters && split <= kMaxSplit) {
    return {256, cache, static_cast<int>(split)};
  }
  return {256, 0, clusters ? kMaxSplit : 1};
}

// The launch configuration of `grid` blocks of `threads` threads, in clusters of `split` blocks
// along x when split > 1. config points at attribute, so the struct is neither copied nor moved.
struct ClusterLaunch {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attribute{};

  ClusterLaunch(int64_t grid, int threads, int split) {
    config.gridDim = dim3(static_cast<unsigned int>(grid));
    config.blockDim = dim3(static_cast<unsigned int>(threads));
    if (split > 1) {
      attribute.id = cudaLaunchAttributeClusterDimension;
      attribute.val.clusterDim.x = static_cast<unsigned int>(split);
      attribute.val.clusterDim.y = 1;
      attribute.val.clusterDim.z = 1;
      config.attrs = &attribute;
      config.numAttrs = 1;
    }
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

inline int current_device() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// Whether rows may be split over clusters on `device`: compute capability 9, `probe` compiled
// as sm_90 code (a PTX JIT of older code lacks the cluster path), and a cluster of kMaxSplit
// blocks of `biggest` (the variant with the most registers) fits on the GPU.
template <typename Probe, typename Biggest>
bool clusters_usable(Probe probe, Biggest biggest, int device) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) {
    return false;
  }
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, probe));
  if (attributes.ptxVersion < 90 || attributes.binaryVersion < 90) {
    return false;
  }
  const ClusterLaunch cluster(kMaxSplit, 256, kMaxSplit);
  int count = 0;
  if (cudaOccupancyMaxActiveClusters(&count, biggest, &cluster.config) != cudaSuccess) {
    (void)cudaGetLastError();  // not an error of this op: take the path without clusters
    return false;
  }
  return count > 0;
}

// clusters_usable, asked once per device for each set of variants (the Key type).
template <typename Key, typename Probe, typename Biggest>
bool clusters_usable_cached(Probe probe, Biggest biggest, int device) {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // 0: not asked yet, 1: no, 2: yes
  if (device < 0 || device >= kDevices) {
    return clusters_usable(probe, biggest, device);
  }
  int k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    k = clusters_usable(probe, biggest, device) ? 2 : 1;
    known[device].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

// Row groups (blocks, or clusters when split > 1) of kKernel that fit on the GPU at once: the
// grid is made persistent (each group loops over rows), so that every group gets the same number
// of rows to within one and the last wave leaves no SM idle. Asked once per device.
template <auto kKernel>
int64_t resident_units(int threads, int split, int device) {
  constexpr int kDevices = 64;
  static std::atomic<int64_t> known[kDevices];  // 0: not asked yet
  if (device >= 0 && device < kDevices) {
    const int64_t k = known[device].load(std::memory_order_relaxed);
    if (k > 0) {
      return k;
    }
  }
  int64_t units = 0;
  if (split > 1) {
    const ClusterLaunch cluster(split, threads, split);
    int clusters = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kKernel, &cluster.config));
    units = clusters;
  } else {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, 0));
    units = static_cast<int64_t>(per_sm) * multiprocessor_count(device);
  }
  units = std::max<int64_t>(1, units);
  if (device >= 0 && device < kDevices) {
    known[device].store(units, std::memory_order_relaxed);
  }
  return units;
}

// Launches kKernel, instantiated for kGroup threads per row and kSplit blocks per row, on `stream`
// for `rows` rows: row groups of block_threads<kGroup>() threads (clusters of kSplit blocks when
// kSplit > 1). Single blocks get one block per row group (up to the grid limit; the kernels loop
// past it): the hardware's scheduler reaches copy bandwidth where a persistent grid of resident
// blocks does not. Clusters keep the persistent grid, which is the faster of the two for 64k-long
// rows.
template <auto kKernel, int kGroup, int kSplit, typename... Args>
void launch(int64_t rows, int device, cudaStream_t stream, Args&&... args) {
  constexpr int kThreads = block_threads<kGroup>();
  const int64_t units = ceil_div(rows, kThreads / kGroup);
  const int64_t resident = kSplit > 1 ? resident_units<kKernel>(kThreads, kSplit, device) : int64_t{INT32_MAX};
  ClusterLaunch cluster(std::min(units, resident) * kSplit, kThreads, kSplit);
  cluster.config.stream = stream;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cluster.config, kKernel, std::forward<Args>(args)...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
constexpr int full_vec() {
  // float64 rows take the one-element path: only references and gradcheck use them.
  return std::is_same_v<T, double> ? 1 : 16 / static_cast<int>(sizeof(T));
}

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Calls f(Int<value>{}) when value is one of kValues and returns true; false otherwise. Only
// kValues instantiate f.
template <int... kValues, typename F>
bool with_value(int value, F&& f) {
  return ((value == kValues ? (f(Int<kValues>{}), true) : false) || ...);
}

// Calls f(Int<group>, Int<kCache>, Int<1>) for a single-block configuration of `group` threads
// per row; false for a group size no variant has.
template <int kCache, typename F>
bool with_one_block_group(int group, F&& f) {
  return with_value<4, 8, 16, 32, 64, 128, 256>(group, [&](auto g) { f(g, Int<kCache>{}, Int<1>{}); });
}

// Calls f(Int<256>, Int<kCache>, Int<split>) for a cluster of `split` (2, 4 or 8) blocks of 256
// threads per row; false for another split.
template <int kCache, typename F>
bool with_cluster_split(int split, F&& f) {
  return with_value<2, 4, 8>(split, [&](auto s) { f(Int<256>{}, Int<kCache>{}, s); });
}

// Calls f(Int<group>, Int<cache>, Int<split>) for the forward configurations forward_config can
// return with vectors of kVec elements (cache == forward_cache(kVec), small_forward_cache(kVec)
// for single blocks, or 0).
template <int kVec, typename F>
void with_forward_config(const RowConfig& c, F&& f) {
  constexpr int kCache = forward_cache(kVec);
  constexpr int kSmall = small_forward_cache(kVec);
  if (c.split == 1 && c.cache == kCache && with_one_block_group<kCache>(c.group, f)) {
    return;
  }
  if constexpr (kSmall > 0) {
    if (c.split == 1 && c.cache == kSmall && with_one_block_group<kSmall>(c.group, f)) {
      return;
    }
  }
  if (c.cache == kCache && c.group == 256 && with_cluster_split<kCache>(c.split, f)) {
    return;
  }
  if (c.cache == 0 && c.group == 256) {
    if (c.split == 1) {
      return f(Int<256>{}, Int<0>{}, Int<1>{});
    }
    if (c.split == kMaxSplit) {
      return f(Int<256>{}, Int<0>{}, Int<kMaxSplit>{});
    }
  }
  TORCH_CHECK(false, "safeattn softmax (CUDA): no forward variant for ", c.group, " threads x ", c.cache, " vectors x ",
              c.split, " blocks per row");
}

// The same for backward_config.
template <int kVec, typename F>
void with_backward_config(const RowConfig& c, F&& f) {
  if (c.split == 1) {
    // Groups of 4-16 lanes (vectors only) keep one vector (backward_config gives them no other);
    // a warp keeps 1-4 vectors, 8 while that is at most 32 values, 16 and 32 single values; a
    // block of 256 reads twice, or keeps 1-8 vectors.
    auto one_block = [&](auto group) { return [&, group](auto cache) { f(group, cache, Int<1>{}); }; };
    if constexpr (kVec > 1) {
      if (with_value<4, 8, 16>(c.group, [&](auto group) { f(group, Int<1>{}, Int<1>{}); }) ||
          (c.group == 256 && with_value<1, 2, 4, 8>(c.cache, one_block(Int<256>{})))) {
        return;
      }
    }
    if (c.group == 32) {
      if (with_value<1, 2, 4>(c.cache, one_block(Int<32>{}))) {
        return;
      }
      if constexpr (kVec * 8 <= 32) {
        if (with_value<8>(c.cache, one_block(Int<32>{}))) {
          return;
        }
      }
      if constexpr (kVec == 1) {
        if (with_value<16, 32>(c.cache, one_block(Int<32>{}))) {
          return;
        }
      }
    }
    if (c.group == 256 && c.cache == 0) {
      return f(Int<256>{}, Int<0>{}, Int<1>{});
    }
  } else if (c.group == 256) {
    if (c.cache == 0 && c.split == kMaxSplit) {
      return f(Int<256>{}, Int<0>{}, Int<kMaxSplit>{});
    }
    if constexpr (kVec > 1) {
      constexpr int kCache = 32 / kVec;
      if (c.cache == kCache && with_cluster_split<kCache>(c.split, f)) {
        return;
      }
    }
  }
  TORCH_CHECK(false, "safeattn softmax backward (CUDA): no variant for ", c.group, " threads x ", c.cache,
              " vectors x ", c.split, " blocks per row");
}

template <typename T, int kVec, bool kMasked>
void forward_rows_vec(const T* scores, T* out, int64_t rows, int64_t n, const void* mask, const MaskGeometry& mg,
                      acc_type_t<T> scale, cudaStream_t stream) {
  const int device = current_device();
  const bool clusters = clusters_usable_cached<Int<kVec * 2 + kMasked>>(
      &softmax_rows_kernel<T, kVec, 256, 0, kMaxSplit, kMasked>,
      &softmax_rows_kernel<T, kVec, 256, forward_cache(kVec), kMaxSplit, kMasked>, device);
  const RowConfig c = forward_config(n / kVec, forward_cache(kVec), clusters, small_forward_cache(kVec));
  with_forward_config<kVec>(c, [&](auto group, auto cache, auto split) {
    constexpr int kGroup = decltype(group)::value, kSplit = decltype(split)::value;
    launch<&softmax_rows_kernel<T, kVec, kGroup, decltype(cache)::value, kSplit, kMasked>, kGroup, kSplit>(
        rows, device, stream, scores, out, rows, n, mask, mg, scale);
  });
}

template <typename T, int kVec>
void backward_rows_vec(const T* grad_out, const T* out, T* grad_scores, acc_type_t<T>* grad_x, int64_t rows, int64_t n,
                       acc_type_t<T> scale, cudaStream_t stream) {
  const int device = current_device();
  const bool clusters = clusters_usable_cached<Int<kVec * 2 + 64>>(
      &softmax_backward_rows_kernel<T, kVec, 256, 0, kMaxSplit>,
      &softmax_backward_rows_kernel<T, kVec, 256, (kVec > 1 ? 32 / kVec : 0), kMaxSplit>, device);
  const RowConfig c = backward_config(n, n / kVec, kVec, clusters);
  with_backward_config<kVec>(c, [&](auto group, auto cache, auto split) {
    constexpr int kGroup = decltype(group)::value, kSplit = decltype(split)::value;
    launch<&softmax_backward_rows_kernel<T, kVec, kGroup, decltype(cache)::value, kSplit>, kGroup, kSplit>(
        rows, device, stream, grad_out, out, grad_scores, grad_x, rows, n, scale);
  });
}

}  // namespace rows_detail

template <typename T>
void launch_softmax_rows(const T* scores, T* out, int64_t rows, int64_t n, const void* mask, const MaskGeometry& mg,
                         acc_type_t<T> scale, cudaStream_t stream) {
  using namespace rows_detail;
  constexpr int V = full_vec<T>();
  const bool vectorized = V > 1 && n % V == 0 && aligned16(scores) && aligned16(out);
  const bool masked = mg.kind != MaskKind::kNone;
  if (vectorized) {
    masked ? forward_rows_vec<T, V, true>(scores, out, rows, n, mask, mg, scale, stream)
           : forward_rows_vec<T, V, false>(scores, out, rows, n, mask, mg, scale, stream);
  } else {
    masked ? forward_rows_vec<T, 1, true>(scores, out, rows, n, mask, mg, scale, stream)
           : forward_rows_vec<T, 1, false>(scores, out, rows, n, mask, mg, scale, stream);
  }
}

template <typename T>
void launch_softmax_backward_rows(const T* grad_out, const T* out, T* grad_scores, acc_type_t<T>* grad_x, int64_t rows,
                                  int64_t n, acc_type_t<T> scale, cudaStream_t stream) {
  using namespace rows_detail;
  constexpr int V = full_vec<T>();
  const bool vectorized = V > 1 && n % V == 0 && aligned16(grad_out) && aligned16(out) && aligned16(grad_scores);
  if (vectorized) {
    backward_rows_vec<T, V>(grad_out, out, grad_scores, grad_x, rows, n, scale, stream);
  } else {
    backward_rows_vec<T, 1>(grad_out, out, grad_scores, grad_x, rows, n, scale, stream);
  }
}

}  // namespace safeattn::cuda
