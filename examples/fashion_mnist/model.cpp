#include "model.h"

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

namespace F = torch::nn::functional;

SmallCnnImpl::SmallCnnImpl() {
  reset();
}

void SmallCnnImpl::reset() {
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
  fc1 = register_module("fc1", torch::nn::Linear(64 * 7 * 7, 64));
  fc2 = register_module("fc2", torch::nn::Linear(64, 10));
  dropout = register_module("dropout", torch::nn::Dropout(0.25));
}

torch::Tensor SmallCnnImpl::forward(torch::Tensor x) {
  x = F::max_pool2d(F::relu(conv1(x)), F::MaxPool2dFuncOptions(2));  // 32 x 14 x 14
  x = F::max_pool2d(F::relu(conv2(x)), F::MaxPool2dFuncOptions(2));  // 64 x 7 x 7
  x = dropout(F::relu(fc1(x.flatten(1))));
  return fc2(x);
}

torch::nn::Sequential small_cnn_layers(double dropout) {
  // Parameters are created in SmallCnn's order, so one seed gives both forms the same weights.
  return torch::nn::Sequential({{"conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1))},
                                {"relu1", torch::nn::ReLU()},
                                {"pool1", torch::nn::MaxPool2d(2)},
                                {"conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1))},
                                {"relu2", torch::nn::ReLU()},
                                {"pool2", torch::nn::MaxPool2d(2)},
                                {"flatten", torch::nn::Flatten()},
                                {"fc1", torch::nn::Linear(64 * 7 * 7, 64)},
                                {"relu3", torch::nn::ReLU()},
                                {"dropout", torch::nn::Dropout(dropout)},
                                {"fc2", torch::nn::Linear(64, 10)}});
}
