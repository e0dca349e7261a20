// Standalone check and timing of the generic (mma.sync) backward attention kernels
// (csrc/ops/cuda/generic/attention_bwd.cuh), without torch, for dK/dV tile shapes side by side:
// the shape each head dim runs (DkvConfig) and candidates (BwdTiles). Build (from the repository
// root):
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
//        --expt-relaxed-constexpr -Icsrc -Xcompiler -fopenmp -lgomp \
//        benchmarks/mma_sync_bwd_check.cu -o mma_sync_bwd_check
//
// (add -Xptxas -v for each kernel's registers, spills and static shared memory.)
// Run: ./mma_sync_bwd_check [--no-timing] [--no-checks] [--only TEXT[,TEXT...] (shapes whose name contains one of
// them)] [--deterministic (also time the deterministic mode: dK/dV kernel + dQ kernel)] [--profile (one launch of
// each shape at the timing sizes, no checks: for ncu)].
// For each shape: random Q, K, V, dO and grad_lse (never zeros), gradients poisoned with NaN, the kernels given row
// shift, row lo and Delta as the rows pre-pass makes them (from a float64 forward), then a float64 CPU reference of
// dQ, dK, dV over odd shapes (Q in 1, 97, 300, KV in 17, 300; GQA 2:1; causal shifts 0, -5, +7 and one that empties
// every row; log2 units, natural units, a softcap, a bool mask of one diagonal a head whose tiles the summaries call
// masked, visible, diagonal (a compare, dK/dV kernel) or mixed (read); contiguous, transposed-view and padded input
// strides), in both dQ modes (atomics from the dK/dV kernel into a float32 buffer, and the deterministic dQ kernel):
// relative L2 error and max error against the largest reference value, no NaN, and exact zeros where the contract says
// 0 (dQ of rows with no visible key, dK and dV of keys no row sees); the grids in the launchers' order (groups of
// heads, tile_order.h). Then B=4 H=16 S=4096 at the shape's head dim, causal (in that order, then in the grids' own:
// "causal-hah") and not, timed with CUDA events (3 warm-ups, median of 20; the atomic mode: dq_accum's zeroing, the
// dK/dV kernel and dQ's conversion to the input dtype, not the rows pre-pass), TFLOP/s with the backward counted as 2.5
// forwards and causal as half. Exit status 1 when any check fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#define SAFEATTN_STANDALONE
#define SAFEATTN_ATTN_BWD_DEFINE_KERNELS
#include "check_common.h"
#include "ops/cuda/generic/attention_bwd.cuh"

using safeattn::cuda::attn::BwdParams;
using safeattn::cuda::attn::BwdTiles;
using safeattn::cuda::attn::DkvConfig;
using safeattn::cuda::attn::DqAccumLayout;
using safeattn::cuda::attn::DqConfig;
using safeattn::cuda::attn::kBwdSmemSm86;
using safeattn::cuda::attn::launch_dq_accum_to_grad;
using safeattn::cuda::attn::ScoreRule;
using safeattn::cuda::attn::WithRanges;
using safeattn::cuda::attn::bwd_detail::attention_bwd_dkdv_kernel;
using safeattn::cuda::attn::bwd_detail::attention_bwd_dq_kernel;

static bool g_profile = false;
static bool g_checks = true;          // --no-checks: timings only
static bool g_deterministic = false;  // --deterministic: also time the dK/dV kernel + dQ kernel
static const char* g_only = nullptr;  // --only TEXT[,TEXT...]: the shapes whose name contains one of them
static bool g_grid_order = true;      // the grids in the launchers' order (tile_order.h); false: their own

using safeattn::cuda::resident_ctas;
using safeattn::cuda::attn::bwd_detail::grid_head_group;

// The dK/dV kernel of shape Cfg over `batch` batches; atomic: dQ added into p.dq_accum.
template <typename T, class Cfg>
static void launch_dkdv(const BwdParams& p, int batch, bool atomic) {
  auto kernel = atomic ? &attention_bwd_dkdv_kernel<T, Cfg, true> : &attention_bwd_dkdv_kernel<T, Cfg, false>;
  const size_t smem = Cfg::smem_bytes(atomic);
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((p.kv_len + Cfg::kKeys - 1) / Cfg::kKeys), static_cast<unsigned>(p.hkv),
                  static_cast<unsigned>(batch));
  BwdParams grid_p = p;
  grid_p.head_group_dkdv =
      grid_head_group(g_grid_order && (p.causal.enabled || p.tiles_dkdv.ptr != nullptr), grid,
                      atomic ? resident_ctas<&attention_bwd_dkdv_kernel<T, Cfg, true>>(Cfg::kThreads, smem)
                             : resident_ctas<&attention_bwd_dkdv_kernel<T, Cfg, false>>(Cfg::kThreads, smem));
  kernel<<<grid, Cfg::kThreads, smem>>>(grid_p);
  CHECK_CUDA(cudaGetLastError());
}

// The deterministic dQ kernel of head dim D over `batch` batches (kRanges: its key ranges' test).
template <typename T, int D, bool kRanges = false>
static void launch_dq(const BwdParams& p, int batch) {
  using Tr = DqConfig<D>;
  auto kernel = &attention_bwd_dq_kernel<T, D, kRanges>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Tr::kDqSmem)));
  const dim3 grid(static_cast<unsigned>((p.q_len + Tr::kDqQueries - 1) / Tr::kDqQueries), static_cast<unsigned>(p.hq),
                  static_cast<unsigned>(batch));
  kernel<<<grid, Tr::kThreads, Tr::kDqSmem>>>(p);
  CHECK_CUDA(cudaGetLastError());
}

struct SmallCase {
  int q_len, kv_len;
  bool causal;
  int64_t shift;
  // 0: log2 units, 1: natural units, 2: softcap 5 (log2 units), 3: a bool mask [H, Q, KV] of one diagonal a head
  // (log2 units), its dK/dV tiles summarised as masked, visible, or alternately diagonal (a compare) and mixed (read),
  // the dQ kernel's as masked, visible or mixed; 4: key ranges (WithRanges shapes only, log2 units), both kernels'
  // tiles summarised as masked, visible or mixed
  int mode;
  int layout;  // of Q, K, V, dO: check_common.h's make_strides
};

// One case, both dQ modes against one float64 reference; false when either fails.
template <typename T, class Cfg>
static bool run_case(const SmallCase& cs, std::mt19937& rng) {
  constexpr int D = Cfg::kHeadDim;
  const int B = 2, H = 2, Hkv = 1, group = H / Hkv;
  const double scale = 1.0 / std::sqrt(double(D)), softcap = cs.mode == 2 ? 5.0 : 0.0;
  const bool natural = cs.mode == 1;
  // Mode 3: head h sees keys j <= i + kDiagonalShift[h].
  const bool diagonals = cs.mode == 3;
  constexpr int64_t kDiagonalShift[H] = {-37, 75};
  // Mode 4: key ranges (check_common.h's make_key_ranges).
  const bool ranged = cs.mode == 4;
  const std::vector<int> hranges = ranged ? make_key_ranges(cs.q_len, cs.kv_len, rng) : std::vector<int>();
  auto in_range = [&](int b, int i, int j) {
    const size_t at = 2 * (size_t(b) * cs.q_len + i);
    return !ranged || (j >= hranges[at] && j < hranges[at + 1]);
  };
  int64_t qs[3], ks[3], vs[3], dos[3];
  const size_t qn = make_strides(cs.layout, B, H, cs.q_len, D, qs);
  const size_t kn = make_strides(cs.layout, B, Hkv, cs.kv_len, D, ks);
  const size_t vn = make_strides(cs.layout, B, Hkv, cs.kv_len, D, vs);
  const size_t don = make_strides(cs.layout, B, H, cs.q_len, D, dos);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<T> hq(qn), hk(kn), hv(vn), hdo(don);
  for (auto* vec : {&hq, &hk, &hv, &hdo}) {
    for (auto& x : *vec) {
      x = from_f<T>(uni(rng));
    }
  }
  const int64_t rows = int64_t{B} * H * cs.q_len;
  std::vector<float> glse(rows);
  for (auto& x : glse) {
    x = 0.5f * uni(rng);
  }
  auto q_at = [&](int b, int h, int i, int d) { return double(to_f(hq[b * qs[0] + h * qs[1] + i * qs[2] + d])); };
  auto k_at = [&](int b, int h, int j, int d) { return double(to_f(hk[b * ks[0] + h * ks[1] + j * ks[2] + d])); };
  auto v_at = [&](int b, int h, int j, int d) { return double(to_f(hv[b * vs[0] + h * vs[1] + j * vs[2] + d])); };
  auto do_at = [&](int b, int h, int i, int d) { return double(to_f(hdo[b * dos[0] + h * dos[1] + i * dos[2] + d])); };

  // Per query row in float64: the forward (P), what the rows pre-pass gives the kernels (row shift
  // and lo in their units, Delta from O as the forward rounds it), and dS' = P (dP - Delta) d score
  // / d dot.
  std::vector<double> P(size_t(rows) * cs.kv_len), dsp(size_t(rows) * cs.kv_len);
  std::vector<float> row_shift(rows), row_lo(rows), delta(rows);
  std::vector<char> row_seen(rows, 0);
#pragma omp parallel for schedule(dynamic)
  for (int64_t r = 0; r < rows; ++r) {
    const int b = static_cast<int>(r / (int64_t{H} * cs.q_len)), h = static_cast<int>(r / cs.q_len % H);
    const int i = static_cast<int>(r % cs.q_len), hk = h / group;
    double* prow = P.data() + size_t(r) * cs.kv_len;
    double* drow = dsp.data() + size_t(r) * cs.kv_len;  // d score / d dot, then dS'
    double m = -INFINITY;
    for (int j = 0; j < cs.kv_len; ++j) {
      double dot = 0;
      for (int d = 0; d < D; ++d) {
        dot += q_at(b, h, i, d) * k_at(b, hk, j, d);
      }
      double s = dot * scale;
      drow[j] = scale;
      if (softcap > 0.0) {
        const double t = std::tanh(s / softcap);
        s = softcap * t;
        drow[j] = scale * (1.0 - t * t);
      }
      prow[j] = (cs.causal && j > i + cs.shift) || (diagonals && j > i + kDiagonalShift[h]) || !in_range(b, i, j)
                    ? -INFINITY
                    : s;
      m = std::max(m, prow[j]);
    }
    double l = 0;
    for (int j = 0; j < cs.kv_len; ++j) {
      prow[j] = prow[j] == -INFINITY ? 0.0 : std::exp(prow[j] - m);
      l += prow[j];
    }
    double dsum = 0, dsum_rounded = 0;
    for (int d = 0; d < D && l > 0; ++d) {
      double o = 0;
      for (int j = 0; j < cs.kv_len; ++j) {
        o += prow[j] * v_at(b, hk, j, d);
      }
      o /= l;
      dsum += do_at(b, h, i, d) * o;
      dsum_rounded += do_at(b, h, i, d) * double(to_f(from_f<T>(float(o))));  // O as the forward wrote it
    }
    const double lse = m + std::log(l), delta_ref = l > 0 ? dsum - glse[r] : 0.0;
    row_seen[r] = l > 0;
    for (int j = 0; j < cs.kv_len; ++j) {
      prow[j] = l > 0 ? prow[j] / l : 0.0;
      double dp = 0;
      for (int d = 0; d < D && prow[j] != 0.0; ++d) {
        dp += do_at(b, h, i, d) * v_at(b, hk, j, d);
      }
      drow[j] = prow[j] == 0.0 ? 0.0 : prow[j] * (dp - delta_ref) * drow[j];
    }
    delta[r] = l > 0 ? float(dsum_rounded) - glse[r] : 0.0f;
    if (l == 0) {
      row_shift[r] = INFINITY, row_lo[r] = 0.0f;
    } else if (natural) {
      row_shift[r] = float(lse);
      row_lo[r] = float((lse - double(float(lse))) * 1.4426950408889634);
    } else {
      row_shift[r] = float(lse * 1.4426950408889634), row_lo[r] = 0.0f;
    }
  }

  // Reference gradients: dQ = dS' K per row; dK = dS'^T Q and dV = P^T dO per key, summed over the
  // query heads of its group (GQA).
  const int64_t keys = int64_t{B} * Hkv * cs.kv_len;
  std::vector<double> ref_dq(size_t(rows) * D, 0.0), ref_dk(size_t(keys) * D, 0.0), ref_dv(size_t(keys) * D, 0.0);
  std::vector<char> key_seen(keys, 0);
#pragma omp parallel for schedule(dynamic)
  for (int64_t r = 0; r < rows; ++r) {
    const int b = static_cast<int>(r / (int64_t{H} * cs.q_len)), hk = static_cast<int>(r / cs.q_len % H) / group;
    for (int j = 0; j < cs.kv_len; ++j) {
      const double ds = dsp[size_t(r) * cs.kv_len + j];
      for (int d = 0; d < D && ds != 0.0; ++d) {
        ref_dq[size_t(r) * D + d] += ds * k_at(b, hk, j, d);
      }
    }
  }
#pragma omp parallel for schedule(dynamic)
  for (int64_t key = 0; key < keys; ++key) {
    const int b = static_cast<int>(key / (int64_t{Hkv} * cs.kv_len));
    const int hk = static_cast<int>(key / cs.kv_len % Hkv), j = static_cast<int>(key % cs.kv_len);
    for (int h = hk * group; h < (hk + 1) * group; ++h) {
      for (int i = 0; i < cs.q_len; ++i) {
        const size_t r = (size_t(b) * H + h) * cs.q_len + i;
        const double pij = P[r * cs.kv_len + j], ds = dsp[r * cs.kv_len + j];
        if (pij == 0.0) {
          continue;
        }
        key_seen[key] = 1;
        for (int d = 0; d < D; ++d) {
          ref_dk[size_t(key) * D + d] += ds * q_at(b, h, i, d);
          ref_dv[size_t(key) * D + d] += pij * do_at(b, h, i, d);
        }
      }
    }
  }

  T *dq_in = upload(hq), *dk_in = upload(hk), *dv_in = upload(hv), *ddo = upload(hdo);
  float *dshift = upload(row_shift), *dlo = upload(row_lo), *ddelta = upload(delta), *dq_accum;
  const size_t dq_n = size_t(rows) * D, dkv_n = size_t(B) * Hkv * cs.kv_len * D;
  const size_t accum_n = DqAccumLayout::floats(int64_t{B} * H, cs.q_len, D);
  T *gq, *gk, *gv;
  CHECK_CUDA(cudaMalloc(&dq_accum, accum_n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&gq, dq_n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&gk, dkv_n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&gv, dkv_n * sizeof(T)));

  BwdParams p{};
  p.query = dq_in, p.key = dk_in, p.value = dv_in, p.grad_out = ddo;
  p.q_stride_b = qs[0], p.q_stride_h = qs[1], p.q_stride_s = qs[2];
  p.k_stride_b = ks[0], p.k_stride_h = ks[1], p.k_stride_s = ks[2];
  p.v_stride_b = vs[0], p.v_stride_h = vs[1], p.v_stride_s = vs[2];
  p.do_stride_b = dos[0], p.do_stride_h = dos[1], p.do_stride_s = dos[2];
  p.row_shift = dshift, p.row_lo = natural ? dlo : nullptr, p.delta = ddelta;
  p.grad_query = gq, p.grad_key = gk, p.grad_value = gv;
  p.causal.enabled = cs.causal, p.causal.shift = cs.shift;
  p.score = safeattn::cuda::attn::score_rule(scale, softcap, natural);
  p.hq = H, p.hkv = Hkv, p.q_len = cs.q_len, p.kv_len = cs.kv_len;

  // Mode 3's mask and the two kernels' summaries of it, built on the host as the kernels meet them.
  std::vector<uint8_t> hbool(diagonals ? size_t(H) * cs.q_len * cs.kv_len : 0);
  for (size_t e = 0; e < hbool.size(); ++e) {
    const int64_t h = e / (size_t(cs.q_len) * cs.kv_len), i = e / cs.kv_len % cs.q_len, j = e % cs.kv_len;
    hbool[e] = j <= i + kDiagonalShift[h];
  }
  // The classes of [Hs, q_tiles, kv_tiles] tiles of tq x tk, Hs = H (mode 3, by head: the non-trivial ones alternately
  // kTileDiagonal, their diagonals in *diag, and kTileMixed when with_diagonal, else kTileMixed) or B (mode 4, by
  // batch: kTileMixed), uploaded as a summary view.
  auto summarize = [&](int tq, int tk, bool with_diagonal, std::vector<int16_t>* diag) {
    using safeattn::cuda::attn::kTileDiagonal, safeattn::cuda::attn::kTileMixed;
    const int q_tiles = (cs.q_len + tq - 1) / tq, kv_tiles = (cs.kv_len + tk - 1) / tk, slices = ranged ? B : H;
    std::vector<uint8_t> cls(size_t(slices) * q_tiles * kv_tiles);
    diag->assign(cls.size(), 0);
    for (int x = 0; x < slices; ++x) {
      for (int qt = 0; qt < q_tiles; ++qt) {
        for (int kt = 0; kt < kv_tiles; ++kt) {
          const size_t t = (size_t(x) * q_tiles + qt) * kv_tiles + kt;
          const bool diagonal = with_diagonal && (qt + kt) % 2 == 0;
          cls[t] = tile_class(
              qt * tq, tq, kt * tk, tk, cs.q_len, cs.kv_len, diagonal ? kTileDiagonal : kTileMixed, [&](int i, int j) {
                return ranged ? in_range(x, i, j) : hbool[(size_t(x) * cs.q_len + i) * cs.kv_len + j] != 0;
              });
          (*diag)[t] = static_cast<int16_t>(qt * tq + (ranged ? 0 : kDiagonalShift[x]) - kt * tk);
        }
      }
    }
    safeattn::cuda::attn::TileSummaryView view;
    view.ptr = upload(cls);
    view.diagonal = with_diagonal ? upload(*diag) : nullptr;
    view.kv_tiles = kv_tiles, view.slice_tiles = int64_t{q_tiles} * kv_tiles;
    (ranged ? view.stride_b : view.stride_h) = int64_t{q_tiles} * kv_tiles;
    view.stride_q = kv_tiles;
    view.block_q = tq, view.block_kv = tk;
    return view;
  };
  int* ranges = nullptr;
  std::vector<int16_t> diag_dkdv, diag_dq;
  if (ranged) {
    ranges = upload(hranges);
    p.ranges.ptr = ranges, p.ranges.stride_b = 2 * int64_t{cs.q_len};
    p.tiles_dkdv = summarize(Cfg::kQueries, Cfg::kKeys, false, &diag_dkdv);
    p.tiles_dq = summarize(DqConfig<D>::kDqQueries, DqConfig<D>::kDqKeys, false, &diag_dq);
  }
  uint8_t* bool_mask = nullptr;
  if (diagonals) {
    bool_mask = upload(hbool);
    p.mask.ptr = bool_mask, p.mask.kind = safeattn::cuda::attn::MaskKind::kBool;
    p.mask.stride_h = int64_t{cs.q_len} * cs.kv_len, p.mask.stride_q = cs.kv_len, p.mask.stride_kv = 1;
    p.tiles_dkdv = summarize(Cfg::kQueries, Cfg::kKeys, true, &diag_dkdv);
    p.tiles_dq = summarize(DqConfig<D>::kDqQueries, DqConfig<D>::kDqKeys, false, &diag_dq);
  }

  bool ok = true;
  for (bool atomic : {true, false}) {
    CHECK_CUDA(cudaMemset(gq, 0xff, dq_n * sizeof(T)));  // NaN in both 16-bit formats
    CHECK_CUDA(cudaMemset(gk, 0xff, dkv_n * sizeof(T)));
    CHECK_CUDA(cudaMemset(gv, 0xff, dkv_n * sizeof(T)));
    if (atomic) {
      CHECK_CUDA(cudaMemset(dq_accum, 0, accum_n * sizeof(float)));
      p.dq_accum = dq_accum;
      launch_dkdv<T, Cfg>(p, B, true);
      CHECK_CUDA(launch_dq_accum_to_grad(dq_accum, gq, int64_t{B} * H, cs.q_len, D, nullptr));
    } else {
      p.dq_accum = nullptr;
      launch_dkdv<T, Cfg>(p, B, false);
      launch_dq<T, D, Cfg::kReadsRanges>(p, B);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> hgq(dq_n), hgk(dkv_n), hgv(dkv_n);
    CHECK_CUDA(cudaMemcpy(hgq.data(), gq, dq_n * sizeof(T), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hgk.data(), gk, dkv_n * sizeof(T), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hgv.data(), gv, dkv_n * sizeof(T), cudaMemcpyDeviceToHost));
    GradError eq, ek, ev;
    long empty_rows = 0, unseen_keys = 0;
    for (int64_t r = 0; r < rows; ++r) {
      empty_rows += !row_seen[r];
      for (int d = 0; d < D; ++d) {
        const float got = to_f(hgq[size_t(r) * D + d]);
        if (!row_seen[r]) {
          eq.bad_zero += !(got == 0.0f);
        } else {
          eq.add(got, ref_dq[size_t(r) * D + d]);
        }
      }
    }
    for (size_t kj = 0; kj < key_seen.size(); ++kj) {
      unseen_keys += !key_seen[kj];
      for (int d = 0; d < D; ++d) {
        const float got_k = to_f(hgk[kj * D + d]), got_v = to_f(hgv[kj * D + d]);
        if (!key_seen[kj]) {
          ek.bad_zero += !(got_k == 0.0f);
          ev.bad_zero += !(got_v == 0.0f);
        } else {
          ek.add(got_k, ref_dk[kj * D + d]);
          ev.add(got_v, ref_dv[kj * D + d]);
        }
      }
    }
    // P and dS' are rounded to 16 bits before their products, as in every flash backward.
    const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
    const double tol_rel = bf16 ? 2e-2 : 4e-3, tol_max = bf16 ? 6e-2 : 1.5e-2;
    bool case_ok = true;
    for (const GradError* e : {&eq, &ek, &ev}) {
      case_ok = case_ok && e->rel() <= tol_rel && e->max_rel() <= tol_max && e->nan == 0 && e->bad_zero == 0;
    }
    if (!case_ok) {
      printf(
          "  FAIL %s dQ, q %d kv %d causal %d shift %lld mode %d layout %d: dq %.2e/%.2e dk %.2e/%.2e dv %.2e/%.2e "
          "nan %ld/%ld/%ld zero-bad %ld/%ld/%ld (empty rows %ld, unseen keys %ld)\n",
          atomic ? "atomic" : "deterministic", cs.q_len, cs.kv_len, cs.causal, static_cast<long long>(cs.shift),
          cs.mode, cs.layout, eq.rel(), eq.max_rel(), ek.rel(), ek.max_rel(), ev.rel(), ev.max_rel(), eq.nan, ek.nan,
          ev.nan, eq.bad_zero, ek.bad_zero, ev.bad_zero, empty_rows, unseen_keys);
    }
    ok = ok && case_ok;
  }
  for (void* ptr :
       {static_cast<void*>(dq_in), static_cast<void*>(dk_in), static_cast<void*>(dv_in), static_cast<void*>(ddo),
        static_cast<void*>(dshift), static_cast<void*>(dlo), static_cast<void*>(ddelta), static_cast<void*>(dq_accum),
        static_cast<void*>(gq), static_cast<void*>(gk), static_cast<void*>(gv), static_cast<void*>(bool_mask),
        static_cast<void*>(const_cast<uint8_t*>(p.tiles_dkdv.ptr)),
        static_cast<void*>(const_cast<int16_t*>(p.tiles_dkdv.diagonal)),
        static_cast<void*>(const_cast<uint8_t*>(p.tiles_dq.ptr)), static_cast<void*>(ranges)}) {
    CHECK_CUDA(cudaFree(ptr));
  }
  return ok;
}

// The backward of B x H x S x S at head dim Cfg::kHeadDim: median ms of 20 (after 3 warm-ups).
template <typename T, class Cfg>
static float time_shape(bool causal, bool deterministic, int B, int H, int S) {
  constexpr int D = Cfg::kHeadDim;
  const size_t n = size_t(B) * H * S * D, rows = size_t(B) * H * S;
  T* buf[4];  // q, k, v, dO
  for (int t = 0; t < 4; ++t) {
    CHECK_CUDA(cudaMalloc(&buf[t], n * sizeof(T)));
    fill_uniform<T><<<1024, 256>>>(buf[t], n, 1234 + t, 1.0f);
    CHECK_CUDA(cudaGetLastError());
  }
  float *shift, *delta, *dq_accum;
  CHECK_CUDA(cudaMalloc(&shift, rows * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&delta, rows * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dq_accum, n * sizeof(float)));
  fill_uniform<float><<<1024, 256>>>(delta, rows, 99, 0.1f);
  // Scores of unit-uniform inputs are O(1): a row shift near log2(S) keeps p in range.
  fill_uniform<float><<<1024, 256>>>(shift, rows, 98, 0.5f);
  CHECK_CUDA(cudaGetLastError());
  {
    std::vector<float> h(rows);
    CHECK_CUDA(cudaMemcpy(h.data(), shift, rows * sizeof(float), cudaMemcpyDeviceToHost));
    for (auto& x : h) {
      x += float(std::log2(double(S)));
    }
    CHECK_CUDA(cudaMemcpy(shift, h.data(), rows * sizeof(float), cudaMemcpyHostToDevice));
  }
  T *gq, *gk, *gv;
  CHECK_CUDA(cudaMalloc(&gq, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&gk, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&gv, n * sizeof(T)));
  BwdParams p{};
  p.query = buf[0], p.key = buf[1], p.value = buf[2], p.grad_out = buf[3];
  p.q_stride_b = p.k_stride_b = p.v_stride_b = p.do_stride_b = int64_t{H} * S * D;
  p.q_stride_h = p.k_stride_h = p.v_stride_h = p.do_stride_h = int64_t{S} * D;
  p.q_stride_s = p.k_stride_s = p.v_stride_s = p.do_stride_s = D;
  p.row_shift = shift, p.delta = delta;
  p.grad_query = gq, p.grad_key = gk, p.grad_value = gv;
  p.causal.enabled = causal;
  p.score = safeattn::cuda::attn::score_rule(1.0 / std::sqrt(double(D)), 0.0, false);
  p.hq = H, p.hkv = H, p.q_len = S, p.kv_len = S;
  p.dq_accum = deterministic ? nullptr : dq_accum;
  auto run = [&]() {
    if (deterministic) {
      launch_dkdv<T, Cfg>(p, B, false);
      launch_dq<T, D>(p, B);
    } else {
      CHECK_CUDA(cudaMemsetAsync(dq_accum, 0, n * sizeof(float)));  // the rows pre-pass's share
      launch_dkdv<T, Cfg>(p, B, true);
      CHECK_CUDA(launch_dq_accum_to_grad(dq_accum, gq, int64_t{B} * H, S, D, nullptr));
    }
  };
  float median = 0.0f;
  if (g_profile) {
    run();
  } else {
    std::vector<float> ms;
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    for (int it = 0; it < 23; ++it) {
      CHECK_CUDA(cudaEventRecord(e0));
      run();
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float t = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
      if (it >= 3) {
        ms.push_back(t);
      }
    }
    std::sort(ms.begin(), ms.end());
    median = ms[ms.size() / 2];
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  for (int t = 0; t < 4; ++t) {
    CHECK_CUDA(cudaFree(buf[t]));
  }
  for (void* ptr : {static_cast<void*>(shift), static_cast<void*>(delta), static_cast<void*>(dq_accum),
                    static_cast<void*>(gq), static_cast<void*>(gk), static_cast<void*>(gv)}) {
    CHECK_CUDA(cudaFree(ptr));
  }
  return median;
}

template <typename T, class Cfg>
static int check_shape(const char* name, bool timing) {
  if (g_only != nullptr && !selected(name, g_only)) {
    return 0;
  }
  const size_t smem = Cfg::smem_bytes(true);
  int opt_in = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&opt_in, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  if (smem > static_cast<size_t>(opt_in)) {
    printf("%-30s skipped: %zu B of shared memory, the device allows %d\n", name, smem, opt_in);
    return 0;
  }
  cudaFuncAttributes attr{};
  CHECK_CUDA(cudaFuncGetAttributes(&attr, attention_bwd_dkdv_kernel<T, Cfg, true>));
  int per_sm = 0;
  CHECK_CUDA(cudaFuncSetAttribute(attention_bwd_dkdv_kernel<T, Cfg, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attention_bwd_dkdv_kernel<T, Cfg, true>,
                                                           Cfg::kThreads, smem));
  printf(
      "%-30s D %3d  %3d keys x %2d queries, %d warps (S^T %dx%d, sub %d; dK/dV %dx%d), P^T %s, Q/dO stages %d, %s "
      "rows: "
      "%3d regs, %3zu B spill (local), %6zu B (%5.1f KB) smem%s, %d CTA/SM\n",
      name, Cfg::kHeadDim, Cfg::kKeys, Cfg::kQueries, Cfg::kWarps, Cfg::kWarpKeys, Cfg::kWarpQueries, Cfg::kSubQueries,
      Cfg::kDkvWarpKeys, Cfg::kDkvWarpCols, Cfg::kPInRegs ? "regs" : "smem", Cfg::kStages,
      Cfg::kSwizzle ? "swizzled" : "padded", attr.numRegs, attr.localSizeBytes, smem, smem / 1024.0,
      smem <= kBwdSmemSm86 ? "" : " (over sm_86's 99 KB)", per_sm);
  int failures = 0;
  if (!g_profile && g_checks) {
    std::mt19937 rng(1234);
    int layout = 0;
    for (int ql : {1, 97, 300}) {
      for (int kl : {17, 300}) {
        // Mode 4, key ranges, alone for the WithRanges shapes (the others would not run them).
        for (int mode = Cfg::kReadsRanges ? 4 : 0; mode < (Cfg::kReadsRanges ? 5 : 4); ++mode) {
          failures += !run_case<T, Cfg>({ql, kl, false, 0, mode, layout++ % 3}, rng);
          for (int64_t shift : {int64_t{0}, int64_t{-5}, int64_t{7}, int64_t{-400}}) {
            failures += !run_case<T, Cfg>({ql, kl, true, shift, mode, layout++ % 3}, rng);
          }
        }
      }
    }
    printf("  checks: %s\n", failures == 0 ? "ok" : "FAILED");
  }
  if (timing || g_profile) {
    for (bool deterministic : {false, true}) {
      if (deterministic && !g_deterministic) {
        continue;
      }
      // Causal twice: in the launchers' order (groups of heads, tile_order.h) and in the grids' own.
      for (int order = 0; order < 3; ++order) {
        const bool causal = order < 2;
        const int B = 4, H = 16, S = 4096;
        g_grid_order = order != 1;
        const float ms = time_shape<T, Cfg>(causal, deterministic, B, H, S);
        g_grid_order = true;
        if (!g_profile) {
          const double flops = 2.5 * 4.0 * B * H * double(S) * S * Cfg::kHeadDim * (causal ? 0.5 : 1.0);
          printf("  TIME %-30s D %3d %-10s %s B4 H16 S4096 bwd: %.3f ms  %.0f TFLOP/s\n", name, Cfg::kHeadDim,
                 order == 0   ? "causal"
                 : order == 1 ? "causal-hah"
                              : "noncausal",
                 deterministic ? "determ." : "atomic ", ms, flops / ms / 1e9);
        } else if (order == 0) {
          break;
        }
      }
    }
  }
  return failures;
}

// Candidate shapes: <D, keys, queries, warps, warps across queries, sub-queries, Q/dO stages,
// swizzled rows, warps across the head dim for dK/dV, CTAs per SM, scale folded, queries of a dQ
// job> (BwdTiles).
template <int D, int K, int Q, int W, int WQ, int SQ, int ST, bool SW = false, int DC = 1, int MB = 1, bool FS = false,
          int DQ = 16, bool PS = true>
using Tiles = BwdTiles<D, K, Q, W, WQ, SQ, ST, SW, DC, MB, FS, DQ, PS>;

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it comes, also into a pipe or a file
  bool timing = true;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--no-timing")) {
      timing = false;
    } else if (!strcmp(argv[i], "--no-checks")) {
      g_checks = false;
    } else if (!strcmp(argv[i], "--deterministic")) {
      g_deterministic = true;
    } else if (!strcmp(argv[i], "--profile")) {
      g_profile = true;
    } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
      g_only = argv[++i];
    }
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  printf("%s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  using bf16 = __nv_bfloat16;
  int failures = 0;
  // The shape each head dim runs.
  failures += check_shape<bf16, DkvConfig<32>>("DkvConfig<32>", false);
  failures += check_shape<bf16, DkvConfig<64>>("DkvConfig<64>", timing);
  failures += check_shape<__half, DkvConfig<64>>("DkvConfig<64> fp16", false);
  failures += check_shape<bf16, DkvConfig<96>>("DkvConfig<96>", false);
  failures += check_shape<bf16, DkvConfig<128>>("DkvConfig<128>", timing);
  failures += check_shape<__half, DkvConfig<128>>("DkvConfig<128> fp16", false);
  // The large shapes (GPUs whose blocks may take more than 99 KB of shared memory).
  failures += check_shape<bf16, DkvConfig<64, true>>("DkvConfig<64> large", timing);
  failures += check_shape<__half, DkvConfig<64, true>>("DkvConfig<64> large fp16", false);
  failures += check_shape<bf16, DkvConfig<128, true>>("DkvConfig<128> large", timing);
  failures += check_shape<__half, DkvConfig<128, true>>("DkvConfig<128> large fp16", false);
  // The shipped shapes with the key ranges' test (WithRanges: what calls with key ranges run once
  // kMmaSyncReadsKeyRanges is on), checked, not timed.
  failures += check_shape<bf16, WithRanges<DkvConfig<64>>>("DkvConfig<64> ranges", false);
  failures += check_shape<bf16, WithRanges<DkvConfig<64, true>>>("DkvConfig<64> large ranges", false);
  failures += check_shape<bf16, WithRanges<DkvConfig<128>>>("DkvConfig<128> ranges", false);
  failures += check_shape<bf16, WithRanges<DkvConfig<128, true>>>("DkvConfig<128> large ranges", false);
  failures += check_shape<__half, WithRanges<DkvConfig<128, true>>>("DkvConfig<128> large ranges fp16", false);
  // Candidates within sm_86's 99 KB. D = 128: 64-key tiles with P^T in shared memory
  // (FlashAttention-2's layout): 4 warps as 2 x 2 blocks of 32 keys x 32 queries, dK/dV 32 keys x
  // 64 columns a warp, one Q/dO buffer, two CTAs an SM (83 KB); the same scored 16 queries at a
  // time; 32-query steps with two Q/dO buffers (75 KB); 8 warps as 4 x 2 blocks of 16 x 32 with
  // dK/dV 32 keys x 32 columns (83 KB); the shipped layout (P^T in registers) on 64 keys, swizzled,
  // one Q/dO buffer (75 KB).
  failures += check_shape<bf16, Tiles<128, 64, 64, 4, 2, 32, 1, true, 2, 2>>("d128 k64 4w 2x2 psmem", timing);
  failures += check_shape<__half, Tiles<128, 64, 64, 4, 2, 32, 1, true, 2, 2>>("d128 k64 4w 2x2 psmem fp16", false);
  failures += check_shape<bf16, Tiles<128, 64, 64, 4, 2, 16, 1, true, 2, 2>>("d128 k64 4w 2x2 psmem sub16", timing);
  failures += check_shape<bf16, Tiles<128, 64, 32, 4, 2, 16, 2, true, 2, 2>>("d128 k64 q32 4w 2x2 psmem 2st", timing);
  failures += check_shape<bf16, Tiles<128, 64, 64, 8, 2, 32, 1, true, 4, 1>>("d128 k64 8w 4x2 psmem", timing);
  failures += check_shape<bf16, Tiles<128, 64, 64, 4, 1, 32, 1, true, 1, 2>>("d128 k64 4w pregs swz 1st", timing);
  // Occupancy: 8 warps held to 128 registers so that two CTAs share an SM (16 warps), scoring 16
  // queries at a time (83 KB each; 32 at a time spilled 68 bytes).
  failures +=
      check_shape<bf16, Tiles<128, 64, 64, 8, 2, 16, 1, true, 4, 2>>("d128 k64 8w 4x2 psmem sub16 2cta", timing);
  // 128-key tiles within 99 KB (half the dQ atomics of 64-key tiles), P^T in registers, swizzled:
  // 32-query steps with one Q/dO buffer (91 KB), 16-query steps with two (88 KB).
  failures += check_shape<bf16, Tiles<128, 128, 32, 8, 1, 32, 1, true>>("d128 k128 q32 pregs swz 1st", timing);
  failures += check_shape<bf16, Tiles<128, 128, 16, 8, 1, 16, 2, true>>("d128 k128 q16 pregs swz 2st", timing);
  // FlashAttention-2's H100 shape at D = 128 (128 keys x 64 queries, 8 warps 4 x 2, P^T in shared
  // memory, 166 KB): over sm_86's 99 KB, timed to show what the layout gives.
  failures += check_shape<bf16, Tiles<128, 128, 64, 8, 2, 32, 2, true, 2, 1>>("d128 k128 8w 4x2 psmem >99KB", timing);
  // D = 64: 128-key tiles with P^T in shared memory, 8 warps 4 x 2 (32 keys x 32 queries, dK/dV 32
  // x 32), one Q/dO buffer (86 KB); 64-key tiles, 4 warps 2 x 2, two Q/dO buffers (68 KB); the
  // shipped shape in swizzled rows (84 KB).
  failures += check_shape<bf16, Tiles<64, 128, 64, 8, 2, 32, 1, true, 2, 1>>("d64 k128 8w 4x2 psmem", timing);
  failures += check_shape<bf16, Tiles<64, 64, 64, 4, 2, 32, 2, true, 2, 2>>("d64 k64 4w 2x2 psmem", timing);
  failures += check_shape<__half, Tiles<64, 64, 64, 4, 2, 32, 2, true, 2, 2>>("d64 k64 4w 2x2 psmem fp16", false);
  failures += check_shape<bf16, Tiles<64, 128, 64, 8, 1, 64, 2, true>>("d64 pregs swz", timing);
  // D = 64, 64-key tiles, 8 warps 4 x 2 (16 keys x 32 queries; dK/dV 16 keys x 32 columns) held to
  // 128 registers, two Q/dO buffers (68 KB): two or three CTAs an SM.
  failures += check_shape<bf16, Tiles<64, 64, 64, 8, 2, 32, 2, true, 2, 2>>("d64 k64 8w 4x2 psmem 2cta", timing);
  // The scale folded into the exponent (kFoldScale) on the shipped shapes and on candidates above
  // (the 4-warp D = 128 shape scoring 32 queries at a time spilled 96 bytes with it).
  failures += check_shape<bf16, Tiles<128, 128, 64, 8, 1, 32, 2, false, 1, 1, true>>("d128 shipped fold", timing);
  failures +=
      check_shape<bf16, Tiles<128, 64, 64, 4, 2, 16, 1, true, 2, 2, true>>("d128 k64 4w 2x2 psmem sub16 fold", timing);
  failures += check_shape<bf16, Tiles<128, 64, 64, 8, 2, 16, 1, true, 4, 2, true>>(
      "d128 k64 8w 4x2 psmem sub16 2cta fold", timing);
  failures += check_shape<bf16, Tiles<64, 128, 64, 8, 1, 64, 2, false, 1, 1, true>>("d64 shipped fold", timing);
  failures +=
      check_shape<bf16, Tiles<64, 64, 64, 8, 2, 32, 2, true, 2, 2, true>>("d64 k64 8w 4x2 psmem 2cta fold", timing);
  // Folded 128-key shapes: the two within 99 KB above, and FlashAttention-2's sm_80 / sm_90 shapes
  // (over 99 KB, within sm_80's 163 KB): D = 128 with 128 keys x 64 queries, 8 warps 4 x 2; D = 64
  // with 128 keys x 128 queries, 8 warps 2 x 4 over S^T, dK/dV 4 x 2.
  failures +=
      check_shape<bf16, Tiles<128, 128, 32, 8, 1, 32, 1, true, 1, 1, true>>("d128 k128 q32 pregs 1st fold", timing);
  failures +=
      check_shape<bf16, Tiles<128, 128, 16, 8, 1, 16, 2, true, 1, 1, true>>("d128 k128 q16 pregs 2st fold", timing);
  failures +=
      check_shape<bf16, Tiles<128, 128, 64, 8, 2, 32, 2, true, 2, 1, true>>("d128 k128 8w 4x2 psmem fold", timing);
  failures += check_shape<bf16, Tiles<128, 128, 64, 8, 2, 16, 2, true, 2, 1, true>>("d128 k128 8w 4x2 psmem sub16 fold",
                                                                                    timing);
  failures += check_shape<bf16, Tiles<128, 128, 64, 8, 2, 16, 1, true, 2, 1, true>>(
      "d128 k128 8w 4x2 psmem sub16 1st fold", timing);
  failures +=
      check_shape<bf16, Tiles<64, 128, 128, 8, 4, 32, 1, true, 2, 1, true>>("d64 k128 q128 8w 2x4 fold", timing);
  failures +=
      check_shape<bf16, Tiles<64, 128, 128, 8, 4, 16, 1, true, 2, 1, true>>("d64 k128 q128 8w 2x4 sub16 fold", timing);
  failures +=
      check_shape<bf16, Tiles<64, 128, 64, 8, 2, 32, 2, true, 2, 1, true>>("d64 k128 8w 4x2 psmem fold", timing);
  // The large shapes with the atomic dQ in jobs of 16 queries (16 x 64 per warp) instead of the
  // shipped 32 (DkvConfig<D, true>).
  failures += check_shape<bf16, Tiles<128, 128, 64, 8, 2, 32, 1, true, 2, 1, true, 16>>("d128 large dq16", timing);
  failures += check_shape<bf16, Tiles<64, 128, 128, 8, 4, 16, 1, true, 2, 1, true, 16>>("d64 large dq16", timing);
  // S^T and dP^T one after the other (kPairScores false: half the fragment registers) on 32-query
  // sub-tiles, as both large shapes now run: each K / V fragment feeds four MMAs instead of two
  // (ncu, H200, D = 64: the paired 16-query shape read 22% more shared memory than
  // FlashAttention-2's and stalled on it 14% of the time). H200, causal / non-causal ms: D = 64
  // 1.564 / 2.804 against 1.728 / 3.081 paired; D = 128 2.860 / 5.153 against 2.872 / 5.177 before
  // the dQ accumulator tiles, 2.592 / 4.646 against 2.699 / 4.841 with them ("d128 large paired":
  // the shape D = 128 ran before).
  // The same with two Q/dO buffers: 64-query steps (101 KB), and 128-query steps (167 KB with
  // padded P^T / dS'^T rows: over sm_80's 163 KB, timed to show what the second buffer gives).
  failures +=
      check_shape<bf16, Tiles<64, 128, 64, 8, 2, 32, 2, true, 2, 1, true, 16, false>>("d64 q64 seq32 2st", timing);
  failures +=
      check_shape<bf16, Tiles<64, 128, 128, 8, 4, 32, 2, true, 2, 1, true, 32, false>>("d64 q128 seq32 2st", timing);
  failures +=
      check_shape<bf16, Tiles<128, 128, 64, 8, 2, 32, 1, true, 2, 1, true, 32, true>>("d128 large paired", timing);
  printf("%s\n", failures == 0 ? "ALL CHECKS PASSED" : "CHECKS FAILED");
  return failures == 0 ? 0 : 1;
}
