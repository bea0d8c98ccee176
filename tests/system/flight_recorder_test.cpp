// The flight recorder under `dtrain run` (docs/flight_recorder.md): a rank
// that sleeps before an all_reduce, one that issues the wrong collective, one
// that is stopped. Each time the launcher's failure report must name that
// rank and the operation, soon after the group's timeout (4 s here).
#include <gtest/gtest.h>

#include <cstdlib>

#include "launch_helpers.h"
#include "test_paths.h"

using namespace dtrain::testing;

namespace {

struct HangRun {
  int code = 0;
  std::string err;
  double seconds = 0;
  fs::path dumps;
};

// Three ranks of tests/system/hang_worker.cpp, rank 2 (or `culprit`) misbehaving as `mode` says.
HangRun run_hang_worker(const Scratch& s, const std::string& mode, int culprit) {
  ::setenv("DTRAIN_FLIGHT_RECORDER", "64", 1);
  ::setenv("DTRAIN_TIMEOUT_SECONDS", "4", 1);
  ::setenv("HANG_MODE", mode.c_str(), 1);
  ::setenv("HANG_RANK", std::to_string(culprit).c_str(), 1);
  const auto start = Clock::now();
  Launch launch({"--nproc-per-node", "3", "--log-dir", (s.path() / "logs").string(), "--stop-grace", "1",
                 dtrain::testing::binary_dir() + "/tests/dtrain_hang_worker"},
                s);
  HangRun run;
  run.code = launch.wait(std::chrono::seconds(120));
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  run.err = launch.err();
  run.dumps = s.path() / "logs" / "flight_recorder" / "attempt_0";
  for (const char* name : {"DTRAIN_FLIGHT_RECORDER", "DTRAIN_TIMEOUT_SECONDS", "HANG_MODE", "HANG_RANK"}) {
    ::unsetenv(name);
  }
  return run;
}

// Well within the test's budget, and not a hang: the timeout (4 s), the
// dump wait (3 s), worker start and stop on a loaded 2-core machine.
constexpr double kReportWithin = 60;

}  // namespace

TEST(FlightRecorderLaunch, NamesTheRankThatSleptBeforeAnAllReduce) {
  Scratch s;
  const HangRun run = run_hang_worker(s, "sleep", 2);
  EXPECT_NE(run.code, 0);
  EXPECT_LT(run.seconds, kReportWithin);
  EXPECT_NE(run.err.find("flight recorder: rank 2 never entered all_reduce(sum) #3 of group world; ranks 0-1 waited"),
            std::string::npos)
      << run.err;
  // It answered the launcher's SIGUSR1 while asleep: its last op is known.
  EXPECT_NE(run.err.find("rank 2's last op: all_reduce(sum) #2 of group world (completed)"), std::string::npos)
      << run.err;
  EXPECT_TRUE(fs::exists(run.dumps / "rank_2.json"));
}

TEST(FlightRecorderLaunch, NamesTheRankThatIssuedTheWrongCollective) {
  Scratch s;
  const HangRun run = run_hang_worker(s, "wrong_op", 1);
  EXPECT_NE(run.code, 0);
  EXPECT_LT(run.seconds, kReportWithin);
  EXPECT_NE(run.err.find("flight recorder: rank 1 issued all_gather (Float[1000] -> Float[3000]) as #3 of group "
                         "world where ranks 0, 2 issued all_reduce(sum) (Float[1000])"),
            std::string::npos)
      << run.err;
}

TEST(FlightRecorderLaunch, NamesTheStoppedRank) {
  Scratch s;
  const HangRun run = run_hang_worker(s, "stop", 2);
  EXPECT_NE(run.code, 0);
  EXPECT_LT(run.seconds, kReportWithin);
  EXPECT_NE(run.err.find("flight recorder: rank 2 never completed all_reduce(sum) #3 of group world; ranks 0-1 waited"),
            std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("no dump from rank 2"), std::string::npos) << run.err;
}
