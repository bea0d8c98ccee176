// Checkpointer across ranks (processes over Gloo): each rank's own generator
// state and per-rank parts resume exactly, also when ranks are seeded
// differently; an error on one rank mid-save commits nothing and leaves the
// previous checkpoint loadable on every rank.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cstdlib>
#include <filesystem>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "ranks.h"

namespace fs = std::filesystem;
using dtrain::testing::run_rank_processes;

namespace {
constexpr int kWorld = 2;

dtrain::dist::GroupOptions options() {
  return {.timeout = std::chrono::seconds(20)};
}

// A per-rank counter, saved as a per-rank part.
struct Counter : dtrain::Stateful {
  std::int64_t value = 0;
  int fail_at = -1;  // throw when saving with this value
  void save_state(torch::serialize::OutputArchive& archive) const override {
    DTRAIN_CHECK(value != fail_at, DataError, "disk full (simulated) at " << value << ".", "free space");
    archive.write("value", at::tensor(value));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    at::Tensor t;
    archive.read("value", t);
    value = t.item<std::int64_t>();
  }
};

// Step s draws from the default generator (as dropout or augmentation would).
at::Tensor draw() {
  return at::rand({3});
}

std::string shared_dir(const std::string& name) {
  return (fs::temp_directory_path() / ("dtrain-ckpt-ranks-" + name + "-" + std::to_string(::getpid()))).string();
}

dtrain::testing::ProcessRanksOptions with_dir(const std::string& dir) {
  return {.env_for_rank = [dir](int) { return std::map<std::string, std::optional<std::string>>{{"CKPT_DIR", dir}}; }};
}
}  // namespace

TEST(CheckpointRanks, EachRankResumesItsOwnGeneratorBitForBit) {
  const auto dir = shared_dir("rng");
  fs::remove_all(dir);
  run_rank_processes(
      kWorld,
      [](int rank) {
        auto group = dtrain::dist::init_process_group(options());
        const fs::path dir = std::getenv("CKPT_DIR");
        // Uninterrupted: 10 steps from seed 100 + rank.
        at::manual_seed(100 + rank);
        std::vector<at::Tensor> reference;
        for (int s = 0; s < 10; ++s) reference.push_back(draw());
        // The ranks' streams differ.
        const auto all = group.all_gather(reference[7]);
        EXPECT_FALSE(at::equal(all[0], all[1]));

        // Interrupted after 7 steps, checkpoints at 3 and 6.
        at::manual_seed(100 + rank);
        auto counter = std::make_shared<Counter>();
        dtrain::Checkpointer ckpt({.dir = dir}, group);
        ckpt.add_state("counter", counter, dtrain::StateScope::kPerRank);
        for (int s = 0; s < 7; ++s) {
          draw();
          counter->value = (s + 1) * 10 + rank;
          if ((s + 1) % 3 == 0) ckpt.save({.step = s + 1});
        }
        // A restart: other seeds, a fresh counter.
        at::manual_seed(7);
        counter->value = -1;
        const auto resumed = ckpt.load_latest();
        ASSERT_TRUE(resumed.has_value());
        EXPECT_EQ(resumed->step, 6);
        EXPECT_EQ(counter->value, 60 + rank);
        for (int s = 6; s < 10; ++s) EXPECT_TRUE(at::equal(draw(), reference[s])) << "rank " << rank << " step " << s;
        if (rank == 0) {
          EXPECT_TRUE(fs::exists(dir / "step_6" / "rank_1" / "rng.pt"));
          EXPECT_TRUE(fs::exists(dir / "step_6" / "rank_1" / "counter.pt"));
        }
      },
      with_dir(dir));
  fs::remove_all(dir);
}

TEST(CheckpointRanks, AFailureOnOneRankMidSaveKeepsThePreviousCheckpoint) {
  const auto dir = shared_dir("fail");
  fs::remove_all(dir);
  run_rank_processes(
      kWorld,
      [](int rank) {
        auto group = dtrain::dist::init_process_group(options());
        const fs::path dir = std::getenv("CKPT_DIR");
        at::manual_seed(200 + rank);
        auto counter = std::make_shared<Counter>();
        if (rank == 1) counter->fail_at = 6;
        dtrain::Checkpointer ckpt({.dir = dir, .keep = 3}, group);
        ckpt.add_state("counter", counter, dtrain::StateScope::kPerRank);
        counter->value = 3;
        ckpt.save({.step = 3});
        const auto after_3 = draw();
        counter->value = 6;
        try {
          ckpt.save({.step = 6});
          ADD_FAILURE() << "rank " << rank << ": the save did not fail";
        } catch (const dtrain::DataError& e) {
          const std::string expected = rank == 1 ? "disk full (simulated)" : "rank 1 failed writing its part";
          EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
        }
        group.barrier();
        EXPECT_EQ(ckpt.complete_steps(), (std::vector<std::int64_t>{3}));
        EXPECT_FALSE(fs::exists(dir / ".tmp_step_6"));
        EXPECT_FALSE(fs::exists(dir / "step_6"));
        at::manual_seed(1);
        const auto resumed = ckpt.load_latest();
        ASSERT_TRUE(resumed.has_value());
        EXPECT_EQ(resumed->step, 3);
        EXPECT_EQ(counter->value, 3);
        EXPECT_TRUE(at::equal(draw(), after_3));
      },
      with_dir(dir));
  fs::remove_all(dir);
}
