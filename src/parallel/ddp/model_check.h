// Private: checks that every rank holds the same model before DDP
// synchronises it, so a mismatch is an error naming the first differing
// parameter instead of a hang or silent corruption.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain::detail {

struct NamedTensor {
  std::string kind;  // "parameter" or "buffer"
  std::string name;
  at::Tensor tensor;
};

// Collective over `group`. Throws ConfigError on every rank, with the same
// message, when any rank's list differs from rank 0's in length, names,
// dtypes or shapes.
void check_same_model_across_ranks(dist::ProcessGroup& group, const std::vector<NamedTensor>& tensors);

}  // namespace dtrain::detail
