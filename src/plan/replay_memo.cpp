// The search's replay memo (replay_memo.h).
#include "replay_memo.h"

#include <bit>
#include <cstdint>

namespace dtrain::plan::detail {

// Note [Replay memo]
// A pipeline plan's replay depends on its schedule (kind, p, v, m: one
// compiled program), every stage's F, I and W times, the transfer time and
// whether sends block; nothing else. Plans the search enumerates share all
// of them where they differ only in what the stage times leave out: ZeRO
// stages 0-2 and the HSDP split of the same degrees (their gradient sync and
// optimizer come after the replay; ZeRO-3's gathers change the stage times).
// The memo keys a replay by all of it, compared bit for bit, never by a
// summary of the plan: two plans that share a key get the same replay
// because their replays are the same computation. It lives for one search
// and holds kCapacity replays at most (the duplicates the search meets lie
// within one (tp, cp, pp, dp) block of its enumeration, a few hundred
// distinct replays), so its memory stays a few MiB.
namespace {

std::uint64_t bits(double x) {
  return std::bit_cast<std::uint64_t>(x);
}

bool same(const ReplayOptions& a, const ReplayOptions& b) {
  if (a.stage.size() != b.stage.size() || bits(a.p2p_seconds) != bits(b.p2p_seconds) ||
      a.blocking_sends != b.blocking_sends)
    return false;
  for (std::size_t s = 0; s < a.stage.size(); ++s) {
    const StageTimes &x = a.stage[s], &y = b.stage[s];
    if (bits(x.forward) != bits(y.forward) || bits(x.backward_input) != bits(y.backward_input) ||
        bits(x.backward_weight) != bits(y.backward_weight))
      return false;
  }
  return true;
}

std::size_t hash_of(const ReplayProgram& program, const ReplayOptions& o) {
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a over 64-bit words
  auto mix = [&h](std::uint64_t word) { h = (h ^ word) * 1099511628211ULL; };
  mix(reinterpret_cast<std::uintptr_t>(&program));
  mix(bits(o.p2p_seconds));
  mix(o.blocking_sends ? 1 : 0);
  for (const StageTimes& t : o.stage) {
    mix(bits(t.forward));
    mix(bits(t.backward_input));
    mix(bits(t.backward_weight));
  }
  return static_cast<std::size_t>(h);
}

}  // namespace

const ReplayResult& ReplayMemo::replay(const ReplayProgram& program, const ReplayOptions& options) {
  const std::size_t h = hash_of(program, options);
  const auto [begin, end] = entries_.equal_range(h);
  for (auto it = begin; it != end; ++it) {
    if (it->second.program == &program && same(it->second.options, options)) return it->second.result;
  }
  if (entries_.size() >= kCapacity) entries_.clear();
  ReplayResult result = plan::replay(program, options);
  return entries_.emplace(h, Entry{&program, options, std::move(result)})->second.result;
}

}  // namespace dtrain::plan::detail
