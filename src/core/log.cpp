// Rank-tagged, line-atomic logging to stderr.
#include "dtrain/log.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>

namespace dtrain::log {
namespace {
thread_local int tls_rank = -1;
thread_local int tls_world = 0;
// The process's identity as one word (rank in the high half, world size in
// the low), so a reader never pairs one writer's rank with another's size.
std::atomic<std::uint64_t> process_identity{0};

Level threshold_from_env() {
  const char* raw = std::getenv("DTRAIN_LOG_LEVEL");
  if (raw == nullptr) return Level::kInfo;
  const std::string v(raw);
  if (v == "debug") return Level::kDebug;
  if (v == "warning" || v == "warn") return Level::kWarning;
  if (v == "error") return Level::kError;
  return Level::kInfo;
}

const char* level_name(Level level) {
  switch (level) {
    case Level::kDebug: return "D";
    case Level::kInfo: return "I";
    case Level::kWarning: return "W";
    case Level::kError: return "E";
  }
  return "?";
}
}  // namespace

void set_rank(int rank, int world_size) {
  tls_rank = world_size > 0 ? rank : -1;
  tls_world = world_size;
}

void set_process_rank(int rank, int world_size) {
  const auto word = world_size > 0 ? (static_cast<std::uint64_t>(static_cast<std::uint32_t>(rank)) << 32) |
                                         static_cast<std::uint32_t>(world_size)
                                   : std::uint64_t{0};
  process_identity.store(word, std::memory_order_relaxed);
}

Identity identity() {
  if (tls_world > 0) return {.rank = tls_rank, .world_size = tls_world};
  const std::uint64_t word = process_identity.load(std::memory_order_relaxed);
  if (word == 0) return {};
  return {.rank = static_cast<int>(word >> 32), .world_size = static_cast<int>(word & 0xffffffffU)};
}

// Saves the thread's own identity, not the process's it may be showing, so
// that ending the scope gives the thread back to the process's.
ScopedIdentity::ScopedIdentity(Identity identity) : previous_{.rank = tls_rank, .world_size = tls_world} {
  set_rank(identity.rank, identity.world_size);
}
ScopedIdentity::~ScopedIdentity() {
  set_rank(previous_.rank, previous_.world_size);
}

std::string rank_tag() {
  const Identity id = identity();
  if (id.world_size <= 0) return {};
  return "[rank " + std::to_string(id.rank) + "/" + std::to_string(id.world_size) + "]";
}

std::string format_seconds(std::chrono::milliseconds duration) {
  std::ostringstream out;
  out << static_cast<double>(duration.count()) / 1000.0 << " s";
  return out.str();
}

bool enabled(Level level) {
  static const Level threshold = threshold_from_env();
  return level >= threshold;
}

void write(Level level, std::string_view message) {
  std::string line = "dtrain ";
  line += level_name(level);
  const std::string tag = rank_tag();
  if (!tag.empty()) {
    line += ' ';
    line += tag;
  }
  line += ' ';
  line += message;
  line += '\n';
  // One fwrite per line keeps lines from different threads whole.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace dtrain::log
