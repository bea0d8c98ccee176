// Helpers for the launcher's system tests: scratch folders with scripts, and
// `dtrain run` started in the background with its output in files.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include "test_paths.h"

extern char** environ;

namespace dtrain::testing {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

inline const std::string kDtrain = dtrain::testing::binary_dir() + "/tools/dtrain";
inline const std::string kExample = dtrain::testing::binary_dir() + "/examples/fashion_mnist";

inline std::string slurp(const fs::path& p) {
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
  // `name` tells apart the output files of several launchers in one scratch folder.
  // `wrapper` runs the launcher through another program (e.g. ip netns exec NS).
  Launch(const std::vector<std::string>& args, const Scratch& scratch, const std::string& name = "",
         const std::vector<std::string>& wrapper = {})
      : out_(scratch.path() / ("out" + name)), err_(scratch.path() / ("err" + name)) {
    std::vector<std::string> argv_s = wrapper;
    argv_s.insert(argv_s.end(), {kDtrain, "run"});
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawnp(&pid_, argv_s.front().c_str(), &fa, nullptr, argv.data(), environ);
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

inline bool wait_for(const std::function<bool()>& ready, std::chrono::seconds timeout = std::chrono::seconds(60)) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

inline bool alive(int pid) {
  return ::kill(pid, 0) == 0;
}

}  // namespace dtrain::testing
