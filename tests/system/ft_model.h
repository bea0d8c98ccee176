// The fault-tolerance test's training problem, shared by the worker program
// (tests/system/ft_worker.cpp, one replica group) and the test's reference
// (tests/system/ft_test.cpp): a small MLP, Adam, and the batch every replica
// draws for a step, a function of (step, replica) only.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace dtrain::testing::ft_problem {

constexpr int kBatch = 8;
constexpr int kIn = 16;
constexpr int kHidden = 32;
constexpr int kOut = 4;

inline torch::nn::Sequential make_model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(), torch::nn::Linear(kHidden, kOut));
}

// Over the model's parameters, or over the tensors a strategy steps on
// (ZeRO's shards): the same options either way.
inline torch::optim::Adam make_optimizer(std::vector<torch::Tensor> parameters) {
  return torch::optim::Adam(std::move(parameters), torch::optim::AdamOptions(1e-2));
}
inline torch::optim::Adam make_optimizer(torch::nn::Sequential& model) {
  return make_optimizer(model->parameters());
}

// The samples replica `replica` trains on at `step`: ids step * 1000 +
// replica * kBatch + [0, kBatch), for the audit; features from a generator
// seeded by the step and the replica.
inline std::pair<torch::Tensor, torch::Tensor> batch(std::int64_t step, int replica) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(step * 1000 + replica));
  auto x = at::randn({kBatch, kIn}, gen, at::kFloat);
  auto y = at::randint(0, kOut, {kBatch}, gen, at::kLong);
  return {x, y};
}

inline std::int64_t first_sample(std::int64_t step, int replica) {
  return step * 1000 + replica * kBatch;
}

// Forward and backward of one replica's batch; the gradients in p.grad().
inline void compute_gradients(torch::nn::Sequential& model, std::int64_t step, int replica) {
  auto [x, y] = batch(step, replica);
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  torch::nn::functional::cross_entropy(model->forward(x), y).backward();
}

}  // namespace dtrain::testing::ft_problem
