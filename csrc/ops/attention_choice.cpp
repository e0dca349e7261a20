// attention_path and the chooser registry (ops/attention_choice.h).
#include "ops/attention_choice.h"

#include <array>
#include <iterator>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace safeattn {

const char* attention_path_name(AttentionPath path) {
  // By AttentionPath's value, in its order.
  static constexpr const char* kNames[] = {"none", "cpu", "decode", "sm90a", "mma_sync", "chunked_aten"};
  static_assert(std::size(kNames) == static_cast<size_t>(AttentionPath::kChunkedAten) + 1, "a path without a name");
  const auto index = static_cast<size_t>(path);
  return index < std::size(kNames) ? kNames[index] : "unknown";
}

AttentionChoice choose_attention_cpu() {
  AttentionChoice choice;
  choice.offer(AttentionPath::kCpu, nullptr);  // it reads key ranges: nothing is drawn
  return choice;
}

namespace {

std::array<std::optional<AttentionChooser>, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>&
choosers() {
  static std::array<std::optional<AttentionChooser>,
                    static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
      table;
  return table;
}

AttentionChoice choose_cpu_fwd(const AttentionFwdArgs&) {
  return choose_attention_cpu();
}

AttentionChoice choose_cpu_bwd(const AttentionBwdArgs&) {
  return choose_attention_cpu();
}

// The CPU backward entry point passes no sums_broadcast (ops/attention.cpp).
[[maybe_unused]] const bool cpu_registered = [] {
  register_attention_chooser(c10::DeviceType::CPU, {&choose_cpu_fwd, &choose_cpu_bwd, nullptr});
  return true;
}();

// attention_path's recording kernels: a kernel is a plain function pointer (AttentionFwdFn), so
// the chooser they ask and the choice they keep live here, for the one call on this thread.
thread_local const AttentionChooser* recording_chooser = nullptr;
thread_local std::optional<AttentionChoice> recorded;

void record_fwd(const AttentionFwdArgs& args) {
  if (!recorded) {
    recorded = recording_chooser->forward(args);
  }
}

void record_bwd(const AttentionBwdArgs& args) {
  if (!recorded) {
    recorded = recording_chooser->backward(args);
  }
}

// Clears the recording state when attention_path leaves, by a return or an exception.
struct Recording {
  explicit Recording(const AttentionChooser* chooser) {
    recording_chooser = chooser;
    recorded.reset();
  }
  ~Recording() {
    recording_chooser = nullptr;
    recorded.reset();
  }
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;
  AttentionChoice take() {
    AttentionChoice choice = recorded.value_or(AttentionChoice{});  // no kernel call: kNone
    recorded.reset();
    return choice;
  }
};

}  // namespace

void register_attention_chooser(c10::DeviceType device, AttentionChooser chooser) {
  choosers().at(static_cast<size_t>(device)) = chooser;
}

AttentionChoice attention_path(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                               std::optional<double> scale, bool enable_gqa, int64_t q_offset, int64_t kv_offset,
                               double softcap, const std::optional<at::Tensor>& sinks,
                               const std::optional<at::Tensor>& key_ranges, bool backward) {
  const std::optional<AttentionChooser>& chooser = choosers().at(static_cast<size_t>(query.device().type()));
  TORCH_CHECK(chooser.has_value(), "attention: this build has no attention kernels for device ", query.device());
  const c10::NoGradGuard no_grad;  // the entry points' own ATen work builds no graph here
  Recording recording(&*chooser);
  // The forward entry point's body; with_lse_lo, as the autograd forward (_attention_forward)
  // runs it, so that the backward below gets its lse_lo.
  auto [out, lse, lse_lo] = attention_impl(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                           q_offset, kv_offset, softcap, sinks, key_ranges,
                                           /*with_lse_lo=*/true, &record_fwd);
  AttentionChoice forward = recording.take();
  if (!backward) {
    return forward;
  }
  // Zeros: every row has a visible key as far as the backward can tell; no choice reads them.
  out.zero_();
  lse.zero_();
  lse_lo.zero_();
  const at::Tensor grad_out = at::zeros_like(out);
  const bool grad_mask_needed = attn_mask.has_value() && attn_mask->requires_grad();
  attention_backward_impl(grad_out, std::nullopt, query, key, value, out, lse, attn_mask, is_causal, scale, q_offset,
                          kv_offset, softcap, sinks, grad_mask_needed, lse_lo, key_ranges, &record_bwd,
                          kMaskGradBudgetBytes, chooser->sums_broadcast);
  return recording.take();
}

}  // namespace safeattn
