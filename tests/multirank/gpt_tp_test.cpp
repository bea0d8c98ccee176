// examples/gpt under tensor parallelism (tensor_parallel.h) against the
// unsplit GPT on one batch: on 2 and 4 rank threads, with and without
// sequence parallelism, the vocabulary-split logits, the vocab-parallel loss
// and every parameter's gradient (compared through the parameter's layout,
// the tied embedding included) equal one process's (fp32: rtol 1e-5, atol
// 1e-6 times the tensor's largest |value| where that is above 1); four SGD
// steps give the same loss curve and final parameters. Head count,
// width or vocabulary that tp does not divide: ConfigError naming it.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "model.h"
#include "ranks.h"
#include "tensor_checks.h"
#include "tensor_parallel.h"

using dtrain::testing::expect_all_close;

namespace {

constexpr auto kTimeout = std::chrono::seconds(120);

gpt::GptConfig small_config() {
  return {.vocab_size = 65, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32, .dropout = 0.0, .bias = true};
}

class GptTensorParallel : public ::testing::TestWithParam<std::tuple<int, bool>> {};

}  // namespace

TEST_P(GptTensorParallel, ForwardAndBackwardEqualTheUnsplitGpt) {
  const auto [world, sp] = GetParam();
  const gpt::GptConfig config = small_config();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto ids = at::TensorOptions().dtype(at::kLong);
  const at::Tensor idx = at::randint(config.vocab_size, {3, 16}, gen, ids);
  const at::Tensor targets = at::randint(config.vocab_size, {3, 16}, gen, ids);

  gpt::Gpt reference(config);
  gpt::init_weights(*reference, config.n_layer, 11);
  const at::Tensor logits = reference(idx);
  const at::Tensor loss = gpt::lm_loss(logits, targets);
  loss.backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : reference->layers->named_parameters()) grads[item.key()] = item.value().grad();

  dtrain::testing::run_rank_threads(
      world,
      [&](int rank, dtrain::dist::Store store) {
        auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = kTimeout});
        dtrain::dist::DeviceMesh mesh(group, {{"tp", world}});
        gpt::Gpt full(config);
        gpt::init_weights(*full, config.n_layer, 11);
        torch::nn::Sequential layers = gpt::apply_tp(full->layers, mesh, {.sequence_parallel = sp});
        const std::string what = std::string(sp ? "tp+sp" : "tp") + " rank " + std::to_string(rank);

        const at::Tensor local_logits = layers->forward(idx);
        expect_all_close(local_logits, logits.detach().chunk(world, -1)[static_cast<std::size_t>(rank)],
                         what + " logits (this rank's vocabulary)");
        const at::Tensor tp_loss = gpt::tp_lm_loss(local_logits, targets, mesh["tp"], config.vocab_size);
        expect_all_close(tp_loss, loss.detach(), what + " loss");
        tp_loss.backward();

        const auto layouts = dtrain::dist::named_layouts(*layers, mesh);
        auto params = layers->named_parameters();
        ASSERT_EQ(layouts.size(), grads.size()) << what << ": parameters by name";
        for (const auto& [name, layout] : layouts) {
          ASSERT_TRUE(grads.count(name)) << what << ": no parameter " << name << " in the unsplit GPT";
          const at::Tensor& p = params[name];
          const at::Tensor expected =
              dtrain::dist::local_part(grads[name].reshape(layout.global_shape), layout, mesh.coordinates())
                  .reshape(p.sizes());
          expect_all_close(p.grad(), expected, what + " grad of " + name + " (" + layout.to_string() + ")");
        }
      },
      {.timeout = kTimeout});
}

INSTANTIATE_TEST_SUITE_P(Degrees, GptTensorParallel, ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_sp" : "");
                         });

// Four SGD (momentum) steps on four batches: the TP GPT's loss curve and final
// parameters equal one process's. (SGD rather than Adam: Adam's first step
// is lr * sign(g), which turns a rounding-level difference of a near-zero
// gradient into a full step.)
TEST_P(GptTensorParallel, TrainingStepsEqualTheUnsplitGpt) {
  const auto [world, sp] = GetParam();
  const gpt::GptConfig config = small_config();
  constexpr int kSteps = 4;
  const torch::optim::SGDOptions sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto ids = at::TensorOptions().dtype(at::kLong);
  for (int s = 0; s < kSteps; ++s)
    batches.emplace_back(at::randint(config.vocab_size, {3, 16}, gen, ids),
                         at::randint(config.vocab_size, {3, 16}, gen, ids));

  gpt::Gpt reference(config);
  gpt::init_weights(*reference, config.n_layer, 13);
  torch::optim::SGD reference_opt(reference->parameters(), sgd);
  std::vector<double> losses;
  for (const auto& [idx, targets] : batches) {
    reference_opt.zero_grad();
    const at::Tensor loss = gpt::lm_loss(reference(idx), targets);
    loss.backward();
    reference_opt.step();
    losses.push_back(loss.item<double>());
  }
  std::map<std::string, at::Tensor> finals;
  for (const auto& item : reference->layers->named_parameters()) finals[item.key()] = item.value().detach();

  dtrain::testing::run_rank_threads(
      world,
      [&](int rank, dtrain::dist::Store store) {
        auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = kTimeout});
        dtrain::dist::DeviceMesh mesh(group, {{"tp", world}});
        gpt::Gpt full(config);
        gpt::init_weights(*full, config.n_layer, 13);
        torch::nn::Sequential layers = gpt::apply_tp(full->layers, mesh, {.sequence_parallel = sp});
        torch::optim::SGD opt(layers->parameters(), sgd);
        const std::string what = std::string(sp ? "tp+sp" : "tp") + " rank " + std::to_string(rank);
        for (int s = 0; s < kSteps; ++s) {
          opt.zero_grad();
          const at::Tensor loss =
              gpt::tp_lm_loss(layers->forward(batches[s].first), batches[s].second, mesh["tp"], config.vocab_size);
          loss.backward();
          opt.step();
          expect_all_close(loss.detach(), at::scalar_tensor(losses[s], at::kDouble),
                           what + " loss at step " + std::to_string(s));
        }
        auto params = layers->named_parameters();
        for (const auto& [name, layout] : dtrain::dist::named_layouts(*layers, mesh)) {
          const at::Tensor& p = params[name];
          const at::Tensor expected =
              dtrain::dist::local_part(finals.at(name).reshape(layout.global_shape), layout, mesh.coordinates())
                  .reshape(p.sizes());
          expect_all_close(p.detach(), expected, what + " final " + name);
        }
      },
      {.timeout = kTimeout});
}

TEST(GptTensorParallelConfig, SizesTheDegreeDoesNotDivideAreConfigErrors) {
  auto message = [](gpt::GptConfig c, std::int64_t tp, bool sp) -> std::string {
    try {
      gpt::validate_tp(c, tp, {.sequence_parallel = sp});
    } catch (const dtrain::ConfigError& e) {
      return e.what();
    }
    return "(no ConfigError)";
  };
  gpt::GptConfig c = small_config();
  EXPECT_EQ(message(c, 4, true), "(no ConfigError)");
  c.n_head = 6;
  c.n_embd = 48;
  EXPECT_NE(message(c, 4, false).find("n_head 6 is not divisible by the tp degree 4"), std::string::npos);
  // (n_embd is a multiple of n_head, so tp divides it whenever it divides n_head.)
  c = small_config();
  c.vocab_size = 65;  // the Shakespeare characters: 33 + 32 rows, 17 + 17 + 17 + 14
  EXPECT_EQ(message(c, 2, false), "(no ConfigError)");
  EXPECT_EQ(message(c, 4, false), "(no ConfigError)");
  c.vocab_size = 3;  // pieces of 1 over 4 ranks: the last has none
  EXPECT_NE(message(c, 4, false).find("vocab_size 3 in pieces of 1 over tp 4 leaves the last rank no rows"),
            std::string::npos);
  c = small_config();
  c.block_size = 18;
  EXPECT_EQ(message(c, 4, false), "(no ConfigError)");
  EXPECT_NE(message(c, 4, true).find("block_size"), std::string::npos);
  c = small_config();
  c.dropout = 0.1;
  EXPECT_NE(message(c, 2, false).find("dropout"), std::string::npos);
}
