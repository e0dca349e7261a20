// safeattn::safe_softmax and safeattn::masked_softmax from C++ without Python, and their private
// backward ops through the dispatcher, against the same softmax composed of ATen ops in float64:
// a slice whose every element is masked (or -inf) gives 0 output and 0 gradient.
// c10 defines its own CHECK macro, so Catch2 macros are used with their CATCH_ prefix.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>

#include <limits>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "ops/softmax.h"

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// softmax over `dim` with every slice that is all -inf set to 0 (the safe rule), in ATen ops.
at::Tensor reference_safe_softmax(const at::Tensor& x, int64_t dim) {
  const at::Tensor empty = x.isneginf().all(dim, /*keepdim=*/true);
  return at::where(empty, at::zeros({}, x.options()), at::softmax(x, dim));
}

// The private backward ops, called through the dispatcher as autograd calls them.
at::Tensor safe_softmax_backward(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("safeattn::_safe_softmax_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType)>();
  return op.call(grad_out, out, dim, out.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> masked_softmax_backward(const at::Tensor& grad_out, const at::Tensor& out,
                                                           const at::Tensor& mask, double scale,
                                                           bool mask_requires_grad) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("safeattn::_masked_softmax_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const std::optional<at::Tensor>&, double, int64_t,
                                                                 at::ScalarType, bool)>();
  return op.call(grad_out, out, mask, scale, -1, out.scalar_type(), mask_requires_grad);
}

// x: [2, 3, 5, 7] float64 with query row 1 of batch 0 all -inf, and a -inf element elsewhere.
at::Tensor scores_with_empty_row() {
  at::manual_seed(0);
  at::Tensor x = at::randn({2, 3, 5, 7}, at::TensorOptions().dtype(at::kDouble));
  x.select(0, 0).select(1, 1).fill_(-kInf);
  x.select(0, 1).select(1, 2).select(1, 4).fill_(-kInf);
  return x;
}

}  // namespace

CATCH_TEST_CASE("safe_softmax matches the ATen composition, empty slices 0") {
  const at::Tensor x = scores_with_empty_row();
  for (const int64_t dim : {int64_t{-1}, int64_t{1}}) {
    CATCH_INFO("dim " << dim);
    const at::Tensor out = safeattn::safe_softmax(x, dim);
    CATCH_CHECK(at::allclose(out, reference_safe_softmax(x, dim), 1e-12, 1e-12));
    CATCH_CHECK_FALSE(out.isnan().any().item<bool>());
  }
  const at::Tensor out = safeattn::safe_softmax(x, -1);
  CATCH_CHECK(out.select(0, 0).select(1, 1).eq(0).all().item<bool>());

  // float32 in, float32 out, against the float64 composition.
  const at::Tensor out32 = safeattn::safe_softmax(x.to(at::kFloat), -1);
  CATCH_CHECK(out32.scalar_type() == at::kFloat);
  CATCH_CHECK(at::allclose(out32.to(at::kDouble), reference_safe_softmax(x, -1), 1e-6, 1e-7));
}

CATCH_TEST_CASE("safe_softmax backward matches ATen's softmax backward, empty slices 0") {
  const at::Tensor x = scores_with_empty_row();
  const at::Tensor out = safeattn::safe_softmax(x, -1);
  const at::Tensor grad_out = at::randn_like(out);
  const at::Tensor grad = safe_softmax_backward(grad_out, out, -1);
  const at::Tensor expected = at::_softmax_backward_data(grad_out, out, -1, at::kDouble);
  CATCH_CHECK(at::allclose(grad, expected, 1e-12, 1e-12));
  CATCH_CHECK(grad.select(0, 0).select(1, 1).eq(0).all().item<bool>());
}

CATCH_TEST_CASE("masked_softmax with a bool mask matches the ATen composition") {
  at::manual_seed(1);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor scores = at::randn({2, 3, 5, 7}, f64);
  at::Tensor mask = at::rand({2, 1, 5, 7}, f64) > 0.3;  // broadcast over heads
  mask.select(0, 1).select(1, 3).fill_(false);          // batch 1, query 3: every key masked
  // A NaN at a masked position never reaches the output (a bool mask selects, it does not add).
  scores.masked_fill_(mask.logical_not().expand_as(scores), std::numeric_limits<double>::quiet_NaN());
  const double scale = 0.25;

  const at::Tensor out = safeattn::masked_softmax(scores, mask, scale, -1);
  const at::Tensor masked = at::where(mask, scores * scale, at::full({}, -kInf, f64));
  CATCH_CHECK(at::allclose(out, reference_safe_softmax(masked, -1), 1e-12, 1e-12));
  CATCH_CHECK_FALSE(out.isnan().any().item<bool>());
  CATCH_CHECK(out.select(0, 1).select(1, 3).eq(0).all().item<bool>());
}

CATCH_TEST_CASE("masked_softmax with a float mask and its gradients match the ATen composition") {
  at::manual_seed(2);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor scores = at::randn({2, 3, 5, 7}, f64);
  at::Tensor bias = at::randn({1, 1, 5, 7}, f64);  // broadcast over batch and heads
  bias.select(2, 0).fill_(-kInf);                  // query 0: every key blocked
  const double scale = 0.5;

  const at::Tensor out = safeattn::masked_softmax(scores, bias, scale, -1);
  const at::Tensor expected = reference_safe_softmax(scores * scale + bias, -1);
  CATCH_CHECK(at::allclose(out, expected, 1e-12, 1e-12));
  CATCH_CHECK(out.select(2, 0).eq(0).all().item<bool>());

  const at::Tensor grad_out = at::randn_like(out);
  const auto [grad_scores, grad_bias] = masked_softmax_backward(grad_out, out, bias, scale, true);
  const at::Tensor grad_x = at::_softmax_backward_data(grad_out, out, -1, at::kDouble);
  CATCH_CHECK(at::allclose(grad_scores, grad_x * scale, 1e-12, 1e-12));
  CATCH_CHECK(at::allclose(grad_bias, grad_x.sum({0, 1}, /*keepdim=*/true), 1e-12, 1e-12));
  CATCH_CHECK(grad_scores.select(2, 0).eq(0).all().item<bool>());
  CATCH_CHECK(grad_bias.select(2, 0).eq(0).all().item<bool>());
}
