// CUDA and NCCL paths; every test skips cleanly where no GPU is visible.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm/device.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "gpu.h"
#include "ranks.h"

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
  const int n = std::min(dtrain::testing::visible_gpus(), 2);
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

TEST(Gpu, DdpOverNcclEqualsLocalTraining) {
  DTRAIN_REQUIRE_GPU();
  // One rank per GPU over NCCL; with every rank fed the same batch, DDP's
  // averaged gradient equals the local one, so the result equals plain training.
  const int n = std::min(dtrain::testing::visible_gpus(), 2);
  dtrain::testing::run_rank_processes(n, [](int rank) {
    const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
    auto group = dtrain::dist::init_process_group(
        dtrain::dist::GroupOptions{.device = device, .timeout = std::chrono::seconds(60)});
    torch::manual_seed(0);
    torch::nn::Linear reference(8, 3), wrapped(8, 3);
    reference->to(device);
    wrapped->to(device);
    {
      torch::NoGradGuard no_grad;
      wrapped->weight.copy_(reference->weight);
      wrapped->bias.copy_(reference->bias);
    }
    dtrain::DistributedDataParallel ddp(wrapped, group);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1), opt(wrapped->parameters(), 0.1);
    const at::Tensor x = at::ones({4, 8}, at::TensorOptions().device(device));
    for (int step = 0; step < 3; ++step) {
      ref_opt.zero_grad();
      reference->forward(x).pow(2).sum().backward();
      ref_opt.step();
      opt.zero_grad();
      ddp(x).pow(2).sum().backward();
      opt.step();
    }
    EXPECT_TRUE(at::allclose(reference->weight, wrapped->weight, 1e-5, 1e-6));
  });
}
