// Dropout under context parallelism (Note [CP dropout] in examples/gpt's
// context_parallel.h). The reference: one process's GPT in training mode
// whose default generator is seeded just before its forward, so its
// dropouts (the embedding's, each block's attention probabilities, residual
// branch and MLP) draw in a known order. The GPT split over cp 2 with
// dropout generators seeded alike draws the whole sequence's masks in that
// order and keeps its rows: its loss (the mean over cp) and its gradients
// (their mean over cp) equal the reference's (rtol 1e-5: the ring's online
// softmax sums in another order), for the ring and the all-gather exchange;
// with selective or full recompute each rank's gradients equal the cp run
// without recompute bit for bit (the masks are drawn once, before the
// recomputed part). The dropout is not vacuous: it changes the reference's
// gradients.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "context_parallel.h"
#include "cp_gpt_run.h"
#include "dtrain/nn/context_parallel.h"
#include "model.h"
#include "ranks.h"
#include "tensor_checks.h"

namespace {

constexpr auto kCpDropoutTimeout = std::chrono::seconds(120);
constexpr std::uint64_t kCpDropoutSeed = 21;

gpt::GptConfig cp_dropout_config(dtrain::Recompute recompute) {
  return dtrain::testing::cp_test_gpt(0.25, recompute);
}

dtrain::testing::CpGptRun cp_dropout_run(const gpt::GptConfig& config, dtrain::dist::ProcessGroup& cp,
                                         dtrain::nn::cp::KvExchange exchange, const at::Tensor& idx,
                                         const at::Tensor& targets) {
  return dtrain::testing::cp_gpt_run(
      config, 19, cp,
      {.exchange = exchange, .dropout_generator = at::make_generator<at::CPUGeneratorImpl>(kCpDropoutSeed)}, idx,
      targets);
}

class GptCpDropout : public ::testing::TestWithParam<dtrain::nn::cp::KvExchange> {};

}  // namespace

TEST_P(GptCpDropout, RowsOfOneProcessMasksGiveItsLossAndGradients) {
  const dtrain::nn::cp::KvExchange exchange = GetParam();
  constexpr int kCp = 2;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const auto ids = at::TensorOptions().dtype(at::kLong);
  const at::Tensor idx = at::randint(65, {3, 16}, gen, ids);
  const at::Tensor targets = at::randint(65, {3, 16}, gen, ids);

  const gpt::GptConfig config = cp_dropout_config(dtrain::Recompute::kNone);
  gpt::Gpt reference(config);
  gpt::init_weights(*reference, config.n_layer, 19);
  reference->eval();
  gpt::lm_loss(reference(idx), targets).backward();
  std::map<std::string, at::Tensor> without_dropout;
  for (const auto& item : reference->layers->named_parameters()) {
    without_dropout[item.key()] = item.value().grad().clone();
    item.value().mutable_grad().zero_();
  }
  reference->train();
  at::manual_seed(kCpDropoutSeed);  // the dropouts' generator, as the cp ranks seed theirs
  const at::Tensor loss = gpt::lm_loss(reference(idx), targets);
  loss.backward();
  std::map<std::string, at::Tensor> grads;
  double changed = 0;  // the largest relative change dropout made to a gradient
  for (const auto& item : reference->layers->named_parameters()) {
    grads[item.key()] = item.value().grad();
    const at::Tensor& before = without_dropout.at(item.key());
    changed = std::max(changed, ((grads[item.key()] - before).norm() / before.norm()).item<double>());
  }
  EXPECT_GT(changed, 0.1) << "dropout changed no gradient";

  dtrain::testing::run_rank_threads(
      kCp,
      [&](int rank, dtrain::dist::Store store) {
        auto cp = dtrain::dist::init_process_group(store, rank, kCp, {.timeout = kCpDropoutTimeout});
        const std::string what = "cp rank " + std::to_string(rank);
        const dtrain::testing::CpGptRun plain = cp_dropout_run(config, cp, exchange, idx, targets);
        dtrain::testing::expect_all_close(plain.loss, loss.detach(), what + " loss against one process");
        ASSERT_EQ(plain.grads.size(), grads.size()) << what;
        for (const auto& [name, g] : plain.grads) {
          ASSERT_TRUE(grads.count(name)) << what << ": " << name;
          at::Tensor mean = g.clone();
          cp.all_reduce(mean).wait();
          mean.div_(kCp);
          dtrain::testing::expect_all_close(mean, grads.at(name), what + " mean grad of " + name + " vs one process");
        }
        for (const auto recompute : {dtrain::Recompute::kSelective, dtrain::Recompute::kFull}) {
          const dtrain::testing::CpGptRun again =
              cp_dropout_run(cp_dropout_config(recompute), cp, exchange, idx, targets);
          const std::string mode = what + " recompute " + dtrain::to_string(recompute);
          EXPECT_TRUE(at::equal(again.loss, plain.loss)) << mode << ": loss";
          for (const auto& [name, g] : again.grads) {
            EXPECT_TRUE(at::equal(g, plain.grads.at(name))) << mode << ": grad of " << name << " differs by up to "
                                                            << (g - plain.grads.at(name)).abs().max().item<float>();
          }
        }
      },
      {.timeout = kCpDropoutTimeout});
}

INSTANTIATE_TEST_SUITE_P(Exchanges, GptCpDropout,
                         ::testing::Values(dtrain::nn::cp::KvExchange::kRing, dtrain::nn::cp::KvExchange::kAllGather),
                         [](const auto& info) {
                           return info.param == dtrain::nn::cp::KvExchange::kRing ? "ring" : "allgather";
                         });
