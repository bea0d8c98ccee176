// DataParallel and model parallelism on CUDA devices, against the same model
// on the CPU; skips where no GPU is visible. With one GPU, DataParallel mixes
// cuda:0 and cpu replicas, and the model-parallel split spans cpu and cuda:0,
// so activations and gradients really cross devices.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "dtrain/comm/device.h"
#include "dtrain/parallel/data_parallel/data_parallel.h"
#include "dtrain/parallel/model_parallel/model_parallel.h"
#include "gpu.h"

namespace {

struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(10, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(at::Tensor x) { return fc2(at::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

std::vector<at::Tensor> train(const std::function<at::Tensor(const at::Tensor&)>& forward, torch::nn::Module& module,
                              c10::Device output_device) {
  torch::optim::SGD opt(module.parameters(), 0.1);
  for (int t = 0; t < 3; ++t) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(t);
    const at::Tensor x = at::randn({11, 10}, gen), y = at::randn({11, 4}, gen);
    opt.zero_grad();
    torch::nn::functional::mse_loss(forward(x), y.to(output_device)).backward();
    opt.step();
  }
  std::vector<at::Tensor> out;
  for (auto& p : module.parameters()) out.push_back(p.detach().cpu());
  return out;
}

void expect_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::allclose(a[i], b[i], 1e-4, 1e-5)) << "parameter " << i;
}

TEST(GpuDataParallel, EqualsCpuTraining) {
  DTRAIN_REQUIRE_GPU();
  torch::manual_seed(1);
  Net reference;
  const c10::Device cpu(c10::kCPU);
  const auto want = train([&](const at::Tensor& x) { return reference(x); }, *reference, cpu);

  auto devices = dtrain::parse_devices("cuda");
  if (devices.size() == 1) devices.push_back(cpu);  // one GPU: a GPU replica and a CPU replica
  torch::manual_seed(1);
  Net net;
  dtrain::DataParallel dp(net, {.devices = devices});
  const auto got = train([&](const at::Tensor& x) { return dp(x); }, *net, devices.front());
  expect_close(got, want);
}

TEST(GpuModelParallel, SplitAcrossCpuAndGpuEqualsUnplaced) {
  DTRAIN_REQUIRE_GPU();
  auto make = [] {
    torch::manual_seed(2);
    return torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
  };
  auto plain = make();
  const c10::Device cpu(c10::kCPU), gpu(c10::kCUDA, 0);
  const auto want = train([&](const at::Tensor& x) { return plain->forward(x); }, *plain, cpu);
  dtrain::ModelParallel split(make(), std::vector<c10::Device>{cpu, gpu, gpu});
  EXPECT_EQ(split->output_device(), gpu);
  const auto got = train([&](const at::Tensor& x) { return split(x); }, *split, gpu);
  expect_close(got, want);
}

}  // namespace
