// Split-KV decode forward of safeattn::attention (see attention_decode.h). Semantics: those of
// ops/attention.h, as the tensor-core forward (attention_fwd.cuh) gives them; the float64
// reference is python/safeattn/reference.py.
//
// Decoding reads the whole KV cache for one query row per head: the work is bytes, not flops.
// The tensor-core forward spends a 128-row query tile on that one row and reads each kv head
// once per query head of its group, with one CTA per (batch, head): a few hundred CTAs that
// each walk the whole cache. Here instead:
//   1. split kernel: one CTA per (KV split, kv head, batch) holds every query row of the kv
//      head's group (rows = group * Q <= kMaxRows) and walks its split's keys in tiles of
//      kTileKeys: scores on CUDA cores (each key read once, 16-byte loads, a lane per 8
//      elements), the online softmax in the log2 domain, P V from a V tile staged in shared
//      memory by cp.async. It writes, per row and split, the normalised partial output and its
//      lse (fp32 workspace).
//   2. combine kernel: one warp per row merges the splits' partials by their lse (with the
//      sink logit in the denominator when there are sinks) and writes out and lse.
// Numerics as in the tensor-core forward: a row (or split) with no visible key keeps m = -inf
// and uses 0 as its exponent offset, so it contributes exactly 0 and never NaN; a masked
// element is -inf whatever its score; a NaN score makes its row's out and lse NaN.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_decode.h"

namespace safeattn::cuda {
namespace {

using attn::Causal;
using attn::kLn2;
using attn::kLog2e;
using attn::MaskView;
using attn::ScoreTransform;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxRows = 8;    // query rows per kv head (group * Q) one CTA holds
constexpr int kTileKeys = 64;  // keys per step; two per lane in the softmax update
constexpr int kMaxSplits = 256;
constexpr int kCombineWarps = 4;

struct DecodeParams {
  const void* q;  // [B, Hq, Q, D], unit inner stride, 16-byte aligned rows
  const void* k;  // [B, Hkv, KV, D]
  const void* v;  // [B, Hkv, KV, D]
  int64_t q_sb, q_sh, q_si;
  int64_t k_sb, k_sh, k_si;
  int64_t v_sb, v_sh, v_si;
  float* o_part;    // [B * Hq * Q, splits, D]: each split's output, normalised by its own sum
  float* lse_part;  // [B * Hq * Q, splits]: each split's lse, log2 domain (-inf: no visible key)
  int64_t hq, group, q_len;
  int64_t kv_end;           // keys at or past it are visible to no row (kv_len, or less by causal)
  int64_t tiles_per_split;  // key tiles of kTileKeys per split
  int splits;
  int rows;  // group * q_len: row r is query i = r / group of head hk * group + r % group
  ScoreTransform transform;
  Causal causal;
  MaskView mask;
};

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&x)[8]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    x[k] = attn::to_float(e[k]);
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16(x);
  } else {
    return __float2half(x);
  }
}

template <typename T, int kD>
__global__ void __launch_bounds__(kThreads) attention_decode_split_kernel(const DecodeParams p) {
  constexpr int kVecs = kD / 8;             // 16-byte vectors per row
  constexpr int kKeysPerPass = 32 / kVecs;  // keys one warp scores at once
  constexpr int kKeysPerWarp = kTileKeys / kWarps;
  constexpr int kPasses = kKeysPerWarp / kKeysPerPass;
  constexpr int kParts = kThreads / (kVecs * kMaxRows);  // threads sharing one (row, vector) in P V
  constexpr int kVStride = kD + 8;                       // shared V row, elements (16-byte padding)
  static_assert(kD % 8 == 0 && 32 % kVecs == 0 && kKeysPerWarp % kKeysPerPass == 0, "decode: head dim");
  static_assert(kParts >= 1 && kThreads % (kVecs * kMaxRows) == 0 && kTileKeys % kParts == 0, "decode: P V map");

  __shared__ __align__(16) T v_s[kTileKeys * kVStride];
  __shared__ float p_s[kMaxRows][kTileKeys];  // scores (log2 domain), then probabilities
  __shared__ float row_max[kMaxRows], row_sum[kMaxRows], row_alpha[kMaxRows];
  __shared__ __align__(16) float part_s[kParts > 1 ? (kParts - 1) * kVecs * kMaxRows * 8 : 1];

  const int split = blockIdx.x;
  const int64_t hk = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rows = p.rows;

  // Scoring: lane -> (key of the pass, 8-element vector of the head dim). Every lane keeps its
  // vector of every row's query in registers.
  const int pass_key = lane / kVecs, vec = lane % kVecs;
  float q_reg[kMaxRows][8];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r < rows) {
      const int64_t h = hk * p.group + r % p.group, i = r / p.group;
      const T* row = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh + i * p.q_si;
      unpack8<T>(*reinterpret_cast<const uint4*>(row + vec * 8), q_reg[r]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        q_reg[r][e] = 0.0f;
      }
    }
  }
  if (tid < kMaxRows) {
    row_max[tid] = -INFINITY;
    row_sum[tid] = 0.0f;
  }

  // P V: thread -> (row, vector, part); the parts split a tile's keys and are summed at the end.
  const int pv_vec = tid % kVecs, pv_row = (tid / kVecs) % kMaxRows, pv_part = tid / (kVecs * kMaxRows);
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    acc[e] = 0.0f;
  }

  const T* k_base = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  const int64_t j_begin = split * p.tiles_per_split * kTileKeys;
  const int64_t j_limit = j_begin + p.tiles_per_split * kTileKeys;
  const int64_t j_end = j_limit < p.kv_end ? j_limit : p.kv_end;
  __syncthreads();  // row_max / row_sum initialised

  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileKeys) {
    // The V tile goes to shared memory while the scores are computed; keys past j_end read as
    // zeros (their probability is 0, and 0 * garbage could be NaN).
    for (int c = tid; c < kTileKeys * kVecs; c += kThreads) {
      const int key = c / kVecs, ve = c % kVecs;
      const bool valid = j0 + key < j_end;
      attn::cp_async_16(v_s + key * kVStride + ve * 8, valid ? v_base + (j0 + key) * p.v_si + ve * 8 : v_base, valid);
    }
    attn::cp_async_commit();

    // Scores of this warp's keys for every row; the kVecs lanes of a key sum their partial dots.
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int c = warp * kKeysPerWarp + pass * kKeysPerPass + pass_key;
      const int64_t j = j0 + c;
      float dot[kMaxRows];
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        dot[r] = 0.0f;
      }
      if (j < j_end) {
        float kf[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(k_base + j * p.k_si + vec * 8), kf);
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            dot[r] = fmaf(q_reg[r][e], kf[e], dot[r]);
          }
        }
      }
#pragma unroll
      for (int offset = kVecs / 2; offset > 0; offset /= 2) {
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], offset);
        }
      }
      if (vec == 0) {
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < rows) {
            const int64_t h = hk * p.group + r % p.group, i = r / p.group;
            float x = -INFINITY;
            if (j < j_end && p.causal.visible(i, j)) {
              const float s = p.transform(dot[r]);
              const float m = p.mask.kind == attn::MaskKind::kNone ? 0.0f : p.mask.additive(p.mask.offset(b, h, i, j));
              // A masked element hides its score, NaN included.
              x = m == -INFINITY ? -INFINITY : (s + m) * kLog2e;
            }
            p_s[r][c] = x;
          }
        }
      }
    }
    __syncthreads();

    // Online softmax: a warp per row, two keys per lane.
    for (int r = warp; r < rows; r += kWarps) {
      const float x0 = p_s[r][lane], x1 = p_s[r][lane + 32];
      float mx = fmaxf(x0, x1);
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
      }
      const float m_old = row_max[r];
      const float m_new = fmaxf(m_old, mx);
      const float offset_new = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet: no -inf - -inf
      const float p0 = exp2f(x0 - offset_new), p1 = exp2f(x1 - offset_new);
      p_s[r][lane] = p0;
      p_s[r][lane + 32] = p1;
      float sum = p0 + p1;
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      }
      if (lane == 0) {
        const float alpha = exp2f(m_old - offset_new);  // old max -inf: 0
        row_alpha[r] = alpha;
        row_sum[r] = row_sum[r] * alpha + sum;
        row_max[r] = m_new;
      }
    }
    attn::cp_async_wait<0>();
    __syncthreads();

    // acc = acc * alpha + P V over this part's keys of the tile.
    if (pv_row < rows) {
      const float alpha = row_alpha[pv_row];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        acc[e] *= alpha;
      }
      for (int c = pv_part; c < kTileKeys; c += kParts) {
        const float pr = p_s[pv_row][c];
        float vf[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(v_s + c * kVStride + pv_vec * 8), vf);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          acc[e] = fmaf(pr, vf[e], acc[e]);
        }
      }
    }
    __syncthreads();  // v_s and p_s are refilled by the next tile
  }

  if constexpr (kParts > 1) {
    if (pv_part > 0 && pv_row < rows) {
      float* dst = part_s + (((pv_part - 1) * kMaxRows + pv_row) * kVecs + pv_vec) * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        dst[e] = acc[e];
      }
    }
    __syncthreads();
    if (pv_part == 0 && pv_row < rows) {
      for (int part = 1; part < kParts; ++part) {
        const float* src = part_s + (((part - 1) * kMaxRows + pv_row) * kVecs + pv_vec) * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          acc[e] += src[e];
        }
      }
    }
  }

  if (pv_part == 0 && pv_row < rows) {
    const float l = row_sum[pv_row];
    const float m = row_max[pv_row];
    const bool empty = l == 0.0f;  // no visible key in this split (NaN is not empty)
    const int64_t h = hk * p.group + pv_row % p.group, i = pv_row / p.group;
    const int64_t row = (b * p.hq + h) * p.q_len + i;
    float* dst = p.o_part + (row * p.splits + split) * kD + pv_vec * 8;
    const float inv = empty ? 0.0f : 1.0f / l;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      dst[e] = empty ? 0.0f : acc[e] * inv;
    }
    if (pv_vec == 0) {
      p.lse_part[row * p.splits + split] = empty ? -INFINITY : (m == -INFINITY ? 0.0f : m) + log2f(l);
    }
  }
}

// One warp per query row (b, h, i): lse = log-sum-exp of the splits' lse (and the sink logit),
// out = sum over splits of exp(lse_split - lse) * out_split.
template <typename T, int kD>
__global__ void __launch_bounds__(kCombineWarps * 32)
    attention_decode_combine_kernel(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                                    const float* __restrict__ sinks, T* __restrict__ out, int64_t o_sb, int64_t o_sh,
                                    int64_t o_si, float* __restrict__ lse, int64_t total_rows, int64_t hq,
                                    int64_t q_len, int splits) {
  static_assert(kD % 32 == 0, "decode combine: a lane per 32 elements");
  constexpr int kPerLane = kD / 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= total_rows) {
    return;
  }
  const int64_t i = row % q_len, h = (row / q_len) % hq, b = row / (q_len * hq);
  const float* lse_row = lse_part + row * splits;

  float mx = -INFINITY;
  bool nan = false;
  for (int s = lane; s < splits; s += 32) {
    const float x = lse_row[s];
    nan |= x != x;
    mx = fmaxf(mx, x);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
  }
  nan = __any_sync(0xffffffffu, nan);
  float total = 0.0f;
  if (mx != -INFINITY) {
    for (int s = lane; s < splits; s += 32) {
      total += exp2f(lse_row[s] - mx);  // an empty split: exp2(-inf) = 0
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    total += __shfl_xor_sync(0xffffffffu, total, offset);
  }
  const float row_lse2 = mx == -INFINITY ? -INFINITY : mx + log2f(total);
  float lse2 = row_lse2;
  if (sinks != nullptr) {
    // The sink joins the denominator only: lse = logaddexp(row lse, sink).
    const float sink2 = sinks[h] * kLog2e;
    const float top = row_lse2 > sink2 ? row_lse2 : sink2;
    lse2 = top == -INFINITY ? top : top + log2f(exp2f(row_lse2 - top) + exp2f(sink2 - top));
  }
  if (nan) {
    lse2 = NAN;
  }
  const bool empty = row_lse2 == -INFINITY && !nan;

  float acc[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    acc[k] = 0.0f;
  }
  if (!empty) {
    const float* o_row = o_part + row * splits * kD;
    for (int s = 0; s < splits; ++s) {
      const float x = lse_row[s];
      const float w = x == -INFINITY ? 0.0f : exp2f(x - lse2);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        acc[k] = fmaf(w, o_row[s * kD + lane + 32 * k], acc[k]);
      }
    }
  }
  T* o = out + b * o_sb + h * o_sh + i * o_si;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    o[lane + 32 * k] = from_float<T>(acc[k]);  // an empty row is exactly 0
  }
  if (lane == 0) {
    lse[row] = lse2 * kLn2;
  }
}

int64_t multiprocessor_count() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

bool decode_enabled() {
  const char* setting = std::getenv("SAFEATTN_ATTN_DECODE");
  return setting != nullptr && std::string_view(setting) == "1";
}

template <typename T, int kD>
void launch_decode(const AttentionFwdArgs& a, DecodeParams p, int64_t batch) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t total_rows = batch * p.hq * p.q_len;
  const at::TensorOptions f32 = a.query.options().dtype(at::kFloat);
  const at::Tensor o_part = at::empty({total_rows, p.splits, kD}, f32);
  const at::Tensor lse_part = at::empty({total_rows, p.splits}, f32);
  p.o_part = o_part.data_ptr<float>();
  p.lse_part = lse_part.data_ptr<float>();
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.hq / p.group), static_cast<unsigned>(batch));
  attention_decode_split_kernel<T, kD><<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t blocks = (total_rows + kCombineWarps - 1) / kCombineWarps;
  attention_decode_combine_kernel<T, kD><<<static_cast<unsigned>(blocks), kCombineWarps * 32, 0, stream>>>(
      p.o_part, p.lse_part, a.sinks.defined() ? a.sinks.const_data_ptr<float>() : nullptr,
      static_cast<T*>(a.out.data_ptr()), a.out.stride(0), a.out.stride(1), a.out.stride(2), a.lse.data_ptr<float>(),
      total_rows, p.hq, p.q_len, p.splits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool attention_fwd_decode(const AttentionFwdArgs& a) {
  const at::ScalarType dtype = a.query.scalar_type();
  const int64_t batch = a.query.size(0), hq = a.query.size(1), q_len = a.query.size(2);
  const int64_t head_dim = a.query.size(3), hkv = a.key.size(1), kv_len = a.key.size(2);
  const int64_t group = hq / hkv;
  const bool applies = decode_enabled() && a.out.numel() > 0 && (dtype == at::kHalf || dtype == at::kBFloat16) &&
                       (head_dim == 64 || head_dim == 128) && a.value.size(3) == head_dim && q_len >= 1 &&
                       group * q_len <= kMaxRows && batch <= 65535 && hkv <= 65535 && a.out.stride(3) == 1 &&
                       attn::rows_aligned_16(a.query) && attn::rows_aligned_16(a.key) &&
                       attn::rows_aligned_16(a.value) && (!a.mask.defined() || a.mask.scalar_type() != at::kDouble) &&
                       a.lse.is_contiguous() && a.lse.scalar_type() == at::kFloat;
  if (!applies) {
    return false;
  }
  DecodeParams p{};
  p.q = a.query.const_data_ptr();
  p.k = a.key.const_data_ptr();
  p.v = a.value.const_data_ptr();
  p.q_sb = a.query.stride(0), p.q_sh = a.query.stride(1), p.q_si = a.query.stride(2);
  p.k_sb = a.key.stride(0), p.k_sh = a.key.stride(1), p.k_si = a.key.stride(2);
  p.v_sb = a.value.stride(0), p.v_sh = a.value.stride(1), p.v_si = a.value.stride(2);
  p.hq = hq;
  p.group = group;
  p.q_len = q_len;
  p.rows = static_cast<int>(group * q_len);
  p.transform.scale = static_cast<float>(a.scale);
  p.transform.softcap = static_cast<float>(a.softcap);
  p.causal.enabled = a.is_causal;
  p.causal.shift = a.q_offset - a.kv_offset;
  p.mask = attn::make_mask_view(a.mask);
  // Keys at or past kv_end are hidden from every row by the causal rule (the last row, q_len - 1,
  // sees keys j <= q_len - 1 + shift): they are not read.
  int64_t kv_end = kv_len;
  if (a.is_causal) {
    kv_end = std::clamp<int64_t>(q_len + p.causal.shift, 0, kv_len);
  }
  p.kv_end = kv_end;
  // Enough CTAs for every SM to hold several (the split kernel is bound by bytes in flight),
  // at least one key tile per split.
  const int64_t tiles = (kv_end + kTileKeys - 1) / kTileKeys;
  const int64_t sms = multiprocessor_count();
  const int64_t wanted = std::max<int64_t>(1, (sms * 8 + batch * hkv - 1) / (batch * hkv));
  const int64_t splits = std::clamp<int64_t>(std::min(wanted, tiles), 1, kMaxSplits);
  p.tiles_per_split = std::max<int64_t>(1, (tiles + splits - 1) / splits);
  p.splits = static_cast<int>(std::max<int64_t>(1, (tiles + p.tiles_per_split - 1) / p.tiles_per_split));
  if (dtype == at::kBFloat16) {
    head_dim == 64 ? launch_decode<__nv_bfloat16, 64>(a, p, batch) : launch_decode<__nv_bfloat16, 128>(a, p, batch);
  } else {
    head_dim == 64 ? launch_decode<__half, 64>(a, p, batch) : launch_decode<__half, 128>(a, p, batch);
  }
  return true;
}

}  // namespace safeattn::cuda
