// examples/gpt's Hugging Face export and import (hf_export.h) against
// transformers (tests/data/checkpoint/hf_peer.py): an exported GPT loads in
// GPT2LMHeadModel with no key warnings and gives our logits (rtol 1e-5) and
// greedy tokens; a GPT2LMHeadModel made by transformers loads into the GPT and
// gives its logits.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <torch/optim/adamw.h>

#include "checkpoint_files.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "hf_export.h"
#include "model.h"
#include "ranks.h"
#include "zero_strategy.h"

namespace {

namespace fs = std::filesystem;
using dtrain::testing::ckfiles::run_peer;
using dtrain::testing::ckfiles::temp_dir;
namespace ck = dtrain::checkpoint;

at::Tensor tensor(const ck::NamedTensors& tensors, const std::string& name) {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  throw std::runtime_error("no " + name);
}

}  // namespace

TEST(GptHuggingFace, ExportLoadsInTransformersWithEqualLogits) {
  for (const bool bias : {true, false}) {
    const gpt::GptConfig config{
        .vocab_size = 65, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32, .bias = bias, .gelu_tanh = !bias};
    gpt::Gpt model(config);
    gpt::init_weights(*model, config.n_layer, 11);
    torch::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
    for (auto& p : model->parameters()) p.add_(at::randn(p.sizes(), gen) * 0.05);  // norms and biases off 1 and 0
    model->eval();
    const auto dir = temp_dir("gpt-hf", bias ? "bias" : "nobias");
    gpt::export_hf(*model, config, dir);

    const at::Tensor idx = at::randint(0, 65, {3, 16}, gen, at::kLong);
    at::Tensor tokens = idx.narrow(1, 0, 6);
    for (int i = 0; i < 8; ++i) {  // greedy continuation
      const at::Tensor logits = model->forward(
          tokens.narrow(1, std::max<std::int64_t>(0, tokens.size(1) - 16), std::min<std::int64_t>(16, tokens.size(1))));
      tokens = at::cat({tokens, logits.select(1, -1).argmax(-1, true)}, 1);
    }
    ck::save_safetensors(dir / "reference.safetensors", {{"idx", idx},
                                                         {"logits", model->forward(idx).contiguous()},
                                                         {"prompt", idx.narrow(1, 0, 6).contiguous()},
                                                         {"greedy", tokens}});
    run_peer("hf_peer.py", "check " + dir.string());
  }
}

TEST(GptHuggingFace, ImportsTransformersModel) {
  const auto dir = temp_dir("gpt-hf", "import");
  run_peer("hf_peer.py", "make " + dir.string());
  const gpt::GptConfig config = gpt::config_from_hf(dir);
  EXPECT_TRUE(config.gelu_tanh);
  EXPECT_TRUE(config.bias);
  EXPECT_EQ(config.n_embd, 32);
  gpt::Gpt model(config);
  gpt::load_hf(*model, config, dir);
  model->eval();
  torch::NoGradGuard no_grad;
  const auto ref = ck::load_safetensors(dir / "reference.safetensors").tensors;
  const at::Tensor logits = model->forward(tensor(ref, "idx"));
  EXPECT_TRUE(at::allclose(logits, tensor(ref, "logits"), 1e-5, 1e-6))
      << "max |diff| " << (logits - tensor(ref, "logits")).abs().max().item<double>();

  // A model of other sizes is refused, naming the tensor.
  gpt::Gpt wrong(
      gpt::GptConfig{.vocab_size = 65, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16, .bias = true});
  EXPECT_THROW(gpt::load_hf(*wrong, wrong->config, dir), dtrain::DataError);
}

// A GPT2LMHeadModel made by transformers (random, no download) imported and
// trained 5 steps in dtrain under ZeRO-3 on 2 ranks (each half of every
// batch) equals the same 5 steps in Python (AdamW on the whole batch): every
// element within rtol 1e-5, atol 1e-6, plus twice Python's own drift between
// the whole batch and its two halves averaged at that element. Adam divides
// each gradient by its own scale, so an element whose gradient nearly cancels
// moves by rounding noise of up to lr a step, whatever the order of summation
// (ATen's and oneDNN's kernels land such elements on either side of a fixed
// atol); Python's two orders measure that noise for each element.
TEST(GptHuggingFace, TransformersModelTrainedUnderZero3EqualsPython) {
  const auto dir = temp_dir("gpt-hf", "train");
  run_peer("hf_peer.py", "train " + dir.string());
  const gpt::GptConfig config = gpt::config_from_hf(dir);
  const auto batches = ck::load_safetensors(dir / "batches.safetensors", {.copy = true}).tensors;
  std::map<std::string, at::Tensor> trained;
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    gpt::Gpt model(config);
    gpt::load_hf(*model, config, dir);
    dtrain::ShardedDataParallel sdp(model, group, gpt::zero_options("zero3"));
    torch::optim::AdamW opt(sdp.parameters(), torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.1));
    for (int step = 0; step < 5; ++step) {
      const at::Tensor x = tensor(batches, "x" + std::to_string(step)).narrow(0, rank * 2, 2);
      const at::Tensor y = tensor(batches, "y" + std::to_string(step)).narrow(0, rank * 2, 2);
      opt.zero_grad();
      const at::Tensor logits = sdp(x);
      at::cross_entropy_loss(logits.reshape({-1, config.vocab_size}), y.reshape(-1)).backward();
      opt.step();
    }
    auto full = sdp.full_state_dict();
    if (rank == 0) trained = std::move(full);
  });
  gpt::Gpt reference(config), halves(config);
  gpt::load_hf(*reference, config, dir / "trained");
  gpt::load_hf(*halves, config, dir / "trained_halves");
  const auto halves_params = halves->named_parameters();
  std::size_t compared = 0;
  for (const auto& item : reference->named_parameters()) {
    const auto it = trained.find(item.key());
    if (it == trained.end()) continue;  // the tied head: the embedding's
    ++compared;
    at::Tensor ours = it->second, theirs = item.value(), drift = (halves_params[item.key()] - theirs).abs();
    if (item.key().find("c_attn.bias") != std::string::npos) {
      // The key bias's gradient is zero in exact arithmetic (q . b_k shifts a
      // whole row of scores; softmax ignores it), so both sides step it by
      // Adam's normalised rounding noise (up to lr a step): compared apart,
      // within those 5 steps' reach; the query and value biases as the rest.
      const std::int64_t d = config.n_embd;
      EXPECT_LE((ours.narrow(0, d, d) - theirs.narrow(0, d, d)).abs().max().item<double>(), 5 * 1e-3) << item.key();
      ours = at::cat({ours.narrow(0, 0, d), ours.narrow(0, 2 * d, d)});
      theirs = at::cat({theirs.narrow(0, 0, d), theirs.narrow(0, 2 * d, d)});
      drift = at::cat({drift.narrow(0, 0, d), drift.narrow(0, 2 * d, d)});
    }
    const at::Tensor excess = (ours - theirs).abs() - (1e-6 + 1e-5 * theirs.abs() + 2 * drift);
    EXPECT_LE(excess.max().item<double>(), 0.0)
        << item.key() << ": max |diff| " << (ours - theirs).abs().max().item<double>() << ", Python's drift there "
        << drift.flatten()[excess.argmax()].item<double>();
  }
  EXPECT_EQ(compared, trained.size());
  fs::remove_all(dir);
}
