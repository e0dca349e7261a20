// Helpers shared by the attention forward and backward CPU kernels. Included only by the
// per-ISA kernel files (so at::vec resolves to that file's ISA); everything is internal.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

// float64 exists for gradcheck on small shapes only: a plain loop is enough.
inline void gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb,
                 double* C, int64_t ldc, bool accumulate) {
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
    switch (mask.scalar_type()) {
      case at::kBool:
        kind = MaskKind::kBool;
        break;
      case at::kFloat:
        kind = MaskKind::kFloat;
        break;
      case at::kHalf:
        kind = MaskKind::kHalf;
        break;
      case at::kBFloat16:
        kind = MaskKind::kBFloat16;
        break;
      case at::kDouble:
        kind = MaskKind::kDouble;
        break;
      default:
        TORCH_CHECK(false, "attention: unexpected attn_mask dtype");
    }
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

}  // namespace
}  // namespace safeattn::cpu
