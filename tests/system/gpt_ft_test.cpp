// The GPT example under fault tolerance (issue 27's first test): `dtrain run
// --ft-replicas 4` starts examples/gpt unchanged as 4 replica groups of 2
// ranks, ZeRO-2 inside each (--strategy zero2); the test SIGKILLs rank 0 of
// one group mid-run. The others never stop, the launcher restarts only that
// group, which recovers its shards live from a peer; the shared audit
// (ft_audit.h) and the Trainer's sample log of every rank show no step
// repeated or skipped and no sample consumed twice; and every group's final
// parameters equal, bit for bit, the example's own reference run of the
// recorded membership (--ft-replay: the same ZeRO-2 over 2 ranks, each
// step's members' gradients summed in replica order and divided by their
// count, then clipping, the schedule and AdamW as in the job).
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "example_run.h"
#include "ft_audit.h"
#include "launch_helpers.h"
#include "test_paths.h"

namespace dtrain::testing {
namespace {

const std::string kGpt = dtrain::testing::binary_dir() + "/examples/gpt";

// A GPT small enough for 8 processes on 2 cores; gradients clipped (the
// replay clips the same shards the same way), a warm-up then cosine decay;
// `strategy`: the plan inside each replica group.
std::vector<std::string> gpt_ft_args(int steps, const std::vector<std::string>& strategy) {
  std::vector<std::string> args{kGpt,
                                "--n-layer",
                                "2",
                                "--n-embd",
                                "32",
                                "--n-head",
                                "2",
                                "--block-size",
                                "16",
                                "--batch-size",
                                "2",
                                "--max-iters",
                                std::to_string(steps),
                                "--eval-interval",
                                "1000",
                                "--eval-iters",
                                "1",
                                "--sample-tokens",
                                "0",
                                "--warmup-iters",
                                "5",
                                "--seed",
                                "5",
                                "--grad-clip",
                                "0.5",
                                "--devices",
                                "cpu"};
  args.insert(args.end(), strategy.begin(), strategy.end());
  return args;
}

// Every line of one data rank's sample log: (0-based step, line).
std::vector<nlohmann::json> gpt_sample_lines(const fs::path& path) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(slurp(path));
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

// A replica group's log for the shared audit, from its rank 0's sample log
// (the Trainer logs no recoveries: a restarted group that did not recover
// would log step 0 again).
FtReplicaLog gpt_replica_log(const fs::path& path) {
  FtReplicaLog log;
  for (const auto& l : gpt_sample_lines(path)) {
    log.steps.push_back({.step = l.at("step").get<std::int64_t>() - 1,
                         .members = l.at("members").get<std::vector<int>>(),
                         .first_sample = l.at("indices").at(0).get<std::int64_t>(),
                         .pid = l.at("pid").get<int>()});
  }
  return log;
}

struct GptFtCase {
  int replicas = 4;
  int ranks = 2;                      // per replica group
  std::vector<std::string> strategy;  // the plan inside a group
  int data_ranks = 2;                 // per replica group (a pipeline's stages share one)
  int steps = 250;
};

// `c.replicas` groups of `c.ranks` ranks; rank 0 of group 1 SIGKILLed after
// 15 steps; the audit and the replay.
void run_gpt_ft_kill(const GptFtCase& c) {
  const int kReplicas = c.replicas, k = c.ranks, kSteps = c.steps, kVictim = 1, kBatch = 2;
  const int kDataWorld = kReplicas * c.data_ranks;
  const int dpg = c.data_ranks;
  Scratch scratch;
  const fs::path dir = scratch.path();
  auto args = gpt_ft_args(kSteps, c.strategy);
  // The example as it is, its restart held back 1 s (twice the heartbeat
  // timeout), so the survivors step on without the killed group meanwhile
  // (a restart faster than the timeout is waited for: docs/fault_tolerance.md).
  // Not much longer: a survivor alone runs the pipeline case's remaining
  // steps in about 2 s on 2 cores, and a group back after the others
  // finished is told so and ends without training (docs/fault_tolerance.md,
  // Quorum); with 2 s that happened 1 run in 11.
  args.front() = scratch.script("gpt_restarted_late.sh",
                                "[ \"${TORCHELASTIC_RESTART_COUNT:-0}\" = 0 ] || sleep 1\nexec " + kGpt + " \"$@\"\n");
  args.insert(args.begin(),
              {"--nproc-per-node", std::to_string(kReplicas * k), "--ft-replicas", std::to_string(kReplicas),
               "--max-restarts", "2", "--ft-heartbeat-timeout", "0.5", "--log-dir", (dir / "logs").string()});
  args.insert(args.end(),
              {"--save-params", (dir / "final.f32").string(), "--sample-log", (dir / "samples.jsonl").string()});
  Launch launch(args, scratch, "ft");
  // Rank r of group g writes samples.rank<g * k + r>.jsonl.
  const auto rank_log = [&](int file) { return dir / ("samples.rank" + std::to_string(file) + ".jsonl"); };
  const fs::path victim_log = rank_log(kVictim * k);
  ASSERT_TRUE(wait_for([&] { return gpt_sample_lines(victim_log).size() >= 15; }, std::chrono::seconds(60)))
      << launch.err();
  const int victim_pid = gpt_sample_lines(victim_log).back().at("pid").get<int>();
  ASSERT_EQ(::kill(victim_pid, SIGKILL), 0);
  ASSERT_EQ(launch.wait(std::chrono::seconds(120)), 0) << launch.err();
  EXPECT_NE(launch.err().find("restarting that replica group only"), std::string::npos) << launch.err();

  // The shared audit on each group's rank 0; the sample position of data
  // rank d at step s is (s * kDataWorld + d) * kBatch (StepStream's numbering).
  std::map<int, FtReplicaLog> logs;
  for (int r = 0; r < kReplicas; ++r) logs[r] = gpt_replica_log(rank_log(r * k));
  const auto membership =
      audit_ft_kill(logs, {.replicas = kReplicas,
                           .victim = kVictim,
                           .victim_pid = victim_pid,
                           .steps = kSteps,
                           .first_sample = [&](std::int64_t s, int m) { return (s * kDataWorld + m * dpg) * kBatch; }});
  ASSERT_EQ(membership.size(), static_cast<std::size_t>(kSteps));
  // Every rank, not only each group's rank 0: a logged step is one its
  // group's quorum committed, its samples are its data rank's, and no
  // sample is consumed twice.
  // (A pipeline's stages read the same batch: each data rank's first rank counts.)
  std::set<std::int64_t> samples;
  for (int f = 0; f < kReplicas * k; ++f) {
    const int d = (f / k) * dpg + (f % k) * dpg / k;
    for (const auto& l : gpt_sample_lines(rank_log(f))) {
      const std::int64_t s = l.at("step").get<std::int64_t>() - 1;
      ASSERT_GE(s, 0);
      ASSERT_LT(s, kSteps);
      const auto& members = membership[static_cast<std::size_t>(s)];
      EXPECT_NE(std::find(members.begin(), members.end(), f / k), members.end())
          << "rank " << f << " logged step " << s << " outside its quorum";
      const auto indices = l.at("indices").get<std::vector<std::int64_t>>();
      ASSERT_EQ(indices.size(), static_cast<std::size_t>(kBatch));
      for (int i = 0; i < kBatch; ++i) {
        EXPECT_EQ(indices[i], (s * kDataWorld + d) * kBatch + i) << "rank " << f << " step " << s;
        if (f % (k / dpg) == 0) {
          EXPECT_TRUE(samples.insert(indices[i]).second) << "sample " << indices[i] << " consumed twice";
        }
      }
    }
  }

  // The reference: the example's replay of the recorded membership.
  const fs::path replay = dir / "replay.json";
  std::ofstream(replay) << nlohmann::json{{"replicas", kReplicas}, {"members", membership}}.dump();
  auto replay_args = gpt_ft_args(kSteps, c.strategy);
  replay_args.insert(replay_args.begin(), {"--nproc-per-node", std::to_string(k)});
  replay_args.insert(replay_args.end(),
                     {"--ft-replay", replay.string(), "--save-params", (dir / "replay.f32").string()});
  Launch reference(replay_args, scratch, "replay");
  ASSERT_EQ(reference.wait(std::chrono::seconds(60)), 0) << reference.err();
  // A pipeline's stages each write FILE.stage<s>: the whole is their concatenation.
  const auto params = [&](const std::string& file) {
    std::vector<float> all = read_floats(dir / file);
    for (int stage = 0; fs::exists(dir / (file + ".stage" + std::to_string(stage))); ++stage) {
      const auto part = read_floats(dir / (file + ".stage" + std::to_string(stage)));
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  };
  const auto expected = params("replay.f32");
  ASSERT_GT(expected.size(), 1000u);
  for (int r = 0; r < kReplicas; ++r) {
    const auto got = params("final.f32.replica" + std::to_string(r));
    ASSERT_EQ(got.size(), expected.size()) << "replica " << r;
    EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0)
        << "replica " << r << "'s parameters differ from the replay of its membership";
  }
}

// The test: 4 groups of 2 ranks, ZeRO-2 inside each.
TEST(GptFaultTolerance, KilledZero2ReplicaGroupOfFourRecoversLiveAndMatchesReplay) {
  if (!have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  run_gpt_ft_kill({.replicas = 4, .ranks = 2, .strategy = {"--strategy", "zero2"}, .data_ranks = 2});
}

// A pipeline inside each replica group (2 stages, 1F1B over 2 micro-batches):
// the killed group's stages recover rank to rank (the default replica_state:
// each stage's own parameters and optimizer state from the same stage of a
// live group). Two groups of two ranks.
TEST(GptFaultTolerance, KilledPipelineReplicaGroupRecoversLiveAndMatchesReplay) {
  if (!have_gpt_corpus()) GTEST_SKIP() << "no corpus: run scripts/setup.sh";
  run_gpt_ft_kill({.replicas = 2,
                   .ranks = 2,
                   .strategy = {"--strategy", "pipeline", "--pp-schedule", "1f1b", "--micro-batches", "2"},
                   .data_ranks = 1});
}

}  // namespace
}  // namespace dtrain::testing
