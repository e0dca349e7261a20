// The tensor-core forward of safeattn::attention (FlashAttention-2 style), for 16-bit inputs
// whose head dim has a generated instantiation (attention_fwd_d<D>_<dtype>.cu, made by
// scripts/gen_attention_instances.py). Semantics: ops/attention.h.
//
// One CTA per (query tile, head, batch); each warp owns kMTiles x 16 rows of the query tile.
//   Q tile   global -> shared (cp.async) -> registers (ldmatrix), once; or, for large head dims,
//            re-read from shared memory at every key tile (FwdConfig::kQInRegs).
//   K/V      tiles of kBlockN keys, global -> shared by cp.async, double buffered: the next
//            tile is in flight while the current one is computed. Rows are padded by 16 bytes
//            (kStride = D + 8), so the 8 rows an ldmatrix reads fall in 8 different bank groups.
//   S = Q K^T  mma.sync.m16n8k16 (16-bit in, fp32 accumulators), K fragments by ldmatrix.
//   softmax  online, in registers, in the log2 domain: x = score * log2(e), p = exp2(x - m).
//   O += P V P rounded to 16 bits in registers is directly the A operand; V fragments by
//            ldmatrix.trans. O is rescaled in registers when the row max grows.
//   out      staged through shared memory, written with 16-byte stores through out's strides;
//            lse (natural log, fp32) by one thread per row.
// Key tiles that no query of the tile can see (causal) are never visited; a tile that the mask
// summary (summarize_mask_tiles) proves fully masked is skipped without reading K, V or the
// mask; only tiles on the causal diagonal, at the end of the keys, or that the summary calls
// mixed test elements one by one.
//
// Numerics: a row whose every score is -inf keeps m = -inf and uses 0 as its exponent offset,
// so p = exp2(-inf) = 0 and never exp2(-inf + inf) = NaN; it ends with out 0 and lse -inf (the
// sink logit with sinks). The row max uses fmaxf, which drops NaN, but a NaN score still makes
// its p NaN, and so its row sum, out and lse: NaN is never hidden. A masked element (False, or
// a float bias of -inf) is set to -inf rather than added to, so a NaN or inf score behind it
// stays hidden, as behind a skipped tile.
#pragma once

#include <cstdint>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/head_dim_switch.h"

namespace safeattn::cuda::attn {

// Everything the kernel reads; pointers are already offset to element 0 of each tensor.
struct FwdParams {
  const void* q = nullptr;       // [B, Hq, Q, D], unit inner stride, 16-byte aligned rows
  const void* k = nullptr;       // [B, Hkv, KV, D]
  const void* v = nullptr;       // [B, Hkv, KV, D]
  void* out = nullptr;           // [B, Hq, Q, D] strided view, unit inner stride
  float* lse = nullptr;          // [B, Hq, Q] contiguous
  float* lse_lo = nullptr;       // [B, Hq, Q] contiguous, or null: lse's rounding error
  const float* sinks = nullptr;  // [Hq] or null
  int64_t q_sb = 0, q_sh = 0, q_si = 0;
  int64_t k_sb = 0, k_sh = 0, k_si = 0;
  int64_t v_sb = 0, v_sh = 0, v_si = 0;
  int64_t o_sb = 0, o_sh = 0, o_si = 0;
  int64_t heads = 1;        // Hq
  int64_t group = 1;        // Hq / Hkv: query head h reads kv head h / group
  int64_t batch_heads = 1;  // B * Hq
  int64_t q_len = 0, kv_len = 0;
  // Score units (attention_common.cuh, exp_of): log2, or natural with a floating mask.
  ScoreRule score;
  Causal causal;
  MaskView mask;
  TileSummaryView tiles;  // null ptr without a mask
};

// Tile sizes and warps per head dim. Registers per thread (fp32 accumulators): S kMTiles*kBlockN/2,
// O kMTiles*D/2, Q fragments kMTiles*D/4 when kept in registers. Two 16-row tiles per warp
// (kMTiles = 2) load each K/V fragment once for two MMAs, which halves shared-memory traffic;
// it fits only for small head dims.
template <int kHeadDim>
struct FwdConfig {
  static constexpr int kBlockM = 128;
  // D = 256: O alone takes 128 registers, so Q is re-read from shared memory and 32-key tiles keep
  // S small (64-key tiles spilled); 135 KB of shared memory.
  static constexpr int kBlockN = kHeadDim <= 128 ? 64 : 32;
  static constexpr int kWarps = kHeadDim <= 64 ? 4 : 8;
  static constexpr bool kQInRegs = kHeadDim <= 128;
  // With Q in registers its shared tile is free once loaded, so the second K/V stage reuses it
  // (and the output staging reuses it at the end): 68 KB at D = 128 instead of 102, which fits
  // the 99 KB a block may have on sm_86 / sm_89 / sm_120 and leaves room for a second CTA on
  // sm_80 / sm_90. Without Q in registers (D = 256) the stages have their own rows.
  static constexpr bool kAliasQ = kQInRegs;
  static constexpr int kQRows = kAliasQ && 2 * kBlockN > kBlockM ? 2 * kBlockN : kBlockM;
  static constexpr int kSmemRows = kQRows + (kAliasQ ? 2 : 4) * kBlockN;
  static constexpr size_t smem_bytes(size_t element_size) {
    return static_cast<size_t>(kSmemRows) * padded_row(kHeadDim) * element_size;
  }
};

// Host: the (query, key) tile sizes of head dim d, for the mask summary; {0, 0} if none.
inline void fwd_tile_sizes(int64_t d, int& block_q, int& block_kv) {
  block_q = block_kv = 0;
  with_head_dim<kFwdHeadDims>(d, [&](auto dim) {
    block_q = FwdConfig<decltype(dim)::value>::kBlockM;
    block_kv = FwdConfig<decltype(dim)::value>::kBlockN;
  });
}

// Host: the shared memory the kernel of head dim d takes (bytes, 16-bit elements); 0 if none.
inline size_t fwd_smem_bytes(int64_t d) {
  size_t bytes = 0;
  with_head_dim<kFwdHeadDims>(d, [&](auto dim) { bytes = FwdConfig<decltype(dim)::value>::smem_bytes(2); });
  return bytes;
}

// Launches the kernel for one (dtype, head dim) on `stream`. Defined (with the kernel) only where
// SAFEATTN_ATTN_FWD_DEFINE_KERNELS is set: in the generated attention_fwd_d<D>_<dtype>.cu, each
// of which instantiates one pair; the dispatch code sees this declaration.
template <typename T, int kHeadDim>
void launch_attention_fwd(const FwdParams& p, cudaStream_t stream);

namespace fwd_detail {

template <typename T>
__device__ __forceinline__ void mma_pair(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]};
  const uint32_t b1[2] = {b[2], b[3]};
  mma_16816<T>(d0, a, b0);
  mma_16816<T>(d1, a, b1);
}

}  // namespace fwd_detail

#ifdef SAFEATTN_ATTN_FWD_DEFINE_KERNELS

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(FwdConfig<kHeadDim>::kWarps * 32, 1) attention_fwd_kernel(const FwdParams p) {
  using namespace fwd_detail;
  using Cfg = FwdConfig<kHeadDim>;
  constexpr int D = kHeadDim;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kWarps = Cfg::kWarps;
  constexpr bool kQInRegs = Cfg::kQInRegs;
  constexpr int kThreads = kWarps * 32;
  constexpr int kMTiles = kBlockM / (16 * kWarps);  // 16-row MMA tiles per warp
  constexpr int kStride = padded_row(D);
  constexpr int kChunks = D / 8;        // 16-byte chunks per row
  constexpr int kNTiles = kBlockN / 8;  // n8 tiles of a score row
  constexpr int kDTiles = D / 8;        // n8 tiles of an output row
  constexpr int kKSteps = D / 16;       // k16 steps of Q K^T
  static_assert(D % 16 == 0 && kBlockN % 16 == 0 && kBlockM % (16 * kWarps) == 0, "bad tile shape");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // [kQRows][kStride]: Q, then (kAliasQ) stage 1's K and V, then the output staging.
  T* s_q = reinterpret_cast<T*>(smem_raw);
  // Stage s's K tile ([kBlockN][kStride]), V right after it; stage 1 in Q's rows when kAliasQ.
  auto s_k = [&](int stage) -> T* {
    if constexpr (Cfg::kAliasQ) {
      return stage == 0 ? s_q + Cfg::kQRows * kStride : s_q;
    } else {
      return s_q + (Cfg::kQRows + 2 * stage * kBlockN) * kStride;
    }
  };
  auto s_v = [&](int stage) -> T* { return s_k(stage) + kBlockN * kStride; };

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // the MMA fragment's row group and column pair
  const int64_t q_tiles = (p.q_len + kBlockM - 1) / kBlockM;
  // Consecutive CTAs are the query tiles of one head, so the CTAs resident together share the
  // K/V of a few heads in L2; within a head the longest (under causal, latest) tiles go first.
  const int64_t q_tile = q_tiles - 1 - static_cast<int64_t>(blockIdx.x) % q_tiles;
  const int64_t bh = static_cast<int64_t>(blockIdx.x) / q_tiles;
  const int64_t b = bh / p.heads, h = bh % p.heads, hk = h / p.group;
  const int64_t i0 = q_tile * kBlockM;
  const int64_t rows = p.q_len - i0 < kBlockM ? p.q_len - i0 : kBlockM;
  const int warp_row0 = warp * kMTiles * 16;
  // Warps whose rows all lie past q_len (short query tiles, decoding) only help load.
  const bool warp_active = warp_row0 < rows;

  const T* q_base = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  const T* k_base = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;

  // ldmatrix row addresses of this lane: A operand and V (.trans) share one pattern, K another.
  const int a_row = (lane % 8) + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);
  const int k_row = (lane % 8) + 8 * (lane / 16), k_col = 8 * ((lane / 8) % 2);

  // Key tiles [0, n_tiles) may hold a key visible to this query tile; of those, the ones the
  // mask summary proves fully masked are skipped.
  const int64_t kv_end = p.causal.kv_end(i0 + rows, p.kv_len);
  const int64_t n_tiles = (kv_end + kBlockN - 1) / kBlockN;
  auto next_tile = [&](int64_t j) {
    while (j < n_tiles && p.tiles.at(b, h, q_tile, j) == kTileMasked) {
      ++j;
    }
    return j;
  };
  auto load_kv = [&](int64_t tile, int stage) {
    const int64_t j0 = tile * kBlockN;
    load_tile<T, kBlockN, D, kThreads>(s_k(stage), k_base + j0 * p.k_si, p.k_si, p.kv_len - j0, tid);
    load_tile<T, kBlockN, D, kThreads>(s_v(stage), v_base + j0 * p.v_si, p.v_si, p.kv_len - j0, tid);
  };

  load_tile<T, kBlockM, D, kThreads>(s_q, q_base + i0 * p.q_si, p.q_si, rows, tid);
  int64_t tile = next_tile(0);
  if (tile < n_tiles) {
    load_kv(tile, 0);
  }
  cp_async_commit();

  [[maybe_unused]] uint32_t q_frag[kQInRegs ? kMTiles : 1][kQInRegs ? kKSteps : 1][4];
  if constexpr (kQInRegs) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        ldmatrix_x4(q_frag[mt][kk], s_q + (warp_row0 + mt * 16 + a_row) * kStride + kk * 16 + a_col);
      }
    }
    if constexpr (Cfg::kAliasQ) {
      __syncthreads();  // every warp holds its Q before the first prefetch refills Q's rows
    }
  }

  float o_acc[kMTiles][kDTiles][4];
  float row_max[kMTiles][2], row_sum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o_acc[mt][dt][e] = 0.0f;
      }
    }
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  int stage = 0;
  while (tile < n_tiles) {
    const int64_t j0 = tile * kBlockN;
    const int64_t next = next_tile(tile + 1);
    if (next < n_tiles) {
      load_kv(next, stage ^ 1);  // in flight while this tile is computed
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group (and Q's) complete; the next may still fly
    __syncthreads();

    if (warp_active) {
      const T* k_s = s_k(stage);
      const T* v_s = s_v(stage);

      // ---- S = Q K^T ----
      float s_acc[kMTiles][kNTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s_acc[mt][nt][e] = 0.0f;
          }
        }
      }
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          if constexpr (kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              a[mt][e] = q_frag[mt][kk][e];
            }
          } else {
            ldmatrix_x4(a[mt], s_q + (warp_row0 + mt * 16 + a_row) * kStride + kk * 16 + a_col);
          }
        }
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t kb[4];
          ldmatrix_x4(kb, k_s + (np * 16 + k_row) * kStride + kk * 16 + k_col);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_pair<T>(s_acc[mt][2 * np], s_acc[mt][2 * np + 1], a[mt], kb);
          }
        }
      }

      // ---- scores in the kernel's units: scale (softcap), mask, causal, key bounds ----
      p.score.score_all<kMTiles * kNTiles * 4>(&s_acc[0][0][0]);
      const bool read_mask = p.tiles.at(b, h, q_tile, tile) == kTileMixed;
      const bool edge = j0 + kBlockN > p.kv_len || !p.causal.tile_all_visible(i0, j0 + kBlockN);
      if (read_mask || edge) {
        // In tile coordinates (row r, column c; 32-bit): in range when r < row_limit and
        // c < col_limit; causal (key j0 + c <= query i0 + r + shift) when c - r <= diag, with
        // diag clamped to where the test is always true (kBlockN) or always false (-kBlockM - 1).
        const int row_limit = static_cast<int>(rows);
        const int col_limit = static_cast<int>(p.kv_len - j0 < kBlockN ? p.kv_len - j0 : kBlockN);
        const int64_t diag_full = p.causal.enabled ? i0 + p.causal.shift - j0 : int64_t{kBlockN};
        const int diag = static_cast<int>(diag_full > kBlockN        ? kBlockN
                                          : diag_full < -kBlockM - 1 ? -kBlockM - 1
                                                                     : diag_full);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = warp_row0 + mt * 16 + g + 8 * half;
            const bool row_ok = r < row_limit;
            const int64_t mask_row = (row_ok && read_mask) ? p.mask.offset(b, h, i0 + r, j0) : 0;
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int c = nt * 8 + 2 * t + e;
                const bool visible = row_ok && c < col_limit && c - r <= diag;
                float x = s_acc[mt][nt][2 * half + e];
                if (visible && read_mask) {
                  x = p.score.masked(x, p.mask.additive(mask_row + c * p.mask.stride_kv));
                }
                s_acc[mt][nt][2 * half + e] = visible ? x : -INFINITY;
              }
            }
          }
        }
      }

      // ---- online softmax ----
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            mx = fmaxf(mx, fmaxf(s_acc[mt][nt][2 * half], s_acc[mt][nt][2 * half + 1]));
          }
          // The four threads of a quad hold one row.
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(row_max[mt][half], mx);
          const float offset = m_new == -INFINITY ? 0.0f : m_new;  // empty so far: no -inf - -inf
          // Natural units: subtract first, then convert (see exp_of).
          const float unit = p.score.natural ? kLog2e : 1.0f;
          const float alpha = fast_exp2((row_max[mt][half] - offset) * unit);  // old max -inf: 0
          row_max[mt][half] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pr = fast_exp2((s_acc[mt][nt][2 * half + e] - offset) * unit);
              s_acc[mt][nt][2 * half + e] = pr;
              sum += pr;
            }
          }
          row_sum[mt][half] = row_sum[mt][half] * alpha + sum;  // per thread; quad-summed at the end
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            o_acc[mt][dt][2 * half] *= alpha;
            o_acc[mt][dt][2 * half + 1] *= alpha;
          }
        }
      }

      // ---- O += P V ----
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t pa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          pa[mt][0] = pack2<T>(s_acc[mt][2 * kk][0], s_acc[mt][2 * kk][1]);
          pa[mt][1] = pack2<T>(s_acc[mt][2 * kk][2], s_acc[mt][2 * kk][3]);
          pa[mt][2] = pack2<T>(s_acc[mt][2 * kk + 1][0], s_acc[mt][2 * kk + 1][1]);
          pa[mt][3] = pack2<T>(s_acc[mt][2 * kk + 1][2], s_acc[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, v_s + (kk * 16 + a_row) * kStride + dp * 16 + a_col);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_pair<T>(o_acc[mt][2 * dp], o_acc[mt][2 * dp + 1], pa[mt], vb);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    tile = next;
    stage ^= 1;
  }
  cp_async_wait<0>();

  // ---- epilogue: normalise, lse, stage the tile in shared memory, 16-byte stores ----
  const float sink = p.sinks != nullptr ? p.sinks[h] * (p.score.natural ? 1.0f : kLog2e) : 0.0f;
  float* lse_row = p.lse + bh * p.q_len;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = row_sum[mt][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const bool empty = l == 0.0f;  // no visible key (NaN is not empty)
      const RowEnd end = finish_row(row_max[mt][half], l, p.sinks != nullptr, sink, p.score.natural);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        // An empty row is exactly 0, even if a masked value was NaN (0 * NaN in P V).
        o_acc[mt][dt][2 * half] = empty ? 0.0f : o_acc[mt][dt][2 * half] * end.factor;
        o_acc[mt][dt][2 * half + 1] = empty ? 0.0f : o_acc[mt][dt][2 * half + 1] * end.factor;
      }
      const int64_t i = i0 + warp_row0 + mt * 16 + g + 8 * half;
      if (warp_active && t == 0 && i < p.q_len) {
        lse_row[i] = end.lse;
        if (p.lse_lo != nullptr) {
          p.lse_lo[bh * p.q_len + i] = end.lse_lo;
        }
      }
    }
  }
  __syncthreads();  // s_q may still be read by other warps (kQInRegs false)
  if (warp_active) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        T* row = s_q + (warp_row0 + mt * 16 + g + 8 * half) * kStride + 2 * t;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          *reinterpret_cast<uint32_t*>(row + dt * 8) = pack2<T>(o_acc[mt][dt][2 * half], o_acc[mt][dt][2 * half + 1]);
        }
      }
    }
  }
  __syncthreads();
  T* o_base = static_cast<T*>(p.out) + b * p.o_sb + h * p.o_sh + i0 * p.o_si;
  constexpr int kOutChunks = kBlockM * kChunks;
#pragma unroll
  for (int it = 0; it < (kOutChunks + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + tid;
    const int r = c / kChunks, ch = c % kChunks;
    if ((kOutChunks % kThreads == 0 || c < kOutChunks) && r < rows) {
      *reinterpret_cast<uint4*>(o_base + r * p.o_si + ch * 8) =
          *reinterpret_cast<const uint4*>(s_q + r * kStride + ch * 8);
    }
  }
}

template <typename T, int kHeadDim>
void launch_attention_fwd(const FwdParams& p, cudaStream_t stream) {
  using Cfg = FwdConfig<kHeadDim>;
  constexpr int kThreads = Cfg::kWarps * 32;
  constexpr size_t kSmem = Cfg::smem_bytes(sizeof(T));
  static_assert(kSmem <= 227 * 1024, "the tiles do not fit in shared memory");
  auto kernel = &attention_fwd_kernel<T, kHeadDim>;
  if constexpr (kSmem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  }
  const int64_t q_tiles = (p.q_len + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t blocks = q_tiles * p.batch_heads;
  TORCH_CHECK(blocks <= 0x7fffffffLL, "attention (CUDA): too many query tiles (", blocks, ")");
  kernel<<<static_cast<unsigned>(blocks), kThreads, kSmem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#endif  // SAFEATTN_ATTN_FWD_DEFINE_KERNELS

}  // namespace safeattn::cuda::attn
