// Autocast guard: torch.autocast's __init__/__enter__/__exit__ over ATen's
// thread-local autocast state (see include/dtrain/amp/autocast.h).
#include "dtrain/amp/autocast.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>

#include "dtrain/error.h"

namespace dtrain::amp {

Autocast::Autocast(c10::DeviceType device_type, const AutocastOptions& options)
    : device_type_(device_type), enabled_(options.enabled) {
  DTRAIN_CHECK(at::autocast::is_autocast_available(device_type), ConfigError,
               "autocast is not available for device type " << c10::DeviceTypeName(device_type, /*lower_case=*/true),
               "use c10::kCPU or c10::kCUDA (autocast exists for cpu, cuda, xpu, mps and a few accelerators)");
  dtype_ = options.dtype.value_or(at::autocast::get_autocast_dtype(device_type));
  // torch.autocast warns and disables itself in these cases; a C++ program gets no
  // warning it would see, so the mistake is an error here.
  DTRAIN_CHECK(!enabled_ || dtype_ == at::kBFloat16 || dtype_ == at::kHalf, ConfigError,
               "autocast to " << c10::toString(dtype_) << " is not supported",
               "autocast lowers precision to at::kBFloat16 (CPU and recent GPUs) or at::kHalf (CUDA)");
  DTRAIN_CHECK(!enabled_ || device_type != c10::kCUDA || at::hasCUDA(), DeviceError,
               "Autocast(c10::kCUDA) in a process without CUDA",
               "use Autocast(c10::kCPU) for CPU training, or link dtrain_torch_link (all of LibTorch) and run on a "
               "machine with a GPU");
  previous_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  previous_enabled_ = at::autocast::is_autocast_enabled(device_type);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_type);
  at::autocast::set_autocast_enabled(device_type, enabled_);
  at::autocast::set_autocast_dtype(device_type, dtype_);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(options.cache_enabled.value_or(previous_cache_enabled_));
}

Autocast::~Autocast() {
  // Leaving the outermost region drops the cached low-precision weights, so
  // that the next iteration casts the updated weights again.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, previous_enabled_);
  at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
  at::autocast::set_autocast_cache_enabled(previous_cache_enabled_);
}

bool is_autocast_enabled(c10::DeviceType device_type) {
  return at::autocast::is_autocast_enabled(device_type);
}

c10::ScalarType autocast_dtype(c10::DeviceType device_type) {
  return at::autocast::get_autocast_dtype(device_type);
}

}  // namespace dtrain::amp
