// A ZeRO-3 training worker for the elastic test (gpt_zero_test.cpp's
// ZeroElastic): trains tests/multirank/zero_helpers.h's model with AdamW on
// global batches fixed by the step (ZERO_GLOBAL sequences, split over the
// ranks of the current world), saves a sharded checkpoint after every step
// into $ELASTIC_DIR/ckpt and resumes from the newest one, whatever world size
// saved it. Appends "round R world W rank K step S" to $ELASTIC_DIR/steps.log;
// at the end rank 0 exports the full parameters to $ELASTIC_DIR/final.pt.
//   ELASTIC_DIR (required), ELASTIC_STEPS (default 40), ELASTIC_STEP_MS (default 100)
#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "dtrain/dtrain.h"
#include "zero_helpers.h"

namespace {
std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}
}  // namespace

int main() {
  return dtrain::elastic::run_recording_errors([] {
    using namespace dtrain::testing::zero;
    const std::string dir = env_or("ELASTIC_DIR", "");
    const int target = std::stoi(env_or("ELASTIC_STEPS", "40"));
    const int step_ms = std::stoi(env_or("ELASTIC_STEP_MS", "100"));
    const std::string round = env_or("DTRAIN_RDZV_ROUND", "?");
    constexpr std::int64_t kGlobal = 12;
    at::set_num_threads(1);
    auto group = dtrain::dist::init_process_group();
    auto model = make_model();
    dtrain::ShardedDataParallel sdp(model, group, {.stage = 3});
    auto opt = make_optimizer(OptimizerKind::kAdamW, sdp.parameters());
    dtrain::ShardedCheckpointer ckpt({.dir = dir + "/ckpt"}, sdp, *opt);
    std::int64_t first = 0;
    if (auto info = ckpt.load_latest()) first = info->step;
    const std::int64_t per_rank = kGlobal / group.size();
    for (std::int64_t step = first; step < target; ++step) {
      const Batch mine = global_batch(static_cast<int>(step), kGlobal).slice(group.rank() * per_rank, per_rank);
      opt->zero_grad();
      loss_of(sdp(mine.x), mine.y).backward();
      opt->step();
      ckpt.save(step + 1);
      std::ofstream(dir + "/steps.log", std::ios::app)
          << "round " << round << " world " << group.size() << " rank " << group.rank() << " step " << step << "\n";
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
    }
    ckpt.export_full_state_dict(dir + "/final.pt");
    return 0;
  });
}
