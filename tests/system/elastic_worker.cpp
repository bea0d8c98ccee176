// A training stand-in for the elastic launcher tests: every step all-reduces
// ones across the group (so a lost peer breaks it at once) and checks the sum
// is the world size. Progress survives regroupings: rank 0 records the step
// in $ELASTIC_DIR/step after each one, and a new round resumes from it (every
// rank gets rank 0's value by broadcast). Each rank appends
// "round R world W rank K step S" to $ELASTIC_DIR/steps.log.
//   ELASTIC_DIR (required), ELASTIC_STEPS (target, default 100), ELASTIC_STEP_MS (default 50)
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "dtrain/dtrain.h"

namespace {
std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}
}  // namespace

int main() {
  return dtrain::elastic::run_recording_errors([] {
    const std::string dir = env_or("ELASTIC_DIR", "");
    const int target = std::stoi(env_or("ELASTIC_STEPS", "100"));
    const int step_ms = std::stoi(env_or("ELASTIC_STEP_MS", "50"));
    const std::string round = env_or("DTRAIN_RDZV_ROUND", "?");
    auto group = dtrain::dist::init_process_group();
    at::Tensor start = at::zeros({1}, at::kLong);
    if (group.rank() == 0) {
      std::ifstream in(dir + "/step");
      std::int64_t s = 0;
      if (in >> s) start.fill_(s);
    }
    group.broadcast(start, 0).wait();
    for (std::int64_t step = start.item<std::int64_t>(); step < target; ++step) {
      at::Tensor t = at::ones({256});
      group.all_reduce(t).wait();
      DTRAIN_CHECK(t[0].item<float>() == static_cast<float>(group.size()), CommunicationError,
                   "all-reduce gave " << t[0].item<float>() << " on " << group.size() << " ranks", "");
      if (group.rank() == 0) {
        std::ofstream(dir + "/step.tmp") << step + 1 << "\n";
        std::rename((dir + "/step.tmp").c_str(), (dir + "/step").c_str());
      }
      std::ofstream(dir + "/steps.log", std::ios::app)
          << "round " << round << " world " << group.size() << " rank " << group.rank() << " step " << step << "\n";
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
    }
    group.barrier();
    return 0;
  });
}
