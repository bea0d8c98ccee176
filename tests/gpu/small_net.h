// The small model that the Gloo-on-CUDA and the NCCL pipeline tests train:
// 8 -> 16 -> 4 with a ReLU, from a fixed seed (every call builds the same
// weights), and its loss.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

namespace dtrain::testing {

inline torch::nn::Sequential small_net() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
}

inline at::Tensor mse(const at::Tensor& out, const at::Tensor& target) {
  return torch::nn::functional::mse_loss(out, target);
}

}  // namespace dtrain::testing
