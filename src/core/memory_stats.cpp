#include "dtrain/memory_stats.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>

namespace dtrain {

namespace {

std::atomic<std::int64_t> g_live{0};
std::atomic<std::int64_t> g_peak{0};
std::atomic<bool> g_enabled{false};

void add_live(std::int64_t bytes) {
  const std::int64_t now = g_live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  std::int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// Each allocation is the wrapped allocator's raw block with a header of
// kHeader bytes in front holding the size: the data pointer is its own
// context (a "simple" DataPtr), as LibTorch's raw_allocate() requires, and
// the deleter finds the size from the pointer. kHeader keeps the wrapped
// allocator's alignment (64 bytes on the CPU).
constexpr std::size_t kHeader = 64;
c10::DeleterFnPtr g_inner_deleter = nullptr;

void free_counted(void* data) {
  char* block = static_cast<char*>(data) - kHeader;
  g_live.fetch_sub(*reinterpret_cast<std::int64_t*>(block), std::memory_order_relaxed);
  g_inner_deleter(block);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    char* block = static_cast<char*>(inner_->raw_allocate(n + kHeader));
    *reinterpret_cast<std::int64_t*>(block) = static_cast<std::int64_t>(n);
    add_live(static_cast<std::int64_t>(n));
    char* data = block + kHeader;
    return {data, data, &free_counted, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_counted; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

}  // namespace

void CpuMemoryStats::enable() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: tensors allocated through it free through it, up to
    // the process's exit. Priority: above LibTorch's default (0) and
    // equal to the highest a library sets, so later calls cannot replace it.
    c10::Allocator* inner = c10::GetCPUAllocator();
    // raw_allocate() below needs an allocator of simple pointers (LibTorch's
    // CPU allocators are).
    g_inner_deleter = inner->raw_deleter();
    if (g_inner_deleter == nullptr) return;
    static CountingAllocator* allocator = new CountingAllocator(inner);
    c10::SetCPUAllocator(allocator, /*priority=*/UINT8_MAX);
    g_enabled = true;
  });
}

bool CpuMemoryStats::enabled() {
  return g_enabled.load();
}

std::int64_t CpuMemoryStats::live_bytes() {
  return g_live.load(std::memory_order_relaxed);
}

std::int64_t CpuMemoryStats::peak_bytes() {
  return g_peak.load(std::memory_order_relaxed);
}

void CpuMemoryStats::reset_peak() {
  g_peak.store(g_live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace dtrain
