// CPU kernel of sdpa_mask, compiled once per ISA (see common/isa_dispatch.h).
//
// A row is its base interval plus per-element fixes: the kernel writes three fills (before,
// inside, after the interval), then revisits only the elements that packed ids, block ids or
// padding can change. With padding alone that revisit is a select over the padding row, which
// the ISA flags vectorise; with a bool output it is a plain copy.
#include <algorithm>
#include <cstring>
#include <limits>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "ops/sdpa_mask.h"

namespace safeattn::cpu {
namespace {

using namespace safeattn::sdpa_mask_detail;

// Rows per task: enough elements that a task amortises its scheduling.
constexpr int64_t kElementsPerTask = 1 << 15;

template <typename T>
void write_row(const SdpaMaskParams& p, int64_t b, int64_t i, T* row, T on, T off) {
  const int64_t kv_length = p.kv_length;
  const int64_t q_pos = query_position(p, b, i);
  const Interval base = base_interval(p, b, q_pos);
  std::fill(row, row + base.begin, off);
  std::fill(row + base.begin, row + base.end, on);
  std::fill(row + base.end, row + kv_length, off);
  if (!needs_elementwise(p)) {
    return;
  }
  const RowKeys keys = row_keys(p, b, q_pos);
  if (p.packed_ids == nullptr && keys.block_group < 0) {
    if (p.padding_mask == nullptr) {
      return;  // block ids exist but this query is in no block: the row is its interval
    }
    // Padding only: inside the interval the row is the padding row; past the padding mask's
    // width every key counts as padded.
    const bool* pad = p.padding_mask + b * p.padding_width;
    const int64_t pad_end = std::clamp<int64_t>(p.padding_width - p.kv_offset, 0, kv_length);
    const int64_t end = std::min(base.end, pad_end);
    for (int64_t j = base.begin; j < end; ++j) {
      row[j] = pad[p.kv_offset + j] ? on : off;
    }
    std::fill(row + std::max(base.begin, end), row + base.end, off);
    return;
  }
  // Block ids can open elements anywhere in the row; packed ids only close them inside it.
  const int64_t begin = keys.block_group >= 0 ? 0 : base.begin;
  const int64_t end = keys.block_group >= 0 ? kv_length : base.end;
  for (int64_t j = begin; j < end; ++j) {
    row[j] = element_attends(p, b, base, keys, j) ? on : off;
  }
}

template <typename T>
void write_mask(const SdpaMaskParams& p, T* out, T on, T off) {
  const int64_t rows = p.batch_size * p.q_length;
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(p.kv_length, 1));
  at::parallel_for(0, rows, grain, [&](int64_t row_begin, int64_t row_end) {
    for (int64_t r = row_begin; r < row_end; ++r) {
      write_row(p, r / p.q_length, r % p.q_length, out + r * p.kv_length, on, off);
    }
  });
}

void sdpa_mask_kernel(const SdpaMaskParams& params, at::Tensor& out, bool use_finfo_min) {
  if (out.numel() == 0) {
    return;
  }
  if (out.scalar_type() == at::kBool) {
    write_mask<bool>(params, out.data_ptr<bool>(), true, false);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sdpa_mask_cpu", [&] {
    // Additive mask: 0 attends; -inf blocks, or finfo.min as Transformers' eager_mask does.
    const scalar_t off = use_finfo_min ? std::numeric_limits<scalar_t>::lowest()
                                       : -std::numeric_limits<scalar_t>::infinity();
    write_mask<scalar_t>(params, out.data_ptr<scalar_t>(), scalar_t(0), off);
  });
}

}  // namespace

SAFEATTN_REGISTER_ISA_KERNEL(sdpa_mask_cpu_stub, &sdpa_mask_kernel);

}  // namespace safeattn::cpu
