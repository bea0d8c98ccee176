// gtest main for dtrain's test binaries: one intra-op thread per process, so
// that ranks running side by side on a small machine do not fight over cores.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
