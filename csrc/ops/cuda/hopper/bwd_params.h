// What the sm_90a backward attention kernel (hopper/bwd_kernel.cuh) reads and writes: plain data,
// no CuTe and no torch, so the dispatch code (attention_bwd_sm90.cu, built for plain sm_90) and
// the standalone check (benchmarks/hopper_bwd_check.cu) can both fill it. Semantics: ops/attention.h.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "ops/cuda/hopper/sm90_params.h"

namespace safeattn::cuda::hopper {

// The rows of row_shift, delta and dq_accum: Q rounded up to a multiple of this (whole tiles).
constexpr int kBwdRowPad = 128;
// The query rows of the backward's mask summary tiles (its query tile; keys: bwd_key_tile).
constexpr int kBwdMaskTileRows = 64;
// The backward's key tile for head dim D (one CTA's keys; the mask summary's key tile): 128 keys,
// 64 per consumer warpgroup, but 64 past D = 128, shared by the two (dK and dV of 64 keys at
// D = 256 are 128 float32 accumulators per thread of a warpgroup: hopper/bwd_kernel.cuh).
constexpr int bwd_key_tile(int head_dim) {
  return head_dim > 128 ? 64 : 128;
}

// Whether dQ has a pass of its own (hopper/bwd_dq_kernel.cuh): a CTA per kDqTileRows query rows
// walks the key tiles, recomputes S and dP and multiplies dQ = dS K in registers, written once
// (no dq_accum, no atomics: deterministic); the dK/dV kernel then has no dQ product. Always past
// head dim 128, where the dK/dV kernel's 64-key tiles would each add their dQ into L2 (4x
// D = 128's bytes), half its time at D = 256 (benchmarks/notes_attention_cuda.md, "Hopper backward
// at head dim 256"); at the other head dims only when the result must be bit-reproducible
// (BwdSm90Params::deterministic): there the dQ product inside the dK/dV kernel, added with
// reduce-adds in no fixed order, is faster.
constexpr bool bwd_dq_pass(int head_dim, bool deterministic) {
  return deterministic || head_dim > 128;
}
// The dQ pass's query tile (two consumer warpgroups of 64 rows) and its mask summary's rows.
constexpr int kDqTileRows = 128;
// The dQ pass's key tile for head dim D (its mask summary's key tile): 128 keys at D = 64, else 64.
// At D = 128, 128 keys' S and dP (64 float32 registers each per thread) beside dQ (64) left ptxas
// too few registers to keep the wgmmas in flight (C7512: serialised).
constexpr int dq_key_tile(int head_dim) {
  return head_dim > 64 ? 64 : 128;
}

// Q, K, V and the mask: Sm90Inputs. The mask's summary is for tiles of kBwdMaskTileRows x
// bwd_key_tile(D) (the kernel's query and key tiles); a float mask with a softcap is not taken (the
// softcap's dS recovers the capped score from p). head_group 0: head_group_for's choice for
// resident_ctas CTAs at once.
struct BwdSm90Params : Sm90Inputs {
  const void* grad_out = nullptr;  // [B, Hq, Q, D], 16-byte aligned, strides as Q's
  // Null, or a flag the kernel reads on the device: nonzero when grad_out holds a non-finite
  // value in a row with no visible key, and the kernel reads grad_out_clean ([B, Hq, Q, D]
  // contiguous, those rows 0) instead (attention_bwd_sm90.h, Sm90BwdRows).
  const int* grad_out_dirty = nullptr;
  const void* grad_out_clean = nullptr;
  // Per query row, [B, Hq, q_pad] contiguous float32 with q_pad = Q rounded up to a multiple of
  // kBwdRowPad (the kernel bulk-copies whole tiles of rows), from the rows pre-pass
  // (attention_bwd_kernel.cu): row_shift = (lse + lse_lo) * log2(e), +inf for a row with no
  // visible key (every p becomes 0) and for the padding; delta = rowsum(dO * O) - grad_lse, 0 in
  // the padding.
  const float* row_shift = nullptr;
  const float* delta = nullptr;
  // With a float mask (null otherwise), [B, Hq, q_pad] float32 (rows in natural units, so that a
  // row of huge biases keeps lse_lo): row_shift = lse, row_lo = lse_lo log2(e), and
  // p = exp2((s - row_shift) log2(e) - row_lo) with s = scale q.k + mask in natural units
  // (+inf / 0 for empty rows and the padding, as above).
  const float* row_lo = nullptr;
  // dQ summed over the key tiles, float32: B * Hq * q_pad * D elements (the layout inside each
  // tile of rows is the kernel's own), zeroed by the caller, added into with bulk
  // reduce-adds; the launcher converts it into grad_q after the kernel. Unused (null) where
  // bwd_dq_pass(D, deterministic): the dQ pass writes grad_q itself.
  float* dq_accum = nullptr;
  // Bit-reproducible gradients: dQ by the dQ pass at every head dim (bwd_dq_pass). A float mask's
  // gradient summed over broadcast dims (grad_mask_adds) is added with atomics all the same.
  bool deterministic = false;
  void* grad_q = nullptr;  // [B, Hq, Q, D] strided, 4-byte aligned rows
  // [B, Hkv, KV, D] strided; written by TMA with 128-key tiles (kStagedDkv): a 16-byte aligned
  // start and strides of whole 16 bytes (tma_writable), else 4-byte aligned rows.
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  int64_t do_sb = 0, do_sh = 0, do_si = 0;  // strides in elements
  int64_t dq_sb = 0, dq_sh = 0, dq_si = 0;
  int64_t dk_sb = 0, dk_sh = 0, dk_si = 0;
  int64_t dv_sb = 0, dv_sh = 0, dv_si = 0;
  // Where bwd_dq_pass and there is a summary: the same mask summarised for the dQ pass's tiles,
  // kDqTileRows x dq_key_tile(D), with its first_visible record.
  attn::TileSummaryView dq_mask_tiles;
  // Null, or the float mask's gradient d loss / d mask = p (dP - delta) per element of (batch b,
  // query head h, row i, key j) at grad_mask + (b * grad_mask_sb + h * grad_mask_sh + i) * kv_len
  // + j (float32, contiguous rows of kv_len), at each visited (query tile, key tile); the caller
  // zeroes it (skipped tiles are not written). Only with a float mask. Either [B, Hq, Q, KV]
  // (strides Hq Q and Q rows) with every element stored once, or, with grad_mask_adds, the
  // mask's own shape [Bm, Hm, Q, KV], Bm in {1, B}, Hm in {1, Hq}, its broadcast dims' strides 0:
  // the (batch, head)s that share an element add into it (atomics, any order). The strides count
  // rows, not elements, so a step's address takes one 64-bit product by kv_len (in elements the
  // D = 128 bias kernel spilled 4 more bytes).
  float* grad_mask = nullptr;
  int64_t grad_mask_sb = 0, grad_mask_sh = 0;  // in rows of kv_len; 0 on a dim summed into one
  bool grad_mask_adds = false;
  // Or, in place of grad_mask, the gradient itself in the inputs' 16-bit type (a mask of that
  // dtype, GradMaskWrite::kOwnShape): [Bm, Hq, Q, KV] with Bm 1 = batch or B, through the same
  // strides, each element rounded once from its float32 value; zeroed by the caller.
  void* grad_mask_16 = nullptr;
  // The CTAs of one (key tile, kv head) for every batch row run side by side (the grid's batch
  // varies fastest in its order): set for a float mask shared by the batch, whose tiles are then
  // read from memory once for the batch and whose summed gradient's atomics meet in L2 (a
  // learnable [1, 16, 4096, 4096] bias at B = 4, D = 128, H100: the kernel 1.0 ms faster). A mask
  // shared by the heads needs no flag: the default order (KeyTileGrid) already runs the kv heads
  // of one key tile side by side, and the query heads of a kv group are one CTA's.
  bool batch_inner = false;
  int resident_ctas = 0;  // CTAs that run at once: the SM count (one CTA per SM); 0: unknown
};

// The launcher of one (dtype, head dim) instantiation; T is __nv_bfloat16 or __half. Defined in
// bwd_kernel.cuh, instantiated once per generated file attention_bwd_sm90_d<D>_<dtype>.cu. Runs
// the dK/dV kernel (adding dQ into dq_accum) and the dQ conversion on the stream; where
// bwd_dq_pass(D, params.deterministic), the dK/dV kernel and the dQ pass. Returns the first launch
// error (cudaErrorInvalidValue for a grid it cannot launch).
template <typename T, int kHeadDim>
cudaError_t launch_attention_bwd_sm90(const BwdSm90Params& params, cudaStream_t stream);

}  // namespace safeattn::cuda::hopper
