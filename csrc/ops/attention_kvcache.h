// safeattn::_attention_kvcache: attention over a KV cache, contiguous or paged, with new tokens
// appended in place first: the C++ route of safeattn.attention_with_kvcache (python/safeattn/
// serving.py), which checks the arguments and documents the semantics (FlashAttention's
// flash_attn_with_kvcache). Private: that function calls it when no gradient is asked for.
//
// Shapes: q [B, Sq, Hq, D]; k_cache, v_cache [B, S_max, Hkv, D | Dv] (contiguous) or
// [num_pages, page_size, Hkv, D | Dv] with block_table [B, max_pages] int32 (paged); cache_seqlens
// [B] int32; k, v [B, Sn, Hkv, D | Dv] or none. Returns out [B, Sq, Hq, Dv] contiguous and lse
// [B, Hq, Sq] (float32; float64 for float64 inputs).
//
// The rules every backend shares (KvCacheView, host and device): the capacity C (S_max, or
// max_pages * page_size); sequence b's new tokens go to positions s_b .. s_b + Sn - 1 with s_b =
// clamp(cache_seqlens[b], 0, C - Sn), and it then holds L_b = s_b + Sn tokens; position p lives in
// slot p % page_size of page clamp(block_table[b, p / page_size], 0, num_pages - 1). Query i sits at
// key position diag = i + L_b - Sq and sees keys [lo, hi): lo = max(0, diag - left) (left >= 0),
// hi = min(L_b, diag + right + 1) (right >= 0; causal sets right to 0), empty when hi <= lo.
// Nothing outside the cache is ever read or written, whatever the lengths and the table hold.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

#include "ops/kv_cache_view.h"

namespace safeattn {

// The view of _attention_kvcache's arguments (int32 seqlens and block table), checked first
// (check_attention_kvcache): what every backend's kernel starts from.
KvCacheView checked_kv_cache_view(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k,
                                  const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& block_table,
                                  bool causal, int64_t window_left, int64_t window_right,
                                  const std::optional<at::Tensor>& sinks);

// The backend-independent route: append (at::index_put_; skipped when `append` is false, the
// caller having written the tokens), the paged cache gathered into a contiguous copy, then
// safeattn::attention with `key_ranges` ([B, Sq, 2] int32, KvCacheView::key_range of every row,
// computed by the backend). The CPU kernel, and the CUDA kernel's fallback where the decode
// kernel cannot take the call. `kv_end`: one past the last key any row sees (the largest `hi`),
// where the backend knows it without a host synchronisation, else -1; the attention then reads
// the cache only up to it (a decode step costs what the sequences hold, not the capacity).
std::tuple<at::Tensor, at::Tensor> attention_kvcache_composite(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& block_table, std::optional<double> scale, const at::Tensor& key_ranges,
    int64_t kv_end, double softcap, const std::optional<at::Tensor>& sinks, bool append);

// Checks what keeps every kernel inside its tensors (the user-facing checks, with their messages,
// are attention_with_kvcache's): ranks, shapes, dtypes, devices, int32 indices.
void check_attention_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k,
                             const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& block_table,
                             const std::optional<at::Tensor>& sinks);

// _attention_kvcache through the dispatcher's typed handle: the op as torch.ops calls it, without
// its boxed argument parsing (safeattn._C._attention_kvcache, csrc/python_module.cpp).
std::tuple<at::Tensor, at::Tensor> attention_kvcache(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& block_table, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks);

}  // namespace safeattn
