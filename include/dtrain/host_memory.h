// Host-memory policy for training processes.
//
// A training step frees and reallocates the same large CPU buffers
// (activations, gradients) every step. glibc's malloc serves big requests
// with fresh mmap()s, or trims the heap top back to the kernel, under
// thresholds it adjusts as the program runs; once an evaluation pass has
// moved them (GPT example: 20 no-grad batches), every training step paid
// ~4,600 page faults, +7 ms on a 29 ms step. retain_freed_host_memory() pins
// both thresholds high, so freed blocks stay in the process and are reused:
// the process keeps its peak footprint instead of returning memory to the
// kernel between steps, as PyTorch's CUDA caching allocator does on GPUs.
#pragma once

#include <cstddef>

namespace dtrain {

struct HostMemoryOptions {
  // Requests at least this large still get their own mmap() (and go back to
  // the kernel when freed). glibc takes at most 32 MiB on 64-bit machines.
  std::size_t mmap_threshold = std::size_t{32} << 20;
  // The heap top is returned to the kernel only when this much is free there.
  std::size_t trim_threshold = std::size_t{1} << 30;
};

// Applies `options` to the process's malloc. Returns false (and changes
// nothing) where the C library is not glibc; throws ConfigError for a value
// glibc refuses. Call once, early in main(): it is process-wide.
bool retain_freed_host_memory(const HostMemoryOptions& options = {});

}  // namespace dtrain
