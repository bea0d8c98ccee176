// Rank-tagged logging.
//
// Each thread carries a rank identity (set by init_process_group, or by
// set_rank for hand-made setups); log lines and dtrain::Error messages start
// with "[rank R/W]" once it is set. Identity is per thread so that tests which
// run several ranks as threads of one process still tag each line correctly.
// A thread with none takes the process's (set_process_rank: a launched
// worker's rank, from dist::read_env_contract()), so a program's errors
// before its process group exists, and its helper threads, name the rank too.
//
//   DTRAIN_LOG(kInfo) << "epoch " << e << " done";
//
// Lines go to stderr, whole lines at a time. The threshold comes from
// DTRAIN_LOG_LEVEL (debug, info, warning, error; default info).
#pragma once

#include <chrono>
#include <sstream>
#include <string>
#include <string_view>

namespace dtrain::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Sets the calling thread's rank identity; world_size 0 clears it.
void set_rank(int rank, int world_size);
// Sets the identity of every thread that has none of its own (see above);
// world_size 0 clears it.
void set_process_rank(int rank, int world_size);
// "[rank R/W]", or "" when the calling thread has no rank identity (its own
// or the process's).
std::string rank_tag();

// A thread's rank identity, to hand to the helper threads it starts (loader
// workers, replica threads, communication workers), so their logs and errors
// carry the same "[rank R/W]".
struct Identity {
  int rank = -1;
  int world_size = 0;  // 0: none
};
Identity identity();
// Takes `identity` for the calling thread while alive; restores the previous one.
class ScopedIdentity {
 public:
  explicit ScopedIdentity(Identity identity);
  ~ScopedIdentity();
  ScopedIdentity(const ScopedIdentity&) = delete;
  ScopedIdentity& operator=(const ScopedIdentity&) = delete;

 private:
  Identity previous_;
};

bool enabled(Level level);
// "1.5 s", "30 s": a duration for messages (the one seconds formatter).
std::string format_seconds(std::chrono::milliseconds duration);
void write(Level level, std::string_view message);

namespace detail {
// Collects one line and writes it on destruction.
class Line {
 public:
  explicit Line(Level level) : level_(level) {}
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;
  ~Line() { write(level_, stream_.str()); }
  template <typename T>
  Line& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  Level level_;
  std::ostringstream stream_;
};
}  // namespace detail

}  // namespace dtrain::log

#define DTRAIN_LOG(level)                                     \
  if (!::dtrain::log::enabled(::dtrain::log::Level::level)) { \
  } else                                                      \
    ::dtrain::log::detail::Line(::dtrain::log::Level::level)
