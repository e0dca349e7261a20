// What the standalone checks of the attention kernels (benchmarks/hopper_fwd_check.cu,
// benchmarks/hopper_bwd_check.cu, benchmarks/mma_sync_fwd_check.cu, mma_sync_bwd_check.cu,
// decode_check.cu) share: error checking, 16-bit conversions, the test cases' shape and storage
// layouts, key ranges and tile classes for the summaries, and device-side random inputs for the
// timings. No torch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ops/cuda/mask_view.cuh"

#define CHECK_CUDA(x)                                                                                    \
  do {                                                                                                   \
    cudaError_t err_ = (x);                                                                              \
    if (err_ != cudaSuccess) {                                                                           \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(err_), __FILE__, __LINE__, #x); \
      exit(2);                                                                                           \
    }                                                                                                    \
  } while (0)

template <typename T>
float to_f(T x);
template <>
float to_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
float to_f(__half x) {
  return __half2float(x);
}
template <typename T>
__host__ __device__ T from_f(float x);
template <>
__host__ __device__ __nv_bfloat16 from_f(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__host__ __device__ __half from_f(float x) {
  return __float2half_rn(x);
}
template <>
__host__ __device__ float from_f(float x) {
  return x;
}

struct Case {
  int batch, heads, kv_heads, q_len, kv_len;
  bool causal;
  int64_t shift;
  int layout;  // 0: contiguous [B, H, S, D]; 1: transposed view of [B, S, H, D]; 2: rows padded by 24
};

// Element strides (b, h, s) of a [B, H, S, D] tensor stored per `layout`; returns storage size.
static size_t make_strides(int layout, int batch, int heads, int len, int d, int64_t (&st)[3]) {
  if (layout == 1) {  // storage [B, S, H, D]
    st[0] = int64_t{len} * heads * d, st[1] = d, st[2] = int64_t{heads} * d;
  } else {
    const int64_t row = layout == 2 ? d + 24 : d;
    st[2] = row, st[1] = row * len, st[0] = row * len * heads;
  }
  return static_cast<size_t>(st[0]) * batch;
}

template <typename T>
static T* upload(const std::vector<T>& h) {
  T* d;
  CHECK_CUDA(cudaMalloc(&d, h.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Uniform(-1, 1) from a hash of (seed, index): the timing inputs are made on the device.
template <typename T>
__global__ void fill_uniform(T* p, size_t n, uint64_t seed, float amplitude) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 29, x *= 0x94D049BB133111EBull, x ^= x >> 32;
    p[i] = from_f<T>(amplitude * (float(x & 0xFFFFFF) / float(1 << 23) - 1.0f));
  }
}

// Whether `name` contains one of the comma-separated texts of `only` (a harness's --only), or is one
// of them written after "=" (the exact name).
static bool selected(const char* name, const char* only) {
  std::string list(only);
  for (size_t start = 0; start <= list.size();) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, end - start);
    if (!item.empty() &&
        (item[0] == '=' ? item.compare(1, std::string::npos, name) == 0 : strstr(name, item.c_str()) != nullptr)) {
      return true;
    }
    start = end + 1;
  }
  return false;
}

// A gradient's error against its reference: relative L2, the largest absolute error against the
// largest reference value, NaN count (and, kept by the caller, values that should be exact zeros).
struct GradError {
  double err2 = 0, ref2 = 0, max_abs = 0, max_ref = 0;
  long nan = 0, bad_zero = 0;
  void add(double got, double ref) {
    if (!(got == got)) {
      ++nan;
      return;
    }
    err2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
    max_abs = std::max(max_abs, std::fabs(got - ref));
    max_ref = std::max(max_ref, std::fabs(ref));
  }
  double rel() const {
    return ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  }
  double max_rel() const {
    return max_ref > 0 ? max_abs / max_ref : max_abs;
  }
};

// Key ranges ([2, q_len, 2] int32 lo, hi) for the checks of the kernels that read them: batch 0 a
// random interval of keys a row (every eighth row empty; ends past both sides of [0, kv_len)),
// batch 1 a band (keys i - 50 .. i + 30).
static std::vector<int> make_key_ranges(int q_len, int kv_len, std::mt19937& rng) {
  std::vector<int> ranges(size_t(2) * q_len * 2);
  std::uniform_int_distribution<int> key(-20, kv_len + 20);
  for (int i = 0; i < q_len; ++i) {
    int lo = key(rng), hi = key(rng);
    if (hi < lo) {
      std::swap(lo, hi);
    }
    ranges[2 * i] = i % 8 == 5 ? hi : lo;  // empty: lo = hi
    ranges[2 * i + 1] = hi;
    ranges[2 * (q_len + i)] = i - 50;
    ranges[2 * (q_len + i) + 1] = i + 31;
  }
  return ranges;
}

// The summary class of the tile of rows [i0, i0 + tq) x keys [j0, j0 + tk) (within q_len x kv_len)
// whose element (i, j) is visible(i, j): masked, visible, or `partial` (kTileMixed, or
// kTileDiagonal where the caller knows its diagonal).
template <class Visible>
static uint8_t tile_class(int i0, int tq, int j0, int tk, int q_len, int kv_len, uint8_t partial, Visible&& visible) {
  int seen = 0, total = 0;
  for (int i = i0; i < std::min(i0 + tq, q_len); ++i) {
    for (int j = j0; j < std::min(j0 + tk, kv_len); ++j) {
      seen += visible(i, j) ? 1 : 0;
      ++total;
    }
  }
  using safeattn::cuda::attn::kTileMasked, safeattn::cuda::attn::kTileVisible;
  return seen == 0 ? uint8_t{kTileMasked} : seen == total ? uint8_t{kTileVisible} : partial;
}
