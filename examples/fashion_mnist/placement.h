// Where examples/fashion_mnist trains: the devices and process group of
// --strategy and --devices (dtrain::parallelize places the model).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"

struct PlacementOptions {
  std::string strategy = "single";
  std::string devices = "all";
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
