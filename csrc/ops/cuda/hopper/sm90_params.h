// What both directions of the sm_90a attention kernels are given about the inputs: plain data, no
// CuTe and no torch, so the dispatch code (attention_{fwd,bwd}_sm90.cu, built for plain sm_90)
// and the standalone checks (benchmarks/hopper_*_check.cu) can fill it. Contract: Q, K and V as
// TMA reads them, the score rule, causality, the mask with its tile summary and the key ranges;
// FwdSm90Params (fwd_params.h) and BwdSm90Params (bwd_params.h) add what each direction writes.
// Semantics: ops/attention.h.
#pragma once

#include <cstdint>

#include "ops/cuda/mask_view.cuh"
#include "ops/cuda/score_rule.cuh"

namespace safeattn::cuda::hopper {

struct Sm90Inputs {
  // Element 0 of each tensor; 16-byte aligned, unit inner stride, every other stride a multiple
  // of 8 elements (what TMA needs); sizes below 2^31.
  const void* q = nullptr;               // [B, Hq, Q, D]
  const void* k = nullptr;               // [B, Hkv, KV, D]
  const void* v = nullptr;               // [B, Hkv, KV, D]
  int64_t q_sb = 0, q_sh = 0, q_si = 0;  // strides in elements
  int64_t k_sb = 0, k_sh = 0, k_si = 0;
  int64_t v_sb = 0, v_sh = 0, v_si = 0;
  int batch = 1, heads = 1, kv_heads = 1;  // query head h reads kv head h / (heads / kv_heads)
  int q_len = 0, kv_len = 0;
  // Scores in log2 units: score.scale = scale * log2(e), score.natural_scale = scale > 0; with a
  // softcap (score.softcap_post > 0) each score is score.score() of its dot product
  // (attn::score_rule(scale, softcap, false)).
  attn::ScoreRule score;
  bool causal = false;
  // Query i sees key j iff j <= i + causal_shift (q_offset - kv_offset); the host clamps it to
  // [-q_len - 1, kv_len], which changes no visibility and keeps i + shift in range.
  int64_t causal_shift = 0;
  // attn_mask as a [B, Hq, Q, KV] view (bool, or float: a bias added to the scores; kNone: no
  // mask) and its summary for the kernel's tiles: fully masked tiles are skipped, fully visible
  // ones read no mask, and mixed ones read it per element.
  attn::MaskView mask;
  attn::TileSummaryView mask_tiles;
  // Null, or each query row's one interval of keys (AttentionFwdArgs::key_ranges), ANDed with the
  // mask: mask_tiles then summarises both (attn::summarize_key_ranges), and a mixed tile tests
  // both per element (the mask's bits where there is a mask, the interval's always).
  attn::KeyRangeView key_ranges;
  // Causal (and masked) tiles go longest first within groups of at most head_group (batch,
  // head)s (ops/cuda/tile_order.h); 0: the direction's own choice; 1: head after head.
  int head_group = 0;
};

}  // namespace safeattn::cuda::hopper
