// Worker processes for the launcher: spawn, watch, stream output, stop.
#include "dtrain/elastic/worker_group.h"

#include "dtrain/elastic/error_file.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "../comm/shm_util.h"
#include "../core/broken_pipes.h"
#include "dtrain/error.h"

extern char** environ;

namespace dtrain::elastic {
namespace {
using Clock = std::chrono::steady_clock;

// SIGCHLD wakes the monitor loop at once (self-pipe), so a dead worker is
// noticed immediately rather than at the next monitor tick.
int g_child_pipe[2] = {-1, -1};
void on_sigchld(int) {
  const int saved = errno;
  const char byte = 1;
  (void)!::write(g_child_pipe[1], &byte, 1);
  errno = saved;
}
void install_sigchld_wakeup() {
  static const bool installed = [] {
    if (::pipe2(g_child_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return false;
    struct sigaction sa {};
    sa.sa_handler = on_sigchld;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    return ::sigaction(SIGCHLD, &sa, nullptr) == 0;
  }();
  (void)installed;
}
void drain_child_pipe() {
  char buf[64];
  while (::read(g_child_pipe[0], buf, sizeof buf) > 0) {
  }
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// 'T'/'t' in /proc/PID/stat: stopped by a signal or a tracer.
bool is_stopped(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  const auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  const char state = text[close + 2];
  return state == 'T' || state == 't';
}

}  // namespace

int WorkerExit::launcher_exit_code() const {
  if (hung) return 124;
  if (signal != 0) return 128 + signal;
  return exit_code;
}

std::string WorkerExit::describe() const {
  std::ostringstream out;
  out << "rank " << global_rank << " (local rank " << local_rank << ") ";
  if (hung) {
    out << "stopped responding and was killed";
  } else if (signal != 0) {
    out << "was killed by " << signal_name(signal);
  } else {
    out << "exited with code " << exit_code;
  }
  if (!error.empty()) out << ": " << error;
  return out.str();
}

std::string resolve_program(const std::string& program) {
  DTRAIN_CHECK(!program.empty(), ConfigError, "no program to run was given.", "dtrain run [options] PROGRAM [ARGS...]");
  auto executable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    DTRAIN_CHECK(executable(program), ConfigError, "cannot run '" << program << "': no such executable file.",
                 "check the path and that the file is executable");
    return program;
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (executable(candidate)) return candidate;
  }
  throw ConfigError("cannot run '" + program + "': not found on PATH.", "give a path such as ./" + program);
}

struct ProcessWorkerGroup::Worker {
  WorkerLaunch launch;
  int pid = -1;
  int out_fd = -1;  // read end of the output pipe (tee), or -1
  std::string partial;
  std::ofstream log;
  std::string error_file;
  std::optional<Clock::time_point> stopped_since;
  bool done = false;
  bool swept = false;  // its leftover shared-memory files removed
  WorkerExit exit;
};

ProcessWorkerGroup::ProcessWorkerGroup(ProcessWorkerGroupOptions options) : options_(std::move(options)) {
  install_sigchld_wakeup();
}

ProcessWorkerGroup::~ProcessWorkerGroup() {
  stop(SIGKILL, std::chrono::milliseconds(0));
}

void ProcessWorkerGroup::start(const std::vector<WorkerLaunch>& launches, int attempt) {
  stop(SIGKILL, std::chrono::milliseconds(0));
  workers_.clear();
  workers_.resize(launches.size());
  std::string attempt_dir;
  if (!options_.log_dir.empty()) {
    attempt_dir = options_.log_dir + "/attempt_" + std::to_string(attempt);
    std::filesystem::create_directories(attempt_dir);
  }
  if (!options_.error_file_dir.empty()) std::filesystem::create_directories(options_.error_file_dir);

  for (size_t i = 0; i < launches.size(); ++i) {
    Worker& w = workers_[i];
    w.launch = launches[i];
    w.exit.local_rank = w.launch.local_rank;
    w.exit.global_rank = w.launch.global_rank;
    std::map<std::string, std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv(*e);
      const auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    for (const auto& [k, v] : w.launch.env) env[k] = v;
    if (!options_.error_file_dir.empty()) {
      w.error_file = options_.error_file_dir + "/error_" + std::to_string(attempt) + "_" +
                     std::to_string(w.launch.global_rank) + ".json";
      std::filesystem::remove(w.error_file);
      env["TORCHELASTIC_ERROR_FILE"] = w.error_file;
    }
    std::string log_path;
    if (!attempt_dir.empty()) log_path = attempt_dir + "/rank_" + std::to_string(w.launch.global_rank) + ".log";

    // Everything the child needs is prepared before fork: after it, only
    // async-signal-safe calls.
    std::vector<std::string> env_strings;
    env_strings.reserve(env.size());
    for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    envp.reserve(env_strings.size() + 1);
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = options_.argv;
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    int pipe_fds[2] = {-1, -1};
    int log_fd = -1;
    if (options_.tee) {
      DTRAIN_CHECK(::pipe2(pipe_fds, O_CLOEXEC) == 0, InternalError, "pipe2 failed: " << std::strerror(errno), "");
      if (!log_path.empty()) w.log.open(log_path);
    } else if (!log_path.empty()) {
      log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      DTRAIN_CHECK(log_fd >= 0, ConfigError, "cannot write log " << log_path << ": " << std::strerror(errno),
                   "check --log-dir");
    }
    const pid_t launcher = ::getpid();
    const pid_t pid = ::fork();
    DTRAIN_CHECK(pid >= 0, InternalError, "fork failed: " << std::strerror(errno), "");
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no orphans, even if the launcher is SIGKILLed
      if (::getppid() != launcher) ::_exit(127);
      const int out = options_.tee ? pipe_fds[1] : log_fd;
      if (out >= 0) {
        ::dup2(out, 1);
        ::dup2(out, 2);
      }
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::dtrain::detail::default_broken_pipes_in_child();  // not the launcher's ignore: Note [Broken pipes]
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    w.pid = pid;
    if (options_.tee) {
      ::close(pipe_fds[1]);
      w.out_fd = pipe_fds[0];
    }
    if (log_fd >= 0) ::close(log_fd);
  }
}

void ProcessWorkerGroup::flush_line(Worker& w, const std::string& line) {
  if (w.log.is_open()) w.log << line << '\n' << std::flush;
  std::cout << "[rank " << w.launch.global_rank << "]:" << line << '\n' << std::flush;
}

void ProcessWorkerGroup::pump_output(std::chrono::milliseconds wait) {
  std::vector<pollfd> fds;
  std::vector<Worker*> owners;
  if (g_child_pipe[0] >= 0) {
    fds.push_back({g_child_pipe[0], POLLIN, 0});
    owners.push_back(nullptr);
  }
  for (auto& w : workers_) {
    if (w.out_fd >= 0) {
      fds.push_back({w.out_fd, POLLIN, 0});
      owners.push_back(&w);
    }
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(wait);
    return;
  }
  if (::poll(fds.data(), fds.size(), static_cast<int>(wait.count())) <= 0) return;
  char buf[65536];
  for (size_t i = 0; i < fds.size(); ++i) {
    if (owners[i] == nullptr) {
      if (fds[i].revents & POLLIN) drain_child_pipe();
      continue;
    }
    if ((fds[i].revents & (POLLIN | POLLHUP)) == 0) continue;
    Worker& w = *owners[i];
    const ssize_t n = ::read(w.out_fd, buf, sizeof buf);
    if (n <= 0) {
      if (!w.partial.empty()) flush_line(w, w.partial);
      w.partial.clear();
      ::close(w.out_fd);
      w.out_fd = -1;
      continue;
    }
    w.partial.append(buf, static_cast<size_t>(n));
    size_t start = 0, nl;
    while ((nl = w.partial.find('\n', start)) != std::string::npos) {
      flush_line(w, w.partial.substr(start, nl - start));
      start = nl + 1;
    }
    w.partial.erase(0, start);
  }
}

GroupStatus ProcessWorkerGroup::poll(std::chrono::milliseconds interval, std::optional<WorkerExit>& failure) {
  pump_output(interval);
  bool all_done = true;
  for (auto& w : workers_) {
    if (w.done) continue;
    int status = 0;
    const pid_t r = ::waitpid(w.pid, &status, WNOHANG);
    if (r == w.pid) {
      w.done = true;
      if (WIFEXITED(status)) w.exit.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) w.exit.signal = WTERMSIG(status);
      if (!w.error_file.empty()) w.exit.error = read_error_message(w.error_file);
      if ((w.exit.exit_code != 0 || w.exit.signal != 0) && !failure) failure = w.exit;
      continue;
    }
    all_done = false;
    if (is_stopped(w.pid)) {
      if (!w.stopped_since) w.stopped_since = Clock::now();
      if (Clock::now() - *w.stopped_since >= options_.hang_timeout && !failure) {
        w.exit.hung = true;
        failure = w.exit;
      }
    } else {
      w.stopped_since.reset();
    }
  }
  if (failure) return GroupStatus::kFailed;
  if (all_done) {
    pump_output(std::chrono::milliseconds(0));
    return GroupStatus::kSucceeded;
  }
  return GroupStatus::kRunning;
}

std::vector<int> ProcessWorkerGroup::signal_live(int signal) {
  std::vector<int> ranks;
  for (auto& w : workers_) {
    if (!w.done && w.pid > 0 && ::kill(w.pid, signal) == 0) ranks.push_back(w.launch.global_rank);
  }
  return ranks;
}

void ProcessWorkerGroup::stop(int signal, std::chrono::milliseconds grace) {
  for (auto& w : workers_) {
    if (!w.done && w.pid > 0) {
      ::kill(-w.pid, signal);
      ::kill(-w.pid, SIGCONT);  // a stopped worker must run to act on the signal
    }
  }
  const auto deadline = Clock::now() + grace;
  while (true) {
    bool alive = false;
    for (auto& w : workers_) {
      if (w.done || w.pid <= 0) continue;
      int status = 0;
      if (::waitpid(w.pid, &status, WNOHANG) == w.pid) {
        w.done = true;
      } else {
        alive = true;
      }
    }
    if (!alive) break;
    if (Clock::now() >= deadline) {
      for (auto& w : workers_) {
        if (!w.done && w.pid > 0) {
          ::kill(-w.pid, SIGKILL);
          ::waitpid(w.pid, nullptr, 0);
          w.done = true;
        }
      }
      break;
    }
    pump_output(std::chrono::milliseconds(20));
  }
  for (auto& w : workers_) {
    if (w.out_fd >= 0) {
      pump_output(std::chrono::milliseconds(0));
      ::close(w.out_fd);
      w.out_fd = -1;
    }
  }
  // Every worker of the round has exited: shared-memory files they made
  // that were never unlinked can go (src/comm/shm_util.h).
  for (auto& w : workers_) {
    if (w.pid > 0 && w.done && !w.swept) {
      dist::detail::remove_shared_memory_of(w.pid);
      w.swept = true;
    }
  }
}

}  // namespace dtrain::elastic
