// Device pieces shared by the CUDA attention kernels (forward: attention_fwd_*.cu, backward:
// attention_bwd_*.cu): the tensor-core instruction wrappers, the view of the mask, the causal
// rule per element and per tile, and the score transform. The semantics are those of
// ops/attention.h; python/safeattn/reference.py is the float64 reference.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <ATen/core/Tensor.h>

#include "ops/attention.h"
#include "ops/cuda/mask_view.cuh"
#include "ops/cuda/score_rule.cuh"  // kLog2e, ScoreRule, finish_row

namespace safeattn::cuda::attn {

// ---- tensor-core and async-copy wrappers (sm_80 and later) -----------------------------------

// D[16x8] (+)= A[16x16] @ B[16x8], fp32 accumulators, A/B as packed pairs of 16-bit values in
// the register layout of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16").
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices from shared memory; lane l gives the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row)));
}

// The same, each matrix transposed (B operands stored row-major in K, such as V).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row)));
}

// 16 bytes global -> shared without registers; `valid` false writes zeros (tile edges), so
// out-of-range rows never hold garbage that could become NaN in a product.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// The mma.sync kernels' shared-memory row of `elements` 16-bit values, padded by 16 bytes so that
// ldmatrix's eight row addresses fall in different banks.
constexpr int padded_row(int elements) {
  return elements + 8;
}

// A kRows x kHeadDim tile from global memory (rows `row_stride` elements apart) to shared memory
// (rows padded_row(kHeadDim) apart), one 16-byte cp.async per chunk; rows at or past valid_rows
// are zero-filled (their source is not read). kUnroll rounds of kThreads chunks are unrolled
// (default: all of them; the register-bound backward takes 1).
template <typename T, int kRows, int kHeadDim, int kThreads,
          int kUnroll = (kRows * kHeadDim / 8 + kThreads - 1) / kThreads>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t row_stride, int64_t valid_rows, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kStride = padded_row(kHeadDim);
  constexpr int kTotal = kRows * kChunks;
#pragma unroll kUnroll
  for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + tid;
    if (kTotal % kThreads != 0 && c >= kTotal) {  // head dims such as 80: a ragged last round
      break;
    }
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = r < valid_rows;
    const T* from = valid ? src + r * row_stride + ch * 8 : src;
    cp_async_16(dst + r * kStride + ch * 8, from, valid);
  }
}

// 2^x on the special-function unit (ex2.approx.ftz: 2 ulp, -inf -> 0, NaN -> NaN); results below
// 2^-126 flush to 0, which a probability can afford. exp2f without --use_fast_math adds
// subnormal handling around the same instruction, in the hottest loops.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(2^a + 2^b) without overflow: a row's lse with the sink logit added (both log2 domain).
// -inf when both are -inf; NaN when either is NaN.
__device__ __forceinline__ float log2_add_exp2(float a, float b) {
  const float top = (a != a || a > b) ? a : b;
  return top == -INFINITY ? top : top + log2f(exp2f(a - top) + exp2f(b - top));
}

// Two fp32 values as one register of two 16-bit values (the A operand of P @ V).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// to_float (16-bit values to float): mask_view.cuh.

// ---- the mask --------------------------------------------------------------------------------

// Host: the view of a [B, Hq, Q, KV] (expanded, stride 0 on broadcast dims) mask tensor, or an
// empty view for an undefined tensor.
MaskView make_mask_view(const at::Tensor& mask);

// Host: whether the kernels hold scores in natural units (a floating mask; see exp_of).
inline bool natural_units(const at::Tensor& mask) {
  return mask.defined() && mask.is_floating_point();
}

// Host: whether the kernels can read a 4-D tensor of 16-bit elements in place with 16-byte loads
// (cp.async, uint4): unit stride along the last dim and every row on a 16-byte boundary. Size-1
// dims are never stepped over, so their strides do not matter.
bool rows_aligned_16(const at::Tensor& t);

// Host: why both sm_90a kernels (attention_fwd_sm90.cu, attention_bwd_sm90.cu) cannot take a
// call, their head dims aside, or nullptr when they can: they need bf16 / fp16, D == Dv, no empty
// input, sizes below 2^31, an sm_90 device, and scale > 0 with a scale * log2(e) that neither
// rounds to 0 nor overflows in float32 (they take each row's max over raw dot products and scale
// after); and the generic kernels not forced (cuda::generic_kernels_only, safeattn.h).
const char* sm90_inputs_rejects(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale);

// Host: on an sm_90 GPU with a build that lacks the sm_90a kernels (built without CUTLASS or with
// SAFEATTN_SM90=0), a warning, once per process, that names the rebuild command: attention then
// runs the generic kernels at about 40% of the speed, which nothing else would reveal.
void warn_if_hopper_kernels_missing(const at::Tensor& query);

// Host: the tensors' addresses and [B, H, S] strides (elements) that the forward kernels'
// parameter structs share (attention_fwd.cuh and hopper/fwd_params.h): query, key and value as
// the kernel reads them (aligned copies or the inputs), out, lse and lse_lo from `a`.
template <class Params>
void set_forward_tensors(Params& p, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const AttentionFwdArgs& a) {
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  p.out = a.out.data_ptr();
  p.lse = a.lse.data_ptr<float>();
  p.lse_lo = a.lse_lo.defined() ? a.lse_lo.data_ptr<float>() : nullptr;
  p.q_sb = query.stride(0), p.q_sh = query.stride(1), p.q_si = query.stride(2);
  p.k_sb = key.stride(0), p.k_sh = key.stride(1), p.k_si = key.stride(2);
  p.v_sb = value.stride(0), p.v_sh = value.stride(1), p.v_si = value.stride(2);
  p.o_sb = a.out.stride(0), p.o_sh = a.out.stride(1), p.o_si = a.out.stride(2);
}

// Host: whether every size of t is below 2^31 (what kernels with 32-bit indices, such as TMA's
// coordinates, need).
bool sizes_fit_int32(const at::Tensor& t);

// Host: whether a block may take `bytes` of shared memory on t's device (the opt-in limit: 227 KB
// on sm_90 / sm_100, 163 KB on sm_80 / sm_87, 99 KB on sm_86 / sm_89 / sm_120). A kernel whose
// tiles do not fit leaves the call to the next path rather than fail at launch.
bool smem_fits(size_t bytes, const at::Tensor& t);

// Host: t itself when rows_aligned_16(t), else an aligned contiguous copy. A clone, since
// contiguous() returns a contiguous view with an odd offset unchanged.
at::Tensor with_aligned_rows(const at::Tensor& t);

// ---- the causal rule -------------------------------------------------------------------------

// Query i sees key j when kv_offset + j <= q_offset + i (ops/attention.h). `shift` is
// q_offset - kv_offset, so the rule is j <= i + shift.
struct Causal {
  bool enabled = false;
  int64_t shift = 0;

  __device__ __forceinline__ bool visible(int64_t i, int64_t j) const {
    return !enabled || j <= i + shift;
  }
  // Keys [0, end) can be visible to some query before q_end: key tiles at or beyond `end` are
  // skipped without being read. 0 when no key is visible to any of these queries.
  __device__ __forceinline__ int64_t kv_end(int64_t q_end, int64_t kv_len) const {
    if (!enabled) {
      return kv_len;
    }
    const int64_t e = q_end + shift;  // the last query, q_end - 1, sees keys j <= q_end - 1 + shift
    return e < 0 ? 0 : (e < kv_len ? e : kv_len);
  }
  // Every key in [kv_begin, kv_end) is visible to every query in [q_begin, q_end): such a tile
  // needs no per-element causal test.
  __device__ __forceinline__ bool tile_all_visible(int64_t q_begin, int64_t kv_end_exclusive) const {
    return !enabled || kv_end_exclusive - 1 <= q_begin + shift;
  }
  // The first query of [0, q_len) that sees key j (queries before it do not): the backward's
  // per-key-tile start. q_len when none does.
  __device__ __forceinline__ int64_t first_query(int64_t j, int64_t q_len) const {
    if (!enabled) {
      return 0;
    }
    const int64_t f = j - shift;
    return f < 0 ? 0 : (f < q_len ? f : q_len);
  }
};

// ---- the score rule --------------------------------------------------------------------------

// Host: the rule for `scale` and `softcap` (0: none) in natural units when `natural` (a floating
// mask), else log2 units, with a floating mask's values converted to them when `log2_mask`.
ScoreRule score_rule(double scale, double softcap, bool natural, bool log2_mask = false);

// Host: the causal fields the mma.sync forward's and the decode kernels' parameter structs
// share. The entry point passed q_offset = causal_shift(...), kv_offset 0.
inline Causal causal_rule(const AttentionFwdArgs& a) {
  return Causal{a.is_causal, a.q_offset - a.kv_offset};
}

// ---- per-tile summary of a dense mask ---------------------------------------------------------

// Host: the summary of a [B, Hq, Q, KV] mask view (as make_mask_view takes it) for tiles of
// block_q queries x block_kv keys: a uint8 tensor [Bm, Hm, ceil(Q / block_q), ceil(KV / block_kv)]
// where Bm (Hm) is 1 when the mask is broadcast over the batch (heads), so each distinct mask
// slice is summarised once. One kernel on the current stream, no host synchronisation. Edge
// tiles look only at the elements inside [Q, KV]. Tile sizes are arguments, so the forward and
// the backward can each ask for their own.
// With `diagonals` (block_q <= 128): also the tiles of a bool mask with 16-byte aligned rows that
// are one diagonal (kTileDiagonal), their diagonals written to *diagonals (int16, the summary's
// shape); only the sm_90a kernels read that class.
// With `first_visible`: also, per row of tiles, the lowest key tile that is not masked (int32,
// one per (Bm, Hm, q tile); TileSummaryView::first_visible).
// With `causal` enabled (for kernels that apply the same causal rule themselves): the tiles no
// row of which sees any key are masked without being read (half of a [1, H, S, S] bias's bytes).
at::Tensor summarize_mask_tiles(const at::Tensor& mask, int block_q, int block_kv, at::Tensor* diagonals = nullptr,
                                at::Tensor* first_visible = nullptr, Causal causal = {});

// Host: the summary, for the sm_90a kernels, of key ranges ([B, Q, 2] int32, rows of 2
// contiguous: AttentionFwdArgs::key_ranges) ANDed with a bool mask view (or none): uint8
// [B, Hm, ceil(Q / block_q), ceil(KV / block_kv)] with Hm the mask summary's heads (1 without a
// mask), and the diagonals (int16, same shape) of its kTileDiagonal tiles in *diagonals. Tiles of
// at most 128 rows; first_visible and causal (the mask's tiles) as summarize_mask_tiles takes
// them. Kernels on the current stream, no host synchronisation.
at::Tensor summarize_key_ranges(const at::Tensor& key_ranges, int64_t kv_len, const at::Tensor& mask, int block_q,
                                int block_kv, at::Tensor* diagonals, at::Tensor* first_visible = nullptr,
                                Causal causal = {});
// Host: the kernels' view of key_ranges (undefined: a null view).
KeyRangeView make_key_range_view(const at::Tensor& key_ranges);

// Host: the view of a summary made by summarize_mask_tiles for the same tile sizes.
TileSummaryView make_tile_summary_view(const at::Tensor& summary, int block_q, int block_kv,
                                       const at::Tensor& diagonals = at::Tensor(),
                                       const at::Tensor& first_visible = at::Tensor());

// Host: an sm_90a kernel's mask fields (mask, mask_tiles, key_ranges; hopper/fwd_params.h,
// bwd_params.h) from the call's bool mask and key ranges, either or both undefined, summarised
// for tiles of block_q x block_kv (p.kv_len, p.causal and p.causal_shift set before: the tiles
// causality hides are not read). summary and diagonals hold the summary until the launch is
// queued, and *first_visible (null: not asked for) each row of tiles' lowest visited key tile
// (the forward's walk stops there). Neither: the fields stay null (the kernel without mask code).
template <class Params>
void set_mask_fields(Params& p, const at::Tensor& mask, const at::Tensor& key_ranges, int block_q, int block_kv,
                     at::Tensor& summary, at::Tensor& diagonals, at::Tensor* first_visible = nullptr) {
  const Causal causal{p.causal, p.causal_shift};
  if (key_ranges.defined()) {
    summary = summarize_key_ranges(key_ranges, p.kv_len, mask, block_q, block_kv, &diagonals, first_visible, causal);
    p.key_ranges = make_key_range_view(key_ranges);
  } else if (mask.defined()) {
    summary = summarize_mask_tiles(mask, block_q, block_kv, &diagonals, first_visible, causal);
  }
  if (mask.defined()) {
    p.mask = make_mask_view(mask);
  }
  if (summary.defined()) {
    p.mask_tiles = make_tile_summary_view(summary, block_q, block_kv, diagonals,
                                          first_visible != nullptr ? *first_visible : at::Tensor());
  }
}

}  // namespace safeattn::cuda::attn
