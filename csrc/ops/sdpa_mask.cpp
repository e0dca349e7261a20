// Schema, validation, the CPU entry point and the typed C++ entry point of sdpa_mask.
#include "ops/sdpa_mask.h"

#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "common/checks.h"

namespace safeattn {

SAFEATTN_DEFINE_ISA_STUB(sdpa_mask_cpu_stub, SdpaMaskCpuFn);

namespace {

constexpr const char* kOp = "sdpa_mask";

void check_ids(const std::optional<at::Tensor>& ids, const char* name, const c10::SymInt& batch_size) {
  if (!ids.has_value()) {
    return;
  }
  TORCH_CHECK(at::isIntegralType(ids->scalar_type(), /*includeBool=*/false), kOp, ": ", name,
              " must have an integer dtype, got ", dtype_name(ids->scalar_type()));
  TORCH_CHECK(ids->dim() == 2, kOp, ": ", name, " must be 2-D [batch_size, length], got ", ids->dim(), "-D");
  TORCH_CHECK(holds(ids->sym_size(0).sym_eq(batch_size)), kOp, ": ", name, " has batch ", ids->sym_size(0),
              " but batch_size is ", batch_size);
}

at::Tensor as_long(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->to(at::kLong).contiguous() : at::Tensor();
}

}  // namespace

c10::Device check_sdpa_mask(const c10::SymInt& batch_size, const c10::SymInt& q_length, const c10::SymInt& kv_length,
                            const c10::SymInt& q_offset, const c10::SymInt& kv_offset,
                            const std::optional<at::Tensor>& q_positions, std::optional<int64_t> sliding_window,
                            std::optional<int64_t> chunk_size, const std::optional<at::Tensor>& chunk_left_padding,
                            const std::optional<at::Tensor>& padding_mask, const std::optional<at::Tensor>& packed_ids,
                            const std::optional<at::Tensor>& block_ids, std::optional<at::ScalarType> dtype,
                            bool use_finfo_min, std::optional<c10::Device> device) {
  TORCH_CHECK(holds(batch_size.sym_ge(0)), kOp, ": batch_size must be >= 0, got ", batch_size);
  TORCH_CHECK(holds(q_length.sym_ge(0)), kOp, ": q_length must be >= 0, got ", q_length);
  TORCH_CHECK(holds(kv_length.sym_ge(0)), kOp, ": kv_length must be >= 0, got ", kv_length);
  TORCH_CHECK(holds(q_offset.sym_ge(0)), kOp, ": q_offset must be >= 0, got ", q_offset);
  TORCH_CHECK(holds(kv_offset.sym_ge(0)), kOp, ": kv_offset must be >= 0, got ", kv_offset);
  // Every query and key position must be an int64 (the kernels compute the rule exactly from there).
  const c10::SymInt max_position(std::numeric_limits<int64_t>::max());
  TORCH_CHECK(holds(q_offset.sym_le(max_position - q_length)), kOp, ": q_offset + q_length must be <= 2**63 - 1, got ",
              q_offset, " + ", q_length);
  TORCH_CHECK(holds(kv_offset.sym_le(max_position - kv_length)), kOp,
              ": kv_offset + kv_length must be <= 2**63 - 1, got ", kv_offset, " + ", kv_length);
  TORCH_CHECK(!sliding_window.has_value() || *sliding_window > 0, kOp, ": sliding_window must be > 0, got ",
              sliding_window.value_or(0));
  TORCH_CHECK(!chunk_size.has_value() || *chunk_size > 0, kOp, ": chunk_size must be > 0, got ",
              chunk_size.value_or(0));

  const at::ScalarType out_dtype = dtype.value_or(at::kBool);
  TORCH_CHECK(out_dtype == at::kBool || at::isFloatingType(out_dtype), kOp,
              ": dtype must be torch.bool or a floating dtype, got ", dtype_name(out_dtype));
  TORCH_CHECK(!use_finfo_min || out_dtype != at::kBool, kOp, ": use_finfo_min needs a floating dtype");

  if (q_positions.has_value()) {
    const at::Tensor& pos = *q_positions;
    TORCH_CHECK(at::isIntegralType(pos.scalar_type(), /*includeBool=*/false), kOp,
                ": q_positions must have an integer dtype, got ", dtype_name(pos.scalar_type()));
    TORCH_CHECK(pos.dim() <= 2, kOp, ": q_positions must be 0-D, [q_length] or [batch_size, q_length], got ", pos.dim(),
                "-D");
    TORCH_CHECK(pos.dim() != 1 || holds(pos.sym_size(0).sym_eq(q_length)), kOp, ": q_positions has ",
                pos.dim() == 1 ? pos.sym_size(0) : c10::SymInt(0), " positions but q_length is ", q_length);
    TORCH_CHECK(
        pos.dim() != 2 || (holds(pos.sym_size(0).sym_eq(batch_size)) && holds(pos.sym_size(1).sym_eq(q_length))), kOp,
        ": q_positions must be [batch_size, q_length] = [", batch_size, ", ", q_length, "], got ", pos.sym_sizes());
    TORCH_CHECK(holds(q_offset.sym_eq(0)), kOp, ": q_offset must be 0 when q_positions is given, got ", q_offset);
  }
  if (chunk_left_padding.has_value()) {
    const at::Tensor& pad = *chunk_left_padding;
    TORCH_CHECK(chunk_size.has_value(), kOp, ": chunk_left_padding needs chunk_size");
    TORCH_CHECK(at::isIntegralType(pad.scalar_type(), /*includeBool=*/false), kOp,
                ": chunk_left_padding must have an integer dtype, got ", dtype_name(pad.scalar_type()));
    TORCH_CHECK(pad.dim() == 1 && holds(pad.sym_size(0).sym_eq(batch_size)), kOp,
                ": chunk_left_padding must be [batch_size] = [", batch_size, "], got ", pad.sym_sizes());
  }
  if (padding_mask.has_value()) {
    const at::Tensor& pad = *padding_mask;
    TORCH_CHECK(pad.scalar_type() == at::kBool || at::isIntegralType(pad.scalar_type(), /*includeBool=*/false), kOp,
                ": padding_mask must be bool or integer, got ", dtype_name(pad.scalar_type()));
    TORCH_CHECK(pad.dim() == 2, kOp, ": padding_mask must be 2-D [batch_size, length], got ", pad.dim(), "-D");
    TORCH_CHECK(holds(pad.sym_size(0).sym_eq(batch_size)), kOp, ": padding_mask has batch ", pad.sym_size(0),
                " but batch_size is ", batch_size);
  }
  check_ids(packed_ids, "packed_ids", batch_size);
  if (packed_ids.has_value()) {
    const c10::SymInt kv_end = kv_offset + kv_length;
    const c10::SymInt needed = q_positions.has_value() ? kv_end : kv_end.max(q_offset + q_length);
    TORCH_CHECK(holds(packed_ids->sym_size(1).sym_ge(needed)), kOp,
                ": packed_ids is too short: ", packed_ids->sym_size(1), " positions, needs ", needed);
  }
  check_ids(block_ids, "block_ids", batch_size);

  return common_device(kOp, device,
                       {{"q_positions", q_positions},
                        {"chunk_left_padding", chunk_left_padding},
                        {"padding_mask", padding_mask},
                        {"packed_ids", packed_ids},
                        {"block_ids", block_ids}});
}

c10::Device check_key_ranges(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                             int64_t kv_offset, std::optional<int64_t> sliding_window,
                             std::optional<int64_t> chunk_size, const std::optional<at::Tensor>& chunk_left_padding,
                             const std::optional<at::Tensor>& packed_ids, std::optional<c10::Device> device) {
  const c10::Device where =
      check_sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, std::nullopt, sliding_window, chunk_size,
                      chunk_left_padding, std::nullopt, packed_ids, std::nullopt, std::nullopt, false, device);
  TORCH_CHECK(kv_length <= std::numeric_limits<int32_t>::max(),
              "key_ranges: kv_length must be < 2**31 (the ranges are int32), got ", kv_length);
  return where;
}

SdpaMaskInputs prepare_sdpa_mask(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                                 int64_t kv_offset, const std::optional<at::Tensor>& q_positions, bool causal,
                                 std::optional<int64_t> sliding_window, std::optional<int64_t> chunk_size,
                                 const std::optional<at::Tensor>& chunk_left_padding,
                                 const std::optional<at::Tensor>& padding_mask,
                                 const std::optional<at::Tensor>& packed_ids,
                                 const std::optional<at::Tensor>& block_ids) {
  SdpaMaskInputs in;
  SdpaMaskParams& p = in.params;
  p.batch_size = batch_size;
  p.q_length = q_length;
  p.kv_length = kv_length;
  p.q_offset = q_offset;
  p.kv_offset = kv_offset;
  p.causal = causal;
  p.sliding_window = sliding_window.value_or(0);
  p.chunk_size = chunk_size.value_or(0);
  // These tensors are [B, L] or smaller: converting them costs nothing next to the mask.
  in.q_positions = as_long(q_positions);
  in.chunk_left_padding = as_long(chunk_left_padding);
  in.packed_ids = as_long(packed_ids);
  in.block_ids = as_long(block_ids);
  if (padding_mask.has_value()) {
    in.padding_mask = padding_mask->to(at::kBool).contiguous();
  }
  if (in.q_positions.defined()) {
    p.q_positions = in.q_positions.data_ptr<int64_t>();
    p.q_positions_rank = static_cast<int>(in.q_positions.dim());
  }
  if (in.chunk_left_padding.defined()) {
    p.chunk_left_padding = in.chunk_left_padding.data_ptr<int64_t>();
  }
  if (in.padding_mask.defined()) {
    p.padding_mask = in.padding_mask.data_ptr<bool>();
    p.padding_width = in.padding_mask.size(1);
  }
  if (in.packed_ids.defined()) {
    p.packed_ids = in.packed_ids.data_ptr<int64_t>();
    p.packed_width = in.packed_ids.size(1);
  }
  if (in.block_ids.defined()) {
    p.block_ids = in.block_ids.data_ptr<int64_t>();
    p.block_width = in.block_ids.size(1);
  }
  return in;
}

namespace {

// sdpa_mask's CPU kernel (sdpa_mask_kernel): the per-ISA fill.
struct CpuMaskBackend {
  c10::Device device;

  explicit CpuMaskBackend(c10::Device where) : device(where) {
    TORCH_CHECK(where.is_cpu(), kOp, ": the CPU kernel was asked to build on ", where.str());
  }
  void fill(const SdpaMaskParams& params, at::Tensor& out, bool use_finfo_min) const {
    sdpa_mask_cpu_stub().pick()(params, out, use_finfo_min);
  }
  // Each position's run of equal packed ids (one pass per batch row), then every row's range.
  void key_ranges(const SdpaMaskParams& p, at::Tensor& out) const {
    std::vector<int64_t> run_begin, run_end;
    if (p.packed_ids != nullptr) {
      const int64_t width = p.packed_width;
      run_begin.resize(p.batch_size * width);
      run_end.resize(p.batch_size * width);
      at::parallel_for(0, p.batch_size, 1, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
          const int64_t* ids = p.packed_ids + b * width;
          int64_t* begin = run_begin.data() + b * width;
          int64_t* end = run_end.data() + b * width;
          for (int64_t t = 0; t < width; ++t) {
            begin[t] = t > 0 && ids[t] == ids[t - 1] ? begin[t - 1] : t;
          }
          for (int64_t t = width - 1; t >= 0; --t) {
            end[t] = t + 1 < width && ids[t + 1] == ids[t] ? end[t + 1] : t + 1;
          }
        }
      });
    }
    int32_t* rows = out.data_ptr<int32_t>();
    at::parallel_for(0, p.batch_size * p.q_length, 4096, [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        key_range_of_row(p, run_begin.data(), run_end.data(), row / p.q_length, row % p.q_length, rows + 2 * row);
      }
    });
  }
};

// safeattn::_sdpa_mask_check: the checks alone, for sdpa_mask's fake (python/safeattn/_fake.py),
// which only adds the output. CompositeImplicitAutograd, so FakeTensorMode runs it on the fake
// tensors themselves (their own devices, symbolic sizes) rather than as a Meta kernel, under which
// every tensor would read as a meta tensor.
void sdpa_mask_check(c10::SymInt batch_size, c10::SymInt q_length, c10::SymInt kv_length, c10::SymInt q_offset,
                     c10::SymInt kv_offset, const std::optional<at::Tensor>& q_positions,
                     std::optional<int64_t> sliding_window, std::optional<int64_t> chunk_size,
                     const std::optional<at::Tensor>& chunk_left_padding, const std::optional<at::Tensor>& padding_mask,
                     const std::optional<at::Tensor>& packed_ids, const std::optional<at::Tensor>& block_ids,
                     std::optional<at::ScalarType> dtype, bool use_finfo_min, std::optional<c10::Device> device) {
  check_sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, q_positions, sliding_window, chunk_size,
                  chunk_left_padding, padding_mask, packed_ids, block_ids, dtype, use_finfo_min, device);
}

// The op may have no tensor argument at all (plain causal mask), so the backend comes from
// `device` (or the tensors) here: BackendSelect runs before any backend kernel.
at::Tensor sdpa_mask_backend_select(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                                    int64_t kv_offset, const std::optional<at::Tensor>& q_positions, bool causal,
                                    std::optional<int64_t> sliding_window, std::optional<int64_t> chunk_size,
                                    const std::optional<at::Tensor>& chunk_left_padding,
                                    const std::optional<at::Tensor>& padding_mask,
                                    const std::optional<at::Tensor>& packed_ids,
                                    const std::optional<at::Tensor>& block_ids, std::optional<at::ScalarType> dtype,
                                    bool use_finfo_min, std::optional<c10::Device> device) {
  const c10::Device where = common_device(kOp, device,
                                          {{"q_positions", q_positions},
                                           {"chunk_left_padding", chunk_left_padding},
                                           {"padding_mask", padding_mask},
                                           {"packed_ids", packed_ids},
                                           {"block_ids", block_ids}});
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("safeattn::sdpa_mask", "")
                       .typed<decltype(sdpa_mask_backend_select)>();
  const c10::DispatchKeySet keys(c10::computeDispatchKey(std::nullopt, std::nullopt, where));
  return op.redispatch(keys, batch_size, q_length, kv_length, q_offset, kv_offset, q_positions, causal, sliding_window,
                       chunk_size, chunk_left_padding, padding_mask, packed_ids, block_ids, dtype, use_finfo_min,
                       device);
}

// _key_ranges may have no tensor argument either (a window alone): its backend as sdpa_mask's.
at::Tensor key_ranges_backend_select(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset,
                                     int64_t kv_offset, bool causal, std::optional<int64_t> sliding_window,
                                     std::optional<int64_t> chunk_size,
                                     const std::optional<at::Tensor>& chunk_left_padding,
                                     const std::optional<at::Tensor>& packed_ids, std::optional<c10::Device> device) {
  const c10::Device where =
      common_device("key_ranges", device, {{"chunk_left_padding", chunk_left_padding}, {"packed_ids", packed_ids}});
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("safeattn::_key_ranges", "")
                       .typed<decltype(key_ranges_backend_select)>();
  const c10::DispatchKeySet keys(c10::computeDispatchKey(std::nullopt, std::nullopt, where));
  return op.redispatch(keys, batch_size, q_length, kv_length, q_offset, kv_offset, causal, sliding_window, chunk_size,
                       chunk_left_padding, packed_ids, device);
}

}  // namespace

at::Tensor sdpa_mask(int64_t batch_size, int64_t q_length, int64_t kv_length, int64_t q_offset, int64_t kv_offset,
                     const std::optional<at::Tensor>& q_positions, bool causal, std::optional<int64_t> sliding_window,
                     std::optional<int64_t> chunk_size, const std::optional<at::Tensor>& chunk_left_padding,
                     const std::optional<at::Tensor>& padding_mask, const std::optional<at::Tensor>& packed_ids,
                     const std::optional<at::Tensor>& block_ids, std::optional<at::ScalarType> dtype,
                     bool use_finfo_min, std::optional<c10::Device> device) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("safeattn::sdpa_mask", "")
          .typed<at::Tensor(c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt,
                            const std::optional<at::Tensor>&, bool, std::optional<int64_t>, std::optional<int64_t>,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            std::optional<at::ScalarType>, bool, std::optional<c10::Device>)>();
  return op.call(batch_size, q_length, kv_length, q_offset, kv_offset, q_positions, causal, sliding_window, chunk_size,
                 chunk_left_padding, padding_mask, packed_ids, block_ids, dtype, use_finfo_min, device);
}

TORCH_LIBRARY_FRAGMENT(safeattn, m) {
  m.def(
      "sdpa_mask(SymInt batch_size, SymInt q_length, SymInt kv_length, SymInt q_offset=0, SymInt kv_offset=0, *, "
      "Tensor? q_positions=None, bool causal=True, int? sliding_window=None, int? chunk_size=None, "
      "Tensor? chunk_left_padding=None, Tensor? padding_mask=None, Tensor? packed_ids=None, "
      "Tensor? block_ids=None, ScalarType? dtype=None, bool use_finfo_min=False, Device? device=None) -> Tensor");
  // Private: sdpa_mask's checks (sdpa_mask_check above), with its arguments but `causal`.
  m.def(
      "_sdpa_mask_check(SymInt batch_size, SymInt q_length, SymInt kv_length, SymInt q_offset=0, SymInt kv_offset=0, "
      "*, Tensor? q_positions=None, int? sliding_window=None, int? chunk_size=None, Tensor? chunk_left_padding=None, "
      "Tensor? padding_mask=None, Tensor? packed_ids=None, Tensor? block_ids=None, ScalarType? dtype=None, "
      "bool use_finfo_min=False, Device? device=None) -> ()");
  // Private: attention's key_ranges of a MaskDescription (sdpa_mask.h, key_range_of_row).
  m.def(
      "_key_ranges(SymInt batch_size, SymInt q_length, SymInt kv_length, SymInt q_offset=0, SymInt kv_offset=0, *, "
      "bool causal=True, int? sliding_window=None, int? chunk_size=None, Tensor? chunk_left_padding=None, "
      "Tensor? packed_ids=None, Device? device=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(safeattn, BackendSelect, m) {
  m.impl("sdpa_mask", &sdpa_mask_backend_select);
  m.impl("_key_ranges", &key_ranges_backend_select);
}

TORCH_LIBRARY_IMPL(safeattn, CPU, m) {
  m.impl("sdpa_mask", &sdpa_mask_kernel<CpuMaskBackend>);
  m.impl("_key_ranges", &key_ranges_kernel<CpuMaskBackend>);
}

TORCH_LIBRARY_IMPL(safeattn, CompositeImplicitAutograd, m) {
  m.impl("_sdpa_mask_check", &sdpa_mask_check);
}

// A mask has no gradient: if an input ever requires grad, autograd raises "not implemented"
// naming safeattn::sdpa_mask instead of silently producing a tensor without history.
TORCH_LIBRARY_IMPL(safeattn, Autograd, m) {
  m.impl("sdpa_mask", torch::autograd::autogradNotImplementedFallback());
  m.impl("_key_ranges", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace safeattn
