// safeattn::_attention_kvcache (attention_kvcache.h): the schema, the checks, the composite
// route (the CPU kernel). Its fake is python/safeattn/_fake.py's: on symbolic sizes, after
// attention_with_kvcache's checks.
#include "ops/attention_kvcache.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "ops/attention.h"

namespace safeattn {

namespace {

void check_float(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.dim() == 4, "_attention_kvcache: ", name, " must be 4-D, got ", t.dim(), "-D");
  TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type(), "_attention_kvcache: ", name, " has dtype ", t.scalar_type(),
                    " but q has ", q.scalar_type());
  TORCH_CHECK_VALUE(t.device() == q.device(), "_attention_kvcache: ", name, " is on ", t.device(), " but q is on ",
                    q.device());
}

void check_index(const at::Tensor& t, const char* name, int64_t rank, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.dim() == rank && t.scalar_type() == at::kInt && t.is_contiguous(), "_attention_kvcache: ", name,
                    " must be a contiguous ", rank, "-D int32 tensor, got ", t.dim(), "-D ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == q.device(), "_attention_kvcache: ", name, " is on ", t.device(), " but q is on ",
                    q.device());
}

}  // namespace

void check_attention_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k,
                             const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& block_table,
                             const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(q.dim() == 4, "_attention_kvcache: q must be 4-D [B, Sq, Hq, D], got ", q.dim(), "-D");
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
                    "_attention_kvcache: q must be float32, float16, bfloat16 or float64, got ", dtype);
  check_float(k_cache, "k_cache", q);
  check_float(v_cache, "v_cache", q);
  const int64_t batch = q.size(0), heads = q.size(2), head_dim = q.size(3), kv_heads = k_cache.size(2);
  TORCH_CHECK_VALUE(v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3) && k_cache.size(3) == head_dim &&
                        kv_heads > 0 && heads % kv_heads == 0,
                    "_attention_kvcache: k_cache ", k_cache.sizes(), " and v_cache ", v_cache.sizes(), " do not fit q ",
                    q.sizes());
  check_index(cache_seqlens, "cache_seqlens", 1, q);
  TORCH_CHECK_VALUE(cache_seqlens.size(0) == batch, "_attention_kvcache: cache_seqlens must have ", batch, " entries");
  int64_t capacity = k_cache.size(1);
  if (block_table.has_value()) {
    check_index(*block_table, "block_table", 2, q);
    TORCH_CHECK_VALUE(block_table->size(0) == batch && k_cache.size(0) > 0, "_attention_kvcache: block_table ",
                      block_table->sizes(), " does not fit q ", q.sizes(), " and k_cache ", k_cache.sizes());
    TORCH_CHECK_VALUE(k_cache.size(1) >= 16 && k_cache.size(1) <= 256,
                      "_attention_kvcache: page_size (k_cache.shape[1]) must be 16 to 256, got ", k_cache.size(1));
    capacity = block_table->size(1) * k_cache.size(1);
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) == batch, "_attention_kvcache: k_cache has batch ", k_cache.size(0),
                      " but q has ", batch);
  }
  TORCH_CHECK_VALUE(capacity <= int64_t{1} << 30, "_attention_kvcache: a cache of more than 2^30 tokens");
  TORCH_CHECK_VALUE(k.has_value() == v.has_value(), "_attention_kvcache: k and v must be given together");
  if (k.has_value()) {
    check_float(*k, "k", q);
    check_float(*v, "v", q);
    TORCH_CHECK_VALUE(k->size(0) == batch && k->size(2) == kv_heads && k->size(3) == head_dim &&
                          v->sizes().slice(0, 3) == k->sizes().slice(0, 3) && v->size(3) == v_cache.size(3) &&
                          k->size(1) <= capacity,
                      "_attention_kvcache: k ", k->sizes(), " and v ", v->sizes(), " do not fit the cache ",
                      k_cache.sizes(), " of capacity ", capacity);
  }
  if (sinks.has_value()) {
    TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->size(0) == heads && sinks->device() == q.device(),
                      "_attention_kvcache: sinks must be [", heads, "] on q's device, got ", sinks->sizes());
  }
}

KvCacheView checked_kv_cache_view(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k,
                                  const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& block_table,
                                  bool causal, int64_t window_left, int64_t window_right,
                                  const std::optional<at::Tensor>& sinks) {
  check_attention_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, sinks);
  KvCacheView view;
  view.seqlens = cache_seqlens.const_data_ptr<int>();
  view.capacity = static_cast<int>(k_cache.size(1));
  if (block_table.has_value()) {
    view.block_table = block_table->const_data_ptr<int>();
    view.table_stride = block_table->size(1);
    view.page_size = static_cast<int>(k_cache.size(1));
    if ((view.page_size & (view.page_size - 1)) == 0) {
      view.page_shift = __builtin_ctz(static_cast<unsigned>(view.page_size));
    }
    view.num_pages = static_cast<int>(k_cache.size(0));
    view.capacity = static_cast<int>(block_table->size(1) * k_cache.size(1));
  }
  view.new_tokens = static_cast<int>(k.has_value() ? k->size(1) : 0);
  view.q_len = static_cast<int>(q.size(1));
  // Windows past the capacity are unbounded; int32 from here on.
  auto bound = [&](int64_t w) { return w < 0 || w > view.capacity ? -1 : static_cast<int>(w); };
  view.left = bound(window_left);
  view.right = causal ? 0 : bound(window_right);
  return view;
}

std::tuple<at::Tensor, at::Tensor> attention_kvcache_composite(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& block_table, std::optional<double> scale, const at::Tensor& key_ranges,
    int64_t kv_end, double softcap, const std::optional<at::Tensor>& sinks, bool append) {
  const int64_t batch = q.size(0);
  const bool paged = block_table.has_value();
  const int64_t page_size = k_cache.size(1), capacity = paged ? block_table->size(1) * page_size : page_size;
  const int64_t new_tokens = k.has_value() ? k->size(1) : 0;
  const at::TensorOptions index = cache_seqlens.options().dtype(at::kLong);
  at::Tensor pages;  // [B, max_pages] int64, clamped into the cache
  if (paged) {
    pages = block_table->to(at::kLong).clamp(0, k_cache.size(0) - 1);
  }
  if (append && new_tokens > 0) {
    const at::Tensor start = cache_seqlens.to(at::kLong).clamp(0, capacity - new_tokens);
    const at::Tensor position = start.unsqueeze(1) + at::arange(new_tokens, index);  // [B, Sn]
    c10::List<std::optional<at::Tensor>> where;
    if (paged) {
      where.push_back(pages.gather(1, position.div(page_size, "floor")));
      where.push_back(position.remainder(page_size));
    } else {
      where.push_back(at::arange(batch, index).unsqueeze(1).expand_as(position));
      where.push_back(position);
    }
    k_cache.index_put_(where, *k);
    v_cache.index_put_(where, *v);
  }
  // The keys read: up to kv_end where it is known (at least one, so that the attention keeps its
  // usual shapes; a row's empty range still gives 0).
  const int64_t reach = kv_end < 0 ? capacity : std::min(capacity, std::max<int64_t>(kv_end, 1));
  at::Tensor keys = k_cache, values = v_cache;
  if (!paged) {
    keys = k_cache.narrow(1, 0, reach);
    values = v_cache.narrow(1, 0, reach);
  } else {
    // Each sequence's pages in order, [B, max_pages, page_size, H, D] -> [B, C, H, D], up to the
    // page of key reach - 1. The copy is ours: slots no row sees are zeroed, so that a kernel
    // multiplying a masked probability (0) by its value never meets a NaN there.
    // index_select copies whole pages (contiguous blocks); advanced indexing took 2-3x longer.
    const at::Tensor read = pages.narrow(1, 0, (reach + page_size - 1) / page_size).reshape(-1);
    keys = k_cache.index_select(0, read).flatten(0, 1).unflatten(0, {batch, -1});
    values = v_cache.index_select(0, read).flatten(0, 1).unflatten(0, {batch, -1});
    const int64_t gathered = keys.size(1);
    if (key_ranges.is_cpu()) {
      // The rows' ends are on the host: zero each sequence's slots past its last seen key, if any
      // (a broadcast masked_fill over the whole copy took 140 us at B=8 x 256 keys).
      const auto ranges = key_ranges.accessor<int, 3>();
      for (int64_t b = 0; b < batch; ++b) {
        int64_t seen = 0;
        for (int64_t i = 0; i < ranges.size(1); ++i) {
          seen = std::max<int64_t>(seen, ranges[b][i][1]);
        }
        if (seen < gathered) {
          keys[b].narrow(0, seen, gathered - seen).zero_();
          values[b].narrow(0, seen, gathered - seen).zero_();
        }
      }
    } else {
      const at::Tensor seen = key_ranges.select(2, 1).amax(1, /*keepdim=*/true);  // [B, 1]
      const at::Tensor unused = (at::arange(gathered, index).unsqueeze(0) >= seen).view({batch, gathered, 1, 1});
      keys.masked_fill_(unused, 0);
      values.masked_fill_(unused, 0);
    }
  }
  auto [out, lse] = attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), std::nullopt, 0.0, false,
                              scale, /*enable_gqa=*/true, 0, 0, softcap, sinks, key_ranges);
  return {out.transpose(1, 2), lse};  // out is stored [B, Sq, Hq, Dv]: contiguous
}

std::tuple<at::Tensor, at::Tensor> attention_kvcache(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& block_table, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("safeattn::_attention_kvcache", "")
                             .typed<decltype(attention_kvcache)>();
  return op.call(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, causal, window_left, window_right,
                 softcap, sinks);
}

namespace {

std::tuple<at::Tensor, at::Tensor> attention_kvcache_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& block_table, std::optional<double> scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks) {
  const KvCacheView view = checked_kv_cache_view(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal,
                                                 window_left, window_right, sinks);
  const int64_t batch = q.size(0), q_len = q.size(1);
  at::Tensor key_ranges = at::empty({batch, q_len, 2}, cache_seqlens.options());
  int* r = key_ranges.data_ptr<int>();
  int64_t kv_end = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < q_len; ++i, r += 2) {
      view.key_range(b, static_cast<int>(i), r[0], r[1]);
      kv_end = std::max<int64_t>(kv_end, r[1]);
    }
  }
  return attention_kvcache_composite(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, key_ranges, kv_end,
                                     softcap, sinks, /*append=*/true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(safeattn, m) {
  // Private: attention_with_kvcache's route when no gradient is asked for (attention_kvcache.h).
  m.def(
      "_attention_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? k, "
      "Tensor? v, Tensor? block_table, float? scale, bool causal, int window_left, int window_right, "
      "float softcap, Tensor? sinks) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(safeattn, CPU, m) {
  m.impl("_attention_kvcache", &attention_kvcache_cpu);
}

}  // namespace safeattn
