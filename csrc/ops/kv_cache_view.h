// KvCacheView: the rules of a KV cache, contiguous or paged, that the host code and the kernels of
// safeattn::_attention_kvcache share (ops/attention_kvcache.h states them): where sequence b's
// new tokens go, which keys query i sees, and where position p lives. No torch include: the
// standalone decode check (benchmarks/decode_check.cu) uses it too.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace safeattn {

struct KvCacheView {
  const int* seqlens = nullptr;      // [B] int32
  const int* block_table = nullptr;  // [B, table_stride] int32, or null: contiguous
  int64_t table_stride = 0;
  int page_size = 1;
  int page_shift = -1;  // log2(page_size) when a power of two (a shift and a mask, not a division)
  int num_pages = 1;
  int capacity = 0;  // C
  int new_tokens = 0;
  int q_len = 0;
  int left = -1, right = -1;  // the window, -1 unbounded; causal: right 0

  // First position of sequence b's new tokens, s_b.
  SAFEATTN_HOST_DEVICE int write_start(int64_t b) const {
    const int s = seqlens[b];
    const int top = capacity - new_tokens;
    return s < 0 ? 0 : (s > top ? top : s);
  }
  // Keys [lo, hi) of query i of sequence b (hi <= lo: none).
  SAFEATTN_HOST_DEVICE void key_range(int64_t b, int i, int& lo, int& hi) const {
    const int length = write_start(b) + new_tokens;
    const int64_t diag = int64_t{i} + length - q_len;
    int64_t l = 0, h = length;
    if (right >= 0 && diag + right + 1 < h) {
      h = diag + right + 1;
    }
    if (left >= 0 && diag - left > l) {
      l = diag - left;
    }
    lo = static_cast<int>(l);
    hi = static_cast<int>(h < l ? l : h);
  }
  // The page holding position p of sequence b (contiguous: b), and p's slot in it.
  SAFEATTN_HOST_DEVICE int64_t page(int64_t b, int p) const {
    return block_table == nullptr ? b : clamp_page(*table_entry(b, p));
  }
  // Paged: the block table's entry for position p of sequence b, and what an entry means.
  SAFEATTN_HOST_DEVICE const int* table_entry(int64_t b, int p) const {
    return block_table + b * table_stride + (page_shift >= 0 ? p >> page_shift : p / page_size);
  }
  SAFEATTN_HOST_DEVICE int clamp_page(int entry) const {
    return entry < 0 ? 0 : (entry >= num_pages ? num_pages - 1 : entry);
  }
  SAFEATTN_HOST_DEVICE int slot(int p) const {
    if (block_table == nullptr) {
      return p;
    }
    return page_shift >= 0 ? p & (page_size - 1) : p % page_size;
  }
};

}  // namespace safeattn
