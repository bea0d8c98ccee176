// The GPT's ZeRO sharding units, one definition for main.cpp's ModelParts
// (dtrain::parallelize) and the tests and bench/zero that build
// ShardedDataParallel directly.
//
// Sharding units are the transformer blocks; the embedding and the head stay
// in the root unit, because the head's output projection is the token
// embedding (one parameter used at both ends of the network), and the root
// unit is gathered for the whole forward and backward.
#pragma once

#include <string>

#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace gpt {

inline bool is_zero_unit(const std::string& name, const torch::nn::Module& /*layer*/) {
  return name.find(".block") != std::string::npos;
}

// ZeroOptions for --strategy zero1|zero2|zero3 over a Gpt (layers under "layers").
inline dtrain::ZeroOptions zero_options(const std::string& strategy) {
  return {.stage = strategy.back() - '0', .sequential = "layers", .unit_policy = is_zero_unit};
}

}  // namespace gpt
