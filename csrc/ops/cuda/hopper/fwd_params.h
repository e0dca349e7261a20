// What the sm_90a forward attention kernel (hopper/fwd_kernel.cuh) reads and writes: plain data,
// no CuTe and no torch, so the dispatch code (attention_fwd_sm90.cu, built for plain sm_90) and
// the standalone check (benchmarks/hopper_fwd_check.cu) can both fill it. Semantics: ops/attention.h.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "ops/cuda/mask_view.cuh"
#include "ops/cuda/score_rule.cuh"

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

struct FwdParams {
  // Element 0 of each tensor; 16-byte aligned, unit inner stride, every other stride a multiple
  // of 8 elements (what TMA needs); sizes below 2^31.
  const void* q = nullptr;               // [B, Hq, Q, D]
  const void* k = nullptr;               // [B, Hkv, KV, D]
  const void* v = nullptr;               // [B, Hkv, KV, D]
  void* out = nullptr;                   // [B, Hq, Q, D] strided view, 4-byte aligned rows
  float* lse = nullptr;                  // [B, Hq, Q] contiguous, natural log
  float* lse_lo = nullptr;               // [B, Hq, Q] contiguous or null: lse + lse_lo = m + log(l) closely
  int64_t q_sb = 0, q_sh = 0, q_si = 0;  // strides in elements
  int64_t k_sb = 0, k_sh = 0, k_si = 0;
  int64_t v_sb = 0, v_sh = 0, v_si = 0;
  int64_t o_sb = 0, o_sh = 0, o_si = 0;
  int batch = 1, heads = 1, kv_heads = 1;  // query head h reads kv head h / (heads / kv_heads)
  int q_len = 0, kv_len = 0;
  // Scores in log2 units: score.scale = scale * log2(e); with a softcap (score.softcap_post > 0)
  // each score is score.score() of its dot product (attn::score_rule(scale, softcap, false)).
  attn::ScoreRule score;
  const float* sinks = nullptr;  // [Hq] or null: logits (natural units) in the denominator only
  bool causal = false;
  // Query i sees key j iff j <= i + causal_shift (q_offset - kv_offset); the host clamps it to
  // [-q_len - 1, kv_len], which changes no visibility and keeps i + shift in range.
  int64_t causal_shift = 0;
  // attn_mask as a [B, Hq, Q, KV] view (bool, or float: a bias; kNone: no mask) and its summary
  // for tiles of kFwdMaskTileRows x fwd_key_tile(D): fully masked key tiles are skipped, fully
  // visible ones read no mask, and mixed ones read it per element (a 16-bit float mask with
  // aligned rows as TMA tiles: launch_attention_fwd_sm90).
  attn::MaskView mask;
  attn::TileSummaryView mask_tiles;
  // Null, or each query row's one interval of keys (AttentionFwdArgs::key_ranges), ANDed with the
  // mask: mask_tiles then summarises both (attn::summarize_key_ranges), and a mixed tile tests
  // both per element (the mask's bits where there is a mask, the interval's always).
  attn::KeyRangeView key_ranges;
  // Persistent grid: at most this many CTAs (the multiprocessor count); 0: one CTA per tile.
  int max_ctas = 0;
  // Null: static schedule (CTA c takes tiles c, c + grid, ...). Else one int, zeroed by the kernel
  // on the stream just before the launch (the launch depends on it programmatically: fwd_kernel.cuh):
  // CTAs take tiles dynamically, which keeps unequal (causal) tiles balanced.
  int* tile_counter = nullptr;
  // Causal (and masked) tiles go longest first within groups of at most head_group (batch, head)s
  // (hopper/tile_order.h); 0: fwd_head_group's choice for the grid and l2_bytes; 1: head after head.
  int head_group = 0;
  int64_t l2_bytes = 0;  // the device's L2 cache (0: unknown)
};

// The launcher of one (dtype, head dim) instantiation; T is __nv_bfloat16 or __half. Defined in
// fwd_kernel.cuh, instantiated once per generated file attention_fwd_sm90_d<D>_<dtype>.cu.
// Returns the launch's error (cudaErrorInvalidValue for more than 2^31 - 1 tiles).
template <typename T, int kHeadDim>
cudaError_t launch_attention_fwd_sm90(const FwdParams& params, cudaStream_t stream);

}  // namespace safeattn::cuda::hopper
