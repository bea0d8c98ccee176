// DDP communication hooks: numerics against plain all-reduce, and training
// Fashion-MNIST to within one accuracy point of plain all-reduce.
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/optim/sgd.h>

#include <filesystem>

#include "ddp_helpers.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/data/fashion_mnist.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "ranks.h"

using dtrain::CommHook;
using dtrain::DistributedDataParallel;
namespace hooks = dtrain::hooks;
using namespace dtrain::testing;

namespace {
dtrain::dist::GroupOptions hook_group_options() {
  return {.timeout = std::chrono::seconds(60)};
}

// Hooks keep per-model state: each rank's DDP gets its own from the factory
// (null factory: DDP's default).
using HookFactory = std::function<std::shared_ptr<CommHook>()>;
std::shared_ptr<CommHook> make(const HookFactory& factory) {
  return factory ? factory() : nullptr;
}

// A user-written hook: sums instead of averaging.
class SumHook : public CommHook {
 public:
  dtrain::dist::Future run(dtrain::dist::ProcessGroup& group, dtrain::GradBucket& bucket) override {
    ++calls;
    return group.all_reduce(bucket.buffer).future();
  }
  int calls = 0;
};

// Trains with `hook` for `steps` steps of per-rank batches; returns rank 0's parameters.
std::vector<at::Tensor> train_mlp(int world, const HookFactory& hook, int steps, double lr = 0.1) {
  std::vector<at::Tensor> result;
  std::mutex mutex;
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, world, hook_group_options());
    DistributedDataParallel ddp(seeded(4, [] { return Mlp(32); }), group, {.comm_hook = make(hook)});
    torch::optim::SGD opt(ddp.module()->parameters(), lr);
    for (int t = 0; t < steps; ++t) {
      const Batch b = batch_for(rank, t, 8);
      opt.zero_grad();
      loss_of(ddp(b.x), b.y).backward();
      opt.step();
    }
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mutex);
      result = snapshot(*ddp.module());
    }
  });
  return result;
}

struct MnistMlpImpl : torch::nn::Module {
  MnistMlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(784, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  at::Tensor forward(at::Tensor x) { return fc2(torch::nn::functional::relu(fc1(x.flatten(1)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MnistMlp);

// Two ranks over the training set; test accuracy.
double mnist_accuracy(const HookFactory& hook) {
  static const dtrain::data::FashionMnist train(dtrain::data::kFashionMnistDefaultDir, dtrain::data::Split::kTrain);
  static const dtrain::data::FashionMnist test(dtrain::data::kFashionMnistDefaultDir, dtrain::data::Split::kTest);
  double accuracy = 0;
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, hook_group_options());
    DistributedDataParallel ddp(seeded(11, [] { return MnistMlp(); }), group, {.comm_hook = make(hook)});
    torch::optim::SGD opt(ddp.module()->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    // Two epochs over all 60k examples (30k per rank); the learning rate
    // decays so the runs end converged, where one point is a real difference.
    constexpr int kPerRank = 30000, kBatch = 64, kEpochs = 2;
    for (int epoch = 0; epoch < kEpochs; ++epoch) {
      auto order = at::randperm(kPerRank, at::make_generator<at::CPUGeneratorImpl>(epoch), at::kLong);
      for (int start = 0; start + kBatch <= kPerRank; start += kBatch) {
        const double progress = (epoch * kPerRank + start) / static_cast<double>(kEpochs * kPerRank);
        for (auto& group_options : opt.param_groups()) {
          static_cast<torch::optim::SGDOptions&>(group_options.options()).lr(0.05 * (1.0 - 0.9 * progress));
        }
        const auto idx = order.slice(0, start, start + kBatch) * 2 + rank;
        const auto batch = train.get_batch(idx);
        opt.zero_grad();
        loss_of(ddp(batch.images), batch.labels).backward();
        opt.step();
      }
    }
    if (rank == 0) {
      torch::NoGradGuard no_grad;
      const auto all = test.all();
      const auto correct = ddp.module()->forward(all.images).argmax(1).eq(all.labels).sum().item<double>();
      accuracy = correct / static_cast<double>(test.size());
    }
  });
  return accuracy;
}
}  // namespace

TEST(DdpHooks, Fp16AndBf16StayCloseToPlainAllReduce) {
  const auto plain = train_mlp(2, {}, 4);
  const auto fp16 = train_mlp(2, hooks::fp16_compress, 4);
  const auto bf16 = train_mlp(2, hooks::bf16_compress, 4);
  EXPECT_TRUE(params_close(fp16, plain, 1e-3, 1e-4));
  EXPECT_TRUE(params_close(bf16, plain, 2e-2, 2e-3));
  EXPECT_FALSE(params_close(bf16, plain, 1e-7, 0)) << "bf16 hook did not change anything: is it running?";
}

TEST(DdpHooks, PowerSgdWarmUpIsPlainAllReduce) {
  const HookFactory powersgd = [] { return hooks::powersgd({.start_iteration = 3}); };
  EXPECT_TRUE(params_close(train_mlp(2, powersgd, 3), train_mlp(2, {}, 3), 1e-6, 1e-7));
  // After warm-up the updates are compressed, so they differ.
  EXPECT_FALSE(params_close(train_mlp(2, powersgd, 6), train_mlp(2, {}, 6), 1e-5, 1e-6));
}

TEST(DdpHooks, PowerSgdRanksStayIdentical) {
  const HookFactory powersgd = [] { return hooks::powersgd({.matrix_approximation_rank = 2, .start_iteration = 2}); };
  run_rank_threads(3, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 3, hook_group_options());
    DistributedDataParallel ddp(seeded(4, [] { return Mlp(32); }), group, {.comm_hook = powersgd()});
    torch::optim::SGD opt(ddp.module()->parameters(), 0.1);
    for (int t = 0; t < 6; ++t) {
      const Batch b = batch_for(rank, t, 8);
      opt.zero_grad();
      loss_of(ddp(b.x), b.y).backward();
      opt.step();
    }
    for (auto& p : ddp.module()->parameters()) {
      const auto all = group.all_gather(p.detach().clone());
      for (const auto& other : all) EXPECT_TRUE(at::equal(other, all[0]));
    }
  });
}

TEST(DdpHooks, CompressedHooksTrainFashionMnistWithinOnePoint) {
  if (!std::filesystem::exists(dtrain::data::kFashionMnistDefaultDir)) GTEST_SKIP() << "no Fashion-MNIST";
  const double plain = mnist_accuracy({});
  EXPECT_GT(plain, 0.85);
  for (const auto& [name, hook] : std::vector<std::pair<std::string, HookFactory>>{
           {"fp16", hooks::fp16_compress},
           {"bf16", hooks::bf16_compress},
           {"powersgd", [] { return hooks::powersgd({.matrix_approximation_rank = 2}); }}}) {
    const double accuracy = mnist_accuracy(hook);
    std::printf("hook %s: test accuracy %.4f (plain all-reduce %.4f)\n", name.c_str(), accuracy, plain);
    EXPECT_NEAR(accuracy, plain, 0.01) << name;
  }
}

TEST(DdpHooks, UserHookRunsForEveryBucketAndDecidesTheReduction) {
  // Summing with lr / world is plain averaging with lr.
  for (int world : {1, 2, 3}) {
    const auto plain = train_mlp(world, {}, 3, 0.1);
    std::vector<std::shared_ptr<SumHook>> made;
    std::mutex mutex;
    const auto summed = train_mlp(
        world,
        [&] {
          auto hook = std::make_shared<SumHook>();
          std::lock_guard<std::mutex> lock(mutex);
          made.push_back(hook);
          return hook;
        },
        3, 0.1 / world);
    EXPECT_TRUE(params_close(summed, plain, 1e-5, 1e-6)) << "world " << world;
    for (const auto& hook : made) EXPECT_GE(hook->calls, 3) << "one call per bucket per step at least";
  }
}
