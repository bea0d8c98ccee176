// Autocast: an RAII guard for ATen's automatic mixed precision, LibTorch's
// missing counterpart of Python's `with torch.autocast(...)`.
//
//   {
//     dtrain::amp::Autocast autocast(c10::kCPU);           // bf16 on CPU (fp16 on CUDA)
//     loss = loss_fn(model(x), y);                         // matmuls and convolutions in bf16,
//   }                                                      // losses and reductions in fp32
//   loss.backward();                                       // outside the region, as in Python
//
// While alive, ops dispatched on this thread for tensors of the device type run
// in the lower-precision dtype when they are on autocast's lower-precision
// list, in fp32 when they are on its fp32 list, and unchanged otherwise (the
// lists are ATen's, the same for C++ and Python). On exit the guard restores
// the enabled flag, dtype and cache setting it found, and, when it was the
// outermost guard, clears the cache of casted weights, exactly as
// torch.autocast.__exit__ does; guards nest (an inner one may disable, or
// change the dtype, for a sub-region).
//
// Contract: the state is thread-local (as in Python). DataParallel replica
// threads and the autograd engine inherit it from the calling thread; a thread
// you start yourself needs its own guard. Guards end in reverse order of
// construction (they are scoped objects, neither copyable nor movable).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace dtrain::amp {

struct AutocastOptions {
  // Lower-precision dtype: at::kBFloat16 or at::kHalf. Unset: ATen's current
  // autocast dtype for the device type (bf16 on CPU, fp16 on CUDA unless changed).
  std::optional<c10::ScalarType> dtype;
  // False: a region where autocast is off (e.g. inside an enabled one).
  bool enabled = true;
  // Cache the low-precision copies of fp32 leaf tensors that require grad
  // (weights) for the region. Unset: keep the current setting (on by default).
  std::optional<bool> cache_enabled;
};

class Autocast {
 public:
  // Throws ConfigError for a dtype autocast does not support and for a device
  // type without autocast; DeviceError for CUDA when this process has no CUDA.
  explicit Autocast(c10::DeviceType device_type, const AutocastOptions& options = {});
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;
  Autocast(Autocast&&) = delete;
  Autocast& operator=(Autocast&&) = delete;

  c10::DeviceType device_type() const { return device_type_; }
  c10::ScalarType dtype() const { return dtype_; }
  bool enabled() const { return enabled_; }

 private:
  c10::DeviceType device_type_;
  c10::ScalarType dtype_;
  bool enabled_;
  // What the constructor found, restored by the destructor.
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
  bool previous_cache_enabled_;
};

// Whether autocast is on for `device_type` on this thread, and its dtype.
bool is_autocast_enabled(c10::DeviceType device_type);
c10::ScalarType autocast_dtype(c10::DeviceType device_type);

}  // namespace dtrain::amp
