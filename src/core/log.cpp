// Rank-tagged, line-atomic logging to stderr.
#include "dtrain/log.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>

namespace dtrain::log {
namespace {
thread_local int tls_rank = -1;
thread_local int tls_world = 0;

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

Identity identity() {
  return {.rank = tls_rank, .world_size = tls_world};
}

ScopedIdentity::ScopedIdentity(Identity identity) : previous_(log::identity()) {
  set_rank(identity.rank, identity.world_size);
}
ScopedIdentity::~ScopedIdentity() {
  set_rank(previous_.rank, previous_.world_size);
}

std::string rank_tag() {
  if (tls_world <= 0) return {};
  return "[rank " + std::to_string(tls_rank) + "/" + std::to_string(tls_world) + "]";
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
