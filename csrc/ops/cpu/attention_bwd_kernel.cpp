// CPU backward of safeattn::attention, compiled once per ISA (see common/isa_dispatch.h).
//
// A task is one (batch, kv-head): it packs what it reads (K, K^T, V, and the group's Q, Q^T,
// dO, dO^T in float32), and owns dK and dV of that head and dQ (and the mask gradient's partial
// sums) of the query heads of its group, so nothing is written by two tasks: no atomics, the
// result does not depend on the thread count, and the whole backward is one parallel region.
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
#include <c10/core/ScalarType.h>

#include "ops/cpu/attention_common.h"

namespace safeattn::cpu {
namespace {

constexpr int64_t kQBlock = 64;
constexpr int64_t kKvBlock = 128;

// dst[r * ld_dst + c] = src[r * stride_r + c * stride_c] for r < rows, c < cols, converted.
template <typename acc_t, typename scalar_t>
void pack(acc_t* dst, int64_t ld_dst, const scalar_t* src, int64_t stride_r, int64_t stride_c, int64_t rows,
          int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      dst[r * ld_dst + c] = static_cast<acc_t>(src[r * stride_r + c * stride_c]);
    }
  }
}

template <typename scalar_t>
void attention_bwd_typed(const AttentionBwdArgs& a) {
  using acc_t = acc_of<scalar_t>;
  using Vec = Vectorized<acc_t>;
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t head_dim = a.query.size(3);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2), dv = a.value.size(3);
  const int64_t group = hq / hkv;

  const at::Tensor &query = a.query, &key = a.key, &value = a.value, &grad_out = a.grad_out, &out = a.out;
  const scalar_t* q_src = query.const_data_ptr<scalar_t>();
  const scalar_t* k_src = key.const_data_ptr<scalar_t>();
  const scalar_t* v_src = value.const_data_ptr<scalar_t>();
  const scalar_t* go_src = grad_out.const_data_ptr<scalar_t>();
  const scalar_t* out_src = out.const_data_ptr<scalar_t>();
  const acc_t* lse_ptr = a.lse.const_data_ptr<acc_t>();
  const acc_t* lse_lo_ptr = a.lse_lo.const_data_ptr<acc_t>();
  // grad_lse may be any float dtype and strides: read it as acc through a converted copy (tiny).
  const at::Tensor grad_lse =
      a.grad_lse.defined() ? a.grad_lse.to(c10::CppTypeToScalarType<acc_t>::value).contiguous() : at::Tensor();
  const acc_t* glse_ptr = grad_lse.defined() ? grad_lse.const_data_ptr<acc_t>() : nullptr;
  scalar_t* gq = a.grad_query.data_ptr<scalar_t>();
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
    // Per task, packed in acc: the group's Q, Q^T, dO, dO^T, Delta, lse and dQ^T accumulator;
    // the kv-head's K, K^T, V. Tile columns are padded to whole vectors; padding columns hold
    // junk that no GEMM reads.
    const int64_t ld = round_up(kQBlock, Vec::size());
    std::vector<acc_t> q_rows(group * q_len * head_dim), q_cols(group * head_dim * q_len);
    std::vector<acc_t> go_rows(group * q_len * dv), go_cols(group * dv * q_len);
    std::vector<acc_t> delta(group * q_len), lse(group * q_len), lse_lo(group * q_len);
    std::vector<acc_t> dq_cols(group * head_dim * q_len);
    std::vector<acc_t> k_rows(kv_len * head_dim), k_cols(head_dim * kv_len), v_rows(kv_len * dv);
    std::vector<acc_t> st(kKvBlock * ld), dpt(kKvBlock * ld), tanh_t(softcap > 0 ? kKvBlock * ld : 0);
    std::vector<acc_t> dk(kKvBlock * head_dim), dvb(kKvBlock * dv);
    std::vector<acc_t> lse_tile(ld), lse_lo_tile(ld), delta_tile(ld);
    std::vector<acc_t> mask_tile(mask.kind != MaskKind::kNone ? kKvBlock * ld : 0);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t b = task / hkv, hk = task % hkv;
      pack(k_rows.data(), head_dim, k_src + b * key.stride(0) + hk * key.stride(1), key.stride(2), key.stride(3),
           kv_len, head_dim);
      pack(k_cols.data(), kv_len, k_src + b * key.stride(0) + hk * key.stride(1), key.stride(3), key.stride(2),
           head_dim, kv_len);
      pack(v_rows.data(), dv, v_src + b * value.stride(0) + hk * value.stride(1), value.stride(2), value.stride(3),
           kv_len, dv);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        const scalar_t* qh = q_src + b * query.stride(0) + h * query.stride(1);
        const scalar_t* goh = go_src + b * grad_out.stride(0) + h * grad_out.stride(1);
        const scalar_t* oh = out_src + b * out.stride(0) + h * out.stride(1);
        pack(q_rows.data() + g * q_len * head_dim, head_dim, qh, query.stride(2), query.stride(3), q_len, head_dim);
        pack(q_cols.data() + g * head_dim * q_len, q_len, qh, query.stride(3), query.stride(2), head_dim, q_len);
        pack(go_rows.data() + g * q_len * dv, dv, goh, grad_out.stride(2), grad_out.stride(3), q_len, dv);
        pack(go_cols.data() + g * dv * q_len, q_len, goh, grad_out.stride(3), grad_out.stride(2), dv, q_len);
        for (int64_t i = 0; i < q_len; ++i) {
          // Delta_i = sum_d dO[i, d] O[i, d] - dlse_i: the row term of the softmax backward (a
          // gradient flowing into lse adds p_ij * dlse_i to every score's gradient).
          const acc_t* go_row = go_rows.data() + (g * q_len + i) * dv;
          acc_t sum = 0;
          for (int64_t d = 0; d < dv; ++d) {
            sum += go_row[d] * static_cast<acc_t>(oh[i * out.stride(2) + d * out.stride(3)]);
          }
          const int64_t row = (b * hq + h) * q_len + i;
          delta[g * q_len + i] = glse_ptr != nullptr ? sum - glse_ptr[row] : sum;
          // No visible key and no sink: lse = -inf; use +inf so that every p is exactly 0.
          const acc_t l = lse_ptr[row];
          lse[g * q_len + i] = l == kNegInf<acc_t> ? std::numeric_limits<acc_t>::infinity() : l;
          lse_lo[g * q_len + i] = l == kNegInf<acc_t> ? acc_t(0) : lse_lo_ptr[row];
        }
      }
      std::fill(dq_cols.begin(), dq_cols.end(), acc_t(0));

      for (int64_t j0 = 0; j0 < kv_len; j0 += kKvBlock) {
        const int64_t n = std::min(kKvBlock, kv_len - j0);
        std::fill(dk.begin(), dk.end(), acc_t(0));
        std::fill(dvb.begin(), dvb.end(), acc_t(0));
        // Query tiles entirely above the diagonal see none of these keys: start below it.
        const int64_t first_i = causal ? clamp_to(j0 - diagonal, 0, q_len) : 0;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hk * group + g;
          const acc_t* qr = q_rows.data() + g * q_len * head_dim;
          const acc_t* qc = q_cols.data() + g * head_dim * q_len;
          const acc_t* gor = go_rows.data() + g * q_len * dv;
          const acc_t* goc = go_cols.data() + g * dv * q_len;
          acc_t* dqc = dq_cols.data() + g * head_dim * q_len;
          const int64_t i_start = first_i / kQBlock * kQBlock;
          if (gm != nullptr && a.grad_mask_assign) {
            // Assigned, not accumulated: the rows no tile visits must still be written.
            acc_t* gm_head = gm + (b * gm_heads + h) * gm_q * gm_kv;
            for (int64_t i = 0; i < i_start; ++i) {
              std::fill(gm_head + i * gm_kv + j0, gm_head + i * gm_kv + j0 + n, acc_t(0));
            }
          }
          for (int64_t i0 = i_start; i0 < q_len; i0 += kQBlock) {
            const int64_t m = std::min(kQBlock, q_len - i0);
            const int64_t m_pad = round_up(m, Vec::size());
            for (int64_t c = 0; c < ld; ++c) {
              lse_tile[c] = c < m ? lse[g * q_len + i0 + c] : acc_t(0);
              lse_lo_tile[c] = c < m ? lse_lo[g * q_len + i0 + c] : acc_t(0);
              delta_tile[c] = c < m ? delta[g * q_len + i0 + c] : acc_t(0);
            }
            gemm(n, m, head_dim, k_rows.data() + j0 * head_dim, head_dim, qc + i0, q_len, st.data(), ld, false);
            gemm(n, m, dv, v_rows.data() + j0 * dv, dv, goc + i0, q_len, dpt.data(), ld, false);
            if (mask.kind != MaskKind::kNone) {
              stage_mask_transposed(mask_tile.data(), ld, mask, mask.offset(b, h, i0, j0), m, n);
            }
            for (int64_t r = 0; r < n; ++r) {
              const int64_t j = j0 + r;
              acc_t* s = st.data() + r * ld;
              acc_t* dp = dpt.data() + r * ld;
              acc_t* th = softcap > 0 ? tanh_t.data() + r * ld : nullptr;
              scale_scores<acc_t>(s, m_pad, scale, softcap, th);
              if (mask.kind != MaskKind::kNone) {
                add_staged_mask(s, mask_tile.data() + r * ld, m_pad);
              }
              if (causal) {
                // Queries i < j - diagonal do not see key j.
                const int64_t hidden = clamp_to(j - diagonal - i0, 0, m);
                std::fill(s, s + hidden, kNegInf<acc_t>);
              }
              // P^T then dS^T, in place: s holds p, dp holds ds. (s - lse) - lse_lo: lse_lo is
              // what lse lost to rounding, and subtracting it last keeps it.
              for (int64_t c = 0; c < m_pad; c += Vec::size()) {
                const Vec p = exp_keep_nan((Vec::loadu(s + c) - Vec::loadu(lse_tile.data() + c)) -
                                           Vec::loadu(lse_lo_tile.data() + c));
                p.store(s + c);
                (p * (Vec::loadu(dp + c) - Vec::loadu(delta_tile.data() + c))).store(dp + c);
              }
            }
            if (gm != nullptr) {
              // The mask gradient is dS; written along the mask's rows (contiguous).
              const int64_t head_slot = gm_heads == hq ? h : hk;
              acc_t* gm_head = gm + (b * gm_heads + head_slot) * gm_q * gm_kv;
              for (int64_t c = 0; c < m; ++c) {
                acc_t* gm_row = gm_head + (gm_q == 1 ? 0 : i0 + c) * gm_kv;
                if (gm_kv == 1) {
                  acc_t sum = 0;
                  for (int64_t r = 0; r < n; ++r) {
                    sum += dpt[r * ld + c];
                  }
                  // Assigned when this is the only key (KV == 1: one tile, one contribution).
                  gm_row[0] = a.grad_mask_assign ? sum : gm_row[0] + sum;
                } else if (a.grad_mask_assign) {
                  for (int64_t r = 0; r < n; ++r) {
                    gm_row[j0 + r] = dpt[r * ld + c];
                  }
                } else {
                  for (int64_t r = 0; r < n; ++r) {
                    gm_row[j0 + r] += dpt[r * ld + c];
                  }
                }
              }
            }
            // dS' = dS * scale (* (1 - tanh^2) with softcap): the gradient of the raw q.k.
            for (int64_t r = 0; r < n; ++r) {
              acc_t* dp = dpt.data() + r * ld;
              if (softcap > 0) {
                const acc_t* th = tanh_t.data() + r * ld;
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
            gemm(n, dv, m, st.data(), ld, gor + i0 * dv, dv, dvb.data(), dv, true);
            gemm(n, head_dim, m, dpt.data(), ld, qr + i0 * head_dim, head_dim, dk.data(), head_dim, true);
            gemm(head_dim, m, n, k_cols.data() + j0, kv_len, dpt.data(), ld, dqc + i0, q_len, true);
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
      for (int64_t g = 0; g < group; ++g) {
        const acc_t* dqc = dq_cols.data() + g * head_dim * q_len;
        scalar_t* dst = gq + (b * hq + hk * group + g) * q_len * head_dim;
        for (int64_t i = 0; i < q_len; ++i) {
          for (int64_t d = 0; d < head_dim; ++d) {
            dst[i * head_dim + d] = static_cast<scalar_t>(dqc[d * q_len + i]);
          }
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
