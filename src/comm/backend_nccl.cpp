// The NCCL backend (CUDA tensors): the libdtrain_nccl module, built only when
// LibTorch has CUDA and loaded by backend_nccl_loader.cpp on first use. Its
// two entry points have C names; everything else is internal, so nothing here
// can be confused with libdtrain's own symbols.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <c10/cuda/CUDAFunctions.h>

#include "backends.h"
#include "dtrain/error.h"

namespace dtrain::dist::detail {
namespace {

void check_usable(const c10::Device& device) {
  const auto count = static_cast<int>(c10::cuda::device_count());
  DTRAIN_CHECK(count > 0, ConfigError, "the nccl backend needs CUDA, but no CUDA device is visible.",
               "use --backend gloo (or device cpu), or run on a machine with a GPU; check CUDA_VISIBLE_DEVICES");
  DTRAIN_CHECK(device.is_cuda(), ConfigError, "the nccl backend needs a CUDA training device, got " << device << ".",
               "pass a cuda device (e.g. --devices cuda) or use the gloo backend for CPU training");
  const int index = device.has_index() ? device.index() : 0;
  DTRAIN_CHECK(index < count, DeviceError, "cuda:" << index << " does not exist: " << count << " visible.",
               "use a device index below " << count);
}

c10::intrusive_ptr<c10d::Backend> make_backend(const BackendRequest& request) {
  check_usable(request.device);
  const int index = request.device.has_index() ? request.device.index() : 0;
  // NCCL communicators are bound to the current device when first used.
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = request.timeout;
  options->group_name = request.group_name;
  try {
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(request.store, request.rank, request.size, options);
    backend->setBoundDeviceId(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)));
    return backend;
  } catch (const c10::Error& e) {
    throw CommunicationError("NCCL could not create group '" + request.group_name + "': " + e.what_without_backtrace(),
                             "check NCCL_DEBUG=INFO output and that every rank sees its GPU");
  }
}

}  // namespace
}  // namespace dtrain::dist::detail

extern "C" __attribute__((visibility("default"))) void dtrain_nccl_check_usable(const c10::Device* device) {
  dtrain::dist::detail::check_usable(*device);
}

extern "C" __attribute__((visibility("default"))) void dtrain_nccl_make_backend(
    const dtrain::dist::detail::BackendRequest* request, c10::intrusive_ptr<c10d::Backend>* out) {
  *out = dtrain::dist::detail::make_backend(*request);
}
