// Checkpoints for resuming: model, optimizer, step, sampler position and RNG
// state, written atomically.
//
// Layout: DIR/step_<N>/{model.pt, optimizer.pt, state.json, MANIFEST}. A
// checkpoint is written into a hidden temporary folder, every file fsync'd,
// the MANIFEST (sizes and CRC32s of the others) written last, then the folder
// is renamed into place and DIR fsync'd: a crash at any point leaves either
// the complete checkpoint or none, never a half one under its final name.
// Loading verifies the MANIFEST; a corrupt or partial checkpoint is skipped
// with a warning and the next older one is tried.
//
// With a process group: rank 0 writes (the state is replicated under DDP),
// and at load rank 0 picks the newest complete checkpoint and every rank
// loads that same one.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "dtrain/comm/process_group.h"
#include "dtrain/data/sampler.h"

namespace dtrain {

struct CheckpointOptions {
  std::filesystem::path dir;
  int keep = 2;  // complete checkpoints kept; older ones are deleted after a save
};

struct TrainingState {
  std::int64_t step = 0;  // optimizer steps taken
  data::SamplerState sampler;
};

class Checkpointer {
 public:
  explicit Checkpointer(CheckpointOptions options, std::optional<dist::ProcessGroup> group = std::nullopt);

  // Collective when a group is given (rank 0 writes, then all ranks sync).
  void save(const TrainingState& state, torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  // Loads the newest complete checkpoint into `model` and `optimizer` and
  // restores the default CPU generator; nullopt when there is none.
  std::optional<TrainingState> load_latest(torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  // Steps of the complete, verified checkpoints in DIR, newest first.
  std::vector<std::int64_t> complete_steps() const;

 private:
  CheckpointOptions options_;
  std::optional<dist::ProcessGroup> group_;
};

}  // namespace dtrain
