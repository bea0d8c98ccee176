// DataParallel's engine: replicas made once, gradients routed back to the
// primary inside the autograd graph, lazy replica sync, scatter/gather.
//
// Note [Replica gradients]
// Each replica parameter is given a gradient edge (set_history) to a small
// node that moves its gradient to the primary's device and feeds it to the
// primary parameter's AccumulateGrad. The autograd engine then sums the
// contributions of every replica into the primary's .grad itself, in the same
// backward call, thread-safely, and on CUDA each device's part of backward
// runs on that device's autograd thread. LibTorch's data_parallel uses the
// same edges but rebuilds them, and clones the whole module, on every call;
// here they are built once, because a replica parameter keeps its edge.
#include "dtrain/parallel/data_parallel.h"

#include <ATen/ops/cat.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <string>

#include "dtrain/comm/device.h"
#include "dtrain/error.h"
#include "replica_threads.h"

namespace dtrain::detail {
namespace {

// See Note [Replica gradients].
struct ReplicaGradToPrimary : torch::autograd::Node {
  explicit ReplicaGradToPrimary(c10::Device primary_device) : primary_device_(primary_device) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    return {grads[0].to(primary_device_)};
  }
  std::string name() const override { return "dtrain::ReplicaGradToPrimary"; }

 private:
  c10::Device primary_device_;
};

// A primary tensor and its counterparts on the replicas. Unshared ones are
// copied before every forward, as torch's DataParallel broadcasts: version
// counters would miss changes made through .data() and BatchNorm's in-place
// statistics updates, and a stale replica would silently train wrong.
struct Mirrored {
  at::Tensor primary;
  std::vector<at::Tensor> replicas;  // [0] is the primary itself
  std::vector<bool> shares_storage;  // replica aliases the primary's storage

  void copy_to(std::size_t i) {
    if (!shares_storage[i]) replicas[i].copy_(primary);
  }
};

std::shared_ptr<torch::nn::Module> clone_to(const torch::nn::Module& module, c10::Device device) {
  try {
    return module.clone(device);
  } catch (const c10::Error& e) {
    throw ConfigError("DataParallel cannot replicate module '" + module.name() + "': " + e.what_without_backtrace(),
                      "derive the module from torch::nn::Cloneable<Impl> and build its submodules in reset()");
  }
}

}  // namespace

struct DataParallelEngine::State {
  std::vector<c10::Device> devices;
  c10::Device output_device{c10::kCPU};
  std::int64_t dim = 0;
  std::vector<std::shared_ptr<torch::nn::Module>> replicas;  // [0] = primary
  std::vector<std::vector<std::shared_ptr<torch::nn::Module>>> submodules;  // per replica, preorder
  std::vector<Mirrored> params;
  std::vector<Mirrored> buffers;
  std::unique_ptr<ReplicaThreads> threads;
};

DataParallelEngine::DataParallelEngine(std::shared_ptr<torch::nn::Module> primary, DataParallelOptions options)
    : state_(std::make_unique<State>()) {
  auto& s = *state_;
  DTRAIN_CHECK(primary != nullptr, ConfigError, "DataParallel got an empty module.", "pass a constructed module");
  s.devices = options.devices.empty() ? parse_devices("all") : options.devices;
  check_devices(s.devices);
  s.output_device = options.output_device.value_or(s.devices.front());
  check_devices({s.output_device});
  s.dim = options.dim;
  const auto k = s.devices.size();

  primary->to(s.devices.front());
  s.replicas.push_back(primary);
  for (std::size_t i = 1; i < k; ++i) s.replicas.push_back(clone_to(*primary, s.devices[i]));
  for (const auto& r : s.replicas) s.submodules.push_back(r->modules(/*include_self=*/true));

  torch::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> replica_params, replica_buffers;
  for (const auto& r : s.replicas) {
    replica_params.push_back(r->parameters());
    replica_buffers.push_back(r->buffers());
  }
  auto mirror = [&](const std::vector<std::vector<at::Tensor>>& per_replica, std::size_t j, bool share) {
    Mirrored m;
    m.primary = per_replica[0][j];
    for (std::size_t i = 0; i < k; ++i) {
      m.replicas.push_back(per_replica[i][j]);
      const bool same_device = i > 0 && s.devices[i] == s.devices[0];
      if (share && same_device) m.replicas[i].set_(m.primary);  // no copy ever needed
      m.shares_storage.push_back(i == 0 || (share && same_device));
    }
    return m;
  };
  for (std::size_t j = 0; j < replica_params[0].size(); ++j) {
    Mirrored m = mirror(replica_params, j, options.share_parameters);
    if (m.primary.requires_grad()) {
      for (std::size_t i = 1; i < k; ++i) {
        auto node = c10::make_intrusive<ReplicaGradToPrimary>(s.devices.front());
        node->set_next_edges(torch::autograd::collect_next_edges(m.primary));
        torch::autograd::set_history(m.replicas[i], node);
      }
    }
    s.params.push_back(std::move(m));
  }
  // Buffers are copied, never shared: replicas update them concurrently in training.
  for (std::size_t j = 0; j < replica_buffers[0].size(); ++j) s.buffers.push_back(mirror(replica_buffers, j, false));
  if (k > 1) s.threads = std::make_unique<ReplicaThreads>(k - 1);
}

DataParallelEngine::~DataParallelEngine() = default;

const std::shared_ptr<torch::nn::Module>& DataParallelEngine::replica(std::size_t i) const {
  return state_->replicas.at(i);
}
std::size_t DataParallelEngine::replica_count() const { return state_->replicas.size(); }
const std::vector<c10::Device>& DataParallelEngine::devices() const { return state_->devices; }
c10::Device DataParallelEngine::output_device() const { return state_->output_device; }

at::Tensor DataParallelEngine::forward(const at::Tensor& input,
                                       const std::function<at::Tensor(std::size_t, const at::Tensor&)>& apply) {
  auto& s = *state_;
  DTRAIN_CHECK(input.defined() && input.dim() > 0, ConfigError,
               "DataParallel needs a batched input tensor, got " << (input.defined() ? "a scalar" : "an undefined tensor")
                                                                 << ".",
               "pass a tensor whose dimension " << s.dim << " is the batch");
  const std::int64_t dim = s.dim < 0 ? s.dim + input.dim() : s.dim;
  DTRAIN_CHECK(dim >= 0 && dim < input.dim(), ConfigError,
               "DataParallel's batch dimension " << s.dim << " does not exist in an input of shape " << input.sizes()
                                                 << ".",
               "set DataParallelOptions::dim");
  const std::int64_t n = input.size(dim);
  DTRAIN_CHECK(n > 0, ConfigError, "DataParallel got an empty batch (shape " << input.sizes() << ").",
               "skip empty batches");

  // Even split: sizes differ by at most one; a batch smaller than the replica
  // count runs on the first n replicas only.
  const std::size_t used = std::min<std::size_t>(s.replicas.size(), static_cast<std::size_t>(n));
  std::vector<std::int64_t> offsets(used), sizes(used);
  for (std::size_t i = 0, off = 0; i < used; ++i) {
    sizes[i] = n / static_cast<std::int64_t>(used) + (static_cast<std::int64_t>(i) < n % static_cast<std::int64_t>(used));
    offsets[i] = static_cast<std::int64_t>(off);
    off += static_cast<std::size_t>(sizes[i]);
  }

  if (used > 1) {
    // Mirror training flags (preorder, since train() recurses into children).
    const auto& primary_mods = s.submodules[0];
    for (std::size_t i = 1; i < used; ++i) {
      for (std::size_t j = 0; j < primary_mods.size(); ++j) {
        const bool training = primary_mods[j]->is_training();
        if (s.submodules[i][j]->is_training() != training) s.submodules[i][j]->train(training);
      }
    }
    // Buffers first, on this thread: the primary's forward updates them in place.
    torch::NoGradGuard no_grad;
    for (auto& b : s.buffers) {
      for (std::size_t i = 1; i < used; ++i) b.copy_to(i);
    }
  }

  std::vector<at::Tensor> outputs(used);
  auto task = [&](std::size_t i) {
    const c10::Device device = s.devices[i];
    c10::OptionalDeviceGuard guard;
    if (!device.is_cpu()) guard.reset_device(device);
    if (i > 0) {
      // Parameters are only read by the other replicas' forwards: safe to copy concurrently.
      torch::NoGradGuard no_grad;
      for (auto& p : s.params) p.copy_to(i);
    }
    at::Tensor chunk = used == 1 ? input : input.narrow(dim, offsets[i], sizes[i]);
    try {
      outputs[i] = apply(i, chunk.to(device)).to(s.output_device);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error("DataParallel replica " + std::to_string(i) + " on " + device.str() + " failed: " + e.what());
    }
  };
  if (used == 1) {
    task(0);
    return outputs[0];
  }
  s.threads->run(used, task);
  return at::cat(outputs, dim);
}

}  // namespace dtrain::detail
