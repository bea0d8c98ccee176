// examples/gpt's Hugging Face export and import (hf_export.h) against
// transformers (tests/data/checkpoint/hf_peer.py): an exported GPT loads in
// GPT2LMHeadModel with no key warnings and gives our logits (rtol 1e-5) and
// greedy tokens; a GPT2LMHeadModel made by transformers loads into the GPT and
// gives its logits.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "checkpoint_files.h"
#include "dtrain/checkpoint/safetensors.h"
#include "hf_export.h"
#include "model.h"

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
