// The Hopper (sm_90a) backward of safeattn::attention: TMA + wgmma + warp-specialised kernels on
// CuTe (ops/cuda/hopper/), present when the build found the CUTLASS headers and targets sm_90
// (setup.py defines SAFEATTN_WITH_SM90 then).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "ops/attention.h"
#include "ops/cuda/hopper/bwd_params.h"  // kBwdRowPad

namespace safeattn::cuda {

// Why the Hopper kernel cannot take the call (a static string), or nullptr when it can: the
// conditions are in the code, each with its reason (sm90_inputs_rejects holds those both
// directions share). Masks of either kind (a float one not with a softcap), key ranges, softcap
// and sinks are read. A build without the Hopper kernels always says so.
const char* attention_bwd_sm90_rejects(const AttentionBwdArgs& args);
// Whether a call it takes can be bit-reproducible: under deterministic algorithms dQ comes from
// the dQ pass (attention_bwd_sm90_dq_pass), but a mask's gradient summed over its broadcast
// batch and head dims (GradMaskWrite::kSumBroadcast) is added with float atomics all the same. The chooser
// (attention_choice.h) weighs that against deterministic algorithms.
bool attention_bwd_sm90_deterministic(const AttentionBwdArgs& args);
// Whether dQ has a pass of its own (hopper::bwd_dq_pass: past head dim 128, and at every head dim
// under torch.use_deterministic_algorithms); otherwise the dK/dV kernel adds it into dq_accum with
// float32 reduce-adds in no fixed order.
bool attention_bwd_sm90_dq_pass(const AttentionBwdArgs& args);

// The rows of the per-row arrays below: Q rounded up to whole tiles of the kernel.
inline int64_t attention_bwd_sm90_row_pitch(int64_t q_len) {
  return (q_len + hopper::kBwdRowPad - 1) / hopper::kBwdRowPad * hopper::kBwdRowPad;
}

// What the rows pre-pass (attention_bwd_kernel.cu) prepares for the kernel. grad_out is read as
// the caller gave it: a row with no visible key gets row_shift +inf and delta 0 (so p = dS = 0),
// and when such a row holds a non-finite dO (which P^T dO and dO V^T would still spread) the
// pre-pass sets grad_out_dirty and the kernel reads grad_out_clean instead.
struct Sm90BwdRows {
  at::Tensor delta;      // [B, Hq, pitch] float32: rowsum(dO * O) - grad_lse; 0 for empty rows and padding
  at::Tensor row_shift;  // [B, Hq, pitch] float32: (lse + lse_lo) log2(e); +inf for empty rows and padding
  // With a float mask, [B, Hq, pitch] float32 (hopper::BwdSm90Params::row_lo; natural units):
  // row_shift = lse and row_lo = lse_lo log2(e). Undefined otherwise.
  at::Tensor row_lo;
  at::Tensor dq_accum;        // [B, Hq, pitch, D] float32, zeroed; undefined where attention_bwd_sm90_dq_pass
  at::Tensor grad_out_dirty;  // undefined when no row can be empty, else int32 [1]
  at::Tensor grad_out_clean;  // defined with grad_out_dirty: grad_out's shape, contiguous, empty rows 0
};

// Computes grad_query, grad_key and grad_value on the Hopper kernel; only where the chooser took
// it (attention_choice.h).
void attention_bwd_sm90(const AttentionBwdArgs& args, const Sm90BwdRows& rows);

}  // namespace safeattn::cuda
