// safeattn::sdpa_mask: builds every attention mask Transformers' masking_utils builds, in one
// pass over the [B, 1, Q, KV] output.
//
// Query i of batch b sits at position q_offset + i, or at q_positions (rank 0: a start
// position on the device, rank 1: [Q], rank 2: [B, Q]); key j sits at kv_offset + j.
// Element (b, q, kv) attends when
//     ((base AND packed) OR block) AND padding
// with, on positions (q, kv):
//   base     causal: kv <= q, else true
//            AND sliding window w: kv > q - w when causal, |q - kv| <= w otherwise
//            AND chunk c with left padding p[b]: floor((kv - p) / c) == floor((q - p) / c)
//   packed   packed_ids[b, q] == packed_ids[b, kv]
//   block    block_ids[b, q] == block_ids[b, kv] and block_ids[b, q] >= 0
//   padding  padding_mask[b, kv] (columns past the mask's width count as False)
// A query position outside the ids' width (possible only with q_positions) counts as -1 for
// block_ids and matches nothing in packed_ids; block_ids narrower than kv_offset + kv_length
// are read as -1 past their end (as Transformers pads them). No index leaves its tensor.
//
// base is one interval of key columns per row (intervals intersect), so kernels write it as a
// fill and look at single elements only for packed, block and padding.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/SymInt.h>
#include <c10/macros/Macros.h>

#include "common/isa_dispatch.h"

namespace safeattn {

// Everything a kernel needs, as plain data (usable on the device). Optional tensors are
// already contiguous int64 (ids, positions) or bool (padding); nullptr when absent.
struct SdpaMaskParams {
  int64_t batch_size = 0;
  int64_t q_length = 0;
  int64_t kv_length = 0;
  int64_t q_offset = 0;
  int64_t kv_offset = 0;
  bool causal = true;
  int64_t sliding_window = 0;  // 0: none
  int64_t chunk_size = 0;      // 0: none
  const int64_t* q_positions = nullptr;
  int q_positions_rank = 0;                     // 0: start position, 1: [Q], 2: [B, Q]
  const int64_t* chunk_left_padding = nullptr;  // [B]
  const bool* padding_mask = nullptr;           // [B, padding_width]
  int64_t padding_width = 0;
  const int64_t* packed_ids = nullptr;  // [B, packed_width]
  int64_t packed_width = 0;
  const int64_t* block_ids = nullptr;  // [B, block_width]
  int64_t block_width = 0;
};

namespace sdpa_mask_detail {

// Positions are computed in 128 bits: a query position is q_offset + i or a position tensor's
// value (+ i), any int64, and the rule's sums (q + window, q - pad, ...) pass the int64 range
// near its ends; in 128 bits every one of them is exact, and only the final columns, clipped to
// [0, kv_length], go back to int64. Validation keeps q_offset + q_length and kv_offset +
// kv_length within int64.
using Position = __int128;

// Python's floor division (chunk indices of left-padded positions are negative).
C10_HOST_DEVICE inline Position floor_div(Position a, Position b) {
  const Position q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

C10_HOST_DEVICE inline Position query_position(const SdpaMaskParams& p, int64_t b, int64_t i) {
  if (p.q_positions == nullptr) {
    return Position{p.q_offset} + i;
  }
  switch (p.q_positions_rank) {
    case 0:
      return Position{p.q_positions[0]} + i;
    case 1:
      return p.q_positions[i];
    default:
      return p.q_positions[b * p.q_length + i];
  }
}

// ids[b, position], or `outside` when the position is not inside the tensor.
C10_HOST_DEVICE inline int64_t id_at(const int64_t* ids, int64_t width, int64_t b, Position position, int64_t outside) {
  return (position >= 0 && position < width) ? ids[b * width + static_cast<int64_t>(position)] : outside;
}

// Columns [begin, end) of the row's base interval (empty when begin >= end).
struct Interval {
  int64_t begin;
  int64_t end;
};

// causal_end false: a causal rule's window (kv > q - w) without causality's end (kv <= q), for the
// key ranges, whose users apply causality themselves (key_ranges below).
C10_HOST_DEVICE inline Interval base_interval(const SdpaMaskParams& p, int64_t b, Position q_pos,
                                              bool causal_end = true) {
  // Inclusive key positions; start unbounded (far outside any int64 position) and intersect.
  constexpr Position kUnbounded = Position{1} << 100;
  Position lo = -kUnbounded;
  Position hi = kUnbounded;
  if (p.causal && causal_end) {
    hi = q_pos;
  }
  if (p.sliding_window > 0) {
    if (p.causal) {
      lo = q_pos - p.sliding_window + 1;
    } else {
      lo = q_pos - p.sliding_window;
      hi = hi < q_pos + p.sliding_window ? hi : q_pos + p.sliding_window;
    }
  }
  if (p.chunk_size > 0) {
    const Position pad = p.chunk_left_padding != nullptr ? p.chunk_left_padding[b] : 0;
    const Position first = pad + floor_div(q_pos - pad, p.chunk_size) * p.chunk_size;
    lo = lo > first ? lo : first;
    hi = hi < first + p.chunk_size - 1 ? hi : first + p.chunk_size - 1;
  }
  // Positions to columns, clipped to [0, kv_length].
  Position begin = lo - p.kv_offset;
  Position end = hi - p.kv_offset + 1;
  begin = begin < 0 ? 0 : (begin > p.kv_length ? p.kv_length : begin);
  end = end < begin ? begin : (end > p.kv_length ? p.kv_length : end);
  return {static_cast<int64_t>(begin), static_cast<int64_t>(end)};
}

// A row's interval ANDed with its query's run of packed ids, [run_begin, run_end) in positions:
// where a row's ids never decrease (runs), ids[q] == ids[kv] holds exactly for kv in q's run.
C10_HOST_DEVICE inline Interval in_run(const SdpaMaskParams& p, Interval row, int64_t run_begin, int64_t run_end) {
  row.begin = row.begin > run_begin - p.kv_offset ? row.begin : run_begin - p.kv_offset;
  const int64_t end = row.end < run_end - p.kv_offset ? row.end : run_end - p.kv_offset;
  row.end = end > row.begin ? end : row.begin;
  return row;
}

// What a row needs beyond its interval: the query's packed id and block group.
struct RowKeys {
  int64_t packed_id;
  bool packed_known;    // false: the query position is outside packed_ids
  int64_t block_group;  // < 0: the query is in no block
};

C10_HOST_DEVICE inline RowKeys row_keys(const SdpaMaskParams& p, int64_t b, Position q_pos) {
  RowKeys keys{0, false, -1};
  if (p.packed_ids != nullptr) {
    keys.packed_known = q_pos >= 0 && q_pos < p.packed_width;
    keys.packed_id = keys.packed_known ? p.packed_ids[b * p.packed_width + static_cast<int64_t>(q_pos)] : 0;
  }
  if (p.block_ids != nullptr) {
    keys.block_group = id_at(p.block_ids, p.block_width, b, q_pos, -1);
  }
  return keys;
}

// True when the row is not just its interval (some element needs its own test).
C10_HOST_DEVICE inline bool needs_elementwise(const SdpaMaskParams& p) {
  return p.packed_ids != nullptr || p.block_ids != nullptr || p.padding_mask != nullptr;
}

// The full rule for one element (column j) of a row.
C10_HOST_DEVICE inline bool element_attends(const SdpaMaskParams& p, int64_t b, const Interval& base,
                                            const RowKeys& keys, int64_t j) {
  if (j >= p.kv_length) {
    return false;  // a column past the row (a vector's tail): not stored, and kv_offset + j could overflow
  }
  const int64_t kv_pos = p.kv_offset + j;
  bool attend = j >= base.begin && j < base.end;
  if (attend && p.packed_ids != nullptr) {
    // Validation guarantees kv_pos < packed_width; an unknown query position matches nothing.
    attend =
        keys.packed_known && kv_pos < p.packed_width && p.packed_ids[b * p.packed_width + kv_pos] == keys.packed_id;
  }
  if (!attend && keys.block_group >= 0) {
    attend = id_at(p.block_ids, p.block_width, b, kv_pos, -1) == keys.block_group;
  }
  if (attend && p.padding_mask != nullptr) {
    attend = kv_pos < p.padding_width && p.padding_mask[b * p.padding_width + kv_pos];
  }
  return attend;
}

}  // namespace sdpa_mask_detail

// The per-ISA CPU kernel: writes `out` ([B, 1, Q, KV], contiguous, bool or floating).
using SdpaMaskCpuFn = void (*)(const SdpaMaskParams& params, at::Tensor& out, bool use_finfo_min);
SAFEATTN_DECLARE_ISA_STUB(sdpa_mask_cpu_stub, SdpaMaskCpuFn);

// Validates the arguments and returns the device the mask is built on: the one source of the
// op's rules, run by every backend's kernel and by the Meta kernel (the fake), on SymInt sizes
// (common/checks.h; an int64_t converts implicitly).
c10::Device check_sdpa_mask(const c10::SymInt& batch_size, const c10::SymInt& q_length, const c10::SymInt& kv_length,
                            const c10::SymInt& q_offset, const c10::SymInt& kv_offset,
                            const std::optional<at::Tensor>& q_positions, std::optional<int64_t> sliding_window,
                            std::optional<int64_t> chunk_size, const std::optional<at::Tensor>& chunk_left_padding,
                            const std::optional<at::Tensor>& padding_mask, const std::optional<at::Tensor>& packed_ids,
                            const std::optional<at::Tensor>& block_ids, std::optional<at::ScalarType> dtype,
                            bool use_finfo_min, std::optional<c10::Device> device);

// Converts the optional tensors to the layout SdpaMaskParams points into. The returned
// holder keeps those tensors alive while a kernel runs.
struct SdpaMaskInputs {
  SdpaMaskParams params;
  at::Tensor q_positions, chunk_left_padding, padding_mask, packed_ids, block_ids;
};
SdpaMaskInputs prepare_sdpa_mask(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                                 int64_t kv_offset, const std::optional<at::Tensor>& q_positions, bool causal,
                                 std::optional<int64_t> sliding_window, std::optional<int64_t> chunk_size,
                                 const std::optional<at::Tensor>& chunk_left_padding,
                                 const std::optional<at::Tensor>& padding_mask,
                                 const std::optional<at::Tensor>& packed_ids,
                                 const std::optional<at::Tensor>& block_ids);

// What each backend registers for sdpa_mask: the checks; a Backend made from the device they
// name (it refuses another backend's device; CUDA's opens the device guard, so the inputs are
// converted on that device's current stream) with that device as `device`; the inputs prepared
// and the output allocated there; then Backend::fill(params, out, use_finfo_min) writes the mask
// (nothing to write when it is empty).
template <class Backend>
at::Tensor sdpa_mask_kernel(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                            int64_t kv_offset, const std::optional<at::Tensor>& q_positions, bool causal,
                            std::optional<int64_t> sliding_window, std::optional<int64_t> chunk_size,
                            const std::optional<at::Tensor>& chunk_left_padding,
                            const std::optional<at::Tensor>& padding_mask, const std::optional<at::Tensor>& packed_ids,
                            const std::optional<at::Tensor>& block_ids, std::optional<at::ScalarType> dtype,
                            bool use_finfo_min, std::optional<c10::Device> device) {
  const Backend backend(check_sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, q_positions,
                                        sliding_window, chunk_size, chunk_left_padding, padding_mask, packed_ids,
                                        block_ids, dtype, use_finfo_min, device));
  SdpaMaskInputs in =
      prepare_sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, q_positions, causal, sliding_window,
                        chunk_size, chunk_left_padding, padding_mask, packed_ids, block_ids);
  at::Tensor out = at::empty({batch_size, 1, q_length, kv_length},
                             at::TensorOptions().dtype(dtype.value_or(at::kBool)).device(backend.device));
  if (out.numel() > 0) {
    backend.fill(in.params, out, use_finfo_min);
  }
  return out;
}

// ---- key ranges ---------------------------------------------------------------------------

// safeattn::_key_ranges: the window's, the chunks' and the packed runs' keys of each query row as
// attention's key_ranges, int32 [Bm, Q, 2] (lo, hi), query i keeping keys lo <= j < hi: sdpa_mask's
// base rule without causality's end (attention applies causality as is_causal), ANDed with the
// query's run of packed_ids (ids the caller promises are runs: each id's positions one run).
// Bm is batch_size with per-row inputs (chunk_left_padding, packed_ids), else 1. One kernel on the
// device (two with packed ids), in place of the twenty small ops that built them in Python.
// The row (b, i)'s range, run_begin / run_end ([B, packed_width]: each position's run) where
// there are packed ids; validation keeps query positions inside the ids.
C10_HOST_DEVICE inline void key_range_of_row(const SdpaMaskParams& p, const int64_t* run_begin, const int64_t* run_end,
                                             int64_t b, int64_t i, int32_t* out) {
  using namespace sdpa_mask_detail;
  const Position q_pos = query_position(p, b, i);
  Interval row = base_interval(p, b, q_pos, /*causal_end=*/false);
  if (p.packed_ids != nullptr) {
    const int64_t at = b * p.packed_width + static_cast<int64_t>(q_pos);
    row = in_run(p, row, run_begin[at], run_end[at]);
  }
  // Within [0, kv_length] (a run past the keys left begin there, and the range empty).
  out[0] = static_cast<int32_t>(row.begin < p.kv_length ? row.begin : p.kv_length);
  out[1] = static_cast<int32_t>(row.end < p.kv_length ? row.end : p.kv_length);
}

// Validates _key_ranges' arguments (sdpa_mask's rules, and int32 columns) and returns its device.
c10::Device check_key_ranges(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                             int64_t kv_offset, std::optional<int64_t> sliding_window,
                             std::optional<int64_t> chunk_size, const std::optional<at::Tensor>& chunk_left_padding,
                             const std::optional<at::Tensor>& packed_ids, std::optional<c10::Device> device);

// What each backend registers for _key_ranges: as sdpa_mask_kernel, then
// Backend::key_ranges(params, out) writes the [Bm, Q, 2] ranges (params.batch_size = Bm).
template <class Backend>
at::Tensor key_ranges_kernel(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                             int64_t kv_offset, bool causal, std::optional<int64_t> sliding_window,
                             std::optional<int64_t> chunk_size, const std::optional<at::Tensor>& chunk_left_padding,
                             const std::optional<at::Tensor>& packed_ids, std::optional<c10::Device> device) {
  const Backend backend(check_key_ranges(batch_size, q_length, kv_length, q_offset, kv_offset, sliding_window,
                                         chunk_size, chunk_left_padding, packed_ids, device));
  const int64_t rows_b = chunk_left_padding.has_value() || packed_ids.has_value() ? batch_size : 1;
  SdpaMaskInputs in =
      prepare_sdpa_mask(rows_b, q_length, kv_length, q_offset, kv_offset, std::nullopt, causal, sliding_window,
                        chunk_size, chunk_left_padding, std::nullopt, packed_ids, std::nullopt);
  at::Tensor out = at::empty({rows_b, q_length, 2}, at::TensorOptions().dtype(at::kInt).device(backend.device));
  if (out.numel() > 0) {
    backend.key_ranges(in.params, out);
  }
  return out;
}

// Typed C++ entry point: calls the dispatcher (so it works for every backend and under
// autograd/tracing exactly as torch.ops.safeattn.sdpa_mask does from Python).
at::Tensor sdpa_mask(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset = 0,
                     int64_t kv_offset = 0, const std::optional<at::Tensor>& q_positions = std::nullopt,
                     bool causal = true, std::optional<int64_t> sliding_window = std::nullopt,
                     std::optional<int64_t> chunk_size = std::nullopt,
                     const std::optional<at::Tensor>& chunk_left_padding = std::nullopt,
                     const std::optional<at::Tensor>& padding_mask = std::nullopt,
                     const std::optional<at::Tensor>& packed_ids = std::nullopt,
                     const std::optional<at::Tensor>& block_ids = std::nullopt,
                     std::optional<at::ScalarType> dtype = std::nullopt, bool use_finfo_min = false,
                     std::optional<c10::Device> device = std::nullopt);

}  // namespace safeattn
