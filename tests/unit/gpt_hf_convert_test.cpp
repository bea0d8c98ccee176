// `dtrain ckpt convert --to hf` (tools/dtrain) on the checkpoint of a GPT
// trained under ZeRO-3 on 2 ranks: the run records the GPT's Hugging Face
// mapping in its checkpoints (checkpoint/hf_mapping.h), the tool knows
// nothing of the GPT, and transformers' GPT2LMHeadModel loads the folder it
// writes with no missing or unexpected keys and gives the trained GPT's logits
// (rtol 1e-5) and greedy tokens (tests/data/checkpoint/hf_peer.py check).
// A checkpoint without the mapping is refused with a clear error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <torch/optim/adamw.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "checkpoint_files.h"
#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/checkpoint/hf_mapping.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/zero/sharded_checkpoint.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "hf_export.h"
#include "model.h"
#include "ranks.h"
#include "test_paths.h"
#include "zero_strategy.h"

namespace {

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;

// Runs `dtrain ckpt ...`; its exit status and what it printed (both streams).
std::pair<int, std::string> run_dtrain_ckpt(const std::string& args) {
  const std::string cmd = dtrain::testing::binary_dir() + "/tools/dtrain ckpt " + args + " 2>&1";
  std::string text;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  std::array<char, 4096> buf{};
  while (pipe != nullptr && std::fgets(buf.data(), buf.size(), pipe) != nullptr) text += buf.data();
  const int status = pipe != nullptr ? ::pclose(pipe) : -1;
  return {status, cmd + "\n" + text};
}

const gpt::GptConfig kConvertConfig{
    .vocab_size = 65, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32, .bias = false, .gelu_tanh = false};

// 3 AdamW steps of the GPT under ZeRO-3 on 2 ranks, then a checkpoint in
// `dir` (with the GPT's mapping when `record_mapping`); the trained full
// parameters, by name.
std::map<std::string, at::Tensor> train_zero3_and_save(const fs::path& dir, bool record_mapping) {
  std::map<std::string, at::Tensor> trained;
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    gpt::Gpt model(kConvertConfig);
    gpt::init_weights(*model, kConvertConfig.n_layer, 3);
    dtrain::ShardedDataParallel sdp(model, group, gpt::zero_options("zero3"));
    torch::optim::AdamW opt(sdp.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
    for (int step = 0; step < 3; ++step) {
      const at::Tensor x = at::randint(0, kConvertConfig.vocab_size, {2, 16}, gen, at::kLong);
      const at::Tensor y = at::randint(0, kConvertConfig.vocab_size, {2, 16}, gen, at::kLong);
      opt.zero_grad();
      at::cross_entropy_loss(sdp(x).reshape({-1, kConvertConfig.vocab_size}), y.reshape(-1)).backward();
      opt.step();
    }
    dtrain::Checkpointer ckpt({.dir = dir}, group);
    ckpt.add_state("zero", dtrain::zero_state(sdp, opt), dtrain::StateScope::kSharded);
    if (record_mapping) ckpt.add_state(ck::kHfMappingState, ck::hf_mapping_state(gpt::hf_mapping(kConvertConfig)));
    ckpt.save({.step = 3});
    auto full = sdp.full_state_dict();
    if (rank == 0) trained = std::move(full);
  });
  return trained;
}

}  // namespace

TEST(GptHuggingFace, Zero3CheckpointConvertsToHfThatTransformersLoads) {
  const auto dir = dtrain::testing::ckfiles::temp_dir("gpt-hf", "convert");
  const auto trained = train_zero3_and_save(dir / "ckpt", true);
  const auto [status, text] =
      run_dtrain_ckpt("convert --to hf " + (dir / "ckpt").string() + " " + (dir / "hf").string());
  ASSERT_EQ(status, 0) << text;

  // The GPT's own logits and greedy tokens with the trained weights.
  gpt::Gpt model(kConvertConfig);
  torch::NoGradGuard no_grad;
  std::size_t copied = 0;
  for (auto& item : model->named_parameters()) {
    const auto it = trained.find(item.key());
    ASSERT_NE(it, trained.end()) << item.key();
    item.value().copy_(it->second);
    ++copied;
  }
  EXPECT_EQ(copied, trained.size());
  model->eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor idx = at::randint(0, 65, {3, 16}, gen, at::kLong);
  at::Tensor tokens = idx.narrow(1, 0, 6);
  for (int i = 0; i < 8; ++i) {
    const at::Tensor logits = model->forward(
        tokens.narrow(1, std::max<std::int64_t>(0, tokens.size(1) - 16), std::min<std::int64_t>(16, tokens.size(1))));
    tokens = at::cat({tokens, logits.select(1, -1).argmax(-1, true)}, 1);
  }
  ck::save_safetensors(dir / "hf" / "reference.safetensors", {{"idx", idx},
                                                              {"logits", model->forward(idx).contiguous()},
                                                              {"prompt", idx.narrow(1, 0, 6).contiguous()},
                                                              {"greedy", tokens}});
  dtrain::testing::ckfiles::run_peer("hf_peer.py", "check " + (dir / "hf").string());

  // The folder equals the GPT's own export of the same weights, tensor for tensor.
  gpt::export_hf(*model, kConvertConfig, dir / "exported");
  const auto converted = ck::load_safetensors_dir(dir / "hf").tensors;
  const auto exported = ck::load_safetensors_dir(dir / "exported").tensors;
  ASSERT_EQ(converted.size(), exported.size());
  std::map<std::string, at::Tensor> by_name(exported.begin(), exported.end());
  for (const auto& [name, t] : converted) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_TRUE(at::equal(t, by_name.at(name))) << name;
  }
  fs::remove_all(dir);
}

TEST(GptHuggingFace, ConvertToHfRefusesACheckpointWithoutMapping) {
  const auto dir = dtrain::testing::ckfiles::temp_dir("gpt-hf", "nomapping");
  train_zero3_and_save(dir / "ckpt", false);
  const auto [status, text] =
      run_dtrain_ckpt("convert --to hf " + (dir / "ckpt").string() + " " + (dir / "hf").string());
  EXPECT_NE(status, 0) << text;
  EXPECT_NE(text.find("records no Hugging Face mapping"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(dir / "hf" / "config.json"));
  fs::remove_all(dir);
}
