// CUDA and NCCL paths; every test skips cleanly where no GPU is visible.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "dtrain/comm/device.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "ranks.h"

// GTEST_SKIP returns from the enclosing function, so this must be a macro.
#define DTRAIN_REQUIRE_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible"

TEST(Gpu, InventorySeesDevices) {
  DTRAIN_REQUIRE_GPU();
  const auto inv = dtrain::DeviceInventory::current();
  ASSERT_GT(inv.cuda_count, 0);
  EXPECT_EQ(dtrain::parse_devices("cuda", inv).size(), static_cast<size_t>(inv.cuda_count));
  EXPECT_THROW(dtrain::parse_devices("cuda:" + std::to_string(inv.cuda_count), inv), dtrain::DeviceError);
}

TEST(Gpu, AutoBackendPicksNcclAndReduces) {
  DTRAIN_REQUIRE_GPU();
  // One rank per GPU (NCCL refuses two ranks on one device), as processes.
  const int n = std::min<int>(static_cast<int>(torch::cuda::device_count()), 2);
  dtrain::testing::run_rank_processes(n, [n](int rank) {
    auto group = dtrain::dist::init_process_group(dtrain::dist::GroupOptions{
        .device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank)), .timeout = std::chrono::seconds(60)});
    EXPECT_EQ(group.backend(), dtrain::dist::BackendKind::kNccl);
    at::Tensor t = at::full({1024}, static_cast<float>(rank + 1), at::TensorOptions().device(group.device()));
    group.all_reduce(t).wait();
    EXPECT_FLOAT_EQ(t.cpu()[7].item<float>(), static_cast<float>(n * (n + 1) / 2));
    at::Tensor b = rank == 0 ? at::ones({3}, t.options()) : at::zeros({3}, t.options());
    group.broadcast(b, 0).wait();
    EXPECT_FLOAT_EQ(b.sum().item<float>(), 3.0f);
    group.barrier();
  });
}
