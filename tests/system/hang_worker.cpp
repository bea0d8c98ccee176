// A worker for the flight-recorder system tests (flight_recorder_test.cpp):
// all-reduces a small tensor HANG_STEPS times (default 5), then a barrier.
// Rank HANG_RANK misbehaves just before collective #HANG_AT (default 3), as
// HANG_MODE says:
//   sleep     sleeps 120 s (the others time out waiting for it)
//   wrong_op  issues an all_gather where the others all-reduce
//   stop      stops itself (SIGSTOP), as a debugger or a stuck node would
// Results are not checked: a rank out of step reads garbage, and the point
// is the report of who was out of step, which needs every rank alive to dump.
#include <ATen/ATen.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "dtrain/dtrain.h"

namespace {
std::string hang_env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}
}  // namespace

int main() {
  return dtrain::elastic::run_recording_errors([] {
    const std::string mode = hang_env("HANG_MODE", "none");
    const int culprit = std::stoi(hang_env("HANG_RANK", "-1"));
    const int at = std::stoi(hang_env("HANG_AT", "3"));
    const int steps = std::stoi(hang_env("HANG_STEPS", "5"));
    // Every rank checks in under a long timeout first, so that the short
    // one (DTRAIN_TIMEOUT_SECONDS) only ever times out the collectives, not
    // a slow start on a loaded machine.
    auto started = dtrain::dist::init_process_group({.timeout = std::chrono::seconds(120), .name = "started"});
    auto group = dtrain::dist::init_process_group();
    for (int seq = 1; seq <= steps; ++seq) {
      at::Tensor t = at::ones({1000});
      if (seq == at && group.rank() == culprit) {
        if (mode == "sleep") std::this_thread::sleep_for(std::chrono::seconds(120));
        if (mode == "stop") ::raise(SIGSTOP);
        if (mode == "wrong_op") {
          at::Tensor out = at::empty({1000 * group.size()});
          group.all_gather_into(out, t).wait();
          continue;
        }
      }
      group.all_reduce(t).wait();
    }
    group.barrier();
    return 0;
  });
}
