// The GPT cut into pipeline stages: this rank's stages of gpt_layers for a
// pipeline of p ranks with v stages each (stage s on rank s % p), cut by the
// placement planner, with the head's output projection tied to the first
// stage's token embedding (see dtrain::pipeline::TiedParameter).
#pragma once

#include <vector>

#include "dtrain/error.h"
#include "dtrain/parallel/pipeline/pipeline.h"
#include "model.h"

namespace gpt {

// `layers`: a whole gpt_layers Sequential (or its tp or cp split, whose
// layers have the same names), built and initialised alike on every rank
// (its other stages are simply not used here). `stage_of_layer`:
// an explicit cut (one stage index per layer), or empty for the planner's.
inline std::vector<dtrain::pipeline::PipelineStage> pipeline_stages(const torch::nn::Sequential& layers, int ranks,
                                                                    int stages_per_rank, int rank,
                                                                    std::vector<std::size_t> stage_of_layer = {}) {
  const int n = ranks * stages_per_rank;
  if (stage_of_layer.empty()) stage_of_layer = dtrain::pipeline::plan_stages(layers, n);
  DTRAIN_CHECK(
      stage_of_layer.size() == layers->size() && stage_of_layer.front() == 0 && int(stage_of_layer.back()) == n - 1,
      ConfigError,
      "a cut of the GPT's " << layers->size() << " layers into " << n
                            << " stages needs one stage index per layer, from 0 to " << n - 1,
      "e.g. 0,0,0,1,1,1 for 4 blocks on 2 stages");
  const std::vector<torch::nn::Sequential> all = dtrain::pipeline::split_stages(layers, stage_of_layer);
  // The token embedding, which the head reads as its output projection: in
  // `layers` one tensor (its tied copy on another rank is that rank's).
  const auto first_params = layers->ptr(0)->named_parameters();
  const at::Tensor* wte = first_params.find("wte.weight");
  DTRAIN_CHECK(wte != nullptr, ConfigError, "the GPT's first layer has no wte.weight to tie the head to.",
               "cut gpt_layers (or its tp or cp split: apply_tp, apply_cp) into stages");
  const at::Tensor embedding = *wte;
  const at::Tensor head_copy = embedding;
  std::vector<dtrain::pipeline::PipelineStage> mine;
  for (int s = rank; s < n; s += ranks) {
    dtrain::pipeline::PipelineStage stage{.module = all[s], .tied = {}};
    if (s == 0 && n > 1) stage.tied.push_back({.parameter = embedding, .other_stage = n - 1, .owner = true});
    if (s == n - 1) stage.tied.push_back({.parameter = head_copy, .other_stage = 0, .owner = n == 1});
    mine.push_back(std::move(stage));
  }
  return mine;
}

}  // namespace gpt
