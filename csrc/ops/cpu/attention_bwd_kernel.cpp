// CPU backward of safeattn::attention, compiled once per ISA (see common/isa_dispatch.h).
//
// A task is one (batch, kv-head): it owns dK and dV of that head and dQ (and the mask
// gradient's partial sums) of the query heads of its group, so nothing is written by two
// tasks: no atomics, and the result does not depend on the thread count.
// The task walks key tiles (kKvBlock) and, inside, every query head of the group and query
// tiles (kQBlock). Probabilities are recomputed from lse; the tiles are kept transposed
// (keys along rows, queries along columns) so that every product is a row-major GEMM and the
// per-query terms (lse, Delta) are vectors along a row:
//   S^T  = K[tile] @ Q^T[:, qtile]           P^T = exp(scores(S^T) - lse)
//   dP^T = V[tile] @ dO^T[:, qtile]          dS^T = P^T * (dP^T - Delta)
//   dV[tile] += P^T @ dO[qtile]              dK[tile] += scale * dS'^T @ Q[qtile]
//   dQ^T[:, qtile] += scale * K^T[:, tile] @ dS'^T
// where dS' is dS times the softcap derivative (1 - tanh^2); the mask gradient is dS.
// A row with lse = -inf (no visible key, no sink) uses lse = +inf: every p is 0, so its
// gradients are 0 rather than NaN.
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "ops/cpu/attention_common.h"

namespace safeattn::cpu {
namespace {

constexpr int64_t kQBlock = 64;
constexpr int64_t kKvBlock = 128;

template <typename scalar_t>
void attention_bwd_typed(const AttentionBwdArgs& a) {
  using acc_t = acc_of<scalar_t>;
  using Vec = Vectorized<acc_t>;
  const int64_t batch = a.query_acc.size(0), hq = a.query_acc.size(1), q_len = a.query_acc.size(2);
  const int64_t head_dim = a.query_acc.size(3);
  const int64_t hkv = a.key_acc.size(1), kv_len = a.key_acc.size(2), dv = a.value_acc.size(3);
  const int64_t group = hq / hkv;

  const acc_t* q = a.query_acc.const_data_ptr<acc_t>();
  const acc_t* qt = a.query_t.const_data_ptr<acc_t>();
  const acc_t* k = a.key_acc.const_data_ptr<acc_t>();
  const acc_t* kt = a.key_t.const_data_ptr<acc_t>();
  const acc_t* v = a.value_acc.const_data_ptr<acc_t>();
  const acc_t* go = a.grad_out_acc.const_data_ptr<acc_t>();
  const acc_t* got = a.grad_out_t.const_data_ptr<acc_t>();
  const acc_t* lse_ptr = a.lse.const_data_ptr<acc_t>();
  const acc_t* delta_ptr = a.delta.const_data_ptr<acc_t>();
  acc_t* gqt = a.grad_query_t.data_ptr<acc_t>();
  scalar_t* gk = a.grad_key.data_ptr<scalar_t>();
  scalar_t* gv = a.grad_value.data_ptr<scalar_t>();
  const MaskView mask(a.mask);
  acc_t* gm = a.grad_mask_partial.defined() ? a.grad_mask_partial.data_ptr<acc_t>() : nullptr;
  const int64_t gm_heads = gm ? a.grad_mask_partial.size(1) : 0;
  const int64_t gm_q = gm ? a.grad_mask_partial.size(2) : 0;
  const int64_t gm_kv = gm ? a.grad_mask_partial.size(3) : 0;

  const acc_t scale = static_cast<acc_t>(a.scale);
  const acc_t softcap = static_cast<acc_t>(a.softcap);
  const bool causal = a.is_causal;
  const int64_t diagonal = a.q_offset - a.kv_offset;  // key j visible to query i iff j <= i + diagonal

  at::parallel_for(0, batch * hkv, 1, [&](int64_t task_begin, int64_t task_end) {
    // Columns padded to whole vectors; padding columns hold junk that no GEMM reads.
    const int64_t ld = round_up(kQBlock, Vec::size());
    std::vector<acc_t> st(kKvBlock * ld), dpt(kKvBlock * ld), tanh_t(softcap > 0 ? kKvBlock * ld : 0);
    std::vector<acc_t> dk(kKvBlock * head_dim), dvb(kKvBlock * dv);
    std::vector<acc_t> lse_tile(ld), delta_tile(ld);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t b = task / hkv, hk = task % hkv;
      const acc_t* k_bh = k + (b * hkv + hk) * kv_len * head_dim;
      const acc_t* kt_bh = kt + (b * hkv + hk) * head_dim * kv_len;
      const acc_t* v_bh = v + (b * hkv + hk) * kv_len * dv;
      for (int64_t j0 = 0; j0 < kv_len; j0 += kKvBlock) {
        const int64_t n = std::min(kKvBlock, kv_len - j0);
        std::fill(dk.begin(), dk.end(), acc_t(0));
        std::fill(dvb.begin(), dvb.end(), acc_t(0));
        // Query tiles entirely above the diagonal see none of these keys: start below it.
        const int64_t first_i = causal ? clamp_to(j0 - diagonal, 0, q_len) : 0;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hk * group + g;
          const int64_t bh = b * hq + h;
          for (int64_t i0 = first_i / kQBlock * kQBlock; i0 < q_len; i0 += kQBlock) {
            const int64_t m = std::min(kQBlock, q_len - i0);
            const int64_t m_pad = round_up(m, Vec::size());
            for (int64_t c = 0; c < ld; ++c) {
              const bool inside = c < m;
              const acc_t l = inside ? lse_ptr[bh * q_len + i0 + c] : acc_t(0);
              lse_tile[c] = l == kNegInf<acc_t> ? std::numeric_limits<acc_t>::infinity() : l;
              delta_tile[c] = inside ? delta_ptr[bh * q_len + i0 + c] : acc_t(0);
            }
            gemm(n, m, head_dim, k_bh + j0 * head_dim, head_dim, qt + bh * head_dim * q_len + i0, q_len, st.data(),
                 ld, false);
            gemm(n, m, dv, v_bh + j0 * dv, dv, got + bh * dv * q_len + i0, q_len, dpt.data(), ld, false);
            for (int64_t r = 0; r < n; ++r) {
              const int64_t j = j0 + r;
              acc_t* s = st.data() + r * ld;
              acc_t* dp = dpt.data() + r * ld;
              acc_t* th = softcap > 0 ? tanh_t.data() + r * ld : nullptr;
              scale_scores<acc_t>(s, m, scale, softcap, th);
              if (mask.kind != MaskKind::kNone) {
                apply_mask_run(s, m, mask, mask.offset(b, h, i0, j), mask.stride_q);
              }
              if (causal) {
                // Queries i < j - diagonal do not see key j.
                const int64_t hidden = clamp_to(j - diagonal - i0, 0, m);
                std::fill(s, s + hidden, kNegInf<acc_t>);
              }
              // P^T then dS^T, in place: s holds p, dp holds ds.
              for (int64_t c = 0; c < m_pad; c += Vec::size()) {
                const Vec p = exp_keep_nan(Vec::loadu(s + c) - Vec::loadu(lse_tile.data() + c));
                p.store(s + c);
                (p * (Vec::loadu(dp + c) - Vec::loadu(delta_tile.data() + c))).store(dp + c);
              }
              if (gm != nullptr) {
                const int64_t head_slot = gm_heads == hq ? h : hk;
                acc_t* gm_row = gm + ((b * gm_heads + head_slot) * gm_q) * gm_kv + (gm_kv == 1 ? 0 : j);
                for (int64_t c = 0; c < m; ++c) {
                  gm_row[(gm_q == 1 ? 0 : i0 + c) * gm_kv] += dp[c];
                }
              }
              if (softcap > 0) {
                for (int64_t c = 0; c < m_pad; c += Vec::size()) {
                  const Vec t = Vec::loadu(th + c);
                  (Vec::loadu(dp + c) * (Vec(acc_t(1)) - t * t) * Vec(scale)).store(dp + c);
                }
              } else {
                for (int64_t c = 0; c < m_pad; c += Vec::size()) {
                  (Vec::loadu(dp + c) * Vec(scale)).store(dp + c);
                }
              }
            }
            gemm(n, dv, m, st.data(), ld, go + (bh * q_len + i0) * dv, dv, dvb.data(), dv, true);
            gemm(n, head_dim, m, dpt.data(), ld, q + (bh * q_len + i0) * head_dim, head_dim, dk.data(), head_dim,
                 true);
            gemm(head_dim, m, n, kt_bh + j0, kv_len, dpt.data(), ld, gqt + bh * head_dim * q_len + i0, q_len, true);
          }
        }
        scalar_t* gk_tile = gk + ((b * hkv + hk) * kv_len + j0) * head_dim;
        scalar_t* gv_tile = gv + ((b * hkv + hk) * kv_len + j0) * dv;
        for (int64_t e = 0; e < n * head_dim; ++e) {
          gk_tile[e] = static_cast<scalar_t>(dk[e]);
        }
        for (int64_t e = 0; e < n * dv; ++e) {
          gv_tile[e] = static_cast<scalar_t>(dvb[e]);
        }
      }
    }
  });
}

void attention_bwd_kernel(const AttentionBwdArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.grad_key.scalar_type(), "attention_bwd_cpu",
                                  [&] { attention_bwd_typed<scalar_t>(args); });
}

}  // namespace

SAFEATTN_REGISTER_ISA_KERNEL(attention_bwd_cpu_stub, &attention_bwd_kernel);

}  // namespace safeattn::cpu
