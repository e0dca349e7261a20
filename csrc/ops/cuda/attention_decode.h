// Split-KV decode forward of safeattn::attention on CUDA (attention_decode_kernel.cu): the
// generation step of a language model, a few query rows per kv head over a long KV cache.
#pragma once

#include "ops/attention.h"

namespace safeattn::cuda {

// Why the decode kernel cannot take `a` (a static string), or nullptr when it can: bfloat16 /
// float16, head dim 64 or 128 (D == Dv), at most 16 query rows per kv head (group * Q), 16-byte
// aligned rows, no float mask. Asked by the chooser (attention_choice.h).
const char* attention_fwd_decode_rejects(const AttentionFwdArgs& a);

// Computes a.out and a.lse; only where attention_fwd_decode_rejects(a) is nullptr.
void attention_fwd_decode(const AttentionFwdArgs& a);

}  // namespace safeattn::cuda
