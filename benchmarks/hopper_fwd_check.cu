// Standalone check and timing of the sm_90a forward attention kernel (csrc/ops/cuda/hopper/),
// without torch. Build (from the repository root; CUTLASS headers from the nvidia-cutlass wheel):
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Icsrc -I"$CUTLASS_INCLUDE" -Xcompiler -fopenmp -lgomp -cudart static \
//        benchmarks/hopper_fwd_check.cu -o hopper_fwd_check
//
// (-DHOPPER_CHECK_D96 or -DHOPPER_CHECK_D256: that head dim's candidates alone.)
// Run: ./hopper_fwd_check [--quick] [--no-timing] [--only N (variant N; 99: the static schedule)]
// [--seq N (timings: sequences of N, a batch of 16384 / N; default 4096)] [--profile (two causal
// launches of each default, nothing else: for ncu)] [--head-group N (the causal tile order,
// tile_order.h)]. For each kernel variant: fresh random inputs (never zeros), outputs poisoned with
// NaN, the kernel, then a float64 CPU reference over odd shapes (Q/KV in 1, 17, 97, 1025, 4096;
// causal shifts -5, 0, +7 and ones that empty every row; GQA 4:1; transposed-view and padded
// strides, the latter with an output 4-byte but not 16-byte aligned where the epilogue stores from
// registers, and where it stores by TMA a check that such an output is refused) comparing out, lse,
// lse + lse_lo, and fully masked rows (out exactly 0, lse -inf, lse_lo 0). Then B=4 H=16 S=4096 (or
// --seq) causal and not, timed with CUDA events (3 warm-ups, median of 20), TFLOP/s with causal
// counting half the flops. Exit status 1 when any check fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "check_common.h"
#include "ops/cuda/hopper/fwd_kernel.cuh"

using safeattn::cuda::hopper::FwdSm90Params;
using safeattn::cuda::hopper::FwdTileConfig;

// --head-group N: at most N heads per group of the causal tile order (tile_order.h; 1: head after
// head); 0, the default, fwd_head_group's choice, as the extension runs. For the reference checks
// and the timings alike.
static int g_head_group = 0;

// The L2's bytes, for the head group rule (FwdSm90Params::l2_bytes), as the extension passes them.
static int64_t l2_bytes() {
  int bytes = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, 0));
  return bytes;
}

struct Errors {
  double out_rel_l2 = 0, out_max_abs = 0, lse_max_abs = 0, lse2_max_abs = 0;
  long bad_empty = 0, bad_lo = 0, nan_out = 0, unwritten = 0;
};

template <typename T, class Config>
static bool run_case(const Case& cs, std::mt19937& rng, double scale, const char* name) {
  constexpr int D = Config::kHeadDim;
  int64_t qs[3], ks[3], vs[3], os[3];
  const size_t qn = make_strides(cs.layout, cs.batch, cs.heads, cs.q_len, D, qs);
  const size_t kn = make_strides(cs.layout, cs.batch, cs.kv_heads, cs.kv_len, D, ks);
  const size_t vn = make_strides(cs.layout, cs.batch, cs.kv_heads, cs.kv_len, D, vs);
  const size_t on = make_strides(1, cs.batch, cs.heads, cs.q_len, D, os);  // out: [B, Q, H, D] storage
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<T> hq(qn), hk(kn), hv(vn);
  for (auto& x : hq)
    x = from_f<T>(uni(rng));
  for (auto& x : hk)
    x = from_f<T>(uni(rng));
  for (auto& x : hv)
    x = from_f<T>(uni(rng));
  T *dq, *dk, *dv, *dout;
  float *dlse, *dlo;
  const size_t rows = size_t(cs.batch) * cs.heads * cs.q_len;
  CHECK_CUDA(cudaMalloc(&dq, qn * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&dk, kn * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&dv, vn * sizeof(T)));
  // Padded-stride cases also take an output 4 bytes past a 16-byte boundary: the epilogue's
  // 4-byte stores instead of its 16-byte ones, where it stores from registers (one Q buffer); an
  // output by TMA (Config::kOutViaQ) must be 16-byte aligned, and such an out is refused below.
  const size_t o_offset = cs.layout == 2 && !Config::kOutViaQ ? 2 : 0;
  CHECK_CUDA(cudaMalloc(&dout, (on + o_offset) * sizeof(T)));
  dout += o_offset;
  CHECK_CUDA(cudaMalloc(&dlse, rows * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dlo, rows * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dq, hq.data(), qn * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, hk.data(), kn * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, hv.data(), vn * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dout, 0xff, on * sizeof(T)));  // NaN in both 16-bit formats
  CHECK_CUDA(cudaMemset(dlse, 0xff, rows * sizeof(float)));
  CHECK_CUDA(cudaMemset(dlo, 0xff, rows * sizeof(float)));

  FwdSm90Params p;
  p.q = dq, p.k = dk, p.v = dv, p.out = dout, p.lse = dlse, p.lse_lo = dlo;
  p.q_sb = qs[0], p.q_sh = qs[1], p.q_si = qs[2];
  p.k_sb = ks[0], p.k_sh = ks[1], p.k_si = ks[2];
  p.v_sb = vs[0], p.v_sh = vs[1], p.v_si = vs[2];
  p.o_sb = os[0], p.o_sh = os[1], p.o_si = os[2];
  p.batch = cs.batch, p.heads = cs.heads, p.kv_heads = cs.kv_heads;
  p.q_len = cs.q_len, p.kv_len = cs.kv_len;
  p.score.scale = static_cast<float>(scale * 1.4426950408889634);
  p.causal = cs.causal;
  p.head_group = g_head_group;
  p.causal_shift = std::min<int64_t>(std::max<int64_t>(cs.shift, -int64_t{cs.q_len} - 1), cs.kv_len);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  p.max_ctas = sms;
  p.l2_bytes = l2_bytes();
  int* counter = nullptr;
  if (cs.causal || cs.q_len == 1025) {  // the dynamic schedule (and once without causality)
    CHECK_CUDA(cudaMalloc(&counter, sizeof(int)));
    CHECK_CUDA(cudaMemset(counter, 0, sizeof(int)));
    p.tile_counter = counter;
  }
  bool refused = true;  // kOutViaQ: an out 4 bytes past a 16-byte boundary is refused, nothing launched
  if (Config::kOutViaQ && cs.layout == 2) {
    FwdSm90Params misaligned = p;
    misaligned.out = dout + 2;
    refused = safeattn::cuda::hopper::launch_fwd_config<T, Config>(misaligned, 0) == cudaErrorInvalidValue;
    cudaGetLastError();
  }
  CHECK_CUDA((safeattn::cuda::hopper::launch_fwd_config<T, Config>(p, 0)));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<T> hout(on);
  std::vector<float> hlse(rows), hlo(rows);
  CHECK_CUDA(cudaMemcpy(hout.data(), dout, on * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hlse.data(), dlse, rows * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hlo.data(), dlo, rows * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dout - o_offset), cudaFree(dlse), cudaFree(dlo), cudaFree(counter);

  Errors e;
  double err2 = 0, ref2 = 0;
  const int group = cs.heads / cs.kv_heads;
#pragma omp parallel for collapse(2) schedule(dynamic) reduction(+ : err2, ref2)
  for (int bh = 0; bh < cs.batch * cs.heads; ++bh) {
    for (int i = 0; i < cs.q_len; ++i) {
      const int b = bh / cs.heads, h = bh % cs.heads, hk_ = h / group;
      std::vector<double> s(cs.kv_len), acc(D, 0.0);
      const T* qrow = hq.data() + b * qs[0] + h * qs[1] + int64_t{i} * qs[2];
      double m = -INFINITY;
      for (int j = 0; j < cs.kv_len; ++j) {
        if (cs.causal && j > i + cs.shift) {
          s[j] = -INFINITY;
          continue;
        }
        const T* krow = hk.data() + b * ks[0] + hk_ * ks[1] + int64_t{j} * ks[2];
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += double(to_f(qrow[d])) * double(to_f(krow[d]));
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      double l = 0;
      for (int j = 0; j < cs.kv_len; ++j) {
        if (s[j] == -INFINITY)
          continue;
        const double pj = std::exp(s[j] - m);
        l += pj;
        const T* vrow = hv.data() + b * vs[0] + hk_ * vs[1] + int64_t{j} * vs[2];
        for (int d = 0; d < D; ++d)
          acc[d] += pj * double(to_f(vrow[d]));
      }
      const size_t r = size_t(bh) * cs.q_len + i;
      const T* orow = hout.data() + b * os[0] + h * os[1] + int64_t{i} * os[2];
      double row_err2 = 0, row_ref2 = 0, row_max = 0;
      long nan_out = 0, bad_empty = 0, bad_lo = 0;
      double lse_err = 0, lse2_err = 0;
      if (l == 0) {  // no visible key
        for (int d = 0; d < D; ++d)
          bad_empty += !(to_f(orow[d]) == 0.0f);
        bad_empty += !(hlse[r] == -INFINITY) + !(hlo[r] == 0.0f);
      } else {
        for (int d = 0; d < D; ++d) {
          const double ref = acc[d] / l, got = to_f(orow[d]);
          if (!(got == got))
            ++nan_out;
          row_err2 += (got - ref) * (got - ref);
          row_ref2 += ref * ref;
          row_max = std::max(row_max, std::fabs(got - ref));
        }
        const double ref_lse = m + std::log(l);
        lse_err = std::fabs(double(hlse[r]) - ref_lse);
        lse2_err = std::fabs(double(hlse[r]) + double(hlo[r]) - ref_lse);
        if (!(lse_err == lse_err))
          lse_err = INFINITY;
        if (!(lse2_err == lse2_err))
          lse2_err = INFINITY;
        // lse_lo is a rounding remainder (attn::finish_row: the rounding of lse2 ln 2 and the
        // two_sum error of lse2, scaled by ln 2): under 1.2 ulps of lse.
        const float ulp = std::nextafter(std::fabs(hlse[r]), INFINITY) - std::fabs(hlse[r]);
        bad_lo += !(std::fabs(hlo[r]) <= 1.2f * ulp);
      }
      err2 += row_err2;
      ref2 += row_ref2;
#pragma omp critical
      {
        e.out_max_abs = std::max(e.out_max_abs, row_max);
        e.lse_max_abs = std::max(e.lse_max_abs, lse_err);
        e.lse2_max_abs = std::max(e.lse2_max_abs, lse2_err);
        e.nan_out += nan_out, e.bad_empty += bad_empty, e.bad_lo += bad_lo;
      }
    }
  }
  e.out_rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  const double tol_rel = bf16 ? 1e-2 : 2e-3, tol_abs = bf16 ? 4e-2 : 8e-3;
  const bool ok = e.out_rel_l2 <= tol_rel && e.out_max_abs <= tol_abs && e.lse_max_abs <= 2e-3 &&
                  e.lse2_max_abs <= 2e-3 && e.nan_out == 0 && e.bad_empty == 0 && e.bad_lo == 0 && refused;
  printf(
      "%-4s %-28s B%d H%d/%d Q%-5d KV%-5d %s shift %-5lld layout %d: rel %.2e max %.2e lse %.2e lse+lo %.2e "
      "nan %ld empty-bad %ld lo-bad %ld%s\n",
      ok ? "ok" : "FAIL", name, cs.batch, cs.heads, cs.kv_heads, cs.q_len, cs.kv_len, cs.causal ? "causal" : "full  ",
      static_cast<long long>(cs.shift), cs.layout, e.out_rel_l2, e.out_max_abs, e.lse_max_abs, e.lse2_max_abs,
      e.nan_out, e.bad_empty, e.bad_lo, refused ? "" : " (a misaligned out was not refused)");
  return ok;
}

static int g_only = -1, g_variant = 0;  // --only N: run variant N alone (a hang stays in its process)
static int g_seq = 4096;                // --seq N: the timings' sequence length (batch 16384 / N)
static bool g_profile = false;          // --profile: two launches of each default, causal, for ncu

struct Timing {
  std::string name;
  bool causal;
  int ctas;
  bool dynamic;
  double ms, tflops;
};
static std::vector<Timing> g_timings;

template <typename T, class Config>
static void time_variant(const char* name, bool causal, bool persistent, bool dynamic, int KV = 0) {
  constexpr int D = Config::kHeadDim;
  const int H = 16, S = g_seq, B = 16384 / g_seq;
  KV = KV > 0 ? KV : S;
  const size_t n = size_t(B) * H * S * D;
  constexpr int kSets = 2;  // rotate input sets so repeated runs do not sit in L2
  T* buf[kSets][3];
  for (int s = 0; s < kSets; ++s) {
    for (int t = 0; t < 3; ++t) {
      CHECK_CUDA(cudaMalloc(&buf[s][t], n * sizeof(T)));
      fill_uniform<T><<<1024, 256>>>(buf[s][t], n, 1234 + 3 * s + t, 1.0f);
      CHECK_CUDA(cudaGetLastError());
    }
  }
  T* out;
  float* lse;
  float* lo;
  CHECK_CUDA(cudaMalloc(&out, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&lse, size_t(B) * H * S * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&lo, size_t(B) * H * S * sizeof(float)));
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int* counter;
  CHECK_CUDA(cudaMalloc(&counter, sizeof(int)));
  auto params = [&](int s) {
    FwdSm90Params p;
    p.q = buf[s][0], p.k = buf[s][1], p.v = buf[s][2], p.out = out, p.lse = lse, p.lse_lo = lo;
    // Transformers' layout: [B, S, H, D] storage viewed as [B, H, S, D].
    p.q_sb = p.k_sb = p.v_sb = p.o_sb = int64_t{S} * H * D;
    p.q_sh = p.k_sh = p.v_sh = p.o_sh = D;
    p.q_si = p.k_si = p.v_si = p.o_si = int64_t{H} * D;
    p.batch = B, p.heads = H, p.kv_heads = H, p.q_len = S, p.kv_len = KV;
    p.causal_shift = KV - S;  // bottom-right aligned when KV < S (rows before S - KV see no key)
    p.score.scale = static_cast<float>(1.4426950408889634 / std::sqrt(double(D)));
    p.causal = causal;
    p.head_group = g_head_group;
    p.max_ctas = persistent ? sms : 0;
    p.l2_bytes = l2_bytes();
    p.tile_counter = dynamic ? counter : nullptr;
    return p;
  };
  // One call as the op makes it: the counter's memset (dynamic schedule), then the kernel.
  auto launch = [&](const FwdSm90Params& p) {
    if (p.tile_counter != nullptr) {
      CHECK_CUDA(cudaMemsetAsync(p.tile_counter, 0, sizeof(int), 0));
    }
    CHECK_CUDA((safeattn::cuda::hopper::launch_fwd_config<T, Config>(p, 0)));
  };
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < (g_profile ? 1 : 3); ++i)
    launch(params(i % kSets));
  std::vector<float> ms;
  for (int i = 0; i < (g_profile ? 1 : 20); ++i) {
    const FwdSm90Params p = params(i % kSets);
    CHECK_CUDA(cudaEventRecord(start));
    launch(p);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double flops = 4.0 * B * H * double(S) * KV * D * (causal ? 0.5 : 1.0);
  g_timings.push_back({name, causal, persistent ? sms : 0, dynamic, med, flops / (med * 1e-3) / 1e12});
  printf("time %-28s %s %s %s B %d S %d KV %d: %.3f ms (min %.3f max %.3f) %.1f TFLOP/s\n", name,
         causal ? "causal" : "full  ", persistent ? "persistent" : "grid=tiles", dynamic ? "dynamic" : "static", B, S,
         KV, med, ms.front(), ms.back(), g_timings.back().tflops);
  for (int s = 0; s < kSets; ++s)
    for (int t = 0; t < 3; ++t)
      cudaFree(buf[s][t]);
  cudaFree(out), cudaFree(lse), cudaFree(lo), cudaFree(counter);
  cudaEventDestroy(start), cudaEventDestroy(stop);
}

template <typename T, class Config>
static int check_variant(const char* name, bool quick, bool timing) {
  if (g_only >= 0 && g_variant++ != g_only) {
    return 0;
  }
  constexpr int D = Config::kHeadDim;
  std::mt19937 rng(std::random_device{}());
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<Case> cases = {
      {1, 1, 1, 1, 1, false, 0, 0},       {2, 3, 3, 17, 17, false, 0, 1}, {1, 2, 2, 97, 1025, false, 0, 2},
      {1, 2, 2, 1025, 97, true, 0, 0},    {2, 8, 2, 97, 97, true, -5, 1},  // GQA 4:1, first 5 rows empty
      {1, 4, 1, 1025, 1025, true, 7, 1},                                   // GQA 4:1
      {1, 2, 2, 17, 1025, true, 1008, 0},                                  // bottom-right aligned (decode-like)
      {1, 2, 2, 97, 97, true, -200, 0},                                    // every row empty: no tile visited
      {1, 1, 1, 300, 300, true, -150, 2},                                  // whole tiles empty, others partial
  };
  if (!quick) {
    cases.push_back({1, 2, 1, 4096, 4096, true, 0, 1});
    cases.push_back({1, 1, 1, 4096, 1, false, 0, 0});
    cases.push_back({1, 1, 1, 1, 4096, false, 0, 1});
  }
  int failed = 0;
  for (const Case& cs : cases) {
    failed += !run_case<T, Config>(cs, rng, scale, name);
  }
  if (timing) {
    time_variant<T, Config>(name, false, true, false);
    time_variant<T, Config>(name, true, true, true);  // causal: the dynamic schedule, as the op runs it
  }
  return failed;
}

int main(int argc, char** argv) {
  bool quick = false, timing = true;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--head-group") && i + 1 < argc)
      g_head_group = atoi(argv[++i]);
    if (!strcmp(argv[i], "--quick"))
      quick = true;
    if (!strcmp(argv[i], "--no-timing"))
      timing = false;
    if (!strcmp(argv[i], "--only") && i + 1 < argc)
      g_only = atoi(argv[++i]);
    if (!strcmp(argv[i], "--seq") && i + 1 < argc)
      g_seq = atoi(argv[++i]);
    if (!strcmp(argv[i], "--profile"))
      g_profile = true;
  }
  if (argc > 1 && !strcmp(argv[1], "--sweep")) {  // per-tile overhead: full tiles of 4 .. 32 key blocks
    for (int kv : {512, 1024, 2048, 4096}) {
      time_variant<__nv_bfloat16, FwdTileConfig<128, 128, 2, 2, true>>("bf16 d128 default", false, true, false, kv);
    }
    for (int kv : {512, 1024, 2048, 4096}) {
      time_variant<__nv_bfloat16, FwdTileConfig<64, 128, 4, 3, true>>("bf16 d64 default", false, true, false, kv);
    }
    return 0;
  }
  if (g_profile) {
    printf("head group %d%s\n", g_head_group, g_head_group == 0 ? " (head_group_for)" : "");
    time_variant<__nv_bfloat16, FwdTileConfig<128, 128, 2, 2, true>>("bf16 d128 default", true, true, true);
    time_variant<__nv_bfloat16, FwdTileConfig<64, 128, 4, 3, true>>("bf16 d64 default", true, true, true);
    return 0;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs, sm_%d%d, head group %d%s\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor,
         g_head_group, g_head_group == 0 ? " (head_group_for)" : "");
  int failed = 0;
  using bf16 = __nv_bfloat16;
  // name, dtype, config (head dim, key tile, stages, consumer warpgroups, ping-pong)
#define VARIANT(T, D, N, S, W, PP) \
  failed +=                        \
      check_variant<T, FwdTileConfig<D, N, S, W, PP>>(#T " d" #D " n" #N " s" #S " wg" #W " pp" #PP, quick, timing)
#if defined(HOPPER_CHECK_D96)  // head dim 96 alone (64-byte swizzled rows): its candidates
  VARIANT(bf16, 96, 128, 2, 2, true);
  VARIANT(__half, 96, 128, 2, 2, true);
  VARIANT(bf16, 96, 128, 3, 2, true);
  VARIANT(bf16, 96, 128, 3, 3, true);
#elif defined(HOPPER_CHECK_D256)  // head dim 256 alone (one Q buffer: 64 KB): its candidates
  failed += check_variant<bf16, FwdTileConfig<256, 64, 2, 2, true, 1>>("bf16 d256 n64 s2 q1", quick, timing);
  failed += check_variant<__half, FwdTileConfig<256, 64, 2, 2, true, 1>>("fp16 d256 n64 s2 q1", quick, timing);
  failed += check_variant<bf16, FwdTileConfig<256, 80, 2, 2, true, 1>>("bf16 d256 n80 s2 q1", quick, timing);
  failed += check_variant<bf16, FwdTileConfig<256, 48, 3, 2, true, 1>>("bf16 d256 n48 s3 q1", quick, timing);
  failed += check_variant<bf16, FwdTileConfig<256, 64, 2, 2, false, 1>>("bf16 d256 n64 s2 q1 no-pp", quick, timing);
#else
  VARIANT(bf16, 128, 128, 2, 2, true);
  VARIANT(__half, 128, 128, 2, 2, true);
  VARIANT(bf16, 64, 128, 4, 3, true);
  VARIANT(__half, 64, 128, 4, 3, true);
#endif
#if !defined(HOPPER_CHECK_DEFAULTS_ONLY) && !defined(HOPPER_CHECK_D96) && !defined(HOPPER_CHECK_D256)
  failed += check_variant<bf16, FwdTileConfig<128, 128, 3, 2, true, 1>>("bf16 d128 n128 s3 wg2 pp q1", quick, timing);
  failed += check_variant<__half, FwdTileConfig<128, 128, 3, 2, true, 1>>("fp16 d128 n128 s3 wg2 pp q1", quick, timing);
  VARIANT(bf16, 64, 128, 5, 3, true);
  VARIANT(bf16, 64, 192, 3, 2, true);
  VARIANT(bf16, 128, 64, 4, 2, true);  // short sequences: 64-key tiles, four stages (192 KB)
  VARIANT(bf16, 64, 128, 4, 2, true);  // short sequences: 128-row tiles at D = 64
  VARIANT(__half, 64, 128, 4, 2, true);
#endif
#undef VARIANT
#if !defined(HOPPER_CHECK_D96) && !defined(HOPPER_CHECK_D256)
  if (timing && (g_only < 0 || g_only == 99)) {  // the static schedule under causality
    time_variant<bf16, FwdTileConfig<128, 128, 2, 2, true>>("bf16 d128 n128 s2 wg2 pptrue", true, true, false);
    time_variant<bf16, FwdTileConfig<64, 128, 4, 3, true>>("bf16 d64 n128 s4 wg3 pptrue", true, true, false);
  }
#endif
  printf("\n%-30s %-7s %-5s %-8s %9s %9s\n", "variant", "mask", "ctas", "schedule", "ms", "TFLOP/s");
  for (const Timing& t : g_timings) {
    printf("%-30s %-7s %-5d %-8s %9.3f %9.1f\n", t.name.c_str(), t.causal ? "causal" : "full", t.ctas,
           t.dynamic ? "dynamic" : "static", t.ms, t.tflops);
  }
  printf("%s: %d failed checks\n", failed ? "FAIL" : "PASS", failed);
  return failed ? 1 : 0;
}
