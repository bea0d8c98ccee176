// All-reduce latency through dtrain's process group (Gloo), one process per
// rank under the env contract. Rank 0 prints one JSON line per tensor size:
//   {"impl":"dtrain","case":"4KiB","bytes":4096,"p50_us":..,"p95_us":..,"iters":..}
// bench/allreduce/peer.py measures torch.distributed the same way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "../common/timing.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "dtrain/dtrain.h"

namespace {
struct Case {
  const char* name;
  std::int64_t floats;
};

using dtrain::bench::percentile;
}  // namespace

int main() {
  try {
    at::set_num_threads(1);
    auto group = dtrain::dist::init_process_group();
    const Case cases[] = {{"4KiB", 1024}, {"1MiB", 256 * 1024}, {"16MiB", 4 * 1024 * 1024}};
    for (const auto& c : cases) {
      at::Tensor t = at::ones({c.floats});
      const int iters = c.floats >= 1 << 20 ? 30 : 200;
      for (int i = 0; i < 10; ++i) group.all_reduce(t).wait();
      group.barrier();
      std::vector<double> us;
      for (int i = 0; i < iters; ++i) {
        const auto start = std::chrono::steady_clock::now();
        group.all_reduce(t).wait();
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
      }
      if (group.rank() == 0) {
        std::printf(
            "{\"impl\":\"dtrain\",\"case\":\"%s\",\"bytes\":%lld,\"p50_us\":%.1f,\"p95_us\":%.1f,\"iters\":%d}\n",
            c.name, static_cast<long long>(c.floats * 4), percentile(us, 0.5), percentile(us, 0.95), iters);
        std::fflush(stdout);
      }
    }
    group.barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allreduce: error: %s\n", e.what());
    return 1;
  }
}
