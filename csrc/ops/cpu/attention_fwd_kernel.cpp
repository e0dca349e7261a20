// CPU forward of safeattn::attention, compiled once per ISA (see common/isa_dispatch.h).
//
// Flash-style: a task is one tile of kQBlock queries of one (batch, head); it walks the keys
// in tiles of kKvBlock with an online softmax in float32 (float64 for float64 inputs), so
// the Q x KV score matrix never exists beyond one tile. Per key tile:
//   S = Q_tile @ K^T[:, tile]       (GEMM; K^T was packed once for the whole call)
//   S = scale / softcap / mask / causal, row max m, P = exp(S - m), row sum l
//   O = O * exp(m_old - m_new) + P @ V[tile]   (GEMM)
// and at the end out = O / l, lse = m + log(l) (with the sink logit joined by logaddexp).
// A row whose every score is -inf keeps m = -inf: the exponent offset is taken as 0 so every
// p is exp(-inf) = 0, never exp(-inf + inf) = NaN, and the row ends with out 0, lse -inf.
//
// The two GEMMs run one of two ways, chosen per call (the Tiles types below):
//   FloatTiles  in the accumulation type: K^T and V converted once per call, the scale folded
//               into the Q tile as it is converted.
//   LowpTiles   bf16 / fp16 inputs where the CPU multiplies them in hardware (use_lowp_tiles):
//               products in the input type with float32 accumulation (oneDNN's brgemm), K^T and V
//               packed once per call in the VNNI layout, P rounded to the input type before
//               P @ V (as PyTorch's CPU flash kernel and the CUDA kernels do), the scale applied
//               to the float32 scores (a scaled Q would be rounded twice).
// The softmax, the masks and every special row are the same code for both.
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

// Query rows of a tile: 128 where float32 tiles go to the BLAS sgemm (the builds without
// AVX-512), whose per-call cost larger products amortise: 2-core AMD EPYC held to AVX2, B=1 H=8
// S=2048 D=128 float32 forward 109.6 -> 102.3 ms (SDPA 95.9); 64 with AVX-512 (oneDNN's brgemm,
// and the bf16 tiles), where 128 was level or up to 4% slower.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kQBlock = 64;
#else
constexpr int64_t kQBlock = 128;
#endif
constexpr int64_t kKvBlock = 512;
constexpr int64_t kPackBlock = 256;  // keys per packing task (a multiple of kVnniCols)
// Elements touched per parallel chunk (grain_for): a decoding call (one query, a short cache)
// stays on the calling thread.
constexpr int64_t kElementsPerTask = int64_t{1} << 15;

struct FwdShape {
  int64_t batch, hq, q_len, head_dim, hkv, kv_len, dv;
};

// Runs pack(bh, j0, j1) for every (batch x kv-head, kPackBlock keys) chunk of [0, keys), in
// parallel: the per-call packing of K and V.
template <typename Fn>
void for_each_pack_chunk(const FwdShape& s, int64_t keys, int64_t work_per_key, const Fn& pack) {
  const int64_t chunks = (keys + kPackBlock - 1) / kPackBlock;
  const int64_t work = std::min(kPackBlock, keys) * work_per_key;
  at::parallel_for(0, s.batch * s.hkv * chunks, grain_for(work, kElementsPerTask), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = (task % chunks) * kPackBlock;
      pack(task / chunks, j0, std::min(keys, j0 + kPackBlock));
    }
  });
}

// Tiles in the accumulation type: K^T per (batch, kv-head) converted once per call, so that every
// tile's Q K^T is a row-major GEMM; V converted with a unit inner stride unless it already is
// (float32 inputs: read in place, with its row stride as the GEMM's leading dimension). A float32
// call of at most kKeysInPlaceRows query rows (decoding, speculative tokens, short appends) reads
// K in place too, its Q K^T the BLAS sgemm with K as a transposed operand: the transposing copy
// of K cost more than the products it served. 2-core AVX-512 EPYC, Hq 8 Hkv 2 D 64, us, packed /
// in place: B=8 1024 keys, Q 1 636 / 406, Q 4 792 / 652, Q 16 1902 / 1804, Q 32 3644 / 3522,
// Q 64 6487 / 6414, Q 128 12218 / 12978; B=1 4096 keys, Q 1 368 / 248, Q 16 1183 / 907, Q 128
// 5955 / 6306. Through attention_with_kvcache, B=8 1024 keys, Q 1: 1.16 -> 0.45 ms (SDPA 0.54).
constexpr int64_t kKeysInPlaceRows = 16;

template <typename scalar_t>
class FloatTiles {
 public:
  using acc_t = acc_of<scalar_t>;
  static constexpr bool kScaleInQ = true;
  // Score columns past the tile's keys are processed up to a multiple of this.
  static constexpr int64_t kKeyGrain = Vectorized<acc_t>::size();

  FloatTiles(const AttentionFwdArgs& a, const FwdShape& s, acc_t q_scale) : s_(s), q_scale_(q_scale) {
    const at::Tensor &key = a.key, &value = a.value;
    const bool pack_value = !std::is_same_v<scalar_t, acc_t> || value.stride(3) != 1 || value.stride(2) < s.dv;
    keys_in_place_ = std::is_same_v<scalar_t, float> && s.q_len <= kKeysInPlaceRows && blas_sgemm_available() &&
                     key.stride(3) == 1 && key.stride(2) >= s.head_dim &&  // BLAS: a leading dimension >= D
                     key.stride(2) <= std::numeric_limits<int>::max();
    if (keys_in_place_) {
      k_ptr_ = reinterpret_cast<const acc_t*>(key.const_data_ptr<scalar_t>());
      k_sb_ = key.stride(0), k_sh_ = key.stride(1), k_sj_ = key.stride(2);
    } else {
      key_t_ = at::empty({s.batch, s.hkv, s.head_dim, s.kv_len},
                         key.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    }
    value_acc_ = pack_value ? at::empty({s.batch, s.hkv, s.kv_len, s.dv},
                                        key.options().dtype(c10::CppTypeToScalarType<acc_t>::value))
                            : at::Tensor();
    acc_t* kt_ptr = keys_in_place_ ? nullptr : key_t_.data_ptr<acc_t>();
    const scalar_t* k_src = key.const_data_ptr<scalar_t>();
    const scalar_t* v_src = value.const_data_ptr<scalar_t>();
    acc_t* v_dst = pack_value ? value_acc_.data_ptr<acc_t>() : nullptr;
    const int64_t k_sb = key.stride(0), k_sh = key.stride(1), k_sj = key.stride(2), k_sd = key.stride(3);
    const int64_t v_sb = value.stride(0), v_sh = value.stride(1), v_sj = value.stride(2), v_sd = value.stride(3);
    const int64_t pack_work = (keys_in_place_ ? 0 : s.head_dim) + (pack_value ? s.dv : 0);
    auto pack = [&](int64_t bh, int64_t j0, int64_t j1) {
      const int64_t b = bh / s.hkv, hk = bh % s.hkv;
      if (kt_ptr != nullptr) {
        const scalar_t* k = k_src + b * k_sb + hk * k_sh;
        acc_t* kt = kt_ptr + bh * s.head_dim * s.kv_len;
        for (int64_t d = 0; d < s.head_dim; ++d) {
          for (int64_t j = j0; j < j1; ++j) {
            kt[d * s.kv_len + j] = static_cast<acc_t>(k[j * k_sj + d * k_sd]);
          }
        }
      }
      if (v_dst != nullptr) {
        const scalar_t* v = v_src + b * v_sb + hk * v_sh;
        for (int64_t j = j0; j < j1; ++j) {
          for (int64_t d = 0; d < s.dv; ++d) {
            v_dst[(bh * s.kv_len + j) * s.dv + d] = static_cast<acc_t>(v[j * v_sj + d * v_sd]);
          }
        }
      }
    };
    if (pack_work > 0) {
      for_each_pack_chunk(s, s.kv_len, pack_work, pack);
    }
    const at::Tensor& v_used = pack_value ? value_acc_ : value;
    v_ptr_ = static_cast<const acc_t*>(v_used.const_data_ptr());
    v_sb_ = v_used.stride(0);
    v_sh_ = v_used.stride(1);
    v_si_ = v_used.stride(2);
  }

  // Score tiles are processed in whole vectors: their row stride for this call.
  int64_t score_stride() const {
    return std::min(kKvBlock, round_up(s_.kv_len, kKeyGrain));
  }

  struct Scratch {
    std::vector<acc_t> q;
    Scratch(const FwdShape& s, int64_t q_block) : q(q_block * s.head_dim) {}
  };

  // The Q tile (m rows from `src`, rows stride_i apart, elements stride_d apart), scaled.
  void load_q(Scratch& w, const scalar_t* src, int64_t stride_i, int64_t stride_d, int64_t m) const {
    for (int64_t r = 0; r < m; ++r) {
      acc_t* dst = w.q.data() + r * s_.head_dim;
      for (int64_t d = 0; d < s_.head_dim; ++d) {
        dst[d] = static_cast<acc_t>(src[r * stride_i + d * stride_d]) * q_scale_;
      }
    }
  }

  // S[m, n] = Q_tile @ K^T[:, j0 .. j0 + n) of kv-head bh, into s (row stride ld).
  void scores(Scratch& w, int64_t bh, int64_t j0, int64_t n, int64_t m, acc_t* s, int64_t ld) const {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (keys_in_place_) {
        const acc_t* k = k_ptr_ + (bh / s_.hkv) * k_sb_ + (bh % s_.hkv) * k_sh_ + j0 * k_sj_;
        gemm_transposed_b(m, n, s_.head_dim, w.q.data(), s_.head_dim, k, k_sj_, s, ld);
        return;
      }
    }
    const acc_t* kt = key_t_.const_data_ptr<acc_t>() + bh * s_.head_dim * s_.kv_len;
    gemm(m, n, s_.head_dim, w.q.data(), s_.head_dim, kt + j0, s_.kv_len, s, ld, false);
  }

  // O[m, dv] += P[m, n] @ V[j0 .. j0 + n); p's columns [n, n_pad) are 0 (unused here).
  void accumulate(Scratch&, int64_t bh, int64_t j0, int64_t n, int64_t /*n_pad*/, int64_t m, const acc_t* p, int64_t ld,
                  acc_t* o) const {
    const acc_t* v = v_ptr_ + (bh / s_.hkv) * v_sb_ + (bh % s_.hkv) * v_sh_;
    gemm(m, s_.dv, n, p, ld, v + j0 * v_si_, v_si_, o, s_.dv, true);
  }

  void release_thread() const {}

 private:
  FwdShape s_;
  acc_t q_scale_;
  at::Tensor key_t_, value_acc_;
  bool keys_in_place_ = false;
  const acc_t* k_ptr_ = nullptr;
  int64_t k_sb_ = 0, k_sh_ = 0, k_sj_ = 0;
  const acc_t* v_ptr_ = nullptr;
  int64_t v_sb_ = 0, v_sh_ = 0, v_si_ = 0;
};

#if defined(SAFEATTN_LOWP_TILES)
// Tiles in the input type (bf16 / fp16), float32 accumulation (attention_common.h). Packed once
// per call, per (batch, kv-head), with kv_pad = keys rounded up to kVnniCols (zeros past KV):
//   K^T  [kv_pad / 64][d2 / 2][64][2]   the right operand of Q K^T (pairs along the head dim,
//                                       d2 = head_dim rounded up to even)
//   V    [dv blocks][kv_pad / 2][64][2] the right operand of P V (pairs along the keys)
// S is computed in whole blocks of 64 keys (columns past the tile's keys are overwritten with
// -inf before use). P @ V takes the keys of a tile in multiples of kKeyGrain: the tile's last
// partial group goes through a copy of its V rows with the rows past the tile zeroed, so that a
// key the tile cannot see (past the causal diagonal) is never multiplied, not even by a 0.
template <typename scalar_t>
class LowpTiles {
 public:
  using acc_t = float;
  static constexpr bool kScaleInQ = false;
  static constexpr int64_t kKeyGrain = 32;

  LowpTiles(const AttentionFwdArgs& a, const FwdShape& s, float /*q_scale: applied to the scores*/)
      : s_(s),
        d2_(round_up(s.head_dim, 2)),
        kv_pad_(round_up(s.kv_len, kVnniCols)),
        dv_blocks_((s.dv + kVnniCols - 1) / kVnniCols) {
    const at::Tensor &key = a.key, &value = a.value;
    key_t_ = at::empty({s.batch * s.hkv * kv_pad_ * d2_}, key.options());
    value_ = at::empty({s.batch * s.hkv * dv_blocks_ * kVnniCols * kv_pad_}, key.options());
    scalar_t* kt = key_t_.data_ptr<scalar_t>();
    scalar_t* vv = value_.data_ptr<scalar_t>();
    const scalar_t* k_src = key.const_data_ptr<scalar_t>();
    const scalar_t* v_src = value.const_data_ptr<scalar_t>();
    const int64_t k_sb = key.stride(0), k_sh = key.stride(1), k_sj = key.stride(2), k_sd = key.stride(3);
    const int64_t v_sb = value.stride(0), v_sh = value.stride(1), v_sj = value.stride(2), v_sd = value.stride(3);
    // Chunks of kPackBlock keys (whole VNNI blocks of K^T, whole row pairs of V); the last one
    // runs to kv_pad and writes the zero padding.
    for_each_pack_chunk(s, kv_pad_, s.head_dim + s.dv, [&](int64_t bh, int64_t j0, int64_t j1) {
      const int64_t b = bh / s.hkv, hk = bh % s.hkv;
      const int64_t rows = std::max<int64_t>(std::min(j1, s.kv_len) - j0, 0);  // real keys in the chunk
      // K^T: B[d][j] = K[j][d].
      pack_vnni(kt + bh * kv_pad_ * d2_ + j0 * d2_, d2_ * kVnniCols, k_src + b * k_sb + hk * k_sh + j0 * k_sj, k_sd,
                k_sj, s.head_dim, d2_, rows, j1 - j0);
      // V: B[j][d] = V[j][d], rows j0 .. j1 of every column block.
      pack_vnni(vv + bh * dv_blocks_ * kVnniCols * kv_pad_ + j0 * kVnniCols, kv_pad_ * kVnniCols,
                v_src + b * v_sb + hk * v_sh + j0 * v_sj, v_sj, v_sd, rows, j1 - j0, s.dv, dv_blocks_ * kVnniCols);
    });
  }

  int64_t score_stride() const {
    return std::min(kKvBlock, kv_pad_);
  }

  struct Scratch {
    std::vector<scalar_t> q, p, v_tail;
    Scratch(const FwdShape& s, int64_t q_block)
        : q(q_block * round_up(s.head_dim, 2)),
          p(q_block * std::min(kKvBlock, round_up(s.kv_len, kVnniCols))),
          v_tail((s.dv + kVnniCols - 1) / kVnniCols * kVnniCols * kKeyGrain) {}
  };

  void load_q(Scratch& w, const scalar_t* src, int64_t stride_i, int64_t stride_d, int64_t m) const {
    pack_rows(w.q.data(), d2_, src, stride_i, stride_d, m, s_.head_dim, d2_);
  }

  void scores(Scratch& w, int64_t bh, int64_t j0, int64_t n, int64_t m, float* s, int64_t ld) const {
    const scalar_t* kt = key_t_.const_data_ptr<scalar_t>() + bh * kv_pad_ * d2_ + j0 * d2_;
    gemm_vnni(m, round_up(n, kVnniCols), d2_, w.q.data(), d2_, kt, d2_ * kVnniCols, s, ld, false);
  }

  // O += P @ V[j0 .. j0 + n): p's columns [n, n_pad) are 0 (n_pad = n rounded up to kKeyGrain).
  void accumulate(Scratch& w, int64_t bh, int64_t j0, int64_t n, int64_t n_pad, int64_t m, const float* p, int64_t ld,
                  float* o) const {
    const int64_t ld_p = score_stride();
    for (int64_t r = 0; r < m; ++r) {
      round_row(w.p.data() + r * ld_p, p + r * ld, n_pad, n_pad);
    }
    const scalar_t* v = value_.const_data_ptr<scalar_t>() + bh * dv_blocks_ * kVnniCols * kv_pad_;
    const int64_t block_stride = kv_pad_ * kVnniCols;
    const int64_t whole = n / kKeyGrain * kKeyGrain;
    if (whole > 0) {
      gemm_vnni(m, s_.dv, whole, w.p.data(), ld_p, v + j0 * kVnniCols, block_stride, o, s_.dv, true);
    }
    if (whole < n) {
      // Keys [j0 + whole, j0 + n) and zeros up to kKeyGrain rows (whole and j0 are even).
      const int64_t pairs = kKeyGrain / 2, tail_stride = kKeyGrain * kVnniCols;
      for (int64_t c = 0; c < dv_blocks_; ++c) {
        const scalar_t* from = v + c * block_stride + (j0 + whole) * kVnniCols;
        scalar_t* to = w.v_tail.data() + c * tail_stride;
        const int64_t rows = n - whole;
        std::copy(from, from + rows / 2 * 2 * kVnniCols, to);
        std::fill(to + rows / 2 * 2 * kVnniCols, to + pairs * 2 * kVnniCols, scalar_t(0));
        if (rows % 2 == 1) {  // the last pair's first key only
          const scalar_t* pair_from = from + rows / 2 * 2 * kVnniCols;
          scalar_t* pair_to = to + rows / 2 * 2 * kVnniCols;
          for (int64_t col = 0; col < kVnniCols; ++col) {
            pair_to[2 * col] = pair_from[2 * col];
          }
        }
      }
      gemm_vnni(m, s_.dv, kKeyGrain, w.p.data() + whole, ld_p, w.v_tail.data(), tail_stride, o, s_.dv, true);
    }
  }

  void release_thread() const {
    release_lowp_tiles();
  }

 private:
  FwdShape s_;
  int64_t d2_, kv_pad_, dv_blocks_;
  at::Tensor key_t_, value_;
};
#endif

template <typename scalar_t, typename Tiles>
void attention_run(const AttentionFwdArgs& a) {
  using acc_t = typename Tiles::acc_t;
  using Vec = Vectorized<acc_t>;
  const at::Tensor& query = a.query;
  const FwdShape shape{query.size(0), query.size(1), query.size(2),  query.size(3),
                       a.key.size(1), a.key.size(2), a.value.size(3)};
  const int64_t batch = shape.batch, hq = shape.hq, q_len = shape.q_len, head_dim = shape.head_dim;
  const int64_t kv_len = shape.kv_len, dv = shape.dv;
  const int64_t group = hq / shape.hkv;
  const int64_t q_tiles = (q_len + kQBlock - 1) / kQBlock;

  const scalar_t* q_ptr = query.const_data_ptr<scalar_t>();
  const int64_t q_sb = query.stride(0), q_sh = query.stride(1), q_si = query.stride(2), q_sd = query.stride(3);
  scalar_t* out_ptr = a.out.data_ptr<scalar_t>();
  const int64_t o_sb = a.out.stride(0), o_sh = a.out.stride(1), o_si = a.out.stride(2), o_sd = a.out.stride(3);
  acc_t* lse_ptr = a.lse.data_ptr<acc_t>();
  acc_t* lse_lo_ptr = a.lse_lo.defined() ? a.lse_lo.data_ptr<acc_t>() : nullptr;
  const acc_t* sinks_ptr = a.sinks.defined() ? a.sinks.const_data_ptr<acc_t>() : nullptr;
  const MaskView mask(a.mask);
  const acc_t scale = static_cast<acc_t>(a.scale);
  const acc_t softcap = static_cast<acc_t>(a.softcap);
  const bool causal = a.is_causal;
  // Without a softcap FloatTiles fold the scale into the Q tile as it is converted, which saves
  // a pass over every score tile; a softcap needs the unscaled product.
  const bool scale_in_q = Tiles::kScaleInQ && !(softcap > 0);
  const Tiles tiles(a, shape, scale_in_q ? scale : acc_t(1));  // packs K and V (one parallel region)
  // Key j is visible to query i iff j <= i + diagonal.
  const int64_t diagonal = a.q_offset - a.kv_offset;

  // The key span each query tile's mask rows leave (mask_keys), read once per call.
  const MaskSpans spans = MaskSpans::compute<acc_t>(mask, batch, hq, q_len, kv_len, kQBlock);
  // Each row's key range (every key without key_ranges): a tile walks the union of its rows'.
  const KeyRanges ranges(a.key_ranges, kv_len);

  const int64_t tasks = batch * hq * q_tiles;
  // Tiles no larger than the problem: a decoding call allocates and clears a few hundred bytes,
  // not the 128 KB of a full 64 x 512 score tile. ld_scores is the score tile's row stride.
  const int64_t q_block = std::min(kQBlock, q_len);
  const int64_t ld_scores = tiles.score_stride();
  const int64_t task_work = q_block * kv_len * (head_dim + dv);
  at::parallel_for(0, tasks, grain_for(task_work, kElementsPerTask), [&](int64_t task_begin, int64_t task_end) {
    typename Tiles::Scratch scratch(shape, q_block);
    std::vector<acc_t> scores(q_block * ld_scores);
    std::vector<acc_t> acc(q_block * dv);
    std::vector<acc_t> row_max(q_block), row_sum(q_block);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t bh = task / q_tiles;
      const int64_t b = bh / hq, h = bh % hq, hk = h / group;
      const int64_t bh_kv = b * shape.hkv + hk;
      // Causal tiles cost more the later they are: alternate first/last so that a
      // contiguous range of tasks (what each thread gets) mixes cheap and dear ones.
      const int64_t t = task % q_tiles;
      const int64_t tile = (t % 2 == 0) ? t / 2 : q_tiles - 1 - t / 2;
      const int64_t i0 = tile * kQBlock;
      const int64_t m = std::min(kQBlock, q_len - i0);

      tiles.load_q(scratch, q_ptr + b * q_sb + h * q_sh + i0 * q_si, q_si, q_sd, m);
      std::fill(row_max.begin(), row_max.end(), kNegInf<acc_t>);
      std::fill(row_sum.begin(), row_sum.end(), acc_t(0));
      std::fill(acc.begin(), acc.end(), acc_t(0));

      // Keys past the last row's diagonal are invisible to the whole tile, as are those outside
      // the span the mask leaves the tile's rows and those outside every row's key range (the
      // start kept a multiple of kVnniCols, the packed tiles' column block).
      const auto [mask_begin, mask_end] = spans.at(b, h, tile);
      const auto [range_begin, range_end] = ranges.rows(b, i0, m);
      const int64_t kv_begin = std::max(mask_begin, range_begin);
      const int64_t kv_end =
          std::min({causal ? clamp_to(i0 + m - 1 + diagonal + 1, 0, kv_len) : kv_len, mask_end, range_end});
      for (int64_t j0 = kv_begin / kVnniCols * kVnniCols; j0 < kv_end; j0 += kKvBlock) {
        const int64_t n = std::min(kKvBlock, kv_end - j0);
        const int64_t n_pad = round_up(n, Tiles::kKeyGrain);
        tiles.scores(scratch, bh_kv, j0, n, m, scores.data(), ld_scores);
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = i0 + r;
          acc_t* s = scores.data() + r * ld_scores;
          if (!scale_in_q) {
            scale_scores<acc_t>(s, n, scale, softcap, nullptr);
          }
          if (mask.kind != MaskKind::kNone) {
            apply_mask_run(s, n, mask, mask.offset(b, h, i, j0), mask.stride_kv);
          }
          // Columns past n (padding), when causal past the diagonal, and outside the row's key
          // range: -inf, whatever the score (a NaN included).
          const auto [lo, hi] = ranges.row(b, i);
          const int64_t visible = std::min(causal ? clamp_to(i + diagonal - j0 + 1, 0, n) : n, clamp_to(hi - j0, 0, n));
          std::fill(s + visible, s + n_pad, kNegInf<acc_t>);
          std::fill(s, s + clamp_to(lo - j0, 0, visible), kNegInf<acc_t>);

          Vec vmax(kNegInf<acc_t>);
          for (int64_t c = 0; c < n_pad; c += Vec::size()) {
            vmax = at::vec::maximum(vmax, Vec::loadu(s + c));
          }
          const acc_t tile_max =
              at::vec::vec_reduce_all<acc_t>([](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); }, vmax);
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
        tiles.accumulate(scratch, bh_kv, j0, n, n_pad, m, scores.data(), ld_scores, acc.data());
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
    tiles.release_thread();
  });
}

}  // namespace

SAFEATTN_REGISTER_ISA_KERNEL(attention_fwd_cpu_stub, &tiled_kernel<AttentionFwdArgs>);
SAFEATTN_REGISTER_ISA_KERNEL(attention_cpu_tiles_stub, &lowp_tiles_status);

}  // namespace safeattn::cpu
