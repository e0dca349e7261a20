// The order in which the sm_90a kernels take their tiles under causality (hopper/fwd_kernel.cuh's
// persistent schedule, hopper/bwd_kernel.cuh's grid): plain integer arithmetic, free of torch and
// CUDA, so tests/cpp checks it on the host.
#pragma once

#if defined(__CUDACC__)
#define SAFEATTN_TILE_ORDER_FN __host__ __device__ inline
#else
#define SAFEATTN_TILE_ORDER_FN inline
#endif

namespace safeattn::cuda::hopper {

// Tile `index` of heads x tiles_per_head, where a head's tile of rank 0 is its longest. The heads
// go in groups of head_group (consecutive heads, whose K and V stay in L2 together), group after
// group; within a group the longest tiles of all its heads come first, then the next longest,
// and so on. A schedule that hands tiles out in this order (an atomic counter, or the hardware's
// block order) ends with short tiles, so its CTAs finish together; head after head (head_group
// 1), each head's longest tiles come again right before the end, and the CTA that takes the last
// head's longest tile finishes a long tile after the others (simulated for B4 H16 S4096 causal
// with the measured per-tile cost: 6.5% of the forward's time, 7% of the backward's;
// benchmarks/notes_attention_cuda.md).
struct TileRank {
  int head, rank;
};

SAFEATTN_TILE_ORDER_FN TileRank longest_first(int index, int tiles_per_head, int heads, int head_group) {
  const int per_group = head_group * tiles_per_head;
  const int group = index / per_group;
  const int within = index - group * per_group;
  const int first_head = group * head_group;
  const int group_heads = heads - first_head < head_group ? heads - first_head : head_group;
  return TileRank{first_head + within % group_heads, within / group_heads};
}

}  // namespace safeattn::cuda::hopper

#undef SAFEATTN_TILE_ORDER_FN
