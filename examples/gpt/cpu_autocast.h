// bf16 autocast on the CPU for a scope (the GPT's forward and loss), with
// LibTorch's own autocast state, restored on exit. Kept apart so it can become
// dtrain::amp::Autocast when dtrain's AMP library lands.
#pragma once

#include <ATen/autocast_mode.h>

namespace gpt {

class CpuAutocast {
 public:
  explicit CpuAutocast(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(at::kCPU);
    prev_dtype_ = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (!enabled_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, prev_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, prev_dtype_);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool enabled_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

}  // namespace gpt
