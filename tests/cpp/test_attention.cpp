// safeattn::attention from C++ without Python: the dispatcher entry point differentiates (its
// Autograd kernel is C++), against the same attention composed of ATen ops in float64, and a
// query row that sees no key gives 0 output and 0 gradient.
// c10 defines its own CHECK macro, so Catch2 macros are used with their CATCH_ prefix.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <utility>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "ops/attention.h"
#include "ops/attention_composite.h"

namespace {

// softmax(q k^T / sqrt(D), masked) v with ATen's own safe softmax (a row with no visible key
// gives 0), q: [B, H, Q, D], mask: [Q, KV] bool (True attends) or a float bias broadcastable to
// the scores.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor masked = mask.scalar_type() == at::kBool
                                ? scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity())
                                : scores + mask;
  return at::matmul(at::_safe_softmax(masked, -1), v);
}

// A backend that sums a broadcast mask's gradient itself (AttentionBwdSumsBroadcastFn): the
// composite kernel run per batch row, each row's per-head gradient summed over the heads when the
// mask has one (Hm = 1) and added into the buffer's row b (or its one row, Bm = 1) of the mask's
// shape [Bm, Hm, Q, KV]. takes_sums_broadcast says yes when sums_broadcast_allowed;
// sums_broadcast_calls counts the calls that got the buffer.
bool sums_broadcast_allowed = false;
int sums_broadcast_calls = 0;

bool takes_sums_broadcast(const safeattn::AttentionBwdArgs& /*args*/) {
  return sums_broadcast_allowed;
}

void backward_summing_broadcast(const safeattn::AttentionBwdArgs& args) {
  if (args.grad_mask_write != safeattn::GradMaskWrite::kSumBroadcast) {
    safeattn::attention_backward_chunked(args);
    return;
  }
  ++sums_broadcast_calls;
  const at::Tensor& sum = args.grad_mask_partial;
  const int64_t batch = args.query.size(0), hq = args.query.size(1);
  CATCH_REQUIRE((sum.size(0) == 1 || sum.size(0) == batch));
  CATCH_REQUIRE((sum.size(1) == 1 || sum.size(1) == hq));
  CATCH_REQUIRE((sum.size(0) < batch || sum.size(1) < hq));  // something is broadcast
  CATCH_REQUIRE(sum.eq(0).all().item<bool>());               // zeroed by the caller
  for (int64_t b = 0; b < args.query.size(0); ++b) {
    auto row = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, b, 1) : t; };
    safeattn::AttentionBwdArgs one = args;
    for (at::Tensor* t : {&one.grad_out, &one.grad_lse, &one.query, &one.key, &one.value, &one.out, &one.lse,
                          &one.lse_lo, &one.mask, &one.key_ranges, &one.grad_query, &one.grad_key, &one.grad_value}) {
      *t = row(*t);
    }
    one.grad_mask_write = safeattn::GradMaskWrite::kAssign;
    one.grad_mask_partial = at::empty({1, hq, sum.size(2), sum.size(3)}, sum.options());
    safeattn::attention_backward_chunked(one);
    const at::Tensor& per_head = one.grad_mask_partial;
    sum.narrow(0, sum.size(0) == 1 ? 0 : b, 1).add_(sum.size(1) == 1 ? per_head.sum(1, /*keepdim=*/true) : per_head);
  }
}

}  // namespace

CATCH_TEST_CASE("attention differentiates from C++, fully masked row 0") {
  at::manual_seed(0);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::randn({1, 2, 5, 8}, f64).requires_grad_();
  const at::Tensor k = at::randn({1, 2, 7, 8}, f64).requires_grad_();
  const at::Tensor v = at::randn({1, 2, 7, 8}, f64).requires_grad_();
  at::Tensor mask = at::rand({5, 7}, f64) > 0.3;
  mask.select(0, 2).fill_(false);  // query 2 sees no key
  const at::Tensor weight = at::randn({1, 2, 5, 8}, f64);

  const auto [out, lse] = safeattn::attention(q, k, v, mask);
  CATCH_REQUIRE(out.requires_grad());
  const torch::autograd::variable_list grads = torch::autograd::grad({(out * weight).sum()}, {q, k, v});
  const at::Tensor expected = reference_attention(q, k, v, mask);
  const torch::autograd::variable_list expected_grads = torch::autograd::grad({(expected * weight).sum()}, {q, k, v});

  CATCH_CHECK(at::allclose(out, expected, 1e-10, 1e-10));
  for (size_t i = 0; i < grads.size(); ++i) {
    CATCH_INFO("gradient " << i << " (query, key, value)");
    CATCH_CHECK(at::allclose(grads[i], expected_grads[i], 1e-10, 1e-10));
  }
  CATCH_CHECK(out.select(2, 2).eq(0).all().item<bool>());
  CATCH_CHECK(grads[0].select(2, 2).eq(0).all().item<bool>());
  CATCH_CHECK(lse.select(2, 2).eq(-std::numeric_limits<double>::infinity()).all().item<bool>());
}

CATCH_TEST_CASE("attention without a gradient builds no graph") {
  const at::Tensor q = at::randn({1, 1, 3, 4});
  const auto [out, lse] = safeattn::attention(q, q, q);
  CATCH_CHECK_FALSE(out.requires_grad());
  CATCH_CHECK_FALSE(lse.requires_grad());
}

CATCH_TEST_CASE("a broadcast mask gets its gradient in batch chunks, or summed by the backend") {
  // 4 GiB of partial sums per chunk by default; one or two batch rows per chunk here. Each result
  // against the float64 reference (the bias's gradient summed over its broadcast dims), through
  // the composite backward (the chunking is the backend-independent attention_backward_impl's).
  // A backend that says it sums the broadcast dims itself gets one zeroed buffer of the bias's
  // shape instead ([1, H], [1, 1] or [B, 1] x [Q, KV]), in one call, whatever the budget; a
  // [B, H, Q, KV] bias broadcasts nothing and is never offered it.
  CATCH_CHECK(safeattn::mask_grad_batch_chunk(4, int64_t{1} << 30, safeattn::kMaskGradBudgetBytes) == 4);
  CATCH_CHECK(safeattn::mask_grad_batch_chunk(8, int64_t{8} << 30, safeattn::kMaskGradBudgetBytes) == 1);
  CATCH_CHECK(safeattn::mask_grad_batch_chunk(5, 3, 10) == 3);
  CATCH_CHECK(safeattn::mask_grad_batch_chunk(0, 3, 10) == 1);
  at::manual_seed(2);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::randn({5, 2, 6, 8}, f64).requires_grad_();
  const at::Tensor k = at::randn({5, 2, 9, 8}, f64).requires_grad_();
  const at::Tensor v = at::randn({5, 2, 9, 8}, f64).requires_grad_();
  const at::Tensor grad_out = at::randn({5, 2, 6, 8}, f64);
  for (const auto& [bias_batch, heads] : {std::pair<int64_t, int64_t>{1, 2}, {1, 1}, {5, 1}, {5, 2}}) {
    const bool broadcast = bias_batch == 1 || heads == 1;
    at::Tensor bias = at::randn({bias_batch, heads, 6, 9}, f64);
    bias.select(2, 1).select(2, 4).fill_(-std::numeric_limits<double>::infinity());  // masked keys
    bias.requires_grad_();
    const at::Tensor expected = reference_attention(q, k, v, bias);
    const torch::autograd::variable_list want = torch::autograd::grad({(expected * grad_out).sum()}, {q, k, v, bias});
    const auto [out, lse] = safeattn::attention(q.detach(), k.detach(), v.detach(), bias.detach());
    const int64_t row_bytes = heads * 6 * 9 * 8;
    for (const bool sums : {false, true}) {
      for (const int64_t budget : {safeattn::kMaskGradBudgetBytes, row_bytes, 2 * row_bytes}) {
        CATCH_INFO("bias [" << bias_batch << ", " << heads << ", 6, 9], partial-sum budget " << budget
                            << " bytes, backend sums: " << sums);
        sums_broadcast_allowed = sums;
        sums_broadcast_calls = 0;
        const auto got = safeattn::attention_backward_impl(
            grad_out, std::nullopt, q.detach(), k.detach(), v.detach(), out, lse, bias.detach(), false, std::nullopt, 0,
            0, 0.0, std::nullopt, /*grad_mask_needed=*/true, std::nullopt, std::nullopt, &backward_summing_broadcast,
            budget, &takes_sums_broadcast);
        CATCH_CHECK(sums_broadcast_calls == (sums && broadcast ? 1 : 0));
        CATCH_CHECK(at::allclose(std::get<0>(got), want[0], 1e-10, 1e-10));
        CATCH_CHECK(at::allclose(std::get<1>(got), want[1], 1e-10, 1e-10));
        CATCH_CHECK(at::allclose(std::get<2>(got), want[2], 1e-10, 1e-10));
        CATCH_REQUIRE(std::get<3>(got).sizes() == bias.sizes());
        CATCH_CHECK(at::allclose(std::get<3>(got), want[3], 1e-10, 1e-10));
      }
    }
  }
}
