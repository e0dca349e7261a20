// Which kernel runs an attention call, and why not the ones asked before it.
//
// Contract: each kernel family answers one question beside its own code, "why can you not run
// these arguments?" (a static string, or nullptr when it can: CUTLASS's can_implement, xformers'
// not_supported_reasons). A backend's chooser, one per direction, asks them in a fixed order and
// takes the first that can; its entry point runs what the chooser returns and decides nothing
// itself. The CUDA order and rules are in ops/cuda/attention_choice.h; the CPU backend has one
// kernel. attention_path() reports a call's choice without running any attention kernel
// (safeattn._testing.attention_path), so a test can assert which kernel a call takes and a
// silent fallback to a slower one fails it.
#pragma once

#include <array>
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include "ops/attention.h"

namespace safeattn {

enum class AttentionPath : uint8_t {
  kNone,         // no kernel runs: an empty output (or, in the backward, no query or no key)
  kCpu,          // the CPU kernels (ops/cpu/attention_{fwd,bwd}_kernel.cpp), one per ISA
  kDecode,       // CUDA split-KV decode (ops/cuda/attention_decode_kernel.cu), forward only
  kSm90a,        // CUDA Hopper TMA + wgmma kernels (ops/cuda/hopper/attention_{fwd,bwd}_sm90.h)
  kMmaSync,      // CUDA mma.sync tensor-core kernels, the generic ones (generic/attention_{fwd,bwd}.cuh)
  kChunkedAten,  // ATen ops over chunks of queries (ops/attention_composite.h)
};

// "none", "cpu", "decode", "sm90a", "mma_sync", "chunked_aten": the names the Python helper
// reports.
const char* attention_path_name(AttentionPath path);

struct AttentionChoice {
  struct Rejection {
    AttentionPath path = AttentionPath::kNone;
    const char* reason = nullptr;  // a static string
  };
  AttentionPath path = AttentionPath::kNone;
  // The chosen kernel reads with_key_ranges_drawn(args) (ops/attention.h): the key ranges as a
  // mask. The CUDA decode and sm_90a kernels read key ranges themselves, as the CPU kernels do
  // (the mma.sync ones can: kMmaSyncReadsKeyRanges, cuda/generic/mma_sync.cuh).
  bool draw_key_ranges = false;
  // The kernels asked before `path`, in order, each with why it declined. No heap: the choice is
  // made on every call (decode runs once per layer and token).
  std::array<Rejection, 4> rejected{};
  int rejected_count = 0;

  // Takes `candidate` when `reason` is nullptr and returns true; else records the rejection.
  bool offer(AttentionPath candidate, const char* reason) {
    if (reason == nullptr) {
      path = candidate;
      return true;
    }
    if (rejected_count < static_cast<int>(rejected.size())) {
      rejected[rejected_count++] = {candidate, reason};
    }
    return false;
  }

  // Calls run(path, args) with the arguments the chosen kernel reads: args itself, or a copy
  // with the key ranges drawn into the mask.
  template <class Args, class Run>
  void run(const Args& args, Run&& run) const {
    if (draw_key_ranges) {
      run(path, with_key_ranges_drawn(args));
    } else {
      run(path, args);
    }
  }
};

// A backend's kernel as attention_kernel and attention_backward_kernel (ops/attention.h) take it:
// kRun on the path that kChoose chooses, with the arguments that path reads (AttentionChoice::run).
template <class Args, AttentionChoice (*kChoose)(const Args&), void (*kRun)(AttentionPath, const Args&)>
void run_chosen(const Args& args) {
  kChoose(args).run(args, kRun);
}

// A backend's choosers as attention_path() reaches them: forward, backward, and the
// sums_broadcast question its backward entry point passes to attention_backward_impl (nullptr:
// never).
struct AttentionChooser {
  AttentionChoice (*forward)(const AttentionFwdArgs& args) = nullptr;
  AttentionChoice (*backward)(const AttentionBwdArgs& args) = nullptr;
  AttentionBwdSumsBroadcastFn sums_broadcast = nullptr;
};

// Registers the chooser of one device type: at static initialisation, beside the backend's
// TORCH_LIBRARY_IMPL, so a build without that backend has none.
void register_attention_chooser(c10::DeviceType device, AttentionChooser chooser);

// The CPU backend's choice: its kernels, which read key ranges themselves.
AttentionChoice choose_attention_cpu();

// What attention (backward=false) or its backward (backward=true; the mask's gradient is asked
// for when attn_mask requires grad) would run for these arguments on query's device. It goes
// through the entry points' own bodies (attention_impl, attention_backward_impl: the checks, the
// outputs, the batch chunks) with a kernel that records the choice of its first call instead of
// running; the backward's inputs (grad_out, out, lse) are zeros. Raises what the op raises for
// bad arguments.
AttentionChoice attention_path(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                               std::optional<double> scale, bool enable_gqa, int64_t q_offset, int64_t kv_offset,
                               double softcap, const std::optional<at::Tensor>& sinks,
                               const std::optional<at::Tensor>& key_ranges, bool backward);

}  // namespace safeattn
