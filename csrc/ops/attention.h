// safeattn::attention: fused scaled-dot-product attention with safe fully-masked rows.
//
// Shapes (B batch, Hq query heads, Hkv key/value heads, Q queries, KV keys):
//   query [B, Hq, Q, D], key [B, Hkv, KV, D], value [B, Hkv, KV, Dv]
//   attn_mask bool or float, broadcastable to [B, Hq, Q, KV] ([Q, KV], [H|1, Q, KV] or
//             [B|1, H|1, Q|1, KV|1]); read through strides, never expanded in memory
//   sinks     [Hq] float logits that join the softmax denominator (GPT-OSS s_aux)
//   key_ranges [B, Q, 2] int32 (lo, hi): query i of batch b sees only keys lo <= j < hi, ANDed
//             with attn_mask and is_causal (a described mask's window or chunk, safeattn.
//             MaskDescription, as indices instead of a drawn [B, 1, Q, KV] mask). Any values:
//             hi <= lo sees nothing.
//   out       [B, Hq, Q, Dv] in query's dtype, stored as [B, Q, Hq, Dv] (a transposed view)
//   lse       [B, Hq, Q] float32 (float64 for float64 inputs): log-sum-exp of each row,
//             sink included
//   lse_lo    [B, Hq, Q] (private output of _attention_forward, input of the backward): the
//             rounding error of lse, lse + lse_lo = max + log(sum) to twice lse's precision.
//             A row whose scores are all huge and negative (a Transformers eager mask of
//             finfo.min) has lse == its max in float32: without lse_lo the backward's
//             exp(s - lse) would lose log(sum) and give every key weight 1 instead of 1/KV.
//
// Scores of query i and key j, in float32 (float64 for float64 inputs):
//   s = scale * <q_i, k_j>;  s = softcap * tanh(s / softcap) if softcap > 0;
//   s += mask (float) or s = -inf where mask is False (bool);
//   s = -inf unless kv_offset + j <= q_offset + i when is_causal
//   out_i = sum_j softmax_j(s) v_j, with the sink logit in the denominator only.
// A row with no visible key gives out 0 and lse -inf (lse = the sink logit with sinks), and
// 0 gradients. A NaN in a row's inputs gives NaN.
//
// Grouped-query attention: query head h reads key/value head h / (Hq / Hkv).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include "common/isa_dispatch.h"
#include "ops/two_sum.h"

namespace safeattn {

// What the forward kernel reads and writes; prepared by attention_cpu (csrc/ops/attention.cpp).
// "acc" is float32, or float64 for float64 inputs. Inputs are read through their strides;
// the kernel packs K^T (and V when it is not already acc with a unit inner stride) itself,
// inside its own parallel loop, so a call opens two parallel regions in all.
struct AttentionFwdArgs {
  at::Tensor query;  // [B, Hq, Q, D], input dtype, any strides
  at::Tensor key;    // [B, Hkv, KV, D], input dtype, any strides
  at::Tensor value;  // [B, Hkv, KV, Dv], input dtype, any strides
  at::Tensor mask;   // undefined, or a [B, Hq, Q, KV] view (stride 0 on broadcast dims)
  // The caller's mask requires grad (a learnable bias: dense, so a kernel that would summarise its
  // values to skip tiles finds none and may leave them unread).
  bool mask_requires_grad = false;
  // Undefined, or [B, Q, 2] int32 with rows of 2 contiguous: the key ranges, ANDed with mask.
  // The sm_90a, decode and CPU kernels read them (the mma.sync ones can: kMmaSyncReadsKeyRanges,
  // cuda/generic/mma_sync.cuh); every other kernel gets with_key_ranges_drawn(args).
  at::Tensor key_ranges;
  at::Tensor sinks;   // undefined, or [Hq] acc dtype contiguous
  at::Tensor out;     // [B, Hq, Q, Dv], input dtype, strided view (written)
  at::Tensor lse;     // [B, Hq, Q], acc dtype, contiguous (written)
  at::Tensor lse_lo;  // undefined, or [B, Hq, Q] acc dtype contiguous (written): lse's rounding error
  double scale = 1.0;
  double softcap = 0.0;  // 0: none
  bool is_causal = false;
  // Key j is visible to query i iff j <= i + q_offset - kv_offset. The entry points pass
  // q_offset = causal_shift(...) and kv_offset = 0, so no kernel subtracts two int64 offsets.
  int64_t q_offset = 0;
  int64_t kv_offset = 0;
};

// How a backward kernel writes AttentionBwdArgs::grad_mask_partial.
enum class GradMaskWrite : uint8_t {
  // Zero-initialised by the caller; contributions added (a group's query heads, broadcast dims).
  kAccumulate,
  // Every element gets exactly one contribution (one query head per slot, full Q and KV dims):
  // assigned, so the buffer needs no zero fill, and for a float32 [B|1, H, Q, KV] mask it is
  // the gradient itself.
  kAssign,
  // The mask is full-size in Q and KV and broadcast over the batch (size 1 in dim 0, batch > 1),
  // the heads (size 1 in dim 1, Hq > 1) or both, and the partial has the mask's own shape
  // [Bm, Hm, Q, KV] (Bm in {1, B}, Hm in {1, Hq}) zero-initialised: every (batch row, query head)
  // contribution added into the element its broadcast dims map to, in any order (only for a
  // backend that says it can: AttentionBwdSumsBroadcastFn).
  kSumBroadcast,
  // As kAssign (one contribution an element: the mask full-size in Q and KV, with the batch's
  // and the query heads' dims), but the partial is the gradient itself: the mask's own shape
  // [B, Hq, Q, KV] and dtype, contiguous, zero-initialised (for the elements no step reaches), so
  // there is no float32 buffer to fill and cast. Only for a backend that says it can
  // (AttentionBwdSumsBroadcastFn).
  kOwnShape,
};

// What the backward kernel reads and writes. It parallelises over (batch x kv-heads): each
// task packs what it reads (in the acc dtype) and writes dK, dV of its kv-head and dQ of the
// query heads of its group, so no element is written by two tasks: no atomics, and results
// that do not depend on the thread count. One parallel region per call.
struct AttentionBwdArgs {
  // [B, Hq, Q, Dv], any strides, as the caller gave it: a row with no visible key (lse -inf) may
  // hold anything, NaN included. Such a row passes no gradient on: a backend either reads
  // grad_out_without_empty_rows(args) or guarantees that itself.
  at::Tensor grad_out;
  at::Tensor grad_lse;    // undefined, or [B, Hq, Q]
  at::Tensor query;       // [B, Hq, Q, D], any strides
  at::Tensor key;         // [B, Hkv, KV, D], any strides
  at::Tensor value;       // [B, Hkv, KV, Dv], any strides
  at::Tensor out;         // [B, Hq, Q, Dv], any strides
  at::Tensor lse;         // [B, Hq, Q], acc dtype
  at::Tensor lse_lo;      // [B, Hq, Q], acc dtype: lse's rounding error (zeros when not given)
  at::Tensor mask;        // as in AttentionFwdArgs
  at::Tensor key_ranges;  // as in AttentionFwdArgs
  at::Tensor grad_query;  // [B, Hq, Q, D], input dtype, contiguous (written)
  at::Tensor grad_key;    // [B, Hkv, KV, D], input dtype, contiguous (written)
  at::Tensor grad_value;  // [B, Hkv, KV, Dv], input dtype, contiguous (written)
  // Undefined, or [B, Hm, Qm, KVm] acc dtype zero-initialised: the mask gradient before its
  // reduction to the mask's shape. Hm is Hq when the mask has a head dim, else Hkv (the heads
  // of one kv group are summed by their task); Qm, KVm are Q, KV or 1 (summed in the task).
  // With GradMaskWrite::kSumBroadcast, the mask's own shape [Bm, Hm, Q, KV] instead (Bm 1 or B,
  // Hm 1 or Hq), zero-initialised; with kOwnShape, the gradient in the mask's shape and dtype.
  at::Tensor grad_mask_partial;
  // How the kernel writes grad_mask_partial (GradMaskWrite).
  GradMaskWrite grad_mask_write = GradMaskWrite::kAccumulate;
  double scale = 1.0;
  double softcap = 0.0;
  bool is_causal = false;
  int64_t q_offset = 0;  // as in AttentionFwdArgs: the causal shift, kv_offset 0
  int64_t kv_offset = 0;
};

// The causal rule's shift q_offset - kv_offset, saturated and clamped to [-q_len, kv_len]: the
// same keys are visible to every query i < q_len (a shift >= kv_len - 1 shows every key, one
// < -(q_len - 1) none), and no kernel's index arithmetic can overflow, whatever the offsets.
inline int64_t causal_shift(int64_t q_offset, int64_t kv_offset, int64_t q_len, int64_t kv_len) {
  int64_t shift = 0;
  if (__builtin_sub_overflow(q_offset, kv_offset, &shift)) {
    shift = q_offset > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
  }
  return shift < -q_len ? -q_len : (shift > kv_len ? kv_len : shift);
}

// A backend's kernels: they get the arguments prepared (and the outputs allocated) by the
// shared entry points below, so CPU and CUDA differ only in these two functions.
using AttentionFwdFn = void (*)(const AttentionFwdArgs& args);
using AttentionBwdFn = void (*)(const AttentionBwdArgs& args);
// Whether the backend's kernel takes these arguments with their grad_mask_write, kSumBroadcast or
// kOwnShape (the partial not yet allocated): one buffer of the mask's own shape instead of
// per-(batch row, head) partial sums and their reduction over the broadcast dims.
using AttentionBwdSumsBroadcastFn = bool (*)(const AttentionBwdArgs& args);
SAFEATTN_DECLARE_ISA_STUB(attention_fwd_cpu_stub, AttentionFwdFn);
SAFEATTN_DECLARE_ISA_STUB(attention_bwd_cpu_stub, AttentionBwdFn);
// What the CPU kernels multiply the tiles of a bf16 / fp16 input in now, and why not in that
// dtype where they don't: "bfloat16", "float16" or "float32 (<reason>)" (build_info's cpu_tiles).
using AttentionCpuTilesFn = std::string (*)(at::ScalarType dtype);
SAFEATTN_DECLARE_ISA_STUB(attention_cpu_tiles_stub, AttentionCpuTilesFn);

// Validates the arguments: the one source of attention's rules, run by every backend's entry
// point and by the Meta kernel (the fake), on SymInt sizes (common/checks.h). `op` names the op
// in the messages.
void check_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& attn_mask, double dropout_p, std::optional<double> scale,
                     bool enable_gqa, double softcap, const std::optional<at::Tensor>& sinks,
                     const std::optional<at::Tensor>& key_ranges = std::nullopt, const char* op = "attention");

// Validates every argument of _attention_backward: the forward's rules, then out, grad_out,
// lse, lse_lo and grad_lse against the shapes and dtypes they must have, so that no call (a
// traced graph's included) can make a kernel read past a tensor. Also run by the Meta kernel.
void check_attention_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                              const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
                              std::optional<double> scale, double softcap, const std::optional<at::Tensor>& sinks,
                              bool grad_mask_needed, const std::optional<at::Tensor>& lse_lo,
                              const std::optional<at::Tensor>& key_ranges);

// The arguments with the key ranges drawn into the mask (a bool [B, 1, Q, KV] ANDed with it, or
// -inf filled into a float one) and key_ranges undefined: what the kernels that do not read key
// ranges run (AttentionFwdArgs::key_ranges). Unchanged without key ranges.
AttentionFwdArgs with_key_ranges_drawn(const AttentionFwdArgs& args);
AttentionBwdArgs with_key_ranges_drawn(const AttentionBwdArgs& args);

// The scale actually used: `scale`, or 1/sqrt(head_dim).
double attention_scale(const at::Tensor& query, std::optional<double> scale);

// The bytes of mask-gradient partial sums (acc dtype, one [Hm, Qm, KVm] row per batch row) the
// backward holds at once for a mask shared by the batch: past them it runs the batch in chunks.
// 4 GiB: a learnable [1, 16, 4096, 4096] bias at batch 4 is one chunk; at [1, 32, 8192, 8192]
// and batch 8 the one-chunk partial sums would be 64 GiB, where the bias is 4 GiB in bf16.
constexpr int64_t kMaskGradBudgetBytes = int64_t{4} << 30;
// The batch rows per chunk: budget_bytes / row_bytes, at least 1 and at most batch (all of them
// when batch <= 1).
int64_t mask_grad_batch_chunk(int64_t batch, int64_t row_bytes, int64_t budget_bytes);

// The backend-independent bodies of the attention and _attention_backward kernels
// (validation, output allocation, sinks and mask-gradient reductions); each backend's
// registration passes its kernel.
// attention_impl returns (out, lse, lse_lo), lse_lo undefined unless with_lse_lo.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_impl(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa, int64_t q_offset, int64_t kv_offset,
    double softcap, const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& key_ranges,
    bool with_lse_lo, AttentionFwdFn kernel);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_impl(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale, int64_t q_offset,
    int64_t kv_offset, double softcap, const std::optional<at::Tensor>& sinks, bool grad_mask_needed,
    const std::optional<at::Tensor>& lse_lo, const std::optional<at::Tensor>& key_ranges, AttentionBwdFn kernel,
    int64_t mask_grad_budget = kMaskGradBudgetBytes, AttentionBwdSumsBroadcastFn sums_broadcast = nullptr);

// What a backend registers for `attention` (kWithLseLo false: out and lse) and
// `_attention_forward` (true: out, lse and lse_lo): attention_impl with the backend's kernel,
// inside an Entry made from the query for the call (the CUDA backend's device guard; NoEntry).
template <class Entry, AttentionFwdFn kKernel, bool kWithLseLo>
std::conditional_t<kWithLseLo, std::tuple<at::Tensor, at::Tensor, at::Tensor>, std::tuple<at::Tensor, at::Tensor>>
attention_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                 const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                 std::optional<double> scale, bool enable_gqa, int64_t q_offset, int64_t kv_offset, double softcap,
                 const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& key_ranges) {
  const Entry entry(query);
  auto result = attention_impl(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset,
                               kv_offset, softcap, sinks, key_ranges, kWithLseLo, kKernel);
  if constexpr (kWithLseLo) {
    return result;
  } else {
    return {std::get<0>(result), std::get<1>(result)};
  }
}

// The same for `_attention_backward`: attention_backward_impl with the backend's kernel and
// sums_broadcast question.
template <class Entry, AttentionBwdFn kKernel, AttentionBwdSumsBroadcastFn kSumsBroadcast = nullptr>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_kernel(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale, int64_t q_offset,
    int64_t kv_offset, double softcap, const std::optional<at::Tensor>& sinks, bool grad_mask_needed,
    const std::optional<at::Tensor>& lse_lo, const std::optional<at::Tensor>& key_ranges) {
  const Entry entry(query);
  return attention_backward_impl(grad_out, grad_lse, query, key, value, out, lse, attn_mask, is_causal, scale, q_offset,
                                 kv_offset, softcap, sinks, grad_mask_needed, lse_lo, key_ranges, kKernel,
                                 kMaskGradBudgetBytes, kSumsBroadcast);
}

// The Entry of a backend that opens nothing for a call (CPU).
struct NoEntry {
  explicit NoEntry(const at::Tensor& /*query*/) {}
};

// grad_out with the rows whose lse is -inf (no visible key) set to 0: with p = 0 for every key,
// a NaN or inf in such a row would still reach dQ (0 * NaN) and, through P^T dO, dV and dK of
// every key. The one statement of that rule; a kernel that reads grad_out directly must keep
// it some other way (the Hopper backward: attention_bwd_sm90.h).
at::Tensor grad_out_without_empty_rows(const AttentionBwdArgs& args);

// A tensor the kernels write in full before anything reads it (the outputs, the gradients, the
// backward's per-row buffers): at::empty without the fill that deterministic algorithms add
// (attention.cpp).
at::Tensor empty_written_in_full(c10::SymIntArrayRef sizes, const at::TensorOptions& options);

// Typed C++ entry points: call the dispatcher (autograd and tracing included).
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                             const std::optional<at::Tensor>& attn_mask = std::nullopt,
                                             double dropout_p = 0.0, bool is_causal = false,
                                             std::optional<double> scale = std::nullopt, bool enable_gqa = false,
                                             int64_t q_offset = 0, int64_t kv_offset = 0, double softcap = 0.0,
                                             const std::optional<at::Tensor>& sinks = std::nullopt,
                                             const std::optional<at::Tensor>& key_ranges = std::nullopt);

}  // namespace safeattn
