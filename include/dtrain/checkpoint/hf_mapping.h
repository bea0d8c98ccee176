// How a model's parameters become a Hugging Face folder (config.json plus
// safetensors), as data: the model that knows HF's names describes them once
// (rules from its names to HF's, which weights HF stores transposed, tensors
// HF expects that the model lacks, the config.json), and both its own export
// and a tool that knows nothing of the model use that description.
//
// A run that records it in its checkpoints (`hf_mapping_state` added as the
// replicated state kHfMappingState) lets `dtrain ckpt convert --to hf DIR OUT`
// turn a checkpoint folder into a folder transformers loads, with no model
// code in the tool:
//
//   trainer.add_checkpoint_state(dtrain::checkpoint::kHfMappingState,
//                                dtrain::checkpoint::hf_mapping_state(gpt::hf_mapping(config)));
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/checkpoint/safetensors.h"

namespace dtrain {
class Stateful;
struct CheckpointFolder;
}  // namespace dtrain

namespace dtrain::checkpoint {

// One name rule: a dtrain parameter name that matches `pattern` (a whole-name
// ECMAScript regex) is named regex_replace(name, pattern, replacement) in HF
// ($1... are the groups), stored transposed when `transpose` (GPT-2's Conv1D).
struct HfNameRule {
  std::string pattern;
  std::string replacement;
  bool transpose = false;
};

// A tensor HF's model has and ours does not (e.g. biases of a bias-free
// model): written as zeros, which compute the same.
struct HfZeroTensor {
  std::string name;
  std::vector<std::int64_t> shape;
};

struct HfMapping {
  std::string config_json;        // config.json, as written
  std::vector<HfNameRule> rules;  // the first rule a name matches applies
  std::vector<HfZeroTensor> zeros;

  // HF's name of a dtrain name and whether it is stored transposed; nullopt
  // when no rule matches.
  std::optional<std::pair<std::string, bool>> hf_name(const std::string& name) const;
  // The tensors under HF's names and layouts (contiguous, on the CPU), then
  // the zeros. A name no rule matches is a DataError naming it.
  NamedTensors apply(const NamedTensors& tensors) const;

  std::string to_json() const;
  static HfMapping from_json(const std::string& text);  // DataError when malformed
};

// Writes DIR/config.json and DIR/model.safetensors (or shards and HF's index
// past options.max_shard_bytes) of `tensors` mapped by `mapping`.
void save_hf_folder(const std::filesystem::path& dir, const HfMapping& mapping, const NamedTensors& tensors,
                    const ShardedSafetensorsOptions& options = {.metadata = {{"format", "pt"}}});

// The checkpoint state that records a mapping (replicated, rank 0's
// <kHfMappingState>.pt); loading it changes nothing (the model's mapping
// follows from the model).
inline constexpr const char* kHfMappingState = "hf_mapping";
std::shared_ptr<Stateful> hf_mapping_state(HfMapping mapping);
// The mapping a checkpoint folder recorded; nullopt when it has none.
std::optional<HfMapping> read_hf_mapping(const CheckpointFolder& folder);

}  // namespace dtrain::checkpoint
