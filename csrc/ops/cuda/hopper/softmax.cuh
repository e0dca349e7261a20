// The forward's online softmax over a consumer thread's two rows of a 64 x kBlockN accumulator
// (element e + 2 r + 4 c: row r, column 8 c + 2 (lane % 4) + e), and the exponentials both
// directions take. Contract, the safe rows: a row's running max starts at -inf and its exponent
// offset is 0 while the max is -inf, so a row whose scores are all -inf gets p = 0 (never
// exp2(-inf + inf) = NaN) and ends empty: out 0 (written as 0 even if a V behind it held NaN),
// lse -inf, lse_lo 0 (attn::finish_row). The max uses fmaxf (drops NaN), but a NaN score gives
// p = NaN, so NaN reaches out and lse.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "ops/cuda/score_rule.cuh"

namespace safeattn::cuda::hopper::detail {

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

// Across the four threads (lane % 4) that hold one row's columns.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// The online softmax of a consumer thread's two rows, over the caller's row state (kept in the
// caller's registers): row_max (in the units of the scores, -inf until a key is seen), row_sum
// (this thread's columns only, until total()) and correction (the last step's rescale of the
// earlier sums and outputs). kNatural: the scores are in natural units (a float mask's, unit
// log2(e)), and the max is subtracted before the change of base, exact for a row of huge values;
// otherwise one FMA takes a score to log2 units and subtracts the offset.
template <int kBlockN, bool kNatural>
struct OnlineSoftmax {
  static __device__ __forceinline__ void start(float (&row_max)[2], float (&row_sum)[2]) {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
  }

  // One tile of scores (in s, overwritten by p; `unit` takes them to log2 units: the scale for
  // raw dot products, 1 for softcapped scores, log2(e) for natural units).
  template <class FragS>
  static __device__ __forceinline__ void step(FragS& s, float (&row_max)[2], float (&row_sum)[2],
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
      const float offset = m == -INFINITY ? 0.0f : (kNatural ? m : m * unit);
      correction[r] =
          exp2_approx(kNatural ? (row_max[r] - offset) * unit : row_max[r] * unit - offset);  // 0 while row_max is -inf
      row_max[r] = m;
      float sum = 0.0f;
      if constexpr (kNatural) {
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
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
  }

  // The earlier outputs (a 64 x N accumulator of the same rows) rescaled by the last step.
  template <class FragO>
  static __device__ __forceinline__ void rescale(FragO& o, const float (&correction)[2]) {
#pragma unroll
    for (int i = 0; i < cute::size(o); ++i) {
      o(i) *= correction[(i / 2) % 2];
    }
  }

  // A row's sum over its four threads; every thread of the warp takes part (a shuffle).
  static __device__ __forceinline__ float total(float row_sum) {
    return quad_sum(row_sum);
  }
  // A row's end from its max and total: lse, lse_lo and the output's normaliser (0 for an empty
  // row: no visible key, total 0), the sink logit (log2 units, natural with kNatural) joining the
  // denominator where there is one. The max in log2 units (natural with kNatural) is the exponent
  // offset step used (the same product).
  static __device__ __forceinline__ attn::RowEnd finish(float row_max, float total, float unit, bool has_sink,
                                                        float sink) {
    return attn::finish_row(kNatural ? row_max : row_max * unit, total, has_sink, sink, kNatural);
  }
};

}  // namespace safeattn::cuda::hopper::detail
