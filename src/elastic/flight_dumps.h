// Private to src/elastic/: the agent's side of the flight recorder
// (docs/flight_recorder.md): where a round's workers dump, and collecting
// and analysing their dumps when the round fails.
#pragma once

#include <chrono>
#include <string>

#include "dtrain/elastic/rendezvous.h"
#include "dtrain/elastic/worker_group.h"

namespace dtrain::elastic {

// `base`/attempt_<round>: one folder per round, like the logs.
std::string flight_dump_dir(const std::string& base, const RoundPlan& plan);

// Asks the live workers to dump (SIGUSR1), waits until each has written a
// dump since, or `wait` passed (a stopped or dead worker never does), then
// analyses every dump in `dir` (dist::analyze_flight_dumps) and logs the
// findings. Returns them (one per line), or "" when there is nothing to say.
// Never throws: a report is a help, not a reason to fail differently.
std::string collect_flight_report(WorkerGroup& workers, const std::string& dir, std::chrono::milliseconds wait);

}  // namespace dtrain::elastic
