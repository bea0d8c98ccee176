// The hybrid: DistributedDataParallel over a model-parallel module (each rank
// holds one model split over its own devices, here several CPU "devices")
// equals single-process training of the unsplit model on the concatenated batch.
#include <gtest/gtest.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddp_helpers.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/parallel/model_parallel/model_parallel.h"
#include "ranks.h"

using namespace dtrain::testing;

namespace {
constexpr int kHybridSteps = 4;
constexpr int kHybridBatch = 5;

torch::nn::Sequential make_layers(int seed) {
  return seeded(seed, [] {
    return torch::nn::Sequential(torch::nn::Linear(10, 24), torch::nn::Tanh(), torch::nn::Linear(24, 24),
                                 torch::nn::ReLU(), torch::nn::Linear(24, 4));
  });
}

std::vector<at::Tensor> reference(int world) {
  auto model = make_layers(1);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
  for (int t = 0; t < kHybridSteps; ++t) {
    const Batch all = global_batch(world, t, kHybridBatch);
    opt.zero_grad();
    loss_of(model->forward(all.x), all.y).backward();
    opt.step();
  }
  return snapshot(*model);
}

class HybridSweep : public ::testing::TestWithParam<int> {};

TEST_P(HybridSweep, DdpOverModelParallelEqualsSingleProcess) {
  const int world = GetParam();
  const auto expected = reference(world);
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(30)});
    // Each rank splits its model over three devices, planned by memory.
    const c10::Device cpu(c10::kCPU);
    dtrain::ModelParallel split(make_layers(rank == 0 ? 1 : 40 + rank),
                                dtrain::ModelParallelOptions{.devices = {cpu, cpu, cpu}});
    ASSERT_EQ(split->placement()->device_of_layer, (std::vector<std::size_t>{0, 0, 1, 1, 2}));
    dtrain::DistributedDataParallel ddp(split, group);
    torch::optim::SGD opt(ddp.module()->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
    for (int t = 0; t < kHybridSteps; ++t) {
      const Batch b = batch_for(rank, t, kHybridBatch);
      opt.zero_grad();
      const at::Tensor out = ddp(b.x);
      loss_of(out, b.y.to(split->output_device())).backward();
      opt.step();
    }
    EXPECT_TRUE(params_close(snapshot(*split), expected)) << "rank " << rank;
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, HybridSweep, ::testing::Values(1, 2, 3));

}  // namespace
