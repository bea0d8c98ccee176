// Rank runners for tests: threads over an in-memory store, or processes over loopback.
#include "ranks.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

extern char** environ;

namespace dtrain::testing {
namespace {
constexpr const char* kChildVar = "DTRAIN_TEST_CHILD";

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
}  // namespace

// Note [Ports below the ephemeral range]: a port the kernel hands out for
// bind(0) is released again before the child binds it, and in that window the
// kernel may give the same port to any outgoing connection of a test running
// beside this one (ctest -j2: every Gloo pair and store client takes one), so
// "the port is already in use" came back now and then. Ports below
// ip_local_port_range are never handed out implicitly; this picks one there,
// from a sequence seeded by the pid so that concurrent test binaries walk
// different ports, and checks that it binds (a port still held or in
// TIME_WAIT is skipped). It leaves out 29000-30999, where torchrun's and
// dtrain run's default ports (29400, 29500) live.
int free_port() {
  int ephemeral_low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> ephemeral_low;
  constexpr int kLowest = 10000;
  if (ephemeral_low <= kLowest + 1000) ephemeral_low = 65536;  // an unusual range: use the ports above 10000
  const int span = ephemeral_low - kLowest;
  static std::atomic<unsigned> next{static_cast<unsigned>(::getpid()) * 2654435761u};
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = kLowest + static_cast<int>(next.fetch_add(7919u) % static_cast<unsigned>(span));
    if (port >= 29000 && port < 31000) continue;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw std::runtime_error("free_port: cannot open a socket: " + std::string(std::strerror(errno)));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (bound) return port;
  }
  throw std::runtime_error("free_port: no loopback port between 10000 and the ephemeral range binds");
}

void run_rank_threads(int world, const std::function<void(int, dist::Store)>& body, const ThreadRanksOptions& options) {
  auto store = dist::Store::in_memory();
  std::mutex mutex;
  std::condition_variable cv;
  int finished = 0;
  std::exception_ptr first_error;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, store);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first_error) first_error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      ++finished;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    if (!cv.wait_for(lock, options.timeout, [&] { return finished == world; })) {
      std::cerr << "run_rank_threads: " << world - finished << " of " << world << " rank threads still running after "
                << options.timeout.count() << " ms; aborting the test binary" << std::endl;
      ADD_FAILURE() << "rank threads timed out";
      std::_Exit(1);
    }
  }
  for (auto& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

std::vector<RankOutcome> run_rank_processes(int world, const std::function<void(int)>& body,
                                            const ProcessRanksOptions& options) {
  if (std::getenv(kChildVar) != nullptr) {
    int code = 0;
    try {
      body(std::atoi(std::getenv("RANK")));
      code = ::testing::Test::HasFailure() ? 1 : 0;
    } catch (const std::exception& e) {
      std::cerr << "uncaught exception: " << e.what() << std::endl;
      code = 3;
    }
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
    std::_Exit(code);
  }

  const auto dir = std::filesystem::temp_directory_path() /
                   ("dtrain-test-" + std::to_string(::getpid()) + "-" + std::to_string(free_port()));
  std::filesystem::create_directories(dir);
  const int port = free_port();
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string filter = "--gtest_filter=" + current_test_filter();

  std::vector<pid_t> pids(static_cast<size_t>(world), -1);
  std::vector<RankOutcome> outcomes(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    std::map<std::string, std::optional<std::string>> env;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv(*e);
      const auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    env[kChildVar] = "1";
    env["RANK"] = std::to_string(r);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_RANK"] = std::to_string(r);
    env["LOCAL_WORLD_SIZE"] = std::to_string(world);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = std::to_string(port);
    env["OMP_NUM_THREADS"] = "1";
    if (options.env_for_rank) {
      for (auto& [k, v] : options.env_for_rank(r)) env[k] = v;
    }
    std::vector<std::string> env_strings;
    for (auto& [k, v] : env) {
      if (v) env_strings.push_back(k + "=" + *v);
    }
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string arg0 = exe, arg1 = filter;
    char* argv[] = {arg0.data(), arg1.data(), nullptr};

    const std::string log = (dir / ("rank" + std::to_string(r) + ".log")).string();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw std::runtime_error("posix_spawn failed for rank " + std::to_string(r));
    pids[static_cast<size_t>(r)] = pid;
    outcomes[static_cast<size_t>(r)].rank = r;
  }

  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  int running = world;
  while (running > 0) {
    for (int r = 0; r < world; ++r) {
      auto& pid = pids[static_cast<size_t>(r)];
      if (pid < 0) continue;
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        auto& o = outcomes[static_cast<size_t>(r)];
        if (WIFEXITED(status)) o.exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) o.signal = WTERMSIG(status);
        pid = -1;
        --running;
      }
    }
    if (running == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      for (int r = 0; r < world; ++r) {
        auto& pid = pids[static_cast<size_t>(r)];
        if (pid < 0) continue;
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        outcomes[static_cast<size_t>(r)].timed_out = true;
        outcomes[static_cast<size_t>(r)].signal = SIGKILL;
        pid = -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  bool all_ok = true;
  std::string report;
  for (auto& o : outcomes) {
    o.output = read_file((dir / ("rank" + std::to_string(o.rank) + ".log")).string());
    const bool ok = o.exit_code == 0 && !o.timed_out;
    all_ok = all_ok && ok;
    report += "---- rank " + std::to_string(o.rank) + ": exit " + std::to_string(o.exit_code) +
              (o.signal ? " signal " + std::to_string(o.signal) : "") + (o.timed_out ? " (timed out)" : "") +
              " ----\n" + o.output + "\n";
  }
  std::filesystem::remove_all(dir);
  if (options.expect_success && !all_ok) ADD_FAILURE() << "rank processes failed:\n" << report;
  return outcomes;
}

}  // namespace dtrain::testing
