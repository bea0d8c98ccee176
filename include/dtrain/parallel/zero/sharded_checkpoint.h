// Sharded checkpoints of ShardedDataParallel training that reshard on load.
//
// Layout of DIR/step_<N>/:
//   rank_<R>.pt   rank R's chunk of every unit (fp32 masters) and its optimizer
//                 state laid out like the chunk (exp_avg, exp_avg_sq, momentum...)
//   MANIFEST      JSON: step, world size, units (name, numel, shard), the
//                 optimizer kind, file sizes, and the caller's extra JSON
// Every rank writes its file (in parallel) into a hidden temporary folder and
// fsyncs it; after a barrier rank 0 writes the MANIFEST last, fsyncs, and
// renames the folder into place, so a crash leaves a complete checkpoint or
// none. Loading picks the newest folder with a MANIFEST (rank 0 decides) and
// works on any world size: each rank reads, from the files of the ranks that
// saved it, the ranges of each unit its new chunk covers.
//
// Optimizer state: torch::optim SGD (momentum), Adam and AdamW are resharded
// element by element; Adam's `step` is one per unit (all of a unit's pieces
// step together). Not the general Checkpointer because its per-rank parts are
// read back by the same rank only (no resharding); see docs/zero.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

class ShardedDataParallel;
class ShardedStateful;

// The same shards (parameters and optimizer state, resharded on load) as a
// state of the general Checkpointer (StateScope::kSharded): how the Trainer's
// ZeroStrategy checkpoints, together with the schedule, scaler, sampler and
// generators in one atomic commit.
std::shared_ptr<ShardedStateful> zero_state(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer);

struct ShardedCheckpointOptions {
  std::filesystem::path dir;
  int keep = 2;  // complete checkpoints kept; older ones are deleted after a save
};

struct ShardedCheckpointInfo {
  std::int64_t step = 0;
  int saved_world_size = 0;
  std::string extra;  // the JSON given to save()
};

class ShardedCheckpointer {
 public:
  ShardedCheckpointer(ShardedCheckpointOptions options, ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer);

  // Collective. `extra` (JSON) is stored in the MANIFEST (sampler, scaler, ...).
  void save(std::int64_t step, const std::string& extra = "{}");
  // Collective: loads the newest complete checkpoint, resharding to this world; nullopt when none.
  std::optional<ShardedCheckpointInfo> load_latest();
  // Steps of the complete checkpoints in DIR, newest first.
  std::vector<std::int64_t> complete_steps() const;
  // Collective: rank 0 writes the consolidated full parameters (name -> fp32
  // tensor, torch::serialize archive) to `path`, e.g. for inference.
  void export_full_state_dict(const std::filesystem::path& path);

 private:
  ShardedCheckpointOptions options_;
  ShardedDataParallel* sdp_;
  torch::optim::Optimizer* optimizer_;
};

}  // namespace dtrain
