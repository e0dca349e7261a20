// How the sm_90a attention kernels write their results from the accumulator registers. Contract:
// float32 accumulators are rounded to the output's 16-bit type and stored through the output's
// strides, two adjacent columns a 4-byte store (rows 4-byte aligned: the host checks it); rows
// past the end (q_len, or keys past kv_len) are never written; an empty row (no visible key) is
// written as exactly 0, its lse -inf and lse_lo 0 (OnlineSoftmax::finish, softmax.cuh).
#pragma once

#include <cstdint>

#include <cutlass/array.h>

#include "ops/cuda/hopper/softmax.cuh"
#include "ops/cuda/score_rule.cuh"

namespace safeattn::cuda::hopper::detail {

// Two adjacent columns (lo, hi) rounded to Element, and the 4-byte slot they are stored to with one
// store: pair_at(dst) = rounded_pair<Element>(lo, hi) (the conversion comes first).
template <typename Element>
__device__ __forceinline__ cutlass::AlignedArray<Element, 2> rounded_pair(float lo, float hi) {
  cutlass::AlignedArray<Element, 2> pair;
  pair[0] = Element(lo);
  pair[1] = Element(hi);
  return pair;
}
template <typename Element>
__device__ __forceinline__ cutlass::AlignedArray<Element, 2>& pair_at(Element* dst) {
  return *reinterpret_cast<cutlass::AlignedArray<Element, 2>*>(dst);
}

// The forward's epilogue: O / l of a consumer thread's two rows (a 64 x D accumulator), lse and
// lse_lo per row, the sink logit added to the denominator where there are sinks (attn::finish_row,
// as in every kernel). kNatural: the softmax ran in natural units (a float mask), as the sinks are.
template <typename Element, int kHeadDim, bool kNatural>
struct OutputEpilogue {
  // p: out, o_sb / o_sh / o_si, lse, lse_lo, sinks, heads, q_len; t: batch, head; row0: this
  // thread's first row.
  template <class P, class T, class FragO>
  static __device__ __forceinline__ void store(const P& p, const T& t, FragO& o, const float (&row_max)[2],
                                               const float (&row_sum)[2], float unit, int64_t row0, int lane) {
    using Softmax = OnlineSoftmax<0, kNatural>;
    const int64_t bh = int64_t{t.batch} * p.heads + t.head;
    Element* out = p.out + t.batch * p.o_sb + t.head * p.o_sh;
    const float sink = p.sinks != nullptr ? p.sinks[t.head] * (kNatural ? 1.0f : attn::kLog2e) : 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = Softmax::total(row_sum[r]);
      const int64_t row = row0 + 8 * r;
      if (row >= p.q_len) {
        continue;
      }
      const bool empty = sum == 0.0f;
      const attn::RowEnd end = Softmax::finish(row_max[r], sum, unit, p.sinks != nullptr, sink);
      Element* out_row = out + row * p.o_si + 2 * (lane % 4);
#pragma unroll
      for (int c = 0; c < kHeadDim / 8; ++c) {
        // An empty row is exactly 0 even if a masked V held NaN (0 * NaN in P V).
        const float lo = empty ? 0.0f : o(2 * r + 4 * c) * end.factor;
        const float hi = empty ? 0.0f : o(1 + 2 * r + 4 * c) * end.factor;
        pair_at(out_row + 8 * c) = rounded_pair<Element>(lo, hi);
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

// A consumer thread's two rows (row0, row0 + 8) of a 64 x D float32 accumulator rounded and
// stored at dst (this thread's first element) through row stride `stride`; rows at or past
// `rows` are not written.
template <class FragC, typename Element>
__device__ __forceinline__ void store_rows(const FragC& acc, Element* dst, int64_t stride, int64_t row0, int64_t rows) {
#pragma unroll
  for (int i = 0; i < cute::size(acc); i += 2) {
    const int r = (i / 2) % 2;
    if (row0 + 8 * r < rows) {
      pair_at(dst + 8 * r * stride + 8 * (i / 4)) = rounded_pair<Element>(acc(i), acc(i + 1));
    }
  }
}

}  // namespace safeattn::cuda::hopper::detail
