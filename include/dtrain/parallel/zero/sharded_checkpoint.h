// Sharded checkpoints of ShardedDataParallel training that reshard on load.
//
// A ShardedCheckpointer is the general Checkpointer (checkpoint/checkpointer.h:
// its commit protocol, CRC-checked MANIFEST, pruning and per-rank generator
// states) holding one sharded state, zero_state() below, and the caller's
// extra JSON. Each rank's part (DIR/step_<N>/rank_<R>/zero.pt) holds its
// chunk of every unit (fp32 masters), its optimizer state laid out like the
// chunk (exp_avg, exp_avg_sq, momentum...) and how the units were cut.
// Loading works on any world size: each rank reads, from the parts of the
// ranks that saved, the ranges of each unit its new chunk covers.
//
// Optimizer state: torch::optim SGD (momentum), Adam and AdamW are resharded
// element by element; Adam's `step` is one per unit (all of a unit's pieces
// step together). See docs/zero.md.
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
namespace torch::serialize {
class InputArchive;
}

namespace dtrain {

class Checkpointer;
class ShardedDataParallel;
class ShardedStateful;
namespace detail {
class ZeroState;
}

// The same shards (parameters and optimizer state, resharded on load) as a
// state of the general Checkpointer (StateScope::kSharded): how the Trainer's
// ZeroStrategy checkpoints, together with the schedule, scaler, sampler and
// generators in one atomic commit.
std::shared_ptr<ShardedStateful> zero_state(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer);
// Live recovery of a fault-tolerant replica group: this rank's chunks and
// optimizer state from `part`, which zero_state(...)->save_state wrote on the
// same rank of a group of the same size and sharding (its counterpart in a
// live replica group); no other part is needed. DataError for a part of
// another shard.
void load_counterpart_part(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer,
                           torch::serialize::InputArchive& part);

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
  ~ShardedCheckpointer();
  ShardedCheckpointer(const ShardedCheckpointer&) = delete;
  ShardedCheckpointer& operator=(const ShardedCheckpointer&) = delete;

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
  ShardedDataParallel* sdp_;
  std::shared_ptr<detail::ZeroState> state_;
  std::string extra_;  // saved and loaded with the shards
  std::unique_ptr<Checkpointer> checkpointer_;
};

}  // namespace dtrain
