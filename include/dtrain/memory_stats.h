// Counts the bytes of CPU tensor storage this process holds, now and at its
// peak: activation-memory measurements (the recompute modes against
// Korthikanti et al.'s formula) and the planner's measured-vs-predicted
// memory. PyTorch has torch.cuda.max_memory_allocated() for GPUs and nothing
// for the CPU.
//
//   dtrain::CpuMemoryStats::enable();          // once, before the tensors to count
//   dtrain::CpuMemoryStats::reset_peak();
//   auto loss = model(x).sum();
//   std::int64_t held = dtrain::CpuMemoryStats::live_bytes();   // activations + ...
//
// enable() installs, process-wide, a CPU allocator that wraps LibTorch's
// current one and counts every allocation it serves; storage allocated before
// enable() is not counted (its frees are not either). It stays installed for
// the process's life (tensors it allocated must be able to free themselves),
// costing two atomic adds per allocation. Only LibTorch's CPU allocator is
// seen: memory that kernels (oneDNN scratch, OpenMP) take from malloc
// directly, and accelerator memory, are not.
#pragma once

#include <cstdint>

namespace dtrain {

struct CpuMemoryStats {
  static void enable();  // idempotent, thread-safe
  // Whether counting is on (false before enable(), or where the CPU allocator
  // in place has no raw deleter to wrap).
  static bool enabled();
  // Bytes of storage allocated since enable() and not yet freed.
  static std::int64_t live_bytes();
  // The highest live_bytes() since enable() or the last reset_peak().
  static std::int64_t peak_bytes();
  static void reset_peak();  // peak := live
};

}  // namespace dtrain
