// The mask kernel from C++ without Python: hand-checked rows, every compiled ISA variant
// equal, and the dispatcher entry point.
// c10 defines its own CHECK macro, so Catch2 macros are used with their CATCH_ prefix.
#define CATCH_CONFIG_MAIN
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "common/isa_dispatch.h"
#include "ops/sdpa_mask.h"

using safeattn::cpu::Isa;

namespace {

// Rows of a [1, 1, Q, KV] bool mask as strings of '1' and '0'.
std::vector<std::string> rows(const at::Tensor& mask) {
  const at::Tensor m = mask.to(at::kBool).contiguous();
  std::vector<std::string> out;
  const auto* data = m.data_ptr<bool>();
  const int64_t q = m.size(2), kv = m.size(3);
  for (int64_t i = 0; i < q; ++i) {
    std::string row;
    for (int64_t j = 0; j < kv; ++j) {
      row += data[i * kv + j] ? '1' : '0';
    }
    out.push_back(row);
  }
  return out;
}

}  // namespace

CATCH_TEST_CASE("causal mask, hand-checked") {
  const at::Tensor m = safeattn::sdpa_mask(1, 4, 4);
  CATCH_CHECK(rows(m) == std::vector<std::string>{"1000", "1100", "1110", "1111"});
}

CATCH_TEST_CASE("decode row with kv offset and sliding window") {
  // Query at position 9, keys at positions 4..11, window 3: keys 7, 8, 9 attend.
  const at::Tensor m = safeattn::sdpa_mask(1, 1, 8, /*q_offset=*/9, /*kv_offset=*/4, std::nullopt, true, 3);
  CATCH_CHECK(rows(m) == std::vector<std::string>{"00011100"});
}

CATCH_TEST_CASE("chunked with left padding and a padding mask") {
  // Left padding 1, chunk 2: chunks are positions {1,2}, {3,4}; key 0 is padding.
  const at::Tensor pad = at::tensor(std::vector<int64_t>{0, 1, 1, 1, 1}).to(at::kBool).reshape({1, 5});
  const at::Tensor left = at::tensor(std::vector<int64_t>{1});
  const at::Tensor m = safeattn::sdpa_mask(1, 5, 5, 0, 0, std::nullopt, true, std::nullopt, 2, left, pad);
  CATCH_CHECK(rows(m) == std::vector<std::string>{"00000", "01000", "01100", "00010", "00011"});
}

CATCH_TEST_CASE("packed sequences and bidirectional blocks") {
  const at::Tensor ids = at::tensor(std::vector<int64_t>{0, 0, 1, 1, 1}).reshape({1, 5});
  const at::Tensor packed = safeattn::sdpa_mask(1, 5, 5, 0, 0, std::nullopt, true, std::nullopt, std::nullopt,
                                                std::nullopt, std::nullopt, ids);
  CATCH_CHECK(rows(packed) == std::vector<std::string>{"10000", "11000", "00100", "00110", "00111"});
  const at::Tensor blocks = at::tensor(std::vector<int64_t>{-1, 0, 0, -1, -1}).reshape({1, 5});
  const at::Tensor image = safeattn::sdpa_mask(1, 5, 5, 0, 0, std::nullopt, true, std::nullopt, std::nullopt,
                                               std::nullopt, std::nullopt, std::nullopt, blocks);
  CATCH_CHECK(rows(image) == std::vector<std::string>{"10000", "11100", "11100", "11110", "11111"});
}

CATCH_TEST_CASE("float output holds 0 and -inf, or finfo.min") {
  const at::Tensor m = safeattn::sdpa_mask(1, 2, 2, 0, 0, std::nullopt, true, std::nullopt, std::nullopt, std::nullopt,
                                           std::nullopt, std::nullopt, std::nullopt, at::kFloat);
  CATCH_CHECK(m[0][0][0][0].item<float>() == 0.0f);
  CATCH_CHECK(std::isinf(m[0][0][0][1].item<float>()));
  const at::Tensor e = safeattn::sdpa_mask(1, 2, 2, 0, 0, std::nullopt, true, std::nullopt, std::nullopt, std::nullopt,
                                           std::nullopt, std::nullopt, std::nullopt, at::kHalf, true);
  CATCH_CHECK(e[0][0][0][1].item<float>() == -65504.0f);
}

CATCH_TEST_CASE("bad input names the argument") {
  CATCH_CHECK_THROWS_WITH(safeattn::sdpa_mask(1, 2, 2, 0, 0, std::nullopt, true, 0),
                          Catch::Contains("sliding_window must be > 0"));
  const at::Tensor pad = at::ones({3, 2}, at::kBool);
  CATCH_CHECK_THROWS_WITH(
      safeattn::sdpa_mask(2, 2, 2, 0, 0, std::nullopt, true, std::nullopt, std::nullopt, std::nullopt, pad),
      Catch::Contains("padding_mask has batch 3 but batch_size is 2"));
}

CATCH_TEST_CASE("every compiled ISA variant gives the same mask") {
  at::manual_seed(0);
  const int64_t batch = 3, q = 97, kv = 300;
  const at::Tensor pad = at::rand({batch, kv}) > 0.2;
  const at::Tensor ids = std::get<0>(at::sort(at::randint(0, 3, {batch, kv}, at::kLong), -1));
  const at::Tensor blocks = ids - 1;
  const at::Tensor left = (pad.cumsum(-1) == 0).sum(-1);

  struct Case {
    std::optional<int64_t> window, chunk;
    bool causal;
    std::optional<at::Tensor> padding, packed, block;
    at::ScalarType dtype;
  };
  const std::vector<Case> cases = {
      {50, std::nullopt, true, pad, std::nullopt, std::nullopt, at::kBool},
      {std::nullopt, 16, true, std::nullopt, ids, std::nullopt, at::kBFloat16},
      {7, std::nullopt, false, pad, std::nullopt, blocks, at::kFloat},
      {std::nullopt, std::nullopt, true, pad, ids, blocks, at::kHalf},
  };
  int variants = 0;
  for (const Case& c : cases) {
    safeattn::SdpaMaskInputs in = safeattn::prepare_sdpa_mask(
        batch, q, kv, 203, 0, std::nullopt, c.causal, c.window, c.chunk,
        c.chunk.has_value() ? std::optional<at::Tensor>(left) : std::nullopt, c.padding, c.packed, c.block);
    at::Tensor first;
    for (Isa isa : {Isa::DEFAULT, Isa::AVX2, Isa::AVX512}) {
      auto fn = safeattn::sdpa_mask_cpu_stub().get(isa);
      if (fn == nullptr || !safeattn::cpu::cpu_runs(isa)) {  // SIGILL otherwise
        continue;
      }
      at::Tensor out = at::empty({batch, 1, q, kv}, at::TensorOptions().dtype(c.dtype));
      fn(in.params, out, false);
      ++variants;
      if (!first.defined()) {
        first = out;
        // The DEFAULT variant must also agree with the dispatcher path.
        CATCH_CHECK(
            at::equal(out, safeattn::sdpa_mask(batch, q, kv, 203, 0, std::nullopt, c.causal, c.window, c.chunk,
                                               c.chunk.has_value() ? std::optional<at::Tensor>(left) : std::nullopt,
                                               c.padding, c.packed, c.block, c.dtype)));
      } else {
        CATCH_INFO("ISA variant " << safeattn::cpu::isa_name(isa));
        CATCH_CHECK(at::equal(out, first));
      }
    }
  }
  CATCH_CHECK(variants >= static_cast<int>(cases.size()));
}
