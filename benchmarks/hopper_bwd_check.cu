// Standalone check and timing of the sm_90a backward attention kernel (csrc/ops/cuda/hopper/),
// without torch. Build (from the repository root; CUTLASS headers from the nvidia-cutlass wheel):
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Icsrc -I"$CUTLASS_INCLUDE" -Xcompiler -fopenmp -lgomp -cudart static \
//        benchmarks/hopper_bwd_check.cu -o hopper_bwd_check
//
// (-DHOPPER_BWD_CHECK_D=64, 96, 128 or 256: that head dim's defaults alone; -DHOPPER_BWD_CHECK_TRY: with D=64's
// alternative tiles and the deterministic route's alternatives: 128-row steps at D=64, 3 stages at D=128.)
// Run: ./hopper_bwd_check [--quick] [--no-timing] [--no-check] [--only N (variant N)] [--head-group N (the
// causal key-tile order, tile_order.h)] [--q-len N (timings: N query rows, no causality)] [--seq N (timings:
// sequences of N, a batch of 16384 / N)]. For each
// kernel variant: fresh random Q, K, V, dO and grad_lse (never zeros), gradients poisoned with NaN,
// the kernel given row_shift and delta as the rows pre-pass makes them (from a float64 forward),
// then a float64 CPU reference of dQ, dK, dV over odd shapes (Q/KV in 1, 17, 97, 300, 1025;
// causal shifts -150, -5, 0, +7 and one that empties every row; GQA 4:1; transposed-view and
// padded strides): relative L2 error and max error against the largest reference value, no NaN,
// and exact zeros where the contract says 0 (dQ of rows with no visible key, dK and dV of keys no
// row sees). Then B=4 H=16 S=4096 causal and not, timed with CUDA events (3 warm-ups, median of
// 10; dq_accum's zeroing, the kernel and the dQ conversion or the dQ pass, not the rows pre-pass), TFLOP/s with
// the backward counted as 2.5 forwards and causal as half. Exit status 1 when any check fails.
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
#include "ops/cuda/hopper/bwd_kernel.cuh"

using safeattn::cuda::hopper::BwdSm90Params;
using safeattn::cuda::hopper::BwdTileConfig;
using safeattn::cuda::hopper::kBwdRowPad;

// --head-group N: at most N heads per group of the causal tile order (tile_order.h; 1: head after
// head); 0, the default, head_group_for's choice, as the extension runs. For the reference checks
// and the timings alike.
static int g_head_group = 0;
// --q-len N: time with N query rows against the 4096 keys, without causality (every CTA then
// walks N / kBlockM steps): timings at several N separate a CTA's fixed cost from a step's.
static int g_q_len = 0;

// The SM count: the backward runs one CTA per SM (BwdSm90Params::resident_ctas).
static int resident_ctas() {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return sms;
}

template <typename T, class Config>
static bool run_case(const Case& cs, std::mt19937& rng, double scale, const char* name) {
  constexpr int D = Config::kHeadDim;
  int64_t qs[3], ks[3], vs[3], dos[3], dqs[3], dks[3], dvs[3];
  const size_t qn = make_strides(cs.layout, cs.batch, cs.heads, cs.q_len, D, qs);
  const size_t kn = make_strides(cs.layout, cs.batch, cs.kv_heads, cs.kv_len, D, ks);
  const size_t vn = make_strides(cs.layout, cs.batch, cs.kv_heads, cs.kv_len, D, vs);
  const size_t don = make_strides(cs.layout == 1 ? 0 : 1, cs.batch, cs.heads, cs.q_len, D, dos);
  const size_t dqn = make_strides(1, cs.batch, cs.heads, cs.q_len, D, dqs);
  const size_t dkn = make_strides(cs.layout == 2 ? 2 : 0, cs.batch, cs.kv_heads, cs.kv_len, D, dks);
  const size_t dvn = make_strides(1, cs.batch, cs.kv_heads, cs.kv_len, D, dvs);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<T> hq(qn), hk(kn), hv(vn), hdo(don);
  for (auto* vec : {&hq, &hk, &hv, &hdo}) {
    for (auto& x : *vec) {
      x = from_f<T>(uni(rng));
    }
  }
  const int group = cs.heads / cs.kv_heads;
  const int64_t rows = int64_t{cs.batch} * cs.heads * cs.q_len;
  const int q_pad = (cs.q_len + kBwdRowPad - 1) / kBwdRowPad * kBwdRowPad;
  std::vector<float> glse(rows);
  for (auto& x : glse) {
    x = 0.5f * uni(rng);
  }

  // Forward in float64: P (kept per row), O, lse; then what the rows pre-pass gives the kernel.
  std::vector<double> P(size_t(rows) * cs.kv_len), delta_ref(rows);
  std::vector<float> row_shift(size_t(cs.batch) * cs.heads * q_pad, INFINITY);
  std::vector<float> delta(size_t(cs.batch) * cs.heads * q_pad, 0.0f);
  auto q_at = [&](int b, int h, int i, int d) { return double(to_f(hq[b * qs[0] + h * qs[1] + i * qs[2] + d])); };
  auto k_at = [&](int b, int h, int j, int d) { return double(to_f(hk[b * ks[0] + h * ks[1] + j * ks[2] + d])); };
  auto v_at = [&](int b, int h, int j, int d) { return double(to_f(hv[b * vs[0] + h * vs[1] + j * vs[2] + d])); };
  auto do_at = [&](int b, int h, int i, int d) { return double(to_f(hdo[b * dos[0] + h * dos[1] + i * dos[2] + d])); };
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int bh = 0; bh < cs.batch * cs.heads; ++bh) {
    for (int i = 0; i < cs.q_len; ++i) {
      const int b = bh / cs.heads, h = bh % cs.heads, hk_ = h / group;
      const int64_t r = int64_t{bh} * cs.q_len + i;
      double* prow = P.data() + size_t(r) * cs.kv_len;
      double m = -INFINITY;
      for (int j = 0; j < cs.kv_len; ++j) {
        if (cs.causal && j > i + cs.shift) {
          prow[j] = -INFINITY;
          continue;
        }
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += q_at(b, h, i, d) * k_at(b, hk_, j, d);
        prow[j] = dot * scale;
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
        for (int j = 0; j < cs.kv_len; ++j)
          o += prow[j] * v_at(b, hk_, j, d);
        o /= l;
        dsum += do_at(b, h, i, d) * o;
        dsum_rounded += do_at(b, h, i, d) * double(to_f(from_f<T>(float(o))));  // O as the forward wrote it
      }
      for (int j = 0; j < cs.kv_len && l > 0; ++j)
        prow[j] /= l;
      delta_ref[r] = dsum - glse[r];
      const size_t padded = size_t(bh) * q_pad + i;
      delta[padded] = float(dsum_rounded) - glse[r];
      row_shift[padded] = l > 0 ? float((m + std::log(l)) * 1.4426950408889634) : INFINITY;
    }
  }

  T *dq_in = upload(hq), *dk_in = upload(hk), *dv_in = upload(hv), *ddo = upload(hdo);
  float *dshift = upload(row_shift), *ddelta = upload(delta), *dq_accum;
  T *gq, *gk, *gv;
  const size_t dq_accum_n = size_t(cs.batch) * cs.heads * q_pad * D;
  CHECK_CUDA(cudaMalloc(&dq_accum, dq_accum_n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&gq, dqn * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&gk, dkn * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&gv, dvn * sizeof(T)));
  CHECK_CUDA(cudaMemset(dq_accum, 0, dq_accum_n * sizeof(float)));  // the caller zeroes it (bwd_params.h)
  CHECK_CUDA(cudaMemset(gq, 0xff, dqn * sizeof(T)));                // NaN in both 16-bit formats
  CHECK_CUDA(cudaMemset(gk, 0xff, dkn * sizeof(T)));
  CHECK_CUDA(cudaMemset(gv, 0xff, dvn * sizeof(T)));

  BwdSm90Params p;
  p.q = dq_in, p.k = dk_in, p.v = dv_in, p.grad_out = ddo;
  p.row_shift = dshift, p.delta = ddelta, p.dq_accum = dq_accum;
  p.grad_q = gq, p.grad_k = gk, p.grad_v = gv;
  p.q_sb = qs[0], p.q_sh = qs[1], p.q_si = qs[2];
  p.k_sb = ks[0], p.k_sh = ks[1], p.k_si = ks[2];
  p.v_sb = vs[0], p.v_sh = vs[1], p.v_si = vs[2];
  p.do_sb = dos[0], p.do_sh = dos[1], p.do_si = dos[2];
  p.dq_sb = dqs[0], p.dq_sh = dqs[1], p.dq_si = dqs[2];
  p.dk_sb = dks[0], p.dk_sh = dks[1], p.dk_si = dks[2];
  p.dv_sb = dvs[0], p.dv_sh = dvs[1], p.dv_si = dvs[2];
  p.batch = cs.batch, p.heads = cs.heads, p.kv_heads = cs.kv_heads;
  p.q_len = cs.q_len, p.kv_len = cs.kv_len;
  p.score.natural_scale = static_cast<float>(scale);
  p.score.scale = static_cast<float>(scale * 1.4426950408889634);
  p.causal = cs.causal;
  p.head_group = g_head_group;
  p.resident_ctas = resident_ctas();
  p.causal_shift = std::min<int64_t>(std::max<int64_t>(cs.shift, -int64_t{cs.q_len} - 1), cs.kv_len);
  CHECK_CUDA((safeattn::cuda::hopper::launch_bwd_config<T, Config>(p, 0)));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<T> hgq(dqn), hgk(dkn), hgv(dvn);
  CHECK_CUDA(cudaMemcpy(hgq.data(), gq, dqn * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hgk.data(), gk, dkn * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hgv.data(), gv, dvn * sizeof(T), cudaMemcpyDeviceToHost));
  for (void* ptr :
       {static_cast<void*>(dq_in), static_cast<void*>(dk_in), static_cast<void*>(dv_in), static_cast<void*>(ddo),
        static_cast<void*>(dshift), static_cast<void*>(ddelta), static_cast<void*>(dq_accum), static_cast<void*>(gq),
        static_cast<void*>(gk), static_cast<void*>(gv)}) {
    cudaFree(ptr);
  }

  // Reference gradients in float64 (dS = scale P (dP - delta), GQA summed over the group).
  GradError eq, ek, ev;
  long empty_rows = 0, unseen_keys = 0;
#pragma omp parallel for schedule(dynamic) reduction(+ : empty_rows)
  for (int bh = 0; bh < cs.batch * cs.heads; ++bh) {
    const int b = bh / cs.heads, h = bh % cs.heads, hk_ = h / group;
    GradError local;
    for (int i = 0; i < cs.q_len; ++i) {
      const int64_t r = int64_t{bh} * cs.q_len + i;
      const double* prow = P.data() + size_t(r) * cs.kv_len;
      std::vector<double> acc(D, 0.0);
      bool any = false;
      for (int j = 0; j < cs.kv_len; ++j) {
        if (prow[j] == 0.0)
          continue;
        any = true;
        double dp = 0;
        for (int d = 0; d < D; ++d)
          dp += do_at(b, h, i, d) * v_at(b, hk_, j, d);
        const double ds = scale * prow[j] * (dp - delta_ref[r]);
        for (int d = 0; d < D; ++d)
          acc[d] += ds * k_at(b, hk_, j, d);
      }
      const T* got = hgq.data() + b * dqs[0] + h * dqs[1] + i * dqs[2];
      empty_rows += !any;
      for (int d = 0; d < D; ++d) {
        if (!any) {
          local.bad_zero += !(to_f(got[d]) == 0.0f);
        } else {
          local.add(to_f(got[d]), acc[d]);
        }
      }
    }
#pragma omp critical
    {
      eq.err2 += local.err2, eq.ref2 += local.ref2, eq.nan += local.nan, eq.bad_zero += local.bad_zero;
      eq.max_abs = std::max(eq.max_abs, local.max_abs), eq.max_ref = std::max(eq.max_ref, local.max_ref);
    }
  }
#pragma omp parallel for schedule(dynamic) reduction(+ : unseen_keys)
  for (int bhk = 0; bhk < cs.batch * cs.kv_heads; ++bhk) {
    const int b = bhk / cs.kv_heads, hk_ = bhk % cs.kv_heads;
    GradError lk, lv;
    for (int j = 0; j < cs.kv_len; ++j) {
      std::vector<double> dk(D, 0.0), dv(D, 0.0);
      bool any = false;
      for (int h = hk_ * group; h < (hk_ + 1) * group; ++h) {
        for (int i = 0; i < cs.q_len; ++i) {
          const int64_t r = (int64_t{b} * cs.heads + h) * cs.q_len + i;
          const double pij = P[size_t(r) * cs.kv_len + j];
          if (pij == 0.0)
            continue;
          any = true;
          double dp = 0;
          for (int d = 0; d < D; ++d)
            dp += do_at(b, h, i, d) * v_at(b, hk_, j, d);
          const double ds = scale * pij * (dp - delta_ref[r]);
          for (int d = 0; d < D; ++d) {
            dk[d] += ds * q_at(b, h, i, d);
            dv[d] += pij * do_at(b, h, i, d);
          }
        }
      }
      const T* gotk = hgk.data() + b * dks[0] + hk_ * dks[1] + j * dks[2];
      const T* gotv = hgv.data() + b * dvs[0] + hk_ * dvs[1] + j * dvs[2];
      unseen_keys += !any;
      for (int d = 0; d < D; ++d) {
        if (!any) {
          lk.bad_zero += !(to_f(gotk[d]) == 0.0f);
          lv.bad_zero += !(to_f(gotv[d]) == 0.0f);
        } else {
          lk.add(to_f(gotk[d]), dk[d]);
          lv.add(to_f(gotv[d]), dv[d]);
        }
      }
    }
#pragma omp critical
    {
      for (auto [dst, src] : {std::pair<GradError*, GradError*>{&ek, &lk}, {&ev, &lv}}) {
        dst->err2 += src->err2, dst->ref2 += src->ref2, dst->nan += src->nan, dst->bad_zero += src->bad_zero;
        dst->max_abs = std::max(dst->max_abs, src->max_abs), dst->max_ref = std::max(dst->max_ref, src->max_ref);
      }
    }
  }
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  // P and dS are rounded to 16 bits before their products, as in every flash backward.
  const double tol_rel = bf16 ? 2e-2 : 4e-3, tol_max = bf16 ? 6e-2 : 1.5e-2;
  bool ok = true;
  for (const GradError* e : {&eq, &ek, &ev}) {
    ok = ok && e->rel() <= tol_rel && e->max_rel() <= tol_max && e->nan == 0 && e->bad_zero == 0;
  }
  printf(
      "%-4s %-22s B%d H%d/%d Q%-5d KV%-5d %s shift %-5lld layout %d: dq %.2e/%.2e dk %.2e/%.2e dv %.2e/%.2e "
      "nan %ld/%ld/%ld zero-bad %ld/%ld/%ld (empty rows %ld, unseen keys %ld)\n",
      ok ? "ok" : "FAIL", name, cs.batch, cs.heads, cs.kv_heads, cs.q_len, cs.kv_len, cs.causal ? "causal" : "full  ",
      static_cast<long long>(cs.shift), cs.layout, eq.rel(), eq.max_rel(), ek.rel(), ek.max_rel(), ev.rel(),
      ev.max_rel(), eq.nan, ek.nan, ev.nan, eq.bad_zero, ek.bad_zero, ev.bad_zero, empty_rows, unseen_keys);
  return ok;
}

static int g_only = -1, g_variant = 0;  // --only N: run variant N alone (a hang stays in its process)

struct Timing {
  std::string name;
  bool causal;
  double ms, tflops;
};
static std::vector<Timing> g_timings;
static int g_seq = 4096;  // --seq N: the timings' sequence length (batch 16384 / N)

template <typename T, class Config>
static void time_variant(const char* name, bool causal) {
  constexpr int D = Config::kHeadDim;
  const int H = 16, S = g_seq, B = 16384 / g_seq;
  const size_t n = size_t(B) * H * S * D;
  const size_t rows = size_t(B) * H * S;  // S is a multiple of kBwdRowPad: no padding
  T* buf[4];                              // q, k, v, dO
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
  // Scores of unit-uniform inputs are O(1): an lse near log(S) keeps p in range.
  fill_uniform<float><<<1024, 256>>>(shift, rows, 98, 0.5f);
  CHECK_CUDA(cudaGetLastError());
  {
    std::vector<float> h(rows);
    CHECK_CUDA(cudaMemcpy(h.data(), shift, rows * sizeof(float), cudaMemcpyDeviceToHost));
    for (auto& x : h)
      x += float(std::log2(double(S)));
    CHECK_CUDA(cudaMemcpy(shift, h.data(), rows * sizeof(float), cudaMemcpyHostToDevice));
  }
  T *gq, *gk, *gv;
  CHECK_CUDA(cudaMalloc(&gq, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&gk, n * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&gv, n * sizeof(T)));
  BwdSm90Params p;
  p.q = buf[0], p.k = buf[1], p.v = buf[2], p.grad_out = buf[3];
  p.row_shift = shift, p.delta = delta, p.dq_accum = dq_accum;
  p.grad_q = gq, p.grad_k = gk, p.grad_v = gv;
  // Transformers' layout: [B, S, H, D] storage viewed as [B, H, S, D], for inputs and gradients.
  p.q_sb = p.k_sb = p.v_sb = p.do_sb = p.dq_sb = p.dk_sb = p.dv_sb = int64_t{S} * H * D;
  p.q_sh = p.k_sh = p.v_sh = p.do_sh = p.dq_sh = p.dk_sh = p.dv_sh = D;
  p.q_si = p.k_si = p.v_si = p.do_si = p.dq_si = p.dk_si = p.dv_si = int64_t{H} * D;
  p.batch = B, p.heads = H, p.kv_heads = H, p.q_len = g_q_len > 0 ? g_q_len : S, p.kv_len = S;
  p.score.natural_scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  p.score.scale = static_cast<float>(1.4426950408889634 / std::sqrt(double(D)));
  p.causal = causal;
  p.head_group = g_head_group;
  p.resident_ctas = resident_ctas();
  p.causal_shift = 0;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i)
    CHECK_CUDA((safeattn::cuda::hopper::launch_bwd_config<T, Config>(p, 0)));
  std::vector<float> ms;
  for (int i = 0; i < 10; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    if (!Config::kDqPass) {                                         // the dQ pass has no dq_accum
      CHECK_CUDA(cudaMemsetAsync(dq_accum, 0, n * sizeof(float)));  // the rows pre-pass's share
    }
    CHECK_CUDA((safeattn::cuda::hopper::launch_bwd_config<T, Config>(p, 0)));
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double flops = 2.5 * 4.0 * B * H * double(p.q_len) * S * D * (causal ? 0.5 : 1.0);
  g_timings.push_back({name, causal, med, flops / (med * 1e-3) / 1e12});
  printf("time %-22s %s q_len %d: %.3f ms (min %.3f max %.3f) %.1f TFLOP/s\n", name, causal ? "causal" : "full  ",
         p.q_len, med, ms.front(), ms.back(), g_timings.back().tflops);
  for (int t = 0; t < 4; ++t)
    cudaFree(buf[t]);
  cudaFree(shift), cudaFree(delta), cudaFree(dq_accum), cudaFree(gq), cudaFree(gk), cudaFree(gv);
  cudaEventDestroy(start), cudaEventDestroy(stop);
}

template <typename T, class Config>
static int check_variant(const char* name, bool quick, bool check, bool timing) {
  if (g_only >= 0 && g_variant++ != g_only) {
    return 0;
  }
  constexpr int D = Config::kHeadDim;
  std::mt19937 rng(std::random_device{}());
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<Case> cases = {
      {1, 1, 1, 1, 1, false, 0, 0},       {2, 3, 3, 17, 17, false, 0, 1}, {1, 2, 2, 97, 300, false, 0, 2},
      {1, 2, 2, 300, 97, true, 0, 0},     {2, 8, 2, 97, 97, true, -5, 1},  // GQA 4:1, first 5 rows empty
      {1, 1, 1, 300, 300, true, -150, 2},                                  // whole tiles empty, others partial
      {1, 2, 2, 17, 300, true, 283, 0},                                    // bottom-right aligned (decode-like)
      {1, 2, 2, 97, 97, true, -200, 0},                                    // every row empty, no key seen
      {1, 4, 1, 300, 1025, false, 0, 1},                                   // GQA 4:1, no causality
  };
  if (!quick) {
    cases.push_back({1, 4, 1, 1025, 1025, true, 7, 1});  // GQA 4:1
    cases.push_back({1, 2, 2, 1025, 17, true, 0, 2});
    cases.push_back({1, 1, 1, 1, 1025, false, 0, 0});
  }
  int failed = 0;
  if (check) {
    for (const Case& cs : cases) {
      failed += !run_case<T, Config>(cs, rng, scale, name);
    }
  }
  if (timing) {
    time_variant<T, Config>(name, false);
    if (g_q_len == 0) {
      time_variant<T, Config>(name, true);
    }
  }
  return failed;
}

int main(int argc, char** argv) {
  bool quick = false, check = true, timing = true;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--head-group") && i + 1 < argc)
      g_head_group = atoi(argv[++i]);
    if (!strcmp(argv[i], "--q-len") && i + 1 < argc)
      g_q_len = atoi(argv[++i]);
    if (!strcmp(argv[i], "--seq") && i + 1 < argc)
      g_seq = atoi(argv[++i]);
    if (!strcmp(argv[i], "--quick"))
      quick = true;
    if (!strcmp(argv[i], "--no-timing"))
      timing = false;
    if (!strcmp(argv[i], "--no-check"))
      check = false;
    if (!strcmp(argv[i], "--only") && i + 1 < argc)
      g_only = atoi(argv[++i]);
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs, sm_%d%d, head group %d%s\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor,
         g_head_group, g_head_group == 0 ? " (head_group_for)" : "");
  int failed = 0;
  using bf16 = __nv_bfloat16;
  // name, dtype, config (head dim, query rows per step, keys per CTA, stages); DQ_PASS_VARIANT: the
  // same tiles with dQ by the dQ pass (the deterministic route, BwdSm90Params::deterministic).
#define VARIANT(T, D, M, N, S) \
  failed += check_variant<T, BwdTileConfig<D, M, N, S>>(#T " d" #D " m" #M " n" #N " s" #S, quick, check, timing)
#define DQ_PASS_VARIANT(T, D, M, N, S)                                                                              \
  failed += check_variant<T, BwdTileConfig<D, M, N, S, true>>(#T " d" #D " m" #M " n" #N " s" #S " dq-pass", quick, \
                                                              check, timing)
#if !defined(HOPPER_BWD_CHECK_D) || HOPPER_BWD_CHECK_D == 128
  VARIANT(bf16, 128, 64, 128, 2);
  VARIANT(__half, 128, 64, 128, 2);
  DQ_PASS_VARIANT(bf16, 128, 64, 128, 2);
#endif
#if !defined(HOPPER_BWD_CHECK_D) || HOPPER_BWD_CHECK_D == 64
  VARIANT(bf16, 64, 64, 128, 2);
  VARIANT(__half, 64, 64, 128, 2);
  DQ_PASS_VARIANT(bf16, 64, 64, 128, 2);
#endif
#if defined(HOPPER_BWD_CHECK_D) && HOPPER_BWD_CHECK_D == 96
  VARIANT(bf16, 96, 64, 128, 2);
  VARIANT(__half, 96, 64, 128, 2);
  DQ_PASS_VARIANT(bf16, 96, 64, 128, 2);
#endif
#if defined(HOPPER_BWD_CHECK_D) && HOPPER_BWD_CHECK_D == 256
  // 64 keys shared by both consumer warpgroups, dQ by its own pass (DefaultBwdConfig<256>).
  VARIANT(bf16, 256, 64, 64, 2);
  VARIANT(__half, 256, 64, 64, 2);
#endif
#if defined(HOPPER_BWD_CHECK_TRY) && (!defined(HOPPER_BWD_CHECK_D) || HOPPER_BWD_CHECK_D == 64)
  // Tried for D=64's backward (-DHOPPER_BWD_CHECK_TRY): 128 query rows a step (48 bytes of
  // spills) and 3 stages. H100, B4 H16 S4096 causal: 0.981 and 0.952-0.962 ms against the
  // default's 0.947-0.951: neither helps (notes_attention_cuda.md, "Hopper backward").
  VARIANT(bf16, 64, 128, 128, 2);
  VARIANT(bf16, 64, 64, 128, 3);
  // The deterministic route's dK/dV kernel with 128 query rows a step: without the dQ product, S^T
  // and dP^T of 128 rows fit beside dK and dV at D=64 (no masks: their summaries have 64-row tiles).
  DQ_PASS_VARIANT(bf16, 64, 128, 128, 2);
#endif
#if defined(HOPPER_BWD_CHECK_TRY) && (!defined(HOPPER_BWD_CHECK_D) || HOPPER_BWD_CHECK_D == 128)
  // The deterministic route's dK/dV kernel with a third Q/dO stage (without the dQ product's stage
  // buffers the shared memory has room for one).
  DQ_PASS_VARIANT(bf16, 128, 64, 128, 3);
#endif
#undef VARIANT
#undef DQ_PASS_VARIANT
  printf("\n%-24s %-7s %9s %9s\n", "variant", "mask", "ms", "TFLOP/s");
  for (const Timing& t : g_timings) {
    printf("%-24s %-7s %9.3f %9.1f\n", t.name.c_str(), t.causal ? "causal" : "full", t.ms, t.tflops);
  }
  printf("%s: %d failed checks\n", failed ? "FAIL" : "PASS", failed);
  return failed ? 1 : 0;
}
