// Pieces the stage-sync appliers share (stage_sync.cpp defines them), private
// to src/parallel/pipeline/.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <vector>

#include "dtrain/parallel/pipeline/stage_sync.h"

namespace dtrain::pipeline::detail {

// The module alone, for a stage without a data group (or one of size 1).
std::unique_ptr<StageGradientSync> local_stage_sync(torch::nn::Sequential module);

// The module's parameters that take gradients: what a replicated stage's
// optimizer steps on.
std::vector<at::Tensor> trainable_parameters(const torch::nn::Sequential& module);

}  // namespace dtrain::pipeline::detail
