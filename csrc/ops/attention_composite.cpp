// The ATen attention: the score rule, safeattn::_attention_math and the chunked forward and
// backward kernels (formulas and reasons in attention_composite.h).
#include "ops/attention_composite.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/attention.h"

namespace safeattn {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

at::ScalarType acc_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// [B, Hq, m, X] -> [B, Hkv, group * m, X]: the query heads of one kv group as more rows, so
// that one matmul per kv head serves the group and K / V are never repeated.
at::Tensor fold_group(const at::Tensor& t, const c10::SymInt& hkv) {
  const c10::SymInt hq = t.sym_size(1);
  return t.reshape_symint({t.sym_size(0), hkv, (hq / hkv) * t.sym_size(2), t.sym_size(3)});
}

// The inverse of fold_group: [B, Hkv, group * m, X] -> [B, Hq, m, X].
at::Tensor unfold_group(const at::Tensor& t, const c10::SymInt& hq, const c10::SymInt& m) {
  return t.reshape_symint({t.sym_size(0), hq, m, t.sym_size(3)});
}

}  // namespace

at::Tensor attention_scores(const at::Tensor& q_rows, const at::Tensor& key, const at::Tensor& mask,
                            const ScoreRule& rule, const c10::SymInt& row0, const c10::SymInt& q_len,
                            at::Tensor* softcap_tanh) {
  const at::ScalarType acc = acc_dtype(q_rows);
  const c10::SymInt batch = q_rows.sym_size(0), hq = q_rows.sym_size(1), rows = q_rows.sym_size(2);
  const c10::SymInt kv_len = key.sym_size(2);
  const at::Tensor k = key.to(acc);
  at::Tensor s = unfold_group(at::matmul(fold_group(q_rows.to(acc), key.sym_size(1)), k.transpose(-2, -1)), hq, rows);
  s = s * rule.scale;
  if (rule.softcap > 0.0) {
    // Gemma2's order: scale, softcap, then the mask.
    at::Tensor t = at::tanh(s / rule.softcap);
    s = t * rule.softcap;
    if (softcap_tanh != nullptr) {
      *softcap_tanh = std::move(t);
    }
  }
  if (mask.defined()) {
    at::Tensor m = mask;
    while (m.dim() < 4) {
      m = m.unsqueeze(0);  // [Q, KV] and [H, Q, KV] broadcast from the right
    }
    m = m.expand_symint({batch, hq, q_len, kv_len}).narrow_symint(2, row0, rows);
    if (m.scalar_type() == at::kBool) {
      s = at::where(m, s, kNegInf);
    } else {
      // A -inf bias masks whatever the score holds (a NaN or +inf score must not leak through
      // it): `where`, not the sum, so it also passes no gradient to that score.
      const at::Tensor bias = m.to(acc);
      s = at::where(bias == kNegInf, kNegInf, s + bias);
    }
  }
  if (rule.is_causal) {
    // kv_offset + j <= q_offset + i  <=>  j - i <= q_offset - kv_offset: the offsets meet only
    // in their difference, and j - i stays within [-q_len, kv_len].
    const at::TensorOptions index_options = q_rows.options().dtype(at::kLong);
    const at::Tensor relative = at::arange(c10::Scalar(kv_len), index_options).unsqueeze(0) -
                                at::arange(c10::Scalar(row0), c10::Scalar(row0 + rows), index_options).unsqueeze(1);
    // The shift without int64 overflow where the offsets are concrete (causal_shift); symbolic
    // sizes bound nothing, so there the shift is only saturated.
    constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();
    const auto q_int = rule.q_offset.maybe_as_int(), kv_int = rule.kv_offset.maybe_as_int();
    const c10::SymInt shift = q_int.has_value() && kv_int.has_value()
                                  ? c10::SymInt(causal_shift(*q_int, *kv_int, q_len.maybe_as_int().value_or(kUnbounded),
                                                             kv_len.maybe_as_int().value_or(kUnbounded)))
                                  : rule.q_offset - rule.kv_offset;
    s = at::where(relative <= c10::Scalar(shift), s, kNegInf);
  }
  return s;
}

std::tuple<at::Tensor, at::Tensor> attention_math(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                  double dropout_p, bool is_causal, std::optional<double> scale,
                                                  bool enable_gqa, c10::SymInt q_offset, c10::SymInt kv_offset,
                                                  double softcap, const std::optional<at::Tensor>& sinks) {
  // The fused op's checks and messages (SymInt-aware: also under torch.compile of a transformed
  // function).
  check_attention(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap, sinks);
  const c10::SymInt batch = query.sym_size(0), hq = query.sym_size(1), q_len = query.sym_size(2);
  const c10::SymInt head_dim = query.sym_size(3);
  const at::ScalarType acc = acc_dtype(query);
  const c10::SymInt hkv = key.sym_size(1), kv_len = key.sym_size(2);
  const ScoreRule rule{
      scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim.guard_int(__FILE__, __LINE__))),
      softcap, is_causal, std::move(q_offset), std::move(kv_offset)};
  // Scores [B, Hq, Q, KV]: every query row in one block.
  const at::Tensor s = attention_scores(query, key, attn_mask.value_or(at::Tensor()), rule, 0, q_len);

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
  at::Tensor out = unfold_group(at::matmul(fold_group(prob, hkv), value.to(acc)), hq, q_len);
  // `where` blocks the row both ways: a NaN value row gives no NaN there, a NaN upstream
  // gradient gets no further.
  out = at::where(no_key, 0.0, out).to(query.scalar_type());
  return {out, at::where(empty, kNegInf, lse).squeeze(-1)};
}

// Correctness, not speed: the forward's [B, Hq, chunk, KV] scores stay under this many
// elements.
constexpr int64_t kForwardChunkElements = int64_t{1} << 26;

void attention_forward_chunked(const AttentionFwdArgs& a) {
  const at::ScalarType acc = acc_dtype(a.query);
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2);
  if (kv_len == 0) {  // no key at all: every row is empty
    a.out.zero_();
    if (a.sinks.defined()) {
      a.lse.copy_(a.sinks.view({1, hq, 1}).expand_as(a.lse));
    } else {
      a.lse.fill_(kNegInf);
    }
    if (a.lse_lo.defined()) {
      a.lse_lo.zero_();
    }
    return;
  }
  const at::TensorOptions acc_options = a.query.options().dtype(acc);
  // K and V once in acc (a copy; this path is not the fast one).
  const at::Tensor key = a.key.to(acc);      // [B, Hkv, KV, D]
  const at::Tensor value = a.value.to(acc);  // [B, Hkv, KV, Dv]
  const ScoreRule rule{a.scale, a.softcap, a.is_causal, a.q_offset, a.kv_offset};
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(q_len, kForwardChunkElements / (batch * hq * kv_len)));
  const at::Tensor zero = at::zeros({}, acc_options);
  const at::Tensor minus_inf = at::full({}, kNegInf, acc_options);
  for (int64_t i0 = 0; i0 < q_len; i0 += chunk) {
    const int64_t n = std::min(chunk, q_len - i0);
    const at::Tensor s = attention_scores(a.query.narrow(2, i0, n), key, a.mask, rule, i0, q_len);  // [B, Hq, n, KV]
    // Row max keeps NaN (amax propagates it); an empty row is shifted by 0, not by -inf.
    const at::Tensor row_max = s.amax(-1, /*keepdim=*/true);
    const at::Tensor offset = at::where(row_max == kNegInf, zero, row_max);
    const at::Tensor prob = at::exp(s - offset);
    const at::Tensor row_sum = prob.sum(-1, /*keepdim=*/true);
    at::Tensor o = unfold_group(at::matmul(fold_group(prob, hkv), value), hq, n);  // [B, Hq, n, Dv]
    // lse = top + log(total) (top: the row max, or the sink logit when larger), by two_sum so
    // that lse_lo keeps what the rounding drops (ops/attention.h); factor normalises the row.
    const at::Tensor empty = row_sum == 0;
    at::Tensor top = at::where(empty, minus_inf, row_max);
    at::Tensor total = row_sum;
    at::Tensor weight = at::ones_like(row_sum);
    if (a.sinks.defined()) {
      const at::Tensor sink = a.sinks.to(acc).view({1, hq, 1, 1}).expand_as(top);
      const at::Tensor row_top = top;
      top = at::where(at::isnan(row_top) | (row_top >= sink), row_top, sink);
      weight = at::where(empty, zero, at::exp(row_top - top));
      total = row_sum * weight + at::exp(sink - top);
    }
    const at::Tensor log_total = at::log(total);
    const at::Tensor lse = top + log_total;
    const at::Tensor b_part = lse - top;
    at::Tensor lse_lo = (top - (lse - b_part)) + (log_total - b_part);
    const at::Tensor row_empty = top == kNegInf;  // no visible key and no sink: lse -inf, lo 0
    lse_lo = at::where(row_empty, zero, lse_lo);
    const at::Tensor factor = at::where(row_empty, zero, weight / total);
    // An empty row is exactly 0, even if a masked value held NaN (0 * NaN in P V).
    o = at::where(empty, zero, o * factor);
    a.out.narrow(2, i0, n).copy_(o);
    a.lse.narrow(2, i0, n).copy_(at::where(row_empty, minus_inf, lse).squeeze(-1));
    if (a.lse_lo.defined()) {
      a.lse_lo.narrow(2, i0, n).copy_(lse_lo.squeeze(-1));
    }
  }
}

// Bytes of one [B, Hq, chunk, KV] score matrix of the backward in the acc dtype; about six
// live at once.
constexpr int64_t kBackwardChunkBytes = int64_t(64) << 20;

void attention_backward_chunked(const AttentionBwdArgs& a) {
  const at::ScalarType acc = acc_dtype(a.query);
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2);
  const double pos_inf = std::numeric_limits<double>::infinity();

  const at::Tensor key = a.key.to(acc);      // [B, Hkv, KV, D]
  const at::Tensor value = a.value.to(acc);  // [B, Hkv, KV, Dv]
  const at::Tensor value_t = value.transpose(2, 3);
  at::Tensor grad_key = at::zeros(key.sizes(), key.options());
  at::Tensor grad_value = at::zeros(value.sizes(), value.options());
  const at::Tensor lse = a.lse.to(acc);
  const at::Tensor lse_lo = a.lse_lo.to(acc);
  const at::Tensor grad_lse = a.grad_lse.defined() ? a.grad_lse.to(acc) : at::Tensor();
  const ScoreRule rule{a.scale, a.softcap, a.is_causal, a.q_offset, a.kv_offset};

  const at::Tensor& partial = a.grad_mask_partial;  // written in place
  const bool mask_grad = partial.defined();
  const bool partial_by_group = mask_grad && partial.size(1) != hq;  // [B, Hkv, ...]: sum the group
  // Full query dim: each chunk assigns its rows (the buffer may be uninitialised, see
  // GradMaskWrite::kAssign); a size-1 query dim accumulates every chunk's row sum, in chunk order.
  const bool partial_q = mask_grad && partial.size(2) == q_len;
  const bool partial_kv = mask_grad && partial.size(3) == kv_len;

  const int64_t row_bytes = batch * hq * kv_len * static_cast<int64_t>(at::elementSize(acc));
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>(q_len, kBackwardChunkBytes / std::max<int64_t>(1, row_bytes)));
  const auto opts = key.options();
  for (int64_t i0 = 0; i0 < q_len; i0 += chunk) {
    const int64_t m = std::min(chunk, q_len - i0);
    const at::Tensor q = a.query.narrow(2, i0, m).to(acc);         // [B, Hq, m, D]
    const at::Tensor d_out = a.grad_out.narrow(2, i0, m).to(acc);  // [B, Hq, m, Dv]
    const at::Tensor o = a.out.narrow(2, i0, m).to(acc);

    at::Tensor tanh_s;                                                                // defined with a softcap
    const at::Tensor s = attention_scores(q, key, a.mask, rule, i0, q_len, &tanh_s);  // [B, Hq, m, KV]
    // A row with no visible key has lse -inf: use +inf so that every p is exactly 0. lse_lo,
    // what lse lost to rounding, is subtracted last so that it survives (ops/attention.h).
    at::Tensor row_lse = lse.narrow(2, i0, m);
    const at::Tensor empty_row = at::isneginf(row_lse);
    row_lse = at::where(empty_row, at::scalar_tensor(pos_inf, opts), row_lse);
    const at::Tensor row_lo = at::where(empty_row, at::scalar_tensor(0.0, opts), lse_lo.narrow(2, i0, m));
    const at::Tensor p = at::exp((s - row_lse.unsqueeze(-1)) - row_lo.unsqueeze(-1));

    at::Tensor delta = (d_out * o).sum(-1);  // [B, Hq, m]
    if (grad_lse.defined()) {
      delta = delta - grad_lse.narrow(2, i0, m);
    }
    const at::Tensor dp = unfold_group(at::matmul(fold_group(d_out, hkv), value_t), hq, m);
    at::Tensor ds = p * (dp - delta.unsqueeze(-1));

    if (mask_grad) {
      at::Tensor g = ds;
      if (partial_by_group) {
        g = g.reshape({batch, hkv, hq / hkv, m, kv_len}).sum(2);
      }
      if (!partial_kv) {
        g = g.sum(3, /*keepdim=*/true);
      }
      if (partial_q) {
        partial.narrow(2, i0, m).copy_(g);
      } else {
        partial.add_(g.sum(2, /*keepdim=*/true));  // zero-initialised by the caller (not assign)
      }
    }

    at::Tensor ds_dot = tanh_s.defined() ? ds * (1.0 - tanh_s * tanh_s) * a.scale : ds * a.scale;
    const at::Tensor ds_folded = fold_group(ds_dot, hkv);  // [B, Hkv, group*m, KV]
    a.grad_query.narrow(2, i0, m).copy_(unfold_group(at::matmul(ds_folded, key), hq, m));
    grad_key.add_(at::matmul(ds_folded.transpose(2, 3), fold_group(q, hkv)));
    grad_value.add_(at::matmul(fold_group(p, hkv).transpose(2, 3), fold_group(d_out, hkv)));
  }
  a.grad_key.copy_(grad_key);
  a.grad_value.copy_(grad_value);
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
