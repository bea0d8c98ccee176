// Checkpointer: round trip, atomicity (partial and corrupt checkpoints are
// skipped), retention, mismatched models, and resume equal to uninterrupted.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/error.h"

namespace fs = std::filesystem;

namespace {
struct TinyNetImpl : torch::nn::Module {
  explicit TinyNetImpl(int hidden = 8) {
    a = register_module("a", torch::nn::Linear(4, hidden));
    b = register_module("b", torch::nn::Linear(hidden, 2));
    register_buffer("seen", at::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x) { return b(at::dropout(at::relu(a(x)), 0.3, is_training())); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TinyNet);

fs::path temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("dtrain-ckpt-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

// Trains `steps` steps from `from` (0 = fresh), saving every 3 steps.
void train(TinyNet& net, torch::optim::Adam& opt, dtrain::Checkpointer* ckpt, std::int64_t from, std::int64_t steps) {
  for (std::int64_t s = from; s < steps; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(s);
    const auto x = at::randn({5, 4}, gen);
    opt.zero_grad();
    net->forward(x).pow(2).mean().backward();  // dropout draws from the default generator
    opt.step();
    if (ckpt && (s + 1) % 3 == 0)
      ckpt->save({.step = s + 1, .sampler = {.epoch = 0, .consumed = (s + 1) * 5}}, *net, opt);
  }
}

std::vector<at::Tensor> params(TinyNet& net) {
  std::vector<at::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}
}  // namespace

TEST(Checkpoint, ResumeEqualsUninterruptedBitForBit) {
  const auto dir = temp_dir("resume");
  torch::manual_seed(0);
  TinyNet reference;
  torch::optim::Adam ref_opt(reference->parameters(), 1e-2);
  train(reference, ref_opt, nullptr, 0, 10);

  torch::manual_seed(0);
  TinyNet first;
  torch::optim::Adam first_opt(first->parameters(), 1e-2);
  dtrain::Checkpointer ckpt({.dir = dir, .keep = 2});
  train(first, first_opt, &ckpt, 0, 7);  // "crashes" after step 7; newest checkpoint: step 6
  EXPECT_EQ(ckpt.complete_steps(), (std::vector<std::int64_t>{6, 3}));

  torch::manual_seed(123);  // a restart starts from other weights and RNG state
  TinyNet second;
  torch::optim::Adam second_opt(second->parameters(), 1e-2);
  const auto state = ckpt.load_latest(*second, second_opt);
  ASSERT_TRUE(state.has_value());
  EXPECT_EQ(state->step, 6);
  EXPECT_EQ(state->sampler, (dtrain::data::SamplerState{.epoch = 0, .consumed = 30}));
  train(second, second_opt, nullptr, state->step, 10);
  const auto expected = params(reference), got = params(second);
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(at::equal(expected[i], got[i])) << "parameter " << i;
  fs::remove_all(dir);
}

TEST(Checkpoint, PartialAndCorruptCheckpointsAreSkipped) {
  const auto dir = temp_dir("corrupt");
  torch::manual_seed(0);
  TinyNet net;
  torch::optim::Adam opt(net->parameters(), 1e-2);
  dtrain::Checkpointer ckpt({.dir = dir, .keep = 5});
  train(net, opt, &ckpt, 0, 9);  // checkpoints 3, 6, 9
  // 9: a byte flipped in the model file; 6: no MANIFEST (a crash before it was written).
  {
    std::fstream f(dir / "step_9" / "model.pt", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  fs::remove(dir / "step_6" / "MANIFEST");
  // A temporary folder left by a crash mid-save is ignored too.
  fs::create_directories(dir / ".tmp_step_12_999");
  testing::internal::CaptureStderr();
  EXPECT_EQ(ckpt.complete_steps(), (std::vector<std::int64_t>{3}));
  const std::string warnings = testing::internal::GetCapturedStderr();
  EXPECT_NE(warnings.find("step_9: model.pt fails its CRC"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("step_6: no MANIFEST (incomplete)"), std::string::npos) << warnings;
  TinyNet other;
  torch::optim::Adam other_opt(other->parameters(), 1e-2);
  EXPECT_EQ(ckpt.load_latest(*other, other_opt)->step, 3);
  // The next save clears what crashed saves left behind.
  ckpt.save({.step = 4}, *other, other_opt);
  EXPECT_FALSE(fs::exists(dir / ".tmp_step_12_999"));
  EXPECT_EQ(ckpt.complete_steps().front(), 4);
  fs::remove_all(dir);
}

// A full disk (here the file size limit: write() fails with EFBIG, as with
// ENOSPC) is a ConfigError naming the file, not a crash: LibTorch's archive
// writer, told of a short write, threw, and threw again from its destructor,
// which terminated the process (the chaos soak's full disk under fault
// tolerance). The previous checkpoint stays the newest and loads.
TEST(Checkpoint, AFullDiskIsAnErrorNotACrashAndKeepsThePreviousCheckpoint) {
  const auto dir = temp_dir("full");
  torch::manual_seed(0);
  TinyNet net(4096);  // model.pt and optimizer.pt well over the limit below
  torch::optim::Adam opt(net->parameters(), 1e-2);
  dtrain::Checkpointer ckpt({.dir = dir, .keep = 2});
  train(net, opt, &ckpt, 0, 3);  // checkpoint 3
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  rlimit small = before;
  small.rlim_cur = 16 * 1024;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string error;
  try {
    ckpt.save({.step = 4}, *net, opt);
  } catch (const dtrain::ConfigError& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(error.find("cannot write"), std::string::npos) << error;
  EXPECT_NE(error.find("File too large"), std::string::npos) << error;
  EXPECT_EQ(ckpt.complete_steps(), (std::vector<std::int64_t>{3}));
  EXPECT_FALSE(fs::exists(dir / ".tmp_step_4"));
  torch::manual_seed(1);
  TinyNet same(4096);
  torch::optim::Adam same_opt(same->parameters(), 1e-2);
  EXPECT_EQ(ckpt.load_latest(*same, same_opt)->step, 3);
  const auto want = params(net), got = params(same);  // net has not stepped since
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::equal(want[i], got[i])) << "parameter " << i;
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, KeepsTheNewestAndHandlesNone) {
  const auto dir = temp_dir("keep");
  torch::manual_seed(0);
  TinyNet net;
  torch::optim::Adam opt(net->parameters(), 1e-2);
  dtrain::Checkpointer ckpt({.dir = dir, .keep = 2});
  EXPECT_FALSE(ckpt.load_latest(*net, opt).has_value());
  train(net, opt, &ckpt, 0, 12);
  EXPECT_EQ(ckpt.complete_steps(), (std::vector<std::int64_t>{12, 9}));
  fs::remove_all(dir);
}

TEST(Checkpoint, ADifferentModelIsRefused) {
  const auto dir = temp_dir("mismatch");
  TinyNet net;
  torch::optim::Adam opt(net->parameters(), 1e-2);
  dtrain::Checkpointer ckpt({.dir = dir});
  ckpt.save({.step = 1}, *net, opt);
  TinyNet wider(16);
  torch::optim::Adam wider_opt(wider->parameters(), 1e-2);
  try {
    ckpt.load_latest(*wider, wider_opt);
    ADD_FAILURE() << "no error";
  } catch (const dtrain::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("parameter/a.weight has shape [8, 4], the model [16, 4]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(dtrain::Checkpointer({.dir = ""}), dtrain::ConfigError);
  fs::remove_all(dir);
}

namespace {
// A replicated state that records a string; `needed` says whether a resume needs it.
class NoteState : public dtrain::Stateful {
 public:
  explicit NoteState(bool needed) : needed_(needed) {}
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("note", c10::IValue(std::string("run description")));
  }
  void load_state(torch::serialize::InputArchive& /*archive*/) override { ++loads; }
  bool needed_to_resume() const override { return needed_; }
  int loads = 0;

 private:
  bool needed_;
};
}  // namespace

// A state added after a checkpoint was written: one that only describes the
// run (needed_to_resume() false) is skipped, so the checkpoint still
// resumes; a needed one is a DataError naming it.
TEST(Checkpoint, AStateAddedLaterIsSkippedOnlyWhereAResumeDoesNotNeedIt) {
  const auto dir = temp_dir("added-later");
  TinyNet net;
  torch::optim::Adam opt(net->parameters(), 1e-2);
  dtrain::Checkpointer({.dir = dir}).save({.step = 3}, *net, opt);
  {
    dtrain::Checkpointer ckpt({.dir = dir});
    auto note = std::make_shared<NoteState>(false);
    ckpt.add_state("run_note", note);
    const auto resumed = ckpt.load_latest(*net, opt);
    ASSERT_TRUE(resumed.has_value());
    EXPECT_EQ(resumed->step, 3);
    EXPECT_EQ(note->loads, 0);
    ckpt.save({.step = 4}, *net, opt);  // written from now on, and loaded
    EXPECT_EQ(ckpt.load_latest(*net, opt)->step, 4);
    EXPECT_EQ(note->loads, 1);
  }
  fs::remove_all(dir);
  dtrain::Checkpointer({.dir = dir}).save({.step = 3}, *net, opt);
  dtrain::Checkpointer ckpt({.dir = dir});
  ckpt.add_state("needed_note", std::make_shared<NoteState>(true));
  try {
    ckpt.load_latest(*net, opt);
    ADD_FAILURE() << "a checkpoint without a needed state loaded";
  } catch (const dtrain::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("has no needed_note state"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
