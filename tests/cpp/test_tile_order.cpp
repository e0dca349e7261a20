// The sm_90a kernels' causal tile order (ops/cuda/hopper/tile_order.h), checked on the host: every
// tile exactly once, head after head when head_group is 1, and within each group of heads the
// longest tiles (rank 0) first.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>

#include <vector>

#include "ops/cuda/hopper/tile_order.h"

using safeattn::cuda::hopper::longest_first;
using safeattn::cuda::hopper::TileRank;

CATCH_TEST_CASE("longest_first visits every tile once, longest first within each head group") {
  for (int tiles_per_head : {1, 3, 32}) {
    for (int heads : {1, 5, 64}) {
      for (int head_group : {1, 2, 4, 7, 64, 100}) {
        std::vector<int> seen(static_cast<size_t>(heads) * tiles_per_head, 0);
        int previous_group = -1, previous_rank = 0;
        for (int index = 0; index < heads * tiles_per_head; ++index) {
          const TileRank r = longest_first(index, tiles_per_head, heads, head_group);
          CATCH_REQUIRE(r.head >= 0);
          CATCH_REQUIRE(r.head < heads);
          CATCH_REQUIRE(r.rank >= 0);
          CATCH_REQUIRE(r.rank < tiles_per_head);
          ++seen[static_cast<size_t>(r.head) * tiles_per_head + r.rank];
          // Groups come in order, and within one the ranks never decrease (longest first).
          const int group = r.head / head_group;
          CATCH_REQUIRE(group >= previous_group);
          if (group == previous_group) {
            CATCH_REQUIRE(r.rank >= previous_rank);
          }
          previous_group = group;
          previous_rank = r.rank;
          if (head_group == 1) {  // the kernels' order before the groups: head after head
            CATCH_REQUIRE(r.head == index / tiles_per_head);
            CATCH_REQUIRE(r.rank == index % tiles_per_head);
          }
        }
        for (int count : seen) {
          CATCH_REQUIRE(count == 1);
        }
      }
    }
  }
}
