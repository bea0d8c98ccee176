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
#include "dtrain/trainer/strategy.h"
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

  // `prefix`: the checkpoint names' (set_checkpoint_prefix); "layers."
  // names them as gpt::Gpt's parameters, as parallelize does.
  TpTrainee(dtrain::dist::ProcessGroup group, int tp, std::uint64_t seed, const std::string& prefix = "") {
    mesh = std::make_shared<dtrain::dist::DeviceMesh>(group, std::vector<dtrain::dist::MeshDim>{{"tp", tp}});
    const gpt::GptConfig config = checkpoint_config();
    torch::nn::Sequential full = gpt::gpt_layers(config);
    gpt::init_weights(*full, config.n_layer, seed);
    layers = gpt::apply_tp(full, *mesh, {});
    strategy = std::make_shared<TpSequentialStrategy>(layers, mesh, c10::Device(c10::kCPU));
    strategy->set_checkpoint_prefix(prefix);
  }
  void step(torch::optim::Optimizer& opt, const std::pair<at::Tensor, at::Tensor>& batch) {
    opt.zero_grad();
    gpt::tp_lm_loss(strategy->forward(batch.first), batch.second, (*mesh)["tp"], 65).backward();
    opt.step();
  }
};

const torch::optim::SGDOptions kCheckpointSgd = torch::optim::SGDOptions(0.1).momentum(0.9);

// gpt::Gpt (parameters "layers.<...>") trained `steps` SGD steps from init
// seed `seed` on `batches` (from `first`), as one process.
void train_whole(gpt::Gpt& model, torch::optim::Optimizer& opt,
                 const std::vector<std::pair<at::Tensor, at::Tensor>>& batches, int first, int last) {
  for (int s = first; s < last; ++s) {
    opt.zero_grad();
    gpt::lm_loss(model(batches[static_cast<std::size_t>(s)].first), batches[static_cast<std::size_t>(s)].second)
        .backward();
    opt.step();
  }
}

// One process's parameters (by the layer list's names) after SGD on every
// batch from init seed 13: what every resumed run must end at.
std::map<std::string, at::Tensor> uninterrupted_finals(const std::vector<std::pair<at::Tensor, at::Tensor>>& batches) {
  const gpt::GptConfig config = checkpoint_config();
  gpt::Gpt reference(config);
  gpt::init_weights(*reference, config.n_layer, 13);
  torch::optim::SGD opt(reference->parameters(), kCheckpointSgd);
  train_whole(reference, opt, batches, 0, static_cast<int>(batches.size()));
  std::map<std::string, at::Tensor> finals;
  for (const auto& item : reference->layers->named_parameters()) finals[item.key()] = item.value().detach();
  return finals;
}

// Each of `t`'s parts against its box of the whole tensors `finals` (the
// module's own names), rtol 1e-5.
void expect_parts_equal(TpTrainee& t, const std::map<std::string, at::Tensor>& finals, const std::string& what) {
  auto params = t.layers->named_parameters();
  for (const auto& [name, layout] : dtrain::dist::named_layouts(*t.layers, *t.mesh)) {
    const at::Tensor& p = params[name];
    const at::Tensor expected =
        dtrain::dist::local_part(finals.at(name).reshape(layout.global_shape), layout, t.mesh->coordinates())
            .reshape(p.sizes());
    const double scale = std::max(1.0, expected.abs().max().item<double>());
    EXPECT_TRUE(at::allclose(p.detach(), expected, 1e-5, 1e-6 * scale))
        << what << ": " << name << " differs by " << (p.detach() - expected).abs().max().item<double>();
  }
}

}  // namespace

TEST(GptTpCheckpoint, SavedAtTp2ResumedAtTp1And2And4EqualsUninterrupted) {
  constexpr int kSteps = 4, kSaveAt = 2;
  const auto batches = checkpoint_batches(kSteps);
  const std::map<std::string, at::Tensor> finals = uninterrupted_finals(batches);

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
      expect_parts_equal(t, finals, "tp " + std::to_string(tp) + " rank " + std::to_string(rank));
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

// tp <-> one process, both ways, through the laid-out format every plan
// shares (the whole model's names, "layers.<...>"; the fused QKV saved as
// [3, C, C] at tp and [3C, C] whole: Note [Another shape of the same
// tensor]): 2 SGD steps at tp 2, saved, 2 more in one process; and 2 in one
// process, saved, 2 more at tp 2. Both end where 4 uninterrupted steps do.
TEST(GptTpCheckpoint, SavedAtTp2ResumesInOneProcessAndBack) {
  constexpr int kSteps = 4, kSaveAt = 2;
  const auto batches = checkpoint_batches(kSteps);
  const gpt::GptConfig config = checkpoint_config();
  const std::map<std::string, at::Tensor> finals = uninterrupted_finals(batches);
  const auto expect_whole_equal = [&](gpt::Gpt& model) {
    for (const auto& item : model->layers->named_parameters()) {
      const at::Tensor& expected = finals.at(item.key());
      EXPECT_TRUE(at::allclose(item.value().detach(), expected, 1e-5, 1e-6))
          << "one process: " << item.key() << " differs by "
          << (item.value().detach() - expected).abs().max().item<double>();
    }
  };

  const auto to_whole = tp_checkpoint_dir("to-whole");
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    TpTrainee t(group, 2, 13, "layers.");
    torch::optim::SGD opt(t.layers->parameters(), kCheckpointSgd);
    for (int s = 0; s < kSaveAt; ++s) t.step(opt, batches[static_cast<std::size_t>(s)]);
    dtrain::Checkpointer checkpointer({.dir = to_whole}, group);
    t.strategy->save(checkpointer, {.step = kSaveAt}, opt);
  });
  {
    gpt::Gpt model(config);
    gpt::init_weights(*model, config.n_layer, 99);  // other weights: the checkpoint must replace them
    torch::optim::SGD opt(model->parameters(), kCheckpointSgd);
    dtrain::SingleDeviceStrategy<gpt::Gpt> single(model, c10::Device(c10::kCPU));
    dtrain::Checkpointer checkpointer({.dir = to_whole});
    const auto resumed = single.load(checkpointer, opt);
    ASSERT_TRUE(resumed.has_value());
    EXPECT_EQ(resumed->step, kSaveAt);
    train_whole(model, opt, batches, kSaveAt, kSteps);
    expect_whole_equal(model);
  }

  const auto from_whole = tp_checkpoint_dir("from-whole");
  {
    gpt::Gpt model(config);
    gpt::init_weights(*model, config.n_layer, 13);
    torch::optim::SGD opt(model->parameters(), kCheckpointSgd);
    train_whole(model, opt, batches, 0, kSaveAt);
    dtrain::SingleDeviceStrategy<gpt::Gpt> single(model, c10::Device(c10::kCPU));
    dtrain::Checkpointer checkpointer({.dir = from_whole});
    single.save(checkpointer, {.step = kSaveAt}, opt);
  }
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    TpTrainee t(group, 2, 99, "layers.");
    torch::optim::SGD opt(t.layers->parameters(), kCheckpointSgd);
    dtrain::Checkpointer checkpointer({.dir = from_whole}, group);
    const auto resumed = t.strategy->load(checkpointer, opt);
    ASSERT_TRUE(resumed.has_value());
    EXPECT_EQ(resumed->step, kSaveAt);
    for (int s = kSaveAt; s < kSteps; ++s) t.step(opt, batches[static_cast<std::size_t>(s)]);
    expect_parts_equal(t, finals, "tp 2 rank " + std::to_string(rank));
  });
  std::filesystem::remove_all(to_whole);
  std::filesystem::remove_all(from_whole);
}

// A tp checkpoint as TensorParallelStrategy wrote it before tp checkpoints
// were laid out (state "tp", the module's own names: the code it ran then)
// loads into today's strategy, which names its parameters "layers.<...>":
// every part and its AdamW state bit for bit, at the saved step.
TEST(GptTpCheckpoint, StateSavedBeforeLaidOutStillLoads) {
  const auto batches = checkpoint_batches(2);
  const auto dir = tp_checkpoint_dir("legacy");
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  std::map<std::string, at::Tensor> saved;  // "<rank>.<name>.<what>"
  std::mutex saved_mutex;
  const auto parts_of = [](TpTrainee& t, torch::optim::AdamW& opt) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& item : t.layers->named_parameters()) {
      const auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(item.value().unsafeGetTensorImpl()));
      EXPECT_EQ(s.step(), 2) << item.key();
      out.emplace_back(item.key() + ".param", item.value().detach().clone());
      out.emplace_back(item.key() + ".exp_avg", s.exp_avg().clone());
      out.emplace_back(item.key() + ".exp_avg_sq", s.exp_avg_sq().clone());
    }
    return out;
  };
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    TpTrainee t(group, 2, 13);
    torch::optim::AdamW opt(t.layers->parameters(), adamw);
    for (const auto& batch : batches) t.step(opt, batch);
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    checkpointer.add_state("tp", dtrain::layout_state(*t.layers, *t.mesh, &opt), dtrain::StateScope::kSharded);
    checkpointer.save({.step = 2});
    std::lock_guard<std::mutex> lock(saved_mutex);
    for (auto& [key, value] : parts_of(t, opt)) saved[std::to_string(rank) + "." + key] = value;
  });
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    TpTrainee t(group, 2, 99, "layers.");
    torch::optim::AdamW opt(t.layers->parameters(), adamw);
    dtrain::Checkpointer checkpointer({.dir = dir}, group);
    const auto resumed = t.strategy->load(checkpointer, opt);
    ASSERT_TRUE(resumed.has_value());
    EXPECT_EQ(resumed->step, 2);
    for (auto& [key, value] : parts_of(t, opt))
      EXPECT_TRUE(at::equal(value, saved.at(std::to_string(rank) + "." + key))) << "rank " << rank << ": " << key;
  });
  std::filesystem::remove_all(dir);
}
