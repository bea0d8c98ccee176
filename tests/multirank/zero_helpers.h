// Shared pieces of the ZeRO tests: a model with awkward sizes, a frozen
// parameter and a parameter shared by two layers; deterministic global
// batches; the reference comparison.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

namespace dtrain::testing::zero {

// x -> tanh(x W^T + b) * scale + s, with `scale` frozen and `s` shared with Out.
struct MidImpl : torch::nn::Module {
  MidImpl() {
    w = register_parameter("w", at::randn({7, 7}) * 0.3);
    b = register_parameter("b", at::randn({7}) * 0.1);
    scale = register_parameter("scale", at::rand({7}) + 0.5, /*requires_grad=*/false);
    s = register_parameter("s", at::randn({7}) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(at::linear(x, w, b)) * scale + s; }
  at::Tensor w, b, scale, s;
};
TORCH_MODULE(Mid);

// x -> fc(x + s), `s` being Mid's.
struct OutImpl : torch::nn::Module {
  explicit OutImpl(const at::Tensor& shared) {
    fc = register_module("fc", torch::nn::Linear(7, 3));
    s = register_parameter("s", shared);
  }
  at::Tensor forward(const at::Tensor& x) { return fc(x + s); }
  torch::nn::Linear fc{nullptr};
  at::Tensor s;
};
TORCH_MODULE(Out);

template <typename F>
auto seeded(std::uint64_t seed, F&& make) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(seed);
  return make();
}

// Units of 35, 63 (7 of them frozen) and 24 parameters, and the shared 7 in the root.
inline torch::nn::Sequential make_model() {
  return seeded(42, [] {
    torch::nn::Sequential seq;
    seq->push_back("in", torch::nn::Linear(torch::nn::LinearOptions(5, 7).bias(false)));
    Mid mid;
    seq->push_back("mid", mid);
    seq->push_back("out", Out(mid->s));
    return seq;
  });
}

// Linear layers of the given widths, tanh between them.
inline torch::nn::Sequential seeded_sequential(const std::vector<std::int64_t>& widths) {
  return seeded(7, [&] {
    torch::nn::Sequential seq;
    for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
      seq->push_back("fc" + std::to_string(i), torch::nn::Linear(widths[i], widths[i + 1]));
    }
    return seq;
  });
}

struct Batch {
  at::Tensor x, y;
  Batch slice(std::int64_t first, std::int64_t n) const { return {x.narrow(0, first, n), y.narrow(0, first, n)}; }
};

inline Batch global_batch(int step, std::int64_t n, std::int64_t in = 5, std::int64_t out = 3) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randn({n, in}, gen), at::randn({n, out}, gen)};
}

inline at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) {
  return (out - y).pow(2).mean();
}

enum class OptimizerKind { kSgd, kAdamW };
inline std::string to_string(OptimizerKind k) {
  return k == OptimizerKind::kSgd ? "sgd" : "adamw";
}

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(OptimizerKind kind, std::vector<at::Tensor> params) {
  if (kind == OptimizerKind::kSgd) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  }
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

// Trainable parameters, each once.
inline std::vector<at::Tensor> trainable(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& p : m.parameters()) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

inline std::map<std::string, at::Tensor> named(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().to(at::kFloat).clone();
  return out;
}

// Every parameter of `actual` equals the reference's of that name (fp32, rtol 1e-5).
inline void expect_equal_parameters(const std::map<std::string, at::Tensor>& actual, torch::nn::Module& reference,
                                    double rtol = 1e-5, double atol = 1e-6) {
  const auto expected = named(reference);
  EXPECT_FALSE(actual.empty());
  for (const auto& [name, value] : actual) {
    auto it = expected.find(name);
    ASSERT_NE(it, expected.end()) << name;
    EXPECT_TRUE(at::allclose(value, it->second, rtol, atol))
        << name << ": max difference " << (value - it->second).abs().max().item<double>();
  }
}

}  // namespace dtrain::testing::zero
