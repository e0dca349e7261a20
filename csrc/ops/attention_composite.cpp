// safeattn::_attention_math: the ATen composite of attention (formula and reasons in
// attention_composite.h).
#include "ops/attention_composite.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/attention.h"

namespace safeattn {

namespace {

bool has_symbolic_sizes(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_math(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                  double dropout_p, bool is_causal, std::optional<double> scale,
                                                  bool enable_gqa, c10::SymInt q_offset, c10::SymInt kv_offset,
                                                  double softcap, const std::optional<at::Tensor>& sinks) {
  // The fused op's checks and messages. Traced with symbolic sizes (torch.compile of a
  // transformed function), the ATen ops below check the shapes instead.
  const bool symbolic = has_symbolic_sizes(query) || has_symbolic_sizes(key) || has_symbolic_sizes(value) ||
                        (attn_mask.has_value() && has_symbolic_sizes(*attn_mask));
  if (!symbolic) {
    check_attention(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap, sinks);
  }
  const at::ScalarType acc = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const c10::SymInt batch = query.sym_size(0), hq = query.sym_size(1), q_len = query.sym_size(2);
  const c10::SymInt head_dim = query.sym_size(3);
  const c10::SymInt hkv = key.sym_size(1), kv_len = key.sym_size(2), dv = value.sym_size(3);
  const c10::SymInt group = hq / hkv;
  const double scale_value =
      scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim.guard_int(__FILE__, __LINE__)));

  // Scores [B, Hq, Q, KV]: the query heads of one kv group side by side as rows, so that one
  // matmul per kv head serves the group and K is only viewed (transposed), never repeated.
  const at::Tensor q = query.to(acc).reshape_symint({batch, hkv, group * q_len, head_dim});
  at::Tensor s = at::matmul(q, key.to(acc).transpose(-2, -1)).reshape_symint({batch, hq, q_len, kv_len});
  s = s * scale_value;
  if (softcap > 0.0) {
    s = at::tanh(s / softcap) * softcap;  // Gemma2's order: scale, softcap, then the mask
  }
  if (attn_mask.has_value()) {
    at::Tensor mask = *attn_mask;
    while (mask.dim() < 4) {
      mask = mask.unsqueeze(0);  // [Q, KV] and [H, Q, KV] broadcast from the right
    }
    if (mask.scalar_type() == at::kBool) {
      s = at::where(mask, s, neg_inf);
    } else {
      // A -inf bias masks whatever the score holds (a NaN or +inf score must not leak through
      // it): `where`, not the sum, so it also passes no gradient to that score.
      const at::Tensor bias = mask.to(acc);
      s = at::where(bias == neg_inf, neg_inf, s + bias);
    }
  }
  if (is_causal) {
    // kv_offset + j <= q_offset + i  <=>  j - i <= q_offset - kv_offset: the offsets meet only
    // in their difference, so positions near the int64 limit do not overflow.
    const at::TensorOptions index_options = query.options().dtype(at::kLong);
    const at::Tensor relative = at::arange(c10::Scalar(kv_len), index_options).unsqueeze(0) -
                                at::arange(c10::Scalar(q_len), index_options).unsqueeze(1);
    // The shift without int64 overflow where the offsets are concrete (causal_shift).
    const auto q_int = q_offset.maybe_as_int(), kv_int = kv_offset.maybe_as_int();
    const c10::SymInt shift = q_int.has_value() && kv_int.has_value()
                                  ? c10::SymInt(causal_shift(*q_int, *kv_int, q_len.maybe_as_int().value_or(0),
                                                             kv_len.maybe_as_int().value_or(0)))
                                  : q_offset - kv_offset;
    s = at::where(relative <= c10::Scalar(shift), s, neg_inf);
  }

  // A row is empty when every key is masked: its output is 0. With sinks its log-sum-exp is
  // the sink; without, -inf.
  const at::Tensor no_key = s.isneginf().all(-1, /*keepdim=*/true);  // [B, Hq, Q, 1]
  at::Tensor logits = s;
  at::Tensor empty = no_key;
  if (sinks.has_value()) {
    const at::Tensor sink = sinks->to(acc).reshape_symint({1, hq, 1, 1}).expand_symint({batch, hq, q_len, 1});
    logits = at::cat({s, sink}, -1);
    empty = no_key.logical_and(sink.isneginf());
  }
  // Constants in place of an empty row's logits: logsumexp and exp (and their derivatives, to
  // every order) then see finite values, never -inf - (-inf).
  const at::Tensor finite = at::where(empty, 0.0, logits);
  const at::Tensor lse = at::logsumexp(finite, {-1}, /*keepdim=*/true);
  // softmax, not exp(s - lse): a row of finfo.min scores has lse == its max in float32 (and in
  // float64), and exp(s - lse) would give every key weight 1 (ops/attention.h, lse_lo).
  at::Tensor prob = at::softmax(finite, -1);
  if (sinks.has_value()) {
    prob = prob.narrow_symint(-1, 0, kv_len);  // the sink takes no value
  }
  at::Tensor out = at::matmul(prob.reshape_symint({batch, hkv, group * q_len, kv_len}), value.to(acc))
                       .reshape_symint({batch, hq, q_len, dv});
  // `where` blocks the row both ways: a NaN value row gives no NaN there, a NaN upstream
  // gradient gets no further.
  out = at::where(no_key, 0.0, out).to(query.scalar_type());
  return {out, at::where(empty, neg_inf, lse).squeeze(-1)};
}

TORCH_LIBRARY_FRAGMENT(safeattn, m) {
  // Private: safeattn.attention's decomposition under torch.func transforms and forward AD
  // (python/safeattn/ops.py routes there). The schema is attention's.
  m.def(
      "_attention_math(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, "
      "bool is_causal=False, float? scale=None, bool enable_gqa=False, *, SymInt q_offset=0, SymInt kv_offset=0, "
      "float softcap=0.0, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
}

// CompositeImplicitAutograd: autograd (double backward included), forward AD and every
// functorch transform go through the ATen ops above; no fake is needed (the ops have theirs).
TORCH_LIBRARY_IMPL(safeattn, CompositeImplicitAutograd, m) {
  m.impl("_attention_math", &attention_math);
}

}  // namespace safeattn
