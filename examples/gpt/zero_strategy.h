// --strategy zero1|zero2|zero3: the GPT under dtrain::ShardedDataParallel.
//
// Sharding units are the transformer blocks; the embedding and the head stay
// in the root unit, because the head's output projection is the token
// embedding (one parameter used at both ends of the network), and the root
// unit is gathered for the whole forward and backward.
#pragma once

#include <memory>
#include <string>
#include <unordered_set>

#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace gpt {

inline bool is_zero_strategy(const std::string& strategy) {
  return strategy == "zero1" || strategy == "zero2" || strategy == "zero3";
}

inline dtrain::ZeroOptions zero_options(const std::string& strategy) {
  return {.stage = strategy.back() - '0',
          .sequential = "layers",
          .unit_policy = [](const std::string& name, const torch::nn::Module&) {
            return name.find(".block") != std::string::npos;
          }};
}

// nanoGPT decays matrices and embeddings, not gains: decided on the full
// parameter's dimension, since the shards are 1-D pieces.
inline std::function<bool(const at::Tensor&)> zero_decays(const dtrain::ShardedDataParallel& sdp) {
  auto matrices = std::make_shared<std::unordered_set<const void*>>();
  for (const auto& s : sdp.parameter_shards()) {
    if (s.parameter.dim() >= 2) matrices->insert(s.shard.unsafeGetTensorImpl());
  }
  return [matrices](const at::Tensor& p) { return matrices->count(p.unsafeGetTensorImpl()) > 0; };
}

}  // namespace gpt
