// Activation recompute under context parallelism (examples/gpt's
// context_parallel.h): the GPT split over cp 2 with --recompute selective
// (the ring attention recomputed in backward, its K/V passed round again)
// or full (the whole block) on one batch. Each rank's gradients equal, bit
// for bit, those of the same cp rank without recompute (the same kernels on
// the same values, the collectives in the same order), and their mean over
// cp equals one process's gradients of the unsplit GPT (rtol 1e-5: the
// blocks' online softmax sums in another order than one kernel over the
// whole sequence), for the ring and the all-gather exchange; the loss, the
// mean over cp, equals one process's.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "context_parallel.h"
#include "cp_gpt_run.h"
#include "dtrain/nn/context_parallel.h"
#include "model.h"
#include "ranks.h"
#include "tensor_checks.h"

namespace {

constexpr auto kCpRecomputeTimeout = std::chrono::seconds(120);

gpt::GptConfig cp_recompute_config(dtrain::Recompute recompute) {
  return dtrain::testing::cp_test_gpt(0.0, recompute);
}

dtrain::testing::CpGptRun cp_recompute_run(const gpt::GptConfig& config, dtrain::dist::ProcessGroup& cp,
                                           dtrain::nn::cp::KvExchange exchange, const at::Tensor& idx,
                                           const at::Tensor& targets) {
  return dtrain::testing::cp_gpt_run(config, 17, cp, {.exchange = exchange}, idx, targets);
}

class GptCpRecompute : public ::testing::TestWithParam<std::tuple<dtrain::Recompute, dtrain::nn::cp::KvExchange>> {};

}  // namespace

TEST_P(GptCpRecompute, GradientsEqualTheCpRunBitwiseAndOneProcess) {
  const auto [recompute, exchange] = GetParam();
  constexpr int kCp = 2;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto ids = at::TensorOptions().dtype(at::kLong);
  const at::Tensor idx = at::randint(65, {3, 16}, gen, ids);
  const at::Tensor targets = at::randint(65, {3, 16}, gen, ids);

  const gpt::GptConfig plain = cp_recompute_config(dtrain::Recompute::kNone);
  gpt::Gpt reference(plain);
  gpt::init_weights(*reference, plain.n_layer, 17);
  const at::Tensor loss = gpt::lm_loss(reference(idx), targets);
  loss.backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : reference->layers->named_parameters()) grads[item.key()] = item.value().grad();

  dtrain::testing::run_rank_threads(
      kCp,
      [&](int rank, dtrain::dist::Store store) {
        auto cp = dtrain::dist::init_process_group(store, rank, kCp, {.timeout = kCpRecomputeTimeout});
        const std::string what = "cp rank " + std::to_string(rank) + " recompute " + dtrain::to_string(recompute);
        const dtrain::testing::CpGptRun without = cp_recompute_run(plain, cp, exchange, idx, targets);
        const dtrain::testing::CpGptRun with =
            cp_recompute_run(cp_recompute_config(recompute), cp, exchange, idx, targets);
        EXPECT_TRUE(at::equal(with.loss, without.loss)) << what << ": loss " << with.loss << " vs " << without.loss;
        dtrain::testing::expect_all_close(with.loss, loss.detach(), what + " loss against one process");
        ASSERT_EQ(with.grads.size(), grads.size()) << what;
        for (const auto& [name, g] : with.grads) {
          ASSERT_TRUE(without.grads.count(name) && grads.count(name)) << what << ": " << name;
          EXPECT_TRUE(at::equal(g, without.grads.at(name)))
              << what << ": grad of " << name << " differs from cp "
              << "without recompute by up to " << (g - without.grads.at(name)).abs().max().item<float>();
          // The whole sequence's gradient: the mean over cp (what
          // ContextParallelStrategy averages).
          at::Tensor mean = g.clone();
          cp.all_reduce(mean).wait();
          mean.div_(kCp);
          dtrain::testing::expect_all_close(mean, grads.at(name), what + " mean grad of " + name + " vs one process");
        }
      },
      {.timeout = kCpRecomputeTimeout});
}

INSTANTIATE_TEST_SUITE_P(Modes, GptCpRecompute,
                         ::testing::Combine(::testing::Values(dtrain::Recompute::kSelective, dtrain::Recompute::kFull),
                                            ::testing::Values(dtrain::nn::cp::KvExchange::kRing,
                                                              dtrain::nn::cp::KvExchange::kAllGather)),
                         [](const auto& info) {
                           return dtrain::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == dtrain::nn::cp::KvExchange::kRing ? "_ring"
                                                                                                : "_allgather");
                         });
