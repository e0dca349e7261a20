// Which tile a CTA of an sm_90a attention kernel computes. Contract: each scheduler maps a CTA (and,
// for the persistent one, a running index) to a tile, in the order of ops/cuda/tile_order.h under
// causality or a mask (the longest tiles first within groups of heads, so the short ones fill the
// tail), in plain order otherwise; a tile knows the key tiles its rows may see (causality folded
// in, before any mask summary). P is a kernel's Params: heads, m_blocks, q_len, kv_len, causal,
// causal_shift, head_group (and batch_heads, tiles, tile_counter for the persistent one).
#pragma once

#include <cstdint>

#include "ops/cuda/pdl.cuh"
#include "ops/cuda/tile_order.h"

namespace safeattn::cuda::hopper::detail {

// kBlockM query rows of one (batch, head), and the key tiles of kBlockN its rows may see:
// [0, n_blocks).
struct QueryTile {
  int m_block, head, batch;
  int n_blocks;
};

template <int kBlockM, int kBlockN>
struct QueryTiles {
  // The key tiles query tile m_block's rows may see: up to the last row's causal limit, or kv_len.
  template <class P>
  static __device__ __forceinline__ int key_tiles(const P& p, int m_block) {
    int64_t kv_end = p.kv_len;
    if (p.causal) {
      const int64_t q_end = std::min<int64_t>(int64_t{m_block + 1} * kBlockM, p.q_len);
      kv_end = std::min<int64_t>(std::max<int64_t>(q_end + p.causal_shift, 0), p.kv_len);
    }
    return static_cast<int>((kv_end + kBlockN - 1) / kBlockN);
  }
};

// The forward's persistent schedule: tile `index` of tiles in (batch, head)-major order, longest
// causal rows first (kLongestFirst, or p.causal). CTA c starts with tile c, then takes the next
// from an atomic counter (p.tile_counter: the CTAs finish together, and the running tiles share a
// few heads' K/V in L2) or, without one, tile + grid.
template <int kBlockM, int kBlockN, bool kLongestFirst>
struct PersistentTileScheduler {
  template <class P>
  static __device__ __forceinline__ QueryTile tile_at(const P& p, int index) {
    QueryTile t;
    int bh;
    if (p.causal || kLongestFirst) {
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
    t.n_blocks = QueryTiles<kBlockM, kBlockN>::key_tiles(p, t.m_block);
    return t;
  }

  // The tile after `index`. The kernel may start while the counter's zeroing still runs (the
  // launch's programmatic dependency): the wait returns once that kernel is done (at once after
  // the first time, and on a launch without the dependency).
  template <class P>
  static __device__ __forceinline__ int next_tile(const P& p, int index) {
    if (p.tile_counter == nullptr) {
      return index + static_cast<int>(gridDim.x);
    }
    programmatic_wait();
    return static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1);
  }
};

// The dQ pass: one CTA per query tile of a (query tiles, heads, batch) grid, handed out by the
// hardware in linear order; under causality (or a mask: kLongestFirst) that order is read as
// longest_first's, the longest rows (the last query tiles) first within each group of heads.
template <int kBlockM, int kBlockN, bool kLongestFirst>
struct QueryTileGrid {
  template <class P>
  static __device__ __forceinline__ QueryTile tile_of(const P& p) {
    QueryTile t;
    const int64_t blocks = int64_t{gridDim.x} * gridDim.y * gridDim.z;
    if ((p.causal || kLongestFirst) && blocks <= INT32_MAX) {
      const int linear = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
      const TileRank r =
          longest_first(linear, static_cast<int>(gridDim.x), static_cast<int>(gridDim.y * gridDim.z), p.head_group);
      t.m_block = p.m_blocks - 1 - r.rank;
      t.head = r.head % p.heads;
      t.batch = r.head / p.heads;
    } else {
      t.m_block = static_cast<int>(blockIdx.x);
      t.head = static_cast<int>(blockIdx.y);
      t.batch = static_cast<int>(blockIdx.z);
    }
    t.n_blocks = QueryTiles<kBlockM, kBlockN>::key_tiles(p, t.m_block);
    return t;
  }
};

// The dK/dV kernel: one CTA per (key tile, kv head, batch) of a (key tiles, kv heads, batch) grid,
// in the hardware's linear order; under causality (or a mask: kLongestFirst) read as
// longest_first's over the (batch, kv head)s, so key tile 0 (seen by every query) and the other
// long ones go first in each group of heads; the kv head varies fastest in that group, or the
// batch row with p.batch_inner. So the CTAs that add a broadcast mask's gradient into the same
// elements (BwdSm90Params::grad_mask_adds) run side by side within a group: one key tile's kv
// heads in the default order (a mask shared by the heads; a kv group's query heads are one CTA's),
// its batch rows with batch_inner (a mask shared by the batch). A float mask always has a summary
// (kLongestFirst), so only a grid past INT32_MAX CTAs takes the hardware's order instead.
template <int kBlockM, int kBlockN, bool kLongestFirst>
struct KeyTileGrid {
  struct Block {
    int n_block, kv_head, batch;
  };
  template <class P>
  static __device__ __forceinline__ Block block_coords(const P& p) {
    const int64_t blocks = int64_t{gridDim.x} * gridDim.y * gridDim.z;
    if ((!p.causal && !kLongestFirst) || blocks > INT32_MAX) {
      return Block{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
    }
    const int linear = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    const TileRank r =
        longest_first(linear, static_cast<int>(gridDim.x), static_cast<int>(gridDim.y * gridDim.z), p.head_group);
    if (p.batch_inner) {
      return Block{r.rank, r.head / static_cast<int>(gridDim.z), r.head % static_cast<int>(gridDim.z)};
    }
    return Block{r.rank, r.head % static_cast<int>(gridDim.y), r.head / static_cast<int>(gridDim.y)};
  }

  // The query tiles key tile n_block sees: [first_m_block, m_blocks) of every head of the group.
  template <class P>
  static __device__ __forceinline__ int first_m_block(const P& p, int n_block) {
    if (!p.causal) {
      return 0;
    }
    // Query i sees key j iff j <= i + shift: the tile's first key is seen from i = j0 - shift on.
    const int64_t first_query = std::max<int64_t>(int64_t{n_block} * kBlockN - p.causal_shift, 0);
    return first_query >= p.q_len ? p.m_blocks : static_cast<int>(first_query / kBlockM);
  }
};

}  // namespace safeattn::cuda::hopper::detail
