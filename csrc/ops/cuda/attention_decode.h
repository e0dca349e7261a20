// Split-KV decode forward of safeattn::attention on CUDA (attention_decode_kernel.cu): the
// generation step of a language model, a few query rows per kv head over a long KV cache.
#pragma once

#include "ops/attention.h"

namespace safeattn::cuda {

// Computes a.out and a.lse and returns true when `a` is the decode case: bfloat16 / float16,
// head dim 64 or 128 (D == Dv), at most 16 query rows per kv head (group * Q), 16-byte aligned
// rows; returns false, touching nothing, otherwise.
bool attention_fwd_decode(const AttentionFwdArgs& a);

}  // namespace safeattn::cuda
