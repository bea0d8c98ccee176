// Device spec parsing and validation.
#include "dtrain/comm/device.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <set>
#include <sstream>

#include "dtrain/error.h"

namespace dtrain {
namespace {

std::string strip(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c)))
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

std::string visible_text(const DeviceInventory& inv) {
  std::ostringstream out;
  out << inv.cuda_count << " CUDA device" << (inv.cuda_count == 1 ? " is" : "s are") << " visible";
  if (inv.cuda_visible_devices) out << " (CUDA_VISIBLE_DEVICES=" << *inv.cuda_visible_devices << ")";
  return out.str();
}

bool all_digits(const std::string& s) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

c10::Device cuda_device(const std::string& item, const std::string& index_text, const DeviceInventory& inv) {
  DTRAIN_CHECK(all_digits(index_text) && index_text.size() < 6, DeviceError,
               "device '" << item << "' has no valid CUDA index.", "write cuda:N or N with N a visible index");
  const int index = std::stoi(index_text);
  DTRAIN_CHECK(inv.cuda_count > 0, DeviceError,
               "device '" << item << "' asks for CUDA, but " << visible_text(inv) << ".",
               "use cpu, or run where a GPU is visible (check CUDA_VISIBLE_DEVICES)");
  DTRAIN_CHECK(index < inv.cuda_count, DeviceError,
               "device '" << item << "' does not exist: " << visible_text(inv) << ".",
               "use an index in 0.." << inv.cuda_count - 1 << " (indices count visible devices only)");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace

// Asks the CUDA driver directly (dlopen'd, so no CUDA or LibTorch link is
// needed): the launcher uses this and must start fast. The driver honours
// CUDA_VISIBLE_DEVICES just as the runtime does. No driver: no devices.
int cuda_driver_device_count() {
  static const int count = [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return 0;
    using InitFn = int (*)(unsigned int);
    using CountFn = int (*)(int*);
    auto init = reinterpret_cast<InitFn>(::dlsym(lib, "cuInit"));
    auto get_count = reinterpret_cast<CountFn>(::dlsym(lib, "cuDeviceGetCount"));
    int n = 0;
    if (init == nullptr || get_count == nullptr || init(0) != 0 || get_count(&n) != 0) n = 0;
    return n;  // the library stays loaded: the process may use CUDA later
  }();
  return count;
}

DeviceInventory DeviceInventory::current() {
  DeviceInventory inv;
  inv.cuda_count = cuda_driver_device_count();
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) inv.cuda_visible_devices = v;
  return inv;
}

std::vector<c10::Device> parse_devices(const std::string& spec, const DeviceInventory& inv) {
  const std::string text = strip(spec);
  DTRAIN_CHECK(!text.empty(), DeviceError, "the device list is empty.", "pass e.g. cpu, cuda, cuda:0 or 0,2");
  std::vector<c10::Device> out;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    DTRAIN_CHECK(!item.empty(), DeviceError, "the device list '" << spec << "' has an empty item.",
                 "separate devices with single commas, e.g. 0,1");
    if (item == "cpu") {
      out.emplace_back(c10::kCPU);
    } else if (item == "cuda" || item == "all") {
      if (item == "all" && inv.cuda_count == 0) {
        out.emplace_back(c10::kCPU);
        continue;
      }
      DTRAIN_CHECK(inv.cuda_count > 0, DeviceError, "device 'cuda' asks for CUDA, but " << visible_text(inv) << ".",
                   "use cpu, or run where a GPU is visible (check CUDA_VISIBLE_DEVICES)");
      for (int i = 0; i < inv.cuda_count; ++i) out.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
    } else if (item.rfind("cuda:", 0) == 0) {
      out.push_back(cuda_device(item, item.substr(5), inv));
    } else if (all_digits(item)) {
      out.push_back(cuda_device(item, item, inv));
    } else {
      throw DeviceError("unknown device '" + item + "' in '" + spec + "'.",
                        "use cpu, cuda, cuda:N, N or all (comma-separated for several)");
    }
  }
  std::set<int> seen;
  for (const auto& d : out) {
    if (!d.is_cuda()) continue;
    DTRAIN_CHECK(seen.insert(d.index()).second, DeviceError,
                 "cuda:" << static_cast<int>(d.index()) << " appears more than once in '" << spec << "'.",
                 "list each GPU once");
  }
  return out;
}

void check_devices(const std::vector<c10::Device>& devices, const DeviceInventory& inv) {
  DTRAIN_CHECK(!devices.empty(), DeviceError, "the device list is empty.", "pass e.g. cpu, cuda, cuda:0 or 0,2");
  for (const auto& d : devices) {
    DTRAIN_CHECK(d.is_cpu() || d.is_cuda(), DeviceError, "device '" << d.str() << "' is not supported.",
                 "use cpu or cuda:N");
    DTRAIN_CHECK(!d.is_cpu() || !d.has_index() || d.index() == 0, DeviceError,
                 "device '" << d.str() << "' does not exist: there is one CPU device.",
                 "write cpu (repeat it, cpu,cpu, for several CPU replicas)");
    if (d.is_cuda()) {
      const std::string text = d.has_index() ? std::to_string(d.index()) : "";
      cuda_device(d.str(), text, inv);
    }
  }
  // Duplicates are checked on the formatted list, with the same message as specs.
  parse_devices(format_devices(devices), inv);
}

c10::Device device_for_local_rank(const std::string& spec, int local_rank, int local_world_size,
                                  const DeviceInventory& inv) {
  const auto devices = parse_devices(spec, inv);
  DTRAIN_CHECK(local_rank >= 0 && local_rank < local_world_size, ConfigError,
               "LOCAL_RANK=" << local_rank << " is not below LOCAL_WORLD_SIZE=" << local_world_size << ".",
               "check the launcher's --nproc-per-node");
  const bool any_cuda = std::any_of(devices.begin(), devices.end(), [](const c10::Device& d) { return d.is_cuda(); });
  if (any_cuda) {
    DTRAIN_CHECK(static_cast<int>(devices.size()) >= local_world_size, DeviceError,
                 local_world_size << " processes on this node need one GPU each, but '" << spec << "' gives "
                                  << devices.size() << ".",
                 "lower --nproc-per-node to " << devices.size() << " or list more devices");
  }
  return devices[static_cast<size_t>(local_rank) % devices.size()];
}

std::string format_devices(const std::vector<c10::Device>& devices) {
  std::string out;
  for (const auto& d : devices) {
    if (!out.empty()) out += ',';
    out += d.is_cuda() ? "cuda:" + std::to_string(d.index()) : d.str();
  }
  return out;
}

}  // namespace dtrain
