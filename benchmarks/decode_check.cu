// Standalone check and timing of the split-KV decode kernels
// (csrc/ops/cuda/generic/attention_decode.cuh), without torch, for their pipeline shapes side by
// side: the shape each head dim runs (DecodeConfig) and candidates. Build (from the repository
// root):
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 --expt-relaxed-constexpr -Icsrc \
//        benchmarks/decode_check.cu -o decode_check
//
// Run: ./decode_check [--no-timing] [--no-checks] [--only TEXT[,TEXT...] (shapes whose name
// contains one of them, or is one written after "=")] [--hkv N (the timings' kv heads, of 32 query heads; default 8)]
// [--split-tiles N (each split of a long cache at least N key tiles, 2N from 512 tiles unless its
// pages are shorter than a tile: decode_launch's long_split_tiles)] [--batch N (time only that batch's shapes; 1 adds
// paged caches of 8192 and 32768 keys)] [--kv N (time only the contiguous caches of N keys, each
// shape's 23 launches: 3 warm, then 20 timed; for ncu's --launch-skip)] [--splits N (the timings' splits a (batch, kv
// head), merged in a cluster where clusters are on and N is at most the largest; default: decode_launch's choice)]
// [--paged N (each timed contiguous cache again as pages of N tokens, right after it)] [--ordered-pages (the
// timings' block tables list each sequence's pages in order, not shuffled)]
// [--resident-splits | --sm-splits (decode_launch's choice with the splits filling every resident
// CTA, as before split_slots_for, or one CTA an SM whatever the head dim and cache)].
// Checks: a KV cache of 3 sequences (lengths 0, odd and full), contiguous or paged (pages of 16,
// 64 and 256 in a shuffled block table), GQA 1, 4 and 8 with 1-2 query tokens, causal, a window,
// softcap, sinks, and split counts 1 (the split kernel writes out itself), 3 (merged in a
// cluster, or by the combine kernel) and the automatic one; out and lse against a float64 CPU reference on the same
// 16-bit inputs. The cache's unused slots hold NaN: reading one would show. Timings: one decode step (split kernel, and
// the combine kernel when there is more than one split, or the cluster's merge: see decode_launch) at Hq 32, Hkv 8
// (--hkv), D 64 and 128, bf16, over batch x cache length, the cache [B, S, Hkv, D] (bshd), [B, Hkv, S, D] (bhsd) or
// paged; L2 flushed before each launch, median of 20, and the bandwidth of the K and V bytes read. Checked and timed
// with clusters and without (the combine kernel, as before sm_90). Exit status 1 when a check fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "check_common.h"
#include "ops/cuda/generic/attention_decode.cuh"

namespace attn = safeattn::cuda::attn;
using safeattn::KvCacheView;
using namespace safeattn::cuda::decode;

static const char* g_only = nullptr;

static float* g_workspace = nullptr;  // the splits' partials
static constexpr size_t kWorkspaceFloats = size_t{64} << 20;

static bool g_clusters = true;               // merge the splits in a thread block cluster where decode_launch says so
static int g_cap_tiles = 8;                  // decode_launch's cap_tiles
static int g_split_tiles = kLongSplitTiles;  // --split-tiles N: decode_launch's long_split_tiles
static int g_hkv = 8;                        // --hkv N: the timings' kv heads (of 32 query heads)
static int g_batch = 0;                      // --batch N: time only the shapes of that batch (0: all)
static int g_kv = 0;                         // --kv N: time only the caches of N keys (0: all)
static int g_splits = 0;                     // --splits N: the timings' splits a (batch, kv head) (0: decode_launch's)
static bool g_pdl = true;                    // the combine kernel's programmatic launch (launch_combine_kernel)
static int g_default_cluster = kMaxClusterSplits;  // max_cluster_splits on this GPU (main)
static int g_max_cluster = kMaxClusterSplits;      // the GPU's largest cluster of splits
static bool g_step_rule = true;                    // step_max_cluster decides a step's (else g_max_cluster)
static bool g_small_clusters = false;              // decode_launch's small_clusters (a candidate)
static int g_split_slots =
    0;                  // --resident-splits (1): every resident CTA; --sm-splits (2): one an SM; 0: split_slots_for
static int g_page = 0;  // --paged N: each timed contiguous shape again over pages of N
static bool g_ordered_pages = false;  // --ordered-pages: the timings' block tables list pages in order

template <typename T, int kD, KvRows kRows, bool kCluster, class Tiles>
static auto* split_kernel() {
  constexpr size_t kSmem = Tiles::template smem_bytes<T, kD>();
  auto kernel = &attention_decode_split_kernel<T, kD, kRows, kCluster, Tiles>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  return kernel;
}

// The largest cluster of splits the GPU places for shape Tiles (its shared memory and threads: a
// shape of one CTA an SM may not get 16), as the extension asks it of each shape.
template <typename T, int kD, KvRows kRows, class Tiles>
static int shape_max_cluster() {
  static const int n =
      max_cluster_splits(split_kernel<T, kD, kRows, true, Tiles>(), Tiles::template smem_bytes<T, kD>());
  return n;
}

// One decode step with shape Tiles: `splits` (0: as the extension chooses) CTAs per (batch, kv
// head), merged in a cluster or by the combine kernel when more than one; the kernel instance for
// p.cache's rows (kv_rows_of), as the extension picks it.
template <typename T, int kD, KvRows kRows, class Tiles>
static void launch_rows(DecodeParams p, int64_t batch, int64_t hkv, int splits) {
  constexpr size_t kSmem = Tiles::template smem_bytes<T, kD>();
  const int max_cluster = std::min(g_max_cluster, shape_max_cluster<T, kD, kRows, Tiles>());
  DecodeLaunch how{splits, g_clusters && splits > 1 && splits <= max_cluster};  // checks: forced
  if (splits == 0) {
    int resident = 0, sms = 0;
    CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, split_kernel<T, kD, kRows, false, Tiles>(),
                                                             kThreads, kSmem));
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    how = decode_launch(
        p.kv_end, batch, hkv, int64_t{sms} * std::max(resident, 1), g_clusters, kRows == KvRows::kPageRows, g_cap_tiles,
        g_split_tiles, g_step_rule ? step_max_cluster(batch, hkv, sms, max_cluster) : max_cluster, g_small_clusters,
        g_split_slots == 1 ? 0
        : g_split_slots == 2
            ? sms
            : split_slots_for(kD, kRows, p.kv_end, batch * hkv, sms, int64_t{sms} * std::max(resident, 1)));
  }
  p.splits = how.splits;
  const int64_t total_rows = batch * p.hq * p.q_len;
  if (static_cast<size_t>(total_rows * p.splits * (kD + 1)) > kWorkspaceFloats) {
    fprintf(stderr, "decode_check: workspace too small\n");
    exit(2);
  }
  p.o_part = g_workspace;
  p.lse_part = g_workspace + total_rows * p.splits * kD;
  if (how.cluster) {
    CHECK_CUDA(launch_split_kernel(split_kernel<T, kD, kRows, true, Tiles>(), p, batch, hkv, kSmem, 0, true));
  } else {
    CHECK_CUDA(launch_split_kernel(split_kernel<T, kD, kRows, false, Tiles>(), p, batch, hkv, kSmem, 0, false));
  }
  if (p.splits > 1 && !how.cluster) {
    CHECK_CUDA((launch_combine_kernel<T, kD>(p, total_rows, 0, g_pdl)));
  }
}

template <typename T, int kD, bool kPaged, class Tiles>
static void launch(const DecodeParams& p, int64_t batch, int64_t hkv, int splits) {
  with_kv_rows(kv_rows_of(p.cache), [&](auto rows) {
    constexpr KvRows kRows = decltype(rows)::value;
    if constexpr ((kRows != KvRows::kContiguous) == kPaged) {  // the instances of this call's cache
      launch_rows<T, kD, kRows, Tiles>(p, batch, hkv, splits);
    }
  });
}

// A cache of `batch` sequences: q [B, Sq, Hq, D]; k, v [B, C, Hkv, D] or [pages, page, Hkv, D].
struct CacheCase {
  int batch, hq, hkv, q_len, capacity, page;  // page 0: contiguous
  bool causal;
  int left;  // window, -1: none
  double softcap;
  bool sinks;
  int splits;  // 0: automatic
};

template <typename T, int kD, bool kPaged, class Tiles>
static int check_case(const char* shape, const CacheCase& c, std::mt19937& rng) {
  const int pages_per_seq = kPaged ? (c.capacity + c.page - 1) / c.page : 1;
  const int num_pages = kPaged ? c.batch * pages_per_seq + 3 : c.batch;
  const int page_rows = kPaged ? c.page : c.capacity;
  const int capacity = kPaged ? pages_per_seq * c.page : c.capacity;
  const size_t q_elems = size_t(c.batch) * c.q_len * c.hq * kD;
  const size_t kv_elems = size_t(num_pages) * page_rows * c.hkv * kD;
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<T> q(q_elems), k(kv_elems), v(kv_elems);
  for (auto& x : q)
    x = from_f<T>(uni(rng));
  for (auto& x : k)
    x = from_f<T>(uni(rng));
  for (auto& x : v)
    x = from_f<T>(uni(rng));
  // Lengths: 0, odd, full (all of them at least q_len but the first).
  std::vector<int> seqlens(c.batch);
  for (int b = 0; b < c.batch; ++b) {
    seqlens[b] = b == 0 ? 0 : (b % 2 == 1 ? std::min(capacity, 37 + 11 * b) : capacity);
  }
  std::vector<int> table(size_t(c.batch) * pages_per_seq);
  std::vector<int> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (size_t e = 0; e < table.size(); ++e) {
    table[e] = perm[e];
  }
  KvCacheView host{};
  host.seqlens = seqlens.data();
  host.block_table = kPaged ? table.data() : nullptr;
  host.table_stride = pages_per_seq;
  host.page_size = kPaged ? c.page : 1;
  host.page_shift = kPaged && (c.page & (c.page - 1)) == 0 ? __builtin_ctz(c.page) : -1;
  host.num_pages = num_pages;
  host.capacity = capacity;
  host.new_tokens = 0;
  host.q_len = c.q_len;
  host.left = c.left;
  host.right = c.causal ? 0 : -1;
  // The slots past every row's keys hold NaN: the kernel must not read them (the slots below a
  // window hold data; those the kernel may read, with probability 0).
  const T nan = from_f<T>(NAN);
  for (int b = 0; b < c.batch; ++b) {
    int lo, hi, hi_all = 0;
    for (int i = 0; i < c.q_len; ++i) {
      host.key_range(b, i, lo, hi);
      if (lo < hi) {
        hi_all = std::max(hi_all, hi);
      }
    }
    for (int j = 0; j < capacity; ++j) {
      if (j < hi_all) {
        continue;
      }
      const size_t base = (size_t(host.page(b, j)) * page_rows + host.slot(j)) * c.hkv * kD;
      for (size_t e = 0; e < size_t(c.hkv) * kD; ++e) {
        k[base + e] = nan, v[base + e] = nan;
      }
    }
  }
  std::vector<float> sinks(c.hq);
  for (auto& s : sinks)
    s = uni(rng);

  T* d_q = upload(q);
  T* d_k = upload(k);
  T* d_v = upload(v);
  int* d_seqlens = upload(seqlens);
  int* d_table = upload(table);
  float* d_sinks = upload(sinks);
  T* d_out;
  float *d_lse, *d_lse_lo;
  CHECK_CUDA(cudaMalloc(&d_out, q_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&d_lse, size_t(c.batch) * c.hq * c.q_len * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_lse_lo, size_t(c.batch) * c.hq * c.q_len * sizeof(float)));
  CHECK_CUDA(cudaMemset(d_out, 0xff, q_elems * sizeof(T)));  // NaN

  const double scale = 1.0 / std::sqrt(double(kD));
  DecodeParams p{};
  p.q = d_q, p.k = d_k, p.v = d_v;
  p.q_sb = int64_t{c.q_len} * c.hq * kD, p.q_sh = kD, p.q_si = int64_t{c.hq} * kD;
  p.k_sb = p.v_sb = int64_t{page_rows} * c.hkv * kD;
  p.k_sh = p.v_sh = kD;
  p.k_si = p.v_si = int64_t{c.hkv} * kD;
  p.hq = c.hq, p.group = c.hq / c.hkv, p.q_len = c.q_len, p.rows = (c.hq / c.hkv) * c.q_len;
  p.kv_end = capacity;
  p.score = attn::score_rule(scale, c.softcap, false, true);
  p.cache = host;
  p.cache.seqlens = d_seqlens;
  p.cache.block_table = kPaged ? d_table : nullptr;
  p.out.out = d_out;
  p.out.o_sb = p.q_sb, p.out.o_sh = p.q_sh, p.out.o_si = p.q_si;
  p.out.lse = d_lse;
  p.out.lse_lo = d_lse_lo;
  p.out.sinks = c.sinks ? d_sinks : nullptr;
  launch<T, kD, kPaged, Tiles>(p, c.batch, c.hkv, c.splits);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<T> out(q_elems);
  std::vector<float> lse(size_t(c.batch) * c.hq * c.q_len);
  CHECK_CUDA(cudaMemcpy(out.data(), d_out, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(lse.data(), d_lse, lse.size() * sizeof(float), cudaMemcpyDeviceToHost));

  // float64 reference.
  double worst_out = 0.0, worst_lse = 0.0;
  int bad = 0;
  std::vector<double> s(capacity), acc(kD);
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.hq; ++h) {
      const int hk = h / (c.hq / c.hkv);
      for (int i = 0; i < c.q_len; ++i) {
        int lo, hi;
        host.key_range(b, i, lo, hi);
        const T* qr = &q[((size_t(b) * c.q_len + i) * c.hq + h) * kD];
        double mx = c.sinks ? double(sinks[h]) : -INFINITY;
        for (int j = lo; j < hi; ++j) {
          const T* kr = &k[((size_t(host.page(b, j)) * page_rows + host.slot(j)) * c.hkv + hk) * kD];
          double dot = 0.0;
          for (int d = 0; d < kD; ++d)
            dot += double(to_f(qr[d])) * double(to_f(kr[d]));
          double x = dot * scale;
          if (c.softcap > 0.0)
            x = c.softcap * std::tanh(x / c.softcap);
          s[j] = x;
          mx = std::max(mx, x);
        }
        double total = c.sinks ? std::exp(double(sinks[h]) - mx) : 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = lo; j < hi; ++j) {
          const double e = std::exp(s[j] - mx);
          total += e;
          const T* vr = &v[((size_t(host.page(b, j)) * page_rows + host.slot(j)) * c.hkv + hk) * kD];
          for (int d = 0; d < kD; ++d)
            acc[d] += e * double(to_f(vr[d]));
        }
        const double ref_lse = total > 0.0 ? mx + std::log(total) : -INFINITY;
        const float got_lse = lse[(size_t(b) * c.hq + h) * c.q_len + i];
        const T* o = &out[((size_t(b) * c.q_len + i) * c.hq + h) * kD];
        if (std::isinf(ref_lse)) {
          if (!(std::isinf(got_lse) && got_lse < 0))
            ++bad;
        } else {
          const double e = std::fabs(double(got_lse) - ref_lse);
          worst_lse = std::max(worst_lse, e);
          if (!(e < 2e-3))
            ++bad;
        }
        for (int d = 0; d < kD; ++d) {
          const double want = total > 0.0 ? acc[d] / total : 0.0;
          const double e = std::fabs(double(to_f(o[d])) - want);
          worst_out = std::max(worst_out, e);
          if (!(e < 1.5e-2))
            ++bad;
        }
      }
    }
  }
  for (void* ptr : {(void*)d_q, (void*)d_k, (void*)d_v, (void*)d_seqlens, (void*)d_table, (void*)d_sinks, (void*)d_out,
                    (void*)d_lse, (void*)d_lse_lo}) {
    CHECK_CUDA(cudaFree(ptr));
  }
  printf("  %-28s D%-3d %s page %-3d B%d Hq%d Hkv%d Sq%d C%d%s%s%s%s splits %d: max |dout| %.2e |dlse| %.2e %s\n",
         shape, kD, kPaged ? "paged" : "contig", c.page, c.batch, c.hq, c.hkv, c.q_len, capacity,
         c.causal ? " causal" : "", c.left >= 0 ? " window" : "", c.softcap > 0 ? " softcap" : "",
         c.sinks ? " sinks" : "", c.splits, worst_out, worst_lse, bad ? "FAILED" : "ok");
  return bad ? 1 : 0;
}

template <typename T, int kD, class Tiles>
static int check_shape(const char* shape) {
  std::mt19937 rng(1234);
  int failures = 0;
  const CacheCase cases[] = {
      // batch, hq, hkv, q_len, capacity, page, causal, left, softcap, sinks, splits
      {3, 8, 8, 1, 300, 0, true, -1, 0.0, false, 0},  {3, 8, 2, 2, 300, 0, true, -1, 0.0, false, 1},
      {3, 16, 2, 2, 517, 0, true, 100, 0.0, true, 3}, {3, 8, 1, 1, 1000, 0, false, -1, 30.0, false, 0},
      {3, 4, 1, 4, 300, 0, true, -1, 0.0, true, 1},
  };
  for (const CacheCase& c : cases) {
    failures += check_case<T, kD, false, Tiles>(shape, c, rng);
  }
  const CacheCase paged[] = {
      {3, 8, 2, 1, 300, 16, true, -1, 0.0, false, 0},
      {3, 8, 2, 2, 700, 64, true, 50, 0.0, true, 3},
      {3, 8, 1, 1, 1000, 256, true, -1, 20.0, false, 1},
  };
  for (const CacheCase& c : paged) {
    failures += check_case<T, kD, true, Tiles>(shape, c, rng);
  }
  return failures;
}

// Median microseconds of one decode step over a full cache (every sequence `len` tokens).
// heads_outer: a contiguous cache laid out [B, Hkv, S, D] (each head's keys consecutive, as SDPA
// reads them) instead of [B, S, Hkv, D].
template <typename T, int kD, bool kPaged, class Tiles>
static void time_shape(const char* shape, int batch, int len, int page, void* flush, size_t flush_bytes,
                       bool heads_outer = false) {
  const int hq = 32, hkv = g_hkv;
  const int pages_per_seq = kPaged ? (len + page - 1) / page : 1;
  const int num_pages = kPaged ? batch * pages_per_seq : batch;
  const int page_rows = kPaged ? page : len;
  const size_t kv_elems = size_t(num_pages) * page_rows * hkv * kD;
  const size_t q_elems = size_t(batch) * hq * kD;
  T *d_q, *d_k, *d_v, *d_out;
  int *d_seqlens, *d_table;
  float* d_lse;
  CHECK_CUDA(cudaMalloc(&d_q, q_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&d_k, kv_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&d_v, kv_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&d_out, q_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&d_lse, size_t(batch) * hq * sizeof(float)));
  fill_uniform<<<1024, 256>>>(d_q, q_elems, 1, 1.0f);
  fill_uniform<<<1024, 256>>>(d_k, kv_elems, 2, 1.0f);
  fill_uniform<<<1024, 256>>>(d_v, kv_elems, 3, 1.0f);
  std::vector<int> seqlens(batch, len), table(size_t(batch) * pages_per_seq);
  std::mt19937 rng(7);
  std::vector<int> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  if (!g_ordered_pages) {
    std::shuffle(perm.begin(), perm.end(), rng);
  }
  for (size_t e = 0; e < table.size(); ++e)
    table[e] = perm[e];
  d_seqlens = upload(seqlens);
  d_table = upload(table);

  DecodeParams p{};
  p.q = d_q, p.k = d_k, p.v = d_v;
  p.q_sb = int64_t{hq} * kD, p.q_sh = kD, p.q_si = int64_t{hq} * kD;
  p.k_sb = p.v_sb = int64_t{page_rows} * hkv * kD;
  p.k_sh = p.v_sh = heads_outer ? int64_t{len} * kD : kD;
  p.k_si = p.v_si = heads_outer ? kD : int64_t{hkv} * kD;
  p.hq = hq, p.group = hq / hkv, p.q_len = 1, p.rows = hq / hkv;
  p.kv_end = kPaged ? pages_per_seq * page : len;
  p.score = attn::score_rule(1.0 / std::sqrt(double(kD)), 0.0, false, true);
  p.cache.seqlens = d_seqlens;
  p.cache.block_table = kPaged ? d_table : nullptr;
  p.cache.table_stride = pages_per_seq;
  p.cache.page_size = kPaged ? page : 1;
  p.cache.page_shift = kPaged ? __builtin_ctz(page) : -1;
  p.cache.num_pages = num_pages;
  p.cache.capacity = static_cast<int>(p.kv_end);
  p.cache.q_len = 1;
  p.cache.right = 0;
  p.out.out = d_out;
  p.out.o_sb = p.q_sb, p.out.o_sh = p.q_sh, p.out.o_si = p.q_si;
  p.out.lse = d_lse;

  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int rep = 0; rep < 23; ++rep) {
    CHECK_CUDA(cudaMemsetAsync(flush, rep, flush_bytes));
    CHECK_CUDA(cudaEventRecord(start));
    launch<T, kD, kPaged, Tiles>(p, batch, hkv, g_splits);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (rep >= 3)
      ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double us = ms[ms.size() / 2] * 1e3;
  const double bytes = 2.0 * batch * hkv * double(len) * kD * sizeof(T);
  char layout[16];
  snprintf(layout, sizeof(layout), kPaged ? "paged%d" : (heads_outer ? "bhsd" : "bshd"), page);
  printf("  %-28s D%-3d %-8s B%-3d KV%-6d %9.1f us  %6.2f TB/s\n", shape, kD, layout, batch, len, us,
         bytes / us * 1e-6);
  for (void* ptr : {(void*)d_q, (void*)d_k, (void*)d_v, (void*)d_out, (void*)d_lse, (void*)d_seqlens, (void*)d_table}) {
    CHECK_CUDA(cudaFree(ptr));
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
}

template <typename T, int kD, class Tiles>
static int run_shape(const char* shape, bool checks, bool timing, void* flush, size_t flush_bytes) {
  if (g_only != nullptr && !selected(shape, g_only)) {
    return 0;
  }
  constexpr size_t kSmem = Tiles::template smem_bytes<T, kD>();
  int resident = 0;
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &resident, split_kernel<T, kD, KvRows::kContiguous, false, Tiles>(), kThreads, kSmem));
  printf(
      "%s: D%d, %d stages, %zu bytes of shared memory, %d CTAs per SM, clusters %s (cap %d tiles), Hkv %d, "
      "splits of at least %d tiles, timed with %d splits (0: decode_launch's)\n",
      shape, kD, Tiles::kStages, kSmem, resident, g_clusters ? "on" : "off", g_cap_tiles, g_hkv, g_split_tiles,
      g_splits);
  int failures = checks ? check_shape<T, kD, Tiles>(shape) : 0;
  if (timing) {
    const int shapes[][2] = {{1, 512},    {1, 1024},  {1, 2048},   {1, 4096},   {1, 8192},   {1, 16384},  {1, 32768},
                             {1, 131072}, {4, 1024},  {8, 1024},   {8, 4096},   {8, 32768},  {8, 131072}, {32, 1024},
                             {32, 2048},  {32, 4096}, {32, 32768}, {128, 1024}, {128, 4096}, {128, 32768}};
    for (const auto& s : shapes) {
      if ((g_batch == 0 || s[0] == g_batch) && (g_kv == 0 || s[1] == g_kv)) {
        time_shape<T, kD, false, Tiles>(shape, s[0], s[1], 0, flush, flush_bytes);
        if (g_page != 0) {
          time_shape<T, kD, true, Tiles>(shape, s[0], s[1], g_page, flush, flush_bytes);
        }
      }
    }
    if (g_kv != 0) {  // one contiguous cache length: a shape ncu can pick by launch count
      return failures;
    }
    if (g_batch == 1) {
      time_shape<T, kD, true, Tiles>(shape, 1, 8192, 256, flush, flush_bytes);
      time_shape<T, kD, true, Tiles>(shape, 1, 32768, 256, flush, flush_bytes);
      return failures;
    }
    time_shape<T, kD, false, Tiles>(shape, 8, 32768, 0, flush, flush_bytes, true);
    time_shape<T, kD, false, Tiles>(shape, 1, 1024, 0, flush, flush_bytes, true);
    time_shape<T, kD, true, Tiles>(shape, 8, 32768, 16, flush, flush_bytes);
    time_shape<T, kD, true, Tiles>(shape, 8, 32768, 64, flush, flush_bytes);
    time_shape<T, kD, true, Tiles>(shape, 8, 32768, 256, flush, flush_bytes);
    time_shape<T, kD, true, Tiles>(shape, 32, 2048, 16, flush, flush_bytes);
  }
  return failures;
}

int main(int argc, char** argv) {
  bool checks = true, timing = true;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--no-timing")) {
      timing = false;
    } else if (!strcmp(argv[i], "--resident-splits")) {
      g_split_slots = 1;
    } else if (!strcmp(argv[i], "--sm-splits")) {
      g_split_slots = 2;
    } else if (!strcmp(argv[i], "--no-checks")) {
      checks = false;
    } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
      g_only = argv[++i];
    } else if (!strcmp(argv[i], "--split-tiles") && i + 1 < argc) {
      g_split_tiles = std::max(1, atoi(argv[++i]));
    } else if (!strcmp(argv[i], "--hkv") && i + 1 < argc) {
      g_hkv = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--batch") && i + 1 < argc) {
      g_batch = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--kv") && i + 1 < argc) {
      g_kv = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--paged") && i + 1 < argc) {
      g_page = atoi(argv[++i]);
      if (g_page < 1 || (g_page & (g_page - 1)) != 0) {
        fprintf(stderr, "decode_check: --paged takes a power of two\n");
        return 2;
      }
    } else if (!strcmp(argv[i], "--ordered-pages")) {
      g_ordered_pages = true;
    } else if (!strcmp(argv[i], "--splits") && i + 1 < argc) {
      g_splits = std::max(0, atoi(argv[++i]));
    }
  }
  CHECK_CUDA(cudaMalloc(&g_workspace, kWorkspaceFloats * sizeof(float)));
  {
    using Tiles = DecodeConfig<128>;
    g_default_cluster = g_max_cluster = max_cluster_splits(
        split_kernel<__nv_bfloat16, 128, KvRows::kContiguous, true, Tiles>(), Tiles::smem_bytes<__nv_bfloat16, 128>());
    printf("clusters of up to %d splits\n", g_default_cluster);
  }
  const size_t flush_bytes = size_t{256} << 20;
  void* flush;
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
  using bf16 = __nv_bfloat16;
  int failures = 0;
  // The shape each head dim runs.
  failures += run_shape<bf16, 128, DecodeConfig<128>>("DecodeConfig<128>", checks, timing, flush, flush_bytes);
  failures += run_shape<__half, 128, DecodeConfig<128>>("DecodeConfig<128> fp16", checks, false, flush, flush_bytes);
  failures += run_shape<bf16, 64, DecodeConfig<64>>("DecodeConfig<64>", checks, timing, flush, flush_bytes);
  // The same without clusters (the combine kernel: what GPUs before sm_90 run), and with clusters
  // up to longer caches.
  g_clusters = false;
  failures +=
      run_shape<bf16, 128, DecodeConfig<128>>("DecodeConfig<128> no cluster", checks, timing, flush, flush_bytes);
  failures += run_shape<bf16, 64, DecodeConfig<64>>("DecodeConfig<64> no cluster", checks, false, flush, flush_bytes);
  g_clusters = true;
  g_cap_tiles = 16;
  failures += run_shape<bf16, 128, DecodeConfig<128>>("DecodeConfig<128> cap 16", false, timing, flush, flush_bytes);
  g_cap_tiles = 8;
  // The combine kernel launched plainly (no programmatic dependency on the split kernel).
  g_pdl = false;
  failures += run_shape<bf16, 128, DecodeConfig<128>>("DecodeConfig<128> no pdl", false, timing, flush, flush_bytes);
  failures += run_shape<bf16, 64, DecodeConfig<64>>("DecodeConfig<64> no pdl", false, timing, flush, flush_bytes);
  g_pdl = true;
  // Clusters of at most the portable 8 splits (what a GPU that cannot place 16 takes), and of 16
  // wherever the cache is short enough (no step_max_cluster).
  g_max_cluster = kMaxClusterSplits;
  failures +=
      run_shape<bf16, 128, DecodeConfig<128>>("DecodeConfig<128> cluster 8", checks, timing, flush, flush_bytes);
  failures += run_shape<bf16, 64, DecodeConfig<64>>("DecodeConfig<64> cluster 8", checks, timing, flush, flush_bytes);
  g_max_cluster = g_default_cluster;
  g_step_rule = false;
  failures +=
      run_shape<bf16, 128, DecodeConfig<128>>("DecodeConfig<128> cluster 16", false, timing, flush, flush_bytes);
  failures += run_shape<bf16, 64, DecodeConfig<64>>("DecodeConfig<64> cluster 16", false, timing, flush, flush_bytes);
  g_step_rule = true;
  // Candidates: clusters of fewer than 8 splits where fewer fit in one wave (short caches, many
  // (batch, kv head) pairs: no combine kernel).
  g_small_clusters = true;
  failures +=
      run_shape<bf16, 128, DecodeConfig<128>>("DecodeConfig<128> small clusters", checks, timing, flush, flush_bytes);
  failures +=
      run_shape<bf16, 64, DecodeConfig<64>>("DecodeConfig<64> small clusters", checks, timing, flush, flush_bytes);
  g_small_clusters = false;
  // Candidates: two Q K^T accumulator chains.
  failures += run_shape<bf16, 128, DecodeTiles<2, 3, 128, 2>>("d128 2 chains", checks, timing, flush, flush_bytes);
  failures += run_shape<bf16, 64, DecodeTiles<2, 3, 128, 2>>("d64 2 chains", checks, timing, flush, flush_bytes);
  // Candidates: L2 prefetch of whole rows with each load.
  failures += run_shape<bf16, 128, DecodeTiles<2, 3, 256>>("d128 prefetch 256", checks, timing, flush, flush_bytes);
  failures += run_shape<bf16, 128, DecodeTiles<2, 3, 128>>("d128 prefetch 128", checks, timing, flush, flush_bytes);
  failures += run_shape<bf16, 64, DecodeTiles<2, 3, 128>>("d64 prefetch 128", checks, timing, flush, flush_bytes);
  // More tiles in flight per CTA, one or two CTAs an SM (for grids of one wave or less):
  // DecodeWaveConfig<D, CTAs> is what the extension runs where wave_config_ctas says; the others
  // are candidates.
  failures +=
      run_shape<bf16, 128, DecodeWaveConfig<128, 1>>("DecodeWaveConfig<128, 1>", checks, timing, flush, flush_bytes);
  failures += run_shape<__half, 128, DecodeWaveConfig<128, 1>>("DecodeWaveConfig<128, 1> fp16", checks, false, flush,
                                                               flush_bytes);
  failures +=
      run_shape<bf16, 64, DecodeWaveConfig<64, 1>>("DecodeWaveConfig<64, 1>", checks, timing, flush, flush_bytes);
  failures +=
      run_shape<__half, 64, DecodeWaveConfig<64, 1>>("DecodeWaveConfig<64, 1> fp16", checks, false, flush, flush_bytes);
  failures +=
      run_shape<bf16, 64, DecodeWaveConfig<64, 2>>("DecodeWaveConfig<64, 2>", checks, timing, flush, flush_bytes);
  failures +=
      run_shape<__half, 64, DecodeWaveConfig<64, 2>>("DecodeWaveConfig<64, 2> fp16", checks, false, flush, flush_bytes);
  failures += run_shape<bf16, 128, DecodeTiles<6, 1, 128>>("d128 6stage 1cta", checks, timing, flush, flush_bytes);
  CHECK_CUDA(cudaFree(g_workspace));
  CHECK_CUDA(cudaFree(flush));
  printf(failures ? "%d CHECKS FAILED\n" : "ALL CHECKS PASSED\n", failures);
  return failures ? 1 : 0;
}
