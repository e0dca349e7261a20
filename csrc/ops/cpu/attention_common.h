// Helpers shared by the attention forward and backward CPU kernels. Included only by the
// per-ISA kernel files (so at::vec resolves to that file's ISA); everything is internal.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/version.h>

#include "ops/attention.h"
#include "ops/cpu/parallel.h"

// The BLAS sgemm (Fortran interface, 32-bit ints as ATen's CPUBlas.cpp declares it) that
// libtorch_cpu exports on x86-64 Linux (MKL in the PyPI wheels). Weak: a torch without it leaves
// the address null and the tiles take brgemm.
#if defined(__linux__) && defined(__x86_64__)
#define SAFEATTN_BLAS_SGEMM 1
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));
#endif

namespace safeattn::cpu {
namespace {

using at::vec::Vectorized;

// Scores are computed in float32, or float64 for float64 inputs (gradcheck).
template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// C[M, N] (+)= A[M, K] @ B[K, N], row-major with leading dimensions, on the calling thread (the
// tiles need it inside at::parallel_for). float32 goes to at::native::cpublas::brgemm (oneDNN's
// micro-kernel) in the AVX-512 build of this file, and to the BLAS sgemm in the others, where it
// is faster: 2-core AMD EPYC with oneDNN and ATen held to AVX2, B=1 H=8 S=2048 D=128 forward
// 133 -> 108 ms (brgemm -> sgemm), while with AVX-512 brgemm is the faster one (89 against 109).
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool accumulate) {
#if defined(SAFEATTN_BLAS_SGEMM) && !defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (sgemm_ != nullptr && std::max({M, N, K, lda, ldb, ldc}) <= kIntMax) {
    // Column-major C^T = B^T A^T is the row-major product.
    const char no_trans = 'N';
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
    const int ld_b = static_cast<int>(ldb), ld_a = static_cast<int>(lda), ld_c = static_cast<int>(ldc);
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    sgemm_(&no_trans, &no_trans, &m, &n, &k, &one, B, &ld_b, A, &ld_a, &beta, C, &ld_c);
    return;
  }
#endif
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
}

// C[M, N] = A[M, K] @ B[N, K]^T, row-major, B read in place (its rows as a transposed operand) by
// the BLAS sgemm. Whether it is there: blas_sgemm_available().
inline bool blas_sgemm_available() {
#if defined(SAFEATTN_BLAS_SGEMM)
  return sgemm_ != nullptr;
#else
  return false;
#endif
}
inline void gemm_transposed_b(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                              float* C, int64_t ldc) {
#if defined(SAFEATTN_BLAS_SGEMM)
  TORCH_INTERNAL_ASSERT(sgemm_ != nullptr && std::max({M, N, K, lda, ldb, ldc}) <= std::numeric_limits<int>::max());
  // Column-major C^T [N, M] = B [N, K] (stored as a transposed K x N) times A^T.
  const char trans = 'T', no_trans = 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int ld_b = static_cast<int>(ldb), ld_a = static_cast<int>(lda), ld_c = static_cast<int>(ldc);
  const float one = 1.0f, zero = 0.0f;
  sgemm_(&trans, &no_trans, &m, &n, &k, &one, B, &ld_b, A, &ld_a, &zero, C, &ld_c);
#else
  TORCH_INTERNAL_ASSERT(false, "gemm_transposed_b without a BLAS sgemm");
#endif
}

// float64 exists for gradcheck on small shapes only: a plain loop is enough.
inline void gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb, double* C,
                 int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < M; ++i) {
    double* c = C + i * ldc;
    if (!accumulate) {
      std::fill(c, c + N, 0.0);
    }
    for (int64_t k = 0; k < K; ++k) {
      const double a = A[i * lda + k];
      const double* b = B + k * ldb;
      for (int64_t j = 0; j < N; ++j) {
        c[j] += a * b[j];
      }
    }
  }
}

// exp that keeps NaN: exp_u20 (the fast exp PyTorch's CPU flash kernel uses, -inf -> 0)
// clamps its input, which would turn a NaN score into a finite number and hide it.
template <typename T>
inline Vectorized<T> exp_keep_nan(const Vectorized<T>& x) {
  Vectorized<T> y;
  if constexpr (std::is_same_v<T, float>) {
    y = x.exp_u20();
  } else {
    y = x.exp();
  }
  return Vectorized<T>::blendv(y, x, x != x);
}

// NaN-propagating max of two scalars (std::max would drop a NaN in its second argument).
template <typename T>
inline T max_keep_nan(T a, T b) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::numeric_limits<T>::quiet_NaN();
  }
  return a > b ? a : b;
}

// The attention mask as the kernels read it: a pointer and four element strides (0 on
// broadcast dims), in one of the dtypes check_attention accepts.
enum class MaskKind { kNone, kBool, kFloat, kHalf, kBFloat16, kDouble };

struct MaskView {
  MaskKind kind = MaskKind::kNone;
  const void* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_kv = 0;

  explicit MaskView(const at::Tensor& mask) {
    if (!mask.defined()) {
      return;
    }
    // The mask's dtype as the kernels name it.
    static constexpr std::pair<at::ScalarType, MaskKind> kKinds[] = {
        {at::kBool, MaskKind::kBool},         {at::kFloat, MaskKind::kFloat},   {at::kHalf, MaskKind::kHalf},
        {at::kBFloat16, MaskKind::kBFloat16}, {at::kDouble, MaskKind::kDouble},
    };
    for (const auto& [dtype, dtype_kind] : kKinds) {
      if (dtype == mask.scalar_type()) {
        kind = dtype_kind;
      }
    }
    TORCH_CHECK(kind != MaskKind::kNone, "attention: unexpected attn_mask dtype");
    data = mask.data_ptr();
    stride_b = mask.stride(0);
    stride_h = mask.stride(1);
    stride_q = mask.stride(2);
    stride_kv = mask.stride(3);
  }

  int64_t offset(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return b * stride_b + h * stride_h + i * stride_q + j * stride_kv;
  }
};

// The first and one past the last nonzero byte of p[0 .. n), eight at a time: (n, 0) when none.
// A bool mask's row, read as bytes (any nonzero byte is True, as `m[c] ? ...` reads it).
inline int64_t first_nonzero(const unsigned char* p, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t word;
    std::memcpy(&word, p + j, 8);
    if (word != 0) {
      break;
    }
  }
  for (; j < n && p[j] == 0; ++j) {
  }
  return j;
}
inline int64_t end_of_nonzero(const unsigned char* p, int64_t n) {
  int64_t j = n;
  for (; j >= 8; j -= 8) {
    uint64_t word;
    std::memcpy(&word, p + j - 8, 8);
    if (word != 0) {
      break;
    }
  }
  for (; j > 0 && p[j - 1] == 0; --j) {
  }
  return j;
}

// Widens [begin, end) to the first and one past the last key of one mask row that the scores of
// type T see: a nonzero bool, or a float entry that is not -inf once in T (what apply_mask_run
// and add_staged_mask hide). Only [0, begin) and [end, kv_len) are searched.
template <typename T, typename M>
inline void widen_to_visible(const M* row, int64_t stride, int64_t kv_len, int64_t& begin, int64_t& end) {
  auto visible = [&](int64_t j) {
    if constexpr (std::is_same_v<M, unsigned char>) {
      return row[j * stride] != 0;
    } else {
      return !(static_cast<T>(row[j * stride]) == kNegInf<T>);
    }
  };
  if constexpr (std::is_same_v<M, unsigned char>) {
    if (stride == 1) {
      begin = first_nonzero(row, begin);               // begin again when none before it
      end += end_of_nonzero(row + end, kv_len - end);  // end again when none after it
      return;
    }
  }
  for (int64_t j = 0; j < begin; ++j) {
    if (visible(j)) {
      begin = j;
      break;
    }
  }
  for (int64_t j = kv_len - 1; j >= end; --j) {
    if (visible(j)) {
      end = j + 1;
      break;
    }
  }
}

// The keys [begin, end) outside which rows [i0, i0 + m) of head h of batch b of the mask hide
// every score of type T (begin == end: the rows see no key): False, or -inf in a float mask. A
// tile of keys whose every score is masked changes nothing (its p are all 0 and the running max
// stays), so the kernels start and stop their key loops there: a sliding window, chunks, packed
// documents, padding or a causal mask given as a dense mask then cost what they show, as
// is_causal's diagonal does. The rows are read last first, so that a causal mask's widest row
// sets the end at once.
template <typename T>
inline std::pair<int64_t, int64_t> mask_keys(const MaskView& mask, int64_t b, int64_t h, int64_t i0, int64_t m,
                                             int64_t kv_len) {
  if (mask.kind == MaskKind::kNone || kv_len == 0) {
    return {0, kv_len};
  }
  const int64_t rows = mask.stride_q == 0 ? std::min<int64_t>(m, 1) : m;
  const int64_t stride = mask.stride_kv;
  const int64_t keys = stride == 0 ? 1 : kv_len;  // one entry for every key: read it once
  int64_t begin = keys, end = 0;
  for (int64_t r = rows - 1; r >= 0 && (begin > 0 || end < keys); --r) {
    const int64_t at = mask.offset(b, h, i0 + r, 0);
    switch (mask.kind) {
      case MaskKind::kBool:
        widen_to_visible<T>(static_cast<const unsigned char*>(mask.data) + at, stride, keys, begin, end);
        break;
      case MaskKind::kFloat:
        widen_to_visible<T>(static_cast<const float*>(mask.data) + at, stride, keys, begin, end);
        break;
      case MaskKind::kHalf:
        widen_to_visible<T>(static_cast<const c10::Half*>(mask.data) + at, stride, keys, begin, end);
        break;
      case MaskKind::kBFloat16:
        widen_to_visible<T>(static_cast<const c10::BFloat16*>(mask.data) + at, stride, keys, begin, end);
        break;
      case MaskKind::kDouble:
        widen_to_visible<T>(static_cast<const double*>(mask.data) + at, stride, keys, begin, end);
        break;
      case MaskKind::kNone:
        break;
    }
  }
  if (begin >= end) {
    return {0, 0};
  }
  return stride == 0 ? std::pair<int64_t, int64_t>{0, kv_len} : std::pair<int64_t, int64_t>{begin, end};
}

// mask_keys of every query tile (q_block rows) of every (batch, head), computed once per call,
// in parallel, before the kernel's own loop: heads or batch rows that share the mask (stride 0)
// share their spans, so a [B, 1, Q, KV] mask is read once, not once per head.
class MaskSpans {
 public:
  template <typename T>
  static MaskSpans compute(const MaskView& mask, int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len,
                           int64_t q_block) {
    MaskSpans spans = every_key(kv_len);
    if (mask.kind == MaskKind::kNone) {
      return spans;
    }
    spans.batch_ = mask.stride_b == 0 ? 1 : batch;
    spans.heads_ = mask.stride_h == 0 ? 1 : heads;
    spans.tiles_ = mask.stride_q == 0 ? 1 : (q_len + q_block - 1) / q_block;
    spans.spans_.resize(spans.batch_ * spans.heads_ * spans.tiles_);
    const int64_t rows = mask.stride_q == 0 ? std::min<int64_t>(q_len, 1) : q_block;
    at::parallel_for(0, static_cast<int64_t>(spans.spans_.size()), grain_for(rows * kv_len, int64_t{1} << 16),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t index = begin; index < end; ++index) {
                         const int64_t t = index % spans.tiles_, bh = index / spans.tiles_;
                         const int64_t i0 = t * q_block;
                         spans.spans_[index] = mask_keys<T>(mask, bh / spans.heads_, bh % spans.heads_, i0,
                                                            std::min(rows, q_len - i0), kv_len);
                       }
                     });
    return spans;
  }

  // Every key for every tile: what compute gives without a mask.
  static MaskSpans every_key(int64_t kv_len) {
    MaskSpans spans;
    spans.kv_len_ = kv_len;
    return spans;
  }

  // The span of query tile t of head h of batch b ([0, kv_len) without a mask).
  std::pair<int64_t, int64_t> at(int64_t b, int64_t h, int64_t t) const {
    if (spans_.empty()) {
      return {0, kv_len_};
    }
    const int64_t index = ((batch_ == 1 ? 0 : b) * heads_ + (heads_ == 1 ? 0 : h)) * tiles_ + (tiles_ == 1 ? 0 : t);
    return spans_[index];
  }

 private:
  int64_t kv_len_ = 0, batch_ = 1, heads_ = 1, tiles_ = 1;
  std::vector<std::pair<int64_t, int64_t>> spans_;
};

// s += bias, except s = -inf where the bias is -inf: a masked element hides its score, NaN
// included (as a False bool does, and as the CUDA kernels and the backward's add_staged_mask do).
template <typename T, typename M>
inline void add_bias_run(T* s, int64_t count, const M* m, int64_t stride) {
  for (int64_t c = 0; c < count; ++c) {
    const T bias = static_cast<T>(m[c * stride]);
    s[c] = bias == kNegInf<T> ? bias : s[c] + bias;
  }
}

// Applies `count` mask elements starting at element `offset`, `stride` apart, to the scores
// s[0 .. count): a False bool sets -inf (a NaN score behind it does not leak), a float adds.
template <typename T>
inline void apply_mask_run(T* s, int64_t count, const MaskView& mask, int64_t offset, int64_t stride) {
  switch (mask.kind) {
    case MaskKind::kNone:
      return;
    case MaskKind::kBool: {
      const bool* m = static_cast<const bool*>(mask.data) + offset;
      if (stride == 1) {
        for (int64_t c = 0; c < count; ++c) {
          s[c] = m[c] ? s[c] : kNegInf<T>;
        }
      } else {
        for (int64_t c = 0; c < count; ++c) {
          s[c] = m[c * stride] ? s[c] : kNegInf<T>;
        }
      }
      return;
    }
    case MaskKind::kFloat:
      add_bias_run(s, count, static_cast<const float*>(mask.data) + offset, stride);
      return;
    case MaskKind::kHalf:
      add_bias_run(s, count, static_cast<const c10::Half*>(mask.data) + offset, stride);
      return;
    case MaskKind::kBFloat16:
      add_bias_run(s, count, static_cast<const c10::BFloat16*>(mask.data) + offset, stride);
      return;
    case MaskKind::kDouble:
      add_bias_run(s, count, static_cast<const double*>(mask.data) + offset, stride);
      return;
  }
}

// Stages the mask for a transposed tile: dst[r * ld + c] = the additive value of element
// (query i0 + c, key j0 + r), read along the mask's rows (contiguous in memory) rather than
// down its columns. A bool mask becomes 0 / -inf. `first` is the offset of (i0, j0).
template <typename T>
inline void stage_mask_transposed(T* dst, int64_t ld, const MaskView& mask, int64_t first, int64_t m, int64_t n) {
  auto stage = [&](auto convert, const auto* base) {
    for (int64_t c = 0; c < m; ++c) {
      const auto* row = base + first + c * mask.stride_q;
      for (int64_t r = 0; r < n; ++r) {
        dst[r * ld + c] = convert(row[r * mask.stride_kv]);
      }
    }
  };
  auto to_acc = [](auto x) { return static_cast<T>(x); };
  switch (mask.kind) {
    case MaskKind::kNone:
      return;
    case MaskKind::kBool:
      stage([](bool x) { return x ? T(0) : kNegInf<T>; }, static_cast<const bool*>(mask.data));
      return;
    case MaskKind::kFloat:
      stage(to_acc, static_cast<const float*>(mask.data));
      return;
    case MaskKind::kHalf:
      stage(to_acc, static_cast<const c10::Half*>(mask.data));
      return;
    case MaskKind::kBFloat16:
      stage(to_acc, static_cast<const c10::BFloat16*>(mask.data));
      return;
    case MaskKind::kDouble:
      stage(to_acc, static_cast<const double*>(mask.data));
      return;
  }
}

// s = s + mask, except s = -inf where the mask is -inf, so that a NaN score behind a masked
// element stays hidden (as a False bool mask hides it in the forward). A row the forward found
// NaN has lse NaN, so its probabilities are NaN whatever this returns.
template <typename T>
inline void add_staged_mask(T* s, const T* staged, int64_t count) {
  using Vec = Vectorized<T>;
  const Vec neg_inf(kNegInf<T>);
  for (int64_t c = 0; c < count; c += Vec::size()) {
    const Vec mv = Vec::loadu(staged + c);
    Vec::blendv(Vec::loadu(s + c) + mv, neg_inf, mv == neg_inf).store(s + c);
  }
}

// s = scale * s, or softcap * tanh(scale * s / softcap), over s[0 .. count) (count may be
// rounded up to a whole vector inside a tile buffer). With softcap, tanh values go to `t`
// when it is not null (the backward needs 1 - t^2).
template <typename T>
inline void scale_scores(T* s, int64_t count, T scale, T softcap, T* t) {
  using Vec = Vectorized<T>;
  const int64_t vec_end = count - count % Vec::size();
  if (softcap > 0) {
    const Vec pre(scale / softcap);
    const Vec post(softcap);
    int64_t c = 0;
    for (; c < vec_end; c += Vec::size()) {
      const Vec th = (Vec::loadu(s + c) * pre).tanh();
      if (t != nullptr) {
        th.store(t + c);
      }
      (th * post).store(s + c);
    }
    for (; c < count; ++c) {
      const T th = std::tanh(s[c] * (scale / softcap));
      if (t != nullptr) {
        t[c] = th;
      }
      s[c] = softcap * th;
    }
  } else {
    const Vec vs(scale);
    int64_t c = 0;
    for (; c < vec_end; c += Vec::size()) {
      (Vec::loadu(s + c) * vs).store(s + c);
    }
    for (; c < count; ++c) {
      s[c] *= scale;
    }
  }
}

inline int64_t clamp_to(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

inline int64_t round_up(int64_t x, int64_t multiple) {
  return (x + multiple - 1) / multiple * multiple;
}

// attention's key_ranges as the CPU kernels read them ([B, Q, 2] int32, rows of 2 contiguous;
// undefined: every key): query i of batch b keeps keys [lo, hi), clamped to [0, kv_len); lo >= hi
// keeps none.
class KeyRanges {
 public:
  KeyRanges(const at::Tensor& ranges, int64_t kv_len)
      : ptr_(ranges.defined() ? ranges.const_data_ptr<int32_t>() : nullptr),
        stride_b_(ranges.defined() ? ranges.stride(0) : 0),
        stride_q_(ranges.defined() ? ranges.stride(1) : 0),
        kv_len_(kv_len) {}

  bool defined() const {
    return ptr_ != nullptr;
  }

  // Row i's keys [lo, hi), lo <= hi.
  std::pair<int64_t, int64_t> row(int64_t b, int64_t i) const {
    if (ptr_ == nullptr) {
      return {0, kv_len_};
    }
    const int32_t* r = ptr_ + b * stride_b_ + i * stride_q_;
    const int64_t lo = clamp_to(r[0], 0, kv_len_);
    return {lo, clamp_to(r[1], lo, kv_len_)};
  }

  // The keys some row of [i0, i0 + rows) keeps, [begin, end); {0, 0} when none does.
  std::pair<int64_t, int64_t> rows(int64_t b, int64_t i0, int64_t rows) const {
    if (ptr_ == nullptr) {
      return {0, kv_len_};
    }
    int64_t begin = kv_len_, end = 0;
    for (int64_t i = i0; i < i0 + rows; ++i) {
      const auto [lo, hi] = row(b, i);
      if (lo < hi) {
        begin = std::min(begin, lo);
        end = std::max(end, hi);
      }
    }
    return begin < end ? std::pair<int64_t, int64_t>{begin, end} : std::pair<int64_t, int64_t>{0, 0};
  }

 private:
  const int32_t* ptr_;
  int64_t stride_b_, stride_q_, kv_len_;
};

// ---- Reduced-precision tiles: bf16 / fp16 products with float32 accumulation ----------------
//
// On a CPU with bf16 dot-product hardware (AVX512-BF16: vdpbf16ps; AMX-BF16: tile multiplies)
// the tiles of bf16 inputs are multiplied in bf16 with float32 accumulation by oneDNN's brgemm
// micro-kernel, as PyTorch's own CPU flash attention does with AMX; fp16 likewise where AMX-FP16
// exists. That micro-kernel wants its right operand B in the "VNNI" layout (the one
// cpublas::pack produces): pairs of consecutive rows of B (the reduction dimension) interleaved,
// in blocks of kVnniCols columns, so that one 32-bit word holds B[2p][n] and B[2p + 1][n].
// Given without VNNI layout (is_vnni=false) brgemm takes a generic GEMM instead, which ran
// slower than our float32 tiles (2-core AMD EPYC, 64 x 512 x 128: bf16 VNNI about 2x the
// float32 brgemm, bf16 plain about 0.8x). Element (k, n) of a packed [K, N] matrix sits at
//   (n / 64) * block_stride + (k / 2) * 128 + (n % 64) * 2 + k % 2
// with rows past K and columns past N zero (K is padded to even: the pair's second half).
// Only the AVX-512 build of the kernels takes these tiles; the others keep float32.
#if defined(CPU_CAPABILITY_AVX512)
#define SAFEATTN_LOWP_TILES 1
#endif

constexpr int64_t kVnniCols = 64;  // the block width PyTorch packs for AMX (cpublas::pack)

// Whether oneDNN may use `dtype`'s dot-product instructions: ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA
// before oneDNN 2.0) can hold it below them, and then its bf16 micro-kernel emulates the
// products, slower than our float32 tiles. The names follow oneDNN's cpu_isa list.
inline bool onednn_isa_allows(at::ScalarType dtype) {
  const char* held = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (held == nullptr) {
    held = std::getenv("DNNL_MAX_CPU_ISA");
  }
  if (held == nullptr) {
    return true;
  }
  std::string isa(held);
  for (char& c : isa) {
    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  if (isa.empty() || isa == "ALL" || isa == "DEFAULT") {
    return true;
  }
  auto has = [&](const char* part) { return isa.find(part) != std::string::npos; };
  if (dtype == at::kHalf) {
    return has("AMX_FP16");
  }
  return has("BF16") || has("FP16") || has("AMX") || has("AVX10");
}

// One small product through the same call the tiles make, checked against the exact answer: a
// torch whose brgemm lacks the VNNI path (oneDNN held too low: it throws) or reads another layout
// leaves the tiles in float32 rather than computing garbage. 3 x 40 over K = 6 with ldc 48 covers
// M and N tails and checks that nothing is written past N. Small integers are exact in bf16/fp16.
// Returns "" when the product is exact, else what went wrong (for lowp_tiles_status).
template <typename T>
std::string lowp_probe() {
  constexpr int64_t M = 3, N = 40, K = 6, ldc = 48;
  T a[M * K];
  T b[K / 2 * kVnniCols * 2];
  float c[M * ldc];
  float want[M * ldc];
  std::fill(b, b + K / 2 * kVnniCols * 2, T(0));
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t k = 0; k < K; ++k) {
      a[i * K + k] = T(static_cast<float>((i + 2 * k) % 5 - 2));
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n) {
      b[(k / 2) * kVnniCols * 2 + n * 2 + k % 2] = T(static_cast<float>((k * 7 + n) % 9 - 4));
    }
  }
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t n = 0; n < ldc; ++n) {
      float sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        sum += static_cast<float>(a[i * K + k]) * static_cast<float>((k * 7 + n) % 9 - 4);
      }
      c[i * ldc + n] = 0.5f;
      want[i * ldc + n] = n < N ? sum : 0.5f;
    }
  }
  try {
    at::native::cpublas::brgemm(M, N, K, K, kVnniCols, ldc, /*add_C=*/false, a, b, c, /*is_vnni=*/true);
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  } catch (const c10::Error& e) {
    return std::string("torch's brgemm refused the probe: ") + e.what_without_backtrace();
  }
  return std::equal(c, c + M * ldc, want) ? "" : "torch's brgemm gave a wrong product in the probe";
}

// The CPU's bf16 / fp16 matrix hardware, as ATen reports it: AVX512-BF16 or AMX-BF16 for bf16,
// AMX-FP16 for fp16. torch 2.11 replaced the is_*_supported() functions with
// get_cpu_capabilities() (torch 2.6 to 2.10 have only the former).
struct LowpHardware {
  bool bf16 = false;
  bool fp16 = false;
};
inline LowpHardware lowp_hardware() {
  LowpHardware hardware;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11)
  const auto caps = at::cpu::get_cpu_capabilities();
  auto flag = [&](const char* name) {
    auto it = caps.find(name);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  hardware.bf16 = flag("avx512_bf16") || flag("amx_bf16");
  hardware.fp16 = flag("amx_fp16");
#else
  hardware.bf16 = at::cpu::is_avx512_bf16_supported() || at::cpu::is_amx_tile_supported();
  hardware.fp16 = at::cpu::is_amx_fp16_supported();
#endif
  return hardware;
}

// Whether the tiles of `dtype` can take the bf16 / fp16 micro-kernel in this process: the
// AVX-512 build, a CPU with the instructions (AVX512-BF16 or AMX-BF16 for bf16; AMX-FP16 for fp16:
// without it oneDNN converts fp16 to float32 and gains nothing), oneDNN allowed to use them, and
// the probe passed. Returns "" when they can, else why not (decided once per dtype).
inline const std::string& lowp_tiles_barrier(at::ScalarType dtype) {
  static const std::string kNotLowp = "not a bf16 / fp16 dtype";
#if defined(SAFEATTN_LOWP_TILES)
  auto barrier = [](bool hardware, at::ScalarType t, auto probe) -> std::string {
    if (!hardware) {
      return t == at::kHalf ? "no AMX-FP16 on this CPU" : "no AVX512-BF16 or AMX-BF16 on this CPU";
    }
    if (!onednn_isa_allows(t)) {
      return "ONEDNN_MAX_CPU_ISA holds oneDNN below the instructions";
    }
    return probe();
  };
  static const LowpHardware hardware = lowp_hardware();
  static const std::string bf16 = barrier(hardware.bf16, at::kBFloat16, [] { return lowp_probe<c10::BFloat16>(); });
  static const std::string fp16 = barrier(hardware.fp16, at::kHalf, [] { return lowp_probe<c10::Half>(); });
  return dtype == at::kBFloat16 ? bf16 : dtype == at::kHalf ? fp16 : kNotLowp;
#else
  static const std::string kNotBuilt = "only the AVX-512 kernels multiply in bf16 / fp16";
  return dtype == at::kBFloat16 || dtype == at::kHalf ? kNotBuilt : kNotLowp;
#endif
}

// Whether this call's tiles of `dtype` take the bf16 / fp16 micro-kernel: lowp_tiles_barrier
// clear and oneDNN enabled (torch.backends.mkldnn.enabled: without it brgemm refuses VNNI; read
// per call, so that `with torch.backends.mkldnn.flags(enabled=False)` gives float32 tiles).
inline bool use_lowp_tiles(at::ScalarType dtype) {
  return lowp_tiles_barrier(dtype).empty() && at::globalContext().userEnabledMkldnn();
}

// What the tiles of `dtype` are multiplied in now, and why: "bfloat16" / "float16", or
// "float32 (<the reason>)". For build_info()["cpu_tiles"] (attention_cpu_tiles_stub).
inline std::string lowp_tiles_status(at::ScalarType dtype) {
  const std::string& barrier = lowp_tiles_barrier(dtype);
  if (!barrier.empty()) {
    return "float32 (" + barrier + ")";
  }
  if (!at::globalContext().userEnabledMkldnn()) {
    return "float32 (torch.backends.mkldnn.enabled is False)";
  }
  return dtype == at::kBFloat16 ? "bfloat16" : "float16";
}

// Releases the AMX tile state this thread configured (a no-op elsewhere); called by every thread
// at the end of its share of a parallel loop that ran reduced-precision tiles, as PyTorch's
// flash kernel does, so that no thread leaves a kernel holding the tiles configured.
inline void release_lowp_tiles() {
  at::native::cpublas::brgemm_release(/*is_vnni=*/true);
}

// C[M, N] (+)= A[M, K] @ B[K, N] with float32 accumulation: A row-major (lda), B packed in the
// VNNI layout with its column blocks block_stride elements apart, K even. One micro-kernel call
// per block of kVnniCols columns; C needs only N columns (the last call takes the tail).
template <typename T>
inline void gemm_vnni(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t block_stride,
                      float* C, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += kVnniCols) {
    at::native::cpublas::brgemm(M, std::min(kVnniCols, N - n0), K, lda, kVnniCols, ldc, accumulate, A,
                                B + (n0 / kVnniCols) * block_stride, C + n0, /*is_vnni=*/true);
  }
}

// Packs B[k][n] = src[k * stride_k + n * stride_n] (k < rows, n < cols) into the VNNI layout:
// rows [0, rows_pad) with rows_pad even, columns [0, cols_pad) with cols_pad a multiple of
// kVnniCols, zeros outside the source.
template <typename T, typename S>
void pack_vnni(T* dst, int64_t block_stride, const S* src, int64_t stride_k, int64_t stride_n, int64_t rows,
               int64_t rows_pad, int64_t cols, int64_t cols_pad) {
  for (int64_t n0 = 0; n0 < cols_pad; n0 += kVnniCols) {
    T* block = dst + (n0 / kVnniCols) * block_stride;
    const int64_t width = std::clamp<int64_t>(cols - n0, 0, kVnniCols);
    for (int64_t k = 0; k < rows_pad; k += 2) {
      T* out = block + (k / 2) * kVnniCols * 2;
      const int64_t pair = std::min<int64_t>(std::max<int64_t>(rows - k, 0), 2);
      for (int64_t c = 0; c < width; ++c) {
        const S* in = src + k * stride_k + (n0 + c) * stride_n;
        out[2 * c] = pair > 0 ? static_cast<T>(in[0]) : T(0);
        out[2 * c + 1] = pair > 1 ? static_cast<T>(in[stride_k]) : T(0);
      }
      std::fill(out + 2 * width, out + kVnniCols * 2, T(0));
    }
  }
}

// dst[r * ld_dst + c] = src[r * stride_r + c * stride_c] for r < rows, c < cols, converted, and 0
// for cols <= c < cols_pad: the row-major left operand of a tile product, its reduction
// dimension padded to even.
template <typename T, typename S>
void pack_rows(T* dst, int64_t ld_dst, const S* src, int64_t stride_r, int64_t stride_c, int64_t rows, int64_t cols,
               int64_t cols_pad) {
  for (int64_t r = 0; r < rows; ++r) {
    T* out = dst + r * ld_dst;
    const S* in = src + r * stride_r;
    if (stride_c == 1 && std::is_same_v<T, S>) {
      std::memcpy(out, in, cols * sizeof(T));
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        out[c] = static_cast<T>(in[c * stride_c]);
      }
    }
    std::fill(out + cols, out + cols_pad, T(0));
  }
}

#if defined(SAFEATTN_LOWP_TILES)
// dst[0 .. count) = src rounded to T (round to nearest even, NaN kept), zeros up to count_pad.
template <typename T>
inline void round_row(T* dst, const float* src, int64_t count, int64_t count_pad) {
  at::vec::convert(src, dst, count);
  std::fill(dst + count, dst + count_pad, T(0));
}

// The VNNI block (kVnniCols columns) of the float32 tile src[r * ld + c], r < rows, rounded to
// T: rows [0, rows_pad) with zeros past `rows`. Two rows at a time: 16 columns of each are
// rounded into one 32-lane vector [a0..a15, b0..b15], then interleaved to [a0 b0 a1 b1 ...].
template <typename T>
inline void pack_vnni_tile(T* dst, const float* src, int64_t ld, int64_t rows, int64_t rows_pad) {
  using FVec = Vectorized<float>;
  static_assert(FVec::size() == 16 && kVnniCols % 16 == 0, "AVX-512 layout");
  // Lane 2i takes a_i (element i), lane 2i + 1 takes b_i (element 16 + i).
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  const FVec zero(0.0f);
  for (int64_t k = 0; k < rows_pad; k += 2) {
    T* out = dst + (k / 2) * kVnniCols * 2;
    const float* row_a = src + k * ld;
    const float* row_b = row_a + ld;
    for (int64_t c = 0; c < kVnniCols; c += FVec::size()) {
      const FVec a = k < rows ? FVec::loadu(row_a + c) : zero;
      const FVec b = k + 1 < rows ? FVec::loadu(row_b + c) : zero;
      const __m512i both = at::vec::convert_from_float<T>(a, b);
      _mm512_storeu_si512(out + 2 * c, _mm512_permutexvar_epi16(order, both));
    }
  }
}
#endif

// The tile classes of each kernel file (attention_fwd_kernel.cpp, attention_bwd_kernel.cpp): in
// the accumulation type, and (the AVX-512 build only, SAFEATTN_LOWP_TILES) in bf16 / fp16.
template <typename scalar_t>
class FloatTiles;
template <typename scalar_t>
class LowpTiles;

// The tile loop of each direction, defined by its kernel file for its Args.
template <typename scalar_t, typename Tiles>
void attention_run(const AttentionFwdArgs& args);
template <typename scalar_t, typename Tiles>
void attention_run(const AttentionBwdArgs& args);

// The kernel of one direction that its file registers per ISA (SAFEATTN_REGISTER_ISA_KERNEL):
// attention_run<scalar_t, Tiles> for the query's dtype (every input and gradient has it:
// check_attention, check_attention_backward), Tiles LowpTiles<scalar_t> where the call's bf16 /
// fp16 tiles take the reduced-precision micro-kernel (use_lowp_tiles), else FloatTiles<scalar_t>.
template <class Args>
void tiled_kernel(const Args& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.query.scalar_type(), "attention_cpu", [&] {
#if defined(SAFEATTN_LOWP_TILES)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
      if (use_lowp_tiles(args.query.scalar_type())) {
        attention_run<scalar_t, LowpTiles<scalar_t>>(args);
        return;
      }
    }
#endif
    attention_run<scalar_t, FloatTiles<scalar_t>>(args);
  });
}

}  // namespace
}  // namespace safeattn::cpu
