// The order in which the attention kernels take their tiles under causality or a mask summary:
// the sm_90a kernels (hopper/fwd_kernel.cuh's persistent schedule, hopper/bwd_kernel.cuh's grid)
// and the generic mma.sync ones (generic/attention_fwd.cuh's and attention_bwd.cuh's grids, read
// in the hardware's block order). Plain integer arithmetic, free of torch and CUDA, so tests/cpp
// checks it on the host and benchmarks/schedule_sim.py simulates it; under nvcc, the occupancy
// query the launchers size the groups with.
#pragma once

#include <cstddef>

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#define SAFEATTN_TILE_ORDER_FN __host__ __device__ inline
#else
#define SAFEATTN_TILE_ORDER_FN inline
#endif

namespace safeattn::cuda {

// Tile `index` of heads x tiles_per_head, where a head's tile of rank 0 is its longest. The heads
// go in groups of consecutive heads (whose K and V stay in L2 together), group after group: as
// few groups as hold at most head_group heads each, as equal as they can be (the first ones one
// head larger). Within a group the longest tiles of all its heads come first, then the next
// longest, and so on. A schedule that hands tiles out in this order (an atomic counter, or the
// hardware's block order) ends with short tiles, so its CTAs finish together; head after head
// (head_group 1), each head's longest tiles come again right before the end, and the CTA that
// takes the last head's longest tile finishes a long tile after the others (simulated for B4 H16
// S4096 causal with the measured per-tile cost: 6.5% of the forward's time, 7% of the
// backward's; benchmarks/notes_attention_cuda.md). Unequal groups lose time too: 16 heads of the
// D = 128 forward in groups of 9 and 7 lose 4.5%, in two of 8 0.4%.
struct TileRank {
  int head, rank;
};

SAFEATTN_TILE_ORDER_FN TileRank longest_first(int index, int tiles_per_head, int heads, int head_group) {
  const int groups = (heads + head_group - 1) / head_group;
  const int size = heads / groups;           // heads in a smaller group
  const int larger = heads - size * groups;  // groups of size + 1 heads, first
  const int larger_tiles = larger * (size + 1) * tiles_per_head;
  const bool in_larger = index < larger_tiles;
  const int group_heads = in_larger ? size + 1 : size;
  const int rest = in_larger ? index : index - larger_tiles;
  const int group = rest / (group_heads * tiles_per_head);
  const int within = rest - group * group_heads * tiles_per_head;
  const int first_head = (in_larger ? 0 : larger * (size + 1)) + group * group_heads;
  return TileRank{first_head + within % group_heads, within / group_heads};
}

// The head group the kernels take: the fewest heads whose tiles number at least twice the CTAs
// that run at once, so that the last group's short tiles can fill the others' tail. Simulated
// over S = 1k to 32k, 8 to 256 (batch x head)s, D = 64 and 128, both directions (schedule_sim.py
// --sweep): 1.1% over the ideal on average, 2.9% at the 90th percentile, against 6.5% and 16.4%
// head after head; one group of every head does 0.7% / 2.0%, but then every head's K and V are
// live in L2 at once, where this group's come to about 2 x CTAs key tiles (17 MB at D = 128).
SAFEATTN_TILE_ORDER_FN int head_group_for(int tiles_per_head, int heads, int resident_ctas) {
  if (tiles_per_head <= 0 || resident_ctas <= 0) {
    return 1;
  }
  const int want = (2 * resident_ctas + tiles_per_head - 1) / tiles_per_head;
  return want < 1 ? 1 : (want > heads ? heads : want);
}

// The forward's head group: head_group_for's, or as many heads as the L2 holds the K and V of
// (kv_bytes a head; l2_bytes 0: unknown) when that is more. Larger groups end closer together
// and, while their K and V stay in L2, read no more from memory. H100, B4 H16 S4096 causal
// (benchmarks/notes_attention_cuda.md, "Causal tile order"): at D = 64 (1 MB a head) the kernel 2.4% faster
// in two groups of 32 than in groups of 12 (head_group_for's); at D = 128 (2 MB) groups of 21
// time as 9, while 32 (past the L2) lose 2.5% and one group of 64 7%.
SAFEATTN_TILE_ORDER_FN int fwd_head_group(int tiles_per_head, int heads, int resident_ctas, long long kv_bytes,
                                          long long l2_bytes) {
  const int group = head_group_for(tiles_per_head, heads, resident_ctas);
  if (kv_bytes <= 0 || l2_bytes <= 0 || heads <= 0) {
    return group;
  }
  const long long fit = l2_bytes / kv_bytes;
  return fit > group ? (fit > heads ? heads : static_cast<int>(fit)) : group;
}

#if defined(__CUDACC__)
// Host, for the launchers that size the groups: the CTAs of kKernel (threads a CTA, smem bytes of
// dynamic shared memory, its attribute already set) that run at once on the current GPU, by
// occupancy (at least one an SM), and that GPU's L2 in bytes (0: unknown). The occupancy is asked
// once per kernel, on the first GPU that launches it (the order it sizes changes only the time,
// never a result); a failed query leaves no error behind for the launch check.
inline int current_device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return value;
}

template <auto kKernel>
int resident_ctas(int threads, size_t smem) {
  static const int per_sm = [&] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      return 1;
    }
    return n < 1 ? 1 : n;
  }();
  return per_sm * current_device_attribute(cudaDevAttrMultiProcessorCount);
}

inline long long current_l2_bytes() {
  return current_device_attribute(cudaDevAttrL2CacheSize);
}
#endif

}  // namespace safeattn::cuda

#undef SAFEATTN_TILE_ORDER_FN
