// The CUDA backend's choice of attention kernel: the one place that decides it (the contract is
// ops/attention_choice.h). Plain C++: no CUDA header, so ops/attention_choice.h's users need none.
//
// Forward (choose_attention_fwd), the first kernel that can take the call:
//   - decode (attention_decode.h) and sm90a (attention_fwd_sm90.h), key ranges read;
//   - else key ranges drawn into the mask (with_key_ranges_drawn): mma_sync (attention_fwd.cuh),
//     chunked_aten (ops/attention_composite.h), which takes everything.
// Backward (choose_attention_bwd):
//   - sm90a (attention_bwd_sm90.h), key ranges read, where it can take the call and, under
//     torch.use_deterministic_algorithms(True), is bit-reproducible there
//     (attention_bwd_sm90_deterministic);
//   - else key ranges drawn into the mask: mma_sync (attention_bwd.cuh), chunked_aten.
// Drawing keeps the mask's kind (a float mask stays float; none or a bool one becomes bool), and
// no predicate reads the key ranges, so every kernel is asked about the arguments as given: the
// choice is made once, before any mask is drawn.
#pragma once

#include "ops/attention.h"
#include "ops/attention_choice.h"

namespace safeattn::cuda {

AttentionChoice choose_attention_fwd(const AttentionFwdArgs& args);
AttentionChoice choose_attention_bwd(const AttentionBwdArgs& args);

// The question attention_backward_impl asks before it allocates the gradient of a full-size mask
// (AttentionBwdSumsBroadcastFn, with GradMaskWrite::kOwnShape or kSumBroadcast): only the sm_90a
// kernels write it in the mask's shape, so whether choose_attention_bwd takes them (kSumBroadcast
// not under deterministic algorithms: its adds are atomics).
bool attention_bwd_sums_broadcast(const AttentionBwdArgs& args);

// The mma.sync kernels' predicates (why they cannot take the call, or nullptr), defined beside
// their host code in attention_fwd_kernel.cu and attention_bwd_kernel.cu.
const char* attention_fwd_mma_sync_rejects(const AttentionFwdArgs& args);
const char* attention_bwd_mma_sync_rejects(const AttentionBwdArgs& args);

}  // namespace safeattn::cuda
