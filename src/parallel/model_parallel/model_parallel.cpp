// ModelParallel: placing a Sequential's layers, and running across devices.
#include "dtrain/parallel/model_parallel/model_parallel.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <sstream>

#include "dtrain/comm/device.h"
#include "dtrain/error.h"

namespace dtrain {
namespace {

std::int64_t tensor_bytes(const std::vector<at::Tensor>& tensors) {
  std::int64_t total = 0;
  for (const auto& t : tensors) total += static_cast<std::int64_t>(t.nbytes());
  return total;
}

std::vector<std::string> layer_names(const torch::nn::Sequential& layers) {
  std::vector<std::string> names;
  for (const auto& item : layers->named_children()) names.push_back(item.key());
  return names;
}

void check_layers(const torch::nn::Sequential& layers) {
  DTRAIN_CHECK(!layers.is_empty() && layers->size() > 0, ConfigError, "ModelParallel got no layers.",
               "pass a non-empty torch::nn::Sequential");
}

}  // namespace

std::vector<LayerCost> layer_costs(const torch::nn::Sequential& layers, double memory_factor) {
  check_layers(layers);
  std::vector<LayerCost> costs;
  const auto names = layer_names(layers);
  for (std::size_t i = 0; i < layers->size(); ++i) {
    const auto& module = layers->ptr(i);
    const auto bytes = tensor_bytes(module->parameters()) + tensor_bytes(module->buffers());
    costs.push_back({names[i], static_cast<std::int64_t>(static_cast<double>(bytes) * memory_factor), 0.0});
  }
  return costs;
}

std::vector<LayerCost> profile_layers(const torch::nn::Sequential& layers, const at::Tensor& input,
                                      double memory_factor, int repeats) {
  auto costs = layer_costs(layers, memory_factor);
  // Profiling runs the layers in their current mode; buffers (BatchNorm
  // statistics) are restored afterwards so that profiling changes nothing.
  std::vector<at::Tensor> buffers = layers->buffers(), saved;
  {
    torch::NoGradGuard no_grad;
    for (const auto& b : buffers) saved.push_back(b.clone());
  }
  at::Tensor x = input;
  std::size_t i = 0;
  torch::nn::Sequential mutable_layers = layers;  // AnyModule::forward is non-const
  for (auto& layer : *mutable_layers) {
    std::vector<double> times;
    at::Tensor out;
    for (int r = 0; r < std::max(1, repeats); ++r) {
      const auto start = std::chrono::steady_clock::now();
      at::Tensor in = x.detach().requires_grad_(x.is_floating_point());
      out = layer.forward(in);
      if (out.requires_grad()) out.sum().backward();
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    for (auto& p : layer.ptr()->parameters()) p.mutable_grad() = at::Tensor();
    std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
    // A floor keeps every profiled layer's cost positive (planned by compute).
    costs[i++].compute = std::max(times[times.size() / 2], 1e-9);
    x = out.detach();
  }
  torch::NoGradGuard no_grad;
  for (std::size_t b = 0; b < buffers.size(); ++b) buffers[b].copy_(saved[b]);
  return costs;
}

ModelParallelImpl::ModelParallelImpl(torch::nn::Sequential layers, std::vector<c10::Device> device_of_layer)
    : layers_(register_module("layers", std::move(layers))) {
  check_layers(layers_);
  place(std::move(device_of_layer));
}

ModelParallelImpl::ModelParallelImpl(torch::nn::Sequential layers,
                                     const std::map<std::string, c10::Device>& device_by_name)
    : layers_(register_module("layers", std::move(layers))) {
  check_layers(layers_);
  const auto names = layer_names(layers_);
  std::vector<c10::Device> devices;
  for (const auto& name : names) {
    const auto it = device_by_name.find(name);
    if (it == device_by_name.end()) {
      std::ostringstream known;
      for (const auto& n : names) known << (&n == &names.front() ? "" : ", ") << n;
      throw ConfigError("the placement map has no device for layer '" + name + "'.",
                        "map every layer; the layers are: " + known.str());
    }
    devices.push_back(it->second);
  }
  for (const auto& [name, device] : device_by_name) {
    DTRAIN_CHECK(std::find(names.begin(), names.end(), name) != names.end(), ConfigError,
                 "the placement map names layer '" << name << "', which the model does not have.",
                 "check the names of the Sequential's layers");
  }
  place(std::move(devices));
}

ModelParallelImpl::ModelParallelImpl(torch::nn::Sequential layers, const ModelParallelOptions& options)
    : layers_(register_module("layers", std::move(layers))) {
  check_layers(layers_);
  check_devices(options.devices);
  const auto costs = options.profile_input ? profile_layers(layers_, *options.profile_input, options.memory_factor,
                                                            options.profile_repeats)
                                           : layer_costs(layers_, options.memory_factor);
  placement_ = plan_placement(costs, options.devices.size(), options.memory_budgets);
  std::vector<c10::Device> devices;
  for (const auto j : placement_->device_of_layer) devices.push_back(options.devices[j]);
  place(std::move(devices));
}

void ModelParallelImpl::place(std::vector<c10::Device> device_of_layer) {
  DTRAIN_CHECK(device_of_layer.size() == layers_->size(), ConfigError,
               "the placement gives " << device_of_layer.size() << " devices for " << layers_->size() << " layers.",
               "give one device per layer");
  // Model parallelism may place several layers on one GPU, so duplicates are fine here.
  for (const auto& d : device_of_layer) check_devices({d});
  device_of_layer_ = std::move(device_of_layer);
  for (std::size_t i = 0; i < layers_->size(); ++i) layers_->ptr(i)->to(device_of_layer_[i]);
}

at::Tensor ModelParallelImpl::forward(at::Tensor x) {
  std::size_t i = 0;
  for (auto& layer : *layers_) {
    const c10::Device device = device_of_layer_[i++];
    if (x.device() != device) x = x.to(device);
    x = layer.forward(x);
  }
  return x;
}

}  // namespace dtrain
