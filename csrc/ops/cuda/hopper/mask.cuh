// Which scores of a tile are visible, for every sm_90a attention kernel. Contract: a masked score
// is set to -inf, never added to, so nothing behind it (NaN or inf in K, V or a bias) leaks; the
// masks are ANDed:
//   none          only keys past kv_len (the key padding of the last tile) are masked;
//   causal        query i sees key j iff j <= i + causal_shift (q_offset - kv_offset);
//   dense         an attn_mask (bool, or float: a bias added in natural units) read per element
//                 only in its summary's mixed tiles; fully masked tiles are never visited, fully
//                 visible ones read nothing, diagonal ones are a compare (kMasked);
//   key ranges    each query row's one interval of keys, tested with the mask's mixed tiles.
// The summary is walked by the producer, which hands each visited tile (TileVisit) to the
// consumers through shared memory with a TMA load, so the consumers' loop reads no summary.
// MaskPolicy::QueryMajor serves the fragments whose rows are query rows (the forward and the dQ
// pass: 64 x kBlockN per consumer warpgroup, element e + 2 r + 4 c of a thread at row
// 16 warp + lane / 4 + 8 r, column 8 c + 2 (lane % 4) + e); MaskPolicy::KeyMajor the dK/dV
// kernel's transposed ones (keys are rows), with the same rules.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "ops/cuda/mask_view.cuh"

namespace safeattn::cuda::hopper::detail {

// A tile the walk over a mask summary visits: its position in the walk's order (outside the walk's
// range: the walk has ended), class and, for a kTileDiagonal one, its diagonal. The producer
// writes it before the load's mbarrier arrive (release); the consumers read it after the wait
// (acquire).
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

// kMasked: the variant that reads a mask's summary (and the mask, and the key ranges); the other
// has none of that code (the mask's gathers cost the unmasked kernels registers they cannot
// spare). kBias: the mask is a float one, whose values are added in natural units; a bool mask's
// kernel has none of that code. kBiasTile: the float mask's mixed tiles come through shared memory
// (the TMA bias tiles of the forward and the dK/dV kernel) and are added, and their -inf elements
// masked, there, not gathered here.
template <bool kMasked_, bool kBias_, bool kBiasTile_ = false>
struct MaskPolicy {
  static constexpr bool kMasked = kMasked_;
  static constexpr bool kBias = kBias_;
  static constexpr bool kBiasTile = kBiasTile_;
  static_assert(kMasked || !kBias, "a bias is a mask");
  static_assert(kBias || !kBiasTile, "a bias tile is a bias");

  // The key tile visited after tile n of a query tile (m_block of head, batch): the nearest one
  // below n, at least `lowest` (the summary's first_visible), that the summary does not rule out
  // (position -1: none), with its class and diagonal. Without a summary every tile down to 0.
  template <class P>
  static __device__ __forceinline__ TileVisit visit_after(const P& p, int batch, int head, int m_block, int n,
                                                          int lowest) {
    TileVisit v{n - 1, attn::kTileVisible, 0};
    if constexpr (kMasked) {
      for (; v.position >= lowest; --v.position) {
        v.tile_class = p.mask_tiles.at(batch, head, m_block, v.position);
        if (v.tile_class == attn::kTileDiagonal) {
          v.diagonal = p.mask_tiles.diagonal_at(batch, head, m_block, v.position);
        }
        if (v.tile_class != attn::kTileMasked) {
          return v;
        }
      }
      v.position = -1;
    }
    return v;
  }

  template <int kBlockN>
  struct QueryMajor {
    static constexpr int kElems = kBlockN / 2;  // accumulator elements per thread

    // The last key each of this thread's rows (row0, row0 + 8) sees, causality and kv_len folded
    // in, clamped to [-1, kv_len - 1].
    template <class P>
    static __device__ __forceinline__ void last_keys(const P& p, int64_t row0, int (&last_key)[2]) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t causal_last = p.causal ? row0 + 8 * r + p.causal_shift : int64_t{p.kv_len};
        last_key[r] = static_cast<int>(std::max<int64_t>(std::min<int64_t>(causal_last, p.kv_len - 1), -1));
      }
    }
    // Whether key tile n tests elements: it reaches past kv_len or past the tile's first row's limit.
    template <class P>
    static __device__ __forceinline__ bool needs_mask(const P& p, int n, int64_t tile_row0) {
      const int64_t tile_last_key = int64_t{n + 1} * kBlockN - 1;
      return tile_last_key >= p.kv_len || (p.causal && tile_last_key > tile_row0 + p.causal_shift);
    }
    // Causality and kv_len on key tile n_block: one compare with a constant and one select per
    // element, so the diagonal tiles cost little more than the others.
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

    // The mask's bits of a visited key tile (set: visible), one per accumulator element: all set
    // unless the tile is mixed or diagonal. A diagonal tile's are a compare: element e + 2 r + 4 c
    // (column 8 c + 2 (lane % 4) + e of the tile, row row_in_tile + 8 r) is visible iff
    // column <= row + diagonal. A mixed tile's are gathered (gather_mask).
    // TileClass: the class as the caller keeps it (an int of a TileVisit, or a byte).
    template <class P, class T, class TileClass>
    static __device__ __forceinline__ uint64_t tile_bits(const P& p, const T& t, int n, TileClass tile_class,
                                                         int diagonal, int row_in_tile, int64_t row0, int lane) {
      if constexpr (kMasked) {
        if (tile_class == attn::kTileDiagonal) {
          uint64_t keep = 0;
#pragma unroll
          for (int i = 0; i < kElems; ++i) {
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
    }

    // The bool mask's elements of key tile n_block for this thread's accumulator elements, one bit
    // each (set: visible), eight loads in flight, ANDed with the rows' key intervals where there
    // are any; the consumers gather a tile's bits while the products of the tile before it run.
    // Rows past q_len and keys past kv_len keep their bit (the first are never written, the second
    // are -inf already). P and T: a kernel's Params and Tile (mask, key_ranges, q_len, kv_len;
    // batch, head).
    template <class P, class T>
    static __device__ __forceinline__ uint64_t gather_mask(const P& p, const T& t, int n_block, int64_t row0,
                                                           int lane) {
      static_assert(kElems <= 64, "one bit per accumulator element");
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
      if (!kBiasTile && p.mask.ptr != nullptr) {  // kBiasTile: the bias tile masks the -inf elements
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

    // The element tests of key tile n's scores: causality and kv_len where the tile reaches past
    // them (tile_row0: the tile's first row), then the mask's bits `keep`.
    template <class FragS, class P>
    static __device__ __forceinline__ void mask_scores(FragS& s, const P& p, int n, uint64_t keep, int64_t tile_row0,
                                                       const int (&last_key)[2], int lane) {
      if (needs_mask(p, n, tile_row0)) {
        mask_tile(s, n, last_key, lane);
      }
      if constexpr (kMasked) {
        if (~keep != 0) {
          apply_mask(s, keep);
        }
      }
    }

    // The elements whose bit is clear set to -inf.
    template <class FragS>
    static __device__ __forceinline__ void apply_mask(FragS& s, uint64_t keep) {
#pragma unroll
      for (int i = 0; i < decltype(cute::size(s))::value; ++i) {
        if (!((keep >> i) & 1u)) {
          s(i) = -INFINITY;
        }
      }
    }
  };

  // The dK/dV kernel's transposed fragments (S^T: keys are rows, a step's query rows columns):
  // accumulator element i of a thread sits at key key_base + acc_row(i) of the key tile and query
  // row query_base + acc_col(i) of the step (per-thread bases plus constants once the loops are
  // unrolled). A step is query tile m_begin + step % m_count of head kv_head * group + step / m_count.
  template <int kBlockM, int kBlockN>
  struct KeyMajor {
    static __device__ __forceinline__ int acc_row(int i) {
      return 8 * ((i / 2) % 2);
    }
    static __device__ __forceinline__ int acc_col(int i) {
      return 8 * (i / 4) + i % 2;
    }

    // The mask's bits of a visited step (set: visible), one per accumulator element of S^T: a
    // diagonal step's are a compare (query row r of the tile sees the tile's keys c <= r +
    // diagonal), a mixed one's are gathered, the others' all set. Rows past q_len and keys past
    // kv_len read nothing and keep their bit (they are masked apart).
    template <int kElems, class P>
    static __device__ __forceinline__ uint32_t tile_bits(const P& p, const TileVisit& visit, int steps, int batch,
                                                         int kv_head, int m_begin, int m_count, int key0,
                                                         int keys_in_tile, int key_base, int query_base) {
      uint32_t keep = ~0u;
      if constexpr (kMasked) {
        const int step = visit.position;
        if (step < steps && visit.tile_class == attn::kTileDiagonal) {
          keep = 0;
#pragma unroll
          for (int i = 0; i < kElems; ++i) {
            keep |= uint32_t{key_base + acc_row(i) <= query_base + acc_col(i) + visit.diagonal} << i;
          }
        } else if (step < steps && visit.tile_class == attn::kTileMixed) {
          static_assert(kElems <= 32);
          const int row0 = (m_begin + step % m_count) * kBlockM;
          const int last_row = p.q_len - 1 - row0;
          // Unconditional loads (indices clamped, bounds applied after), all in flight at once. A
          // float mask's bits are its elements that are not -inf (add_bias adds the values).
          auto gather = [&](const auto* mask) {
            mask += p.mask.offset(batch, kv_head * p.group + step / m_count, row0, key0);
#pragma unroll 8
            for (int i = 0; i < kElems; ++i) {
              const int key = key_base + acc_row(i), row = query_base + acc_col(i);
              const bool visible =
                  attn::visible(mask[int64_t{row < last_row ? row : last_row} * p.mask.stride_q +
                                     int64_t{key < keys_in_tile ? key : keys_in_tile - 1} * p.mask.stride_kv]);
              if (!visible && key < keys_in_tile && row <= last_row) {
                keep &= ~(1u << i);
              }
            }
          };
          if (!kBiasTile && p.mask.ptr != nullptr) {  // kBiasTile: the bias tile masks the -inf elements
            p.mask.with_elements(gather);
          }
          if (p.key_ranges.ptr != nullptr) {  // and each row's one interval of keys
#pragma unroll 8
            for (int i = 0; i < kElems; ++i) {
              const int key = key0 + key_base + acc_row(i), row = query_base + acc_col(i);
              const int64_t q = row0 + (row < last_row ? row : last_row);
              if (key < p.key_ranges.lo(batch, q) || key >= p.key_ranges.hi(batch, q)) {
                keep &= ~(1u << i);
              }
            }
          }
        }
      }
      return keep;
    }

    // A float mask's values of a mixed step added to its scores, which go to natural units; its
    // -inf elements are masked after, by tile_bits (NaN behind them does not leak). Loads as in
    // tile_bits: clamped, unconditional; tile_bits read the same elements a step before, so these
    // mostly hit L1 (reading them once, here, with the -inf test folded in, measured 1.2 ms slower
    // at D = 128: notes).
    template <class FragS, class P>
    static __device__ __forceinline__ void add_bias(FragS& s, const P& p, int batch, int head, int row0, int key0,
                                                    int keys_in_tile, int key_base, int query_base) {
      const int last_row = p.q_len - 1 - row0;
      p.mask.with_values([&](const auto* mask) {
        mask += p.mask.offset(batch, head, row0, key0);
#pragma unroll
        for (int i = 0; i < cute::size(s); ++i) {
          const int key = key_base + acc_row(i), row = query_base + acc_col(i);
          const float bias =
              attn::to_float(mask[int64_t{row < last_row ? row : last_row} * p.mask.stride_q +
                                  int64_t{key < keys_in_tile ? key : keys_in_tile - 1} * p.mask.stride_kv]);
          s(i) = fmaf(s(i), p.score.natural_scale, bias);
        }
      });
    }

    // Keys past kv_len, and under causality key > row + shift: limit is the largest visible
    // (key - row) offset within the tile, clamped to int range. Then the mask's bits.
    template <class FragS, class P>
    static __device__ __forceinline__ void mask_tile(FragS& s, const P& p, uint32_t keep, int row0, int key0,
                                                     int keys_in_tile, int key_base, int query_base) {
      const int64_t diagonal = int64_t{row0} + p.causal_shift - key0;
      const bool causal_mask = p.causal && diagonal < kBlockN - 1;
      if (keys_in_tile < kBlockN || causal_mask) {
        const int limit = static_cast<int>(std::max<int64_t>(std::min<int64_t>(diagonal, kBlockN), -kBlockM - 1));
#pragma unroll
        for (int i = 0; i < cute::size(s); ++i) {
          const int key = key_base + acc_row(i), row = query_base + acc_col(i);
          if (key >= keys_in_tile || (causal_mask && key - row > limit)) {
            s(i) = -INFINITY;
          }
        }
      }
      if (kMasked && ~keep != 0) {
#pragma unroll
        for (int i = 0; i < cute::size(s); ++i) {
          if (!((keep >> i) & 1u)) {
            s(i) = -INFINITY;
          }
        }
      }
    }
  };
};

}  // namespace safeattn::cuda::hopper::detail
