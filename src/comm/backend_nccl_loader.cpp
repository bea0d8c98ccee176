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
#include "dtrain/module_loader.h"

namespace dtrain::dist::detail {
namespace {

struct NcclModule {
  void (*check)(const c10::Device*) = nullptr;
  void (*make)(const BackendRequest*, c10::intrusive_ptr<c10d::Backend>*) = nullptr;
};

constexpr const char* kHint = "install libdtrain_nccl.so next to libdtrain (or set DTRAIN_NCCL_MODULE to its path)";

// Loaded once; a failure is remembered and reported on every use.
const NcclModule& module() {
  static NcclModule m;
  static std::string error;
  static std::once_flag once;
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
    try {
      void* lib = dtrain::detail::load_module("the NCCL backend module", path, /*lazy=*/false, kHint);
      m.check = reinterpret_cast<decltype(m.check)>(
          dtrain::detail::module_symbol(lib, path, "dtrain_nccl_check_usable", kHint));
      m.make = reinterpret_cast<decltype(m.make)>(
          dtrain::detail::module_symbol(lib, path, "dtrain_nccl_make_backend", kHint));
    } catch (const ConfigError& e) {
      error = e.message();
    }
  });
  DTRAIN_CHECK(error.empty(), ConfigError, error, kHint);
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
