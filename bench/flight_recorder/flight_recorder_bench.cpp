// What the flight recorder costs an operation: one entry recorded, then
// marked started and completed (what every ProcessGroup operation pays with
// DTRAIN_FLIGHT_RECORDER on), in this thread's CPU time, so that other
// processes on the machine do not count. Off, an operation pays one null
// check of FlightRecorder::get(). Run by run.sh with DTRAIN_FLIGHT_RECORDER set.
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "../../src/comm/flight_recorder.h"

namespace {
double thread_cpu_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}
}  // namespace

int main() {
  using dtrain::dist::detail::FlightRecorder;
  using dtrain::dist::detail::FlightState;
  FlightRecorder* recorder = FlightRecorder::get();
  if (recorder == nullptr) {
    std::fprintf(stderr, "set DTRAIN_FLIGHT_RECORDER=N (N > 0)\n");
    return 2;
  }
  auto group = std::make_shared<const dtrain::dist::detail::FlightGroup>(
      dtrain::dist::detail::FlightGroup{.name = "dp_replicate", .backend = "gloo", .rank = 0, .world_ranks = {0, 1}});
  constexpr int kOps = 1'000'000;
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const double start = thread_cpu_ns();
    for (int i = 0; i < kOps; ++i) {
      const auto ticket = recorder->record({.group = group,
                                            .seq = static_cast<std::uint64_t>(i),
                                            .op = "all_reduce(sum)",
                                            .sizes = "Float[544000]",
                                            .dtype = "Float",
                                            .bytes = 2176000});
      recorder->mark(ticket, FlightState::kStarted);
      recorder->mark(ticket, FlightState::kCompleted);
    }
    best = std::min(best, (thread_cpu_ns() - start) / kOps);
  }
  std::printf("{\"bench\":\"flight_recorder\",\"metric\":\"cpu_ns_per_op\",\"value\":%.1f}\n", best);
  return 0;
}
