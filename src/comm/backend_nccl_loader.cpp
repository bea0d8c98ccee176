// libdtrain's side of the NCCL backend: loads the libdtrain_nccl module (see
// backend_nccl.cpp) from libdtrain's own folder on first use. A process that
// never asks for NCCL never loads LibTorch's CUDA libraries.
#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "backends.h"
#include "dtrain/comm/device.h"
#include "dtrain/error.h"

namespace dtrain::dist::detail {
namespace {

struct NcclModule {
  void (*check)(const c10::Device*) = nullptr;
  void (*make)(const BackendRequest*, c10::intrusive_ptr<c10d::Backend>*) = nullptr;
};

const NcclModule& module() {
  static NcclModule m;
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    std::string path;
    if (const char* override_path = std::getenv("DTRAIN_NCCL_MODULE")) {
      path = override_path;
    } else {
      Dl_info info{};
      ::dladdr(reinterpret_cast<void*>(&nccl_compiled_in), &info);
      const std::filesystem::path self = info.dli_fname != nullptr ? info.dli_fname : "";
      path = (self.parent_path() / "libdtrain_nccl.so").string();
    }
    void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      error = "cannot load the NCCL backend module " + path + ": " + ::dlerror();
      return;
    }
    m.check = reinterpret_cast<decltype(m.check)>(::dlsym(lib, "dtrain_nccl_check_usable"));
    m.make = reinterpret_cast<decltype(m.make)>(::dlsym(lib, "dtrain_nccl_make_backend"));
    if (m.check == nullptr || m.make == nullptr) error = path + " lacks dtrain's NCCL entry points";
  });
  DTRAIN_CHECK(error.empty(), ConfigError, error << ".",
               "install libdtrain_nccl.so next to libdtrain (or set DTRAIN_NCCL_MODULE to its path)");
  return m;
}

}  // namespace

bool nccl_compiled_in() {
  return true;
}

void check_nccl_usable(const c10::Device& device) {
  // Without a visible GPU there is nothing to load the CUDA libraries for.
  DTRAIN_CHECK(DeviceInventory::current().cuda_count > 0, ConfigError,
               "the nccl backend needs CUDA, but no CUDA device is visible.",
               "use --backend gloo (or device cpu), or run on a machine with a GPU; check CUDA_VISIBLE_DEVICES");
  module().check(&device);
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const BackendRequest& request) {
  check_nccl_usable(request.device);
  c10::intrusive_ptr<c10d::Backend> backend;
  module().make(&request, &backend);
  return backend;
}

}  // namespace dtrain::dist::detail
