// The sm_90a kernels' causal tile order (ops/cuda/tile_order.h), checked on the host: every
// tile exactly once, head after head when head_group is 1, within each group of heads the longest
// tiles (rank 0) first, and the groups as equal as they can be; head_group_for's and fwd_head_group's rules.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>

#include <vector>

#include "ops/cuda/tile_order.h"

using safeattn::cuda::fwd_head_group;
using safeattn::cuda::head_group_for;
using safeattn::cuda::longest_first;
using safeattn::cuda::TileRank;

CATCH_TEST_CASE("longest_first visits every tile once, longest first within each head group") {
  for (int tiles_per_head : {1, 3, 32}) {
    for (int heads : {1, 5, 16, 64}) {
      for (int head_group : {1, 2, 4, 7, 9, 64, 100}) {
        CATCH_CAPTURE(tiles_per_head, heads, head_group);
        // The groups: ceil(heads / head_group) of them, the heads dealt out one at a time, so
        // their sizes differ by at most one, the larger ones first; consecutive heads each.
        std::vector<int> sizes((heads + head_group - 1) / head_group, 0);
        for (int h = 0; h < heads; ++h) {
          ++sizes[h % sizes.size()];
        }
        std::vector<int> seen(static_cast<size_t>(heads) * tiles_per_head, 0);
        int index = 0, first_head = 0;
        for (int size : sizes) {
          CATCH_REQUIRE(size <= head_group);
          int previous_rank = 0;
          for (int i = 0; i < size * tiles_per_head; ++i, ++index) {
            const TileRank r = longest_first(index, tiles_per_head, heads, head_group);
            // Inside its group, every tile once, and the ranks never decrease (longest first).
            CATCH_REQUIRE(r.head >= first_head);
            CATCH_REQUIRE(r.head < first_head + size);
            CATCH_REQUIRE(r.rank >= previous_rank);
            CATCH_REQUIRE(r.rank < tiles_per_head);
            previous_rank = r.rank;
            ++seen[static_cast<size_t>(r.head) * tiles_per_head + r.rank];
            if (head_group == 1) {  // the kernels' order before the groups: head after head
              CATCH_REQUIRE(r.head == index / tiles_per_head);
              CATCH_REQUIRE(r.rank == index % tiles_per_head);
            }
          }
          first_head += size;
        }
        for (int count : seen) {
          CATCH_REQUIRE(count == 1);
        }
      }
    }
  }
}

CATCH_TEST_CASE("head_group_for: the fewest heads with twice the resident CTAs' tiles, within bounds") {
  // 132 CTAs (an H100), 64 (batch, head)s: 32 tiles per head (S = 4096, 128-row tiles) need 9
  // heads for 264 tiles; 22 (192-row tiles) need 12; 64 tiles need 5.
  CATCH_REQUIRE(head_group_for(32, 64, 132) == 9);
  CATCH_REQUIRE(head_group_for(22, 64, 132) == 12);
  CATCH_REQUIRE(head_group_for(64, 64, 132) == 5);
  CATCH_REQUIRE(head_group_for(1000, 64, 132) == 1);  // one head already has the tiles
  CATCH_REQUIRE(head_group_for(8, 16, 132) == 16);    // never more than the heads there are
  CATCH_REQUIRE(head_group_for(0, 16, 132) == 1);     // nothing known: head after head
  CATCH_REQUIRE(head_group_for(32, 16, 0) == 1);
  for (int tiles : {1, 7, 32, 33, 100}) {
    for (int heads : {1, 3, 64, 1000}) {
      const int g = head_group_for(tiles, heads, 132);
      CATCH_REQUIRE(g >= 1);
      CATCH_REQUIRE(g <= heads);
      if (g < heads) {  // enough tiles, and one head fewer would not be
        CATCH_REQUIRE(g * tiles >= 2 * 132);
      }
      if (g > 1) {
        CATCH_REQUIRE((g - 1) * tiles < 2 * 132);
      }
    }
  }
}

CATCH_TEST_CASE("fwd_head_group: as many heads as the L2 holds the K and V of, never fewer than head_group_for") {
  const long long mb = 1 << 20, l2 = 50 * mb;  // an H100's L2
  // B4 H16 S4096 bf16: D = 64 (1 MB of K and V a head, 192-row tiles), D = 128 (2 MB), D = 256 (4 MB).
  CATCH_REQUIRE(fwd_head_group(22, 64, 132, 1 * mb, l2) == 50);
  CATCH_REQUIRE(fwd_head_group(32, 64, 132, 2 * mb, l2) == 25);
  CATCH_REQUIRE(fwd_head_group(32, 64, 132, 4 * mb, l2) == 12);
  CATCH_REQUIRE(fwd_head_group(22, 16, 132, 1 * mb, l2) == 16);  // never more than the heads there are
  CATCH_REQUIRE(fwd_head_group(32, 64, 132, 64 * mb, l2) == 9);  // one head's K and V past the L2
  CATCH_REQUIRE(fwd_head_group(32, 64, 132, 2 * mb, 0) == 9);    // the L2 unknown: head_group_for's
  CATCH_REQUIRE(fwd_head_group(32, 64, 132, 0, l2) == 9);
  for (long long kv : {1LL, 1000LL, 3 * mb, 1LL << 40}) {
    for (int heads : {1, 3, 64, 1000}) {
      const int g = fwd_head_group(32, heads, 132, kv, l2);
      CATCH_REQUIRE(g >= head_group_for(32, heads, 132));
      CATCH_REQUIRE(g <= heads);
      CATCH_REQUIRE((g == head_group_for(32, heads, 132) || g == heads || g * kv <= l2));
    }
  }
}
