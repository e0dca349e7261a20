// safeattn::_attention_math: safeattn::attention written as a composite of ATen ops, for what
// the fused kernels cannot do: torch.func transforms (vmap, grad, jvp, jacrev, jacfwd),
// forward-mode AD and double backward. It is registered as CompositeImplicitAutograd, so
// autograd, functorch and forward AD all see its ATen ops: nothing here has a hand-written
// derivative. safeattn.attention (python/safeattn/ops.py) calls it only under a torch.func
// transform or with a forward-AD dual input; every other call keeps the fused kernels.
//
// Same arguments, outputs and semantics as safeattn::attention (see attention.h), computed the
// way the kernels compute them (cuda/attention_fwd_kernel.cu, attention_fwd_generic):
//   scores in float32 (float64 for float64 inputs): s = scale * q k^T; softcap; bool mask
//   (False -> -inf) or float mask (added; a -inf entry stays -inf whatever the score);
//   causal: key j visible to query i iff kv_offset + j <= q_offset + i;
//   lse = log(sum_j exp(s_j) + exp(sink)), out = sum_j exp(s_j - lse) v_j.
// A row with no visible key: out 0, lse -inf (the sink with sinks), and 0 gradients and
// tangents: the row's logits are replaced by constants before logsumexp / exp, and `where`
// (not a product with 0) zeroes its outputs, so neither exp(-inf - (-inf)) nor a NaN upstream
// gradient or value on that row reaches any derivative.
// Grouped-query attention reshapes the query heads of a kv group into extra rows
// ([B, Hkv, G * Q, D]): K and V are never repeated.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

namespace safeattn {

// query [B, Hq, Q, D], key [B, Hkv, KV, D], value [B, Hkv, KV, Dv], attn_mask broadcastable to
// [B, Hq, Q, KV], sinks [Hq]. Returns out [B, Hq, Q, Dv] in query's dtype and lse [B, Hq, Q]
// in float32 (float64 for float64 inputs). Arguments are checked as safeattn::attention checks
// them (check_attention), whenever the sizes are concrete.
std::tuple<at::Tensor, at::Tensor> attention_math(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                  double dropout_p, bool is_causal, std::optional<double> scale,
                                                  bool enable_gqa, c10::SymInt q_offset, c10::SymInt kv_offset,
                                                  double softcap, const std::optional<at::Tensor>& sinks);

}  // namespace safeattn
