// gtest main for dtrain's test binaries: one intra-op thread per process, so
// that ranks running side by side on a small machine do not fight over cores.
#include <ATen/Parallel.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  // MKL's vector math sets itself up at its first call, not thread-safely
  // (Note [Vector math warm-up], src/comm/process_group.cpp, which makes the
  // first calls as a world forms): tests whose threads compute before any
  // group exists need exp's, the one their merges take, made here.
  static_cast<void>(at::exp(at::zeros({16})));
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
