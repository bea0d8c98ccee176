// Runs a test body on N ranks, as threads of this process over an in-memory
// store, or as real processes over Gloo on loopback, always under a timeout.
//
// Process mode re-executes the current test binary filtered to the current
// test with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port), ... set;
// in the child, run_rank_processes() runs the body for that rank and exits
// with the test's verdict, so the code after it runs only in the parent.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/store.h"

namespace dtrain::testing {

struct ThreadRanksOptions {
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
};

// Calls body(rank, store) on `world` threads sharing one in-memory store.
// The first exception thrown by a rank is rethrown here after all threads end.
// A run that outlives `timeout` fails the test and ends the process (a hung
// thread cannot be cancelled); keep collective timeouts below it.
void run_rank_threads(int world, const std::function<void(int rank, dist::Store store)>& body,
                      const ThreadRanksOptions& options = {});

struct ProcessRanksOptions {
  std::chrono::milliseconds timeout = std::chrono::seconds(90);
  // Extra environment per rank; a nullopt value removes the variable.
  std::function<std::map<std::string, std::optional<std::string>>(int rank)> env_for_rank;
  // When true (default), any rank failing fails the test, with all outputs shown.
  bool expect_success = true;
};

struct RankOutcome {
  int rank = 0;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  bool timed_out = false;
  std::string output;  // stdout and stderr together
};

// Runs body(rank) in `world` child processes. In the parent returns each
// rank's outcome; in a child never returns.
std::vector<RankOutcome> run_rank_processes(int world, const std::function<void(int rank)>& body,
                                            const ProcessRanksOptions& options = {});

// A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's
// ephemeral range so that no outgoing connection takes it meanwhile (Note
// [Ports below the ephemeral range] in ranks.cpp).
int free_port();

}  // namespace dtrain::testing
