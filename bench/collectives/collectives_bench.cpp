// Collective latency through dtrain's process group, one process per rank
// under the env contract: all_reduce, reduce_scatter and all_gather_into at
// 4 KiB .. 64 MiB of float32. The size is the full buffer: all_reduce's
// tensor, reduce_scatter's input (output = size / world), all_gather's output
// (input = size / world). Rank 0 prints one JSON line per (op, size):
//   {"impl":"dtrain","case":"reduce_scatter_1MiB","op":..,"bytes":..,
//    "p50_ms":..,"p95_ms":..,"iters":..}
// With --gloo the group runs on Gloo (intra_host_shared_memory = false) and
// impl is "dtrain_gloo"; by default dtrain picks its transport (shared memory
// for CPU ranks on one host). bench/collectives/peer.py measures
// torch.distributed (gloo) the same way.
//
//   collectives_bench [--gloo]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "../common/timing.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"

namespace {
using Clock = std::chrono::steady_clock;

struct Size {
  const char* name;
  std::int64_t bytes;
};

using dtrain::bench::percentile;

// Same schedule as peer.py: warm-up and timed iterations by size.
int iterations(std::int64_t bytes) {
  if (bytes <= 64 * 1024) return 200;
  if (bytes <= 1024 * 1024) return 60;
  if (bytes <= 16 * 1024 * 1024) return 20;
  return 10;
}
}  // namespace

int main(int argc, char** argv) {
  bool gloo_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--gloo") == 0) {
      gloo_only = true;
    } else {
      std::fprintf(stderr, "usage: %s [--gloo]\n", argv[0]);
      return 2;
    }
  }
  try {
    at::set_num_threads(1);
    auto group = dtrain::dist::init_process_group({.intra_host_shared_memory = !gloo_only});
    const std::int64_t world = group.size();
    const Size sizes[] = {
        {"4KiB", 4 << 10}, {"64KiB", 64 << 10}, {"1MiB", 1 << 20}, {"16MiB", 16 << 20}, {"64MiB", 64 << 20}};
    const char* ops[] = {"all_reduce", "reduce_scatter", "all_gather"};
    const char* impl = gloo_only ? "dtrain_gloo" : "dtrain";
    for (const char* op : ops) {
      for (const auto& s : sizes) {
        const std::int64_t floats = s.bytes / 4;
        at::Tensor full = at::ones({floats});
        at::Tensor slice = at::ones({floats / world});
        auto once = [&] {
          if (std::strcmp(op, "all_reduce") == 0) {
            group.all_reduce(full).wait();
          } else if (std::strcmp(op, "reduce_scatter") == 0) {
            group.reduce_scatter(slice, full).wait();
          } else {
            group.all_gather_into(full, slice).wait();
          }
        };
        const int iters = iterations(s.bytes);
        for (int i = 0; i < std::max(3, iters / 10); ++i) once();
        std::vector<double> ms;
        for (int i = 0; i < iters; ++i) {
          group.barrier();
          const auto start = Clock::now();
          once();
          ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
        }
        if (group.rank() == 0) {
          std::printf(
              "{\"impl\":\"%s\",\"case\":\"%s_%s\",\"op\":\"%s\",\"bytes\":%lld,\"p50_ms\":%.4f,\"p95_ms\":%.4f,"
              "\"iters\":%d,\"shared_memory\":%s}\n",
              impl, op, s.name, op, static_cast<long long>(s.bytes), percentile(ms, 0.5), percentile(ms, 0.95), iters,
              group.uses_shared_memory() ? "true" : "false");
          std::fflush(stdout);
        }
      }
    }
    group.barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: error: %s\n", e.what());
    return 1;
  }
}
