// The process side of the launcher, behind an interface so the agent's state
// machine can be tested with fake workers.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::elastic {

struct WorkerLaunch {
  int local_rank = 0;
  int global_rank = 0;
  std::map<std::string, std::string> env;  // added to the launcher's environment
};

struct WorkerExit {
  int local_rank = 0;
  int global_rank = 0;
  int exit_code = 0;  // valid when signal == 0 and !hung
  int signal = 0;     // the signal that killed it, if any
  bool hung = false;  // stopped responding (see ProcessWorkerGroupOptions::hang_timeout)
  std::string error;  // from its error file, if it wrote one
  // The launcher's exit code for this failure: exit_code, or 128 + signal.
  int launcher_exit_code() const;
  // "rank 1 (local 1) exited with code 3: <error>", "... was killed by SIGKILL", ...
  std::string describe() const;
};

enum class GroupStatus { kRunning, kSucceeded, kFailed };

class WorkerGroup {
 public:
  virtual ~WorkerGroup() = default;
  // Starts one process per entry. `attempt` numbers restarts (log folders).
  virtual void start(const std::vector<WorkerLaunch>& workers, int attempt) = 0;
  // Waits up to `interval`, handling output, then reports: kFailed (with the
  // first failure) as soon as any worker failed or hung, kSucceeded once all
  // exited with 0.
  virtual GroupStatus poll(std::chrono::milliseconds interval, std::optional<WorkerExit>& failure) = 0;
  // Sends `signal` to every live worker's process group, waits up to `grace`,
  // then SIGKILLs what is left; reaps everything.
  virtual void stop(int signal, std::chrono::milliseconds grace) = 0;
  // Sends `signal` to every live worker's own process (not its children;
  // e.g. SIGUSR1, the flight recorder's dump request) and returns their
  // global ranks. The default (fakes): none.
  virtual std::vector<int> signal_live(int /*signal*/) { return {}; }
};

struct ProcessWorkerGroupOptions {
  std::vector<std::string> argv;  // program and arguments
  std::string log_dir;            // per-rank log files under log_dir/attempt_N/ ("" = none)
  bool tee = false;               // prefix each output line with "[rank R]:" on the launcher's output
  // A worker stopped (e.g. SIGSTOP) for longer than this counts as hung.
  std::chrono::milliseconds hang_timeout = std::chrono::seconds(30);
  std::string error_file_dir;  // where workers' TORCHELASTIC_ERROR_FILEs go
};

// Real processes: fork/exec, each in its own process group, killed with the
// launcher (PR_SET_PDEATHSIG), output to logs and/or tee'd.
class ProcessWorkerGroup : public WorkerGroup {
 public:
  explicit ProcessWorkerGroup(ProcessWorkerGroupOptions options);
  ~ProcessWorkerGroup() override;
  void start(const std::vector<WorkerLaunch>& workers, int attempt) override;
  GroupStatus poll(std::chrono::milliseconds interval, std::optional<WorkerExit>& failure) override;
  void stop(int signal, std::chrono::milliseconds grace) override;
  std::vector<int> signal_live(int signal) override;

 private:
  struct Worker;
  void pump_output(std::chrono::milliseconds wait);
  void flush_line(Worker& w, const std::string& line);
  ProcessWorkerGroupOptions options_;
  std::vector<Worker> workers_;
};

// Checks that `program` can be executed (a path, or a name found on PATH);
// throws ConfigError naming it otherwise.
std::string resolve_program(const std::string& program);

}  // namespace dtrain::elastic
