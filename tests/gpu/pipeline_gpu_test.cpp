// Pipeline parallelism over NCCL: two stage processes on two GPUs (NCCL
// refuses two ranks on one device); skips where fewer than two are visible.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "gpu.h"
#include "ranks.h"
#include "small_net.h"

using dtrain::testing::mse;
using dtrain::testing::small_net;

// Every schedule on p = 2 (interleaved: the three layers over 2 x 2 stages
// would need four; it runs GPipe, 1F1B and ZB), 4 micro-batches, three SGD
// steps: the stages' weights equal training the whole model on one GPU.
TEST(GpuPipeline, StagesOverNcclEqualOneDevice) {
  DTRAIN_REQUIRE_GPUS(2) << " (NCCL refuses two ranks on one GPU)";
  using dtrain::pipeline::ScheduleKind;
  for (const ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZeroBubble}) {
    dtrain::testing::run_rank_processes(2, [kind](int rank) {
      const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
      auto group = dtrain::dist::init_process_group(
          dtrain::dist::GroupOptions{.device = device, .timeout = std::chrono::seconds(60)});
      ASSERT_EQ(group.backend(), dtrain::dist::BackendKind::kNccl);
      auto layers = small_net();
      layers->to(device);
      const auto stages = dtrain::pipeline::split_stages(layers, {0, 0, 1});
      dtrain::pipeline::Pipeline pipe({{.module = stages[rank]}}, group, {.schedule = kind, .micro_batches = 4}, mse);
      torch::optim::SGD opt(pipe.parameters(), 0.1);
      auto reference = small_net();
      reference->to(device);
      torch::optim::SGD ref_opt(reference->parameters(), 0.1);
      for (int step = 0; step < 3; ++step) {
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
        const at::Tensor x = at::randn({8, 8}, gen).to(device), y = at::randn({8, 4}, gen).to(device);
        opt.zero_grad();
        pipe.step(x, y);
        opt.step();
        ref_opt.zero_grad();
        mse(reference->forward(x), y).backward();
        ref_opt.step();
      }
      const auto mine = stages[rank]->named_parameters();
      const auto want = reference->named_parameters();
      for (const auto& item : mine) {
        EXPECT_TRUE(at::allclose(item.value(), want[item.key()], 1e-5, 1e-6))
            << to_string(kind) << " rank " << rank << " " << item.key();
      }
    });
  }
}
