// A small CNN for 28x28 grey images: two 3x3 conv blocks and two linear layers
// (about 0.23 M parameters). Simple CNNs like it reach about 90-91% on
// Fashion-MNIST's test set.
//
// Two forms of the same network: SmallCnn, a module (Cloneable, so
// DataParallel can replicate it), and small_cnn_layers(), a Sequential for
// model parallelism (layers placed on devices). With the same seed both start
// from the same weights.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

struct SmallCnnImpl : torch::nn::Cloneable<SmallCnnImpl> {
  SmallCnnImpl();
  void reset() override;
  torch::Tensor forward(torch::Tensor x);

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(SmallCnn);

// `dropout`: before the last layer (SmallCnn's 0.25 by default).
torch::nn::Sequential small_cnn_layers(double dropout = 0.25);
