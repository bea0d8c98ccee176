// Gloo with CUDA tensors: two processes sharing one GPU (which NCCL refuses),
// the way a one-GPU machine exercises DDP, ZeRO-3 and the pipeline on CUDA.
// scripts/gpu-check.sh runs these (-R GlooCuda) where exactly one GPU is
// visible; they run on more too. Each skips where no GPU is visible.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "gpu.h"
#include "ranks.h"
#include "small_net.h"

using dtrain::testing::mse;
using dtrain::testing::small_net;

namespace {

const c10::Device kGpu(c10::kCUDA, 0);

dtrain::dist::ProcessGroup gloo_on_gpu() {
  return dtrain::dist::init_process_group(dtrain::dist::GroupOptions{
      .backend = dtrain::dist::BackendKind::kGloo, .device = kGpu, .timeout = std::chrono::seconds(60)});
}

void expect_same_parameters(torch::nn::Module& got, torch::nn::Module& want) {
  const auto mine = got.named_parameters();
  const auto theirs = want.named_parameters();
  for (const auto& item : mine) {
    EXPECT_TRUE(at::allclose(item.value().cpu(), theirs[item.key()].cpu(), 1e-5, 1e-6)) << item.key();
  }
}

}  // namespace

TEST(GpuGlooCuda, CollectivesWithCudaTensors) {
  DTRAIN_REQUIRE_GPU();
  dtrain::testing::run_rank_processes(2, [](int rank) {
    auto group = gloo_on_gpu();
    ASSERT_EQ(group.backend(), dtrain::dist::BackendKind::kGloo);
    const auto on_gpu = at::TensorOptions().device(kGpu);
    at::Tensor sum = at::full({1000}, static_cast<float>(rank + 1), on_gpu);
    group.all_reduce(sum).wait();
    EXPECT_TRUE(sum.is_cuda());
    EXPECT_FLOAT_EQ(sum.cpu()[999].item<float>(), 3.0f);
    at::Tensor biggest = at::full({7}, static_cast<float>(rank), on_gpu);
    group.all_reduce(biggest, dtrain::dist::ReduceOp::kMax).wait();
    EXPECT_FLOAT_EQ(biggest.cpu()[0].item<float>(), 1.0f);
    at::Tensor b = rank == 0 ? at::arange(5, on_gpu.dtype(at::kFloat)) : at::zeros({5}, on_gpu);
    group.broadcast(b, 0).wait();
    EXPECT_TRUE(at::equal(b.cpu(), at::arange(5, at::kFloat)));
    at::Tensor gathered = at::empty({2 * 3}, on_gpu);
    group.all_gather_into(gathered, at::full({3}, static_cast<float>(rank), on_gpu)).wait();
    EXPECT_TRUE(at::equal(gathered.cpu(), at::tensor({0.f, 0.f, 0.f, 1.f, 1.f, 1.f})));
    at::Tensor part = at::empty({3}, on_gpu);
    group.reduce_scatter(part, at::arange(6, on_gpu.dtype(at::kFloat))).wait();
    EXPECT_TRUE(at::equal(part.cpu(), at::arange(3 * rank, 3 * rank + 3, at::kFloat) * 2));
    // A pipeline's activation: [micro-batch, sequence, width].
    at::Tensor activation = rank == 0 ? at::randn({2, 5, 8}, on_gpu) : at::empty({2, 5, 8}, on_gpu);
    if (rank == 0) {
      group.send(activation, 1);
    } else {
      group.recv(activation, 0);
      EXPECT_TRUE(activation.is_cuda());
    }
    group.barrier();
  });
}

TEST(GpuGlooCuda, DdpEqualsLocalTraining) {
  DTRAIN_REQUIRE_GPU();
  dtrain::testing::run_rank_processes(2, [](int) {
    auto group = gloo_on_gpu();
    auto reference = small_net(), wrapped = small_net();
    reference->to(kGpu);
    wrapped->to(kGpu);
    dtrain::DistributedDataParallel ddp(wrapped, group);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1), opt(wrapped->parameters(), 0.1);
    const at::Tensor x = at::ones({4, 8}, at::TensorOptions().device(kGpu));  // every rank the same batch
    for (int step = 0; step < 3; ++step) {
      ref_opt.zero_grad();
      reference->forward(x).pow(2).sum().backward();
      ref_opt.step();
      opt.zero_grad();
      ddp(x).pow(2).sum().backward();
      opt.step();
    }
    expect_same_parameters(*wrapped, *reference);
  });
}

TEST(GpuGlooCuda, Zero3EqualsLocalTraining) {
  DTRAIN_REQUIRE_GPU();
  dtrain::testing::run_rank_processes(2, [](int) {
    auto group = gloo_on_gpu();
    auto reference = small_net(), sharded = small_net();
    reference->to(kGpu);
    sharded->to(kGpu);
    dtrain::ShardedDataParallel sdp(sharded, group, {.stage = 3});
    torch::optim::SGD ref_opt(reference->parameters(), 0.1), opt(sdp.parameters(), 0.1);
    const at::Tensor x = at::ones({4, 8}, at::TensorOptions().device(kGpu));
    for (int step = 0; step < 3; ++step) {
      ref_opt.zero_grad();
      reference->forward(x).pow(2).sum().backward();
      ref_opt.step();
      opt.zero_grad();
      sdp(x).pow(2).sum().backward();
      opt.step();
    }
    const auto full = sdp.full_state_dict();
    for (const auto& item : reference->named_parameters()) {
      ASSERT_TRUE(full.count(item.key())) << item.key();
      EXPECT_TRUE(at::allclose(full.at(item.key()).cpu(), item.value().cpu(), 1e-5, 1e-6)) << item.key();
    }
  });
}

TEST(GpuGlooCuda, PipelineEqualsLocalTraining) {
  DTRAIN_REQUIRE_GPU();
  dtrain::testing::run_rank_processes(2, [](int rank) {
    auto group = gloo_on_gpu();
    auto layers = small_net();
    layers->to(kGpu);
    const auto stages = dtrain::pipeline::split_stages(layers, {0, 0, 1});
    dtrain::pipeline::Pipeline pipe({{.module = stages[rank]}}, group,
                                    {.schedule = dtrain::pipeline::ScheduleKind::k1F1B, .micro_batches = 4}, mse);
    torch::optim::SGD opt(pipe.parameters(), 0.1);
    auto reference = small_net();
    reference->to(kGpu);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
      const at::Tensor x = at::randn({8, 8}, gen).to(kGpu), y = at::randn({8, 4}, gen).to(kGpu);
      opt.zero_grad();
      pipe.step(x, y);
      opt.step();
      ref_opt.zero_grad();
      mse(reference->forward(x), y).backward();
      ref_opt.step();
    }
    const auto want = reference->named_parameters();
    for (const auto& item : stages[rank]->named_parameters()) {
      EXPECT_TRUE(at::allclose(item.value().cpu(), want[item.key()].cpu(), 1e-5, 1e-6)) << item.key();
    }
  });
}
