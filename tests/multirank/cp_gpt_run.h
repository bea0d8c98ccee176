// One context-parallel rank's run of a small GPT (examples/gpt's
// context_parallel.h), shared by the cp recompute and dropout tests: the
// model, its split over `cp`, one forward and backward on the whole batch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>

#include "context_parallel.h"
#include "dtrain/comm/process_group.h"
#include "model.h"

namespace dtrain::testing {

// The GPT both tests split: 2 layers, 4 heads, width 32, sequences of 16,
// biases; `dropout` and `recompute` as the case needs.
inline gpt::GptConfig cp_test_gpt(double dropout, dtrain::Recompute recompute) {
  return {.vocab_size = 65,
          .block_size = 16,
          .n_layer = 2,
          .n_head = 4,
          .n_embd = 32,
          .dropout = dropout,
          .bias = true,
          .recompute = recompute};
}

// This cp rank's loss (the mean over cp) and gradients by parameter name.
struct CpGptRun {
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
};

// `config`'s GPT with weights from `init_seed`, split over `cp` with
// `options`, in training mode, on the whole batch (idx, targets).
inline CpGptRun cp_gpt_run(const gpt::GptConfig& config, std::uint64_t init_seed, dtrain::dist::ProcessGroup& cp,
                           const gpt::CpOptions& options, const at::Tensor& idx, const at::Tensor& targets) {
  gpt::Gpt full(config);
  gpt::init_weights(*full, config.n_layer, init_seed);
  torch::nn::Sequential layers = gpt::apply_cp(full->layers, cp, options);
  layers->train();
  CpGptRun out;
  out.loss = gpt::cp_lm_loss(layers->forward(idx), gpt::cp_targets(targets, cp), cp);
  out.loss.backward();
  for (const auto& item : layers->named_parameters()) out.grads[item.key()] = item.value().grad().clone();
  return out;
}

}  // namespace dtrain::testing
