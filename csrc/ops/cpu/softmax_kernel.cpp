// CPU kernels of the softmax family, compiled once per ISA (see common/isa_dispatch.h).
//
// Last-dim slices (inner == 1), the common case: one task per range of rows. A row of up to
// kStagedElements is read from memory once: pass 1 turns the (masked, scaled) scores into
// float32 in a per-task buffer while taking the max, pass 2 replaces the buffer by
// exp(x - max) and sums it, pass 3 writes buffer * (1 / sum) in the output dtype. Passes 2 and
// 3 stay in L2. Longer rows go by chunks of that size with an online max / sum (the sum is
// rescaled when the max grows), then a second read writes exp(x - max) / sum.
//
// Other dims (inner > 1): the slice runs down a column of the [dim_size, inner] matrix of one
// outer index. A task takes a block of adjacent columns, one vector lane per column, so loads
// stay contiguous and nothing is transposed; the block is staged in the buffer when
// dim_size x block fits, else the passes re-read the input.
//
// exp is at::vec's exp_u20 (the one PyTorch's CPU flash attention uses): it is only ever fed
// x - max <= 0 or -inf, because a NaN or +inf max sends the row to the NaN branch first.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>

#include "ops/cpu/parallel.h"
#include "ops/softmax.h"

namespace safeattn::cpu {
namespace {

using at::vec::Vectorized;
using namespace safeattn::softmax_detail;

// float32 accumulation for float, half and bfloat16; float64 stays float64 (gradcheck).
template <typename T>
using acc_type_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// A row (or column block) this many elements long is staged in float32: 256 KB, well inside
// the per-core L2 of current x86 parts, so passes 2 and 3 do not touch memory.
constexpr int64_t kStagedElements = int64_t{1} << 16;
// Elements per parallel task: enough to amortise scheduling.
constexpr int64_t kElementsPerTask = int64_t{1} << 14;

template <typename acc_t>
constexpr int64_t vec_size() {
  return Vectorized<acc_t>::size();
}

int64_t round_up(int64_t n, int64_t m) {
  return (n + m - 1) / m * m;
}

// ---- loads and stores in the accumulation type ------------------------------------------

template <typename T, typename acc_t>
inline Vectorized<acc_t> load_acc(const T* p) {
  if constexpr (std::is_same_v<T, acc_t>) {
    return Vectorized<acc_t>::loadu(p);
  } else {
    Vectorized<float> v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

// The first `count` lanes from p, the others 0. The 16-bit types go through a zeroed buffer:
// Vectorized<Half / BFloat16>::loadu(p, count) of older torch (2.6, AVX2) leaves the other
// lanes undefined, and a NaN there reached the backward's row sums.
template <typename T, typename acc_t>
inline Vectorized<acc_t> load_acc(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, acc_t>) {
    return Vectorized<acc_t>::loadu(p, count);
  } else {
    __at_align__ T tail[Vectorized<T>::size()] = {};
    std::memcpy(tail, p, count * sizeof(T));
    auto halves = at::vec::convert_to_float<T>(Vectorized<T>::loadu(tail));
    return std::get<0>(halves);
  }
}

template <typename T, typename acc_t>
inline void store_acc(T* p, const Vectorized<acc_t>& v) {
  if constexpr (std::is_same_v<T, acc_t>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, Vectorized<float>::size());
  }
}

template <typename T, typename acc_t>
inline void store_acc(T* p, const Vectorized<acc_t>& v, int64_t count) {
  if constexpr (std::is_same_v<T, acc_t>) {
    v.store(p, count);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, count);
  }
}

template <typename acc_t>
inline acc_t reduce_max(const Vectorized<acc_t>& v) {
  // at::vec::maximum propagates NaN, so a NaN anywhere makes the max NaN.
  return at::vec::vec_reduce_all<acc_t>(
      [](const Vectorized<acc_t>& a, const Vectorized<acc_t>& b) { return at::vec::maximum(a, b); }, v);
}

template <typename acc_t>
inline acc_t reduce_sum(const Vectorized<acc_t>& v) {
  return at::vec::vec_reduce_all<acc_t>([](const Vectorized<acc_t>& a, const Vectorized<acc_t>& b) { return a + b; },
                                        v);
}

// Lanes >= count set to -inf: they then add nothing to a max or to a sum of exp.
template <typename acc_t>
inline Vectorized<acc_t> pad_neg_inf(const Vectorized<acc_t>& v, int64_t count) {
  return Vectorized<acc_t>::set(Vectorized<acc_t>(neg_inf<acc_t>()), v, count);
}

// ---- the value each element contributes: x = f(score, mask) ----------------------------
// Each "source" yields vectors of x for `count` consecutive elements starting at `index`,
// read at element stride 1 from `scores` and at `mask_stride` from `mask`; lanes >= count are
// -inf.

template <typename T, typename acc_t, bool kScaled>
struct PlainSource {
  const T* scores;
  acc_t scale;  // used when kScaled (masked_softmax without a mask)
  inline Vectorized<acc_t> operator()(int64_t index, int64_t count) const {
    using Vec = Vectorized<acc_t>;
    if (count == vec_size<acc_t>()) {
      const Vec s = load_acc<T, acc_t>(scores + index);
      return kScaled ? s * Vec(scale) : s;
    }
    const Vec s = load_acc<T, acc_t>(scores + index, count);
    return pad_neg_inf(kScaled ? s * Vec(scale) : s, count);
  }
};

// A bool mask (M = bool: masked lanes -inf) or a floating one (M = T or float: added to the
// scaled scores).
template <typename T, typename M, typename acc_t>
struct MaskSource {
  const T* scores;
  const M* mask;
  int64_t mask_stride;
  acc_t scale;
  inline Vectorized<acc_t> operator()(int64_t index, int64_t count) const {
    using Vec = Vectorized<acc_t>;
    const M* m = mask + index * mask_stride;
    const Vec s =
        count == vec_size<acc_t>() ? load_acc<T, acc_t>(scores + index) : load_acc<T, acc_t>(scores + index, count);
    if constexpr (std::is_same_v<M, bool>) {
      using bits_t = at::vec::int_same_size_t<acc_t>;
      // Per-lane all-ones / zero select mask built from the bool bytes.
      __at_align__ bits_t keep[vec_size<acc_t>()] = {};
      if (mask_stride == 1) {
        for (int64_t i = 0; i < count; ++i) {
          keep[i] = m[i] ? bits_t(-1) : bits_t(0);
        }
      } else {
        for (int64_t i = 0; i < count; ++i) {
          keep[i] = m[i * mask_stride] ? bits_t(-1) : bits_t(0);
        }
      }
      // A select, not an addition: a NaN or inf score at a masked position must not leak.
      return Vec::blendv(Vec(neg_inf<acc_t>()), s * Vec(scale), Vec::loadu(keep));
    } else {
      Vec bias;
      if (mask_stride == 1) {
        bias = count == vec_size<acc_t>() ? load_acc<M, acc_t>(m) : load_acc<M, acc_t>(m, count);
      } else {
        __at_align__ acc_t gathered[vec_size<acc_t>()] = {};
        for (int64_t i = 0; i < count; ++i) {
          gathered[i] = static_cast<acc_t>(m[i * mask_stride]);
        }
        bias = Vec::loadu(gathered);
      }
      const Vec x = at::vec::fmadd(s, Vec(scale), bias);
      return count == vec_size<acc_t>() ? x : pad_neg_inf(x, count);
    }
  }
};

template <typename T>
void fill(T* out, int64_t n, T value) {
  std::fill(out, out + n, value);
}

// ---- last-dim rows -----------------------------------------------------------------------

// Stages x for elements [begin, begin + len) into buf (rounded up to whole vectors, padding
// lanes -inf) and returns their max.
template <typename acc_t, typename Source>
inline acc_t stage_and_max(const Source& x, int64_t begin, int64_t len, acc_t* buf) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t V = vec_size<acc_t>();
  Vec vmax(neg_inf<acc_t>());
  int64_t j = 0;
  for (; j + V <= len; j += V) {
    const Vec v = x(begin + j, V);
    v.store(buf + j);
    vmax = at::vec::maximum(vmax, v);
  }
  if (j < len) {
    const Vec v = x(begin + j, len - j);
    v.store(buf + j);
    vmax = at::vec::maximum(vmax, v);
  }
  return reduce_max(vmax);
}

// buf[0, round_up(len)) <- exp(buf - max); returns the sum (padding lanes give 0). Four
// accumulators: a quarter of the additions per lane (long float32 rows summed with a quarter
// of one accumulator's rounding growth) and four independent addition chains.
template <typename acc_t>
inline acc_t exp_and_sum(acc_t* buf, int64_t len, acc_t max, bool store) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t V = vec_size<acc_t>();
  const Vec vmax(max);
  Vec vsum[4] = {Vec(0), Vec(0), Vec(0), Vec(0)};
  const int64_t padded = round_up(len, V);
  auto step = [&](int64_t j, Vec& acc) {
    const Vec e = (Vec::loadu(buf + j) - vmax).exp_u20();
    if (store) {
      e.store(buf + j);
    }
    acc = acc + e;
  };
  int64_t j = 0;
  for (; j + 4 * V <= padded; j += 4 * V) {
    for (int k = 0; k < 4; ++k) {
      step(j + k * V, vsum[k]);
    }
  }
  for (; j < padded; j += V) {
    step(j, vsum[0]);
  }
  return reduce_sum((vsum[0] + vsum[1]) + (vsum[2] + vsum[3]));
}

template <typename T, typename acc_t, typename Source>
void softmax_row(const Source& x, int64_t n, T* out, acc_t* buf) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t V = vec_size<acc_t>();
  if (n <= kStagedElements) {
    const acc_t max = stage_and_max(x, 0, n, buf);
    switch (row_kind(max)) {
      case RowKind::kEmpty:
        fill(out, n, T(0));
        return;
      case RowKind::kNaN:
        fill(out, n, T(std::numeric_limits<acc_t>::quiet_NaN()));
        return;
      case RowKind::kNormal:
        break;
    }
    // The max element contributes exp(0) = 1, so sum >= 1 and 1 / sum is finite.
    const Vec inv(acc_t(1) / exp_and_sum(buf, n, max, /*store=*/true));
    int64_t j = 0;
    for (; j + V <= n; j += V) {
      store_acc<T, acc_t>(out + j, Vec::loadu(buf + j) * inv);
    }
    if (j < n) {
      store_acc<T, acc_t>(out + j, Vec::loadu(buf + j) * inv, n - j);
    }
    return;
  }
  // Longer rows: online max and sum over chunks (the running sum rescaled when the max grows).
  acc_t max = neg_inf<acc_t>();
  acc_t sum = 0;
  for (int64_t begin = 0; begin < n; begin += kStagedElements) {
    const int64_t len = std::min(kStagedElements, n - begin);
    const acc_t chunk_max = stage_and_max(x, begin, len, buf);
    const RowKind kind = row_kind(chunk_max);
    if (kind == RowKind::kNaN) {
      fill(out, n, T(std::numeric_limits<acc_t>::quiet_NaN()));
      return;
    }
    if (kind == RowKind::kEmpty) {
      continue;
    }
    if (chunk_max > max) {
      sum *= std::exp(max - chunk_max);  // 0 while max is still -inf
      max = chunk_max;
    }
    sum += exp_and_sum(buf, len, max, /*store=*/false);
  }
  if (max == neg_inf<acc_t>()) {
    fill(out, n, T(0));
    return;
  }
  const Vec vmax(max);
  const Vec inv(acc_t(1) / sum);
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    store_acc<T, acc_t>(out + j, (x(j, V) - vmax).exp_u20() * inv);
  }
  if (j < n) {
    store_acc<T, acc_t>(out + j, (x(j, n - j) - vmax).exp_u20() * inv, n - j);
  }
}

// ---- strided slices (inner > 1): a block of columns, one lane per column ----------------

// Softmax down `width` adjacent columns of a [dim_size, inner] matrix. `x(d, c, count)` gives
// x for row d, columns [c, c + count) of the block; `out` points at column 0 of the block in
// row 0. When `staged`, buf holds dim_size x round_up(width) values and the input is read once;
// otherwise the passes re-read it. col_shift / col_inv hold round_up(width) values.
template <typename T, typename acc_t, typename Source>
void softmax_columns(const Source& x, int64_t dim_size, int64_t inner, int64_t width, T* out, acc_t* buf, bool staged,
                     acc_t* col_shift, acc_t* col_inv) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t V = vec_size<acc_t>();
  const int64_t padded = round_up(width, V);
  // Pass 1: column maxima (into col_shift).
  for (int64_t c = 0; c < padded; c += V) {
    const int64_t count = std::min(V, width - c);
    Vec vmax(neg_inf<acc_t>());
    for (int64_t d = 0; d < dim_size; ++d) {
      const Vec v = x(d, c, count);
      if (staged) {
        v.store(buf + d * padded + c);
      }
      vmax = at::vec::maximum(vmax, v);
    }
    vmax.store(col_shift + c);
  }
  // A column whose max is -inf, NaN or +inf would make x - max NaN: shift it by 0 instead and
  // let its final factor decide (0 for an empty column, whose exps are all 0; NaN for a NaN
  // column). col_inv temporarily holds the kind.
  for (int64_t c = 0; c < padded; ++c) {
    const RowKind kind = row_kind(col_shift[c]);
    col_inv[c] = static_cast<acc_t>(static_cast<int>(kind));
    if (kind != RowKind::kNormal) {
      col_shift[c] = 0;
    }
  }
  // Pass 2: sums of exp(x - shift), then the per-column factor.
  for (int64_t c = 0; c < padded; c += V) {
    const int64_t count = std::min(V, width - c);
    const Vec vshift = Vec::loadu(col_shift + c);
    Vec vsum(0);
    for (int64_t d = 0; d < dim_size; ++d) {
      const Vec v = staged ? Vec::loadu(buf + d * padded + c) : x(d, c, count);
      const Vec e = (v - vshift).exp_u20();
      if (staged) {
        e.store(buf + d * padded + c);
      }
      vsum = vsum + e;
    }
    __at_align__ acc_t sums[V];
    vsum.store(sums);
    for (int64_t k = 0; k < V; ++k) {
      const auto kind = static_cast<RowKind>(static_cast<int>(col_inv[c + k]));
      col_inv[c + k] = kind == RowKind::kNormal  ? acc_t(1) / sums[k]
                       : kind == RowKind::kEmpty ? acc_t(0)
                                                 : std::numeric_limits<acc_t>::quiet_NaN();
    }
  }
  // Pass 3: write.
  for (int64_t c = 0; c < padded; c += V) {
    const int64_t count = std::min(V, width - c);
    const Vec vshift = Vec::loadu(col_shift + c);
    const Vec vinv = Vec::loadu(col_inv + c);
    for (int64_t d = 0; d < dim_size; ++d) {
      const Vec e = staged ? Vec::loadu(buf + d * padded + c) : (x(d, c, count) - vshift).exp_u20();
      const Vec y = e * vinv;
      if (count == V) {
        store_acc<T, acc_t>(out + d * inner + c, y);
      } else {
        store_acc<T, acc_t>(out + d * inner + c, y, count);
      }
    }
  }
}

// ---- forward drivers ---------------------------------------------------------------------

// inner == 1: row_source(r) gives the Source of row r.
template <typename T, typename acc_t, typename RowSource>
void forward_rows(const SoftmaxGeometry& g, T* out, const RowSource& row_source) {
  constexpr int64_t V = vec_size<acc_t>();
  const int64_t n = g.dim_size;
  at::parallel_for(0, g.outer, grain_for(n, kElementsPerTask), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(round_up(std::min(n, kStagedElements), V));
    for (int64_t r = begin; r < end; ++r) {
      softmax_row<T, acc_t>(row_source(r), n, out + r * n, buf.data());
    }
  });
}

// inner > 1: column_source(o, c0, width, scratch) gives the Source of the block of columns
// [c0, c0 + width) at outer index o (scratch: a per-task int64 vector it may use).
template <typename T, typename acc_t, typename ColumnSource>
void forward_columns(const SoftmaxGeometry& g, T* out, const ColumnSource& column_source) {
  constexpr int64_t V = vec_size<acc_t>();
  const int64_t n = g.dim_size;
  // Blocks as wide as the staging buffer allows (dim_size x width elements).
  const bool staged = n * V <= kStagedElements;
  const int64_t width = staged ? std::min(round_up(g.inner, V), kStagedElements / n / V * V) : V;
  const int64_t blocks_per_outer = (g.inner + width - 1) / width;
  const int64_t tasks = g.outer * blocks_per_outer;
  at::parallel_for(0, tasks, grain_for(n * width, kElementsPerTask), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(staged ? n * round_up(width, V) : 0);
    std::vector<acc_t> col_shift(round_up(width, V));
    std::vector<acc_t> col_inv(round_up(width, V));
    std::vector<int64_t> scratch;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o = t / blocks_per_outer;
      const int64_t c0 = (t % blocks_per_outer) * width;
      const int64_t w = std::min(width, g.inner - c0);
      softmax_columns<T, acc_t>(column_source(o, c0, w, scratch), n, g.inner, w, out + o * n * g.inner + c0, buf.data(),
                                staged, col_shift.data(), col_inv.data());
    }
  });
}

// Column sources: element (d, c) of the block at outer index o, block start c0.
template <typename T, typename acc_t, bool kScaled>
struct PlainColumns {
  const T* scores;  // at (o, 0, c0)
  int64_t inner;
  acc_t scale;
  inline Vectorized<acc_t> operator()(int64_t d, int64_t c, int64_t count) const {
    return PlainSource<T, acc_t, kScaled>{scores + d * inner, scale}(c, count);
  }
};

// Masked columns: the mask offsets of the block's columns are precomputed (mask_offsets[c]
// for column c0 + c), row d adds d * dim_stride. Scalar gathers: the mask may broadcast in
// any pattern across columns.
template <typename T, typename M, typename acc_t>
struct MaskedColumns {
  const T* scores;  // at (o, 0, c0)
  int64_t inner;
  const M* mask;
  const int64_t* mask_offsets;
  int64_t dim_stride;
  acc_t scale;
  inline Vectorized<acc_t> operator()(int64_t d, int64_t c, int64_t count) const {
    constexpr int64_t V = vec_size<acc_t>();
    __at_align__ acc_t x[V];
    const T* s = scores + d * inner + c;
    for (int64_t k = 0; k < V; ++k) {
      if (k >= count) {
        x[k] = neg_inf<acc_t>();
        continue;
      }
      const M m = mask[mask_offsets[c + k] + d * dim_stride];
      if constexpr (std::is_same_v<M, bool>) {
        x[k] = masked_score<acc_t>(static_cast<acc_t>(s[k]), scale, m);
      } else {
        x[k] = biased_score<acc_t>(static_cast<acc_t>(s[k]), scale, static_cast<acc_t>(m));
      }
    }
    return Vectorized<acc_t>::loadu(x);
  }
};

template <typename T, bool kScaled>
void plain_forward(const T* scores, double scale, const SoftmaxGeometry& g, T* out) {
  using acc_t = acc_type_t<T>;
  const int64_t n = g.dim_size;
  const acc_t s = static_cast<acc_t>(scale);
  if (g.inner == 1) {
    forward_rows<T, acc_t>(g, out, [&](int64_t r) { return PlainSource<T, acc_t, kScaled>{scores + r * n, s}; });
    return;
  }
  forward_columns<T, acc_t>(g, out, [&](int64_t o, int64_t c0, int64_t, std::vector<int64_t>&) {
    return PlainColumns<T, acc_t, kScaled>{scores + o * n * g.inner + c0, g.inner, s};
  });
}

template <typename T, typename M>
void masked_forward(const T* scores, const M* mask, const MaskGeometry& mg, double scale, const SoftmaxGeometry& g,
                    T* out) {
  using acc_t = acc_type_t<T>;
  const int64_t n = g.dim_size;
  const acc_t s = static_cast<acc_t>(scale);
  if (g.inner == 1) {
    forward_rows<T, acc_t>(g, out, [&](int64_t r) {
      const M* m = mask + mg.outer.offset(r);
      return MaskSource<T, M, acc_t>{scores + r * n, m, mg.dim_stride, s};
    });
    return;
  }
  forward_columns<T, acc_t>(g, out, [&](int64_t o, int64_t c0, int64_t w, std::vector<int64_t>& offsets) {
    offsets.resize(w);
    const int64_t base = mg.outer.offset(o);
    for (int64_t c = 0; c < w; ++c) {
      offsets[c] = base + mg.inner.offset(c0 + c);
    }
    return MaskedColumns<T, M, acc_t>{scores + o * n * g.inner + c0, g.inner, mask, offsets.data(), mg.dim_stride, s};
  });
}

void softmax_forward_kernel(const at::Tensor& scores, const at::Tensor& mask, const MaskGeometry& mask_geometry,
                            double scale, const SoftmaxGeometry& geometry, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "safeattn_softmax_cpu", [&] {
    using acc_t = acc_type_t<scalar_t>;
    const scalar_t* in = scores.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    switch (mask_geometry.kind) {
      case MaskKind::kNone:
        if (scale == 1.0) {
          plain_forward<scalar_t, false>(in, scale, geometry, o);
        } else {
          plain_forward<scalar_t, true>(in, scale, geometry, o);
        }
        break;
      case MaskKind::kBool:
        masked_forward<scalar_t, bool>(in, mask.const_data_ptr<bool>(), mask_geometry, scale, geometry, o);
        break;
      case MaskKind::kFloat:
        masked_forward<scalar_t, scalar_t>(in, mask.const_data_ptr<scalar_t>(), mask_geometry, scale, geometry, o);
        break;
      case MaskKind::kFloat32:
        if constexpr (!std::is_same_v<scalar_t, acc_t>) {
          masked_forward<scalar_t, float>(in, mask.const_data_ptr<float>(), mask_geometry, scale, geometry, o);
        } else {
          TORCH_CHECK(false, "safeattn softmax kernel: a float32 mask goes with half or bfloat16 scores");
        }
        break;
    }
  });
}

// ---- backward ----------------------------------------------------------------------------

template <typename T, typename acc_t>
void backward_typed(const T* grad_out, const T* out, acc_t scale, const SoftmaxGeometry& g, T* grad_scores,
                    acc_t* grad_x) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t V = vec_size<acc_t>();
  const int64_t n = g.dim_size;
  const Vec zero(0);
  const Vec vscale(scale);
  // dot term and gradient, vectorised forms of softmax_detail::dot_term / grad_element.
  auto dot_term_v = [&](const Vec& go, const Vec& o) { return Vec::blendv(go * o, zero, o == zero); };
  auto grad_v = [&](const Vec& go, const Vec& o, const Vec& dot) {
    return Vec::blendv(o * (go - dot), zero, o == zero);
  };
  // `count` lanes (V: a whole vector) in acc_t.
  auto load = [](const T* p, int64_t count) {
    return count == V ? load_acc<T, acc_t>(p) : load_acc<T, acc_t>(p, count);
  };
  // The gradient gr at `count` lanes: scaled into gs, unscaled into gx when asked for (non-null).
  auto store = [&](T* gs, acc_t* gx, const Vec& gr, int64_t count) {
    if (count == V) {
      store_acc<T, acc_t>(gs, gr * vscale);
      if (gx != nullptr) {
        gr.store(gx);
      }
    } else {
      store_acc<T, acc_t>(gs, gr * vscale, count);
      if (gx != nullptr) {
        gr.store(gx, count);
      }
    }
  };
  if (g.inner == 1) {
    at::parallel_for(0, g.outer, grain_for(n, kElementsPerTask), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* go = grad_out + r * n;
        const T* o = out + r * n;
        Vec vdot(0);
        int64_t j = 0;
        for (; j + V <= n; j += V) {
          vdot = vdot + dot_term_v(load_acc<T, acc_t>(go + j), load_acc<T, acc_t>(o + j));
        }
        if (j < n) {
          // Partial loads give 0 outputs past the row: they add nothing.
          vdot = vdot + dot_term_v(load_acc<T, acc_t>(go + j, n - j), load_acc<T, acc_t>(o + j, n - j));
        }
        const Vec dot(reduce_sum(vdot));
        T* gs = grad_scores + r * n;
        acc_t* gx = grad_x != nullptr ? grad_x + r * n : nullptr;
        for (j = 0; j < n; j += V) {
          const int64_t count = std::min(V, n - j);
          const Vec gr = grad_v(load(go + j, count), load(o + j, count), dot);
          store(gs + j, gx != nullptr ? gx + j : nullptr, gr, count);
        }
      }
    });
    return;
  }
  // Strided: blocks of V columns, one lane per column; the second pass re-reads (from cache
  // when dim_size x V fits).
  const int64_t blocks_per_outer = (g.inner + V - 1) / V;
  const int64_t tasks = g.outer * blocks_per_outer;
  at::parallel_for(0, tasks, grain_for(n * V, kElementsPerTask), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o_idx = t / blocks_per_outer;
      const int64_t c0 = (t % blocks_per_outer) * V;
      const int64_t count = std::min(V, g.inner - c0);
      const int64_t base = o_idx * n * g.inner + c0;
      Vec vdot(0);
      for (int64_t d = 0; d < n; ++d) {
        const int64_t at = base + d * g.inner;
        vdot = vdot + dot_term_v(load(grad_out + at, count), load(out + at, count));
      }
      for (int64_t d = 0; d < n; ++d) {
        const int64_t at = base + d * g.inner;
        const Vec gr = grad_v(load(grad_out + at, count), load(out + at, count), vdot);
        store(grad_scores + at, grad_x != nullptr ? grad_x + at : nullptr, gr, count);
      }
    }
  });
}

void softmax_backward_kernel(const at::Tensor& grad_out, const at::Tensor& out, double scale,
                             const SoftmaxGeometry& geometry, at::Tensor& grad_scores, at::Tensor& grad_x) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "safeattn_softmax_backward_cpu", [&] {
    using acc_t = acc_type_t<scalar_t>;
    backward_typed<scalar_t, acc_t>(grad_out.const_data_ptr<scalar_t>(), out.const_data_ptr<scalar_t>(),
                                    static_cast<acc_t>(scale), geometry, grad_scores.mutable_data_ptr<scalar_t>(),
                                    grad_x.defined() ? grad_x.mutable_data_ptr<acc_t>() : nullptr);
  });
}

}  // namespace

SAFEATTN_REGISTER_ISA_KERNEL(softmax_forward_cpu_stub, &softmax_forward_kernel);
SAFEATTN_REGISTER_ISA_KERNEL(softmax_backward_cpu_stub, &softmax_backward_kernel);

}  // namespace safeattn::cpu
