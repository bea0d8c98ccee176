// Model parallelism: the layers of a Sequential placed on several devices.
//
// Each layer runs on its device; forward moves the activation to the next
// layer's device where the device changes, and autograd moves gradients back
// the same way. The output (and so the loss) sits on the last layer's device.
// Placement is explicit (one device per layer, or by layer name) or planned:
// balanced parameter memory, or profiled compute, under per-device memory
// budgets (see placement.h). A ModelParallel is an ordinary module: train it
// directly, or wrap it in DistributedDataParallel for the hybrid (each process
// holds one model split over its own devices).
//
//   auto mp = dtrain::ModelParallel(layers, dtrain::ModelParallelOptions{
//       .devices = dtrain::parse_devices("cuda:0,cuda:1")});
//   auto loss = loss_fn(mp(x), y.to(mp->output_device()));
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/parallel/model_parallel/placement.h"

namespace dtrain {

struct ModelParallelOptions {
  // Devices to plan over, in pipeline order.
  std::vector<c10::Device> devices;
  // Memory budget per device in bytes; empty = unlimited.
  std::vector<std::int64_t> memory_budgets;
  // A layer's memory is (parameter + buffer bytes) x this factor: 1 counts
  // weights only; about 4 covers gradients and Adam's two moments as well.
  double memory_factor = 1.0;
  // When set, each layer's forward+backward is timed on this sample input
  // (propagated through the layers, on their current device) and compute is
  // balanced instead of memory.
  std::optional<at::Tensor> profile_input;
  int profile_repeats = 3;
};

// Memory of each layer of `layers` ((parameter + buffer bytes) x factor).
std::vector<LayerCost> layer_costs(const torch::nn::Sequential& layers, double memory_factor = 1.0);
// layer_costs plus each layer's median forward+backward time on `input`.
std::vector<LayerCost> profile_layers(const torch::nn::Sequential& layers, const at::Tensor& input,
                                      double memory_factor = 1.0, int repeats = 3);

class ModelParallelImpl : public torch::nn::Module {
 public:
  // Explicit: device_of_layer[i] runs layer i.
  ModelParallelImpl(torch::nn::Sequential layers, std::vector<c10::Device> device_of_layer);
  // Explicit by name: every layer of `layers` (see Sequential's named_children)
  // must be in the map.
  ModelParallelImpl(torch::nn::Sequential layers, const std::map<std::string, c10::Device>& device_by_name);
  // Planned over options.devices.
  ModelParallelImpl(torch::nn::Sequential layers, const ModelParallelOptions& options);

  at::Tensor forward(at::Tensor x);

  const std::vector<c10::Device>& device_of_layer() const { return device_of_layer_; }
  // Where forward's output lives: the last layer's device.
  c10::Device output_device() const { return device_of_layer_.back(); }
  // The plan, when the placement was planned.
  const std::optional<Placement>& placement() const { return placement_; }
  torch::nn::Sequential& layers() { return layers_; }

 private:
  void place(std::vector<c10::Device> device_of_layer);

  torch::nn::Sequential layers_{nullptr};
  std::vector<c10::Device> device_of_layer_;
  std::optional<Placement> placement_;
};
TORCH_MODULE(ModelParallel);

}  // namespace dtrain
