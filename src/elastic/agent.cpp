// The launcher agent's state machine (single node).
#include "dtrain/elastic/agent.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::elastic {

std::string to_string(AgentState state) {
  switch (state) {
    case AgentState::kInit: return "init";
    case AgentState::kRendezvous: return "rendezvous";
    case AgentState::kRunning: return "running";
    case AgentState::kRestarting: return "restarting";
    case AgentState::kSucceeded: return "succeeded";
    case AgentState::kFailed: return "failed";
    case AgentState::kInterrupted: return "interrupted";
  }
  return "?";
}

int listen_tcp(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int yes = 1;
  if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof addr;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::listen(fd, 1024) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  if (!ok) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw ConfigError("cannot listen on TCP port " + std::to_string(port) + ": " + std::strerror(err) + ".",
                      "choose another port, or stop the process holding it");
  }
  port = ntohs(addr.sin_port);
  return fd;
}

Agent::Agent(AgentOptions options, WorkerGroup& workers) : options_(std::move(options)), workers_(workers) {
  DTRAIN_CHECK(options_.nproc_per_node >= 1, ConfigError,
               "--nproc-per-node " << options_.nproc_per_node << " must be at least 1.", "pass N >= 1");
  DTRAIN_CHECK(options_.max_restarts >= 0, ConfigError, "--max-restarts " << options_.max_restarts << " is negative.",
               "pass 0 or more");
}

void Agent::move_to(AgentState next) {
  const AgentState from = state_;
  state_ = next;
  if (on_transition) on_transition(from, next);
}

std::map<std::string, std::string> Agent::worker_env(int local_rank, int restart_count, int master_port) const {
  std::map<std::string, std::string> env = options_.extra_env;
  const int world = options_.nproc_per_node;  // one node
  env["RANK"] = std::to_string(local_rank);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["GROUP_RANK"] = "0";
  env["ROLE_RANK"] = std::to_string(local_rank);
  env["WORLD_SIZE"] = std::to_string(world);
  env["LOCAL_WORLD_SIZE"] = std::to_string(options_.nproc_per_node);
  env["ROLE_WORLD_SIZE"] = std::to_string(world);
  env["MASTER_ADDR"] = options_.master_addr;
  env["MASTER_PORT"] = std::to_string(master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options_.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = options_.run_id;
  if (std::getenv("OMP_NUM_THREADS") == nullptr) env["OMP_NUM_THREADS"] = "1";
  return env;
}

AgentResult Agent::run(const std::atomic<int>& interrupt) {
  AgentResult result;
  for (int restarts = 0;; ++restarts) {
    move_to(AgentState::kRendezvous);
    int port = options_.master_port;
    const int listen_fd = listen_tcp(port);
    std::vector<WorkerLaunch> launches;
    for (int r = 0; r < options_.nproc_per_node; ++r) {
      launches.push_back({.local_rank = r, .global_rank = r, .env = worker_env(r, restarts, port)});
    }
    launches[0].env["DTRAIN_MASTER_LISTEN_FD"] = std::to_string(listen_fd);
    launches[0].inherit_fd = listen_fd;
    workers_.start(launches, restarts);
    ::close(listen_fd);  // rank 0 owns it now
    move_to(AgentState::kRunning);
    std::optional<WorkerExit> failure;
    GroupStatus status = GroupStatus::kRunning;
    while (status == GroupStatus::kRunning) {
      if (const int sig = interrupt.load(); sig != 0) {
        DTRAIN_LOG(kWarning) << "received "
                             << (sig == SIGINT    ? "SIGINT"
                                 : sig == SIGTERM ? "SIGTERM"
                                                  : "a signal")
                             << "; forwarding it to the workers";
        workers_.stop(sig, options_.stop_grace);
        move_to(AgentState::kInterrupted);
        result.state = state_;
        result.exit_code = 128 + sig;
        result.restarts = restarts;
        return result;
      }
      status = workers_.poll(options_.monitor_interval, failure);
    }
    if (status == GroupStatus::kSucceeded) {
      move_to(AgentState::kSucceeded);
      result.state = state_;
      result.exit_code = 0;
      result.restarts = restarts;
      return result;
    }
    result.root_cause = failure;
    workers_.stop(SIGTERM, options_.stop_grace);
    if (restarts >= options_.max_restarts) {
      move_to(AgentState::kFailed);
      result.state = state_;
      result.exit_code = failure ? failure->launcher_exit_code() : 1;
      result.restarts = restarts;
      return result;
    }
    DTRAIN_LOG(kWarning) << failure->describe() << "; restarting the workers (restart " << restarts + 1 << " of "
                         << options_.max_restarts << ")";
    move_to(AgentState::kRestarting);
  }
}

}  // namespace dtrain::elastic
