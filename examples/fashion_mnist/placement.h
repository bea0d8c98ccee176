// Where examples/fashion_mnist trains: the devices and process group of
// --strategy and --devices, and the model placed accordingly behind the
// Trainer's Strategy interface.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/functional/loss.h>

#include "dtrain/dtrain.h"
#include "model.h"
#include "pipeline_cli.h"

struct PlacementOptions {
  std::string strategy = "single";
  std::string devices = "all";
  // --strategy pipeline: stages cut by the planner, on a mesh of pipelines.
  examples::PipelineCli pipeline;
};

// ZeRO stage of --strategy zero1|zero2|zero3, 0 otherwise.
inline int zero_stage(const std::string& strategy) {
  return strategy.size() == 5 && strategy.rfind("zero", 0) == 0 ? strategy[4] - '0' : 0;
}

inline bool distributed(const std::string& strategy) {
  return strategy == "ddp" || strategy == "ddp-model-parallel" || strategy == "pipeline" || zero_stage(strategy) > 0;
}

// Where this process trains and which share of the data it sees.
struct Placement {
  std::vector<c10::Device> devices;  // this process's devices
  int rank = 0;
  int world = 1;
  std::optional<dtrain::dist::ProcessGroup> group;  // ddp, zero only
};

inline Placement place(const PlacementOptions& opt) {
  if (!distributed(opt.strategy)) {
    auto devices = dtrain::parse_devices(opt.devices);
    if (opt.strategy == "single") {
      DTRAIN_CHECK(
          devices.size() == 1 || opt.devices == "all", ConfigError,
          "--strategy single trains on one device, but --devices " << opt.devices << " lists " << devices.size() << ".",
          "pass a single device, e.g. --devices cpu or --devices cuda:0, or use --strategy dp");
      devices.erase(devices.begin() + 1, devices.end());
    }
    return {.devices = devices};
  }
  DTRAIN_CHECK(dtrain::dist::launched_by_launcher(), ConfigError,
               "--strategy " << opt.strategy << " runs one process per rank, but RANK and WORLD_SIZE are not set.",
               "start it through a launcher: dtrain run --nproc-per-node 2 fashion_mnist --strategy "
                   << opt.strategy << " (or torchrun)");
  const auto env = dtrain::dist::read_env_contract();
  std::vector<c10::Device> devices;
  if (opt.strategy == "ddp" || opt.strategy == "pipeline" || zero_stage(opt.strategy) > 0) {
    devices = {dtrain::device_for_local_rank(opt.devices, env.local_rank, env.local_world_size)};
  } else {
    devices = dtrain::parse_devices(opt.devices);
    if (devices.front().is_cuda()) {
      const auto per_rank = devices.size() / static_cast<std::size_t>(env.local_world_size);
      DTRAIN_CHECK(per_rank >= 1, DeviceError,
                   env.local_world_size << " ranks on this node cannot share the " << devices.size()
                                        << " devices of --devices " << opt.devices << ".",
                   "list at least one device per rank, or lower --nproc-per-node");
      const auto first = devices.begin() + static_cast<std::ptrdiff_t>(per_rank) * env.local_rank;
      devices = std::vector<c10::Device>(first, first + static_cast<std::ptrdiff_t>(per_rank));
    }
  }
  auto group = dtrain::dist::init_process_group(env, {.device = devices.front()});
  return {.devices = devices, .rank = env.rank, .world = env.world_size, .group = std::move(group)};
}

// The model placed as --strategy says, behind the Trainer's Strategy interface.
inline std::shared_ptr<dtrain::Strategy> make_strategy(const PlacementOptions& opt, Placement& where) {
  const c10::Device first = where.devices.front();
  if (opt.strategy == "model-parallel" || opt.strategy == "ddp-model-parallel") {
    dtrain::ModelParallel split(small_cnn_layers(), dtrain::ModelParallelOptions{.devices = where.devices});
    if (where.rank == 0) {
      DTRAIN_LOG(kInfo) << "layers placed on " << dtrain::format_devices(split->device_of_layer());
    }
    if (where.group) {
      return std::make_shared<dtrain::DdpStrategy<dtrain::ModelParallel>>(split, *where.group, first,
                                                                          split->output_device());
    }
    return std::make_shared<dtrain::ForwardStrategy>(dtrain::ForwardStrategy::Parts{
        "model-parallel", split.ptr(), [split](const at::Tensor& x) mutable { return split(x); }, first,
        split->output_device()});
  }
  if (opt.strategy == "pipeline") {
    // The layers cut into one stage per rank (v per rank when interleaved) by
    // the placement planner; every rank builds the whole model alike and
    // keeps its stages.
    auto layers = small_cnn_layers();
    layers->to(first);
    dtrain::dist::DeviceMesh mesh(*where.group, opt.pipeline.mesh_dims(where.world));
    const int pp = mesh.size("pp"), v = opt.pipeline.stages_per_rank();
    const auto stages = dtrain::pipeline::split_stages(layers, dtrain::pipeline::plan_stages(layers, pp * v));
    std::vector<dtrain::pipeline::PipelineStage> mine;
    for (int s = mesh.coordinate("pp"); s < pp * v; s += pp) mine.push_back({.module = stages[s]});
    auto pipe = std::make_shared<dtrain::pipeline::Pipeline>(
        std::move(mine), mesh["pp"], opt.pipeline.options(mesh),
        [](const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); });
    return std::make_shared<dtrain::PipelineStrategy>(pipe, mesh);
  }
  if (const int stage = zero_stage(opt.strategy)) {
    // ShardedDataParallel runs a Sequential unit by unit: the same layers and
    // initialisation as SmallCnn (ModelParallelEqualsSingleDevice checks it).
    auto layers = small_cnn_layers();
    layers->to(first);
    auto sdp = std::make_shared<dtrain::ShardedDataParallel>(layers, *where.group, dtrain::ZeroOptions{.stage = stage});
    return std::make_shared<dtrain::ZeroStrategy>(sdp, first);
  }
  SmallCnn net;
  net->to(first);
  if (opt.strategy == "dp") {
    auto dp =
        std::make_shared<dtrain::DataParallel<SmallCnn>>(net, dtrain::DataParallelOptions{.devices = where.devices});
    return std::make_shared<dtrain::ForwardStrategy>(
        dtrain::ForwardStrategy::Parts{"dp", net.ptr(), [dp](const at::Tensor& x) { return (*dp)(x); }, first, first});
  }
  if (where.group) return std::make_shared<dtrain::DdpStrategy<SmallCnn>>(net, *where.group, first, first);
  return std::make_shared<dtrain::SingleDeviceStrategy<SmallCnn>>(net, first);
}
