// Comparing a computed tensor with a reference, for tests of splits (tensor,
// sequence and context parallelism) that sum in another order than the
// unsplit computation.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

namespace dtrain::testing {

// Shapes equal and allclose(actual, expected, rtol, atol * max(1, max
// |expected|)): atol scales with the tensor, since an element near zero of a
// gradient whose others are ~70 differs by ~1e-6 when summed in another order.
// Compared in fp64; `what` names the tensor in the failure.
inline void expect_all_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
                             double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_TRUE(actual.defined()) << what << ": undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const at::Tensor a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  const double scale = std::max(1.0, e.abs().max().item<double>());
  EXPECT_TRUE(at::allclose(a, e, rtol, atol * scale))
      << what << ": max |difference| " << (a - e).abs().max().item<double>() << " (max |expected| "
      << e.abs().max().item<double>() << ")";
}

}  // namespace dtrain::testing
