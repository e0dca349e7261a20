// Schema, validation and CPU entry points of safeattn::attention and its backward.
// The math and the layouts are described in attention.h; the kernels are in
// cpu/attention_fwd_kernel.cpp and cpu/attention_bwd_kernel.cpp.
#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/FuncTorchTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>
#ifdef SAFEATTN_WITH_CUDA
#include <ATen/cuda/EmptyTensor.h>
#endif

#include "common/checks.h"
#include "ops/attention_choice.h"
#include "ops/attention_composite.h"

namespace safeattn {

SAFEATTN_DEFINE_ISA_STUB(attention_fwd_cpu_stub, AttentionFwdFn);
SAFEATTN_DEFINE_ISA_STUB(attention_bwd_cpu_stub, AttentionBwdFn);
SAFEATTN_DEFINE_ISA_STUB(attention_cpu_tiles_stub, AttentionCpuTilesFn);

namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

at::ScalarType acc_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The outputs of attention and _attention_forward, for the kernels and the Meta kernels alike:
// out [B, Hq, Q, Dv] stored as [B, Q, Hq, Dv] (so that out.transpose(1, 2), what Transformers
// returns, is contiguous), lse and lse_lo [B, Hq, Q] in the acc dtype (lse_lo only if asked for).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_outputs(const at::Tensor& query, const at::Tensor& value,
                                                                 bool with_lse_lo) {
  const c10::SymInt batch = query.sym_size(0), hq = query.sym_size(1), q_len = query.sym_size(2);
  at::Tensor out = empty_written_in_full({batch, q_len, hq, value.sym_size(3)}, query.options()).transpose(1, 2);
  at::Tensor lse = empty_written_in_full({batch, hq, q_len}, query.options().dtype(acc_type(query.scalar_type())));
  at::Tensor lse_lo = with_lse_lo ? empty_written_in_full({batch, hq, q_len}, lse.options()) : at::Tensor();
  return {out, lse, lse_lo};
}

// The score rule's settings, the same in the forward's and the backward's kernel arguments. The
// kernels get the causal shift q_offset - kv_offset (causal_shift) and kv_offset 0.
template <typename KernelArgs>
void set_score_rule(KernelArgs& args, const at::Tensor& query, std::optional<double> scale, double softcap,
                    bool is_causal, int64_t q_offset, int64_t kv_offset, int64_t q_len, int64_t kv_len) {
  args.scale = attention_scale(query, scale);
  args.softcap = softcap;
  args.is_causal = is_causal;
  args.q_offset = causal_shift(q_offset, kv_offset, q_len, kv_len);
  args.kv_offset = 0;
}

// The mask as a 4-D view [B|1, H|1, Q|1, KV|1] (leading dims added, nothing copied).
at::Tensor mask_as_4d(const at::Tensor& mask) {
  at::Tensor m = mask;
  while (m.dim() < 4) {
    m = m.unsqueeze(0);
  }
  return m;
}

}  // namespace

// A tensor written in full before it is read (attention.h): at::empty, without the fill that
// deterministic algorithms add to every new tensor (torch.utils.deterministic.
// fill_uninitialized_memory). Its memory then holds what it holds without deterministic
// algorithms, so the results are the same; the fill was a pass over each of the call's largest
// tensors (H200, B4 H16 S4096 D128 bf16 fwd+bwd: 4 fills, 83 us of 2.35 ms).
at::Tensor empty_written_in_full(c10::SymIntArrayRef sizes, const at::TensorOptions& options) {
  const at::Context& context = at::globalContext();
  const bool fills = context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory();
  if (fills && options.device().is_cpu()) {
    return at::detail::empty_cpu(C10_AS_INTARRAYREF_SLOW(sizes), options);
  }
#ifdef SAFEATTN_WITH_CUDA
  if (fills && options.device().is_cuda()) {
    return at::detail::empty_cuda(C10_AS_INTARRAYREF_SLOW(sizes), options);
  }
#endif
  return at::empty_symint(sizes, options);  // Meta and fake tensors, or no fill to skip
}

void check_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& attn_mask, double dropout_p, std::optional<double> scale,
                     bool enable_gqa, double softcap, const std::optional<at::Tensor>& sinks,
                     const std::optional<at::Tensor>& key_ranges, const char* kOp) {
  TORCH_CHECK(query.dim() == 4, kOp, ": query must be 4-D [batch, heads, q_length, head_dim], got ", query.dim(), "-D");
  TORCH_CHECK(key.dim() == 4, kOp, ": key must be 4-D [batch, kv_heads, kv_length, head_dim], got ", key.dim(), "-D");
  TORCH_CHECK(value.dim() == 4, kOp, ": value must be 4-D [batch, kv_heads, kv_length, head_dim_v], got ", value.dim(),
              "-D");
  TORCH_CHECK(is_supported_float(query.scalar_type()), kOp,
              ": query must have dtype Float, Half, BFloat16 or Double, got ", dtype_name(query.scalar_type()));
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), kOp, ": key has dtype ", dtype_name(key.scalar_type()),
              " but query has ", dtype_name(query.scalar_type()));
  TORCH_CHECK(value.scalar_type() == query.scalar_type(), kOp, ": value has dtype ", dtype_name(value.scalar_type()),
              " but query has ", dtype_name(query.scalar_type()));
  common_device(kOp, std::nullopt,
                {{"query", query},
                 {"key", key},
                 {"value", value},
                 {"attn_mask", attn_mask},
                 {"sinks", sinks},
                 {"key_ranges", key_ranges}});
  // Sizes are SymInts: symbolic in the Meta kernel under torch.compile (see holds()).
  const c10::SymInt batch = query.sym_size(0), hq = query.sym_size(1), q_len = query.sym_size(2);
  const c10::SymInt hkv = key.sym_size(1), kv_len = key.sym_size(2);
  TORCH_CHECK(holds(key.sym_size(0).sym_eq(batch)), kOp, ": key has batch ", key.sym_size(0), " but query has ", batch);
  TORCH_CHECK(holds(value.sym_size(0).sym_eq(batch)), kOp, ": value has batch ", value.sym_size(0), " but query has ",
              batch);
  TORCH_CHECK(holds(value.sym_size(1).sym_eq(hkv)), kOp, ": value has ", value.sym_size(1), " heads but key has ", hkv);
  TORCH_CHECK(holds(value.sym_size(2).sym_eq(kv_len)), kOp, ": value has kv_length ", value.sym_size(2),
              " but key has ", kv_len);
  TORCH_CHECK(holds(key.sym_size(3).sym_eq(query.sym_size(3))), kOp, ": key has head_dim ", key.sym_size(3),
              " but query has ", query.sym_size(3));
  TORCH_CHECK(holds(query.sym_size(3).sym_gt(0)), kOp, ": query head_dim must be > 0");
  TORCH_CHECK(holds(value.sym_size(3).sym_gt(0)), kOp, ": value head_dim must be > 0");
  if (enable_gqa) {
    TORCH_CHECK(holds(hkv.sym_gt(0)) && holds((hq % hkv).sym_eq(0)), kOp, ": query heads (", hq,
                ") must be a multiple of key/value heads (", hkv, ")");
  } else {
    TORCH_CHECK(holds(hq.sym_eq(hkv)), kOp, ": query has ", hq, " heads but key and value have ", hkv,
                "; pass enable_gqa=True for grouped-query attention");
  }
  TORCH_CHECK(dropout_p == 0.0, kOp, ": dropout_p must be 0 (dropout is not implemented), got ", dropout_p);
  // The kernels compute in float32 (float64 for float64 inputs): a softcap or scale that is not
  // a finite number there cannot be honoured (softcap=inf would give inf/inf = NaN, a softcap
  // that underflows to 0 would silently mean "none").
  const at::ScalarType t_in = query.scalar_type();
  const bool acc_is_double = t_in == at::kDouble;
  auto positive_in_acc = [&](double x) { return acc_is_double || static_cast<float>(x) > 0.0f; };
  TORCH_CHECK(softcap == 0.0 || (softcap > 0.0 && finite_in_acc(softcap, t_in) && positive_in_acc(softcap)), kOp,
              ": softcap must be 0 (none) or a finite positive number", acc_is_double ? "" : " in float32", ", got ",
              softcap);
  if (scale.has_value()) {
    check_scale(kOp, *scale, t_in);
  }
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    const at::ScalarType t = m.scalar_type();
    TORCH_CHECK(t == at::kBool || t == at::kFloat || t == query.scalar_type(), kOp,
                ": attn_mask must be Bool, Float or the query dtype (", dtype_name(query.scalar_type()), "), got ",
                dtype_name(t));
    TORCH_CHECK(m.dim() >= 2 && m.dim() <= 4, kOp, ": attn_mask must be 2-D, 3-D or 4-D, got ", m.dim(), "-D");
    const c10::SymInt target[4] = {batch, hq, q_len, kv_len};
    bool ok = true;
    for (int64_t d = 0; d < m.dim(); ++d) {
      const c10::SymInt& size = m.sym_size(m.dim() - 1 - d);
      ok = ok && (holds(size.sym_eq(1)) || holds(size.sym_eq(target[3 - d])));
    }
    TORCH_CHECK(ok, kOp, ": attn_mask of shape ", m.sym_sizes(), " is not broadcastable to [batch, heads, q_length, ",
                "kv_length] = [", target[0], ", ", target[1], ", ", target[2], ", ", target[3], "]");
  }
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->is_floating_point(), kOp, ": sinks must have a floating dtype, got ",
                dtype_name(sinks->scalar_type()));
    TORCH_CHECK(sinks->dim() == 1 && holds(sinks->sym_size(0).sym_eq(hq)), kOp, ": sinks must be [num_heads] = [", hq,
                "], got ", sinks->sym_sizes());
  }
  if (key_ranges.has_value()) {
    TORCH_CHECK(key_ranges->scalar_type() == at::kInt, kOp, ": key_ranges must have dtype Int (int32), got ",
                dtype_name(key_ranges->scalar_type()));
    TORCH_CHECK(key_ranges->dim() == 3 && holds(key_ranges->sym_size(0).sym_eq(batch)) &&
                    holds(key_ranges->sym_size(1).sym_eq(q_len)) && holds(key_ranges->sym_size(2).sym_eq(2)),
                kOp, ": key_ranges must be [batch, q_length, 2] = [", batch, ", ", q_len, ", 2], got ",
                key_ranges->sym_sizes());
  }
}

void check_attention_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                              const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
                              std::optional<double> scale, double softcap, const std::optional<at::Tensor>& sinks,
                              bool grad_mask_needed, const std::optional<at::Tensor>& lse_lo,
                              const std::optional<at::Tensor>& key_ranges) {
  constexpr const char* op = "_attention_backward";
  // The forward's rules (query heads a multiple of the kv heads, as the forward let through).
  check_attention(query, key, value, attn_mask, 0.0, scale, /*enable_gqa=*/true, softcap, sinks, key_ranges, op);
  common_device(op, query.device(),
                {{"grad_out", grad_out}, {"grad_lse", grad_lse}, {"out", out}, {"lse", lse}, {"lse_lo", lse_lo}});
  const std::vector<c10::SymInt> out_shape{query.sym_size(0), query.sym_size(1), query.sym_size(2), value.sym_size(3)};
  const c10::SymIntArrayRef row_shape = c10::SymIntArrayRef(out_shape).slice(0, 3);
  TORCH_CHECK(same_sizes(out.sym_sizes(), out_shape), op,
              ": out must be [batch, heads, q_length, head_dim_v] = ", c10::SymIntArrayRef(out_shape), ", got ",
              out.sym_sizes());
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), op, ": out has dtype ", dtype_name(out.scalar_type()),
              " but query has ", dtype_name(query.scalar_type()));
  TORCH_CHECK(same_sizes(grad_out.sym_sizes(), out.sym_sizes()), op, ": grad_out has shape ", grad_out.sym_sizes(),
              " but out has ", out.sym_sizes());
  TORCH_CHECK(grad_out.scalar_type() == query.scalar_type(), op, ": grad_out has dtype ",
              dtype_name(grad_out.scalar_type()), " but query has ", dtype_name(query.scalar_type()));
  auto check_rows = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.is_floating_point(), op, ": ", name, " must have a floating dtype, got ",
                dtype_name(t.scalar_type()));
    TORCH_CHECK(same_sizes(t.sym_sizes(), row_shape), op, ": ", name, " must be [batch, heads, q_length] = ", row_shape,
                ", got ", t.sym_sizes());
  };
  check_rows("lse", lse);
  if (lse_lo.has_value()) {
    check_rows("lse_lo", *lse_lo);
  }
  if (grad_lse.has_value()) {
    check_rows("grad_lse", *grad_lse);
  }
  TORCH_CHECK(!grad_mask_needed || !attn_mask.has_value() || attn_mask->is_floating_point(), op,
              ": grad_mask_needed needs a floating attn_mask (a bool mask has no gradient)");
}

double attention_scale(const at::Tensor& query, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(3)));
}

namespace {

// A mask ANDed with the key ranges ([B, Q, 2] int32): a bool mask (or none) gets the ranges as a
// bool [B, 1, Q, KV] ANDed, a float one -inf outside them. The mask is 4-D; its broadcast dims
// (size 1, or stride 0 in an expanded view) stay single in the result.
at::Tensor and_key_ranges(const at::Tensor& mask, const at::Tensor& key_ranges, int64_t kv_len) {
  const at::Tensor keys = at::arange(kv_len, key_ranges.options());
  const at::Tensor lo = key_ranges.select(2, 0).unsqueeze(-1), hi = key_ranges.select(2, 1).unsqueeze(-1);
  const at::Tensor keep = keys.ge(lo).logical_and_(keys.lt(hi)).unsqueeze(1);
  if (!mask.defined()) {
    return keep;
  }
  at::Tensor m = mask;
  for (int64_t d = 0; d < m.dim(); ++d) {
    if (m.size(d) > 1 && m.stride(d) == 0) {
      m = m.narrow(d, 0, 1);
    }
  }
  return m.scalar_type() == at::kBool ? m.logical_and(keep)
                                      : m.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
}

template <class Args>
Args key_ranges_drawn(const Args& args) {
  if (!args.key_ranges.defined()) {
    return args;
  }
  Args drawn = args;
  const int64_t batch = args.query.size(0), hq = args.query.size(1), q_len = args.query.size(2);
  const int64_t kv_len = args.key.size(2);
  drawn.mask = and_key_ranges(args.mask, args.key_ranges, kv_len).expand({batch, hq, q_len, kv_len});
  drawn.key_ranges = at::Tensor();
  return drawn;
}

}  // namespace

AttentionFwdArgs with_key_ranges_drawn(const AttentionFwdArgs& args) {
  return key_ranges_drawn(args);
}

AttentionBwdArgs with_key_ranges_drawn(const AttentionBwdArgs& args) {
  return key_ranges_drawn(args);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_impl(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, int64_t q_offset, int64_t kv_offset,
    double softcap, const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& key_ranges,
    bool with_lse_lo, AttentionFwdFn kernel) {
  check_attention(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap, sinks, key_ranges);
  const int64_t batch = query.size(0), hq = query.size(1), q_len = query.size(2);
  const int64_t kv_len = key.size(2);
  const at::ScalarType acc = acc_type(query.scalar_type());
  auto [out, lse, lse_lo] = attention_outputs(query, value, with_lse_lo);
  if (out.numel() == 0) {  // Dv > 0 (checked), so lse is empty too
    return {out, lse, lse_lo};
  }
  AttentionFwdArgs args;
  args.query = query;
  args.key = key;
  args.value = value;
  if (attn_mask.has_value()) {
    args.mask = mask_as_4d(*attn_mask).expand({batch, hq, q_len, kv_len});
    args.mask_requires_grad = attn_mask->requires_grad();
  }
  if (key_ranges.has_value()) {
    args.key_ranges = key_ranges->contiguous();
  }
  if (sinks.has_value()) {
    args.sinks = sinks->to(acc).contiguous();
  }
  args.out = out;
  args.lse = lse;
  args.lse_lo = lse_lo;
  set_score_rule(args, query, scale, softcap, is_causal, q_offset, kv_offset, q_len, kv_len);
  kernel(args);
  return {out, lse, lse_lo};
}

namespace {

at::Tensor without_empty_rows(const at::Tensor& grad_out, const at::Tensor& lse) {
  return grad_out.masked_fill(lse.eq(-std::numeric_limits<double>::infinity()).unsqueeze(-1), 0);
}

}  // namespace

at::Tensor grad_out_without_empty_rows(const AttentionBwdArgs& args) {
  return without_empty_rows(args.grad_out, args.lse);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_impl(
    const at::Tensor& grad_out_in, const std::optional<at::Tensor>& grad_lse_in, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale, int64_t q_offset,
    int64_t kv_offset, double softcap, const std::optional<at::Tensor>& sinks, bool grad_mask_needed,
    const std::optional<at::Tensor>& lse_lo, const std::optional<at::Tensor>& key_ranges, AttentionBwdFn kernel,
    int64_t mask_grad_budget, AttentionBwdSumsBroadcastFn sums_broadcast) {
  check_attention_backward(grad_out_in, grad_lse_in, query, key, value, out, lse, attn_mask, scale, softcap, sinks,
                           grad_mask_needed, lse_lo, key_ranges);
  const int64_t batch = query.size(0), hq = query.size(1), q_len = query.size(2);
  const int64_t hkv = key.size(1), kv_len = key.size(2);
  const at::ScalarType acc = acc_type(query.scalar_type());

  // A row with no visible key (lse -inf) passes no gradient on, whatever its upstream gradient
  // holds: grad_lse's rows here, grad_out's by the backend (grad_out_without_empty_rows).
  std::optional<at::Tensor> grad_lse;
  if (grad_lse_in.has_value()) {
    grad_lse = grad_lse_in->masked_fill(lse.eq(-std::numeric_limits<double>::infinity()), 0);
  }

  // Written in full by the kernel; zeros only when it has nothing to run.
  const bool empty = query.numel() == 0 || kv_len == 0;
  auto make = [&](const at::Tensor& like) {
    return empty ? at::zeros(like.sizes(), like.options()) : empty_written_in_full(like.sym_sizes(), like.options());
  };
  at::Tensor grad_query = make(query);
  at::Tensor grad_key = make(key);
  at::Tensor grad_value = make(value);
  at::Tensor grad_mask = at::empty({0}, query.options());
  at::Tensor grad_sinks = at::empty({0}, query.options());

  if (sinks.has_value()) {
    // d(loss)/d(sink_h) = -sum_{b,i} exp(sink_h - lse[b,h,i]) * Delta[b,h,i], with
    // Delta = rowsum(dO * O) - dlse (the row term of the softmax backward): O(B*H*Q), here.
    const at::Tensor grad_out = without_empty_rows(grad_out_in, lse);
    at::Tensor delta = (grad_out.to(acc) * out.to(acc)).sum(-1);
    if (grad_lse.has_value()) {
      delta = delta - grad_lse->to(acc);
    }
    at::Tensor sink_prob = at::exp(sinks->to(acc).view({1, hq, 1}) - lse.to(acc));
    if (lse_lo.has_value()) {
      sink_prob = at::exp((sinks->to(acc).view({1, hq, 1}) - lse.to(acc)) - lse_lo->to(acc));
    }
    // A row with lse -inf (no visible key and a sink of -inf) gives the sink no weight, not
    // exp(-inf + inf) = NaN.
    sink_prob = sink_prob.masked_fill(lse.isneginf(), 0.0);
    grad_sinks =
        (-(sink_prob * delta).sum(at::IntArrayRef{0, 2})).to(sinks->scalar_type());  // C++17: an init list is ambiguous
  }

  // The mask's gradient: the kernel writes per-batch partial sums [b, Hm, Qm, KVm] (acc dtype),
  // reduced here to the mask's shape. A mask shared by the batch (a learnable [1, H, Q, KV] bias)
  // would need the batch times its own size for them, so the batch runs in chunks whose partial
  // sums fit in mask_grad_budget (mask_grad_batch_chunk), each chunk's reduction added to the
  // ones before it in batch order: deterministic, like the one-chunk reduction. A full-size mask
  // (Q and KV its own) broadcast over the batch, the heads or both (a learnable [1, H, Q, KV],
  // [B, 1, Q, KV] or [1, 1, Q, KV] bias) can instead go to a backend that sums the broadcast dims
  // itself (sums_broadcast; the CUDA one with atomics, so not under deterministic algorithms): one
  // zeroed buffer of the mask's own shape [Bm, Hm, Q, KV], no partial sums and no reduction. A
  // mask with an element for each (batch row, query head) (kAssign's) can have the gradient itself
  // written in its own dtype by such a backend (kOwnShape): no float32 buffer to fill and cast.
  at::Tensor mask4;
  std::vector<int64_t> partial_sizes;
  bool grad_mask_assign = false;     // GradMaskWrite::kAssign
  bool grad_mask_broadcast = false;  // GradMaskWrite::kSumBroadcast, if the backend takes it
  bool grad_mask_own_shape = false;  // GradMaskWrite::kOwnShape, if the backend takes it
  int64_t chunk = std::max<int64_t>(batch, 1);
  bool batch_done = false;  // the broadcast-summed gradient below ran the whole batch
  if (attn_mask.has_value()) {
    mask4 = mask_as_4d(*attn_mask);
    if (grad_mask_needed) {
      const int64_t mask_heads = mask4.size(1) == hq ? hq : hkv;
      const bool full_size = mask4.size(2) == q_len && mask4.size(3) == kv_len && !empty;
      grad_mask_assign = mask_heads == hq && full_size;
      // Hm = 1 sums every query head (with GQA all Hq of them, not Hkv group sums).
      grad_mask_broadcast = full_size && (mask4.size(1) == 1 || mask4.size(1) == hq) &&
                            ((mask4.size(0) == 1 && batch > 1) || (mask4.size(1) == 1 && hq > 1));
      grad_mask_own_shape = grad_mask_assign && mask4.size(0) == batch && mask4.size(1) == hq;
      partial_sizes = {batch, mask_heads, mask4.size(2), mask4.size(3)};
      if (mask4.size(0) == 1) {
        const int64_t row_bytes = mask_heads * mask4.size(2) * mask4.size(3) * c10::elementSize(acc);
        chunk = mask_grad_batch_chunk(batch, row_bytes, mask_grad_budget);
      }
    }
  }
  // The kernel's arguments for batch rows [b0, b0 + rows), with `partial` as the mask gradient's.
  auto args_for = [&](int64_t b0, int64_t rows, const at::Tensor& partial) {
    auto rows_of = [&](const at::Tensor& t) { return t.narrow(0, b0, rows); };
    AttentionBwdArgs args;
    args.grad_out = rows_of(grad_out_in);
    if (grad_lse.has_value()) {
      args.grad_lse = rows_of(*grad_lse);
    }
    args.query = rows_of(query);
    args.key = rows_of(key);
    args.value = rows_of(value);
    args.out = rows_of(out);
    args.lse = rows_of(lse).to(acc).contiguous();
    args.lse_lo = lse_lo.has_value() ? rows_of(*lse_lo).to(acc).contiguous() : at::zeros_like(args.lse);
    if (mask4.defined()) {
      args.mask = (mask4.size(0) == 1 ? mask4 : rows_of(mask4)).expand({rows, hq, q_len, kv_len});
    }
    if (key_ranges.has_value()) {
      args.key_ranges = rows_of(*key_ranges).contiguous();
    }
    args.grad_query = rows_of(grad_query);
    args.grad_key = rows_of(grad_key);
    args.grad_value = rows_of(grad_value);
    args.grad_mask_partial = partial;
    args.grad_mask_write = grad_mask_assign ? GradMaskWrite::kAssign : GradMaskWrite::kAccumulate;
    set_score_rule(args, query, scale, softcap, is_causal, q_offset, kv_offset, q_len, kv_len);
    return args;
  };
  at::Tensor mask_grad_sum;  // acc dtype, reduced over the mask's broadcast dims
  // Deterministic reduction of `rows` batch rows' partial sums to the mask's own shape, added to
  // the ones before.
  auto add_to_sum = [&](at::Tensor partial, int64_t rows) {
    if (mask4.size(0) == 1 && rows != 1) {
      partial = partial.sum(0, /*keepdim=*/true);
    }
    if (mask4.size(1) == 1 && partial.size(1) != 1) {
      partial = partial.sum(1, /*keepdim=*/true);
    }
    mask_grad_sum = mask_grad_sum.defined() ? mask_grad_sum.add_(partial) : partial;
  };
  if (grad_mask_own_shape && sums_broadcast != nullptr) {
    AttentionBwdArgs args = args_for(0, batch, at::Tensor());
    args.grad_mask_write = GradMaskWrite::kOwnShape;
    if (sums_broadcast(args)) {
      args.grad_mask_partial = at::zeros(mask4.sizes(), mask4.options());
      kernel(args);
      mask_grad_sum = args.grad_mask_partial;  // the gradient itself, in the mask's dtype
      batch_done = true;
    }
  }
  if (grad_mask_broadcast && !batch_done && sums_broadcast != nullptr) {
    AttentionBwdArgs args = args_for(0, batch, at::Tensor());
    args.grad_mask_write = GradMaskWrite::kSumBroadcast;
    if (sums_broadcast(args)) {
      args.grad_mask_partial = at::zeros({mask4.size(0), mask4.size(1), q_len, kv_len}, query.options().dtype(acc));
      kernel(args);
      mask_grad_sum = args.grad_mask_partial;  // the mask's own shape: nothing left to reduce
      batch_done = true;
    }
  }
  for (int64_t b0 = 0; !batch_done && (b0 == 0 || b0 < batch); b0 += chunk) {
    const int64_t rows = std::min(chunk, batch - b0);
    at::Tensor partial;
    if (!partial_sizes.empty()) {
      partial_sizes[0] = rows;
      partial = grad_mask_assign ? at::empty(partial_sizes, query.options().dtype(acc))
                                 : at::zeros(partial_sizes, query.options().dtype(acc));
    }
    if (!empty) {
      kernel(args_for(b0, rows, partial));
    }
    if (partial.defined()) {
      add_to_sum(partial, rows);
    }
  }
  if (mask_grad_sum.defined()) {
    grad_mask = mask_grad_sum.reshape(attn_mask->sizes()).to(attn_mask->scalar_type());
  }
  return {grad_query, grad_key, grad_value, grad_mask, grad_sinks};
}

int64_t mask_grad_batch_chunk(int64_t batch, int64_t row_bytes, int64_t budget_bytes) {
  if (batch <= 1 || row_bytes <= 0) {
    return std::max<int64_t>(batch, 1);
  }
  return std::clamp<int64_t>(budget_bytes / row_bytes, 1, batch);
}

namespace {

// The CPU kernels read key ranges themselves (choose_attention_cpu).
void attention_fwd_cpu(const AttentionFwdArgs& args) {
  attention_fwd_cpu_stub().pick()(args);
}

// The CPU backward reads grad_out with the empty rows dropped.
void attention_bwd_cpu(const AttentionBwdArgs& args) {
  AttentionBwdArgs cleaned = args;
  cleaned.grad_out = grad_out_without_empty_rows(args);
  attention_bwd_cpu_stub().pick()(cleaned);
}

// The Meta kernels: what torch.compile, torch.export and FakeTensorMode run (sizes may be
// symbolic). The same checks as the CPU and CUDA entry points, then the outputs they allocate.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_meta(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, c10::SymInt q_offset,
    c10::SymInt kv_offset, double softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& key_ranges) {
  check_attention(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap, sinks, key_ranges);
  return attention_outputs(query, value, /*with_lse_lo=*/true);
}

std::tuple<at::Tensor, at::Tensor> attention_meta(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                  double dropout_p, bool is_causal, std::optional<double> scale,
                                                  bool enable_gqa, c10::SymInt q_offset, c10::SymInt kv_offset,
                                                  double softcap, const std::optional<at::Tensor>& sinks,
                                                  const std::optional<at::Tensor>& key_ranges) {
  check_attention(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap, sinks, key_ranges);
  auto [out, lse, unused] = attention_outputs(query, value, /*with_lse_lo=*/false);
  return {out, lse};
}

// As attention_backward_impl allocates them: gradients of query, key, value contiguous; the mask's
// and the sinks' in their own shape and dtype, or empty when not asked for.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale, c10::SymInt q_offset,
    c10::SymInt kv_offset, double softcap, const std::optional<at::Tensor>& sinks, bool grad_mask_needed,
    const std::optional<at::Tensor>& lse_lo, const std::optional<at::Tensor>& key_ranges) {
  check_attention_backward(grad_out, grad_lse, query, key, value, out, lse, attn_mask, scale, softcap, sinks,
                           grad_mask_needed, lse_lo, key_ranges);
  auto like = [](const at::Tensor& t) { return at::empty_symint(t.sym_sizes(), t.options()); };
  auto none = [&] { return at::empty({0}, query.options()); };  // a fresh one each: outputs never alias
  return {like(query), like(key), like(value), attn_mask.has_value() && grad_mask_needed ? like(*attn_mask) : none(),
          sinks.has_value() ? like(*sinks) : none()};
}

}  // namespace

namespace {

using AttentionSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const std::optional<at::Tensor>&, double, bool,
                                                              std::optional<double>, bool, c10::SymInt, c10::SymInt,
                                                              double, const std::optional<at::Tensor>&,
                                                              const std::optional<at::Tensor>&);
using AttentionForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, bool,
    std::optional<double>, bool, c10::SymInt, c10::SymInt, double, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&);
using AttentionBackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool, std::optional<double>, c10::SymInt,
    c10::SymInt, double, const std::optional<at::Tensor>&, bool, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<AttentionSignature>& attention_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("safeattn::attention", "").typed<AttentionSignature>();
  return op;
}

const c10::TypedOperatorHandle<AttentionForwardSignature>& attention_forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("safeattn::_attention_forward", "")
                             .typed<AttentionForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<AttentionBackwardSignature>& attention_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("safeattn::_attention_backward", "")
                             .typed<AttentionBackwardSignature>();
  return op;
}

std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The Autograd kernel of attention. It is C++ rather than a Python kernel on the Autograd key
// (torch.library's way, as the softmax ops have it in python/safeattn/_autograd.py): with twelve
// arguments, the two crossings of the Python boundary such a kernel makes cost about 25 us a call
// on the CI machine's CPU, twice the op itself on a small problem (decoding, where the op runs once
// per layer and token). The backward is the op _attention_backward, so torch.compile traces the
// pair as two opaque nodes either way; C++ callers of safeattn::attention get gradients too.
class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& query,
                                                const at::Tensor& key, const at::Tensor& value,
                                                const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                bool is_causal, std::optional<double> scale, bool enable_gqa,
                                                const c10::SymInt& q_offset, const c10::SymInt& kv_offset,
                                                double softcap, const std::optional<at::Tensor>& sinks,
                                                const std::optional<at::Tensor>& key_ranges) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // _attention_forward: attention plus lse_lo, which only the backward reads.
    auto [out, lse, lse_lo] = attention_forward_op().call(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                          enable_gqa, q_offset, kv_offset, softcap, sinks, key_ranges);
    const at::Tensor mask = attn_mask.value_or(at::Tensor());
    ctx->save_for_backward(
        {query, key, value, mask, sinks.value_or(at::Tensor()), out, lse, lse_lo, key_ranges.value_or(at::Tensor())});
    // An unused lse gets an undefined gradient rather than a materialised zero one (a pass saved).
    ctx->set_materialize_grads(false);
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;  // None stays None: the backward op resolves it
    ctx->saved_data["q_offset"] = q_offset;
    ctx->saved_data["kv_offset"] = kv_offset;
    ctx->saved_data["softcap"] = softcap;
    return {out, lse};
  }

  // One gradient per forward argument (13); needs_input_grad counts the tensor arguments given
  // (query, key, value, then attn_mask and sinks where present).
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &query = saved[0], &key = saved[1], &value = saved[2], &mask = saved[3], &sinks = saved[4];
    const at::Tensor &out = saved[5], &lse = saved[6], &lse_lo = saved[7], &key_ranges = saved[8];
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const bool grad_mask_needed = mask.defined() && ctx->needs_input_grad(3);
    const bool grad_sinks_needed = sinks.defined() && ctx->needs_input_grad(mask.defined() ? 4 : 3);
    auto [grad_query, grad_key, grad_value, grad_mask, grad_sinks] = attention_backward_op().call(
        grad_out, defined_or_none(grads[1]), query, key, value, out, lse, defined_or_none(mask),
        ctx->saved_data["is_causal"].toBool(), ctx->saved_data["scale"].toOptional<double>(),
        ctx->saved_data["q_offset"].toSymInt(), ctx->saved_data["kv_offset"].toSymInt(),
        ctx->saved_data["softcap"].toDouble(), defined_or_none(sinks), grad_mask_needed, defined_or_none(lse_lo),
        defined_or_none(key_ranges));
    torch::autograd::variable_list result(13);
    result[0] = grad_query;
    result[1] = grad_key;
    result[2] = grad_value;
    if (grad_mask_needed) {
      result[3] = grad_mask;
    }
    if (grad_sinks_needed) {
      result[11] = grad_sinks;
    }
    return result;
  }
};

// Whether a torch.func transform is active: the check a C++ autograd::Function makes before it
// runs (ATen/FuncTorchTLS.h: it raises under a transform), asked here first. The functorch TLS
// exists only once a transform has run, so an ordinary call pays one null test.
bool under_functorch_transform() {
  const auto& tls = at::functorch::functorchTLSAccessor();
  if (!tls) {
    return false;
  }
  try {
    tls->checkSupportsCppAutogradFunction();
    return false;
  } catch (const c10::Error&) {
    return true;
  }
}

std::tuple<at::Tensor, at::Tensor> attention_autograd(const at::Tensor& query, const at::Tensor& key,
                                                      const at::Tensor& value,
                                                      const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                      bool is_causal, std::optional<double> scale, bool enable_gqa,
                                                      c10::SymInt q_offset, c10::SymInt kv_offset, double softcap,
                                                      const std::optional<at::Tensor>& sinks,
                                                      const std::optional<at::Tensor>& key_ranges) {
  // Under a torch.func transform (which rejects a C++ autograd::Function) or with a forward-AD
  // dual input (which it has no rule for), the ATen composite: every transform and every order
  // of derivative then work, at O(Q * KV) memory. Only such calls take it (ops.py routes the
  // public wrapper the same way; this covers direct calls of the op, Transformers' included).
  auto dual = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() && t->_fw_grad(/*level=*/0).defined();
  };
  if (under_functorch_transform() || dual(query) || dual(key) || dual(value) || dual(attn_mask) || dual(sinks)) {
    // The composite reads key ranges drawn into the mask (differentiable for a float one).
    std::optional<at::Tensor> mask = attn_mask;
    if (key_ranges.has_value()) {
      check_attention(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap, sinks, key_ranges);
      mask = and_key_ranges(attn_mask.has_value() ? mask_as_4d(*attn_mask) : at::Tensor(), *key_ranges, key.size(2));
    }
    return attention_math(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa, q_offset, kv_offset,
                          softcap, sinks);
  }
  // Nothing to differentiate: the op itself below autograd, with no graph node and no lse_lo
  // (an inference call, and what an exported graph keeps after run_decompositions).
  auto requires_grad = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() && t->requires_grad();
  };
  if (!at::GradMode::is_enabled() || !(requires_grad(query) || requires_grad(key) || requires_grad(value) ||
                                       requires_grad(attn_mask) || requires_grad(sinks))) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_op().call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset,
                               kv_offset, softcap, sinks, key_ranges);
  }
  const torch::autograd::variable_list result =
      AttentionFunction::apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset,
                               kv_offset, softcap, sinks, key_ranges);
  return {result[0], result[1]};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                             const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                             bool is_causal, std::optional<double> scale, bool enable_gqa,
                                             int64_t q_offset, int64_t kv_offset, double softcap,
                                             const std::optional<at::Tensor>& sinks,
                                             const std::optional<at::Tensor>& key_ranges) {
  return attention_op().call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset, kv_offset,
                             softcap, sinks, key_ranges);
}

TORCH_LIBRARY_FRAGMENT(safeattn, m) {
  m.def(
      "attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, "
      "bool is_causal=False, float? scale=None, bool enable_gqa=False, *, SymInt q_offset=0, SymInt kv_offset=0, "
      "float softcap=0.0, Tensor? sinks=None, Tensor? key_ranges=None) -> (Tensor out, Tensor lse)");
  // Private: the forward that AttentionFunction calls, with lse's rounding error as a third
  // output (attention.h says why the backward needs it).
  m.def(
      "_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, "
      "bool is_causal=False, float? scale=None, bool enable_gqa=False, *, SymInt q_offset=0, SymInt kv_offset=0, "
      "float softcap=0.0, Tensor? sinks=None, Tensor? key_ranges=None) -> (Tensor out, Tensor lse, Tensor lse_lo)");
  // Private: the backward as its own op, so it stays traceable (AttentionFunction above calls it).
  // `scale` is the forward's argument, None included (resolved here, so a traced caller does not
  // guard on the head dim). grad_mask and grad_sinks are empty when not asked for (no mask
  // gradient needed, no sinks). lse_lo: _attention_forward's third output (None: zeros).
  m.def(
      "_attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor lse, Tensor? attn_mask, bool is_causal, float? scale, SymInt q_offset, SymInt kv_offset, "
      "float softcap, Tensor? sinks, bool grad_mask_needed, Tensor? lse_lo=None, Tensor? key_ranges=None) -> "
      "(Tensor grad_query, "
      "Tensor grad_key, Tensor grad_value, Tensor grad_mask, Tensor grad_sinks)");
}

TORCH_LIBRARY_IMPL(safeattn, CPU, m) {
  m.impl("attention", &attention_kernel<NoEntry, &attention_fwd_cpu, /*kWithLseLo=*/false>);
  m.impl("_attention_forward", &attention_kernel<NoEntry, &attention_fwd_cpu, /*kWithLseLo=*/true>);
  m.impl("_attention_backward", &attention_backward_kernel<NoEntry, &attention_bwd_cpu>);
}

// Also the fakes: FakeTensorMode runs a C++ Meta kernel for an op that has no Python fake.
TORCH_LIBRARY_IMPL(safeattn, Meta, m) {
  m.impl("attention", &attention_meta);
  m.impl("_attention_forward", &attention_forward_meta);
  m.impl("_attention_backward", &attention_backward_meta);
}

TORCH_LIBRARY_IMPL(safeattn, Autograd, m) {
  m.impl("attention", &attention_autograd);
  // No double backward: asking for one raises "not implemented" naming the op. The private
  // forward has no gradient of its own (attention's Autograd kernel calls it below autograd).
  m.impl("_attention_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("_attention_backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace safeattn
