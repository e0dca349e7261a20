// two_sum, with no torch include: the sm_90a kernels (hopper/) use it through
// ops/cuda/score_rule.cuh, every other kernel through ops/attention.h.
#pragma once

#include "common/host_device.h"

namespace safeattn {

// sum + err == a + b exactly (Knuth's TwoSum; no multiplication, so FMA contraction cannot
// change it). The forward kernels use it for lse and lse_lo.
template <typename T>
SAFEATTN_HOST_DEVICE inline void two_sum(T a, T b, T& sum, T& err) {
  sum = a + b;
  const T b_part = sum - a;
  err = (a - (sum - b_part)) + (b - b_part);
}

}  // namespace safeattn
