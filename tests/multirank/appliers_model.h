// The small models the appliers' tests train, with odd widths (ZeRO's units
// are padded and its shards uneven): four layers (one per stage under the
// interleaved schedule), and the same with a tied weight: the last layer
// reads the first layer's weight, as a language model's head reads its
// token embedding. Shared by pipeline_appliers_test.cpp and
// parallelize_test.cpp; no example code.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

namespace appliers_model {

constexpr std::int64_t kIn = 7, kClasses = 5;

// Linear then tanh, as one layer (a Sequential cannot hold a Sequential).
struct AppliersTanhLinearImpl : torch::nn::Module {
  AppliersTanhLinearImpl(std::int64_t in, std::int64_t out)
      : linear(register_module("linear", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(linear->forward(x)); }
  torch::nn::Linear linear;
};
TORCH_MODULE(AppliersTanhLinear);

inline torch::nn::Sequential appliers_net() {
  torch::manual_seed(2311);
  torch::nn::Sequential net;
  net->push_back("0", AppliersTanhLinear(kIn, 13));
  net->push_back("1", AppliersTanhLinear(13, 9));
  net->push_back("2", AppliersTanhLinear(9, 11));
  net->push_back("3", torch::nn::Linear(11, kClasses));
  return net;
}

// Logits over kIn classes: x [B, 13] times the first layer's weight [13, kIn]
// (not a submodule: the tie), plus a bias of its own.
struct AppliersTiedHeadImpl : torch::nn::Module {
  explicit AppliersTiedHeadImpl(torch::nn::Linear first) : tied(std::move(first)) {
    bias = register_parameter("bias", at::randn({kIn}) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, tied->weight.to(x.device())) + bias; }
  torch::nn::Linear tied;
  at::Tensor bias;
};
TORCH_MODULE(AppliersTiedHead);

// kIn classes; layer 3's weight is layer 0's.
inline torch::nn::Sequential tied_appliers_net() {
  torch::manual_seed(2312);
  torch::nn::Sequential net;
  AppliersTanhLinear first(kIn, 13);
  net->push_back("0", first);
  net->push_back("1", AppliersTanhLinear(13, 9));
  net->push_back("2", AppliersTanhLinear(9, 13));
  net->push_back("3", AppliersTiedHead(first->linear));
  return net;
}

}  // namespace appliers_model
