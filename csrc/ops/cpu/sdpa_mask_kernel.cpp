// CPU kernel of sdpa_mask, compiled once per ISA (see common/isa_dispatch.h).
//
// A row is its base interval plus per-element rules: the kernel fills what lies outside the
// interval and writes the inside as a fill or by the packed ids, then applies the padding: each a
// branch-free pass that the ISA flags vectorise. Only a query inside a bidirectional block
// needs the general rule over the whole row.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "ops/cpu/parallel.h"
#include "ops/sdpa_mask.h"

namespace safeattn::cpu {
namespace {

using namespace safeattn::sdpa_mask_detail;

// Rows per task: enough elements that a task amortises its scheduling.
constexpr int64_t kElementsPerTask = 1 << 15;

// Columns [begin, end) of a row inside its interval, by the packed ids, and for a floating
// output by the padding too (`pad` non-null: columns before pad_end) in the same branch-free pass,
// which the ISA flags vectorise. A bool output takes the padding in a pass of its own
// (apply_padding): for bytes, the loop over both the 8-byte ids and the 1-byte padding stayed
// scalar (packed + padding, 1024^2: 0.62 ms, against 0.15 in two passes); for floats the one
// pass is the faster (0.33 ms against 0.63).
template <typename T>
void write_packed(T* row, int64_t begin, int64_t end, const int64_t* ids, int64_t query_id, const bool* pad,
                  int64_t pad_end, T on, T off) {
  if (pad == nullptr) {
    for (int64_t j = begin; j < end; ++j) {
      row[j] = ids[j] == query_id ? on : off;
    }
    return;
  }
  const int64_t stop = std::min(end, pad_end);
  for (int64_t j = begin; j < stop; ++j) {
    row[j] = (ids[j] == query_id) & pad[j] ? on : off;
  }
  std::fill(row + std::max(begin, stop), row + end, off);  // keys past the padding mask's width
}

// The padding over columns [begin, end) already written: a padded key gets `off`, and so do keys
// past the padding mask's width (they count as padded).
template <typename T>
void apply_padding(T* row, int64_t begin, int64_t end, const bool* pad, int64_t pad_end, T off) {
  const int64_t stop = std::min(end, pad_end);
  for (int64_t j = begin; j < stop; ++j) {
    if constexpr (std::is_same_v<T, bool>) {
      row[j] = row[j] & pad[j];  // a byte AND: GCC keeps a select on bytes scalar (20x slower)
    } else {
      row[j] = pad[j] ? row[j] : off;
    }
  }
  std::fill(row + std::max(begin, stop), row + end, off);
}

template <typename T>
void write_row(const SdpaMaskParams& p, int64_t b, int64_t i, T* row, T on, T off) {
  const int64_t kv_length = p.kv_length;
  const Position q_pos = query_position(p, b, i);
  const Interval base = base_interval(p, b, q_pos);
  std::fill(row, row + base.begin, off);
  std::fill(row + base.end, row + kv_length, off);
  if (!needs_elementwise(p)) {
    std::fill(row + base.begin, row + base.end, on);
    return;
  }
  const RowKeys keys = row_keys(p, b, q_pos);
  if (keys.block_group >= 0) {
    // Block ids can open elements anywhere in the row: the general rule, element by element.
    for (int64_t j = 0; j < kv_length; ++j) {
      row[j] = element_attends(p, b, base, keys, j) ? on : off;
    }
    return;
  }
  if (p.packed_ids != nullptr && !keys.packed_known) {
    std::fill(row + base.begin, row + base.end, off);  // an unknown query position matches nothing
    return;
  }
  // Row views shifted so that column j reads position kv_offset + j.
  // (validation: packed_ids reach past kv_offset + kv_length; a padding mask may end sooner, and
  // its columns from pad_end on are padding, never read.)
  const int64_t* ids = p.packed_ids != nullptr ? p.packed_ids + b * p.packed_width + p.kv_offset : nullptr;
  const int64_t pad_end = std::clamp<int64_t>(p.padding_width - p.kv_offset, 0, kv_length);
  const bool* pad = p.padding_mask == nullptr ? nullptr
                    : pad_end > 0             ? p.padding_mask + b * p.padding_width + p.kv_offset
                                              : p.padding_mask;
  constexpr bool kBool = std::is_same_v<T, bool>;
  if (ids != nullptr) {
    write_packed(row, base.begin, base.end, ids, keys.packed_id, kBool ? nullptr : pad, pad_end, on, off);
    if (kBool && pad != nullptr) {
      apply_padding(row, base.begin, base.end, pad, pad_end, off);
    }
  } else if (pad != nullptr) {
    std::fill(row + base.begin, row + base.end, on);
    apply_padding(row, base.begin, base.end, pad, pad_end, off);
  } else {
    std::fill(row + base.begin, row + base.end, on);  // block ids given, but this query is in none
  }
}

// What an element holds when it attends and when it does not: types rather than runtime
// values, so that the constants reach the row loops inside at::parallel_for's body (a function
// of its own in the OpenMP build). Read there from captured variables, they left GCC with a
// scalar, branchy padding loop, 8x slower than the vectorised one.
struct BoolValues {
  static bool on() {
    return true;
  }
  static bool off() {
    return false;
  }
};
template <typename T>
struct AdditiveValues {  // 0 attends, -inf blocks
  static T on() {
    return T(0);
  }
  static T off() {
    return -std::numeric_limits<T>::infinity();
  }
};
template <typename T>
struct FinfoMinValues {  // 0 attends, finfo.min blocks, as Transformers' eager_mask does
  static T on() {
    return T(0);
  }
  static T off() {
    return std::numeric_limits<T>::lowest();
  }
};

template <typename Values, typename T>
void write_mask(const SdpaMaskParams& p, T* out) {
  const int64_t rows = p.batch_size * p.q_length;
  at::parallel_for(0, rows, grain_for(p.kv_length, kElementsPerTask), [&](int64_t row_begin, int64_t row_end) {
    for (int64_t r = row_begin; r < row_end; ++r) {
      write_row(p, r / p.q_length, r % p.q_length, out + r * p.kv_length, Values::on(), Values::off());
    }
  });
}

void sdpa_mask_kernel(const SdpaMaskParams& params, at::Tensor& out, bool use_finfo_min) {
  if (out.numel() == 0) {
    return;
  }
  if (out.scalar_type() == at::kBool) {
    write_mask<BoolValues>(params, out.data_ptr<bool>());
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sdpa_mask_cpu", [&] {
    if (use_finfo_min) {
      write_mask<FinfoMinValues<scalar_t>>(params, out.data_ptr<scalar_t>());
    } else {
      write_mask<AdditiveValues<scalar_t>>(params, out.data_ptr<scalar_t>());
    }
  });
}

}  // namespace

SAFEATTN_REGISTER_ISA_KERNEL(sdpa_mask_cpu_stub, &sdpa_mask_kernel);

}  // namespace safeattn::cpu
