// How the sm_90a attention kernels write their results from the accumulator registers. Contract:
// float32 accumulators are rounded to the output's 16-bit type and stored through the output's
// strides, 16 bytes a store where the rows are 16-byte aligned, else 4 (two adjacent columns; rows
// are at least 4-byte aligned: the host checks it); rows past the end (q_len, or keys past kv_len)
// are never written; an empty row (no visible key) is written as exactly 0, its lse -inf and
// lse_lo 0 (OnlineSoftmax::finish, softmax.cuh). The forward's output may instead be rounded into a
// fragment (OutputEpilogue::rounded) that the kernel stores by TMA (Fwd::store_staged), with the same
// values.
#pragma once

#include <cstdint>

#include <cutlass/array.h>

#include "ops/cuda/hopper/softmax.cuh"
#include "ops/cuda/score_rule.cuh"

namespace safeattn::cuda::hopper::detail {

// Two accumulator values (lo, hi) rounded to Element: two adjacent columns, one 4-byte word.
template <typename Element>
__device__ __forceinline__ uint32_t rounded_word(float lo, float hi) {
  cutlass::AlignedArray<Element, 2> pair;
  pair[0] = Element(lo);
  pair[1] = Element(hi);
  return reinterpret_cast<const uint32_t&>(pair);
}

// A quad's 4 x 4 words, transposed: lane q's word i becomes lane i's word q (two exchange rounds,
// lanes q ^ 1 then q ^ 2). Every lane of the warp takes part.
__device__ __forceinline__ void transpose_quad(uint32_t (&w)[4], int lane) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit *= 2) {
    const bool high = (lane & bit) != 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if ((i & bit) == 0) {  // the pair (i, i + bit): a lane keeps the word whose bit matches its own
        const uint32_t sent = __shfl_xor_sync(0xffffffffu, high ? w[i] : w[i + bit], bit);
        (high ? w[i] : w[i + bit]) = sent;
      }
    }
  }
}

// One row of a wgmma accumulator, rounded and stored: the row's kBlocks blocks of 8 columns are
// spread over a quad, lane q holding columns 2 q and 2 q + 1 of each, word(c) (rounded_word's 4
// bytes). Four blocks at a time are transposed over the quad (transpose_quad), so each lane holds 8
// consecutive columns and the quad writes 64 contiguous bytes, one 16-byte store a lane where `row`
// (column 0) is 16-byte aligned, else four 4-byte stores: whole 32-byte sectors with a quarter of
// the store instructions (H200, sm_90a forward, B x S = 16k, D = 128, ms: S=512 causal 0.133 ->
// 0.124, S=1024 0.182 -> 0.171; not causal 0.160 -> 0.152, 0.257 -> 0.246; D = 64 within 3%).
// Blocks past the last group of four go as pairs. Not written when !valid (every lane still takes
// part in the exchange).
template <int kBlocks, typename Element, class Word>
__device__ __forceinline__ void store_row(Element* row, bool valid, int lane, const Word& word) {
  const int q = lane % 4;
  const bool wide = reinterpret_cast<uintptr_t>(row) % 16 == 0;  // the same for the quad's lanes
#pragma unroll
  for (int g = 0; g < kBlocks / 4; ++g) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = word(4 * g + i);
    }
    transpose_quad(w, lane);  // now columns 8 (4 g + q) .. + 7
    if (valid) {
      Element* dst = row + 8 * (4 * g + q);
      if (wide) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          *reinterpret_cast<uint32_t*>(dst + 2 * i) = w[i];
        }
      }
    }
  }
#pragma unroll
  for (int c = kBlocks / 4 * 4; c < kBlocks; ++c) {
    const uint32_t w = word(c);
    if (valid) {
      *reinterpret_cast<uint32_t*>(row + 8 * c + 2 * q) = w;
    }
  }
}

// The forward's epilogue: O / l of a consumer thread's two rows (a 64 x D accumulator), lse and
// lse_lo per row, the sink logit added to the denominator where there are sinks (attn::finish_row,
// as in every kernel). kNatural: the softmax ran in natural units (a float mask), as the sinks are.
// Two routes for O: store() from the registers through out's strides; or rounded() into a 16-bit
// fragment that the kernel stages in shared memory for a TMA store (fwd_kernel.cuh).
template <typename Element, int kHeadDim, bool kNatural>
struct OutputEpilogue {
  // What each of the thread's two rows is multiplied by, and which of them are empty (no visible
  // key: written as exactly 0 even if a masked V held NaN, 0 * NaN in P V).
  struct Rows {
    float factor[2];
    bool empty[2];
  };

  // Finishes the thread's rows and writes their lse and lse_lo. p: lse, lse_lo, sinks, heads,
  // q_len; t: batch, head; row0: this thread's first row.
  template <class P, class T>
  static __device__ __forceinline__ Rows finish(const P& p, const T& t, const float (&row_max)[2],
                                                const float (&row_sum)[2], float unit, int64_t row0, int lane) {
    using Softmax = OnlineSoftmax<0, kNatural>;
    const int64_t bh = int64_t{t.batch} * p.heads + t.head;
    const float sink = p.sinks != nullptr ? p.sinks[t.head] * (kNatural ? 1.0f : attn::kLog2e) : 0.0f;
    Rows rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = Softmax::total(row_sum[r]);
      const int64_t row = row0 + 8 * r;
      const attn::RowEnd end = Softmax::finish(row_max[r], sum, unit, p.sinks != nullptr, sink);
      rows.factor[r] = end.factor;
      rows.empty[r] = sum == 0.0f;
      if (row < p.q_len && lane % 4 == 0) {
        p.lse[bh * p.q_len + row] = end.lse;
        if (p.lse_lo != nullptr) {
          p.lse_lo[bh * p.q_len + row] = end.lse_lo;
        }
      }
    }
    return rows;
  }

  // Accumulator element i (row (i / 2) % 2 of the thread's two) finished.
  template <class FragO>
  static __device__ __forceinline__ float value(const FragO& o, const Rows& rows, int i) {
    const int r = (i / 2) % 2;
    return rows.empty[r] ? 0.0f : o(i) * rows.factor[r];
  }

  // O through out's strides (p: out, o_sb / o_sh / o_si besides finish's), rows past q_len unwritten.
  template <class P, class T, class FragO>
  static __device__ __forceinline__ void store(const P& p, const T& t, FragO& o, const float (&row_max)[2],
                                               const float (&row_sum)[2], float unit, int64_t row0, int lane) {
    const Rows rows = finish(p, t, row_max, row_sum, unit, row0, lane);
    Element* out = p.out + t.batch * p.o_sb + t.head * p.o_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row0 + 8 * r;
      const bool valid = row < p.q_len;
      store_row<kHeadDim / 8>(out + (valid ? row : 0) * p.o_si, valid, lane, [&](int c) {
        return rounded_word<Element>(value(o, rows, 2 * r + 4 * c), value(o, rows, 1 + 2 * r + 4 * c));
      });
    }
  }

  // O finished and rounded into `out`, a 16-bit fragment of o's layout.
  template <class FragO, class FragOut>
  static __device__ __forceinline__ void rounded(const FragO& o, const Rows& rows, FragOut& out) {
#pragma unroll
    for (int i = 0; i < decltype(cute::size(o))::value; ++i) {
      out(i) = Element(value(o, rows, i));
    }
  }
};

// A consumer thread's two rows (row0, row0 + 8) of a 64 x kCols float32 accumulator (rows 8 apart,
// element 2 r + 4 c + e at column 8 c + 2 (lane % 4) + e) rounded and stored at dst (column 0 of
// row0) through row stride `stride`; rows at or past `rows` are not written.
template <int kCols, class FragC, typename Element>
__device__ __forceinline__ void store_rows(const FragC& acc, Element* dst, int64_t stride, int64_t row0, int64_t rows,
                                           int lane) {
  static_assert(decltype(cute::size(acc))::value == kCols / 2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool valid = row0 + 8 * r < rows;
    store_row<kCols / 8>(dst + (valid ? 8 * r * stride : 0), valid, lane,
                         [&](int c) { return rounded_word<Element>(acc(2 * r + 4 * c), acc(1 + 2 * r + 4 * c)); });
  }
}

}  // namespace safeattn::cuda::hopper::detail
