// Checkpoints under tensor parallelism (TensorParallelStrategy's save/load
// through layout_state and the Checkpointer): the GPT trained 2 steps at
// tp 2, saved, resumed at tp 1, 2 and 4 (each rank filling its parts from the
// saved boxes that meet them: the vocabulary's 33 + 32 rows into 17 + 17 +
// 17 + 14, the fused QKV's heads) and trained 2 more steps, ends where one
// uninterrupted process does after 4 steps (SGD with momentum: the momentum
// buffers move through their layouts too; rtol 1e-5). AdamW's state saved at
// tp 2 and loaded at tp 4 is, bit for bit, the saved state's parts.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/trainer/tp_strategy.h"
#include "model.h"
#include "ranks.h"
#include "tensor_parallel.h"

namespace {

using TpSequentialStrategy = dtrain::TensorParallelStrategy<torch::nn::Sequential>;

gpt::GptConfig checkpoint_config() {
  return {.vocab_size = 65, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32, .dropout = 0.0, .bias = true};
}

std::filesystem::path tp_checkpoint_dir(const std::string& name) {
  auto dir =
      std::filesystem::temp_directory_path() / ("dtrain-tp-checkpoint-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

std::vector<std::pair<at::Tensor, at::Tensor>> checkpoint_batches(int steps) {
  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto ids = at::TensorOptions().dtype(at::kLong);
  for (int s = 0; s < steps; ++s)
    batches.emplace_back(at::randint(65, {3, 16}, gen, ids), at::randint(65, {3, 16}, gen, ids));
  return batches;
}

// This rank's tp GPT and its strategy; weights from init seed `seed`.
struct TpTrainee {
  std::shared_ptr<dtrain::dist::DeviceMesh> mesh;
  torch::nn::Sequential layers{nullptr};
  std::shared_ptr<TpSequentialStrategy> strategy;

  TpTrainee(dtrain::dist::ProcessGroup group, int tp, std::uint64_t seed) {
    mesh = std::make_shared<dtrain::dist::DeviceMesh>(group, std::vector<dtrain::dist::MeshDim>{{"tp", tp}});
    const gpt::GptConfig config = checkpoint_config();
    torch::nn::Sequential full = gpt::gpt_layers(config);
    gpt::init_weights(*full, config.n_layer, seed);
    layers = gpt::apply_tp(full, *mesh, {});
    strategy = std::make_shared<TpSequentialStrategy>(layers, mesh, c10::Device(c10::kCPU));
  }
  void step(torch::optim::Optimizer& opt, const std::pair<at::Tensor, at::Tensor>& batch) {
    opt.zero_grad();
    gpt::tp_lm_loss(strategy->forward(batch.first), batch.second, (*mesh)["tp"], 65).backward();
    opt.step();
  }
};

const torch::optim::SGDOptions kCheckpointSgd = torch::optim::SGDOptions(0.1).momentum(0.9);

}  // namespace

TEST(GptTpCheckpoint, SavedAtTp2ResumedAtTp1And2And4EqualsUninterrupted) {
  constexpr int kSteps = 4, kSaveAt = 2;
  const auto batches = checkpoint_batches(kSteps);
  const gpt::GptConfig config = checkpoint_config();
  gpt::Gpt reference(config);
  gpt::init_weights(*reference, config.n_layer, 13);
  torch::optim::SGD reference_opt(reference->parameters(), kCheckpointSgd);
  for (const auto& [idx, targets] : batches) {
    reference_opt.zero_grad();
    gpt::lm_loss(reference(idx), targets).backward();
    reference_opt.step();
  }
  std::map<std::string, at::Tensor> finals;
  for (const auto& item : reference->layers->named_parameters()) finals[item.key()] = item.value().detach();

  const auto dir = tp_checkpoint_dir("sgd");
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    TpTrainee t(group, 2, 13);
    torch::optim::SGD opt(t.layers->parameters(), kCheckpointSgd);
    for (int s = 0; s < kSaveAt; ++s) t.step(opt, batches[static_cast<std::size_t>(s)]);
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    t.strategy->save(checkpointer, {.step = kSaveAt}, opt);
  });

  for (int tp : {1, 2, 4}) {
    dtrain::testing::run_rank_threads(tp, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, tp, {.timeout = std::chrono::seconds(60)});
      TpTrainee t(group, tp, 99);  // other weights: the checkpoint must replace them
      torch::optim::SGD opt(t.layers->parameters(), kCheckpointSgd);
      dtrain::Checkpointer checkpointer({.dir = dir}, group);
      const auto resumed = t.strategy->load(checkpointer, opt);
      ASSERT_TRUE(resumed.has_value());
      EXPECT_EQ(resumed->step, kSaveAt);
      for (int s = kSaveAt; s < kSteps; ++s) t.step(opt, batches[static_cast<std::size_t>(s)]);
      auto params = t.layers->named_parameters();
      for (const auto& [name, layout] : dtrain::dist::named_layouts(*t.layers, *t.mesh)) {
        const at::Tensor& p = params[name];
        const at::Tensor expected =
            dtrain::dist::local_part(finals.at(name).reshape(layout.global_shape), layout, t.mesh->coordinates())
                .reshape(p.sizes());
        const double scale = std::max(1.0, expected.abs().max().item<double>());
        EXPECT_TRUE(at::allclose(p.detach(), expected, 1e-5, 1e-6 * scale))
            << "tp " << tp << " rank " << rank << ": " << name << " differs by "
            << (p.detach() - expected).abs().max().item<double>();
      }
    });
  }
  std::filesystem::remove_all(dir);
}

TEST(GptTpCheckpoint, AdamWStateSavedAtTp2LoadsAsItsPartsAtTp4) {
  const auto batches = checkpoint_batches(2);
  const auto dir = tp_checkpoint_dir("adamw");
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  // Full tensors assembled from the tp 2 ranks' parts, by key.
  std::map<std::string, at::Tensor> saved;
  std::mutex saved_mutex;
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    TpTrainee t(group, 2, 13);
    torch::optim::AdamW opt(t.layers->parameters(), adamw);
    for (const auto& batch : batches) t.step(opt, batch);
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    t.strategy->save(checkpointer, {.step = 2}, opt);
    auto params = t.layers->named_parameters();
    std::lock_guard<std::mutex> lock(saved_mutex);
    for (const auto& [name, layout] : dtrain::dist::named_layouts(*t.layers, *t.mesh)) {
      const at::Tensor& p = params[name];
      const auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      EXPECT_EQ(s.step(), 2);
      for (const auto& [what, local] : std::vector<std::pair<std::string, at::Tensor>>{
               {"param", p.detach()}, {"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}}) {
        at::Tensor& global = saved[name + "." + what];
        if (!global.defined()) global = at::zeros(layout.global_shape);
        dtrain::dist::local_part(global, layout, t.mesh->coordinates())
            .copy_(local.reshape(dtrain::dist::local_part(global, layout, t.mesh->coordinates()).sizes()));
      }
    }
  });

  dtrain::testing::run_rank_threads(4, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 4, {.timeout = std::chrono::seconds(60)});
    TpTrainee t(group, 4, 99);
    torch::optim::AdamW opt(t.layers->parameters(), adamw);  // no state yet: the load creates it
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    ASSERT_TRUE(t.strategy->load(checkpointer, opt).has_value());
    auto params = t.layers->named_parameters();
    for (const auto& [name, layout] : dtrain::dist::named_layouts(*t.layers, *t.mesh)) {
      const at::Tensor& p = params[name];
      ASSERT_TRUE(opt.state().count(p.unsafeGetTensorImpl())) << name;
      const auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      EXPECT_EQ(s.step(), 2) << name;
      for (const auto& [what, local] : std::vector<std::pair<std::string, at::Tensor>>{
               {"param", p.detach()}, {"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}}) {
        const at::Tensor expected =
            dtrain::dist::local_part(saved.at(name + "." + what), layout, t.mesh->coordinates()).reshape(local.sizes());
        EXPECT_TRUE(at::equal(local, expected)) << "tp 4 rank " << rank << ": " << name << " " << what;
      }
    }
  });
  std::filesystem::remove_all(dir);
}
