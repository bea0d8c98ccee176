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

extern char** environ;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {
const std::string kDtrain = std::string(DTRAIN_BINARY_DIR) + "/tools/dtrain";
const std::string kExample = std::string(DTRAIN_BINARY_DIR) + "/examples/fashion_mnist";

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

class Scratch {
 public:
  Scratch() {
    dir_ = fs::temp_directory_path() /
           ("dtrain-launcher-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~Scratch() { fs::remove_all(dir_); }
  const fs::path& path() const { return dir_; }
  // Writes an executable shell script.
  std::string script(const std::string& name, const std::string& body) const {
    const auto p = dir_ / name;
    std::ofstream(p) << "#!/bin/bash\n" << body;
    fs::permissions(p, fs::perms::owner_all);
    return p.string();
  }

 private:
  static inline int counter_ = 0;
  fs::path dir_;
};

// A launcher running in the background, output to files.
class Launch {
 public:
  Launch(const std::vector<std::string>& args, const Scratch& scratch)
      : out_(scratch.path() / "out"), err_(scratch.path() / "err") {
    std::vector<std::string> argv_s{kDtrain, "run"};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn(&pid_, kDtrain.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Launch() {
    if (pid_ > 0 && !done_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // Exit code, or -1 on timeout (then the launcher is killed).
  int wait(std::chrono::seconds timeout = std::chrono::seconds(120)) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        done_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  pid_t pid() const { return pid_; }
  std::string out() const { return slurp(out_); }
  std::string err() const { return slurp(err_); }
  // The launcher's direct children (the workers).
  std::vector<int> workers() const {
    std::vector<int> pids;
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(e.path() / "stat");
      std::string text((std::istreambuf_iterator<char>(stat)), {});
      const auto close = text.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(text.substr(close + 2));
      char state;
      int ppid;
      rest >> state >> ppid;
      if (ppid == pid_ && state != 'Z') pids.push_back(std::stoi(name));
    }
    return pids;
  }

 private:
  fs::path out_, err_;
  pid_t pid_ = -1;
  bool done_ = false;
};

bool wait_for(const std::function<bool()>& ready, std::chrono::seconds timeout = std::chrono::seconds(60)) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

bool alive(int pid) {
  return ::kill(pid, 0) == 0;
}
}  // namespace

TEST(Launcher, SetsTheEnvContractAndTeesWithRankPrefixes) {
  Scratch s;
  const auto worker = s.script("w.sh",
                               "echo \"env $RANK $LOCAL_RANK $GROUP_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE "
                               "$MASTER_ADDR $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS "
                               "$TORCHELASTIC_RUN_ID $OMP_NUM_THREADS port=$MASTER_PORT\"\n");
  Launch l({"--nproc-per-node", "3", "--tee", "--log-dir", (s.path() / "logs").string(), "--rdzv-id", "job7", worker},
           s);
  ASSERT_EQ(l.wait(), 0) << l.err();
  const std::string out = l.out();
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(out.find("[rank " + std::to_string(r) + "]:env " + std::to_string(r) + " " + std::to_string(r) +
                       " 0 3 3 127.0.0.1 0 0 job7 1 port="),
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

TEST(Launcher, KilledWorkerIsReportedWithItsSignal) {
  Scratch s;
  const auto worker = s.script("w.sh", "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi\nsleep 30\n");
  Launch l({"--nproc-per-node", "2", "--stop-grace", "1", worker}, s);
  EXPECT_EQ(l.wait(), 128 + SIGKILL);
  EXPECT_NE(l.err().find("root cause: rank 0 (local rank 0) was killed by SIGKILL"), std::string::npos) << l.err();
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

TEST(Launcher, KilledDdpWorkerRecoversToTheSameFinalModel) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no Fashion-MNIST";
  Scratch s;
  const std::vector<std::string> train = {kExample, "--strategy",   "ddp", "--epochs",  "2",   "--train-limit",
                                          "2048",   "--batch-size", "32",  "--devices", "cpu", "--checkpoint-every",
                                          "8"};
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
