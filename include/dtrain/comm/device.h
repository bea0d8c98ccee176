// Device selection: parsing device specs and checking them against what this
// process can see.
//
// Spec grammar (comma-separated items, whitespace ignored):
//   cpu            one CPU device (repeat it, "cpu,cpu", for several CPU replicas)
//   cuda           every visible CUDA device
//   cuda:N or N    visible CUDA device N
//   all            every visible CUDA device, or cpu when there is none
// Indices are visible indices: with CUDA_VISIBLE_DEVICES=2,3, "cuda:0" is
// physical GPU 2, as in the CUDA runtime. Each CUDA device may appear once.
#pragma once

#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <vector>

namespace dtrain {

// What this process can see. Tests construct fakes; current() asks the CUDA runtime.
struct DeviceInventory {
  int cuda_count = 0;
  std::optional<std::string> cuda_visible_devices;  // the env var, if set
  static DeviceInventory current();
};

// Parses `spec`; throws DeviceError naming the bad item, what is visible
// (and CUDA_VISIBLE_DEVICES when set), and what to pass instead.
std::vector<c10::Device> parse_devices(const std::string& spec,
                                       const DeviceInventory& inventory = DeviceInventory::current());

// Checks devices given as values (not a spec): each is cpu or a visible CUDA
// device, and no CUDA device appears twice. Throws DeviceError naming the bad
// one and what is visible.
void check_devices(const std::vector<c10::Device>& devices,
                   const DeviceInventory& inventory = DeviceInventory::current());

// The device of local rank `local_rank` when each process drives one device
// of `spec`: devices[local_rank % devices.size()] for CPU, and for CUDA an
// error when there are fewer devices than local ranks.
c10::Device device_for_local_rank(const std::string& spec, int local_rank, int local_world_size,
                                  const DeviceInventory& inventory = DeviceInventory::current());

// "cpu", "cuda:0,cuda:1", ... (parse_devices(format_devices(d)) == d).
std::string format_devices(const std::vector<c10::Device>& devices);

}  // namespace dtrain
