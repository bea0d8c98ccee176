// Private: backend factories, one implementation file per backend
// (backend_gloo.cpp; backend_nccl.cpp or backend_nccl_unavailable.cpp, chosen
// by CMake from whether LibTorch was built with CUDA).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include <c10/core/Device.h>

namespace dtrain::dist::detail {

struct BackendRequest {
  c10::intrusive_ptr<c10d::Store> store;  // already prefixed for this group
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::string gloo_host;          // see GroupOptions::gloo_host; resolved by the caller
  c10::Device device{c10::kCPU};  // NCCL binds to it
  std::string group_name;
};

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const BackendRequest& request);
// Throws ConfigError (or DeviceError) unless NCCL can run on `device` here:
// a CUDA-enabled build, a visible GPU, a CUDA device of a valid index.
void check_nccl_usable(const c10::Device& device);
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const BackendRequest& request);
// Whether this build can create NCCL backends at all (CUDA-enabled LibTorch).
bool nccl_compiled_in();

}  // namespace dtrain::dist::detail
