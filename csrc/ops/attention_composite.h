// Attention written with ATen ops, in one place for every device and fallback:
//   - attention_scores: the score rule (scale -> softcap -> mask -> causal) of a block of query
//     rows, which the three functions below all build their scores with;
//   - safeattn::_attention_math (attention_math): safeattn::attention as a composite of ATen
//     ops, for what the fused kernels cannot do: torch.func transforms (vmap, grad, jvp, jacrev,
//     jacfwd), forward-mode AD and double backward. It is registered as
//     CompositeImplicitAutograd, so autograd, functorch and forward AD all see its ATen ops:
//     nothing here has a hand-written derivative. safeattn.attention (python/safeattn/ops.py)
//     calls it only under a torch.func transform or with a forward-AD dual input; every other
//     call keeps the fused kernels;
//   - attention_forward_chunked / attention_backward_chunked: the forward and backward kernels
//     for what the fused CUDA kernels do not cover (float32, float64 for gradcheck, head dims
//     without an instantiation, D != Dv, unaligned views), over chunks of queries so that memory
//     stays bounded. Plain ATen and device-independent: the CUDA backend calls them, and they
//     run as they are on CPU tensors.
//
// Same arguments, outputs and semantics as safeattn::attention (see attention.h):
//   scores in float32 (float64 for float64 inputs): s = scale * q k^T; softcap; bool mask
//   (False -> -inf) or float mask (added; a -inf entry stays -inf whatever the score);
//   causal: key j visible to query i iff kv_offset + j <= q_offset + i;
//   lse = log(sum_j exp(s_j) + exp(sink)), out = sum_j exp(s_j - lse) v_j.
// A row with no visible key: out 0, lse -inf (the sink with sinks), and 0 gradients and
// tangents. In attention_math the row's logits are replaced by constants before logsumexp /
// exp, and `where` (not a product with 0) zeroes its outputs, so neither exp(-inf - (-inf)) nor
// a NaN upstream gradient or value on that row reaches any derivative.
// Grouped-query attention reshapes the query heads of a kv group into extra rows
// ([B, Hkv, G * rows, D]): K and V are never repeated.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include "ops/attention.h"

namespace safeattn {

// The score rule's parameters. SymInt offsets: attention_math is traced with symbolic values.
struct ScoreRule {
  double scale = 1.0;
  double softcap = 0.0;  // 0: none
  bool is_causal = false;
  c10::SymInt q_offset = 0;  // query i sits at q_offset + i, key j at kv_offset + j
  c10::SymInt kv_offset = 0;
};

// Scores [B, Hq, n, KV] in the acc dtype (float32, float64 for float64 inputs) of the query
// rows [row0, row0 + n) of a q_len-row query against every key:
//   q_rows [B, Hq, n, D] (those rows, any float dtype; converted to acc),
//   key    [B, Hkv, KV, D] (best already in acc: a conversion here would repeat per block),
//   mask   undefined, or bool / float broadcastable to [B, Hq, q_len, KV].
// With softcap > 0 and softcap_tanh given, *softcap_tanh receives tanh(scale * q k^T / softcap)
// (the backward's derivative of the softcap). Sizes may be symbolic (attention_math).
at::Tensor attention_scores(const at::Tensor& q_rows, const at::Tensor& key, const at::Tensor& mask,
                            const ScoreRule& rule, const c10::SymInt& row0, const c10::SymInt& q_len,
                            at::Tensor* softcap_tanh = nullptr);

// query [B, Hq, Q, D], key [B, Hkv, KV, D], value [B, Hkv, KV, Dv], attn_mask broadcastable to
// [B, Hq, Q, KV], sinks [Hq]. Returns out [B, Hq, Q, Dv] in query's dtype and lse [B, Hq, Q]
// in float32 (float64 for float64 inputs). Arguments are checked as safeattn::attention checks
// them (check_attention), whenever the sizes are concrete.
std::tuple<at::Tensor, at::Tensor> attention_math(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                  double dropout_p, bool is_causal, std::optional<double> scale,
                                                  bool enable_gqa, c10::SymInt q_offset, c10::SymInt kv_offset,
                                                  double softcap, const std::optional<at::Tensor>& sinks);

// The forward kernel (an AttentionFwdFn) in ATen ops over chunks of queries whose
// [B, Hq, chunk, KV] scores stay under 2^26 elements. Writes out, lse and lse_lo (TwoSum, as the
// fused kernels) for any device.
void attention_forward_chunked(const AttentionFwdArgs& args);

// The backward kernel (an AttentionBwdFn) in ATen ops over chunks of queries whose
// [B, Hq, chunk, KV] scores stay under 64 MiB. Per chunk, with the GQA group folded into rows:
//   S = the score rule                 P = exp(S - lse - lse_lo)  (lse -inf -> +inf: P = 0)
//   dP = dO V^T    dS = P * (dP - Delta)    dS' = dS * scale (* (1 - tanh^2) with softcap)
//   dQ[chunk] = dS' K      dK += dS'^T Q      dV += P^T dO      mask gradient = dS
// Chunks run in a fixed order and every sum has a fixed shape: results are run-to-run identical.
void attention_backward_chunked(const AttentionBwdArgs& args);

}  // namespace safeattn
