// The lighthouse's view of one registered replica (an incarnation): the
// serving thread's, shared by src/ft/lighthouse.cpp and lighthouse_end.cpp.
#pragma once

#include <chrono>
#include <cstdint>

#include "dtrain/ft/lighthouse.h"

namespace dtrain::ft {

struct Lighthouse::Replica {
  int id = 0;
  std::int64_t incarnation = 0;
  std::int64_t beats = -1;
  std::chrono::steady_clock::time_point last_beat;
  std::int64_t answered_seq = 0;
  // The answered request whose answer/ and claim/ keys are still there
  // (0: none); deleted once the replica asks again.
  std::int64_t answer_kept = 0;
  // Registered before this lighthouse started: live only once its heartbeat
  // moved since (the counter's first reading proves nothing).
  bool inherited = false;
  // The pending request, if any.
  bool pending = false;
  std::int64_t seq = 0;
  std::int64_t step = 0;
  bool fresh = false;
  std::chrono::steady_clock::time_point asked_at;
};

}  // namespace dtrain::ft
