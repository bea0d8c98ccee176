// A program linked with LibTorch's CPU part and the dtrain_torch_cuda_on_demand
// object (as the examples are) loads LibTorch's CUDA part only where the CUDA
// driver sees a device, and, where it loads it, gets CUDA from LibTorch as a
// program linked with all of it does: the CUDA kernels registered and the
// real CUDA hooks (not the stub LibTorch keeps for good once asked without
// them). This binary is such a program; the last test runs it again with
// DTRAIN_TORCH_CUDA=load, which loads the CUDA part without a device.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <torch/utils.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "../system/example_run.h"
#include "dtrain/comm/device.h"
#include "dtrain/comm/torch_cuda.h"
#include "proc_maps.h"

namespace {
bool cuda_kernels_registered() {
  const auto add = c10::Dispatcher::singleton().findOp({"aten::add", "Tensor"});
  return add.has_value() && add->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}
}  // namespace

TEST(TorchCudaOnDemand, LoadedOnlyWhereTheDriverSeesADevice) {
  const char* ask = std::getenv("DTRAIN_TORCH_CUDA");
  if (ask != nullptr) GTEST_SKIP() << "DTRAIN_TORCH_CUDA is set";
  const bool visible = dtrain::DeviceInventory::current().cuda_count > 0;
  EXPECT_EQ(dtrain::testing::process_maps_contain("libtorch_cuda"), visible);
  EXPECT_EQ(dtrain::load_torch_cuda(), visible);
  if (!visible) {
    EXPECT_FALSE(cuda_kernels_registered());
    // What a CPU run of the examples does first: seeding asks for the CUDA
    // hooks; without the CUDA part it gets the stub and goes on.
    torch::manual_seed(1);
    EXPECT_FALSE(at::detail::getCUDAHooks().hasCUDA());
  }
}

// Runs in the child only: the CUDA part loaded before main() (here without a
// device), and LibTorch then has CUDA as with all of it linked.
TEST(TorchCudaOnDemand, ForcedLoadGivesLibTorchItsCudaPart) {
  const char* ask = std::getenv("DTRAIN_TORCH_CUDA");
  if (ask == nullptr) GTEST_SKIP() << "runs as a child of LoadedWhenAskedFor";
  ASSERT_TRUE(dtrain::testing::process_maps_contain("libtorch_cuda"));
  EXPECT_TRUE(dtrain::load_torch_cuda());
  EXPECT_TRUE(cuda_kernels_registered());
  torch::manual_seed(1);  // the first hooks query: the real ones, with or without a device
  EXPECT_GT(at::detail::getCUDAHooks().versionCUDART(), 0);
}

TEST(TorchCudaOnDemand, LoadedWhenAskedFor) {
#if !DTRAIN_TEST_TORCH_HAS_CUDA
  GTEST_SKIP() << "this LibTorch has no CUDA part";
#endif
  if (std::getenv("DTRAIN_TORCH_CUDA") != nullptr) GTEST_SKIP() << "the child";
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const auto child = dtrain::testing::run_example(
      self, "--gtest_filter=TorchCudaOnDemand.ForcedLoadGivesLibTorchItsCudaPart", "DTRAIN_TORCH_CUDA=load");
  EXPECT_EQ(child.exit_code, 0) << child.stdout_text << child.stderr_text;
  EXPECT_NE(child.stdout_text.find("[  PASSED  ] 1 test"), std::string::npos) << child.stdout_text << child.stderr_text;
}
