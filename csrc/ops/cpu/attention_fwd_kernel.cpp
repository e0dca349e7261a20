// CPU forward of safeattn::attention, compiled once per ISA (see common/isa_dispatch.h).
//
// Flash-style: a task is one tile of kQBlock queries of one (batch, head); it walks the keys
// in tiles of kKvBlock with an online softmax in float32 (float64 for float64 inputs), so
// the Q x KV score matrix never exists beyond one tile. Per key tile:
//   S = Q_tile @ K^T[:, tile]       (GEMM; K^T was transposed once for the whole call)
//   S = scale / softcap / mask / causal, row max m, P = exp(S - m), row sum l
//   O = O * exp(m_old - m_new) + P @ V[tile]   (GEMM)
// and at the end out = O / l, lse = m + log(l) (with the sink logit joined by logaddexp).
// A row whose every score is -inf keeps m = -inf: the exponent offset is taken as 0 so every
// p is exp(-inf) = 0, never exp(-inf + inf) = NaN, and the row ends with out 0, lse -inf.
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>

#include "ops/cpu/attention_common.h"

namespace safeattn::cpu {
namespace {

constexpr int64_t kQBlock = 64;
constexpr int64_t kKvBlock = 512;
constexpr int64_t kPackBlock = 256;  // keys per packing task
// Elements touched per parallel chunk (grain_for): a decoding call (one query, a short cache)
// stays on the calling thread.
constexpr int64_t kElementsPerTask = int64_t{1} << 15;

template <typename scalar_t>
void attention_fwd_typed(const AttentionFwdArgs& a) {
  using acc_t = acc_of<scalar_t>;
  using Vec = Vectorized<acc_t>;
  const at::Tensor& query = a.query;
  const at::Tensor& key = a.key;
  const at::Tensor& value = a.value;
  const int64_t batch = query.size(0), hq = query.size(1), q_len = query.size(2), head_dim = query.size(3);
  const int64_t hkv = key.size(1), kv_len = key.size(2), dv = value.size(3);
  const int64_t group = hq / hkv;
  const int64_t q_tiles = (q_len + kQBlock - 1) / kQBlock;

  const scalar_t* q_ptr = query.const_data_ptr<scalar_t>();
  const int64_t q_sb = query.stride(0), q_sh = query.stride(1), q_si = query.stride(2), q_sd = query.stride(3);

  // Packing pass: K^T per (batch, kv-head) in acc, so every tile's Q K^T is a row-major
  // GEMM; V in acc with a unit inner stride unless it already is (float32 inputs: read in
  // place, with its row stride as the GEMM's leading dimension).
  const bool pack_value = !std::is_same_v<scalar_t, acc_t> || value.stride(3) != 1 || value.stride(2) < dv;
  at::Tensor key_t = at::empty({batch, hkv, head_dim, kv_len}, key.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  at::Tensor value_acc = pack_value ? at::empty({batch, hkv, kv_len, dv}, key_t.options()) : at::Tensor();
  acc_t* kt_ptr = key_t.data_ptr<acc_t>();
  {
    const scalar_t* k_src = key.const_data_ptr<scalar_t>();
    const scalar_t* v_src = value.const_data_ptr<scalar_t>();
    acc_t* v_dst = pack_value ? value_acc.data_ptr<acc_t>() : nullptr;
    const int64_t k_sb = key.stride(0), k_sh = key.stride(1), k_sj = key.stride(2), k_sd = key.stride(3);
    const int64_t v_sb = value.stride(0), v_sh = value.stride(1), v_sj = value.stride(2), v_sd = value.stride(3);
    const int64_t chunks = (kv_len + kPackBlock - 1) / kPackBlock;
    const int64_t pack_work = std::min(kPackBlock, kv_len) * (head_dim + (v_dst != nullptr ? dv : 0));
    at::parallel_for(0, batch * hkv * chunks, grain_for(pack_work, kElementsPerTask), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / chunks, b = bh / hkv, hk = bh % hkv;
        const int64_t j0 = (task % chunks) * kPackBlock, j1 = std::min(kv_len, j0 + kPackBlock);
        const scalar_t* k = k_src + b * k_sb + hk * k_sh;
        acc_t* kt = kt_ptr + bh * head_dim * kv_len;
        for (int64_t d = 0; d < head_dim; ++d) {
          for (int64_t j = j0; j < j1; ++j) {
            kt[d * kv_len + j] = static_cast<acc_t>(k[j * k_sj + d * k_sd]);
          }
        }
        if (v_dst != nullptr) {
          const scalar_t* v = v_src + b * v_sb + hk * v_sh;
          for (int64_t j = j0; j < j1; ++j) {
            for (int64_t d = 0; d < dv; ++d) {
              v_dst[(bh * kv_len + j) * dv + d] = static_cast<acc_t>(v[j * v_sj + d * v_sd]);
            }
          }
        }
      }
    });
  }
  const at::Tensor& v_used = pack_value ? value_acc : value;
  const acc_t* v_ptr = static_cast<const acc_t*>(v_used.const_data_ptr());
  const int64_t v_sb = v_used.stride(0), v_sh = v_used.stride(1), v_si = v_used.stride(2);
  scalar_t* out_ptr = a.out.data_ptr<scalar_t>();
  const int64_t o_sb = a.out.stride(0), o_sh = a.out.stride(1), o_si = a.out.stride(2), o_sd = a.out.stride(3);
  acc_t* lse_ptr = a.lse.data_ptr<acc_t>();
  acc_t* lse_lo_ptr = a.lse_lo.defined() ? a.lse_lo.data_ptr<acc_t>() : nullptr;
  const acc_t* sinks_ptr = a.sinks.defined() ? a.sinks.const_data_ptr<acc_t>() : nullptr;
  const MaskView mask(a.mask);
  const acc_t scale = static_cast<acc_t>(a.scale);
  const acc_t softcap = static_cast<acc_t>(a.softcap);
  const bool causal = a.is_causal;
  // Without a softcap the scale goes into the Q tile as it is converted, which saves a pass over
  // every score tile; a softcap needs the unscaled product.
  const acc_t q_scale = softcap > 0 ? acc_t(1) : scale;
  // Key j is visible to query i iff j <= i + diagonal.
  const int64_t diagonal = a.q_offset - a.kv_offset;

  const int64_t tasks = batch * hq * q_tiles;
  // Tiles no larger than the problem: a decoding call allocates and clears a few hundred bytes,
  // not the 128 KB of a full 64 x 512 score tile. ld_scores is the score tile's row stride.
  const int64_t q_block = std::min(kQBlock, q_len);
  const int64_t ld_scores = std::min(kKvBlock, round_up(kv_len, Vec::size()));
  const int64_t task_work = q_block * kv_len * (head_dim + dv);
  at::parallel_for(0, tasks, grain_for(task_work, kElementsPerTask), [&](int64_t task_begin, int64_t task_end) {
    std::vector<acc_t> q_tile(q_block * head_dim);
    std::vector<acc_t> scores(q_block * ld_scores);
    std::vector<acc_t> acc(q_block * dv);
    std::vector<acc_t> row_max(q_block), row_sum(q_block);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t bh = task / q_tiles;
      const int64_t b = bh / hq, h = bh % hq, hk = h / group;
      // Causal tiles cost more the later they are: alternate first/last so that a
      // contiguous range of tasks (what each thread gets) mixes cheap and dear ones.
      const int64_t t = task % q_tiles;
      const int64_t tile = (t % 2 == 0) ? t / 2 : q_tiles - 1 - t / 2;
      const int64_t i0 = tile * kQBlock;
      const int64_t m = std::min(kQBlock, q_len - i0);

      for (int64_t r = 0; r < m; ++r) {
        const scalar_t* src = q_ptr + b * q_sb + h * q_sh + (i0 + r) * q_si;
        acc_t* dst = q_tile.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          dst[d] = static_cast<acc_t>(src[d * q_sd]) * q_scale;
        }
      }
      std::fill(row_max.begin(), row_max.end(), kNegInf<acc_t>);
      std::fill(row_sum.begin(), row_sum.end(), acc_t(0));
      std::fill(acc.begin(), acc.end(), acc_t(0));

      // Keys past the last row's diagonal are invisible to the whole tile.
      const int64_t kv_end = causal ? clamp_to(i0 + m - 1 + diagonal + 1, 0, kv_len) : kv_len;
      const acc_t* kt = kt_ptr + (b * hkv + hk) * head_dim * kv_len;
      const acc_t* v = v_ptr + b * v_sb + hk * v_sh;
      for (int64_t j0 = 0; j0 < kv_end; j0 += kKvBlock) {
        const int64_t n = std::min(kKvBlock, kv_end - j0);
        const int64_t n_pad = round_up(n, Vec::size());
        gemm(m, n, head_dim, q_tile.data(), head_dim, kt + j0, kv_len, scores.data(), ld_scores, false);
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = i0 + r;
          acc_t* s = scores.data() + r * ld_scores;
          if (softcap > 0) {
            scale_scores<acc_t>(s, n, scale, softcap, nullptr);
          }
          if (mask.kind != MaskKind::kNone) {
            apply_mask_run(s, n, mask, mask.offset(b, h, i, j0), mask.stride_kv);
          }
          // Columns past n (vector padding) and, when causal, past the diagonal: -inf.
          const int64_t visible = causal ? clamp_to(i + diagonal - j0 + 1, 0, n) : n;
          std::fill(s + visible, s + n_pad, kNegInf<acc_t>);

          Vec vmax(kNegInf<acc_t>);
          for (int64_t c = 0; c < n_pad; c += Vec::size()) {
            vmax = at::vec::maximum(vmax, Vec::loadu(s + c));
          }
          const acc_t tile_max = at::vec::vec_reduce_all<acc_t>(
              [](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); }, vmax);
          const acc_t old_max = row_max[r];
          const acc_t new_max = max_keep_nan(old_max, tile_max);
          // Fully masked so far: offset 0, so that exp(-inf - 0) = 0 rather than NaN.
          const acc_t offset = new_max == kNegInf<acc_t> ? acc_t(0) : new_max;
          const Vec voff(offset);
          Vec vsum(acc_t(0));
          for (int64_t c = 0; c < n_pad; c += Vec::size()) {
            const Vec p = exp_keep_nan(Vec::loadu(s + c) - voff);
            p.store(s + c);
            vsum = vsum + p;
          }
          const acc_t tile_sum = at::vec::vec_reduce_all<acc_t>([](const Vec& x, const Vec& y) { return x + y; }, vsum);
          const acc_t rescale = std::exp(old_max - offset);  // old_max = -inf: 0 (acc is 0 anyway)
          row_max[r] = new_max;
          row_sum[r] = row_sum[r] * rescale + tile_sum;
          if (!(rescale == acc_t(1))) {
            acc_t* o = acc.data() + r * dv;
            at::vec::map([rescale](Vec x) { return x * Vec(rescale); }, o, o, dv);
          }
        }
        gemm(m, dv, n, scores.data(), ld_scores, v + j0 * v_si, v_si, acc.data(), dv, true);
      }

      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = i0 + r;
        const acc_t l = row_sum[r];
        const bool empty = l == acc_t(0);  // no visible key (a NaN row is not empty)
        // lse = top + log(total): top is the row max, or the sink logit when that is larger (the
        // sink joins the denominator only); total = l exp(max - top) (+ exp(sink - top)).
        // two_sum keeps what the rounding of lse drops in lse_lo (attention.h says why).
        const acc_t row_top = empty ? kNegInf<acc_t> : row_max[r];
        const acc_t top = sinks_ptr != nullptr ? max_keep_nan(row_top, sinks_ptr[h]) : row_top;
        acc_t lse = kNegInf<acc_t>, lse_lo = 0, factor = 0;
        if (!(top == kNegInf<acc_t>)) {
          const acc_t row_weight = empty ? acc_t(0) : std::exp(row_top - top);
          const acc_t total = l * row_weight + (sinks_ptr != nullptr ? std::exp(sinks_ptr[h] - top) : acc_t(0));
          two_sum(top, std::log(total), lse, lse_lo);
          factor = row_weight / total;
        }
        lse_ptr[(b * hq + h) * q_len + i] = lse;
        if (lse_lo_ptr != nullptr) {
          lse_lo_ptr[(b * hq + h) * q_len + i] = lse_lo;
        }
        const acc_t* o = acc.data() + r * dv;
        scalar_t* dst = out_ptr + b * o_sb + h * o_sh + i * o_si;
        // A row without visible keys is exactly 0, even if a masked value held NaN or inf.
        for (int64_t d = 0; d < dv; ++d) {
          dst[d * o_sd] = empty ? scalar_t(0) : static_cast<scalar_t>(o[d] * factor);
        }
      }
    }
  });
}

void attention_fwd_kernel(const AttentionFwdArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.query.scalar_type(), "attention_fwd_cpu",
                                  [&] { attention_fwd_typed<scalar_t>(args); });
}

}  // namespace

SAFEATTN_REGISTER_ISA_KERNEL(attention_fwd_cpu_stub, &attention_fwd_kernel);

}  // namespace safeattn::cpu
