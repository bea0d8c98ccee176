// Dropout under tensor parallelism (Note [TP dropout] in tensor_parallel.h).
//
// What the reference is: the tp ranks draw their masks from their own
// streams (RngTracker), so no single process draws the same masks from its
// one generator, and "tp 2 equals one process" cannot hold mask for mask.
// What must hold is that tp with dropout computes the unsplit GPT with
// *some* masks, the right ones: the masks the ranks drew, put together
// (attention masks concatenated over the heads in rank order, masks of
// sequence-parallel regions over the sequence, the replicated regions' masks
// equal on every rank and taken once). So each rank records its masks, and
// the unsplit GPT, written out op by op with torch's own attention kernel
// (at::_scaled_dot_product_attention_math with a dropout_mask) and those
// masks, is the reference for the loss, the logits and every gradient.
// Also: masks of the replicated regions are equal across tp ranks, those of
// the split regions differ per rank, and the same seeds give the same masks.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/nn/linear.h"
#include "dtrain/nn/rng_tracker.h"
#include "model.h"
#include "ranks.h"
#include "tensor_checks.h"
#include "tensor_parallel.h"

using dtrain::testing::expect_all_close;

namespace {

constexpr double kDropoutP = 0.25;

struct DrawnMask {
  std::string stream;
  at::Tensor mask;
};

// One rank's forward and backward under tp with dropout.
struct TpDropoutRank {
  std::vector<DrawnMask> masks;
  at::Tensor logits, loss;
  std::map<std::string, at::Tensor> grads;
  std::map<std::string, dtrain::dist::Layout> layouts;
  std::vector<int> coordinates;
};

gpt::GptConfig dropout_config() {
  return {
      .vocab_size = 65, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32, .dropout = kDropoutP, .bias = true};
}

std::vector<TpDropoutRank> run_tp_with_dropout(int world, bool sp, const at::Tensor& idx, const at::Tensor& targets) {
  const gpt::GptConfig config = dropout_config();
  std::vector<TpDropoutRank> ranks(static_cast<std::size_t>(world));
  dtrain::testing::run_rank_threads(
      world,
      [&](int rank, dtrain::dist::Store store) {
        auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(60)});
        dtrain::dist::DeviceMesh mesh(group, {{"tp", world}});
        TpDropoutRank& out = ranks[static_cast<std::size_t>(rank)];
        auto rng = std::make_shared<dtrain::nn::RngTracker>(dtrain::nn::RngTracker::for_tp(21, rank));
        rng->set_observer([&out](const std::string& stream, const at::Tensor& mask) {
          out.masks.push_back({stream, mask.clone()});
        });
        torch::nn::Sequential full = gpt::gpt_layers(config);
        gpt::init_weights(*full, config.n_layer, 11);
        torch::nn::Sequential layers = gpt::apply_tp(full, mesh, {.sequence_parallel = sp, .rng = rng});
        out.logits = layers->forward(idx);
        out.loss = gpt::tp_lm_loss(out.logits, targets, mesh["tp"], config.vocab_size);
        out.loss.backward();
        auto params = layers->named_parameters();
        for (const auto& [name, layout] : dtrain::dist::named_layouts(*layers, mesh)) {
          out.grads[name] = params[name].grad();
          out.layouts.emplace(name, layout);
        }
        out.coordinates = mesh.coordinates();
      },
      {.timeout = std::chrono::seconds(120)});
  return ranks;
}

// The unsplit GPT op by op, dropping with `masks` in the tp model's order of
// draws (embedding; per block: attention probabilities, attention branch,
// MLP branch); without masks, no dropout.
at::Tensor unsplit_logits_with_masks(gpt::GptImpl& model, const at::Tensor& idx, const std::vector<at::Tensor>& masks) {
  std::size_t next = 0;
  const bool dropping = !masks.empty();
  auto drop = [&](const at::Tensor& x) {
    return dropping ? dtrain::nn::apply_dropout_mask(x, masks.at(next++), kDropoutP) : x;
  };
  auto& layers = model.layers;
  auto& embed = *layers->ptr<gpt::EmbedImpl>(0);
  const std::int64_t b = idx.size(0), t = idx.size(1), c = embed.config.n_embd, h = embed.config.n_head;
  at::Tensor x = drop(embed.wte(idx) + embed.wpe(at::arange(t, idx.options())));
  for (std::size_t i = 1; i + 1 < layers->size(); ++i) {
    auto& block = *layers->ptr<gpt::BlockImpl>(i);
    auto& attn = *block.attn;
    auto qkv = at::linear(block.ln_1(x), attn.c_attn->weight, attn.c_attn->bias).split(c, 2);
    auto heads = [&](const at::Tensor& m) { return m.view({b, t, h, c / h}).transpose(1, 2); };
    std::optional<at::Tensor> probs_mask;
    if (dropping) probs_mask = masks.at(next++);
    const at::Tensor y = std::get<0>(at::_scaled_dot_product_attention_math(
        heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {}, dropping ? kDropoutP : 0.0, /*is_causal=*/true, probs_mask));
    x = x + drop(at::linear(y.transpose(1, 2).contiguous().view({b, t, c}), attn.c_proj->weight, attn.c_proj->bias));
    auto& mlp = *block.mlp;
    const at::Tensor hidden = at::gelu(at::linear(block.ln_2(x), mlp.c_fc->weight, mlp.c_fc->bias));
    x = x + drop(at::linear(hidden, mlp.c_proj->weight, mlp.c_proj->bias));
  }
  EXPECT_EQ(next, masks.size()) << "masks left over";
  auto& head = *layers->ptr<gpt::HeadImpl>(layers->size() - 1);
  return at::linear(head.ln_f(x), embed.wte->weight);
}

class GptTpDropout : public ::testing::TestWithParam<std::tuple<int, bool>> {};

}  // namespace

TEST_P(GptTpDropout, EqualsTheUnsplitGptWithTheRanksMasks) {
  const auto [world, sp] = GetParam();
  const std::string what = std::string(sp ? "tp+sp " : "tp ") + std::to_string(world);
  const gpt::GptConfig config = dropout_config();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const auto ids = at::TensorOptions().dtype(at::kLong);
  const at::Tensor idx = at::randint(config.vocab_size, {3, 16}, gen, ids);
  const at::Tensor targets = at::randint(config.vocab_size, {3, 16}, gen, ids);

  const std::vector<TpDropoutRank> ranks = run_tp_with_dropout(world, sp, idx, targets);

  // Put the masks together, checking where each was drawn.
  const std::size_t draws = ranks[0].masks.size();
  ASSERT_EQ(draws, 1 + 3 * static_cast<std::size_t>(config.n_layer)) << what;
  std::vector<at::Tensor> masks;
  for (std::size_t i = 0; i < draws; ++i) {
    const bool probs = i % 3 == 1;  // embedding, then per block: probabilities, attention branch, MLP branch
    const std::string expected_stream =
        probs || sp ? dtrain::nn::RngTracker::kTensorParallel : dtrain::nn::RngTracker::kReplicated;
    std::vector<at::Tensor> parts;
    for (const TpDropoutRank& r : ranks) {
      ASSERT_EQ(r.masks.size(), draws) << what;
      EXPECT_EQ(r.masks[i].stream, expected_stream) << what << " draw " << i;
      parts.push_back(r.masks[i].mask);
    }
    if (expected_stream == dtrain::nn::RngTracker::kReplicated) {
      for (const at::Tensor& m : parts) EXPECT_TRUE(at::equal(m, parts[0])) << what << ": replicated mask " << i;
      masks.push_back(parts[0]);
    } else {
      // Heads (probabilities [B, h/t, T, T]) or the sequence ([B, T/t, C]): dimension 1.
      for (std::size_t r = 1; r < parts.size(); ++r)
        EXPECT_FALSE(at::equal(parts[r], parts[0])) << what << ": ranks 0 and " << r << " drew one mask, draw " << i;
      masks.push_back(at::cat(parts, 1));
    }
  }
  // About 1 - p of the elements kept.
  const double kept = masks[1].to(at::kFloat).mean().item<double>();
  EXPECT_NEAR(kept, 1 - kDropoutP, 0.05) << what;

  gpt::Gpt reference(config);
  gpt::init_weights(*reference, config.n_layer, 11);
  {
    // The op-by-op reference without masks is the GPT's forward.
    torch::NoGradGuard no_grad;
    reference->eval();
    expect_all_close(unsplit_logits_with_masks(*reference, idx, {}), reference->forward(idx),
                     "reference without dropout");
    reference->train();
  }
  const at::Tensor logits = unsplit_logits_with_masks(*reference, idx, masks);
  const at::Tensor loss = gpt::lm_loss(logits, targets);
  loss.backward();
  auto reference_params = reference->layers->named_parameters();
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const TpDropoutRank& rank = ranks[r];
    const std::string who = what + " rank " + std::to_string(r);
    expect_all_close(rank.loss.detach(), loss.detach(), who + " loss");
    expect_all_close(rank.logits.detach(), logits.detach().chunk(world, -1)[r], who + " logits");
    ASSERT_EQ(rank.grads.size(), reference_params.size()) << who;
    for (const auto& [name, grad] : rank.grads) {
      const dtrain::dist::Layout& layout = rank.layouts.at(name);
      const at::Tensor expected =
          dtrain::dist::local_part(reference_params[name].grad().reshape(layout.global_shape), layout, rank.coordinates)
              .reshape(grad.sizes());
      expect_all_close(grad, expected, who + " grad of " + name);
    }
  }

  // The same seeds, the same masks.
  if (world == 2) {
    const std::vector<TpDropoutRank> again = run_tp_with_dropout(world, sp, idx, targets);
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      EXPECT_TRUE(at::equal(again[r].loss, ranks[r].loss)) << what << " rerun, rank " << r;
      for (std::size_t i = 0; i < draws; ++i)
        EXPECT_TRUE(at::equal(again[r].masks[i].mask, ranks[r].masks[i].mask)) << what << " rerun, draw " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Degrees, GptTpDropout, ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_sp" : "");
                         });
