// The generic backward of safeattn::attention: ATen ops in the acc dtype (float32, float64 for
// float64 inputs) over chunks of queries, for what the tensor-core kernels do not cover (float32
// and float64 inputs, head dims without an instantiation, D != Dv, unaligned views). Correct
// rather than fast; memory is bounded by the chunk size (kGenericChunkBytes of scores).
//
// Device-independent on purpose (plain ATen): the CUDA backend calls it, and the same code can
// be run on CPU tensors to check it against the reference.
//
// Per query chunk [i0, i1) of every (batch, query head), with the GQA group folded into rows
// (query head h reads key/value head h / group):
//   S = scale * Q K^T, softcap, mask, causal          P = exp(S - lse)  (lse -inf -> +inf: P = 0)
//   dP = dO V^T    dS = P * (dP - Delta)    dS' = dS * scale (* (1 - tanh^2) with softcap)
//   dQ[chunk] = dS' K      dK += dS'^T Q      dV += P^T dO      mask gradient = dS
// Chunks run in a fixed order and every sum has a fixed shape: results are run-to-run identical.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "ops/attention.h"

namespace safeattn::attn_generic {

// Bytes of one [B, Hq, chunk, KV] score matrix in the acc dtype; about six live at once.
constexpr int64_t kGenericChunkBytes = int64_t(64) << 20;

// [B, Hq, m, X] -> [B, Hkv, group * m, X] (the query heads of one kv group as more rows).
inline at::Tensor fold_group(const at::Tensor& t, int64_t hkv) {
  const int64_t batch = t.size(0), hq = t.size(1), m = t.size(2), x = t.size(3);
  return t.reshape({batch, hkv, (hq / hkv) * m, x});
}

// The inverse of fold_group.
inline at::Tensor unfold_group(const at::Tensor& t, int64_t hq) {
  const int64_t batch = t.size(0), hkv = t.size(1), rows = t.size(2), x = t.size(3);
  return t.reshape({batch, hq, rows / (hq / hkv), x});
}

inline void attention_bwd_generic(const AttentionBwdArgs& a) {
  const at::ScalarType acc = a.query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const double pos_inf = std::numeric_limits<double>::infinity();

  const at::Tensor key = a.key.to(acc);      // [B, Hkv, KV, D]
  const at::Tensor value = a.value.to(acc);  // [B, Hkv, KV, Dv]
  const at::Tensor key_t = key.transpose(2, 3);
  const at::Tensor value_t = value.transpose(2, 3);
  at::Tensor grad_key = at::zeros(key.sizes(), key.options());
  at::Tensor grad_value = at::zeros(value.sizes(), value.options());
  const at::Tensor lse = a.lse.to(acc);
  const at::Tensor lse_lo = a.lse_lo.to(acc);
  const at::Tensor grad_lse = a.grad_lse.defined() ? a.grad_lse.to(acc) : at::Tensor();

  const at::Tensor& partial = a.grad_mask_partial;  // written in place
  const bool mask_grad = partial.defined();
  const bool partial_by_group = mask_grad && partial.size(1) != hq;  // [B, Hkv, ...]: sum the group
  // Full query dim: each chunk assigns its rows (the buffer may be uninitialised, see
  // grad_mask_assign); a size-1 query dim accumulates every chunk's row sum, in chunk order.
  const bool partial_q = mask_grad && partial.size(2) == q_len;
  const bool partial_kv = mask_grad && partial.size(3) == kv_len;

  const int64_t row_bytes = batch * hq * kv_len * static_cast<int64_t>(at::elementSize(acc));
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>(q_len, kGenericChunkBytes / std::max<int64_t>(1, row_bytes)));
  const auto opts = key.options();
  for (int64_t i0 = 0; i0 < q_len; i0 += chunk) {
    const int64_t m = std::min(chunk, q_len - i0);
    const at::Tensor q = a.query.narrow(2, i0, m).to(acc);         // [B, Hq, m, D]
    const at::Tensor d_out = a.grad_out.narrow(2, i0, m).to(acc);  // [B, Hq, m, Dv]
    const at::Tensor o = a.out.narrow(2, i0, m).to(acc);

    at::Tensor s = unfold_group(at::matmul(fold_group(q, hkv), key_t), hq) * a.scale;  // [B, Hq, m, KV]
    at::Tensor tanh_s;
    if (a.softcap > 0) {
      tanh_s = at::tanh(s / a.softcap);
      s = tanh_s * a.softcap;
    }
    if (a.mask.defined()) {
      const at::Tensor mask = a.mask.narrow(2, i0, m);
      if (mask.scalar_type() == at::kBool) {
        s = at::where(mask, s, at::scalar_tensor(neg_inf, opts));
      } else {
        // A -inf bias hides what is behind it, NaN included (as a False bool does).
        const at::Tensor bias = mask.to(acc);
        s = at::where(at::isneginf(bias), at::scalar_tensor(neg_inf, opts), s + bias);
      }
    }
    if (a.is_causal) {
      // Key j is visible to query i when kv_offset + j <= q_offset + i.
      const at::Tensor rows = at::arange(i0, i0 + m, opts.dtype(at::kLong)).unsqueeze(1) + a.q_offset;
      const at::Tensor cols = at::arange(kv_len, opts.dtype(at::kLong)).unsqueeze(0) + a.kv_offset;
      s = at::where(cols <= rows, s, at::scalar_tensor(neg_inf, opts));
    }
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
    const at::Tensor dp = unfold_group(at::matmul(fold_group(d_out, hkv), value_t), hq);
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
    a.grad_query.narrow(2, i0, m).copy_(unfold_group(at::matmul(ds_folded, key), hq));
    grad_key.add_(at::matmul(ds_folded.transpose(2, 3), fold_group(q, hkv)));
    grad_value.add_(at::matmul(fold_group(p, hkv).transpose(2, 3), fold_group(d_out, hkv)));
  }
  a.grad_key.copy_(grad_key);
  a.grad_value.copy_(grad_value);
}

}  // namespace safeattn::attn_generic
