// Stands in for backend_nccl.cpp when LibTorch was built without CUDA.
#include "backends.h"
#include "dtrain/error.h"

namespace dtrain::dist::detail {

bool nccl_compiled_in() {
  return false;
}

void check_nccl_usable(const c10::Device&) {
  throw ConfigError("the nccl backend is not available: this dtrain was built against a LibTorch without CUDA.",
                    "use the gloo backend, or rebuild against a CUDA-enabled LibTorch");
}

}  // namespace dtrain::dist::detail

namespace dtrain::dist::detail {
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const BackendRequest& request) {
  check_nccl_usable(request.device);
  return {};
}
}  // namespace dtrain::dist::detail
