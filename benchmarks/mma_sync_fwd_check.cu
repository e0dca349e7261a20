// Standalone check and timing of the generic (mma.sync) forward attention kernel
// (csrc/ops/cuda/generic/attention_fwd.cuh), without torch, for its tile shapes side by side: the
// shape each head dim runs (FwdConfig) and candidates. Build (from the repository root):
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
//        --expt-relaxed-constexpr -Icsrc benchmarks/mma_sync_fwd_check.cu -o mma_sync_fwd_check
//
// Run: ./mma_sync_fwd_check [--no-timing] [--no-checks] [--only TEXT[,TEXT...] (shapes whose name contains one of
// them)] [--profile (one launch of each shape at the timing sizes, no checks: for ncu)].
// For each shape: random inputs, outputs poisoned with NaN, the kernel, then a float64 CPU reference over odd shapes
// (Q in 1, 97, 300, KV in 17, 300; GQA 2:1; causal shifts 0, -5, +7 and one that empties every row; log2 units with the
// scale folded into the exponent, natural units, a softcap, a float mask with sinks: natural units, every tile read
// element by element, a quarter of the mask -inf; a bool mask of one diagonal a head whose tiles the summary calls
// masked, visible, diagonal (a compare, not read) or mixed; key ranges for the WithRanges kernels), comparing out and
// lse, and fully masked rows (out exactly 0, lse -inf, or the sink); the grid in groups of heads (tile_order.h). Then
// B=4 H=16 S=4096 at the shape's head dim, causal (in the launcher's order of the CTAs, then head after head:
// "causal-hah") and not, timed with CUDA events (3 warm-ups, median of 20), TFLOP/s with causal counting half the
// flops. Exit status 1 when any check fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define SAFEATTN_STANDALONE
#define SAFEATTN_ATTN_FWD_DEFINE_KERNELS
#include "check_common.h"
#include "ops/cuda/generic/attention_fwd.cuh"

using safeattn::cuda::attn::attention_fwd_kernel;
using safeattn::cuda::attn::FwdConfig;
using safeattn::cuda::attn::FwdParams;
using safeattn::cuda::attn::FwdTiles;
using safeattn::cuda::attn::ScoreRule;
using safeattn::cuda::attn::WithoutMask;
using safeattn::cuda::attn::WithRanges;

static bool g_profile = false;
static bool g_checks = true;          // --no-checks: timings only
static const char* g_only = nullptr;  // --only TEXT[,TEXT...]: the shapes whose name contains one of them

template <typename T, class Cfg>
static void launch(const FwdParams& p) {
  const size_t smem = Cfg::smem_bytes(sizeof(T));
  auto kernel = &attention_fwd_kernel<T, Cfg>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = (p.q_len + Cfg::kBlockM - 1) / Cfg::kBlockM * p.batch_heads;
  kernel<<<static_cast<unsigned>(blocks), Cfg::kWarps * 32, smem>>>(p);
  CHECK_CUDA(cudaGetLastError());
}

struct SmallCase {
  int q_len, kv_len;
  bool causal;
  int64_t shift;
  // 0: log2 units (scale folded), 1: natural units, 2: softcap 5, 3: float mask [Q, KV] and sinks, 4: a bool
  // mask [H, Q, KV] of one diagonal a head, its tiles summarised as the kernel meets them (masked, visible,
  // and the others alternately diagonal, tested by a compare, and mixed, read element by element), 5: key ranges
  // (WithRanges kernels only), no mask, their tiles summarised as masked, visible or mixed
  int mode;
};

template <typename T, class Cfg>
static bool run_case(const SmallCase& cs, std::mt19937& rng) {
  constexpr int D = Cfg::kHeadDim;
  const int B = 2, H = 2, Hkv = 1;
  const double scale = 1.0 / std::sqrt(double(D)), softcap = cs.mode == 2 ? 5.0 : 0.0;
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  auto make = [&](size_t n) {
    std::vector<T> h(n);
    for (auto& x : h) {
      x = from_f<T>(u(rng));
    }
    return h;
  };
  const std::vector<T> hq = make(size_t(B) * H * cs.q_len * D), hk = make(size_t(B) * Hkv * cs.kv_len * D),
                       hv = make(size_t(B) * Hkv * cs.kv_len * D);
  T* q = upload(hq);
  T* k = upload(hk);
  T* v = upload(hv);
  // Mode 3: a float bias shared by every (b, h), a quarter of it -inf (whole rows of it where i % 7 == 3), a summary
  // that calls every tile mixed (the element path), and a sink logit per head.
  const bool masked = cs.mode == 3;
  std::vector<float> hmask(masked ? size_t(cs.q_len) * cs.kv_len : 0), hsinks(masked ? H : 0);
  for (size_t e = 0; e < hmask.size(); ++e) {
    const float x = u(rng);
    hmask[e] = (x > 1.0f || (e / cs.kv_len) % 7 == 3) ? -INFINITY : x;
  }
  for (float& x : hsinks) {
    x = u(rng);
  }
  const int q_tiles = (cs.q_len + Cfg::kBlockM - 1) / Cfg::kBlockM,
            kv_tiles = (cs.kv_len + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const std::vector<uint8_t> hsummary(masked ? size_t(q_tiles) * kv_tiles : 0, safeattn::cuda::attn::kTileMixed);
  float* mask = masked ? upload(hmask) : nullptr;
  float* sinks = masked ? upload(hsinks) : nullptr;
  uint8_t* summary = masked ? upload(hsummary) : nullptr;
  // Mode 4: head h sees keys j <= i + kDiagonalShift[h]; each tile's class from its elements inside [Q, KV].
  const bool diagonals = cs.mode == 4;
  constexpr int64_t kDiagonalShift[H] = {-37, 75};
  std::vector<uint8_t> hbool(diagonals ? size_t(H) * cs.q_len * cs.kv_len : 0);
  std::vector<uint8_t> hclass(diagonals ? size_t(H) * q_tiles * kv_tiles : 0);
  std::vector<int16_t> hdiag(hclass.size(), 0);
  for (int h = 0; diagonals && h < H; ++h) {
    for (int i = 0; i < cs.q_len; ++i) {
      for (int j = 0; j < cs.kv_len; ++j) {
        hbool[(size_t(h) * cs.q_len + i) * cs.kv_len + j] = j <= i + kDiagonalShift[h];
      }
    }
    for (int qt = 0; qt < q_tiles; ++qt) {
      for (int kt = 0; kt < kv_tiles; ++kt) {
        const int i0 = qt * Cfg::kBlockM, j0 = kt * Cfg::kBlockN;
        const size_t t = (size_t(h) * q_tiles + qt) * kv_tiles + kt;
        using safeattn::cuda::attn::kTileDiagonal, safeattn::cuda::attn::kTileMixed;
        hclass[t] = tile_class(i0, Cfg::kBlockM, j0, Cfg::kBlockN, cs.q_len, cs.kv_len,
                               (qt + kt) % 2 ? kTileMixed : kTileDiagonal,
                               [&](int i, int j) { return hbool[(size_t(h) * cs.q_len + i) * cs.kv_len + j] != 0; });
        hdiag[t] = static_cast<int16_t>(i0 + kDiagonalShift[h] - j0);
      }
    }
  }
  // Mode 5: key ranges (check_common.h's make_key_ranges); each tile's class from its rows' intervals.
  const bool ranged = cs.mode == 5;
  const std::vector<int> hranges = ranged ? make_key_ranges(cs.q_len, cs.kv_len, rng) : std::vector<int>();
  auto in_range = [&](int b, int i, int j) {
    const size_t at = 2 * (size_t(b) * cs.q_len + i);
    return !ranged || (j >= hranges[at] && j < hranges[at + 1]);
  };
  std::vector<uint8_t> hrange_class(ranged ? size_t(B) * q_tiles * kv_tiles : 0);
  for (int b = 0; ranged && b < B; ++b) {
    for (int qt = 0; qt < q_tiles; ++qt) {
      for (int kt = 0; kt < kv_tiles; ++kt) {
        hrange_class[(size_t(b) * q_tiles + qt) * kv_tiles + kt] =
            tile_class(qt * Cfg::kBlockM, Cfg::kBlockM, kt * Cfg::kBlockN, Cfg::kBlockN, cs.q_len, cs.kv_len,
                       safeattn::cuda::attn::kTileMixed, [&](int i, int j) { return in_range(b, i, j); });
      }
    }
  }
  int* ranges = ranged ? upload(hranges) : nullptr;
  uint8_t* range_classes = ranged ? upload(hrange_class) : nullptr;
  uint8_t* bool_mask = diagonals ? upload(hbool) : nullptr;
  uint8_t* classes = diagonals ? upload(hclass) : nullptr;
  int16_t* tile_diagonals = diagonals ? upload(hdiag) : nullptr;
  T* out;
  float* lse;
  const size_t n_out = size_t(B) * H * cs.q_len * D, n_lse = size_t(B) * H * cs.q_len;
  CHECK_CUDA(cudaMalloc(&out, n_out * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&lse, n_lse * sizeof(float)));
  CHECK_CUDA(cudaMemset(out, 0xff, n_out * sizeof(T)));  // NaN
  CHECK_CUDA(cudaMemset(lse, 0xff, n_lse * sizeof(float)));

  FwdParams p;
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
  p.q_sb = int64_t{H} * cs.q_len * D, p.q_sh = int64_t{cs.q_len} * D, p.q_si = D;
  p.k_sb = int64_t{Hkv} * cs.kv_len * D, p.k_sh = int64_t{cs.kv_len} * D, p.k_si = D;
  p.v_sb = p.k_sb, p.v_sh = p.k_sh, p.v_si = D;
  p.o_sb = p.q_sb, p.o_sh = p.q_sh, p.o_si = D;
  p.heads = H, p.group = H / Hkv, p.batch_heads = int64_t{B} * H, p.q_len = cs.q_len, p.kv_len = cs.kv_len;
  p.head_group = 3;  // the grid in two groups of two (batch, head)s (tile_order.h): every tile once
  p.score = safeattn::cuda::attn::score_rule(scale, softcap, cs.mode == 1 || masked);
  p.causal.enabled = cs.causal, p.causal.shift = cs.shift;
  if (masked) {
    p.sinks = sinks;
    p.mask.ptr = mask, p.mask.kind = safeattn::cuda::attn::MaskKind::kFloat;
    p.mask.stride_q = cs.kv_len, p.mask.stride_kv = 1;
    p.tiles.ptr = summary, p.tiles.stride_q = kv_tiles, p.tiles.kv_tiles = kv_tiles;
    p.tiles.block_q = Cfg::kBlockM, p.tiles.block_kv = Cfg::kBlockN;
  }
  if (diagonals) {
    p.mask.ptr = bool_mask, p.mask.kind = safeattn::cuda::attn::MaskKind::kBool;
    p.mask.stride_h = int64_t{cs.q_len} * cs.kv_len, p.mask.stride_q = cs.kv_len, p.mask.stride_kv = 1;
    p.tiles.ptr = classes, p.tiles.diagonal = tile_diagonals;
    p.tiles.stride_h = int64_t{q_tiles} * kv_tiles, p.tiles.stride_q = kv_tiles, p.tiles.kv_tiles = kv_tiles;
    p.tiles.slice_tiles = int64_t{q_tiles} * kv_tiles;
    p.tiles.block_q = Cfg::kBlockM, p.tiles.block_kv = Cfg::kBlockN;
  }
  if (ranged) {
    p.ranges.ptr = ranges, p.ranges.stride_b = 2 * int64_t{cs.q_len};
    p.tiles.ptr = range_classes;
    p.tiles.stride_b = int64_t{q_tiles} * kv_tiles, p.tiles.stride_q = kv_tiles, p.tiles.kv_tiles = kv_tiles;
    p.tiles.slice_tiles = int64_t{q_tiles} * kv_tiles;
    p.tiles.block_q = Cfg::kBlockM, p.tiles.block_kv = Cfg::kBlockN;
  }
  launch<T, Cfg>(p);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<T> ho(n_out);
  std::vector<float> hl(n_lse);
  CHECK_CUDA(cudaMemcpy(ho.data(), out, n_out * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hl.data(), lse, n_lse * sizeof(float), cudaMemcpyDeviceToHost));
  for (void* ptr :
       {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(out),
        static_cast<void*>(lse), static_cast<void*>(mask), static_cast<void*>(sinks), static_cast<void*>(summary),
        static_cast<void*>(bool_mask), static_cast<void*>(classes), static_cast<void*>(tile_diagonals),
        static_cast<void*>(ranges), static_cast<void*>(range_classes)}) {
    CHECK_CUDA(cudaFree(ptr));
  }

  double max_out = 0.0, max_lse = 0.0;
  bool empty_ok = true;
  std::vector<double> s(cs.kv_len);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int hkv = h / (H / Hkv);
      for (int i = 0; i < cs.q_len; ++i) {
        const T* qi = &hq[((size_t(b) * H + h) * cs.q_len + i) * D];
        double m = -INFINITY;
        for (int j = 0; j < cs.kv_len; ++j) {
          const bool visible =
              (!cs.causal || j <= i + cs.shift) && (!diagonals || j <= i + kDiagonalShift[h]) && in_range(b, i, j);
          double dot = 0.0;
          const T* kj = &hk[((size_t(b) * Hkv + hkv) * cs.kv_len + j) * D];
          for (int d = 0; d < D; ++d) {
            dot += double(to_f(qi[d])) * double(to_f(kj[d]));
          }
          double sc = dot * scale;
          if (softcap > 0.0) {
            sc = softcap * std::tanh(sc / softcap);
          }
          const double bias = masked ? double(hmask[size_t(i) * cs.kv_len + j]) : 0.0;
          s[j] = visible && bias != -INFINITY ? sc + bias : -INFINITY;
          m = std::max(m, s[j]);
        }
        const size_t row = (size_t(b) * H + h) * cs.q_len + i;
        const double sink = masked ? double(hsinks[h]) : -INFINITY;
        if (m == -INFINITY) {
          for (int d = 0; d < D; ++d) {
            empty_ok &= to_f(ho[row * D + d]) == 0.0f;
          }
          empty_ok &= masked ? std::abs(double(hl[row]) - sink) <= 1e-6 : hl[row] == -INFINITY;
          continue;
        }
        // The sink logit joins the denominator only.
        m = std::max(m, sink);
        double l = masked ? std::exp(sink - m) : 0.0;
        for (int j = 0; j < cs.kv_len; ++j) {
          l += std::exp(s[j] - m);
        }
        max_lse = std::max(max_lse, std::abs(double(hl[row]) - (m + std::log(l))));
        for (int d = 0; d < D; ++d) {
          double o = 0.0;
          for (int j = 0; j < cs.kv_len; ++j) {
            o += std::exp(s[j] - m) / l * double(to_f(hv[((size_t(b) * Hkv + hkv) * cs.kv_len + j) * D + d]));
          }
          const double err = std::abs(double(to_f(ho[row * D + d])) - o);
          max_out = std::max(max_out, err != err ? INFINITY : err);
        }
      }
    }
  }
  // P in 16 bits before P V: a few units of the 16-bit type's rounding on |out| <= 2.
  const double out_tol = sizeof(T) == 2 && std::is_same_v<T, __nv_bfloat16> ? 3e-2 : 4e-3;
  const bool ok = max_out <= out_tol && max_lse <= 1e-3 && empty_ok;
  if (!ok) {
    printf("  FAIL q %d kv %d causal %d shift %lld mode %d: out err %.3g, lse err %.3g, empty rows %s\n", cs.q_len,
           cs.kv_len, cs.causal, static_cast<long long>(cs.shift), cs.mode, max_out, max_lse,
           empty_ok ? "ok" : "WRONG");
  }
  return ok;
}

// head_group: the CTAs' order (FwdParams::head_group); 0: the extension's launcher's rule.
template <typename T, class Cfg>
static float time_shape(bool causal, int B, int H, int S, int head_group = 0) {
  constexpr int D = Cfg::kHeadDim;
  const size_t n = size_t(B) * H * S * D;
  T *q, *k, *v, *out;
  float* lse;
  CHECK_CUDA(cudaMalloc(&q, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&k, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&v, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&out, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&lse, size_t(B) * H * S * sizeof(float)));
  fill_uniform<<<1024, 256>>>(q, n, 1, 1.0f);
  fill_uniform<<<1024, 256>>>(k, n, 2, 1.0f);
  fill_uniform<<<1024, 256>>>(v, n, 3, 1.0f);
  FwdParams p;
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
  p.q_sb = p.k_sb = p.v_sb = p.o_sb = int64_t{H} * S * D;
  p.q_sh = p.k_sh = p.v_sh = p.o_sh = int64_t{S} * D;
  p.q_si = p.k_si = p.v_si = p.o_si = D;
  p.heads = H, p.group = 1, p.batch_heads = int64_t{B} * H, p.q_len = S, p.kv_len = S;
  p.score = safeattn::cuda::attn::score_rule(1.0 / std::sqrt(double(D)), 0.0, false);
  p.causal.enabled = causal;
  const int q_tiles = (S + Cfg::kBlockM - 1) / Cfg::kBlockM;
  p.head_group = head_group > 0 || !causal
                     ? (head_group > 0 ? head_group : 1)
                     : safeattn::cuda::fwd_head_group(q_tiles, B * H,
                                                      safeattn::cuda::resident_ctas<&attention_fwd_kernel<T, Cfg>>(
                                                          Cfg::kWarps * 32, Cfg::smem_bytes(sizeof(T))),
                                                      2LL * S * D * static_cast<long long>(sizeof(T)),
                                                      safeattn::cuda::current_l2_bytes());
  float median = 0.0f;
  if (g_profile) {
    launch<T, Cfg>(p);
  } else {
    std::vector<float> ms;
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    for (int it = 0; it < 23; ++it) {
      CHECK_CUDA(cudaEventRecord(e0));
      launch<T, Cfg>(p);
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
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  for (void* ptr : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(out),
                    static_cast<void*>(lse)}) {
    CHECK_CUDA(cudaFree(ptr));
  }
  return median;
}

template <typename T, class Cfg>
static int check_shape(const char* name, bool timing) {
  if (g_only != nullptr && !selected(name, g_only)) {
    return 0;
  }
  int device = 0, opt_in = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&opt_in, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t smem = Cfg::smem_bytes(sizeof(T));
  cudaFuncAttributes attr{};
  CHECK_CUDA(cudaFuncGetAttributes(&attr, attention_fwd_kernel<T, Cfg>));
  int per_sm = 0;
  CHECK_CUDA(cudaFuncSetAttribute(attention_fwd_kernel<T, Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  CHECK_CUDA(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attention_fwd_kernel<T, Cfg>, Cfg::kWarps * 32, smem));
  printf(
      "%-28s D %3d  %3dx%-3d %d warps Q %s K/V stages %d/%d %s rows: %3d regs, %4zu B spill (local), %6zu B "
      "(%5.1f KB) smem%s, %d CTA/SM\n",
      name, Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kWarps, Cfg::kQInRegs ? "regs" : "smem", Cfg::kStages,
      Cfg::kVStages, Cfg::kSwizzle ? "swizzled" : "padded", attr.numRegs, attr.localSizeBytes, smem, smem / 1024.0,
      smem <= safeattn::cuda::attn::kSmemPerBlockSm86 ? "" : " (over sm_86's 99 KB)", per_sm);
  int failures = 0;
  if (!g_profile && g_checks) {
    std::mt19937 rng(1234);
    for (int ql : {1, 97, 300}) {
      for (int kl : {17, 300}) {
        // Modes 3 and 4 read a mask; mode 5, key ranges, alone for the WithRanges kernels (the others
        // without ranges would not run them).
        for (int mode = Cfg::kReadsRanges ? 5 : 0; mode < (Cfg::kReadsRanges ? 6 : Cfg::kReadsMask ? 5 : 3); ++mode) {
          failures += !run_case<T, Cfg>({ql, kl, false, 0, mode}, rng);
          for (int64_t shift : {int64_t{0}, int64_t{-5}, int64_t{7}, int64_t{-400}}) {
            failures += !run_case<T, Cfg>({ql, kl, true, shift, mode}, rng);
          }
        }
      }
    }
    printf("  checks: %s\n", failures == 0 ? "ok" : "FAILED");
  }
  if (timing || g_profile) {
    // Causal twice: in the launcher's order (groups of heads, tile_order.h) and head after head.
    for (int order = 0; order < 3; ++order) {
      const bool causal = order < 2;
      const int B = 4, H = 16, S = 4096;
      const float ms = time_shape<T, Cfg>(causal, B, H, S, order == 1 ? 1 : 0);
      if (!g_profile) {
        const double flops = 4.0 * B * H * double(S) * S * Cfg::kHeadDim * (causal ? 0.5 : 1.0);
        printf("  TIME %-28s D %3d %-9s B4 H16 S4096: %.3f ms  %.0f TFLOP/s\n", name, Cfg::kHeadDim,
               order == 0   ? "causal"
               : order == 1 ? "causal-hah"
                            : "noncausal",
               ms, flops / ms / 1e9);
      }
      if (g_profile) {
        break;
      }
    }
  }
  return failures;
}

// Candidate shapes: <D, BlockM, BlockN, warps, Q in registers, K stages, CTAs per SM, swizzled rows,
// V stages>.
template <int D, int M, int N, int W, bool QR, int S, int MB, bool SW = false, int VS = S>
using Tiles = FwdTiles<D, M, N, W, QR, S, MB, SW, VS>;

int main(int argc, char** argv) {
  bool timing = true;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--no-timing")) {
      timing = false;
    } else if (!strcmp(argv[i], "--no-checks")) {
      g_checks = false;
    } else if (!strcmp(argv[i], "--profile")) {
      g_profile = true;
    } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
      g_only = argv[++i];
    }
  }
  using bf16 = __nv_bfloat16;
  int failures = 0;
  // The shape each head dim runs.
  failures += check_shape<bf16, FwdConfig<32>>("FwdConfig<32>", timing);
  failures += check_shape<bf16, FwdConfig<64>>("FwdConfig<64>", timing);
  failures += check_shape<__half, FwdConfig<64>>("FwdConfig<64> fp16", false);
  failures += check_shape<bf16, FwdConfig<64, true>>("FwdConfig<64> large", timing);
  failures += check_shape<__half, FwdConfig<64, true>>("FwdConfig<64> large fp16", false);
  failures += check_shape<bf16, FwdConfig<80>>("FwdConfig<80>", timing);
  failures += check_shape<bf16, FwdConfig<96>>("FwdConfig<96>", timing);
  failures += check_shape<bf16, FwdConfig<128>>("FwdConfig<128>", timing);
  failures += check_shape<__half, FwdConfig<128>>("FwdConfig<128> fp16", false);
  failures += check_shape<bf16, FwdConfig<256>>("FwdConfig<256>", timing);
  // Candidates FwdConfig's comment compares with.
  failures += check_shape<bf16, Tiles<128, 128, 64, 4, false, 2, 2>>("d128 4w qsmem n64 (102 KB)", timing);
  failures += check_shape<bf16, Tiles<128, 128, 64, 8, true, 2, 1>>("d128 8w qregs n64", timing);
  failures += check_shape<bf16, Tiles<128, 128, 64, 4, false, 1, 2>>("d128 4w qsmem n64 1stage", timing);
  failures += check_shape<bf16, Tiles<64, 128, 64, 4, false, 3, 2>>("d64 qsmem 3stage", timing);
  // D = 128 with 64-key tiles within sm_86's 99 KB: swizzled rows (96 KB), two K buffers and one V
  // (85 KB), both (80 KB); FlashAttention-2's one K and one V, swizzled (64 KB); the shipped 32-key
  // shape swizzled (64 KB); 8 warps with Q in registers, swizzled (64 KB).
  failures += check_shape<bf16, Tiles<128, 128, 64, 4, false, 2, 2, true>>("d128 n64 swz", timing);
  failures += check_shape<__half, Tiles<128, 128, 64, 4, false, 2, 2, true>>("d128 n64 swz fp16", false);
  failures += check_shape<bf16, Tiles<128, 128, 64, 4, false, 2, 2, false, 1>>("d128 n64 k2v1", timing);
  failures += check_shape<bf16, Tiles<128, 128, 64, 4, false, 2, 2, true, 1>>("d128 n64 swz k2v1", timing);
  failures += check_shape<__half, Tiles<128, 128, 64, 4, false, 2, 2, true, 1>>("d128 n64 swz k2v1 fp16", false);
  failures += check_shape<bf16, Tiles<128, 128, 64, 4, false, 1, 2, true, 1>>("d128 n64 swz 1stage", timing);
  failures += check_shape<bf16, Tiles<128, 128, 32, 4, false, 2, 2, true>>("d128 n32 swz", timing);
  failures += check_shape<bf16, Tiles<128, 128, 64, 8, true, 2, 1, true>>("d128 8w qregs n64 swz", timing);
  // Swizzled rows at the other power-of-two head dims.
  failures += check_shape<bf16, Tiles<64, 128, 64, 4, true, 2, 2, true>>("d64 swz", timing);
  failures += check_shape<bf16, Tiles<256, 128, 32, 8, false, 2, 1, true>>("d256 swz", false);
  // D = 64 with FlashAttention-2's 128-key tiles: 4 warps of 32 rows, Q in registers, swizzled
  // (48 KB double buffered), two or one CTAs an SM; one stage; 8 warps of 16 rows.
  failures += check_shape<bf16, Tiles<64, 128, 128, 4, true, 2, 2, true>>("d64 n128 swz", timing);
  failures += check_shape<bf16, Tiles<64, 128, 128, 4, true, 2, 1, true>>("d64 n128 swz 1cta", timing);
  failures += check_shape<bf16, Tiles<64, 128, 128, 4, true, 1, 2, true>>("d64 n128 swz 1stage", timing);
  failures += check_shape<bf16, Tiles<64, 128, 128, 8, true, 2, 1, true>>("d64 n128 8w swz", timing);
  failures += check_shape<bf16, Tiles<64, 128, 64, 8, true, 2, 1, true>>("d64 n64 8w swz", timing);
  // D = 64, 128-key tiles with Q re-read from shared memory as FwdConfig<64, true>, in FlashAttention-2's
  // single-buffered order (48 KB, two CTAs an SM on sm_86 too: 104 bytes of spills, 0.603 / 1.022
  // ms on the H200 against the large shape's 0.541 / 0.940), and two K buffers with one V (64 KB).
  failures += check_shape<bf16, Tiles<64, 128, 128, 4, false, 1, 2, true, 1>>("d64 n128 qsmem swz 1stage", timing);
  failures += check_shape<bf16, Tiles<64, 128, 128, 4, false, 2, 2, true, 1>>("d64 n128 qsmem swz k2v1", timing);
  // The shipped shapes without the mask code (WithoutMask: what calls with neither a mask nor a
  // summary could run): no spills where the shipped kernels have 32 bytes (D = 128, D = 64 large).
  failures += check_shape<bf16, WithoutMask<FwdConfig<64>>>("FwdConfig<64> nomask", timing);
  failures += check_shape<bf16, WithoutMask<FwdConfig<64, true>>>("FwdConfig<64> large nomask", timing);
  failures += check_shape<__half, WithoutMask<FwdConfig<64, true>>>("FwdConfig<64> large nomask fp16", false);
  failures += check_shape<bf16, WithoutMask<FwdConfig<128>>>("FwdConfig<128> nomask", timing);
  failures += check_shape<__half, WithoutMask<FwdConfig<128>>>("FwdConfig<128> nomask fp16", false);
  // The shipped shapes with the key ranges' test (WithRanges: what calls with key ranges run once
  // kMmaSyncReadsKeyRanges is on), checked, not timed.
  failures += check_shape<bf16, WithRanges<FwdConfig<64>>>("FwdConfig<64> ranges", false);
  failures += check_shape<bf16, WithRanges<FwdConfig<64, true>>>("FwdConfig<64> large ranges", false);
  failures += check_shape<bf16, WithRanges<FwdConfig<128>>>("FwdConfig<128> ranges", false);
  failures += check_shape<__half, WithRanges<FwdConfig<128>>>("FwdConfig<128> ranges fp16", false);
  printf("%s\n", failures == 0 ? "ALL CHECKS PASSED" : "CHECKS FAILED");
  return failures == 0 ? 0 : 1;
}
