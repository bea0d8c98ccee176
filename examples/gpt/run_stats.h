// Per-rank measurements for the planner's predicted-vs-measured comparison
// (bench/plan/compare.py), on when DTRAIN_GPT_RUN_STATS=1: the peak of CPU
// tensor storage this rank held from the model's construction on
// (dtrain::CpuMemoryStats: parameters, gradients, optimizer state,
// activations, buffers; not the corpus, loaded before), and the median wall
// and CPU time (this process's, all threads) between consecutive optimizer
// steps, the first step left out. Every rank prints one JSON line:
//   {"event":"rank_stats","rank":r,"peak_bytes":..,"step_wall_ms":..,"step_cpu_ms":..,"steps":..}
#pragma once

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <vector>

#include "dtrain/memory_stats.h"

namespace gpt {

class RunStats {
 public:
  static bool requested() {
    const char* v = std::getenv("DTRAIN_GPT_RUN_STATS");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }
  // Before the model is built: counting starts here.
  void start() { dtrain::CpuMemoryStats::enable(); }
  // After each optimizer step.
  void step() {
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    timespec cpu{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    wall_.push_back(wall);
    cpu_.push_back(static_cast<double>(cpu.tv_sec) + 1e-9 * static_cast<double>(cpu.tv_nsec));
  }
  void print(int rank) const {
    std::cout << nlohmann::json{{"event", "rank_stats"},
                                {"rank", rank},
                                {"peak_bytes", dtrain::CpuMemoryStats::peak_bytes()},
                                {"step_wall_ms", 1e3 * median_delta(wall_)},
                                {"step_cpu_ms", 1e3 * median_delta(cpu_)},
                                {"steps", wall_.size()}}
                     .dump()
              << std::endl;
  }

 private:
  static double median_delta(const std::vector<double>& t) {
    std::vector<double> d;
    for (std::size_t k = 1; k < t.size(); ++k) d.push_back(t[k] - t[k - 1]);
    if (d.empty()) return 0;
    std::sort(d.begin(), d.end());
    return d[d.size() / 2];
  }
  std::vector<double> wall_, cpu_;
};

}  // namespace gpt
