// CPU backward of safeattn::attention, compiled once per ISA (see common/isa_dispatch.h).
//
// A task is one (batch, kv-head): it packs what it reads (K, V and the group's Q and dO, in the
// layouts its GEMMs want), and owns dK and dV of that head and dQ (and the mask gradient's
// partial sums) of the query heads of its group, so nothing is written by two tasks: no atomics,
// the result does not depend on the thread count, and the whole backward is one parallel region.
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
//
// The five GEMMs run one of two ways, chosen per call (as in the forward, attention_common.h):
//   FloatTiles  in the accumulation type, every operand converted once per task;
//   LowpTiles   bf16 / fp16 products with float32 accumulation on CPUs that have them: the
//               right operands packed once per task in the VNNI layout, P^T and dS'^T rounded to
//               the input type per tile (as FlashAttention does), the accumulators float32.
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include "ops/cpu/attention_common.h"

namespace safeattn::cpu {
namespace {

constexpr int64_t kQBlock = 64;  // one VNNI column block: the query tile of the lowp products
constexpr int64_t kKvBlock = 128;

struct BwdShape {
  int64_t q_len, head_dim, kv_len, dv, group;
  int64_t q_pad;  // q_len rounded up to kQBlock: the row stride of the dQ^T accumulator
};

// The strided source rows of one (batch, head): element (i, d) at ptr[i * row + d * col].
template <typename scalar_t>
struct Rows {
  const scalar_t* ptr;
  int64_t row, col;
};

template <typename scalar_t>
Rows<scalar_t> head_rows(const at::Tensor& t, int64_t b, int64_t h) {
  return {t.const_data_ptr<scalar_t>() + b * t.stride(0) + h * t.stride(1), t.stride(2), t.stride(3)};
}

// Operands in the accumulation type, packed per task: K, K^T, V and the group's Q, Q^T, dO, dO^T.
template <typename scalar_t>
class FloatTiles {
 public:
  using acc_t = acc_of<scalar_t>;

  explicit FloatTiles(const BwdShape& s)
      : s_(s),
        q_rows_(s.group * s.q_len * s.head_dim),
        q_cols_(s.group * s.head_dim * s.q_len),
        go_rows_(s.group * s.q_len * s.dv),
        go_cols_(s.group * s.dv * s.q_len),
        k_rows_(s.kv_len * s.head_dim),
        k_cols_(s.head_dim * s.kv_len),
        v_rows_(s.kv_len * s.dv) {}

  void pack_kv(Rows<scalar_t> k, Rows<scalar_t> v) {
    pack_rows(k_rows_.data(), s_.head_dim, k.ptr, k.row, k.col, s_.kv_len, s_.head_dim, s_.head_dim);
    pack_rows(k_cols_.data(), s_.kv_len, k.ptr, k.col, k.row, s_.head_dim, s_.kv_len, s_.kv_len);
    pack_rows(v_rows_.data(), s_.dv, v.ptr, v.row, v.col, s_.kv_len, s_.dv, s_.dv);
  }

  void pack_head(int64_t g, Rows<scalar_t> q, Rows<scalar_t> go) {
    const int64_t Q = s_.q_len, D = s_.head_dim, Dv = s_.dv;
    pack_rows(q_rows_.data() + g * Q * D, D, q.ptr, q.row, q.col, Q, D, D);
    pack_rows(q_cols_.data() + g * D * Q, Q, q.ptr, q.col, q.row, D, Q, Q);
    pack_rows(go_rows_.data() + g * Q * Dv, Dv, go.ptr, go.row, go.col, Q, Dv, Dv);
    pack_rows(go_cols_.data() + g * Dv * Q, Q, go.ptr, go.col, go.row, Dv, Q, Q);
  }

  // S^T and dP^T of keys [j0, j0 + n) and the m queries from i0 of head g (row stride ld).
  void scores(int64_t g, int64_t j0, int64_t n, int64_t i0, int64_t m, acc_t* st, acc_t* dpt, int64_t ld) const {
    const int64_t Q = s_.q_len, D = s_.head_dim, Dv = s_.dv;
    gemm(n, m, D, k_rows_.data() + j0 * D, D, q_cols_.data() + g * D * Q + i0, Q, st, ld, false);
    gemm(n, m, Dv, v_rows_.data() + j0 * Dv, Dv, go_cols_.data() + g * Dv * Q + i0, Q, dpt, ld, false);
  }

  // dV += P^T dO, dK += dS'^T Q, dQ^T += K^T dS'^T (dq: head g's dQ^T, row stride q_pad).
  void accumulate(int64_t g, int64_t j0, int64_t n, int64_t i0, int64_t m, const acc_t* pt, const acc_t* dst,
                  int64_t ld, acc_t* dk, acc_t* dv, acc_t* dq) const {
    const int64_t Q = s_.q_len, D = s_.head_dim, Dv = s_.dv;
    gemm(n, Dv, m, pt, ld, go_rows_.data() + (g * Q + i0) * Dv, Dv, dv, Dv, true);
    gemm(n, D, m, dst, ld, q_rows_.data() + (g * Q + i0) * D, D, dk, D, true);
    gemm(D, m, n, k_cols_.data() + j0, s_.kv_len, dst, ld, dq + i0, s_.q_pad, true);
  }

  void release_thread() const {}

 private:
  BwdShape s_;
  std::vector<acc_t> q_rows_, q_cols_, go_rows_, go_cols_, k_rows_, k_cols_, v_rows_;
};

#if defined(SAFEATTN_LOWP_TILES)
// Operands in the input type (bf16 / fp16), per task; "pairs along x" is the VNNI layout of
// attention_common.h with x the reduction dimension, d2 / dv2 the head dims rounded up to even:
//   K rows [KV][d2], V rows [KV][dv2]        left operands of S^T and dP^T
//   K^T [D][kv_pad] (kv_pad: KV up to kKeyGrain) left operand of dQ^T
//   Q^T, dO^T: pairs along the head dim, 64-query blocks     right operands of S^T, dP^T
//   Q, dO: pairs along the queries (q_pad rows), 64-column blocks  right operands of dK, dV
// and per tile P^T, dS'^T rounded (left operands of dV, dK) and dS'^T paired along the keys
// (right operand of dQ^T). Reductions over queries and keys run over whole kKeyGrain groups;
// the rows and columns past the tile are zeros of these buffers, never other keys' data.
template <typename scalar_t>
class LowpTiles {
 public:
  using acc_t = float;
  static constexpr int64_t kKeyGrain = 32;

  explicit LowpTiles(const BwdShape& s)
      : s_(s),
        d2_(round_up(s.head_dim, 2)),
        dv2_(round_up(s.dv, 2)),
        d_cols_(round_up(s.head_dim, kVnniCols)),
        dv_cols_(round_up(s.dv, kVnniCols)),
        kv_pad_(round_up(s.kv_len, kKeyGrain)),
        k_rows_(s.kv_len * d2_),
        v_rows_(s.kv_len * dv2_),
        k_cols_(s.head_dim * kv_pad_),
        q_t_(s.group * s.q_pad * d2_),
        go_t_(s.group * s.q_pad * dv2_),
        q_pairs_(s.group * s.q_pad * d_cols_),
        go_pairs_(s.group * s.q_pad * dv_cols_),
        pt_(kKvBlock * kQBlock),
        dst_(kKvBlock * kQBlock),
        dst_pairs_(kKvBlock * kQBlock) {}

  void pack_kv(Rows<scalar_t> k, Rows<scalar_t> v) {
    pack_rows(k_rows_.data(), d2_, k.ptr, k.row, k.col, s_.kv_len, s_.head_dim, d2_);
    pack_rows(v_rows_.data(), dv2_, v.ptr, v.row, v.col, s_.kv_len, s_.dv, dv2_);
    pack_rows(k_cols_.data(), kv_pad_, k.ptr, k.col, k.row, s_.head_dim, s_.kv_len, kv_pad_);
  }

  void pack_head(int64_t g, Rows<scalar_t> q, Rows<scalar_t> go) {
    const int64_t Q = s_.q_len, Qp = s_.q_pad;
    // B[d][i] = Q[i][d] and B[i][d] = Q[i][d] (likewise dO).
    pack_vnni(q_t_.data() + g * Qp * d2_, d2_ * kVnniCols, q.ptr, q.col, q.row, s_.head_dim, d2_, Q, Qp);
    pack_vnni(go_t_.data() + g * Qp * dv2_, dv2_ * kVnniCols, go.ptr, go.col, go.row, s_.dv, dv2_, Q, Qp);
    pack_vnni(q_pairs_.data() + g * Qp * d_cols_, Qp * kVnniCols, q.ptr, q.row, q.col, Q, Qp, s_.head_dim, d_cols_);
    pack_vnni(go_pairs_.data() + g * Qp * dv_cols_, Qp * kVnniCols, go.ptr, go.row, go.col, Q, Qp, s_.dv, dv_cols_);
  }

  // All kQBlock columns are computed (the queries past m: zero rows of Q^T and dO^T).
  void scores(int64_t g, int64_t j0, int64_t n, int64_t i0, int64_t /*m*/, float* st, float* dpt, int64_t ld) const {
    const int64_t Qp = s_.q_pad;
    gemm_vnni(n, kQBlock, d2_, k_rows_.data() + j0 * d2_, d2_, q_t_.data() + g * Qp * d2_ + i0 * d2_, d2_ * kVnniCols,
              st, ld, false);
    gemm_vnni(n, kQBlock, dv2_, v_rows_.data() + j0 * dv2_, dv2_, go_t_.data() + g * Qp * dv2_ + i0 * dv2_,
              dv2_ * kVnniCols, dpt, ld, false);
  }

  void accumulate(int64_t g, int64_t j0, int64_t n, int64_t i0, int64_t m, const float* pt, const float* dst,
                  int64_t ld, float* dk, float* dv, float* dq) {
    const int64_t Qp = s_.q_pad;
    const int64_t m_pad = round_up(m, kKeyGrain), n_pad = round_up(n, kKeyGrain);
    for (int64_t r = 0; r < n; ++r) {
      round_row(pt_.data() + r * kQBlock, pt + r * ld, m, m_pad);
      round_row(dst_.data() + r * kQBlock, dst + r * ld, m, m_pad);
    }
    // Its columns past m reach only dQ^T's columns past q_len (the accumulator's padding).
    pack_vnni_tile(dst_pairs_.data(), dst, ld, n, n_pad);
    // Rows i0 .. i0 + m_pad of the query-paired operands: pair i0 / 2 of every column block.
    gemm_vnni(n, s_.dv, m_pad, pt_.data(), kQBlock, go_pairs_.data() + g * Qp * dv_cols_ + i0 * kVnniCols,
              Qp * kVnniCols, dv, s_.dv, true);
    gemm_vnni(n, s_.head_dim, m_pad, dst_.data(), kQBlock, q_pairs_.data() + g * Qp * d_cols_ + i0 * kVnniCols,
              Qp * kVnniCols, dk, s_.head_dim, true);
    gemm_vnni(s_.head_dim, kQBlock, n_pad, k_cols_.data() + j0, kv_pad_, dst_pairs_.data(), 0, dq + i0, Qp, true);
  }

  void release_thread() const {
    release_lowp_tiles();
  }

 private:
  BwdShape s_;
  int64_t d2_, dv2_, d_cols_, dv_cols_, kv_pad_;
  std::vector<scalar_t> k_rows_, v_rows_, k_cols_, q_t_, go_t_, q_pairs_, go_pairs_;
  std::vector<scalar_t> pt_, dst_, dst_pairs_;
};
#endif

template <typename scalar_t, typename Tiles>
void attention_run(const AttentionBwdArgs& a) {
  using acc_t = typename Tiles::acc_t;
  using Vec = Vectorized<acc_t>;
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t head_dim = a.query.size(3);
  const int64_t hkv = a.key.size(1), kv_len = a.key.size(2), dv = a.value.size(3);
  const int64_t group = hq / hkv;
  const BwdShape shape{q_len, head_dim, kv_len, dv, group, round_up(q_len, kQBlock)};
  const int64_t q_pad = shape.q_pad;

  const at::Tensor &grad_out = a.grad_out, &out = a.out;
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
  TORCH_INTERNAL_ASSERT(
      a.grad_mask_write != GradMaskWrite::kSumBroadcast && a.grad_mask_write != GradMaskWrite::kOwnShape,
      "attention backward (CPU): the broadcast dims are summed by the caller here");
  const bool assign_mask_grad = a.grad_mask_write == GradMaskWrite::kAssign;

  const acc_t scale = static_cast<acc_t>(a.scale);
  const acc_t softcap = static_cast<acc_t>(a.softcap);
  const bool causal = a.is_causal;
  const int64_t diagonal = a.q_offset - a.kv_offset;  // key j visible to query i iff j <= i + diagonal

  // The key span each query tile's mask rows leave (mask_keys), read once per call; a (query
  // tile, key tile) pair outside it is all masked and contributes nothing. With a mask gradient
  // to write every pair is visited (a skipped one would leave its entries unwritten).
  const MaskSpans spans =
      gm != nullptr ? MaskSpans::every_key(kv_len) : MaskSpans::compute<acc_t>(mask, batch, hq, q_len, kv_len, kQBlock);
  // Each row's key range (every key without key_ranges): a pair outside the union of the query
  // tile's ranges is skipped likewise, and elements outside their row's range are masked.
  const KeyRanges ranges(a.key_ranges, kv_len);

  at::parallel_for(0, batch * hkv, 1, [&](int64_t task_begin, int64_t task_end) {
    // Per task: the operands (Tiles), Delta, lse and the dQ^T accumulator of the group. Tile
    // columns are padded to whole vectors; padding columns hold junk that no product reads.
    Tiles tiles(shape);
    const int64_t ld = round_up(kQBlock, Vec::size());
    std::vector<acc_t> delta(group * q_len), lse(group * q_len), lse_lo(group * q_len);
    std::vector<acc_t> dq_cols(group * head_dim * q_pad);
    std::vector<acc_t> st(kKvBlock * ld), dpt(kKvBlock * ld), tanh_t(softcap > 0 ? kKvBlock * ld : 0);
    std::vector<acc_t> dk(kKvBlock * head_dim), dvb(kKvBlock * dv);
    std::vector<acc_t> lse_tile(ld), lse_lo_tile(ld), delta_tile(ld);
    std::vector<int64_t> lo_tile(ranges.defined() ? kQBlock : 0), hi_tile(ranges.defined() ? kQBlock : 0);
    std::vector<acc_t> mask_tile(mask.kind != MaskKind::kNone ? kKvBlock * ld : 0);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t b = task / hkv, hk = task % hkv;
      tiles.pack_kv(head_rows<scalar_t>(a.key, b, hk), head_rows<scalar_t>(a.value, b, hk));
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        const Rows<scalar_t> go = head_rows<scalar_t>(grad_out, b, h), o = head_rows<scalar_t>(out, b, h);
        tiles.pack_head(g, head_rows<scalar_t>(a.query, b, h), go);
        for (int64_t i = 0; i < q_len; ++i) {
          // Delta_i = sum_d dO[i, d] O[i, d] - dlse_i: the row term of the softmax backward (a
          // gradient flowing into lse adds p_ij * dlse_i to every score's gradient).
          acc_t sum = 0;
          for (int64_t d = 0; d < dv; ++d) {
            sum +=
                static_cast<acc_t>(go.ptr[i * go.row + d * go.col]) * static_cast<acc_t>(o.ptr[i * o.row + d * o.col]);
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
          acc_t* dqc = dq_cols.data() + g * head_dim * q_pad;
          const int64_t i_start = first_i / kQBlock * kQBlock;
          if (gm != nullptr && assign_mask_grad) {
            // Assigned, not accumulated: the rows no tile visits must still be written.
            acc_t* gm_head = gm + (b * gm_heads + h) * gm_q * gm_kv;
            for (int64_t i = 0; i < i_start; ++i) {
              std::fill(gm_head + i * gm_kv + j0, gm_head + i * gm_kv + j0 + n, acc_t(0));
            }
          }
          for (int64_t i0 = i_start; i0 < q_len; i0 += kQBlock) {
            const auto [keys_begin, keys_end] = spans.at(b, h, i0 / kQBlock);
            if (keys_end <= j0 || keys_begin >= j0 + n) {
              continue;
            }
            const int64_t m = std::min(kQBlock, q_len - i0);
            if (ranges.defined()) {
              const auto [range_begin, range_end] = ranges.rows(b, i0, m);
              if (gm == nullptr && (range_end <= j0 || range_begin >= j0 + n)) {
                continue;
              }
              for (int64_t c = 0; c < m; ++c) {
                std::tie(lo_tile[c], hi_tile[c]) = ranges.row(b, i0 + c);
              }
            }
            const int64_t m_pad = round_up(m, Vec::size());
            for (int64_t c = 0; c < ld; ++c) {
              lse_tile[c] = c < m ? lse[g * q_len + i0 + c] : acc_t(0);
              lse_lo_tile[c] = c < m ? lse_lo[g * q_len + i0 + c] : acc_t(0);
              delta_tile[c] = c < m ? delta[g * q_len + i0 + c] : acc_t(0);
            }
            tiles.scores(g, j0, n, i0, m, st.data(), dpt.data(), ld);
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
              if (ranges.defined()) {
                for (int64_t c = 0; c < m; ++c) {
                  if (j < lo_tile[c] || j >= hi_tile[c]) {
                    s[c] = kNegInf<acc_t>;
                  }
                }
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
                  gm_row[0] = assign_mask_grad ? sum : gm_row[0] + sum;
                } else if (assign_mask_grad) {
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
            tiles.accumulate(g, j0, n, i0, m, st.data(), dpt.data(), ld, dk.data(), dvb.data(), dqc);
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
        const acc_t* dqc = dq_cols.data() + g * head_dim * q_pad;
        scalar_t* dst = gq + (b * hq + hk * group + g) * q_len * head_dim;
        for (int64_t i = 0; i < q_len; ++i) {
          for (int64_t d = 0; d < head_dim; ++d) {
            dst[i * head_dim + d] = static_cast<scalar_t>(dqc[d * q_pad + i]);
          }
        }
      }
    }
    tiles.release_thread();
  });
}

}  // namespace

SAFEATTN_REGISTER_ISA_KERNEL(attention_bwd_cpu_stub, &tiled_kernel<AttentionBwdArgs>);

}  // namespace safeattn::cpu
