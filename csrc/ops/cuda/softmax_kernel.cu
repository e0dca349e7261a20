// CUDA kernels of the softmax family (safe_softmax, masked_softmax and their backward ops).
//
// Last-dim rows (inner == 1) pick a strategy by row length, as the fastest published softmax
// kernels do:
//   - rows of up to 1024 elements: a group of up to 32 threads (one warp, or a fraction of one
//     for short rows, so a warp handles several rows) per row, the row held in registers;
//   - longer rows: a block of 256 or 1024 threads per row, the row held in registers when it
//     fits in 8 vectors per thread, else read twice (the second read mostly hits L2).
// Loads and stores are 16 bytes wide when every row start is 16-byte aligned (the host checks
// the pointers and the row length), else one element wide. Statistics go through an online
// (max, sum) per thread (softmax_detail::OnlineState), merged across the group with shuffles
// (and shared memory across warps), all in float32 (float64 for float64).
// Other dims (inner > 1): one thread per column of the [dim_size, inner] matrix, so
// neighbouring threads read neighbouring addresses and nothing is transposed.
//
// A fully masked / all -inf row is written as 0 and a row with NaN or +inf as NaN on every path
// (softmax_detail::row_kind); the backward writes 0 wherever the output is 0. No host
// synchronisation; every launch is checked; offsets are 64-bit.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "ops/softmax.h"

namespace safeattn::cuda {
namespace {

using namespace safeattn::softmax_detail;

template <typename T>
using acc_type_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

constexpr int kWarp = 32;

// ---- small device helpers ----------------------------------------------------------------

template <typename acc_t>
__device__ __forceinline__ acc_t fast_exp(acc_t x) {
  // Accurate expf (not __expf): the online rescaling multiplies exp errors, and on long
  // columns __expf's relative error reached twice PyTorch's (H100, 6000-long dim-1 softmax).
  // The kernels are memory-bound, so the extra instructions cost nothing measurable.
  if constexpr (std::is_same_v<acc_t, float>) {
    return ::expf(x);  // exp(-inf) = 0
  } else {
    return ::exp(x);
  }
}

// Online (max, sum of exp(x - max)) of a set of values, with NaN / +inf recorded apart so
// that no exp ever sees them (softmax_detail::row_kind reads the result).
template <typename acc_t>
struct OnlineState {
  acc_t max;
  acc_t sum;
  bool bad;  // a NaN or +inf was seen

  __device__ __forceinline__ static OnlineState empty() {
    return {neg_inf<acc_t>(), acc_t(0), false};
  }
  __device__ __forceinline__ void add(acc_t x) {
    if (!(x < std::numeric_limits<acc_t>::infinity())) {  // NaN or +inf
      bad = true;
    } else if (x > max) {
      sum = sum * fast_exp(max - x) + acc_t(1);  // exp(-inf) = 0 while max is -inf
      max = x;
    } else if (x != neg_inf<acc_t>()) {
      sum += fast_exp(x - max);
    }
  }
  __device__ __forceinline__ void merge(const OnlineState& o) {
    const acc_t m = max > o.max ? max : o.max;
    if (m != neg_inf<acc_t>()) {
      sum = sum * fast_exp(max - m) + o.sum * fast_exp(o.max - m);
    }
    max = m;
    bad = bad || o.bad;
  }
  // What the row max means, as row_kind does on the CPU.
  __device__ __forceinline__ RowKind kind() const {
    return bad ? RowKind::kNaN : row_kind(max);
  }
};

template <typename acc_t, int kGroup>
__device__ __forceinline__ OnlineState<acc_t> group_reduce(OnlineState<acc_t> s, acc_t* smem_max, acc_t* smem_sum,
                                                           int* smem_bad) {
  // Within a warp (or a group of kGroup <= 32 lanes, aligned, so xor stays inside the group).
  constexpr int kLanes = kGroup < kWarp ? kGroup : kWarp;
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    OnlineState<acc_t> o;
    o.max = __shfl_xor_sync(0xffffffffu, s.max, offset, kLanes);
    o.sum = __shfl_xor_sync(0xffffffffu, s.sum, offset, kLanes);
    o.bad = __shfl_xor_sync(0xffffffffu, static_cast<int>(s.bad), offset, kLanes) != 0;
    s.merge(o);
  }
  if constexpr (kGroup > kWarp) {
    constexpr int kWarps = kGroup / kWarp;
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    __syncthreads();  // the shared slots may still be read from the previous row
    if (lane == 0) {
      smem_max[warp] = s.max;
      smem_sum[warp] = s.sum;
      smem_bad[warp] = s.bad;
    }
    __syncthreads();
    // Every thread merges the warps' states in the same fixed order: same result everywhere.
    s = {smem_max[0], smem_sum[0], smem_bad[0] != 0};
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      s.merge({smem_max[w], smem_sum[w], smem_bad[w] != 0});
    }
  }
  return s;
}

template <typename acc_t, int kGroup>
__device__ __forceinline__ acc_t group_sum(acc_t v, acc_t* smem) {
  constexpr int kLanes = kGroup < kWarp ? kGroup : kWarp;
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset, kLanes);
  }
  if constexpr (kGroup > kWarp) {
    constexpr int kWarps = kGroup / kWarp;
    __syncthreads();
    if (threadIdx.x % kWarp == 0) {
      smem[threadIdx.x / kWarp] = v;
    }
    __syncthreads();
    v = smem[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      v += smem[w];
    }
  }
  return v;
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

// The mask of one row / column, the kind being uniform across a launch (no divergence).
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

template <typename acc_t>
__device__ __forceinline__ acc_t output_value(acc_t x, acc_t max, RowKind kind, acc_t inv) {
  if (kind == RowKind::kEmpty) {
    return acc_t(0);
  }
  if (kind == RowKind::kNaN) {
    return std::numeric_limits<acc_t>::quiet_NaN();
  }
  return fast_exp(x - max) * inv;  // x = -inf gives 0
}

// ---- forward -----------------------------------------------------------------------------

// Last-dim rows. kGroup threads per row (kGroup <= 32: several rows per block, one per group of
// lanes; else the whole block). Vector k of a row (elements [k * VEC, (k + 1) * VEC)) belongs
// to thread k % kGroup. kCache > 0: the row has at most kGroup * kCache vectors and stays in
// registers between the passes; kCache == 0: it is read twice. The host guarantees n % VEC == 0
// and 16-byte aligned rows when VEC > 1.
template <typename T, int VEC, int kGroup, int kCache>
__global__ void __launch_bounds__(kGroup > 128 ? kGroup : 128)
    softmax_rows_kernel(const T* __restrict__ scores, T* __restrict__ out, int64_t rows, int64_t n,
                        const void* __restrict__ mask, MaskGeometry mg, acc_type_t<T> scale) {
  using acc_t = acc_type_t<T>;
  constexpr int kSmem = kGroup > kWarp ? kGroup / kWarp : 1;
  __shared__ acc_t smem_max[kSmem];
  __shared__ acc_t smem_sum[kSmem];
  __shared__ int smem_bad[kSmem];
  const int64_t groups_per_block = blockDim.x / kGroup;
  const int t = static_cast<int>(threadIdx.x % kGroup);
  const int64_t vectors = n / VEC;
  // Every thread of a block runs the same number of iterations (shuffles and barriers need
  // the whole warp / block); groups past the last row do no memory access.
  for (int64_t first = blockIdx.x * groups_per_block; first < rows; first += gridDim.x * groups_per_block) {
    const int64_t row = first + threadIdx.x / kGroup;
    const bool active = row < rows;
    const T* in = scores + row * n;
    const MaskRef m = active ? mask_ref(mask, mg, row, 0, sizeof(T)) : MaskRef{MaskKind::kNone, nullptr, 0};
    OnlineState<acc_t> st = OnlineState<acc_t>::empty();
    Pack<T, VEC> cache[kCache > 0 ? kCache : 1];
    if (active) {
      if constexpr (kCache > 0) {
#pragma unroll
        for (int k = 0; k < kCache; ++k) {
          const int64_t v = t + static_cast<int64_t>(k) * kGroup;
          if (v < vectors) {
            cache[k] = load_pack<T, VEC>(in + v * VEC);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              st.add(element_value<T, acc_t>(cache[k].v[e], scale, m, v * VEC + e));
            }
          }
        }
      } else {
        for (int64_t v = t; v < vectors; v += kGroup) {
          const Pack<T, VEC> p = load_pack<T, VEC>(in + v * VEC);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            st.add(element_value<T, acc_t>(p.v[e], scale, m, v * VEC + e));
          }
        }
      }
    }
    st = group_reduce<acc_t, kGroup>(st, smem_max, smem_sum, smem_bad);
    if (!active) {
      continue;
    }
    const RowKind kind = st.kind();
    // The max element contributes exp(0) = 1, so a normal row has sum >= 1.
    const acc_t inv = kind == RowKind::kNormal ? acc_t(1) / st.sum : acc_t(0);
    T* o = out + row * n;
    auto write = [&](const Pack<T, VEC>& p, int64_t v) {
      Pack<T, VEC> r;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        r.v[e] = static_cast<T>(output_value(element_value<T, acc_t>(p.v[e], scale, m, v * VEC + e), st.max, kind, inv));
      }
      store_pack<T, VEC>(o + v * VEC, r);
    };
    if constexpr (kCache > 0) {
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int64_t v = t + static_cast<int64_t>(k) * kGroup;
        if (v < vectors) {
          write(cache[k], v);
        }
      }
    } else {
      for (int64_t v = t; v < vectors; v += kGroup) {
        write(load_pack<T, VEC>(in + v * VEC), v);
      }
    }
  }
}

// Other dims: one thread per column (o, i) of the [outer, dim_size, inner] view; neighbouring
// threads take neighbouring i, so every access of a warp is contiguous.
template <typename T>
__global__ void softmax_columns_kernel(const T* __restrict__ scores, T* __restrict__ out, int64_t outer, int64_t n,
                                       int64_t inner, const void* __restrict__ mask, MaskGeometry mg,
                                       acc_type_t<T> scale) {
  using acc_t = acc_type_t<T>;
  const int64_t columns = outer * inner;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < columns;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = c / inner;
    const int64_t i = c % inner;
    const int64_t base = o * n * inner + i;
    const MaskRef m = mask_ref(mask, mg, o, i, sizeof(T));
    OnlineState<acc_t> st = OnlineState<acc_t>::empty();
    for (int64_t d = 0; d < n; ++d) {
      st.add(element_value<T, acc_t>(scores[base + d * inner], scale, m, d));
    }
    const RowKind kind = st.kind();
    const acc_t inv = kind == RowKind::kNormal ? acc_t(1) / st.sum : acc_t(0);
    for (int64_t d = 0; d < n; ++d) {
      out[base + d * inner] =
          static_cast<T>(output_value(element_value<T, acc_t>(scores[base + d * inner], scale, m, d), st.max, kind, inv));
    }
  }
}

// ---- backward ----------------------------------------------------------------------------

// Same layout and strategy as softmax_rows_kernel. grad_x (may be null): the unscaled
// gradient in acc_t for the mask's gradient.
template <typename T, int VEC, int kGroup, int kCache>
__global__ void __launch_bounds__(kGroup > 128 ? kGroup : 128)
    softmax_backward_rows_kernel(const T* __restrict__ grad_out, const T* __restrict__ out,
                                 T* __restrict__ grad_scores, acc_type_t<T>* __restrict__ grad_x, int64_t rows,
                                 int64_t n, acc_type_t<T> scale) {
  using acc_t = acc_type_t<T>;
  constexpr int kSmem = kGroup > kWarp ? kGroup / kWarp : 1;
  __shared__ acc_t smem[kSmem];
  const int64_t groups_per_block = blockDim.x / kGroup;
  const int t = static_cast<int>(threadIdx.x % kGroup);
  const int64_t vectors = n / VEC;
  for (int64_t first = blockIdx.x * groups_per_block; first < rows; first += gridDim.x * groups_per_block) {
    const int64_t row = first + threadIdx.x / kGroup;
    const bool active = row < rows;
    const T* g = grad_out + row * n;
    const T* y = out + row * n;
    acc_t dot = 0;
    Pack<T, VEC> g_cache[kCache > 0 ? kCache : 1];
    Pack<T, VEC> y_cache[kCache > 0 ? kCache : 1];
    if (active) {
      if constexpr (kCache > 0) {
#pragma unroll
        for (int k = 0; k < kCache; ++k) {
          const int64_t v = t + static_cast<int64_t>(k) * kGroup;
          if (v < vectors) {
            g_cache[k] = load_pack<T, VEC>(g + v * VEC);
            y_cache[k] = load_pack<T, VEC>(y + v * VEC);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              dot += dot_term<acc_t>(static_cast<acc_t>(g_cache[k].v[e]), static_cast<acc_t>(y_cache[k].v[e]));
            }
          }
        }
      } else {
        for (int64_t v = t; v < vectors; v += kGroup) {
          const Pack<T, VEC> gp = load_pack<T, VEC>(g + v * VEC);
          const Pack<T, VEC> yp = load_pack<T, VEC>(y + v * VEC);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            dot += dot_term<acc_t>(static_cast<acc_t>(gp.v[e]), static_cast<acc_t>(yp.v[e]));
          }
        }
      }
    }
    dot = group_sum<acc_t, kGroup>(dot, smem);
    if (!active) {
      continue;
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
        const int64_t v = t + static_cast<int64_t>(k) * kGroup;
        if (v < vectors) {
          write(g_cache[k], y_cache[k], v);
        }
      }
    } else {
      for (int64_t v = t; v < vectors; v += kGroup) {
        write(load_pack<T, VEC>(g + v * VEC), load_pack<T, VEC>(y + v * VEC), v);
      }
    }
  }
}

template <typename T>
__global__ void softmax_backward_columns_kernel(const T* __restrict__ grad_out, const T* __restrict__ out,
                                                T* __restrict__ grad_scores, acc_type_t<T>* __restrict__ grad_x,
                                                int64_t outer, int64_t n, int64_t inner, acc_type_t<T> scale) {
  using acc_t = acc_type_t<T>;
  const int64_t columns = outer * inner;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < columns;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t base = (c / inner) * n * inner + c % inner;
    acc_t dot = 0;
    for (int64_t d = 0; d < n; ++d) {
      const int64_t at = base + d * inner;
      dot += dot_term<acc_t>(static_cast<acc_t>(grad_out[at]), static_cast<acc_t>(out[at]));
    }
    for (int64_t d = 0; d < n; ++d) {
      const int64_t at = base + d * inner;
      const acc_t gr = grad_element<acc_t>(static_cast<acc_t>(grad_out[at]), static_cast<acc_t>(out[at]), dot);
      grad_scores[at] = static_cast<T>(gr * scale);
      if (grad_x != nullptr) {
        grad_x[at] = gr;
      }
    }
  }
}

// ---- launch configuration ----------------------------------------------------------------

template <int N>
using Int = std::integral_constant<int, N>;

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) {
    p *= 2;
  }
  return p;
}

struct RowConfig {
  int group;  // threads per row
  int cache;  // vectors per thread kept in registers (0: read twice)
};

// By row length in vectors: up to 1024 elements, a group of <= 32 lanes with the row in
// registers; up to 2048 vectors, 256 threads; up to 8192, 1024 threads (in registers: at most
// 8 vectors, 128 bytes, per thread); longer, 1024 threads reading twice. Unaligned rows
// (VEC == 1) use fewer variants to keep the build small: lanes of a warp, then 256 threads.
RowConfig row_config(int64_t n, int64_t vectors, bool vectorized) {
  if (n <= 1024) {
    const int64_t group = vectorized ? std::min<int64_t>(32, std::max<int64_t>(4, next_pow2(vectors))) : 32;
    return {static_cast<int>(group), static_cast<int>(next_pow2((vectors + group - 1) / group))};
  }
  if (!vectorized) {
    return {256, 0};
  }
  if (vectors <= 256 * 8) {
    return {256, static_cast<int>(next_pow2((vectors + 255) / 256))};
  }
  if (vectors <= 1024 * 8) {
    return {1024, static_cast<int>(next_pow2((vectors + 1023) / 1024))};
  }
  return {1024, 0};
}

// Calls f(Int<group>, Int<cache>) for the configurations row_config can return.
template <bool kVectorized, typename F>
void with_row_config(const RowConfig& c, F&& f) {
  if constexpr (kVectorized) {
    switch (c.group) {
      case 4:
        return f(Int<4>{}, Int<1>{});
      case 8:
        return f(Int<8>{}, Int<1>{});
      case 16:
        return f(Int<16>{}, Int<1>{});
      case 32:
        switch (c.cache) {
          case 1:
            return f(Int<32>{}, Int<1>{});
          case 2:
            return f(Int<32>{}, Int<2>{});
          case 4:
            return f(Int<32>{}, Int<4>{});
          case 8:
            return f(Int<32>{}, Int<8>{});
          case 16:  // float64 (2 per vector) rows of 513 to 1024
            return f(Int<32>{}, Int<16>{});
          default:
            break;
        }
        break;
      case 256:
        switch (c.cache) {
          case 1:
            return f(Int<256>{}, Int<1>{});
          case 2:
            return f(Int<256>{}, Int<2>{});
          case 4:
            return f(Int<256>{}, Int<4>{});
          case 8:
            return f(Int<256>{}, Int<8>{});
          default:
            break;
        }
        break;
      case 1024:
        switch (c.cache) {
          case 0:
            return f(Int<1024>{}, Int<0>{});
          case 4:
            return f(Int<1024>{}, Int<4>{});
          case 8:
            return f(Int<1024>{}, Int<8>{});
          default:
            break;
        }
        break;
      default:
        break;
    }
  } else {
    if (c.group == 256) {
      return f(Int<256>{}, Int<0>{});
    }
    switch (c.cache) {
      case 1:
        return f(Int<32>{}, Int<1>{});
      case 2:
        return f(Int<32>{}, Int<2>{});
      case 4:
        return f(Int<32>{}, Int<4>{});
      case 8:
        return f(Int<32>{}, Int<8>{});
      case 16:
        return f(Int<32>{}, Int<16>{});
      case 32:
        return f(Int<32>{}, Int<32>{});
      default:
        break;
    }
  }
  TORCH_CHECK(false, "safeattn softmax (CUDA): no kernel variant for ", c.group, " threads x ", c.cache,
              " vectors per row");
}

// The current stream: c10::cuda::getCurrentCUDAStream is what at::cuda::getCurrentCUDAStream
// forwards to (ATen/cuda/CUDAContext.h also pulls in cuSPARSE / cuBLAS headers, which a bare
// toolkit may lack).
cudaStream_t current_stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

int64_t multiprocessor_count() {
  int device = 0;
  int count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Blocks for `groups` row groups: enough to fill the GPU several times over; the kernels loop.
unsigned int grid_for(int64_t groups) {
  const int64_t sms = multiprocessor_count();
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(groups, sms * 64)));
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename T>
constexpr int full_vec() {
  return 16 / sizeof(T);
}

template <typename T>
void forward_typed(const at::Tensor& scores, const at::Tensor& mask, const MaskGeometry& mg, double scale,
                   const SoftmaxGeometry& g, at::Tensor& out) {
  using acc_t = acc_type_t<T>;
  const T* in = scores.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const void* m = mask.defined() ? mask.const_data_ptr() : nullptr;
  const acc_t s = static_cast<acc_t>(scale);
  const cudaStream_t stream = current_stream();
  if (g.inner > 1) {
    constexpr int kThreads = 256;
    softmax_columns_kernel<T><<<grid_for((g.outer * g.inner + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        in, o, g.outer, g.dim_size, g.inner, m, mg, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t n = g.dim_size;
  constexpr int V = full_vec<T>();
  const bool vectorized = n % V == 0 && aligned16(in) && aligned16(o);
  auto launch = [&](auto vec, auto group, auto cache) {
    constexpr int kVec = decltype(vec)::value;
    constexpr int kGroup = decltype(group)::value;
    constexpr int kCache = decltype(cache)::value;
    const int threads = kGroup > 128 ? kGroup : 128;
    const int64_t rows_per_block = threads / kGroup;
    softmax_rows_kernel<T, kVec, kGroup, kCache>
        <<<grid_for((g.outer + rows_per_block - 1) / rows_per_block), threads, 0, stream>>>(in, o, g.outer, n, m, mg,
                                                                                           s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (vectorized) {
    with_row_config<true>(row_config(n, n / V, true), [&](auto group, auto cache) { launch(Int<V>{}, group, cache); });
  } else {
    with_row_config<false>(row_config(n, n, false), [&](auto group, auto cache) { launch(Int<1>{}, group, cache); });
  }
}

template <typename T>
void backward_typed(const at::Tensor& grad_out, const at::Tensor& out, double scale, const SoftmaxGeometry& g,
                    at::Tensor& grad_scores, at::Tensor& grad_x) {
  using acc_t = acc_type_t<T>;
  const T* go = grad_out.const_data_ptr<T>();
  const T* y = out.const_data_ptr<T>();
  T* gs = grad_scores.mutable_data_ptr<T>();
  acc_t* gx = grad_x.defined() ? grad_x.mutable_data_ptr<acc_t>() : nullptr;
  const acc_t s = static_cast<acc_t>(scale);
  const cudaStream_t stream = current_stream();
  if (g.inner > 1) {
    constexpr int kThreads = 256;
    softmax_backward_columns_kernel<T>
        <<<grid_for((g.outer * g.inner + kThreads - 1) / kThreads), kThreads, 0, stream>>>(go, y, gs, gx, g.outer,
                                                                                           g.dim_size, g.inner, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t n = g.dim_size;
  constexpr int V = full_vec<T>();
  const bool vectorized = n % V == 0 && aligned16(go) && aligned16(y) && aligned16(gs);
  auto launch = [&](auto vec, auto group, auto cache) {
    constexpr int kVec = decltype(vec)::value;
    constexpr int kGroup = decltype(group)::value;
    constexpr int kCache = decltype(cache)::value;
    const int threads = kGroup > 128 ? kGroup : 128;
    const int64_t rows_per_block = threads / kGroup;
    softmax_backward_rows_kernel<T, kVec, kGroup, kCache>
        <<<grid_for((g.outer + rows_per_block - 1) / rows_per_block), threads, 0, stream>>>(go, y, gs, gx, g.outer, n,
                                                                                           s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (vectorized) {
    with_row_config<true>(row_config(n, n / V, true), [&](auto group, auto cache) { launch(Int<V>{}, group, cache); });
  } else {
    with_row_config<false>(row_config(n, n, false), [&](auto group, auto cache) { launch(Int<1>{}, group, cache); });
  }
}

void softmax_forward_cuda(const at::Tensor& scores, const at::Tensor& mask, const MaskGeometry& mask_geometry,
                          double scale, const SoftmaxGeometry& geometry, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "safeattn_softmax_cuda", [&] {
    forward_typed<scalar_t>(scores, mask, mask_geometry, scale, geometry, out);
  });
}

void softmax_backward_cuda(const at::Tensor& grad_out, const at::Tensor& out, double scale,
                           const SoftmaxGeometry& geometry, at::Tensor& grad_scores, at::Tensor& grad_x) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "safeattn_softmax_backward_cuda", [&] {
    backward_typed<scalar_t>(grad_out, out, scale, geometry, grad_scores, grad_x);
  });
}

// ---- registration --------------------------------------------------------------------------

at::Tensor safe_softmax_cuda(const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
  const c10::cuda::CUDAGuard guard(self.device());
  return safe_softmax_impl(self, dim, dtype, &softmax_forward_cuda);
}

at::Tensor safe_softmax_backward_cuda(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim,
                                      at::ScalarType input_dtype) {
  const c10::cuda::CUDAGuard guard(out.device());
  return safe_softmax_backward_impl(grad_out, out, dim, input_dtype, &softmax_backward_cuda);
}

at::Tensor masked_softmax_cuda(const at::Tensor& scores, const std::optional<at::Tensor>& mask, double scale,
                               int64_t dim, std::optional<at::ScalarType> dtype) {
  const c10::cuda::CUDAGuard guard(scores.device());
  return masked_softmax_impl(scores, mask, scale, dim, dtype, &softmax_forward_cuda);
}

std::tuple<at::Tensor, at::Tensor> masked_softmax_backward_cuda(const at::Tensor& grad_out, const at::Tensor& out,
                                                                const std::optional<at::Tensor>& mask, double scale,
                                                                int64_t dim, at::ScalarType input_dtype,
                                                                bool mask_requires_grad) {
  const c10::cuda::CUDAGuard guard(out.device());
  return masked_softmax_backward_impl(grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad,
                                      &softmax_backward_cuda);
}

}  // namespace
}  // namespace safeattn::cuda

TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  m.impl("safe_softmax", &safeattn::cuda::safe_softmax_cuda);
  m.impl("_safe_softmax_backward", &safeattn::cuda::safe_softmax_backward_cuda);
  m.impl("masked_softmax", &safeattn::cuda::masked_softmax_cuda);
  m.impl("_masked_softmax_backward", &safeattn::cuda::masked_softmax_backward_cuda);
}
