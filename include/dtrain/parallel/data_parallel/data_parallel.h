// DataParallel: one process drives several devices.
//
// The module is replicated once, at construction (not per call, as LibTorch's
// torch::nn::parallel::data_parallel does). Each forward scatters the batch
// along `dim` (uneven splits allowed: sizes differ by at most one; a batch
// smaller than the replica count uses only the first replicas), runs the
// replicas concurrently on persistent threads, and gathers the outputs on the
// output device. Backward sums every replica's parameter gradients into the
// wrapped module's (the primary replica's) gradients inside the autograd graph,
// so the optimizer is built on `dp->parameters()` and used as usual:
//
//   dtrain::DataParallel dp(model, {.devices = dtrain::parse_devices("cuda:0,cuda:1")});
//   torch::optim::SGD opt(dp->parameters(), 0.1);
//   for (...) { opt.zero_grad(); loss_fn(dp(x), y).backward(); opt.step(); }
//
// Contracts (see docs/data_parallel.md):
// - The primary replica is the wrapped module itself, moved to devices[0];
//   do not move or re-create its parameters afterwards.
// - Replicas are brought back in sync with the primary before every forward
//   (so after each optimizer step, load or manual change). Replicas on the
//   primary's device share its parameter storage and need no copy at all;
//   others get the parameters copied, as torch's DataParallel broadcasts them.
// - Buffers (BatchNorm statistics) behave as in PyTorch's DataParallel: in
//   training each replica normalises with its own chunk's statistics; the
//   running statistics are updated from the first chunk only (the primary's),
//   and the other replicas' updates are overwritten from the primary.
// - Training mode, grad mode and autocast of the caller apply to every replica.
// - The module must be Cloneable (torch::nn::Cloneable<Impl>), and its forward
//   take and return one Tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtrain {

struct DataParallelOptions {
  // Replica devices; the first holds the primary replica. Empty: every visible
  // CUDA device, or one CPU device when there is none. On CPU, repeat "cpu"
  // for several replicas (parse_devices("cpu,cpu")), one thread each.
  std::vector<c10::Device> devices;
  // Where outputs are gathered; default devices[0].
  std::optional<c10::Device> output_device;
  // The batch dimension of inputs and outputs.
  std::int64_t dim = 0;
  // Replicas on the primary's device alias its parameters (no copy, no extra
  // memory). false gives them their own copies, synced like replicas on
  // other devices (tests use it to exercise that path on CPU).
  bool share_parameters = true;
};

namespace detail {

// The untyped machinery behind DataParallel<M>.
class DataParallelEngine {
 public:
  DataParallelEngine(const std::shared_ptr<torch::nn::Module>& primary, const DataParallelOptions& options);
  ~DataParallelEngine();
  DataParallelEngine(const DataParallelEngine&) = delete;
  DataParallelEngine& operator=(const DataParallelEngine&) = delete;

  // Replica i (0 is the primary module).
  const std::shared_ptr<torch::nn::Module>& replica(std::size_t i) const;
  std::size_t replica_count() const;
  const std::vector<c10::Device>& devices() const;
  c10::Device output_device() const;

  // Scatter, sync, apply(i, chunk on device i) concurrently, gather.
  at::Tensor forward(const at::Tensor& input, const std::function<at::Tensor(std::size_t, const at::Tensor&)>& apply);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

template <typename T>
struct ModuleImplOf {
  using type = typename T::ContainedType;  // a TORCH_MODULE holder
};
template <typename T>
struct ModuleImplOf<std::shared_ptr<T>> {
  using type = T;
};

}  // namespace detail

// `ModuleHolder` is a LibTorch module holder (what TORCH_MODULE declares) or a
// std::shared_ptr to a module; its forward takes and returns one Tensor.
template <typename ModuleHolder>
class DataParallel {
  using Impl = typename detail::ModuleImplOf<ModuleHolder>::type;

 public:
  explicit DataParallel(ModuleHolder module, DataParallelOptions options = {}) : module_(std::move(module)) {
    std::shared_ptr<torch::nn::Module> primary;
    if constexpr (requires { module_.ptr(); }) {
      primary = module_.ptr();
    } else {
      primary = module_;
    }
    engine_ = std::make_unique<detail::DataParallelEngine>(std::move(primary), std::move(options));
    for (std::size_t i = 0; i < engine_->replica_count(); ++i) {
      replicas_.push_back(std::dynamic_pointer_cast<Impl>(engine_->replica(i)));
    }
  }

  at::Tensor forward(const at::Tensor& input) {
    return engine_->forward(input,
                            [this](std::size_t i, const at::Tensor& chunk) { return replicas_[i]->forward(chunk); });
  }
  at::Tensor operator()(const at::Tensor& input) { return forward(input); }

  // The primary replica: the wrapped module (its parameters get the gradients).
  ModuleHolder& module() { return module_; }
  Impl* operator->() { return replicas_.front().get(); }
  const std::vector<c10::Device>& devices() const { return engine_->devices(); }
  // Replica i (0 is the primary); for inspection in tests and tools.
  const std::shared_ptr<Impl>& replica(std::size_t i) const { return replicas_.at(i); }

 private:
  ModuleHolder module_;
  std::unique_ptr<detail::DataParallelEngine> engine_;
  std::vector<std::shared_ptr<Impl>> replicas_;
};

}  // namespace dtrain
