// Split-KV decode forward of safeattn::attention on CUDA (attention_decode_kernel.cu): the
// generation step of a language model, a few query rows per kv head over a long KV cache.
#pragma once

#include <tuple>

#include "ops/attention.h"
#include "ops/attention_kvcache.h"

namespace safeattn::cuda {

// Why the decode kernel cannot take `a` (a static string), or nullptr when it can: bfloat16 /
// float16, head dim 64 or 128 (D == Dv), at most 16 query rows per kv head (group * Q), 16-byte
// aligned rows, no float mask. Asked by the chooser (attention_choice.h).
const char* attention_fwd_decode_rejects(const AttentionFwdArgs& a);

// Computes a.out and a.lse; only where attention_fwd_decode_rejects(a) is nullptr.
void attention_fwd_decode(const AttentionFwdArgs& a);

// The same kernel over a KV cache (ops/attention_kvcache.h: q [B, Sq, Hq, D], a contiguous or
// paged cache, each row's keys and pages by `cache`), for _attention_kvcache. Why it cannot take
// the call (as above, `capacity` the cache's tokens per sequence), or nullptr.
const char* attention_kvcache_decode_rejects(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             int64_t capacity);
// Returns out [B, Sq, Hq, Dv] contiguous and lse [B, Hq, Sq] float32; sinks undefined or [Hq]
// float32 contiguous.
std::tuple<at::Tensor, at::Tensor> attention_kvcache_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                            const at::Tensor& v_cache, const KvCacheView& cache,
                                                            double scale, double softcap, const at::Tensor& sinks);

}  // namespace safeattn::cuda
