#include "flight_dumps.h"

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "dtrain/comm/flight_analysis.h"
#include "dtrain/log.h"

namespace dtrain::elastic {

std::string flight_dump_dir(const std::string& base, const RoundPlan& plan) {
  return (std::filesystem::path(base) / ("attempt_" + std::to_string(plan.round))).string();
}

std::string collect_flight_report(WorkerGroup& workers, const std::string& dir, std::chrono::milliseconds wait) {
  namespace fs = std::filesystem;
  try {
    const auto asked_at = fs::file_time_type::clock::now();
    const std::vector<int> asked = workers.signal_live(SIGUSR1);
    const auto deadline = std::chrono::steady_clock::now() + wait;
    auto answered = [&](int rank) {
      std::error_code ec;
      const auto written = fs::last_write_time(fs::path(dir) / ("rank_" + std::to_string(rank) + ".json"), ec);
      return !ec && written >= asked_at;
    };
    while (std::chrono::steady_clock::now() < deadline && !std::all_of(asked.begin(), asked.end(), answered)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!fs::is_directory(dir)) {
      DTRAIN_LOG(kWarning) << "flight recorder: no rank dumped to " << dir;
      return "";
    }
    const std::string text = dist::analyze_flight_dumps(dir).text();
    DTRAIN_LOG(kError) << "flight recorder (dumps in " << dir << "):\n" << text;
    return text;
  } catch (const std::exception& e) {
    DTRAIN_LOG(kWarning) << "flight recorder: could not analyse the dumps in " << dir << ": " << e.what();
    return "";
  }
}

}  // namespace dtrain::elastic
