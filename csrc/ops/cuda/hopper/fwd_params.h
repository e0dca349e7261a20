// What the sm_90a forward attention kernel (hopper/fwd_kernel.cuh) reads and writes: plain data,
// no CuTe and no torch, so the dispatch code (attention_fwd_sm90.cu, built for plain sm_90) and
// the standalone check (benchmarks/hopper_fwd_check.cu) can both fill it. Semantics: ops/attention.h.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "ops/cuda/hopper/sm90_params.h"

namespace safeattn::cuda::hopper {

// The tiles of the mask summary the sm_90a kernels read (attn::summarize_mask_tiles), each kernel's
// own, so that a tile's class is one byte of the summary: the forward's kFwdMaskTileRows query
// rows x fwd_key_tile(D) keys (its tile), the backward's kBwdMaskTileRows x bwd_key_tile(D)
// (hopper/bwd_params.h).
constexpr int kFwdMaskTileRows = 128;
// The forward's key tile for head dim D: 128 keys, but 64 past D = 128, where O's D / 2
// accumulators per thread leave no registers for 128 keys' scores (and K and V stages of 128 keys
// no shared memory beside Q).
constexpr int fwd_key_tile(int head_dim) {
  return head_dim > 128 ? 64 : 128;
}

// Q, K, V and the mask: Sm90Inputs. The mask's summary is for tiles of kFwdMaskTileRows x
// fwd_key_tile(D) (a 16-bit float mask with aligned rows comes as TMA tiles:
// launch_attention_fwd_sm90); head_group 0: fwd_head_group's choice for the grid and l2_bytes.
struct FwdSm90Params : Sm90Inputs {
  void* out = nullptr;                   // [B, Hq, Q, D] strided view, 4-byte aligned rows
  float* lse = nullptr;                  // [B, Hq, Q] contiguous, natural log
  float* lse_lo = nullptr;               // [B, Hq, Q] contiguous or null: lse + lse_lo = m + log(l) closely
  int64_t o_sb = 0, o_sh = 0, o_si = 0;  // strides in elements
  const float* sinks = nullptr;          // [Hq] or null: logits (natural units) in the denominator only
  // Persistent grid: at most this many CTAs (the multiprocessor count); 0: one CTA per tile.
  int max_ctas = 0;
  // Null: static schedule (CTA c takes tiles c, c + grid, ...). Else one int, zeroed by the kernel
  // on the stream just before the launch (the launch depends on it programmatically: fwd_kernel.cuh):
  // CTAs take tiles dynamically, which keeps unequal (causal) tiles balanced.
  int* tile_counter = nullptr;
  int64_t l2_bytes = 0;  // the device's L2 cache (0: unknown)
};

// The launcher of one (dtype, head dim) instantiation; T is __nv_bfloat16 or __half. Defined in
// fwd_kernel.cuh, instantiated once per generated file attention_fwd_sm90_d<D>_<dtype>.cu.
// Returns the launch's error (cudaErrorInvalidValue for more than 2^31 - 1 tiles).
template <typename T, int kHeadDim>
cudaError_t launch_attention_fwd_sm90(const FwdSm90Params& params, cudaStream_t stream);

}  // namespace safeattn::cuda::hopper
