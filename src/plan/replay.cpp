// Event replay of a schedule's action lists with real durations (replay.h).
#include "dtrain/plan/replay.h"

#include <algorithm>
#include <limits>

#include "dtrain/error.h"

namespace dtrain::plan {

using pipeline::Action;
using pipeline::ActionKind;

ReplayResult replay(const pipeline::Schedule& s, const ReplayOptions& o) {
  const int p = s.options.ranks, n = s.stage_count(), m = s.options.micro_batches;
  DTRAIN_INTERNAL_ASSERT(static_cast<int>(o.stage.size()) == n, "replay needs one StageTimes per stage");
  constexpr double kUnknown = std::numeric_limits<double>::infinity();
  // Indexed [stage * m + micro]: when each fact became true.
  const std::size_t cells = static_cast<std::size_t>(n) * m;
  std::vector<double> f_done(cells, kUnknown), b_done(cells, kUnknown), i_done(cells, kUnknown),
      sent_f(cells, kUnknown), sent_b(cells, kUnknown);
  auto at = [m](int stage, int micro) { return static_cast<std::size_t>(stage) * m + micro; };
  ReplayResult r;
  r.busy.assign(p, 0);
  r.end.assign(p, 0);
  r.peak_in_flight.assign(p, 0);
  std::vector<std::size_t> pc(p, 0);
  std::vector<double> clock(p, 0);
  std::vector<int> in_flight(p, 0);
  bool progress = true, done = false;
  while (progress && !done) {
    progress = false;
    done = true;
    for (int rank = 0; rank < p; ++rank) {
      const auto& list = s.actions[rank];
      for (; pc[rank] < list.size(); ++pc[rank]) {
        const Action& a = list[pc[rank]];
        const int st = a.stage, i = a.micro;
        const StageTimes& t = o.stage[st];
        double ready = 0, duration = 0;
        switch (a.kind) {
          case ActionKind::kForward:
            ready = (st > 0 && s.rank_of_stage(st - 1) == rank) ? f_done[at(st - 1, i)] : 0;
            duration = t.forward;
            break;
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
            ready = std::max(f_done[at(st, i)],
                             (st + 1 < n && s.rank_of_stage(st + 1) == rank) ? i_done[at(st + 1, i)] : 0.0);
            duration = t.backward_input + (a.kind == ActionKind::kBackward ? t.backward_weight : 0);
            break;
          case ActionKind::kBackwardWeight:
            ready = i_done[at(st, i)];
            duration = t.backward_weight;
            break;
          case ActionKind::kSendActivation:
          case ActionKind::kSendGradient:
            (a.kind == ActionKind::kSendActivation ? sent_f : sent_b)[at(st, i)] = clock[rank];
            if (o.blocking_sends) clock[rank] += o.p2p_seconds;
            progress = true;
            continue;
          case ActionKind::kRecvActivation: ready = sent_f[at(st - 1, i)] + o.p2p_seconds; break;
          case ActionKind::kRecvGradient: ready = sent_b[at(st + 1, i)] + o.p2p_seconds; break;
        }
        if (ready == kUnknown) break;  // waits for another rank: come back next sweep
        const double start = std::max(clock[rank], ready);
        clock[rank] = start + duration;
        r.busy[rank] += duration;
        progress = true;
        if (a.kind == ActionKind::kForward) {
          f_done[at(st, i)] = clock[rank];
          r.peak_in_flight[rank] = std::max(r.peak_in_flight[rank], ++in_flight[rank]);
        } else if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
          i_done[at(st, i)] = clock[rank];
          if (a.kind == ActionKind::kBackward) {
            b_done[at(st, i)] = clock[rank];
            --in_flight[rank];
          }
        } else if (a.kind == ActionKind::kBackwardWeight) {
          b_done[at(st, i)] = clock[rank];
          --in_flight[rank];
        }
      }
      done = done && pc[rank] == list.size();
    }
  }
  DTRAIN_INTERNAL_ASSERT(done, "the replay of a validated pipeline schedule stalled");
  for (int rank = 0; rank < p; ++rank) r.end[rank] = clock[rank];
  r.makespan = *std::max_element(clock.begin(), clock.end());
  return r;
}

}  // namespace dtrain::plan
