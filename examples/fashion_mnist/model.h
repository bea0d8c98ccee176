// A small CNN for 28x28 grey images: two 3x3 conv blocks and two linear layers
// (about 0.23 M parameters). Simple CNNs like it reach about 90-91% on
// Fashion-MNIST's test set.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

struct SmallCnnImpl : torch::nn::Module {
  SmallCnnImpl();
  torch::Tensor forward(torch::Tensor x);

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(SmallCnn);
