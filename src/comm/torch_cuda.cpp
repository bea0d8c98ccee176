// LibTorch's CUDA part on demand: see dtrain/comm/torch_cuda.h.
#include "dtrain/comm/torch_cuda.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <filesystem>
#include <string_view>
#include <system_error>

#include "dtrain/comm/device.h"
#include "dtrain/log.h"

namespace dtrain {

bool load_torch_cuda() {
  static const bool loaded = [] {
    const char* ask = std::getenv("DTRAIN_TORCH_CUDA");
    const bool forced = ask != nullptr && std::string_view(ask) == "load";
    if (!forced && DeviceInventory::current().cuda_count == 0) return false;
    // libtorch_cuda.so sits beside libtorch_cpu.so (a wheel's torch/lib, a
    // LibTorch archive's lib/), which this process has loaded already.
    void* cpu = ::dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    link_map* map = nullptr;
    if (cpu == nullptr) return false;
    const bool found = ::dlinfo(cpu, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr;
    const std::filesystem::path path =
        found ? std::filesystem::path(map->l_name).parent_path() / "libtorch_cuda.so" : std::filesystem::path();
    ::dlclose(cpu);
    std::error_code error;
    if (path.empty() || !std::filesystem::exists(path, error)) return false;     // a CPU-only LibTorch
    if (::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) return true;  // stays loaded
    const char* why = ::dlerror();
    DTRAIN_LOG(kWarning) << "cannot load LibTorch's CUDA part from " << path.string() << ": "
                         << (why != nullptr ? why : "unknown reason")
                         << "; CUDA tensors will fail (reinstall torch with CUDA, or train on cpu)";
    return false;
  }();
  return loaded;
}

}  // namespace dtrain
