// safeattn::attention from C++ without Python: the dispatcher entry point differentiates (its
// Autograd kernel is C++), against the same attention composed of ATen ops in float64, and a
// query row that sees no key gives 0 output and 0 gradient.
// c10 defines its own CHECK macro, so Catch2 macros are used with their CATCH_ prefix.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "ops/attention.h"

namespace {

// softmax(q k^T / sqrt(D), masked) v with ATen's own safe softmax (a row with no visible key
// gives 0), q: [B, H, Q, D], mask: [Q, KV] bool (True attends).
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor masked = scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::_safe_softmax(masked, -1), v);
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
