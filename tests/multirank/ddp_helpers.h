// Shared pieces of the DDP tests: a small model, deterministic per-rank data,
// and a single-process reference trainer.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <functional>
#include <mutex>
#include <vector>

namespace dtrain::testing {

// 10 -> hidden -> 4 MLP, optionally with an extra head used only on request
// (for unused-parameter tests) and a BatchNorm (for buffer tests).
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int hidden = 16, bool with_extra = false, bool with_norm = false) {
    fc1 = register_module("fc1", torch::nn::Linear(10, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 4));
    if (with_extra) extra = register_module("extra", torch::nn::Linear(hidden, 4));
    if (with_norm) norm = register_module("norm", torch::nn::BatchNorm1d(hidden));
  }
  at::Tensor forward(at::Tensor x, bool use_extra = false) {
    at::Tensor h = fc1(x);
    if (norm) h = norm(h);
    h = at::tanh(h);
    at::Tensor out = fc2(h);
    if (use_extra) out = out + extra(h);
    return out;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, extra{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Mlp);

// Builds a module from a fixed seed. LibTorch's default generator is global,
// so rank threads building models at once would interleave its draws: a lock
// keeps each construction deterministic.
template <typename F>
auto seeded(std::uint64_t seed, F&& make) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(seed);
  return make();
}

struct Batch {
  at::Tensor x;
  at::Tensor y;
};

// Rank r's batch for step t: the same on every call.
inline Batch batch_for(int rank, int step, int size) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank + 17);
  return {at::randn({size, 10}, gen), at::randint(0, 4, {size}, gen, at::kLong)};
}

inline Batch concat(const std::vector<Batch>& parts) {
  std::vector<at::Tensor> xs, ys;
  for (const auto& b : parts) {
    xs.push_back(b.x);
    ys.push_back(b.y);
  }
  return {at::cat(xs), at::cat(ys)};
}

// Every rank's batch of step t, concatenated: what one process trains on in the references.
inline Batch global_batch(int world, int step, int size) {
  std::vector<Batch> parts;
  for (int r = 0; r < world; ++r) parts.push_back(batch_for(r, step, size));
  return concat(parts);
}

inline at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits, y);
}

inline std::vector<at::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

// Relative closeness of two parameter lists.
inline ::testing::AssertionResult params_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                                               double rtol = 1e-5, double atol = 1e-6) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "different counts";
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::allclose(a[i], b[i], rtol, atol)) {
      return ::testing::AssertionFailure()
             << "parameter " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace dtrain::testing
