// Note [Flight recorder]
// One ring per process (a rank is a process; tests that run ranks as threads
// share one ring, whose entries still name their group and rank). Every
// ProcessGroup operation calls note_issue() before it is issued: with the
// recorder off that is one branch on a pointer; on, the entry is copied in
// under a mutex (a few hundred nanoseconds; a GPT step issues tens to
// hundreds of operations). An entry moves forward through its states:
//   enqueued   the ProcessGroup method was called (before argument checks
//              that need the peers, before a lazy shared-memory setup);
//   started    handed to the transport: Gloo's or NCCL's queue, or, for
//              shared memory, its executor began running it; a send or
//              receive through a shared-memory ring starts at its Work's wait;
//   completed  the transport finished it (collectives: their future's
//              callback; point-to-point: the wait that returned);
//   failed     it ended with the CommunicationError the wait throws.
// A point-to-point op that nobody waited on stays "started". Sequence
// numbers come from the group (FlightCounters), so they agree across ranks
// as long as the ranks issue the same operations, which is what the analysis
// (flight_analysis.cpp) checks.
//
// Dumps are JSON (docs/flight_recorder.md lists the fields), written to a
// temporary file and renamed, so a reader never sees half a dump. SIGUSR1's
// handler only writes a byte to a pipe (async-signal-safe); a helper thread
// blocked on the pipe writes the dump.
#include "flight_recorder.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "dtrain/comm/env.h"
#include "dtrain/log.h"
#include "group_state.h"

namespace dtrain::dist {

std::string to_string(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
  }
  return "?";
}

namespace detail {
namespace {

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* to_string(FlightState state) {
  switch (state) {
    case FlightState::kEnqueued: return "enqueued";
    case FlightState::kStarted: return "started";
    case FlightState::kCompleted: return "completed";
    case FlightState::kFailed: return "failed";
  }
  return "?";
}

struct Entry {
  std::uint64_t ticket = 0;  // 0: empty slot
  FlightRecorder::Op op;
  FlightState state = FlightState::kEnqueued;
  std::int64_t enqueued_us = 0, started_us = 0, ended_us = 0;
};

// SIGUSR1 -> one byte on this pipe -> the dump thread.
int g_wake_pipe[2] = {-1, -1};

void on_sigusr1(int) {
  const int saved = errno;
  const char byte = 1;
  static_cast<void>(::write(g_wake_pipe[1], &byte, 1));
  errno = saved;
}

}  // namespace

struct FlightRecorder::Ring {
  std::mutex mutex;
  std::vector<Entry> entries;
  std::uint64_t next_ticket = 1;
  std::string dir;
  log::Identity identity;  // the rank this process is (its file name)
  std::mutex dump_mutex;   // one dump at a time
  std::chrono::steady_clock::time_point last_failure_dump{};
};

FlightRecorder::FlightRecorder(int entries, std::string dir) : ring_(std::make_unique<Ring>()) {
  ring_->entries.resize(static_cast<std::size_t>(entries));
  ring_->dir = std::move(dir);
  ring_->identity = log::identity();
}

namespace {

// Note [SIGUSR1 at load]
// The launcher asks every live worker to dump with SIGUSR1, whose default
// action ends a process. A worker that has not made its first group yet (the
// ring is made then) must survive it, so the handler is installed when
// libdtrain is loaded, if DTRAIN_FLIGHT_RECORDER is on and the program has
// no SIGUSR1 handler of its own: only the pipe and sigaction there
// (no threads, no logging while static objects are still being made). The
// thread that turns a byte on the pipe into a dump starts with the ring
// (FlightRecorder::get); a signal before then waits in the pipe and is
// answered as soon as the ring exists.
bool recorder_requested_by_env() {
  const char* entries = std::getenv("DTRAIN_FLIGHT_RECORDER");
  if (entries == nullptr) return false;
  char* end = nullptr;
  const long n = std::strtol(entries, &end, 10);
  return end != entries && n > 0;
}

bool install_sigusr1_handler() {
  if (g_wake_pipe[0] >= 0) return true;
  struct sigaction old {};
  if (::sigaction(SIGUSR1, nullptr, &old) != 0 || old.sa_handler != SIG_DFL || (old.sa_flags & SA_SIGINFO) != 0) {
    return false;  // the program handles SIGUSR1 itself
  }
  if (::pipe2(g_wake_pipe, O_CLOEXEC) != 0) return false;
  ::fcntl(g_wake_pipe[1], F_SETFL, O_NONBLOCK);  // a burst of signals never blocks the handler
  struct sigaction sa {};
  sa.sa_handler = on_sigusr1;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &sa, nullptr);
  return true;
}

[[maybe_unused]] const bool g_sigusr1_at_load = recorder_requested_by_env() && install_sigusr1_handler();

}  // namespace

FlightRecorder* FlightRecorder::get() {
  static FlightRecorder* const recorder = []() -> FlightRecorder* {
    const FlightRecorderOptions options = flight_recorder_options();
    if (options.entries <= 0) return nullptr;
    auto* made = new FlightRecorder(options.entries, options.dump_dir);  // never freed: see get()'s contract
    // SIGUSR1, unless the program handles it itself (Note [SIGUSR1 at load]).
    if (install_sigusr1_handler()) {
      std::thread([made] {
        for (;;) {
          char byte = 0;
          const ssize_t n = ::read(g_wake_pipe[0], &byte, 1);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) return;
          made->dump("SIGUSR1");
        }
      }).detach();
    }
    DTRAIN_LOG(kInfo) << "flight recorder on: last " << options.entries << " operations, dumps to " << options.dump_dir
                      << " (on failure or SIGUSR1)";
    return made;
  }();
  return recorder;
}

std::uint64_t FlightRecorder::record(Op op) {
  const std::int64_t now = now_us();
  std::lock_guard<std::mutex> lock(ring_->mutex);
  const std::uint64_t ticket = ring_->next_ticket++;
  Entry& e = ring_->entries[(ticket - 1) % ring_->entries.size()];
  e.ticket = ticket;
  e.op = std::move(op);
  e.state = FlightState::kEnqueued;
  e.enqueued_us = now;
  e.started_us = e.ended_us = 0;
  return ticket;
}

void FlightRecorder::mark(std::uint64_t ticket, FlightState state) {
  if (ticket == 0) return;
  const std::int64_t now = now_us();
  std::lock_guard<std::mutex> lock(ring_->mutex);
  Entry& e = ring_->entries[(ticket - 1) % ring_->entries.size()];
  if (e.ticket != ticket || state <= e.state) return;
  e.state = state;
  if (e.started_us == 0) e.started_us = now;
  if (state == FlightState::kCompleted || state == FlightState::kFailed) e.ended_us = now;
}

std::string FlightRecorder::dump(const std::string& reason, bool after_failure) {
  namespace fs = std::filesystem;
  std::lock_guard<std::mutex> dump_lock(ring_->dump_mutex);
  const auto now = std::chrono::steady_clock::now();
  if (after_failure) {
    if (now - ring_->last_failure_dump < std::chrono::seconds(1)) return "";
    ring_->last_failure_dump = now;
  }
  std::vector<Entry> copy;
  {
    std::lock_guard<std::mutex> lock(ring_->mutex);
    const std::size_t n = ring_->entries.size();
    copy.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {  // oldest first
      const Entry& e = ring_->entries[(ring_->next_ticket - 1 + i) % n];
      if (e.ticket != 0) copy.push_back(e);
    }
  }
  const int rank = ring_->identity.rank;
  nlohmann::json entries = nlohmann::json::array();
  for (const Entry& e : copy) {
    const FlightGroup& g = *e.op.group;
    const int peer_rank = e.op.peer >= 0 ? g.world_ranks.at(static_cast<std::size_t>(e.op.peer)) : -1;
    entries.push_back({{"ticket", e.ticket},
                       {"group", g.name},
                       {"group_ranks", g.world_ranks},
                       {"group_rank", g.rank},
                       {"backend", g.backend},
                       {"rank", g.world_ranks.at(static_cast<std::size_t>(g.rank))},
                       {"seq", e.op.seq},
                       {"kind", e.op.peer >= 0 ? "p2p" : "collective"},
                       {"op", e.op.op},
                       {"peer", peer_rank},
                       {"sizes", e.op.sizes},
                       {"dtype", e.op.dtype},
                       {"bytes", e.op.bytes},
                       {"state", to_string(e.state)},
                       {"enqueued_us", e.enqueued_us},
                       {"started_us", e.started_us},
                       {"ended_us", e.ended_us}});
  }
  const nlohmann::json doc{{"version", 1},
                           {"rank", rank},
                           {"world_size", ring_->identity.world_size},
                           {"pid", static_cast<std::int64_t>(::getpid())},
                           {"reason", reason},
                           {"dumped_at_us", now_us()},
                           {"capacity", ring_->entries.size()},
                           {"entries", std::move(entries)}};
  const std::string name = rank >= 0 ? "rank_" + std::to_string(rank) : "pid_" + std::to_string(::getpid());
  const fs::path path = fs::path(ring_->dir) / (name + ".json");
  const fs::path temporary = fs::path(ring_->dir) / ("." + name + ".json.tmp");
  log::ScopedIdentity scoped(ring_->identity);
  try {
    fs::create_directories(ring_->dir);
    {
      std::ofstream out(temporary, std::ios::trunc);
      out << doc.dump(1) << "\n";
      if (!out.flush()) throw std::runtime_error("cannot write " + temporary.string());
    }
    fs::rename(temporary, path);
  } catch (const std::exception& e) {
    DTRAIN_LOG(kWarning) << "flight recorder: could not dump to " << path.string() << ": " << e.what();
    return "";
  }
  DTRAIN_LOG(kInfo) << "flight recorder: dumped the last " << copy.size() << " operations to " << path.string() << " ("
                    << reason << ")";
  return path.string();
}

void note_issue(GroupState& s, OpInfo& info, OpKind kind, const at::Tensor& tensor, std::int64_t bytes) {
  const auto k = static_cast<std::size_t>(kind);
  s.traffic[2 * k].fetch_add(1, std::memory_order_relaxed);
  s.traffic[2 * k + 1].fetch_add(bytes, std::memory_order_relaxed);
  FlightRecorder* recorder = FlightRecorder::get();
  if (recorder == nullptr || !s.flight) return;
  FlightCounters& c = *s.flight;
  std::uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (kind == OpKind::kSend) {
      seq = ++c.sends[static_cast<std::size_t>(info.peer)];
    } else if (kind == OpKind::kRecv) {
      seq = ++c.recvs[static_cast<std::size_t>(info.peer)];
    } else {
      seq = ++c.collectives;
    }
  }
  info.flight = recorder->record({.group = c.group,
                                  .seq = seq,
                                  .op = info.op,
                                  .peer = info.peer,
                                  .sizes = info.sizes,
                                  .dtype = tensor.defined() ? std::string(c10::toString(tensor.scalar_type())) : "",
                                  .bytes = bytes});
}

}  // namespace detail

bool flight_recorder_enabled() {
  return detail::FlightRecorder::get() != nullptr;
}

std::string dump_flight_recorder(const std::string& reason) {
  detail::FlightRecorder* recorder = detail::FlightRecorder::get();
  return recorder != nullptr ? recorder->dump(reason) : "";
}

}  // namespace dtrain::dist
