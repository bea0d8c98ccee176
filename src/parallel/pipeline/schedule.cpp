// Schedule generators, the communication pass, the validating simulator and
// the printed table. Pure bookkeeping: no tensors, no process groups.
#include "dtrain/parallel/pipeline/schedule.h"

#include <algorithm>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>
#include <tuple>

#include "dtrain/error.h"

namespace dtrain::pipeline {

std::string to_string(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward: return "F";
    case ActionKind::kBackward: return "B";
    case ActionKind::kBackwardInput: return "I";
    case ActionKind::kBackwardWeight: return "W";
    case ActionKind::kSendActivation: return "SEND_F";
    case ActionKind::kRecvActivation: return "RECV_F";
    case ActionKind::kSendGradient: return "SEND_B";
    case ActionKind::kRecvGradient: return "RECV_B";
  }
  return "?";
}

std::string to_string(const Action& action) {
  return to_string(action.kind) + std::to_string(action.stage) + "." + std::to_string(action.micro);
}

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved1F1B: return "interleaved";
    case ScheduleKind::kZeroBubble: return "zb";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  for (auto kind :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubble}) {
    if (to_string(kind) == name) return kind;
  }
  DTRAIN_CHECK(false, ConfigError, "unknown pipeline schedule '" << name << "'",
               "use one of gpipe, 1f1b, interleaved, zb");
}

std::vector<int> Schedule::stages_of_rank(int rank) const {
  std::vector<int> stages;
  for (int s = rank; s < stage_count(); s += options.ranks) stages.push_back(s);
  return stages;
}

namespace {

int duration(ActionKind kind) {
  return kind == ActionKind::kBackward ? 2 : 1;
}

// Note [Schedule generation]
// Every rank runs its forwards in one fixed order and its backwards in
// another: Megatron's, by micro-batch group of p, then stage (forward: first
// stage first; backward: last first), then micro-batch; with one stage per
// rank, simply micro-batch order. The schedules differ in how they
// interleave the two:
//  - GPipe: all forwards, then all backwards.
//  - 1F1B / interleaved: w_r warm-up forwards, then one forward and one
//    backward alternately, then the remaining backwards, with w_r = p - r - 1
//    (one stage per rank) or Megatron's 2(p - r - 1) + (v - 1)p (interleaved).
//  - Zero bubble (ZB-H1): 1F1B with I in place of B; after each I, rank r
//    runs the oldest pending W's until at most r are left, the rest at the
//    end. The first rank keeps none (its W's fill what were 1F1B's steady
//    slots), the last defers p - 1: its I's, which the others wait for, move
//    forward, and the deferred W's fill 1F1B's cool-down bubble. Activations
//    held (F done, W not) stay at most p on every rank, 1F1B's peak.
// The result is a list, not a timetable: the executor keeps the order whatever
// the real durations are, and validate() proves it cannot deadlock.
using Order = std::vector<std::pair<int, int>>;  // (stage, micro-batch)

void fixed_orders(const ScheduleOptions& o, int r, Order& fwd, Order& bwd) {
  const int p = o.ranks, v = o.stages_per_rank, m = o.micro_batches;
  fwd.clear();
  for (int s = r; s < p * v; s += p) {
    for (int i = 0; i < m; ++i) fwd.emplace_back(s, i);
  }
  bwd = fwd;
  auto key = [&](const std::pair<int, int>& a, bool backward) {
    const int chunk = a.first / p;
    return std::make_tuple(a.second / p, backward ? v - 1 - chunk : chunk, a.second % p);
  };
  std::sort(fwd.begin(), fwd.end(), [&](auto& x, auto& y) { return key(x, false) < key(y, false); });
  std::sort(bwd.begin(), bwd.end(), [&](auto& x, auto& y) { return key(x, true) < key(y, true); });
}

std::vector<Action> alternating(const ScheduleOptions& o, int r, int extra_warmup) {
  const int p = o.ranks, v = o.stages_per_rank;
  Order fwd, bwd;
  fixed_orders(o, r, fwd, bwd);
  const int total = int(fwd.size());
  int warmup = total;  // GPipe
  if (o.kind != ScheduleKind::kGPipe)
    warmup = std::min(total, extra_warmup + (v == 1 ? p - r - 1 : 2 * (p - r - 1) + (v - 1) * p));
  const bool split = o.kind == ScheduleKind::kZeroBubble;
  std::vector<Action> out;
  int f = 0, b = 0, w = 0;
  for (; f < warmup; ++f) out.push_back({ActionKind::kForward, fwd[f].first, fwd[f].second});
  while (b < total) {
    if (f < total) {
      out.push_back({ActionKind::kForward, fwd[f].first, fwd[f].second});
      ++f;
    }
    out.push_back({split ? ActionKind::kBackwardInput : ActionKind::kBackward, bwd[b].first, bwd[b].second});
    ++b;
    for (; split && b - w > r; ++w) out.push_back({ActionKind::kBackwardWeight, bwd[w].first, bwd[w].second});
  }
  for (; split && w < total; ++w) out.push_back({ActionKind::kBackwardWeight, bwd[w].first, bwd[w].second});
  return out;
}

std::vector<std::vector<Action>> alternating(const ScheduleOptions& o, int extra_warmup) {
  std::vector<std::vector<Action>> order(o.ranks);
  for (int r = 0; r < o.ranks; ++r) order[r] = alternating(o, r, extra_warmup);
  return order;
}

void check_options(const ScheduleOptions& o) {
  DTRAIN_CHECK(o.ranks >= 1 && o.stages_per_rank >= 1 && o.micro_batches >= 1, ConfigError,
               "pipeline schedule needs ranks, stages per rank and micro-batches >= 1 (got p="
                   << o.ranks << ", v=" << o.stages_per_rank << ", m=" << o.micro_batches << ")",
               "pass positive numbers");
  const bool may_interleave = o.kind == ScheduleKind::kInterleaved1F1B || o.kind == ScheduleKind::kZeroBubble;
  DTRAIN_CHECK(may_interleave || o.stages_per_rank == 1, ConfigError,
               to_string(o.kind) << " runs one stage per rank (got " << o.stages_per_rank << ")",
               "use the interleaved schedule for several stages per rank");
}

}  // namespace

Schedule add_communication(ScheduleOptions options, const std::vector<std::vector<Action>>& compute) {
  Schedule schedule{.options = options, .actions = {}};
  const int n = schedule.stage_count();
  schedule.actions.resize(compute.size());
  for (std::size_t r = 0; r < compute.size(); ++r) {
    auto& out = schedule.actions[r];
    auto remote = [&](int stage) { return stage >= 0 && stage < n && schedule.rank_of_stage(stage) != int(r); };
    for (const Action& a : compute[r]) {
      const bool backward = a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput;
      if (a.kind == ActionKind::kForward && remote(a.stage - 1))
        out.push_back({ActionKind::kRecvActivation, a.stage, a.micro});
      if (backward && remote(a.stage + 1)) out.push_back({ActionKind::kRecvGradient, a.stage, a.micro});
      out.push_back(a);
      if (a.kind == ActionKind::kForward && remote(a.stage + 1))
        out.push_back({ActionKind::kSendActivation, a.stage, a.micro});
      if (backward && remote(a.stage - 1)) out.push_back({ActionKind::kSendGradient, a.stage, a.micro});
    }
  }
  return schedule;
}

Schedule make_schedule(const ScheduleOptions& options) {
  check_options(options);
  // Megatron's interleaved warm-up assumes m a multiple of p; otherwise it can
  // deadlock (validate says where). Then every rank warms up by one more
  // forward until it does not: with all forwards first it is GPipe's order,
  // which never deadlocks.
  const int most = options.stages_per_rank * options.micro_batches;
  for (int extra = 0;; ++extra) {
    Schedule schedule = add_communication(options, alternating(options, extra));
    try {
      validate(schedule);
      return schedule;
    } catch (const ConfigError&) {
      if (extra >= most) throw;
    }
  }
}

// Note [Schedule validation]
// A static pass checks each action against the placement (the stage lives on
// this rank, the transfer's peer is another rank), that every compute action
// appears exactly once (F; and B, or I and W), and that sends and receives
// pair up one to one. Then the simulator runs all ranks in unit time under
// the execution model (sends never block, a receive waits for its send's
// issue, a compute action waits for its inputs: the previous stage's output
// received or computed here, the next stage's gradient likewise, its own
// forward, I before W). If at some moment no rank can move and none is busy,
// the schedule deadlocks: the error lists each stuck rank and what it waits for.
SimulationResult validate(const Schedule& s) {
  const int p = s.options.ranks, n = s.stage_count(), m = s.options.micro_batches;
  DTRAIN_CHECK(int(s.actions.size()) == p, ConfigError,
               "schedule has action lists for " << s.actions.size() << " ranks, expected " << p, "one list per rank");
  // How often each (kind, stage, micro-batch) appears; flat, since the
  // planner validates schedules of thousands of micro-batches.
  constexpr int kKinds = 8;
  std::vector<int> count(static_cast<std::size_t>(kKinds) * n * m, 0);
  auto cell = [&](ActionKind k, int st, int i) { return (static_cast<std::size_t>(k) * n + st) * m + i; };
  for (int r = 0; r < p; ++r) {
    for (const Action& a : s.actions[r]) {
      // The message is built only when a check fails.
      auto where = [&] { return to_string(a) + " on rank " + std::to_string(r); };
      DTRAIN_CHECK(a.stage >= 0 && a.stage < n && a.micro >= 0 && a.micro < m, ConfigError,
                   where() << " is out of range (" << n << " stages, " << m << " micro-batches)", "fix the schedule");
      DTRAIN_CHECK(s.rank_of_stage(a.stage) == r, ConfigError,
                   where() << ": stage " << a.stage << " lives on rank " << s.rank_of_stage(a.stage),
                   "put each stage's actions on its own rank");
      int peer_stage = -1;
      if (a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kRecvGradient) peer_stage = a.stage + 1;
      if (a.kind == ActionKind::kRecvActivation || a.kind == ActionKind::kSendGradient) peer_stage = a.stage - 1;
      if (!a.is_compute()) {
        DTRAIN_CHECK(peer_stage >= 0 && peer_stage < n, ConfigError, where() << " has no peer stage",
                     "the first stage receives no activation, the last no gradient");
        DTRAIN_CHECK(s.rank_of_stage(peer_stage) != r, ConfigError,
                     where() << " would transfer between rank " << r << " and itself (stages " << a.stage << " and "
                             << peer_stage << ")",
                     "stages on one rank hand data over without send/recv");
      }
      ++count[cell(a.kind, a.stage, a.micro)];
    }
  }
  auto n_of = [&](ActionKind k, int st, int i) { return count[cell(k, st, i)]; };
  for (int st = 0; st < n; ++st) {
    for (int i = 0; i < m; ++i) {
      auto id = [&] { return std::to_string(st) + "." + std::to_string(i); };
      const int f = n_of(ActionKind::kForward, st, i), b = n_of(ActionKind::kBackward, st, i);
      const int bi = n_of(ActionKind::kBackwardInput, st, i), bw = n_of(ActionKind::kBackwardWeight, st, i);
      DTRAIN_CHECK(f == 1, ConfigError, "F" << id() << " appears " << f << " times", "every forward runs once");
      DTRAIN_CHECK((b == 1 && bi == 0 && bw == 0) || (b == 0 && bi == 1 && bw == 1), ConfigError,
                   "backward of " << id() << ": B " << b << "x, I " << bi << "x, W " << bw << "x",
                   "each micro-batch needs one B, or one I and one W, per stage");
      if (st + 1 < n) {
        const int sf = n_of(ActionKind::kSendActivation, st, i), rf = n_of(ActionKind::kRecvActivation, st + 1, i);
        DTRAIN_CHECK(
            sf == rf && sf <= 1, ConfigError,
            "SEND_F" << id() << " appears " << sf << " times but RECV_F" << st + 1 << "." << i << " " << rf << " times",
            "every send needs exactly one matching receive");
        const int sb = n_of(ActionKind::kSendGradient, st + 1, i), rb = n_of(ActionKind::kRecvGradient, st, i);
        DTRAIN_CHECK(
            sb == rb && sb <= 1, ConfigError,
            "SEND_B" << st + 1 << "." << i << " appears " << sb << " times but RECV_B" << id() << " " << rb << " times",
            "every send needs exactly one matching receive");
      }
    }
  }

  // Simulation. Times at which things become available; kNever = not yet.
  constexpr int kNever = std::numeric_limits<int>::max();
  std::vector<std::vector<int>> f_done(n, std::vector<int>(m, kNever)),
      b_done = f_done, w_done = f_done, sent_f = f_done, sent_b = f_done, recv_f = f_done, recv_b = f_done;
  SimulationResult result;
  result.start.resize(p);
  result.peak_in_flight.assign(p, 0);
  std::vector<std::size_t> pc(p, 0);
  std::vector<int> busy_until(p, 0), in_flight(p, 0), busy_total(p, 0);
  for (int r = 0; r < p; ++r) result.start[r].assign(s.actions[r].size(), -1);
  auto input_ready = [&](int r, int st, int i, int t) {
    if (st == 0) return true;
    return s.rank_of_stage(st - 1) == r ? f_done[st - 1][i] <= t : recv_f[st][i] <= t;
  };
  auto grad_ready = [&](int r, int st, int i, int t) {
    if (st == n - 1) return true;
    return s.rank_of_stage(st + 1) == r ? b_done[st + 1][i] <= t : recv_b[st][i] <= t;
  };
  for (int t = 0;; ++t) {
    bool moved = true;
    while (moved) {  // zero-time actions may enable one another
      moved = false;
      for (int r = 0; r < p; ++r) {
        while (pc[r] < s.actions[r].size() && busy_until[r] <= t) {
          const Action& a = s.actions[r][pc[r]];
          const int st = a.stage, i = a.micro;
          bool ok = false;
          switch (a.kind) {
            case ActionKind::kForward: ok = input_ready(r, st, i, t); break;
            case ActionKind::kBackward:
            case ActionKind::kBackwardInput: ok = f_done[st][i] <= t && grad_ready(r, st, i, t); break;
            case ActionKind::kBackwardWeight: ok = b_done[st][i] <= t; break;
            case ActionKind::kSendActivation: ok = f_done[st][i] <= t; break;
            case ActionKind::kSendGradient: ok = b_done[st][i] <= t; break;
            case ActionKind::kRecvActivation: ok = sent_f[st - 1][i] <= t; break;
            case ActionKind::kRecvGradient: ok = sent_b[st + 1][i] <= t; break;
          }
          if (!ok) break;
          if (a.is_compute()) {
            const int end = t + duration(a.kind);
            result.start[r][pc[r]] = t;
            busy_until[r] = end;
            busy_total[r] += end - t;
            if (a.kind == ActionKind::kForward) {
              f_done[st][i] = end;
              result.peak_in_flight[r] = std::max(result.peak_in_flight[r], ++in_flight[r]);
            } else if (a.kind == ActionKind::kBackwardWeight) {
              w_done[st][i] = end;
              --in_flight[r];
            } else {
              b_done[st][i] = end;
              if (a.kind == ActionKind::kBackward) --in_flight[r];
            }
          } else if (a.kind == ActionKind::kSendActivation) {
            sent_f[st][i] = t;
          } else if (a.kind == ActionKind::kSendGradient) {
            sent_b[st][i] = t;
          } else if (a.kind == ActionKind::kRecvActivation) {
            recv_f[st][i] = t;
          } else {
            recv_b[st][i] = t;
          }
          ++pc[r];
          moved = true;
        }
      }
    }
    bool all_done = true, any_busy = false;
    for (int r = 0; r < p; ++r) {
      all_done = all_done && pc[r] == s.actions[r].size();
      any_busy = any_busy || busy_until[r] > t;
    }
    if (all_done) {
      result.makespan = *std::max_element(busy_until.begin(), busy_until.end());
      break;
    }
    if (!any_busy) {
      std::ostringstream stuck;
      for (int r = 0; r < p; ++r) {
        if (pc[r] < s.actions[r].size())
          stuck << " rank " << r << " waits at " << to_string(s.actions[r][pc[r]]) << ";";
      }
      DTRAIN_CHECK(false, ConfigError,
                   "pipeline schedule (" << to_string(s.options.kind) << ", p=" << p << ", m=" << m
                                         << ") deadlocks at time " << t << ":" << stuck.str(),
                   "a receive must follow its send's issue on the peer, and a compute action its inputs");
    }
  }
  double busy = 0;
  for (int r = 0; r < p; ++r) busy += busy_total[r];
  result.bubble_fraction = result.makespan == 0 ? 0 : 1.0 - busy / (double(p) * result.makespan);
  return result;
}

std::string to_table(const Schedule& schedule) {
  const SimulationResult sim = validate(schedule);
  const int p = schedule.options.ranks;
  std::vector<std::vector<std::string>> grid(p, std::vector<std::string>(sim.makespan, "."));
  std::size_t width = 1;
  for (int r = 0; r < p; ++r) {
    for (std::size_t k = 0; k < schedule.actions[r].size(); ++k) {
      const Action& a = schedule.actions[r][k];
      if (!a.is_compute()) continue;
      for (int d = 0; d < duration(a.kind); ++d) grid[r][sim.start[r][k] + d] = to_string(a);
      width = std::max(width, to_string(a).size());
    }
  }
  std::ostringstream out;
  out << to_string(schedule.options.kind) << " schedule: p=" << p << " v=" << schedule.options.stages_per_rank
      << " m=" << schedule.options.micro_batches << " (time slots: F=I=W=1, B=2)\n";
  for (int r = 0; r < p; ++r) {
    out << "rank " << r << " |";
    for (const auto& cell : grid[r]) out << ' ' << std::setw(int(width)) << std::left << cell;
    out << " | peak activations " << sim.peak_in_flight[r] << '\n';
  }
  out << "simulated bubble " << std::fixed << std::setprecision(3) << sim.bubble_fraction << '\n';
  return out.str();
}

}  // namespace dtrain::pipeline
