// `dtrain run` end to end: env contract, logs and tee, failures with root
// cause, restarts, hung (stopped) workers, signal forwarding, no orphans, bad
// input, and recovery of a real DDP training run from a SIGKILL with final
// parameters equal to an uninterrupted run's.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "launch_helpers.h"

using namespace dtrain::testing;

TEST(Launcher, SetsTheEnvContractAndTeesWithRankPrefixes) {
  Scratch s;
  const auto worker = s.script("w.sh",
                               "echo \"env $RANK $LOCAL_RANK $GROUP_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE "
                               "$MASTER_ADDR $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS "
                               "$TORCHELASTIC_RUN_ID $OMP_NUM_THREADS $TORCHELASTIC_USE_AGENT_STORE "
                               "port=$MASTER_PORT\"\n");
  Launch l({"--nproc-per-node", "3", "--tee", "--log-dir", (s.path() / "logs").string(), "--rdzv-id", "job7", worker},
           s);
  ASSERT_EQ(l.wait(), 0) << l.err();
  const std::string out = l.out();
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(out.find("[rank " + std::to_string(r) + "]:env " + std::to_string(r) + " " + std::to_string(r) +
                       " 0 3 3 127.0.0.1 0 0 job7 1 True port="),
              std::string::npos)
        << out;
    const auto log = slurp(s.path() / "logs" / "attempt_0" / ("rank_" + std::to_string(r) + ".log"));
    EXPECT_EQ(log.rfind("env " + std::to_string(r), 0), 0u) << log;
  }
}

TEST(Launcher, ExhaustedRestartsGiveTheWorkersExitCodeAndRootCause) {
  Scratch s;
  const auto worker = s.script("w.sh",
                               "if [ \"$RANK\" = 1 ]; then\n"
                               "  echo '{\"message\":{\"message\":\"ValueError: bad batch 7\",\"extraInfo\":{}}}' > "
                               "\"$TORCHELASTIC_ERROR_FILE\"\n"
                               "  exit 3\nfi\nsleep 30\n");
  const auto start = Clock::now();
  Launch l({"--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval", "0.05", "--stop-grace", "1", worker},
           s);
  EXPECT_EQ(l.wait(), 3);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 20.0) << "the sleeping rank was not stopped";
  const std::string err = l.err();
  EXPECT_NE(err.find("failed after 2 restarts (--max-restarts 2)"), std::string::npos) << err;
  EXPECT_NE(err.find("root cause: rank 1 (local rank 1) exited with code 3: ValueError: bad batch 7"),
            std::string::npos)
      << err;
}

TEST(Launcher, RemovesSharedMemoryFilesItsWorkersLeft) {
  // Files a rank made in /dev/shm and nobody unlinked (a ring no peer
  // mapped, a collective region a rank died before mapping;
  // src/comm/shm_util.h) go once every rank has exited; others stay.
  Scratch s;
  const auto worker =
      s.script("w.sh",
               "touch /dev/shm/dtrain-$$-p2p-77-to-1 /dev/shm/dtrain-$$-comm-5 /dev/shm/dtrain-x$$-kept\n"
               "echo \"pid $$\"\n"
               "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 0.5; exit 5; fi\n");
  // Round 0 fails (rank 1, after rank 0 is done), round 1 succeeds.
  Launch l({"--nproc-per-node", "2", "--tee", "--max-restarts", "1", "--monitor-interval", "0.05", worker}, s);
  ASSERT_EQ(l.wait(), 0) << l.err();
  std::istringstream out(l.out());
  int workers = 0;
  for (std::string line; std::getline(out, line);) {
    const auto at = line.find("pid ");
    if (at == std::string::npos) continue;
    const std::string pid = line.substr(at + 4);
    ++workers;
    EXPECT_FALSE(std::filesystem::exists("/dev/shm/dtrain-" + pid + "-p2p-77-to-1")) << "rank pid " << pid;
    EXPECT_FALSE(std::filesystem::exists("/dev/shm/dtrain-" + pid + "-comm-5")) << "rank pid " << pid;
    EXPECT_TRUE(std::filesystem::exists("/dev/shm/dtrain-x" + pid + "-kept")) << "rank pid " << pid;
    std::filesystem::remove("/dev/shm/dtrain-x" + pid + "-kept");
  }
  EXPECT_EQ(workers, 4) << l.out();  // two rounds of two
}

TEST(Launcher, KilledWorkerIsReportedWithItsSignal) {
  Scratch s;
  const auto worker = s.script("w.sh", "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi\nsleep 30\n");
  Launch l({"--nproc-per-node", "2", "--stop-grace", "1", worker}, s);
  EXPECT_EQ(l.wait(), 128 + SIGKILL);
  EXPECT_NE(l.err().find("root cause: rank 0 (local rank 0) was killed by SIGKILL"), std::string::npos) << l.err();
}

// The launcher hosts the workers' store, so it ignores SIGPIPE (a worker
// dying mid-reply must not take the store down with it); its workers start
// with the default action all the same, as a shell or torchrun starts them,
// not with the ignore they would inherit across exec (Note [Broken pipes]).
// The store is hosted while the first workers start, so the first attempt
// waits for the launcher's ignore and fails; the restarted workers are
// started by a launcher that ignores SIGPIPE.
TEST(Launcher, IgnoresBrokenPipesButItsWorkersStartWithTheDefaultAction) {
  Scratch s;
  const auto worker = s.script("w.sh",
                               "ignored() { awk '/SigIgn/ {print $2}' /proc/$1/status; }\n"
                               "for i in $(seq 600); do\n"
                               "  (( (0x$(ignored $PPID) >> 12) & 1 )) && break\n"
                               "  sleep 0.05\n"
                               "done\n"
                               "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exit 1; fi\n"
                               "echo \"launcher SigIgn: $(ignored $PPID)\"\n"
                               "echo \"worker SigIgn: $(ignored $$)\"\n");
  Launch l({"--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.05", "--tee", worker}, s);
  ASSERT_EQ(l.wait(), 0) << l.err();
  const std::string out = l.out();
  const auto pipe_ignored = [&](const std::string& who) {
    const auto at = out.find(who + " SigIgn: ");
    if (at == std::string::npos) {
      ADD_FAILURE() << "no " << who << " SigIgn line";
      return false;
    }
    const auto mask = std::stoull(out.substr(at + who.size() + 9), nullptr, 16);
    return (mask >> (SIGPIPE - 1) & 1) == 1;
  };
  for (int r = 0; r < 2; ++r) {
    const std::string prefix = "[rank " + std::to_string(r) + "]:";
    EXPECT_TRUE(pipe_ignored(prefix + "launcher")) << out;
    EXPECT_FALSE(pipe_ignored(prefix + "worker")) << out;
  }
}

TEST(Launcher, StoppedWorkerCountsAsHungAndTheGroupRestarts) {
  Scratch s;
  const auto worker =
      s.script("w.sh",
               "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then kill -STOP $$; fi\n"
               "echo \"done $RANK restart $TORCHELASTIC_RESTART_COUNT\"\n");
  Launch l({"--nproc-per-node", "2", "--max-restarts", "1", "--hang-timeout", "1", "--monitor-interval", "0.05",
            "--tee", worker},
           s);
  EXPECT_EQ(l.wait(), 0) << l.err();
  EXPECT_NE(l.err().find("rank 1 (local rank 1) stopped responding and was killed; restarting"), std::string::npos)
      << l.err();
  EXPECT_NE(l.out().find("[rank 1]:done 1 restart 1"), std::string::npos) << l.out();
}

TEST(Launcher, SigtermIsForwardedAndWorkersGetAGracePeriod) {
  Scratch s;
  const auto marker = s.path() / "got_term";
  const auto worker = s.script("w.sh", "trap 'touch " + marker.string() +
                                           "_$RANK; exit 0' TERM\n"
                                           "touch " +
                                           (s.path() / "ready_").string() +
                                           "$RANK\n"
                                           "while true; do sleep 0.05; done\n");
  Launch l({"--nproc-per-node", "2", "--stop-grace", "5", worker}, s);
  ASSERT_TRUE(wait_for([&] { return fs::exists(s.path() / "ready_0") && fs::exists(s.path() / "ready_1"); }));
  const auto workers = l.workers();
  ASSERT_EQ(workers.size(), 2u);
  ::kill(l.pid(), SIGTERM);
  EXPECT_EQ(l.wait(std::chrono::seconds(20)), 128 + SIGTERM);
  EXPECT_TRUE(fs::exists(marker.string() + "_0") && fs::exists(marker.string() + "_1")) << "TERM not forwarded";
  for (int pid : workers) EXPECT_FALSE(alive(pid));
}

TEST(Launcher, NoOrphansWhenTheLauncherIsKilled) {
  Scratch s;
  const auto worker = s.script("w.sh", "touch " + (s.path() / "ready_").string() + "$RANK\nexec sleep 60\n");
  Launch l({"--nproc-per-node", "2", worker}, s);
  ASSERT_TRUE(wait_for([&] { return fs::exists(s.path() / "ready_0") && fs::exists(s.path() / "ready_1"); }));
  const auto workers = l.workers();
  ASSERT_EQ(workers.size(), 2u);
  ::kill(l.pid(), SIGKILL);
  l.wait();
  EXPECT_TRUE(wait_for([&] { return !alive(workers[0]) && !alive(workers[1]); }, std::chrono::seconds(5)))
      << "workers outlived a SIGKILLed launcher";
}

TEST(Launcher, BadInputFailsClearly) {
  Scratch s;
  const auto ok = s.script("ok.sh", "exit 0\n");
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"--nnodes", "3:2", ok}, "--nnodes 3:2: MIN 3 exceeds MAX 2"},
      {{"--nnodes", "x", ok}, "--nnodes='x' is not an integer"},
      {{"/no/such/program"}, "cannot run '/no/such/program': no such executable file"},
      {{"no-such-program-xyz"}, "cannot run 'no-such-program-xyz': not found on PATH"},
      {{"--nproc-per-node", "0", ok}, "--nproc-per-node=0 is out of range"},
      {{"--monitor-interval", "-1", ok}, "--monitor-interval -1 must be positive"},
      {{"--devices", "cuda:7", ok}, "device 'cuda:7'"},
      {{}, "no program to run was given"},
  };
  for (const auto& c : cases) {
    Launch l(c.args, s);
    EXPECT_EQ(l.wait(), 2) << c.needle;
    EXPECT_NE(l.err().find(c.needle), std::string::npos) << l.err();
  }
}

TEST(Launcher, LibdtrainThatCannotBeLoadedIsReportedClearly) {
  // The agent hosts the workers' store through libdtrain (docs/launcher.md).
  Scratch s;
  const auto marker = s.path() / "started";
  const auto worker = s.script("w.sh", "touch " + marker.string() + "\nsleep 30\n");
  ::setenv("DTRAIN_LIBRARY", "/no/such/libdtrain.so", 1);
  Launch missing({worker}, s, "missing");
  std::ofstream(s.path() / "not_a_library.so") << "text\n";
  ::setenv("DTRAIN_LIBRARY", (s.path() / "not_a_library.so").c_str(), 1);
  Launch broken({"--stop-grace", "1", worker}, s, "broken");
  ::unsetenv("DTRAIN_LIBRARY");
  // Not there: found out before any worker starts.
  EXPECT_EQ(missing.wait(), 2);
  EXPECT_NE(missing.err().find("DTRAIN_LIBRARY=/no/such/libdtrain.so does not exist"), std::string::npos)
      << missing.err();
  EXPECT_NE(missing.err().find("Hint: set DTRAIN_LIBRARY"), std::string::npos) << missing.err();
  // There but not loadable: found out while the workers start; they are stopped.
  EXPECT_EQ(broken.wait(std::chrono::seconds(20)), 2);
  EXPECT_NE(broken.err().find("cannot load libdtrain from " + (s.path() / "not_a_library.so").string()),
            std::string::npos)
      << broken.err();
}

TEST(Launcher, KilledDdpWorkerRecoversToTheSameFinalModel) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no Fashion-MNIST";
  Scratch s;
  const std::vector<std::string> train = {kExample, "--strategy",         "ddp",  "--epochs",     "2",  "--train-limit",
                                          "2048",   "--test-limit",       "1000", "--batch-size", "32", "--devices",
                                          "cpu",    "--checkpoint-every", "8"};
  auto run_args = [&](const std::string& ckpt, int restarts) {
    std::vector<std::string> args{"--nproc-per-node",   "2",   "--max-restarts", std::to_string(restarts),
                                  "--monitor-interval", "0.05"};
    args.insert(args.end(), train.begin(), train.end());
    args.push_back("--checkpoint-dir");
    args.push_back(ckpt);
    return args;
  };
  auto fingerprint = [](const std::string& out) {
    std::istringstream lines(out);
    std::string line, fnv;
    while (std::getline(lines, line)) {
      if (line.rfind("{\"event\":\"done\"", 0) == 0) fnv = nlohmann::json::parse(line)["params_fnv"];
    }
    return fnv;
  };
  Scratch a;
  Launch uninterrupted(run_args((a.path() / "ckpt").string(), 0), a);
  ASSERT_EQ(uninterrupted.wait(), 0) << uninterrupted.err();
  const std::string expected = fingerprint(uninterrupted.out());
  ASSERT_FALSE(expected.empty()) << uninterrupted.out();

  Launch interrupted(run_args((s.path() / "ckpt").string(), 2), s);
  ASSERT_TRUE(wait_for([&] { return fs::exists(s.path() / "ckpt" / "step_16"); }));
  const auto workers = interrupted.workers();
  ASSERT_EQ(workers.size(), 2u);
  ::kill(workers[1], SIGKILL);
  ASSERT_EQ(interrupted.wait(), 0) << interrupted.err();
  EXPECT_NE(interrupted.err().find("was killed by SIGKILL; restarting the workers (restart 1 of 2)"), std::string::npos)
      << interrupted.err();
  EXPECT_NE(interrupted.err().find("resumed from"), std::string::npos) << interrupted.err();
  EXPECT_EQ(fingerprint(interrupted.out()), expected) << "recovered run ended with different parameters";
}
