// Loading a checkpoint saved under any plan into the plan of this run
// (docs/checkpoints.md). Two formats hold a model's training state:
//  - "laid_out" (LayoutState, checkpoint/layout_state.h): every parameter
//    and its optimizer state under its global name, each rank's piece with
//    its box in the global tensor: single process, DDP, DataParallel, the
//    hybrid, pipelines (each stage under the whole model's names);
//  - "zero" (parallel/zero/sharded_checkpoint.h): each rank's chunk of every
//    flat ZeRO unit, with where each parameter lies in it (ZeRO 1-3, HSDP).
// A strategy saves its own format and loads either: the same format directly
// (the boxes, or the ZeRO chunks, of any world size), the other one through
// the whole state (consolidate_zero_parts / LayoutState::load_whole, or a
// ZeroFullState filled from the boxes): a ZeRO plan loading a laid-out
// checkpoint, or the reverse, holds the whole model's fp32 state on each
// rank once, during the load.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/checkpoint/layout_state.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

class LayoutState;
class ShardedDataParallel;

inline constexpr const char* kLaidOutState = "laid_out";
inline constexpr const char* kZeroState = "zero";
// Tensor-parallel checkpoints saved before they were laid out: a LayoutState
// under the tp module's own names (TensorParallelStrategy still loads them).
inline constexpr const char* kTensorParallelState = "tp";

// The model state of the checkpoint load_latest() would take (the newest
// complete one): none, laid out, ZeRO chunks, a replicated model.pt (before
// laid-out checkpoints), a tensor-parallel "tp" state (before tp saved laid
// out), or something else (per-rank pipeline parts). Collective where the
// checkpointer has a group (Checkpointer::latest_step).
enum class SavedModelState { kNone, kLaidOut, kZero, kReplicated, kTensorParallel, kOther };
SavedModelState saved_model_state(Checkpointer& checkpointer);

// A whole tensor as a laid-out load target (or a piece to save whole).
LaidOutTensor whole_tensor(at::Tensor t, bool optional = false);

// The whole state of `sdp`'s parameters as load targets (fp32 zeros, every
// parameter "model.<name_of(name)>", a trainable one's optimizer fields
// "optimizer.<...>.<field>" and step, optional), the names they may have,
// and what takes this rank's chunks and optimizer state from them once a
// LayoutState has loaded them (load_zero_full_state; `loaded` tells which
// optional tensors the checkpoint had). Each rank holds its whole state
// once, during the load.
// `part_of`, when given, lays out a parameter's target (and its optimizer
// fields'): `sdp`'s parameters are then this rank's parts of the model's
// (tensor-parallel parts: their tp placement), and the load fills each from
// the saved pieces its box meets; unset, every target is whole.
struct ZeroWholeTargets {
  LaidOutTensors tensors;
  std::set<std::string> known;
  std::function<void(const std::function<bool(const std::string&)>& loaded)> finish;
};
using PartOf = std::function<LaidOutTensor(const std::string& name, at::Tensor local)>;
// The names of `sdp`'s module's state a ZeRO laid-out checkpoint holds: its
// parameters, then its buffers.
std::vector<std::string> zero_module_names(ShardedDataParallel& sdp);
ZeroWholeTargets zero_whole_targets(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer,
                                    const std::function<std::string(const std::string&)>& name_of,
                                    const PartOf& part_of = {});

// A laid-out state that loads `sdp`'s chunks and optimizer state through
// zero_whole_targets (with `part_of`) and its module's buffers in place:
// what a ZeRO plan over tp parts reads either format with (as a laid-out
// state, and through zero_reader for ZeRO chunks). Load only.
std::shared_ptr<LayoutState> zero_parts_reader(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer,
                                               PartOf part_of);

// Readers of the other format, for load_any_plan: a laid-out state filled
// from ZeRO chunks; ZeRO shards filled from laid-out pieces.
std::shared_ptr<ShardedStateful> zero_reader(std::shared_ptr<LayoutState> laid_out);
std::shared_ptr<ShardedStateful> laid_out_reader(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer);

// What a strategy reads each format with (null: that format is refused).
struct StateReaders {
  std::shared_ptr<ShardedStateful> laid_out;
  std::shared_ptr<ShardedStateful> zero;
};

// Loads the newest checkpoint through the reader of its format, registered
// under the format's name for this load only: the strategy registers its own
// state (saved_state) when it saves. A format without a reader is a
// ConfigError naming it; the checkpoint's other states (schedule, scaler,
// sampler, generators) load as always.
std::optional<TrainingState> load_any_plan(Checkpointer& checkpointer, const StateReaders& readers,
                                           const std::string& plan);
// Every tensor of a laid-out state, whole, by name ("model.<name>",
// "optimizer.<name>.<field>"), from the parts of the `saved_world` ranks that
// saved it: what tools (`dtrain ckpt`) read. A tensor the parts do not
// cover is a DataError naming it.
std::vector<std::pair<std::string, at::Tensor>> consolidate_laid_out(
    const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world);

// (Re)registers `state` as `name` (kSharded) for the saves that follow.
void register_saved_state(Checkpointer& checkpointer, const std::string& name, std::shared_ptr<ShardedStateful> state);

}  // namespace dtrain
