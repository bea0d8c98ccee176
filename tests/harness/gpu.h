// Skipping a gpu-labelled test where the CUDA devices it needs are not
// visible, with the reason in the skip message (scripts/gpu-check.sh and
// ctest show it). Every test in tests/gpu/ starts with one of these.
#pragma once

#include <gtest/gtest.h>
#include <torch/cuda.h>

namespace dtrain::testing {

// CUDA devices this process sees: 0 without a driver, without a CUDA
// LibTorch, or with CUDA_VISIBLE_DEVICES empty.
inline int visible_gpus() {
  return static_cast<int>(torch::cuda::device_count());
}

}  // namespace dtrain::testing

// Skips the calling test unless at least `n` CUDA devices are visible; more
// reason can be streamed after it: DTRAIN_REQUIRE_GPUS(2) << " (why)".
// A macro because GTEST_SKIP returns from the enclosing function; the
// if/else shape keeps a caller's `else` from binding to it.
#define DTRAIN_REQUIRE_GPUS(n)                    \
  if (::dtrain::testing::visible_gpus() >= (n)) { \
  } else                                          \
    GTEST_SKIP() << "needs " << (n) << " CUDA device(s), " << ::dtrain::testing::visible_gpus() << " visible"

#define DTRAIN_REQUIRE_GPU() DTRAIN_REQUIRE_GPUS(1)
