// Checkpoints for resuming: model, optimizer, step, sampler position, each
// rank's RNG state, and any other named state (a GradScaler, an LR schedule,
// a sharded optimizer's part), written atomically.
//
// Layout of DIR/step_<N>/:
//   model.pt, optimizer.pt, state.json        rank 0's, for state replicated across ranks
//   <name>.pt                                 each replicated state added with add_state()
//   rank_<R>/rng.pt                           rank R's own CPU (and CUDA) generator states
//   rank_<R>/<name>.pt                        each per-rank state of rank R (StateScope::kPerRank)
//   MANIFEST                                  sizes and CRC32s of all of the above, all ranks
// See Note [Checkpoint commit] in checkpoint.cpp: every rank writes its files
// into one hidden temporary folder and fsyncs them; when all ranks are done,
// rank 0 writes the MANIFEST last and renames the folder into place, so a
// crash or an error on any rank at any point leaves either the complete
// checkpoint or none, never a half one under its final name. Loading verifies
// the MANIFEST; a corrupt or partial checkpoint is skipped with a warning and
// the next older one is tried.
//
// With a process group, at load rank 0 picks the newest complete checkpoint
// and every rank loads that same one, and its own rank_<R>/ part: a program
// that seeds `seed + rank` resumes bit for bit.
//
//   dtrain::Checkpointer ckpt({.dir = "ckpt"}, group);
//   ckpt.add_state("grad_scaler", dtrain::json_state([&] { return to_json(*scaler.state_dict()); },
//                                                    [&](const std::string& s) { ... }));
//   if (auto resumed = ckpt.load_latest(model, optimizer)) { ... }
//   ckpt.save({.step = step, .sampler = loader.state()}, model, optimizer);
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/data/sampler.h"

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace dtrain {

struct CheckpointOptions {
  std::filesystem::path dir;
  int keep = 2;  // complete checkpoints kept; older ones are deleted after a save
};

struct TrainingState {
  std::int64_t step = 0;  // optimizer steps taken
  data::SamplerState sampler;
};

// Something that saves its state into a checkpoint and restores it.
class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual void save_state(torch::serialize::OutputArchive& archive) const = 0;
  virtual void load_state(torch::serialize::InputArchive& archive) = 0;
  // False for a replicated state that only describes the run and is not
  // needed to resume it (the model's Hugging Face mapping, read by `dtrain
  // ckpt`): a checkpoint written before it was added then still loads, the
  // state skipped. Every other missing state is a DataError.
  virtual bool needed_to_resume() const { return true; }
};

// Replicated: identical on every rank; rank 0 writes <name>.pt and every rank
// loads it. Per-rank: each rank writes and loads its own rank_<R>/<name>.pt
// (per-rank streams); loading with a rank that has no part is an error.
// Sharded: each rank writes rank_<R>/<name>.pt as per-rank state, but the
// object (a ShardedStateful) loads from the parts of all the ranks that saved,
// however many they were: it reshards (ZeRO's parameter and optimizer shards).
enum class StateScope { kReplicated, kPerRank, kSharded };

// State split over ranks that a different number of ranks can load
// (StateScope::kSharded). save_state writes this rank's part; at load,
// load_parts gets every saving rank's part (part(r) for r < saved_world,
// opened on first use, verified by the MANIFEST) and takes what this rank needs.
class ShardedStateful : public Stateful {
 public:
  virtual void load_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) = 0;
  // Sharded state is loaded through load_parts only.
  void load_state(torch::serialize::InputArchive& archive) final;
};

// A Stateful from two functions over a text (e.g. JSON) representation.
std::shared_ptr<Stateful> json_state(std::function<std::string()> save, std::function<void(const std::string&)> load);
// A module's parameters and buffers (copied in place at load, see checkpoint.cpp).
std::shared_ptr<Stateful> module_state(torch::nn::Module& module);
// An optimizer's state (LibTorch's serialization).
std::shared_ptr<Stateful> optimizer_state(torch::optim::Optimizer& optimizer);

class Checkpointer {
 public:
  explicit Checkpointer(CheckpointOptions options, std::optional<dist::ProcessGroup> group = std::nullopt);

  // Adds named state to every checkpoint saved and loaded from now on. Names
  // are [A-Za-z0-9_.-]+, unique, and not model, optimizer, state or rng.
  // The object must outlive its use by this Checkpointer.
  void add_state(const std::string& name, std::shared_ptr<Stateful> object, StateScope scope = StateScope::kReplicated);
  // Removes an added state (a no-op for a name not added): how a loader
  // that reads another format's state under its name hands back the name.
  void remove_state(const std::string& name);
  const CheckpointOptions& options() const { return options_; }

  // Collective when a group is given: every rank writes its part, and all
  // return once the checkpoint is committed. An error on any rank (a full
  // disk, a failing state) is thrown on every rank, and the checkpoint is not
  // committed: the previous ones stay as they were.
  void save(const TrainingState& state, torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  // The same without a model and optimizer: only state.json, the added states and the RNG.
  void save(const TrainingState& state);

  // Loads the newest complete checkpoint into `model`, `optimizer` and the
  // added states, and restores this rank's generators; nullopt when there is none.
  std::optional<TrainingState> load_latest(torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  std::optional<TrainingState> load_latest();

  // Steps of the complete, verified checkpoints in DIR, newest first (every
  // file of every step read and checked against its CRC32).
  std::vector<std::int64_t> complete_steps() const;
  // The step load_latest() takes: the newest that verifies on rank 0, told to
  // every rank (collective when a group is given); -1 when there is none.
  // The answer is kept for the next load_latest(), which then does not read
  // the files again; a save in between forgets it.
  std::int64_t latest_step();

 private:
  struct Entry {
    std::string name;
    std::shared_ptr<Stateful> object;
    StateScope scope;
  };
  void save_entries(const TrainingState& state, const std::vector<Entry>& entries);
  std::optional<TrainingState> load_entries(const std::vector<Entry>& entries);
  // complete_steps, taking the steps in `known` (with a MANIFEST) as verified.
  std::vector<std::int64_t> complete_steps(const std::set<std::int64_t>& known) const;
  // The newest step that verifies, checked newest first; -1 when none.
  std::int64_t newest_complete_step();

  CheckpointOptions options_;
  std::optional<dist::ProcessGroup> group_;
  std::vector<Entry> added_;
  // Steps this Checkpointer committed or verified in full (rank 0): pruning
  // does not read them again (Note [Checkpoint I/O] in checkpointer.cpp).
  std::set<std::int64_t> committed_;
  // latest_step()'s answer until the next load or save.
  std::optional<std::int64_t> latest_;
};

}  // namespace dtrain
