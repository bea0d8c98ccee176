// DataParallel's engine: replicas made once, scatter, concurrent forward and
// backward on replica threads, gather, gradients summed into the primary.
//
// Note [Replica backward]
// Forward cuts the graph between the replicas and the gathered output: each
// replica's output is kept aside, and the gathered output gets one node,
// ReplicaBackward, whose next edges are the input's gradient edge and the
// primary parameters' AccumulateGrad. When backward reaches it, it splits the
// incoming gradient and runs every replica's part of backward concurrently,
// each on that replica's thread (torch::autograd::grad with respect to the
// replica's parameters and its input chunk), then sums the parameter gradients
// in replica order and returns them along those edges. So:
// - on CPU, backward runs on k threads (the autograd engine would run all CPU
//   work on the one thread that called backward: only forward would be
//   parallel, which measured 1.2x instead of ~2x on two cores);
// - the sum is deterministic (fixed order, not the order threads finish);
// - gradients reach the primary's .grad through AccumulateGrad, so hooks on it
//   (DistributedDataParallel's Reducer) work as for any module.
// LibTorch's data_parallel instead gives every replica parameter a ReduceAdd
// edge to the primary, rebuilt with a fresh clone of the module on every call;
// its Scatter/Gather accept only CUDA tensors.
#include "dtrain/parallel/data_parallel/data_parallel.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <string>

#include "../../core/torch_compat.h"
#include "dtrain/comm/device.h"
#include "dtrain/error.h"
#include "replica_threads.h"

namespace dtrain::detail {
namespace {

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

std::string replica_failure(std::size_t i, c10::Device device, const char* what) {
  return "DataParallel replica " + std::to_string(i) + " on " + device.str() + " failed: " + what;
}

// Runs f on replica i's device, naming the replica in errors that are not dtrain's own.
template <typename F>
void on_replica(std::size_t i, c10::Device device, F&& f) {
  c10::OptionalDeviceGuard guard;
  if (!device.is_cpu()) guard.reset_device(device);
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(replica_failure(i, device, e.what()));
  }
}

// One forward's slice of work: what backward needs to run every replica's part.
struct Split {
  std::size_t used = 0;
  std::int64_t dim = 0;
  std::vector<std::int64_t> offsets, sizes;
};

// See Note [Replica backward].
struct ReplicaBackward : torch::autograd::Node {
  std::shared_ptr<ReplicaThreads> threads;
  Split split;
  std::vector<c10::Device> devices;
  c10::Device input_device{c10::kCPU};
  c10::Device primary_device{c10::kCPU};
  std::vector<at::Tensor> outputs;                  // per used replica, on its device
  std::vector<at::Tensor> chunks;                   // per used replica; defined when the input needs a gradient
  std::vector<std::vector<at::Tensor>> parameters;  // per used replica: those whose gradient is returned
  bool keep_graph = true;
  bool all_cpu = false;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    DTRAIN_CHECK(!torch::autograd::GradMode::is_enabled(), ConfigError,
                 "DataParallel does not support higher-order gradients (backward with create_graph).",
                 "compute them on the module itself, without DataParallel");
    const std::size_t n_params = parameters.front().size();
    std::vector<torch::autograd::variable_list> per_replica(split.used);
    if (grads[0].defined()) {
      threads->run(split.used, [&](std::size_t i) {
        if (!outputs[i].requires_grad()) return;
        on_replica(i, devices[i], [&] {
          torch::autograd::variable_list wrt = parameters[i];
          if (chunks[i].defined()) wrt.push_back(chunks[i]);
          const at::Tensor g = grads[0].narrow(split.dim, split.offsets[i], split.sizes[i]).to(outputs[i].device());
          per_replica[i] = torch::autograd::grad({outputs[i]}, wrt, {g}, keep_graph, /*create_graph=*/false,
                                                 /*allow_unused=*/true);
        });
      });
    }
    torch::autograd::variable_list result(1 + n_params);
    if (all_cpu) {
      sum_on_replica_threads(per_replica, result);
    } else {
      for (std::size_t j = 0; j < n_params; ++j) {
        for (std::size_t i = 0; i < split.used; ++i) {
          if (per_replica[i].empty() || !per_replica[i][j].defined()) continue;
          at::Tensor g = per_replica[i][j].to(primary_device);
          result[1 + j] = result[1 + j].defined() ? result[1 + j] + g : g;
        }
      }
    }
    if (!chunks.front().defined()) return result;
    std::vector<at::Tensor> input_grads;
    for (std::size_t i = 0; i < split.used; ++i) {
      const bool have = !per_replica[i].empty() && per_replica[i].back().defined();
      input_grads.push_back(have ? per_replica[i].back().to(input_device)
                                 : at::zeros(chunks[i].sizes(), chunks[i].options().device(input_device)));
    }
    result[0] = split.used == 1 ? input_grads[0] : at::cat(input_grads, split.dim);
    return result;
  }
  // Sums the replicas' gradients of each parameter into result[1 + j], in
  // replica order, with every replica thread summing a slice of each large
  // parameter (the sum is memory-bound: done by one thread it took a fifth of
  // a 2-replica MLP step). Accumulates in place into replica 0's gradient
  // when nothing else can see it.
  void sum_on_replica_threads(std::vector<torch::autograd::variable_list>& per_replica,
                              torch::autograd::variable_list& result) {
    constexpr std::int64_t kSliceMin = 1 << 15;  // elements; smaller parameters are summed whole
    const std::size_t n_params = parameters.front().size();
    std::vector<std::vector<at::Tensor>> parts(n_params);
    for (std::size_t j = 0; j < n_params; ++j) {
      for (std::size_t i = 0; i < split.used; ++i) {
        if (!per_replica[i].empty() && per_replica[i][j].defined()) parts[j].push_back(per_replica[i][j]);
      }
      if (parts[j].empty()) continue;
      at::Tensor& first = parts[j].front();
      const bool private_to_us =
          first.is_contiguous() && first.use_count() == 1 && first.storage().use_count() == 1 && parts[j].size() > 1;
      result[1 + j] = parts[j].size() == 1 ? first : (private_to_us ? first : at::empty_like(first));
    }
    const auto slices = static_cast<std::int64_t>(split.used);
    threads->run(split.used, [&](std::size_t t) {
      const auto ti = static_cast<std::int64_t>(t);
      for (std::size_t j = 0; j < n_params; ++j) {
        if (parts[j].size() < 2) continue;
        const std::int64_t numel = result[1 + j].numel();
        std::int64_t begin = 0, end = numel;
        if (numel >= kSliceMin) {
          begin = numel * ti / slices;
          end = numel * (ti + 1) / slices;
        } else if (j % split.used != t) {
          continue;
        }
        at::Tensor out = result[1 + j].view(-1).narrow(0, begin, end - begin);
        auto slice = [&](const at::Tensor& g) { return g.reshape(-1).narrow(0, begin, end - begin); };
        at::add_out(out, slice(parts[j][0]), slice(parts[j][1]));
        for (std::size_t i = 2; i < parts[j].size(); ++i) out.add_(slice(parts[j][i]));
      }
    });
  }
  void will_release_variables() override { keep_graph = false; }
  void release_variables() override {
    outputs.clear();
    chunks.clear();
  }
  std::string name() const override { return "dtrain::DataParallelBackward"; }
};

}  // namespace

struct DataParallelEngine::State {
  std::vector<c10::Device> devices;
  c10::Device output_device{c10::kCPU};
  std::int64_t dim = 0;
  std::vector<std::shared_ptr<torch::nn::Module>> replicas;                 // [0] = primary
  std::vector<std::vector<std::shared_ptr<torch::nn::Module>>> submodules;  // per replica, preorder
  std::vector<Mirrored> params;
  std::vector<Mirrored> buffers;
  std::shared_ptr<ReplicaThreads> threads;
};

DataParallelEngine::DataParallelEngine(const std::shared_ptr<torch::nn::Module>& primary,
                                       const DataParallelOptions& options)
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
  std::vector<std::vector<at::Tensor>> replica_params, replica_buffers;
  for (const auto& r : s.replicas) {
    replica_params.push_back(r->parameters());
    replica_buffers.push_back(r->buffers());
  }
  for (std::size_t j = 0; j < replica_params[0].size(); ++j) {
    s.params.push_back(mirror(replica_params, j, options.share_parameters));
  }
  // Buffers are copied, never shared: replicas update them concurrently in training.
  for (std::size_t j = 0; j < replica_buffers[0].size(); ++j) s.buffers.push_back(mirror(replica_buffers, j, false));
  if (k > 1) s.threads = std::make_shared<ReplicaThreads>(k - 1);
}

DataParallelEngine::~DataParallelEngine() = default;

const std::shared_ptr<torch::nn::Module>& DataParallelEngine::replica(std::size_t i) const {
  return state_->replicas.at(i);
}
std::size_t DataParallelEngine::replica_count() const {
  return state_->replicas.size();
}
const std::vector<c10::Device>& DataParallelEngine::devices() const {
  return state_->devices;
}
c10::Device DataParallelEngine::output_device() const {
  return state_->output_device;
}

at::Tensor DataParallelEngine::forward(const at::Tensor& input,
                                       const std::function<at::Tensor(std::size_t, const at::Tensor&)>& apply) {
  auto& s = *state_;
  DTRAIN_CHECK(input.defined() && input.dim() > 0, ConfigError,
               "DataParallel needs a batched input tensor, got "
                   << (input.defined() ? "a scalar" : "an undefined tensor") << ".",
               "pass a tensor whose dimension " << s.dim << " is the batch");
  const std::int64_t dim = s.dim < 0 ? s.dim + input.dim() : s.dim;
  DTRAIN_CHECK(
      dim >= 0 && dim < input.dim(), ConfigError,
      "DataParallel's batch dimension " << s.dim << " does not exist in an input of shape " << input.sizes() << ".",
      "set DataParallelOptions::dim");
  const std::int64_t n = input.size(dim);
  DTRAIN_CHECK(n > 0, ConfigError, "DataParallel got an empty batch (shape " << input.sizes() << ").",
               "skip empty batches");

  if (s.replicas.size() == 1) {
    at::Tensor out;
    on_replica(0, s.devices[0], [&] { out = apply(0, input.to(s.devices[0])).to(s.output_device); });
    return out;
  }

  // Even split: sizes differ by at most one; a batch smaller than the replica
  // count runs on the first n replicas only.
  Split split;
  split.dim = dim;
  split.used = std::min<std::size_t>(s.replicas.size(), static_cast<std::size_t>(n));
  const auto used_count = static_cast<std::int64_t>(split.used);
  for (std::int64_t i = 0, off = 0; i < used_count; ++i) {
    split.sizes.push_back(n / used_count + (i < n % used_count ? 1 : 0));
    split.offsets.push_back(off);
    off += split.sizes.back();
  }

  // Mirror training flags (preorder, since train() recurses into children),
  // requires_grad flags, and buffers, on this thread: the primary's forward
  // updates its buffers in place.
  const auto& primary_mods = s.submodules[0];
  for (std::size_t i = 1; i < split.used; ++i) {
    for (std::size_t j = 0; j < primary_mods.size(); ++j) {
      const bool training = primary_mods[j]->is_training();
      if (s.submodules[i][j]->is_training() != training) s.submodules[i][j]->train(training);
    }
    for (auto& p : s.params) {
      if (p.replicas[i].requires_grad() != p.primary.requires_grad())
        p.replicas[i].requires_grad_(p.primary.requires_grad());
    }
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& b : s.buffers) {
      for (std::size_t i = 1; i < split.used; ++i) b.copy_to(i);
    }
  }

  const bool grad_mode = torch::autograd::GradMode::is_enabled();
  const bool input_grad = grad_mode && input.requires_grad();
  std::vector<at::Tensor> outputs(split.used), chunks(split.used);
  s.threads->run(split.used, [&](std::size_t i) {
    on_replica(i, s.devices[i], [&] {
      if (i > 0) {
        // Parameters are only read by the other replicas' forwards: safe to copy concurrently.
        torch::NoGradGuard no_grad;
        for (auto& p : s.params) p.copy_to(i);
      }
      at::Tensor chunk = input.narrow(dim, split.offsets[i], split.sizes[i]).detach().to(s.devices[i]);
      if (input_grad) {
        // A leaf of its own (a copy when `to` aliased the input's storage).
        if (chunk.is_alias_of(input)) chunk = chunk.clone();
        chunk.requires_grad_(true);
        chunks[i] = chunk;
      }
      outputs[i] = apply(i, chunk);
    });
  });

  std::vector<at::Tensor> gathered_parts;
  bool differentiable = false;
  for (const auto& out : outputs) {
    DTRAIN_CHECK(out.defined() && out.dim() > dim, ConfigError,
                 "DataParallel's replicas must return tensors with the batch dimension " << dim << ".",
                 "return a batched tensor from forward");
    gathered_parts.push_back(out.detach().to(s.output_device));
    differentiable = differentiable || out.requires_grad();
  }
  at::Tensor gathered = at::cat(gathered_parts, dim);
  if (!grad_mode || !differentiable) return gathered;

  // See Note [Replica backward].
  auto node = compat::make_node<ReplicaBackward>();
  node->threads = s.threads;
  node->split = split;
  node->devices = s.devices;
  node->input_device = input.device();
  node->primary_device = s.devices.front();
  node->all_cpu = std::all_of(s.devices.begin(), s.devices.end(), [](const c10::Device& d) { return d.is_cpu(); });
  node->outputs = std::move(outputs);
  node->chunks = std::move(chunks);
  node->parameters.resize(split.used);
  torch::autograd::edge_list edges;
  edges.push_back(input_grad ? torch::autograd::impl::gradient_edge(input) : torch::autograd::Edge());
  for (auto& p : s.params) {
    if (!p.primary.requires_grad()) continue;
    edges.push_back(torch::autograd::impl::gradient_edge(p.primary));
    for (std::size_t i = 0; i < split.used; ++i) node->parameters[i].push_back(p.replicas[i]);
  }
  node->set_next_edges(std::move(edges));
  torch::autograd::set_history(gathered, node);
  return gathered;
}

}  // namespace dtrain::detail
