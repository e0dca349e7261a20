// The one head-dim switch of the CUDA attention kernels. A kernel family's head dims are the
// instantiation files setup.py compiles (attention_<family>_d<D>_<dtype>.cu, those that
// SAFEATTN_ATTN_HEAD_DIMS keeps), passed to the compiler as SAFEATTN_ATTN_<FAMILY>_DIM_BITS, bit
// D / 16 for each head dim D: no list of head dims is written in C++.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#ifndef SAFEATTN_ATTN_FWD_DIM_BITS
#define SAFEATTN_ATTN_FWD_DIM_BITS 0
#endif
#ifndef SAFEATTN_ATTN_BWD_DIM_BITS
#define SAFEATTN_ATTN_BWD_DIM_BITS 0
#endif
#ifndef SAFEATTN_ATTN_FWD_SM90_DIM_BITS
#define SAFEATTN_ATTN_FWD_SM90_DIM_BITS 0
#endif
#ifndef SAFEATTN_ATTN_BWD_SM90_DIM_BITS
#define SAFEATTN_ATTN_BWD_SM90_DIM_BITS 0
#endif

namespace safeattn::cuda {

// The compiled head dims of each family (bit D / 16).
constexpr uint64_t kFwdHeadDims = SAFEATTN_ATTN_FWD_DIM_BITS;           // attention_fwd.cuh
constexpr uint64_t kBwdHeadDims = SAFEATTN_ATTN_BWD_DIM_BITS;           // attention_bwd.cuh
constexpr uint64_t kFwdSm90HeadDims = SAFEATTN_ATTN_FWD_SM90_DIM_BITS;  // hopper/fwd_kernel.cuh
constexpr uint64_t kBwdSm90HeadDims = SAFEATTN_ATTN_BWD_SM90_DIM_BITS;  // hopper/bwd_kernel.cuh

namespace head_dim_detail {

template <uint64_t kDims, int kDim, typename F>
bool call_if(int64_t head_dim, F& f) {
  if constexpr (((kDims >> (kDim / 16)) & 1u) != 0) {
    if (head_dim == kDim) {
      f(std::integral_constant<int, kDim>{});
      return true;
    }
  }
  return false;
}

template <uint64_t kDims, typename F, int... kSteps>
bool dispatch(int64_t head_dim, F& f, std::integer_sequence<int, kSteps...>) {
  return (call_if<kDims, 16 * (kSteps + 1)>(head_dim, f) || ...);
}

}  // namespace head_dim_detail

// Calls f(std::integral_constant<int, D>{}) with D == head_dim when D is one of kDims (16, 32,
// ..., 256) and returns true; returns false otherwise. Only the head dims of kDims instantiate f.
template <uint64_t kDims, typename F>
bool with_head_dim(int64_t head_dim, F&& f) {
  return head_dim_detail::dispatch<kDims>(head_dim, f, std::make_integer_sequence<int, 16>{});
}

template <uint64_t kDims>
bool has_head_dim(int64_t head_dim) {
  return with_head_dim<kDims>(head_dim, [](auto) {});
}

}  // namespace safeattn::cuda
