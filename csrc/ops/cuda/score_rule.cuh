// The score rule and the end of a row's softmax, shared by every CUDA attention kernel (the
// mma.sync ones through attention_common.cuh, the sm_90a ones in hopper/ directly): no torch
// include, so the Hopper kernels' translation units stay light. Semantics: ops/attention.h.
#pragma once

#include <cmath>

#include <cuda_runtime.h>

#include "ops/two_sum.h"

namespace safeattn::cuda::attn {

// Scores go to the log2 domain (exp2 is one instruction) and lse back to the natural one.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- score units ------------------------------------------------------------------------------

// The kernels hold scores in log2 units (score * log2(e): exp is one ex2 and log2(e) folds into
// the scale), except with a floating mask: a bias of finfo.min (Transformers' eager masks) times
// log2(e) overflows float32 to -inf and would turn a row of finfo.min, whose softmax is uniform,
// into an empty one. With a floating mask scores stay natural, the bias is added to them, and
// exponents are taken as ex2((s - m) * log2(e)) after the subtraction.
__device__ __forceinline__ float exp_of(float x, bool natural) {
  return exp2f(natural ? x * kLog2e : x);
}

// The end of a row's online softmax: its max m and sum l (of exp(s - m)), both in the kernel's
// units, and an optional sink logit (same units) that joins the denominator only. lse (natural
// log) and lse_lo (what float32 drops from it, ops/two_sum.h) are written by the
// caller; `factor` normalises the row's accumulator (0 for a row with no visible key).
struct RowEnd {
  float lse, lse_lo, factor;
};
__device__ __forceinline__ RowEnd finish_row(float m, float l, bool has_sink, float sink, bool natural) {
  const bool empty = l == 0.0f;  // no visible key (NaN is not empty)
  const float row_top = empty ? -INFINITY : m;
  float top = row_top;
  if (has_sink && !(row_top != row_top) && !(row_top >= sink)) {
    top = sink;  // NaN-keeping max
  }
  if (l != l) {
    // A NaN score: NaN out and lse, even where the max dropped it (fmaxf) and stayed -inf.
    return {l, 0.0f, l};
  }
  if (top == -INFINITY) {
    return {-INFINITY, 0.0f, 0.0f};
  }
  const float weight = empty ? 0.0f : exp_of(row_top - top, natural);
  const float total = l * weight + (has_sink ? exp_of(sink - top, natural) : 0.0f);
  RowEnd end;
  if (natural) {
    two_sum(top, logf(total), end.lse, end.lse_lo);
  } else {
    // lse = (top + log2(total)) ln 2: the sum's error from two_sum, the product's from an FMA.
    float lse2, err2;
    two_sum(top, log2f(total), lse2, err2);
    end.lse = lse2 * kLn2;
    end.lse_lo = fmaf(lse2, kLn2, -end.lse) + err2 * kLn2;
  }
  end.factor = weight / total;
  return end;
}

// What every kernel (forward, decode, backward; the sm_90a forward for softcap) makes of a raw dot product q.k, in its
// score units (exp_of: log2, or natural with a floating mask): s = scale * dot, then softcap *
// tanh(s / softcap) when softcap > 0; then a mask value m added (in natural units, scaled by
// mask_unit), a -inf one hiding the score, NaN included. Built on the host by score_rule().
struct ScoreRule {
  float scale = 0.0f;          // scale in the score units (no softcap)
  float softcap_pre = 0.0f;    // scale / softcap
  float softcap_post = 0.0f;   // softcap in the score units; 0: no softcap
  float mask_unit = 1.0f;      // log2(e) for a floating mask in log2 units (decode), else 1
  float natural_scale = 0.0f;  // scale in natural units: d score / d dot without softcap
  bool natural = false;

  __device__ __forceinline__ float score(float dot) const {
    if (softcap_post > 0.0f) {
      return softcap_post * tanhf(dot * softcap_pre);
    }
    // Natural units: rounded on its own (never fused with the mask add), alike in every kernel.
    return natural ? __fmul_rn(dot, scale) : dot * scale;
  }
  // score() over n values, the branch taken once (keeps tanhf off the plain path).
  template <int n>
  __device__ __forceinline__ void score_all(float* s) const {
    if (softcap_post > 0.0f) {
#pragma unroll
      for (int k = 0; k < n; ++k) {
        s[k] = softcap_post * tanhf(s[k] * softcap_pre);
      }
    } else if (natural) {
#pragma unroll
      for (int k = 0; k < n; ++k) {
        s[k] = __fmul_rn(s[k], scale);
      }
    } else {
#pragma unroll
      for (int k = 0; k < n; ++k) {
        s[k] *= scale;
      }
    }
  }
  // The softcapped score() of n dot products (softcap_post > 0) in fewer registers and
  // instructions, for the sm_90a kernels whose consumers hold a whole tile of scores: tanh(x) =
  // 1 - 2 / (e^2x + 1) from one ex2 and one rcp (saturating to +-1, NaN kept). Its absolute error,
  // a few float32 ulps of 1, is what the softmax sees of the score: the same as tanhf's to within
  // softcap * 2^-22.
  template <int n>
  __device__ __forceinline__ void softcap_all(float* s) const {
    const float twice_pre_log2 = 2.0f * softcap_pre * kLog2e;
#pragma unroll
    for (int k = 0; k < n; ++k) {
      float e, r;
      asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(s[k] * twice_pre_log2));
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.0f));
      s[k] = softcap_post * fmaf(-2.0f, r, 1.0f);
    }
  }
  // The score with the mask value m (0 or -inf for a bool mask) applied.
  __device__ __forceinline__ float masked(float score, float m) const {
    return m == -INFINITY ? -INFINITY : score + m * mask_unit;
  }
  // d score / d dot from the score (the backward's chain rule): scale (1 - tanh^2) with softcap.
  __device__ __forceinline__ float derivative(float score) const {
    if (softcap_post > 0.0f) {
      const float t = score / softcap_post;
      return natural_scale * (1.0f - t * t);
    }
    return natural_scale;
  }
};

// Host: the rule for `scale` and `softcap` (0: none) in natural units when `natural` (a floating
// mask), else log2 units, with a floating mask's values converted to them when `log2_mask`.
inline ScoreRule score_rule(double scale, double softcap, bool natural, bool log2_mask = false) {
  const double unit = natural ? 1.0 : 1.4426950408889634;  // log2(e)
  ScoreRule r;
  r.scale = static_cast<float>(scale * unit);
  if (softcap > 0.0) {
    r.softcap_pre = static_cast<float>(scale / softcap);
    r.softcap_post = static_cast<float>(softcap * unit);
  }
  r.mask_unit = log2_mask && !natural ? static_cast<float>(unit) : 1.0f;
  r.natural_scale = static_cast<float>(scale);
  r.natural = natural;
  return r;
}

}  // namespace safeattn::cuda::attn
