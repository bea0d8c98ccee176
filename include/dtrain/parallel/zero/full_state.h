// A ZeRO model's training state, whole: every parameter unsharded and every
// optimizer state tensor shaped like its parameter, by parameter name. It is
// what the shards of any world size consolidate into, what any world size
// and stage loads from, and what Python's FSDP2 state dicts hold: the bridge
// between dtrain's sharded checkpoints and torch.distributed.checkpoint (DCP).
//
//   // a dtrain checkpoint (ZeroStrategy / ShardedCheckpointer) -> Python
//   auto full = dtrain::consolidate_zero_parts(part, saved_world);  // or read_zero_checkpoint(open_checkpoint(dir))
//   dtrain::checkpoint::save_torch_file("full.pt", dtrain::to_fsdp_state_dict(full));
//   //   python python/dtrain_dcp.py to-dcp full.pt dcp/   ->  dcp.load(...) into fully_shard(model)
//
//   // Python (FSDP2, DCP) -> dtrain, any world size and stage:
//   //   python python/dtrain_dcp.py from-dcp dcp/ full.pt
//   auto full = dtrain::from_fsdp_state_dict(dtrain::checkpoint::load_torch_file("full.pt"));
//   dtrain::load_zero_full_state(sdp, optimizer, full);  // on every rank; each takes its ranges
//
// The Python structure is that of torch.distributed.checkpoint.state_dict's
// get_state_dict(model, optimizer) under the keys "model" and "optim" (DCP's
// tutorial AppState): {"model": {name: tensor}, "optim": {"state": {name:
// {"step": float32 scalar, "exp_avg": ..., "exp_avg_sq": ...}}, "param_groups":
// [{"lr": ..., "betas": (..), ..., "params": [names]}]}}. AdamW and SGD
// (momentum) convert; a parameter shared by several modules appears once,
// under its first name in named_parameters() order (as Python's
// named_parameters() names it).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
class OptimizerOptions;
}  // namespace torch::optim
namespace torch::serialize {
class InputArchive;
}

namespace dtrain {

class ShardedDataParallel;
struct CheckpointFolder;  // checkpoint/checkpoint_reader.h

struct ParameterOptimizerState {
  std::int64_t step = 0;                    // optimizer steps this parameter took (Adam family)
  std::map<std::string, at::Tensor> state;  // exp_avg, exp_avg_sq[, max_exp_avg_sq] or momentum_buffer
};

// Where a parameter lay in the shards that were consolidated: elements
// [offset, offset + numel) of its unit's flat buffer, which was cut into
// `shards` chunks of `shard` elements (Shard(0) of the flat unit; rank r held
// [r * shard, (r + 1) * shard)).
struct ShardPlacement {
  std::string unit;
  std::int64_t offset = 0;
  std::int64_t unit_numel = 0;
  std::int64_t shard = 0;
  int shards = 0;
};

struct ZeroFullState {
  // Every parameter (frozen ones too), full, fp32, in the model's order.
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  std::vector<bool> trainable;  // per entry of `parameters`
  // Per entry of `parameters` when consolidated from shards; empty otherwise.
  std::vector<ShardPlacement> placements;
  // "adamw", "adam", "sgd" or "other" (no state kept).
  std::string optimizer_kind;
  // Per trainable parameter name; absent before the first step.
  std::map<std::string, ParameterOptimizerState> optimizer_state;
  // The optimizer's hyper-parameters (its one param group's options), or null
  // when the checkpoint did not record them (older checkpoints, several groups).
  std::shared_ptr<torch::optim::OptimizerOptions> options;
};

// The whole state from the parts of a ZeRO checkpoint ("zero" state of the
// Checkpointer; ShardedStateful::load_parts's `part`) saved by `saved_world`
// ranks. Needs the per-parameter layout that checkpoints record since issue 26
// (an older checkpoint is a DataError saying so: resume it and save again).
ZeroFullState consolidate_zero_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world);

// Loads a full state into this rank's shards and optimizer state, whatever
// world size and stage saved it: each rank copies the ranges its chunks
// cover (no communication). Every parameter of the model must be present
// with its shape (a DataError names the first that is not); parameters'
// optimizer state is replaced; the optimizer's options are set from `full`
// when recorded. The optimizer must be of `full.optimizer_kind`.
void load_zero_full_state(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer, const ZeroFullState& full);

// Every parameter `sdp` shards (frozen ones too), in its order: name, shape
// and whether it trains; and the optimizer's kind as ZeroFullState names it.
// What a loader needs to build a ZeroFullState from another format
// (trainer/resharding.h).
struct ZeroParameterInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  bool trainable = false;
};
std::vector<ZeroParameterInfo> zero_parameters(ShardedDataParallel& sdp);
std::string zero_optimizer_kind(const torch::optim::Optimizer& optimizer);

// The sharded state `name` of a committed checkpoint (ZeroStrategy and
// ShardedCheckpointer save ZeRO's as "zero"), consolidated from every rank's
// part; a checkpoint without it is a DataError saying so.
ZeroFullState read_zero_checkpoint(const CheckpointFolder& folder, const std::string& name = "zero");

// The Python structure above, for save_torch_file (and python/dtrain_dcp.py
// to-dcp). Needs the options for param_groups; without them a ConfigError.
c10::IValue to_fsdp_state_dict(const ZeroFullState& full);
// The reverse, from load_torch_file of what python/dtrain_dcp.py from-dcp
// (or torch.save of get_state_dict's full state dicts) wrote. A structure
// other than the above is a DataError naming what is missing.
ZeroFullState from_fsdp_state_dict(const c10::IValue& state_dict);

}  // namespace dtrain
